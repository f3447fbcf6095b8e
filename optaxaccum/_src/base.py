"""The gate protocol of :func:`optaxaccum.chain`: its types, nothing else.

A *gate* decides, on each call, whether the transformations after it in an
:func:`optaxaccum.chain` run. It is an ordinary
:class:`optax.GradientTransformationExtraArgs` with one more function,
``gate_update(updates, state, params, ctx, **extra_args) -> GateResult``
(and optionally ``gate_flush``); docs/gates.md shows how to write one.
The package exports these names (``optaxaccum.__all__``). A gate itself, a
:class:`~optaxaccum.GatedTransformation`, and what it decides inside the
package (the window bookkeeping) live in ``gating.py``; ``chain.py``
composes gates.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import optax


class GateContext(NamedTuple):
    """What the chain tells a gate about the call (frozen).

    A plain ``update`` call, :func:`apply_gradients` and the first gate of a
    chain get ``GateContext()``: an ordinary call that counts.

    Attributes:
      passed: a flag (a boolean scalar array, or the literal ``True``):
        whether the gates before this one let the call through. Where it is
        false the call must not count: return the state as it was and
        ``may_open`` false.
      window_weight: ``None`` for an ordinary call; else the total weight of
        the window that an earlier :func:`accumulate` just closed, which this
        call stands for (a gate that weighs calls uses it instead of
        ``accum_weight``).
    """

    passed: Any = True
    window_weight: Any = None


class Emitted(NamedTuple):
    """What a gate emits when it opens.

    Attributes:
      updates: the updates passed on to the followers.
      state: the gate's state when it opens.
    """

    updates: optax.Updates
    state: Any  # the gate's state (a pytree)


class GateResult(NamedTuple):
    """What a gate decided on one call.

    Attributes:
      state: the gate's state to keep when it stays closed (a pytree).
      may_open: a boolean scalar (a bool array or a Python bool): whether
        the gate opens (then ``emit`` is used).
      emit: a function of no arguments returning the :class:`Emitted`; the
        chain calls it only inside the branch taken where ``may_open`` is
        true, so work that matters only then (dividing by the window's
        weight, an all-reduce) belongs in it. A gate whose emission costs
        nothing (values it computed anyway) gives the :class:`Emitted`
        itself: an *eager* gate, which the chain merges with the next gate
        so that the fused step still branches once.
    """

    state: Any  # the gate's state (a pytree)
    may_open: Any
    emit: Callable[[], Emitted] | Emitted


# The keyword under which a plain follower gets the closing window's noise
# scale estimates (an oa.NoiseScale), if it declares it by name.
WINDOW_NOISE_ARG = "window_noise_scale"


class GateUpdateFn(Protocol):
    """``gate_update(updates, state, params, ctx, **extra_args)``: a gate's
    decision on one call (the arguments of ``update``, and the chain's
    :class:`GateContext`)."""

    def __call__(
        self,
        updates: optax.Updates,
        state: Any,
        params: optax.Params | None,
        ctx: GateContext,
        /,
        **extra_args: Any,
    ) -> GateResult: ...


class GateFlushFn(Protocol):
    """``gate_flush(state, params, **extra_args)``: closes a partial window
    now, without a new gradient (:func:`flush`)."""

    def __call__(
        self, state: Any, params: optax.Params, /, **extra_args: Any
    ) -> GateResult: ...
