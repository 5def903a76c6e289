//! Activation recomputation on a GPT: the same loss and gradients as the layered pass, with
//! dropout on everywhere, and a lower peak of live heap memory while several microbatches are
//! in flight (forwards first, then the backwards, as a 1F1B stage holds them). The peak is
//! measured by a counting global allocator in this test binary; the tests take a lock so one
//! measurement never sees another test's allocations.

use std::alloc::{GlobalAlloc, Layout, System};
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use candle_core::{DType, Device, Tensor};
use oobleck_core::model::{accumulate, DropoutKey, ForwardCtx, ParamSource, Stage, StageForward};
use oobleck_models::ModelConfig;

/// Counts live heap bytes and their peak.
struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded unchanged to the system allocator.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            let now = LIVE.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
            PEAK.fetch_max(now, Ordering::Relaxed);
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `alloc` above with this layout.
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// One test at a time: the counters are global.
static SERIAL: Mutex<()> = Mutex::new(());

const MICROBATCHES: u64 = 3;
const B: usize = 2;
const T: usize = 32;

/// gpt-tiny (2 blocks of width 64) with a small vocabulary, so the test runs in a moment, and
/// every dropout on (the presets have none), so the recomputed masks are checked too.
fn stage() -> Stage {
    let ModelConfig::Gpt(mut c) = ModelConfig::preset("gpt-tiny").unwrap() else {
        unreachable!("gpt-tiny is a GPT preset");
    };
    c.vocab_size = 512;
    (c.resid_pdrop, c.embd_pdrop, c.attn_pdrop) = (0.1, 0.1, 0.1);
    let cfg = ModelConfig::Gpt(c);
    let model = cfg.build().unwrap();
    let layers = model
        .build_layers(
            0..model.num_layers(),
            &Device::Cpu,
            ParamSource::Init { seed: 4 },
        )
        .unwrap();
    Stage::new(layers).unwrap()
}

/// Token ids and next-token targets of microbatch `mb`, `[B, T]` each.
fn batch(mb: u64) -> (Tensor, Tensor) {
    let ids: Vec<u32> = (0..B * (T + 1))
        .map(|i| ((i as u64 * 131 + mb * 977) % 512) as u32)
        .collect();
    let all = Tensor::from_vec(ids, (B, T + 1), &Device::Cpu).unwrap();
    (all.narrow(1, 0, T).unwrap(), all.narrow(1, 1, T).unwrap())
}

fn ctx(targets: &Tensor, mb: u64) -> ForwardCtx<'_> {
    ForwardCtx {
        targets: Some(targets),
        loss_scale: 1.0 / MICROBATCHES as f64,
        train: true,
        dropout_key: DropoutKey {
            seed: 11,
            iteration: 1,
            microbatch: mb,
        },
        ..ForwardCtx::inference()
    }
}

#[derive(Clone, Copy, Debug)]
enum Pass {
    Graph,
    Layered,
    Recompute,
}

/// Every microbatch forward (all held, as the first stage of a deep 1F1B pipeline holds them),
/// then every backward: the losses, the gradients summed over microbatches and by name, and
/// the peak of live heap bytes above what was live before the first forward.
fn run(stage: &Stage, pass: Pass) -> (Vec<f32>, HashMap<String, Tensor>, usize) {
    let batches: Vec<(Tensor, Tensor)> = (0..MICROBATCHES).map(batch).collect();
    let base = LIVE.load(Ordering::Relaxed);
    PEAK.store(base, Ordering::Relaxed);
    let mut held: Vec<StageForward> = Vec::new();
    let mut losses = Vec::new();
    for (mb, (x, tg)) in batches.iter().enumerate() {
        let c = ctx(tg, mb as u64);
        let fwd = match pass {
            Pass::Graph => stage.forward(x, &c),
            Pass::Layered => stage.forward_layered(x, &c),
            Pass::Recompute => stage.forward_recompute(x, &c),
        }
        .unwrap();
        losses.push(fwd.output.to_scalar::<f32>().unwrap());
        held.push(fwd);
    }
    let mut grads = HashMap::new();
    for fwd in held {
        let g = stage.backward(fwd, None).unwrap();
        assert!(g.input.is_none(), "the first stage has no input gradient");
        accumulate(&mut grads, g.params).unwrap();
    }
    let peak = PEAK.load(Ordering::Relaxed) - base;
    (losses, grads, peak)
}

fn max_rel_diff(a: &Tensor, b: &Tensor) -> f32 {
    let flat = |t: &Tensor| {
        t.to_dtype(DType::F32)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
    };
    flat(a)
        .iter()
        .zip(flat(b))
        .map(|(x, y)| (x - y).abs() / x.abs().max(1e-3))
        .fold(0.0, f32::max)
}

#[test]
fn recompute_gives_the_gradients_of_the_layered_pass() {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let stage = stage();
    let (loss_a, grads_a, _) = run(&stage, Pass::Layered);
    let (loss_b, grads_b, _) = run(&stage, Pass::Recompute);
    assert_eq!(loss_a, loss_b, "the loss of every microbatch");
    // Dropout is on: the eval loss differs, so equal losses are not vacuous.
    let (x, tg) = batch(0);
    let eval = ForwardCtx {
        train: false,
        ..ctx(&tg, 0)
    };
    let plain = stage.forward(&x, &eval).unwrap().output;
    assert_ne!(
        plain.to_scalar::<f32>().unwrap(),
        loss_a[0] * MICROBATCHES as f32
    );
    assert_eq!(grads_a.len(), grads_b.len());
    let mut worst = (0.0f32, String::new());
    for (name, ga) in &grads_a {
        let d = max_rel_diff(ga, &grads_b[name]);
        if d > worst.0 {
            worst = (d, name.clone());
        }
    }
    println!(
        "max relative gradient difference {:e} ({})",
        worst.0, worst.1
    );
    assert!(
        worst.0 <= 1e-6,
        "{}: relative difference {}",
        worst.1,
        worst.0
    );
}

#[test]
fn recompute_holds_less_memory_with_microbatches_in_flight() {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let stage = stage();
    // Once unmeasured, so lazily built state (thread pools, caches) is not charged to a pass.
    run(&stage, Pass::Graph);
    let (_, _, graph) = run(&stage, Pass::Graph);
    let (_, _, layered) = run(&stage, Pass::Layered);
    let (_, _, recompute) = run(&stage, Pass::Recompute);
    let mib = |b: usize| b as f64 / (1 << 20) as f64;
    println!(
        "peak live heap, {MICROBATCHES} microbatches of [{B}, {T}] in flight: one graph {:.2} \
         MiB, layered {:.2} MiB, recompute {:.2} MiB",
        mib(graph),
        mib(layered),
        mib(recompute)
    );
    assert!(
        recompute < graph,
        "recompute {recompute} B, one graph {graph} B"
    );
    assert!(
        recompute < layered,
        "recompute {recompute} B, layered {layered} B"
    );
}
