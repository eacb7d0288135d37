"""The memory plan of a call (`decode.memory`): its figures are the arrays' own sizes,
and a call that asks for more than a stated device memory is refused in one line that
gives the figures and what to change, before anything is compiled."""

import math
import pathlib

import jax
import pytest
from flax import nnx
from helpers import make_head

from jax_specdec import Generator, NGram
from jax_specdec.decode import prefill, program
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


def _call(config, rows, queries, keys):
    """A prefill call's bytes: one layer's scores (three float32 copies), the keys and
    values scored and MLP intermediates (three), and every layer's new keys and values."""
    c = config
    layer = 4 * (3 * c.num_heads * keys + 3 * c.mlp_dim)
    attended = 2 * keys * c.num_kv_heads * c.head_dim * 4
    return rows * (
        queries * (layer + 2 * c.num_layers * c.num_kv_heads * c.head_dim * 4) + attended
    )


def _features(target, rows, prompt=300):
    """The target's features a head reads, over the prompt, and their shifted copy."""
    return 2 * rows * prompt * target.config.d_model * 4


LONG = [[5] * 300, [6] * 250]


def test_a_prefill_is_counted_and_slots_prefill_one_row_in_chunks(pair):
    """A whole batch's prefill holds one layer's scores [rows, heads, P, keys] and MLP
    intermediates, in place of the round's working margin; through slots, one row's
    chunk of 32 queries; a draft model's catch-up, every row's chunk over its cache. A
    call refused for its long prompts fits through slots, as the refusal says."""
    target, draft = pair
    call = dict(key=jax.random.key(0), max_new_tokens=8)
    gen = Generator(target, NGram(), schedule=3)
    whole = gen.bind(LONG, **call).memory_plan
    assert whole.cache_len == 311
    # keys: the 300 tokens and the empty cache's smallest live prefix (256 of its 311)
    assert whole.prefill == _call(target.config, 2, 300, 300 + 256)
    assert whole.total == whole.parameters + whole.caches + whole.prefill > whole.working
    sliced = gen.bind(LONG, num_slots=1, **call).memory_plan
    # one row's 32 queries over themselves and its own cache of 320 (10 chunks), whole
    assert sliced.prefill == _call(target.config, 1, 32, 32 + 320)
    with_draft = Generator(target, draft, schedule=3).bind(LONG, num_slots=2, **call)
    catch_up = _call(draft.config, 2, 32, 32 + with_draft.cache_len)
    assert with_draft.memory_plan.prefill == max(catch_up, _call(target.config, 1, 32, 352))
    head = Generator(target, make_head(target), schedule=3)  # loads a slot's prompt whole
    whole_row = _call(head.draft_model.config, 1, 300, 300 + 300)  # its own cache of 300
    assert head.bind(LONG, num_slots=1, **call).memory_plan.prefill == max(
        whole_row, _call(target.config, 1, 32, 352)
    ) + _features(target, 1)
    limited = Generator(target, NGram(), schedule=3, device_memory=sliced.total)
    with pytest.raises(ValueError, match=r"prefill \d+\.\d+ GiB.*num_slots"):
        limited.bind(LONG, **call)
    assert limited.bind(LONG, num_slots=1, **call).memory_plan.total == sliced.total


@pytest.fixture
def chunk_of_128(monkeypatch):
    """A whole batch's prompts prefill in chunks past 128 positions (programs traced
    under either size are dropped before and after)."""
    jax.clear_caches()
    monkeypatch.setattr(prefill, "BATCH_CHUNK", 128)
    yield
    jax.clear_caches()


def test_a_long_prompts_prefill_is_counted_a_chunk_at_a_time(pair, chunk_of_128):
    """Prompts past `BATCH_CHUNK` positions (300 past 128: three calls of 100): the whole
    batch's prefill holds a chunk's queries over the cache, the head's too (a draft
    model's catch-up as before)."""
    target, draft = pair
    call = dict(key=jax.random.key(0), max_new_tokens=8)
    whole = Generator(target, NGram(), schedule=3).bind(LONG, **call).memory_plan
    assert whole.prefill == _call(target.config, 2, 100, 100 + 311)
    head = Generator(target, make_head(target), schedule=3)
    assert head.bind(LONG, **call).memory_plan.prefill == max(
        _call(target.config, 2, 100, 100 + 311), _call(head.draft_model.config, 2, 100, 100 + 311)
    ) + _features(target, 2)
    sliced = head.bind(LONG, num_slots=1, **call).memory_plan  # a slot's head load: 100 too
    assert sliced.prefill == max(
        _call(target.config, 1, 32, 352), _call(head.draft_model.config, 1, 100, 100 + 300)
    ) + _features(target, 1)


@pytest.mark.slow
@pytest.mark.parametrize("chunked", [False, True], ids=["one-call", "chunks"])
def test_a_prefills_plan_is_what_xla_allocates(pair, monkeypatch, chunked):
    """For calls the prefill dominates, the plan's temporaries are within 0.8-1.3x of
    what XLA allocates for the compiled program (its temporary buffers); in one call,
    and in chunks of 128."""
    target, draft = pair
    jax.clear_caches()
    if chunked:
        monkeypatch.setattr(prefill, "BATCH_CHUNK", 128)
    try:
        for drafter in (NGram(), draft):
            run = Generator(target, drafter, schedule=3).bind(
                LONG, key=jax.random.key(0), max_new_tokens=2
            )
            temp = run.lower().compile().memory_analysis().temp_size_in_bytes
            plan = run.memory_plan
            ratio = max(plan.prefill, plan.working) / temp
            name = type(drafter).__name__
            print(f"\nplan / XLA, {'chunks' if chunked else 'one call'}, {name}: {ratio:.3f}")
            assert 0.8 < ratio < 1.3, (plan, temp)
    finally:
        jax.clear_caches()
