"""``oa.chain``: ``optax.chain`` with gates, the fused step and ``flush``.

What ``optax.chain`` holds (``chain``, its ``init``, ``flush``, the checks
of a call) and the fused step ``apply_gradients``. How one gate composes
with what follows it (its decision, the elements after it, a later gate) is
``gating.py``'s.
"""

from __future__ import annotations

import inspect
from typing import Any, Literal, cast, overload

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optaxaccum._src import base, flags, gating, keywords, windows
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
        *(keywords.declared_extra_args(tx) for tx in transforms)
    )
    gate_at = next(
        (i for i, t in enumerate(transforms) if gating.is_gate(t)), None
    )
    if gate_at is None:  # a chain without gates is optax.chain
        return _checked(optax.chain(*transforms), declared, len(transforms))
    n, head = len(transforms), gating.plain_run(transforms[:gate_at])
    gate, rest = _split(transforms[gate_at], _followers(transforms, gate_at))
    assert gating.is_gate(gate)  # for the type checker: found as a gate
    gate_declared = keywords.declared_extra_args(gate)
    plain = rest is not None and not gating.is_gate(rest)
    # Gates after the first one: the state of an earlier version that one
    # of them converts in a branch is converted before it (both branches).
    convert = rest is not None and not plain
    then = gating.rule_for(rest)  # how the gate composes with the rest
    asks_units = gating.UNWEIGHTED_ARG in declared  # oa.scale_by_window's
    scaled = windows.scales_gradients(transforms[gate_at + 1 :])

    def gate_update_fn(updates, state, params, ctx, **extra_args):
        _check_chain_state(state, n)
        if convert:
            state = windows.upgraded(state)
        window, new_head = ctx.window_weight, ()
        if asks_units and window is None and "accum_weight" not in extra_args:
            # The call weighs its micro-batch 1: tell the followers that ask.
            extra_args = {**extra_args, gating.UNWEIGHTED_ARG: True}
        if gate_at:
            # Before the gate, as optax.chain: on every call that counts
            # (not where an earlier gate refused it, nor for a window of
            # weight 0).
            updates, new_head = head(
                updates, state[:gate_at], params, window, extra_args
            )
            counts = flags.both(ctx.passed, gating.window_counts(window))
            new_head = flags.select(counts, new_head, state[:gate_at])
        # The gate decides; the elements after it run where it opens. The
        # peaks of the updates reach only the gate, and only if no element
        # before it changed the updates.
        peaks = extra_args.pop(gating.PEAKS_ARG, None)  # this call's dict
        args = extra_args  # as they are, unless some to filter or add
        if peaks is not None and not gate_at:
            args = {**extra_args, gating.PEAKS_ARG: peaks}
        if args or window is not None:
            args = gating.args_for(gate_declared, args, window)
        if scaled and gating.LOSS_SCALE_ARG in gate_declared:
            # A loss scale after the gate: the gradients come scaled by it.
            scale = windows.gradient_scale(state[gate_at + 1 :])
            args = {**args, gating.LOSS_SCALE_ARG: scale}
        res = gating.decision_of(
            gate.gate_update(updates, state[gate_at], params, ctx, **args)
        )
        _check_flags(res, gate)
        if window is not None:
            res = res.pass_window_on(window, plain)
        tail = state[gate_at + 1 :]
        return then(res, new_head, tail, rest, params, extra_args)

    if scaled or windows.scales_gradients(transforms[: gate_at + 1]):
        windows.mark_scales_gradients(gate_update_fn)  # for a chain around
    return gating.GatedTransformation(
        _init(transforms),
        keywords.with_signature(gate_update_fn, declared, gate=True),
        _flush_fn(transforms),
    )


def _split(gate: Any, rest: Any) -> tuple[Any, Any]:
    """The gate and followers the chain runs: as given, unless the gate has
    a follower hook (``shard_update``: the followers run on each device's
    piece) and followers."""
    hook = gating.followers_of(gate)
    if hook is None or rest is None:
        return gate, rest
    return hook.gate, hook.wrap(rest)


def _init(transforms: tuple) -> Any:
    """``optax.chain(*transforms).init``, except that the elements after
    the first gate with a follower hook are initialised on the params its
    hook places (``shard_update``: their state sharded like them)."""
    hooks = [gating.followers_of(tx) for tx in transforms]
    at = next((i for i, h in enumerate(hooks) if h is not None), None)
    if at is None:
        return optax.chain(*transforms).init
    hook = hooks[at]
    assert hook is not None  # for the type checker: found as a hook

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


def _check_flags(res: Any, gate: Any) -> None:
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
            if gating.is_gate(t) and t.gate_flush is not None
        ),
        None,
    )
    if flush_at is None:
        return None
    flusher, rest = _split(
        transforms[flush_at], _followers(transforms, flush_at)
    )
    assert gating.is_gate(flusher) and flusher.gate_flush is not None
    flush_fn, n = flusher.gate_flush, len(transforms)
    convert = gating.is_gate(rest)  # as in chain's update

    def gate_flush_fn(state, params, **extra_args):
        _check_chain_state(state, n)
        if convert:
            state = windows.upgraded(state)
        res = gating.decision_of(
            flush_fn(state[flush_at], params, **extra_args)
        )
        head, tail = state[:flush_at], state[flush_at + 1 :]
        res = gating.followed_by(res, head, tail, rest, params, extra_args)
        if getattr(rest, "gate_flush", None) is None:
            return res
        # Nested accumulates: the flushed window entered the next one as
        # one more micro-batch; close that one's partial window too.
        return gating.then_flush(res, rest, flush_at + 1, params, extra_args)

    return cast(base.GateFlushFn, gate_flush_fn)


def _checked(tx, declared, n):
    """``tx`` (an ``optax.chain`` of ``n``) with the state and near-miss
    checks."""

    def update_fn(updates, state, params=None, **extra_args):
        _check_chain_state(state, n)
        keywords.check_extra_args(extra_args, declared)
        return tx.update(updates, state, params, **extra_args)

    return optax.GradientTransformationExtraArgs(
        tx.init, keywords.with_signature(update_fn, declared)
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
    """The elements after position ``i``: ``None``, one gated chain, or
    their :func:`gating.plain_run` (built once). Extra arguments are
    checked where the call enters (``update``, :func:`apply_gradients`,
    :func:`flush`), not again here."""
    rest = transforms[i + 1 :]
    if not rest:
        return None
    if any(map(gating.is_gate, rest)):
        return chain(*rest)
    return gating.plain_run(rest)


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
    if not gating.is_gate(tx):
        warn_if_wrapped(opt_state)
        updates, opt_state = tx.update(grads, opt_state, params, **extra_args)
        return optax.apply_updates(params, updates), opt_state, updates
    keywords.check_extra_args(extra_args, keywords.declared_extra_args(tx))
    ctx = base.GateContext()
    result = gating.decision_of(
        tx.gate_update(grads, opt_state, params, ctx, **extra_args)
    )
    if not with_updates:
        return _apply(result, params, None)
    args = (grads, opt_state, params, extra_args)
    return _apply(result, params, (gating.emitted_shapes(tx), args))


def _apply(res: Any, params, updates_like: tuple | None):
    """The step of a gate's decision ``res``: ``params`` with its updates
    applied where it opens, untouched where it stays closed; the updates
    too where ``updates_like`` is ``(shapes, args)``: the emitted shapes
    of the gate (:func:`gating.emitted_shapes`) and the call's arguments,
    which shape the zeros of a call that stays closed."""

    selected = []  # whether the emission decided once more (a traced flag)

    def opened():
        updates, state, flag, *_ = res.emission()
        selected.append(flag is not True)
        new_params = optax.apply_updates(params, updates)
        new_params = flags.select(flag, new_params, params)
        updates = None if updates_like is None else flags.mask(flag, updates)
        return new_params, state, updates

    def closed():
        if updates_like is None:  # nothing to shape: opened is not traced
            return params, res.state, None
        shapes, args = updates_like
        like = shapes.find(args, lambda: jax.eval_shape(opened)[2])
        return params, res.state, flags.zeros_of(like)

    def order(out, in_loop):
        # The optimizer's moments after the new params only where the step
        # selects its old state back (a dropped window): there it saves a
        # copy; elsewhere it splits the optimizer's pass in two.
        moments = in_loop and selected[-1]
        state = flags.ordered_after(out[1], out[0], moments=moments)
        return out[0], state, out[2]

    return flags.loop_or_call(res.may_open, opened, closed, order)


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
    keywords.check_extra_args(extra_args, declared)
    return gating.decision_of(
        gate_flush(opt_state, params, **extra_args)
    ).as_update()


def _flusher(tx: Any) -> tuple[Any, frozenset[str]] | None:
    """The ``gate_flush`` of ``tx`` (a transformation, or the ``update`` of
    one), with the keywords it declares: a gate's own; for a stock
    ``optax.chain`` (it keeps only its elements' update functions), that of
    its first element that can flush, followed by the elements after it.
    ``None`` if there is none."""
    gate = tx if gating.is_gate(tx) else getattr(tx, "_oa_gate", None)
    update: Any = getattr(tx, "update", tx)
    if gate is not None:
        if gate.gate_flush is None:
            return None
        return gate.gate_flush, keywords.declared_extra_args(gate)
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
        res = gating.decision_of(inner(state[at], params, **extra_args))
        head, tail = state[:at], state[at + 1 :]
        follow = run if later else None
        return gating.followed_by(res, head, tail, follow, params, extra_args)

    return gate_flush_fn
