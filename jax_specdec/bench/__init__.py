"""Measurement: timing (`bench.timing`), the speculative-vs-autoregressive benchmark
(`bench.benchmark`) and the calibration of a `CostModel`'s costs from the same timings
(`bench.calibrate`)."""

from jax_specdec.bench.benchmark import (
    expected_batch_rounds,
    expected_tokens_per_round,
    markdown_report,
    predicted_speedup,
    run_benchmark,
)
from jax_specdec.bench.calibrate import calibrate_costs, calibrate_round_costs
from jax_specdec.bench.timing import (
    Measurement,
    Timing,
    bare_matmul_time,
    decode_step_loop,
    decode_step_time,
    drop_programs_if_crowded,
    measure,
    peak_rss_mib,
    time_call,
    time_interleaved,
)

__all__ = [
    "Measurement",
    "Timing",
    "bare_matmul_time",
    "calibrate_costs",
    "calibrate_round_costs",
    "decode_step_loop",
    "decode_step_time",
    "drop_programs_if_crowded",
    "expected_batch_rounds",
    "expected_tokens_per_round",
    "markdown_report",
    "measure",
    "peak_rss_mib",
    "predicted_speedup",
    "run_benchmark",
    "time_call",
    "time_interleaved",
]
