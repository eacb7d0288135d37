"""The tokenizer a GGUF file describes, as a `tokenizers.Tokenizer`.

A GGUF carries no tokenizer.json: its metadata holds the vocabulary
(`tokenizer.ggml.tokens`), the BPE merges, each token's type and the special ids.
Only byte-level BPE (`tokenizer.ggml.model == "gpt2"`, as SmolLM2, Qwen2 and Llama 3
use) is supported. The text is split before BPE as llama.cpp splits it for the file's
`tokenizer.ggml.pre` (the known kinds are in `_SPLITS`); control tokens (type 3, like
`<|im_start|>`) are added as special tokens and user-defined ones (type 4) as plain
added tokens, so both stay whole.
"""

from __future__ import annotations

import os
from functools import lru_cache

from jax_specdec.io.gguf_file import GGUFError, field, open_gguf

Path_ = str | os.PathLike

_GPT2 = "gpt2"  # the byte-level regex of GPT-2 (ByteLevel(use_regex=True))
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> how text is split: GPT-2's regex, digits first (SmolLM), or a regex.
_SPLITS = {
    "default": _GPT2,
    "gpt-2": _GPT2,
    "gpt2": _GPT2,
    "smollm": "digits",
    "llama3": _LLAMA3,
    "llama-v3": _LLAMA3,
    "llama-bpe": _LLAMA3,
    "smaug-bpe": _LLAMA3,
    "qwen2": _QWEN2,
    "deepseek-r1-qwen": _QWEN2,
}
_CONTROL, _USER_DEFINED = 3, 4
_SPECIAL_KEYS = {
    "bos": "bos",
    "eos": "eos",
    "unk": "unknown",
    "pad": "padding",
    "eot": "eot",  # end of turn (llama.cpp's)
    "eom": "eom",  # end of message
}


def load_gguf_tokenizer(path: Path_):
    """The byte-level BPE `tokenizers.Tokenizer` stored in a GGUF file's metadata.

    Raises:
        FileNotFoundError: no such file.
        GGUFError (a ValueError): unreadable file, a tokenizer that is not byte-level
            BPE, no merges, or an unknown pre-tokenizer kind.
    """
    reader = open_gguf(path)
    kind = field(reader, "tokenizer.ggml.model", None)
    if kind != "gpt2":
        raise GGUFError(
            f"{path}: tokenizer kind {kind!r} is not supported (only byte-level BPE, 'gpt2')"
        )
    tokens = field(reader, "tokenizer.ggml.tokens")
    merges = field(reader, "tokenizer.ggml.merges", None)
    if not merges:
        raise GGUFError(f"{path}: the byte-level BPE tokenizer has no merges")
    pre = field(reader, "tokenizer.ggml.pre", "default")
    if pre not in _SPLITS:
        raise GGUFError(
            f"{path}: pre-tokenizer {pre!r} is not supported (supported: {', '.join(_SPLITS)})"
        )
    types = field(reader, "tokenizer.ggml.token_type", None) or [1] * len(tokens)
    try:
        tokenizer = _byte_level_bpe(tokens, merges, _SPLITS[pre])
    except Exception as e:  # tokenizers rejects merges of unknown tokens etc.
        raise GGUFError(f"{path}: the tokenizer metadata is invalid ({e})") from e
    _add_special(tokenizer, tokens, types)
    _add_post_processor(tokenizer, reader)
    return tokenizer


def special_token_ids(reader) -> dict[str, int]:
    """The special token ids the file names: a subset of keys bos, eos, unk, pad, eot,
    eom."""
    ids = {}
    for short, key in _SPECIAL_KEYS.items():
        value = field(reader, f"tokenizer.ggml.{key}_token_id", None)
        if value is not None:
            ids[short] = int(value)
    return ids


def _byte_level_bpe(tokens: list[str], merges: list[str], split: str):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    alphabet = _byte_alphabet()
    spelled = set(alphabet.values())
    vocab = {}
    for index, token in enumerate(tokens):
        # Tokens are stored in the byte alphabet; the rare one that is not gets respelled.
        if not set(token) <= spelled:
            token = "".join(alphabet[b] for b in token.encode("utf-8"))
        vocab.setdefault(token, index)
    pairs = []
    for merge in merges:
        parts = merge.split(" ")
        if len(parts) != 2:
            raise ValueError(f"merge {merge!r} is not two tokens")
        pairs.append((parts[0], parts[1]))
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=split != "digits")
    if split == _GPT2:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    elif split == "digits":
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    else:
        split_by = pre_tokenizers.Split(Regex(split), behavior="isolated")
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([split_by, byte_level])
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _add_special(tokenizer, tokens: list[str], types: list[int]) -> None:
    from tokenizers import AddedToken

    spelled = set(_byte_alphabet().values())
    control, user = [], []
    for token, kind in zip(tokens, types, strict=False):
        # A "control" token outside the byte alphabet is a mislabel in some files: adding it
        # would grow the vocabulary past the model's.
        if kind == _CONTROL and set(token) <= spelled:
            control.append(AddedToken(token, special=True, normalized=False))
        elif kind == _USER_DEFINED and tokenizer.token_to_id(token) is not None:
            user.append(AddedToken(token, special=False, normalized=False))
    tokenizer.add_special_tokens(control)
    tokenizer.add_tokens(user)


def _add_post_processor(tokenizer, reader) -> None:
    from tokenizers import processors

    ids = special_token_ids(reader)
    single, specials = "$A", []
    for short, flag in (("bos", "add_bos_token"), ("eos", "add_eos_token")):
        if field(reader, f"tokenizer.ggml.{flag}", False) and short in ids:
            token = tokenizer.id_to_token(ids[short])
            single = f"{token} {single}" if short == "bos" else f"{single} {token}"
            specials.append((token, ids[short]))
    if specials:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=single, special_tokens=specials
        )


@lru_cache(maxsize=1)
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the byte-level BPE alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table
