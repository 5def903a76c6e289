//! Test fixtures: every format written from its documented layout (llm.c's
//! `dev/data/data_common.py::write_datafile`, nanoGPT's `prepare.py`, Megatron-LM's
//! `_IndexWriter`), independently of the readers: byte for byte with literal magics and
//! offsets, so a reader that drifted from the real layout fails here.

use std::path::{Path, PathBuf};

use memmap2::{Mmap, MmapMut};

/// llm.c's 256-int32 header: magic, version, token count, then zeros.
pub fn llmc_header(magic: i32, version: i32, count: i32) -> Vec<u8> {
    let mut header = vec![0u8; 1024];
    header[0..4].copy_from_slice(&magic.to_le_bytes());
    header[4..8].copy_from_slice(&version.to_le_bytes());
    header[8..12].copy_from_slice(&count.to_le_bytes());
    header
}

/// A whole llm.c shard: u16 tokens under magic 20240520, u32 under any other.
pub fn llmc_bytes(magic: i32, version: i32, tokens: &[u32]) -> Vec<u8> {
    let mut bytes = llmc_header(magic, version, tokens.len() as i32);
    for &t in tokens {
        if magic == 20240520 {
            bytes.extend_from_slice(&u16::try_from(t).unwrap().to_le_bytes());
        } else {
            bytes.extend_from_slice(&t.to_le_bytes());
        }
    }
    bytes
}

/// nanoGPT's `train.bin`: `np.array(ids, dtype=np.uint16).tofile(...)`.
pub fn raw_u16_bytes(tokens: &[u32]) -> Vec<u8> {
    tokens
        .iter()
        .flat_map(|&t| u16::try_from(t).unwrap().to_le_bytes())
        .collect()
}

/// `value` stored as Megatron's dtype `code` (floats as floats, for the refusal tests).
pub fn megatron_token(code: u8, value: i64) -> Vec<u8> {
    match code {
        1 => vec![value as u8],
        2 => vec![value as i8 as u8],
        3 => (value as i16).to_le_bytes().to_vec(),
        4 => (value as i32).to_le_bytes().to_vec(),
        5 => value.to_le_bytes().to_vec(),
        6 => (value as f64).to_le_bytes().to_vec(),
        7 => (value as f32).to_le_bytes().to_vec(),
        8 => (value as u16).to_le_bytes().to_vec(),
        _ => (value as i32).to_le_bytes().to_vec(),
    }
}

/// A Megatron `.idx` from its arrays, written field by field as `_IndexWriter` does.
pub fn megatron_idx(code: u8, lengths: &[i32], pointers: &[i64], documents: &[i64]) -> Vec<u8> {
    let mut idx = b"MMIDIDX\x00\x00".to_vec();
    idx.extend_from_slice(&1u64.to_le_bytes());
    idx.push(code);
    idx.extend_from_slice(&(lengths.len() as u64).to_le_bytes());
    idx.extend_from_slice(&(documents.len() as u64).to_le_bytes());
    lengths
        .iter()
        .for_each(|l| idx.extend_from_slice(&l.to_le_bytes()));
    pointers
        .iter()
        .for_each(|p| idx.extend_from_slice(&p.to_le_bytes()));
    documents
        .iter()
        .for_each(|d| idx.extend_from_slice(&d.to_le_bytes()));
    idx
}

/// A consistent Megatron pair `(bin, idx)` of `docs`, each a list of sequences of tokens, as
/// `IndexedDatasetBuilder.add_document` + `finalize` write it.
pub fn megatron_pair(code: u8, docs: &[Vec<Vec<i64>>]) -> (Vec<u8>, Vec<u8>) {
    let (mut bin, mut lengths, mut pointers, mut documents) = (vec![], vec![], vec![], vec![0]);
    for doc in docs {
        for sequence in doc {
            pointers.push(bin.len() as i64);
            lengths.push(sequence.len() as i32);
            sequence
                .iter()
                .for_each(|&t| bin.extend(megatron_token(code, t)));
        }
        documents.push(lengths.len() as i64);
    }
    let idx = megatron_idx(code, &lengths, &pointers, &documents);
    (bin, idx)
}

/// Writes `bytes` to `dir/name`.
pub fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, bytes).unwrap();
    path
}

/// `bytes` in an anonymous read-only map, for parsers that take ownership of a map.
pub fn anon_map(bytes: &[u8]) -> Mmap {
    let mut map = MmapMut::map_anon(bytes.len()).unwrap();
    map.copy_from_slice(bytes);
    map.make_read_only().unwrap()
}
