"""`jax-specdec convert IN.gguf OUT_DIR`: a GGUF file (or a zoo model name such as
smollm2-135m) written as a Hugging Face directory that transformers loads."""

from __future__ import annotations

import sys

from jax_specdec.cli import common


def add_parser(sub) -> None:
    p = sub.add_parser(
        "convert",
        help="write a GGUF file as a Hugging Face directory (config.json, model.safetensors, "
        "tokenizer.json)",
    )
    p.add_argument("input", help="a .gguf file, or a model name such as smollm2-135m")
    p.add_argument("output", help="the directory to write (created if needed)")
    p.add_argument(
        "--force",
        action="store_true",
        help="overwrite a model already in OUTPUT (refused otherwise); its other files stay",
    )
    p.set_defaults(handler=run, parser=p)


def run(args, parser) -> int:
    from jax_specdec.io import zoo
    from jax_specdec.io.gguf import convert_gguf

    try:
        out = convert_gguf(zoo.resolve(args.input), args.output, overwrite=args.force)
    except (ValueError, OSError) as e:
        common.fail(parser, e)
    print(f"wrote {out}/config.json, model.safetensors, tokenizer.json", file=sys.stderr)
    return 0
