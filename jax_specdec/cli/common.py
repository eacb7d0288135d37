"""What the subcommands share: failing cleanly, model directories, sampling and prompt flags."""

from __future__ import annotations

import argparse
import re
import sys

DEFAULT_TARGET = "models/stdlib-target"
DEFAULT_DRAFT = "models/stdlib-draft"
DEFAULT_PROMPTS = "models/prompts.txt"


def fail(parser: argparse.ArgumentParser, error: Exception):
    """Bad input: one line on stderr, exit code 2, no traceback."""
    print(f"{parser.prog}: error: {error}", file=sys.stderr)
    sys.exit(2)


def ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected integers such as 1,8,32, got {text!r}"
        ) from None


def floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers such as 0,1, got {text!r}") from None


def unescape(line: str) -> str:
    """A prompt-file line: `\\n` is a newline, `\\\\` a backslash."""
    return re.sub(r"\\(.)", lambda m: "\n" if m.group(1) == "n" else m.group(1), line)


def text_lines(path) -> list[str]:
    """The lines of a UTF-8 text file, newlines kept; bad UTF-8 is a ValueError naming the
    file and the line."""
    with open(path, "rb") as f:
        raw = f.readlines()
    try:
        return [line.decode("utf-8") for line in raw]
    except UnicodeDecodeError:
        bad = next(n for n, line in enumerate(raw, 1) if not _utf8(line))
        raise ValueError(f"{path} line {bad} is not valid UTF-8") from None


def _utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def read_prompts(path: str) -> list[str]:
    """One prompt per non-empty line of `path`, with `\\n` escapes."""
    prompts = [unescape(line.rstrip("\n")) for line in text_lines(path) if line.strip()]
    if not prompts:
        raise ValueError(f"{path} holds no prompts")
    return prompts


def config_from_args(cls, args, **values):
    """The dataclass `cls` with each field read from the flag of the same name in `args`
    (fields without a flag keep their default); `values` set the rest by hand."""
    import dataclasses

    names = {f.name for f in dataclasses.fields(cls)} - set(values)
    return cls(**{n: getattr(args, n) for n in names if hasattr(args, n)}, **values)


def add_sampling_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument(
        "--min-p",
        type=float,
        default=0.0,
        help="keep tokens at least this times as probable as the most probable (0 = off)",
    )
    parser.add_argument(
        "--repetition-penalty",
        type=float,
        default=1.0,
        help="divide a positive logit (multiply a negative one) of every token of the prompt "
        "and the output so far by this, as transformers (1 = off)",
    )
    parser.add_argument(
        "--presence-penalty",
        type=float,
        default=0.0,
        help="subtract this from the logit of every token generated so far, as the OpenAI "
        "API, in [-2, 2] (0 = off)",
    )
    parser.add_argument(
        "--frequency-penalty",
        type=float,
        default=0.0,
        help="subtract this times its count from the logit of every token generated so far, "
        "as the OpenAI API, in [-2, 2] (0 = off)",
    )
    parser.add_argument(
        "--logit-bias",
        default="",
        metavar="ID:BIAS[,ID:BIAS...]",
        help="add BIAS (in [-100, 100]) to token ID's logit",
    )
    parser.add_argument(
        "--eos",
        default="auto",
        help="ids that end a row: 'auto' (every end-of-sequence and end-of-turn id the model "
        "states, else <|endoftext|>), 'none', or ID[,ID...]",
    )


def add_sample_flags(parser: argparse.ArgumentParser, what: str) -> None:
    """--n, --stop, --logprobs and --logprob-kind: samples per prompt, the stop strings
    that end a row and cut its text, and the log-probabilities written."""
    parser.add_argument(
        "--n",
        type=int,
        default=1,
        help=f"samples per {what}: sample 0 keyed as a lone sample is, sample i >= 1 by a "
        "seed derived from that seed and i alone; with a fixed -k it gets the tokens that "
        "seed gets alone (with auto, their distribution) (default: %(default)s)",
    )
    parser.add_argument(
        "--stop",
        action="append",
        metavar="STR",
        help="a stop string (repeatable): the row ends once it is generated (its own "
        "tokenization ends the row in the program) and the text is cut before the earliest "
        "one found, finish_reason 'stop'",
    )
    parser.add_argument(
        "--logprobs",
        type=int,
        metavar="N",
        help=f"write each generated token's log-probability and its N most likely "
        f"alternatives (0-20; per {what}, its own 'logprobs' overrides it where it applies)",
    )
    parser.add_argument(
        "--logprob-kind",
        choices=("processed", "raw"),
        default="processed",
        help="log-probabilities under the distribution sampled from (bias, penalties, "
        "temperature, top-k/p, min-p; greedy: temperature 1) or the model's raw one "
        "(default: %(default)s)",
    )


def add_model_flags(parser: argparse.ArgumentParser) -> None:
    """--dtype and --mesh: how the models are held."""
    parser.add_argument(
        "--dtype",
        choices=("auto", "float32", "bfloat16"),
        default="auto",
        help="the models' parameters and activations; auto: bfloat16 on a GPU or TPU, on "
        "the CPU each checkpoint's own (bfloat16 stays bfloat16, the rest float32). "
        "Sampling and acceptance are float32 always (default: %(default)s)",
    )
    parser.add_argument(
        "--mesh",
        help="DATAxMODEL, e.g. 4x2: rows over data, weights over model (all devices; with "
        "--distributed, all processes' devices)",
    )


def add_round_flags(parser: argparse.ArgumentParser, gamma="auto", why: str = "") -> None:
    """--num-draft-tokens (default `gamma`, `why` says why), --tree, --branch, --lookup
    and --acceptance: the shape of a round and its acceptance rule."""
    parser.add_argument(
        "--num-draft-tokens",
        "-k",
        default=gamma,
        help="tokens drafted per round: auto (each round's width chosen from round costs "
        "measured on this machine, once per shape, and the acceptance seen so far; "
        "drafting switches itself off where it does not pay) or a fixed γ (a --tree's "
        f"depth; 4 with auto) (default: %(default)s{why})",
    )
    parser.add_argument(
        "--tree",
        type=int,
        default=None,
        help="draft a token tree of this many nodes (its depth: the number of draft tokens; "
        "4 with auto, where the tree joins auto's menu and runs in the rounds where it is "
        "expected to be fastest) and verify it in one target call; needs --draft ngram or a "
        "feature head",
    )
    parser.add_argument(
        "--branch",
        type=int,
        default=4,
        help="with --tree and a feature head: children expanded per node (default: %(default)s)",
    )
    parser.add_argument(
        "--lookup",
        type=int,
        default=0,
        help="with --tree and a feature head: nodes of the tree given to prompt lookup (the "
        "continuations of the text's earlier matches of its last tokens, grafted where they "
        "leave the head's tree; such a tree is walked at any temperature) (default: "
        "%(default)s)",
    )
    parser.add_argument(
        "--acceptance",
        choices=("token", "block"),
        default="token",
        help="a chain's acceptance rule: token by token, or block verification (keeps no "
        "fewer tokens on average; both exact) (default: %(default)s)",
    )


def trees(text: str) -> list:
    """--trees: a comma-separated list of NODES:DEPTH:BRANCH[:LOOKUP] as `Tree`s (LOOKUP:
    the nodes of prompt lookup grafted onto a head's tree, `Tree.lookup`)."""
    from jax_specdec.decode.tree import Tree

    out = []
    for item in filter(None, text.split(",")):
        try:
            values = [int(v) for v in item.split(":")]
            if len(values) not in (3, 4):
                raise ValueError(f"{len(values)} fields")
            out.append(Tree(*values[:3], lookup=values[3] if len(values) == 4 else 0))
        except (TypeError, ValueError) as e:
            raise ValueError(
                f"--trees: {item!r} is not NODES:DEPTH:BRANCH[:LOOKUP] ({e})"
            ) from None
    return out
