"""One process of a multi-host `jax-specdec batch` job on this machine, with 4 simulated
CPU devices (XLA_FLAGS must be set before JAX starts); the CLI sets gloo collectives.
Every process runs the same command, e.g. two processes on mesh (4, 2):

    python tests/batch_multihost_run.py --input in.jsonl --output out.jsonl --mesh 4x2 \\
        --coordinator localhost:12345 --num-processes 2 --process-id 0 &
    python tests/batch_multihost_run.py --input in.jsonl --output out.jsonl --mesh 4x2 \\
        --coordinator localhost:12345 --num-processes 2 --process-id 1

(tests/test_batch_multihost.py runs them with tiny models; any `jax-specdec batch` flags
go through.)
"""

import os
import sys

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from jax_specdec.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["batch", *sys.argv[1:]]))
