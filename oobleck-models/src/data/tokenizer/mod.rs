//! The GPT-2 byte-level BPE tokenizer, built with the `tokenizers` crate from OpenAI's original
//! `encoder.json` + `vocab.bpe` (shipped in `datasets/gpt2-tokenizer/`, see its README, and
//! compiled into the library: [`Gpt2Tokenizer::embedded`]).
//!
//! Matches OpenAI's `gpt-2/src/encoder.py` and tiktoken's `gpt2` encoding id for id (checked
//! against `datasets/gpt2-tokenizer/reference_ids.json` by the tests). One difference, the same
//! as Hugging Face's `GPT2TokenizerFast`: the literal text `<|endoftext|>` encodes to the single
//! special id 50256 instead of being spelled out in pieces.
//!
//! The same code loads other byte-level BPE vocabularies, OPT's among them: OPT's tokenizer
//! is GPT-2's merges with the ids renumbered (fairseq's dictionary order, `</s>` = 2, `<pad>` =
//! 1), see `datasets/README.md`. A model may have more embedding rows than the tokenizer has
//! ids ([`Gpt2Tokenizer::check_vocab`]): OPT pads its vocabulary to a multiple of 8.
//!
//! Encoding a vocabulary-and-merges tokenizer runs our own byte-level BPE ([`bpe`], with the
//! hand-written pre-tokenizer of [`pretokenize`]): id for id the `tokenizers` crate's (the
//! exactness tests compare the two on the corpus and on fuzzed Unicode), and on
//! `oobleck bench data`'s documents 66 MB/s on one core against tiktoken's 11 and the
//! crate's 1-2 (from Python; 2 threads: 123 MB/s, 1.86x one). A `tokenizer.json` keeps the
//! `tokenizers` crate's encoding, as its settings may be anything. Building the tables costs
//! ~35 ms more per tokenizer. Decoding is always the `tokenizers` crate's.

mod bpe;
#[cfg(test)]
mod exactness_tests;
mod pretokenize;

use std::borrow::Cow;
use std::path::{Path, PathBuf};

use rayon::prelude::*;
use sha2::{Digest, Sha256};
use tokenizers::models::bpe::{Merges, Vocab, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{AddedToken, Tokenizer};

use super::embedded::{EMBEDDED_ENCODER_JSON, EMBEDDED_TOKENIZER_NAME, EMBEDDED_VOCAB_BPE};
use super::{read_input, DataError, Result};

/// Vocabulary size of GPT-2 (and GPT-3, OPT-compatible presets): 50,000 merges + 256 bytes +
/// `<|endoftext|>`.
pub const GPT2_VOCAB_SIZE: usize = 50257;
/// The document separator of GPT-2.
pub const END_OF_TEXT: &str = "<|endoftext|>";
/// Id of [`END_OF_TEXT`] in the GPT-2 vocabulary.
pub const END_OF_TEXT_ID: u32 = 50256;

/// Names of a tokenizer's files in a Hugging Face model directory.
const HF_TOKENIZER_FILE: &str = "tokenizer.json";
const HF_VOCAB_FILE: &str = "vocab.json";
const HF_MERGES_FILE: &str = "merges.txt";

/// Size of the pieces a long text is cut into before encoding (see [`cut_points`]).
const CHUNK_BYTES: usize = 1 << 18;
/// Pieces encoded per `encode_batch` call: bounds the memory of the `Encoding`s held at once.
const CHUNKS_PER_BATCH: usize = 8;

/// A GPT-2 byte-level BPE tokenizer plus the hash of the files it was built from (the token
/// cache is keyed by it) and those files' bytes (a checkpoint carries them, so the ids a model
/// was trained with travel with its weights).
pub struct Gpt2Tokenizer {
    inner: Tokenizer,
    /// Our encoder of the same ids, for tokenizers built from a vocabulary and merges.
    fast: Option<FastEncoder>,
    source: PathBuf,
    hash: String,
    vocab_size: usize,
    files: SourceFiles,
}

/// [`bpe::ByteLevelBpe`] and the id the literal [`END_OF_TEXT`] encodes to.
struct FastEncoder {
    bpe: bpe::ByteLevelBpe,
    end_of_text: u32,
}

/// The bytes a tokenizer was built from.
enum SourceFiles {
    /// A `token -> id` vocabulary and a merges file (the built-in ones are borrowed).
    Bpe {
        vocab: Cow<'static, [u8]>,
        merges: Cow<'static, [u8]>,
    },
    /// A Hugging Face `tokenizer.json`.
    Json(Vec<u8>),
}

impl std::fmt::Debug for Gpt2Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gpt2Tokenizer")
            .field("source", &self.source)
            .field("vocab_size", &self.vocab_size)
            .field("hash", &self.hash)
            .finish()
    }
}

impl Gpt2Tokenizer {
    /// Loads a tokenizer from `path`, which is either
    /// - a folder with `encoder.json` + `vocab.bpe` (OpenAI names) or `vocab.json` + `merges.txt`
    ///   (Hugging Face names), built as GPT-2's byte-level BPE, or
    /// - a Hugging Face `tokenizer.json` file, used as it is.
    pub fn from_path(path: &Path) -> Result<Self> {
        if path.is_dir() {
            let pick = |a: &str, b: &str| {
                let (pa, pb) = (path.join(a), path.join(b));
                if pa.is_file() {
                    Some(pa)
                } else if pb.is_file() {
                    Some(pb)
                } else {
                    None
                }
            };
            match (
                pick("encoder.json", "vocab.json"),
                pick("vocab.bpe", "merges.txt"),
            ) {
                (Some(vocab), Some(merges)) => Self::from_vocab_and_merges(&vocab, &merges),
                _ => Err(DataError::BadTokenizer {
                    path: path.to_path_buf(),
                    problem: "folder has neither encoder.json + vocab.bpe nor vocab.json + \
                              merges.txt"
                        .into(),
                }),
            }
        } else if path.exists() {
            Self::from_tokenizer_json(path)
        } else {
            Err(DataError::NotFound {
                what: "tokenizer",
                path: path.to_path_buf(),
            })
        }
    }

    /// Builds GPT-2's tokenizer from a vocabulary (`token -> id` JSON) and a merges file.
    pub fn from_vocab_and_merges(vocab_path: &Path, merges_path: &Path) -> Result<Self> {
        let vocab_bytes = read_input(vocab_path, "tokenizer vocabulary")?;
        let merges_bytes = read_input(merges_path, "tokenizer merges")?;
        let source = vocab_path.parent().unwrap_or(vocab_path).to_path_buf();
        Self::from_bpe_bytes(
            (vocab_path, Cow::Owned(vocab_bytes)),
            (merges_path, Cow::Owned(merges_bytes)),
            source,
        )
    }

    /// The GPT-2 tokenizer compiled into the library (the bytes of `datasets/gpt2-tokenizer/`,
    /// so its [`Self::hash`] and ids equal those of [`Self::from_path`] on that folder).
    pub fn embedded() -> Self {
        let dir = Path::new(EMBEDDED_TOKENIZER_NAME);
        Self::from_bpe_bytes(
            (
                &dir.join("encoder.json"),
                Cow::Borrowed(EMBEDDED_ENCODER_JSON),
            ),
            (&dir.join("vocab.bpe"), Cow::Borrowed(EMBEDDED_VOCAB_BPE)),
            dir.to_path_buf(),
        )
        .expect("the built-in tokenizer files are the shipped ones, which the tests load")
    }

    /// GPT-2's byte-level BPE from the bytes of a vocabulary and a merges file; the paths name
    /// them in errors.
    fn from_bpe_bytes(
        (vocab_path, vocab_bytes): (&Path, Cow<'static, [u8]>),
        (merges_path, merges_bytes): (&Path, Cow<'static, [u8]>),
        source: PathBuf,
    ) -> Result<Self> {
        let vocab = parse_vocab(vocab_path, &vocab_bytes)?;
        let vocab_size = vocab.len();
        let merges = parse_merges(merges_path, &merges_bytes)?;
        let fast = bpe::ByteLevelBpe::new(vocab.iter().map(|(t, &id)| (t.as_str(), id)), &merges);
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .build()
            .map_err(|e| DataError::BadTokenizer {
                path: vocab_path.to_path_buf(),
                problem: e.to_string(),
            })?;
        let mut inner = Tokenizer::new(bpe);
        // GPT-2: no prefix space, the GPT-2 split regex, bytes mapped to printable characters.
        inner.with_pre_tokenizer(Some(ByteLevel::default().add_prefix_space(false)));
        inner.with_decoder(Some(ByteLevel::default()));
        inner.add_special_tokens(&[AddedToken::from(END_OF_TEXT, true)]);

        let mut h = Sha256::new();
        h.update(b"oobleck gpt2 byte-level bpe v1\0");
        h.update((vocab_bytes.len() as u64).to_le_bytes());
        h.update(&vocab_bytes);
        h.update(&merges_bytes);
        let fast = match (fast, inner.token_to_id(END_OF_TEXT)) {
            (Some(bpe), Some(end_of_text)) => Some(FastEncoder { bpe, end_of_text }),
            _ => None,
        };
        Ok(Self {
            vocab_size: inner.get_vocab_size(true).max(vocab_size),
            inner,
            fast,
            source,
            hash: hex::encode(h.finalize()),
            files: SourceFiles::Bpe {
                vocab: vocab_bytes,
                merges: merges_bytes,
            },
        })
    }

    /// Loads a Hugging Face `tokenizer.json`.
    pub fn from_tokenizer_json(path: &Path) -> Result<Self> {
        let bytes = read_input(path, "tokenizer")?;
        let inner = Tokenizer::from_bytes(&bytes).map_err(|e| DataError::BadTokenizer {
            path: path.to_path_buf(),
            problem: format!("not a tokenizer.json: {e}"),
        })?;
        Ok(Self {
            vocab_size: inner.get_vocab_size(true),
            inner,
            fast: None,
            source: path.to_path_buf(),
            hash: hex::encode(Sha256::digest(&bytes)),
            files: SourceFiles::Json(bytes),
        })
    }

    /// Number of token ids (including special tokens): 50257 for GPT-2.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// Where the tokenizer was loaded from (folder or `tokenizer.json`).
    pub fn source(&self) -> &Path {
        &self.source
    }

    /// SHA-256 (hex) of the files the tokenizer was built from.
    pub fn hash(&self) -> &str {
        &self.hash
    }

    /// The files this tokenizer was built from, under the names a Hugging Face model directory
    /// gives them (`vocab.json` + `merges.txt`, or `tokenizer.json`): written beside a
    /// checkpoint's weights, they make the directory name its own ids for `--init-from`
    /// ([`Self::in_model_dir`]) and for `transformers`.
    pub fn files(&self) -> Vec<(&'static str, &[u8])> {
        match &self.files {
            SourceFiles::Bpe { vocab, merges } => {
                vec![
                    (HF_VOCAB_FILE, vocab.as_ref()),
                    (HF_MERGES_FILE, merges.as_ref()),
                ]
            }
            SourceFiles::Json(bytes) => vec![(HF_TOKENIZER_FILE, bytes.as_slice())],
        }
    }

    /// The tokenizer a model directory ships, as a path for [`Self::from_path`]: its
    /// `tokenizer.json`, else the directory itself when it holds `vocab.json` + `merges.txt`
    /// (what Hugging Face GPT-2 and OPT repositories and this project's checkpoints hold).
    /// `None`: the directory names no tokenizer.
    pub fn in_model_dir(dir: &Path) -> Option<PathBuf> {
        let json = dir.join(HF_TOKENIZER_FILE);
        if json.is_file() {
            return Some(json);
        }
        (dir.join(HF_VOCAB_FILE).is_file() && dir.join(HF_MERGES_FILE).is_file())
            .then(|| dir.to_path_buf())
    }

    /// Checks that every id this tokenizer produces has a row in a model of `model_vocab`
    /// embedding rows, and returns how many rows it never produces (the model's padding).
    ///
    /// More rows than ids is padding, not a mismatch: OPT pads its 50,265 ids to 50,272 (a
    /// multiple of 8, for fast matrix shapes), and with GPT-2's 50,257 ids 15 rows are never
    /// an input or a target. Those rows only ever get the softmax's push-down in the tied LM
    /// head, so training is that of a 50,257-token model. More ids than rows would index
    /// past the embedding: that is refused with both numbers.
    pub fn check_vocab(&self, model_vocab: usize) -> Result<usize> {
        model_vocab
            .checked_sub(self.vocab_size)
            .ok_or_else(|| DataError::VocabMismatch {
                path: self.source.clone(),
                tokenizer_vocab: self.vocab_size,
                model_vocab,
            })
    }

    /// Token ids of `text`. Long texts are cut at points where GPT-2's pre-tokenizer splits
    /// anyway and encoded in parallel; the ids equal those of one `encode` of the whole text.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        match &self.fast {
            Some(fast) => Ok(fast.encode_in_chunks(text, CHUNK_BYTES)),
            None => self.encode_in_chunks(text, CHUNK_BYTES),
        }
    }

    /// The `tokenizers` crate's ids of `text`, whatever encoder [`Self::encode`] uses: what
    /// the exactness tests compare ours with.
    #[cfg(test)]
    fn encode_with_tokenizers_crate(&self, text: &str) -> Vec<u32> {
        self.encode_in_chunks(text, CHUNK_BYTES)
            .expect("the tokenizers crate encodes any text")
    }

    fn encode_in_chunks(&self, text: &str, chunk_bytes: usize) -> Result<Vec<u32>> {
        let pieces = split_at(text, &cut_points(text, chunk_bytes));
        let mut ids = Vec::with_capacity(text.len() / 3);
        for group in pieces.chunks(CHUNKS_PER_BATCH) {
            let encodings = self
                .inner
                .encode_batch_fast(group.to_vec(), false)
                .map_err(|e| DataError::Tokenize {
                    what: format!("{} bytes of text", text.len()),
                    message: e.to_string(),
                })?;
            for enc in encodings {
                ids.extend_from_slice(enc.get_ids());
            }
        }
        Ok(ids)
    }

    /// Text of `ids`; ids outside the vocabulary are an error.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        if let Some(&bad) = ids.iter().find(|&&id| id as usize >= self.vocab_size) {
            return Err(DataError::Tokenize {
                what: format!("decode of {} ids", ids.len()),
                message: format!("id {bad} is outside the vocabulary of {}", self.vocab_size),
            });
        }
        self.inner
            .decode(ids, false)
            .map_err(|e| DataError::Tokenize {
                what: format!("decode of {} ids", ids.len()),
                message: e.to_string(),
            })
    }
}

impl FastEncoder {
    /// As [`Gpt2Tokenizer::encode`]: pieces cut at [`cut_points`] are encoded in parallel.
    fn encode_in_chunks(&self, text: &str, chunk_bytes: usize) -> Vec<u32> {
        let cuts = cut_points(text, chunk_bytes);
        if cuts.is_empty() {
            let mut ids = Vec::with_capacity(text.len() / 3);
            self.encode_into(text, &mut ids);
            return ids;
        }
        let parts: Vec<Vec<u32>> = split_at(text, &cuts)
            .into_par_iter()
            .map(|piece| {
                let mut ids = Vec::with_capacity(piece.len() / 3);
                self.encode_into(piece, &mut ids);
                ids
            })
            .collect();
        parts.concat()
    }

    /// Appends the ids of `text` to `ids`: each literal [`END_OF_TEXT`] is its special id (as
    /// the `tokenizers` crate's added token: matched before pre-tokenization, anywhere).
    fn encode_into(&self, mut text: &str, ids: &mut Vec<u32>) {
        while let Some(at) = text.find(END_OF_TEXT) {
            self.bpe.encode_ordinary(&text[..at], ids);
            ids.push(self.end_of_text);
            text = &text[at + END_OF_TEXT.len()..];
        }
        self.bpe.encode_ordinary(text, ids);
    }
}

/// The `token -> id` JSON object in `bytes`, checked to use exactly the ids `0..n`.
fn parse_vocab(path: &Path, bytes: &[u8]) -> Result<Vocab> {
    let bad = |problem: String| DataError::BadTokenizer {
        path: path.to_path_buf(),
        problem,
    };
    let map: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(bytes).map_err(|e| bad(format!("not a JSON object: {e}")))?;
    let mut seen = vec![false; map.len()];
    let mut vocab = Vocab::with_capacity(map.len());
    for (token, id) in map.iter() {
        let id = id
            .as_u64()
            .filter(|&id| (id as usize) < map.len())
            .ok_or_else(|| {
                bad(format!(
                    "token {token:?} has id {id}, not in 0..{}",
                    map.len()
                ))
            })?;
        if std::mem::replace(&mut seen[id as usize], true) {
            return Err(bad(format!("id {id} is used twice")));
        }
        // In range: id < map.len(), and a JSON object of 2^32 entries cannot be in memory.
        vocab.insert(token.clone(), id as u32);
    }
    if vocab.is_empty() {
        return Err(bad("vocabulary is empty".into()));
    }
    Ok(vocab)
}

/// The merges of a merges file in rank order: every line but a `#version` header and blank
/// lines is two space-separated symbols.
fn parse_merges(path: &Path, bytes: &[u8]) -> Result<Merges> {
    let text = std::str::from_utf8(bytes).map_err(|e| DataError::NotUtf8 {
        path: path.to_path_buf(),
        offset: e.valid_up_to(),
    })?;
    let mut merges = Merges::new();
    for (i, line) in text.lines().enumerate() {
        if line.starts_with("#version") || line.is_empty() {
            continue;
        }
        match line.split_once(' ') {
            Some((a, b)) if !b.contains(' ') => merges.push((a.to_owned(), b.to_owned())),
            _ => {
                return Err(DataError::BadTokenizer {
                    path: path.to_path_buf(),
                    problem: format!("line {}: expected two symbols, got {line:?}", i + 1),
                })
            }
        }
    }
    Ok(merges)
}

/// Byte offsets, roughly every `chunk` bytes, where cutting `text` cannot change GPT-2's
/// pre-tokenization: right after a lone `\n` that follows a non-space and precedes a
/// non-space. Every alternative of the GPT-2 regex that could span such a point would have to
/// contain both whitespace and non-whitespace, which only ` ?\p{L}+`-style patterns do, and
/// their optional leading character is a space, not `\n`. The lone `\n` is its own piece both
/// in the whole text and at the end of the cut piece (`\s+(?!\S)` fails before `\S`, `\s+`
/// takes it; at the end of a piece `\s+(?!\S)` takes it), and the regex has no look-behind.
fn cut_points(text: &str, chunk: usize) -> Vec<usize> {
    let b = text.as_bytes();
    let mut cuts = Vec::new();
    let mut next = chunk;
    while next < b.len() {
        let found = (next.max(2)..b.len()).find(|&i| {
            b[i - 1] == b'\n'
                && !text[..i - 1]
                    .chars()
                    .next_back()
                    .is_none_or(char::is_whitespace)
                && !is_space_start(&text[i..])
        });
        match found {
            Some(i) => {
                cuts.push(i);
                next = i + chunk;
            }
            None => break,
        }
    }
    cuts
}

/// Whether `s` starts with a Unicode whitespace character (what the regex's `\s` matches).
fn is_space_start(s: &str) -> bool {
    s.chars().next().is_none_or(char::is_whitespace)
}

fn split_at<'a>(text: &'a str, cuts: &[usize]) -> Vec<&'a str> {
    let mut pieces = Vec::with_capacity(cuts.len() + 1);
    let mut start = 0;
    for &c in cuts {
        pieces.push(&text[start..c]);
        start = c;
    }
    pieces.push(&text[start..]);
    pieces
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cut_points_fall_after_lone_newlines_between_words() {
        let text = "aaaa\n\nbbbb\n cccc\ndddd\neeee";
        let cuts = cut_points(text, 3);
        // Not inside "\n\n", not before " cccc"; after "cccc\n" and "dddd\n".
        assert_eq!(cuts, vec![17, 22]);
        assert_eq!(split_at(text, &cuts).concat(), text);
    }

    fn shipped() -> Gpt2Tokenizer {
        Gpt2Tokenizer::embedded()
    }

    fn whole(tok: &Gpt2Tokenizer, text: &str) -> Vec<u32> {
        tok.inner
            .encode_fast(text, false)
            .unwrap()
            .get_ids()
            .to_vec()
    }

    #[test]
    fn chunked_encoding_equals_one_pass_on_awkward_whitespace() {
        let tok = shipped();
        // Every kind of whitespace next to a newline, repeated so that tiny chunks cut often.
        let unit = "Ber.\nWho's there?\n\nFran.\n Nay\u{a0}\nanswer\t\nme:\r\nstand \n\n\nand\n\
                    \u{3000}unfold\nyourself\n'tis\n123\n<|endoftext|>\nend";
        let text = unit.repeat(40);
        for chunk in [1, 3, 7, 50] {
            assert!(!cut_points(&text, chunk).is_empty());
            assert_eq!(
                tok.encode_in_chunks(&text, chunk).unwrap(),
                whole(&tok, &text),
                "chunk {chunk}"
            );
        }
    }

    #[test]
    fn chunked_encoding_equals_one_pass_on_the_corpus() {
        let tok = shipped();
        let text = &crate::data::EMBEDDED_CORPUS[..600_000];
        assert!(cut_points(text, CHUNK_BYTES).len() >= 2);
        assert_eq!(tok.encode(text).unwrap(), whole(&tok, text));
    }

    #[test]
    fn cut_points_of_a_text_without_safe_points_is_empty() {
        assert!(cut_points("one long line without newlines", 4).is_empty());
        assert!(cut_points("", 4).is_empty());
    }
}
