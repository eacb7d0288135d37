"""The schedule sweep on the shipped pair: `jax-specdec sweep` with its defaults.

    python scripts/sweep.py                       # batches 1,8,32,64; T 0,1; writes docs/sweep/
    python scripts/sweep.py --batches 1 --temperatures 0 --gammas 2 --max-gamma 2  # smoke

Arguments are those of `jax-specdec sweep --help`.
"""

import sys

from jax_specdec.cli import main

if __name__ == "__main__":
    sys.exit(main(["sweep", *sys.argv[1:]]))
