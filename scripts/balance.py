"""Prints the one-position balance table; same as `jax-specdec balance`.

python scripts/balance.py --p 0.2,0.5,0.3 --q 0.6,0.3,0.1
"""

import sys

from jax_specdec.cli import main

if __name__ == "__main__":
    sys.exit(main(["balance", *sys.argv[1:]]))
