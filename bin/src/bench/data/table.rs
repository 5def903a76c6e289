//! The one table `oobleck bench data` prints, with each target beside its number.

use std::fmt::Write;

use super::Report;

/// Tokenization: at least tiktoken's MB/s per core.
pub const TARGET_VS_TIKTOKEN: f64 = 1.0;
/// Tokenization: speed-up from 1 to 2 cores at least this.
pub const TARGET_SCALING_2: f64 = 1.8;
/// Loader: under this share of the step, percent.
pub const TARGET_LOADER_PCT: f64 = 1.0;
/// Memory: peak RSS of the smallest and the largest corpus at most this far apart, MB.
pub const TARGET_RSS_MB: f64 = 64.0;

pub fn render(r: &Report) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "\n# oobleck bench data ({} cores)\n", r.cores);
    tokenize(&mut s, r);
    loader(&mut s, r);
    memory(&mut s, r);
    s
}

fn mb_per_s(r: &Report, who: &str, threads: usize) -> Option<f64> {
    r.tokenize
        .iter()
        .find(|t| t.who.starts_with(who) && t.threads == threads)
        .and_then(|t| t.mb_per_s)
}

fn tokenize(s: &mut String, r: &Report) {
    let _ = writeln!(s, "## Tokenization (GPT-2, same documents and threads)\n");
    let _ = writeln!(s, "| tokenizer | threads | MB/s | tokens | note |");
    let _ = writeln!(s, "|---|---|---|---|---|");
    for t in &r.tokenize {
        let speed = t.mb_per_s.map_or("n/a".into(), |v| format!("{v:.2}"));
        let _ = writeln!(
            s,
            "| {} | {} | {speed} | {} | {} |",
            t.who, t.threads, t.tokens, t.note
        );
    }
    let (ours1, tik1) = (mb_per_s(r, "ours", 1), mb_per_s(r, "tiktoken", 1));
    if let (Some(o), Some(t)) = (ours1, tik1) {
        let ratio = o / t;
        let _ = writeln!(
            s,
            "\nours / tiktoken on 1 core: {ratio:.2}x (target >= {TARGET_VS_TIKTOKEN:.1}x: {})",
            verdict(ratio >= TARGET_VS_TIKTOKEN)
        );
    }
    let many = r.tokenize.iter().map(|t| t.threads).max().unwrap_or(1);
    if let (Some(o1), Some(on)) = (ours1, mb_per_s(r, "ours", many)) {
        let scaling = on / o1;
        let target = if many >= 2 { TARGET_SCALING_2 } else { 1.0 };
        let _ = writeln!(
            s,
            "ours on {many} threads / on 1: {scaling:.2}x (target >= {target:.1}x on 2 cores: {})",
            verdict(scaling >= target)
        );
    }
}

fn corpus(megabytes: Option<u64>) -> String {
    megabytes.map_or("shipped (5 MB text)".into(), |mb| format!("{mb} MB shards"))
}

fn loader(s: &mut String, r: &Report) {
    let _ = writeln!(
        s,
        "\n## Loader: a step's microbatches against the default run's step\n"
    );
    let _ = writeln!(
        s,
        "| corpus | microbatches | loader ms/step | step ms | share |"
    );
    let _ = writeln!(s, "|---|---|---|---|---|");
    for l in &r.loader {
        let _ = writeln!(
            s,
            "| {} | {} | {:.3} | {:.1} | {:.3} % ({}) |",
            corpus(l.megabytes),
            l.microbatches_per_step,
            l.loader_ms_per_step,
            l.step_ms,
            l.share_pct,
            verdict(l.share_pct < TARGET_LOADER_PCT)
        );
    }
}

fn memory(s: &mut String, r: &Report) {
    let _ = writeln!(s, "\n## Memory: peak RSS of `train --nodes 1 --steps 5`\n");
    let _ = writeln!(s, "| corpus | tokens | peak RSS MB | wall s |");
    let _ = writeln!(s, "|---|---|---|---|");
    for m in &r.memory {
        let _ = writeln!(
            s,
            "| {} | {} | {:.1} | {:.1} |",
            corpus(m.megabytes),
            m.tokens,
            m.peak_rss_mb,
            m.wall_s
        );
    }
    let sized: Vec<_> = r.memory.iter().filter(|m| m.megabytes.is_some()).collect();
    if let [small, .., large] = sized[..] {
        let diff = large.peak_rss_mb - small.peak_rss_mb;
        let _ = writeln!(
            s,
            "\n{} MB vs {} MB: {diff:+.1} MB (target under {TARGET_RSS_MB:.0} MB: {})",
            large.megabytes.unwrap_or(0),
            small.megabytes.unwrap_or(0),
            verdict(diff.abs() < TARGET_RSS_MB)
        );
    }
}

fn verdict(met: bool) -> &'static str {
    if met {
        "met"
    } else {
        "NOT met"
    }
}
