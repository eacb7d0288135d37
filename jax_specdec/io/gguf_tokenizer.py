"""The tokenizer a GGUF file describes, as a `tokenizers.Tokenizer`.

A GGUF carries no tokenizer.json: its metadata holds the vocabulary
(`tokenizer.ggml.tokens`), the BPE merges or the tokens' scores, each token's type and
the special ids. Two kinds are supported:

- byte-level BPE (`tokenizer.ggml.model == "gpt2"`, as SmolLM2, Qwen2/3 and Llama 3
  use). The text is split before BPE as llama.cpp splits it for the file's
  `tokenizer.ggml.pre` (the known kinds are in `_SPLITS`).
- Gemma's SentencePiece BPE (`"llama"` in a gemma/gemma2/gemma3 file): spaces become
  "▁", unknown bytes fall back to the `<0xNN>` tokens. The file lists no merges; they
  are rebuilt from the vocabulary, every split of a token into two tokens being a
  merge, ranked by the token's position in the file (Gemma's order, which its scores
  do not follow), as `transformers` rebuilds them.

Control tokens (type 3, like `<|im_start|>` or `<start_of_turn>`) are added as special
tokens and user-defined ones (type 4) as plain added tokens, so both stay whole.
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


_GEMMA = ("gemma", "gemma2", "gemma3")  # architectures whose "llama" tokenizer is Gemma's


def load_gguf_tokenizer(path: Path_):
    """The `tokenizers.Tokenizer` stored in a GGUF file's metadata.

    Raises:
        FileNotFoundError: no such file.
        GGUFError (a ValueError): unreadable file, a tokenizer of another kind (see the
            module docstring), no merges, or an unknown pre-tokenizer kind.
    """
    reader = open_gguf(path)
    kind = field(reader, "tokenizer.ggml.model", None)
    arch = field(reader, "general.architecture", None)
    tokens = field(reader, "tokenizer.ggml.tokens")
    types = field(reader, "tokenizer.ggml.token_type", None) or [1] * len(tokens)
    if kind == "llama" and arch in _GEMMA:
        try:
            tokenizer = _gemma_bpe(tokens)
        except Exception as e:
            raise GGUFError(f"{path}: the tokenizer metadata is invalid ({e})") from e
        _add_special(tokenizer, tokens, types, byte_level=False)
        _add_post_processor(tokenizer, reader)
        return tokenizer
    if kind != "gpt2":
        raise GGUFError(
            f"{path}: tokenizer kind {kind!r} is not supported (byte-level BPE, 'gpt2', "
            "and Gemma's SentencePiece, 'llama' in a gemma file)"
        )
    merges = field(reader, "tokenizer.ggml.merges", None)
    if not merges:
        raise GGUFError(f"{path}: the byte-level BPE tokenizer has no merges")
    pre = field(reader, "tokenizer.ggml.pre", "default")
    if pre not in _SPLITS:
        raise GGUFError(
            f"{path}: pre-tokenizer {pre!r} is not supported (supported: {', '.join(_SPLITS)})"
        )
    try:
        tokenizer = _byte_level_bpe(tokens, merges, _SPLITS[pre])
    except Exception as e:  # tokenizers rejects merges of unknown tokens etc.
        raise GGUFError(f"{path}: the tokenizer metadata is invalid ({e})") from e
    _add_special(tokenizer, tokens, types, byte_level=True)
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


def _gemma_bpe(tokens: list[str]):
    """Gemma's SentencePiece BPE (byte fallback, spaces as "▁") of a GGUF vocabulary."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

    # A token of blanks holding a space is stored as it reads; the model looks it up as "▁"s.
    tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {token: index for index, token in enumerate(tokens)}  # a repeated token: its last
    bpe = models.BPE(
        vocab=vocab,
        merges=_merges_by_position(vocab),
        unk_token="<unk>" if "<unk>" in vocab else None,
        fuse_unk=True,
        byte_fallback=True,
    )
    tokenizer = Tokenizer(bpe)
    tokenizer.normalizer = normalizers.Replace(" ", "\u2581")
    tokenizer.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    return tokenizer


def _merges_by_position(vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Every (left, right) split of a token into two tokens, the earlier token first;
    among one token's splits, the longer left part first (as `transformers`' merges
    rebuilt from a vocabulary ranked by position)."""
    merges = []
    for token, index in vocab.items():
        splits = [(token[:i], token[i:]) for i in range(1, len(token))]
        for left, right in splits:
            if left in vocab and right in vocab:
                merges.append((index, -len(left), -len(right), left, right))
    merges.sort(key=lambda m: m[:3])
    return [(left, right) for *_, left, right in merges]


def _add_special(tokenizer, tokens: list[str], types: list[int], byte_level: bool) -> None:
    from tokenizers import AddedToken

    spelled = set(_byte_alphabet().values())
    control, user = [], []
    for token, kind in zip(tokens, types, strict=False):
        # A "control" token outside the byte alphabet is a mislabel in some byte-level
        # files: adding it would grow the vocabulary past the model's.
        if kind == _CONTROL and (not byte_level or set(token) <= spelled):
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
