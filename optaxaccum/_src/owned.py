"""Whole-matrix followers under ``shard_update=True``: *owned* leaves.

A follower that needs whole leaves (``optax.contrib.muon``, or any
transformation wrapped in :func:`whole_leaves`) cannot run on each device's
piece of a matrix. Under ``oa.accumulate(k, axis_name=..., shard_update=True)``
each of its matrices is instead *owned* by one device of the data axes
(:func:`_assign`: a greedy balance of the Newton–Schulz cost and the state's
bytes); a matrix stacked along a layer axis (``whole_leaves(tx,
layer_axis=0)``) is split along it, each device owning ``L / data`` layers.
Once per window (inside the closing branch):

1. each device sends the owners its piece of their matrices' window
   gradients (and of the params): one ``all_to_all`` over the data axes;
2. each device runs the follower on its own matrices (whole) and on its
   piece of every other leaf (element-wise, as the rest of ``shard_update``);
   a ``lax.switch`` on the device's data index picks its matrices, so each
   device computes only its own;
3. the updates return to the params' sharding by one ``all_gather`` over
   the data axes.

The follower's state is stored *per device*: its leaves, flattened and
concatenated by dtype, one row per device (:class:`WholeLeavesState`): about
``1/data`` of the whole per device. A device holds the state of the matrices
it owns (replicated over the other mesh axes, e.g. fsdp, within its data
group) and its piece of the element-wise leaves' state.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Hashable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from optaxaccum._src import reducer, sharding, utils

__all__ = ["whole_leaves", "WholeLeavesState"]


class WholeLeavesState(NamedTuple):
    """The state of a whole-leaves follower under ``shard_update=True``.

    Attributes:
      rows: by dtype name, an array of shape ``(devices, length)`` sharded
        over every mesh axis: row ``i`` holds device ``i``'s part of the
        follower's state (its owned matrices' state and its piece of the
        element-wise leaves' state), flattened and concatenated.
    """

    rows: dict[str, jax.Array]


class _WholeLeaves(optax.GradientTransformationExtraArgs):
    """A transformation marked by :func:`whole_leaves` (its ``layer_axis``
    in the instance's ``__dict__``)."""

    layer_axis: int | None


def whole_leaves(
    tx: optax.GradientTransformation, *, layer_axis: int | None = None
) -> optax.GradientTransformationExtraArgs:
    """Declares that ``tx`` needs whole matrices (ZeRO-1 by ownership).

    Unchanged on its own. After ``oa.accumulate(k, axis_name=...,
    shard_update=True)`` in an :func:`optaxaccum.chain`, each leaf of two
    or more dimensions is *owned* by one device of the data axes, which
    runs ``tx`` on it whole once per window; other leaves are split
    element by element as for any follower. ``optax.contrib.muon`` is
    recognised without it (``layer_axis=None``).

    ``tx`` must treat leaves independently (Newton–Schulz per matrix,
    Adam per element; no statistic over several leaves, such as a global
    norm: put such elements before it in the chain), and be the last
    element of the chain.

    Args:
      tx: an optax transformation.
      layer_axis: ``0`` if ``tx`` treats the leading dimension of a leaf of
        three or more dimensions as a stack of independent matrices
        (scanned layers, e.g. muon with ``MuonDimensionNumbers(1, 2)``):
        such a leaf whose layers the data size divides is split along it.
        ``None``: every leaf is owned whole.

    Returns:
      ``tx``, marked.

    Raises:
      ValueError: if ``layer_axis`` is neither ``None`` nor ``0``.

    Example:
      >>> import optax, optaxaccum as oa
      >>> muon = oa.whole_leaves(optax.contrib.muon(0.02), layer_axis=0)
      >>> tx = oa.chain(oa.accumulate(4, axis_name="data",
      ...                             shard_update=True), muon)
    """
    if layer_axis not in (None, 0) or isinstance(layer_axis, bool):
        raise ValueError(
            f"layer_axis must be None or 0, got {layer_axis=!r}"
        )
    tx = optax.with_extra_args_support(tx)
    out = _WholeLeaves(tx.init, tx.update)
    out.layer_axis = layer_axis
    return out


def layer_axis_of(tx: Any) -> tuple[bool, int | None]:
    """Whether ``tx`` needs whole leaves, and its layer axis."""
    if isinstance(tx, _WholeLeaves):
        return True, tx.layer_axis
    return _is_muon(tx), None


def _is_muon(tx: Any) -> bool:
    """Whether ``tx`` is what ``optax.contrib.muon`` returns: a partition
    into ``'muon'`` (led by ``scale_by_muon``) and ``'adam'``."""
    init = getattr(tx, "init", None)
    cells = getattr(init, "__closure__", None) or ()
    names = getattr(getattr(init, "__code__", None), "co_freevars", ())
    for name, cell in zip(names, cells):
        if name != "transforms":
            continue
        found = cell.cell_contents
        if not isinstance(found, dict) or set(found) != {"muon", "adam"}:
            return False
        return "scale_by_muon" in _qualnames(found["muon"], 3)
    return False


def _qualnames(x: Any, depth: int) -> str:
    """The qualified names of the functions reachable from ``x``'s init
    through closures, ``depth`` levels deep, joined."""
    fn = getattr(x, "init", x)
    out = getattr(fn, "__qualname__", "")
    if depth and callable(fn):
        for cell in getattr(fn, "__closure__", None) or ():
            c = cell.cell_contents
            items = c if isinstance(c, (tuple, list)) else (c,)
            for item in items:
                if callable(item) or hasattr(item, "init"):
                    out += " " + _qualnames(item, depth - 1)
    return out


# ------------------------------------------------------------------ plan


class _Leaf(NamedTuple):
    kind: str  # "owned" (by owner), "stacked" (split on dim 0), "piece"
    owner: int
    shape: tuple[int, ...]
    dtype: Any
    spec: P  # the params' spec (plain)
    placed: P  # the element-wise placement (shard_update)
    move: P  # how it travels: over the data axes only


class _Plan(NamedTuple):
    mesh: Any
    axes: tuple[Hashable, ...]  # the data axes, in the mesh's order
    n: int  # their size
    leaves: tuple[_Leaf, ...]
    treedef: Any


def _cost(shape: tuple[int, ...]) -> float:
    """Newton–Schulz's cost of a leaf: its size times its smaller matrix
    dimension (the last two)."""
    return float(math.prod(shape)) * min(shape[-2:])


def plan(params: Any, axis_name: Any, layer_axis: int | None) -> _Plan:
    """Where each leaf of ``params`` (global arrays or types, on a mesh
    whose data axes ``axis_name`` are Explicit) lies for the follower."""
    leaves, treedef = jax.tree.flatten(params)
    named = [sharding.named_sharding(p) for p in leaves]
    mesh = named[0].mesh
    axes = sharding.ordered_axes(mesh, utils.axis_names(axis_name))
    n = math.prod(mesh.shape[a] for a in axes)
    out, loads = [], np.zeros((n, 2))
    for p, s in zip(leaves, named, strict=True):
        spec = sharding.without_unreduced(s.spec)
        if sharding.sharded_axes(spec.partitions) & set(axes):
            raise ValueError(
                "a follower that needs whole leaves (optax.contrib.muon, "
                "oa.whole_leaves) under shard_update=True needs params not "
                f"sharded over the data axes {axes}; got {spec} for a leaf "
                f"of shape {p.shape}"
            )
        shape, dtype = tuple(p.shape), jnp.dtype(p.dtype)
        placed = reducer.placed_spec(spec, shape, mesh, axes)
        kind, move = "piece", placed
        floating = jnp.issubdtype(dtype, jnp.inexact)
        if floating and len(shape) >= 2:
            kind = "owned"
            move = reducer.placed_spec(P(), shape, mesh, axes)
            split = layer_axis == 0 and len(shape) >= 3 and n > 1
            if split and shape[0] % n == 0:
                kind, move = "stacked", P(sharding.spec_entry(axes))
                loads += [_cost(shape) / n, math.prod(shape) / n]
        out.append(_Leaf(kind, 0, shape, dtype, spec, placed, move))
    return _Plan(mesh, axes, n, tuple(_assign(out, loads)), treedef)


def _assign(leaves: list[_Leaf], loads: np.ndarray) -> list[_Leaf]:
    """Each owned leaf given to one device: the largest first, each to the
    device whose larger share (of the total cost, of the total bytes)
    grows least; ties to the lowest index. Deterministic."""
    owned = [i for i, leaf in enumerate(leaves) if leaf.kind == "owned"]
    need = {i: (_cost(leaves[i].shape), math.prod(leaves[i].shape)) for i in owned}
    total = loads.sum(0) + np.sum([need[i] for i in owned] or [[0, 0]], 0)
    total = np.maximum(total, 1.0)
    for i in sorted(owned, key=lambda i: (-need[i][0], -need[i][1], i)):
        share = ((loads + need[i]) / total).max(1)
        d = int(np.argmin(share))  # the first of equals
        loads[d] += need[i]
        leaves[i] = leaves[i]._replace(owner=d)
    return leaves


# ---------------------------------------------------------- local shapes


def _local(shape: tuple[int, ...], spec: P, mesh: Any) -> tuple[int, ...]:
    """A device's piece of an array of ``shape`` at ``spec``."""
    entries = sharding.padded_entries(spec, len(shape))
    return tuple(
        s // math.prod(mesh.shape[a] for a in sharding.entry_axes(e))
        for s, e in zip(shape, entries, strict=True)
    )


def _split_dim(leaf: _Leaf) -> int | None:
    """The dimension the data axes split in ``leaf.move``, if any."""
    entries = sharding.padded_entries(leaf.move, len(leaf.shape))
    found = [i for i, e in enumerate(entries) if e is not None]
    return found[0] if found else None


def _piece_of(x: jax.Array, spec: P, mesh: Any) -> jax.Array:
    """Inside ``shard_map``: this device's piece of the whole ``x`` at
    ``spec`` (axes other than the data axes; a dynamic slice)."""
    entries = sharding.padded_entries(spec, x.ndim)
    for i, e in enumerate(entries):
        axes = sharding.entry_axes(e)
        if not axes:
            continue
        size = x.shape[i] // math.prod(mesh.shape[a] for a in axes)
        x = lax.dynamic_slice_in_dim(x, lax.axis_index(axes) * size, size, i)
    return x


class _Packer(NamedTuple):
    """Arrays of fixed shapes flattened and concatenated by dtype into rows
    of fixed lengths (the longest of several such lists)."""

    lengths: dict[str, int]

    @staticmethod
    def of(*groups: list[Any]) -> _Packer:
        lengths: dict[str, int] = {}
        for group in groups:
            used: dict[str, int] = {}
            for x in group:
                k = jnp.dtype(x.dtype).name
                used[k] = used.get(k, 0) + math.prod(x.shape)
            for k, v in used.items():
                lengths[k] = max(lengths.get(k, 0), v)
        return _Packer(lengths)

    def pack(self, xs: list[jax.Array]) -> dict[str, jax.Array]:
        parts: dict[str, list[jax.Array]] = {k: [] for k in self.lengths}
        for x in xs:
            parts[jnp.dtype(x.dtype).name].append(jnp.ravel(x))
        out = {}
        for k, length in self.lengths.items():
            flat = jnp.concatenate([*parts[k], jnp.zeros((0,), k)])
            out[k] = jnp.pad(flat, (0, length - flat.shape[0]))
        return out

    def unpack(self, rows: dict[str, jax.Array], like: list[Any]) -> list:
        at = dict.fromkeys(self.lengths, 0)
        out = []
        for x in like:
            k, size = jnp.dtype(x.dtype).name, math.prod(x.shape)
            out.append(rows[k][at[k] : at[k] + size].reshape(x.shape))
            at[k] += size
        return out


# ------------------------------------------------------------ the runner


def _mine(pl: _Plan, d: int, leaf: _Leaf) -> bool:
    return leaf.kind != "owned" or leaf.owner == d


def _tree_for(pl: _Plan, d: int, values: list) -> Any:
    """The tree device ``d`` gives the follower: ``values`` (one per leaf)
    where ``d`` holds the leaf, ``optax.MaskedNode()`` where another device
    owns it."""
    leaves = [
        v if _mine(pl, d, leaf) else optax.MaskedNode()
        for v, leaf in zip(values, pl.leaves, strict=True)
    ]
    return jax.tree.unflatten(pl.treedef, leaves)


def _abstract(pl: _Plan, d: int) -> list[jax.ShapeDtypeStruct]:
    """The shapes device ``d`` gives the follower (one per leaf)."""
    out = []
    for leaf in pl.leaves:
        if leaf.kind == "owned":
            shape = leaf.shape
        elif leaf.kind == "stacked":
            shape = (leaf.shape[0] // pl.n, *leaf.shape[1:])
        else:
            shape = _local(leaf.shape, leaf.placed, pl.mesh)
        out.append(jax.ShapeDtypeStruct(shape, leaf.dtype))
    return out


def _state_shapes(tx: Any, pl: _Plan) -> list[Any]:
    """Per device ``d``: the follower state's treedef and leaf types."""
    out = []
    for d in range(pl.n):
        params = _tree_for(pl, d, _abstract(pl, d))
        leaves, treedef = jax.tree.flatten(jax.eval_shape(tx.init, params))
        out.append((treedef, leaves))
    return out


def _moved(pl: _Plan) -> list[int]:
    """The owned leaves that travel to their owner (split over the data
    axes in ``move``)."""
    return [
        i
        for i, leaf in enumerate(pl.leaves)
        if leaf.kind == "owned" and _split_dim(leaf) is not None
    ]


def _send_layout(pl: _Plan, trees: int) -> tuple[_Packer, list[list]]:
    """The all_to_all's rows: for destination ``d``, each of the ``trees``
    trees' pieces of the moved leaves ``d`` owns."""
    per_dest = [[] for _ in range(pl.n)]
    for i in _moved(pl):
        leaf = pl.leaves[i]
        piece = jax.ShapeDtypeStruct(_local(leaf.shape, leaf.move, pl.mesh), leaf.dtype)
        per_dest[leaf.owner] += [(i, t, piece) for t in range(trees)]
    packer = _Packer.of(*[[p for *_, p in dest] for dest in per_dest])
    return packer, per_dest


def _gather_whole(pl: _Plan, d: int, recv: dict, per_dest: list, packer: _Packer, trees: int):
    """Inside device ``d``'s branch: the whole moved leaves it owns, from
    the pieces every device sent (``recv``: one row per source)."""
    mine = per_dest[d]
    like = [p for *_, p in mine]
    by_source = [
        packer.unpack({k: v[s] for k, v in recv.items()}, like)
        for s in range(pl.n)
    ]
    whole = {}
    for j, (i, t, _) in enumerate(mine):
        dim = _split_dim(pl.leaves[i])
        whole[i, t] = jnp.concatenate([src[j] for src in by_source], dim)
    return whole


def _run(tx: Any, pl: _Plan, inputs: list, state_rows: Any, extra: dict, trees: int):
    """The shard_map body's work on one device: ``inputs`` are per tree
    (``trees`` of them: params; or updates and params) a list of local
    values per leaf; returns the owned updates' params pieces rows, the
    other leaves' update pieces and the new state rows (``state_rows`` None:
    the state of ``tx.init``)."""
    r = lax.axis_index(pl.axes) if pl.n > 1 else 0
    packer, per_dest = _send_layout(pl, trees)
    send = {k: [] for k in packer.lengths}
    for d in range(pl.n):
        dest = [inputs[t][i] for i, t, _ in per_dest[d]]
        for k, v in packer.pack(dest).items():
            send[k].append(v)
    send = {k: jnp.stack(v) for k, v in send.items()}
    if pl.n > 1 and send:
        recv = {
            k: lax.all_to_all(v, pl.axes, 0, 0, tiled=True)
            for k, v in send.items()
        }
    else:
        recv = send
    shapes = _state_shapes(tx, pl)
    state_packer = _Packer.of(*[leaves for _, leaves in shapes])
    out_like = [
        [_piece_shape(pl, leaf) for leaf in pl.leaves if leaf.kind == "owned" and leaf.owner == d]
        for d in range(pl.n)
    ]
    upd_packer = _Packer.of(*out_like)

    def branch(d):
        def f(recv, inputs, state_rows, extra):
            whole = _gather_whole(pl, d, recv, per_dest, packer, trees)
            values = [
                [whole.get((i, t), inputs[t][i]) for i in range(len(pl.leaves))]
                for t in range(trees)
            ]
            params = _tree_for(pl, d, values[-1])
            treedef, like = shapes[d]
            if state_rows is None:
                new = tx.init(params)
                upd_rows, pieces = upd_packer.pack([]), []
            else:
                state = jax.tree.unflatten(treedef, state_packer.unpack(state_rows, like))
                updates = _tree_for(pl, d, values[0])
                upd, new = tx.update(updates, state, params, **extra)
                upd = jax.tree.leaves(upd)
                flat = iter(upd)
                owned_out, pieces = [], []
                for leaf in pl.leaves:
                    if leaf.kind == "owned" and leaf.owner != d:
                        continue
                    u = next(flat)
                    if leaf.kind == "owned":
                        owned_out.append(_piece_of(u, leaf.spec, pl.mesh))
                    else:
                        pieces.append(u)
                upd_rows = upd_packer.pack(owned_out)
            return upd_rows, pieces, state_packer.pack(jax.tree.leaves(new))

        return f

    args = (recv, inputs, state_rows, extra)
    if pl.n == 1:
        upd_rows, pieces, new_rows = branch(0)(*args)
    else:
        upd_rows, pieces, new_rows = lax.switch(r, [branch(d) for d in range(pl.n)], *args)
    if state_rows is None:
        return None, None, new_rows
    gathered = {
        k: (lax.all_gather(v, pl.axes, axis=0, tiled=False) if pl.n > 1 else v[None])
        for k, v in upd_rows.items()
    }
    owned = {}
    for d in range(pl.n):
        mine = [i for i, leaf in enumerate(pl.leaves) if leaf.kind == "owned" and leaf.owner == d]
        got = upd_packer.unpack({k: v[d] for k, v in gathered.items()}, out_like[d])
        owned.update(zip(mine, got, strict=True))
    return owned, pieces, new_rows


def _piece_shape(pl: _Plan, leaf: _Leaf) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(_local(leaf.shape, leaf.spec, pl.mesh), leaf.dtype)


def _every(pl: _Plan) -> P:
    """One row per device: the leading dimension over every mesh axis."""
    return P(sharding.spec_entry(tuple(pl.mesh.axis_names)))


def _reshard(x: Any, spec: P) -> Any:
    from optaxaccum._src import shard_update  # a cycle: it imports us

    return shard_update._reshard(x, spec)


def _in_spec(leaf: _Leaf) -> P:
    return leaf.placed if leaf.kind == "piece" else leaf.move


def _mapped(
    tx: Any, pl: _Plan, trees: list, rows: Any, extra: dict
) -> tuple[Any, Any, dict]:
    """:func:`_run` in a ``shard_map`` over the whole mesh, from and to
    global arrays."""
    inputs = [
        [_reshard(x, _in_spec(leaf)) for x, leaf in zip(t, pl.leaves)]
        for t in trees
    ]
    in_specs = [[_in_spec(leaf) for leaf in pl.leaves] for _ in trees]
    arrays = {k: v for k, v in extra.items() if isinstance(v, jax.Array)}
    fixed = {k: v for k, v in extra.items() if k not in arrays}
    rest = [leaf for leaf in pl.leaves if leaf.kind != "owned"]
    owned = [i for i, leaf in enumerate(pl.leaves) if leaf.kind == "owned"]
    every = _every(pl)

    def body(inputs, rows, arrays):
        local = None if rows is None else {k: v[0] for k, v in rows.items()}
        out, pieces, new = _run(
            tx, pl, inputs, local, {**fixed, **arrays}, len(trees)
        )
        new = {k: v[None] for k, v in new.items()}
        if out is None:
            return new
        return [out[i] for i in owned], pieces, new

    rows_spec = None if rows is None else {k: every for k in rows}
    if rows is None:
        state_shapes = _state_shapes(tx, pl)
        out_specs: Any = {
            k: every
            for k in _Packer.of(*[lv for _, lv in state_shapes]).lengths
        }
    else:
        out_specs = (
            [pl.leaves[i].spec for i in owned],
            [_in_spec(leaf) for leaf in rest],
            {k: every for k in rows},
        )
    fn = jax.shard_map(
        body,
        mesh=pl.mesh,
        in_specs=(in_specs, rows_spec, {k: P() for k in arrays}),
        out_specs=out_specs,
        check_vma=False,
    )
    return fn(inputs, rows, arrays)


def init(tx: Any, params: Any, axis_name: Any) -> WholeLeavesState:
    """The state of the whole-leaves follower ``tx`` for ``params`` (on a
    mesh whose data axes ``axis_name`` are Explicit)."""
    _, layer_axis = layer_axis_of(tx)
    pl = plan(params, axis_name, layer_axis)
    rows = _mapped(tx, pl, [jax.tree.leaves(params)], None, {})
    return WholeLeavesState(rows)


def update(
    tx: Any,
    updates: Any,
    state: WholeLeavesState,
    params: Any,
    axis_name: Any,
    extra_args: dict[str, Any],
) -> tuple[Any, WholeLeavesState]:
    """``tx`` stepped on the window's ``updates`` (at the element-wise
    placement of ``shard_update``) by ownership; the updates at the
    params' sharding."""
    _, layer_axis = layer_axis_of(tx)
    pl = plan(params, axis_name, layer_axis)
    trees = [jax.tree.leaves(updates), jax.tree.leaves(params)]
    out, pieces, rows = _mapped(tx, pl, trees, state.rows, extra_args)
    out, pieces = iter(out), iter(pieces)
    leaves = []
    for leaf in pl.leaves:
        if leaf.kind == "owned":
            leaves.append(next(out))
        else:
            leaves.append(_reshard(next(pieces), leaf.spec))
    return jax.tree.unflatten(pl.treedef, leaves), WholeLeavesState(rows)
