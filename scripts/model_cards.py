"""Measures the shipped pair and writes its model cards, prompt set and figures.

    python scripts/model_cards.py               # after scripts/build_models.sh
    python scripts/model_cards.py --from-json   # shipped_pair.md again from its JSON

Writes models/prompts.txt (benchmark prompts from the validation files, one per line,
newlines escaped as \\n), models/stdlib-{target,draft}/README.md and
<out>/shipped_pair.{json,md} (default out: bench_out/shipped_pair, git-ignored):
validation losses, α before/after distillation, and the greedy speedup over
autoregressive decoding at batch 1 with its cost-model breakdown (docs/drafters.md
quotes them).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import jax
import numpy as np

from jax_specdec.bench import decode_step_time, expected_tokens_per_round, measure
from jax_specdec.decode import Generator
from jax_specdec.io.hf import load_model, load_tokenizer
from jax_specdec.report import markdown_table
from jax_specdec.sampling import SamplingConfig
from jax_specdec.training.corpus import stdlib_corpus
from jax_specdec.training.lm_recipe import benchmark_prompts

ROOT = pathlib.Path(__file__).resolve().parent.parent
MODELS = ROOT / "models"
OUT = ROOT / "bench_out" / "shipped_pair"
GAMMAS = (1, 2, 3, 4, 6)
NUM_PROMPTS = 8
MAX_NEW = 128


def _speed(target, draft, prompts, sampling):
    """Batch 1, each prompt alone: autoregressive decoding and one speculative run per γ,
    timed interleaved (`measure`). Returns the autoregressive seconds (sum over prompts
    of medians) and per γ (seconds, α, tokens per round)."""
    ar_t, spec_t = 0.0, np.zeros(len(GAMMAS))
    accepted, rejections, rounds, tokens = (np.zeros(len(GAMMAS), int) for _ in range(4))
    generators = [Generator(target, sampling=sampling)]
    generators += [Generator(target, draft, schedule=g, sampling=sampling) for g in GAMMAS]
    for ids in prompts:
        runs = [g.bind([ids], key=jax.random.key(0), max_new_tokens=MAX_NEW) for g in generators]
        ar, *spec = measure(runs, 5)
        ar_t += ar.seconds
        for i, m in enumerate(spec):
            s = m.stats
            spec_t[i] += m.seconds
            accepted[i] += int(s.accepted.sum())
            rejections[i] += int(s.rejected.sum())
            rounds[i] += int(s.rounds.sum())
            tokens[i] += m.tokens - 1
        jax.clear_caches()
    alpha = accepted / np.maximum(accepted + rejections, 1)
    return ar_t, list(zip(spec_t, alpha, tokens / np.maximum(rounds, 1), strict=True))


def _layers(n: int) -> str:
    return f"{n} layer" + "s" * (n > 1)


def _write_pair_doc(out: pathlib.Path, figures: dict, d_info: dict) -> tuple[str, str]:
    """shipped_pair.md from the measured figures; returns its two tables."""
    speed_md = markdown_table(
        ["γ", "speedup", "predicted", "α", "tokens/round", "verify ms", "round parts ms"],
        [
            [r["gamma"], f"{r['speedup']:.2f}", f"{r['predicted_speedup']:.2f}",
             f"{r['alpha']:.3f}", f"{r['tokens_per_round']:.2f}", f"{r['verify_ms']:.2f}",
             f"{r['round_parts_ms']:.2f}"]
            for r in figures["greedy_batch1"]
        ],
    )  # fmt: skip
    alphas = []
    for label, key in (("before distillation", "alpha_before"), ("after", "alpha_after")):
        a = {x["temperature"]: x["alpha"] for x in d_info[key]}
        alphas.append([label, f"{a[0.0]:.3f}", f"{a[1.0]:.3f}"])
    alpha_md = markdown_table(["draft", "α greedy", "α temperature 1"], alphas)
    (out / "shipped_pair.md").write_text(
        f"# The shipped pair, measured\n\nGreedy, batch 1, {figures['prompts']} prompts from "
        f"`models/prompts.txt`, {figures['max_new_tokens']} new tokens each; target decode "
        f"step {figures['target_step_ms']:.2f} ms, draft step {figures['draft_step_ms']:.3f} ms "
        f"({figures['draft_cost_ratio']:.1f}x cheaper). Autoregressive and speculative "
        f"programs are timed interleaved, medians of 5 runs.\n\n{speed_md}\n\n{alpha_md}\n\n"
        "Reproduce: `python scripts/model_cards.py` (`--from-json` rewrites this page from "
        "`shipped_pair.json` without measuring).\n"
    )
    return speed_md, alpha_md


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=pathlib.Path, default=OUT, help="(default: %(default)s)")
    p.add_argument("--from-json", action="store_true", help="<out>/shipped_pair.md again")
    args = p.parse_args(argv)
    target_dir, draft_dir = MODELS / "stdlib-target", MODELS / "stdlib-draft"
    if args.from_json:
        figures = json.loads((args.out / "shipped_pair.json").read_text())
        _write_pair_doc(args.out, figures, json.loads((draft_dir / "training.json").read_text()))
        return 0
    target, draft = load_model(target_dir), load_model(draft_dir)
    tokenizer = load_tokenizer(target_dir)
    prompts_text = benchmark_prompts(stdlib_corpus(), 32)
    (MODELS / "prompts.txt").write_text(
        "".join(p.replace("\\", "\\\\").replace("\n", "\\n") + "\n" for p in prompts_text)
    )
    prompts = [tokenizer.encode(p).ids for p in prompts_text[:NUM_PROMPTS]]
    steps, rows = _measure(target, draft, prompts)
    t_info = json.loads((target_dir / "training.json").read_text())
    d_info = json.loads((draft_dir / "training.json").read_text())
    figures = {
        "target_validation_loss": t_info["validation_loss"],
        "draft_validation_loss_before_distillation": d_info["validation_loss_before"],
        "draft_validation_loss": d_info["validation_loss"],
        "alpha_before": d_info["alpha_before"],
        "alpha_after": d_info["alpha_after"],
        "target_step_ms": 1e3 * steps["target"],
        "draft_step_ms": 1e3 * steps["draft"],
        "draft_cost_ratio": steps["target"] / steps["draft"],
        "greedy_batch1": rows,
        "prompts": NUM_PROMPTS,
        "max_new_tokens": MAX_NEW,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "shipped_pair.json").write_text(json.dumps(figures, indent=2))
    speed_md, alpha_md = _write_pair_doc(args.out, figures, d_info)
    _write_cards(target_dir, draft_dir, tokenizer, steps, (speed_md, alpha_md))
    print(speed_md)
    print(alpha_md)
    return 0


def _measure(target, draft, prompts) -> tuple[dict, list[dict]]:
    """One-step times of target and draft ({"target", "draft", "draft_first"}, seconds)
    and a row per γ: speed against autoregressive decoding, α, tokens per round, the
    verify's time and the speed-up the step times predict."""
    context = int(np.mean([len(p) for p in prompts])) + MAX_NEW // 2
    cache_len = max(len(p) for p in prompts) + MAX_NEW + max(GAMMAS)

    def part(model, tokens):
        return decode_step_time(
            model, batch=1, tokens_per_call=tokens, context=context, cache_len=cache_len
        ).median

    steps = {"target": part(target, 1), "draft": part(draft, 1), "draft_first": part(draft, 2)}
    ar_time, speeds = _speed(target, draft, prompts, SamplingConfig(temperature=0.0))
    rows = []
    for gamma, (spec_time, alpha, tpr) in zip(GAMMAS, speeds, strict=True):
        verify = part(target, gamma + 1)
        round_parts = steps["draft_first"] + (gamma - 1) * steps["draft"] + verify
        predicted = expected_tokens_per_round(alpha, gamma) * steps["target"] / round_parts
        rows.append(
            {
                "gamma": gamma,
                "speedup": ar_time / spec_time,
                "alpha": alpha,
                "tokens_per_round": tpr,
                "verify_ms": 1e3 * verify,
                "round_parts_ms": 1e3 * round_parts,
                "predicted_speedup": predicted,
            }
        )
        print(rows[-1], file=sys.stderr)
    return steps, rows


def _write_cards(target_dir, draft_dir, tokenizer, steps: dict, tables) -> None:
    """The README.md of each shipped model: what it is, its corpus, how it was trained,
    and the pair's `tables` (speed, acceptance)."""
    t_info = json.loads((target_dir / "training.json").read_text())
    d_info = json.loads((draft_dir / "training.json").read_text())
    pre = json.loads((draft_dir / "pretraining.json").read_text())
    speed_md, alpha_md = tables
    corpus_line = (
        f"the .py files of the Python {t_info['corpus']['python_version']} standard library "
        f"(tests, IDLE, tkinter, lib2to3 excluded): {t_info['corpus']['train_files']} training "
        f"files ({t_info['corpus']['train_tokens']:,} tokens, listed in "
        f"`stdlib-target/corpus_files.txt`) and {t_info['corpus']['validation_files']} "
        "validation files "
        f"({t_info['corpus']['validation_tokens']:,} tokens), split by a hash of the path"
    )
    cards = {
        target_dir: (
            "stdlib-target",
            f"Llama-style target, {t_info['parameters']:,} parameters "
            f"(d={t_info['config']['d_model']}, {t_info['config']['num_layers']} layers, "
            f"{t_info['config']['num_heads']} heads / {t_info['config']['num_kv_heads']} "
            f"key-value heads, SwiGLU {t_info['config']['mlp_dim']}, tied embeddings).",
            f"Trained {t_info['train']['steps']} steps of {t_info['train']['batch_size']}x"
            f"{t_info['train']['seq_len']} tokens ({t_info['tokens_seen']:,} tokens) in "
            f"{t_info['train_seconds_total'] / 60:.0f} min on 2 CPU cores; validation loss "
            f"{t_info['validation_loss']:.3f} nats/token.",
        ),
        draft_dir: (
            "stdlib-draft",
            f"Llama-style draft, {d_info['parameters']:,} parameters "
            f"(d={d_info['config']['d_model']}, {_layers(d_info['config']['num_layers'])}), "
            f"{steps['target'] / steps['draft']:.0f}x cheaper per decode step than the target.",
            f"Pre-trained {pre['train']['steps']} steps ({pre['tokens_seen']:,} tokens, "
            f"{pre['train_seconds_total'] / 60:.0f} min, validation loss "
            f"{pre['validation_loss']:.3f}), then distilled towards stdlib-target for "
            f"{d_info['train']['steps']} steps with the {d_info['train']['divergence']} "
            f"divergence (DistillSpec) in {d_info['train_seconds_total'] / 60:.0f} min; "
            f"validation loss {d_info['validation_loss']:.3f}.",
        ),
    }
    for directory, (name, what, how) in cards.items():
        (directory / "README.md").write_text(
            f"# {name}\n\n{what}\n\nCorpus: {corpus_line}. Byte-level BPE tokenizer with "
            f"{tokenizer.get_vocab_size()} tokens (`tokenizer.json`, shared by the pair), "
            "trained on the same files.\n\n"
            f"{how}\n\nAcceptance of the draft against the target (γ = 4, 16 validation "
            f"prompts, 64 tokens):\n\n{alpha_md}\n\nSpeculative vs autoregressive decoding, "
            f"greedy, batch 1:\n\n{speed_md}\n\nLoad with `jax_specdec.io.hf.load_model` or "
            "`transformers.AutoModelForCausalLM.from_pretrained`. `training.json` holds the "
            "full training record. Built by `scripts/build_models.sh`.\n"
        )


if __name__ == "__main__":
    sys.exit(main())
