//! The on-disk token cache: a corpus is tokenized once, its ids stored as u16 little-endian
//! (every GPT-2 id is below 65,536) and memory-mapped afterwards.
//!
//! File layout (one file, so it is replaced atomically as a whole):
//!
//! ```text
//! 0        8          12          16                     D = 16 + H rounded up to 64
//! | magic  | version  | H (u32 LE) | header JSON (H bytes) | zero pad | tokens: n x u16 LE |
//! "OOBTOKS\0"  u32 LE
//! ```
//!
//! The header records the SHA-256 of the corpus bytes, of the tokenizer files and of the token
//! data. A cache whose corpus or tokenizer hash differs is stale and rebuilt; one whose data
//! hash or length is wrong is corrupt and rebuilt (with a warning). Writes go to a temporary
//! name in the same folder, are fsynced and renamed into place, so readers never see half a
//! file and concurrent builders (several workers starting at once) each publish a complete,
//! identical file.
//!
//! Where the cache lives: an explicit folder if the caller gives one; otherwise the first of
//! [`default_cache_dirs`] that already holds a valid cache, else the first that is writable:
//! `$OOBLECK_CACHE_DIR` (alone, if set), next to the corpus (`<corpus>.tokens`),
//! `$XDG_CACHE_HOME/oobleck-rs` (or `~/.cache/oobleck-rs`), then the system temp folder. So a
//! read-only checkout still works. The built-in corpus (which has no folder) skips "next to the
//! corpus" ([`shared_cache_dirs`]). When no default place is writable the tokens are kept in
//! memory for this process (logged at debug level); an explicit folder that is not writable is
//! an error instead, since the caller asked for it.
//!
//! Several workers of a local cluster start at once and may all miss the cache: each tokenizes,
//! writes its own uniquely named temporary file and renames it over the cache name. The files
//! are identical, so whichever rename lands last, every reader maps a complete, valid cache; a
//! writer whose rename fails uses the cache another one published, if valid.

use std::borrow::Cow;
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use memmap2::Mmap;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::cache_dirs::{default_cache_dirs, shared_cache_dirs};
use super::tokenizer::Gpt2Tokenizer;
use super::{io_err, read_input, DataError, Result};

const MAGIC: &[u8; 8] = b"OOBTOKS\0";
/// Version of the cache file layout; a different version is rebuilt.
pub const CACHE_FORMAT_VERSION: u32 = 1;
const DATA_ALIGN: usize = 64;
/// Largest header accepted when reading (a corrupt length must not allocate gigabytes).
const MAX_HEADER: usize = 1 << 16;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Header {
    /// SHA-256 of the corpus file's bytes.
    corpus_sha256: String,
    /// Size of the corpus in bytes (for humans reading the header).
    corpus_bytes: u64,
    /// [`Gpt2Tokenizer::hash`] of the tokenizer that produced the ids.
    tokenizer_sha256: String,
    /// Vocabulary size of that tokenizer; every id is below it.
    vocab_size: u64,
    /// Number of u16 ids after the header.
    num_tokens: u64,
    /// SHA-256 of the token bytes, checked on every open.
    tokens_sha256: String,
}

/// Token ids of one corpus, memory-mapped from the cache file (or, with no writable cache
/// place, held in memory).
pub struct TokenCache {
    /// The cache file; `None` when the tokens are held in memory.
    path: Option<PathBuf>,
    bytes: CacheBytes,
    /// Where the token data starts in `bytes`.
    offset: usize,
    num_tokens: usize,
    tokens_sha256: String,
}

impl std::fmt::Debug for TokenCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenCache")
            .field("path", &self.path)
            .field("num_tokens", &self.num_tokens)
            .field("in_memory", &matches!(self.bytes, CacheBytes::Owned(_)))
            .finish()
    }
}

/// The bytes of a cache file: mapped, or built in memory when no cache place was writable.
enum CacheBytes {
    Mapped(Mmap),
    Owned(Vec<u8>),
}

impl CacheBytes {
    fn as_slice(&self) -> &[u8] {
        match self {
            CacheBytes::Mapped(map) => map,
            CacheBytes::Owned(bytes) => bytes,
        }
    }
}

/// The corpus a cache is built from: its bytes, its name in messages and where its cache may go.
struct Source<'a> {
    /// The corpus path, or [`super::EMBEDDED_CORPUS_NAME`] for the built-in one.
    label: &'a Path,
    bytes: Cow<'a, [u8]>,
    sha256: String,
    /// Cache files to try, in order.
    candidates: Vec<PathBuf>,
    /// Whether, with no candidate writable, the tokens may be kept in memory (default places
    /// only: an explicit folder the caller named must work).
    in_memory_ok: bool,
}

impl TokenCache {
    /// Opens the token cache of `corpus` under `tokenizer`, building it if missing, stale or
    /// corrupt. `cache_dir`: an explicit folder (created if needed), or `None` for the defaults.
    pub fn open(
        corpus: &Path,
        tokenizer: &Gpt2Tokenizer,
        cache_dir: Option<&Path>,
    ) -> Result<Self> {
        if corpus.is_dir() {
            return Err(DataError::NotAFile {
                path: corpus.to_path_buf(),
            });
        }
        let bytes = read_input(corpus, "corpus")?;
        let sha256 = hex::encode(Sha256::digest(&bytes));
        let name = cache_base_name(corpus);
        let candidates = match cache_dir {
            Some(dir) => vec![dir.join(format!("{name}.tokens"))],
            None => default_cache_dirs(corpus)
                .into_iter()
                .map(|(dir, hashed)| {
                    if hashed {
                        dir.join(hashed_name(&name, &sha256))
                    } else {
                        dir.join(format!("{name}.tokens"))
                    }
                })
                .collect(),
        };
        Self::open_source(
            Source {
                label: corpus,
                bytes: Cow::Owned(bytes),
                sha256,
                candidates,
                in_memory_ok: cache_dir.is_none(),
            },
            tokenizer,
        )
    }

    /// Opens the token cache of a corpus compiled into the binary (`label` names it in
    /// messages and, by its file name, in the cache's name). It never goes beside a source
    /// file: `cache_dir` or the [`shared_cache_dirs`], else memory.
    pub fn open_bytes(
        label: &Path,
        bytes: &[u8],
        tokenizer: &Gpt2Tokenizer,
        cache_dir: Option<&Path>,
    ) -> Result<Self> {
        let sha256 = hex::encode(Sha256::digest(bytes));
        let name = cache_base_name(label);
        let dirs = match cache_dir {
            Some(dir) => vec![dir.to_path_buf()],
            None => shared_cache_dirs(),
        };
        let candidates = dirs
            .into_iter()
            .map(|d| d.join(hashed_name(&name, &sha256)))
            .collect();
        Self::open_source(
            Source {
                label,
                bytes: Cow::Borrowed(bytes),
                sha256,
                candidates,
                in_memory_ok: cache_dir.is_none(),
            },
            tokenizer,
        )
    }

    fn open_source(src: Source<'_>, tokenizer: &Gpt2Tokenizer) -> Result<Self> {
        let want = |h: &Header| {
            h.corpus_sha256 == src.sha256
                && h.tokenizer_sha256 == tokenizer.hash()
                && h.vocab_size == tokenizer.vocab_size() as u64
        };
        for path in &src.candidates {
            if let Some(cache) = Self::load_if_valid(path, &want) {
                tracing::debug!(path = %path.display(), tokens = cache.num_tokens, "token cache hit");
                return Ok(cache);
            }
        }

        let (file, header) = build_file(&src, tokenizer)?;
        let mut tried = Vec::new();
        for path in &src.candidates {
            let problem = match write_atomic(path, &file) {
                Ok(()) => match Self::load_if_valid(path, &want) {
                    Some(cache) => {
                        tracing::info!(path = %path.display(), tokens = cache.num_tokens, "wrote token cache");
                        return Ok(cache);
                    }
                    None => "unreadable right after writing".to_owned(),
                },
                Err(e) => match Self::load_if_valid(path, &want) {
                    // Another process published the same cache while this one tokenized.
                    Some(cache) => return Ok(cache),
                    None => e.to_string(),
                },
            };
            tracing::debug!(path = %path.display(), problem, "cache location not usable");
            tried.push(format!("{} ({problem})", path.display()));
        }
        if !src.in_memory_ok {
            return Err(DataError::NoWritableCache {
                corpus: src.label.to_path_buf(),
                tried: tried.join(", "),
            });
        }
        tracing::debug!(
            corpus = %src.label.display(),
            tried = tried.join(", "),
            "no writable token cache location; keeping the tokens in memory"
        );
        let num_tokens = header.num_tokens as usize;
        Ok(Self {
            path: None,
            offset: file.len() - 2 * num_tokens,
            bytes: CacheBytes::Owned(file),
            num_tokens,
            tokens_sha256: header.tokens_sha256,
        })
    }

    /// Maps `path` if it is a complete cache whose header satisfies `want`; `None` otherwise
    /// (missing, stale or corrupt: the caller rebuilds).
    fn load_if_valid(path: &Path, want: &dyn Fn(&Header) -> bool) -> Option<Self> {
        let file = File::open(path).ok()?;
        // SAFETY: cache files are never modified in place: writers create a new file and
        // rename it over the old one, which leaves this mapping on the old inode intact. Only
        // an outside process truncating the file could invalidate it.
        let map = unsafe { Mmap::map(&file) }.ok()?;
        match parse(&map) {
            Ok((header, offset)) if want(&header) => {
                let num_tokens = header.num_tokens as usize;
                let data = &map[offset..];
                let mut max = 0u16;
                for pair in data.chunks_exact(2) {
                    max = max.max(u16::from_le_bytes([pair[0], pair[1]]));
                }
                if hex::encode(Sha256::digest(data)) != header.tokens_sha256
                    || (num_tokens > 0 && max as u64 >= header.vocab_size)
                {
                    tracing::warn!(path = %path.display(), "token cache is corrupt; rebuilding");
                    return None;
                }
                Some(Self {
                    path: Some(path.to_path_buf()),
                    bytes: CacheBytes::Mapped(map),
                    offset,
                    num_tokens,
                    tokens_sha256: header.tokens_sha256,
                })
            }
            Ok(_) => {
                tracing::info!(path = %path.display(), "token cache is stale; rebuilding");
                None
            }
            Err(problem) => {
                tracing::warn!(path = %path.display(), problem, "token cache unreadable; rebuilding");
                None
            }
        }
    }

    /// The cache file in use; `None` when the tokens are held in memory (no writable place).
    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    /// SHA-256 (hex) of the token data (`num_tokens` u16 LE ids), as checked on open.
    pub fn tokens_sha256(&self) -> &str {
        &self.tokens_sha256
    }

    /// Number of tokens of the whole corpus.
    pub fn len(&self) -> usize {
        self.num_tokens
    }

    /// Whether the corpus has no tokens (never true for an opened cache: empty corpora fail).
    pub fn is_empty(&self) -> bool {
        self.num_tokens == 0
    }

    /// Token `i`. Panics if `i >= len()`: callers index within checked ranges.
    pub fn get(&self, i: usize) -> u32 {
        let at = self.offset + 2 * i;
        let bytes = self.bytes.as_slice();
        u16::from_le_bytes([bytes[at], bytes[at + 1]]) as u32
    }

    /// Appends tokens `[start, start + n)` to `out`. Panics if the range is out of bounds.
    pub fn extend_into(&self, start: usize, n: usize, out: &mut Vec<u32>) {
        let bytes = &self.bytes.as_slice()[self.offset + 2 * start..self.offset + 2 * (start + n)];
        out.extend(
            bytes
                .chunks_exact(2)
                .map(|p| u16::from_le_bytes([p[0], p[1]]) as u32),
        );
    }
}

/// The corpus's file name, which starts its cache file's name (`corpus` if it has none).
fn cache_base_name(corpus: &Path) -> String {
    corpus
        .file_name()
        .map_or_else(|| "corpus".into(), |n| n.to_string_lossy().into_owned())
}

/// `<name>-<first 16 hex digits of the corpus hash>.tokens`: the name in shared folders.
fn hashed_name(name: &str, corpus_sha256: &str) -> String {
    format!("{name}-{}.tokens", &corpus_sha256[..16])
}

/// Tokenizes the corpus and lays out the whole cache file; also returns its header.
fn build_file(src: &Source<'_>, tokenizer: &Gpt2Tokenizer) -> Result<(Vec<u8>, Header)> {
    let ids = tokenize_corpus(src.label, &src.bytes, tokenizer)?;
    let tokens: Vec<u8> = ids
        .iter()
        .flat_map(|&id| (id as u16).to_le_bytes())
        .collect();
    let header = Header {
        corpus_sha256: src.sha256.clone(),
        corpus_bytes: src.bytes.len() as u64,
        tokenizer_sha256: tokenizer.hash().to_owned(),
        vocab_size: tokenizer.vocab_size() as u64,
        num_tokens: ids.len() as u64,
        tokens_sha256: hex::encode(Sha256::digest(&tokens)),
    };
    Ok((encode_file(&header, &tokens), header))
}

fn tokenize_corpus(path: &Path, bytes: &[u8], tokenizer: &Gpt2Tokenizer) -> Result<Vec<u32>> {
    let text = std::str::from_utf8(bytes).map_err(|e| DataError::NotUtf8 {
        path: path.to_path_buf(),
        offset: e.valid_up_to(),
    })?;
    let started = Instant::now();
    let ids = tokenizer.encode(text)?;
    if ids.is_empty() {
        return Err(DataError::EmptyCorpus {
            path: path.to_path_buf(),
        });
    }
    if let Some(&id) = ids.iter().find(|&&id| id > u16::MAX as u32) {
        return Err(DataError::VocabTooLarge {
            id,
            vocab: tokenizer.vocab_size(),
        });
    }
    tracing::info!(
        corpus = %path.display(),
        bytes = bytes.len(),
        tokens = ids.len(),
        seconds = started.elapsed().as_secs_f64(),
        "tokenized corpus"
    );
    Ok(ids)
}

fn encode_file(header: &Header, tokens: &[u8]) -> Vec<u8> {
    let json = serde_json::to_vec(header).expect("a struct of strings and integers serializes");
    let data_at = (16 + json.len()).div_ceil(DATA_ALIGN) * DATA_ALIGN;
    let mut out = Vec::with_capacity(data_at + tokens.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&CACHE_FORMAT_VERSION.to_le_bytes());
    out.extend_from_slice(&(json.len() as u32).to_le_bytes());
    out.extend_from_slice(&json);
    out.resize(data_at, 0);
    out.extend_from_slice(tokens);
    out
}

/// Header and data offset of a cache file, or why it is not one.
fn parse(bytes: &[u8]) -> std::result::Result<(Header, usize), String> {
    if bytes.len() < 16 || &bytes[..8] != MAGIC {
        return Err("not a token cache (bad magic)".into());
    }
    let version = u32::from_le_bytes(bytes[8..12].try_into().expect("4 bytes"));
    if version != CACHE_FORMAT_VERSION {
        return Err(format!(
            "format version {version}, expected {CACHE_FORMAT_VERSION}"
        ));
    }
    let h = u32::from_le_bytes(bytes[12..16].try_into().expect("4 bytes")) as usize;
    if h > MAX_HEADER || 16 + h > bytes.len() {
        return Err(format!("header length {h} out of range"));
    }
    let header: Header =
        serde_json::from_slice(&bytes[16..16 + h]).map_err(|e| format!("bad header: {e}"))?;
    let data_at = (16 + h).div_ceil(DATA_ALIGN) * DATA_ALIGN;
    let expected = (data_at as u64).checked_add(header.num_tokens.saturating_mul(2));
    if expected != Some(bytes.len() as u64) {
        return Err(format!(
            "file is {} bytes, header promises {} tokens after byte {data_at}",
            bytes.len(),
            header.num_tokens
        ));
    }
    Ok((header, data_at))
}

/// Writes `bytes` to `path` via a temporary file in the same folder: write, fsync, rename,
/// fsync the folder. Creates the folder if needed. The temporary name is unique to this
/// process and call (process id, a counter, the clock) and created exclusively, so concurrent writers,
/// in one process or several, never write into each other's file.
fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    static WRITES: AtomicU64 = AtomicU64::new(0);
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).map_err(io_err(dir))?;
    let nth = WRITES.fetch_add(1, Ordering::Relaxed);
    // The clock only keeps a file left by a crashed process of a reused id out of the way.
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    let file_name = path.file_name().unwrap_or_default().to_string_lossy();
    let tmp = dir.join(format!(
        ".{file_name}.tmp-{}-{nth}-{nanos}",
        std::process::id()
    ));
    let result = (|| {
        let mut f = File::options()
            .write(true)
            .create_new(true)
            .open(&tmp)
            .map_err(io_err(&tmp))?;
        f.write_all(bytes).map_err(io_err(&tmp))?;
        f.sync_all().map_err(io_err(&tmp))?;
        drop(f);
        std::fs::rename(&tmp, path).map_err(io_err(path))?;
        // The rename is durable only once the folder entry is on disk; not every platform
        // lets a folder be opened, so a failure here is not an error.
        if let Ok(d) = File::open(dir) {
            let _ = d.sync_all();
        }
        Ok(())
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(n: u64) -> Header {
        Header {
            corpus_sha256: "c".into(),
            corpus_bytes: 3,
            tokenizer_sha256: "t".into(),
            vocab_size: 50257,
            num_tokens: n,
            tokens_sha256: "d".into(),
        }
    }

    #[test]
    fn file_layout_round_trips_and_aligns_the_data() {
        let file = encode_file(&header(3), &[1, 0, 2, 0, 3, 0]);
        let (h, at) = parse(&file).unwrap();
        assert_eq!(h, header(3));
        assert_eq!(at % DATA_ALIGN, 0);
        assert_eq!(&file[at..], &[1, 0, 2, 0, 3, 0]);
    }

    #[test]
    fn truncated_or_foreign_files_are_rejected() {
        let file = encode_file(&header(3), &[1, 0, 2, 0, 3, 0]);
        assert!(parse(&file[..file.len() - 1])
            .unwrap_err()
            .contains("promises 3"));
        assert!(parse(b"hello world, not a cache")
            .unwrap_err()
            .contains("magic"));
        let mut bad_version = file.clone();
        bad_version[8] = 9;
        assert!(parse(&bad_version).unwrap_err().contains("version 9"));
        let mut huge_header = file;
        huge_header[12..16].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(parse(&huge_header).unwrap_err().contains("out of range"));
    }
}
