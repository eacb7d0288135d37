"""The `jax-specdec` command line.

Subcommands import their heavy dependencies (jax, models) lazily, so `--help` and the
balance report start instantly.
"""

from __future__ import annotations

import argparse
import sys

__all__ = ["main"]


def _fail(parser: argparse.ArgumentParser, error: Exception) -> None:
    """Bad input: one line on stderr, exit code 2, no traceback."""
    print(f"{parser.prog}: error: {error}", file=sys.stderr)
    sys.exit(2)


def _distribution(text: str) -> list[float]:
    try:
        return [float(x) for x in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated numbers such as 0.2,0.5,0.3, got {text!r}"
        ) from None


def format_balance(p, q) -> str:
    """The balance table of one position (see `exact.one_position`) as markdown text."""
    from jax_specdec.exact import one_position

    b = one_position(p, q)
    names = [chr(ord("A") + i) if len(b.output) <= 26 else str(i) for i in range(len(b.output))]
    rows = [
        ("p (target)", p),
        ("q (draft)", q),
        ("accepted min(p, q)", b.accepted),
        ("residual norm(max(0, p - q))", b.residual),
        ("output = accepted + rejected * residual", b.output),
        ("wrong: accepted + rejected * p", b.wrong_output),
    ]
    width = max(len(r[0]) for r in rows)
    lines = ["| " + "quantity".ljust(width) + " | " + " | ".join(f"{n:>6}" for n in names) + " |"]
    lines.append("|" + "-" * (width + 2) + "|" + "|".join("-" * 8 for _ in names) + "|")
    for label, values in rows:
        cells = " | ".join(f"{float(v):6.4f}" for v in values)
        lines.append(f"| {label.ljust(width)} | {cells} |")
    lines.append("")
    lines.append(
        f"Accepted proposals emit {b.accepted.sum():.4f}; the rejected mass "
        f"{b.rejected_mass:.4f} is carried by the residual. "
        f"max |output - p| = {abs(b.output - p).max():.1e}, "
        f"max |wrong - p| = {abs(b.wrong_output - p).max():.4f}."
    )
    return "\n".join(lines)


def _cmd_balance(args, parser) -> int:
    import numpy as np

    try:
        text = format_balance(np.asarray(args.p, np.float64), np.asarray(args.q, np.float64))
    except ValueError as e:
        _fail(parser, e)  # exit code 2, no traceback
    print(text)
    return 0


DEFAULT_TARGET = "models/stdlib-target"
DEFAULT_DRAFT = "models/stdlib-draft"
DEFAULT_PROMPTS = "models/prompts.txt"
_PRESETS = ("target", "draft", "tiny")


def _model_dir(text: str, which: str):
    """Resolves a model directory: as given, else relative to the installed checkout."""
    import pathlib

    path = pathlib.Path(text)
    if not path.is_dir():
        beside_package = pathlib.Path(__file__).resolve().parent.parent / text
        if beside_package.is_dir():
            path = beside_package
    if not (path / "config.json").is_file():
        raise ValueError(f"--{which}: {text} is not a model directory (no config.json)")
    return path


def _load_pair(args):
    from jax_specdec.hf import load_model, load_tokenizer

    target_dir = _model_dir(args.target, "target")
    draft_dir = _model_dir(args.draft, "draft")
    target_tok = (
        (target_dir / "tokenizer.json").read_text()
        if (target_dir / "tokenizer.json").is_file()
        else None
    )
    draft_tok = (
        (draft_dir / "tokenizer.json").read_text()
        if (draft_dir / "tokenizer.json").is_file()
        else None
    )
    if target_tok is None:
        raise ValueError(f"--target: {target_dir} has no tokenizer.json")
    if draft_tok is not None and draft_tok != target_tok:
        raise ValueError(
            f"the draft's tokenizer ({draft_dir}/tokenizer.json) differs from the target's"
        )
    return load_model(target_dir), load_model(draft_dir), load_tokenizer(target_dir)


def _sampling(args):
    from jax_specdec.sampling import SamplingConfig

    return SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)


def _cmd_generate(args, parser) -> int:
    import json
    import time

    try:
        sampling = _sampling(args)
        if args.prompt_file is not None:
            prompts = _read_prompts(args.prompt_file)
        elif args.prompt is not None:
            prompts = [args.prompt]
        else:
            prompts = [sys.stdin.read()]
        if not prompts or any(not p for p in prompts):
            raise ValueError("the prompt is empty")
        target, draft, tokenizer = _load_pair(args)
    except (ValueError, OSError) as e:
        _fail(parser, e)

    import jax
    import numpy as np

    from jax_specdec.decode import speculative_generate

    ids = [tokenizer.encode(p).ids for p in prompts]
    try:
        eos = _eos(args.eos, tokenizer)
    except ValueError as e:
        _fail(parser, e)
    common = dict(
        key=jax.random.key(args.seed),
        max_new_tokens=args.max_new_tokens,
        sampling=sampling,
        eos_token_id=eos,
    )
    try:
        start = time.perf_counter()
        out = speculative_generate(
            target, draft, ids, num_draft_tokens=args.num_draft_tokens, **common
        )
        jax.block_until_ready(out.tokens)
        seconds = time.perf_counter() - start
        ar_seconds = None
        if args.compare:
            # Medians of 3 runs of each compiled program, compilation excluded.
            from jax_specdec.bench import time_generation
            from jax_specdec.decode import autoregressive_program, speculative_program

            timing, out = time_generation(
                speculative_program(
                    target, draft, ids, num_draft_tokens=args.num_draft_tokens, **common
                ),
                3,
            )
            seconds = timing.median
            ar_timing, ar = time_generation(autoregressive_program(target, ids, **common), 3)
            ar_seconds = ar_timing.median
    except ValueError as e:
        _fail(parser, e)
    tokens, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
    texts = [tokenizer.decode(tokens[b, : lengths[b]].tolist()) for b in range(len(ids))]
    stats = out.stats
    summary = {
        "alpha": stats.alpha,
        "acceptance_rate": stats.acceptance_rate,
        "tokens_per_round": stats.tokens_per_round(out.lengths),
        "generated_tokens": int(lengths.sum()),
        "seconds": seconds,
        "tokens_per_second": float(lengths.sum() / seconds),
    }
    if ar_seconds is not None:
        summary["autoregressive_seconds"] = ar_seconds
        summary["speedup"] = ar_seconds / seconds
        summary["same_text_as_autoregressive"] = bool(np.array_equal(np.asarray(ar.tokens), tokens))
    if args.json:
        rows = [
            {"prompt": p, "text": t, "tokens": tokens[b, : lengths[b]].tolist()}
            for b, (p, t) in enumerate(zip(prompts, texts, strict=True))
        ]
        print(json.dumps({"outputs": rows, "stats": summary}, indent=2))
        return 0
    for prompt, text in zip(prompts, texts, strict=True):
        print(prompt + text)
        print("-" * 60)
    line = (
        f"α {summary['alpha']:.3f} · {summary['tokens_per_round']:.2f} tokens/round · "
        f"{summary['generated_tokens']} tokens in {seconds:.2f} s "
        f"({summary['tokens_per_second']:.1f} tokens/s"
        + (", incl. compilation)" if ar_seconds is None else ", median of 3)")
    )
    if ar_seconds is not None:
        line += f" · autoregressive {ar_seconds:.2f} s · speedup {summary['speedup']:.2f}x"
    print(line, file=sys.stderr)
    return 0


def _cmd_train(args, parser) -> int:
    import json
    import pathlib

    from jax_specdec.train import TrainConfig

    try:
        config = TrainConfig(
            steps=args.steps,
            batch_size=args.batch_size,
            seq_len=args.seq_len,
            learning_rate=args.learning_rate,
            warmup_steps=args.warmup_steps,
            seed=args.seed,
            eval_every=args.eval_every,
            checkpoint_every=args.checkpoint_every,
            divergence=getattr(args, "divergence", "ce"),
        )
    except ValueError as e:
        _fail(parser, e)
    from jax_specdec import workflow

    out = pathlib.Path(args.out)
    try:
        if args.command == "train":
            result = workflow.train_model(
                preset=args.preset,
                out=out,
                config=config,
                tokenizer_path=args.tokenizer,
                vocab_size=args.vocab_size,
                checkpoint_dir=args.checkpoint_dir,
            )
        else:
            result = workflow.distill_model(
                target_dir=_model_dir(args.target, "target"),
                draft_dir=_model_dir(args.draft, "draft"),
                out=out,
                config=config,
                checkpoint_dir=args.checkpoint_dir,
            )
    except (ValueError, FileNotFoundError) as e:
        _fail(parser, e)
    print(json.dumps(result, indent=2))
    return 0


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected integers such as 1,8,32, got {text!r}"
        ) from None


def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers such as 0,1, got {text!r}") from None


def _unescape(line: str) -> str:
    """A prompt-file line: `\\n` is a newline, `\\\\` a backslash."""
    import re

    return re.sub(r"\\(.)", lambda m: "\n" if m.group(1) == "n" else m.group(1), line)


def _read_prompts(path: str) -> list[str]:
    with open(path, encoding="utf-8") as f:
        prompts = [_unescape(line.rstrip("\n")) for line in f if line.strip()]
    if not prompts:
        raise ValueError(f"{path} holds no prompts")
    return prompts


def _cmd_sweep(args, parser) -> int:
    import pathlib

    try:
        if not args.batches or min(args.batches) < 1:
            raise ValueError(f"--batches must be positive integers, got {args.batches}")
        if not args.gammas or min(args.gammas) < 1:
            raise ValueError(f"--gammas must be positive integers, got {args.gammas}")
        if args.max_gamma < max(args.gammas):
            raise ValueError(f"--max-gamma ({args.max_gamma}) < largest --gammas")
        if not args.temperatures or min(args.temperatures) < 0:
            raise ValueError(f"--temperatures must be >= 0, got {args.temperatures}")
        if not 0.0 <= args.threshold <= 1.0:
            raise ValueError(f"--threshold must lie in [0, 1], got {args.threshold}")
        if args.max_new_tokens < 1 or args.repeats < 1 or args.min_rows < 1:
            raise ValueError("--max-new-tokens, --repeats and --min-rows must be >= 1")
        prompts = _read_prompts(args.prompts)
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ValueError(
                "the sweep's plots need matplotlib: pip install -e '.[plot]'"
            ) from None
        target, draft, tokenizer = _load_pair(args)
    except (ValueError, OSError) as e:
        _fail(parser, e)
    from jax_specdec.sweep import markdown_table, run_sweep, write_report

    ids = [tokenizer.encode(p).ids for p in prompts]
    results = run_sweep(
        target,
        draft,
        ids,
        batches=args.batches,
        temperatures=args.temperatures,
        gammas=args.gammas,
        max_gamma=args.max_gamma,
        max_new_tokens=args.max_new_tokens,
        threshold=args.threshold,
        repeats=args.repeats,
        seed=args.seed,
        min_rows=args.min_rows,
    )
    results["models"] = {"target": str(args.target), "draft": str(args.draft)}
    paths = write_report(results, pathlib.Path(args.out))
    print(markdown_table(results))
    print("wrote " + ", ".join(str(p) for p in paths), file=sys.stderr)
    return 0


def _cmd_batch(args, parser) -> int:
    import json
    import pathlib

    from jax_specdec.batch import JobError, make_generate, model_identity, read_rows, run_job

    try:
        if args.batch_size < 1:
            raise ValueError(f"--batch-size must be >= 1, got {args.batch_size}")
        if args.num_draft_tokens < 1:
            raise ValueError(f"--num-draft-tokens must be >= 1, got {args.num_draft_tokens}")
        if args.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
        if not 0 <= args.seed < 2**63:
            raise ValueError(f"--seed must lie in [0, 2**63), got {args.seed}")
        sampling = _sampling(args)
        if not pathlib.Path(args.input).is_file():
            raise ValueError(f"--input: {args.input} is not a file")
        target, draft, tokenizer = _load_pair(args)
        eos = _eos(args.eos, tokenizer)
        rows, errors = read_rows(
            args.input,
            tokenizer=tokenizer,
            vocab_size=target.config.vocab_size,
            job_seed=args.seed,
            sampling=sampling,
            max_new_tokens=args.max_new_tokens,
            on_error=args.on_error,
        )
    except (ValueError, OSError) as e:
        _fail(parser, e)
    output = pathlib.Path(args.output)
    errors_path = pathlib.Path(args.errors or f"{output}.errors.jsonl")
    if errors:
        errors_path.write_text("".join(json.dumps(e) + "\n" for e in errors))
        print(f"skipped {len(errors)} bad line(s), listed in {errors_path}", file=sys.stderr)

    import jax

    mesh = None
    if args.mesh is not None:
        try:
            data, model = (int(x) for x in args.mesh.lower().split("x"))
            mesh = jax.make_mesh((data, model), ("data", "model"))
        except ValueError as e:
            _fail(
                parser,
                ValueError(
                    f"--mesh must be DATAxMODEL with {jax.device_count()} "
                    f"devices in all, got {args.mesh!r} ({e})"
                ),
            )

    generate = make_generate(
        target,
        None if args.autoregressive else draft,
        eos_token_id=eos,
        num_draft_tokens=args.num_draft_tokens,
        mesh=mesh,
    )

    job = {
        "mode": "autoregressive" if args.autoregressive else "speculative",
        "target": model_identity(args.target),
        "draft": None if args.autoregressive else model_identity(args.draft),
        "seed": args.seed,
        "num_draft_tokens": None if args.autoregressive else args.num_draft_tokens,
        "defaults": {
            "temperature": sampling.temperature,
            "top_k": sampling.top_k,
            "top_p": sampling.top_p,
            "max_new_tokens": args.max_new_tokens,
            "eos_token_id": eos,
        },
    }
    try:
        summary = run_job(
            rows,
            output,
            generate=generate,
            job=job,
            batch_size=args.batch_size,
            detokenize=tokenizer.decode,
        )
    except (JobError, ValueError) as e:
        _fail(parser, e)
    summary["bad_lines"] = len(errors)
    print(json.dumps(summary, indent=1))
    return 0


def _eos(text: str, tokenizer):
    if text == "auto":
        return tokenizer.token_to_id("<|endoftext|>")
    if text == "none":
        return None
    if not text.isdigit():
        raise ValueError(f"--eos must be 'auto', 'none' or a token id, got {text!r}")
    return int(text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jax-specdec", description="Exact speculative decoding in JAX."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    bal = sub.add_parser(
        "balance",
        help="closed-form balance of one drafted position (DESIGN.md §2)",
        description="Shows that accepted mass plus the residual correction gives back p, "
        "and that resampling rejections from plain p does not.",
    )
    bal.add_argument("--p", type=_distribution, default=[0.2, 0.5, 0.3], help="target p")
    bal.add_argument("--q", type=_distribution, default=[0.6, 0.3, 0.1], help="draft q")
    bal.set_defaults(handler=_cmd_balance, parser=bal)

    gen = sub.add_parser(
        "generate",
        help="speculative generation with the shipped pair (or any HF model directories)",
    )
    gen.add_argument("prompt", nargs="?", help="the prompt; read from stdin when absent")
    gen.add_argument("--prompt-file", help="one prompt per line (\\n for newlines), a batch")
    gen.add_argument("--target", default=DEFAULT_TARGET, help="target model directory")
    gen.add_argument("--draft", default=DEFAULT_DRAFT, help="draft model directory")
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--num-draft-tokens", "-k", type=int, default=4)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--eos", default="auto", help="'auto' (<|endoftext|>), 'none' or an id")
    gen.add_argument(
        "--compare",
        action="store_true",
        help="also run autoregressive decoding and print the speedup",
    )
    gen.add_argument("--json", action="store_true", help="machine-readable output")
    gen.set_defaults(handler=_cmd_generate, parser=gen)

    sw = sub.add_parser(
        "sweep",
        help="time draft-length schedules x γ x temperature x batch; JSON, plots, table",
    )
    sw.add_argument("--target", default=DEFAULT_TARGET, help="target model directory")
    sw.add_argument("--draft", default=DEFAULT_DRAFT, help="draft model directory")
    sw.add_argument("--prompts", default=DEFAULT_PROMPTS, help="one prompt per line (\\n escapes)")
    sw.add_argument("--batches", type=_ints, default=[1, 8, 32, 64])
    sw.add_argument("--temperatures", type=_floats, default=[0.0, 1.0])
    sw.add_argument("--gammas", type=_ints, default=[1, 2, 3, 4, 6], help="constant γ values")
    sw.add_argument("--max-gamma", type=int, default=6, help="cap of the dynamic schedules")
    sw.add_argument("--threshold", type=float, default=0.4, help="confidence threshold τ")
    sw.add_argument("--max-new-tokens", type=int, default=64)
    sw.add_argument("--repeats", type=int, default=3)
    sw.add_argument(
        "--min-rows", type=int, default=8, help="small batches run on several prompt groups"
    )
    sw.add_argument("--seed", type=int, default=0)
    sw.add_argument("--out", default="docs/sweep", help="output directory")
    sw.set_defaults(handler=_cmd_sweep, parser=sw)

    job = sub.add_parser(
        "batch",
        help="a resumable JSONL generation job (one result line per input row)",
        description="Input lines: {id, prompt | tokens, [seed, temperature, top_k, top_p, "
        "max_new_tokens]}. Output lines: {id, seed, tokens, text, stats}. A restarted job "
        "skips finished ids; a row depends only on the job seed and its id (or its seed).",
    )
    job.add_argument("--input", required=True, help="JSONL prompts")
    job.add_argument("--output", required=True, help="JSONL results (appended, resumable)")
    job.add_argument("--target", default=DEFAULT_TARGET, help="target model directory")
    job.add_argument("--draft", default=DEFAULT_DRAFT, help="draft model directory")
    job.add_argument("--batch-size", type=int, default=8)
    job.add_argument("--seed", type=int, default=0, help="job seed (rows without their own)")
    job.add_argument("--num-draft-tokens", "-k", type=int, default=4)
    job.add_argument("--max-new-tokens", type=int, default=128)
    job.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    job.add_argument("--top-k", type=int, default=0)
    job.add_argument("--top-p", type=float, default=1.0)
    job.add_argument("--eos", default="auto", help="'auto' (<|endoftext|>), 'none' or an id")
    job.add_argument(
        "--on-error",
        choices=["stop", "skip"],
        default="stop",
        help="a malformed input line stops the job (default) or is skipped and listed",
    )
    job.add_argument("--errors", help="where skipped lines go (default <output>.errors.jsonl)")
    job.add_argument(
        "--autoregressive", action="store_true", help="plain decoding of the target (baseline)"
    )
    job.add_argument(
        "--mesh",
        help="DATAxMODEL, e.g. 4x2: rows over data, weights over model (all devices)",
    )
    job.set_defaults(handler=_cmd_batch, parser=job)

    for name in ("train", "distill"):
        p = sub.add_parser(
            name,
            help="train a model on the standard-library corpus"
            if name == "train"
            else "distil a draft towards a target (DistillSpec)",
        )
        p.add_argument("--out", required=True, help="output model directory (HF layout)")
        p.add_argument("--checkpoint-dir", help="orbax checkpoints (default: <out>/checkpoints)")
        p.add_argument("--steps", type=int, default=2000)
        p.add_argument("--batch-size", type=int, default=16)
        p.add_argument("--seq-len", type=int, default=256)
        p.add_argument("--learning-rate", type=float, default=3e-3)
        p.add_argument("--warmup-steps", type=int, default=100)
        p.add_argument("--eval-every", type=int, default=250)
        p.add_argument("--checkpoint-every", type=int, default=100)
        p.add_argument("--seed", type=int, default=0)
        if name == "train":
            p.add_argument("--preset", choices=_PRESETS, default="target")
            p.add_argument("--tokenizer", help="tokenizer.json to use (default: train one)")
            p.add_argument("--vocab-size", type=int, default=4096)
        else:
            p.add_argument("--target", default=DEFAULT_TARGET)
            p.add_argument("--draft", default=DEFAULT_DRAFT, help="the draft to start from")
            p.add_argument("--divergence", choices=["kl", "tvd", "jsd"], default="tvd")
        p.set_defaults(handler=_cmd_train, parser=p)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return args.handler(args, args.parser)


if __name__ == "__main__":
    sys.exit(main())
