"""Evaluation front ends: lm-evaluation-harness (`jax_specdec.eval.harness`, installed
with the `eval` extra: `pip install -e ".[eval]"`)."""
