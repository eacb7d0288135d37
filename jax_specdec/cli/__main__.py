import sys

from jax_specdec.cli import main

sys.exit(main())
