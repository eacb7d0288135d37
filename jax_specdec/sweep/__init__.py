"""`jax-specdec sweep`: draft-length schedules × γ × temperature × batch on one pair
(`sweep.run`), and its report: JSON, markdown and PNG plots (`sweep.report`)."""

from jax_specdec.sweep.report import markdown_summary, summary, write_report
from jax_specdec.sweep.run import run_sweep

__all__ = ["markdown_summary", "run_sweep", "summary", "write_report"]
