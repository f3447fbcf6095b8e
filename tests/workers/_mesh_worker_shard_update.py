"""``_mesh_worker.py`` with ``oa.accumulate(..., shard_update=True)``: Adam's
state sharded over ``data`` and ``fsdp`` across the two processes (issue
27). Run as ``python _mesh_worker_shard_update.py PROCESS_ID NUM_PROCESSES
PORT OUT``."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _mesh_worker import main  # noqa: E402

if __name__ == "__main__":
    main(
        int(sys.argv[1]),
        int(sys.argv[2]),
        int(sys.argv[3]),
        sys.argv[4],
        shard_update=True,
    )
