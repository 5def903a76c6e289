#!/usr/bin/env python3
"""The comparators of `oobleck bench data`: GPT-2 tokenization throughput of Hugging Face
`tokenizers` (batch encode) and `tiktoken` on the documents the bench wrote, on N threads.

Both are built from the shipped `datasets/gpt2-tokenizer/` files (no download: tiktoken's
`gpt2` encoding would fetch its files at first use). Prints one JSON line:
{"which", "threads", "seconds", "bytes", "tokens", "checksum"} or {"unavailable": why}.
The checksum is the wrapping sum over documents of (index + 1) * (sum of its ids), the same
the Rust side computes, so the ids are known to agree.

    python3 bin/benches/tokenize_bench.py --which tiktoken --docs docs.jsonl \
        --tokenizer-dir datasets/gpt2-tokenizer --threads 2
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

MASK = (1 << 64) - 1


def checksum(batches) -> tuple[int, int]:
    total, tokens = 0, 0
    for i, ids in enumerate(batches):
        total = (total + (i + 1) * sum(ids)) & MASK
        tokens += len(ids)
    return total, tokens


def tiktoken_encode(tok_dir: Path, docs: list[str], threads: int):
    try:
        sys.path.insert(0, str(tok_dir))
        from make_reference_ids import tiktoken_encoder  # the tests' own loader of the files
    except ImportError as e:
        return None, f"tiktoken: {e}"
    enc = tiktoken_encoder()
    if enc is None:
        return None, "tiktoken is not installed (pip install tiktoken)"
    t0 = time.perf_counter()
    ids = enc.encode_ordinary_batch(docs, num_threads=threads)
    return (time.perf_counter() - t0, ids), None


def hf_encode(tok_dir: Path, docs: list[str], threads: int):
    # The Rust pool reads this when it first starts, so it is set before the import.
    os.environ["RAYON_NUM_THREADS"] = str(threads)
    os.environ["TOKENIZERS_PARALLELISM"] = "true"
    try:
        from tokenizers import ByteLevelBPETokenizer
    except ImportError:
        return None, "tokenizers is not installed (pip install tokenizers)"
    tok = ByteLevelBPETokenizer(
        str(tok_dir / "encoder.json"), str(tok_dir / "vocab.bpe"), add_prefix_space=False
    )
    t0 = time.perf_counter()
    encodings = tok.encode_batch(docs)
    seconds = time.perf_counter() - t0
    return (seconds, [e.ids for e in encodings]), None


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--which", choices=["tiktoken", "hf"], required=True)
    p.add_argument("--docs", type=Path, required=True)
    p.add_argument("--tokenizer-dir", type=Path, required=True)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    docs = [json.loads(line)["text"] for line in a.docs.read_text(encoding="utf-8").splitlines()]
    encode = tiktoken_encode if a.which == "tiktoken" else hf_encode
    result, why = encode(a.tokenizer_dir, docs, a.threads)
    if result is None:
        print(json.dumps({"unavailable": why}))
        return
    seconds, ids = result
    total, tokens = checksum(ids)
    print(json.dumps({
        "which": a.which,
        "threads": a.threads,
        "seconds": seconds,
        "bytes": sum(len(d.encode("utf-8")) for d in docs),
        "tokens": tokens,
        "checksum": f"{total:016x}",
    }))


if __name__ == "__main__":
    main()
