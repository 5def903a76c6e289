//! `oobleck bench data`: the data path against its targets, side by side in one run (issue 42).
//!
//! - **Tokenization** ([`tokenize`]): MB/s of GPT-2 tokenization of the same documents by ours
//!   (the tokenizer `oobleck data prepare` runs, one document per task on a pool of N threads)
//!   on 1 core and on all, and by Hugging Face `tokenizers` (batch encode) and `tiktoken`
//!   (`encode_ordinary_batch`) from Python on the same threads, all built from the shipped
//!   `datasets/gpt2-tokenizer/` files; a checksum of the ids shows they agree. Target: at
//!   least tiktoken's speed per core, and >= 1.8x from 1 to 2 cores.
//! - **Loader** ([`loader`]): the time to produce a step's microbatches of the default run as
//!   a share of its step (target < 1 %).
//! - **Memory** ([`memory`]): peak RSS of `train --nodes 1 --steps 5` on prepared corpora of
//!   100 MB and 5 GB (generated llm.c shards); target: under 64 MB apart.

mod loader;
mod memory;
mod table;
mod tokenize;

use std::path::PathBuf;

use anyhow::{Context, Result};
use serde::Serialize;

use super::child::{binary, Reaper, Scratch};

#[derive(clap::Args, Debug, Clone)]
pub struct BenchDataArgs {
    /// Megabytes of text to tokenize (the shipped corpus repeated, cut into documents).
    #[arg(long, default_value_t = 20)]
    pub text_mb: usize,
    /// Threads of the "all cores" runs [default: every core].
    #[arg(long)]
    pub threads: Option<usize>,
    /// Python with `tiktoken` and `tokenizers` installed (`pip install tiktoken tokenizers`);
    /// a comparator that is missing is reported, not fatal.
    #[arg(long, default_value = "python3")]
    pub python: String,
    /// Sizes of the generated corpora of the memory runs, megabytes of u16 tokens.
    #[arg(long, value_delimiter = ',', default_value = "100,5000")]
    pub memory_mb: Vec<u64>,
    /// Steps of the default run timed for the loader's share.
    #[arg(long, default_value_t = 12)]
    pub steps: u64,
    /// The `train` binary [default: the one beside this `oobleck`].
    #[arg(long)]
    pub train_bin: Option<PathBuf>,
    /// Bound of each child process, seconds.
    #[arg(long, default_value_t = 900)]
    pub timeout_s: u64,
    /// Where the scratch directory goes (the 5 GB corpus too) [default: the system temp
    /// directory].
    #[arg(long)]
    pub scratch: Option<PathBuf>,
    /// Keep the scratch directory.
    #[arg(long)]
    pub keep: bool,
    /// Also write the numbers as JSON to FILE.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// Everything the table shows.
#[derive(Debug, Serialize)]
pub struct Report {
    pub cores: usize,
    pub tokenize: Vec<tokenize::Throughput>,
    pub loader: Vec<loader::LoaderCost>,
    pub memory: Vec<memory::PeakRss>,
}

/// Runs the three parts and prints the table.
pub fn run(a: &BenchDataArgs) -> Result<()> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = a.threads.unwrap_or(cores).max(1);
    let train = binary("train", a.train_bin.as_deref())?;
    let reaper = Reaper::install()?;
    let scratch = Scratch::create("data", a.scratch.as_deref(), a.keep)?;
    eprintln!("bench data: scratch {}", scratch.root.display());

    let tokenize = tokenize::run(a, threads, &scratch.root)?;
    let corpora = memory::generate_all(&a.memory_mb, &scratch.root)?;
    let loader = loader::run(a, &train, &reaper, &scratch.root, &corpora)?;
    let memory = memory::run(a, &train, &reaper, &scratch.root, &corpora)?;
    let report = Report {
        cores,
        tokenize,
        loader,
        memory,
    };
    print!("{}", table::render(&report));
    if let Some(path) = &a.json {
        let text = serde_json::to_string_pretty(&report)?;
        std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}
