"""The gradient noise scale of McCandlish et al. (2018) from the window.

``oa.accumulate(k, noise_scale_decay=d)`` adds, on each micro-step, the
weighted squared norm :math:`w |g|^2` of the micro-batch gradient to a
running scalar (:func:`micro_step`); when the window closes, :func:`close`
turns it and the window's mean into unbiased estimates of
:math:`\\operatorname{tr}(\\Sigma)` and :math:`|G|^2` and folds them into
exponential moving averages. :func:`noise_scale` reads them;
:func:`critical_batch_every_k` sizes windows from them. The
derivation: docs/noise_scale.md.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optaxaccum._src import checks, flags, numerics, windows

__all__ = [
    "NoiseScale",
    "NoiseScaleState",
    "critical_batch_every_k",
    "noise_scale",
]

NOT_ON_MSG = (
    "found no oa.accumulate with noise_scale_decay set in the state given; "
    "turn the estimate on with oa.accumulate(k, noise_scale_decay=0.9)"
)


class NoiseScaleState(NamedTuple):
    """The noise-scale part of an :class:`optaxaccum.AccumulateState`.

    Attributes:
      sq_sum: this device's :math:`\\sum_i w_i |g_i|^2` over the window so
        far; ``shape=()``, the window weight's dtype. Stale when the window's
        ``mini_step`` is 0 (overwritten by the next micro-batch).
      micro_batches: this device's micro-batches of positive weight in the
        window (an integer held in the weight's dtype, so that it is reduced
        with ``sq_sum`` in one collective); stale like ``sq_sum``.
      trace_cov: exponential moving average of the windows'
        :math:`\\operatorname{tr}(\\Sigma)` estimates, not debiased;
        ``shape=()``, the weight's dtype.
      grad_sq: the same for :math:`|G|^2`.
      norm: the sum of the averages' weights, ``1 - decay**n`` after ``n``
        windows with ``k >= 2`` (0 before: the averages are then unset);
        dividing by it debiases them. ``shape=()``, the weight's dtype.
      gradient_scale: the factor the window's gradients come multiplied by
        (the scale of a loss scale after the accumulate, fixed inside a
        window; 1 without one), divided out of the estimates;
        ``shape=()``, float32. ``None`` in a state of an earlier version
        (1).
    """

    sq_sum: jax.Array  # shape=(), weight dtype
    micro_batches: jax.Array  # shape=(), weight dtype (an integer)
    trace_cov: jax.Array  # shape=(), weight dtype
    grad_sq: jax.Array  # shape=(), weight dtype
    norm: jax.Array  # shape=(), weight dtype
    gradient_scale: Any = None  # shape=(), float32; None: 1


class NoiseScale(NamedTuple):
    """What :func:`noise_scale` returns (float32 scalars).

    Attributes:
      b_simple: ``trace_cov / grad_sq``, the critical batch size estimate
        in units of ``accum_weight`` (examples or tokens); ``+inf`` when
        ``grad_sq <= 0``.
      trace_cov: the averaged estimate of the trace of the gradient
        covariance per unit of weight.
      grad_sq: the averaged estimate of the true gradient's squared norm.
    """

    b_simple: jax.Array
    trace_cov: jax.Array
    grad_sq: jax.Array


def check_decay(value: Any) -> float | None:
    """``noise_scale_decay``: ``None`` or a real in ``[0, 1)``."""
    if value is None:
        return None
    decay = checks.check_real("noise_scale_decay", value)
    if not 0.0 <= decay < 1.0:
        raise ValueError(
            f"noise_scale_decay must be None or in [0, 1), got {value=!r}"
        )
    return decay


def init(decay: float | None, dtype: Any, sums: Any) -> NoiseScaleState | None:
    """The initial state: ``None`` (no leaves) when the estimate is off.
    ``sq_sum`` starts as the window sums' reducer ``sums`` stores a zero
    (``reducer.py``; on a ``jit`` mesh, stacked, one entry per device)."""
    if decay is None:
        return None
    # One buffer per field: a state donated to jit may not alias a buffer.
    micro_batches, trace_cov, grad_sq, norm = (
        jnp.zeros([], dtype) for _ in range(4)
    )
    return NoiseScaleState(
        sums.sum_zeros(dtype),
        micro_batches,
        trace_cov,
        grad_sq,
        norm,
        gradient_scale=jnp.ones([], jnp.float32),
    )


def at_scale(state: NoiseScaleState | None, scale: Any) -> Any:
    """``state`` told that its gradients come multiplied by ``scale`` (a
    later loss scale's, passed to the accumulate as
    ``gating.LOSS_SCALE_ARG``; ``None``: 1). A scalar written on each call;
    read when the window closes."""
    if state is None:
        return None
    scale = 1.0 if scale is None else scale
    return state._replace(gradient_scale=jnp.asarray(scale, jnp.float32))


def micro_step(
    sums: Any,
    state: NoiseScaleState | None,
    grads: Any,
    acc: Any,
    w: jax.Array,
    fresh: Any,
    counted: Any,
) -> NoiseScaleState | None:
    """Adds one micro-batch's ``w |g|^2`` (leaves squared in the dtypes of
    the accumulator ``acc``) and whether ``w > 0`` to the window's sums,
    stored and loaded by their reducer ``sums`` (``reducer.py``).

    ``w`` is the checked weight (NaN if invalid), ``fresh`` whether the
    window's sums are stale, ``counted`` whether the call counts at all.
    Gradients left unreduced over ``n`` devices (``jit`` meshes) are ``n``
    small batches of weight ``w / n`` each.
    """
    if state is None:
        return None
    sq, sq_sum, n = sums.squared_norm(grads, acc, sums.load_sum(state.sq_sum))
    state = state._replace(sq_sum=sq_sum)
    sq = sq.astype(w.dtype)
    wsq = sums.scale(n * w, sq)
    # A weight-0 micro-batch adds nothing, even a 0/0 gradient.
    wsq = jnp.where(w == 0, jnp.zeros_like(wsq), wsq)
    positive = n * (w > 0).astype(w.dtype)
    new = state._replace(
        sq_sum=jnp.where(fresh, wsq, state.sq_sum + wsq),
        micro_batches=jnp.where(
            fresh, positive, state.micro_batches + positive
        ),
    )
    new = flags.select(counted, new, state)
    return new._replace(sq_sum=sums.store(new.sq_sum))


def map_window(state: NoiseScaleState | None, fn: Any) -> Any:
    """``state`` with ``fn`` applied to its per-device window sums (for
    :func:`optaxaccum.map_accumulators`)."""
    if state is None:
        return None
    return state._replace(
        sq_sum=fn(state.sq_sum), micro_batches=fn(state.micro_batches)
    )


def close(
    decay: float | None,
    sums: Any,
    state: NoiseScaleState | None,
    acc: Any,
    weight: jax.Array,
    reduction: str,
) -> NoiseScaleState | None:
    """Folds a closing window into the averages.

    ``acc`` and ``weight`` are the window's sum and weight after the
    window's reduction by the reducer ``sums`` (``reducer.py``); this
    device's ``sq_sum`` and ``micro_batches`` are reduced here by it, in
    the same closing branch (no collective on other micro-steps). Both
    estimates are quadratic in the gradients: divided by the square of the
    state's ``gradient_scale``, they are those of the unscaled gradients.
    Windows with fewer than two counted micro-batches, or whose estimates
    are not finite (an overflow, which a loss scale drops), change nothing.
    """
    if state is None or decay is None:
        return state
    state = state._replace(sq_sum=sums.load_sum(state.sq_sum))
    sq_sum, count = sums.reduce_sums(state.sq_sum, state.micro_batches)
    dtype = weight.dtype
    wsum_sq = optax.tree.norm(acc, squared=True).astype(dtype)
    devices = sums.sum_scale(reduction)
    if devices is not None:
        # the reduction averaged the device sums: undo it for |sum w g|^2
        wsum_sq = wsum_sq * jnp.asarray(devices, dtype) ** 2
    valid = count >= 2
    safe_w = jnp.where(valid, weight, jnp.ones_like(weight))
    safe_k = jnp.where(valid, count, 2 * jnp.ones_like(count))
    mean_sq = wsum_sq / safe_w**2  # C = |g_window|^2
    a = sq_sum / safe_w  # A = sum_i w_i |g_i|^2 / W
    trace_cov = safe_w * (a - mean_sq) / (safe_k - 1)
    grad_sq = (safe_k * mean_sq - a) / (safe_k - 1)
    if state.gradient_scale is not None:  # the gradients of loss * scale
        s = jnp.asarray(state.gradient_scale, dtype)
        trace_cov, grad_sq = trace_cov / s / s, grad_sq / s / s
    valid = valid & jnp.isfinite(trace_cov) & jnp.isfinite(grad_sq)
    keep = jnp.asarray(decay, dtype)

    def ema(old, new):
        return jnp.where(valid, keep * old + (1 - keep) * new, old)

    return state._replace(
        sq_sum=sums.store(state.sq_sum),
        trace_cov=ema(state.trace_cov, trace_cov),
        grad_sq=ema(state.grad_sq, grad_sq),
        norm=ema(state.norm, jnp.ones_like(state.norm)),
    )


def noise_scale(opt_state: optax.OptState) -> NoiseScale:
    """The gradient noise scale estimated by an accumulation window.

    Args:
      opt_state: the state of a (possibly nested) chain, a Flax
        ``TrainState.opt_state`` or an ``nnx.Optimizer.opt_state``; the first
        :func:`accumulate` with ``noise_scale_decay`` set is read.

    Returns:
      A :class:`NoiseScale` of float32 scalars: the debiased moving averages
      of :math:`\\operatorname{tr}(\\Sigma)` (per unit of ``accum_weight``)
      and :math:`|G|^2`, and ``b_simple``, their ratio. NaN until a window
      with at least two micro-batches of positive weight has closed.

    Raises:
      ValueError: naming ``noise_scale_decay`` if no accumulate in
        ``opt_state`` has it set.

    Examples:
      >>> import jax.numpy as jnp, optax, optaxaccum as oa
      >>> tx = oa.chain(oa.accumulate(2, noise_scale_decay=0.0), optax.sgd(1.0))
      >>> state = tx.init(jnp.zeros(2))
      >>> for g in ([1.0, 0.0], [3.0, 0.0]):   # mean (2, 0), spread 1 each
      ...   _, state = tx.update(jnp.array(g), state)
      >>> ns = oa.noise_scale(state)   # tr(Sigma) = 2, |G|^2 = 4 - 2 / 2
      >>> float(ns.b_simple), float(ns.trace_cov), float(ns.grad_sq)
      (0.6666666865348816, 2.0, 3.0)
    """
    try:
        found = windows.find_state(opt_state, NoiseScaleState, "oa.noise_scale")
    except ValueError:
        raise ValueError(f"oa.noise_scale {NOT_ON_MSG}") from None
    return estimates(found)


def estimates(state: NoiseScaleState) -> NoiseScale:
    """The debiased averages of ``state`` as a :class:`NoiseScale` of
    float32 scalars (NaN while unset): what :func:`noise_scale` returns, and
    what a closing window passes on to the followers that ask for it
    (:func:`optaxaccum.scale_by_window`)."""
    trace_cov, grad_sq, norm = (
        jnp.asarray(x) for x in (state.trace_cov, state.grad_sq, state.norm)
    )
    unset = norm == 0  # no window with k >= 2 yet
    norm = jnp.where(unset, jnp.nan, norm)
    return NoiseScale(
        b_simple(state).astype(jnp.float32),
        (trace_cov / norm).astype(jnp.float32),
        (grad_sq / norm).astype(jnp.float32),
    )


def b_simple(state: NoiseScaleState) -> jax.Array:
    """``EMA(trace_cov) / EMA(grad_sq)`` (the debiasing cancels): NaN while
    unset, ``+inf`` when ``EMA(grad_sq) <= 0``; in the weight's dtype."""
    trace_cov, grad_sq, norm = (
        jnp.asarray(x) for x in (state.trace_cov, state.grad_sq, state.norm)
    )
    ratio = numerics.divide_or(trace_cov, grad_sq, grad_sq > 0, jnp.inf)
    return jnp.where(norm == 0, jnp.nan, ratio)


class CriticalBatchEveryK(NamedTuple):
    """The ``every_k`` made by :func:`critical_batch_every_k` (static)."""

    min_k: int
    max_k: int
    micro_batch_weight: float
    fraction: float

    def window(self, state: NoiseScaleState | None) -> jax.Array:
        """The window length for the current estimate (an int32 scalar)."""
        if state is None:
            raise ValueError(NEEDS_DECAY_MSG)
        k = jnp.ceil(self.fraction * b_simple(state) / self.micro_batch_weight)
        k = jnp.clip(k, self.min_k, self.max_k)  # +inf gives max_k
        return jnp.where(jnp.isnan(k), self.min_k, k).astype(jnp.int32)


def check_can_grow(every_k: CriticalBatchEveryK, axis_name: Any) -> None:
    """Raises ``ValueError`` naming ``min_k`` for windows that could never
    grow: ``min_k=1`` on one device (no ``axis_name``), where a window of
    one micro-batch gives no estimate."""
    if every_k.min_k < 2 and axis_name is None:
        raise ValueError(
            "oa.critical_batch_every_k(min_k=1) on one device (no "
            "axis_name) would never grow its windows: the noise scale needs "
            "two micro-batches in a window, so a window of one gives no "
            "estimate and the next keeps min_k. Give min_k >= 2 (min_k=1 "
            "works with axis_name over several devices: each device's part "
            "of a micro-batch counts)."
        )


NEEDS_DECAY_MSG = (
    "oa.critical_batch_every_k sizes windows from the noise scale: it needs "
    "noise_scale_decay on the same oa.accumulate (e.g. "
    "oa.accumulate(oa.critical_batch_every_k(...), noise_scale_decay=0.9))"
)


def critical_batch_every_k(
    min_k: int,
    max_k: int,
    *,
    micro_batch_weight: float,
    fraction: float = 1.0,
) -> CriticalBatchEveryK:
    r"""An ``every_k`` that sizes each window from the noise scale.

    When a window opens its length is set to

    .. math:: k = \mathrm{clip}\left(\left\lceil \frac{f\, B_\mathrm{simple}}
       {w_\mathrm{micro}} \right\rceil, k_\min, k_\max\right),

    ``min_k`` while the estimate is NaN (no window with two micro-batches
    yet), ``max_k`` when it is ``+inf``; it stays fixed until the window
    closes. The learning rate is left alone: pair it with a schedule
    yourself (docs/noise_scale.md, "Windows sized by the noise scale").

    Args:
      min_k: the shortest window, an int >= 1; >= 2 on one device (no
        ``axis_name``), where a window of one micro-batch gives no estimate
        and the windows could never grow (:func:`accumulate` refuses it).
      max_k: the longest window, an int >= ``min_k``.
      micro_batch_weight: the weight (``accum_weight``: examples or tokens)
        of one micro-batch, summed over devices with ``axis_name``; > 0.
      fraction: the window's target weight as a fraction of ``b_simple``;
        finite and > 0.

    Returns:
      An ``every_k`` for :func:`accumulate` with ``noise_scale_decay`` set.

    Raises:
      TypeError, ValueError: for a bad argument, naming it.

    Examples:
      >>> import optax, optaxaccum as oa
      >>> tx = oa.chain(
      ...     oa.accumulate(oa.critical_batch_every_k(2, 64,
      ...                   micro_batch_weight=32), noise_scale_decay=0.9),
      ...     optax.sgd(0.1))
    """
    min_k = checks.check_positive_int("min_k", min_k)
    max_k = checks.check_positive_int("max_k", max_k)
    if max_k < min_k:
        raise ValueError(f"max_k must be >= min_k, got {max_k=}, {min_k=}")
    values = {"micro_batch_weight": micro_batch_weight, "fraction": fraction}
    for name, value in values.items():
        number = checks.check_real(name, value)
        if not (math.isfinite(number) and number > 0):
            raise ValueError(
                f"{name} must be finite and > 0, got {name}={value!r}"
            )
    return CriticalBatchEveryK(
        min_k, max_k, float(micro_batch_weight), float(fraction)
    )
