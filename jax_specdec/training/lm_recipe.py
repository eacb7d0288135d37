"""Building the shipped model pair end to end: corpus -> tokenizer -> train -> distil -> export.

`jax-specdec train` and `jax-specdec distill` call these; `scripts/build_models.sh`
runs the whole recipe that produced `models/`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib
import platform
import time

import jax
import numpy as np
from flax import nnx

from jax_specdec.nn import Transformer, TransformerConfig
from jax_specdec.training.corpus import Corpus, encode_files, stdlib_corpus, train_tokenizer
from jax_specdec.training.lm import TrainConfig, evaluate_loss, train

__all__ = ["PRESETS", "train_model", "distill_model", "measure_alpha", "benchmark_prompts"]


def _presets(vocab_size: int) -> dict[str, TransformerConfig]:
    # fmt: off
    return {
        # The target: as large as trains to a useful loss in about an hour on 2 CPU cores.
        "target": TransformerConfig.llama(
            vocab_size=vocab_size, d_model=256, num_layers=6, num_heads=8, num_kv_heads=4,
            mlp_dim=768, max_len=1024, tie_embeddings=True),
        # The draft: two narrow layers, about 19x cheaper per decode step than the target
        # (batch 1, this CPU; one layer was 30x, outside the 10-20x the pair aims for).
        "draft": TransformerConfig.llama(
            vocab_size=vocab_size, d_model=128, num_layers=2, num_heads=4, num_kv_heads=2,
            mlp_dim=384, max_len=1024, tie_embeddings=True),
        "tiny": TransformerConfig.tiny(vocab_size=vocab_size, max_len=1024),
    }
    # fmt: on


PRESETS = tuple(_presets(4096))


def _streams(corpus: Corpus, tokenizer, cache_dir: pathlib.Path):
    """Encoded train/validation streams, cached as .npy beside the checkpoints."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    key = "\n".join([tokenizer.to_str(), *corpus.train, "--", *corpus.validation])
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    paths = {k: cache_dir / f"{k}-{digest}.npy" for k in ("train", "validation")}
    if all(p.exists() for p in paths.values()):
        return np.load(paths["train"]), np.load(paths["validation"])
    train_stream = encode_files(tokenizer, corpus.read(corpus.train))
    validation_stream = encode_files(tokenizer, corpus.read(corpus.validation))
    np.save(paths["train"], train_stream)
    np.save(paths["validation"], validation_stream)
    return train_stream, validation_stream


def benchmark_prompts(corpus: Corpus, count: int = 32, chars: int = 240) -> list[str]:
    """Prompts from validation files: the text up to and including a `def` line."""
    prompts = []
    for text in corpus.read(corpus.validation):
        lines = text.splitlines(keepends=True)
        for i, line in enumerate(lines):
            if line.lstrip().startswith("def ") and i > 3:
                prompt = "".join(lines[max(0, i - 6) : i + 1])[-chars:]
                prompts.append(prompt)
                break
        if len(prompts) == count:
            break
    return prompts


def _write_card(out: pathlib.Path, info: dict) -> None:
    (out / "training.json").write_text(json.dumps(info, indent=2, default=str))


MIN_VOCAB = 257  # a byte-level BPE vocabulary holds every byte and <|endoftext|>


def train_model(
    *,
    preset: str,
    out: pathlib.Path,
    config: TrainConfig,
    tokenizer_path: str | None = None,
    vocab_size: int = 4096,
    checkpoint_dir: str | None = None,
) -> dict:
    """Trains a model of `preset` on the standard-library corpus and exports it to `out`."""
    from jax_specdec.io.hf import save_model, tokenizer_from_file

    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {PRESETS}, got {preset!r}")
    corpus = stdlib_corpus()
    if tokenizer_path is not None:
        tokenizer = tokenizer_from_file(tokenizer_path)
    elif vocab_size < MIN_VOCAB:
        raise ValueError(f"vocab_size must be >= {MIN_VOCAB} (256 bytes and <|endoftext|>)")
    else:
        tokenizer = train_tokenizer(corpus.read(corpus.train), vocab_size)
    model_config = _presets(tokenizer.get_vocab_size())[preset]
    checkpoints = pathlib.Path(checkpoint_dir or out / "checkpoints")
    train_stream, validation_stream = _streams(corpus, tokenizer, checkpoints / "data")
    model = Transformer(model_config, rngs=nnx.Rngs(config.seed))
    start = time.perf_counter()
    log = train(model, train_stream, validation_stream, config, checkpoint_dir=checkpoints)
    out.mkdir(parents=True, exist_ok=True)
    save_model(model, out, tokenizer=tokenizer)
    info = {
        "preset": preset,
        "config": model_config.to_dict(),
        "parameters": _count(model),
        "train": dataclasses.asdict(config),
        "train_seconds_this_run": time.perf_counter() - start,
        "train_seconds_total": log["seconds"],
        "tokens_seen": log["tokens_seen"],
        "validation_loss": log["validation_loss"][-1][1] if log["validation_loss"] else None,
        "validation_curve": log["validation_loss"],
        "corpus": {
            "python_version": corpus.python_version,
            "train_files": len(corpus.train),
            "validation_files": len(corpus.validation),
            "train_tokens": int(train_stream.size),
            "validation_tokens": int(validation_stream.size),
            "validation_file_list": corpus.validation,
        },
        "machine": {"processor": platform.processor(), "devices": str(jax.devices())},
    }
    (out / "corpus_files.txt").write_text("\n".join(corpus.train) + "\n")
    _write_card(out, info)
    return {k: v for k, v in info.items() if k not in ("corpus", "validation_curve")}


def _count(model) -> int:
    return int(sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param))))


def measure_alpha(
    target,
    draft,
    prompts_ids,
    *,
    temperature: float,
    gamma: int = 4,
    max_new_tokens: int = 64,
    seed: int = 0,
) -> dict:
    """α and tokens per round of `draft` against `target` on tokenised prompts."""
    from jax_specdec.decode import speculative_generate
    from jax_specdec.sampling import SamplingConfig

    out = speculative_generate(
        target,
        draft,
        prompts_ids,
        key=jax.random.key(seed),
        max_new_tokens=max_new_tokens,
        num_draft_tokens=gamma,
        sampling=SamplingConfig(temperature=temperature),
    )
    return {
        "temperature": temperature,
        "gamma": gamma,
        "alpha": out.stats.alpha,
        "acceptance_rate": out.stats.acceptance_rate,
        "tokens_per_round": out.stats.tokens_per_round(out.lengths),
    }


def distill_model(
    *,
    target_dir: pathlib.Path,
    draft_dir: pathlib.Path,
    out: pathlib.Path,
    config: TrainConfig,
    checkpoint_dir: str | None = None,
) -> dict:
    """Distils the draft in `draft_dir` towards the target (DistillSpec) and exports it."""
    from jax_specdec.io.hf import load_model, load_tokenizer, save_model

    target, draft = load_model(target_dir), load_model(draft_dir)
    tokenizer = load_tokenizer(target_dir)
    corpus = stdlib_corpus()
    checkpoints = pathlib.Path(checkpoint_dir or out / "checkpoints")
    train_stream, validation_stream = _streams(corpus, tokenizer, checkpoints / "data")
    prompts = [tokenizer.encode(p).ids for p in benchmark_prompts(corpus, 16)]
    before = [measure_alpha(target, draft, prompts, temperature=t) for t in (0.0, 1.0)]
    loss_before = evaluate_loss(draft, validation_stream, config)
    log = train(
        draft,
        train_stream,
        validation_stream,
        config,
        checkpoint_dir=checkpoints,
        teacher=target,
    )
    after = [measure_alpha(target, draft, prompts, temperature=t) for t in (0.0, 1.0)]
    out.mkdir(parents=True, exist_ok=True)
    save_model(draft, out, tokenizer=tokenizer)
    info = {
        "distilled_from": str(draft_dir),
        "teacher": str(target_dir),
        "train": dataclasses.asdict(config),
        "train_seconds_total": log["seconds"],
        "tokens_seen": log["tokens_seen"],
        "validation_loss_before": loss_before,
        "validation_loss": evaluate_loss(draft, validation_stream, config),
        "alpha_before": before,
        "alpha_after": after,
        "parameters": _count(draft),
        "config": draft.config.to_dict(),
    }
    _write_card(out, info)
    return info
