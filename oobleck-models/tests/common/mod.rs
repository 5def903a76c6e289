//! Token files written from their documented layouts, independently of the readers (llm.c
//! `dev/data/data_common.py::write_datafile`, nanoGPT `prepare.py`).

#![allow(dead_code)] // each test target uses some of these

use std::path::{Path, PathBuf};

pub fn u16_bytes(ids: &[u32]) -> Vec<u8> {
    ids.iter()
        .flat_map(|&t| u16::try_from(t).unwrap().to_le_bytes())
        .collect()
}

/// An llm.c shard of u16 tokens: 256 int32 header (magic 20240520, version 1, count).
pub fn llmc(ids: &[u32]) -> Vec<u8> {
    let mut bytes = vec![0u8; 1024];
    bytes[0..4].copy_from_slice(&20240520i32.to_le_bytes());
    bytes[4..8].copy_from_slice(&1i32.to_le_bytes());
    bytes[8..12].copy_from_slice(&(ids.len() as i32).to_le_bytes());
    bytes.extend(u16_bytes(ids));
    bytes
}

pub fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, bytes).unwrap();
    path
}
