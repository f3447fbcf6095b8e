"""Sharded meshes under ``jax.jit``: unreduced gradients, one reduction per
window, and the shardings of an optimizer state.

In JAX's explicit sharding mode a parameter that is *reduced* over a mesh axis
(``P(..., reduced={"data"})``, physically a replicated copy) has an
*unreduced* gradient over that axis (``{U:data}``: each device holds its
partial sum). :func:`unreduced_value_and_grad` casts the parameters to reduced
before differentiating, so that a micro-batch's backward pass does not reduce
over the data axis; :func:`optaxaccum.accumulate` then adds such gradients
locally and reduces them once, when the window closes (the reducers of
``reducer.py``). See ``docs/scaling.md``.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any

import jax
import jax.core
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from optaxaccum._src import checks, numerics

__all__ = [
    "fsdp_gather",
    "state_shardings",
    "unreduced_value_and_grad",
]


axis_names = checks.axis_names  # the one rule


def sharding_of(x: Any) -> NamedSharding | None:
    """The (abstract) named sharding of ``x``'s type, if it has one."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    return sharding if isinstance(sharding, NamedSharding) else None


def named_sharding(x: Any) -> NamedSharding:
    """The named sharding of ``x``'s type (``x`` must have one)."""
    sharding = sharding_of(x)
    if sharding is None:
        raise ValueError(f"expected an array on a named mesh, got {x!r}")
    return sharding


def spec_of(x: Any) -> P:
    """The partition spec of ``x``'s named sharding (``x`` must have one)."""
    return named_sharding(x).spec


def without_unreduced(spec: P) -> P:
    """``spec`` with no unreduced axes (its dimensions and reduced axes
    kept): the sharding an unreduced array has once summed over them.

    jax 0.11 added ``PartitionSpec.unreduced_kind``, which
    ``spec.update(unreduced=frozenset())`` copies over, and a kind without
    unreduced axes is refused (``ValueError``); jax 0.10's ``update`` takes
    no such keyword. A spec built anew derives the kind from its axes on
    every version."""
    return P(*spec.partitions, reduced=spec.reduced)


def all_explicit(mesh: Any, axis_name: Any) -> bool:
    """Whether every axis of ``axis_name`` is an Explicit axis of ``mesh``."""
    explicit = set(mesh.explicit_axes)
    return all(n in explicit for n in checks.axis_names(axis_name))


def is_explicit(x: Any, axis_name: Any) -> bool:
    """Whether every axis of ``axis_name`` is an Explicit axis of the mesh of
    ``x``'s type: ``jit``'s global view, not ``pmap``/``shard_map``."""
    sharding = sharding_of(x)
    if sharding is None or axis_name is None:
        return False
    return all_explicit(sharding.mesh, axis_name)


def tree_is_explicit(tree: Any, axis_name: Any) -> bool:
    """:func:`is_explicit` of the first leaf of ``tree`` (False for none)."""
    leaves = jax.tree.leaves(tree)
    return bool(leaves) and is_explicit(leaves[0], axis_name)


def unreduced_axes(x: Any) -> frozenset:
    """The mesh axes over which ``x`` is unreduced (empty if none)."""
    sharding = sharding_of(x)
    return frozenset() if sharding is None else sharding.spec.unreduced


def check_mesh_axes(
    axis_name: Any,
    caller: str,
    tree: Any = (),
    *,
    field: str = "axis_name",
    no_mesh: str | None = None,
) -> None:
    """Raises ``ValueError`` naming ``axis_name`` (the argument ``field`` of
    ``caller``) and the mesh's axes when one of its names is neither an
    axis of the current mesh (or of the mesh of a leaf of ``tree``) nor a
    bound mapped axis (``pmap``, ``shard_map``, ``vmap``): before JAX's own
    ``NameError``, which points to ``shard_map``. Without any mesh the
    message says what a run on one device (e.g. one resumed there)
    changes, or ``no_mesh`` if given."""
    if axis_name is None:
        return
    meshes = [jax.sharding.get_abstract_mesh()]
    meshes += [s.mesh for s in map(sharding_of, jax.tree.leaves(tree)) if s]
    known = {n for m in meshes for n in m.axis_names}
    for name in checks.axis_names(axis_name):
        if name in known:
            continue
        try:
            lax.axis_size(name)
        except NameError:
            named = f"{caller}: {field}={axis_name!r} names {name!r}"
            if not known:
                if no_mesh:
                    raise ValueError(f"{named}, but {no_mesh}") from None
                msg = _unbound_message(caller, axis_name, name)
                raise ValueError(msg) from None
            axes = next((m.axis_names for m in meshes if m.axis_names), ())
            raise ValueError(
                f"{named}, which is not an axis of the mesh (its axes: "
                f"{axes!r}) nor a mapped axis (pmap, shard_map, vmap)"
            ) from None


def _unbound_message(caller: str, axis_name: Any, name: Any) -> str:
    """What to change when ``axis_name`` is used with no mesh and outside
    any ``pmap``/``shard_map``: e.g. a run resumed on one device."""
    return (
        f"{caller}: axis_name={axis_name!r} names {name!r}, but no mesh is "
        "set and no pmap/shard_map maps that axis (plain jax.jit, or an "
        "eager call). To run on one device (e.g. a run resumed there), "
        f"drop axis_name from {caller}(...), or keep it and run the step "
        "under jax.set_mesh(jax.make_mesh((1,), "
        f"({name!r},), axis_types=(AxisType.Explicit,))), a mesh of one "
        "device (docs/scaling.md)"
    )


_WARNED: set[tuple[Hashable, ...]] = set()  # axis names warned about once


def check_gradients(grads: Any, axis_name: Any) -> None:
    """Checks the gradients reaching ``oa.accumulate(axis_name=...)``.

    Raises ``ValueError`` when a gradient is unreduced over a mesh axis that
    ``axis_name`` does not name (JAX would raise an opaque
    ``ShardingTypeError``), and warns once (``UserWarning``) when, on an
    explicit mesh, the gradients are not unreduced over ``axis_name``: each
    micro-batch was then reduced already, and the accumulation's point lost.
    """
    check_mesh_axes(axis_name, "oa.accumulate", grads)
    names = () if axis_name is None else checks.axis_names(axis_name)
    leaves = [g for g in jax.tree.leaves(grads) if sharding_of(g) is not None]
    stray = set().union(*map(unreduced_axes, leaves)) - set(names)
    if stray:
        raise ValueError(
            f"the gradients are unreduced over the mesh axes {sorted(stray)} "
            f"(oa.unreduced_value_and_grad), but oa.accumulate has "
            f"axis_name={axis_name!r}: name them in axis_name "
            f"(e.g. axis_name={sorted(stray)[0]!r}) so that the window "
            "reduces them once"
        )
    if not names or names in _WARNED:
        return
    floating = [g for g in leaves if jnp.issubdtype(g.dtype, jnp.inexact)]
    reduced = [g for g in floating if is_explicit(g, names)]
    if reduced:
        if not any(set(names) <= unreduced_axes(g) for g in reduced):
            _WARNED.add(names)
            warnings.warn(
                f"oa.accumulate(axis_name={axis_name!r}) got gradients "
                "that are already reduced over those mesh axes: each "
                "micro-batch was reduced in the backward pass, so nothing "
                "is saved. Take the gradients with oa.unreduced_value_and_"
                f"grad(loss_fn, {axis_name!r}) (docs/scaling.md).",
                UserWarning,
                stacklevel=2,
            )


def entry_axes(entry: Any) -> tuple[Hashable, ...]:
    """The mesh axes of one partition-spec entry."""
    if entry is None:
        return ()
    return entry if isinstance(entry, tuple) else (entry,)


def ordered_axes(mesh: Any, axes: Any) -> tuple[Hashable, ...]:
    """The mesh axes ``axes`` in the mesh's order."""
    return tuple(n for n in mesh.axis_names if n in axes)


def spec_entry(axes: tuple[Hashable, ...]) -> Any:
    """A partition-spec entry for one dimension sharded over ``axes``."""
    return axes[0] if len(axes) == 1 else axes


def sharded_axes(entries: Iterable[Any]) -> frozenset:
    """The mesh axes that shard some dimension of a spec, given its entries
    (``spec.partitions``, padded or not)."""
    return frozenset(a for entry in entries for a in entry_axes(entry))


def drop_axes(entries: Iterable[Any], axes: Iterable[Hashable]) -> tuple:
    """The partition-spec ``entries`` with the mesh ``axes`` taken out of
    each (an entry left with no axis is ``None``)."""
    axes = frozenset(axes)
    kept = (tuple(a for a in entry_axes(e) if a not in axes) for e in entries)
    return tuple(spec_entry(k) if k else None for k in kept)


def deferred_spec(spec: P, names: Sequence[Hashable], kind: str) -> P:
    """``spec`` with the axes ``names`` taken out of its dimensions and added
    to its ``kind`` (``"reduced"`` or ``"unreduced"``) set."""
    taken = frozenset(names)
    dims = drop_axes(spec.partitions, taken)
    return spec.update(partitions=dims, **{kind: getattr(spec, kind) | taken})


def _to_reduced(p: Any, names: tuple[Hashable, ...]) -> Any:
    if not jnp.issubdtype(jnp.result_type(p), jnp.inexact):
        return p
    if not is_explicit(p, names):
        raise ValueError(
            "oa.unreduced_value_and_grad needs arguments sharded on a mesh "
            f"whose axes {names} are Explicit (jax.set_mesh of a mesh made "
            f"with AxisType.Explicit); got an argument of type "
            f"{jax.typeof(p)}"
        )
    spec = spec_of(p)
    return jax.reshard(p, deferred_spec(spec, names, "reduced"))


def unreduced_value_and_grad(
    loss_fn: Callable[..., Any],
    axis_name: Hashable | tuple[Hashable, ...],
    *,
    has_aux: bool = False,
    argnums: int | Sequence[int] = 0,
    value_and_grad: Callable[..., Callable] = jax.value_and_grad,
) -> Callable[..., tuple[Any, Any]]:
    """:func:`jax.value_and_grad` leaving gradients unreduced over mesh axes.

    Under an explicit mesh (``jax.set_mesh``) the differentiated arguments
    are cast (no data moves) to *reduced* over ``axis_name``, so their
    gradients come back *unreduced* (``{U:data}``): each device's partial
    sum, with no reduction in the backward pass. ``oa.accumulate(k,
    axis_name=axis_name)`` adds them locally and reduces once per window.

    Args:
      loss_fn: the loss, as for :func:`jax.value_and_grad`; it must keep the
        arguments' reduced axes through any reshard of them (see
        docs/scaling.md: gather to ``P(None, reduced={"data", "fsdp"})``).
      axis_name: a mesh axis name (e.g. ``"data"``) or a tuple of them; an
        axis that shards a parameter is taken out of its dimensions.
      has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
      argnums: which positional argument(s) to differentiate.
      value_and_grad: the differentiation to wrap, called as
        ``value_and_grad(loss_fn, argnums=..., has_aux=...)`` (e.g. a
        ``functools.partial`` of :func:`microbatched_value_and_grad`).

    Returns:
      A function with ``loss_fn``'s arguments returning ``(loss, grads)`` or
      ``((loss, aux), grads)``.

    Raises:
      TypeError, ValueError: for a bad ``axis_name``, or (when called) an
        argument not on a mesh whose ``axis_name`` axes are Explicit.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import optaxaccum as oa
      >>> from jax.sharding import AxisType, PartitionSpec as P
      >>> mesh = jax.make_mesh((1,), ("data",), (AxisType.Explicit,),
      ...                      devices=jax.devices()[:1])
      >>> with jax.set_mesh(mesh):
      ...   w = jax.device_put(jnp.ones(3), P())
      ...   x = jax.device_put(jnp.ones((4, 3)), P("data", None))
      ...   f = oa.unreduced_value_and_grad(
      ...       lambda w, x: jnp.mean(x @ w), "data")
      ...   loss, g = jax.jit(f)(w, x)
      ...   print(jax.typeof(g), jax.reshard(g, P()))
      float32[3]{U:data} [1. 1. 1.]
    """
    names = checks.axis_names(axis_name)
    grad_fn = value_and_grad(loss_fn, argnums=argnums, has_aux=has_aux)
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)

    def wrapped(*args, **kwargs):
        check_mesh_axes(
            axis_name,
            "oa.unreduced_value_and_grad",
            [args[i] for i in nums if i < len(args)],
        )
        args = list(args)
        for i in nums:
            args[i] = jax.tree.map(lambda p: _to_reduced(p, names), args[i])
        return grad_fn(*args, **kwargs)

    return wrapped


def padded_entries(spec: P, ndim: int) -> tuple[Any, ...]:
    """The entries of ``spec``, one per dimension of an ``ndim`` array."""
    return tuple(spec.partitions) + (None,) * (ndim - len(spec.partitions))


def _scatter_back(
    ct: jax.Array, dims: tuple[Any, ...], spec: P, mesh: Any
) -> jax.Array:
    """The cotangent ``ct`` of a gathered parameter back to the parameter's
    sharding ``spec`` (dims ``dims``, each over axes that ``ct`` is
    unreduced over), inside a ``shard_map``: a reduce-scatter
    (``psum_scatter``) over each sharded dimension's axes, a ``psum`` over
    any other unreduced axis the parameter is not reduced over."""
    unreduced = unreduced_axes(ct)
    sharded = sharded_axes(dims)
    rest = ordered_axes(mesh, unreduced - sharded - spec.reduced)

    def body(c):
        for i, d in enumerate(dims):
            if d is not None:
                c = lax.psum_scatter(c, d, scatter_dimension=i, tiled=True)
        return lax.psum(c, rest) if rest else c

    out = P(*dims, unreduced=spec.reduced & unreduced, reduced=frozenset())
    return local_map(body, mesh=mesh, in_specs=spec_of(ct), out_specs=out)(ct)


def local_map(
    body: Callable[[jax.Array], jax.Array],
    *,
    in_specs: P,
    out_specs: P,
    mesh: Any = None,
) -> Callable[[jax.Array], jax.Array]:
    """``jax.shard_map(body, ..., check_vma=False)`` of a one-array
    ``body``, also where every axis of the mesh has size 1 (a run resumed on
    one device).

    JAX inlines a ``shard_map`` over such a mesh and requires an unreduced
    output to come from a sharding constraint, which a body cannot end in.
    There a sum over the mesh is the one device's value, so the body maps a
    plain array: ``jax.reshard`` takes the input's unreduced axes off before
    it and puts those of ``out_specs`` on after it (casts that move no
    data)."""
    kwargs = {} if mesh is None else {"mesh": mesh}
    context = mesh or jax.sharding.get_abstract_mesh()
    one_device = math.prod(context.shape.values()) == 1
    plain_in, plain_out = in_specs, out_specs
    if one_device:
        plain_in, plain_out = map(without_unreduced, (in_specs, out_specs))
    plain = jax.shard_map(
        body, in_specs=plain_in, out_specs=plain_out, check_vma=False, **kwargs
    )
    if not one_device:
        return plain

    def placed(spec: P) -> Any:
        # On the given mesh, else on the context's (a bare spec).
        return spec if mesh is None else jax.NamedSharding(mesh, spec)

    def mapped(x: jax.Array) -> jax.Array:
        if unreduced_axes(x):
            x = jax.reshard(x, placed(plain_in))
        y = plain(x)
        return jax.reshard(y, placed(out_specs)) if out_specs.unreduced else y

    return mapped


def fsdp_gather(w: jax.Array, batch_axes: Any = None) -> jax.Array:
    """All-gathers a sharded parameter for the forward pass (FSDP).

    Returns ``w`` replicated and *reduced* over ``batch_axes``, so that its
    gradient stays unreduced over them through the backward pass; the
    gradient then comes back to ``w``'s sharding by a reduce-scatter in the
    HLO (each device receives its 1/fsdp shard), never an all-reduce of the
    whole tree followed by a slice. With ``w`` from
    :func:`unreduced_value_and_grad` (reduced over ``"data"``) the
    gradient stays unreduced over ``"data"`` for :func:`accumulate`. A
    plain ``jax.reshard(w, P())`` drops the reduced axes (JAX's types), so
    its gradient is all-reduced over the batch in every micro-step.

    Args:
      w: a parameter on an explicit mesh, e.g. ``P("fsdp", None)``.
      batch_axes: every mesh axis that shards the batch (a name or a tuple);
        default: every axis of ``w``'s mesh.

    Returns:
      ``w`` gathered: ``P(None, ..., reduced=batch_axes)``.

    Raises:
      ValueError: if ``w`` is not sharded on a mesh, if ``batch_axes``
        names an axis the mesh lacks, or if ``w`` is sharded over an axis
        ``batch_axes`` does not name.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import optaxaccum as oa
      >>> from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
      >>> axis_types, one = (AxisType.Explicit,), jax.devices()[:1]
      >>> mesh = jax.make_mesh((1,), ("fsdp",), axis_types, devices=one)
      >>> w = jax.device_put(jnp.ones((2, 3)), NamedSharding(mesh, P("fsdp")))
      >>> with jax.set_mesh(mesh):
      ...   print(jax.jit(oa.fsdp_gather)(w).shape)
      (2, 3)
    """
    sharding = sharding_of(w)
    if sharding is None or not sharding.mesh.axis_names:
        raise ValueError(
            "oa.fsdp_gather: w is not sharded on a mesh (its type: "
            f"{jax.typeof(w)}); it gathers a parameter placed on an "
            "explicit mesh, e.g. jax.device_put(w, P('fsdp', None)) under "
            "jax.set_mesh(mesh)"
        )
    mesh, spec = sharding.mesh, sharding.spec
    names = (
        mesh.axis_names if batch_axes is None else checks.axis_names(batch_axes)
    )
    check_mesh_axes(names, "oa.fsdp_gather", w)
    dims = padded_entries(spec, w.ndim)
    other = sharded_axes(dims) - set(names)
    if other:
        raise ValueError(
            f"oa.fsdp_gather: w is sharded over {sorted(map(str, other))}, "
            f"which batch_axes={batch_axes!r} does not name; it gathers over "
            "axes "
            "that shard the batch (FSDP), gather others with jax.reshard"
        )
    full = P(*(None,) * w.ndim, reduced=frozenset(names) | spec.reduced)

    @jax.custom_vjp
    def gather(x):
        return jax.reshard(x, full)

    def fwd(x):
        return gather(x), None

    def bwd(_, ct):
        return (_scatter_back(ct, dims, spec, mesh),)

    gather.defvjp(fwd, bwd)
    return gather(w)


# ------------------------------------------ arrays unreduced over axes


def grad_zeros(p: Any, dtype: Any) -> jax.Array:
    """Zeros of ``p``'s gradient type: like ``p`` in ``dtype``, unreduced
    over the axes over which ``p`` is reduced (JAX's cotangent rule)."""
    z = jnp.zeros_like(p, dtype)
    sharding = sharding_of(p)
    if sharding is None or not sharding.spec.reduced:
        return z
    spec = sharding.spec
    return jax.reshard(
        z, spec.update(reduced=frozenset(), unreduced=spec.reduced)
    )


def match_unreduced(x: Any, like: Any) -> Any:
    """``x`` cast to the unreduced sharding of ``like`` if ``like`` is
    unreduced and ``x`` is not (a local cast: no data moves between
    devices); else ``x``."""
    if unreduced_axes(like) and not unreduced_axes(x):
        return jax.reshard(x, spec_of(like))
    return x


def times(s: jax.Array | None, x: jax.Array, like: Any = None) -> jax.Array:
    """``s * x`` for a scalar ``s`` (``x`` for ``None``), also when ``x`` is
    unreduced (``s`` is then cast to reduced); with ``like`` (an unreduced
    accumulator) a plain ``x`` is first cast to ``like``'s sharding."""
    if like is not None:
        x = match_unreduced(x, like)
    if s is None:
        return x
    axes = unreduced_axes(x)
    scale: Any = jax.reshard(s, P(reduced=axes)) if axes else s
    return scale * x


def globally_finite(
    tree: Any, local: Callable[[Any], jax.Array] | None = None
) -> jax.Array:
    """Whether every value of ``tree`` is finite.

    When a leaf is unreduced, every floating leaf is probed with
    ``sum(x * 0)``, summed over the devices: finite unless some device's
    partial sum holds a NaN or Inf (the answer is global). Otherwise
    ``local(tree)`` (default: every element finite).
    """
    leaves = jax.tree.leaves(tree)
    if any(unreduced_axes(x) for x in leaves):
        # Probes of one dtype and sharding are summed locally first, so the
        # devices exchange one scalar per group, not one per leaf.
        groups: dict[Any, jax.Array] = {}
        for x in leaves:
            if jnp.issubdtype(x.dtype, jnp.inexact):
                probe = jnp.sum(times(jnp.zeros([], x.dtype), x))
                key = (probe.dtype, unreduced_axes(probe))
                groups[key] = groups[key] + probe if key in groups else probe
        return numerics.all_true(
            [jnp.isfinite(jax.reshard(p, P())).all() for p in groups.values()]
        )
    return (local or numerics.all_finite)(tree)


def agree(flag: jax.Array, axis_name: Any) -> jax.Array:
    """``flag`` true on every device of ``axis_name``: ``lax.pmin`` inside
    ``pmap``/``shard_map``; in ``jit``'s global view (an explicit mesh
    axis) the flag already is one global value."""
    if is_explicit(flag, axis_name):
        return flag
    return lax.pmin(flag.astype(jnp.int32), axis_name) > 0


# ------------------------------------------------- optimizer state


def state_shardings(
    tx: optax.GradientTransformation, params: Any, mesh: Any = None
) -> Any:
    """The shardings of ``tx.init(params)`` given sharded ``params``.

    Each params-like tree of the state (an accumulator, Adam's moments) gets
    the params' shardings; every other leaf (counters, the window's weight,
    a loss scale) is replicated. Use it as ``out_shardings`` of
    ``jax.jit(tx.init)`` or with :func:`jax.device_put`.

    Args:
      tx: an optax transformation (e.g. an ``oa.chain``).
      params: the parameters, arrays with a :class:`NamedSharding` (or
        :class:`jax.ShapeDtypeStruct` with one).
      mesh: the mesh of the replicated leaves; default: that of the first
        leaf of ``params``.

    Returns:
      A pytree of :class:`NamedSharding` with the structure of the state.

    Raises:
      ValueError: if ``params`` has no leaf with a ``NamedSharding`` and no
        ``mesh`` is given.

    Examples:
      >>> import jax, jax.numpy as jnp, optax
      >>> import optaxaccum as oa
      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> mesh = jax.make_mesh((1,), ("fsdp",), devices=jax.devices()[:1])
      >>> params = jax.device_put(jnp.ones((4, 3)),
      ...                         NamedSharding(mesh, P("fsdp", None)))
      >>> tx = oa.chain(oa.accumulate(2), optax.adam(1e-3))
      >>> shardings = oa.state_shardings(tx, params)
      >>> shardings[1][0].mu.spec, shardings[0].mini_step.spec
      (P('fsdp', None), P())
      >>> state = jax.jit(tx.init, out_shardings=shardings)(params)
    """
    if mesh is None:
        found = [
            p.sharding
            for p in jax.tree.leaves(params)
            if isinstance(getattr(p, "sharding", None), NamedSharding)
        ]
        if not found:
            raise ValueError(
                "oa.state_shardings needs params with a NamedSharding or "
                f"a mesh; got params {jax.tree.map(jax.typeof, params)}"
            )
        mesh = found[0].mesh
    replicated = NamedSharding(mesh, P())

    def typed(s):
        """The sharding in ``s``'s type (explicit axes) on ``mesh``, else
        None."""
        sharding = getattr(s, "sharding", None)
        if isinstance(sharding, NamedSharding) and sharding.mesh.explicit_axes:
            return NamedSharding(mesh, sharding.spec)
        return None

    return _map_state(
        jax.eval_shape(tx.init, params),
        params,
        lambda s, p: typed(s) or p.sharding,
        lambda s: typed(s) or replicated,
    )


def _masked(x: Any) -> bool:
    return isinstance(x, optax.MaskedNode)


def _map_state(
    state: Any,
    params: Any,
    param_leaf: Callable[[Any, Any], Any],
    other_leaf: Callable[[Any], Any],
) -> Any:
    """``state`` with ``param_leaf(s, p)`` applied to each leaf ``s`` of a
    params-like subtree (the params' structure and shapes, where optax's
    ``MaskedNode`` may stand for a leaf left out by ``optax.masked``,
    ``multi_transform`` or ``partition``; it stays) and its param ``p``,
    ``other_leaf`` to every other leaf. Found by structure, not by calling
    ``init`` on a placeholder (optax's ``tree_map_params``), which some
    transformations (optax's linesearches) cannot take."""
    params_def = jax.tree.structure(params)
    shapes = [tuple(jnp.shape(p)) for p in jax.tree.leaves(params)]

    def params_like(s: Any) -> bool:
        if jax.tree.structure(s, is_leaf=_masked) != params_def:
            return False
        leaves = jax.tree.leaves(s, is_leaf=_masked)
        return all(
            _masked(x) or getattr(x, "shape", None) == shape
            for x, shape in zip(leaves, shapes, strict=True)
        )

    def node(s: Any) -> Any:
        if params_like(s):
            return jax.tree.map(
                lambda x, p: x if _masked(x) else param_leaf(x, p),
                s,
                params,
                is_leaf=_masked,
            )
        return other_leaf(s)

    return jax.tree.map(node, state, is_leaf=params_like)
