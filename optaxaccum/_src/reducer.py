"""The window sums of ``oa.accumulate``: how they are stored between steps
and reduced over the devices, one reducer per mesh mode.

The sums of a window (the accumulator ``acc``, its ``weight`` and the noise
scale's ``sq_sum``/``micro_batches``) are kept on each device as its own
partial sums and reduced once, when the window closes. How depends on the
mode, chosen once per trace (:func:`of`, :func:`at_init`):

* :class:`Local` (no ``axis_name``, no array unreduced over a mesh axis):
  nothing to store apart or reduce, and plain arithmetic: nothing here
  calls into ``sharding.py``.
* :class:`Reducer` itself (no ``axis_name``, but arrays unreduced over
  mesh axes, e.g. a loss scale without ``axis_name`` given the gradients of
  :func:`optaxaccum.unreduced_value_and_grad`): nothing to reduce, but its
  arithmetic respects the unreduced arrays.
* :class:`Mapped` (``pmap``/``shard_map``): each device holds its partial
  sums; a ``psum`` reduces them.
* :class:`Explicit` (``jax.jit`` on a mesh whose ``axis_name`` axes are
  Explicit): a partial sum is an array *unreduced* over those axes, stored
  in its stacked form (one row per device, an ordinary checkpointable
  array); the reduction is one ``jax.reshard`` of each unreduced leaf.
* :class:`Scatter` (the same with ``shard_update``): the reduction is a
  reduce-scatter to each leaf's placement (:func:`placed_spec`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable
from typing import Any

import jax
import jax.core
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from optaxaccum._src import checks, numerics, sharding

__all__: list[str] = []


class Reducer:
    """The window sums of one mesh mode; as such, of no ``axis_name`` with
    arrays unreduced over mesh axes.

    What a reducer has:

    * the checks of a step's input: ``check_axes`` (the mesh has the
      ``axis_name`` axes) and ``check_gradients`` (the mesh mistakes);
    * the stored sums: ``zeros``/``sum_zeros`` (initial), ``store``,
      ``load``/``load_sum`` (between the stored form and the form a step
      adds to) and ``match`` (the loaded accumulator typed like the
      gradients);
    * the reduction over the devices, once per window: ``reduce``,
      ``reduce_sums``, and ``global_weight`` on every micro-batch;
    * flags all devices share: ``finite`` and ``agree``;
    * the arithmetic that depends on the mode: ``scale`` (a scalar times
      a possibly unreduced array), ``sum_scale`` (what makes a reduced sum
      the sum over all devices) and ``squared_norm`` (this device's
      ``|g|^2``, for the noise scale)."""

    def __init__(self, axis_name: Any = None):
        self.axis_name = axis_name

    def check_axes(self, caller: str, tree: Any = ()) -> None:
        """Raises ``ValueError`` naming ``caller`` where an axis of
        ``axis_name`` is neither a mesh axis nor a mapped one
        (:func:`sharding.check_mesh_axes`)."""
        sharding.check_mesh_axes(self.axis_name, caller, tree)

    def check_gradients(self, grads: Any) -> None:
        """Raises ``ValueError`` for gradients unreduced over mesh axes
        that ``axis_name`` does not name; warns once where they are reduced
        already (:func:`sharding.check_gradients`)."""
        sharding.check_gradients(grads, self.axis_name)

    def match(self, acc: Any, grads: Any) -> Any:
        """The loaded accumulator ``acc`` as a step adds ``grads`` to it:
        each plain leaf cast to the unreduced sharding of the corresponding
        gradient (a local cast)."""
        return jax.tree.map(sharding.match_unreduced, acc, grads)

    def zeros(self, zeros: Any) -> Any:
        """The accumulator's ``zeros`` (like the params) as stored."""
        return zeros

    def sum_zeros(self, dtype: Any) -> jax.Array:
        """A zero scalar sum (the noise scale's ``sq_sum``) as stored."""
        return jnp.zeros([], dtype)

    def store(self, tree: Any) -> Any:
        """Sums as the state keeps them between steps."""
        return tree

    def load(self, tree: Any) -> Any:
        """The inverse of :meth:`store` (the accumulator's leaves)."""
        return tree

    def load_sum(self, x: jax.Array) -> jax.Array:
        """The inverse of :meth:`store` for a scalar sum (``sq_sum``)."""
        return x

    def reduce(
        self, acc: Any, weight: jax.Array, reduction: str
    ) -> tuple[Any, jax.Array]:
        """The window's (stored) sum ``acc`` and ``weight`` over the
        devices."""
        del reduction
        return acc, weight

    def reduce_sums(
        self, sq_sum: jax.Array, count: jax.Array
    ) -> tuple[jax.Array, jax.Array]:
        """The noise scale's two sums over the devices."""
        return sq_sum, count

    def global_weight(self, weight: tuple[jax.Array, Any]) -> tuple[Any, Any]:
        """The window's running weight over the devices, on every
        micro-batch (:func:`optaxaccum.every_weight`), as ``(weight,
        low)`` (``low`` what rounding left out of it, or ``None``): here as
        it is."""
        return weight

    def sum_scale(self, reduction: str) -> Any:
        """What the reduced window sum must be multiplied by to be the sum
        over all devices (``None``: nothing)."""
        del reduction

    def scale(
        self, s: jax.Array | None, x: jax.Array, like: Any = None
    ) -> jax.Array:
        """``s * x`` for a scalar ``s`` (``x`` for ``None``), also when ``x``
        is unreduced; with ``like`` (an unreduced accumulator leaf) a plain
        ``x`` is first cast to its sharding."""
        return sharding.times(s, x, like)

    def squared_norm(
        self, grads: Any, acc: Any, sq_sum: jax.Array
    ) -> tuple[jax.Array, jax.Array, int]:
        """This device's ``|g|^2`` of a micro-batch's ``grads`` (leaves
        squared in the dtypes of the accumulator ``acc``), the loaded sum
        ``sq_sum`` it adds to (both in one sharding), and the number ``n``
        of devices that hold a share of the micro-batch (here one)."""
        sq = optax.tree.sum(jax.tree.map(_leaf_sq, grads, acc))
        return jnp.asarray(sq), sq_sum, 1

    def finite(
        self, tree: Any, local: Callable[[Any], jax.Array] | None = None
    ) -> jax.Array:
        """Whether every value of ``tree`` (all devices') is finite;
        ``local(tree)`` (default: every element finite) decides where no
        leaf is unreduced."""
        return sharding.globally_finite(tree, local)

    def agree(self, flag: jax.Array) -> jax.Array:
        """``flag`` true on every device."""
        return flag


class Local(Reducer):
    """No ``axis_name`` and no array unreduced over a mesh axis: every sum
    is already the window's, and the arithmetic is plain."""

    def check_axes(self, caller: str, tree: Any = ()) -> None:
        """Nothing to check: no ``axis_name``."""
        del caller, tree

    def check_gradients(self, grads: Any) -> None:
        """Nothing to check: no ``axis_name``, and (as :func:`of` found)
        no gradient unreduced over a mesh axis."""
        del grads

    def match(self, acc: Any, grads: Any) -> Any:
        """``acc`` as it is: nothing is unreduced."""
        del grads
        return acc

    def scale(
        self, s: jax.Array | None, x: jax.Array, like: Any = None
    ) -> jax.Array:
        """``s * x`` (``x`` for ``None``)."""
        del like
        return x if s is None else s * x

    def finite(
        self, tree: Any, local: Callable[[Any], jax.Array] | None = None
    ) -> jax.Array:
        """``local(tree)``, by default whether every element is finite."""
        return (local or numerics.all_finite)(tree)


class Mapped(Reducer):
    """``pmap``/``shard_map`` over ``axis_name``: each device holds its
    partial sums (a leading device axis is the user's, see
    :func:`optaxaccum.map_accumulators`); ``psum`` reduces them."""

    def reduce(
        self, acc: Any, weight: jax.Array, reduction: str
    ) -> tuple[Any, jax.Array]:
        """``psum`` of both for ``"mean"``, ``pmean`` of the sum for
        ``"sum"``."""
        weight = lax.psum(weight, self.axis_name)
        if reduction == "mean":
            return lax.psum(acc, self.axis_name), weight
        return lax.pmean(acc, self.axis_name), weight

    def sum_scale(self, reduction: str) -> Any:
        """The devices' number for ``"sum"``: its reduction averages the
        devices' sums."""
        return lax.axis_size(self.axis_name) if reduction == "sum" else None

    def reduce_sums(
        self, sq_sum: jax.Array, count: jax.Array
    ) -> tuple[jax.Array, jax.Array]:
        """One ``psum`` of both."""
        both = lax.psum(jnp.stack([sq_sum, count]), self.axis_name)
        return both[0], both[1]

    def global_weight(self, weight: tuple[jax.Array, Any]) -> tuple[Any, Any]:
        """One scalar ``psum`` of each device's weight (its two parts added
        first): each device holds its own."""
        hi, low = weight
        local = hi if low is None else hi + low
        return lax.psum(local, self.axis_name), None

    def agree(self, flag: jax.Array) -> jax.Array:
        """``lax.pmin`` of ``flag`` (one global value already when it lies
        on an explicit mesh)."""
        return sharding.agree(flag, self.axis_name)


class Explicit(Reducer):
    """``jax.jit`` on a mesh whose ``axis_name`` axes are Explicit: partial
    sums are arrays unreduced over mesh axes, stored stacked
    (:func:`stack_partials`); the weight, like every flag, is one global
    value (``agree`` has nothing to do)."""

    def zeros(self, zeros: Any) -> Any:
        """Stacked over ``axis_name`` (:func:`window_zeros`)."""
        return window_zeros(zeros, self.axis_name)

    def sum_zeros(self, dtype: Any) -> jax.Array:
        """Unreduced over every axis of the mesh, as the micro-steps make
        it, stacked. Made as such, not by stacking a zero resharded to
        unreduced: under ``jax.jit``, jax 0.12 then gives the other scalar
        zeros of the output an unreduced GSPMDSharding that a later jit
        refuses (tests/test_noise_scale.py has the plain-JAX repro)."""
        mesh = jax.sharding.get_abstract_mesh()
        spec = P(sharding.spec_entry(tuple(mesh.axis_names)))
        return jnp.zeros((mesh.size,), dtype, out_sharding=spec)

    def squared_norm(
        self, grads: Any, acc: Any, sq_sum: jax.Array
    ) -> tuple[jax.Array, jax.Array, int]:
        """Gradients left unreduced over ``n`` devices are ``n`` small
        batches (:func:`_device_sq`), their squares and ``sq_sum`` left
        unreduced; reduced gradients are one."""
        if any(sharding.unreduced_axes(g) for g in jax.tree.leaves(grads)):
            sq, n = _device_sq(grads, acc)
            return sq, sharding.match_unreduced(sq_sum, sq), n
        sq, sq_sum, n = super().squared_norm(grads, acc, sq_sum)
        return sharding.match_unreduced(sq, sq_sum), sq_sum, n

    def store(self, tree: Any) -> Any:
        return stack_partials(tree)

    def load(self, tree: Any) -> Any:
        return unstack_partials(tree, self.axis_name)

    def load_sum(self, x: jax.Array) -> jax.Array:
        """Unstacked over every axis of its mesh (a local cast)."""
        named = getattr(jax.typeof(x), "sharding", None)
        if not jnp.ndim(x) or not isinstance(named, NamedSharding):
            return x
        return unstack_partials(x, tuple(named.mesh.axis_names))

    def reduce(
        self, acc: Any, weight: jax.Array, reduction: str
    ) -> tuple[Any, jax.Array]:
        """Each unreduced leaf resharded without its unreduced axes: the one
        all-reduce of the window (a plain leaf needs nothing); the weight
        is already global."""
        del reduction
        acc = unstack_partials(acc, self.axis_name)
        return jax.tree.map(self._reduce_leaf, acc), weight

    def _reduce_leaf(self, a: Any) -> Any:
        if not sharding.unreduced_axes(a):
            return a
        return jax.reshard(a, sharding.without_unreduced(sharding.spec_of(a)))

    def reduce_sums(
        self, sq_sum: jax.Array, count: jax.Array
    ) -> tuple[jax.Array, jax.Array]:
        """An unreduced ``sq_sum`` resharded (the count is global)."""
        if sharding.unreduced_axes(sq_sum):
            sq_sum = jax.reshard(sq_sum, P())
        return sq_sum, count


class Scatter(Explicit):
    """:class:`Explicit` with ``shard_update``: the window's reduction is a
    reduce-scatter of each unreduced leaf to its :func:`placed_spec`."""

    def _reduce_leaf(self, a: Any) -> Any:
        if not sharding.unreduced_axes(a):
            return a
        return reduce_scatter(a, self.axis_name)


def of(axis_name: Any, tree: Any, shard_update: bool = False) -> Reducer:
    """The reducer of a step on ``tree`` (the stored accumulator, then the
    gradients): :class:`Explicit` (:class:`Scatter` with
    ``shard_update``) if ``tree`` lies on a mesh whose ``axis_name`` axes
    are Explicit (``jit``'s global view), else :class:`Mapped`;
    without ``axis_name``, :class:`Local` unless a leaf of ``tree`` is
    unreduced over a mesh axis (then :class:`Reducer`)."""
    if axis_name is None:
        # sharding.unreduced_axes's test, read from the leaves' types here
        # so that the mesh-less path makes no call into sharding.py.
        for x in jax.tree.leaves(tree):
            named = getattr(jax.typeof(x), "sharding", None)
            if isinstance(named, NamedSharding) and named.spec.unreduced:
                return Reducer()  # unreduced over a mesh axis
        return _LOCAL
    if sharding.tree_is_explicit(tree, axis_name):
        return _on_mesh(axis_name, shard_update)
    return Mapped(axis_name)


def at_init(axis_name: Any, shard_update: bool = False) -> Reducer:
    """The reducer of ``init``: :class:`Explicit` under ``jax.set_mesh``
    of a mesh whose ``axis_name`` axes are Explicit, else :class:`Mapped`
    (whose users add the device axis themselves,
    :func:`optaxaccum.map_accumulators`); :class:`Local` without
    ``axis_name``."""
    if axis_name is None:
        return _LOCAL
    if sharding.all_explicit(jax.sharding.get_abstract_mesh(), axis_name):
        return _on_mesh(axis_name, shard_update)
    return Mapped(axis_name)


_LOCAL = Local()  # stateless: one for every trace


def _on_mesh(axis_name: Any, shard_update: bool) -> Explicit:
    """The reducer of ``jit`` on a mesh whose ``axis_name`` axes are
    Explicit."""
    return Scatter(axis_name) if shard_update else Explicit(axis_name)


# ------------------------------------------------- the stacked form


def _stacked_spec(spec: P, axes: tuple[Hashable, ...]) -> P:
    """The spec of the stacked form of an array of spec ``spec`` unreduced
    over ``axes``: a leading dimension sharded over ``axes``."""
    return P(sharding.spec_entry(axes), *spec.partitions, reduced=spec.reduced)


def stacked_axes(a: Any, axis_name: Any) -> tuple[Hashable, ...]:
    """The axes ``axis_name`` if ``a`` is an accumulator leaf in stacked
    form (its leading dimension sharded over exactly those explicit axes),
    else ``()``."""
    named = sharding.sharding_of(a)
    if axis_name is None or named is None or not jnp.ndim(a):
        return ()
    if not sharding.is_explicit(a, axis_name) or not named.spec.partitions:
        return ()
    axes = sharding.ordered_axes(named.mesh, checks.axis_names(axis_name))
    first = sharding.entry_axes(named.spec.partitions[0])
    return axes if first == axes else ()


def stack_partials(tree: Any) -> Any:
    """Each leaf unreduced over some mesh axes in its *stacked* form: an
    ordinary global array with a leading dimension of the axes' size,
    sharded over them, row ``i`` holding device ``i``'s partial sum. A local
    cast (``shard_map`` of ``a[None]``): no data moves between devices.
    Other leaves are returned as they are."""

    def stack(x):
        unreduced = sharding.unreduced_axes(x)
        if not unreduced:
            return x
        named = sharding.named_sharding(x)
        axes = sharding.ordered_axes(named.mesh, unreduced)
        out = _stacked_spec(sharding.without_unreduced(named.spec), axes)
        return sharding.local_map(
            lambda b: b[None],
            mesh=named.mesh,
            in_specs=named.spec,
            out_specs=out,
        )(x)

    return jax.tree.map(stack, tree)


def unstack_partials(tree: Any, axis_name: Any) -> Any:
    """The inverse of :func:`stack_partials` for leaves stacked over
    ``axis_name``: each device's row becomes its partial sum of an array
    unreduced over those axes (a local cast). Other leaves pass through."""

    def unstack(a):
        axes = stacked_axes(a, axis_name)
        if not axes:
            return a
        spec = sharding.spec_of(a)
        out = P(
            *spec.partitions[1:],
            unreduced=frozenset(axes),
            reduced=spec.reduced,
        )
        return sharding.local_map(
            lambda b: b[0],
            mesh=sharding.named_sharding(a).mesh,
            in_specs=spec,
            out_specs=out,
        )(a)

    return jax.tree.map(unstack, tree)


def window_zeros(zeros: Any, axis_name: Any) -> Any:
    """The accumulator's ``zeros`` (like the params) stacked over
    ``axis_name`` (see :func:`stack_partials`), one row per device's
    partial sum, where a leaf lies on a mesh whose axes ``axis_name`` are
    Explicit. A plain accumulator given unreduced gradients is stacked by
    the first step."""

    def stacked(z):
        if not sharding.is_explicit(z, axis_name):
            return z
        named = sharding.named_sharding(z)
        axes = sharding.ordered_axes(named.mesh, checks.axis_names(axis_name))
        n = int(np.prod([named.mesh.shape[a] for a in axes]))
        spec = sharding.deferred_spec(named.spec, axes, "unreduced")
        spec = _stacked_spec(sharding.without_unreduced(spec), axes)
        shape = (n, *z.shape)
        if isinstance(z, jax.core.Tracer):  # under a trace: its type
            out = named.update(spec=spec)
            return jnp.zeros(shape, z.dtype, out_sharding=out)
        # Eager, outside any mesh context: place on the concrete mesh.
        return jnp.zeros(shape, z.dtype, device=z.sharding.update(spec=spec))

    return jax.tree.map(stacked, zeros)


def _leaf_sq(g: Any, a: jax.Array) -> jax.Array:
    """``|g|^2`` of one leaf in the accumulator's dtype (fused with the
    accumulator's add by XLA)."""
    return optax.tree.norm(jnp.asarray(g).astype(a.dtype), squared=True)


def _device_sq(grads: Any, acc: Any) -> tuple[jax.Array, int]:
    """``sum_d |g_d|^2`` over the devices' partial sums ``g_d`` of gradients
    unreduced over mesh axes (``jit``), as a scalar left unreduced over every
    mesh axis: each device squares its own shard in a ``shard_map``, with
    no communication; the window's reduction sums them once. Also the
    number ``n`` of devices the gradient is unreduced over.

    With ``accum_weight`` the micro-batch's global weight ``w``, each
    device's part is taken as a small batch of weight ``w / n`` (equal
    shares) whose mean gradient is ``n g_d``: it adds ``n w |g_d|^2``.
    """
    leaves = jax.tree.leaves(grads)
    first = next(g for g in leaves if sharding.unreduced_axes(g))
    mesh = jax.typeof(first).sharding.mesh
    every = frozenset(mesh.axis_names)
    n = math.prod(mesh.shape[a] for a in sharding.unreduced_axes(first))
    total = None
    for g, a in zip(leaves, jax.tree.leaves(acc)):
        g = jnp.asarray(g).astype(a.dtype)
        spec = jax.typeof(g).sharding.spec
        copies = every - spec.unreduced - sharding.sharded_axes(spec.partitions)

        def local(x, copies=copies):
            s = optax.tree.norm(x, squared=True)
            for axis in sorted(copies):  # a replicated copy counts once
                s = jnp.where(lax.axis_index(axis) == 0, s, jnp.zeros_like(s))
            return s

        sq = sharding.local_map(  # local values of an unreduced operand
            local, in_specs=spec, out_specs=P(unreduced=every)
        )(g)
        total = sq if total is None else total + sq
    assert total is not None  # for the type checker: first is a leaf
    return total, n


# ------------------------------------------------- shard_update


def placed_spec(
    spec: P, shape: tuple[int, ...], mesh: Any, axes: tuple[Hashable, ...]
) -> P:
    """Where one leaf of the params' spec ``spec`` lies under ZeRO-1.

    The rule, applied to ``spec`` without the data ``axes``: they (in the
    mesh's order) shard the largest dimension that no mesh axis shards and
    whose size their size ``n`` divides (the first of equals); failing
    that, the largest sharded dimension whose size ``n`` times its axes'
    size divides, after its own axes. A leaf with no such dimension (a
    scalar, a bias of odd size) keeps ``spec``: it is all-reduced as
    without ``shard_update`` and its optimizer state is replicated over
    the data axes. Placing a placed spec again changes nothing.
    """
    axes = sharding.ordered_axes(mesh, axes)
    n = int(np.prod([mesh.shape[a] for a in axes]))
    padded = sharding.padded_entries(spec, len(shape))
    dims = list(sharding.drop_axes(padded, axes))
    if n == 1:
        return spec

    def size(d):
        dim_axes = sharding.entry_axes(d)
        return int(np.prod([mesh.shape[a] for a in dim_axes]))

    free = [i for i, d in enumerate(dims) if d is None and shape[i] % n == 0]
    split = [
        i
        for i, d in enumerate(dims)
        if d is not None and shape[i] % (size(d) * n) == 0
    ]
    for candidates in (free, split):
        if candidates:
            i = max(candidates, key=lambda i: (shape[i], -i))
            own = sharding.entry_axes(dims[i])
            dims[i] = sharding.spec_entry((*own, *axes))
            return spec.update(partitions=tuple(dims))
    return spec


def reduce_scatter(a: jax.Array, axis_name: Any) -> jax.Array:
    """An accumulator leaf unreduced over ``axis_name``, summed over it
    and placed at its :func:`placed_spec`: inside a ``shard_map``, one
    ``psum_scatter`` over the data axes along the placed dimension (a
    ``psum`` for a leaf that keeps its spec). XLA's CPU pipeline does not
    turn an unreduced-to-sharded ``jax.reshard`` into a reduce-scatter (it
    all-reduces, then slices), hence the explicit collective."""
    named = sharding.named_sharding(a)
    mesh, spec = named.mesh, named.spec
    axes = sharding.ordered_axes(mesh, checks.axis_names(axis_name))
    plain = sharding.without_unreduced(spec)
    target = placed_spec(plain, a.shape, mesh, axes)
    old = sharding.padded_entries(plain, a.ndim)
    new = sharding.padded_entries(target, a.ndim)
    placed = [i for i in range(a.ndim) if old[i] != new[i]]
    rest = sharding.ordered_axes(
        mesh, spec.unreduced - set(axes if placed else ())
    )

    def body(c):
        for i in placed:
            c = lax.psum_scatter(c, axes, scatter_dimension=i, tiled=True)
        return lax.psum(c, rest) if rest else c

    return sharding.local_map(body, mesh=mesh, in_specs=spec, out_specs=target)(
        a
    )
