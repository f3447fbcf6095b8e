"""optaxaccum: gradient accumulation for JAX as composable optax transforms.

Users import :mod:`optaxaccum` (and :mod:`optaxaccum.flax` for the Flax
integration, :mod:`optaxaccum.batchnorm` for pooled BatchNorm statistics in
any framework); everything under ``optaxaccum._src`` is private.
"""

from optaxaccum._src.accumulate import (
    AccumulateState,
    accumulate,
    map_accumulators,
)
from optaxaccum._src.agc import agc, unitwise_norm
from optaxaccum._src.base import (
    Emitted,
    GateContext,
    GateFlushFn,
    GateResult,
    GateUpdateFn,
)
from optaxaccum._src.chain import apply_gradients, chain, flush
from optaxaccum._src.collectives import (
    collective_census,
    collective_exposure,
)
from optaxaccum._src.compiler import (
    fold_compiler_options,
    overlap_compiler_options,
)
from optaxaccum._src.every_weight import every_weight
from optaxaccum._src.gather_once import GatherOnce
from optaxaccum._src.gating import GatedTransformation, is_gate
from optaxaccum._src.loss_scale import (
    DynamicLossScaleState,
    StaticLossScaleState,
    dynamic_loss_scale,
    loss_scale,
    scaled_value_and_grad,
    static_loss_scale,
)
from optaxaccum._src.microbatch import (
    microbatched_step_memory,
    microbatched_value_and_grad,
    plan_microbatches,
)
from optaxaccum._src.mixed_precision import mixed_precision_dot_general
from optaxaccum._src.multisteps import MultiSteps, MultiStepsState
from optaxaccum._src.noise_scale import (
    NoiseScale,
    NoiseScaleState,
    critical_batch_every_k,
    noise_scale,
)
from optaxaccum._src.reshard import reshard_state
from optaxaccum._src.sharding import (
    fsdp_gather,
    state_shardings,
    unreduced_value_and_grad,
)
from optaxaccum._src.window_scale import (
    ScaleByWindowState,
    scale_by_window,
    window_progress,
)
from optaxaccum._src.windows import has_updated, optimizer_step

__version__ = "0.1.0"

__all__ = [
    "AccumulateState",
    "DynamicLossScaleState",
    "Emitted",
    "GateContext",
    "GateFlushFn",
    "GateResult",
    "GateUpdateFn",
    "GatedTransformation",
    "MultiSteps",
    "MultiStepsState",
    "NoiseScale",
    "NoiseScaleState",
    "StaticLossScaleState",
    "accumulate",
    "agc",
    "apply_gradients",
    "chain",
    "collective_census",
    "collective_exposure",
    "critical_batch_every_k",
    "fold_compiler_options",
    "dynamic_loss_scale",
    "flush",
    "has_updated",
    "is_gate",
    "loss_scale",
    "map_accumulators",
    "microbatched_step_memory",
    "microbatched_value_and_grad",
    "noise_scale",
    "overlap_compiler_options",
    "optimizer_step",
    "plan_microbatches",
    "reshard_state",
    "scaled_value_and_grad",
    "fsdp_gather",
    "state_shardings",
    "static_loss_scale",
    "unitwise_norm",
    "unreduced_value_and_grad",
    # Windows that follow the data, an optimizer that follows the window.
    "every_weight",
    "scale_by_window",
    "window_progress",
    "ScaleByWindowState",
    # Gather once per step.
    "GatherOnce",
    # Mixed precision at the floor.
    "mixed_precision_dot_general",
]

# Whole-matrix followers under shard_update (ZeRO-1 by ownership).
from optaxaccum._src.owned import WholeLeavesState, whole_leaves  # noqa: E402

__all__ += ["WholeLeavesState", "whole_leaves"]

# Pooled BatchNorm statistics for any framework: ``oa.batchnorm.step``.
from optaxaccum import batchnorm as batchnorm  # noqa: E402
