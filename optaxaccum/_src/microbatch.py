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
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from optaxaccum._src import sharding, utils

__all__ = [
    "microbatched_step_memory",
    "microbatched_value_and_grad",
    "plan_microbatches",
]

_Argnums = int | Sequence[int]


# ------------------------------------------------------------ validation


def _check_argnums(name: str, value: Any, *, allow_none: bool = False):
    """Returns ``(value, indices)``: ``indices`` a tuple of ints, or None."""
    if value is None and allow_none:
        return None, ()
    if isinstance(value, bool):
        raise TypeError(
            f"{name} must be an int or a tuple of ints, got {name}={value!r}"
        )
    if isinstance(value, numbers.Integral):
        return int(value), (int(value),)
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
        return indices, indices
    raise TypeError(
        f"{name} must be an int or a tuple of ints, got {name}={value!r}"
    )


def _normalize(
    indices: tuple[int, ...], nargs: int, name: str
) -> tuple[int, ...]:
    out = []
    for i in indices:
        if not -nargs <= i < nargs:
            raise ValueError(
                f"{name} refers to argument {i}, but the function was called "
                f"with {nargs} positional argument(s)"
            )
        out.append(i % nargs)
    return tuple(out)


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


def _acc_dtype(dtype: Any) -> jnp.dtype:
    """float32, or the wider of float32 and ``dtype`` (complex stays
    complex). Not ``jnp.promote_types``: it raises under strict promotion."""
    dtype = jnp.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.complexfloating):
        return dtype if dtype.itemsize >= 8 else jnp.dtype(jnp.complex64)
    if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize >= 4:
        return dtype
    return jnp.dtype(jnp.float32)


def _strong(x: Any) -> jax.Array:
    """``x`` as an array without weak type (scan carries must match)."""
    x = jnp.asarray(x)
    return lax.convert_element_type(x, x.dtype)


def _vma(x: Any) -> frozenset:
    """The mesh axes ``x`` varies over inside ``shard_map`` (else empty).

    JAX 0.9 exposes them as ``jax.typeof(x).vma``, JAX 0.10 as
    ``jax.typeof(x).manual_axis_type.varying``; with neither, nothing is
    checked here (JAX's own scan error then reports the mismatch).
    """
    aval = jax.typeof(x)
    if hasattr(aval, "vma"):
        return frozenset(aval.vma)
    manual = getattr(aval, "manual_axis_type", None)
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
                "(see the note on data parallelism)."
            )


def _check_state(new_state: Any, state: Any) -> Any:
    """Returns ``new_state`` (without weak types) after checking that it has
    the structure, shapes and dtypes of ``state``: a scan carry must not
    change type."""
    utils.check_same_structure(
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


# ---------------------------------------------------------------- public


def microbatched_value_and_grad(
    loss_fn: Callable[..., Any],
    num_microbatches: int,
    *,
    has_aux: bool = False,
    argnums: _Argnums = 0,
    batch_argnums: _Argnums = 1,
    weight_fn: Callable[[Any], Any] | None = None,
    state_argnums: _Argnums | None = None,
    interleave: bool = False,
) -> Callable[..., Any]:
    r"""Like :func:`jax.value_and_grad`, one micro-batch at a time.

    The returned function splits axis 0 of every leaf of the batch
    argument(s) into ``num_microbatches`` micro-batches of equal size and runs
    ``jax.value_and_grad(loss_fn)`` on one after the other inside a single
    :func:`jax.lax.scan` of length ``num_microbatches``. Compiled, a step
    therefore holds the activations of one micro-batch only, at the cost of a
    float32 accumulator the size of the gradients.

    Without ``weight_fn`` the micro-batches count equally: with :math:`\ell_i`
    and :math:`g_i` the loss and gradient of micro-batch :math:`i` of
    :math:`n`,

    .. math::
      \ell = \frac{1}{n} \sum_{i=1}^{n} \ell_i, \qquad
      g = \frac{1}{n} \sum_{i=1}^{n} g_i,

    which equals ``jax.value_and_grad(loss_fn)`` on the whole batch when the
    loss is a mean over examples. With ``weight_fn``, micro-batch :math:`i`
    has weight :math:`w_i` = ``weight_fn(microbatch_i)`` and

    .. math::
      \ell = \frac{\sum_i w_i \ell_i}{\sum_i w_i}, \qquad
      g = \frac{\sum_i w_i g_i}{\sum_i w_i}.

    If each :math:`\ell_i` is a mean over the micro-batch's tokens (a masked
    mean, say) and :math:`w_i` its token count, the result is the exact
    per-token mean over the whole batch.

    Sums are kept in float32 (or in the gradient's dtype if it is wider);
    gradients come back in the dtypes of the differentiated arguments, the
    loss in the dtype ``loss_fn`` returns.

    Args:
      loss_fn: the function to differentiate; it must return a scalar loss
        (or ``(loss, aux)`` with ``has_aux``; see ``state_argnums`` for the
        form with state).
      num_microbatches: the number of micro-batches, a positive int dividing
        the batch size. ``1`` runs the whole batch at once (still inside a
        scan of length 1).
      has_aux: whether ``loss_fn`` returns ``(loss, aux)``. The ``aux`` of
        every micro-batch is returned, stacked along a new leading axis of
        length ``num_microbatches``.
      argnums: the positional argument(s) to differentiate, as in
        :func:`jax.value_and_grad`: an int, or a tuple of ints (then the
        gradients are a tuple).
      batch_argnums: the positional argument(s) holding the batch: an int or
        a tuple of ints. Every leaf of every batch argument is split along
        axis 0, and all must have the same leading size.
      weight_fn: optional ``microbatch -> scalar`` giving each micro-batch's
        weight (e.g. its number of real tokens); traced, so it may depend on
        the data. It receives the sliced batch argument when
        ``batch_argnums`` is an int, and a tuple of the sliced batch
        arguments (in the order of ``batch_argnums``) when it is a tuple.
        Weights should be non-negative. A micro-batch of weight 0 contributes
        nothing, even if its loss or gradient is not finite (an all-padding
        micro-batch whose masked mean is 0/0); if all weights are 0 the loss
        and the gradients are zeros.
      state_argnums: optional positional argument(s) holding mutable state
        threaded from one micro-batch to the next (e.g. Flax
        ``batch_stats``); an int or a tuple of ints, disjoint from
        ``argnums`` and ``batch_argnums``. ``loss_fn`` must then return
        ``(loss, new_state)``, or ``(loss, (new_state, aux))`` with
        ``has_aux``, where ``new_state`` has the structure, shapes and dtypes
        of the state argument (a tuple of them when ``state_argnums`` is a
        tuple). Micro-batch :math:`i` is called with the state returned by
        micro-batch :math:`i - 1`, and the function returns the last one (not
        stacked) in place of ``aux``: ``((loss, new_state), grads)``, or
        ``((loss, (new_state, aux)), grads)`` with ``has_aux``.
      interleave: if false (default), micro-batch :math:`i` is the
        consecutive slice ``i`` of axis 0; if true, it is ``x[i::n]`` (for
        batches sharded along axis 0; see the note below).

    Returns:
      A function of the same positional arguments as ``loss_fn`` returning
      ``(loss, grads)``, or ``((loss, aux), grads)`` with ``has_aux`` (``aux``
      stacked per micro-batch).

    Raises:
      TypeError: if ``loss_fn`` or ``weight_fn`` is not callable,
        ``num_microbatches`` is not an int, ``has_aux`` is not a bool, or an
        ``*argnums`` is neither an int nor a tuple of ints.
      ValueError: if ``num_microbatches < 1``, the ``*argnums`` overlap or
        repeat an index, and, when the returned function is called, if the
        batch leaves have different leading sizes, a leaf is a scalar, the
        batch size is not divisible by ``num_microbatches``, ``weight_fn``
        does not return a scalar, or the returned state does not match the
        state argument.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import optaxaccum as oa
      >>> def loss_fn(w, x):
      ...   return jnp.mean((x @ w) ** 2)
      >>> w, x = jnp.ones(3), jnp.arange(24.0).reshape(8, 3)
      >>> loss, g = jax.jit(oa.microbatched_value_and_grad(loss_fn, 4))(w, x)
      >>> ref_loss, ref_g = jax.value_and_grad(loss_fn)(w, x)
      >>> print(loss, ref_loss)
      1615.5 1615.5
      >>> print(g, ref_g)
      [1008. 1077. 1146.] [1008. 1077. 1146.]

      Weights, e.g. the number of real (unpadded) rows of each micro-batch:

      >>> def masked_loss(w, batch):
      ...   x, mask = batch
      ...   return jnp.sum(mask * (x @ w) ** 2) / jnp.sum(mask)
      >>> mask = jnp.array([1.0, 1, 1, 0, 1, 1, 1, 0])
      >>> f = oa.microbatched_value_and_grad(
      ...     masked_loss, 4, weight_fn=lambda batch: jnp.sum(batch[1]))
      >>> loss, g = f(w, (x, mask))   # micro-batch 3 (rows 3, 7): weight 0
      >>> print(loss, masked_loss(w, (x, mask)))
      1278.0 1278.0

      Threading state through the micro-batches (here a running sum):

      >>> def loss_with_state(w, x, total):
      ...   return jnp.mean((x @ w) ** 2), total + jnp.sum(x)
      >>> f = oa.microbatched_value_and_grad(loss_with_state, 4,
      ...                                    state_argnums=2)
      >>> (loss, total), g = f(w, x, jnp.zeros(()))
      >>> print(loss, total)
      1615.5 276.0

    .. note::
      **Mutable model state** (e.g. Flax ``batch_stats``). ``has_aux`` alone
      cannot carry state from one micro-batch to the next: every micro-batch
      would see the state passed in, and the new states would come back
      stacked. Pass the state as an argument named by ``state_argnums``
      instead; it becomes part of the scan's carry. With Flax linen::

        def loss_fn(params, batch, batch_stats):
            logits, updates = model.apply(
                {"params": params, "batch_stats": batch_stats}, batch["x"],
                train=True, mutable=["batch_stats"])
            loss = optax.softmax_cross_entropy_with_integer_labels(
                logits, batch["y"]).mean()
            return loss, updates["batch_stats"]

        step = oa.microbatched_value_and_grad(loss_fn, 4, state_argnums=2)
        (loss, batch_stats), grads = step(params, batch, batch_stats)

      In training mode each micro-batch is normalized with its own
      statistics, so these gradients are not those of normalizing with the
      whole batch's statistics (the batch dependence of BatchNorm makes the
      loss no mean of per-example terms). A stock ``nn.BatchNorm`` would
      also update its running averages once per micro-batch; with
      ``optaxaccum.flax.AccumBatchNorm(..., accum_steps=num_microbatches)``
      its window coincides with the step, so they are updated once per step
      with the pooled statistics of the whole batch, as ``nn.BatchNorm`` on
      the whole batch would update them.

    .. note::
      **Which examples form a micro-batch.** By default micro-batch :math:`i`
      is the consecutive slice ``x[i * m:(i + 1) * m]`` (``m = batch_size //
      n``): each leaf is reshaped, without a copy, to ``(n, m, ...)``. With
      ``interleave=True`` it holds the examples ``i, i + n, i + 2n, ...``
      (``x[i::n]``; a reshape to ``(m, n, ...)``). Use ``interleave=True``
      when the batch is sharded along axis 0 under ``jax.jit`` (a
      ``NamedSharding``, explicit or automatic): each micro-batch then takes
      rows local to every device, where consecutive slices would make XLA
      gather the batch (or, with explicit sharding, refuse the reshape). For
      mean-reduced losses both give the same result; a stacked per-example
      ``aux`` of shape ``(n, m, ...)`` goes back to the batch order with
      ``aux.reshape(batch_size, ...)`` (consecutive) or
      ``aux.swapaxes(0, 1).reshape(batch_size, ...)`` (interleaved).

    .. note::
      **Data parallelism.** Under ``jax.jit`` with a batch sharded over
      devices, XLA inserts the gradient all-reduce itself (in each
      micro-batch). Inside ``pmap`` or ``shard_map`` the function splits each
      device's local batch and behaves as ``jax.value_and_grad`` does there.
      With ``shard_map``'s default ``check_vma=True``, that means the
      gradient of a replicated (invariant) parameter comes back already
      summed over the devices: JAX all-reduces it on every micro-batch. To
      all-reduce once per step, make the parameters varying first and average
      the local gradients yourself::

        def step(params, batch):  # inside shard_map over axis "data"
            params = jax.lax.pcast(params, "data", to="varying")
            loss, grads = microbatched(params, batch)
            return jax.lax.pmean((loss, grads), "data")

      With ``pmap`` (or ``check_vma=False``) gradients are local: pass them
      to ``jax.lax.pmean`` once per step. With ``weight_fn`` each device
      returns the weighted mean over *its* micro-batches, so the global
      weighted mean needs each device's total weight ``W`` (e.g. the sum of
      ``weight_fn`` over its batch): ``psum(W * grads) / psum(W)`` -- or hand
      the local gradients to :func:`accumulate` with ``axis_name`` and
      ``accum_weight=W``, which does exactly that once per window. A
      device-varying weight on gradients of replicated parameters (the
      ``check_vma`` case above) raises ``ValueError``. A state
      (``state_argnums``) that becomes device-dependent must be passed in as
      varying too (``jax.lax.pcast(state, "data", to="varying")``), or be
      reduced over the devices inside ``loss_fn`` (e.g.
      ``nn.BatchNorm(axis_name=...)``): the scan carry must keep its type.
    """
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, got loss_fn={loss_fn!r}")
    n = utils.check_positive_int("num_microbatches", num_microbatches)
    if not isinstance(has_aux, bool):
        raise TypeError(f"has_aux must be a bool, got has_aux={has_aux!r}")
    if not isinstance(interleave, bool):
        raise TypeError(
            f"interleave must be a bool, got interleave={interleave!r}"
        )
    split_shape = (lambda m: (m, n)) if interleave else (lambda m: (n, m))
    split_axis = 1 if interleave else 0
    argnums, diff_idx = _check_argnums("argnums", argnums)
    batch_argnums, batch_idx = _check_argnums("batch_argnums", batch_argnums)
    state_argnums, state_idx = _check_argnums(
        "state_argnums", state_argnums, allow_none=True
    )
    if weight_fn is not None and not callable(weight_fn):
        raise TypeError(
            f"weight_fn must be callable or None, got weight_fn={weight_fn!r}"
        )
    named = {"argnums": diff_idx, "batch_argnums": batch_idx}
    if state_argnums is not None:
        named["state_argnums"] = state_idx
    # Catches what can be seen before the number of arguments is known
    # (negative indices are checked again at call time).
    _check_disjoint(named)
    has_state = state_argnums is not None
    vg = jax.value_and_grad(
        loss_fn, argnums=argnums, has_aux=has_aux or has_state
    )

    def split_outputs(out):
        """``loss_fn``'s output -> (loss, state or None, aux or None)."""
        (loss, aux), grads = (
            out if (has_aux or has_state) else ((out[0], None), out[1])
        )
        new_state = None
        if has_state:
            if has_aux:
                if not (isinstance(aux, tuple) and len(aux) == 2):
                    raise ValueError(
                        "with state_argnums and has_aux=True, loss_fn must "
                        "return (loss, (new_state, aux))"
                    )
                new_state, aux = aux
            else:
                new_state, aux = aux, None
        return loss, new_state, aux, grads

    def f(*args):
        nargs = len(args)
        d_idx = _normalize(diff_idx, nargs, "argnums")
        b_idx = _normalize(batch_idx, nargs, "batch_argnums")
        s_idx = _normalize(state_idx, nargs, "state_argnums")
        _check_disjoint(
            {"argnums": d_idx, "batch_argnums": b_idx, "state_argnums": s_idx}
        )
        batches = tuple(args[i] for i in b_idx)
        batch_size = _batch_size(
            batches if isinstance(batch_argnums, tuple) else batches[0]
        )
        _check_divisible(batch_size, n)
        m = batch_size // n
        # A reshape, no copy: micro-batch i is reshaped[i] (consecutive) or
        # reshaped[:, i] = x[i::n] (interleaved, local to sharded rows).
        xs = jax.tree.map(
            lambda x: jnp.reshape(x, split_shape(m) + np.shape(x)[1:]), batches
        )

        diff_args = tuple(args[i] for i in d_idx)
        acc0 = jax.tree.map(
            lambda p: sharding.grad_zeros(p, _acc_dtype(jnp.result_type(p))),
            diff_args,
        )
        state0 = jax.tree.map(_strong, tuple(args[i] for i in s_idx))

        def body(carry, i):
            acc, state = carry
            mb = jax.tree.map(
                lambda x: lax.dynamic_index_in_dim(
                    x, i, axis=split_axis, keepdims=False
                ),
                xs,
            )
            call = list(args)
            for k, x in zip(b_idx, mb, strict=True):
                call[k] = x
            for k, s in zip(s_idx, state, strict=True):
                call[k] = s
            loss, new_state, aux, grads = split_outputs(vg(*call))
            if not isinstance(argnums, tuple):
                grads = (grads,)
            if weight_fn is None:
                acc = jax.tree.map(
                    lambda a, g: a + g.astype(a.dtype), acc, grads
                )
                w = None
            else:
                w = jnp.asarray(
                    weight_fn(mb if isinstance(batch_argnums, tuple) else mb[0])
                )
                if w.ndim != 0:
                    raise ValueError(
                        "weight_fn must return a scalar, got an array of shape "
                        f"{w.shape}"
                    )
                w = w.astype(jnp.float32)
                _check_weight_varies_with_grads(w, grads)
                keep = w != 0

                def add(a, g):
                    wg = sharding.times(w.astype(a.dtype), g.astype(a.dtype))
                    return a + jnp.where(keep, wg, jnp.zeros_like(wg))

                acc = jax.tree.map(add, acc, grads)
            if has_state:
                if not isinstance(state_argnums, tuple):
                    new_state = (new_state,)
                new_state = _check_state(new_state, state)
            return (acc, new_state if has_state else state), (loss, w, aux)

        (acc, state), (losses, ws, auxs) = lax.scan(
            body, (acc0, state0), jnp.arange(n)
        )

        loss_acc = _acc_dtype(losses.dtype)
        if weight_fn is None:
            loss = jnp.mean(losses.astype(loss_acc))
            grads = jax.tree.map(
                lambda a: sharding.times(jnp.asarray(1 / n, a.dtype), a), acc
            )
        else:
            total = jnp.sum(ws)
            nonzero = total != 0
            scale = jnp.where(nonzero, 1 / jnp.where(nonzero, total, 1), 0)
            terms = ws.astype(loss_acc) * losses.astype(loss_acc)
            loss = jnp.sum(jnp.where(ws != 0, terms, 0)) * scale.astype(
                loss_acc
            )
            grads = jax.tree.map(
                lambda a: sharding.times(scale.astype(a.dtype), a), acc
            )
        loss = loss.astype(losses.dtype)
        grads = jax.tree.map(
            lambda g, p: g.astype(jnp.result_type(p)), grads, diff_args
        )
        if not isinstance(argnums, tuple):
            grads = grads[0]
        if has_state:
            state = state if isinstance(state_argnums, tuple) else state[0]
            aux = (state, auxs) if has_aux else state
            return (loss, aux), grads
        if has_aux:
            return (loss, auxs), grads
        return loss, grads

    return f


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
    batch_argnums: _Argnums = 1,
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
    batch_argnums: _Argnums = 1,
    candidates: Iterable[int] | None = None,
    **kwargs: Any,
) -> int:
    """The fewest micro-batches whose jitted step fits a memory budget.

    Tries the divisors of the batch size in increasing order (or the given
    ``candidates``) and returns the first ``num_microbatches`` whose step
    ``jax.jit(microbatched_value_and_grad(loss_fn, num_microbatches, ...))``
    needs at most ``memory_budget`` bytes, counting

    ``argument + output - alias + temp``

    bytes of ``jax.jit(step).lower(*args).compile().memory_analysis()``
    (what ``microbatched_step_memory`` returns). Nothing is run and nothing is
    allocated beyond the arguments given, which may be
    :class:`jax.ShapeDtypeStruct` s: each candidate is only compiled, on the
    backend (device) that would run it.

    Args:
      loss_fn: as for :func:`microbatched_value_and_grad`.
      *args: the step's positional arguments (pytrees of arrays or of
        :class:`jax.ShapeDtypeStruct`); bind anything else (a model object,
        a flag) into ``loss_fn`` with :func:`functools.partial`.
      memory_budget: the budget in bytes, a positive number.
      batch_argnums: as for :func:`microbatched_value_and_grad`.
      candidates: optional positive ints to try instead of all divisors of
        the batch size; each must divide it. Tried in increasing order.
      **kwargs: passed on to :func:`microbatched_value_and_grad`
        (``has_aux``, ``argnums``, ``weight_fn``, ``state_argnums``).

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
      >>> n = oa.plan_microbatches(loss_fn, w, x, memory_budget=2**40)
      >>> n   # a huge budget: no need to split
      1

    .. note::
      The count is for the gradient computation alone: leave room in the
      budget for what the rest of the training step holds (optimizer state,
      updated parameters). Compilation takes a while for big models; restrict
      ``candidates`` to try fewer.
    """
    budget = utils.check_real("memory_budget", memory_budget)
    if not (budget > 0 and math.isfinite(budget)):
        raise ValueError(
            f"memory_budget must be a positive, finite number of bytes, got "
            f"memory_budget={memory_budget!r}"
        )
    batch_argnums, batch_idx = _check_argnums("batch_argnums", batch_argnums)
    b_idx = _normalize(batch_idx, len(args), "batch_argnums")
    batches = tuple(args[i] for i in b_idx)
    batch_size = _batch_size(
        batches if isinstance(batch_argnums, tuple) else batches[0]
    )
    if candidates is None:
        tries = [d for d in range(1, batch_size + 1) if batch_size % d == 0]
    else:
        tries = sorted(
            {utils.check_positive_int("candidates", c) for c in candidates}
        )
        if not tries:
            raise ValueError("candidates must not be empty")
        for c in tries:
            _check_divisible(batch_size, c)
    measured = {}
    for c in tries:
        measured[c] = microbatched_step_memory(
            loss_fn,
            *args,
            num_microbatches=c,
            batch_argnums=batch_argnums,
            **kwargs,
        )
        if measured[c] <= budget:
            return c
    best = min(measured, key=measured.get)
    raise ValueError(
        f"no num_microbatches fits memory_budget={memory_budget!r} bytes: the "
        f"smallest footprint measured is {measured[best]} bytes "
        f"(num_microbatches={best}, {batch_size // best} example(s) per "
        f"micro-batch); tried {tries}"
    )
