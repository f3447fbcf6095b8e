"""``oa.chain``: ``optax.chain`` with gates, the fused step and ``flush``."""

from __future__ import annotations

from typing import Any, cast

import jax
import jax.numpy as jnp
import optax

from optaxaccum._src import base, utils, zero
from optaxaccum._src.accumulate import warn_if_wrapped

__all__ = ["chain", "apply_gradients", "flush"]


def chain(
    *transforms: optax.GradientTransformation,
) -> optax.GradientTransformationExtraArgs:
    """Chains transformations like :func:`optax.chain`, honouring gates.

    Elements before the first gate (:func:`accumulate`,
    :func:`dynamic_loss_scale`, or any :class:`GatedTransformation`) run on
    every call. The gate then decides whether the elements after it run: when
    it stays closed, their states are returned bit-for-bit unchanged and the
    chain emits zeros with the structure, shapes and dtypes that the update
    would have had. Elements after the gate may contain further gates. A chain
    that contains a gate is itself a gate, so chains nest.

    Extra keyword arguments of ``update`` (e.g. ``accum_weight``) reach every
    element as the call gave them (after an accumulate, ``accum_weight`` is
    its window's total).

    Args:
      *transforms: optax gradient transformations, gates among them.

    Returns:
      A :class:`optax.GradientTransformationExtraArgs` whose state is the tuple
      of the elements' states, in order. It is a :class:`GatedTransformation`
      when one of the elements is a gate.

    Raises:
      TypeError: if an element is not an optax gradient transformation.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> import optaxaccum as oa
      >>> tx = oa.chain(oa.accumulate(2), optax.sgd(0.1, momentum=0.9))
      >>> params = jnp.zeros(3)
      >>> state = tx.init(params)
      >>> _, state = tx.update(jnp.ones(3), state, params)  # sgd not run
      >>> u, state = tx.update(jnp.ones(3), state, params)  # window closes
      >>> u
      Array([-0.1, -0.1, -0.1], dtype=float32)

    .. warning::
      Stock :func:`optax.chain` cannot gate: a stateful optimizer placed after
      :func:`accumulate` inside ``optax.chain`` steps on every call. Put the
      gate and its followers in an ``oa.chain`` (which may itself sit inside
      ``optax.chain``).
    """
    for i, tx in enumerate(transforms):
        if not isinstance(tx, optax.GradientTransformation):
            raise TypeError(
                "Every element of oa.chain must be an optax "
                f"GradientTransformation; element {i} is {tx!r} of type "
                f"{type(tx).__name__}"
            )
    declared = frozenset().union(
        *(utils.declared_extra_args(tx) for tx in transforms)
    )
    gate_at = next(
        (i for i, t in enumerate(transforms) if base.is_gate(t)), None
    )
    if gate_at is None:  # a chain without gates is optax.chain
        return _checked(optax.chain(*transforms), declared, len(transforms))
    head = _plain(transforms[:gate_at]) if gate_at else None
    first, rest = zero.split(
        transforms[gate_at], _followers(transforms, gate_at)
    )
    assert base.is_gate(first)  # for the type checker: found as a gate
    init = _init(transforms[: gate_at + 1], rest)

    def gate_update_fn(
        updates,
        state,
        params=None,
        *,
        passed=True,
        window_weight=None,
        **extra_args,
    ):
        _check_state(state, len(transforms))
        head_state = ()
        if head is not None:
            updates, head_state = head.update(
                updates,
                state[:gate_at],
                params,
                window_weight=window_weight,
                **extra_args,
            )
            # An earlier window of weight 0 does not step them.
            stepped = base.both(passed, _nonzero(window_weight))
            head_state = base.select(stepped, head_state, state[:gate_at])
        res = base.call_gate(
            first,
            passed,
            window_weight,
            updates,
            state[gate_at],
            params,
            **extra_args,
        )
        return _follow(
            res, head_state, state[gate_at + 1 :], rest, params, extra_args
        )

    # The first element that can close a window early (``flush``); the
    # elements before it have no gradient to process and are left alone.
    flush_at = next(
        (
            i
            for i, t in enumerate(transforms)
            if base.is_gate(t) and t.gate_flush is not None
        ),
        None,
    )
    if flush_at is None:
        return base.GatedTransformation(
            init, utils.with_signature(gate_update_fn, declared)
        )
    flusher, flush_rest = zero.split(
        transforms[flush_at], _followers(transforms, flush_at)
    )
    assert base.is_gate(flusher) and flusher.gate_flush is not None
    flush_fn = flusher.gate_flush

    def gate_flush_fn(state, params, **extra_args):
        _check_state(state, len(transforms))
        res = flush_fn(state[flush_at], params, **extra_args)
        return _follow(
            res,
            state[:flush_at],
            state[flush_at + 1 :],
            flush_rest,
            params,
            extra_args,
        )

    return base.GatedTransformation(
        init, utils.with_signature(gate_update_fn, declared), gate_flush_fn
    )


def _init(gated, rest):
    """``optax.chain``'s ``init``: the states of ``gated`` (the elements up
    to the gate), then those of ``rest`` (its followers, one chain)."""

    def init(params):
        tail = () if rest is None else tuple(rest.init(params))
        return (*(tx.init(params) for tx in gated), *tail)

    return init


def _checked(tx, declared, n):
    """``tx`` (an ``optax.chain`` of ``n``) with the state and near-miss
    checks."""

    def update_fn(updates, state, params=None, **extra_args):
        _check_state(state, n)
        utils.check_extra_args(extra_args, declared)
        return tx.update(updates, state, params, **extra_args)

    return optax.GradientTransformationExtraArgs(
        tx.init, utils.with_signature(update_fn, declared)
    )


def _check_state(state, n):
    if not isinstance(state, tuple) or len(state) != n:
        raise ValueError(
            f"oa.chain of {n} transformations expects a tuple of "
            f"{n} states, got {type(state).__name__} "
            f"{jax.tree.structure(state)}"
        )


def _followers(transforms, i):
    """The chain of the elements after position ``i`` (built once). Extra
    arguments are checked where the call enters (``update``,
    :func:`apply_gradients`, :func:`flush`), not again here."""
    rest = transforms[i + 1 :]
    if not rest:
        return None
    return chain(*rest) if any(map(base.is_gate, rest)) else _plain(rest)


def _nonzero(window: Any) -> Any:
    """Whether an earlier window's total weight is not 0 (``True`` if there
    is none)."""
    return True if window is None else window != 0


def _plain(transforms):
    """``optax.chain(*transforms)`` (no gates among them) whose ``update``
    also takes the ``window_weight`` of an accumulate before them and gives
    each element the keywords :func:`base.follower_args` says it sees."""
    txs = [optax.with_extra_args_support(t) for t in transforms]

    def update_fn(
        updates, state, params=None, *, window_weight=None, **extra_args
    ):
        new_state = []
        for tx, s in zip(txs, state, strict=True):
            args = base.follower_args(tx, extra_args, window_weight)
            updates, s = tx.update(updates, s, params, **args)
            new_state.append(s)
        return updates, tuple(new_state)

    return optax.GradientTransformationExtraArgs(
        optax.chain(*transforms).init, update_fn
    )


def _follow(
    res: base.GateResult,
    head: tuple,
    tail_state: tuple,
    rest: optax.GradientTransformationExtraArgs | None,
    params: optax.Params | None,
    extra_args: dict[str, Any],
) -> base.GateResult:
    """Extends a gate's result with the elements that follow it (``rest``,
    one chain) and the states of those before it (``head``)."""
    if rest is None:  # emit adds only the head: an eager gate stays eager

        def emit_alone():
            out = base.emitted(res)
            return out._replace(state=(*head, out.state))

        return base.GateResult(
            (*head, res.state), res.may_open, emit_alone, res.eager, res.empty
        )
    if base.is_gate(rest) and res.eager:
        return _follow_eager(res, head, tail_state, rest, params, extra_args)
    gated = base.is_gate(rest)
    into = _emit_into_gate if gated else _emit_into

    def emit():
        out = base.emitted(res)
        window = out.follower_args.get("accum_weight")
        args = base.replaced(extra_args, window)
        e = into(out, tail_state, rest, params, args, window)
        return e._replace(state=(*head, out.state, *e.state))

    # A later gate counts an empty window (weight 0) as one call.
    may_open = base.either(res.may_open, res.empty) if gated else res.may_open
    return base.GateResult((*head, res.state, *tail_state), may_open, emit)


def _emit_into(out, tail_state, rest, params, args, window) -> base.Emitted:
    """The plain followers run where the gate ``opened`` after all."""

    def run():
        return rest.update(
            out.updates, tail_state, params, window_weight=window, **args
        )

    def skip():
        return base.zeros_of(jax.eval_shape(run)[0]), tail_state

    updates, tail = base.cond_or_call(out.opened, run, skip)
    return base.Emitted(updates, tail, out.opened)


def _emit_into_gate(
    out, tail_state, rest, params, args, window
) -> base.Emitted:
    """A later gate decides in turn (only where this one opened, e.g. once
    per window); its emit runs only where it opens too."""
    # An accumulate's window reaches the later gate as one call of the
    # window's weight (0 for an empty window), where it reached this gate.
    res2 = rest.gate_update(
        out.updates,
        tail_state,
        params,
        passed=True if window is None else out.reached,
        window_weight=window,
        **args,
    )
    pred = base.either(res2.may_open, res2.empty)

    def opened():
        out2 = base.emitted(res2)
        flag = base.both(res2.may_open, out2.opened)
        reached = jnp.logical_or(pred, True) & out2.reached
        return out2.updates, out2.state, flag, out2.follower_args, reached

    def closed():
        shapes = jax.eval_shape(
            lambda: (lambda e: (e.updates, e.follower_args))(base.emitted(res2))
        )
        zeros, args2 = base.zeros_of(shapes)
        false = jnp.logical_and(pred, False)
        return zeros, res2.state, false, args2, false

    updates, inner, opened2, args2, reached2 = base.cond_or_call(
        pred, opened, closed
    )
    if window is not None:
        return base.Emitted(updates, inner, opened2, args2, reached2)
    tail = base.select(out.opened, inner, tail_state)
    return base.Emitted(
        updates,
        tail,
        base.both(out.opened, opened2),
        args2,
        base.both(out.opened, reached2),
    )


def _follow_eager(res, head, tail_state, rest, params, extra_args):
    """An eager gate followed by a gated chain: one combined gate, so that a
    step where the later gate stays closed (a non-closing micro-step after a
    loss scale) still skips its followers and keeps the fused fast path."""
    updates, open_state, opened, follower_args, _ = base.emitted(res)
    passed = base.both(res.may_open, opened)
    gate_state = base.select(res.may_open, open_state, res.state)
    # A call this gate refused does not count for the later gate (``passed``).
    window = follower_args.get("accum_weight")
    res2 = base.call_gate(
        rest,
        passed,
        window,
        updates,
        tail_state,
        params,
        **base.replaced(extra_args, window),
    )

    def emit():
        e = base.emitted(res2)
        return e._replace(state=(*head, gate_state, *cast(tuple, e.state)))

    return base.GateResult(
        (*head, gate_state, *cast(tuple, res2.state)),
        base.both(passed, res2.may_open),
        emit,
        res2.eager,
        base.both(passed, res2.empty),
    )


def apply_gradients(
    tx: optax.GradientTransformation,
    grads: optax.Updates,
    opt_state: optax.OptState,
    params: optax.Params,
    **extra_args: Any,
) -> tuple[optax.Params, optax.OptState]:
    """One fused optimizer step: ``update`` then ``optax.apply_updates``.

    Gives the same result as::

      updates, opt_state = tx.update(grads, opt_state, params, **extra_args)
      params = optax.apply_updates(params, updates)

    but when ``tx`` is a gate (e.g. an :func:`chain` holding an
    :func:`accumulate`) that stays closed, ``params`` are returned untouched
    and no tree of zero updates is built. Jitted with ``params`` and
    ``opt_state`` donated, a micro-step that does not close the window then
    costs a single pass over the accumulator (read gradient, read accumulator,
    write accumulator) and allocates no tree-sized temporary. Results equal
    the plain protocol's up to float rounding (XLA may fuse the update into
    the parameter add).

    Give the jitted step its donated arguments in the order it returns
    them, ``step(params, opt_state, grads) -> (params, opt_state)`` with
    ``donate_argnums=(0, 1)`` (docs/concepts.md, "The fused step and
    donation").

    Args:
      tx: any optax transformation; the fast path needs a gate.
      grads: the gradients of this micro-batch.
      opt_state: ``tx``'s state.
      params: the current parameters.
      **extra_args: passed to ``tx.update`` (e.g. ``accum_weight``).

    Returns:
      ``(params, opt_state)`` after the step.

    Examples:
      >>> import jax, jax.numpy as jnp, optax
      >>> import optaxaccum as oa
      >>> tx = oa.chain(oa.accumulate(2), optax.sgd(0.5))
      >>> params = jnp.ones(2)
      >>> state = tx.init(params)
      >>> step = jax.jit(lambda p, s, g: oa.apply_gradients(tx, g, s, p),
      ...                donate_argnums=(0, 1))
      >>> params, state = step(params, state, jnp.ones(2))
      >>> params, state = step(params, state, 3 * jnp.ones(2))
      >>> params
      Array([0., 0.], dtype=float32)
    """
    params, opt_state, _ = fused_step(tx, grads, opt_state, params, extra_args)
    return params, opt_state


def fused_step(
    tx: optax.GradientTransformation,
    grads: optax.Updates,
    opt_state: optax.OptState,
    params: optax.Params,
    extra_args: dict[str, Any],
    with_updates: bool = False,
) -> tuple[optax.Params, optax.OptState, optax.Updates | None]:
    """:func:`apply_gradients`, also returning the updates applied when
    ``with_updates`` (zeros where the gate stayed closed; ``None`` without
    it). Under ``jit`` an unused updates output costs nothing."""
    if not base.is_gate(tx):
        warn_if_wrapped(opt_state)
        updates, opt_state = tx.update(grads, opt_state, params, **extra_args)
        return optax.apply_updates(params, updates), opt_state, updates
    utils.check_extra_args(extra_args, utils.declared_extra_args(tx))
    result = tx.gate_update(grads, opt_state, params, **extra_args)
    return _apply(result, params, with_updates)


def _apply(res: base.GateResult, params, with_updates: bool):
    def opened():
        updates, state, flag, *_ = base.emitted(res)
        new_params = optax.apply_updates(params, updates)
        updates = base.mask(flag, updates) if with_updates else None
        return base.select(flag, new_params, params), state, updates

    def closed():
        shapes = jax.eval_shape(opened)[2]  # None without with_updates
        return params, res.state, base.zeros_of(shapes)

    return base.cond_or_call(res.may_open, opened, closed)


def flush(
    tx: optax.GradientTransformation,
    opt_state: optax.OptState,
    params: optax.Params,
    **extra_args: Any,
) -> tuple[optax.Updates, optax.OptState]:
    """Closes the current, partial accumulation window now (end of an epoch).

    Exactly as if the window's closing micro-batch had just arrived: the
    window emits the (weighted) mean or sum over the micro-batches actually
    seen, in the params' dtypes, and the elements after the accumulation run
    once. With an empty window it emits zeros and changes nothing. Elements
    before the accumulation (e.g. :func:`agc`) do not run: there is no new
    gradient. Only the first accumulation is closed: with nested ones the
    flushed window enters the next as one more micro-batch.

    Args:
      tx: an :func:`accumulate`, or an :func:`chain` containing one.
      opt_state: ``tx``'s state.
      params: the current parameters (they give the emitted dtypes).
      **extra_args: passed to the elements after the accumulation.

    Returns:
      ``(updates, opt_state)``, to be applied with
      :func:`optax.apply_updates`.

    Raises:
      ValueError: if ``tx`` holds no :func:`accumulate` that ``flush`` can
        reach: an :func:`accumulate` or an :func:`chain` (nested chains
        included). One inside a stock ``optax.chain``, ``optax.masked`` or
        ``optax.inject_hyperparams`` is out of reach: flush that inner
        ``oa.chain`` with its own part of the state.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> import optaxaccum as oa
      >>> tx = oa.chain(oa.accumulate(4), optax.sgd(1.0))
      >>> params = jnp.zeros(1)
      >>> state = tx.init(params)
      >>> for g in (1.0, 2.0, 6.0):   # 3 of 4 micro-batches: last of epoch
      ...   _, state = tx.update(jnp.array([g]), state, params)
      >>> updates, state = oa.flush(tx, state, params)
      >>> updates   # minus the mean of the three, not divided by 4
      Array([-3.], dtype=float32)
    """
    gate_flush = getattr(tx, "gate_flush", None) if base.is_gate(tx) else None
    if gate_flush is None:
        warn_if_wrapped(opt_state)
        raise ValueError(
            "oa.flush needs an oa.accumulate, or an oa.chain that contains "
            f"one; got {tx!r}"
        )
    utils.check_extra_args(extra_args, utils.declared_extra_args(tx))
    return base.resolve(gate_flush(opt_state, params, **extra_args))
