"""What the throughput benchmarks of the shipped pair (`batch_bench.py`, `slots_bench.py`)
share: the command line's `--out`, the pair, its tokenizer and prompts (the CLI's
defaults under models/), and the result file, written under bench_out/ (git-ignored) unless
`--out` says otherwise. Run the benchmarks from the repository root."""

from __future__ import annotations

import argparse
import json
import pathlib

from jax_specdec.cli.common import DEFAULT_DRAFT, DEFAULT_PROMPTS, DEFAULT_TARGET, read_prompts
from jax_specdec.io.hf import load_model, load_tokenizer

OUT = pathlib.Path("bench_out")


def parser(doc: str, name: str) -> argparse.ArgumentParser:
    """The benchmark's parser (its docstring's first line) with `--out`, by default
    bench_out/<name>.json."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    default = OUT / f"{name}.json"
    p.add_argument("--out", type=pathlib.Path, default=default, help=f"(default: {default})")
    return p


def load_pair():
    """(target, draft, tokenizer, prompt texts): the shipped stdlib pair and its prompts."""
    target, draft = load_model(DEFAULT_TARGET), load_model(DEFAULT_DRAFT)
    return target, draft, load_tokenizer(DEFAULT_TARGET), read_prompts(DEFAULT_PROMPTS)


def write_json(path: pathlib.Path, data) -> None:
    """`data` as indented JSON at `path`, its folder created."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")
