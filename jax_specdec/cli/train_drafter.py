"""`jax-specdec train-drafter`: a drafter head with a truncated vocabulary for a frozen
target, trained on its features: a feature head (EAGLE-style, our format) or an EAGLE-3
head (the `speculators` format), over a corpus or over text the target writes itself."""

from __future__ import annotations

from jax_specdec.cli import common


def add_parser(sub) -> None:
    p = sub.add_parser(
        "train-drafter",
        help="train a drafter that reads the target's hidden states (resumable)",
    )
    p.add_argument("--target", required=True, help="model directory, .gguf or smollm2-135m")
    p.add_argument("--corpus", default="stdlib", help="'stdlib' or a directory of .py files")
    p.add_argument("--out", required=True, help="the head's output directory")
    p.add_argument("--work-dir", help="features and checkpoints (default: <out>.work)")
    p.add_argument("--run-name", default="head", help="checkpoint folder under <work-dir>/runs")
    p.add_argument(
        "--kind",
        choices=["feature", "eagle3"],
        default="feature",
        help="feature: our feature head; eagle3: an EAGLE-3 head reading three target "
        "layers, written in the speculators format",
    )
    _add_data_flags(p)
    _add_training_flags(p)
    p.set_defaults(handler=run, parser=p)


def _add_data_flags(p) -> None:
    """What the head reads, and what it learns from."""
    p.add_argument(
        "--aux-layers",
        help="--kind eagle3: the target layer ids it reads, e.g. 2,15,27 (default: a low, "
        "a middle and a high one)",
    )
    p.add_argument(
        "--data",
        choices=["text", "greedy", "self"],
        default="text",
        help="text: corpus windows; greedy: corpus prompts and the target's greedy "
        "continuations; self: chat requests and code openings and the target's own "
        "continuations (greedy or sampled)",
    )
    p.add_argument(
        "--temperature", type=float, default=0.8, help="--data self: of the sampled rows"
    )
    p.add_argument(
        "--code-share", type=float, default=0.5, help="--data self: share of code prompts"
    )
    p.add_argument("--tokens", type=int, default=150_000, help="training tokens to extract")
    p.add_argument(
        "--spread",
        action="store_true",
        help="--data text: windows spaced evenly over the corpus, not its first --tokens",
    )
    p.add_argument(
        "--validation-tokens", type=int, default=8192, help="held-out tokens (agreement)"
    )
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument(
        "--prompt-len",
        type=int,
        default=32,
        help="--data greedy: the corpus prefix; --data self: the longest prompt kept",
    )


def _add_training_flags(p) -> None:
    """The head's shape, the optimisation and where the run stops and saves."""
    p.add_argument("--kept", type=int, help="tokens the head scores (8192, or --init's)")
    p.add_argument("--layers", type=int, help="decoder layers (1, or --init's)")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--learning-rate", type=float, default=1e-3)
    p.add_argument(
        "--feature-weight",
        type=float,
        help="feature regression (feature heads only; default 0.1)",
    )
    p.add_argument("--ce-weight", type=float, default=1.0, help="cross-entropy to the target")
    p.add_argument(
        "--unroll",
        type=int,
        choices=range(1, 9),
        default=1,
        help="draft steps trained as the loop runs them",
    )
    p.add_argument("--checkpoint-every", type=int, default=100)
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--stop-after",
        type=int,
        help="stop at this step and save the head as it is; the same command without it "
        "(or with a later step) continues the run",
    )
    p.add_argument(
        "--weights-dtype",
        choices=["float32", "float16"],
        default="float32",
        help="type of the saved weights (float16 halves the directory and what a draft "
        "step reads; it computes in float32 either way)",
    )
    p.add_argument(
        "--init",
        help="a head directory to start from (same shape and target; its kept tokens are "
        "kept), e.g. to train a head further on more data under a new --run-name",
    )


def _configs(args):
    from jax_specdec.training.head_recipe import DataConfig
    from jax_specdec.training.head_train import HeadTrainConfig

    if args.kind == "eagle3" and args.feature_weight is not None:
        raise ValueError(
            "--feature-weight applies to --kind feature (EAGLE-3 heads learn "
            "from the cross-entropy alone)"
        )
    if args.kind == "eagle3" and args.init is not None:
        raise ValueError("--init applies to --kind feature")
    if args.kind == "feature" and args.aux_layers is not None:
        raise ValueError("--aux-layers applies to --kind eagle3")
    weight = 0.0 if args.kind == "eagle3" else (args.feature_weight or 0.1)
    data = common.config_from_args(DataConfig, args, kind=args.data)
    return data, common.config_from_args(HeadTrainConfig, args, feature_weight=weight)


def _aux_layers(args):
    if args.aux_layers is None:
        return None
    try:
        return tuple(int(i) for i in args.aux_layers.split(","))
    except ValueError:
        raise ValueError(
            f"--aux-layers must be comma-separated layer ids, got {args.aux_layers!r}"
        ) from None


def run(args, parser) -> int:
    import json
    import pathlib

    try:
        data, train = _configs(args)
        aux_layers = _aux_layers(args)
    except ValueError as e:
        common.fail(parser, e)
    from jax_specdec.io.hf import load_model, load_tokenizer
    from jax_specdec.io.locate import locate
    from jax_specdec.training.head_recipe import build_head

    work_dir = pathlib.Path(args.work_dir or f"{args.out}.work")
    if pathlib.Path(args.out).is_file():
        common.fail(parser, ValueError(f"--out: {args.out} is a file, not a directory"))
    try:
        target_dir = locate(args.target, "target")
        summary = build_head(
            load_model(target_dir),
            load_tokenizer(target_dir),
            out=args.out,
            work_dir=work_dir,
            data=data,
            train=train,
            kept=args.kept,
            layers=args.layers,
            run_name=args.run_name,
            target_name=str(args.target),
            stop_after=args.stop_after,
            weights_dtype=args.weights_dtype,
            init=args.init,
            kind=args.kind,
            aux_layers=aux_layers,
        )
    except (ValueError, OSError) as e:
        common.fail(parser, e)
    print(json.dumps({k: v for k, v in summary.items() if k != "agreement_log"}, indent=2))
    return 0
