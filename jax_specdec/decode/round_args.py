"""How a `Generator`'s round arguments (schedule, num_draft_tokens, tree, acceptance)
become the program's: the schedule (`Auto()` by default, a tree on its menu), the
acceptance rule, and the schedule as the compiled program sees it."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from jax_specdec.acceptance import accept_block_with_noise, accept_with_noise
from jax_specdec.decode.request import check_int
from jax_specdec.decode.tree import Tree, as_tree
from jax_specdec.decode.tree_accept import accept_tree
from jax_specdec.schedules import Auto, Confidence, Constant, as_schedule

__all__ = ["CHAIN_RULES", "acceptance_rule", "menu_tree", "resolve_schedule", "static_schedule"]

CHAIN_RULES = (accept_with_noise, accept_block_with_noise)


def static_schedule(schedule):
    """The schedule as the program sees it: `Auto`'s costs are an input, not part of it."""
    if isinstance(schedule, Auto):
        return dataclasses.replace(schedule, round_costs=None)
    return schedule


def menu_tree(schedule: Auto, tree, drafter) -> Auto:
    """`schedule` with `tree` (an int N: `Tree(N, min(N, 4, its widest width))`; or
    `schedule.tree`) on its menu, checked against the drafter as a tree round's
    (`as_tree`)."""
    if tree is None and schedule.tree is None:
        return schedule
    if tree is not None and schedule.tree is not None:
        raise ValueError("give the tree once: as tree=... or as Auto(tree=...), not both")
    tree = schedule.tree if tree is None else tree
    if not isinstance(tree, Tree) and isinstance(tree, int) and not isinstance(tree, bool):
        tree = Tree(tree, min(tree, 4, schedule.max_gamma)) if tree >= 1 else tree
    depth = tree.depth if isinstance(tree, Tree) else 1
    tree = as_tree(tree, Constant(depth), drafter)
    return dataclasses.replace(schedule, tree=tree)


def resolve_schedule(num_draft_tokens, schedule, tree):
    """The schedule the arguments ask for: `Auto()` by default (or "auto"); a tree round's
    depth (4 for `tree=N`) when a tree is given alone (with "auto", the tree joins
    `Auto`'s menu: `menu_tree`)."""
    if schedule is None and num_draft_tokens is None:
        if tree is None:
            return Auto()
        return as_schedule(tree.depth if isinstance(tree, Tree) else 4)
    if isinstance(schedule, str):
        if schedule != "auto":
            raise TypeError(
                f"schedule must be an int γ >= 1, 'auto' or a schedule (Auto, Constant, "
                f"Heuristic, CostModel, Custom, ...), got {schedule!r}"
            )
        schedule = Auto()
    if num_draft_tokens is not None:
        if schedule is not None:
            raise ValueError(
                "pass either num_draft_tokens or schedule, not both "
                "(num_draft_tokens=k is schedule=k)"
            )
        return Constant(check_int("num_draft_tokens", num_draft_tokens, 1))
    if isinstance(schedule, Confidence):  # a way of drafting, checked by the Generator
        return schedule
    return as_schedule(schedule)


def acceptance_rule(acceptance: str, rule: Callable | None, tree) -> Callable:
    """The rule the program applies. `rule` (Generator's `_rule`) replaces it: a hook for
    the tests, which show that the exactness harness catches a wrong rule."""
    if acceptance not in ("token", "block"):
        raise ValueError(f"acceptance must be 'token' or 'block', got {acceptance!r}")
    if acceptance == "block" and tree is not None:
        raise ValueError("acceptance block is for chains; a tree round walks its tree")
    if rule is None:
        if tree is not None:
            return accept_tree
        return accept_with_noise if acceptance == "token" else accept_block_with_noise
    if tree is not None and rule in CHAIN_RULES:
        raise ValueError(f"acceptance {rule.__name__} is a chain's rule; tree rounds walk")
    if not callable(rule):
        raise TypeError(f"_rule must be a function, got {type(rule).__name__}")
    return rule
