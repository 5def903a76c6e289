//! Streams one source's documents in order: decompression, records, UTF-8 and field checks.
//!
//! A text file is read whole (it is one document); a JSONL file a line at a time, so its
//! memory is one line. Every error names the file and the place: the line number of a JSONL
//! record, the byte offset (in the decompressed text) of a bad UTF-8 sequence, how far a
//! truncated `.gz`/`.zst` stream decoded.

use std::fs::File;
use std::io::{BufRead, BufReader, Read};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use super::error::{read_err, PrepareError, Result};
use super::sources::{Codec, Layout, SourceFile};

/// Counts the bytes read from disk (before decompression) into a shared counter: the progress
/// line's "MB read" and its ETA against the sources' total size.
struct Counting<R> {
    inner: R,
    counter: Arc<AtomicU64>,
}

impl<R: Read> Read for Counting<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.counter.fetch_add(n as u64, Ordering::Relaxed);
        Ok(n)
    }
}

/// What a reader needs besides the file.
#[derive(Debug, Clone)]
pub struct ReadOptions {
    /// JSONL field holding the text.
    pub text_field: String,
    /// Skip (and count) JSONL records that are not JSON or lack the field, instead of failing.
    pub skip_bad_records: bool,
}

/// The documents of one source, in file order.
pub struct DocReader {
    path: PathBuf,
    layout: Layout,
    codec: Codec,
    input: Box<dyn BufRead + Send>,
    options: ReadOptions,
    /// Records skipped as bad so far (only with `skip_bad_records`).
    pub skipped: u64,
    /// Lines read so far (JSONL) and decompressed bytes consumed.
    line: u64,
    offset: u64,
    done: bool,
    buf: Vec<u8>,
}

impl DocReader {
    /// Opens `src`; `counter` is advanced by the bytes read from disk.
    pub fn open(src: &SourceFile, options: &ReadOptions, counter: Arc<AtomicU64>) -> Result<Self> {
        let file = File::open(&src.path).map_err(read_err(&src.path))?;
        let raw = BufReader::with_capacity(
            1 << 20,
            Counting {
                inner: file,
                counter,
            },
        );
        let input: Box<dyn BufRead + Send> = match src.codec {
            Codec::Plain => Box::new(raw),
            Codec::Gzip => Box::new(BufReader::with_capacity(
                1 << 20,
                flate2::bufread::MultiGzDecoder::new(raw),
            )),
            Codec::Zstd => {
                let d =
                    zstd::stream::read::Decoder::with_buffer(raw).map_err(read_err(&src.path))?;
                Box::new(BufReader::with_capacity(1 << 20, d))
            }
        };
        Ok(Self {
            path: src.path.clone(),
            layout: src.layout,
            codec: src.codec,
            input,
            options: options.clone(),
            skipped: 0,
            line: 0,
            offset: 0,
            done: false,
            buf: Vec::new(),
        })
    }

    /// The next document, or `None` at the end of the source.
    pub fn next_doc(&mut self) -> Result<Option<String>> {
        if self.done {
            return Ok(None);
        }
        match self.layout {
            Layout::Text => {
                self.done = true;
                let mut bytes = Vec::new();
                self.input
                    .read_to_end(&mut bytes)
                    .map_err(|e| self.io_error(e))?;
                self.offset = bytes.len() as u64;
                String::from_utf8(bytes)
                    .map(Some)
                    .map_err(|e| PrepareError::NotUtf8 {
                        path: self.path.clone(),
                        offset: e.utf8_error().valid_up_to() as u64,
                        at_line: String::new(),
                    })
            }
            Layout::JsonLines => self.next_record(),
        }
    }

    fn next_record(&mut self) -> Result<Option<String>> {
        loop {
            self.buf.clear();
            let start = self.offset;
            let n = self
                .input
                .read_until(b'\n', &mut self.buf)
                .map_err(|e| self.io_error(e))?;
            if n == 0 {
                self.done = true;
                return Ok(None);
            }
            self.offset += n as u64;
            self.line += 1;
            let text = std::str::from_utf8(&self.buf).map_err(|e| PrepareError::NotUtf8 {
                path: self.path.clone(),
                offset: start + e.valid_up_to() as u64,
                at_line: format!(", line {}", self.line),
            })?;
            if text.trim().is_empty() {
                continue;
            }
            match extract(text, &self.options.text_field) {
                Ok(doc) => return Ok(Some(doc)),
                Err(_) if self.options.skip_bad_records => self.skipped += 1,
                Err(problem) => {
                    return Err(PrepareError::BadRecord {
                        path: self.path.clone(),
                        line: self.line,
                        problem,
                    })
                }
            }
        }
    }

    fn io_error(&self, e: std::io::Error) -> PrepareError {
        match self.codec {
            Codec::Plain => read_err(&self.path)(e),
            codec => PrepareError::Decompress {
                path: self.path.clone(),
                codec: codec.name(),
                offset: self.offset,
                source: e,
            },
        }
    }
}

/// The string field `field` of one JSON object, or what is wrong with the record.
fn extract(line: &str, field: &str) -> std::result::Result<String, String> {
    let value: serde_json::Value =
        serde_json::from_str(line).map_err(|e| format!("not JSON ({e})"))?;
    let serde_json::Value::Object(mut map) = value else {
        return Err("not a JSON object".into());
    };
    match map.remove(field) {
        Some(serde_json::Value::String(s)) => Ok(s),
        Some(_) => Err(format!("field \"{field}\" is not a string")),
        None => {
            let mut keys: Vec<&str> = map.keys().map(String::as_str).collect();
            keys.sort_unstable();
            Err(format!(
                "no field \"{field}\" (fields: {}; pass --text-field NAME)",
                if keys.is_empty() {
                    "none".to_string()
                } else {
                    keys.join(", ")
                }
            ))
        }
    }
}
