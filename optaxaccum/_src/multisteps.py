"""``oa.MultiSteps``: a drop-in for ``optax.MultiSteps`` built on the gates.

It is an adapter, not a second implementation: the work is done by
``oa.chain(skip_gate, oa.accumulate(k), opt)``, where ``skip_gate`` is an
eager gate that asks ``should_skip_update_fn`` (absent when there is none).
The adapter only renames the chain's state to optax's field names and lends
the skip gate the window count (``gradient_step``) its function expects.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optaxaccum._src import accumulate as _accumulate
from optaxaccum._src import (
    base,
    checks,
    every_weight,
    flags,
    gating,
    keywords,
    windows,
)
from optaxaccum._src import chain as _chain

__all__ = ["MultiSteps", "MultiStepsState"]


class MultiStepsState(NamedTuple):
    """State of :class:`MultiSteps`: optax's fields, in optax's order, then
    two of :func:`accumulate`'s.

    Attributes:
      mini_step: micro-batches accumulated in the current window;
        ``shape=(), int32``.
      gradient_step: windows closed so far; ``shape=(), int32``.
      inner_opt_state: the state of the wrapped optimizer.
      acc_grads: the window's running weighted *sum* of gradients, like the
        params in ``accumulator_dtype`` (optax keeps a running mean); zero
        between windows.
      skip_state: what ``should_skip_update_fn`` returned last (``()``
        without one).
      acc_weight: the window's running sum of ``accum_weight`` (its
        micro-batch count by default); ``shape=()``, float32 (or the wider
        ``accumulator_dtype``); 0 between windows.
      updated: whether the most recent call closed a window and stepped
        the inner optimizer (false on a refused one); ``shape=(), bool``.
      acc_weight_low: what rounding left out of ``acc_weight`` (a
        compensated sum, as :class:`AccumulateState`'s ``weight_low``);
        ``shape=()``; ``None`` in a state built without it (a plain sum).
    """

    mini_step: jax.Array  # shape=(), int32
    gradient_step: jax.Array  # shape=(), int32
    inner_opt_state: Any
    acc_grads: Any  # like params, accumulator_dtype
    skip_state: Any = ()
    acc_weight: jax.Array | None = None  # shape=(), float32 or wider
    updated: jax.Array | None = None  # shape=(), bool
    acc_weight_low: jax.Array | None = None  # shape=(), acc_weight's dtype

    _holds_window = True  # found by oa.has_updated (windows.py); no field
    # Zeroed in place where a window closes (flags.ordered_after); no field
    _param_sums = ("acc_grads",)


def _upgraded(state: MultiStepsState) -> MultiStepsState:
    """A state of an earlier version (no ``acc_weight_low``) as this
    version keeps it (as :class:`AccumulateState`'s)."""
    acc = windows.upgraded(_Views(False).inner(state)[0])
    return state._replace(
        acc_grads=acc.acc, acc_weight=acc.weight, acc_weight_low=acc.weight_low
    )


# A chain converts one before it branches (it may be a chain's follower).
windows.EARLIER_LAYOUTS[MultiStepsState] = (
    lambda s: s.acc_weight_low is None and s.acc_weight is not None,
    _upgraded,
)


class _SkipGateState(NamedTuple):
    """State of the skip gate inside the chain."""

    skip_state: Any
    gradient_step: jax.Array  # lent by the adapter on each call; not stored


def _skip_gate(should_skip_update_fn: Callable) -> gating.GatedTransformation:
    """An eager gate: ``should_skip_update_fn`` refuses a micro-batch, which
    then does not reach (is not counted by) the accumulation after it."""

    def ask(updates, gradient_step, params):
        should_skip, skip_state = should_skip_update_fn(
            updates, gradient_step, params
        )
        should_skip = jnp.asarray(should_skip)
        if (should_skip.dtype, should_skip.shape) != (jnp.bool_, ()):
            raise ValueError(
                "The `should_skip_update_fn` function should return a boolean "
                "scalar array, but it returned an array of dtype "
                f"{should_skip.dtype} and shape {should_skip.shape}"
            )
        return should_skip, skip_state

    def init_fn(params):
        gradient_step = jnp.zeros([], jnp.int32)
        zeros = optax.tree.zeros_like(params)
        return _SkipGateState(
            ask(zeros, gradient_step, params)[1], gradient_step
        )

    def gate_update_fn(updates, state, params, ctx, **extra_args):
        del extra_args
        should_skip, skip_state = ask(updates, state.gradient_step, params)
        # A call refused by a gate before this one leaves it as it was.
        skip_state = flags.select(ctx.passed, skip_state, state.skip_state)
        new = state._replace(skip_state=skip_state)
        opens = flags.both(ctx.passed, jnp.logical_not(should_skip))
        # Eager: it emits the updates it was given (nothing to compute).
        emitted = base.Emitted(updates=updates, state=new)
        return base.GateResult(state=new, may_open=opens, emit=emitted)

    return gating.GatedTransformation(init_fn, gate_update_fn)


class MultiSteps(gating.GatedTransformation):
    """A drop-in for :class:`optax.MultiSteps` whose optimizer runs once per
    window.

    Same constructor, methods (``init``, ``update``, ``has_updated``,
    ``gradient_transformation``, ``inner_opt``) and state field names as
    ``optax.MultiSteps``, and the same updates: zeros on the micro-steps
    inside a window, the wrapped optimizer's update of the window's mean
    (``use_grad_mean=True``) or sum on the micro-step that closes it; a
    micro-batch that ``should_skip_update_fn`` refuses is as if never seen.
    Unlike optax's, the wrapped optimizer is not computed on the other
    micro-steps (a ``lax.cond``), its state is left untouched there, and it
    is an :func:`accumulate` in an :func:`chain` underneath: the fused
    :func:`apply_gradients`, :func:`flush` and ``accum_weight`` work on it,
    and it is itself a gate (an :class:`optax.GradientTransformationExtraArgs`
    that also goes into ``optax.chain`` or ``oa.chain`` as is).

    Args:
      opt: the wrapped optax optimizer.
      every_k_schedule: micro-steps per window: a positive int, a
        jit-traceable function ``gradient_step -> int``, or a weight budget
        (:func:`every_weight`).
      use_grad_mean: average the window's gradients (else sum them).
      should_skip_update_fn: ``(updates, gradient_step, params) ->
        (should_skip, skip_state)``, e.g. :func:`optax.skip_not_finite`.
      accumulator_dtype: floating (or complex) dtype of the running sum,
        fifth positional as in optax; ``None``: each parameter's dtype, at
        least float32 (optax: the parameter's dtype). Complex gradients
        accumulate in the complex dtype of its precision.

    Raises:
      TypeError: for an argument of the wrong type.
      ValueError: for an out-of-range ``every_k_schedule`` or a non-floating
        ``accumulator_dtype``.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> import optaxaccum as oa
      >>> ms = oa.MultiSteps(optax.sgd(1.0), every_k_schedule=2)
      >>> params = jnp.zeros(1)
      >>> state = ms.init(params)
      >>> _, state = ms.update(jnp.array([1.0]), state, params)
      >>> updates, state = ms.update(jnp.array([3.0]), state, params)
      >>> updates, bool(ms.has_updated(state)), int(state.gradient_step)
      (Array([-2.], dtype=float32), True, 1)
    """

    _opt: optax.GradientTransformationExtraArgs
    _config: tuple[Any, ...]

    def __new__(
        cls,
        opt: optax.GradientTransformation,
        every_k_schedule: int
        | Callable[[jax.Array], Any]
        | every_weight.EveryWeight,
        use_grad_mean: bool = True,
        should_skip_update_fn: Callable | None = None,
        accumulator_dtype: Any = jnp.float32,
    ):
        _check_args(opt, every_k_schedule, use_grad_mean, should_skip_update_fn)
        acc = _accumulate.accumulate(
            every_k_schedule,
            reduction="mean" if use_grad_mean else "sum",
            accumulator_dtype=accumulator_dtype,
        )
        skip = should_skip_update_fn is not None
        gates = (_skip_gate(should_skip_update_fn),) if skip else ()
        inner = _chain.chain(*gates, acc, opt)
        assert gating.is_gate(inner)  # it holds an accumulate
        views = _Views(skip)

        def init_fn(params: optax.Params) -> Any:
            return views.outer(inner.init(params))

        def gate_update_fn(updates, state, params, ctx, **extra_args):
            res = inner.gate_update(
                updates, views.inner(state), params, ctx, **extra_args
            )
            return views.result(res)

        def gate_flush_fn(state, params, **extra_args):
            assert inner.gate_flush is not None  # oa.chain with accumulate
            res = inner.gate_flush(views.inner(state), params, **extra_args)
            return views.result(res)

        # Declares the keywords the chain takes (accum_weight, the
        # optimizer's), so that an outer chain can spot near-misses.
        declared = keywords.declared_extra_args(inner)
        self = super().__new__(
            cls,
            init_fn,
            keywords.with_signature(gate_update_fn, declared, gate=True),
            cast(base.GateFlushFn, gate_flush_fn),
        )
        self._opt = optax.with_extra_args_support(opt)
        self._config = (
            opt,
            every_k_schedule,
            use_grad_mean,
            should_skip_update_fn,
            accumulator_dtype
            if accumulator_dtype is None
            else jnp.dtype(accumulator_dtype),
        )
        return self

    def __getnewargs_ex__(self):
        # copy/deepcopy rebuild through __new__ with these arguments.
        *args, dtype = self._config
        return tuple(args), {"accumulator_dtype": dtype}

    @property
    def inner_opt(self) -> optax.GradientTransformationExtraArgs:
        """The wrapped optimizer (with extra-argument support), as optax's."""
        return self._opt

    def has_updated(
        self, state: MultiStepsState | optax.MultiStepsState
    ) -> jax.Array:
        """Whether the last call stepped the optimizer (closed a window): a
        boolean scalar array, as ``optax.MultiSteps``'s, except on a call
        that ``should_skip_update_fn`` refused right after a closing one:
        false (optax's rule reads the counters and says true)."""
        # optax's rule for states without the flag (e.g. optax's own).
        return windows.window_updated(state)

    def gradient_transformation(self) -> optax.GradientTransformationExtraArgs:
        """Itself: it already is an optax (and gated) transformation."""
        return self

    def from_optax_state(self, state: Any) -> MultiStepsState:
        """Converts an ``optax.MultiStepsState`` (e.g. a restored checkpoint
        of ``optax.MultiSteps``) into this wrapper's state.

        Args:
          state: an ``optax.MultiStepsState`` of ``optax.MultiSteps`` built
            with the same optimizer, ``use_grad_mean`` and skip function.

        Returns:
          The equivalent :class:`MultiStepsState`; updating it continues the
          window where optax's state left it.
        """
        n = jnp.asarray(state.mini_step, jnp.int32)
        # The dtypes of this wrapper's state for params like optax's sums.
        like = jax.eval_shape(self.init, state.acc_grads)
        mean = self._config[2]

        def acc_leaf(a, want):
            a = jnp.asarray(a)
            if mean:  # optax keeps the running mean, this wrapper the sum
                a = a * n.astype(a.dtype)
            return a.astype(want.dtype)

        acc = jax.tree.map(acc_leaf, state.acc_grads, like.acc_grads)
        gradient_step = jnp.asarray(state.gradient_step, jnp.int32)
        return MultiStepsState(
            mini_step=n,
            gradient_step=gradient_step,
            inner_opt_state=state.inner_opt_state,
            acc_grads=acc,
            skip_state=state.skip_state,
            acc_weight=n.astype(like.acc_weight.dtype),
            updated=jnp.logical_and(n == 0, gradient_step > 0),
            acc_weight_low=jnp.zeros_like(like.acc_weight),
        )


class _Views:
    """Converts between :class:`MultiStepsState` and the state of the chain
    ``(skip gate state,)? AccumulateState, inner state``."""

    def __init__(self, skip: bool):
        self.skip = skip

    def inner(self, state):
        checks.check_state_type(
            state,
            MultiStepsState,
            "oa.MultiSteps",
            "oa.MultiStepsState",
            hint=" (convert an optax.MultiStepsState with ms.from_optax_state)",
        )
        if state.acc_weight is None or state.updated is None:
            raise ValueError(
                "This oa.MultiStepsState has no acc_weight/updated: build it "
                "with ms.init(params), or convert optax's state with "
                "ms.from_optax_state(state)"
            )
        acc = _accumulate.AccumulateState(
            mini_step=state.mini_step,
            gradient_step=state.gradient_step,
            acc=state.acc_grads,
            weight=state.acc_weight,
            updated=state.updated,
            weight_low=state.acc_weight_low,
        )
        if not self.skip:
            return (acc, state.inner_opt_state)
        skip = _SkipGateState(state.skip_state, state.gradient_step)
        return (skip, acc, state.inner_opt_state)

    def outer(self, chain_state) -> MultiStepsState:
        if self.skip:
            skip, acc, inner = chain_state
            skip_state = skip.skip_state
        else:
            (acc, inner), skip_state = chain_state, ()
        return MultiStepsState(
            mini_step=acc.mini_step,
            gradient_step=acc.gradient_step,
            inner_opt_state=inner,
            acc_grads=acc.acc,
            skip_state=skip_state,
            acc_weight=acc.weight,
            updated=acc.updated,
            acc_weight_low=acc.weight_low,
        )

    def result(self, res: Any) -> gating.Decision:
        res = gating.Decision.of(res)  # an oa.chain's: with its window

        def outer(out: gating.Emission) -> gating.Emission:
            return out._replace(state=self.outer(out.state))

        return res.then(outer)._replace(state=self.outer(res.state))


def _check_args(opt, every_k_schedule, use_grad_mean, should_skip_update_fn):
    if not isinstance(opt, optax.GradientTransformation):
        raise TypeError(
            "opt must be an optax GradientTransformation, got "
            f"opt={opt!r} of type {type(opt).__name__}"
        )
    budget = isinstance(every_k_schedule, every_weight.EveryWeight)
    if not (callable(every_k_schedule) or budget):
        checks.check_positive_int("every_k_schedule", every_k_schedule)
    if not isinstance(use_grad_mean, (bool, np.bool_)):
        raise TypeError(
            f"use_grad_mean must be a bool, got use_grad_mean={use_grad_mean!r}"
        )
    checks.check_callable(
        "should_skip_update_fn", should_skip_update_fn, none_ok=True
    )


def _flatten(ms: MultiSteps):
    return (ms.init, ms.update), ms._config


def _unflatten(config, children) -> MultiSteps:
    del children  # init and update are rebuilt from the configuration
    *args, dtype = config
    return MultiSteps(*args, accumulator_dtype=dtype)


# As a NamedTuple subclass it would otherwise be rebuilt by jax.tree functions
# as MultiSteps(init, update) (see gating.GatedTransformation).
jax.tree_util.register_pytree_node(MultiSteps, _flatten, _unflatten)
