//! Tokenization throughput: ours against `tiktoken` and Hugging Face `tokenizers` on the same
//! documents and threads (`bin/benches/tokenize_bench.py` runs the Python side).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use oobleck_models::data::{default_datasets_dir, Gpt2Tokenizer, EMBEDDED_CORPUS};
use rayon::prelude::*;
use serde::Serialize;

use super::super::child::run_captured;
use super::BenchDataArgs;

/// A document is whole paragraphs of the corpus, at least this many bytes (web documents of
/// FineWeb are a few KB).
const DOCUMENT_BYTES: usize = 4000;

/// One tokenizer on one thread count.
#[derive(Debug, Clone, Serialize)]
pub struct Throughput {
    pub who: String,
    pub threads: usize,
    /// MB (10^6 bytes) of UTF-8 text per second; `None` when the tokenizer did not run.
    pub mb_per_s: Option<f64>,
    pub tokens: u64,
    pub checksum: String,
    /// Why it did not run, or that its ids differ from ours.
    pub note: String,
}

/// Writes the documents as JSONL for the Python side and times every tokenizer on 1 and on
/// `threads` threads.
pub fn run(a: &BenchDataArgs, threads: usize, scratch: &Path) -> Result<Vec<Throughput>> {
    let docs = documents(a.text_mb * 1_000_000);
    let path = scratch.join("docs.jsonl");
    let mut jsonl = String::new();
    for d in &docs {
        jsonl.push_str(&serde_json::json!({ "text": d }).to_string());
        jsonl.push('\n');
    }
    std::fs::write(&path, jsonl).with_context(|| format!("writing {}", path.display()))?;
    let bytes: usize = docs.iter().map(String::len).sum();
    eprintln!(
        "bench data: tokenizing {} documents, {:.1} MB",
        docs.len(),
        bytes as f64 / 1e6
    );
    let counts: Vec<usize> = if threads > 1 {
        vec![1, threads]
    } else {
        vec![1]
    };
    let mut rows = Vec::new();
    for &t in &counts {
        rows.push(ours(&docs, bytes, t)?);
    }
    for which in ["tiktoken", "hf"] {
        for &t in &counts {
            rows.push(python(a, which, &path, t)?);
        }
    }
    let reference = rows[0].checksum.clone();
    for row in rows.iter_mut().filter(|r| r.mb_per_s.is_some()) {
        if row.checksum != reference {
            row.note = format!("ids differ from ours (checksum {})", row.checksum);
        }
    }
    Ok(rows)
}

/// The shipped corpus, repeated to at least `bytes`, as documents of whole paragraphs.
fn documents(bytes: usize) -> Vec<String> {
    let mut docs = Vec::new();
    let (mut total, mut doc) = (0, String::new());
    while total < bytes {
        for paragraph in EMBEDDED_CORPUS.split("\n\n") {
            doc.push_str(paragraph);
            doc.push_str("\n\n");
            if doc.len() >= DOCUMENT_BYTES {
                total += doc.len();
                docs.push(std::mem::take(&mut doc));
                if total >= bytes {
                    break;
                }
            }
        }
    }
    docs
}

/// Ours: a fresh tokenizer (no warm cache), one document per task on a pool of `threads`.
fn ours(docs: &[String], bytes: usize, threads: usize) -> Result<Throughput> {
    let tok = Gpt2Tokenizer::embedded();
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .context("starting the tokenizing threads")?;
    let t0 = Instant::now();
    let ids: Vec<Vec<u32>> = pool.install(|| {
        docs.par_iter()
            .map(|d| tok.encode(d))
            .collect::<std::result::Result<_, _>>()
    })?;
    let seconds = t0.elapsed().as_secs_f64();
    let (checksum, tokens) = checksum(&ids);
    Ok(Throughput {
        who: "ours (GPT-2 BPE of oobleck-models, data prepare's path)".into(),
        threads,
        mb_per_s: Some(bytes as f64 / 1e6 / seconds),
        tokens,
        checksum,
        note: String::new(),
    })
}

/// The wrapping sum over documents of `(index + 1) * sum(ids)`, and the token count: the
/// Python side computes the same.
fn checksum(ids: &[Vec<u32>]) -> (String, u64) {
    let mut total = 0u64;
    for (i, doc) in ids.iter().enumerate() {
        let sum = doc.iter().fold(0u64, |s, &t| s.wrapping_add(u64::from(t)));
        total = total.wrapping_add((i as u64 + 1).wrapping_mul(sum));
    }
    let tokens = ids.iter().map(|d| d.len() as u64).sum();
    (format!("{total:016x}"), tokens)
}

fn python(a: &BenchDataArgs, which: &str, docs: &Path, threads: usize) -> Result<Throughput> {
    let who = match which {
        "tiktoken" => "tiktoken (Python, encode_ordinary_batch)",
        _ => "HF tokenizers (Python, encode_batch)",
    };
    let unavailable = |why: String| Throughput {
        who: who.into(),
        threads,
        mb_per_s: None,
        tokens: 0,
        checksum: String::new(),
        note: why,
    };
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("benches/tokenize_bench.py");
    if !script.is_file() {
        return Ok(unavailable(format!("{} not found", script.display())));
    }
    let mut cmd = Command::new(&a.python);
    cmd.arg(&script)
        .args(["--which", which, "--threads", &threads.to_string()])
        .arg("--docs")
        .arg(docs)
        .arg("--tokenizer-dir")
        .arg(default_datasets_dir().join("gpt2-tokenizer"));
    let out = match run_captured(&mut cmd, Duration::from_secs(a.timeout_s)) {
        Ok(Some(ran)) if ran.status.success() => ran.stdout,
        Ok(Some(ran)) => {
            let why = ran.stderr.lines().last().unwrap_or_default().to_string();
            return Ok(unavailable(format!("{}: {why}", ran.status)));
        }
        Ok(None) => return Ok(unavailable(format!("{} not found (--python)", a.python))),
        Err(e) => return Ok(unavailable(format!("{e:#}"))),
    };
    let line = out.lines().last().unwrap_or_default();
    let v: serde_json::Value =
        serde_json::from_str(line).with_context(|| format!("{which}: not JSON: {out}"))?;
    if let Some(why) = v["unavailable"].as_str() {
        return Ok(unavailable(why.to_string()));
    }
    let num = |k: &str| {
        v[k].as_f64()
            .with_context(|| format!("{which}: no {k} in {line}"))
    };
    Ok(Throughput {
        who: who.into(),
        threads,
        mb_per_s: Some(num("bytes")? / 1e6 / num("seconds")?),
        tokens: num("tokens")? as u64,
        checksum: v["checksum"].as_str().unwrap_or_default().to_string(),
        note: String::new(),
    })
}
