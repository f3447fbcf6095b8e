"""``oa.accumulate``: gradient accumulation as a gate of ``oa.chain``."""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optaxaccum._src import (
    base,
    checks,
    every_weight,
    flags,
    gating,
    noise_scale,
    numerics,
    reducer,
    windows,
)
from optaxaccum._src import shard_update as _shard_update
from optaxaccum._src.gating import GatedTransformation

__all__ = ["AccumulateState", "accumulate", "map_accumulators"]

_NEEDS_WEIGHT_MSG = (
    "oa.accumulate(..., summed_gradients=True) adds each call's gradient as "
    "the sum over its micro-batch: pass the micro-batch's count (examples "
    "or tokens) as accum_weight=..., got no accum_weight. A wrapper that "
    "does not forward extra keywords to tx.update drops it: "
    "flax.training.train_state.TrainState.apply_gradients(grads=..., "
    "accum_weight=n) does; use optaxaccum.flax.TrainState (or "
    "oa.apply_gradients(tx, grads, opt_state, params, accum_weight=n))"
)


class AccumulateState(NamedTuple):
    """State of :func:`accumulate`.

    Attributes:
      mini_step: position in the current window: the number of micro-batches
        accumulated in it so far; ``shape=(), int32``.
      gradient_step: windows closed so far; ``shape=(), int32``.
      acc: the window's running weighted sum of gradients, a pytree like the
        params in ``accumulator_dtype``; zero between windows (zeroed in
        place when a window closes or is flushed). Under
        ``jax.jit`` on a mesh whose ``axis_name`` axes are Explicit, each
        leaf has a leading axis of their size, sharded over them: row ``i``
        is device ``i``'s partial sum (an ordinary, checkpointable array;
        docs/scaling.md).
      weight: the window's running sum of weights; ``shape=()``, the real
        dtype of the widest accumulator leaf, at least float32 (token counts
        overflow float16); 0 between windows.
      updated: whether the most recent call that reached this transformation
        closed a window and stepped the followers (false on a call it
        dropped, that an earlier gate refused, or whose window a later gate
        dropped); ``shape=(), bool``.
      noise_scale: the gradient noise scale's sums and averages
        (``noise_scale_decay``); ``None`` (no leaves) when off.
      weight_low: what rounding left out of ``weight`` (a compensated sum:
        ``weight + weight_low`` is the window's weight, integer counts exact
        up to about ``2**48``; under ``pmap``/``shard_map`` each device's);
        ``shape=()``, ``weight``'s dtype. ``None`` in a state of an earlier
        version, which its first update or flush converts.
      optimizer_step: how many times the followers stepped: the closed
        windows that were not dropped (:func:`optimizer_step`);
        ``shape=(), int32``. ``None`` in a state of an earlier version, which
        its first update or flush converts (to ``gradient_step``).
    """

    mini_step: jax.Array  # shape=(), int32
    gradient_step: jax.Array  # shape=(), int32
    acc: optax.Updates  # like params, accumulator dtype (see accumulate)
    weight: jax.Array  # shape=(), widest accumulator precision, >= float32
    updated: jax.Array  # shape=(), bool
    noise_scale: Any = None  # noise_scale.NoiseScaleState, or None (off)
    weight_low: Any = None  # shape=(), weight's dtype; None: a plain sum
    optimizer_step: Any = None  # shape=(), int32; None: an earlier version

    _holds_window = True  # found by oa.has_updated (windows.py); no field
    # Zeroed in place where a window closes (flags.ordered_after); no field
    _param_sums = ("acc",)


class _Config(NamedTuple):
    """The static configuration of one :func:`accumulate`."""

    # (state, mini_step, (weight, low), sums) -> whether the window closes,
    # given its position and weight with the call counted (_window_fn).
    closes: Callable[..., Any]
    reduction: str
    accumulator_dtype: np.dtype | None  # None: at least float32 and the leaf's
    axis_name: Hashable | None
    skip_nonfinite: bool
    noise_scale_decay: float | None
    shard_update: bool = False
    summed_gradients: bool = False


def accumulate(
    every_k: int
    | Callable[[jax.Array], Any]
    | noise_scale.CriticalBatchEveryK
    | every_weight.EveryWeight,
    *,
    reduction: str = "mean",
    accumulator_dtype: Any = None,
    axis_name: Hashable | None = None,
    skip_nonfinite: bool = False,
    noise_scale_decay: float | None = None,
    shard_update: bool = False,
    summed_gradients: bool = False,
) -> GatedTransformation:
    r"""Accumulates gradients over windows of ``every_k`` micro-batches.

    Each call adds ``w * grads`` (``update(..., accum_weight=w)``, default
    1) to a running sum; the call that completes the window emits the
    weighted mean :math:`\sum_i w_i g_i / \sum_i w_i` (or the sum), and in
    :func:`chain` only then do the elements after it run (docs/concepts.md).

    Args:
      every_k: window length, a positive int, or a jit-traceable callable
        ``gradient_step -> int`` (cast to int32; a length below 1 closes the
        window on every call), or :func:`critical_batch_every_k`.
      reduction: ``"mean"`` (weighted mean) or ``"sum"`` (weighted sum).
      accumulator_dtype: the precision of the running sum (float or
        complex, matched to each leaf's kind); default float32, or the
        leaf's dtype if wider. Updates come in the gradients' dtypes.
      axis_name: the device axis (or axes) over which the window is
        reduced once, when it closes: the mapped axis of ``pmap`` /
        ``shard_map``, or the mesh axes over which
        :func:`unreduced_value_and_grad` left the gradients unreduced under
        ``jax.jit`` (docs/scaling.md).
      skip_nonfinite: drop a micro-batch whose weighted gradient holds a
        NaN/Inf as if never seen (all devices agree under ``axis_name``).
      noise_scale_decay: ``None`` (off: no state, no work), or a decay in
        ``[0, 1)``: the gradient noise scale estimate, averaged over windows
        with it (:func:`noise_scale`, docs/noise_scale.md).
      shard_update: reduce-scatter the window over ``axis_name`` (``jit``,
        explicit mesh), the followers' state sharded over it (ZeRO-1).
      summed_gradients: each gradient is a *sum* over its micro-batch (the
        loss summed) and ``accum_weight`` (required) its count; added as it
        is, the form XLA:GPU folds into the GEMM (docs/gpu.md).

    Returns:
      A :class:`GatedTransformation` with an :class:`AccumulateState`;
      a bad argument raises ``TypeError``/``ValueError`` naming it.

    Examples:
      >>> import jax.numpy as jnp, optax, optaxaccum as oa
      >>> tx = oa.chain(oa.accumulate(2), optax.sgd(1.0))
      >>> state = tx.init(jnp.zeros(1))
      >>> _, state = tx.update(jnp.array([1.0]), state, accum_weight=3)
      >>> u, state = tx.update(jnp.array([5.0]), state, accum_weight=1)
      >>> u   # -(3 * 1 + 1 * 5) / (3 + 1)
      Array([-2.], dtype=float32)
    """
    decay = noise_scale.check_decay(noise_scale_decay)
    closes = _window_fn(every_k, decay)
    if isinstance(every_k, noise_scale.CriticalBatchEveryK):
        noise_scale.check_can_grow(every_k, axis_name)
    if reduction not in ("mean", "sum"):
        raise ValueError(
            f'reduction must be "mean" or "sum", got reduction={reduction!r}'
        )
    cfg = _Config(
        closes,
        reduction,
        None
        if accumulator_dtype is None
        else checks.check_float_dtype(
            "accumulator_dtype", accumulator_dtype, complex_ok=True
        ),
        checks.check_axis_name(axis_name),
        checks.check_bool("skip_nonfinite", skip_nonfinite),
        decay,
        _check_shard_update(shard_update, axis_name),
        checks.check_bool("summed_gradients", summed_gradients),
    )
    # Its results carry the window bookkeeping (gating.Decision), which the
    # chain reads; to anyone else they are GateResults.
    gate = GatedTransformation(
        functools.partial(_init, cfg),
        cast(base.GateUpdateFn, functools.partial(_gate_update, cfg)),
        cast(base.GateFlushFn, functools.partial(_gate_flush, cfg)),
    )
    return _shard_update.gathered(gate, axis_name) if shard_update else gate


def _check_shard_update(shard_update: Any, axis_name: Any) -> bool:
    """``shard_update`` if it is a bool, and ``True`` only with an
    ``axis_name``."""
    checks.check_bool("shard_update", shard_update)
    if shard_update and axis_name is None:
        raise ValueError(
            "shard_update=True shards the window's reduction over the data "
            "axes: it needs axis_name (e.g. axis_name='data'), got "
            f"{axis_name=}"
        )
    return shard_update


def _window_fn(every_k: Any, decay: float | None) -> Callable[..., Any]:
    """``every_k`` as ``closes(state, mini_step, weight, sums)``: whether
    the window closes with the call counted (position ``mini_step``, total
    ``weight`` on this device as ``(weight, low)``, ``sums`` the window
    sums' reducer), decided
    from the state before the call."""
    if isinstance(every_k, every_weight.EveryWeight):
        # The global weight: one scalar psum under pmap/shard_map, nothing
        # where it is global already (jit meshes, one device).
        return lambda state, mini_step, weight, sums: every_k.closes(
            mini_step, *sums.global_weight(weight)
        )
    if isinstance(every_k, noise_scale.CriticalBatchEveryK):
        if decay is None:
            raise ValueError(noise_scale.NEEDS_DECAY_MSG)
        length = lambda state: every_k.window(state.noise_scale)  # noqa: E731
    elif callable(every_k):
        length = lambda state: every_k(state.gradient_step)  # noqa: E731
    else:
        k = checks.check_positive_int("every_k", every_k)
        length = lambda state: k  # noqa: E731
    return lambda state, mini_step, weight, sums: (
        mini_step >= jnp.asarray(length(state), jnp.int32)
    )


def _leaf_dtype(cfg: _Config, leaf: Any) -> np.dtype:
    """The accumulator dtype of a param leaf."""
    dtype = jnp.result_type(leaf)
    if cfg.accumulator_dtype is None:  # at least float32 and the leaf's own
        return numerics.widen(dtype)
    # The accumulator_dtype gives the precision; complex stays complex, real
    # stays real.
    if jnp.issubdtype(dtype, jnp.complexfloating):
        return numerics.widen(jnp.complex64, cfg.accumulator_dtype)
    return jnp.finfo(cfg.accumulator_dtype).dtype


def _weight_dtype(cfg: _Config, params: Any) -> np.dtype:
    """The real dtype of the widest accumulator leaf, at least float32 (token
    counts overflow float16): the window's weight and its division are done
    in it, so a float64 accumulator gives a float64-exact mean."""
    dtypes = [_leaf_dtype(cfg, p) for p in jax.tree.leaves(params)]
    if cfg.accumulator_dtype is not None:
        dtypes.append(cfg.accumulator_dtype)
    return functools.reduce(
        lambda wide, d: numerics.widen(jnp.finfo(d).dtype, wide),
        dtypes,
        jnp.dtype(jnp.float32),
    )


def _init(cfg: _Config, params: optax.Params) -> AccumulateState:
    params = _gradient_params(params)
    sums = reducer.at_init(cfg.axis_name, cfg.shard_update)
    return AccumulateState(
        mini_step=jnp.zeros([], jnp.int32),
        gradient_step=jnp.zeros([], jnp.int32),
        acc=sums.zeros(
            jax.tree.map(
                lambda p: jnp.zeros_like(p, _leaf_dtype(cfg, p)), params
            )
        ),
        weight=jnp.zeros([], _weight_dtype(cfg, params)),
        updated=jnp.zeros([], bool),
        noise_scale=noise_scale.init(
            cfg.noise_scale_decay, _weight_dtype(cfg, params), sums
        ),
        weight_low=jnp.zeros([], _weight_dtype(cfg, params)),
        optimizer_step=jnp.zeros([], jnp.int32),
    )


def _gate_update(
    cfg: _Config,
    updates: optax.Updates,
    state: AccumulateState,
    params: optax.Params | None,
    ctx: base.GateContext,
    *,
    accum_weight: Any = None,
    window_loss_scale: Any = None,
    **extra_args: Any,
) -> gating.Decision:
    """Adds one micro-batch (of weight ``ctx.window_weight``, an earlier
    window's total, if given); decides whether the window closes. A loss
    scale after it in the chain tells it its scale (``window_loss_scale``:
    the gradients come multiplied by it)."""
    del params, extra_args  # the caller checks extra args (near-misses)
    state, sums = _checked_input(cfg, updates, state)
    if state.optimizer_step is None or state.noise_scale is not None:
        state = _prepared(state, window_loss_scale)
    accum_weight, summed = _call_weight(cfg, ctx, accum_weight)
    acc, (weight, low), noise, counted = _add(
        cfg, sums, state, updates, accum_weight, ctx.passed, summed
    )
    mini_step = flags.select(counted, state.mini_step + 1, state.mini_step)
    closes = cfg.closes(state, mini_step, (weight, low), sums)
    closing = flags.both(counted, closes)
    new_state = state._replace(  # its optimizer_step as it was
        mini_step=jnp.where(closing, 0, mini_step).astype(jnp.int32),
        gradient_step=jnp.where(
            closing,
            optax.safe_increment(state.gradient_step),
            state.gradient_step,
        ),
        # Each device's partial sums as the state keeps them (on a jit
        # mesh: an ordinary, checkpointable array).
        acc=sums.store(acc),
        weight=weight,
        weight_low=low,
        # Not stepped (a closing window's emit says otherwise), also where
        # the call was dropped: the flag answers for the last call.
        updated=jnp.zeros_like(state.updated),
        noise_scale=noise,
    )
    # A local weight (no axis, not summed) is decided on here so the chain
    # branches once. A window of weight 0 is ``empty``: a later gate counts
    # it (its accumulator is still zero: weight-0 calls add nothing). Summed
    # gradients are added as they are, so such a window's emit runs: it
    # zeroes the accumulator.
    checked = cfg.axis_name is None and not cfg.summed_gradients
    out_dtypes = jax.tree.map(jnp.result_type, updates)
    may_open, empty = closing, False
    if checked:
        may_open, empty = closing & (weight != 0), closing & (weight == 0)
    peaks = window_loss_scale is not None  # a loss scale checks the window
    return gating.Decision(
        state=new_state,
        may_open=may_open,
        emit=_emitter(cfg, sums, new_state, out_dtypes, checked, peaks),
        empty=empty,
        branches=True,
        followers_branch=cfg.shard_update,
    )


def _call_weight(
    cfg: _Config, ctx: base.GateContext, accum_weight: Any
) -> tuple[Any, bool]:
    """The call's checked weight, and whether its gradient is a sum: an
    earlier window's total reaches a nested accumulate with that window's
    mean (or sum), weighed as usual whatever this one's form."""
    summed = cfg.summed_gradients and ctx.window_weight is None
    if ctx.window_weight is not None:
        accum_weight = ctx.window_weight
    elif accum_weight is None:
        if summed:
            raise ValueError(_NEEDS_WEIGHT_MSG)
        accum_weight = 1.0
    checks.check_weight("accum_weight", accum_weight)
    return accum_weight, summed


def _checked_input(
    cfg: _Config, updates: optax.Updates, state: Any
) -> tuple[AccumulateState, reducer.Reducer]:
    """``state`` with its accumulator as the step adds to it (loaded,
    typed like ``updates``), and the reducer of the window sums in this
    trace (``reducer.of`` the stored accumulator), after checking both: the
    state's type, the mesh mistakes, ``shard_update``'s mesh, the
    gradients' structure."""
    checks.check_state_type(state, AccumulateState, "oa.accumulate")
    if state.weight_low is None:  # a state of an earlier version
        state = _upgraded(state)
    # The stored accumulator decides, as for a flush (the gradients where
    # it has no leaf): eager gradients off the mesh still add to its rows.
    sums = reducer.of(cfg.axis_name, (state.acc, updates), cfg.shard_update)
    sums.check_gradients(updates)  # mesh mistakes
    if cfg.shard_update:
        _shard_update.check_explicit(updates, cfg.axis_name)
    acc = sums.load(state.acc)
    _check_gradients(updates, acc)
    return state._replace(acc=sums.match(acc, updates)), sums


def _add(
    cfg: _Config,
    sums: reducer.Reducer,
    state: AccumulateState,
    updates: optax.Updates,
    weight: Any,
    passed: Any,
    summed: bool,
) -> tuple[optax.Updates, tuple[jax.Array, jax.Array], Any, Any]:
    """The accumulator, total weight and noise-scale sums with this
    micro-batch, and whether it counted (a flag): not where an earlier gate
    refused it (``passed``) or ``skip_nonfinite`` drops it, and then all
    stay as they were.

    The accumulator is zero at a window's start, so a counted call adds to
    it and nothing else: ``acc + g`` for a weight known now to be 1 or for
    ``summed`` gradients, ``acc + w * g`` otherwise (XLA can make the add
    the epilogue of the GEMM that computes ``g``: docs/gpu.md). A weight
    that is negative or not finite (traced: it could not be checked) makes
    the micro-batch non-finite; weight 0 contributes nothing, even a
    non-finite gradient (a fully padded micro-batch), except to ``summed``
    gradients, which are added as they are.
    """
    w, valid, weightless = _weight(weight, state.weight.dtype)
    counted = passed
    if cfg.skip_nonfinite:
        exempt = False if summed else weightless
        finite = flags.both(valid, flags.either(exempt, sums.finite(updates)))
        counted = flags.both(counted, sums.agree(finite))

    def add(a, g):
        g = jnp.asarray(g).astype(a.dtype)
        if weightless is True and not summed:
            return a  # a weight of 0 known now: nothing to add
        if summed or (isinstance(w, float) and w == 1.0):
            return a + sums.scale(None, g, a)
        wg = sums.scale(jnp.asarray(w, a.dtype), g, a)
        if weightless is not False:  # traced: 0 * NaN must add nothing
            wg = jnp.where(weightless, jnp.zeros_like(wg), wg)
        return a + wg

    acc = jax.tree.map(add, state.acc, updates)
    acc = flags.select(counted, acc, state.acc)
    total = _add_weight(state.weight, state.weight_low, w)
    noise = state.noise_scale  # None: the estimate is off (no work)
    if noise is not None:
        noise = noise_scale.micro_step(
            sums,
            noise,
            _per_unit(sums, updates, w) if summed else updates,
            state.acc,
            jnp.asarray(w, state.weight.dtype),
            state.mini_step == 0,
            counted,
        )
        # The add written over the accumulator after the estimate's read
        # of it (flags.ordered_after).
        acc = flags.ordered_after_scalars(acc, noise)
    total = flags.select(counted, total, (state.weight, state.weight_low))
    return acc, total, noise, counted


def _add_weight(
    hi: jax.Array, low: jax.Array, w: Any
) -> tuple[jax.Array, jax.Array]:
    """``hi + w`` with what its rounding drops added to ``low`` (Knuth's
    error-free two-sum). A window of integer token counts then keeps its
    exact total far beyond ``2**24`` in float32."""
    total = hi + w
    w = jnp.asarray(w, hi.dtype)
    back = total - hi
    return total, low + ((hi - (total - back)) + (w - back))


def _weight(weight: Any, dtype: Any) -> tuple[Any, Any, Any]:
    """A checked ``accum_weight`` as ``(w, valid, weightless)``: for a
    weight known now (a Python or NumPy number, a concrete array), a Python
    float and the literals ``True`` and ``w == 0``, so that no select is
    built for it; for a traced one, an array of ``dtype`` (NaN where it is
    negative or not finite) and two boolean scalars."""
    known = numerics.concrete(weight)
    if known is not None:  # checked by checks.check_weight: finite, >= 0
        w = float(known)
        return w, True, w == 0
    w = jnp.asarray(weight).astype(dtype)
    valid = jnp.isfinite(w) & (w >= 0)
    w = jnp.where(valid, w, jnp.nan)
    return w, valid, w == 0


def _per_unit(sums: reducer.Reducer, updates: Any, w: Any) -> Any:
    """Summed gradients divided by their weight ``w`` (0 where it is 0):
    the per-micro-batch means the noise scale squares."""
    inv = numerics.divide_or(1, jnp.asarray(w))
    return jax.tree.map(lambda g: sums.scale(inv.astype(g.dtype), g), updates)


def zeroed(tree: Any) -> Any:
    """Zeros computed from ``tree``'s own values,
    ``where(isfinite(a), a * 0, 0)`` (NaN-safe): written where a closing
    window's work reads the accumulator, XLA reuses its buffer in place,
    and the branch of a call that does not close passes the donated buffer
    through without a copy (``zeros_like`` would make XLA:GPU copy it on
    every such call)."""
    finite = jax.tree.map(jnp.isfinite, tree)
    zeros = optax.tree.zeros_like(tree)
    return jax.tree.map(jnp.where, finite, optax.tree.scale(0, tree), zeros)


def _emitter(
    cfg: _Config,
    sums: reducer.Reducer,
    state: AccumulateState,
    out_dtypes: Any,
    weight_checked: bool = False,
    peaks: bool = False,
) -> Callable[[], gating.Emission]:
    """The ``emit`` of a closing window; ``weight_checked`` promises that the
    caller already checked the window's weight is not 0 (then ``opened`` is
    the literal ``True`` and the chain needs no second branch on it), or
    said that the window is ``empty``: the chain then does not call
    ``emit``, and passes the window on to a later gate as one call of
    weight 0, from the closed state. With ``peaks`` (a loss scale after
    the accumulate checks the window) it also gives the updates' peaks,
    read from the sums (:func:`numerics.peaks`)."""

    def emit():
        # Over the devices, once per window (reducer.py).
        # The window's weight so far: weight, plus what rounding left out.
        weight = state.weight + state.weight_low
        acc, weight = sums.reduce(state.acc, weight, cfg.reduction)
        noise = state.noise_scale  # None: the estimate is off (no work)
        if cfg.noise_scale_decay is not None:
            noise = noise_scale.close(
                cfg.noise_scale_decay, sums, noise, acc, weight, cfg.reduction
            )
        opened = True if weight_checked else weight != 0
        # The mean's factor (0 for a flushed window of weight 0), applied in
        # each leaf's own precision (the weight's is the widest).
        scale = numerics.divide_or(1, weight) if cfg.reduction == "mean" else 1
        updates = jax.tree.map(
            lambda a, d: (jnp.asarray(scale, a.dtype) * a).astype(d),
            acc,
            out_dtypes,
        )
        # Same type (e.g. device-varying) as the flag of the closed branch.
        updated = flags.flag_like(opened, state.updated)
        # Followers (a nested accumulate) weigh this window by its total
        # weight; a window sum adds up with weight 1.
        follower_weight = (
            weight
            if cfg.reduction == "mean"
            else (weight != 0).astype(weight.dtype)
        )
        return gating.Emission(
            updates=updates,
            # The next window starts from zero (in place: see zeroed).
            state=state._replace(
                acc=zeroed(state.acc),
                weight=jnp.zeros_like(state.weight),
                weight_low=jax.tree.map(jnp.zeros_like, state.weight_low),
                updated=updated,
                noise_scale=noise,
                # Counted where the followers step (a later gate that
                # drops the window takes it back: windows.refused).
                optimizer_step=jnp.where(
                    updated,
                    optax.safe_increment(state.optimizer_step),
                    state.optimizer_step,
                ),
            ),
            opened=opened,
            window_weight=follower_weight,
            noise=None if noise is None else noise_scale.estimates(noise),
            # Those of the updates, from the sums (read where they lie).
            peaks=numerics.peaks(acc, scale, out_dtypes) if peaks else None,
        )

    return emit


def _gate_flush(
    cfg: _Config, state: AccumulateState, params: optax.Params, **extra_args
) -> gating.Decision:
    """Closes the current window now, if it holds any micro-batch."""
    del extra_args  # the caller checks extra args (near-misses)
    params = _gradient_params(params)
    if state.weight_low is None:  # a state of an earlier version
        state = _upgraded(state)
    if state.optimizer_step is None:  # a state of an earlier version
        state = _with_count(state)
    sums = reducer.of(cfg.axis_name, state.acc, cfg.shard_update)
    sums.check_axes("oa.flush", state.acc)
    checks.check_same_structure(
        "the params", params, sums.load(state.acc), "the accumulator"
    )
    closed_state = state._replace(
        mini_step=jnp.zeros([], jnp.int32),
        gradient_step=optax.safe_increment(state.gradient_step),
    )
    out_dtypes = jax.tree.map(jnp.result_type, params)
    return gating.Decision(
        state=state,
        may_open=state.mini_step > 0,
        emit=_emitter(cfg, sums, closed_state, out_dtypes),
        followers_branch=cfg.shard_update,
    )


def _with_count(state: AccumulateState) -> AccumulateState:
    """A state of an earlier version (no ``optimizer_step``) with one: its
    windows closed so far, the best it can tell."""
    count = jnp.asarray(state.gradient_step, jnp.int32)
    return state._replace(optimizer_step=count)


def _prepared(state: AccumulateState, scale: Any) -> AccumulateState:
    """``state`` with an ``optimizer_step`` (:func:`_with_count`), its
    noise scale told the loss scale of this call's gradients (``scale``, or
    ``None``: unscaled)."""
    if state.optimizer_step is None:
        state = _with_count(state)
    if state.noise_scale is None:
        return state
    return state._replace(
        noise_scale=noise_scale.at_scale(state.noise_scale, scale)
    )


def _upgraded(state: AccumulateState) -> AccumulateState:
    """A state of an earlier version (no ``weight_low``) as this version
    keeps it: there the accumulator and weight still held the last
    window's sums while ``mini_step`` was 0 (they were reset lazily); here
    they are zero between windows."""
    fresh = state.mini_step == 0

    def zero(a):
        return jnp.where(fresh, jnp.zeros_like(a), a)

    return state._replace(
        acc=jax.tree.map(zero, state.acc),
        weight=zero(state.weight),
        weight_low=jnp.zeros_like(state.weight),
    )


def _is_earlier(state: AccumulateState) -> bool:
    """Whether ``state`` lacks a field of this version (``weight_low``,
    ``optimizer_step``, its noise scale's ``gradient_scale``)."""
    noise = state.noise_scale
    unscaled = noise is not None and noise.gradient_scale is None
    return state.weight_low is None or state.optimizer_step is None or unscaled


def _layout(state: AccumulateState) -> AccumulateState:
    """``state`` with every field of this version (:func:`_is_earlier`)."""
    if state.weight_low is None:
        state = _upgraded(state)
    if state.optimizer_step is None:
        state = _with_count(state)
    noise = state.noise_scale
    if noise is not None and noise.gradient_scale is None:
        state = state._replace(noise_scale=noise_scale.at_scale(noise, None))
    return state


windows.EARLIER_LAYOUTS[AccumulateState] = (_is_earlier, _layout)


def _gradient_params(params: Any) -> Any:
    """The params the gradients are taken of: the fast ones of
    :class:`optax.LookaheadParams` (``optax.lookahead`` after an accumulate
    gets ``(fast, slow)`` params and gradients of the fast ones)."""
    return params.fast if isinstance(params, optax.LookaheadParams) else params


def _check_gradients(updates: Any, acc: Any) -> None:
    """Raises if the gradients do not fit the accumulator, naming the leaf."""
    checks.check_same_structure(
        "the gradients", updates, acc, "the accumulator (params)"
    )
    paths = jax.tree_util.tree_flatten_with_path(updates)[0]
    for (path, g), a in zip(paths, jax.tree.leaves(acc)):
        dtype = jnp.result_type(g)
        where = f"gradient leaf at {jax.tree_util.keystr(path)}"
        if dtype == jax.dtypes.float0:
            raise TypeError(
                f"{where} has dtype float0 (jax.grad(allow_int=True) of an "
                "integer param): filter integer leaves out before the "
                "accumulation (e.g. optax.masked, eqx.filter)"
            )
        if jnp.issubdtype(dtype, jnp.complexfloating) and not (
            jnp.issubdtype(a.dtype, jnp.complexfloating)
        ):
            raise TypeError(
                f"{where} is complex ({dtype}) but its param is real "
                f"({a.dtype}): the accumulator would drop the imaginary part"
            )


def map_accumulators(state: Any, fn: Callable[[Any], Any]) -> Any:
    """Applies ``fn`` to the leaves of ``state`` that differ by device.

    Inside ``pmap``/``shard_map`` with ``oa.accumulate(k, axis_name=...)``,
    each device's accumulator (``acc``, ``weight`` and ``weight_low`` of every
    :class:`optaxaccum.AccumulateState`, and the window sums of its
    ``noise_scale``) holds its own running sum; every
    other leaf is the same on all devices. With ``shard_map`` store those
    leaves with a leading device axis: ``fn`` adds it (outside:
    ``lambda a: jnp.broadcast_to(a, (n, *a.shape))``; specs:
    ``lambda _: P("data")``) or takes it away (inside: ``lambda a: a[0]``,
    back with ``lambda a: a[None]``).

    Args:
      state: an optimizer state (or a tree of specs like it).
      fn: applied to each per-device leaf.

    Returns:
      ``state`` with ``fn`` applied to its per-device leaves.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> import optaxaccum as oa
      >>> tx = oa.chain(oa.accumulate(2, axis_name="d"), optax.sgd(0.1))
      >>> state = tx.init(jnp.zeros(3))
      >>> stacked = oa.map_accumulators(
      ...     state, lambda a: jnp.broadcast_to(a, (4, *a.shape)))
      >>> stacked[0].acc.shape, stacked[0].mini_step.shape
      ((4, 3), ())
    """

    def fix(s):
        if isinstance(s, AccumulateState):
            return s._replace(
                acc=jax.tree.map(fn, s.acc),
                weight=fn(s.weight),
                weight_low=jax.tree.map(fn, s.weight_low),
                noise_scale=noise_scale.map_window(s.noise_scale, fn),
            )
        return s

    return jax.tree.map(
        fix, state, is_leaf=lambda s: isinstance(s, AccumulateState)
    )
