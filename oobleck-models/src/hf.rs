//! Hugging Face `config.json` + safetensors import, from a directory or the hub cache.
//!
//! A model reference is either a local directory holding `config.json` and `model.safetensors`
//! (or a sharded `model.safetensors.index.json`), or a hub id `org/name[@revision]`. Hub ids are
//! resolved in the local Hugging Face cache (`$HF_HUB_CACHE`, else `$HF_HOME/hub`, else
//! `~/.cache/huggingface/hub`, the layout `models--org--name/{refs,snapshots}` that
//! `huggingface_hub` and `hf-hub` share), so everything works with no network. Downloading a
//! model that is not cached needs the `hub` feature (the `hf-hub` crate); `HF_HUB_OFFLINE=1`
//! forbids it even then, since hf-hub does not read that variable itself.
//!
//! Parameter names are normalised to the layout `transformers` writes today: GPT-2 files that
//! lack the `transformer.` prefix and OPT files that lack `model.` are accepted, attention mask
//! buffers (`attn.bias`, `attn.masked_bias`) are dropped, and a stored `lm_head.weight` must equal
//! the tied embedding it duplicates.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};

use crate::config::ModelConfig;
use crate::{Error, Result};

/// A model found on disk: its config and the directory its files are in.
#[derive(Clone, Debug)]
pub struct Pretrained {
    pub dir: PathBuf,
    pub config: ModelConfig,
}

/// Whether `HF_HUB_OFFLINE` asks for no network (`1`, `true`, `yes`, `on`).
pub fn hub_offline() -> bool {
    std::env::var("HF_HUB_OFFLINE")
        .map(|v| {
            matches!(
                v.trim().to_ascii_lowercase().as_str(),
                "1" | "true" | "yes" | "on"
            )
        })
        .unwrap_or(false)
}

/// The hub cache directory, as `huggingface_hub` computes it.
pub fn hub_cache_dir() -> Option<PathBuf> {
    if let Ok(p) = std::env::var("HF_HUB_CACHE") {
        return Some(PathBuf::from(p));
    }
    if let Ok(p) = std::env::var("HF_HOME") {
        return Some(PathBuf::from(p).join("hub"));
    }
    if let Ok(p) = std::env::var("XDG_CACHE_HOME") {
        return Some(PathBuf::from(p).join("huggingface").join("hub"));
    }
    std::env::var("HOME")
        .ok()
        .map(|h| PathBuf::from(h).join(".cache/huggingface/hub"))
}

/// Resolves `reference` (a directory or `org/name[@revision]`) and reads its config.
pub fn locate(reference: &str) -> Result<Pretrained> {
    let as_path = Path::new(reference);
    let dir = if as_path.is_dir() {
        as_path.to_path_buf()
    } else if looks_like_hub_id(reference) {
        resolve_hub(reference)?
    } else {
        return Err(Error::BadWeights {
            path: as_path.into(),
            reason: "not a directory, and not a hub id of the form org/name[@revision]".into(),
        });
    };
    if !dir.join("config.json").is_file() {
        return Err(Error::BadWeights {
            path: dir,
            reason: "expected a Hugging Face model directory (config.json and \
                     model.safetensors, as `save_pretrained` writes them, e.g. a checkpoint \
                     directory of this project) or a hub id org/name[@revision]; there is no \
                     config.json here"
                .into(),
        });
    }
    let config = ModelConfig::from_hf_json(&dir.join("config.json"))?;
    Ok(Pretrained { dir, config })
}

fn looks_like_hub_id(s: &str) -> bool {
    let id = s.split('@').next().unwrap_or(s);
    let parts: Vec<&str> = id.split('/').collect();
    parts.len() == 2 && parts.iter().all(|p| !p.is_empty() && !p.starts_with('.'))
}

/// Finds a cached snapshot of a hub repo; downloads it with the `hub` feature when allowed.
fn resolve_hub(reference: &str) -> Result<PathBuf> {
    let (id, revision) = match reference.split_once('@') {
        Some((id, rev)) => (id, rev),
        None => (reference, "main"),
    };
    let cache = hub_cache_dir().ok_or_else(|| Error::BadWeights {
        path: reference.into(),
        reason: "cannot find the Hugging Face cache (set HF_HOME or HF_HUB_CACHE)".into(),
    })?;
    if let Some(dir) = cached_snapshot(&cache, id, revision) {
        return Ok(dir);
    }
    download(id, revision, &cache)
}

/// `<cache>/models--org--name/snapshots/<commit>` for `revision` (a ref name or a commit hash),
/// if it holds a `config.json`.
pub fn cached_snapshot(cache: &Path, id: &str, revision: &str) -> Option<PathBuf> {
    let repo = cache.join(format!("models--{}", id.replace('/', "--")));
    let commit = std::fs::read_to_string(repo.join("refs").join(revision))
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| revision.to_string());
    let snap = repo.join("snapshots").join(commit);
    snap.join("config.json").is_file().then_some(snap)
}

#[cfg(feature = "hub")]
fn download(id: &str, revision: &str, cache: &Path) -> Result<PathBuf> {
    let fail = |reason: String| Error::BadWeights {
        path: id.into(),
        reason,
    };
    let offline = hub_offline();
    let client = hf_hub::HFClientBuilder::new()
        .cache_dir(cache)
        .build_sync()
        .map_err(|e| fail(format!("cannot start the hub client: {e}")))?;
    let (owner, name) = id.split_once('/').expect("checked by looks_like_hub_id");
    let repo = client.model(owner, name);
    let mut dir = None;
    for file in ["config.json", "model.safetensors"] {
        let path = repo
            .download_file()
            .filename(file)
            .revision(revision)
            .local_files_only(offline)
            .send()
            .map_err(|e| {
                fail(format!(
                    "cannot fetch {file} (revision {revision}, HF_HUB_OFFLINE={offline}): {e}"
                ))
            })?;
        dir = path.parent().map(Path::to_path_buf);
    }
    dir.ok_or_else(|| fail("the hub returned no path".into()))
}

#[cfg(not(feature = "hub"))]
fn download(id: &str, revision: &str, cache: &Path) -> Result<PathBuf> {
    let why = if hub_offline() {
        "HF_HUB_OFFLINE is set"
    } else {
        "this build has no `hub` feature (rebuild with --features hub to download)"
    };
    Err(Error::BadWeights {
        path: id.into(),
        reason: format!(
            "revision `{revision}` is not in the Hugging Face cache at {} and {why}; \
             or pass a local directory holding config.json and model.safetensors",
            cache.display()
        ),
    })
}

/// Reads every weight file of `dir` and normalises names for `config`.
pub fn load_weights(dir: &Path, config: &ModelConfig) -> Result<HashMap<String, Tensor>> {
    let mut raw = HashMap::new();
    for file in weight_files(dir)? {
        let tensors =
            candle_core::safetensors::load(&file, &Device::Cpu).map_err(|e| Error::BadWeights {
                path: file.clone(),
                reason: format!("not a readable safetensors file (truncated or corrupt?): {e}"),
            })?;
        raw.extend(tensors);
    }
    normalise(raw, config, dir)
}

fn weight_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let single = dir.join("model.safetensors");
    if single.is_file() {
        return Ok(vec![single]);
    }
    let index = dir.join("model.safetensors.index.json");
    if !index.is_file() {
        return Err(Error::BadWeights {
            path: dir.into(),
            reason: "no model.safetensors or model.safetensors.index.json".into(),
        });
    }
    let text = std::fs::read_to_string(&index).map_err(|source| Error::Io {
        path: index.clone(),
        source,
    })?;
    let bad = |reason: String| Error::BadWeights {
        path: index.clone(),
        reason,
    };
    let v: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| bad(format!("not valid JSON: {e}")))?;
    let map = v
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| bad("no `weight_map` object".into()))?;
    let mut files: Vec<String> = map
        .values()
        .map(|f| {
            f.as_str()
                .map(str::to_string)
                .ok_or_else(|| bad("non-string file".into()))
        })
        .collect::<Result<_>>()?;
    files.sort();
    files.dedup();
    for f in &files {
        if f.contains('/') || f.contains("..") {
            return Err(bad(format!("shard name `{f}` leaves the model directory")));
        }
    }
    Ok(files.into_iter().map(|f| dir.join(f)).collect())
}

fn normalise(
    raw: HashMap<String, Tensor>,
    config: &ModelConfig,
    dir: &Path,
) -> Result<HashMap<String, Tensor>> {
    let (prefix, embed) = match config {
        ModelConfig::Gpt(_) => ("transformer.", "transformer.wte.weight"),
        ModelConfig::Opt(_) => ("model.", "model.decoder.embed_tokens.weight"),
    };
    let mut out = HashMap::new();
    let mut lm_head = None;
    for (name, t) in raw {
        if name.ends_with(".attn.bias") || name.ends_with(".attn.masked_bias") {
            continue; // GPT-2 causal-mask buffers, not parameters.
        }
        if name == "lm_head.weight" {
            lm_head = Some(t);
            continue;
        }
        let name = if name.starts_with(prefix) {
            name
        } else {
            format!("{prefix}{name}")
        };
        out.insert(name, t.to_dtype(DType::F32)?);
    }
    if let (Some(head), Some(e)) = (lm_head, out.get(embed)) {
        let same = head.dims() == e.dims()
            && head
                .to_dtype(DType::F32)?
                .sub(e)?
                .abs()?
                .max_all()?
                .to_scalar::<f32>()?
                == 0.0;
        if !same {
            return Err(Error::BadWeights {
                path: dir.into(),
                reason: "lm_head.weight differs from the token embedding, but this model ties them"
                    .into(),
            });
        }
    }
    Ok(out)
}

/// The bytes of the HF `config.json` of `config` (pretty JSON, as [`save_pretrained`] writes
/// it): beside a checkpoint's `model.safetensors` it lets `from_pretrained` load the directory.
pub fn config_json(config: &ModelConfig) -> Vec<u8> {
    serde_json::to_string_pretty(&config.to_hf_json())
        .expect("a JSON value always serialises")
        .into_bytes()
}

/// The file name `transformers` reads a model's config from.
pub const CONFIG_FILE: &str = "config.json";

/// Writes `dir/config.json` for `config` through a temporary name and a rename, so a reader
/// (or a crash) never sees half a file. Beside a checkpoint's `model.safetensors` it makes the
/// checkpoint directory loadable with `from_pretrained(dir)`.
pub fn write_config(dir: &Path, config: &ModelConfig) -> Result<()> {
    let path = dir.join(CONFIG_FILE);
    let tmp = dir.join(format!(".{CONFIG_FILE}.tmp-{}", std::process::id()));
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| Error::Io { path, source }
    };
    let written = std::fs::File::create(&tmp)
        .and_then(|mut f| {
            std::io::Write::write_all(&mut f, &config_json(config))?;
            f.sync_all()
        })
        .map_err(io(&tmp))
        .and_then(|()| std::fs::rename(&tmp, &path).map_err(io(&path)));
    if written.is_err() {
        // Best effort: a stray temporary file is harmless, but do not leave one behind.
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

/// Writes `params` as an HF-layout model directory (`config.json` + `model.safetensors`), e.g.
/// to export a trained model or to make test fixtures.
pub fn save_pretrained(
    dir: &Path,
    config: &ModelConfig,
    params: &HashMap<String, Tensor>,
) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|source| Error::Io {
        path: dir.into(),
        source,
    })?;
    let cfg_path = dir.join("config.json");
    std::fs::write(&cfg_path, config_json(config)).map_err(|source| Error::Io {
        path: cfg_path,
        source,
    })?;
    let weights = dir.join("model.safetensors");
    candle_core::safetensors::save(params, &weights)?;
    Ok(())
}
