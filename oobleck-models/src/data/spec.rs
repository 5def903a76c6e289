//! [`DataSpec`]: what `train --data [W:]SRC ... --val-data SRC --val-fraction F --data-format`
//! name, and [`open_data`], which opens it on every node the same way.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::corpus::TokenCache;
use super::dataset::{open_shard_set, Dataset, Opened, Validation};
use super::embedded::open_tokenizer;
use super::holdout::{fraction_millionths, DEFAULT_VAL_FRACTION};
use super::prepare::{ReadOptions, DEFAULT_TEXT_FIELD};
use super::prepared::check_prepared;
use super::shards::FormatHint;
use super::source::{resolve_source, DataSource};
use super::tokenizer::Gpt2Tokenizer;
use super::tokens::TokenStore;
use super::{Result, EMBEDDED_CORPUS, EMBEDDED_CORPUS_NAME};

/// One `--data` value: a path and, in a blend, its weight (`0.7:web/`).
#[derive(Debug, Clone, PartialEq)]
pub struct WeightedSource {
    /// Blend weight, any positive scale; `None`: the source weighs its tokens.
    pub weight: Option<f64>,
    pub path: PathBuf,
}

impl WeightedSource {
    /// `W:PATH` when the text before the first `:` is a number, else all of it is the path.
    pub fn parse(text: &str) -> Self {
        if let Some((w, path)) = text.split_once(':') {
            if let Ok(weight) = w.trim().parse::<f64>() {
                return Self {
                    weight: Some(weight),
                    path: PathBuf::from(path),
                };
            }
        }
        Self {
            weight: None,
            path: PathBuf::from(text),
        }
    }
}

impl std::fmt::Display for WeightedSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.weight {
            Some(w) => write!(f, "{w}:{}", self.path.display()),
            None => write!(f, "{}", self.path.display()),
        }
    }
}

impl Serialize for WeightedSource {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_string())
    }
}

impl<'de> Deserialize<'de> for WeightedSource {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        String::deserialize(d).map(|s| Self::parse(&s))
    }
}

/// The data of a run (see the module docs). The default is the built-in corpus with 5% held
/// out.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DataSpec {
    /// Training sources, blended by their weights; none: the built-in corpus.
    pub sources: Vec<WeightedSource>,
    /// Validation from this source, read whole; then no training document is held out.
    pub val_data: Option<PathBuf>,
    /// Share of each source's documents held out for validation (without `val_data`).
    pub val_fraction: f64,
    /// How a shard with no header is read (`--data-format`).
    pub format: FormatHint,
    /// Raw JSONL and Parquet sources: the field or column holding the text (`--text-field`).
    #[serde(skip_serializing_if = "is_default_text_field")]
    pub text_field: String,
    /// Raw sources: skip and count bad records instead of failing (`--skip-bad-records`).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub skip_bad_records: bool,
}

fn is_default_text_field(field: &str) -> bool {
    field == DEFAULT_TEXT_FIELD
}

impl Default for DataSpec {
    fn default() -> Self {
        Self {
            sources: Vec::new(),
            val_data: None,
            val_fraction: DEFAULT_VAL_FRACTION,
            format: FormatHint::Detect,
            text_field: DEFAULT_TEXT_FIELD.to_string(),
            skip_bad_records: false,
        }
    }
}

impl DataSpec {
    /// One source at `path`, no weight (the default validation).
    pub fn path(path: impl Into<PathBuf>) -> Self {
        Self {
            sources: vec![WeightedSource {
                weight: None,
                path: path.into(),
            }],
            ..Self::default()
        }
    }

    /// How raw sources' records are read.
    fn read_options(&self) -> ReadOptions {
        ReadOptions {
            text_field: self.text_field.clone(),
            skip_bad_records: self.skip_bad_records,
        }
    }
}

/// `train --data ...`: every source of `spec` (a text corpus, token shards, a folder or a glob
/// of them; see [`resolve_source`]; none: the built-in corpus), tokenized with the tokenizer at
/// `tokenizer` or the built-in GPT-2 one, split and blended (see [`Dataset`]). Every path is
/// resolved before the tokenizer loads, so a mistyped path is the error reported. Every node
/// opens the same paths.
pub fn open_data(spec: &DataSpec, tokenizer: Option<&Path>) -> Result<Dataset> {
    let millionths = fraction_millionths(spec.val_fraction)?;
    let resolved = spec
        .sources
        .iter()
        .map(|s| Ok((s, resolve_source(&s.path, spec.format)?)))
        .collect::<Result<Vec<_>>>()?;
    let val = match &spec.val_data {
        Some(path) => Some((path, resolve_source(path, spec.format)?)),
        None => None,
    };
    let tokenizer = Arc::new(open_tokenizer(tokenizer)?);
    let mut sources = Vec::with_capacity(resolved.len().max(1));
    if resolved.is_empty() {
        let label = Path::new(EMBEDDED_CORPUS_NAME);
        let cache = TokenCache::open_bytes(label, EMBEDDED_CORPUS.as_bytes(), &tokenizer, None)?;
        sources.push(Opened {
            label: label.to_path_buf(),
            tokens: TokenStore::Text(cache),
            weight: None,
        });
    }
    for (source, resolved) in resolved {
        sources.push(Opened {
            label: source.path.clone(),
            tokens: open_store(&source.path, resolved, spec, &tokenizer)?,
            weight: source.weight,
        });
    }
    let validation = match val {
        Some((path, resolved)) => Validation::Source(Opened {
            label: path.clone(),
            tokens: open_store(path, resolved, spec, &tokenizer)?,
            weight: None,
        }),
        None => Validation::HeldOut(millionths),
    };
    Dataset::blend(tokenizer, sources, validation)
}

/// The tokens of one resolved source.
fn open_store(
    label: &Path,
    source: DataSource,
    spec: &DataSpec,
    tokenizer: &Gpt2Tokenizer,
) -> Result<TokenStore> {
    match source {
        DataSource::Text(text) => Ok(TokenStore::Text(TokenCache::open(&text, tokenizer, None)?)),
        DataSource::Shards(files) => {
            check_prepared(label, &files, tokenizer)?;
            Ok(TokenStore::Shards(open_shard_set(
                label,
                &files,
                spec.format,
            )?))
        }
        DataSource::Raw(files) => {
            // The cache checked the folder against its manifest and this tokenizer (its key).
            let read = spec.read_options();
            let dir = super::prepare::prepare_cached(label, &files, tokenizer, &read)?;
            let DataSource::Shards(shards) = resolve_source(&dir, FormatHint::Detect)? else {
                return Err(super::DataError::Prepared {
                    dir,
                    problem: "holds no token shards; remove it to prepare again".into(),
                });
            };
            let set = open_shard_set(label, &shards, FormatHint::Detect)?;
            Ok(TokenStore::Shards(set))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_weight_is_a_number_before_the_first_colon() {
        let w = WeightedSource::parse("0.7:web/shards");
        assert_eq!(w.weight, Some(0.7));
        assert_eq!(w.path, Path::new("web/shards"));
        let plain = WeightedSource::parse("data/c:d.txt");
        assert_eq!(plain.weight, None);
        assert_eq!(plain.path, Path::new("data/c:d.txt"));
        assert_eq!(w.to_string(), "0.7:web/shards");
        let json = serde_json::to_string(&DataSpec::path("a.txt")).unwrap();
        assert_eq!(
            json,
            r#"{"sources":["a.txt"],"val_data":null,"val_fraction":0.05,"format":"detect"}"#
        );
        let back: DataSpec = serde_json::from_str(&json).unwrap();
        assert_eq!(back, DataSpec::path("a.txt"));
    }
}
