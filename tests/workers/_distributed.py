"""What the two-process test workers (``_mesh_worker.py``,
``_multihost_worker.py``) share: joining the job on 127.0.0.1, and the
params each saves as one flat vector."""

from __future__ import annotations

import numpy as np


def join(process_id: int, num_processes: int, port: int, devices: int) -> None:
    """Joins the ``jax.distributed`` job with ``devices`` CPU devices and
    gloo collectives. Call it before anything starts JAX's backend."""
    import jax

    jax.config.update("jax_num_cpu_devices", devices)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=num_processes,
        process_id=process_id,
        initialization_timeout=60,
    )


def flatten(params) -> np.ndarray:
    """The params of a dict, one vector in the order of the sorted keys."""
    return np.concatenate([np.ravel(params[k]) for k in sorted(params)])
