"""Stop strings, on the host: a generated text is cut at the earliest occurrence of any
of its stop strings, and the tokens at the shortest prefix whose text holds that string.

These functions are the one place a stop string's effect is decided (the batch job, the
`generate` command and the lm-eval front end's `until` strings call them). A compiled
loop that ends a row early on a stop string only saves work: the text, the tokens and
the finish reason of a row are still what `apply` makes of the tokens it generated.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

__all__ = ["Stopped", "apply", "check", "cut", "token_prefix", "token_sequences"]


def check(value, name: str) -> tuple[str, ...]:
    """A stop field or flag as a tuple of strings: one string, or a list of strings;
    ValueError naming `name` when one is empty or not a string (None: no stops)."""
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(s, str) for s in items):
        raise ValueError(f"{name} must be a string or a list of strings, got {value!r}")
    if any(not s for s in items):
        raise ValueError(f"{name} must not hold an empty string")
    return tuple(items)


def token_sequences(tokenizer, stops: Sequence[str]) -> tuple[tuple[int, ...], ...]:
    """Each stop string's own tokenization (no special tokens added), for the loop to end
    a row as soon as it emits one (`Generator(stop_sequences=...)`). Only a sequence
    whose decoded text (`tokenizer.decode`, as the host decodes) holds its string is
    kept, so the loop never ends a row the host's cut would not: a special token the
    decoder drops, or a string that encodes to no tokens, is left to the host."""
    out = []
    for stop in stops:
        ids = tuple(tokenizer.encode(stop, add_special_tokens=False).ids)
        if ids and stop in tokenizer.decode(list(ids)):
            out.append(ids)
    return tuple(out)


def cut(text: str, stops: Sequence[str]) -> tuple[str, str | None]:
    """`text` up to the earliest occurrence of any of `stops`, and that stop string;
    `(text, None)` when none occurs. Of stops found at the same position the first
    listed wins (the cut text is the same either way). Stops are non-empty (`check`)."""
    best, which = len(text), None
    for stop in stops:
        at = text.find(stop)
        if at != -1 and at < best:
            best, which = at, stop
    return text[:best], which


def token_prefix(tokens: Sequence[int], decode: Callable, stop: str) -> int:
    """The length of the shortest prefix of `tokens` whose decoded text holds `stop`
    (len(tokens) when no shorter one does), by bisection: a prefix's text is taken to
    hold the text of every shorter prefix, as byte-level and SentencePiece decoders'
    do."""
    lo, hi = 0, len(tokens)  # decode(tokens[:hi]) holds stop (or hi is all of them)
    while lo < hi:
        mid = (lo + hi) // 2
        if stop in decode(list(tokens[:mid])):
            hi = mid
        else:
            lo = mid + 1
    return hi


class Stopped(NamedTuple):
    """A row after its stop strings: its tokens, text, finish reason ("stop" when a stop
    string cut it, else the reason given) and the stop string that cut it (or None)."""

    tokens: list[int]
    text: str
    finish_reason: str
    stop: str | None


def apply(
    tokens: Sequence[int], text: str, reason: str, stops: Sequence[str], decode: Callable
) -> Stopped:
    """A generated row (`tokens`, their decoded `text`, the program's finish `reason`)
    cut at the earliest of its `stops`: the text before it, the tokens up to the
    shortest prefix whose text holds it (`token_prefix`), finish reason "stop". With no
    stop in the text, the row as given."""
    short, which = cut(text, stops)
    if which is None:
        return Stopped(list(tokens), text, reason, None)
    kept = list(tokens[: token_prefix(tokens, decode, which)])
    return Stopped(kept, short, "stop", which)
