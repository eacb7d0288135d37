"""`jax-specdec train` and `jax-specdec distill`: models trained on the standard-library
corpus, and drafts distilled towards a target."""

from __future__ import annotations

from jax_specdec.cli import common

PRESETS = ("target", "draft", "tiny")


def add_parser(sub) -> None:
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
            p.add_argument("--preset", choices=PRESETS, default="target")
            p.add_argument("--tokenizer", help="tokenizer.json to use (default: train one)")
            p.add_argument("--vocab-size", type=int, default=4096)
        else:
            p.add_argument("--target", default=common.DEFAULT_TARGET)
            p.add_argument("--draft", default=common.DEFAULT_DRAFT, help="the draft to start from")
            p.add_argument("--divergence", choices=["kl", "tvd", "jsd"], default="tvd")
        p.set_defaults(handler=run, parser=p)


def run(args, parser) -> int:
    import json
    import pathlib

    from jax_specdec.training.lm import TrainConfig

    try:
        config = common.config_from_args(TrainConfig, args)
    except ValueError as e:
        common.fail(parser, e)
    from jax_specdec.training import lm_recipe as workflow

    out = pathlib.Path(args.out)
    if out.exists() and not out.is_dir():
        common.fail(parser, ValueError(f"--out: {out} is a file, not a directory"))
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
            from jax_specdec.io.locate import locate

            result = workflow.distill_model(
                target_dir=locate(args.target, "target"),
                draft_dir=locate(args.draft, "draft"),
                out=out,
                config=config,
                checkpoint_dir=args.checkpoint_dir,
            )
    except (ValueError, OSError) as e:
        common.fail(parser, e)
    print(json.dumps(result, indent=2))
    return 0
