"""``oa.accumulate``: gradient accumulation as a gate of ``oa.chain``."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optaxaccum._src import base, sharding

__all__ = ["AccumulateState", "accumulate", "has_updated"]


class AccumulateState(NamedTuple):
    """State of :func:`accumulate`.

    Attributes:
      mini_step: position in the current window: the number of micro-batches
        accumulated in it so far; ``shape=(), int32``.
      gradient_step: windows closed so far; ``shape=(), int32``.
      acc: the window's running weighted sum of gradients, a pytree like the
        params in ``accumulator_dtype``. Reset lazily: when ``mini_step`` is
        0 its content is stale and the next micro-batch overwrites it.
      weight: the window's running sum of weights; ``shape=()``,
        ``accumulator_dtype`` or float32, whichever is wider (token counts
        overflow float16). Stale when ``mini_step`` is 0.
      updated: whether the most recent call that reached this transformation
        closed a window and stepped the followers; ``shape=(), bool``.
    """

    mini_step: jax.Array  # shape=(), int32
    gradient_step: jax.Array  # shape=(), int32
    acc: optax.Updates  # like params, accumulator_dtype
    weight: jax.Array  # shape=(), accumulator_dtype or float32 (the wider)
    updated: jax.Array  # shape=(), bool


def accumulate(
    every_k: int | Callable[[jax.Array], Any],
    *,
    reduction: str = "mean",
    accumulator_dtype: Any = jnp.float32,
    axis_name: Hashable | None = None,
    skip_nonfinite: bool = False,
) -> base.GatedTransformation:
    r"""Accumulates gradients over windows of ``every_k`` micro-batches.

    Each call adds ``accum_weight * grads`` to a running sum. The call that
    completes the window emits, with ``reduction="mean"``,

    .. math::
      \bar g = \frac{\sum_{i=1}^{k} w_i g_i}{\sum_{i=1}^{k} w_i}

    and with ``reduction="sum"`` the numerator alone. Inside an
    :func:`chain`, the elements after it run only on that call, so an
    optimizer after it steps (and advances its count and schedule) once per
    window; used alone or inside stock :func:`optax.chain` it emits zeros on
    the other calls.

    With per-call weights ``tx.update(grads, state, params, accum_weight=w)``
    equal to each micro-batch's example or token count, and ``grads`` the
    gradient of that micro-batch's *mean* loss, the window emits exactly the
    gradient of the mean loss over all examples (tokens) of the window,
    whatever the micro-batch sizes.

    Args:
      every_k: window length, a positive int, or a jit-traceable callable
        ``gradient_step -> int`` giving the length of each window. Its value
        is cast to int32 (so 2.7 means 2) and cannot be checked under
        ``jit``: a length below 1 closes the window on every call.
      reduction: ``"mean"`` (weighted mean) or ``"sum"`` (weighted sum).
      accumulator_dtype: floating dtype of the running sum (also for bf16 or
        fp16 gradients). Emitted updates are cast back to the gradients'
        dtypes.
      axis_name: inside ``pmap``/``shard_map``, the mapped axis over which the
        window's gradient is averaged, once, when the window closes. With
        ``"mean"`` the window emits ``psum(sum_i w_i g_i) / psum(sum_i w_i)``;
        with ``"sum"``, ``pmean(sum_i w_i g_i)``. Under ``jax.jit`` on an
        explicit mesh, the axis (or axes) over which gradients of
        :func:`unreduced_value_and_grad` are unreduced: they are reduced
        once, when the window closes (see ``docs/scaling.md``).
      skip_nonfinite: if true, a micro-batch gradient holding a NaN or Inf is
        dropped as if it had never been seen (window position, sums and
        weights unchanged); with ``axis_name`` all devices drop it together.
        If false, non-finite values are accumulated and emitted.

    Returns:
      A :class:`GatedTransformation` whose state is an
      :class:`AccumulateState`.

    Raises:
      TypeError: if ``every_k`` is neither an int nor a callable,
        ``accumulator_dtype`` is not a dtype, or ``skip_nonfinite`` is not a
        bool.
      ValueError: if ``every_k < 1``, ``reduction`` is unknown or
        ``accumulator_dtype`` is not floating.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> import optaxaccum as oa
      >>> tx = oa.chain(oa.accumulate(2), optax.sgd(1.0))
      >>> params = jnp.zeros(1)
      >>> state = tx.init(params)
      >>> _, state = tx.update(jnp.array([1.0]), state, params, accum_weight=3)
      >>> u, state = tx.update(jnp.array([5.0]), state, params, accum_weight=1)
      >>> u   # -(3 * 1 + 1 * 5) / (3 + 1)
      Array([-2.], dtype=float32)
      >>> bool(oa.has_updated(state))
      True

    .. note::
      A window whose total weight is 0 (summed over ``axis_name``) emits zeros
      and does not step the followers. Use :func:`flush` to close the last,
      partial window of an epoch.
    """
    if callable(every_k):
        window = every_k
    else:
        k = base.check_positive_int("every_k", every_k)
        window = lambda gradient_step: k  # noqa: E731
    if reduction not in ("mean", "sum"):
        raise ValueError(
            f'reduction must be "mean" or "sum", got reduction={reduction!r}'
        )
    acc_dtype = base.check_float_dtype("accumulator_dtype", accumulator_dtype)
    weight_dtype = jnp.promote_types(acc_dtype, jnp.float32)
    if not isinstance(skip_nonfinite, bool):
        raise TypeError(
            "skip_nonfinite must be a bool, got "
            f"skip_nonfinite={skip_nonfinite!r}"
        )
    if axis_name is not None and not isinstance(axis_name, Hashable):
        raise TypeError(f"axis_name must be hashable, got {axis_name=!r}")

    def init_fn(params):
        return AccumulateState(
            mini_step=jnp.zeros([], jnp.int32),
            gradient_step=jnp.zeros([], jnp.int32),
            acc=sharding.window_zeros(params, acc_dtype, axis_name),
            weight=jnp.zeros([], weight_dtype),
            updated=jnp.zeros([], bool),
        )

    def window_length(gradient_step):
        return jnp.asarray(window(gradient_step), jnp.int32)

    def emit_fn(state, out_dtypes, nonzero_weight=False):
        """Emits the window's result; called only when a window closes.

        ``nonzero_weight=True`` promises that the caller already checked the
        window's weight, so the emitted flag is the literal ``True`` and the
        chain needs no second branch on it.
        """

        def emit():
            acc, weight = state.acc, state.weight
            if axis_name is not None:
                acc, weight = sharding.reduce_window(
                    acc, weight, axis_name, reduction
                )
            opened = True if nonzero_weight else weight != 0
            if reduction == "mean":
                scale = jnp.where(opened, 1 / jnp.where(opened, weight, 1), 0)
                acc = optax.tree.scale(scale, acc)
            updates = jax.tree.map(lambda a, d: a.astype(d), acc, out_dtypes)
            # Same type (e.g. device-varying) as the flag of the closed branch.
            updated = jnp.zeros_like(state.updated) | opened
            return updates, state._replace(updated=updated), opened

        return emit

    def gate_update_fn(updates, state, params=None, *, accum_weight=1.0,
                       _gate_passed=True, **extra_args):
        del params, extra_args
        if not isinstance(state, AccumulateState):
            raise TypeError(
                "oa.accumulate expects an AccumulateState, got "
                f"{type(state).__name__}"
            )
        base.check_same_structure(
            "the gradients", updates, state.acc, "the accumulator (params)"
        )
        state = state._replace(acc=sharding.match_grads(state.acc, updates))
        if jnp.ndim(accum_weight) != 0:
            raise ValueError(
                "accum_weight must be a scalar, got an array of shape "
                f"{jnp.shape(accum_weight)}"
            )
        w = jnp.asarray(accum_weight).astype(weight_dtype)
        fresh = state.mini_step == 0

        def add(a, g):
            wg = sharding.times(w.astype(acc_dtype), g.astype(acc_dtype), a)
            return jnp.where(fresh, wg, a + wg)

        acc = jax.tree.map(add, state.acc, updates)
        weight = jnp.where(fresh, w, state.weight + w)
        mini_step = state.mini_step + 1
        # Whether this call counts: a gate before this one in the chain (a
        # loss scale) may have refused it (``_gate_passed``, passed by
        # oa.chain), and skip_nonfinite refuses non-finite gradients.
        counted = _gate_passed
        if skip_nonfinite:
            finite = sharding.all_finite(updates, axis_name)
            counted = base.both(counted, finite)
        if counted is not True:
            acc = optax.tree.where(counted, acc, state.acc)
            weight = jnp.where(counted, weight, state.weight)
            mini_step = jnp.where(counted, mini_step, state.mini_step)
        closing = base.both(
            counted, mini_step >= window_length(state.gradient_step)
        )
        new_state = AccumulateState(
            mini_step=jnp.where(closing, 0, mini_step).astype(jnp.int32),
            gradient_step=jnp.where(
                closing,
                optax.safe_increment(state.gradient_step),
                state.gradient_step,
            ),
            acc=acc,
            weight=weight,
            # A call that does not count leaves the state as it was.
            updated=base.select(
                counted, jnp.zeros_like(state.updated), state.updated
            ),
        )
        out_dtypes = jax.tree.map(lambda g: jnp.asarray(g).dtype, updates)
        if axis_name is None:
            # The weight is local: decide on it here so the chain branches once.
            return base.GateResult(
                new_state,
                closing & (weight != 0),
                emit_fn(new_state, out_dtypes, nonzero_weight=True),
            )
        return base.GateResult(
            new_state, closing, emit_fn(new_state, out_dtypes)
        )

    def gate_flush_fn(state, params, **extra_args):
        del extra_args
        base.check_same_structure(
            "the params", params, state.acc, "the accumulator"
        )
        nonempty = state.mini_step > 0
        closed_state = state._replace(
            mini_step=jnp.zeros([], jnp.int32),
            gradient_step=optax.safe_increment(state.gradient_step),
        )
        out_dtypes = jax.tree.map(lambda p: jnp.asarray(p).dtype, params)
        return base.GateResult(
            state, nonempty, emit_fn(closed_state, out_dtypes)
        )

    return base.GatedTransformation(
        init_fn, gate_update_fn, gate_flush_fn, takes_gate_passed=True
    )


def has_updated(state: optax.OptState) -> jax.Array:
    """Whether the last call that reached the accumulation closed a window.

    Args:
      state: the state of an :func:`accumulate`, or of any (nested) chain
        containing one (the first one found is used).

    Returns:
      A boolean scalar array: true if the most recent call that reached the
      :func:`accumulate` closed a window and stepped the elements after it.

    Raises:
      ValueError: if ``state`` holds no :class:`AccumulateState`.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> import optaxaccum as oa
      >>> tx = oa.chain(oa.accumulate(2), optax.sgd(1.0))
      >>> state = tx.init(jnp.zeros(1))
      >>> _, state = tx.update(jnp.ones(1), state)
      >>> bool(oa.has_updated(state))
      False
    """
    return find_state(state, AccumulateState, "oa.has_updated").updated


def find_state(state: Any, cls: type, caller: str) -> Any:
    """The first (outermost, leftmost) instance of ``cls`` inside ``state``."""
    found = [
        s
        for s in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, cls))
        if isinstance(s, cls)
    ]
    if not found:
        raise ValueError(
            f"{caller} found no {cls.__name__} in the state given "
            f"({jax.tree.structure(state)})"
        )
    return found[0]
