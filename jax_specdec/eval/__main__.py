"""`python -m jax_specdec.eval ...`: lm-eval's command line with the `jax_specdec` model
registered (see `jax_specdec.eval.harness`)."""

import sys


def main() -> None:
    try:
        from lm_eval.__main__ import cli_evaluate

        import jax_specdec.eval.harness  # noqa: F401  (registers the model)
    except ImportError as e:
        sys.exit(f'jax_specdec.eval needs lm-eval: pip install -e ".[eval]" ({e})')
    cli_evaluate()


if __name__ == "__main__":
    main()
