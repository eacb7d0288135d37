"""`jax-specdec convert-head IN OUT`: an EAGLE-3 head (the `speculators` format or the
original EAGLE-3 release layout) written in the `speculators` format, which vLLM and
`speculators` load and `load_head` reads back."""

from __future__ import annotations

import sys
from pathlib import Path

from jax_specdec.cli import common


def add_parser(sub) -> None:
    p = sub.add_parser(
        "convert-head",
        help="write an EAGLE-3 head (speculators format or EAGLE-3 release) in the "
        "speculators format (config.json, model.safetensors)",
    )
    p.add_argument("input", help="the head's directory (speculators or EAGLE-3 release)")
    p.add_argument("output", help="the directory to write (created if needed)")
    p.add_argument(
        "--verifier",
        help="the target's Hugging Face id or directory, recorded as the head's verifier "
        "(speculators reads its config when it loads the head)",
    )
    p.add_argument(
        "--aux-layer-ids",
        type=common.ints,
        help="the target layers the head reads, e.g. 2,16,29 (a release does not record "
        "them; default: the head's own, else speculators' 2, L/2, L-3)",
    )
    p.add_argument(
        "--norm-before-residual",
        action="store_true",
        help="the head was trained with norm_before_residual (a release does not record it)",
    )
    p.add_argument(
        "--target",
        help="a Hugging Face model directory: refuse the head unless it drafts for it",
    )
    p.add_argument("--force", action="store_true", help="overwrite a head already in OUTPUT")
    p.set_defaults(handler=run, parser=p)


def run(args, parser) -> int:
    from jax_specdec.io import speculators
    from jax_specdec.io.heads import is_feature_head
    from jax_specdec.io.hub import hub_snapshot, is_hub_id

    try:
        if not Path(args.input).exists() and is_hub_id(args.input):  # org/name[@revision]
            args.input = str(hub_snapshot(args.input, "input"))
        if is_feature_head(args.input):
            raise ValueError(f"{args.input} is a feature head, not an EAGLE-3 head")
        head = speculators.load_eagle3(args.input, **_overrides(args))
        if args.target is not None:
            speculators.check_target(head.config, _target_config(args.target), args.target)
        out = Path(args.output)
        if (out / speculators.CONFIG).exists() and not args.force:
            raise ValueError(f"{out} already holds a {speculators.CONFIG} (--force overwrites)")
        speculators.save_speculators(head, out)
    except (ValueError, OSError) as e:
        common.fail(parser, e)
    c = head.config
    print(
        f"wrote {out}/config.json, model.safetensors: EAGLE-3 head ({c.style}, hidden "
        f"{c.d_model}, draft vocabulary {c.draft_vocab_size} of {c.vocab_size})",
        file=sys.stderr,
    )
    return 0


def _overrides(args) -> dict:
    overrides = {}
    if args.verifier is not None:
        overrides["verifier"] = args.verifier
    if args.aux_layer_ids is not None:
        overrides["aux_layer_ids"] = tuple(args.aux_layer_ids)
    if args.norm_before_residual:
        overrides["norm_before_residual"] = True
    return overrides


def _target_config(path: str):
    import json

    from jax_specdec.io.hf_config import config_from_hf

    file = Path(path) / "config.json"
    if not file.is_file():
        raise ValueError(f"--target: {path} is not a Hugging Face model directory (no config.json)")
    return config_from_hf(json.loads(file.read_text()))
