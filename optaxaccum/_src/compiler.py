"""``oa.fold_compiler_options``: the per-jit XLA options of an in-place
micro-step."""

from __future__ import annotations

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

    A window's accumulator is zeroed in the closing branch of the step's
    conditional; the branch every other call takes passes the donated
    accumulator through. XLA's default copy insertion cannot prove that
    pass-through safe when the accumulator was written by a fusion (XLA:CPU,
    and XLA:GPU's Triton GEMMs) and copies every accumulator on every such
    call; its region-based analysis proves it and elides the copy. cuBLAS
    GEMMs (jaxlib >= 0.11) and XLA:TPU need no option. The options change
    how buffers are assigned, not what is computed: results are bit-identical
    (docs/gpu.md says what each backend compiles).

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
