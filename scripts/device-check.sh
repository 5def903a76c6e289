#!/usr/bin/env bash
# The GPU checks, for a machine with an NVIDIA GPU and driver (one H200 is what it was written
# for): builds with --features cuda,nccl, then
#   1. GPU parity: tiny GPT and OPT on the GPU against the CPU (logits, loss, gradients), and
#      bf16 on the GPU against fp32 on the CPU;
#   2. one NCCL rank's whole life: init, all-reduce, abort, a fresh communicator;
#   3. each layer kind's measured time on the GPU against the planner's analytical estimate;
#   4. a short bf16 training run of gpt3-350m (b = 4, 1,024 tokens) and one of gpt3-1.3b at its
#      2,048-token context, on the GPU;
#   5. a 2-worker pipeline (a local cluster of 2 nodes) on the one GPU, over TCP staging;
# and prints one table: tokens/s, model FLOPs utilisation against the GPU's bf16 peak, peak GPU
# memory, and the per-layer times. Everything it writes goes to $OUT (default
# target/device-check/). Meant to finish in under 8 minutes on a 16-core machine.
#
#   scripts/device-check.sh            CUDA_COMPUTE_CAP is read from nvidia-smi when unset
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
out="${OUT:-$root/target/device-check}"
mkdir -p "$out"
started=$SECONDS
say() { echo "== [$((SECONDS - started)) s] $*"; }

command -v nvidia-smi >/dev/null || {
  echo "device-check.sh: no nvidia-smi: this needs a machine with an NVIDIA GPU and driver" >&2
  exit 1
}
gpu_name="$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
if [[ -z "${CUDA_COMPUTE_CAP:-}" ]]; then
  cap="$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d '.')"
  export CUDA_COMPUTE_CAP="${cap:-90}"
fi
say "GPU: $gpu_name (compute capability $CUDA_COMPUTE_CAP)"

say "build: train and oobleck with cuda,nccl"
scripts/build-cuda.sh build 2>&1 | tail -3
# The same toolkit environment for the test builds.
venv="${CUDA_VENV:-$root/.cuda-venv}"
cu="$(ls -d "$venv"/lib/python3*/site-packages/nvidia/cu13 | head -1)"
export CUDA_ROOT="$cu" CUDA_PATH="$cu" PATH="$cu/bin:$PATH"
export LD_LIBRARY_PATH="$cu/lib:$(ls -d "$venv"/lib/python3*/site-packages/nvidia/*/lib | tr '\n' ':')${LD_LIBRARY_PATH:-}"
train="${CARGO_TARGET_DIR:-$root/target}/release/train"

# Peak GPU memory while `$@` runs, in MiB, written to $out/$name.mem.
with_memory() {
  local name="$1"
  shift
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 200 >"$out/$name.smi" &
  local smi=$!
  local rc=0
  "$@" >"$out/$name.log" 2>&1 || rc=$?
  kill "$smi" 2>/dev/null || true
  wait "$smi" 2>/dev/null || true
  sort -n "$out/$name.smi" | tail -1 >"$out/$name.mem"
  if [[ $rc -ne 0 ]]; then
    echo "device-check.sh: $name failed (rc $rc); the end of $out/$name.log:" >&2
    tail -20 "$out/$name.log" >&2
  fi
  return $rc
}

failed=()
say "1-3. GPU tests (parity, bf16, NCCL lifecycle, layer times)"
export OOBLECK_DEVICE_CHECK_OUT="$out"
with_memory tests cargo test --release --locked -p oobleck-models --features cuda --test gpu \
  -- --ignored --nocapture --test-threads 1 || failed+=(gpu-tests)
with_memory nccl cargo test --release --locked -p oobleck-comm --features nccl --test nccl_gpu \
  -- --ignored --nocapture || failed+=(nccl)

say "4. bf16 training on the GPU"
with_memory run350m "$train" --model gpt3-350m --nodes 1 --device cuda --precision bf16 \
  --seq-len 1024 --microbatch-size 4 --global-batch-size 32 --steps 12 --eval-every 0 \
  --checkpoint-every 0 --sample 0 --out "$out/run350m" || failed+=(gpt3-350m)
with_memory run1b3 "$train" --model gpt3-1.3b --nodes 1 --device cuda --precision bf16 \
  --microbatch-size 4 --global-batch-size 32 --steps 8 --eval-every 0 --checkpoint-every 0 \
  --sample 0 --out "$out/run1b3" || failed+=(gpt3-1.3b)

say "5. a 2-worker pipeline on the one GPU over TCP"
with_memory pipe2 "$train" --model gpt-mini --nodes 2 --device cuda --data-plane tcp \
  --steps 6 --eval-every 0 --checkpoint-every 0 --sample 0 --out "$out/pipe2" || failed+=(pipeline)

say "table"
python3 - "$out" "$gpu_name" <<'PY'
import json, os, statistics, sys
out, gpu = sys.argv[1], sys.argv[2]
# Dense bf16 peaks (TFLOPS), as the planner's device table has them.
peaks = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "V100": 125.0}
peak = next((v for k, v in peaks.items() if k in gpu), None)
def mem(name):
    try:
        return f"{int(open(os.path.join(out, name + '.mem')).read().strip()) / 1024:.1f} GiB"
    except (OSError, ValueError):
        return "-"
def steady(run):
    path = os.path.join(out, run, "metrics.jsonl")
    try:
        rows = [json.loads(l) for l in open(path) if l.strip()]
    except OSError:
        return None, None
    steps = [r for r in rows if r.get("kind", "step") == "step" and "tokens_per_s" in r]
    tps = [r["tokens_per_s"] for r in steps[2:]] or [r["tokens_per_s"] for r in steps]
    params = next((r.get("params") for r in rows if r.get("params")), None)
    return (statistics.median(tps) if tps else None), params
params_of = {"run350m": 350e6, "run1b3": 1.3e9, "pipe2": 7.2e6}
print(f"{'check':<34} {'tokens/s':>10} {'MFU':>7} {'peak GPU mem':>13}")
for run, what in [("run350m", "gpt3-350m bf16, b 4 x 1024"),
                  ("run1b3", "gpt3-1.3b bf16, b 4 x 2048"),
                  ("pipe2", "gpt-mini, 2 workers, TCP staging")]:
    tps, params = steady(run)
    n = params or params_of[run]
    mfu = f"{100 * 6 * n * tps / (peak * 1e12):.1f}%" if tps and peak else "-"
    print(f"{what:<34} {tps if tps else float('nan'):>10.0f} {mfu:>7} {mem(run):>13}")
try:
    layers = json.load(open(os.path.join(out, "layer_times.json")))
    print(f"\n{'layer (gpt3-350m, b 4 x 1024, bf16)':<36} {'fwd ms':>8} {'est':>8} {'bwd ms':>8} {'est':>8}")
    for r in layers:
        print(f"{r['layer']:<36} {r['forward_ms']:>8.3f} {r['est_forward_ms']:>8.3f} "
              f"{r['backward_ms']:>8.3f} {r['est_backward_ms']:>8.3f}")
except OSError:
    print("\n(no layer times: the GPU tests failed before writing them)")
PY
say "done in $((SECONDS - started)) s; logs in $out"
if [[ ${#failed[@]} -gt 0 ]]; then
  echo "device-check.sh: failed: ${failed[*]}" >&2
  exit 1
fi
