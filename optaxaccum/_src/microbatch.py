"""In-step microbatching: one jitted step, one micro-batch of activations.

:func:`microbatched_value_and_grad` splits the batch of a loss function into
micro-batches and accumulates loss and gradients inside a single
:func:`jax.lax.scan`, so that a compiled step holds the activations of one
micro-batch at a time. :func:`plan_microbatches` picks the number of
micro-batches for a memory budget by compiling the step and reading XLA's
memory analysis.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from optaxaccum._src import checks, numerics, sharding
from optaxaccum._src import gather_once as gather_lib
from optaxaccum._src.gather_once import GatherOnce

__all__ = [
    "microbatched_step_memory",
    "microbatched_value_and_grad",
    "plan_microbatches",
]

_ArgnumsLike = int | Sequence[int]


class _Argnums(NamedTuple):
    """Checked ``*argnums``: the indices, and whether given as a tuple."""

    indices: tuple[int, ...]
    is_tuple: bool

    def pick(self, values: Sequence[Any]) -> Any:
        """``values`` as a tuple for tuple argnums, else its one element."""
        return tuple(values) if self.is_tuple else values[0]

    def wrap(self, value: Any) -> tuple[Any, ...]:
        """The inverse of :meth:`pick`: ``value`` as a tuple."""
        return value if self.is_tuple else (value,)


# ------------------------------------------------------------ validation


def _check_argnums(
    name: str, value: Any, *, allow_none: bool = False
) -> _Argnums:
    """``value`` as :class:`_Argnums` (no indices for an allowed None)."""
    if value is None and allow_none:
        return _Argnums((), False)
    if isinstance(value, bool):
        raise TypeError(
            f"{name} must be an int or a tuple of ints, got {name}={value!r}"
        )
    if isinstance(value, numbers.Integral):
        return _Argnums((int(value),), False)
    if isinstance(value, (tuple, list)) and all(
        isinstance(i, numbers.Integral) and not isinstance(i, bool)
        for i in value
    ):
        indices = tuple(int(i) for i in value)
        if not indices:
            raise ValueError(f"{name} must not be empty, got {name}={value!r}")
        if len(set(indices)) != len(indices):
            raise ValueError(
                f"{name} must not repeat an index, got {name}={value!r}"
            )
        return _Argnums(indices, True)
    raise TypeError(
        f"{name} must be an int or a tuple of ints, got {name}={value!r}"
    )


def _normalize(
    indices: tuple[int, ...], nargs: int, name: str
) -> tuple[int, ...]:
    return checks.wrap_indices(
        indices,
        nargs,
        lambda i: (
            f"{name} refers to argument {i}, but the function was "
            f"called with {nargs} positional argument(s)"
        ),
    )


def _check_disjoint(named: dict[str, tuple[int, ...]]) -> None:
    names = list(named)
    for a in range(len(names)):
        for b in range(a + 1, len(names)):
            common = sorted(set(named[names[a]]) & set(named[names[b]]))
            if common:
                raise ValueError(
                    f"{names[a]} and {names[b]} must not overlap, but both "
                    f"name argument(s) {common}: "
                    + ", ".join(f"{n}={named[n]}" for n in (names[a], names[b]))
                )


def _batch_size(batch: Any, what: str = "the batch") -> int:
    """The common leading size of every leaf of ``batch`` (static)."""
    leaves = jax.tree.leaves_with_path(batch)
    if not leaves:
        raise ValueError(
            f"{what} has no array leaves to split into micro-batches"
        )
    sizes = {}
    for path, leaf in leaves:
        shape = np.shape(leaf)
        if len(shape) == 0:
            raise ValueError(
                f"every leaf of {what} needs a leading batch axis, but the "
                f"leaf at {jax.tree_util.keystr(path) or '<root>'} is a scalar"
            )
        sizes[jax.tree_util.keystr(path) or "<root>"] = shape[0]
    if len(set(sizes.values())) > 1:
        listing = ", ".join(f"{p}: {s}" for p, s in sizes.items())
        raise ValueError(
            f"every leaf of {what} must have the same leading (batch) size, "
            f"got {listing}"
        )
    return next(iter(sizes.values()))


def _check_divisible(batch_size: int, num_microbatches: int) -> None:
    if batch_size % num_microbatches:
        raise ValueError(
            f"the batch size {batch_size} is not divisible by "
            f"num_microbatches={num_microbatches}"
        )


def _split(x: Any, n: int, interleave: bool) -> jax.Array:
    """``x``'s leading axis split into ``n`` micro-batches: a reshape to
    ``(m, n, ...)`` (interleaved: micro-batch ``i`` is ``x[i::n]``) or
    ``(n, m, ...)``. Interleaved, the rows of each micro-batch keep the
    sharding of ``x``'s rows (JAX's reshape rule may otherwise move a
    size-1 mesh axis onto the micro-batch index), where that divides."""
    m = np.shape(x)[0] // n
    shape = ((m, n) if interleave else (n, m)) + np.shape(x)[1:]
    named = sharding.sharding_of(x)
    if not interleave or named is None:
        return jnp.reshape(x, shape)
    dims = sharding.padded_entries(named.spec, np.ndim(x))
    axes = sharding.entry_axes(dims[0])
    share = int(np.prod([named.mesh.shape[a] for a in axes]))
    if not axes or m % share or not sharding.all_explicit(named.mesh, axes):
        return jnp.reshape(x, shape)
    spec = P(dims[0], None, *dims[1:])
    return jnp.reshape(x, shape, out_sharding=NamedSharding(named.mesh, spec))


def _strong(x: Any) -> jax.Array:
    """``x`` as an array without weak type (scan carries must match)."""
    x = jnp.asarray(x)
    return lax.convert_element_type(x, x.dtype)


def _vma(x: Any) -> frozenset:
    """The mesh axes ``x`` varies over inside ``shard_map`` (else empty):
    ``jax.typeof(x).manual_axis_type.varying`` (jax 0.10 to 0.12; the
    ``.vma`` of earlier versions is gone). Without it nothing is checked
    here (JAX's own scan error then reports the mismatch).
    """
    manual = getattr(jax.typeof(x), "manual_axis_type", None)
    return frozenset(getattr(manual, "varying", ()))


def _check_weight_varies_with_grads(w: jax.Array, grads: Any) -> None:
    """Refuses a device-dependent weight on gradients already summed over
    the devices (replicated params inside ``shard_map`` with check_vma):
    their weighted mean would mix a global sum with local weights."""
    w_axes = _vma(w)
    if not w_axes:
        return
    for g in jax.tree.leaves(grads):
        missing = w_axes - _vma(g)
        if missing:
            raise ValueError(
                "weight_fn returned a weight that varies over the mesh "
                f"axes {sorted(missing)}, but a gradient does not: inside "
                "shard_map the gradient of a replicated parameter is already "
                "summed over those axes, so weighting it by a per-device "
                "weight is meaningless. Make the parameters varying first, "
                "e.g. params = jax.lax.pcast(params, axis_name, "
                "to='varying'), and combine the devices' results yourself "
                "(see 'In-step microbatching' in the concepts page of the "
                "docs)."
            )


def _check_carry(new_state: Any, state: Any) -> Any:
    """Returns ``new_state`` (without weak types) after checking that it has
    the structure, shapes and dtypes of ``state``: a scan carry must not
    change type."""
    checks.check_same_structure(
        "the state returned by loss_fn",
        new_state,
        state,
        "the state argument(s)",
    )

    def check(path, n, o):
        if np.shape(n) != np.shape(o) or jnp.result_type(n) != o.dtype:
            raise ValueError(
                "the state returned by loss_fn must keep the shapes and "
                "dtypes of the state argument(s); at "
                f"{jax.tree_util.keystr(path)} got "
                f"{jnp.result_type(n)}{list(np.shape(n))}, expected "
                f"{o.dtype}{list(o.shape)}"
            )
        return _strong(n)

    return jax.tree.map_with_path(check, new_state, state)


def _argnum_indices(
    nargs: int, named: dict[str, _Argnums]
) -> list[tuple[int, ...]]:
    """Each argnums' indices in ``range(nargs)``, checked to be disjoint."""
    out = {k: _normalize(a.indices, nargs, k) for k, a in named.items()}
    _check_disjoint(out)
    return list(out.values())


def _unpack(out: Any, has_aux: bool, has_state: bool) -> tuple[Any, ...]:
    """``value_and_grad(loss_fn)``'s output -> (loss, state, aux, grads)."""
    if not (has_aux or has_state):
        loss, grads = out
        return loss, None, None, grads
    (loss, aux), grads = out
    if not has_state:
        return loss, None, aux, grads
    if not has_aux:
        return loss, aux, None, grads
    if not (isinstance(aux, tuple) and len(aux) == 2):
        raise ValueError(
            "with state_argnums and has_aux=True, loss_fn must "
            "return (loss, (new_state, aux))"
        )
    return loss, aux[0], aux[1], grads


def _microbatch_weight(
    weight_fn: Callable[[Any], Any], microbatch: Any, grads: Any
) -> jax.Array:
    """``weight_fn(microbatch)`` as a float32 scalar, checked."""
    w = jnp.asarray(weight_fn(microbatch))
    if w.ndim != 0:
        raise ValueError(
            f"weight_fn must return a scalar, got an array of shape {w.shape}"
        )
    w = w.astype(jnp.float32)
    _check_weight_varies_with_grads(w, grads)
    return w


def _add_grads(acc: Any, grads: Any, w: jax.Array | None) -> Any:
    """``acc + grads``, or ``acc + w * grads`` (nothing where ``w == 0``)."""
    if w is None:
        return jax.tree.map(lambda a, g: a + g.astype(a.dtype), acc, grads)
    keep = w != 0

    def add(a, g):
        wg = sharding.times(w.astype(a.dtype), g.astype(a.dtype))
        return a + jnp.where(keep, wg, jnp.zeros_like(wg))

    return jax.tree.map(add, acc, grads)


def _weighted_mean(
    losses: jax.Array, ws: jax.Array | None, acc: Any, n: int
) -> tuple[jax.Array, Any]:
    """The (weighted) mean loss and gradients from the scan's outputs."""
    loss_acc = numerics.widen(losses.dtype)
    if ws is None:
        loss = jnp.mean(losses.astype(loss_acc))
        grads = jax.tree.map(
            lambda a: sharding.times(jnp.asarray(1 / n, a.dtype), a), acc
        )
        return loss.astype(losses.dtype), grads
    scale = numerics.divide_or(1, jnp.sum(ws))
    terms = ws.astype(loss_acc) * losses.astype(loss_acc)
    loss = jnp.sum(jnp.where(ws != 0, terms, 0)) * scale.astype(loss_acc)
    grads = jax.tree.map(
        lambda a: sharding.times(scale.astype(a.dtype), a), acc
    )
    return loss.astype(losses.dtype), grads


def _struct(x: Any) -> Any:
    """``x`` as a :class:`jax.ShapeDtypeStruct` with its type's sharding."""
    x = jnp.asarray(x) if not hasattr(x, "shape") else x
    return jax.ShapeDtypeStruct(
        x.shape, x.dtype, sharding=sharding.sharding_of(x)
    )


def _holding(
    cfg: GatherOnce | None,
    fixed: gather_lib.Plan | None,
    diff_args: Any,
    make: Callable[[gather_lib.Plan], Callable[..., Any]],
    args: Sequence[Any],
) -> gather_lib.Plan | None:
    """The leaves to hold: ``fixed`` (a step compiled to measure a plan),
    else planned for ``cfg`` (None: no holding), a memory budget checked by
    compiling the step on the shapes and shardings of ``args``."""
    if cfg is None:
        return None
    if fixed is not None:
        return fixed
    structs = jax.tree.map(_struct, tuple(args))
    base: list[int] = []

    def measure(p: gather_lib.Plan) -> int:
        if not base:
            none = gather_lib.Plan.nothing(p.treedef)
            base.append(
                _memory_bytes(jax.jit(make(none)).lower(*structs).compile())
            )
        held = _memory_bytes(jax.jit(make(p)).lower(*structs).compile())
        return held - base[0]

    return gather_lib.plan(cfg, diff_args, measure)


# ---------------------------------------------------------------- stages


class _Call(NamedTuple):
    """One call of the step, planned: its arguments (held copies in place
    once gathered), the indices of the differentiated, batch and state
    arguments, the batch arguments split into micro-batches (``xs``), the
    differentiated arguments as given, and the holding (None: none)."""

    args: tuple[Any, ...]
    d_idx: tuple[int, ...]
    b_idx: tuple[int, ...]
    s_idx: tuple[int, ...]
    xs: tuple[Any, ...]
    diff_args: tuple[Any, ...]
    holding: gather_lib.Plan | None = None


class _Carry(NamedTuple):
    """What passes from one micro-batch to the next: the gradient sums and
    the threaded state."""

    acc: tuple[Any, ...]
    state: tuple[Any, ...]


class _Out(NamedTuple):
    """What each micro-batch returns: its loss, weight (None without
    ``weight_fn``) and aux (None without ``has_aux``)."""

    loss: jax.Array
    weight: jax.Array | None
    aux: Any


class _Stages(NamedTuple):
    """The in-step path of :func:`microbatched_value_and_grad`, in the
    order a step runs it: :meth:`plan` the call, :meth:`gather` the held
    leaves, :meth:`start` the sums, :meth:`scan` over the micro-batches
    (each one :meth:`micro_batch`; holding, the first and last one
    :meth:`peeled` off the scan), :meth:`scatter` the held leaves'
    gradients, then the (weighted) mean (:meth:`result`)."""

    vg: Callable[..., Any]  # jax.value_and_grad of loss_fn
    n: int
    interleave: bool
    named: dict[str, _Argnums]
    weight_fn: Callable[[Any], Any] | None
    has_aux: bool
    peel: bool = True  # GatherOnce.peel

    @property
    def has_state(self) -> bool:
        return bool(self.named["state_argnums"].indices)

    def plan(self, args: tuple[Any, ...]) -> _Call:
        """The argument indices and the batch split into micro-batches: a
        reshape, no copy. Micro-batch ``i`` is ``xs[i]`` (consecutive) or
        ``xs[:, i] = x[i::n]`` (interleaved, local to sharded rows)."""
        d_idx, b_idx, s_idx = _argnum_indices(len(args), self.named)
        batches = tuple(args[i] for i in b_idx)
        batch_size = _batch_size(self.named["batch_argnums"].pick(batches))
        _check_divisible(batch_size, self.n)
        xs = jax.tree.map(lambda x: _split(x, self.n, self.interleave), batches)
        diff_args = tuple(args[i] for i in d_idx)
        return _Call(tuple(args), d_idx, b_idx, s_idx, xs, diff_args)

    def gather(self, call: _Call, holding: gather_lib.Plan | None) -> _Call:
        """The call with each held leaf replaced by its held copy, gathered
        once (unchanged without holding)."""
        if holding is None:
            return call
        args = list(call.args)
        for k, x in zip(call.d_idx, holding.hold(call.diff_args), strict=True):
            args[k] = x
        return call._replace(args=tuple(args), holding=holding)

    def micro_batch(
        self, call: _Call, carry: _Carry, i: Any
    ) -> tuple[_Carry, _Out]:
        """Micro-batch ``i``'s loss and gradients, added to ``carry``."""
        axis = 1 if self.interleave else 0
        mb = jax.tree.map(
            lambda x: lax.dynamic_index_in_dim(x, i, axis, keepdims=False),
            call.xs,
        )
        args = list(call.args)
        for k, x in zip(call.b_idx + call.s_idx, mb + carry.state, strict=True):
            args[k] = x
        loss, new_state, aux, grads = _unpack(
            self.vg(*args), self.has_aux, self.has_state
        )
        grads = self.named["argnums"].wrap(grads)
        w = None
        if self.weight_fn is not None:
            batch = self.named["batch_argnums"].pick(mb)
            w = _microbatch_weight(self.weight_fn, batch, grads)
        state = carry.state
        if self.has_state:
            state_nums = self.named["state_argnums"]
            state = _check_carry(state_nums.wrap(new_state), state)
        return _Carry(_add_grads(carry.acc, grads, w), state), _Out(
            loss, w, aux
        )

    def start(self, call: _Call) -> _Carry:
        """Zero gradient sums (float32 or wider), the state as given."""
        acc0 = jax.tree.map(
            lambda p: sharding.grad_zeros(
                p, numerics.widen(jnp.result_type(p))
            ),
            tuple(call.args[i] for i in call.d_idx),
        )
        state0 = jax.tree.map(_strong, tuple(call.args[i] for i in call.s_idx))
        return _Carry(acc0, state0)

    def scan(
        self, call: _Call, carry: _Carry, start: int, stop: int
    ) -> tuple[_Carry, _Out]:
        """Micro-batches ``start`` to ``stop - 1`` in one ``lax.scan``;
        their outputs stacked."""
        return lax.scan(
            lambda c, i: self.micro_batch(call, c, i),
            carry,
            jnp.arange(start, stop),
        )

    def scatter(self, call: _Call, acc: tuple[Any, ...]) -> tuple[Any, ...]:
        """The gradient sums with each held leaf's back in its leaf's
        sharding: one reduce-scatter per held leaf."""
        return acc if call.holding is None else call.holding.release(acc)

    def result(self, call: _Call, carry: _Carry, outs: _Out) -> Any:
        """The (weighted) mean loss and gradients, in the shape
        :func:`jax.value_and_grad` returns them."""
        loss, grads = _weighted_mean(outs.loss, outs.weight, carry.acc, self.n)
        grads = jax.tree.map(
            lambda g, p: g.astype(jnp.result_type(p)), grads, call.diff_args
        )
        grads = self.named["argnums"].pick(grads)
        auxs = outs.aux
        if self.has_state:
            state = self.named["state_argnums"].pick(carry.state)
            return (loss, (state, auxs) if self.has_aux else state), grads
        return ((loss, auxs) if self.has_aux else loss), grads

    def run(self, call: _Call) -> Any:
        """Every micro-batch, the scatter and the mean. Holding, the first
        and the last micro-batch run outside the scan (peeled): XLA can
        then overlap each held leaf's gather with the first one's forward
        and its reduce-scatter with the last one's backward."""
        carry = self.start(call)
        holds = call.holding is not None and call.holding.held
        if not (holds and self.peel):
            carry, outs = self.scan(call, carry, 0, self.n)
        else:
            carry, outs = self.peeled(call, carry)
        carry = carry._replace(acc=self.scatter(call, carry.acc))
        return self.result(call, carry, outs)

    def peeled(self, call: _Call, carry: _Carry) -> tuple[_Carry, _Out]:
        """The first micro-batch, the middle ones in a scan, the last one;
        their outputs stacked in order."""
        carry, first = self.micro_batch(call, carry, 0)
        parts = [jax.tree.map(lambda x: x[None], first)]
        if self.n > 2:
            carry, middle = self.scan(call, carry, 1, self.n - 1)
            parts.append(middle)
        if self.n > 1:
            carry, last = self.micro_batch(call, carry, self.n - 1)
            parts.append(jax.tree.map(lambda x: x[None], last))
        return carry, jax.tree.map(lambda *x: jnp.concatenate(x), *parts)


# ---------------------------------------------------------------- public


def microbatched_value_and_grad(
    loss_fn: Callable[..., Any],
    num_microbatches: int,
    *,
    has_aux: bool = False,
    argnums: _ArgnumsLike = 0,
    batch_argnums: _ArgnumsLike = 1,
    weight_fn: Callable[[Any], Any] | None = None,
    state_argnums: _ArgnumsLike | None = None,
    interleave: bool = False,
    gather_once: GatherOnce | None = None,
) -> Callable[..., Any]:
    r"""Like :func:`jax.value_and_grad`, one micro-batch at a time.

    Splits axis 0 of the batch argument(s) into ``num_microbatches`` equal
    micro-batches and accumulates loss and gradients (float32 or wider) in
    one :func:`jax.lax.scan`: a compiled step holds one micro-batch's
    activations. With weights :math:`w_i` (1 without ``weight_fn``),
    :math:`\ell = \sum_i w_i \ell_i / \sum_i w_i`, likewise the gradients.
    Weights, state, interleaving, devices: see :ref:`microbatching`.

    Args:
      loss_fn: returns a scalar loss (``(loss, aux)`` with ``has_aux``).
      num_microbatches: a positive int dividing the batch size.
      has_aux: whether ``loss_fn`` returns ``(loss, aux)`` (stacked on return).
      argnums: the argument(s) to differentiate, an int or tuple of ints.
      batch_argnums: the argument(s) holding the batch, an int or tuple.
      weight_fn: optional ``microbatch -> scalar`` weight of the sliced batch
        argument (a tuple of them for tuple ``batch_argnums``).
      state_argnums: optional state argument(s) threaded through the scan;
        ``loss_fn`` returns ``(loss, new_state)``/``(loss, (new_state, aux))``.
      interleave: micro-batch ``i`` is ``x[i::n]``, not a consecutive slice.
      gather_once: optional :class:`GatherOnce`: FSDP-sharded parameters
        gathered once before the micro-batches, their gradients
        reduce-scattered once after (see docs/scaling.md).

    Returns:
      ``f(*args) -> (loss, grads)``, ``((loss, aux), grads)`` with ``has_aux``;
      with state, ``aux`` is the last ``new_state`` or ``(new_state, aux)``.

    Raises:
      TypeError: for a non-callable ``loss_fn`` or ``weight_fn``, a non-int
        ``num_microbatches``, a non-bool flag, or a malformed ``*argnums``.
      ValueError: if ``num_microbatches < 1`` or the ``*argnums`` overlap or
        repeat; when called, for ragged or scalar batch leaves, a batch size
        not divisible, a non-scalar weight or a state that changes type.

    Examples:
      >>> import jax, jax.numpy as jnp, optaxaccum as oa
      >>> w, x = jnp.ones(3), jnp.arange(24.0).reshape(8, 3)
      >>> loss_fn = lambda w, x: jnp.mean((x @ w) ** 2)
      >>> step = jax.jit(oa.microbatched_value_and_grad(loss_fn, 4))
      >>> print(*step(w, x))  # as jax.value_and_grad(loss_fn)(w, x)
      1615.5 [1008. 1077. 1146.]
    """
    checks.check_callable("loss_fn", loss_fn)
    n = checks.check_positive_int("num_microbatches", num_microbatches)
    checks.check_bool("has_aux", has_aux)
    checks.check_bool("interleave", interleave)
    named = {
        "argnums": _check_argnums("argnums", argnums),
        "batch_argnums": _check_argnums("batch_argnums", batch_argnums),
        "state_argnums": _check_argnums(
            "state_argnums", state_argnums, allow_none=True
        ),
    }
    diff = named["argnums"]
    checks.check_callable("weight_fn", weight_fn, none_ok=True)
    if gather_once is not None and not isinstance(gather_once, GatherOnce):
        raise TypeError(
            "gather_once must be None or an oa.GatherOnce, got "
            f"gather_once={gather_once!r}"
        )
    # Catches what can be seen before the number of arguments is known
    # (negative indices are checked again at call time).
    _check_disjoint({k: a.indices for k, a in named.items()})
    stages = _Stages(
        vg=jax.value_and_grad(
            loss_fn,
            argnums=diff.pick(diff.indices),
            has_aux=has_aux or state_argnums is not None,
        ),
        n=n,
        interleave=interleave,
        named=named,
        weight_fn=weight_fn,
        has_aux=has_aux,
        peel=gather_once is None or gather_once.peel,
    )

    def make(fixed: gather_lib.Plan | None) -> Callable[..., Any]:
        def f(*args):
            call = stages.plan(args)
            holding = _holding(gather_once, fixed, call.diff_args, make, args)
            return stages.run(stages.gather(call, holding))

        return f

    return make(None)


def _memory_bytes(compiled: Any) -> int:
    stats = compiled.memory_analysis()
    if stats is None:
        raise RuntimeError(
            "this backend provides no memory analysis of compiled programs "
            f"({jax.default_backend()})"
        )
    return int(
        stats.argument_size_in_bytes
        + stats.output_size_in_bytes
        - stats.alias_size_in_bytes
        + stats.temp_size_in_bytes
    )


def microbatched_step_memory(
    loss_fn: Callable[..., Any],
    *args: Any,
    num_microbatches: int,
    batch_argnums: _ArgnumsLike = 1,
    **kwargs: Any,
) -> int:
    """Bytes a jitted :func:`microbatched_value_and_grad` step needs.

    Compiles ``jax.jit(microbatched_value_and_grad(loss_fn, num_microbatches,
    batch_argnums=batch_argnums, **kwargs))`` for ``args`` (arrays or
    :class:`jax.ShapeDtypeStruct`) without running it and returns argument +
    output - alias + temporary bytes of its
    :meth:`~jax.stages.Compiled.memory_analysis`.

    Args:
      loss_fn: as for :func:`microbatched_value_and_grad`.
      *args: the step's positional arguments, or their
        :class:`jax.ShapeDtypeStruct`.
      num_microbatches: the number of micro-batches.
      batch_argnums: as for :func:`microbatched_value_and_grad`.
      **kwargs: passed on to :func:`microbatched_value_and_grad`.

    Returns:
      The footprint in bytes, an int.

    Raises:
      RuntimeError: if the backend has no memory analysis.
    """
    step = microbatched_value_and_grad(
        loss_fn, num_microbatches, batch_argnums=batch_argnums, **kwargs
    )
    return _memory_bytes(jax.jit(step).lower(*args).compile())


def plan_microbatches(
    loss_fn: Callable[..., Any],
    *args: Any,
    memory_budget: float,
    batch_argnums: _ArgnumsLike = 1,
    candidates: Iterable[int] | None = None,
    **kwargs: Any,
) -> int:
    """The fewest micro-batches whose jitted step fits a memory budget.

    Tries the divisors of the batch size (or ``candidates``) in increasing
    order and returns the first ``num_microbatches`` for which
    :func:`microbatched_step_memory` (argument + output - alias + temporary
    bytes of the compiled step) is at most ``memory_budget``. Candidates are
    only compiled, on the backend that would run them; nothing is run. The
    count is for the gradient alone: leave room for the rest of the step.

    Args:
      loss_fn: as for :func:`microbatched_value_and_grad`.
      *args: the step's positional arguments (pytrees of arrays or of
        :class:`jax.ShapeDtypeStruct`); bind anything else (a model object,
        a flag) into ``loss_fn`` with :func:`functools.partial`.
      memory_budget: the budget in bytes, a positive number.
      batch_argnums: as for :func:`microbatched_value_and_grad`.
      candidates: optional positive ints to try instead of all divisors of
        the batch size (fewer compilations); each must divide it.
      **kwargs: passed on to :func:`microbatched_value_and_grad`.

    Returns:
      The smallest fitting ``num_microbatches``, an int.

    Raises:
      TypeError: if ``memory_budget`` is not a real number or a candidate is
        not an int.
      ValueError: if ``memory_budget`` is not positive and finite, a candidate
        does not divide the batch size, or no candidate fits (the message
        gives the smallest footprint measured and the budget).

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import optaxaccum as oa
      >>> def loss_fn(w, x):
      ...   return jnp.mean(jnp.tanh(x @ w) ** 2)
      >>> w = jax.ShapeDtypeStruct((256, 256), jnp.float32)
      >>> x = jax.ShapeDtypeStruct((64, 256), jnp.float32)
      >>> oa.plan_microbatches(loss_fn, w, x, memory_budget=2**40)  # huge
      1
    """
    budget = checks.check_real("memory_budget", memory_budget)
    if not (budget > 0 and math.isfinite(budget)):
        raise ValueError(
            f"memory_budget must be a positive, finite number of bytes, got "
            f"memory_budget={memory_budget!r}"
        )
    batch = _check_argnums("batch_argnums", batch_argnums)
    b_idx = _normalize(batch.indices, len(args), "batch_argnums")
    batch_size = _batch_size(batch.pick([args[i] for i in b_idx]))
    if candidates is None:
        tries = [d for d in range(1, batch_size + 1) if batch_size % d == 0]
    else:
        tries = sorted(
            {checks.check_positive_int("candidates", c) for c in candidates}
        )
        if not tries:
            raise ValueError("candidates must not be empty")
        for c in tries:
            _check_divisible(batch_size, c)
    measured: dict[int, int] = {}
    for c in tries:
        measured[c] = microbatched_step_memory(
            loss_fn,
            *args,
            num_microbatches=c,
            batch_argnums=batch.pick(batch.indices),
            **kwargs,
        )
        if measured[c] <= budget:
            return c
    best = min(measured, key=lambda c: measured[c])
    raise ValueError(
        f"no num_microbatches fits memory_budget={memory_budget!r} bytes: the "
        f"smallest footprint measured is {measured[best]} bytes "
        f"(num_microbatches={best}, {batch_size // best} example(s) per "
        f"micro-batch); tried {tries}"
    )
