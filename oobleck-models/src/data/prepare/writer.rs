//! Appends tokenized documents to llm.c shards, closing a shard before the document that
//! would overflow it, and records each finished shard in the manifest.
//!
//! ```text
//! shard-000000.bin.tmp  <- header placeholder, then [eot, ids...] per document, streamed
//!   full: header rewritten with the count, fsync, SHA-256 of the file,
//!         rename to shard-000000.bin, manifest.json rewritten listing it
//! ```
//!
//! A shard's memory is its write buffer, not its tokens. A document is never split: it goes
//! whole into the next shard, and one longer than `shard_tokens` fills a shard of its own.

use std::fs::File;
use std::io::{BufWriter, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use super::error::{write_err, PrepareError, Result};
use super::manifest::{Manifest, Position, ShardEntry};
use crate::data::{LLMC_MAGIC_U16, LLMC_MAGIC_U32};

/// llm.c's header: 256 int32s.
const HEADER_BYTES: usize = 1024;
/// Suffix of a shard being written.
pub const TMP_SUFFIX: &str = ".tmp";

/// The file name of shard `index`.
pub fn shard_name(index: usize) -> String {
    format!("shard-{index:06}.bin")
}

struct OpenShard {
    index: usize,
    tmp: PathBuf,
    out: BufWriter<File>,
    tokens: u64,
    documents: u64,
    end: Position,
}

/// Writes shards into `dir`, continuing after the shards `manifest` already lists.
pub struct ShardWriter {
    dir: PathBuf,
    manifest: Manifest,
    wide: bool,
    end_of_text: u32,
    current: Option<OpenShard>,
    /// Bad records skipped in all the sources read so far (the shards' `end` positions only
    /// count those before their last document).
    skipped_records: u64,
}

impl ShardWriter {
    /// `manifest` lists the shards kept from an earlier run (none for a fresh one).
    pub fn new(dir: &Path, manifest: Manifest) -> Self {
        Self {
            dir: dir.to_path_buf(),
            wide: manifest.dtype == "u32",
            end_of_text: manifest.tokenizer.end_of_text_id,
            manifest,
            current: None,
            skipped_records: 0,
        }
    }

    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// Appends one document (its end-of-text id first); `end` is the position after it.
    pub fn add_document(&mut self, ids: &[u32], end: Position) -> Result<()> {
        let len = ids.len() as u64 + 1;
        let limit = self.manifest.shard_tokens;
        if let Some(cur) = &self.current {
            if cur.tokens > 0 && cur.tokens + len > limit {
                self.close()?;
            }
        }
        if self.current.is_none() {
            self.current = Some(self.open()?);
        }
        let wide = self.wide;
        let cur = self.current.as_mut().expect("opened just above");
        let mut bytes = Vec::with_capacity(ids.len() * 4 + 4);
        for &id in std::iter::once(&self.end_of_text).chain(ids) {
            if wide {
                bytes.extend_from_slice(&id.to_le_bytes());
            } else {
                let narrow = u16::try_from(id)
                    .expect("u16 shards are chosen only for vocabularies under 65536");
                bytes.extend_from_slice(&narrow.to_le_bytes());
            }
        }
        cur.out.write_all(&bytes).map_err(write_err(&cur.tmp))?;
        cur.tokens += len;
        cur.documents += 1;
        cur.end = end;
        Ok(())
    }

    pub fn set_skipped_records(&mut self, n: u64) {
        self.skipped_records = n;
    }

    /// Closes the last shard and returns the manifest, complete with its totals.
    pub fn finish(mut self) -> Result<Manifest> {
        if self.current.is_some() {
            self.close()?;
        }
        if self.manifest.shards.is_empty() {
            return Err(PrepareError::Empty {
                skipped_records: self.skipped_records,
            });
        }
        self.manifest.complete = true;
        self.manifest.update_totals();
        let at_last_shard = self.manifest.totals.skipped_records;
        self.manifest.totals.skipped_records = self.skipped_records.max(at_last_shard);
        self.manifest.save(&self.dir)?;
        Ok(self.manifest)
    }

    fn open(&self) -> Result<OpenShard> {
        let index = self.manifest.shards.len();
        let tmp = self.dir.join(format!("{}{TMP_SUFFIX}", shard_name(index)));
        let file = File::create(&tmp).map_err(write_err(&tmp))?;
        let mut out = BufWriter::with_capacity(1 << 20, file);
        out.write_all(&[0u8; HEADER_BYTES])
            .map_err(write_err(&tmp))?;
        Ok(OpenShard {
            index,
            tmp,
            out,
            tokens: 0,
            documents: 0,
            end: Position::default(),
        })
    }

    fn close(&mut self) -> Result<()> {
        let cur = self
            .current
            .take()
            .expect("close is called with a shard open");
        let count = i32::try_from(cur.tokens).map_err(|_| PrepareError::Write {
            path: cur.tmp.clone(),
            source: std::io::Error::other(format!(
                "{} tokens in one shard: llm.c's header counts at most {} (one document that long?)",
                cur.tokens,
                i32::MAX
            )),
        })?;
        let (magic, version) = if self.wide {
            (LLMC_MAGIC_U32, 7)
        } else {
            (LLMC_MAGIC_U16, 1)
        };
        let mut header = [0u8; HEADER_BYTES];
        for (i, word) in [magic, version, count].into_iter().enumerate() {
            header[4 * i..4 * i + 4].copy_from_slice(&word.to_le_bytes());
        }
        let tmp = &cur.tmp;
        let mut file = cur
            .out
            .into_inner()
            .map_err(|e| write_err(tmp)(e.into_error()))?;
        file.seek(SeekFrom::Start(0)).map_err(write_err(tmp))?;
        file.write_all(&header).map_err(write_err(tmp))?;
        file.sync_all().map_err(write_err(tmp))?;
        let sha256 = sha256_of(tmp)?;
        let name = shard_name(cur.index);
        let path = self.dir.join(&name);
        std::fs::rename(tmp, &path).map_err(write_err(&path))?;
        self.manifest.shards.push(ShardEntry {
            name,
            tokens: cur.tokens,
            documents: cur.documents,
            sha256,
            end: cur.end,
        });
        self.manifest.update_totals();
        self.manifest.save(&self.dir)
    }
}

fn sha256_of(path: &Path) -> Result<String> {
    let mut f = File::open(path).map_err(write_err(path))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).map_err(write_err(path))?;
        if n == 0 {
            return Ok(hex::encode(h.finalize()));
        }
        h.update(&buf[..n]);
    }
}
