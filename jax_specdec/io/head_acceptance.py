"""A head's measured acceptance in sampled trees: `tree_acceptance.json` beside its
weights, written by `jax-specdec calibrate-tree` and read by `io.heads.load_head`.

The table holds, for each depth d of the walk and each child rank j, the chance that
a node keeps its child j once it has rejected the ones before it
(`GenerationStats.rank_acceptance`). A sampled tree's shape is grown from it
(`decode.tree_accept.static_shape`): where the head's later children are rarely kept,
the tree goes deeper; where they often are, wider. The file names the weights it was
measured with by their SHA-256; a head whose weights changed since loads without it
(with a warning), as the shape would follow another head's acceptance. The table is
used at every temperature, whichever it was measured at (the record says which).
"""

from __future__ import annotations

import json
import math
import os
import warnings
from pathlib import Path

import numpy as np

from jax_specdec.io.weights import file_sha256

__all__ = ["ACCEPTANCE", "acceptance_table", "read_tree_acceptance", "write_tree_acceptance"]

ACCEPTANCE = "tree_acceptance.json"
FORMAT = "jax_specdec.tree_acceptance"
WEIGHTS = "model.safetensors"


def acceptance_table(tested, kept, min_tests: int = 20) -> list[list[float | None]]:
    """[D][K] kept / tested from the counts [D, K] (summed over rows), rounded to 3
    places; None where fewer than `min_tests` children were tested (too few to say)."""
    tested, kept = np.asarray(tested, np.float64), np.asarray(kept, np.float64)
    if tested.shape != kept.shape or tested.ndim != 2:
        raise ValueError(f"tested {tested.shape} and kept {kept.shape} must be [depth, ranks]")
    return [
        [round(k / t, 3) if t >= min_tests else None for t, k in zip(ts, ks, strict=True)]
        for ts, ks in zip(tested, kept, strict=True)
    ]


def write_tree_acceptance(directory, table, measured: dict) -> Path:
    """Writes `table` ([D][K], `acceptance_table`) and how it was `measured` (a dict:
    the tree, the sampling, the prompts, the counts) into `directory`'s
    tree_acceptance.json, naming the weights beside it by their SHA-256."""
    directory = Path(directory)
    _check_table(table, directory / ACCEPTANCE)
    record = {
        "format": FORMAT,
        "weights_sha256": file_sha256(directory / WEIGHTS),
        "acceptance": table,
        "measured": measured,
    }
    path = directory / ACCEPTANCE
    path.write_text(json.dumps(record, indent=1) + "\n")
    return path


def read_tree_acceptance(directory: str | os.PathLike) -> tuple[tuple[float, ...], ...]:
    """The rates `static_shape` takes, from `directory`'s tree_acceptance.json: () when
    there is none, or (with a warning) when it was measured with other weights. Entries
    measured too rarely (null) take the rate of the same rank one level up, else of the
    rank before at the same level. Raises ValueError naming the file if it is malformed."""
    path = Path(directory) / ACCEPTANCE
    if not path.is_file():
        return ()
    try:
        record = json.loads(path.read_text())
        if record.get("format") != FORMAT:
            raise ValueError(f"format is {record.get('format')!r}, not {FORMAT!r}")
        table = record["acceptance"]
        _check_table(table, path)
        digest = record["weights_sha256"]
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise ValueError(f"{path} is not a valid tree acceptance record: {error}") from error
    if digest != file_sha256(Path(directory) / WEIGHTS):
        warnings.warn(
            f"{path} was measured with other weights than {Path(directory) / WEIGHTS}: "
            "sampled trees take the default shape (run jax-specdec calibrate-tree again)",
            stacklevel=3,
        )
        return ()
    return _filled(table)


def _check_table(table, path) -> None:
    if (
        not isinstance(table, list)
        or not table
        or not all(isinstance(r, list) and r for r in table)
    ):
        raise ValueError(f"{path}: acceptance must be a non-empty list of non-empty lists")
    for d, row in enumerate(table):
        for j, rate in enumerate(row):
            ok = rate is None or (
                isinstance(rate, int | float) and not isinstance(rate, bool) and 0 <= rate <= 1
            )
            if not ok or (rate is not None and math.isnan(rate)):
                raise ValueError(f"{path}: acceptance[{d}][{j}] = {rate!r} is not in [0, 1]")
    if table[0][0] is None:
        raise ValueError(f"{path}: acceptance[0][0] (the first child at depth 0) is unmeasured")


def _filled(table) -> tuple[tuple[float, ...], ...]:
    rows: list[list[float]] = []
    for d, row in enumerate(table):
        out: list[float] = []
        for j, rate in enumerate(row):
            if rate is None:
                above = rows[d - 1] if d else []
                rate = above[j] if j < len(above) else out[j - 1]
            out.append(float(rate))
        rows.append(out)
    return tuple(tuple(r) for r in rows)
