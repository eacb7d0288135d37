"""`jax-specdec generate`: speculative generation, optionally timed against autoregressive
decoding of the same target."""

from __future__ import annotations

import json
import sys

from jax_specdec.cli import common
from jax_specdec.io.draft import context, load_pair
from jax_specdec.settings import DecodeSettings


def add_parser(sub) -> None:
    gen = sub.add_parser(
        "generate",
        help="speculative generation: the shipped pair by default, SmolLM2-135M with "
        "--target smollm2-135m --draft ngram, or any HF directory / .gguf file",
    )
    gen.add_argument("prompt", nargs="?", help="the prompt; read from stdin when absent")
    gen.add_argument("--prompt-file", help="one prompt per line (\\n for newlines), a batch")
    gen.add_argument(
        "--target",
        default=common.DEFAULT_TARGET,
        help="target model: a Hugging Face directory (config.json + model.safetensors), "
        "a .gguf file (Llama, Qwen2, Mistral), or smollm2-135m (SmolLM2-135M-Instruct, "
        "fetched on first use into ~/.cache/jax_specdec) (default: %(default)s)",
    )
    gen.add_argument(
        "--draft",
        default=common.DEFAULT_DRAFT,
        help="draft: a model directory or .gguf file sharing the target's tokenizer, or "
        "ngram (prompt lookup: drafts copied from the prompt and the text so far, no "
        "model) (default: %(default)s)",
    )
    gen.add_argument("--max-new-tokens", type=int, default=128)
    common.add_round_flags(gen)
    common.add_model_flags(gen)
    common.add_sampling_flags(gen)
    common.add_sample_flags(gen, "prompt")
    gen.add_argument(
        "--chat",
        action="store_true",
        help="wrap each prompt as one user message in the target's own chat template "
        "(tokenizer_config.json, chat_template.jinja or the GGUF's), with the prompt "
        "for the assistant's answer",
    )
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument(
        "--compare",
        action="store_true",
        help="also run autoregressive decoding and print the speedup (medians of 3 runs, "
        "interleaved, compilation apart)",
    )
    gen.add_argument("--json", action="store_true", help="machine-readable output")
    gen.add_argument(
        "--verbose", action="store_true", help="print the memory plan of the call (stderr)"
    )
    gen.set_defaults(handler=run, parser=gen)


def _prompts(args) -> list[str]:
    if args.prompt_file is not None:
        prompts = common.read_prompts(args.prompt_file)
    elif args.prompt is not None:
        prompts = [args.prompt]
    else:
        prompts = [sys.stdin.read()]
    if not prompts or any(not p for p in prompts):
        raise ValueError("the prompt is empty")
    return prompts


def _encode(chat: bool, loaded, prompts: list[str]) -> list[list[int]]:
    """The prompts' ids: as text, or with --chat each as one user message."""
    if not chat:
        return [loaded.tokenizer.encode(p).ids for p in prompts]
    from jax_specdec.io.chat import encode_chat, load_chat_template

    template = load_chat_template(loaded.target_dir)
    if template is None:
        raise ValueError(
            f"--chat: {loaded.target_dir} has no chat template (no chat_template in "
            "tokenizer_config.json, no chat_template.jinja, no tokenizer.chat_template)"
        )
    user = lambda text: [{"role": "user", "content": text}]
    return [encode_chat(loaded.tokenizer, template, user(p)) for p in prompts]


def _keys(seed: int, prompts: int, n: int):
    """The rows' keys: prompt p's sample i (row p * n + i) gets fold_in(key(seed_i), p),
    seed_0 the seed and seed_i `batch.input.sample_seed(seed, i)`; with n = 1 the one key
    (row p: fold_in(key(seed), p) in the loop)."""
    import jax
    import numpy as np

    from jax_specdec.batch.input import sample_seed
    from jax_specdec.decode.request import seed_key_data

    if n == 1:
        return jax.random.wrap_key_data(seed_key_data(seed))  # jax.random.key below 2**32
    fold = jax.vmap(jax.random.fold_in, (None, 0))
    index = np.arange(prompts, dtype=np.uint32)
    keys = [
        fold(jax.random.wrap_key_data(seed_key_data(sample_seed(seed, i))), index) for i in range(n)
    ]
    return jax.numpy.stack(keys, axis=1).reshape(prompts * n)  # row p * n + i


def _generate(settings: DecodeSettings, args, loaded, ids, mesh) -> dict:
    """Runs (and with --compare, times) the speculative and autoregressive programs, each
    prompt's --n samples as rows of one call."""
    import time

    import jax

    from jax_specdec.bench import measure
    from jax_specdec.decode import Generator

    shared = dict(sampling=settings.sampling, eos_token_id=settings.eos_token_id(loaded), mesh=mesh)
    spec = Generator(loaded.target, loaded.draft, **settings.rounds(), **shared)
    key = _keys(settings.seed, len(ids), settings.n)
    ids = [row for row in ids for _ in range(settings.n)]
    outputs = _outputs(settings, loaded.tokenizer)
    start = time.perf_counter()
    run = spec.bind(ids, key=key, max_new_tokens=args.max_new_tokens, **outputs)
    bound = time.perf_counter() - start  # with auto: compiling and measuring the costs
    if args.verbose:
        print(run.memory_plan.describe(), file=sys.stderr)
    menu_tree = run.config.menu_tree  # None also where auto runs autoregressive decoding
    extra = {"stop_ids": spec.stop_ids, "round_costs": run.round_costs, "menu_tree": menu_tree}
    extra["drafts"] = run.config.speculative
    if not args.compare:
        start = time.perf_counter()
        out = jax.block_until_ready(run())
        return {"out": out, "seconds": time.perf_counter() - start, **extra}
    ar_run = Generator(loaded.target, **shared).bind(
        ids, key=key, max_new_tokens=args.max_new_tokens, **outputs
    )
    spec_m, ar_m = measure([run, ar_run], repeats=3)
    setup = bound + spec_m.timing.compile  # the program compiles in bind or its first run
    return {"out": spec_m.output, "seconds": spec_m.seconds, "ar": ar_m, "setup": setup, **extra}


def _outputs(settings: DecodeSettings, tokenizer) -> dict:
    """`Generator.bind`'s stop sequences (each --stop string's tokenization: the program
    ends a row once it emits one) and log-probabilities, where asked for."""
    from jax_specdec import stop_strings

    out = {}
    sequences = stop_strings.token_sequences(tokenizer, settings.stop) if settings.stop else ()
    if sequences:
        out["stop_sequences"] = [list(s) for s in sequences]
    if settings.logprobs is not None:
        out |= dict(logprobs=settings.logprobs, logprob_kind=settings.logprob_kind)
    return out


def _check_finite(args, result) -> None:
    """A ValueError when a row met NaN/inf logits (the checked call of the Python API warns;
    here nothing of such an output is printed)."""
    import numpy as np

    outputs = [result["out"]] + ([result["ar"].output] if "ar" in result else [])
    bad = np.flatnonzero(np.any([np.asarray(o.stats.nonfinite) for o in outputs], axis=0))
    if bad.size:
        prompts = sorted({int(b) // args.n + 1 for b in bad})  # rows: --n per prompt
        raise ValueError(
            f"NaN/inf logits met for prompt(s) {prompts}: the weights of "
            f"--target {args.target} or --draft {args.draft} hold NaN/inf or are corrupt"
        )


def _summary(result: dict) -> dict:
    import numpy as np

    out, seconds = result["out"], result["seconds"]
    lengths = np.asarray(out.lengths)
    summary = {
        "alpha": out.stats.alpha,
        "acceptance_rate": out.stats.acceptance_rate,
        "tokens_per_round": out.stats.tokens_per_round(out.lengths),
        "generated_tokens": int(lengths.sum()),
        "seconds": seconds,
        "tokens_per_second": float(lengths.sum() / seconds),
    }
    widths = np.asarray(out.stats.gamma_rounds)
    tree = result.get("menu_tree")  # auto's tree: the last of the rounds per width
    label = lambda w: f"tree {tree.label}" if tree and w == len(widths) - 1 else int(w)  # noqa: E731
    summary["rounds_per_width"] = {label(w): int(n) for w, n in enumerate(widths) if n}
    if result["round_costs"] is not None:
        costs = result["round_costs"]
        summary["round_costs"] = {"seconds_per_round": list(costs.per_width)}
        summary["round_costs"]["acceptance_prior"] = costs.alpha
        if tree:
            summary["round_costs"]["tree_acceptance_prior"] = costs.tree_alpha
        summary["round_costs"] |= {"source": costs.source, "measuring_seconds": costs.seconds}
        summary["round_costs"]["drafts"] = result["drafts"]
    if "ar" in result:
        ar = result["ar"]
        summary["setup_seconds"] = result["setup"]
        summary["autoregressive_seconds"] = ar.seconds
        summary["speedup"] = ar.seconds / seconds
        same = np.array_equal(np.asarray(ar.output.tokens), np.asarray(out.tokens))
        summary["same_text_as_autoregressive"] = bool(same)
    return summary


def _rows(settings: DecodeSettings, args, prompts, result, tokenizer) -> list[dict]:
    """Each row's output: its prompt (and sample, with --n), text, tokens and finish
    reason, cut at the earliest --stop string (`stop_strings.apply`, with "stop")."""
    import jax
    import numpy as np

    from jax_specdec import stop_strings
    from jax_specdec.decode.logprobs import entries
    from jax_specdec.decode.stats import finish_reasons

    out, rows = result["out"], []
    sequences = stop_strings.token_sequences(tokenizer, settings.stop) if settings.stop else ()
    reasons = finish_reasons(
        out, args.max_new_tokens, result["stop_ids"], [sequences] * len(out.lengths)
    )
    logprobs = None if out.logprobs is None else jax.tree.map(np.asarray, out.logprobs)
    for b, length in enumerate(np.asarray(out.lengths)):
        ids = np.asarray(out.tokens)[b, : int(length)].tolist()
        row = stop_strings.apply(
            ids, tokenizer.decode(ids), reasons[b], settings.stop, tokenizer.decode
        )
        sample = {} if settings.n == 1 else {"sample": b % settings.n}
        line = {"prompt": prompts[b // settings.n], **sample, "text": row.text}
        line |= {"tokens": row.tokens, "finish_reason": row.finish_reason}
        line |= {} if row.stop is None else {"stop": row.stop}
        if settings.logprobs is not None:
            line["logprobs"] = entries(logprobs, b, len(row.tokens), settings.logprobs)
        rows.append(line)
    return rows


def _print(args, rows: list[dict], summary) -> None:
    """Each row's text (with --json all of it), and the summary."""
    if args.json:
        print(json.dumps({"outputs": rows, "stats": summary}, indent=2))
        return
    for row in rows:
        if "sample" in row:
            print(f"[sample {row['sample']}]")
        print(row["prompt"] + row["text"])
        print("-" * 60)
    compared = "speedup" in summary
    line = (
        f"α {summary['alpha']:.3f} · {summary['tokens_per_round']:.2f} tokens/round · "
        f"{summary['generated_tokens']} tokens in {summary['seconds']:.2f} s "
        f"({summary['tokens_per_second']:.1f} tokens/s"
        + (", median of 3)" if compared else _compiled(summary))
    )
    if compared:
        line += (
            f" · autoregressive {summary['autoregressive_seconds']:.2f} s · "
            f"speedup {summary['speedup']:.2f}x"
        )
    print(line, file=sys.stderr)
    if "round_costs" in summary:
        print(_auto_line(summary), file=sys.stderr)


def _compiled(summary: dict) -> str:
    """Whether the one timed run compiled: not when auto compiled while measuring."""
    measured = summary.get("round_costs", {}).get("source") == "measured"
    return ", compiled before)" if measured else ", incl. compilation)"


def _auto_line(summary: dict) -> str:
    """What auto chose: rounds of each draft width, and where its costs came from."""
    chosen = ", ".join(f"{w}: {n}" for w, n in summary["rounds_per_width"].items())
    costs = summary["round_costs"]
    where = {"cache": "read from the cache", "given": "given"}.get(costs["source"])
    where = where or f"measured in {costs['measuring_seconds']:.1f} s, cached"
    line = f"auto: rounds per draft width {{{chosen}}} (0: a plain step) · round costs {where}"
    if not costs["drafts"]:
        line = (
            "auto: no draft width pays at the first round (its costs, the prior's acceptance): "
            f"autoregressive decoding's program, {summary['rounds_per_width'].get(0, 0)} steps · "
            f"round costs {where}"
        )
    if "setup_seconds" in summary:
        line += f" · compiling{' and measuring' if costs['source'] == 'measured' else ''} "
        line += f"{summary['setup_seconds']:.1f} s"
    return line


def run(args, parser) -> int:
    from jax_specdec.settings import parse_mesh

    try:
        settings = DecodeSettings.from_args(args, draft=args.draft)
        if settings.logprobs is not None and not args.json:
            raise ValueError("--logprobs needs --json (the values go with each output)")
        prompts = _prompts(args)
        mesh = parse_mesh(settings.mesh)
        loaded = load_pair(settings.target, settings.draft, dtype=settings.dtype, mesh=mesh)
        settings.check_context(context(loaded.target, loaded.draft))
        tokenizer = loaded.tokenizer
        ids = _encode(args.chat, loaded, prompts)
        result = _generate(settings, args, loaded, ids, mesh)
        _check_finite(args, result)
    except (ValueError, OSError) as e:
        common.fail(parser, e)
    rows = _rows(settings, args, prompts, result, tokenizer)
    _print(args, rows, _summary(result))
    return 0
