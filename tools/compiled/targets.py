"""Devices to compile for without the hardware, and compiling for them.

XLA:GPU compiles for an H100 or H200 that is not there when the jax CUDA
plugin (``jax-cuda13-pjrt`` and ``jax-cuda13-plugin`` of jaxlib's version) is
importable and is given one of XLA's target configs (this folder's
``*.txtpb``, see tests/gpu_compile/README.md); XLA:TPU compiles for a v5e
slice with ``libtpu``.
Run with ``JAX_PLATFORMS=cpu JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1`` and the
folder holding the wheels on ``PYTHONPATH`` (``plugins.py`` sets that up).
"""

from __future__ import annotations

import contextlib
import functools
import pathlib

import jax

HERE = pathlib.Path(__file__).resolve().parent
# XLA's target configs: the H100 one of 2026-06 still parses with jaxlib
# 0.10.2 (whose proto lacks fields the newer configs set).
GPU_TARGETS = {
    "h100": HERE / "xla_target_h100_sxm_2026-06.txtpb",
    "h200": HERE / "xla_target_h200.txtpb",
}
TPU_TOPOLOGY = "v5e:2x4"


@functools.cache
def gpu_device(target: str) -> jax.Device:
    """The first GPU of a one-GPU topology of ``target`` (``"h100"`` or
    ``"h200"``); raises where this jaxlib cannot read its config."""
    from jax.experimental import topologies

    topo = topologies.get_topology_desc(
        platform="cuda",
        topology_name="",
        target_config=GPU_TARGETS[target].read_text(),
        topology="1x1x1",
    )
    return topo.devices[0]


@functools.cache
def tpu_device() -> jax.Device:
    """The first chip of a TPU v5e 2x4 slice (needs libtpu)."""
    from jax.experimental import topologies

    return topologies.get_topology_desc(TPU_TOPOLOGY, "tpu").devices[0]


def abstract(tree, device: jax.Device):
    """``tree``'s arrays as shapes placed on ``device``."""
    sharding = jax.sharding.SingleDeviceSharding(device)

    def one(x):
        if not hasattr(x, "shape"):
            return x
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    return jax.tree.map(one, tree)


def compile_for(fn, args, device: jax.Device, donate=(), options=None):
    """``jax.jit(fn, donate_argnums=donate, compiler_options=options)``
    compiled for ``device`` at the users' default matmul precision (tests
    run at ``"highest"``)."""
    with jax.default_matmul_precision("default"):
        lowered = jax.jit(
            fn, donate_argnums=donate, compiler_options=options
        ).lower(*abstract(args, device))
        return lowered.compile()


# The compiler settings a card may compile a train step in: its GEMMs as
# Triton fusions (what a compile without a GPU picks) or as cuBLAS-LT calls
# (the autotuner picks per GEMM on a card), each with or without
# oa.fold_compiler_options(); per-jit options, so one process compiles all.
SETTINGS = ("triton", "triton+options", "cublas", "cublas+options")


def options(setting: str) -> dict:
    """The per-jit compiler options of a setting of :data:`SETTINGS`."""
    import optaxaccum as oa

    out = {}
    if setting.startswith("cublas"):
        out["xla_gpu_enable_triton_gemm"] = False
    if setting.endswith("+options"):
        out.update(oa.fold_compiler_options())
    return out


def describe(device: jax.Device) -> str:
    import jaxlib

    return f"{device.device_kind} (jaxlib {jaxlib.__version__})"


@contextlib.contextmanager
def barriers_off():
    """Compiles the gates without the optimization barriers that keep each
    one a conditional on XLA:GPU (``flags.cond_or_call``): the control that
    shows what the barriers are for."""
    from optaxaccum._src import flags

    saved = flags._barrier
    flags._barrier = lambda tree: tree
    try:
        yield
    finally:
        flags._barrier = saved


@functools.cache
def gpu_devices8(target: str) -> list:
    """The 8 GPUs of one host (topology ``1x1x8``) of ``target``."""
    from jax.experimental import topologies

    topo = topologies.get_topology_desc(
        platform="cuda",
        topology_name="",
        target_config=GPU_TARGETS[target].read_text(),
        topology="1x1x8",
    )
    return list(topo.devices)


# Eight chips of each TPU generation libtpu compiles for without the chips.
TPU_GENERATIONS = {
    "v4": "v4:2x2x2",
    "v5e": TPU_TOPOLOGY,
    "v5p": "v5p:2x2x2",
    "v6e": "v6e:2x4",
}


@functools.cache
def tpu_devices8(generation: str = "v5e") -> list:
    """The 8 chips of a TPU slice of ``generation`` (v5e: 2x4; needs
    libtpu)."""
    from jax.experimental import topologies

    topology = TPU_GENERATIONS[generation]
    return list(topologies.get_topology_desc(topology, "tpu").devices)
