"""Loss scaling for low-precision training: dynamic (a gate) and static."""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optaxaccum._src import base, checks, flags, numerics, reducer, windows
from optaxaccum._src.gating import GatedTransformation

__all__ = [
    "DynamicLossScaleState",
    "StaticLossScaleState",
    "dynamic_loss_scale",
    "loss_scale",
    "scaled_value_and_grad",
    "static_loss_scale",
]


class DynamicLossScaleState(NamedTuple):
    """State of :func:`dynamic_loss_scale`.

    Every field is an array leaf, so the whole configuration survives pytree
    flattening, ``jit``, ``pmap`` and checkpointing, and ``update`` reads the
    schedule from the state (not from the factory's arguments).

    Attributes:
      scale: the current loss scale; ``shape=(), float32``.
      counter: finite steps since the scale last changed, modulo ``period``
        (as in ``jmp.DynamicLossScale``); ``shape=(), int32``.
      period: finite steps after which the scale grows; ``shape=(), int32``.
      factor: the scale's growth and shrink factor; ``shape=(), float32``.
      min_scale: the scale never falls below it; ``shape=(), float32``.
    """

    scale: jax.Array  # shape=(), float32
    counter: jax.Array  # shape=(), int32
    period: jax.Array  # shape=(), int32
    factor: jax.Array  # shape=(), float32
    min_scale: jax.Array  # shape=(), float32

    # An accumulate before it gets scaled gradients (windows.py); no field.
    _scales_gradients = True


class StaticLossScaleState(NamedTuple):
    """State of :func:`static_loss_scale`.

    Attributes:
      scale: the constant loss scale; ``shape=(), float32``.
    """

    scale: jax.Array  # shape=(), float32

    _scales_gradients = True  # as DynamicLossScaleState's; no field


def _check_float32(name: str, value: Any, *, lower: float) -> np.float32:
    """``value`` as a float32 if it is real, finite (in float32) and
    ``> lower``."""
    x = checks.check_real(name, value)
    with np.errstate(over="ignore"):
        x32 = np.float32(x)
    if not (math.isfinite(x) and np.isfinite(x32)):
        raise ValueError(
            f"{name} must be finite (in float32), got {name}={value!r}"
        )
    if not x32 > lower:
        raise ValueError(f"{name} must be > {lower}, got {name}={value!r}")
    return x32


def _unscale(
    updates: optax.Updates, scale: jax.Array, sums: reducer.Reducer
) -> optax.Updates:
    """``updates / scale``, computed in (at least) float32, in each leaf's
    dtype, by the reducer ``sums`` of ``updates`` (:func:`reducer.of`)."""
    inv = 1 / scale.astype(jnp.float32)

    def one(g):
        g = jnp.asarray(g)
        if not jnp.issubdtype(g.dtype, jnp.inexact):
            return g
        wide = numerics.widen(g.dtype)
        return sums.scale(inv.astype(wide), g.astype(wide)).astype(g.dtype)

    return jax.tree.map(one, updates)


def _unscaled_all_finite(
    updates: optax.Updates,
    scale: jax.Array,
    sums: reducer.Reducer,
    peaks: list | None = None,
) -> jax.Array:
    """Whether ``_unscale(updates, scale, sums)`` is finite everywhere, decided
    from each leaf's largest magnitude (on XLA:CPU from ``peaks``, as
    :func:`numerics.peaks` gives them, where the gate before knows them: an
    accumulate's window):
    unscaling is monotonic in ``|g|`` and NaN propagates through the
    maximum. Reading only the incoming gradients, it lets XLA fuse the
    unscaling into its consumer (the accumulator update) instead of keeping
    the unscaled tree in a temporary buffer."""
    if peaks is None:
        peaks = numerics.peaks(updates)
    else:  # XLA:CPU keeps a mean with two readers in memory; XLA:TPU
        # copies an accumulator read here and zeroed in place: each its own
        window = peaks
        peaks = jax.lax.platform_dependent(
            cpu=lambda: window, default=lambda: numerics.peaks(updates)
        )
    if not peaks:
        return jnp.array(True)
    unscaled = jax.tree.leaves(_unscale(peaks, scale, sums))
    return numerics.all_true([jnp.isfinite(u) for u in unscaled])


def dynamic_loss_scale(
    init_scale: float = 2.0**15,
    *,
    period: int = 2000,
    factor: float = 2.0,
    min_scale: float = 1.0,
    axis_name: Hashable | None = None,
) -> GatedTransformation:
    r"""Dynamic loss scaling: unscales gradients and skips overflowing steps.

    The incoming gradients are those of ``loss * scale`` (see
    :func:`scaled_value_and_grad`); they are unscaled in float32. If all are
    finite they pass on, and after ``period`` finite steps in a row the
    scale grows by ``factor`` (kept if that overflows float32); otherwise
    the elements after it do not run (zeros are emitted, their states are
    untouched, an :func:`accumulate` does not count the micro-batch) and
    :math:`s \leftarrow \max(s_{\min}, s / f)`: jmp's schedule. A call
    with ``accum_weight=0`` (padding) carries no data: it passes on, the
    scale and counter stay. Before an :func:`accumulate` it checks each
    micro-batch; after it, ``oa.chain(oa.accumulate(k),
    oa.dynamic_loss_scale(), opt)``, once per window (the scale fixed in
    the window, a window with an overflow dropped, ``period`` in windows:
    PyTorch's ``GradScaler``), with no work on the micro-steps
    (docs/concepts.md, "Once per window, or per micro-batch").

    Args:
      init_scale: the initial loss scale, finite and ``> 0``.
      period: finite steps in a row before the scale grows; an int ``>= 1``.
      factor: growth and shrink factor, finite and ``> 1``.
      min_scale: lower bound of the scale, ``0 < min_scale <= init_scale``.
      axis_name: the device axis over which devices agree on finiteness
        (one device's overflow skips the step everywhere).

    Returns:
      A :class:`GatedTransformation` with a :class:`DynamicLossScaleState`.

    Raises:
      ValueError, TypeError: an argument outside the range its line above
        gives, or of the wrong type; the message names it and its value.

    Examples:
      >>> import jax.numpy as jnp, optax, optaxaccum as oa
      >>> tx = oa.chain(oa.dynamic_loss_scale(1024.0), optax.sgd(1.0))
      >>> state = tx.init(jnp.zeros(2))
      >>> u, state = tx.update(jnp.array([1.0, jnp.inf]), state)
      >>> u, oa.loss_scale(state)   # overflow: sgd not run, scale halved
      (Array([0., 0.], dtype=float32), Array(512., dtype=float32))

    References:
      Micikevicius et al., `Mixed Precision Training
      <https://arxiv.org/abs/1710.03740>`_, 2018.
    """
    init32 = _check_float32("init_scale", init_scale, lower=0.0)
    period = checks.check_positive_int("period", period)
    factor32 = _check_float32("factor", factor, lower=1.0)
    min32 = _check_float32("min_scale", min_scale, lower=0.0)
    if min32 > init32:
        raise ValueError(
            "min_scale must be <= init_scale, got "
            f"min_scale={min_scale!r} and init_scale={init_scale!r}"
        )
    checks.check_axis_name(axis_name)

    def init_fn(params):
        del params
        return DynamicLossScaleState(
            scale=jnp.asarray(init32, jnp.float32),
            counter=jnp.zeros([], jnp.int32),
            period=jnp.asarray(period, jnp.int32),
            factor=jnp.asarray(factor32, jnp.float32),
            min_scale=jnp.asarray(min32, jnp.float32),
        )

    def gate_update_fn(
        updates,
        state,
        params,
        ctx,
        *,
        accum_weight=1.0,
        window_peaks=None,
        **extra_args,
    ):
        del params, extra_args
        checks.check_state_type(
            state, DynamicLossScaleState, "oa.dynamic_loss_scale"
        )
        # The reducer of these gradients: the mesh mode (reducer.py).
        sums = reducer.of(axis_name, updates)
        sums.check_axes("oa.dynamic_loss_scale", updates)
        unscaled = _unscale(updates, state.scale, sums)
        finite = sums.finite(
            unscaled,
            lambda _: _unscaled_all_finite(
                updates, state.scale, sums, window_peaks
            ),
        )
        # A call of weight 0 carries no data: not an overflow.
        weight = (
            accum_weight if ctx.window_weight is None else ctx.window_weight
        )
        no_data = _carries_no_data(weight)
        if no_data is not False:
            finite = finite | no_data
        if axis_name is not None:
            finite = sums.agree(finite)
            if (
                no_data is not False
            ):  # the scale moves unless no device has data
                no_data = sums.agree(jnp.asarray(no_data))
        new_state = flags.select(no_data, state, _adjust(state, finite))
        # A call an earlier gate refused (ctx.passed false) leaves it as is.
        new_state = flags.select(ctx.passed, new_state, state)
        # Eager: the Emitted itself (the unscaled gradients cost nothing).
        emitted = base.Emitted(updates=unscaled, state=new_state)
        return base.GateResult(
            state=new_state,
            may_open=flags.both(ctx.passed, finite),
            emit=emitted,
        )

    windows.mark_scales_gradients(gate_update_fn)  # for an accumulate before
    return GatedTransformation(init_fn, gate_update_fn, None)


def _carries_no_data(accum_weight: Any) -> Any:
    """Whether a call of weight ``accum_weight`` carries no data (weight 0):
    a Python bool for a concrete weight (``False``: nothing to select), a
    boolean scalar array for a traced one."""
    checks.check_weight("accum_weight", accum_weight)
    known = numerics.concrete(accum_weight)
    if known is None:  # traced
        return jnp.asarray(accum_weight) == 0
    return bool(known == 0)


def _adjust(state: DynamicLossScaleState, finite: jax.Array):
    """The next state; the schedule of ``jmp.DynamicLossScale.adjust``."""
    grown = state.scale * state.factor
    grown = jnp.where(jnp.isfinite(grown), grown, state.scale)
    if_finite = jnp.where(state.counter == state.period - 1, grown, state.scale)
    if_not = jnp.maximum(state.min_scale, state.scale / state.factor)
    scale = jnp.where(finite, if_finite, if_not).astype(jnp.float32)
    counter = jnp.where(finite, (state.counter + 1) % state.period, 0)
    return state._replace(scale=scale, counter=counter.astype(jnp.int32))


def static_loss_scale(scale: float) -> optax.GradientTransformationExtraArgs:
    """Unscales gradients by a constant loss scale.

    The incoming gradients are those of ``loss * scale``; it emits
    ``grads / scale``, computed in float32 and cast back to each gradient's
    dtype. Non-finite gradients are passed on (use
    :func:`dynamic_loss_scale` to skip them).

    Args:
      scale: the loss scale, finite and ``> 0``.

    Returns:
      An :class:`optax.GradientTransformationExtraArgs` whose state is a
      :class:`StaticLossScaleState`.

    Raises:
      TypeError: if ``scale`` is not a real number.
      ValueError: if ``scale`` is not finite and positive.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> import optaxaccum as oa
      >>> tx = oa.chain(oa.static_loss_scale(128.0), optax.sgd(1.0))
      >>> state = tx.init(jnp.zeros(2))
      >>> tx.update(jnp.array([128.0, 64.0]), state)[0]
      Array([-1. , -0.5], dtype=float32)
      >>> oa.loss_scale(state)
      Array(128., dtype=float32)
    """
    scale32 = _check_float32("scale", scale, lower=0.0)

    def init_fn(params):
        del params
        return StaticLossScaleState(scale=jnp.asarray(scale32, jnp.float32))

    def update_fn(updates, state, params=None, **extra_args):
        del params, extra_args
        return _unscale(updates, state.scale, reducer.of(None, updates)), state

    windows.mark_scales_gradients(update_fn)  # for an accumulate before
    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


_SCALE_STATES = (DynamicLossScaleState, StaticLossScaleState)


def loss_scale(opt_state: optax.OptState) -> jax.Array:
    """The current loss scale held in an optimizer state.

    Args:
      opt_state: the state of a (possibly nested) chain. The first
        (outermost, leftmost) :class:`DynamicLossScaleState` or
        :class:`StaticLossScaleState` found in it is used.

    Returns:
      The scale as a float32 scalar array; ``1.0`` when ``opt_state`` holds
      no loss scale.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> import optaxaccum as oa
      >>> tx = optax.chain(optax.clip(1.0), oa.chain(
      ...     oa.dynamic_loss_scale(64.0), oa.accumulate(2), optax.sgd(0.1)))
      >>> oa.loss_scale(tx.init(jnp.zeros(3)))
      Array(64., dtype=float32)
      >>> oa.loss_scale(optax.sgd(0.1).init(jnp.zeros(3)))
      Array(1., dtype=float32)
    """
    try:
        found = windows.find_state(opt_state, _SCALE_STATES, "oa.loss_scale")
    except ValueError:  # no loss scale: the gradients are not scaled
        return jnp.ones([], jnp.float32)
    return jnp.asarray(found.scale).astype(jnp.float32)


def _scale_argument(value: Any) -> jax.Array:
    """The loss scale given to :func:`scaled_value_and_grad`: a positive
    finite scalar, or read from an optimizer state."""
    foreign = hasattr(value, "loss_scale")  # e.g. a jmp loss scale object
    if isinstance(value, (str, bytes)) or foreign:
        hint = " (pass its .loss_scale)" if foreign else ""
        raise TypeError(
            "opt_state_or_scale must be an optimizer state or a scalar loss "
            f"scale, got {value!r} of type {type(value).__name__}{hint}"
        )
    if isinstance(value, (int, float, np.number)):
        _check_float32("scale", value, lower=0.0)
        return jnp.asarray(value)
    if isinstance(value, (jax.Array, np.ndarray)):
        if jnp.ndim(value) != 0:
            raise ValueError(
                "opt_state_or_scale must be a scalar loss scale, got an array "
                f"of shape {jnp.shape(value)}"
            )
        known = numerics.concrete(value)
        if known is not None:  # a traced scale is checked by jit
            _check_float32("scale", float(known), lower=0.0)
        return jnp.asarray(value)
    return loss_scale(value)


def scaled_value_and_grad(
    fun: Callable[..., Any],
    opt_state_or_scale: optax.OptState | jax.typing.ArrayLike,
    *,
    has_aux: bool = False,
    argnums: int | Sequence[int] = 0,
) -> Callable[..., tuple[Any, Any]]:
    """Like :func:`jax.value_and_grad`, differentiating ``fun * scale``.

    Returns the *unscaled* loss (for logging) and the gradients of
    ``loss * scale`` (the product in float32 or wider), which a chain that
    starts with :func:`dynamic_loss_scale` or :func:`static_loss_scale`
    unscales. Do not log the scaled loss, nor feed the chain the gradients
    of the unscaled one (they would be divided by the scale twice).

    Args:
      fun: the loss function; returns a real scalar, or ``(loss, aux)``
        with ``has_aux=True``.
      opt_state_or_scale: the current optimizer state (the scale is read
        with :func:`loss_scale`; ``1.0`` if it holds none) or the scale
        itself, a real scalar.
      has_aux: whether ``fun`` returns ``(loss, aux)``.
      argnums: which positional argument(s) to differentiate.

    Returns:
      A function with ``fun``'s arguments returning ``(loss, grads)``, or
      ``((loss, aux), grads)`` with ``has_aux=True``.

    Raises:
      TypeError: for a bool, a string or another library's loss scale.
      ValueError: for a scale that is not finite and positive, or not a
        scalar.

    Examples:
      >>> import jax, jax.numpy as jnp, optax, optaxaccum as oa
      >>> tx = oa.chain(oa.dynamic_loss_scale(256.0), optax.sgd(0.1))
      >>> params = jnp.ones(2)
      >>> opt_state = tx.init(params)
      >>> loss_fn = lambda p, x: jnp.sum((p * x) ** 2)
      >>> loss, grads = oa.scaled_value_and_grad(loss_fn, opt_state)(
      ...     params, jnp.ones(2))
      >>> loss, grads   # unscaled loss, gradients of loss * 256
      (Array(2., dtype=float32), Array([512., 512.], dtype=float32))
    """
    scale = _scale_argument(opt_state_or_scale)

    def scaled_fun(*args, **kwargs):
        out = fun(*args, **kwargs)
        loss, aux = out if has_aux else (out, None)
        loss = jnp.asarray(loss)
        wide = numerics.widen(loss.dtype)
        return loss.astype(wide) * scale.astype(wide), (loss, aux)

    value_and_grad = jax.value_and_grad(
        scaled_fun, argnums=argnums, has_aux=True
    )

    def wrapped(*args, **kwargs):
        (_, (loss, aux)), grads = value_and_grad(*args, **kwargs)
        return ((loss, aux), grads) if has_aux else (loss, grads)

    return wrapped
