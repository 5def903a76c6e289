//! Peak memory of a short run on prepared corpora of different sizes: llm.c shards (what
//! `oobleck data prepare` writes) generated here, `train --nodes 1 --steps 5 --data DIR` on
//! each, its peak resident memory (`VmHWM`) read while it runs.

use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use oobleck_core::runtime::wire::records::splitmix64;
use serde::Serialize;

use super::super::child::{Reaper, TrainProcess};
use super::BenchDataArgs;

/// Tokens per generated shard (`data prepare`'s default is 100M).
const SHARD_TOKENS: u64 = 100_000_000;
/// Ids drawn below this (all GPT-2 ids but the end-of-text one).
const IDS: u64 = 50_256;
const END_OF_TEXT: u16 = 50_256;
/// Steps of each memory run.
pub const MEMORY_STEPS: u64 = 5;

/// A generated corpus.
#[derive(Debug, Clone, Serialize)]
pub struct Corpus {
    pub megabytes: u64,
    pub dir: PathBuf,
    pub tokens: u64,
}

/// One run's peak.
#[derive(Debug, Clone, Serialize)]
pub struct PeakRss {
    /// The corpus, or `None` for the shipped one.
    pub megabytes: Option<u64>,
    pub tokens: u64,
    pub peak_rss_mb: f64,
    pub wall_s: f64,
}

/// One corpus per size in `sizes` (megabytes of u16 tokens) under `scratch`.
pub fn generate_all(sizes: &[u64], scratch: &Path) -> Result<Vec<Corpus>> {
    sizes.iter().map(|&mb| generate(mb, scratch)).collect()
}

/// `mb` megabytes of seeded ids in documents of 64 to 2,047 ids, each after an end-of-text
/// id, in llm.c u16 shards of at most [`SHARD_TOKENS`].
fn generate(mb: u64, scratch: &Path) -> Result<Corpus> {
    let dir = scratch.join(format!("corpus-{mb}MB"));
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let tokens = mb * 1_000_000 / 2;
    eprintln!(
        "bench data: writing {mb} MB of token shards to {}",
        dir.display()
    );
    let mut rng = 0x5eed_u64 ^ mb;
    let mut left_in_doc = 0u64;
    let (mut written, mut shard) = (0u64, 0);
    while written < tokens {
        let n = SHARD_TOKENS.min(tokens - written);
        let path = dir.join(format!("gen_{shard:06}.bin"));
        let file =
            std::fs::File::create(&path).with_context(|| format!("creating {}", path.display()))?;
        let mut out = BufWriter::with_capacity(1 << 20, file);
        let mut header = [0u8; 1024];
        header[0..4].copy_from_slice(&20240520i32.to_le_bytes());
        header[4..8].copy_from_slice(&1i32.to_le_bytes());
        header[8..12].copy_from_slice(&(n as i32).to_le_bytes());
        let written_to = || {
            format!("writing {} (the corpora need --memory-mb of free space; --scratch puts them elsewhere)", path.display())
        };
        out.write_all(&header).with_context(written_to)?;
        for _ in 0..n {
            let id = if left_in_doc == 0 {
                left_in_doc = 64 + splitmix(&mut rng) % 1984;
                END_OF_TEXT
            } else {
                left_in_doc -= 1;
                (splitmix(&mut rng) % IDS) as u16
            };
            out.write_all(&id.to_le_bytes()).with_context(written_to)?;
        }
        out.flush().with_context(written_to)?;
        written += n;
        shard += 1;
    }
    Ok(Corpus {
        megabytes: mb,
        dir,
        tokens,
    })
}

/// The next output of the SplitMix64 generator at `state`.
fn splitmix(state: &mut u64) -> u64 {
    let out = splitmix64(*state);
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    out
}

/// `train --nodes 1 --steps 5` on the shipped corpus and on each of `corpora`.
pub fn run(
    a: &BenchDataArgs,
    train: &Path,
    reaper: &Reaper,
    scratch: &Path,
    corpora: &[Corpus],
) -> Result<Vec<PeakRss>> {
    let mut rows = vec![measure(a, train, reaper, scratch, None)?];
    for corpus in corpora {
        rows.push(measure(a, train, reaper, scratch, Some(corpus))?);
    }
    Ok(rows)
}

fn measure(
    a: &BenchDataArgs,
    train: &Path,
    reaper: &Reaper,
    scratch: &Path,
    corpus: Option<&Corpus>,
) -> Result<PeakRss> {
    let name = corpus.map_or("shipped".to_string(), |c| format!("{}MB", c.megabytes));
    let out = scratch.join(format!("memory-{name}"));
    let mut args = vec![
        "--nodes".to_string(),
        "1".into(),
        "--steps".into(),
        MEMORY_STEPS.to_string(),
        "--out".into(),
        out.display().to_string(),
    ];
    if let Some(c) = corpus {
        args.extend(["--data".to_string(), c.dir.display().to_string()]);
    }
    eprintln!("bench data: {} {}", train.display(), args.join(" "));
    let log = scratch.join(format!("memory-{name}.log"));
    let child = TrainProcess::spawn(reaper, train, &args, &log)?;
    let (exit, peak) = child.wait_peak_rss(Duration::from_secs(a.timeout_s))?;
    if !exit.status.success() {
        let err = std::fs::read_to_string(log.with_extension("stderr")).unwrap_or_default();
        bail!("{name} run failed ({}): {}", exit.status, tail(&err));
    }
    Ok(PeakRss {
        megabytes: corpus.map(|c| c.megabytes),
        tokens: corpus.map_or(0, |c| c.tokens),
        peak_rss_mb: peak as f64 / (1 << 20) as f64,
        wall_s: exit.wall_s,
    })
}

fn tail(text: &str) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(5)..].join("\n")
}
