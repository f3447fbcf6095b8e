"""The gate protocol of :func:`optaxaccum.chain`: its types, nothing else.

A *gate* decides, on each call, whether the transformations after it in an
:func:`optaxaccum.chain` run. It is an ordinary
:class:`optax.GradientTransformationExtraArgs` with one more function,
``gate_update(updates, state, params, ctx, **extra_args) -> GateResult``
(and optionally ``gate_flush``); docs/gates.md shows how to write one. The
chain's machinery (conditionals, zeros, followers) lives in ``chain.py``.
The package exports the protocol's public names (``optaxaccum.__all__``);
``as_update``, ``emitted`` and ``map_emit`` serve the gates of ``_src``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol, TypeGuard

import jax
import optax

from optaxaccum._src import utils


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


class _Emission(NamedTuple):
    """An :class:`Emitted` with the window bookkeeping that only
    :func:`optaxaccum.accumulate` and the chain exchange (private)."""

    updates: optax.Updates
    state: Any
    # Whether the followers run after all (a decision that needs the
    # emit's work, e.g. a weight summed across devices); where false the
    # chain emits zeros and the followers' states stay.
    opened: Any = True
    # The total weight of the window this call closed, or None: the
    # followers get it as accum_weight, a later gate as ctx.window_weight.
    window_weight: Any = None
    # Whether the call got through every gate inside this one (a chain):
    # a later gate gets it as ctx.passed.
    passed: Any = True
    # The noise scale estimates (a NoiseScale) of the accumulate that
    # closed the window, or None (off): the plain followers that declare
    # WINDOW_NOISE_ARG by name get it (oa.scale_by_window).
    noise: Any = None


# The keyword under which a plain follower gets the closing window's noise
# scale estimates (an oa.NoiseScale), if it declares it by name.
WINDOW_NOISE_ARG = "window_noise_scale"


class _Result(NamedTuple):
    """A :class:`GateResult` with the window bookkeeping that only
    :func:`optaxaccum.accumulate` and the chain exchange (private): its
    ``emit`` gives an :class:`_Emission`."""

    state: Any
    may_open: Any
    emit: Any  # () -> _Emission, or the _Emission itself (eager)
    # The call closed a window of weight 0 (may_open is false): the
    # followers do not step, but a later gate counts it as one call of
    # weight 0. emit is not called for it: state is the gate's state then.
    empty: Any = False


def _as_emission(value: Any) -> _Emission:
    """A gate's emission (an :class:`Emitted`, an :class:`_Emission` or a
    plain tuple) as an :class:`_Emission`."""
    if isinstance(value, _Emission):
        return value
    if isinstance(value, Emitted):
        return _Emission(updates=value.updates, state=value.state)
    return _Emission(*value)


def _as_result(res: Any) -> _Result:
    """A gate's result (a :class:`GateResult` or an :class:`_Result`) as an
    :class:`_Result`: the one place where the chain reads what a gate
    decided."""
    if isinstance(res, _Result):
        return res
    state, may_open, emit = res
    return _Result(state=state, may_open=may_open, emit=emit)


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


def emitted(res: GateResult | _Result) -> _Emission:
    """The emission of ``res`` (calling ``res.emit`` if lazy)."""
    emit = res.emit
    return _as_emission(emit() if callable(emit) else emit)


def map_emit(emit: Any, fn: Callable[[_Emission], _Emission]) -> Any:
    """``emit`` followed by ``fn``: a value if ``emit`` is one (an eager
    gate stays eager), else a function of no arguments."""
    if callable(emit):
        lazy: Callable[[], Any] = emit
        return lambda: fn(_as_emission(lazy()))
    return fn(_as_emission(emit))


def as_update(res: GateResult | _Result) -> tuple[optax.Updates, Any]:
    """A gate's result as the plain ``(updates, state)`` of ``update``: zeros
    with the structure, shapes and dtypes of the emitted updates where the
    gate stays closed (or opens but does not let the followers run)."""
    res = _as_result(res)

    def opened():
        out = emitted(res)
        return utils.mask(out.opened, out.updates), out.state

    def closed():
        return utils.zeros_of(jax.eval_shape(opened)[0]), res.state

    return utils.cond_or_call(res.may_open, opened, closed)


class GatedTransformation(optax.GradientTransformationExtraArgs):
    """An optax transformation that is also a gate of :func:`chain`.

    A :class:`optax.GradientTransformationExtraArgs` (``init``, ``update``)
    with ``gate_update`` and ``gate_flush``. Its plain ``update`` calls
    ``gate_update`` with ``GateContext()`` and emits zeros where the gate
    stays closed. Writing a gate: docs/gates.md.

    Args:
      init: the usual ``init(params) -> state``.
      gate_update: a :class:`GateUpdateFn`, ``(updates, state, params, ctx,
        **extra_args) -> GateResult``. Keywords it declares by name (e.g.
        ``accum_weight``) are the ones the chain checks near-misses against.
      gate_flush: optional :class:`GateFlushFn`, ``(state, params,
        **extra_args) -> GateResult``.

    Example:
      A gate that lets only finite gradients through:

      >>> import jax.numpy as jnp, optax
      >>> import optaxaccum as oa
      >>> def gate_update(updates, state, params, ctx, **extra_args):
      ...   finite = jnp.all(jnp.isfinite(updates)) & ctx.passed
      ...   return oa.GateResult(
      ...       state=state,
      ...       may_open=finite,
      ...       emit=oa.Emitted(updates=updates, state=state))
      >>> only_finite = oa.GatedTransformation(
      ...     lambda params: optax.EmptyState(), gate_update)
      >>> tx = oa.chain(only_finite, optax.sgd(1.0))
      >>> state = tx.init(jnp.zeros(2))
      >>> tx.update(jnp.array([1.0, jnp.nan]), state)[0]
      Array([0., 0.], dtype=float32)
    """

    gate_update: GateUpdateFn
    gate_flush: GateFlushFn | None
    _followers: _Followers | None  # where the chain runs the followers

    def __new__(
        cls,
        init: optax.TransformInitFn,
        gate_update: GateUpdateFn,
        gate_flush: GateFlushFn | None = None,
    ):
        _check_takes_ctx(gate_update)
        # The plain update declares what gate_update takes by name, so that
        # chains can tell a near-miss keyword (``acum_weight``) from others.
        names = utils.declared_extra_args(gate_update, skip=4)

        def update_fn(updates, state, params=None, **extra_args):
            utils.check_extra_args(extra_args, names)
            ctx = GateContext()
            return as_update(
                gate_update(updates, state, params, ctx, **extra_args)
            )

        self = super().__new__(
            cls, init, utils.with_signature(update_fn, names)
        )
        self.gate_update = gate_update
        self.gate_flush = gate_flush
        self._followers = None
        # Where only the update is kept (``optax.chain`` keeps its
        # elements' update functions), oa.flush finds the gate from it.
        update_fn.__dict__["_oa_gate"] = self
        return self

    def __getnewargs__(self):
        # copy/deepcopy/pickle rebuild through __new__ with these arguments.
        return (self.init, self.gate_update, self.gate_flush)


def _check_takes_ctx(gate_update: Any) -> None:
    """Raises ``TypeError`` at construction if ``gate_update`` cannot be
    called as ``(updates, state, params, ctx)`` (e.g. written for the
    protocol before the context existed), rather than deep inside a chain.
    Keyword-only arguments without a default are the keywords it reads
    (``*, accum_weight``): every call must then pass them."""
    try:
        signature = inspect.signature(gate_update)
    except (TypeError, ValueError):  # no signature to read: trust it
        return
    required = {
        name: None
        for name, p in signature.parameters.items()
        if p.kind is p.KEYWORD_ONLY and p.default is p.empty
    }
    try:
        signature.bind(None, None, None, GateContext(), **required)
    except TypeError as e:
        raise TypeError(
            "gate_update must take (updates, state, params, ctx, "
            f"**extra_args), ctx an oa.GateContext; {gate_update!r} has "
            f"the signature {signature} ({e}). See docs/gates.md."
        ) from None


class _Followers(NamedTuple):
    """A gate's private hook for where :func:`optaxaccum.chain` runs the
    elements after it (``shard_update``: on each device's piece)."""

    gate: GatedTransformation  # what the chain runs in the gate's place
    wrap: Callable[[Any], Any]  # the followers -> the followers, placed
    place: Callable[[Any], Any]  # params -> the followers' init params
    # (followers, params) -> their states, where they are not each
    # initialised on ``place(params)``
    init: Callable[[Any, Any], tuple] | None = None


def _with_followers(
    tx: GatedTransformation, hook: _Followers | None
) -> GatedTransformation:
    """``tx`` with the follower hook ``hook`` (kept by pytree round trips,
    copies and pickles)."""
    tx._followers = hook
    return tx


def _followers_of(tx: Any) -> _Followers | None:
    """The follower hook of ``tx``, or ``None`` (not a gate, or none)."""
    return getattr(tx, "_followers", None) if is_gate(tx) else None


def _flatten_gate(tx: GatedTransformation):
    aux = (tx.gate_update, tx.gate_flush, tx._followers)
    return (tx.init, tx.update), aux


def _unflatten_gate(aux, children) -> GatedTransformation:
    init, _ = children  # update is derived from gate_update again
    gate_update, gate_flush, hook = aux
    return _with_followers(
        GatedTransformation(init, gate_update, gate_flush), hook
    )


# A NamedTuple subclass would otherwise be rebuilt by jax.tree functions as
# GatedTransformation(init, update), losing gate_update.
jax.tree_util.register_pytree_node(
    GatedTransformation, _flatten_gate, _unflatten_gate
)


def is_gate(tx: Any) -> TypeGuard[GatedTransformation]:
    """Whether ``tx`` is a gate (a :class:`GatedTransformation`).

    Args:
      tx: anything.

    Returns:
      ``True`` for a :class:`GatedTransformation` (an :func:`accumulate`, a
      loss scale, an :func:`chain` holding a gate).

    Example:
      >>> import optax, optaxaccum as oa
      >>> oa.is_gate(oa.accumulate(2)), oa.is_gate(optax.sgd(0.1))
      (True, False)
    """
    return isinstance(tx, GatedTransformation)
