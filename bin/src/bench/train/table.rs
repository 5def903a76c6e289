//! The table `oobleck bench train` prints.

use super::{BenchTrainArgs, FrameworkResult, Report, TorchOutcome};

fn mib(b: Option<u64>) -> String {
    b.map_or("n/a".into(), |b| {
        format!("{:.0} MiB", b as f64 / (1 << 20) as f64)
    })
}

pub(super) fn print_table(r: &Report, args: &BenchTrainArgs) {
    let s = &r.shape;
    println!(
        "GPT {} layers, hidden {}, {} heads, seq {}, microbatch {}, vocab {} ({} params); \
         {} warm-up + {} timed steps, {} threads",
        s.layers,
        s.hidden,
        s.heads,
        s.seq_len,
        s.batch,
        s.vocab,
        s.gpt_config().num_params(),
        args.warmup,
        args.steps,
        r.candle.threads
    );
    println!(
        "{:<26} {:>10} {:>9} {:>9} {:>9} {:>9} {:>11} {:>11}",
        "framework", "tokens/s", "step s", "fwd s", "bwd s", "opt s", "peak RSS", "base RSS"
    );
    let row = |f: &FrameworkResult| {
        println!(
            "{:<26} {:>10.1} {:>9.3} {:>9.3} {:>9.3} {:>9.3} {:>11} {:>11}",
            f.framework,
            f.tokens_per_s,
            f.step_s,
            f.forward_s,
            f.backward_s,
            f.optimizer_s,
            mib(f.peak_rss_bytes),
            mib(f.base_rss_bytes)
        )
    };
    row(&r.candle);
    match &r.torch {
        TorchOutcome::Measured(t) => row(t),
        TorchOutcome::Unavailable { unavailable } => {
            println!("{:<26} n/a ({unavailable})", "torch")
        }
    }
    for v in &r.variants {
        row(v);
    }
    match r.ratio_candle_over_torch {
        Some(x) => println!("ratio candle/torch (tokens/s): {x:.2}"),
        None => println!("ratio candle/torch (tokens/s): n/a"),
    }
    if r.rounds.len() > 1 {
        println!("(medians of {} alternated rounds)", r.rounds.len());
        for (i, x) in r.rounds.iter().enumerate() {
            let t = x
                .torch_tokens_per_s
                .map_or("n/a".into(), |t| format!("{t:.1}"));
            let q = x.ratio.map_or("n/a".into(), |q| format!("{q:.2}"));
            println!(
                "  round {}: candle {:.1} tokens/s, torch {t}, ratio {q}",
                i + 1,
                x.candle_tokens_per_s
            );
        }
    }
    print_variants(r);
    let e = &r.estimate;
    println!(
        "memory estimate: {} = params {} + grads {} + Adam {} + activations {}",
        mib(Some(e.total)),
        mib(Some(e.params)),
        mib(Some(e.grads)),
        mib(Some(e.adam)),
        mib(Some(e.activations))
    );
}

/// Each `--variants` run against fp32: speed, and the memory its steps added.
fn print_variants(r: &Report) {
    for v in &r.variants {
        let speed = v.tokens_per_s / r.candle.tokens_per_s;
        // Each variant runs in this process after the others: compare what its steps added
        // above the memory it started with.
        let grown = |f: &FrameworkResult| Some(f.peak_rss_bytes? as f64 - f.base_rss_bytes? as f64);
        let peak = match (grown(v), grown(&r.candle)) {
            (Some(a), Some(b)) => format!(
                ", peak RSS above its start {:.0} MiB against {:.0} MiB",
                a / f64::from(1 << 20),
                b / f64::from(1 << 20)
            ),
            _ => String::new(),
        };
        println!(
            "{} against fp32: {speed:.2}x the tokens/s{peak}",
            v.framework
        );
    }
}
