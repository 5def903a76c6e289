#!/usr/bin/env python3
"""Write reference_ids.json: GPT-2 token ids of fixed strings, from two independent encoders.

1. `openai_encode` below is a line-for-line port of OpenAI's original `gpt-2/src/encoder.py`
   (bytes_to_unicode, greedy lowest-rank merges, the same regex) run on the shipped
   encoder.json / vocab.bpe. Needs the `regex` package.
2. If `tiktoken` is installed, its Rust BPE over the same files must give the same ids
   (checked; the script fails on any difference).

The Rust tokenizer test (`oobleck-models/tests/data_tokenizer.rs`) compares against this file.

    python3 datasets/gpt2-tokenizer/make_reference_ids.py
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import regex as re

HERE = Path(__file__).resolve().parent
PAT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

TEXTS = [
    "Hello world",
    "Hello, world!",
    " Hello world",
    "hello world",
    "The quick brown fox jumps over the lazy dog.",
    "To be, or not to be, that is the question:",
    "I'm here, you're there, they've gone, we'll see, he'd know, it's fine.",
    "a\n\nb",
    "Ber.\nWho's there?\n\nFran.\nNay, answer me: stand, and unfold yourself.\n",
    "   leading spaces and trailing   ",
    "tabs\tand\r\nwindows line ends\r\n",
    "numbers 12345 and 3.14159 and 1,000,000",
    "caf\u00e9 na\u00efve r\u00e9sum\u00e9 \u00fcber",
    "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8",
    "emoji \U0001F600\U0001F680 end",
    "CamelCaseWordsAndALLCAPS",
    "<tag attr=\"x\">text</tag>",
    "",
]


def bytes_to_unicode() -> dict[int, str]:
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("\u00a1"), ord("\u00ac") + 1))
          + list(range(ord("\u00ae"), ord("\u00ff") + 1)))
    cs = bs[:]
    n = 0
    for b in range(2**8):
        if b not in bs:
            bs.append(b)
            cs.append(2**8 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def get_pairs(word: tuple[str, ...]) -> set[tuple[str, str]]:
    return {(word[i], word[i + 1]) for i in range(len(word) - 1)}


ENCODER: dict[str, int] = json.loads((HERE / "encoder.json").read_text(encoding="utf-8"))
MERGES = (HERE / "vocab.bpe").read_text(encoding="utf-8").split("\n")[1:-1]
BPE_RANKS = {tuple(m.split()): i for i, m in enumerate(MERGES)}
BYTE_ENCODER = bytes_to_unicode()


@lru_cache(maxsize=None)
def bpe(token: str) -> str:
    word = tuple(token)
    pairs = get_pairs(word)
    if not pairs:
        return token
    while True:
        bigram = min(pairs, key=lambda p: BPE_RANKS.get(p, float("inf")))
        if bigram not in BPE_RANKS:
            break
        first, second = bigram
        new_word: list[str] = []
        i = 0
        while i < len(word):
            try:
                j = word.index(first, i)
            except ValueError:
                new_word.extend(word[i:])
                break
            new_word.extend(word[i:j])
            i = j
            if word[i] == first and i < len(word) - 1 and word[i + 1] == second:
                new_word.append(first + second)
                i += 2
            else:
                new_word.append(word[i])
                i += 1
        word = tuple(new_word)
        if len(word) == 1:
            break
        pairs = get_pairs(word)
    return " ".join(word)


def openai_encode(text: str) -> list[int]:
    ids: list[int] = []
    for token in re.findall(PAT, text):
        token = "".join(BYTE_ENCODER[b] for b in token.encode("utf-8"))
        ids.extend(ENCODER[t] for t in bpe(token).split(" "))
    return ids


def tiktoken_encoder():
    try:
        import tiktoken
        import tiktoken.load as load
    except ImportError:
        return None
    # tiktoken reads local paths through blobfile; read them directly instead.
    load.read_file = lambda p: Path(p).read_bytes()
    ranks = load.data_gym_to_mergeable_bpe_ranks(str(HERE / "vocab.bpe"), str(HERE / "encoder.json"))
    return tiktoken.Encoding("gpt2-local", pat_str=PAT, mergeable_ranks=ranks,
                             special_tokens={"<|endoftext|>": 50256})


def main() -> None:
    corpus = (HERE.parent / "shakespeare.txt").read_text(encoding="utf-8")
    texts = TEXTS + [corpus[:4000], corpus[2_500_000:2_504_000]]
    tik = tiktoken_encoder()
    cases = []
    for text in texts:
        ids = openai_encode(text)
        if tik is not None:
            other = tik.encode(text, disallowed_special=())
            if other != ids:
                raise SystemExit(f"tiktoken disagrees on {text[:40]!r}: {other[:20]} vs {ids[:20]}")
        cases.append({"text": text, "ids": ids})
    out = {
        "source": "make_reference_ids.py: port of OpenAI gpt-2/src/encoder.py"
                  + (", cross-checked with tiktoken" if tik is not None else ""),
        "vocab_size": len(ENCODER),
        "cases": cases,
    }
    (HERE / "reference_ids.json").write_text(json.dumps(out, ensure_ascii=False, indent=1) + "\n",
                                             encoding="utf-8")
    print(f"wrote {len(cases)} cases; tiktoken cross-check: {tik is not None}")


if __name__ == "__main__":
    main()
