r"""``oa.scale_by_window``: an update that follows the window it closes.

Placed after the optimizer in an :func:`optaxaccum.chain` (a follower of the
accumulate: it runs only where a window closes), it multiplies the window's
updates by a factor ``r`` of the window's total weight ``W`` and, for the
``"gain"`` rule, of the window's noise scale estimates: AdaScale's gain
ratio (Johnson et al., "AdaScale SGD", ICML 2020)

.. math:: r = \frac{\operatorname{tr}\Sigma / B_0 + |G|^2}
   {\operatorname{tr}\Sigma / W + |G|^2}.

Its state adds the factors up (``tau``, AdaScale's scale-invariant
iterations), at which an optax schedule is evaluated. The window's weight
reaches it as ``accum_weight`` (it declares the keyword by name), the
estimates as ``window_noise_scale``.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optaxaccum._src import base, checks, gating, keywords, windows

__all__ = ["ScaleByWindowState", "scale_by_window", "window_progress"]

RULES = ("gain", "linear", "sqrt")

NEEDS_WEIGHT_MSG = (
    "oa.scale_by_window got no window weight: place it after an "
    "oa.accumulate (after the optimizer) in an oa.chain, e.g. "
    "oa.chain(oa.accumulate(oa.every_weight(4096), noise_scale_decay=0.9), "
    "optax.sgd(0.1), oa.scale_by_window(256))"
)

UNWEIGHTED_MSG = (
    "oa.scale_by_window(base_weight={base!r}): the call passed no "
    "accum_weight, so each micro-batch weighs 1 and the window's weight W "
    "counts micro-batches; base_weight is then read as {base!r} "
    "micro-batches. If base_weight counts examples or tokens, pass each "
    "micro-batch's count as accum_weight (tx.update(..., accum_weight=n)); "
    "if it counts micro-batches, pass accum_weight=1 to say so"
)

NEEDS_NOISE_MSG = (
    'oa.scale_by_window(rule="gain") reads the window\'s noise scale: it '
    "needs noise_scale_decay on the oa.accumulate before it (e.g. "
    "oa.accumulate(k, noise_scale_decay=0.9)), or another rule "
    '("linear", "sqrt", a callable)'
)


class ScaleByWindowState(NamedTuple):
    """State of :func:`scale_by_window`.

    Attributes:
      tau: the sum of the factors of the windows closed so far (AdaScale's
        scale-invariant iterations: base-batch steps' worth of progress);
        ``shape=(), float32``.
      factor: the last window's factor ``r``; ``shape=(), float32`` (1
        before any window).
    """

    tau: jax.Array  # shape=(), float32
    factor: jax.Array  # shape=(), float32


def gain(weight: Any, noise: Any, base_weight: float) -> jax.Array:
    """AdaScale's gain ratio of a window of total ``weight`` from the
    estimates ``noise`` (an :class:`optaxaccum.NoiseScale`), clipped between
    1 and ``weight / base_weight``; 1 while the estimates are NaN."""
    w = jnp.asarray(weight, jnp.float32)
    trace_cov = jnp.asarray(noise.trace_cov, jnp.float32)
    grad_sq = jnp.asarray(noise.grad_sq, jnp.float32)
    ratio = (trace_cov / base_weight + grad_sq) / (trace_cov / w + grad_sq)
    linear = w / base_weight
    r = jnp.clip(ratio, jnp.minimum(1.0, linear), jnp.maximum(1.0, linear))
    return jnp.where(jnp.isnan(r), jnp.ones_like(r), r)


def _factor(rule: Any, weight: Any, noise: Any, base_weight: float):
    """The factor ``r`` of a window of total ``weight`` (float32)."""
    if rule == "gain":
        if noise is None:
            raise ValueError(NEEDS_NOISE_MSG)
        return gain(weight, noise, base_weight)
    w = jnp.asarray(weight, jnp.float32)
    if rule == "linear":
        return w / base_weight
    if rule == "sqrt":
        return jnp.sqrt(w / base_weight)
    return jnp.asarray(rule(weight, noise), jnp.float32)


def _check_rule(rule: Any) -> Any:
    if callable(rule) or (isinstance(rule, str) and rule in RULES):
        return rule
    raise ValueError(
        f'rule must be "gain", "linear", "sqrt" or a callable (W, '
        f"noise_scale) -> r, got rule={rule!r}"
    )


def scale_by_window(
    base_weight: float,
    *,
    rule: str | Callable[[jax.Array, Any], Any] = "gain",
    schedule: optax.Schedule | None = None,
) -> optax.GradientTransformationExtraArgs:
    """Scales a window's updates by a factor of its size (AdaScale).

    Place it after the optimizer in an :func:`chain` whose accumulate sets
    the windows: it runs only where a window closes, and multiplies that
    window's updates by ``r * schedule(tau)``, where ``W`` is the window's
    total weight (``accum_weight``, summed over the devices) and ``tau``
    the sum of ``r`` over the windows before. Rules: ``"gain"``, AdaScale's
    :math:`r = (\\operatorname{tr}(\\Sigma) / B_0 + |G|^2) /
    (\\operatorname{tr}(\\Sigma) / W + |G|^2)` (:math:`B_0` is
    ``base_weight``)
    from the accumulate's noise scale estimates (between 1 and ``W /
    base_weight``; 1 while they are NaN); ``"linear"``, ``W /
    base_weight``; ``"sqrt"``, its square root; or a callable ``(W,
    noise_scale) -> r`` (``noise_scale`` an :class:`NoiseScale`, ``None``
    without ``noise_scale_decay``). Meant for ``reduction="mean"``. ``W``
    and ``base_weight`` are in one unit: a call that passes no
    ``accum_weight`` weighs its micro-batch 1 (``W`` counts micro-batches)
    and, with a named rule, warns (pass ``accum_weight=1`` to mean it).

    Args:
      base_weight: the weight of the batch the learning rate was tuned for
        (in ``accum_weight``'s units), finite and > 0.
      rule: ``"gain"``, ``"linear"``, ``"sqrt"``, or a callable.
      schedule: ``tau -> multiplier`` (an optax schedule, written for the
        base batch's steps), or ``None``.

    Returns:
      An optax transformation with a :class:`ScaleByWindowState`.

    Raises:
      TypeError, ValueError: for a bad argument, naming it; at the first
        update, ``"gain"`` without ``noise_scale_decay`` on the accumulate,
        or no accumulate before it.

    Examples:
      >>> import jax.numpy as jnp, optax, optaxaccum as oa
      >>> tx = oa.chain(oa.accumulate(4), optax.sgd(1.0),
      ...               oa.scale_by_window(32, rule="linear"))
      >>> state = tx.init(jnp.zeros(1))
      >>> for _ in range(4):   # W = 4 * 16 examples: twice the base batch
      ...   u, state = tx.update(jnp.ones(1), state, accum_weight=16)
      >>> u, float(oa.window_progress(state))
      (Array([-2.], dtype=float32), 2.0)
    """
    number = checks.check_real("base_weight", base_weight)
    if not (math.isfinite(number) and number > 0):
        raise ValueError(
            f"base_weight must be finite and > 0, got {base_weight=!r}"
        )
    rule = _check_rule(rule)
    checks.check_callable("schedule", schedule, none_ok=True)

    def init_fn(params):
        del params
        return ScaleByWindowState(
            tau=jnp.zeros([], jnp.float32), factor=jnp.ones([], jnp.float32)
        )

    def update_fn(
        updates, state, params=None, *, accum_weight=None, **extra_args
    ):
        del params
        if accum_weight is None:
            raise ValueError(NEEDS_WEIGHT_MSG)
        noise = extra_args.get(base.WINDOW_NOISE_ARG)
        r = _factor(rule, accum_weight, noise, number)
        # Static (the call passed no accum_weight), for the rules that
        # divide W by base_weight.
        if extra_args.get(gating.UNWEIGHTED_ARG, False):
            warnings.warn(UNWEIGHTED_MSG.format(base=base_weight), stacklevel=2)
        scale = r if schedule is None else r * schedule(state.tau)
        updates = jax.tree.map(
            lambda u: (u * jnp.asarray(scale, u.dtype)).astype(u.dtype), updates
        )
        tau = state.tau + r
        return updates, ScaleByWindowState(tau=tau, factor=r)

    names = {"accum_weight", base.WINDOW_NOISE_ARG}
    if isinstance(rule, str):  # W / base_weight: both in the same unit
        names.add(gating.UNWEIGHTED_ARG)
    return optax.GradientTransformationExtraArgs(
        init_fn, keywords.with_signature(update_fn, names)
    )


def window_progress(opt_state: optax.OptState) -> jax.Array:
    """The progress ``tau`` of :func:`scale_by_window`: the sum of its
    factors over the closed windows.

    With ``rule="gain"`` this is AdaScale's count of scale-invariant
    iterations: how many base-batch steps' worth of progress the windows
    made. Plot the loss against it to compare runs with other windows.

    Args:
      opt_state: the state of a (nested) chain, a Flax ``TrainState``'s or
        nnx ``Optimizer``'s ``opt_state``; the first
        :class:`ScaleByWindowState` found is read.

    Returns:
      ``tau``, a float32 scalar.

    Raises:
      ValueError: if ``opt_state`` holds no :func:`scale_by_window`.

    Examples:
      >>> import jax.numpy as jnp, optax, optaxaccum as oa
      >>> tx = oa.chain(oa.accumulate(2), optax.sgd(1.0),
      ...               oa.scale_by_window(1.0, rule="sqrt"))
      >>> state = tx.init(jnp.zeros(1))
      >>> float(oa.window_progress(state))
      0.0
    """
    found = windows.find_state(
        opt_state, ScaleByWindowState, "oa.window_progress"
    )
    return jnp.asarray(found.tau)
