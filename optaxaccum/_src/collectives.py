"""Collectives of a compiled (SPMD-partitioned) HLO module and the mesh axes
they span: :func:`collective_census`, for checking where a step communicates.

Each collective's ``replica_groups`` (explicit ``{{0,4},{1,5}}``, iota
``[4,2]<=[8]`` or mesh-style ``mesh['axis_0'=2,...] {'axis_0'}``) is turned
into device groups, and a group's mesh axes are those along which its
devices' coordinates in the mesh differ.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import numpy as np

from optaxaccum._src import hlo

OPS = (
    "all-reduce",
    "reduce-scatter",
    "all-gather",
    "all-to-all",
    "collective-permute",
)
_IOTA_RE = re.compile(r"^\[([\d,]*)\](?:<=\[([\d,]*)\])?(?:T\(([\d,]*)\))?$")
_GROUPS_RE = re.compile(
    r"replica_groups=(\{\{[\d,{} ]*\}\}|\{\}|\[[\d,]*\](?:<=\[[\d,]*\])?"
    r"(?:T\([\d,]*\))?|mesh\[([^\]]*)\](?:, device_ids=\(([^ ]*)\))?"
    r" \{([^}]*)\})"
)


def _ints(text: str) -> list[int]:
    return [int(t) for t in text.split(",") if t.strip()]


def _iota(text: str) -> np.ndarray:
    """An iota tile assignment ``[dims]<=[reshape]T(perm)`` as an array."""
    m = _IOTA_RE.match(text.strip())
    if m is None:
        raise ValueError(f"not an iota device list: {text!r}")
    dims, reshape, perm = _ints(m[1]), m[2], m[3]
    shape = _ints(reshape) if reshape is not None else dims
    ids = np.arange(int(np.prod(shape))).reshape(shape)
    if perm is not None:
        ids = ids.transpose(_ints(perm))
    return ids.reshape(dims)


def replica_groups(line: str, num_devices: int) -> list[tuple[int, ...]]:
    """The device groups of one collective instruction line."""
    m = _GROUPS_RE.search(line)
    if m is None or m[1] == "{}":
        return [tuple(range(num_devices))]
    text = m[1]
    if text.startswith("{{"):
        return [tuple(_ints(g)) for g in re.findall(r"\{([\d,]+)\}", text)]
    if text.startswith("["):
        return [tuple(row) for row in _iota(text).tolist()]
    sizes = [int(s.split("=")[1]) for s in m[2].split(",")]
    names = [s.split("=")[0].strip().strip("'") for s in m[2].split(",")]
    ids = _iota(m[3]) if m[3] else np.arange(int(np.prod(sizes)))
    ids = ids.reshape(sizes)
    varying = [names.index(a.strip().strip("'")) for a in m[4].split(",")]
    fixed = [i for i in range(len(sizes)) if i not in varying]
    size = int(np.prod([sizes[i] for i in varying]))
    groups = ids.transpose(fixed + varying).reshape(-1, size)
    return [tuple(g) for g in groups.tolist()]


def group_axes(
    groups: Iterable[tuple[int, ...]],
    mesh_ids: np.ndarray,
    axis_names: tuple[str, ...],
) -> frozenset[str]:
    """The mesh axes along which the devices of ``groups`` differ."""
    where = {int(d): np.argwhere(mesh_ids == d)[0] for d in mesh_ids.flat}
    axes = set()
    for g in groups:
        coords = np.stack([where[d] for d in g])
        axes.update(
            axis_names[i]
            for i in range(coords.shape[1])
            if len(set(coords[:, i])) > 1
        )
    return frozenset(axes)


def collective_census(compiled: Any, mesh: Any) -> list[dict]:
    """Every collective of a compiled step, where it runs and its mesh axes.

    Reads the compiled (SPMD-partitioned) HLO: the lowered module holds no
    collectives when Shardy partitions (JAX's default), so count in the
    compiled one. A collective inside a ``lax.cond`` branch (e.g. the
    window's reduction of :func:`accumulate`) runs only when that branch is
    taken. XLA may combine several reductions into one op (a tuple); an
    op inside a loop (``lax.scan``) is listed once, whatever its trip
    count, with ``loop=True``.

    Args:
      compiled: ``jax.jit(f).lower(*args).compile()`` or its ``as_text()``.
      mesh: the :class:`jax.sharding.Mesh` the step is partitioned over.

    Returns:
      One dict per collective: ``op`` (e.g. ``"all-reduce"``), ``bytes``
      (of its result), ``axes`` (frozenset of mesh axis names it spans),
      ``branches`` (the conditional branches leading to it; ``()`` when it
      runs on every call) and ``loop`` (whether it is inside a ``while``
      loop, e.g. a :func:`microbatched_value_and_grad` scan: once per
      iteration).

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import optaxaccum as oa
      >>> mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
      >>> compiled = jax.jit(jnp.sin).lower(jnp.ones(3)).compile()
      >>> oa.collective_census(compiled, mesh)
      []
    """
    text = compiled if isinstance(compiled, str) else compiled.as_text()
    mesh_ids = np.vectorize(lambda d: d.id)(mesh.devices)
    names = tuple(mesh.axis_names)
    found: list[dict] = []
    loops = hlo.loop_computations(text)
    for name, branches, line, shape, opcode in hlo.instructions(text):
        op = opcode.removesuffix("-start")
        if op in OPS:
            groups = replica_groups(line, mesh_ids.size)
            found.append(
                dict(
                    op=op,
                    bytes=hlo.shape_bytes(shape),
                    axes=group_axes(groups, mesh_ids, names),
                    branches=branches,
                    loop=name in loops,
                )
            )
    return found


def over(ops: list[dict], axis: str, *, top: bool | None = None) -> list[dict]:
    """The collectives of ``ops`` spanning ``axis``; with ``top`` only those
    run on every call (True) or only inside a conditional (False)."""
    return [
        o
        for o in ops
        if axis in o["axes"] and (top is None or (not o["branches"]) == top)
    ]


def collective_exposure(compiled: Any, *, min_bytes: int = 0) -> dict:
    """How much of a compiled step's communication overlaps compute.

    Reads the *scheduled* program: a collective is hidden when a GEMM (a
    ``dot``, a convolution, a GEMM custom call, or a fusion, call or
    conditional holding one) or a loop is scheduled between its start and
    its done, and exposed otherwise (every synchronous one). XLA:GPU's
    asynchronous collectives are ``-start``/``-done`` pairs; XLA:TPU's
    (async collective fusion) open in an ``AsyncCollectiveStart`` fusion,
    run on inside the compute fusions in flight and close in an
    ``AsyncCollectiveDone`` fusion: one collective, hidden.
    docs/scaling.md ("Gather once per step") shows it on 8 H200s and 8 TPU
    v5e chips; :func:`overlap_compiler_options` gives the options under
    which a gather-once step's collectives are hidden.

    Args:
      compiled: ``jax.jit(f).lower(*args).compile()`` or its ``as_text()``.
      min_bytes: count only collectives of at least this many bytes (e.g.
        the smallest weight's, to leave out scalar reductions).

    Returns:
      A dict: ``collectives`` (how many), ``exposed`` (with no compute in
      flight), ``in_loop`` (inside a ``while`` loop's body), ``bytes``
      (theirs, summed) and ``overlapped`` (the share of those bytes moved
      while compute runs, 0 to 1).

    Examples:
      >>> import jax, jax.numpy as jnp, optaxaccum as oa
      >>> compiled = jax.jit(jnp.sin).lower(jnp.ones(3)).compile()
      >>> oa.collective_exposure(compiled)["collectives"]
      0
    """
    text = compiled if isinstance(compiled, str) else compiled.as_text()
    return hlo.exposure(hlo.overlaps(text), min_bytes)
