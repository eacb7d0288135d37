"""No longer runs (see the SystemExit below); kept as the record of its run.

Probe variants of the feature head on the same windows, seed and steps; held-out
agreement per draft step. Variants (`--variants`):

- "top": the shipped recipe's head (one layer, K 8192, unroll 3, feature weight 0.1),
  reading the target's top feature as today;
- "fused": EAGLE-3's fused features (Li et al. 2025, arXiv 2503.01840): the head reads
  fuse([top; rms(h_a); rms(h_b); ...]) of the hidden states after decoder blocks
  `--layers`, a learned D x nD map that starts as the identity on the top slot (so it
  starts as the same function as "top");
- "blockN": "top" with its decoder layer started as the target's block N (0-based)
  instead of random weights; for N = 0 its FC also starts as a pass-through of the
  token embedding, which is what block 0 reads.

Stage 1 extracts, for windows spread over the training corpus and for the held-out
windows, the target's top features (after the final norm), its greedy tokens and the
hidden states after `--layers` (resumable, in parts). Stage 2 trains each variant.
Writes JSON lines to --out.

  python scripts/experiments/head_probe/head_probe.py --work-dir ~/.cache/jax_specdec/fused \
      --source ~/.cache/jax_specdec/head18/text-spread-t128-n2000000 --windows 2400 \
      --steps 1000 --variants top fused --out fused_probe.jsonl
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

raise SystemExit(
    "this probe no longer runs: it used jax_specdec.training.head_train._loss (private), "
    "which takes a five-part batch since 8f59e4d; see git history before 8f59e4d"
)

from jax_specdec.io import zoo  # noqa: E402
from jax_specdec.io.hf import load_model  # noqa: E402
from jax_specdec.nn.attention import heads_first  # noqa: E402
from jax_specdec.nn.feature_head import FeatureHead, FeatureHeadConfig, previous_features  # noqa: E402
from jax_specdec.training import head_train  # noqa: E402
from jax_specdec.training.head_data import FeatureSet, kept_vocabulary  # noqa: E402
from jax_specdec.training.head_train import (  # noqa: E402
    HeadTrainConfig,
    feature_scale,
    init_from_target,
    output_rows,
)

_F32 = jnp.float32


@functools.partial(jax.jit, static_argnums=(0, 3))
def _forward(graphdef, state, tokens, layers):
    """Top features, greedy tokens and the hidden states after `layers` [B, T, n, D]."""
    target = nnx.merge(graphdef, state)
    B, T = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (B, T, T))
    x = target._embed(tokens, positions)
    taken = []
    for i, block in enumerate(target.blocks):
        q, k, v = block.attn.project(block.attn_norm(x), positions)
        x = x + block.attn.attend(q, [(heads_first(k), heads_first(v), mask)])
        x = x + block.mlp(block.mlp_norm(x))
        if i in layers:
            taken.append(x)
    h = target.final_norm(x)
    greedy = jnp.argmax(target._logits(h), axis=-1).astype(jnp.int32)
    f16 = jnp.float16
    return h.astype(f16), greedy, jnp.stack(taken, axis=2).astype(f16)


def extract(target, windows, directory: pathlib.Path, layers, batch=8):
    parts = directory / "parts"
    parts.mkdir(parents=True, exist_ok=True)
    graphdef, state = nnx.split(target)
    for start in tqdm(range(0, len(windows), batch), desc=directory.name, unit="batch"):
        file = parts / f"{start:08d}.npz"
        tokens = windows[start : start + batch]
        if file.exists():
            if not np.array_equal(np.load(file)["tokens"], tokens):
                raise ValueError(f"{file} holds other windows: use another --work-dir")
            continue
        top, greedy, mid = _forward(graphdef, state, jnp.asarray(tokens), tuple(layers))
        tmp = file.with_suffix(".tmp.npz")
        np.savez(tmp, tokens=tokens, top=np.asarray(top), greedy=np.asarray(greedy), mid=mid)
        tmp.rename(file)
    files = sorted(parts.glob("*[0-9].npz"))
    loaded = [np.load(f) for f in files]
    return {k: np.concatenate([p[k] for p in loaded]) for k in ("tokens", "top", "greedy", "mid")}


class Fused(nnx.Module):
    """A feature head whose first-pass input is a learned map of several layers."""

    def __init__(self, head: FeatureHead, count: int, fused: bool):
        d = head.config.d_model
        start = jnp.zeros((count * d, d), _F32).at[:d].set(jnp.eye(d))
        self.fuse = nnx.Param(start) if fused else None
        self.head = head

    def first_input(self, top, mid):
        if self.fuse is None:
            return top
        rms = jnp.sqrt(jnp.mean(jnp.square(mid), axis=-1, keepdims=True) + 1e-6)
        B, T, n, d = mid.shape
        both = jnp.concatenate([top, (mid / rms).reshape(B, T, n * d)], axis=-1)
        return both @ self.fuse[...]


class _AsHead:
    """A `Fused` model as the library's head loss sees a head: `vocab_map`, and
    `unrolled(prev, ...)` whose first pass reads `first_input` of the previous position's
    top feature (`prev`) and hidden states. Shifting by one position commutes with
    `first_input` (it acts on each position alone and maps zeros to zeros), so this is
    the head fed previous_features(first_input(top, mid))."""

    def __init__(self, model: Fused, mid):
        self.model, self.mid = model, mid.astype(_F32)

    @property
    def vocab_map(self):
        return self.model.head.vocab_map

    def unrolled(self, prev, tokens, embed, steps):
        prev_mid = jnp.pad(self.mid[:, :-1], ((0, 0), (1, 0), (0, 0), (0, 0)))
        first = self.model.first_input(prev, prev_mid)
        return self.model.head.unrolled(first, tokens, embed, steps)


def _passes(model, tokens, top, mid, embed, steps):
    return _AsHead(model, mid).unrolled(previous_features(top), tokens, embed, steps)


@nnx.jit(static_argnames="config")
def _train_step(model, optimizer, batch, embed, out_rows, scale, config):
    """One AdamW step on the library's head loss (`head_train._loss`: cross-entropy to the
    target's kept-token distribution plus the weighted feature regression, on every
    unrolled draft step)."""
    tokens, top, greedy, mid = batch

    def loss_fn(m):
        as_head, batch3 = _AsHead(m, mid), (tokens, top, greedy)
        return head_train._loss(as_head, batch3, embed, out_rows, scale, config)

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


@nnx.jit(static_argnames="steps")
def _agree(model, batch, embed, steps):
    tokens, top, greedy, mid = batch
    passes = _passes(model, tokens, top.astype(_F32), mid.astype(_F32), embed, steps)
    hits = []
    for s, (logits, _) in enumerate(passes):
        guess = model.head.vocab_map[...][jnp.argmax(logits, axis=-1)]
        hits.append(jnp.mean((guess == greedy)[:, s + 1 :]))
    return jnp.stack(hits)


def agreement(model, data, embed, steps=3, batch=8):
    count = len(data["tokens"]) // batch
    totals = np.zeros(steps)
    for i in range(count):
        part = tuple(jnp.asarray(data[k][i * batch : (i + 1) * batch]) for k in _KEYS)
        totals += np.asarray(_agree(model, part, embed, steps))
    return (totals / count).round(4).tolist()


_KEYS = ("tokens", "top", "greedy", "mid")


def _block_from_target(head: FeatureHead, target, layer: int) -> None:
    """Starts the head's decoder layer as the target's layer `layer`; from layer 0 the
    FC also starts as a pass-through of the token embedding (what layer 0 reads)."""
    nnx.update(head.blocks[0], nnx.state(target.blocks[layer]))
    if layer == 0:
        d = head.config.d_model
        fc = jnp.zeros((2 * d, d), _F32).at[d:].set(jnp.eye(d))
        head.fc.kernel.set_value(fc.astype(head.fc.kernel[...].dtype))


def train(name, fused, target, data, valid, config, args):
    head_config = FeatureHeadConfig.for_target(target.config, args.kept, num_layers=1)
    head = FeatureHead(head_config, rngs=nnx.Rngs(0))
    as_set = FeatureSet(data["tokens"], data["top"], data["greedy"])
    kept = kept_vocabulary(as_set, args.kept, target.config.vocab_size)
    init_from_target(head, target, kept)
    if name.startswith("block"):
        _block_from_target(head, target, int(name[len("block") :]))
    model = Fused(head, 1 + len(args.layers), fused)
    optimizer = nnx.Optimizer(model, config.optimizer(), wrt=nnx.Param)
    embed, out_rows = target.embed[...], output_rows(target)
    scale = feature_scale(as_set)
    rows = []
    start = time.perf_counter()
    bar = tqdm(range(config.steps), desc=name)
    for step in bar:
        pick = np.random.default_rng([config.seed, step]).integers(
            0, len(data["tokens"]), config.batch_size
        )
        batch = tuple(jnp.asarray(data[k][pick]) for k in _KEYS)
        loss = _train_step(model, optimizer, batch, embed, out_rows, scale, config)
        if (step + 1) % args.eval_every == 0 or step + 1 == config.steps:
            seconds = time.perf_counter() - start
            row = {
                "variant": name,
                "step": step + 1,
                "loss": round(float(loss), 4),
                "agreement_per_step": agreement(model, valid, embed),
                "train_seconds": round(seconds, 1),
                "train_tokens": int(data["tokens"].size),
                "layers": args.layers if fused else [],
            }
            rows.append(row)
            tqdm.write(json.dumps(row))
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")
    return rows


def _tokens(directory: pathlib.Path) -> np.ndarray:
    """The windows of a train-drafter feature folder, without loading its features."""
    files = sorted((directory / "parts").glob("*[0-9].npz"))
    if not files:
        raise FileNotFoundError(f"no feature parts under {directory}/parts")
    return np.concatenate([np.load(f)["tokens"] for f in files])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work-dir", required=True, type=pathlib.Path)
    p.add_argument("--source", required=True, help="a train-drafter feature folder (windows)")
    p.add_argument("--valid", help="held-out feature folder (default: <source>/../valid-t128)")
    p.add_argument("--windows", type=int, default=2400)
    p.add_argument("--layers", type=int, nargs="+", default=[2, 15, 27])
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--kept", type=int, default=8192)
    p.add_argument("--variants", nargs="+", default=["top", "fused"], help="top, fused, blockN")
    p.add_argument("--extract-only", action="store_true")
    p.add_argument("--out", default="fused_probe.jsonl")
    args = p.parse_args()
    zoo.enable_compilation_cache(True)
    target = load_model(zoo.resolve("smollm2-135m"))
    blocks = {f"block{i}" for i in range(target.config.num_layers)}
    unknown = [v for v in args.variants if v not in {"top", "fused", *blocks}]
    if unknown:
        p.error(f"--variants: unknown {unknown}; use top, fused or block0 … block{len(blocks) - 1}")
    source = pathlib.Path(args.source)
    windows = _tokens(source)
    pick = np.linspace(0, len(windows) - 1, min(args.windows, len(windows))).round().astype(int)
    valid_windows = _tokens(pathlib.Path(args.valid or source.parent / "valid-t128"))
    tag = "-".join(map(str, args.layers))
    valid = extract(target, valid_windows, args.work_dir / f"valid-{tag}", args.layers)
    data = extract(target, windows[pick], args.work_dir / f"train{len(pick)}-{tag}", args.layers)
    if args.extract_only:
        return
    config = HeadTrainConfig(steps=args.steps, learning_rate=1e-3, feature_weight=0.1, unroll=3)
    for name in args.variants:
        train(name, name == "fused", target, data, valid, config, args)


if __name__ == "__main__":
    main()
