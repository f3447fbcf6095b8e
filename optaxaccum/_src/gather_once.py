"""Gather once per step: FSDP-sharded parameters held, gathered, for the
micro-batches of one :func:`~optaxaccum.microbatched_value_and_grad` step.

A *held* leaf is gathered over the mesh axes ``over`` once per step
(:meth:`Plan.hold`); its held copy is *reduced* over every axis that shards
the batch, so :func:`~optaxaccum.fsdp_gather` of it moves nothing over those
axes and its gradient stays *unreduced* through the micro-batches: their
gradients are summed locally, unsharded over ``over``, and returned to the
parameter's sharding by one reduce-scatter after the last one
(:meth:`Plan.release`). The first and last micro-batch run outside the scan
(``microbatch.py``), so XLA can overlap the gathers with the first one's
forward and the reduce-scatters with the last one's backward. See
``docs/scaling.md``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from optaxaccum._src import checks, numerics, sharding

__all__ = ["GatherOnce"]


@dataclasses.dataclass(frozen=True)
class GatherOnce:
    """Gather FSDP-sharded parameters once per step, not per micro-batch.

    Given as ``gather_once`` to :func:`microbatched_value_and_grad` under
    :func:`jax.jit` on an explicit mesh, with the model gathering its weights
    with :func:`fsdp_gather`: each *held* leaf is gathered over the mesh axes
    ``over`` once, the micro-batches run on the held copy, and its summed
    gradient is reduce-scattered once after them, still unreduced over the
    axes :func:`unreduced_value_and_grad` defers (docs/scaling.md, "Gather
    once per step").

    Args:
      batch_axes: every mesh axis that shards the batch (a name or a tuple),
        as given to :func:`fsdp_gather`.
      over: the axes to gather over once (a name or a tuple, each one of
        ``batch_axes``); default: every axis of ``batch_axes`` sharding a
        leaf. Name the slow axis of a hierarchical mesh (``"replica"``) to
        keep gathering over a fast one every micro-batch.
      dtype: optional floating dtype of the held copies (e.g.
        ``jnp.bfloat16``: half the gathered bytes; the forward and backward
        run at that precision, the gradients are summed in float32).
      memory_budget: optional bytes per device for the held copies plus
        their unsharded gradient sums: leaves are held largest first while
        they fit, checked by compiling the step (never by running it); the
        compiled step then needs at most the same step's memory without
        holding plus ``memory_budget``. Default: hold every leaf.
      leaves: optional ``leaves(path, leaf) -> bool`` choosing the leaves
        that may be held (default: every floating leaf sharded over
        ``over``).
      peel: run the first and last micro-batch outside the scan, so XLA
        can hide the gathers and reduce-scatters under their layers;
        ``False``: all in the scan (less memory on XLA:CPU).

    Raises:
      TypeError: for an argument of the wrong type, naming it.
      ValueError: for a negative budget or an ``over`` axis not in
        ``batch_axes``; when the step is traced, for an axis not on the mesh
        (or no mesh at all) or an ``over`` axis that shards no parameter.

    Examples:
      >>> import jax.numpy as jnp, optaxaccum as oa
      >>> hold = oa.GatherOnce(("data", "fsdp"), dtype=jnp.bfloat16)
      >>> hold.over is None, hold.dtype
      (True, dtype(bfloat16))
      >>> # oa.microbatched_value_and_grad(loss_fn, 4, gather_once=hold)
    """

    batch_axes: Any
    _: dataclasses.KW_ONLY
    over: Any = None
    dtype: Any = None
    memory_budget: float | None = None
    leaves: Callable[[Any, Any], bool] | None = None
    peel: bool = True

    def __post_init__(self):
        names = checks.axis_names(self.batch_axes)
        object.__setattr__(self, "batch_axes", names)
        if self.over is not None:
            over = checks.axis_names(self.over)
            stray = [a for a in over if a not in names]
            if stray:
                raise ValueError(
                    f"GatherOnce: over={self.over!r} names {stray[0]!r}, "
                    f"which is not one of batch_axes={names!r}: "
                    "oa.fsdp_gather gathers over the axes that shard the "
                    "batch, and so does gather_once"
                )
            object.__setattr__(self, "over", over)
        if self.dtype is not None:
            dtype = _field(
                checks.check_float_dtype,
                "dtype",
                self.dtype,
                wrong_kind=TypeError,
            )
            object.__setattr__(self, "dtype", dtype)
        if self.memory_budget is not None:
            budget = _field(
                checks.check_real, "memory_budget", self.memory_budget
            )
            if not (budget >= 0 and math.isfinite(budget)):
                raise ValueError(
                    "GatherOnce: memory_budget must be a non-negative, "
                    "finite number of bytes per device, got "
                    f"memory_budget={self.memory_budget!r}"
                )
        _field(checks.check_callable, "leaves", self.leaves, none_ok=True)
        _field(checks.check_bool, "peel", self.peel)


def _field(check: Callable[..., Any], name: str, value: Any, **kw: Any) -> Any:
    """``check(name, value, **kw)``, its message prefixed with
    ``GatherOnce:`` once."""
    try:
        return check(name, value, **kw)
    except (TypeError, ValueError) as err:
        raise type(err)(f"GatherOnce: {err}") from None


# ------------------------------------------------------------- per leaf


@dataclasses.dataclass(frozen=True)
class _Leaf:
    """How one held leaf is held: ``dims`` (its padded partition entries),
    ``axes`` (the axes gathered once), ``spec`` (its own), ``held`` (the
    held copy's), ``mesh`` (its mesh) and ``dtype`` (the held copy's)."""

    dims: tuple[Any, ...]
    axes: frozenset
    spec: P
    held: P
    mesh: Any
    dtype: Any


def _leaf_plan(leaf: Any, cfg: GatherOnce) -> _Leaf | None:
    """The holding of ``leaf``, or None where nothing would be gathered."""
    if not jnp.issubdtype(jnp.result_type(leaf), jnp.floating):
        return None
    named = sharding.sharding_of(leaf)
    if named is None:
        return None
    spec = named.spec
    dims = sharding.padded_entries(spec, np.ndim(leaf))
    over = cfg.batch_axes if cfg.over is None else cfg.over
    axes = sharding.sharded_axes(dims) & frozenset(over)
    if not axes or not sharding.all_explicit(named.mesh, tuple(axes)):
        return None
    kept = sharding.drop_axes(dims, axes)
    reduced = spec.reduced | (
        frozenset(cfg.batch_axes) - sharding.sharded_axes(kept)
    )
    held = P(*kept, reduced=reduced)
    dtype = cfg.dtype or jnp.result_type(leaf)
    return _Leaf(dims, axes, spec, held, named.mesh, dtype)


def _gather(leaf: Any, how: _Leaf) -> jax.Array:
    """The held copy: ``leaf`` (cast first: fewer bytes move) gathered over
    ``how.axes`` once. The barrier pins the copy: XLA:TPU would otherwise
    repeat the gather for each of its users (the peeled micro-batches and
    the scan)."""
    return lax.optimization_barrier(
        jax.reshard(leaf.astype(how.dtype), how.held)
    )


def _scatter(acc: jax.Array, how: _Leaf) -> jax.Array:
    """The summed gradient of a held copy back to the leaf's sharding: a
    reduce-scatter over the held axes, a ``psum`` over any other batch axis
    it is unreduced over and the leaf is not reduced over (still unreduced
    over the leaf's own reduced axes)."""
    unreduced = sharding.unreduced_axes(acc)
    mesh = how.mesh
    rest = sharding.ordered_axes(mesh, unreduced - how.axes - how.spec.reduced)
    # Each dimension's held axes are scattered as the minor part of its
    # entry; a leaf whose entry orders them otherwise is resharded after.
    out_dims = []
    for entry in how.dims:
        axes = sharding.entry_axes(entry)
        kept = tuple(a for a in axes if a not in how.axes)
        out_dims.append(
            sharding.spec_entry(kept + tuple(a for a in axes if a in how.axes))
            if axes
            else None
        )

    def body(c):
        for i, entry in enumerate(how.dims):
            axes = tuple(a for a in sharding.entry_axes(entry) if a in how.axes)
            if axes:
                c = lax.psum_scatter(
                    c,
                    sharding.spec_entry(axes),
                    scatter_dimension=i,
                    tiled=True,
                )
        return lax.psum(c, rest) if rest else c

    out = P(*out_dims, unreduced=how.spec.reduced & unreduced)
    g = sharding.local_map(
        body, mesh=mesh, in_specs=sharding.spec_of(acc), out_specs=out
    )(acc)
    if tuple(out_dims) != tuple(how.dims):
        g = jax.reshard(g, P(*how.dims, unreduced=out.unreduced))
    return g


# ------------------------------------------------------------- the plan


class Plan:
    """Which leaves of the differentiated arguments are held, and how."""

    def __init__(self, hows: list[_Leaf | None], treedef: Any):
        self.hows = hows
        self.treedef = treedef

    @classmethod
    def nothing(cls, treedef: Any) -> Plan:
        """The plan holding no leaf of a tree of structure ``treedef``."""
        return cls([None] * treedef.num_leaves, treedef)

    @property
    def held(self) -> int:
        """The number of held leaves."""
        return sum(h is not None for h in self.hows)

    def hold(self, tree: Any) -> Any:
        """``tree`` with each held leaf replaced by its held copy."""
        leaves = self.treedef.flatten_up_to(tree)
        return self.treedef.unflatten(
            [
                x if h is None else _gather(x, h)
                for x, h in zip(leaves, self.hows, strict=True)
            ]
        )

    def release(self, acc: Any) -> Any:
        """The summed gradients ``acc`` with each held leaf's sum back in
        its leaf's sharding."""
        leaves = self.treedef.flatten_up_to(acc)
        return self.treedef.unflatten(
            [
                g if h is None else _scatter(g, h)
                for g, h in zip(leaves, self.hows, strict=True)
            ]
        )


def _check_on_mesh(field: str, names: tuple, tree: Any) -> None:
    """Every axis of ``names`` (the field ``field``) is an axis of the
    current mesh or of a leaf's mesh, or a mapped axis."""
    sharding.check_mesh_axes(
        names,
        "GatherOnce",
        tree,
        field=field,
        no_mesh="no mesh is set and no parameter is on one: it gathers "
        "parameters sharded on an explicit mesh. On one device there is "
        "nothing to gather: drop gather_once= from "
        "oa.microbatched_value_and_grad (or run the step under "
        "jax.set_mesh(mesh) with the parameters placed on it)",
    )


def _check_axes(cfg: GatherOnce, hows: list[_Leaf | None], tree: Any) -> None:
    """Every named axis is on the mesh; every ``over`` axis shards a leaf."""
    _check_on_mesh("batch_axes", cfg.batch_axes, tree)
    if cfg.over is None:
        return
    _check_on_mesh("over", cfg.over, tree)
    sharded = frozenset().union(*(h.axes for h in hows if h is not None))
    for a in cfg.over:
        if a not in sharded:
            raise ValueError(
                f"GatherOnce: over={cfg.over!r} names {a!r}, which shards "
                "the batch but no parameter: there is nothing to gather "
                f"over it (its gradients stay unreduced over {a!r} for the "
                "window's one reduction); name the axes that shard the "
                "parameters (FSDP)"
            )


def _cost(how: _Leaf, leaf: Any) -> int:
    """Bytes per device a held leaf adds: its held copy and its unsharded
    gradient sum (accumulator dtype)."""
    mesh = how.mesh
    share = int(
        np.prod(
            [mesh.shape[a] for a in sharding.sharded_axes(how.held.partitions)]
            or [1]
        )
    )
    size = int(np.prod(np.shape(leaf))) // share
    acc = numerics.widen(jnp.result_type(leaf))
    return size * (jnp.dtype(how.dtype).itemsize + jnp.dtype(acc).itemsize)


def plan(
    cfg: GatherOnce,
    tree: Any,
    measure: Callable[[Plan], int] | None = None,
) -> Plan:
    """The leaves of ``tree`` (the differentiated arguments) to hold.

    Without a budget: every leaf sharded over ``over`` (as ``cfg.leaves``
    allows). With one: the largest first while their :func:`_cost` fits,
    then fewer while ``measure(plan)`` (the compiled step's bytes beyond the
    step without holding) exceeds it.
    """
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    hows = [_leaf_plan(x, cfg) for _, x in flat]
    _check_axes(cfg, hows, tree)
    if cfg.leaves is not None:
        hows = [
            h if h is not None and cfg.leaves(path, x) else None
            for (path, x), h in zip(flat, hows, strict=True)
        ]
    if cfg.memory_budget is None:
        return Plan(hows, treedef)
    costs = {
        i: _cost(h, flat[i][1]) for i, h in enumerate(hows) if h is not None
    }
    chosen, used = [], 0
    for i in sorted(costs, key=lambda i: -costs[i]):  # the largest first
        if used + costs[i] <= cfg.memory_budget:
            chosen.append(i)
            used += costs[i]

    def subset(ids):
        return Plan(
            [h if i in ids else None for i, h in enumerate(hows)], treedef
        )

    while chosen and measure is not None:
        if measure(subset(set(chosen))) <= cfg.memory_budget:
            break
        chosen.pop()  # the smallest held leaf goes first
    return subset(set(chosen))
