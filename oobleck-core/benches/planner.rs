//! Planner speed and memory, printed as one table: templates for 96 layers (n = 1..64,
//! G = 1 and 8), instantiation and one reconfiguration decision (3 nodes lost, 2 joined) at
//! 1,000 and 10,000 nodes with the global batch `B` in `{N/4, N, 4N, 16N}` microbatches.
//!
//! `cargo bench -p oobleck-core --bench planner` (`-- --quick` for one run per row, `-- TEXT`
//! for the rows whose label contains TEXT).
//! Time is the median of repeated runs (at least 3, up to about 1 s per row); memory is the
//! peak of heap bytes allocated during one run, counted by this binary's allocator.
//! Targets (2-core machine): the 96-layer template set < 10 ms; instantiation < 50 ms and
//! < 50 MB at 10,000 nodes for every `B` here; a reconfiguration decision < 10 ms.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use oobleck_core::planning::{
    analytical_profile, generate_templates, gradient_sync_ns, instantiate_with_sizes, DeviceSpec,
    Dtype, JobSpec, ModelProfile, TemplateMicrobatches, TransformerShape,
};
use oobleck_core::reconfig::decide;

/// Counts live heap bytes and their peak.
struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            let now = LIVE.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
            PEAK.fetch_max(now, Ordering::Relaxed);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// GPT-3 175B has 96 blocks (98 planner layers); a 94-block model gives exactly 96 layers.
const SHAPE_96: TransformerShape = TransformerShape::gpt(94, 4096, 32, 50257, 2048);
const SHAPE_6_7B: TransformerShape = TransformerShape::gpt(32, 4096, 32, 50257, 2048);

fn job(f: u32, global: u32) -> JobSpec {
    JobSpec {
        fault_threshold: f,
        microbatch_size: 1,
        global_microbatches: global,
        state_bytes_per_param_byte: 8,
        template_microbatches: TemplateMicrobatches::Auto,
    }
}

/// Command-line choices.
struct Opts {
    quick: bool,
    only: Option<String>,
}

impl Opts {
    fn wants(&self, what: &str) -> bool {
        self.only.as_ref().is_none_or(|o| what.contains(o.as_str()))
    }
}

/// Measures `f` as row `what` unless the filter leaves it out.
fn row<T>(opts: &Opts, rows: &mut Vec<Row>, what: String, target_ms: f64, f: impl FnMut() -> T) {
    if !opts.wants(&what) {
        return;
    }
    let (time, peak) = measure(opts.quick, f);
    rows.push(Row {
        what,
        time,
        peak,
        target_ms,
    });
}

/// Median wall time and peak heap bytes of `f` (run at least 3 times, up to about 1 s).
fn measure<T>(quick: bool, mut f: impl FnMut() -> T) -> (Duration, usize) {
    let mut times = Vec::new();
    let started = Instant::now();
    let mut peak = 0;
    loop {
        let base = LIVE.load(Ordering::Relaxed);
        PEAK.store(base, Ordering::Relaxed);
        let t = Instant::now();
        let out = f();
        times.push(t.elapsed());
        peak = peak.max(PEAK.load(Ordering::Relaxed) - base);
        drop(out);
        let enough = times.len() >= 3 && started.elapsed() > Duration::from_secs(1);
        if quick || enough || times.len() >= 50 {
            break;
        }
    }
    times.sort();
    (times[times.len() / 2], peak)
}

struct Row {
    what: String,
    time: Duration,
    peak: usize,
    target_ms: f64,
}

fn print(rows: &[Row]) {
    println!(
        "\n{:<46} {:>11} {:>11} {:>10}  verdict",
        "planner step", "time ms", "peak MB", "target ms"
    );
    for r in rows {
        let ms = r.time.as_secs_f64() * 1e3;
        let verdict = match r.target_ms {
            t if !t.is_finite() => "",
            t if ms < t => "ok",
            _ => "SLOW",
        };
        let target = if r.target_ms.is_finite() {
            r.target_ms.to_string()
        } else {
            "-".into()
        };
        println!(
            "{:<46} {:>11.3} {:>11.2} {:>10}  {verdict}",
            r.what,
            ms,
            r.peak as f64 / 1e6,
            target
        );
    }
}

fn templates(opts: &Opts, rows: &mut Vec<Row>) {
    let dev = DeviceSpec::named("h200-141gb").expect("device");
    for g in [1u32, 8] {
        let profile = analytical_profile("bench-96", &SHAPE_96, dev, 1, Dtype::Bf16);
        let cluster = dev.cluster(g);
        // f = 0 and N = 64: templates for every n in [n0, 64].
        let j = job(0, 256);
        let what = format!("templates 96 layers, n = n0..64, G = {g}");
        row(opts, rows, what, 10.0, || {
            generate_templates(&profile, &cluster, &j, 64).expect("templates")
        });
    }
}

/// How the template set's cost grows with layers, node count and `G` (no target).
fn template_growth(opts: &Opts, rows: &mut Vec<Row>) {
    let dev = DeviceSpec::named("h200-141gb").expect("device");
    let cases = [
        (46, 64, 8),
        (190, 64, 8),
        (94, 32, 8),
        (94, 128, 8),
        (94, 64, 2),
        (94, 64, 4),
    ];
    for (blocks, n, g) in cases {
        let shape = TransformerShape::gpt(blocks, 4096, 32, 50257, 2048);
        let profile = analytical_profile("growth", &shape, dev, 1, Dtype::Bf16);
        let cluster = dev.cluster(g);
        let j = job(0, 4 * n);
        let what = format!("  templates {} layers, n = n0..{n}, G = {g}", blocks + 2);
        row(opts, rows, what, f64::INFINITY, || {
            generate_templates(&profile, &cluster, &j, n).expect("templates")
        });
    }
}

fn profile_6_7b() -> (ModelProfile, &'static DeviceSpec) {
    let dev = DeviceSpec::named("a100-80gb").expect("device");
    let profile = analytical_profile("gpt3-6.7b", &SHAPE_6_7B, dev, 1, Dtype::Bf16);
    (profile, dev)
}

fn at_scale(opts: &Opts, rows: &mut Vec<Row>) {
    let (profile, dev) = profile_6_7b();
    let cluster = dev.cluster(8);
    let sync = gradient_sync_ns(&profile, &cluster);
    for n in [1_000u32, 10_000] {
        for (label, global) in [("N/4", n / 4), ("N", n), ("4N", 4 * n), ("16N", 16 * n)] {
            let j = job(3, global);
            let set = generate_templates(&profile, &cluster, &j, n).expect("templates");
            let nodes: Vec<u32> = (0..n).collect();
            let what = format!("instantiate N = {n}, B = {label} = {global}");
            row(opts, rows, what, 50.0, || {
                instantiate_with_sizes(&set, &j, 8, sync, &nodes, 0).expect("plan")
            });
            let plan = instantiate_with_sizes(&set, &j, 8, sync, &nodes, 0).expect("plan");
            let lost = [5, n / 2 + 17, n - 1];
            let what = format!("  decide: lose 3 of {n}, B = {label}");
            row(opts, rows, what, 10.0, || {
                decide(&plan, &lost, &[]).expect("loss")
            });
            let joined = [n, n + 1];
            let what = format!("  decide: 2 join {n}, B = {label}");
            row(opts, rows, what, 10.0, || {
                decide(&plan, &[], &joined).expect("join")
            });
        }
    }
}

fn main() {
    // `cargo bench` passes `--bench`; `-- --quick` runs each row once, `-- TEXT` filters.
    let args: Vec<String> = std::env::args().skip(1).collect();
    let opts = Opts {
        quick: args.iter().any(|a| a == "--quick"),
        only: args.iter().find(|a| !a.starts_with("--")).cloned(),
    };
    let mut rows = Vec::new();
    templates(&opts, &mut rows);
    template_growth(&opts, &mut rows);
    at_scale(&opts, &mut rows);
    print(&rows);
}
