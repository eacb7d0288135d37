"""Throughput of the batch job on the shipped pair: speculative vs autoregressive at
several batch sizes, each measured after a warm-up pass that compiles its programs.

    python scripts/batch_bench.py [--rows 64] [--batches 8,32,64] [--max-new-tokens 64]

Writes bench_out/batch_bench.json (git-ignored; or --out) and prints a markdown table.
Run from the repository root.
"""

import json
import pathlib
import tempfile

import pair_setup

from jax_specdec.batch import make_generate, read_rows, run_job
from jax_specdec.report import markdown_table
from jax_specdec.sampling import SamplingConfig


def main() -> None:
    parser = pair_setup.parser(__doc__, "batch_bench")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--batches", default="8,32,64")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=1.0)
    args = parser.parse_args()
    target, draft, tokenizer, prompts = pair_setup.load_pair()
    work = pathlib.Path(tempfile.mkdtemp())
    inp = work / "in.jsonl"
    inp.write_text(
        "".join(
            json.dumps({"id": i, "prompt": prompts[i % len(prompts)]}) + "\n"
            for i in range(args.rows)
        )
    )
    sampling = SamplingConfig(args.temperature)
    rows, _ = read_rows(
        inp,
        tokenizer=tokenizer,
        vocab_size=target.config.vocab_size,
        job_seed=0,
        sampling=sampling,
        max_new_tokens=args.max_new_tokens,
    )
    results = []
    for batch in [int(b) for b in args.batches.split(",")]:
        for mode, d in (("speculative", draft), ("autoregressive", None)):
            generate = make_generate(target, d, eos_token_id=None, num_draft_tokens=4)
            job = {"mode": mode, "batch": batch}
            for attempt in ("warm-up", "measured"):
                out = work / f"{mode}-{batch}-{attempt}.jsonl"
                summary = run_job(
                    rows, out, generate=generate, job=job, batch_size=batch, progress=False
                )
            results.append({"batch": batch, "mode": mode, **summary})
            print(batch, mode, f"{summary['tokens_per_second']:.0f} tokens/s", flush=True)
    pair_setup.write_json(args.out, results)
    table = []
    for batch in sorted({r["batch"] for r in results}):
        spec, ar = (
            next(r for r in results if r["batch"] == batch and r["mode"] == m)
            for m in ("speculative", "autoregressive")
        )
        ratio = spec["tokens_per_second"] / ar["tokens_per_second"]
        table.append(
            [
                batch,
                f"{spec['tokens_per_second']:.0f}",
                f"{ar['tokens_per_second']:.0f}",
                f"{ratio:.2f}",
                f"{spec['alpha']:.3f}",
            ]
        )
    header = ["batch", "speculative tokens/s", "autoregressive tokens/s", "ratio", "α"]
    print(markdown_table(header, table))


if __name__ == "__main__":
    main()
