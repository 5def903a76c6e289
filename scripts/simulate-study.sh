#!/usr/bin/env bash
# The comparison of the simulator's README ("GPT-3 2.7B, 6.7B and 13B at scale"): every
# policy of ours on generated two-day traces, GPT-3 2.7B/6.7B/13B, nodes of 8 A100s or H100s,
# 30/300/3000 nodes, node MTBF 250 days and 1 day, f = 1, 16 samples per node per step.
# Usage: scripts/simulate-study.sh [OUT_DIR]   (about 3 minutes on 2 cores; prints the table,
# which needs python3 to read the JSON).
set -euo pipefail
out=${1:-target/simulate-study}
mkdir -p "$out"
cargo build --release -q -p oobleck-cli --bin oobleck
bin=target/release/oobleck
for model in gpt3-2.7b gpt3-6.7b gpt3-13b; do
  for dev in a100-80gb h100-80gb; do
    for n in 30 300 3000; do
      for mtbf in 250d 1d; do
        "$bin" simulate --generate-failures "$mtbf" --nodes "$n" --duration 2d --seed 1 \
          --model "$model" --device "$dev" --devices-per-node 8 \
          --global-batch-size $((16 * n)) --fault-threshold 1 --json \
          > "$out/$model-$dev-$n-$mtbf.json"
        echo "simulate-study: $model $dev $n nodes, MTBF $mtbf" >&2
      done
    done
  done
done
python3 - "$out" <<'PY'
import json, sys
out = sys.argv[1]
print("| model | GPU | nodes | node MTBF | failures | fault-free samples/s | oobleck | checkpoint-restart | redundancy |")
print("|---|---|---:|---|---:|---:|---:|---:|---:|")
for model in ["gpt3-2.7b", "gpt3-6.7b", "gpt3-13b"]:
    for dev in ["a100-80gb", "h100-80gb"]:
        for n in [30, 300, 3000]:
            for mtbf in ["250d", "1d"]:
                d = json.load(open(f"{out}/{model}-{dev}-{n}-{mtbf}.json"))
                kept = {p["policy"]: p["of_fault_free"] for p in d["policies"]}
                cell = lambda k: "-" if kept[k] is None else f"{kept[k] * 100:.1f} %"
                print(f"| {model} | {dev.split('-')[0].upper()} | {n} | {mtbf} | "
                      f"{d['trace']['removals']} | {d['fault_free_samples_per_s']:,.0f} | "
                      f"{cell('oobleck')} | {cell('checkpoint-restart')} | {cell('redundancy')} |")
PY
