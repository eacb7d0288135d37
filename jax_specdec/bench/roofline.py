"""Predicted round costs on an accelerator from its data sheet: a roofline.

A model call costs max(bytes moved / memory bandwidth, FLOPs / peak FLOP/s): at small
batch a decode step reads every weight once and is bound by bandwidth, so scoring N
tokens per row costs about what one does until the FLOPs catch up. A round is the
drafting (a feature head's steps, bandwidth-bound too) plus one verify call of the
target over the round's tokens. Launch overheads, attention kernels' efficiency and
the loop's bookkeeping are left out, so the costs are lower bounds; `predict_rounds`
states them in units of the target's own decode step at the same batch and context,
which is what tokens per round divide.

    python -m jax_specdec.bench.roofline     # the docs' prediction table
"""

from __future__ import annotations

import dataclasses

from jax_specdec.nn import TransformerConfig

__all__ = ["DEVICES", "Device", "call_seconds", "predict_rounds", "round_seconds"]


@dataclasses.dataclass(frozen=True)
class Device:
    """An accelerator's data-sheet figures (dense bfloat16)."""

    name: str
    bandwidth: float  # bytes/s of device memory
    flops: float  # FLOP/s, dense bfloat16


DEVICES = {
    "h200": Device("NVIDIA H200 SXM", 4.8e12, 989e12),
    "v5e": Device("TPU v5e (one chip)", 819e9, 197e12),
}

#: The shapes of the prediction: SmolLM2-135M and a Llama-3.1-8B-shaped target.
SMOLLM2 = TransformerConfig.llama(
    vocab_size=49152, d_model=576, num_layers=30, num_heads=9, num_kv_heads=3,
    head_dim=64, mlp_dim=1536, tie_embeddings=True, max_len=8192,
)  # fmt: skip
LLAMA_8B = TransformerConfig.llama(
    vocab_size=128256, d_model=4096, num_layers=32, num_heads=32, num_kv_heads=8,
    head_dim=128, mlp_dim=14336, max_len=8192,
)  # fmt: skip


def _layer_params(c: TransformerConfig) -> int:
    attn = c.d_model * c.head_dim * (2 * c.num_heads + 2 * c.num_kv_heads)
    return attn + 3 * c.d_model * c.mlp_dim


def call_seconds(
    c: TransformerConfig, device: Device, batch: int, tokens: int, context: int, *,
    layers: int | None = None, vocab: int | None = None, extra_params: int = 0,
) -> float:  # fmt: skip
    """One call of `layers` (default all) decoder layers of shape `c` on `tokens` new
    tokens per row of `batch` rows over `context` cached positions, with an output head
    over `vocab` (default the model's) tokens, in bfloat16 (2 bytes a number)."""
    layers = c.num_layers if layers is None else layers
    vocab = c.vocab_size if vocab is None else vocab
    weights = layers * _layer_params(c) + c.d_model * vocab + extra_params
    kv = 2 * layers * c.num_kv_heads * c.head_dim * batch * context
    moved = 2 * (weights + kv)
    rows = batch * tokens
    flops = 2 * weights * rows + 4 * layers * c.num_heads * c.head_dim * rows * context
    return max(moved / device.bandwidth, flops / device.flops)


def round_seconds(
    c: TransformerConfig, device: Device, batch: int, context: int, *,
    verified: int, head_steps: int, head_rows: int, kept: int,
) -> float:  # fmt: skip
    """A round: a one-layer feature head (its fc 2D -> D and an output head over `kept`
    tokens) run for `head_steps` steps of `head_rows` entries per row, then a target
    call over `verified` tokens per row."""
    head = sum(
        call_seconds(
            c,
            device,
            batch,
            head_rows,
            context,
            layers=1,
            vocab=kept,
            extra_params=2 * c.d_model**2,
        )  # fmt: skip
        for _ in range(head_steps)
    )
    return head + call_seconds(c, device, batch, verified, context)


def predict_rounds(
    c: TransformerConfig, device: Device, batch: int, *, context: int = 1024, kept: int = 8192,
    chains=(4, 8), trees=((8, 6, 2), (16, 6, 4), (32, 6, 8), (64, 6, 10)),
) -> dict[str, float]:  # fmt: skip
    """{round: its cost in target decode steps}: chains of γ (γ head steps, γ + 1
    verified) and trees (nodes, depth, branch): depth head steps, the first on the
    round's chunk, the others on `branch` entries, and nodes + 1 verified."""
    step = call_seconds(c, device, batch, 1, context)
    costs = {}
    for gamma in chains:
        r = round_seconds(c, device, batch, context, verified=gamma + 1, head_steps=gamma,
                          head_rows=1, kept=kept)  # fmt: skip
        costs[f"chain {gamma}"] = r / step
    for nodes, depth, branch in trees:
        r = round_seconds(c, device, batch, context, verified=nodes + 1, head_steps=depth,
                          head_rows=branch, kept=kept)  # fmt: skip
        costs[f"tree {nodes}:{depth}:{branch}"] = r / step
    return costs


def markdown_table(context: int = 1024) -> str:
    """The prediction table of docs/trees.md."""
    lines = []
    for model_name, c in (("SmolLM2-135M", SMOLLM2), ("Llama-3.1-8B shape", LLAMA_8B)):
        for key, device in DEVICES.items():
            for batch in (1, 8, 64):
                costs = predict_rounds(c, device, batch, context=context)
                if not lines:
                    lines.append("| target | device | batch | " + " | ".join(costs) + " |")
                    lines.append("|---" * (3 + len(costs)) + "|")
                cells = " | ".join(f"{v:.2f}" for v in costs.values())
                lines.append(f"| {model_name} | {key} | {batch} | {cells} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown_table())
