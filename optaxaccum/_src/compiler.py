"""``oa.fold_compiler_options`` and ``oa.overlap_compiler_options``: the
per-jit XLA options of an in-place micro-step, and of a gather-once step
whose collectives run under compute."""

from __future__ import annotations

import jax

# XLA's copy insertion with its region-based live-range analysis, one name
# per backend. Each backend reads its own and ignores the other; XLA:TPU
# needs neither (it passes the accumulator through without a copy).
_REGION_ANALYSIS = (
    "xla_cpu_copy_insertion_use_region_analysis",
    "xla_gpu_copy_insertion_use_region_analysis",
)


def fold_compiler_options() -> dict[str, bool]:
    """XLA options for ``jax.jit(..., compiler_options=...)`` under which a
    micro-step that does not close its window moves no more bytes than the
    gradient's own computation.

    ``oa.apply_gradients`` and ``tx.update`` need none: their gate's branch
    is a loop of 0 or 1 trips, updated in place with no option on XLA:CPU,
    XLA:GPU and XLA:TPU. These options are for steps that branch with a
    conditional (on a mesh, a flush): XLA's default copy insertion cannot
    prove a conditional's pass-through of a value a fusion wrote safe and
    copies it; its region-based analysis proves it and elides the copy. They
    change how buffers are assigned, not what is computed: results are
    bit-identical (docs/gpu.md says what each backend compiles).

    Returns:
      A new dict naming XLA:CPU's and XLA:GPU's
      ``*_copy_insertion_use_region_analysis`` options, set to ``True``;
      each backend ignores the other's.

    Examples:
      >>> import jax, jax.numpy as jnp, optax, optaxaccum as oa
      >>> tx = oa.chain(oa.accumulate(4), optax.adam(1e-3))
      >>> params = {"w": jnp.zeros((256, 256))}
      >>> step = jax.jit(
      ...     lambda p, s, g: oa.apply_gradients(tx, g, s, p),
      ...     donate_argnums=(0, 1),
      ...     compiler_options=oa.fold_compiler_options(),
      ... )
      >>> compiled = step.lower(params, tx.init(params), params).compile()
      >>> compiled.memory_analysis().temp_size_in_bytes < 4096
      True
    """
    return dict.fromkeys(_REGION_ANALYSIS, True)


# Per platform, the per-jit options under which a gather-once step's
# collectives are scheduled under compute, each with what it does
# (docs/scaling.md's table of them is generated from this).
OVERLAP_OPTIONS: dict[str, dict[str, tuple[bool | int, str]]] = {
    "gpu": {
        "xla_gpu_all_gather_combine_threshold_bytes": (
            0,
            "combine no all-gathers: each held leaf's gather starts as soon "
            "as its leaf is ready instead of waiting in one combined "
            "collective for the last",
        ),
        "xla_gpu_reduce_scatter_combine_threshold_bytes": (
            0,
            "combine no reduce-scatters: each summed gradient is scattered "
            "as soon as the last micro-batch's backward has made it",
        ),
        "xla_gpu_experimental_parallel_collective_overlap_limit": (
            2,
            "let the latency-hiding scheduler keep two collectives in "
            "flight at once (a gather and a reduce-scatter)",
        ),
    },
    "tpu": {
        "xla_tpu_enable_async_collective_fusion": (
            True,
            "async collective fusion: a collective runs inside the compute "
            "fusions scheduled while it is in flight (continuation fusion)",
        ),
        "xla_tpu_enable_async_collective_fusion_multiple_steps": (
            True,
            "one all-gather may run on over several compute fusions",
        ),
        "xla_tpu_overlap_compute_collective_tc": (
            True,
            "overlap a collective with compute on the TensorCore",
        ),
        "xla_enable_async_all_gather": (
            True,
            "all-gathers asynchronous (start and done apart)",
        ),
    },
    "cpu": {},
}


def overlap_compiler_options(
    platform: str | None = None,
) -> dict[str, bool | int]:
    """XLA options for ``jax.jit(..., compiler_options=...)`` under which a
    gather-once step's collectives are scheduled under compute.

    With :class:`GatherOnce`, each held leaf's gather is issued where the
    first micro-batch's forward needs it and each summed gradient is
    reduce-scattered where the last micro-batch's backward makes it; these
    options let the compiler overlap them with the neighbouring layers'
    matrix products (read the result with :func:`collective_exposure`).
    XLA:GPU: no combining of all-gathers or reduce-scatters, two
    collectives in flight. XLA:TPU: async collective fusion and
    asynchronous all-gathers, the options every TPU generation compiles
    (on v5e libtpu's defaults, pinned); whether all-gathers run in
    continuation fusion stays libtpu's choice (on v5e by default; libtpu
    0.0.50 refuses it on other generations). XLA:CPU: none. They change
    the schedule, not what is computed.
    docs/scaling.md says what each option does and what the compiled
    programs show per platform.

    Args:
      platform: ``"gpu"``, ``"tpu"`` or ``"cpu"``; ``None`` (default):
        ``jax.default_backend()``.

    Returns:
      A new dict of option names and values.

    Raises:
      ValueError: ``platform`` is none of those.

    Examples:
      >>> import optaxaccum as oa
      >>> oa.overlap_compiler_options("gpu")[
      ...     "xla_gpu_experimental_parallel_collective_overlap_limit"]
      2
      >>> oa.overlap_compiler_options("cpu")
      {}
    """
    if platform is None:
        platform = jax.default_backend()
    if not isinstance(platform, str) or platform not in OVERLAP_OPTIONS:
        raise ValueError(
            "platform must be None, 'gpu', 'tpu' or 'cpu', got "
            f"platform={platform!r}"
        )
    return {name: v for name, (v, _) in OVERLAP_OPTIONS[platform].items()}
