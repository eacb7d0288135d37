"""A batch job whose rows ask for four sampling settings: all rows in one program (per-row
sampling) against the same rows run group by group, one program and one pass through the
slots per setting (what `jax-specdec batch` did before sampling settings were per row).

    python scripts/mixed_bench.py [--rows 256] [--slots 16] [--repeats 3] [--draft ngram]
        [--settings 4|4t|4p|16]

Settings in turn by row: greedy, T = 0.7, T = 1 with top-p 0.9, T = 1 with top-k 50
(`--settings 4t`: temperatures 0.5, 0.7, 0.9, 1; `4p`: four settings with penalties and
a logit bias; `16`: temperatures 0, 0.1, …, 1.5);
budgets geometric (mean 32, cap 256, as a workload ended by EOS). Both ways run once
(compiling: its seconds are recorded), then interleaved `--repeats` times; tokens/s and
slot occupancy, medians. Writes bench_out/mixed_bench.json (git-ignored; or --out) and
prints a markdown table. Run from the repository root.
"""

import json
import pathlib
import statistics
import tempfile

import numpy as np
import pair_setup

from jax_specdec.batch import make_generate, read_rows, run_job
from jax_specdec.decode import NGram
from jax_specdec.report import markdown_table
from jax_specdec.sampling import SamplingConfig

FOUR = [
    {"temperature": 0},
    {"temperature": 0.7},
    {"temperature": 1, "top_p": 0.9},
    {"temperature": 1, "top_k": 50},
]
SIXTEEN = [{"temperature": t / 10} for t in range(16)]
TEMPERATURES = [{"temperature": t} for t in (0.5, 0.7, 0.9, 1.0)]
PENALTIES = [
    {"temperature": 0, "repetition_penalty": 1.2},
    {"temperature": 0.7, "presence_penalty": 0.5},
    {"temperature": 1, "top_p": 0.9, "frequency_penalty": 0.5},
    {"temperature": 1, "logit_bias": {"0": -5.0}},
]
SETTINGS = {"4": FOUR, "16": SIXTEEN, "4t": TEMPERATURES, "4p": PENALTIES}


def job_lines(prompts, rows: int, settings: list[dict]) -> list[dict]:
    budgets = np.minimum(np.random.default_rng(1).geometric(1 / 32, size=rows), 256)
    return [
        {
            "id": i,
            "prompt": prompts[i % len(prompts)],
            "max_new_tokens": int(budgets[i]),
            **settings[i % len(settings)],
        }
        for i in range(rows)
    ]


def read(path, tokenizer, target):
    rows, _ = read_rows(
        path,
        tokenizer=tokenizer,
        vocab_size=target.config.vocab_size,
        job_seed=0,
        sampling=SamplingConfig(1.0),
        max_new_tokens=32,
    )
    return rows


def timed(groups, generate, slots, work, tag) -> dict:
    """One pass over the groups (each a list of rows, one job each): tokens, seconds,
    tokens per round."""
    tokens = seconds = rounds = row_rounds = after_first = 0.0
    for g, rows in enumerate(groups):
        out = work / f"{tag}-{g}.jsonl"
        out.unlink(missing_ok=True)
        pathlib.Path(f"{out}.job.json").unlink(missing_ok=True)
        summary = run_job(
            rows, out, generate=generate, job={}, batch_size=1, slots=slots, progress=False
        )
        tokens += summary["tokens"]
        seconds += summary["seconds"]
        rounds += summary["occupancy"] * summary["seconds"]
        # tokens per round counts the tokens after each row's first (the prefill's)
        after_first += summary["tokens"] - summary["rows_run"]
        row_rounds += (summary["tokens"] - summary["rows_run"]) / summary["tokens_per_round"]
    return {
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_second": tokens / seconds,
        "tokens_per_round": after_first / row_rounds,
        "occupancy": rounds / seconds,  # time-weighted over the groups
    }


def main() -> None:
    parser = pair_setup.parser(__doc__, "mixed_bench")
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--draft", choices=["model", "ngram"], default="model")
    parser.add_argument("--settings", choices=sorted(SETTINGS), default="4")
    args = parser.parse_args()
    target, draft, tokenizer, prompts = pair_setup.load_pair()
    draft = NGram() if args.draft == "ngram" else draft
    work = pathlib.Path(tempfile.mkdtemp())
    inp = work / "in.jsonl"
    inp.write_text(
        "".join(
            json.dumps(r) + "\n" for r in job_lines(prompts, args.rows, SETTINGS[args.settings])
        )
    )
    rows = read(inp, tokenizer, target)
    grouped = [
        [r for r in rows if r.sampling == s] for s in dict.fromkeys(r.sampling for r in rows)
    ]
    ways = {"mixed": [rows], "grouped": grouped}
    generate = make_generate(target, draft, eos_token_id=None, num_slots=args.slots)
    compiling = {
        name: timed(groups, generate, args.slots, work, name) for name, groups in ways.items()
    }
    runs = {name: [] for name in ways}
    for _ in range(args.repeats):
        for name, groups in ways.items():
            runs[name].append(timed(groups, generate, args.slots, work, name))
            print(name, f"{runs[name][-1]['tokens_per_second']:.0f} tokens/s", flush=True)
    median = {n: statistics.median(r["tokens_per_second"] for r in runs[n]) for n in ways}
    occupancy = {n: statistics.median(r["occupancy"] for r in runs[n]) for n in ways}
    result = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "first_pass": compiling,
        "runs": runs,
        "median": median,
    }
    pair_setup.write_json(args.out, result)
    table = [
        [
            n,
            f"{median[n]:.0f}",
            f"{median[n] / median['grouped']:.2f}",
            f"{occupancy[n]:.2f}",
            f"{runs[n][0]['tokens_per_round']:.2f}",
            f"{compiling[n]['seconds']:.0f}",
        ]
        for n in ways
    ]
    header = ["way", "tokens/s (median)", "over grouped", "occupancy", "tokens/round"]
    header.append("first pass s")
    print(markdown_table(header, table))


if __name__ == "__main__":
    main()
