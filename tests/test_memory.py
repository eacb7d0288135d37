"""The memory plan of a call (`decode.memory`): its figures are the arrays' own sizes,
and a call that asks for more than a stated device memory is refused in one line that
gives the figures and what to change, before anything is compiled."""

import math
import pathlib

import jax
import pytest
from flax import nnx

from jax_specdec import Generator, NGram
from jax_specdec.decode import program
from jax_specdec.io.hf import load_model

MODELS = pathlib.Path(__file__).resolve().parents[1] / "models"
PROMPTS = [[5, 6, 7, 8], [9, 10, 11]]


@pytest.fixture(scope="module")
def pair():
    return load_model(MODELS / "stdlib-target"), load_model(MODELS / "stdlib-draft")


def test_the_plan_counts_parameters_and_caches(pair):
    target, draft = pair
    run = Generator(target, draft, schedule=3).bind(
        PROMPTS, key=jax.random.key(0), max_new_tokens=8
    )
    plan = run.memory_plan
    params = sum(x.nbytes for m in pair for x in jax.tree.leaves(nnx.state(m)))
    assert plan.parameters == params
    c, d = target.config, draft.config
    per = lambda cfg: 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4  # noqa: E731
    assert plan.caches == per(c) * 2 * run.cache_len
    assert plan.drafter == per(d) * 2 * run.cache_len
    assert plan.working == 4 * 2 * 4 * c.vocab_size * 4
    assert plan.available is None  # a CPU reports no limit: nothing refused
    slots = Generator(target, NGram(), schedule=3).bind(
        PROMPTS, key=jax.random.key(0), max_new_tokens=8, num_slots=1
    )
    assert slots.memory_plan.rows == 1 and slots.memory_plan.drafter == 0


def test_a_call_that_does_not_fit_is_refused_before_compiling(pair, monkeypatch):
    target, draft = pair
    compiled = []
    monkeypatch.setattr(program, "generate", lambda *a, **k: compiled.append(1))
    # A fixed width: schedule="auto" would run the program to measure its costs when
    # bound (after the same check).
    need = Generator(target, draft, schedule=4).bind(
        PROMPTS, key=jax.random.key(0), max_new_tokens=64
    )
    total = need.memory_plan.total
    gen = Generator(target, draft, schedule=4, device_memory=total - 1)
    with pytest.raises(ValueError) as error:
        gen(PROMPTS, key=jax.random.key(0), max_new_tokens=64)
    message = str(error.value)
    assert "does not fit the device" in message and "\n" not in message
    assert f"{total / 2**30:.2f} GiB a device" in message and "KV caches" in message
    assert "num_slots" in message and "bfloat16" in message
    assert not compiled
    assert math.isclose(
        Generator(target, draft, schedule=4, device_memory=total)
        .bind(PROMPTS, key=jax.random.key(0), max_new_tokens=64)
        .memory_plan.total,
        total,
    )
    with pytest.raises(ValueError, match="device_memory"):
        Generator(target, device_memory=0)
