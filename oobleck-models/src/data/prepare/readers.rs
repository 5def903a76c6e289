//! Streams one source's documents in order: decompression, records, UTF-8 and field checks.
//!
//! A text file is read whole (it is one document); a JSONL file a line at a time, so its
//! memory is one line; a Parquet file a batch of rows of one row group at a time
//! (parquet_reader.rs). Every error names the file and the place: the line number of a JSONL
//! record, the row of a Parquet record, the byte offset (in the decompressed text) of a bad
//! UTF-8 sequence, how far a truncated `.gz`/`.zst` stream decoded.

use std::fs::File;
use std::io::{BufRead, BufReader, Read};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use super::error::{read_err, PrepareError, Result};
use super::parquet_reader::{ParquetDocs, Row};
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
    /// JSONL field, or Parquet column, holding the text.
    pub text_field: String,
    /// Skip (and count) records that are not JSON, lack the field or (Parquet) are null,
    /// instead of failing.
    pub skip_bad_records: bool,
}

/// Where the documents come from: a (decompressed) byte stream, or a Parquet file's column.
enum Input {
    /// A whole text file, one document.
    Text(Box<dyn BufRead + Send>),
    /// One JSON object a line.
    Lines(Box<dyn BufRead + Send>),
    Parquet(Box<ParquetDocs>),
}

/// The documents of one source, in file order.
pub struct DocReader {
    path: PathBuf,
    codec: Codec,
    input: Input,
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
        let input = match src.layout {
            Layout::Text => Input::Text(open_bytes(src, counter)?),
            Layout::JsonLines => Input::Lines(open_bytes(src, counter)?),
            Layout::Parquet => Input::Parquet(Box::new(ParquetDocs::open(
                &src.path,
                &options.text_field,
                counter,
            )?)),
        };
        Ok(Self {
            path: src.path.clone(),
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
        match &mut self.input {
            Input::Text(input) => {
                self.done = true;
                let mut bytes = Vec::new();
                if let Err(e) = input.read_to_end(&mut bytes) {
                    return Err(self.io_error(e));
                }
                self.offset = bytes.len() as u64;
                String::from_utf8(bytes)
                    .map(Some)
                    .map_err(|e| PrepareError::NotUtf8 {
                        path: self.path.clone(),
                        offset: e.utf8_error().valid_up_to() as u64,
                        at_line: String::new(),
                    })
            }
            Input::Lines(_) => self.next_record(),
            Input::Parquet(_) => self.next_row(),
        }
    }

    fn next_record(&mut self) -> Result<Option<String>> {
        let Input::Lines(input) = &mut self.input else {
            unreachable!("next_record is called for JSONL input only");
        };
        loop {
            self.buf.clear();
            let start = self.offset;
            let n = match input.read_until(b'\n', &mut self.buf) {
                Ok(n) => n,
                Err(e) => return Err(io_error(&self.path, self.codec, self.offset, e)),
            };
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

    fn next_row(&mut self) -> Result<Option<String>> {
        let Input::Parquet(rows) = &mut self.input else {
            unreachable!("next_row is called for Parquet input only");
        };
        loop {
            match rows.next_row()? {
                None => {
                    self.done = true;
                    return Ok(None);
                }
                Some(Row::Text(text)) => return Ok(Some(text)),
                Some(Row::Bad(_)) if self.options.skip_bad_records => self.skipped += 1,
                Some(Row::Bad(problem)) => {
                    return Err(PrepareError::BadRow {
                        path: self.path.clone(),
                        row: rows.last_row(),
                        problem,
                    })
                }
            }
        }
    }

    fn io_error(&self, e: std::io::Error) -> PrepareError {
        io_error(&self.path, self.codec, self.offset, e)
    }
}

/// The decompressed bytes of a text or JSONL source.
fn open_bytes(src: &SourceFile, counter: Arc<AtomicU64>) -> Result<Box<dyn BufRead + Send>> {
    let file = File::open(&src.path).map_err(read_err(&src.path))?;
    let raw = BufReader::with_capacity(
        1 << 20,
        Counting {
            inner: file,
            counter,
        },
    );
    Ok(match src.codec {
        Codec::Plain => Box::new(raw),
        Codec::Gzip => Box::new(BufReader::with_capacity(
            1 << 20,
            flate2::bufread::MultiGzDecoder::new(raw),
        )),
        Codec::Zstd => {
            let d = zstd::stream::read::Decoder::with_buffer(raw).map_err(read_err(&src.path))?;
            Box::new(BufReader::with_capacity(1 << 20, d))
        }
    })
}

/// An I/O error at decompressed byte `offset`: a read error, or a broken compressed stream.
fn io_error(path: &std::path::Path, codec: Codec, offset: u64, e: std::io::Error) -> PrepareError {
    match codec {
        Codec::Plain => read_err(path)(e),
        codec => PrepareError::Decompress {
            path: path.to_path_buf(),
            codec: codec.name(),
            offset,
            source: e,
        },
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
