"""``oa.reshard_state``: a saved optimizer state placed on another mesh.

On a ``jax.jit`` mesh the accumulator of an unclosed window (and the noise
scale's ``sq_sum``) is stored *stacked*: one row per device's partial sum, a
leading dimension of the size of the data axes (docs/scaling.md,
"Checkpointing"). Only the sum of the rows means anything, so a state saved
on one mesh is resumed on another by folding the rows into the new layout:
their sum in the first row, zeros in the others (a plain accumulator, off a
mesh, takes the sum). Every other leaf keeps its value and takes the
sharding :func:`optaxaccum.state_shardings` gives.
"""

from __future__ import annotations

import contextlib
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding

from optaxaccum._src import accumulate, noise_scale, owned, sharding

__all__ = ["reshard_state"]


def reshard_state(
    tx: optax.GradientTransformation, state: Any, params: Any
) -> Any:
    """A saved optimizer state placed for ``params`` on their mesh.

    ``state`` may come from any mesh (another shape, another number of
    devices) or none: host arrays from :func:`jax.device_get`, or an orbax
    restore without a target (dicts and lists). The unclosed window's
    partial sums (each :func:`accumulate`'s accumulator and the noise
    scale's ``sq_sum``, one row per device) are folded into the new layout,
    nothing counted twice or lost; every other leaf (the window's weight,
    counters, the followers' state, ``shard_update`` or not) keeps its
    value, placed as :func:`state_shardings` says. The layout is that of
    ``jax.jit(tx.init)`` under ``jax.set_mesh`` of the params' mesh, in any
    mesh context. The state passes through the host: each process needs all
    of it.

    Args:
      tx: the transformation the state belongs to.
      state: the saved state, with the structure of ``tx.init(params)``
        (namedtuples, or the dicts and lists orbax restores them as).
      params: the parameters on the new mesh (arrays or
        :class:`jax.ShapeDtypeStruct` with a :class:`NamedSharding`), or
        unsharded.

    Returns:
      The state, with the structure of ``tx.init(params)``, placed.

    Raises:
      ValueError: naming the leaf, if ``state`` lacks a leaf of
        ``tx.init(params)``, has one more, or one that does not fit.

    Examples:
      >>> import jax, jax.numpy as jnp, numpy as np, optax
      >>> import optaxaccum as oa
      >>> from jax.sharding import AxisType, PartitionSpec as P
      >>> tx = oa.chain(oa.accumulate(2, axis_name="data"), optax.sgd(1.0))
      >>> saved = jax.device_get(tx.init(jnp.zeros(3)))  # saved off a mesh
      >>> mesh = jax.make_mesh((1,), ("data",), (AxisType.Explicit,),
      ...                      devices=jax.devices()[:1])
      >>> with jax.set_mesh(mesh):
      ...   params = jax.device_put(jnp.zeros(3), P())
      ...   state = oa.reshard_state(tx, saved, params)
      >>> state[0].acc.shape   # one row per device along "data"
      (1, 3)
    """
    mesh = _explicit_mesh(params)
    context = jax.set_mesh(mesh) if mesh else contextlib.nullcontext()
    with context, owned.recording() as indexes:
        abstract = jax.eval_shape(tx.init, params)
        shardings = (
            None if mesh is None else sharding.state_shardings(tx, params)
        )
    saved = _by_path(state)
    _move_owned(saved, abstract, indexes)
    folds = _window_paths(abstract)
    paths, treedef = jax.tree_util.tree_flatten_with_path(abstract)
    leaves = []
    for path, want in paths:
        key = _key(path)
        if key not in saved:
            raise ValueError(
                f"oa.reshard_state: the saved state has no leaf at "
                f"{jax.tree_util.keystr(path)} of tx.init(params)"
            )
        leaves.append(_fit(saved.pop(key), want, key, key in folds))
    if saved:
        raise ValueError(
            "oa.reshard_state: the saved state has leaves that "
            f"tx.init(params) does not have: {sorted(saved)[:5]}"
        )
    host = jax.tree.unflatten(treedef, leaves)
    if shardings is None:
        return jax.device_put(host)
    return jax.device_put(host, shardings)


def _explicit_mesh(params: Any) -> Any:
    """The mesh of the first leaf of ``params`` with a named sharding, if
    it has explicit axes (``jit``'s global view), else ``None``."""
    for p in jax.tree.leaves(params):
        named = getattr(p, "sharding", None)
        if isinstance(named, NamedSharding):
            return named.mesh if named.mesh.explicit_axes else None
    return None


def _key(path: Any) -> tuple[str, ...]:
    """A key path as names: a namedtuple's field, a dict's key and a
    sequence's index read alike (orbax restores namedtuples as dicts and
    tuples as lists)."""
    out = []
    for entry in path:
        for attr in ("name", "key", "idx"):
            if hasattr(entry, attr):
                out.append(str(getattr(entry, attr)))
                break
        else:
            out.append(str(entry))
    return tuple(out)


def _by_path(state: Any) -> dict[tuple[str, ...], np.ndarray]:
    """The saved state's leaves on the host, by :func:`_key`."""
    flat = jax.tree_util.tree_flatten_with_path(state)[0]
    return {_key(path): np.asarray(leaf) for path, leaf in flat}


def _move_owned(saved: dict, abstract: Any, indexes: list) -> None:
    """The rows of each whole-leaves follower's state in ``saved`` moved to
    the owners of the new layout (``indexes``: the new layouts, in the
    order of the followers in ``abstract``, each with its
    :func:`owned.layered` leaves), its ``owners`` replaced."""

    def is_whole(x):
        return isinstance(x, owned.WholeLeavesState)

    found = [
        (path, node)
        for path, node in jax.tree_util.tree_flatten_with_path(
            abstract, is_leaf=is_whole
        )[0]
        if is_whole(node)
    ]
    for (path, node), (new_index, layers) in zip(found, indexes):
        prefix = _key(path)

        def take(field, node=node, prefix=prefix):
            return {
                k: saved.get((*prefix, field, k))
                for k in {
                    *getattr(node, field),
                    *(
                        key[len(prefix) + 1]
                        for key in saved
                        if key[: len(prefix) + 1] == (*prefix, field)
                    ),
                }
                if saved.get((*prefix, field, k)) is not None
            }

        rows = moved_rows(
            take("rows"), take("owners"), new_index, node.rows, layers
        )
        for field in ("rows", "owners"):
            for key in [
                k for k in saved if k[: len(prefix) + 1] == (*prefix, field)
            ]:
                del saved[key]
        for k, v in rows.items():
            saved[(*prefix, "rows", k)] = v
        for k, v in new_index.items():
            saved[(*prefix, "owners", k)] = v


def _window_paths(abstract: Any) -> set[tuple[str, ...]]:
    """The keys of the leaves of ``abstract`` that hold per-device partial
    sums of a window: each accumulate's ``acc`` and ``noise_scale.sq_sum``."""

    def is_acc(x):
        return isinstance(x, accumulate.AccumulateState)

    found: set[tuple[str, ...]] = set()
    for path, node in jax.tree_util.tree_flatten_with_path(
        abstract, is_leaf=is_acc
    )[0]:
        if not is_acc(node):
            continue
        for sub, _ in jax.tree_util.tree_flatten_with_path(node.acc)[0]:
            found.add(_key((*path, *_field("acc"), *sub)))
        if isinstance(node.noise_scale, noise_scale.NoiseScaleState):
            found.add(_key((*path, *_field("noise_scale", "sq_sum"))))
    return found


def _field(*names: str) -> tuple[Any, ...]:
    return tuple(jax.tree_util.GetAttrKey(n) for n in names)


def _fit(
    x: np.ndarray, want: Any, key: tuple[str, ...], window: bool
) -> np.ndarray:
    """The saved leaf ``x`` in the shape of ``want``: as it is when the
    shapes agree; for a window's partial sums (``window``) stored with
    another number of rows (or none), the rows' sum in the first row."""
    where = "/".join(key)
    if x.dtype != want.dtype:
        raise ValueError(
            f"oa.reshard_state: the saved leaf {where} has dtype {x.dtype}, "
            f"tx.init(params) has {want.dtype}"
        )
    shape = tuple(want.shape)
    if x.shape == shape:
        return x
    stacked_in = x.ndim >= 1 and x.shape[1:] in (shape, shape[1:])
    if not window or not (stacked_in or x.shape == shape[1:]):
        raise ValueError(
            f"oa.reshard_state: the saved leaf {where} has shape {x.shape}, "
            f"tx.init(params) has {shape}"
        )
    total = x.sum(0, dtype=_wide(x.dtype)) if stacked_in else x
    total = np.asarray(total).astype(x.dtype)
    if total.shape == shape:  # the new layout is plain: the sum
        return total
    rows = np.zeros(shape, x.dtype)
    rows[0] = total
    return rows


def _wide(dtype: np.dtype) -> Any:
    """The widest dtype of ``dtype``'s kind, to sum the rows in."""
    return np.complex128 if np.iscomplexobj(np.zeros((), dtype)) else np.float64


def moved_rows(
    saved_rows: dict,
    saved_index: dict,
    new_index: dict,
    new_rows: dict,
    layers: owned.Layered | None = None,
) -> dict[str, np.ndarray]:
    """The saved ``rows`` (host arrays, ``saved_index`` their layout) in
    the layout ``new_index`` with rows shaped as ``new_rows``: each owned
    leaf's state moved from its old owner to its new one. ``layers``: the
    new layout's :class:`owned.Layered` leaves, to name in an error."""
    out = {}
    saved_n = next((np.shape(r)[0] for r in saved_rows.values()), None)
    for k, want in new_rows.items():
        old = np.asarray(saved_index.get(k, np.zeros((0, 3), np.int32)))
        new = np.asarray(new_index[k])
        rows = np.asarray(saved_rows.get(k, np.zeros((0, 0), want.dtype)))
        if old.shape != new.shape or not np.array_equal(old[:, 2], new[:, 2]):
            raise ValueError(
                "oa.reshard_state: the saved state of a whole-leaves "
                f"follower holds {len(old)} owned {k} leaves of sizes "
                f"{old[:, 2].tolist()}, tx.init(params) {len(new)} of sizes "
                f"{new[:, 2].tolist()}" + _why(layers, saved_n)
            )
        moved = np.zeros(want.shape, want.dtype)
        for (o, off, size), (o2, off2, _) in zip(old, new):
            moved[o2, off2 : off2 + size] = rows[o, off : off + size]
        out[k] = moved
    return out


def _why(layers: owned.Layered | None, saved_n: int | None) -> str:
    """The end of :func:`moved_rows`'s error: the stacked leaves split
    along their layers on one data size and owned whole on the other,
    if that explains it."""
    if layers is None or saved_n is None:
        return " (another follower or params?)"
    n = layers.n
    changed = [
        s
        for s in layers.shapes
        if owned.splits(s, n) != owned.splits(s, saved_n)
    ]
    if not changed:
        return " (another follower or params?)"
    now_split = owned.splits(changed[0], n)  # those that changed the same way
    changed = [s for s in changed if owned.splits(s, n) == now_split]
    if now_split:
        was, now = "owned whole", "splits them along their layers"
    else:
        was, now = "split along their layers", "cannot and owns them whole"
    return (
        ". With layer_axis=0 a stacked leaf is split along its layers "
        "where the data size (above 1) divides their number, else owned "
        f"whole: the saved state (data size {saved_n}) holds the stacked "
        f"leaves of shapes {changed} {was}; this mesh (data size {n}) "
        f"{now}. Resume on a data size that splits them as the saved one "
        "did, or start this follower's state afresh from tx.init(params)."
    )
