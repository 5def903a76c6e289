//! `oobleck data prepare SOURCE... --out DIR`: raw text tokenized with every core into llm.c
//! token shards and a manifest that `train --data DIR` reads (the library part is
//! `oobleck_models::data::prepare`). This file is flags, the progress line and the summary.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use oobleck_models::data::open_tokenizer;
use oobleck_models::data::prepare::{
    self, PrepareOptions, Progress, ReadOptions, Summary, DEFAULT_SHARD_TOKENS, DEFAULT_TEXT_FIELD,
};

/// `oobleck data ...`
#[derive(clap::Subcommand)]
pub enum DataCmd {
    /// Tokenize raw text (.txt, .md, .jsonl, .json, each optionally .gz or .zst; .parquet)
    /// with every core into llm.c token shards plus manifest.json in --out. Run it again after
    /// an interrupt: finished shards are kept and the output is the same as an uninterrupted
    /// run.
    Prepare(PrepareArgs),
    /// List what `train --data RAW` prepared into the shared cache folders ($OOBLECK_CACHE_DIR,
    /// else ~/.cache/oobleck-rs and the temp folder): each preparation's size and whether its
    /// sources are still as they were. --prune removes the stale ones (a source gone or
    /// changed) and unfinished ones nobody is preparing.
    Cache(CacheArgs),
}

#[derive(clap::Args)]
pub struct CacheArgs {
    /// Remove the stale and unfinished preparations (never one in use).
    #[arg(long)]
    pub prune: bool,
}

#[derive(clap::Args)]
pub struct PrepareArgs {
    /// Files, folders (every file below, recursively, sorted by path) or globs, read in this
    /// order. A .txt/.md file is one document; a .jsonl/.json file has one JSON object a line;
    /// a .parquet file has one document a row, in a string column.
    #[arg(required = true)]
    pub sources: Vec<String>,
    /// Output folder: shard-000000.bin, ... and manifest.json.
    #[arg(long)]
    pub out: PathBuf,
    /// Most tokens per shard (a longer document gets a shard of its own). 100 million: llm.c's
    /// FineWeb shard size, 200 MB of u16 tokens.
    #[arg(long, default_value_t = DEFAULT_SHARD_TOKENS)]
    pub shard_tokens: u64,
    /// Tokenizing threads (default: every core). The output does not depend on it.
    #[arg(long)]
    pub workers: Option<usize>,
    /// JSON field holding the text of a JSONL record, or the Parquet column holding it.
    #[arg(long, default_value = DEFAULT_TEXT_FIELD)]
    pub text_field: String,
    /// Skip (and count) JSONL records that are not JSON or lack the text field, and Parquet
    /// rows whose text is null, instead of stopping at the first.
    #[arg(long)]
    pub skip_bad_records: bool,
    /// Tokenizer folder (encoder.json + vocab.bpe, or vocab.json + merges.txt) or
    /// tokenizer.json (default: the shipped GPT-2 tokenizer).
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Print the manifest's totals as JSON on stdout when done.
    #[arg(long)]
    pub json: bool,
}

pub fn run(cmd: &DataCmd) -> Result<()> {
    match cmd {
        DataCmd::Prepare(a) => run_prepare(a),
        DataCmd::Cache(a) => run_cache(a),
    }
}

fn run_cache(args: &CacheArgs) -> Result<()> {
    let places = oobleck_models::data::shared_cache_dirs();
    let entries = prepare::inventory(&places);
    let shown: Vec<String> = places.iter().map(|p| p.display().to_string()).collect();
    println!("prepared data in {}:", shown.join(", "));
    if entries.is_empty() {
        println!("  (none)");
    }
    for e in &entries {
        let state = match &e.state {
            prepare::CacheState::Current => "current".to_string(),
            prepare::CacheState::Stale(why) => format!("stale: {why}"),
            prepare::CacheState::Unfinished => "unfinished".to_string(),
            prepare::CacheState::InUse => "in use (being prepared)".to_string(),
        };
        println!("  {:>10}  {}  {state}", mb(e.bytes), e.dir.display());
    }
    let removable: u64 = entries
        .iter()
        .filter(|e| e.state.removable())
        .map(|e| e.bytes)
        .sum();
    if args.prune {
        let freed = prepare::prune(&entries)?;
        println!(
            "removed the stale and unfinished preparations: {} freed",
            mb(freed)
        );
    } else if removable > 0 {
        println!(
            "{} in stale or unfinished preparations: `oobleck data cache --prune` removes them",
            mb(removable)
        );
    }
    Ok(())
}

fn mb(bytes: u64) -> String {
    format!("{:.1} MB", bytes as f64 / 1e6)
}

fn run_prepare(args: &PrepareArgs) -> Result<()> {
    let tokenizer = open_tokenizer(args.tokenizer.as_deref()).context("loading the tokenizer")?;
    let workers = args
        .workers
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let options = PrepareOptions {
        sources: args.sources.clone(),
        out: args.out.clone(),
        shard_tokens: args.shard_tokens,
        workers,
        read: ReadOptions {
            text_field: args.text_field.clone(),
            skip_bad_records: args.skip_bad_records,
        },
    };
    let mut line = ProgressLine::new();
    let summary = prepare::prepare(&options, &tokenizer, &mut |p: &Progress| line.update(p))
        .with_context(|| format!("preparing {}", args.out.display()))?;
    line.finish();
    report(args, &summary, line.started.elapsed(), workers)
}

fn report(args: &PrepareArgs, s: &Summary, took: Duration, workers: usize) -> Result<()> {
    let t = &s.manifest.totals;
    if s.already_complete {
        eprintln!("{} is already prepared: nothing to do", args.out.display());
    } else if s.kept_shards > 0 {
        eprintln!("kept {} finished shards of an earlier run", s.kept_shards);
    }
    if t.skipped_records > 0 {
        eprintln!(
            "skipped {} bad records (--skip-bad-records)",
            t.skipped_records
        );
    }
    eprintln!(
        "{}: {} shards, {} tokens, {} documents from {} sources ({:.1} MB) in {:.1}s with {} workers",
        args.out.display(),
        t.shards,
        t.tokens,
        t.documents,
        s.manifest.sources.len(),
        t.source_bytes as f64 / 1e6,
        took.as_secs_f64(),
        workers
    );
    if args.json {
        println!(
            "{}",
            serde_json::to_string(t).context("encoding the totals")?
        );
    }
    Ok(())
}

/// The progress on stderr: a bar redrawn at most 4 times a second on a terminal, a plain line
/// every 5 seconds otherwise (logs, pipes).
struct ProgressLine {
    bar: Option<ProgressBar>,
    started: Instant,
    last_plain: Instant,
}

impl ProgressLine {
    fn new() -> Self {
        let bar = std::io::stderr().is_terminal().then(|| {
            let b = ProgressBar::with_draw_target(Some(0), ProgressDrawTarget::stderr_with_hz(4));
            b.set_style(
                ProgressStyle::with_template("[{bar:30}] {msg} eta {eta}")
                    .expect("static template is valid")
                    .progress_chars("=> "),
            );
            b
        });
        let now = Instant::now();
        Self {
            bar,
            started: now,
            last_plain: now,
        }
    }

    fn update(&mut self, p: &Progress) {
        let secs = self.started.elapsed().as_secs_f64().max(1e-3);
        let msg = format!(
            "{:.1}/{:.1} MB read ({:.1} MB/s), {:.0}k tokens/s, {} documents, {} shards",
            p.bytes_read as f64 / 1e6,
            p.bytes_total as f64 / 1e6,
            p.bytes_read as f64 / 1e6 / secs,
            p.tokens as f64 / 1e3 / secs,
            p.documents,
            p.shards
        );
        match &self.bar {
            Some(bar) => {
                bar.set_length(p.bytes_total);
                bar.set_position(p.bytes_read);
                bar.set_message(msg);
            }
            None if self.last_plain.elapsed() >= Duration::from_secs(5) => {
                self.last_plain = Instant::now();
                eprintln!("{msg}");
            }
            None => {}
        }
    }

    fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}
