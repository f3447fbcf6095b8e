"""Flax integration: accumulated BatchNorm and a fused ``TrainState``.

``optaxaccum.flax`` needs ``flax`` (``pip install optaxaccum[flax]``); the
core package ``optaxaccum`` does not import it. The ``flax.nnx`` module lives
in :mod:`optaxaccum.flax.nnx`.
"""

from optaxaccum.flax._linen import (
    AccumBatchNorm,
    convert_batch_stats,
    flush_batch_stats,
)
from optaxaccum.flax._train_state import TrainState

__all__ = [
    "AccumBatchNorm",
    "TrainState",
    "convert_batch_stats",
    "flush_batch_stats",
]
