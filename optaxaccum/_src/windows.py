"""Questions about an accumulation window, asked of a (nested) chain state.

A *window state* is a state class with ``mini_step``, ``gradient_step``
and ``updated`` that sets the class attribute ``_holds_window = True``
(:class:`AccumulateState`, :class:`MultiStepsState`): this module finds
them without importing the modules that define them, so the combinator
(``chain.py``) and the layers above (``optaxaccum.flax``) depend on it and
not on a gate module.

Whether a call counted (:func:`counted`) and whether it closed the
optimizer's window (:func:`closed`) are derived from the states before and
after the call, not stored in them: a lazy gate (one of the user's) that
does not run leaves its followers' states bit-for-bit unchanged (the
chain's contract), so a stored "counted" flag could not be cleared on a
call that it refused. "The window's position or count moved" is exactly
"the call counted". The ``updated`` flag is the one field that every call
reaching the window sets, a dropped one included (to false); a gate after
the window that drops it (a loss scale checking once per window) clears it
and takes back the window's ``optimizer_step`` (:func:`refused`).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

__all__ = [
    "closed",
    "counted",
    "gradient_scale",
    "has_updated",
    "optimizer_step",
    "refused",
    "warn_if_wrapped",
    "window_updated",
]


def _is_window(x: Any) -> bool:
    return getattr(type(x), "_holds_window", False) is True


def _find_window(state: Any, caller: str) -> Any:
    """The first (outermost, leftmost) window state inside ``state``."""
    return find_state(
        state, _is_window, caller, "AccumulateState or MultiStepsState"
    )


def has_updated(state: optax.OptState) -> jax.Array:
    """Whether the last call that reached the accumulation stepped the
    optimizer (closed the whole window).

    A micro-batch dropped right after a closing call (``skip_nonfinite``,
    an overflow of the loss scale, ``oa.MultiSteps``' skip function) did
    not step it: false there, so a loop that counts windows with it counts
    each once. A window dropped after it closed (by a loss scale after the
    accumulate, or by an ``optax.apply_if_finite`` around the optimizer,
    that found it non-finite) did not step it either: false. (A call
    that a lazy gate of your own refuses before the accumulate does not
    reach it, and leaves the answer as it was.)

    With nested accumulates (``oa.chain(oa.accumulate(a),
    oa.accumulate(b), opt)``) it answers as one ``oa.accumulate(a * b)``
    would: true only where every window closed, not where an inner one did.

    Args:
      state: the state of an :func:`accumulate`, or of any (nested) chain
        containing one (the ``opt_state`` of an ``nnx.Optimizer``
        included).

    Returns:
      A boolean scalar array (a plain ``jax.Array``): true if the most
      recent call that reached the :func:`accumulate` closed its window and
      stepped the elements after the last accumulate; false where it was
      dropped.

    Raises:
      ValueError: if ``state`` holds no :class:`AccumulateState`.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> import optaxaccum as oa
      >>> tx = oa.chain(oa.accumulate(2), optax.sgd(1.0))
      >>> state = tx.init(jnp.zeros(1))
      >>> _, state = tx.update(jnp.ones(1), state)
      >>> bool(oa.has_updated(state))
      False
    """
    warn_if_wrapped(state)
    _find_window(state, "oa.has_updated")  # raises if there is none
    # Every nested window closed on the call: a later accumulate is reached
    # only where those before it closed, and a call that does not reach it
    # leaves its flag as it was. An optax.apply_if_finite after the window
    # did not step its optimizer on a window it found non-finite.
    flags = [window_updated(s) for s in _window_states(state)]
    flags += [jnp.asarray(s.last_finite, bool) for s in _finite_checks(state)]
    return functools.reduce(jnp.logical_and, flags[1:], flags[0])


def optimizer_step(state: optax.OptState) -> jax.Array:
    """How many times the optimizer (the elements after the accumulate)
    has stepped.

    The closed windows that were not dropped: a window that a loss scale
    after the accumulate (``oa.chain(oa.accumulate(k),
    oa.dynamic_loss_scale(), opt)``) or an ``optax.apply_if_finite`` around
    the optimizer found non-finite, or one of total weight 0, does not
    count; a window closed by :func:`flush` does. With nested accumulates,
    the count of their whole window. When the state's ``step`` counts
    micro-batches (a Flax ``TrainState``), this is the step to give a
    learning-rate schedule or a log (docs/concepts.md, "Counting steps").

    Args:
      state: the state of an :func:`accumulate`, of an :class:`MultiSteps`,
        or of any (nested) chain containing one (the ``opt_state`` of a
        Flax ``TrainState`` or of an ``nnx.Optimizer`` included).

    Returns:
      An int32 scalar array.

    Raises:
      ValueError: if ``state`` holds no :class:`AccumulateState` or
        :class:`MultiStepsState`.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> import optaxaccum as oa
      >>> tx = oa.chain(oa.accumulate(2), optax.sgd(1.0))
      >>> state = tx.init(jnp.zeros(1))
      >>> for _ in range(5):
      ...   _, state = tx.update(jnp.ones(1), state)
      >>> int(oa.optimizer_step(state))   # two windows of two
      2
    """
    warn_if_wrapped(state)
    _find_window(state, "oa.optimizer_step")  # raises if there is none
    # The last (innermost) window state: of nested accumulates, the one
    # whose window is the whole window (the optimizer follows it).
    found = _window_states(state)[-1]
    count = getattr(found, "optimizer_step", None)
    if count is None:  # oa.MultiSteps (a state of an earlier version)
        count = found.gradient_step
    count = jnp.asarray(count, jnp.int32)
    for check in _finite_checks(state):  # windows it did not step on
        count = count - jnp.asarray(check.total_notfinite, jnp.int32)
    return count


def _finite_checks(state: Any) -> list[Any]:
    """The states of the ``optax.apply_if_finite`` wrappers that follow the
    first window state of ``state`` (after it in the state's order, none
    inside them): they see each window once."""

    def node(x):
        return _is_window(x) or isinstance(x, optax.ApplyIfFiniteState)

    found, seen_window = [], False
    for s in jax.tree.leaves(state, is_leaf=node):
        if _is_window(s):
            seen_window = True
        elif isinstance(s, optax.ApplyIfFiniteState) and seen_window:
            inside = jax.tree.leaves(tuple(s), is_leaf=_is_window)
            if not any(map(_is_window, inside)):
                found.append(s)
    return found


def refused(
    closed_state: Any, emitted: Any, stepped: Any, old_tail: Any, new_tail: Any
) -> Any:
    """A closing gate's emitted state ``emitted`` after the gates that
    follow it decided (their states went from ``old_tail`` to
    ``new_tail``): where they dropped the window (``stepped`` false and no
    window among them counted it: a loss scale refused it), each window
    state in it says so (``updated`` false, its ``optimizer_step`` as in
    ``closed_state``, the gate's state where it stays closed); the rest of
    the emitted state (the zeroed accumulator) stays. A window that a later
    accumulate counted was not dropped: nested accumulates answer together
    (:func:`has_updated`, :func:`optimizer_step`)."""
    if stepped is True:
        return emitted
    later = list(zip(_window_states(old_tail), _window_states(new_tail)))
    stepped = functools.reduce(
        jnp.logical_or, [_moved(old, new) for old, new in later], stepped
    )

    def one(e, c):
        if not _is_window(e):
            return e
        kept = {}
        if getattr(e, "updated", None) is not None:
            kept["updated"] = jnp.logical_and(e.updated, stepped)
        if getattr(e, "optimizer_step", None) is not None:
            kept["optimizer_step"] = jnp.where(
                stepped, e.optimizer_step, c.optimizer_step
            )
        return e._replace(**kept)

    return jax.tree.map(one, emitted, closed_state, is_leaf=_is_window)


# Set on a loss scale's update (or gate_update) function: the gradients
# before it come multiplied by its state's ``scale``.
SCALES_GRADIENTS = "_oa_scales_gradients"


def scales_gradients(transforms: Any) -> bool:
    """Whether one of ``transforms`` (a chain's elements) is a loss scale,
    or a chain holding one: known when the chain is built, so that a chain
    without one reads no state for it (:func:`gradient_scale`)."""
    for t in transforms:
        fns = (getattr(t, "update", None), getattr(t, "gate_update", None))
        if any(getattr(f, SCALES_GRADIENTS, False) for f in fns):
            return True
    return False


def mark_scales_gradients(fn: Any) -> Any:
    """``fn`` (an update or gate_update function) marked as a loss scale's
    (:func:`scales_gradients`)."""
    fn.__dict__[SCALES_GRADIENTS] = True
    return fn


def gradient_scale(states: Any) -> Any:
    """The factor by which the gradients entering a gate are multiplied,
    given the states of the elements after it (``states``): the ``scale``
    of the first loss-scale state among them (a class that sets
    ``_scales_gradients = True``; it divides the scale out later), or
    ``None``."""

    def scales(x):
        return getattr(type(x), "_scales_gradients", False) is True

    for s in jax.tree.leaves(states, is_leaf=scales):
        if scales(s):
            return s.scale
    return None


def window_updated(found: Any) -> jax.Array:
    """One window state's own flag as a plain boolean array (``updated``,
    or optax's rule for a state without it, e.g. optax's
    ``MultiStepsState``); wrapped leaves (an ``nnx`` variable) unwrapped."""
    if getattr(found, "updated", None) is None:
        return optax_has_updated(found.mini_step, found.gradient_step)
    return jnp.asarray(found.updated, bool)


def _window_states(state: Any) -> list[Any]:
    """Every window state inside ``state``, outermost first, those inside a
    window state included (an accumulate inside ``oa.MultiSteps``)."""
    found = []
    for s in jax.tree.leaves(state, is_leaf=_is_window):
        if _is_window(s):
            found += [s, *_window_states(tuple(s))]
    return found


def _moved(old: Any, new: Any) -> jax.Array:
    """Whether one window state counted the call that turned ``old`` into
    ``new`` (its position or its window count moved)."""
    return (new.mini_step != old.mini_step) | (
        new.gradient_step != old.gradient_step
    )


def counted(old_state: optax.OptState, new_state: optax.OptState) -> Any:
    """Whether the outermost accumulate of a chain took the call that turned
    ``old_state`` into ``new_state`` into its window (``True`` when the state
    holds no window: every call counts).

    The core's one answer to "did this micro-batch count" (the Flax layers
    keep their BatchNorm windows aligned with it). :func:`has_updated` cannot
    tell: it is false on a dropped call, as on a counted call that does not
    close the window.
    """
    try:
        old = _find_window(old_state, "counted")
    except ValueError:
        return True
    return _moved(old, _find_window(new_state, "counted"))


def closed(old_state: optax.OptState, new_state: optax.OptState) -> Any:
    """Whether the call that turned ``old_state`` into ``new_state`` closed
    the optimizer's window: every window state of the (nested) chain counted
    it and is back at position 0 (the last of nested accumulates is reached
    only where those before it closed). ``False`` when the state holds no
    window (the caller keeps its own window length).

    The Flax layers close their BatchNorm windows on it, so that these
    follow any window length (a callable ``every_k`` included).

    Args:
      old_state: the optimizer's state before the call.
      new_state: its state after the call.

    Returns:
      A boolean scalar array, or the literal ``False`` (no window state).

    Example:
      >>> import jax.numpy as jnp, optax
      >>> import optaxaccum as oa
      >>> from optaxaccum._src import windows
      >>> tx = oa.chain(oa.accumulate(2), optax.sgd(1.0))
      >>> s0 = tx.init(jnp.zeros(1))
      >>> _, s1 = tx.update(jnp.ones(1), s0)
      >>> _, s2 = tx.update(jnp.ones(1), s1)
      >>> bool(windows.closed(s0, s1)), bool(windows.closed(s1, s2))
      (False, True)
    """
    found = _window_states(old_state)
    if not found:
        return False
    flags = [
        _moved(old, new) & (new.mini_step == 0)
        for old, new in zip(found, _window_states(new_state), strict=True)
    ]
    return functools.reduce(jnp.logical_and, flags)


# optax wrappers that count their own calls: around a gated chain they count
# micro-batches, not windows.
_COUNTING_WRAPPERS = (
    optax.InjectHyperparamsState,
    optax.InjectStatefulHyperparamsState,
    optax.LookaheadState,
    optax.MultiStepsState,
)


def warn_if_wrapped(state: Any) -> None:
    """Warns when a window state sits inside the state of an optax wrapper
    that counts every call (``inject_hyperparams``, ``lookahead``,
    ``MultiSteps``): its schedule, sync or count advances once per
    micro-batch instead of once per window."""

    def wrapper(x):
        return isinstance(x, _COUNTING_WRAPPERS)

    for outer in jax.tree.leaves(state, is_leaf=wrapper):
        if not wrapper(outer):
            continue
        inside = jax.tree.leaves(tuple(outer), is_leaf=_is_window)
        if any(map(_is_window, inside)):
            warnings.warn(
                f"an optax wrapper ({type(outer).__name__}) holds an "
                "oa.accumulate: the wrapper counts every call (every "
                "micro-batch), not every window, so its schedule, sync or "
                "step count runs k times too fast. Put the wrapper inside "
                "the oa.chain, after the accumulate: oa.chain(oa.accumulate"
                "(k), optax.inject_hyperparams(optax.sgd)(learning_rate="
                "schedule)). See docs/concepts.md, 'Where wrappers go'.",
                UserWarning,
                stacklevel=3,
            )
            return


# The state types whose earlier layout :func:`upgraded` converts: type ->
# (whether a state of it has the earlier layout, its conversion).
# accumulate.py and multisteps.py add theirs (this module imports neither).
EARLIER_LAYOUTS: dict[type, tuple[Callable[[Any], bool], Callable]] = {}


def upgraded(state: Any) -> Any:
    """``state`` (an optimizer state) with each state of an earlier version
    in it converted as this version keeps it. A chain converts its state
    before it branches: a state that one branch converts (a nested
    accumulate's) and the other passes on must have one tree.

    Looks through plain tuples (the states of ``oa.chain`` and
    ``optax.chain``, nested), where a gate's state sits in a chain's; not
    into other states, whose leaves it would only walk.

    Args:
      state: an optimizer state.

    Returns:
      ``state`` itself if nothing in it has an earlier layout, else
      ``state`` with those converted.

    Examples:
      >>> import jax.numpy as jnp
      >>> import optaxaccum as oa
      >>> from optaxaccum._src import windows
      >>> old = oa.accumulate(2).init(jnp.zeros(1))._replace(weight_low=None)
      >>> windows.upgraded((old,))[0].weight_low
      Array(0., dtype=float32)
    """
    known = EARLIER_LAYOUTS.get(type(state))
    if known is not None:
        is_earlier, conversion = known
        return conversion(state) if is_earlier(state) else state
    if type(state) is not tuple:
        return state
    parts = tuple(upgraded(s) for s in state)
    same = all(p is s for p, s in zip(parts, state))
    return state if same else parts


def find_state(
    state: Any,
    kind: type | tuple[type, ...] | Callable[[Any], bool],
    caller: str,
    names: str = "",
) -> Any:
    """The first (outermost, leftmost) node of ``state`` of ``kind``.

    Args:
      state: a (nested) optimizer state.
      kind: a class, a tuple of classes, or a predicate of a node.
      caller: the function asking, for the message.
      names: what the message calls the nodes sought (default: the names
        of the classes of ``kind``).

    Returns:
      The first node found, in ``jax.tree.leaves`` order.

    Raises:
      ValueError: naming ``caller`` if there is none.
    """
    if isinstance(kind, (type, tuple)):
        classes = kind if isinstance(kind, tuple) else (kind,)
        names = names or " or ".join(c.__name__ for c in classes)
        match = lambda x: isinstance(x, classes)  # noqa: E731
    else:
        match = kind
    for node in jax.tree.leaves(state, is_leaf=match):
        if match(node):
            return node
    raise ValueError(
        f"{caller} found no {names} in the state given "
        f"({jax.tree.structure(state)})"
    )


def optax_has_updated(mini_step: Any, gradient_step: Any) -> jax.Array:
    """optax's ``MultiSteps.has_updated`` rule, for states without an
    ``updated`` flag: the window position is 0 after at least one step."""
    return (jnp.asarray(mini_step) == 0) & (jnp.asarray(gradient_step) > 0)
