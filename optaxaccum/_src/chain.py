"""``oa.chain``: ``optax.chain`` with gates, the fused step and ``flush``."""

from __future__ import annotations

import inspect
from typing import Any, Literal, cast, overload

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optaxaccum._src import base, utils
from optaxaccum._src.windows import warn_if_wrapped

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

    Extra keyword arguments of ``update`` reach every element as the call
    gave them, except ``accum_weight``: it reaches only the elements that
    declare it by name (an accumulate, a gate that weighs calls), and after
    an accumulate as its window's total weight; others never see it
    (``optax.lbfgs``'s line search hands unknown keywords to ``value_fn``).

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
    _check_elements(transforms)
    declared = frozenset().union(
        *(utils.declared_extra_args(tx) for tx in transforms)
    )
    gate_at = next(
        (i for i, t in enumerate(transforms) if base.is_gate(t)), None
    )
    if gate_at is None:  # a chain without gates is optax.chain
        return _checked(optax.chain(*transforms), declared, len(transforms))
    n, head = len(transforms), _plain(transforms[:gate_at])
    gate, rest = _split(transforms[gate_at], _followers(transforms, gate_at))
    assert base.is_gate(gate)  # for the type checker: found as a gate

    def gate_update_fn(updates, state, params, ctx, **extra_args):
        _check_chain_state(state, n)
        # Before the gate, as optax.chain: on every call that counts (not
        # where an earlier gate refused it, nor for a window of weight 0).
        updates, new_head = head(
            updates, state[:gate_at], params, ctx.window_weight, extra_args
        )
        counts = utils.both(ctx.passed, _nonzero(ctx.window_weight))
        new_head = utils.select(counts, new_head, state[:gate_at])
        # The gate decides; the elements after it run where it opens.
        args = _args_for(gate, extra_args, ctx.window_weight)
        res = base._as_result(
            gate.gate_update(updates, state[gate_at], params, ctx, **args)
        )
        _check_flags(res, gate)
        plain = rest is not None and not base.is_gate(rest)
        res = _inherit_window(res, ctx.window_weight, plain)
        tail = state[gate_at + 1 :]
        return _follow(res, new_head, tail, rest, params, extra_args)

    return base.GatedTransformation(
        _init(transforms),
        utils.with_signature(gate_update_fn, declared, gate=True),
        _flush_fn(transforms),
    )


def _split(gate: Any, rest: Any) -> tuple[Any, Any]:
    """The gate and followers the chain runs: as given, unless the gate has
    a follower hook (``shard_update``: the followers run on each device's
    piece) and followers."""
    hook = base._followers_of(gate)
    if hook is None or rest is None:
        return gate, rest
    return hook.gate, hook.wrap(rest)


def _init(transforms: tuple) -> Any:
    """``optax.chain(*transforms).init``, except that the elements after
    the first gate with a follower hook are initialised on the params its
    hook places (``shard_update``: their state sharded like them)."""
    hooks = [base._followers_of(tx) for tx in transforms]
    at = next((i for i, h in enumerate(hooks) if h is not None), None)
    if at is None:
        return optax.chain(*transforms).init
    hook = cast(base._Followers, hooks[at])

    def init(params):
        if hook.init is not None:
            rest = hook.init(transforms[at + 1 :], params)
        else:
            placed = hook.place(params)
            rest = tuple(tx.init(placed) for tx in transforms[at + 1 :])
        return (*(tx.init(params) for tx in transforms[: at + 1]), *rest)

    return init


def _check_elements(transforms):
    for i, tx in enumerate(transforms):
        if not isinstance(tx, optax.GradientTransformation):
            raise TypeError(
                "Every element of oa.chain must be an optax "
                f"GradientTransformation; element {i} is {tx!r} of type "
                f"{type(tx).__name__}"
            )


def _check_flags(res: base._Result, gate: Any) -> None:
    """Raises ``TypeError`` naming the gate if its ``may_open`` (or
    ``empty``) is not a flag: a Python bool or a boolean scalar array
    (``ctx.passed & ~False`` is an int: ``~False`` is -1)."""
    for name in ("may_open", "empty"):
        flag = getattr(res, name)
        if isinstance(flag, (bool, np.bool_)):
            continue
        dtype = getattr(flag, "dtype", None)
        if dtype == jnp.bool_ and jnp.shape(flag) == ():
            continue
        fn = gate.gate_update
        fn = getattr(fn, "func", fn)  # a functools.partial
        kind = f"dtype {dtype}"
        if dtype is None:
            kind = f"type {type(flag).__name__}"
        raise TypeError(
            f"the gate {getattr(fn, '__qualname__', fn)!r} returned "
            f"{name} of {kind} and shape {jnp.shape(flag)} ({flag!r}): "
            f"{name} must be a boolean scalar (a bool array or a Python "
            "bool). Combine flags with & and jnp.logical_not, not ~ on a "
            "Python bool (~False is the int -1)."
        )


def _flush_fn(transforms) -> base.GateFlushFn | None:
    """The chain's ``gate_flush``: that of its first element that can close
    a window early (``flush``), then the elements after it; those before it
    have no gradient to process and are left alone. ``None`` if none can."""
    flush_at = next(
        (
            i
            for i, t in enumerate(transforms)
            if base.is_gate(t) and t.gate_flush is not None
        ),
        None,
    )
    if flush_at is None:
        return None
    flusher, rest = _split(
        transforms[flush_at], _followers(transforms, flush_at)
    )
    assert base.is_gate(flusher) and flusher.gate_flush is not None
    flush_fn, n = flusher.gate_flush, len(transforms)

    def gate_flush_fn(state, params, **extra_args):
        _check_chain_state(state, n)
        res = base._as_result(flush_fn(state[flush_at], params, **extra_args))
        head, tail = state[:flush_at], state[flush_at + 1 :]
        res = _follow(res, head, tail, rest, params, extra_args)
        if getattr(rest, "gate_flush", None) is None:
            return res
        # Nested accumulates: the flushed window entered the next one as
        # one more micro-batch; close that one's partial window too.
        return _flush_next(res, rest, flush_at + 1, params, extra_args)

    return cast(base.GateFlushFn, gate_flush_fn)


def _flush_next(res, rest, at, params, extra_args) -> base._Result:
    """After ``res`` (a flush whose window went on into the gated followers
    ``rest``, at position ``at`` of the chain's state), the flush of
    ``rest``'s own partial window: one flush of the whole nested window, as
    that of one accumulate of their product. At most one of the two steps
    the optimizer (a window that ``res`` completes leaves ``rest`` empty)."""

    def run():
        out = base.emitted(res)
        return out._replace(
            opened=jnp.asarray(out.opened, bool),
            passed=jnp.asarray(out.passed, bool),
        )

    def skip():
        false = jnp.asarray(False)
        return _shut(jax.eval_shape(run), res.state, opened=false, passed=false)

    first = utils.cond_or_call(res.may_open, run, skip)
    front = first.state[:at]
    second = base._as_result(
        rest.gate_flush(first.state[at:], params, **extra_args)
    )

    def emit():
        def then():
            out = run_second()
            return out._replace(
                opened=jnp.asarray(out.opened, bool),
                passed=jnp.asarray(out.passed, bool),
            )

        def run_second():
            out = base.emitted(second)
            return out._replace(state=(*front, *out.state))

        return utils.cond_or_call(first.opened, lambda: first, then)

    return base._Result(
        state=(*front, *second.state),
        may_open=first.opened | jnp.asarray(second.may_open, bool),
        emit=emit,
    )


def _checked(tx, declared, n):
    """``tx`` (an ``optax.chain`` of ``n``) with the state and near-miss
    checks."""

    def update_fn(updates, state, params=None, **extra_args):
        _check_chain_state(state, n)
        utils.check_extra_args(extra_args, declared)
        return tx.update(updates, state, params, **extra_args)

    return optax.GradientTransformationExtraArgs(
        tx.init, utils.with_signature(update_fn, declared)
    )


def _check_chain_state(state, n):
    """Raises if ``state`` is not the tuple of ``n`` states of a chain."""
    if not isinstance(state, tuple) or len(state) != n:
        raise ValueError(
            f"oa.chain of {n} transformations expects a tuple of "
            f"{n} states, got {type(state).__name__} "
            f"{jax.tree.structure(state)}"
        )


def _followers(transforms, i):
    """The elements after position ``i``: ``None``, one gated chain, or the
    plain run of :func:`_plain` (built once). Extra arguments are checked
    where the call enters (``update``, :func:`apply_gradients`,
    :func:`flush`), not again here."""
    rest = transforms[i + 1 :]
    if not rest:
        return None
    return chain(*rest) if any(map(base.is_gate, rest)) else _plain(rest)


def _inherit_window(
    res: base._Result, window: Any, plain: bool
) -> base._Result:
    """A gate that closes no window of its own (a loss scale, a user's gate)
    passes an earlier accumulate's window weight on to its followers: a
    later accumulate weighs the window by it (and counts one of weight 0),
    and ``plain`` followers do not step on a window of weight 0
    (docs/concepts.md)."""
    if window is None:
        return res

    def inherit(out: base._Emission) -> base._Emission:
        if out.window_weight is not None:  # the gate closed its own window
            return out
        out = out._replace(window_weight=window)
        if plain:  # they do not step on a window of weight 0
            out = out._replace(opened=utils.both(out.opened, _nonzero(window)))
        return out

    return res._replace(emit=base.map_emit(res.emit, inherit))


def _nonzero(window: Any) -> Any:
    """Whether an earlier window's total weight is not 0 (``True`` if there
    is none)."""
    return True if window is None else window != 0


def _args_for(
    receiver: Any, extra_args: dict[str, Any], window: Any
) -> dict[str, Any]:
    """The keywords an element ``receiver`` (a transformation) sees:
    exactly the call's, except the accumulate's own keyword
    ``accum_weight`` and the window's noise estimates
    (``base.WINDOW_NOISE_ARG``, put among ``extra_args`` by
    :func:`_emit_into`): only an element that declares one by name gets it,
    ``accum_weight`` then as the total weight ``window`` of an earlier
    accumulate's window where there is one (even if the call passed none).
    No other keyword reaches it: optax's linesearches hand unknown keywords
    to ``value_fn``."""
    declared = utils.declared_extra_args(receiver)
    private = [
        k
        for k in ("accum_weight", base.WINDOW_NOISE_ARG)
        if k in extra_args and k not in declared
    ]
    if private:
        extra_args = {k: v for k, v in extra_args.items() if k not in private}
    if window is None or "accum_weight" not in declared:
        return extra_args
    return {**extra_args, "accum_weight": window}


def _plain(transforms):
    """``optax.chain(*transforms)``'s update (no gates among them) as
    ``run(updates, state, params, window, extra_args)``, where ``window`` is
    the total weight of an accumulate's window before them (or ``None``)."""
    txs = [optax.with_extra_args_support(t) for t in transforms]

    def run(updates, state, params, window, extra_args):
        new_state = []
        for tx, s in zip(txs, state, strict=True):
            args = _args_for(tx, extra_args, window)
            updates, s = tx.update(updates, s, params, **args)
            new_state.append(s)
        return updates, tuple(new_state)

    setattr(run, "transforms", tuple(transforms))  # noqa: B010 (for pyright)
    return run


def _follow(
    res: base._Result,
    head: tuple,
    tail_state: tuple,
    rest: Any,
    params: optax.Params | None,
    extra_args: dict[str, Any],
) -> base._Result:
    """Extends a gate's result with the elements that follow it (``rest``,
    see :func:`_followers`) and the states of those before it (``head``)."""
    if rest is None:  # emit adds only the head: an eager gate stays eager

        def alone(out: base._Emission) -> base._Emission:
            return out._replace(state=(*head, out.state))

        emit = base.map_emit(res.emit, alone)
        return res._replace(state=(*head, res.state), emit=emit)
    gated = base.is_gate(rest)
    if gated and not callable(res.emit):  # an eager gate, then a gate
        return _follow_eager(res, head, tail_state, rest, params, extra_args)
    state = (*head, res.state, *tail_state)
    if not gated:  # an empty window passes on as it came: the followers
        # do not step on it; an enclosing gate counts it (_passed_on).

        def emit_plain():
            out = base.emitted(res)
            e = _emit_into(out, tail_state, rest, params, extra_args)
            return e._replace(state=(*head, out.state, *e.state))

        return res._replace(state=state, emit=emit_plain)

    def emit():
        out = _passed_on(res)
        args = _args_for(rest, extra_args, out.window_weight)
        e = _emit_into_gate(out, tail_state, rest, params, args)
        return e._replace(state=(*head, out.state, *e.state))

    # A later gate counts an empty window (weight 0) as one call.
    return base._Result(
        state=state, may_open=utils.either(res.may_open, res.empty), emit=emit
    )


def _passed_on(res: base._Result) -> base._Emission:
    """What a gate passes on to a later gate where it opens or closed a
    window of weight 0 (``res.empty``), the chain's one place for such a
    window: its emission where it opens; for the empty window, one call of
    weight 0 from the gate's closed ``state``, ``opened`` false (``emit``
    is not called: followers it holds would step on the window)."""
    if res.empty is False:
        return base.emitted(res)
    literal = []  # whether the emission's ``passed`` is the literal True

    def opened():
        out = base.emitted(res)
        literal.append(out.passed is True)
        return out._replace(
            opened=jnp.asarray(out.opened, bool),
            passed=jnp.asarray(out.passed, bool),
        )

    def empty():
        false, true = jnp.asarray(False), jnp.asarray(True)
        return _shut(
            jax.eval_shape(opened), res.state, opened=false, passed=true
        )

    out = utils.cond_or_call(res.may_open, opened, empty)
    # True in both branches: keep the literal (no select on the next state).
    return out._replace(passed=True if literal and all(literal) else out.passed)


def _shut(
    shapes: Any, state: Any, *, opened: Any, passed: Any
) -> base._Emission:
    """The emission of a branch that does not step the followers: zero
    updates and window weight shaped as in ``shapes`` (an emission's
    shapes), ``state``, ``opened`` and ``passed`` as given."""
    updates, weight = utils.zeros_of((shapes.updates, shapes.window_weight))
    return base._Emission(
        updates=updates,
        state=state,
        opened=opened,
        window_weight=weight,
        passed=passed,
    )


def _emit_into(out, tail_state, rest, params, args) -> base._Emission:
    """The plain followers run where the gate ``opened`` after all; the
    window's noise scale estimates go with the call's keywords, for the
    followers that ask for them (:func:`_args_for`)."""
    if out.noise is not None:
        args = {**args, base.WINDOW_NOISE_ARG: out.noise}

    def run():
        return rest(out.updates, tail_state, params, out.window_weight, args)

    def skip():
        return utils.zeros_of(jax.eval_shape(run)[0]), tail_state

    updates, tail = utils.cond_or_call(out.opened, run, skip)
    # The window's weight and ``passed`` go on to an enclosing gate.
    return out._replace(updates=updates, state=tail)


def _emit_into_gate(out, tail_state, rest, params, args) -> base._Emission:
    """A later gate decides in turn (only where this one opened, e.g. once
    per window); its emit runs only where it opens too."""
    # An accumulate's window reaches the later gate as one call of the
    # window's weight (0 for an empty window), where it passed this gate.
    window = out.window_weight
    passed = True if window is None else out.passed
    ctx = base.GateContext(passed=passed, window_weight=window)
    res2 = base._as_result(
        rest.gate_update(out.updates, tail_state, params, ctx, **args)
    )
    pred = utils.either(res2.may_open, res2.empty)

    def opened():
        out2 = _passed_on(res2)
        return out2._replace(
            opened=utils.both(res2.may_open, out2.opened),
            passed=jnp.logical_or(pred, True) & out2.passed,
        )

    def closed():
        false = jnp.logical_and(pred, False)
        shapes = jax.eval_shape(lambda: base.emitted(res2))
        return _shut(shapes, res2.state, opened=false, passed=false)

    e = utils.cond_or_call(pred, opened, closed)
    if window is not None:
        return e
    return e._replace(
        state=utils.select(out.opened, e.state, tail_state),
        opened=utils.both(out.opened, e.opened),
        passed=utils.both(out.opened, e.passed),
    )


def _follow_eager(res, head, tail_state, rest, params, extra_args):
    """An eager gate followed by a gated chain: one combined gate, so that a
    step where the later gate stays closed (a non-closing micro-step after a
    loss scale) still skips its followers and keeps the fused fast path."""
    out = base.emitted(res)
    passed = utils.both(res.may_open, out.opened)
    gate_state = utils.select(res.may_open, out.state, res.state)
    # A call this gate refused does not count for the later gate (``passed``).
    window = out.window_weight
    ctx = base.GateContext(passed=passed, window_weight=window)
    args = _args_for(rest, extra_args, window)
    res2 = base._as_result(
        rest.gate_update(out.updates, tail_state, params, ctx, **args)
    )

    def prepend(e: base._Emission) -> base._Emission:
        return e._replace(state=(*head, gate_state, *cast(tuple, e.state)))

    return base._Result(
        state=(*head, gate_state, *cast(tuple, res2.state)),
        may_open=utils.both(passed, res2.may_open),
        emit=base.map_emit(res2.emit, prepend),
        empty=utils.both(passed, res2.empty),
    )


@overload
def apply_gradients(
    tx: optax.GradientTransformation,
    grads: optax.Updates,
    opt_state: optax.OptState,
    params: optax.Params,
    *,
    return_updates: Literal[False] = False,
    **extra_args: Any,
) -> tuple[optax.Params, optax.OptState]: ...


@overload
def apply_gradients(
    tx: optax.GradientTransformation,
    grads: optax.Updates,
    opt_state: optax.OptState,
    params: optax.Params,
    *,
    return_updates: Literal[True],
    **extra_args: Any,
) -> tuple[optax.Params, optax.OptState, optax.Updates]: ...


def apply_gradients(
    tx: optax.GradientTransformation,
    grads: optax.Updates,
    opt_state: optax.OptState,
    params: optax.Params,
    *,
    return_updates: bool = False,
    **extra_args: Any,
) -> (
    tuple[optax.Params, optax.OptState]
    | tuple[optax.Params, optax.OptState, optax.Updates]
):
    """One fused optimizer step: ``update`` then ``optax.apply_updates``.

    Gives the same result as::

      updates, opt_state = tx.update(grads, opt_state, params, **extra_args)
      params = optax.apply_updates(params, updates)

    but when ``tx`` is a gate (e.g. an :func:`chain` holding an
    :func:`accumulate`) that stays closed, ``params`` are returned untouched
    and no tree of zero updates is built. Jitted with ``params`` and
    ``opt_state`` donated, a micro-step that does not close the window then
    costs a single pass over the accumulator and allocates no tree-sized
    temporary. Results equal the plain protocol's up to float rounding.

    Donate ``params`` and ``opt_state`` in the order the step returns them
    (docs/concepts.md, "The fused step and donation").

    Args:
      tx: any optax transformation; the fast path needs a gate.
      grads: the gradients of this micro-batch.
      opt_state: ``tx``'s state.
      params: the current parameters.
      return_updates: also return the updates applied (zeros where the
        gate stayed closed), as ``optax``'s ``update`` gives them. Under
        ``jit`` a caller that does not use them pays nothing for them.
      **extra_args: passed to ``tx.update`` (e.g. ``accum_weight``).

    Returns:
      ``(params, opt_state)`` after the step; with ``return_updates``,
      ``(params, opt_state, updates)``.

    Examples:
      >>> import jax, jax.numpy as jnp, optax
      >>> import optaxaccum as oa
      >>> tx = oa.chain(oa.accumulate(2), optax.sgd(0.5))
      >>> params = jnp.ones(2)
      >>> state = tx.init(params)
      >>> step = jax.jit(lambda p, s, g: oa.apply_gradients(tx, g, s, p),
      ...                donate_argnums=(0, 1))
      >>> params, state = step(params, state, jnp.ones(2))
      >>> params, state, updates = oa.apply_gradients(
      ...     tx, 3 * jnp.ones(2), state, params, return_updates=True)
      >>> params, updates
      (Array([0., 0.], dtype=float32), Array([-1., -1.], dtype=float32))
    """
    out = _fused_step(tx, grads, opt_state, params, extra_args, return_updates)
    return cast(Any, out if return_updates else out[:2])


def _fused_step(
    tx: optax.GradientTransformation,
    grads: optax.Updates,
    opt_state: optax.OptState,
    params: optax.Params,
    extra_args: dict[str, Any],
    with_updates: bool,
) -> tuple[optax.Params, optax.OptState, optax.Updates | None]:
    """:func:`apply_gradients`, also returning the updates applied when
    ``with_updates`` (zeros where the gate stayed closed; ``None`` without
    it)."""
    if not base.is_gate(tx):
        warn_if_wrapped(opt_state)
        updates, opt_state = tx.update(grads, opt_state, params, **extra_args)
        return optax.apply_updates(params, updates), opt_state, updates
    utils.check_extra_args(extra_args, utils.declared_extra_args(tx))
    ctx = base.GateContext()
    result = base._as_result(
        tx.gate_update(grads, opt_state, params, ctx, **extra_args)
    )
    return _apply(result, params, with_updates)


def _apply(res: base._Result, params, with_updates: bool):
    def opened():
        updates, state, flag, *_ = base.emitted(res)
        new_params = optax.apply_updates(params, updates)
        updates = utils.mask(flag, updates) if with_updates else None
        return utils.select(flag, new_params, params), state, updates

    def closed():
        shapes = jax.eval_shape(opened)[2]  # None without with_updates
        return params, res.state, utils.zeros_of(shapes)

    return utils.cond_or_call(res.may_open, opened, closed)


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
    gradient. Nested accumulates close their whole nested window, innermost
    first (the flushed window enters the next as one more micro-batch, whose
    partial window then closes): as a flush of one accumulate of their
    product.

    Args:
      tx: an :func:`accumulate`, or an :func:`chain` containing one (also
        inside a stock ``optax.chain``).
      opt_state: ``tx``'s state.
      params: the current parameters (they give the emitted dtypes).
      **extra_args: passed to the elements after the accumulation.

    Returns:
      ``(updates, opt_state)``, to be applied with
      :func:`optax.apply_updates`.

    Raises:
      ValueError: if ``tx`` holds no :func:`accumulate` that ``flush`` can
        reach: an :func:`accumulate`, an :func:`chain` or a stock
        ``optax.chain`` (nested ones included). One inside ``optax.masked``
        or ``optax.inject_hyperparams`` is out of reach: flush that inner
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
    found = _flusher(tx)
    if found is None:
        warn_if_wrapped(opt_state)
        raise ValueError(
            "oa.flush needs an oa.accumulate, or an oa.chain that contains "
            "one (also inside a stock optax.chain); got "
            f"{tx!r}. Inside another wrapper (optax.masked, "
            "optax.inject_hyperparams), flush the inner oa.chain with its "
            "part of the state: oa.flush(inner, state[i], params)"
        )
    gate_flush, declared = found
    utils.check_extra_args(extra_args, declared)
    return base.as_update(gate_flush(opt_state, params, **extra_args))


def _flusher(tx: Any) -> tuple[Any, frozenset[str]] | None:
    """The ``gate_flush`` of ``tx`` (a transformation, or the ``update`` of
    one), with the keywords it declares: a gate's own; for a stock
    ``optax.chain`` (it keeps only its elements' update functions), that of
    its first element that can flush, followed by the elements after it.
    ``None`` if there is none."""
    gate = tx if base.is_gate(tx) else getattr(tx, "_oa_gate", None)
    update: Any = getattr(tx, "update", tx)
    if gate is not None:
        if gate.gate_flush is None:
            return None
        return gate.gate_flush, utils.declared_extra_args(gate)
    try:  # optax.chain's update_fn closes over its elements' updates
        fns = inspect.getclosurevars(update).nonlocals.get("update_fns")
    except TypeError:  # not a Python function
        return None
    if not isinstance(fns, (tuple, list)) or not all(map(callable, fns)):
        return None
    for i, fn in enumerate(fns):
        found = _flusher(fn)
        if found is not None:
            return _optax_chain_flush(found[0], i, fns), found[1]
    return None


def _optax_chain_flush(inner: Any, at: int, fns: Any) -> Any:
    """The flush of a stock ``optax.chain`` whose element ``at`` flushes
    with ``inner``: the elements before it do not run (no gradient), those
    after it run on the flushed window where it opens, as on a closing
    call (they see the call's keywords but ``accum_weight``)."""
    later = tuple(fns[at + 1 :])

    def run(updates, state, params, window, extra_args):
        del window
        args = {k: v for k, v in extra_args.items() if k != "accum_weight"}
        new_state = []
        for fn, s in zip(later, state, strict=True):
            updates, s = fn(updates, s, params, **args)
            new_state.append(s)
        return updates, tuple(new_state)

    def gate_flush_fn(state, params, **extra_args):
        _check_chain_state(state, len(fns))
        res = base._as_result(inner(state[at], params, **extra_args))
        head, tail = state[:at], state[at + 1 :]
        follow = run if later else None
        return _follow(res, head, tail, follow, params, extra_args)

    return gate_flush_fn
