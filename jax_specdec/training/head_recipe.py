"""The build recipe of a feature head for a target: corpus -> the target's features ->
kept vocabulary -> training -> a head directory (`jax-specdec train-drafter`).

Every stage resumes: feature parts already on disk are not computed again, and
training continues from its last orbax checkpoint (the same command, run again).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import pathlib
import time

import numpy as np
from flax import nnx

from jax_specdec.io.heads import WEIGHTS, load_head, load_head_config, save_head
from jax_specdec.io.speculators import save_speculators
from jax_specdec.io.weights import file_sha256
from jax_specdec.nn.eagle3 import Eagle3Config, Eagle3Head, default_aux_layer_ids
from jax_specdec.nn.feature_head import FeatureHead, FeatureHeadConfig
from jax_specdec.training.corpus import encode_files, stdlib_corpus
from jax_specdec.training.head_data import (
    FeatureSet,
    extract_features,
    greedy_continuations,
    kept_vocabulary,
    load_features,
    spread_windows,
    windows_of,
)
from jax_specdec.training.head_train import HeadTrainConfig, agreement, init_from_target, train_head
from jax_specdec.training.prompts import SPLITS, prompts
from jax_specdec.training.self_data import Windows, generate_windows, tokenize_prompts

__all__ = ["DataConfig", "build_head", "prepare_data"]

DATA_KINDS = ("text", "greedy", "self")
HEAD_KINDS = ("feature", "eagle3")


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """What the head is trained on.

    Attributes:
      kind: "text" (corpus windows as they are), "greedy" (corpus prompts of
        `prompt_len` tokens, then the target's greedy continuation) or "self" (chat
        requests and code openings, `training.prompts`, then the target's continuation:
        greedy or sampled at `temperature`, `training.self_data`).
      tokens: training tokens (windows x seq_len) at most.
      seq_len: window length.
      prompt_len: for "greedy", the corpus part of each window; for "self", the
        longest prompt kept.
      validation_tokens: held-out tokens (text of the validation files, or for "self"
        continuations of the held-out prompts) for agreement.
      corpus: "stdlib", or a directory whose .py files make the corpus.
      spread: for "text", windows spaced evenly over the whole corpus rather than
        its first `tokens` tokens.
      temperature: for "self", the temperature of the sampled continuations.
      code_share: for "self", the share of code openings among the prompts.
    """

    kind: str = "text"
    tokens: int = 150_000
    seq_len: int = 128
    prompt_len: int = 32
    validation_tokens: int = 8192
    corpus: str = "stdlib"
    spread: bool = False
    temperature: float = 0.8
    code_share: float = 0.5

    def __post_init__(self):
        if self.kind not in DATA_KINDS:
            raise ValueError(f"data kind must be one of {DATA_KINDS}, got {self.kind!r}")
        if not 0 < self.prompt_len < self.seq_len:
            raise ValueError(f"prompt_len must lie in (0, seq_len), got {self.prompt_len}")
        if self.spread and self.kind != "text":
            raise ValueError(f"spread applies to data kind 'text' only, not {self.kind!r}")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if not 0 <= self.code_share <= 1:
            raise ValueError(f"code_share must lie in [0, 1], got {self.code_share}")

    @property
    def name(self) -> str:
        extra = f"-p{self.prompt_len}" if self.kind != "text" else ""
        extra += f"-T{self.temperature}-c{self.code_share}" if self.kind == "self" else ""
        extra += "-spread" if self.spread else ""
        if self.corpus != "stdlib":  # another corpus, other windows: another directory
            extra += "-" + hashlib.sha256(str(self.corpus).encode()).hexdigest()[:8]
        return f"{self.kind}{extra}-t{self.seq_len}-n{self.tokens}"


def _corpus(corpus: str):
    """The standard library's files, or the .py files under the directory `corpus`."""
    return stdlib_corpus() if corpus == "stdlib" else stdlib_corpus(root=corpus)


def _streams(tokenizer, corpus: str):
    files = _corpus(corpus)
    eot = tokenizer.token_to_id("<|endoftext|>")
    if eot is None:
        raise ValueError("the target's tokenizer has no <|endoftext|> token")
    return encode_files(tokenizer, files.read(files.train)), encode_files(
        tokenizer, files.read(files.validation)
    )


def prepare_data(
    target, tokenizer, data: DataConfig, work_dir, *, batch: int = 8, aux_layers=()
) -> tuple[FeatureSet, FeatureSet]:
    """(train, validation) `FeatureSet`s, extracted into `work_dir` (or loaded); with
    `aux_layers` (an EAGLE-3 head's layer ids) their hidden states too."""
    work_dir = pathlib.Path(work_dir)
    suffix = "-aux" + ".".join(map(str, aux_layers)) if aux_layers else ""
    extract = functools.partial(extract_features, target, batch=batch, aux_layers=aux_layers)
    if data.kind == "self":
        train, valid = (_self_windows(target, tokenizer, data, work_dir, split) for split in SPLITS)
        name = f"valid-{data.name}"
        validation = extract(valid.tokens, work_dir / (name + suffix), start=valid.start)
        return extract(train.tokens, work_dir / (data.name + suffix), start=train.start), validation
    train_stream, valid_stream = _streams(tokenizer, data.corpus)
    valid = windows_of(valid_stream, data.seq_len, data.validation_tokens)
    validation = extract(valid, work_dir / f"valid-t{data.seq_len}{suffix}")
    if data.kind == "text" and data.spread:
        windows = spread_windows(train_stream, data.seq_len, data.tokens)
    elif data.kind == "text":
        windows = windows_of(train_stream, data.seq_len, data.tokens)
    else:
        cached = work_dir / f"{data.name}-windows.npy"
        if not cached.exists():
            count = data.tokens // data.seq_len
            prompts = windows_of(train_stream, data.prompt_len, count * data.prompt_len * 4)
            prompts = prompts[:: max(len(prompts) // count, 1)][:count]
            new = data.seq_len - data.prompt_len
            np.save(cached, greedy_continuations(target, prompts, new, batch=2 * batch))
        windows = np.load(cached)
    return extract(windows, work_dir / (data.name + suffix)), validation


def _self_windows(target, tokenizer, data: DataConfig, work_dir, split: str) -> Windows:
    """The target's continuations of `split`'s prompts (`training.self_data`)."""
    files = _corpus(data.corpus)
    names = files.train if split == "train" else files.validation
    tokens = data.tokens if split == "train" else data.validation_tokens
    count = max(tokens // data.seq_len, 1)
    chosen = prompts(split, files.read(names), count=count, code_share=data.code_share)
    fitting = tokenize_prompts(tokenizer, chosen, data.prompt_len)  # longer ones left out
    if not fitting:
        raise ValueError(
            f"none of the {len(chosen)} {split} prompts is at most prompt_len "
            f"({data.prompt_len}) tokens long"
        )
    directory = work_dir / (data.name if split == "train" else f"valid-{data.name}")
    return generate_windows(
        target, fitting, data.seq_len, directory / "windows", temperature=data.temperature
    )


def build_head(
    target,
    tokenizer,
    *,
    out,
    work_dir,
    data: DataConfig,
    train: HeadTrainConfig,
    kept: int | None = None,
    layers: int | None = None,
    run_name: str = "head",
    target_name: str = "",
    stop_after: int | None = None,
    weights_dtype: str | None = None,
    init: str | None = None,
    kind: str = "feature",
    aux_layers: tuple[int, ...] | None = None,
) -> dict:
    """Builds (or resumes building) a head for `target` and saves it to `out`.

    Returns a summary: data, kept-token coverage, training time and steps, and the
    held-out agreement with the target's greedy token per draft step. `stop_after`
    stops the run at that step (the head saved as it is); calling again continues it.
    `weights_dtype` ("float16") stores the saved head's weights in that type. `init` (a
    feature head directory of the same shape, for the same target) starts the training
    from that head's weights and kept tokens instead of from the target's output rows.
    `kept` (default 8192) and `layers` (default 1) default to `init`'s where it is given.
    `kind` "eagle3" builds an EAGLE-3 head reading the target's `aux_layers` (default:
    a low, a middle and a high one), saved in the `speculators` format.
    """
    config = _recipe_config(
        target, tokenizer, out, kind=kind, init=init, kept=kept, layers=layers,
        aux_layers=aux_layers, target_name=target_name,
    )  # fmt: skip
    init_training = None if init is None else _training_record(init)
    run_dir = pathlib.Path(work_dir) / "runs" / run_name
    _record_start(run_dir, init)
    t0 = time.perf_counter()
    aux = config.aux_layer_ids if kind == "eagle3" else ()
    train_set, valid_set = prepare_data(target, tokenizer, data, work_dir, aux_layers=aux)
    extract_seconds = time.perf_counter() - t0
    head = (FeatureHead if kind == "feature" else Eagle3Head)(config, rngs=nnx.Rngs(train.seed))
    kept = config.kept if kind == "feature" else config.draft_vocab_size
    if init is None:
        init_from_target(head, target, kept_vocabulary(train_set, kept, config.vocab_size))
    else:
        _start_from(head, init)
    log = train_head(
        head, target, train_set, valid_set, train, checkpoint_dir=run_dir, stop_after=stop_after
    )
    if kind == "feature":
        save_head(head, out, dtype=weights_dtype)
    else:
        save_speculators(head, out, dtype=weights_dtype)
    summary = {
        "kind": kind,
        "data": dataclasses.asdict(data),
        "train": dataclasses.asdict(train),
        "kept": kept,
        "layers": config.layer.num_layers,
        "aux_layers": list(aux),
        "init": None if init is None else str(init),
        "init_training": init_training,
        **_outcome(head, target, train_set, valid_set, log),
        "feature_seconds_this_call": round(extract_seconds, 1),
    }
    pathlib.Path(out, "training.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _recipe_config(target, tokenizer, out, *, kind, init, kept, layers, aux_layers, target_name):
    """The head's config for `build_head`'s arguments, which it checks first."""
    if kind not in HEAD_KINDS:
        raise ValueError(f"kind must be one of {HEAD_KINDS}, got {kind!r}")
    if init is not None and pathlib.Path(out).resolve() == pathlib.Path(init).resolve():
        raise ValueError(f"--out {out} is the --init head: the run would overwrite its start")
    if kind == "eagle3":
        if init is not None:
            raise ValueError(
                "init applies to feature heads; an EAGLE-3 head starts from the target"
            )
        return _eagle3_config(target, kept, layers, aux_layers, target_name)
    if aux_layers is not None:
        raise ValueError("aux_layers applies to EAGLE-3 heads (kind 'eagle3') only")
    return _head_config(target, tokenizer, init, kept, layers, target_name)


def _outcome(head, target, train_set, valid_set, log: dict) -> dict:
    """What a build measured: the data's size, the kept tokens' coverage of the held-out
    greedy tokens, the training's time and steps, and the held-out agreement."""
    vocab_map = np.asarray(head.vocab_map[...])  # the run's (a resumed one's, too)
    return {
        "train_tokens": int(train_set.tokens.size),
        "kept_coverage_validation_greedy": _coverage(valid_set, vocab_map),
        "train_seconds": round(log["seconds"], 1),
        "steps": log["steps"],
        "agreement": agreement(head, valid_set, target.embed[...], steps=3),
        "agreement_log": log["agreement"],
    }


# An EAGLE-3 head's layers are Llama-style whatever the target's family (the speculators
# format has Llama and Qwen3 layers; Qwen3's q/k norms come from the head's style), with
# global attention.
LLAMA_LAYER = dict(
    mlp="swiglu",
    qk_norm=False,
    embed_scale=False,
    norm_plus_one=False,
    post_norms=False,
    query_pre_attn_scalar=None,
    attn_softcap=None,
    final_softcap=None,
    sliding_window=None,
    local_layers=(),
    rope_local_theta=None,
)


def _eagle3_config(target, kept, layers, aux_layers, target_name) -> Eagle3Config:
    """An EAGLE-3 head shaped like the target's layers, reading `aux_layers` (default
    `default_aux_layer_ids`), `layers` decoder layers (1) and `kept` draft tokens (8192),
    the target's embedding (not stored), in the target's style (Qwen3-style q/k norms
    where the target has them)."""
    tc = target.config
    ids = default_aux_layer_ids(tc.num_layers) if aux_layers is None else tuple(aux_layers)
    for i in ids:
        if not 0 <= i <= tc.num_layers:
            raise ValueError(f"aux layer {i} is not a layer id of the target (0 … {tc.num_layers})")
    verifier = verifier_of(target_name, tc)
    layer = tc.replace(
        num_layers=1 if layers is None else layers, tie_embeddings=False, **LLAMA_LAYER
    )
    return Eagle3Config(
        layer=layer,  # the head's q/k norms are its `style`, as speculators configs say
        style="qwen3" if tc.qk_norm else "llama",
        draft_vocab_size=8192 if kept is None else kept,
        aux_layer_ids=ids,
        has_embed=False,
        verifier=verifier[0],
        verifier_architectures=verifier[1],
    )


def verifier_of(target_name: str, config) -> tuple[str, tuple[str, ...]]:
    """How an EAGLE-3 head's `speculators` config names its target (what vLLM loads as
    the verifier): a zoo model by its Hugging Face id, a Hugging Face directory by its
    absolute path, anything else as given; the architectures are those of the target's
    `config` as a Hugging Face config.json (a directory's own where it states them)."""
    from jax_specdec.io import zoo
    from jax_specdec.io.hf_config import config_to_hf

    try:
        architectures = tuple(config_to_hf(config)["architectures"])
    except ValueError:  # a layout transformers has no class for
        architectures = ()
    if target_name in zoo.MODELS:
        return zoo.MODELS[target_name].hub_id, architectures
    path = pathlib.Path(target_name, "config.json")
    if path.is_file():
        stated = json.loads(path.read_text()).get("architectures")
        return str(path.parent.resolve()), tuple(stated or architectures)
    return target_name, architectures


def _head_config(target, tokenizer, init, kept, layers, target_name) -> FeatureHeadConfig:
    """The head's config: `kept` (default 8192) and `layers` (default 1) default to those
    of the `init` head where one is given, which must fit the config (checked here, before
    the extraction, which can take an hour)."""
    from jax_specdec.io.heads import tokenizer_sha256

    shape = None if init is None else load_head_config(init)
    if kept is None:
        kept = 8192 if shape is None else shape.kept
    if layers is None:
        layers = 1 if shape is None else shape.layer.num_layers
    config = FeatureHeadConfig.for_target(
        target.config,
        kept,
        target=target_name,
        tokenizer_sha256=tokenizer_sha256(tokenizer),
        num_layers=layers,
    )
    if shape is not None:
        _check_fits(init, shape, config)
    return config


def _check_fits(path, theirs: FeatureHeadConfig, mine: FeatureHeadConfig) -> None:
    """A ValueError naming both heads and every field in which the saved head `theirs`
    differs from the head this run builds (the weights' storage type aside)."""
    a = theirs.layer.replace(param_dtype=mine.layer.param_dtype).to_dict()
    b = mine.layer.to_dict()
    differ = [f"{k} {a[k]!r} vs {b[k]!r}" for k in b if a[k] != b[k]]
    if theirs.kept != mine.kept:
        differ.append(f"kept {theirs.kept} vs {mine.kept}")
    if theirs.tokenizer_sha256 not in ("", mine.tokenizer_sha256):
        differ.append("another tokenizer")
    if differ:
        raise ValueError(
            f"init head {path} (for target {theirs.target!r}) does not fit this run's head "
            f"(for target {mine.target!r}): {', '.join(differ)}"
        )


def _record_start(run_dir: pathlib.Path, init) -> None:
    """Writes what the run in `run_dir` starts from beside it: the init head's path and
    the SHA-256 of its weights file. A run that started from other weights (another
    head, or the target's rows) cannot be resumed from here; the same head copied or
    moved elsewhere can. A record from before the digest names the head by its path
    only: such a run resumes from that path alone, and its record is kept as it is."""
    start = {"init": None, "init_sha256": None}
    if init is not None:
        weights = pathlib.Path(init, WEIGHTS)
        start = {"init": str(pathlib.Path(init).resolve()), "init_sha256": file_sha256(weights)}
    record = run_dir.with_name(f"{run_dir.name}.start.json")
    if record.is_file():
        before = json.loads(record.read_text())
    else:  # a run from before these records started from the target's rows
        before = {"init": None} if run_dir.is_dir() and any(run_dir.iterdir()) else start
    by_digest = "init_sha256" in before
    field = "init_sha256" if by_digest else "init"
    if before[field] != start[field]:
        what = None
        if before["init"] and start["init"]:
            what = "other weights" if by_digest else "its record names the head by path"
        raise ValueError(
            f"run {run_dir} started from {before['init'] or 'the target'}; this command "
            f"starts from {start['init'] or 'the target'}{f' ({what})' if what else ''}: "
            "give it another --run-name"
        )
    if by_digest or not record.is_file():
        record.parent.mkdir(parents=True, exist_ok=True)
        record.write_text(json.dumps(start) + "\n")


def _training_record(path) -> dict | None:
    """The `training.json` saved beside the head in `path` (None if it has none), so a
    head trained further records how its starting point was trained."""
    record = pathlib.Path(path, "training.json")
    return json.loads(record.read_text()) if record.is_file() else None


def _start_from(head: FeatureHead, path) -> None:
    """Sets `head`'s weights and kept tokens to those of the head saved in `path` (its
    shape checked by `_check_fits` before the extraction)."""
    start = load_head(path, param_dtype=head.config.layer.param_dtype)
    nnx.update(head, nnx.state(start))


def _coverage(data: FeatureSet, vocab_map: np.ndarray) -> float:
    """Share of the target's greedy tokens that the kept vocabulary holds."""
    return round(float(np.isin(data.greedy[:, 1:], vocab_map).mean()), 4)


def load_data(work_dir, data: DataConfig) -> tuple[FeatureSet, FeatureSet]:
    """The feature sets of an earlier `prepare_data` call."""
    work_dir = pathlib.Path(work_dir)
    return load_features(work_dir / data.name), load_features(work_dir / f"valid-t{data.seq_len}")
