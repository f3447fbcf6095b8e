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

The follower's state (:class:`WholeLeavesState`): the state of the owned
matrices flattened and concatenated by dtype, one row per device of the
data axes (replicated over the other mesh axes, e.g. fsdp, within its data
group), and every other leaf as a global array (element-wise moments at
the ``shard_update`` placement): about ``1/data`` of the whole per device.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Hashable, Iterator
from typing import Any, NamedTuple

import jax
import jax.core
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from optaxaccum._src import checks, reducer, sharding

__all__ = ["whole_leaves", "WholeLeavesState"]


class WholeLeavesState(NamedTuple):
    """The state of a whole-leaves follower under ``shard_update=True``.

    Attributes:
      rows: by dtype name, an array of shape ``(data, length)`` sharded
        over the data axes: row ``d`` holds the state of the leaves device
        ``d`` of the data axes owns, flattened and concatenated (the same
        on the devices of the other mesh axes in its group).
      shared: every other leaf of the follower's state, in the order of
        its path (element-wise moments at the ``shard_update`` placement,
        counters replicated, stacked layers split over the data axes).
      owners: by dtype name, int32 of shape ``(owned leaves, 3)``: the
        ``(owner, offset, size)`` of each owned leaf's state in ``rows``,
        in the order of their paths (what ``oa.reshard_state`` reads).
    """

    rows: dict[str, jax.Array]
    shared: tuple[jax.Array, ...]
    owners: dict[str, jax.Array]


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
        raise ValueError(f"layer_axis must be None or 0, got {layer_axis=!r}")
    tx = optax.with_extra_args_support(tx)
    out = _WholeLeaves(tx.init, tx.update)
    out.layer_axis = layer_axis
    return out


def layer_axis_of(tx: Any) -> int | None:
    """The layer axis :func:`whole_leaves` marked ``tx`` with (``None``
    unmarked)."""
    return tx.layer_axis if isinstance(tx, _WholeLeaves) else None


def needs_whole_leaves(tx: Any, state: Any) -> bool:
    """Whether the follower ``tx``, whose state (or its shapes) is
    ``state``, runs by ownership: marked by :func:`whole_leaves`, already
    holding a :class:`WholeLeavesState`, or ``optax.contrib.muon`` itself,
    known by the state it makes (optax's public types): a partition into
    ``'muon'``, led by a ``MuonState``, and ``'adam'``. Muon inside another
    transformation is not: that one may not treat leaves independently."""
    if isinstance(tx, _WholeLeaves) or isinstance(state, WholeLeavesState):
        return True
    inner = getattr(state, "inner_states", None)
    if not isinstance(state, optax.PartitionState) or not isinstance(
        inner, dict
    ):
        return False
    muon = inner.get("muon")
    led = getattr(muon, "inner_state", None)
    return (
        set(inner) == {"muon", "adam"}
        and isinstance(muon, optax.MaskedState)
        and isinstance(led, tuple)
        and bool(led)
        and isinstance(led[0], optax.contrib.MuonState)
    )


def probed_state(tx: Any) -> Any:
    """The shapes of ``tx``'s state on a probe tree of one matrix and one
    vector, where params are not known yet (a chain being built); ``None``
    where ``tx`` cannot initialise on it (its labels expect the user's
    tree): the params' own state decides then."""
    probe = {
        "w": jax.ShapeDtypeStruct((2, 2), jnp.float32),
        "b": jax.ShapeDtypeStruct((2,), jnp.float32),
    }
    try:
        return jax.eval_shape(tx.init, probe)
    except Exception:  # noqa: BLE001 - any failure: not known yet
        return None


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
    axes = sharding.ordered_axes(mesh, checks.axis_names(axis_name))
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
            if layer_axis == 0 and len(shape) >= 3 and splits(shape, n):
                kind, move = "stacked", P(sharding.spec_entry(axes))
                loads += [_cost(shape) / n, math.prod(shape) / n]
        out.append(_Leaf(kind, 0, shape, dtype, spec, placed, move))
    return _Plan(mesh, axes, n, tuple(_assign(out, loads)), treedef)


def _assign(leaves: list[_Leaf], loads: np.ndarray) -> list[_Leaf]:
    """Each owned leaf given to one device: the largest first, each to the
    device whose larger share (of the total cost, of the total bytes)
    grows least; ties to the lowest index. Deterministic."""
    owned = [i for i, leaf in enumerate(leaves) if leaf.kind == "owned"]
    need = {
        i: (_cost(leaves[i].shape), math.prod(leaves[i].shape)) for i in owned
    }
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


class _Layout(NamedTuple):
    """Where the follower's state lies (static, per trace)."""

    branches: list  # per device d: its state's treedef and leaf paths
    owned: list  # per d: (path, type) of the state of the leaves d owns
    shared: dict  # path -> global type (with spec) of every other leaf
    packer: _Packer  # the rows of the owned leaves' state


def _paths(tree: Any) -> tuple[list[str], list[Any], Any]:
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    return (
        [jax.tree_util.keystr(k) for k, _ in flat],
        [x for _, x in flat],
        treedef,
    )


def layout(tx: Any, pl: _Plan) -> _Layout:
    """The state of device ``d``'s tree (:func:`_tree_for`) split into the
    state of the leaves ``d`` owns (rows) and the rest, the same leaves on
    every device (element-wise pieces, counters, stacked layers): one
    global array each, at its own spec."""
    branches, owned = [], []
    base = jax.eval_shape(tx.init, _masked_all(pl, _abstract(pl, 0)))
    base_paths = set(_paths(base)[0])
    for d in range(pl.n):
        paths, leaves, treedef = _paths(
            jax.eval_shape(tx.init, _tree_for(pl, d, _abstract(pl, d)))
        )
        branches.append((treedef, paths))
        owned.append(
            sorted((k, x) for k, x in zip(paths, leaves) if k not in base_paths)
        )
    glob = []
    for leaf in pl.leaves:
        spec = _in_spec(leaf)
        glob.append(
            jax.ShapeDtypeStruct(
                leaf.shape, leaf.dtype, sharding=NamedSharding(pl.mesh, spec)
            )
        )
    paths, leaves, _ = _paths(jax.eval_shape(tx.init, _masked_all(pl, glob)))
    shared = dict(zip(paths, leaves))
    packer = _Packer.of(*[[x for _, x in mine] for mine in owned])
    return _Layout(branches, owned, shared, packer)


def _masked_all(pl: _Plan, values: list) -> Any:
    """``values`` with every owned leaf masked."""
    leaves = [
        optax.MaskedNode() if leaf.kind == "owned" else v
        for v, leaf in zip(values, pl.leaves, strict=True)
    ]
    return jax.tree.unflatten(pl.treedef, leaves)


def _spec_of(x: Any) -> P:
    named = getattr(x, "sharding", None)
    if isinstance(named, NamedSharding):
        return sharding.without_unreduced(named.spec)
    return P()


def index(lay: _Layout) -> dict[str, np.ndarray]:
    """By dtype: one row ``(owner, offset, size)`` per owned state leaf, in
    the order of their paths: what :func:`optaxaccum.reshard_state` needs
    to move the rows onto another number of devices."""
    out: dict[str, list] = {k: [] for k in lay.packer.lengths}
    entries = []
    for d, mine in enumerate(lay.owned):
        at = dict.fromkeys(lay.packer.lengths, 0)
        for path, x in mine:
            k, size = jnp.dtype(x.dtype).name, math.prod(x.shape)
            entries.append((path, k, (d, at[k], size)))
            at[k] += size
    for _, k, row in sorted(entries):
        out[k].append(row)
    return {k: np.asarray(v, np.int32).reshape(-1, 3) for k, v in out.items()}


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
        piece = jax.ShapeDtypeStruct(
            _local(leaf.shape, leaf.move, pl.mesh), leaf.dtype
        )
        per_dest[leaf.owner] += [(i, t, piece) for t in range(trees)]
    packer = _Packer.of(*[[p for *_, p in dest] for dest in per_dest])
    return packer, per_dest


def _gather_whole(
    pl: _Plan, d: int, recv: dict, per_dest: list, packer: _Packer, trees: int
):
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


def _send(pl: _Plan, inputs: list, trees: int) -> tuple:
    """Each device's pieces of the moved leaves to their owners: one
    ``all_to_all`` over the data axes; one row per source comes back."""
    packer, per_dest = _send_layout(pl, trees)
    send = {k: [] for k in packer.lengths}
    for d in range(pl.n):
        dest = [inputs[t][i] for i, t, _ in per_dest[d]]
        for k, v in packer.pack(dest).items():
            send[k].append(v)
    send = {k: jnp.stack(v) for k, v in send.items()}
    if pl.n > 1:
        send = {
            k: lax.all_to_all(v, pl.axes, 0, 0, tiled=True)
            for k, v in send.items()
        }
    return send, packer, per_dest


def _run(tx, pl, lay, inputs, state, extra, trees):
    """One device's work inside the ``shard_map``: ``inputs`` per tree
    (params; or updates and params) one local value per leaf; ``state``
    the local ``(rows, shared)`` (``None``: ``tx.init``). Returns the owned
    leaves' updates (params' pieces), the other leaves' updates, and the
    new ``(rows, shared)``."""
    recv, packer, per_dest = _send(pl, inputs, trees)
    dtypes = [x.dtype for x in inputs[0]]  # the updates' (or params')
    out_like = [
        [
            _piece_shape(pl, leaf, dtypes[i])
            for i, leaf in enumerate(pl.leaves)
            if _owns(leaf, d)
        ]
        for d in range(pl.n)
    ]
    upd_packer = _Packer.of(*out_like)
    sent = (packer, per_dest, trees)
    branches = [_branch(tx, pl, lay, d, sent, upd_packer) for d in range(pl.n)]
    args = (recv, inputs, state, extra)
    if pl.n == 1:
        upd_rows, pieces, new = branches[0](*args)
    else:  # each device runs its own branch only
        r = lax.axis_index(pl.axes)
        upd_rows, pieces, new = lax.switch(r, branches, *args)
    if state is None:
        return None, None, new
    if pl.n > 1:  # the owners' updates back: one all-gather
        upd_rows = {
            k: lax.all_gather(v, pl.axes, axis=0, tiled=False)
            for k, v in upd_rows.items()
        }
    else:
        upd_rows = {k: v[None] for k, v in upd_rows.items()}
    owned = {}
    for d in range(pl.n):
        mine = [i for i, leaf in enumerate(pl.leaves) if _owns(leaf, d)]
        got = upd_packer.unpack(
            {k: v[d] for k, v in upd_rows.items()}, out_like[d]
        )
        owned.update(zip(mine, got, strict=True))
    return owned, pieces, new


def _branch(tx, pl, lay, d, sent, upd_packer):
    """Device ``d``'s branch: the follower on the leaves it owns (whole,
    from the pieces ``sent`` to it) and on its piece of the others."""
    packer, per_dest, trees = sent
    order = {k: j for j, k in enumerate(lay.shared)}

    def f(recv, inputs, state, extra):
        whole = _gather_whole(pl, d, recv, per_dest, packer, trees)
        values = [
            [whole.get((i, t), inputs[t][i]) for i in range(len(pl.leaves))]
            for t in range(trees)
        ]
        params = _tree_for(pl, d, values[-1])
        if state is None:
            new, owned_out, pieces = tx.init(params), [], []
        else:
            rows, shared = state
            like = [x for _, x in lay.owned[d]]
            mine = dict(
                zip([k for k, _ in lay.owned[d]], lay.packer.unpack(rows, like))
            )
            treedef, paths = lay.branches[d]
            leaves = [mine[k] if k in mine else shared[order[k]] for k in paths]
            upd, new = tx.update(
                _tree_for(pl, d, values[0]),
                jax.tree.unflatten(treedef, leaves),
                params,
                **extra,
            )
            dtypes = [x.dtype for x in values[0]]
            owned_out, pieces = _split_updates(
                pl, d, jax.tree.leaves(upd), dtypes
            )
        paths, leaves, _ = _paths(new)
        by_path = dict(zip(paths, leaves))
        rows = lay.packer.pack([by_path[k] for k, _ in lay.owned[d]])
        shared = tuple(by_path[k] for k in order)
        return upd_packer.pack(owned_out), pieces, (rows, shared)

    return f


def _owns(leaf: _Leaf, d: int) -> bool:
    return leaf.kind == "owned" and leaf.owner == d


def _split_updates(
    pl: _Plan, d: int, upd: list, dtypes: list
) -> tuple[list, list]:
    """Device ``d``'s updates (one per leaf it holds): the params' piece of
    each leaf it owns, and the other leaves' updates as they are."""
    flat = iter(upd)
    owned_out, pieces = [], []
    for i, leaf in enumerate(pl.leaves):
        if leaf.kind == "owned" and leaf.owner != d:
            continue
        u = next(flat)
        if leaf.kind == "owned":  # in the gradient's dtype, as packed
            owned_out.append(_piece_of(u, leaf.spec, pl.mesh).astype(dtypes[i]))
        elif leaf.kind == "stacked":  # its layers' piece at the params' spec
            pieces.append(_piece_of(u, _layers_spec(leaf), pl.mesh))
        else:
            pieces.append(u)
    return owned_out, pieces


def _piece_shape(pl: _Plan, leaf: _Leaf, dtype: Any) -> jax.ShapeDtypeStruct:
    """The type of a device's piece of ``leaf`` at the params' spec."""
    return jax.ShapeDtypeStruct(_local(leaf.shape, leaf.spec, pl.mesh), dtype)


def _rows_spec(pl: _Plan) -> P:
    """One row per device of the data axes (replicated over the others)."""
    return P(sharding.spec_entry(pl.axes))


def reshard(x: Any, spec: P) -> Any:
    """``x`` resharded to ``spec`` on its own mesh (traced or concrete)."""
    if spec == sharding.spec_of(x):
        return x
    if isinstance(x, jax.core.Tracer) or not isinstance(
        getattr(x, "sharding", None), NamedSharding
    ):
        return jax.reshard(x, sharding.named_sharding(x).update(spec=spec))
    return jax.device_put(x, x.sharding.update(spec=spec))


def _in_spec(leaf: _Leaf) -> P:
    return leaf.placed if leaf.kind == "piece" else leaf.move


def _out_spec(leaf: _Leaf) -> P:
    """Where a leaf that is not owned leaves the ``shard_map``: a piece at
    its placement; a stacked leaf's layers at the params' spec on its other
    dimensions (so that one all-gather over the data axes of the params'
    shard brings it to the params' sharding)."""
    if leaf.kind != "stacked":
        return _in_spec(leaf)
    entries = sharding.padded_entries(_layers_spec(leaf), len(leaf.shape))
    return P(sharding.padded_entries(leaf.move, 1)[0], *entries[1:])


def _layers_spec(leaf: _Leaf) -> P:
    """A stacked leaf's layers at the params' spec on its other dimensions
    (whole along the layers, which ``leaf.move`` splits)."""
    entries = sharding.padded_entries(leaf.spec, len(leaf.shape))
    return P(None, *entries[1:])


def _mapped(tx: Any, pl: _Plan, trees: list, state: Any, extra: dict) -> Any:
    """:func:`_run` in a ``shard_map`` over the whole mesh, from and to
    global arrays. ``state``: ``(rows, shared)`` or ``None`` (init)."""
    lay = layout(tx, pl)
    inputs = [
        # Through the element-wise placement (a local slice of the params):
        # from there to ``move`` is an all-gather over the other axes.
        [
            reshard(reshard(x, leaf.placed), _in_spec(leaf))
            for x, leaf in zip(t, pl.leaves)
        ]
        for t in trees
    ]
    in_specs = [[_in_spec(leaf) for leaf in pl.leaves] for _ in trees]
    arrays = {k: v for k, v in extra.items() if isinstance(v, jax.Array)}
    fixed = {k: v for k, v in extra.items() if k not in arrays}
    owned = [i for i, leaf in enumerate(pl.leaves) if leaf.kind == "owned"]
    rest = [leaf for leaf in pl.leaves if leaf.kind != "owned"]
    state_specs = (
        {k: _rows_spec(pl) for k in lay.packer.lengths},
        tuple(_spec_of(x) for x in lay.shared.values()),
    )

    def body(inputs, state, arrays):
        if state is not None:
            rows, shared = state
            state = ({k: v[0] for k, v in rows.items()}, shared)
        out, pieces, (rows, shared) = _run(
            tx, pl, lay, inputs, state, {**fixed, **arrays}, len(trees)
        )
        new = ({k: v[None] for k, v in rows.items()}, shared)
        if out is None:
            return new
        return [out[i] for i in owned], pieces, new

    out_specs: Any = state_specs
    if state is not None:
        out_specs = (
            [pl.leaves[i].spec for i in owned],
            [_out_spec(leaf) for leaf in rest],
            state_specs,
        )
    fn = jax.shard_map(
        body,
        mesh=pl.mesh,
        in_specs=(
            in_specs,
            None if state is None else state_specs,
            {k: P() for k in arrays},
        ),
        out_specs=out_specs,
        check_vma=False,
    )
    return fn(inputs, state, arrays), lay


def init(tx: Any, params: Any, axis_name: Any) -> WholeLeavesState:
    """The state of the whole-leaves follower ``tx`` for ``params`` (on a
    mesh whose data axes ``axis_name`` are Explicit)."""
    layer_axis = layer_axis_of(tx)
    pl = plan(params, axis_name, layer_axis)
    (rows, shared), lay = _mapped(tx, pl, [jax.tree.leaves(params)], None, {})
    found = index(lay)
    for record in _RECORDS:
        record.append((found, layered(pl, layer_axis)))
    idx = {k: jnp.asarray(v) for k, v in found.items()}
    return WholeLeavesState(rows, shared, idx)


_RECORDS: list[list] = []  # open recordings of the indexes init makes


class Layered(NamedTuple):
    """The leaves ``layer_axis=0`` may split along their layers, on a data
    size ``n``: their shapes."""

    n: int
    shapes: tuple[tuple[int, ...], ...]


def layered(pl: _Plan, layer_axis: int | None) -> Layered:
    """The :class:`Layered` leaves of ``pl``: none without a layer axis."""
    shapes = tuple(
        leaf.shape
        for leaf in pl.leaves
        if layer_axis == 0 and leaf.kind != "piece" and len(leaf.shape) >= 3
    )
    return Layered(pl.n, shapes)


@contextlib.contextmanager
def recording() -> Iterator[list]:
    """The :func:`index` of each :class:`WholeLeavesState` that ``init``
    makes inside the block (also under ``jax.eval_shape``, which keeps
    only their types), with its :func:`layered` leaves, in order."""
    found: list = []
    _RECORDS.append(found)
    try:
        yield found
    finally:
        _RECORDS.remove(found)


def splits(shape: tuple[int, ...], n: int) -> bool:
    """Whether a stacked leaf of ``shape`` is split along its layers (the
    leading dimension) over ``n`` devices of the data axes."""
    return n > 1 and shape[0] % n == 0


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
    if not isinstance(state, WholeLeavesState):
        raise ValueError(
            "under oa.accumulate(..., shard_update=True) a follower that "
            "needs whole leaves expects the oa.WholeLeavesState that the "
            "chain's init makes on the mesh (jax.jit(tx.init) under "
            "jax.set_mesh, or params placed on it); got "
            f"{type(state).__name__}"
        )
    layer_axis = layer_axis_of(tx)
    pl = plan(params, axis_name, layer_axis)
    trees = [jax.tree.leaves(updates), jax.tree.leaves(params)]
    (out, pieces, (rows, shared)), _ = _mapped(
        tx, pl, trees, (state.rows, state.shared), extra_args
    )
    out, pieces = iter(out), iter(pieces)
    leaves = []
    for leaf in pl.leaves:
        if leaf.kind == "owned":
            leaves.append(next(out))
        else:
            leaves.append(reshard(next(pieces), leaf.spec))
    new = WholeLeavesState(rows, shared, state.owners)
    return jax.tree.unflatten(pl.treedef, leaves), new
