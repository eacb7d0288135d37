"""One-command device benchmark: step costs and speculative vs autoregressive tokens/s.

On a machine whose Python already has jax with CUDA (nothing else is installed here):

    pip install --no-deps -e .
    python scripts/device_bench.py results/h200          # about 8 minutes on one H200
    python scripts/device_bench.py /tmp/quick --quick    # tiny shapes, CPU, under a minute

Measures, in bfloat16 (random weights; timings do not depend on their values):
1. the step-cost table on a SmolLM2-135M-shaped model: decode calls of 1-8 tokens per row
   (chains) and of 9, 17, 33 and 65 (the verify calls of trees of 8-64 nodes, whose
   cost `jax_specdec.bench.roofline` predicts) at batch 1, 8 and 64 with the cache
   allocated for 256 and 4096 positions (`jax_specdec.bench.decode_step_time`), against
   the bare weight matmuls;
2. speculative vs autoregressive tokens/s (public `speculative_generate` /
   `autoregressive_generate`, timed with `jax_specdec.bench.time_interleaved`) on the
   SmolLM2-shaped target with a 44M draft and with the n-gram proposer, and on a ~1B
   target with the same draft; the draft's embedding is a random projection of the
   target's and both heads are sharpened by the same factor, so their distributions
   agree partly (the acceptance rate α is reported);
3. the attention kernels (einsum, and `jax.nn.dot_product_attention` through XLA and
   cuDNN) at the longest context, at batch 8 (`--kernel-batches`);
4. the per-row sampling transforms (`RowSampling.probs`) on a verify call's logits
   [16, 5, vocab]: temperature only, and a mix of greedy, temperature, top-p and top-k
   rows, against one setting for all rows (`probs_from_logits`);
5. only when named (`--sections load_8b`, about 4 minutes on one H100): an 8B-shaped
   checkpoint written on the machine, loaded onto the mesh by the sharded loader, its
   step and 5-, 17- and 65-token verify calls against the weight-read floor
   (scripts/device_bench_8b.py).

Writes device_bench.json and device_bench.md into the folder named on the command line.
Sections run in order, each within its share of `--budget-s`; cases left when a share is
spent are listed under "skipped" rather than run.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_specdec import NGram, SamplingConfig, autoregressive_generate, speculative_generate
from jax_specdec.bench import bare_matmul_time, decode_step_time, time_call, time_interleaved
from jax_specdec.nn import Transformer, TransformerConfig, attention
from jax_specdec.sampling import RowSampling, probs_from_logits

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from device_bench_8b import load_8b  # noqa: E402
from device_bench_md import markdown  # noqa: E402

FULL = dict(
    # the most telling first, in case the budget runs out; 9-65: tree rounds of 8-64 nodes
    tokens=(1, 5, 2, 3, 8, 4, 9, 17, 33, 65, 6, 7),
    batches=(1, 8, 64),
    caches=((256, 192), (4096, 192), (4096, 3584)),  # (allocated, live context)
    gen_batches=(1, 8),
    gammas=(3,),
    prompt_len=32,
    new_tokens=128,
    repeats=3,
    steps=8,
    kernel_tokens=(1, 5),
    kernel_batches=(8,),
    sampling_shape=(16, 5),  # (rows, tokens per row) of a verify call's logits
    sampling_reps=16,
)
QUICK = dict(
    tokens=(1, 2),
    batches=(1, 2),
    caches=((64, 16),),
    gen_batches=(2,),
    gammas=(2,),
    prompt_len=8,
    new_tokens=8,
    repeats=1,
    steps=2,
    kernel_tokens=(1,),
    kernel_batches=(2,),
    sampling_shape=(4, 3),
    sampling_reps=2,
)


def model_configs(quick: bool, dtype: str) -> dict[str, TransformerConfig]:
    """smollm (SmolLM2-135M's shapes), target_1b (~1.0B) and draft (44M), or tiny
    stand-ins with the same structure for --quick."""
    common = dict(dtype=dtype, param_dtype=dtype, tie_embeddings=True, max_len=8192)
    if quick:
        tiny = dict(vocab_size=512, num_heads=4, num_kv_heads=2, head_dim=16, **common)
        return {
            "smollm": TransformerConfig.llama(d_model=64, num_layers=2, mlp_dim=128, **tiny),
            "target_1b": TransformerConfig.llama(d_model=96, num_layers=3, mlp_dim=192, **tiny),
            "draft": TransformerConfig.llama(d_model=32, num_layers=1, mlp_dim=64, **tiny),
        }
    return {
        "smollm": TransformerConfig.llama(
            vocab_size=49152, d_model=576, num_layers=30, num_heads=9, num_kv_heads=3,
            head_dim=64, mlp_dim=1536, rope_theta=100000.0, norm_eps=1e-5, **common,
        ),
        "target_1b": TransformerConfig.llama(
            vocab_size=49152, d_model=2048, num_layers=20, num_heads=32, num_kv_heads=8,
            head_dim=64, mlp_dim=5632, rope_theta=100000.0, norm_eps=1e-5, **common,
        ),
        "draft": TransformerConfig.llama(
            vocab_size=49152, d_model=512, num_layers=6, num_heads=8, num_kv_heads=4,
            head_dim=64, mlp_dim=1536, rope_theta=100000.0, norm_eps=1e-5, **common,
        ),
    }  # fmt: skip


def parameter_count(model) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def sharpened(config: TransformerConfig, seed: int, sharpness: float, embed=None):
    """A random model whose logits are dominated by the (tied) embedding: small block
    weights, unit-variance embedding rows (`embed` if given), and a final norm scale
    that puts the logit of the last token itself near sharpness * ln(vocab), so it keeps
    about half the probability at sharpness 1 and the rest is spread (peakier above 1)."""
    model = Transformer(config, rngs=nnx.Rngs(seed), init_scale=0.02)
    if embed is None:
        embed = jax.random.normal(jax.random.key(seed + 1000), model.embed.shape, jnp.float32)
    model.embed.set_value(embed.astype(config.jnp_param_dtype))
    level = sharpness * np.log(config.vocab_size) / config.d_model
    scale = jnp.full((config.d_model,), level, jnp.float32)
    model.final_norm.scale.set_value(scale.astype(config.jnp_param_dtype))
    return model


def draft_for(target, config: TransformerConfig, sharpness: float):
    """A draft whose embedding is the target's projected to its width (E P, P ~ N(0, 1/d)):
    E P (E P)^T approximates E E^T, so the two models' logits are correlated."""
    e = target.embed.get_value().astype(jnp.float32)
    p = jax.random.normal(jax.random.key(7), (e.shape[1], config.d_model)) / np.sqrt(config.d_model)
    embed = (e @ p) * np.sqrt(config.d_model / e.shape[1])
    return sharpened(config, 11, sharpness, embed=embed / jnp.std(embed))


class Budget:
    """Splits `total` seconds among named sections, in order; a section may also use
    what earlier sections left."""

    def __init__(self, total: float, shares: dict[str, float]):
        self.start, self.total, self.shares = time.perf_counter(), total, shares
        self.skipped: list[str] = []

    def left(self, section: str) -> float:
        names = list(self.shares)
        upto = sum(self.shares[n] for n in names[: names.index(section) + 1])
        deadline = self.total * upto / sum(self.shares.values())
        return deadline - (time.perf_counter() - self.start)

    def allows(self, section: str, label: str) -> bool:
        if self.left(section) > 0:
            return True
        self.skipped.append(f"{section}: {label}")
        return False


def step_table(model, plan: dict, budget: Budget) -> dict:
    """decode_step_time for every (tokens, batch, cache) case; bare matmuls per batch."""
    bare = {}
    for b in plan["batches"]:
        timing = bare_matmul_time(model, batch=b, steps=plan["steps"], repeats=plan["repeats"])
        bare[b] = 1e3 * timing.median
    rows = []
    for t in plan["tokens"]:
        for b in plan["batches"]:
            for cache_len, context in plan["caches"]:
                label = f"T={t} B={b} cache={cache_len} context={context}"
                if not budget.allows("steps", label):
                    continue
                timing = decode_step_time(
                    model, batch=b, tokens_per_call=t, context=context, cache_len=cache_len,
                    steps=plan["steps"], repeats=plan["repeats"],
                )  # fmt: skip
                rows.append(
                    dict(batch=b, tokens=t, cache_len=cache_len, context=context,
                         ms=1e3 * timing.median, compile_s=timing.compile)
                )  # fmt: skip
    for r in rows:  # ratios to the one-token step of the same batch, cache and context
        place = lambda o: (o["batch"], o["cache_len"], o["context"])  # noqa: E731
        one = [o for o in rows if o["tokens"] == 1 and place(o) == place(r)]
        r["vs_one_token"] = r["ms"] / one[0]["ms"] if one else None
        r["vs_bare"] = r["ms"] / bare[r["batch"]]
    return {"bare_ms": bare, "rows": rows}


def generation(name, target, drafts: dict, plan: dict, budget: Budget, section: str) -> list:
    """Tokens/s of autoregressive decoding and of speculative decoding with each draft
    and γ, at temperature 1, timed interleaved per batch size."""
    sampling = SamplingConfig(temperature=1.0)
    vocab = target.config.vocab_size
    out = []
    for batch in plan["gen_batches"]:
        if not budget.allows(section, f"{name} batch {batch}"):
            continue
        prompts = np.asarray(
            jax.random.randint(jax.random.key(batch), (batch, plan["prompt_len"]), 0, vocab)
        ).tolist()
        common = dict(key=jax.random.key(0), max_new_tokens=plan["new_tokens"], sampling=sampling)
        labels, calls = (
            ["autoregressive"],
            [lambda p=prompts, c=common: autoregressive_generate(target, p, **c).tokens],
        )
        for draft_name, draft in drafts.items():
            for gamma in plan["gammas"]:
                labels.append(f"{draft_name} γ={gamma}")
                calls.append(
                    lambda d=draft, g=gamma, p=prompts, c=common: (
                        speculative_generate(target, d, p, num_draft_tokens=g, **c).tokens
                    )
                )
        timings = time_interleaved(calls, repeats=plan["repeats"])
        ar = timings[0].median
        for label, timing in zip(labels, timings, strict=True):
            row = dict(model=name, batch=batch, method=label, s=timing.median,
                       tokens_per_s=batch * plan["new_tokens"] / timing.median,
                       speedup=ar / timing.median, compile_s=timing.compile)  # fmt: skip
            if label != "autoregressive":
                d_name, gamma = label.split(" γ=")
                stats = speculative_generate(
                    target, drafts[d_name], prompts, num_draft_tokens=int(gamma), **common
                ).stats
                row["alpha"] = float(stats.alpha)
            out.append(row)
    return out


def kernels(model, plan: dict, budget: Budget) -> list:
    """Steps at the longest context with each attention kernel."""
    cache_len, context = plan["caches"][-1]
    rows = []
    for batch, kernel, t in itertools.product(
        plan["kernel_batches"], attention.KERNELS, plan["kernel_tokens"]
    ):
        if not budget.allows("kernels", f"{kernel} batch {batch} T={t}"):
            continue
        row = dict(kernel=kernel, batch=batch, tokens=t, cache_len=cache_len, context=context)
        os.environ["JAX_SPECDEC_ATTENTION"] = kernel
        try:
            timing = decode_step_time(
                model, batch=batch, tokens_per_call=t, context=context, cache_len=cache_len,
                steps=plan["steps"], repeats=plan["repeats"],
            )  # fmt: skip
            row["ms"] = 1e3 * timing.median
        except Exception as error:  # a kernel the device refuses must not end the run
            row["error"] = f"{type(error).__name__}: {str(error)[:300]}"
        finally:
            del os.environ["JAX_SPECDEC_ATTENTION"]
        rows.append(row)
    return rows


MIXES = {
    "one setting, T 1 (probs_from_logits)": None,
    "rows: temperatures only": [SamplingConfig(t) for t in (0.5, 0.7, 1.0, 1.3)],
    "rows: greedy, T 0.7, top-p 0.9, top-k 50": [
        SamplingConfig(0.0),
        SamplingConfig(0.7),
        SamplingConfig(1.0, top_p=0.9),
        SamplingConfig(1.0, top_k=50),
    ],
}


def sampling_transforms(vocab: int, plan: dict, budget: Budget) -> list:
    """Milliseconds per verify call's logits of each sampling transform, timed over
    `sampling_reps` different logits arrays per call (so one call's dispatch is spread)."""
    rows, tokens = plan["sampling_shape"]
    reps = plan["sampling_reps"]
    logits = 3.0 * jax.random.normal(jax.random.key(3), (reps, rows, tokens, vocab))
    out = []
    for label, mix in MIXES.items():
        if not budget.allows("sampling", label):
            continue
        if mix is None:
            fn = jax.jit(jax.vmap(lambda x: probs_from_logits(x, SamplingConfig(1.0))))
        else:
            settings = RowSampling.of([mix[b % len(mix)] for b in range(rows)])
            fn = jax.jit(jax.vmap(settings.probs))
        timing = time_call(lambda f=fn: f(logits), repeats=plan["repeats"] + 2)
        out.append(dict(transform=label, rows=rows, tokens=tokens, vocab=vocab,
                        ms=1e3 * timing.median / reps))  # fmt: skip
    base = out[0]["ms"] if out and out[0]["transform"] == next(iter(MIXES)) else None
    for r in out:
        r["vs_one_setting"] = None if base is None else r["ms"] / base
    return out


SHARES = {"steps": 0.4, "smollm": 0.2, "target_1b": 0.3, "kernels": 0.07, "sampling": 0.03}
# Not run unless named (--sections load_8b): it writes and reads 16 GB (device_bench_8b.py).
OPTIONAL = {"load_8b": 0.4}


def run(out_dir: str, quick: bool, dtype: str, budget_s: float, sharpness: float,
        sections=tuple(SHARES), overrides=None) -> dict:  # fmt: skip
    """The chosen `sections` (of SHARES) with the plan's entries replaced by `overrides`."""
    plan = {**(QUICK if quick else FULL), **(overrides or {})}
    start = time.perf_counter()
    budget = Budget(budget_s, {name: {**SHARES, **OPTIONAL}[name] for name in sections})
    configs = model_configs(quick, dtype)
    smollm = sharpened(configs["smollm"], 0, sharpness)
    result = dict(device=str(jax.devices()[0].device_kind), backend=jax.default_backend(),
                  dtype=dtype, quick=quick, jax=jax.__version__, sections=list(sections),
                  python=platform.python_version(), plan=plan, generation=[],
                  steps={"bare_ms": {}, "rows": []}, kernels=[], sampling=[],
                  parameters={"smollm": parameter_count(smollm)})  # fmt: skip
    marks = [time.perf_counter()]
    if "steps" in sections:
        result["steps"] = step_table(smollm, plan, budget)
        _written(out_dir, result, budget, marks, start)
    if "smollm" in sections:
        draft = draft_for(smollm, configs["draft"], sharpness)
        drafts = {"draft": draft, "ngram": NGram(max_ngram=3)}
        result["generation"] += generation("smollm", smollm, drafts, plan, budget, "smollm")
        _written(out_dir, result, budget, marks, start)
    if "target_1b" in sections:
        target = sharpened(configs["target_1b"], 1, sharpness)
        draft = draft_for(target, configs["draft"], sharpness)
        result["parameters"].update(target_1b=parameter_count(target), draft=parameter_count(draft))
        result["generation"] += generation(
            "target_1b", target, {"draft": draft}, plan, budget, "target_1b"
        )
        _written(out_dir, result, budget, marks, start)
    if "kernels" in sections:
        result["kernels"] = kernels(smollm, plan, budget)
        _written(out_dir, result, budget, marks, start)
    if "sampling" in sections:
        result["sampling"] = sampling_transforms(smollm.config.vocab_size, plan, budget)
        _written(out_dir, result, budget, marks, start)
    if "load_8b" in sections:
        result["load_8b"] = load_8b(quick, lambda label: budget.allows("load_8b", label))
        _written(out_dir, result, budget, marks, start)
    return result


def _written(out_dir: str, result: dict, budget: Budget, marks: list, start: float) -> None:
    """Marks the end of a section and writes what has been measured so far (a run cut
    short by a timeout keeps its finished sections)."""
    marks.append(time.perf_counter())
    done = list(budget.shares)[: len(marks) - 1]
    result["section_s"] = dict(zip(done, np.diff(marks).tolist(), strict=True))
    result["skipped"] = budget.skipped
    result["wall_s"] = time.perf_counter() - start
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "device_bench.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    with open(os.path.join(out_dir, "device_bench.md"), "w") as f:
        f.write(markdown(result))


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out_dir", help="folder for device_bench.json and device_bench.md")
    p.add_argument("--quick", action="store_true", help="tiny shapes: a CPU check in CI time")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--budget-s", type=float, default=None,
                   help="seconds for all measurements (default 420, --quick 120)")  # fmt: skip
    p.add_argument("--sharpness", type=float, default=1.0,
                   help="logit of the repeated token / ln(vocab) in the random models")  # fmt: skip
    p.add_argument("--sections", default=",".join(SHARES),
                   help="comma-separated subset of: " + ", ".join({**SHARES, **OPTIONAL})
                   + " (load_8b only when named: an 8B checkpoint written, loaded onto the "
                   "mesh and timed, about 4 minutes on one H100)")  # fmt: skip
    p.add_argument("--tokens", type=_ints, help="tokens per row of the step table, e.g. 1,5,9")
    p.add_argument("--batches", type=_ints, help="batch sizes of the step table, e.g. 1,8")
    p.add_argument("--kernel-batches", type=_ints, help="batch sizes of the kernel table")
    p.add_argument("--cache-lens", type=_ints,
                   help="allocated caches of the step table (context 192), e.g. 256")  # fmt: skip
    args = p.parse_args(argv)
    sections = tuple(args.sections.split(","))
    known = {**SHARES, **OPTIONAL}
    unknown = set(sections) - set(known)
    if unknown:
        p.error(f"--sections: unknown {sorted(unknown)}; choose from {', '.join(known)}")
    sections = tuple(name for name in known if name in sections)  # the order they run in
    names = ("tokens", "batches", "kernel_batches")
    overrides = {k: getattr(args, k) for k in names if getattr(args, k)}
    if args.cache_lens:
        overrides["caches"] = tuple((c, min(192, c * 3 // 4)) for c in args.cache_lens)
    budget = args.budget_s if args.budget_s is not None else (120.0 if args.quick else 420.0)
    result = run(args.out_dir, args.quick, args.dtype, budget, args.sharpness, sections, overrides)
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
