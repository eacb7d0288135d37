"""The roofline's predicted costs: bandwidth-bound small calls cost the same for 1 or 9
tokens, compute catches up with many rows, and the figures follow from the shapes."""

import pytest

from jax_specdec.bench.roofline import DEVICES, LLAMA_8B, SMOLLM2, call_seconds, predict_rounds


def test_a_decode_step_of_smollm2_reads_its_weights_once():
    h200 = DEVICES["h200"]
    weights = 30 * (576 * 64 * (2 * 9 + 2 * 3) + 3 * 576 * 1536) + 576 * 49152
    kv = 2 * 30 * 3 * 64 * 1 * 1024
    assert call_seconds(SMOLLM2, h200, 1, 1, 1024) == pytest.approx(2 * (weights + kv) / 4.8e12)


def test_wide_calls_cost_a_step_until_compute_catches_up():
    v5e = DEVICES["v5e"]
    one = call_seconds(LLAMA_8B, v5e, 1, 1, 1024)
    assert call_seconds(LLAMA_8B, v5e, 1, 65, 1024) == pytest.approx(one)
    assert call_seconds(LLAMA_8B, v5e, 64, 65, 1024) > 5 * one  # 4160 rows: compute-bound


def test_round_costs_in_steps():
    costs = predict_rounds(SMOLLM2, DEVICES["h200"], 1)
    assert 1.0 < costs["chain 4"] < costs["chain 8"]  # drafting steps are not free
    assert costs["tree 8:6:2"] == pytest.approx(costs["tree 64:6:10"])  # both bandwidth-bound
    big = predict_rounds(LLAMA_8B, DEVICES["h200"], 64)
    assert big["tree 64:6:10"] > 5 * big["tree 8:6:2"]
