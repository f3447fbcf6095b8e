"""What the linen and the nnx ``AccumBatchNorm`` share beyond the window
arithmetic (:mod:`optaxaccum.batchnorm`): the documentation of their
``__call__``. Each layer writes its own call, as flax writes
``nn.BatchNorm``'s and ``nnx.BatchNorm``'s."""

from typing import Final

CALL_DOC: Final = """\
Normalizes ``x`` as the stock ``BatchNorm`` does (same arguments); in
training the running statistics see whole windows.

Args:
  x: the input.
  use_running_average: if true, normalize with the running statistics
    (evaluation); overrides the field of the same name.
  mask: optional boolean array broadcastable to ``x``: which elements
    count toward the statistics.

Returns:
  The normalized input, of the same shape.
"""
