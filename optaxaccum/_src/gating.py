"""The gate's inner workings: what a gate decided, and how the chain composes
one gate with what follows it.

A gate (:class:`GatedTransformation`) is a transformation plus a decision.
Inside the package a decision is a :class:`Decision`, whose ``emit`` gives an
:class:`Emission`: the public :class:`~optaxaccum.GateResult` and
:class:`~optaxaccum.Emitted` with the window bookkeeping that only
:func:`optaxaccum.accumulate` and the chain exchange. A gate's decision
composes with the elements after it by the rule :func:`rule_for` picks from
what they are (once per chain; :func:`followed_by` picks and applies it):

* nothing: :func:`with_head` (the states of the elements before it join);
* plain transformations: :func:`then_plain`, which runs them where the gate
  opens;
* a later gate: :func:`then_gate`. After an eager gate (its emission costs
  nothing), one decision for both (:func:`merge_eager`), so the step still
  branches once; after a lazy one, the later gate decides only where this
  one opened or closed an empty window (:meth:`Decision.to_next_gate`,
  :func:`through_gate`).

The keywords each element sees are :func:`args_for`'s rule; the plain
followers run through :func:`plain_run`. ``docs/gates.md`` teaches the public
protocol; the rules here keep it.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, NamedTuple, TypeGuard, cast

import jax
import jax.numpy as jnp
import optax

from optaxaccum._src import base, flags, keywords, windows
from optaxaccum._src.base import GateFlushFn, GateUpdateFn

__all__ = ["GatedTransformation", "is_gate"]


class Emission(NamedTuple):
    """What a gate emits where it opens: an :class:`~optaxaccum.Emitted`
    with the window bookkeeping."""

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
    # base.WINDOW_NOISE_ARG by name get it (oa.scale_by_window).
    noise: Any = None
    # The largest magnitude of each leaf of ``updates`` (numerics.peaks), where
    # the gate knows them from what it holds (a window's loss scale after
    # it asked), or None: a later gate that checks finiteness reads them,
    # not the updates (a second reader of the updates keeps them in memory).
    peaks: Any = None

    @classmethod
    def of(cls, value: Any) -> Emission:
        """A gate's emission (an :class:`~optaxaccum.Emitted`, an
        :class:`Emission` or a plain tuple) as an :class:`Emission`."""
        if isinstance(value, Emission):
            return value
        if isinstance(value, base.Emitted):
            return cls(updates=value.updates, state=value.state)
        return cls(*value)

    @classmethod
    def shut(cls, shapes: Any, state: Any, *, opened: Any, passed: Any):
        """The emission of a branch that does not step the followers: zero
        updates and window weight shaped as in ``shapes`` (an emission's
        shapes), ``state``, ``opened`` and ``passed`` as given."""
        updates, weight, noise, peaks = flags.zeros_of(
            (shapes.updates, shapes.window_weight, shapes.noise, shapes.peaks)
        )
        return cls(
            updates=updates,
            state=state,
            opened=opened,
            window_weight=weight,
            passed=passed,
            noise=noise,  # as the branch that opens gives it (no step reads it)
            peaks=peaks,
        )

    def with_flags(self) -> Emission:
        """This emission with ``opened`` and ``passed`` as bool arrays (as
        a branch of ``lax.cond`` must return them)."""
        return self._replace(
            opened=jnp.asarray(self.opened, bool),
            passed=jnp.asarray(self.passed, bool),
        )


# The leaves besides arrays that a key of EmittedShapes holds by value.
_PLAIN_LEAVES = (bool, int, float, complex, str)


class EmittedShapes:
    """The shapes of the updates a gate's plain ``update`` emits, by the
    types of the call's arguments: a call that stays closed builds its
    zeros from them instead of tracing the work it skips (an un-jitted
    micro-step would trace the optimizer on every call). At most
    ``size`` entries; the oldest goes first."""

    def __init__(self, size: int = 16):
        self.size = size
        self._kept: dict[Any, Any] = {}

    def __reduce__(self):  # a copy or a pickle starts empty
        return (EmittedShapes, (self.size,))

    @staticmethod
    def key(args: Any) -> Any:
        """What the emitted shapes depend on: the tree of ``args``, the
        type of each array leaf (shape, dtype, weak type, sharding,
        device-varying axes), the value of each Python number or string,
        the mesh in context and x64. ``None`` (nothing is kept) where
        another leaf is there (a function, e.g. a linesearch's
        ``value_fn``: a key would keep it, and what it closes over, alive)
        or a node cannot be hashed."""
        leaves, treedef = jax.tree.flatten(args)
        types = []
        try:
            for x in leaves:
                if hasattr(x, "dtype"):
                    types.append(jax.typeof(x))
                elif type(x) in _PLAIN_LEAVES:
                    types.append((type(x), x))
                else:
                    return None
            key = (
                treedef,
                tuple(types),
                jax.sharding.get_abstract_mesh(),
                jax.dtypes.canonicalize_dtype(jnp.float64),  # x64 on?
            )
            hash(key)
        except (TypeError, ValueError):
            return None
        return key

    def find(self, args: Any, trace: Callable[[], Any]) -> Any:
        """The shapes kept for a call with ``args``; else ``trace()``'s,
        kept."""
        key = self.key(args)
        like = self.get(key)
        if like is None:
            like = trace()
            self.put(key, like)
        return like

    def get(self, key: Any) -> Any:
        return None if key is None else self._kept.get(key)

    def put(self, key: Any, shapes: Any) -> None:
        if key is None:
            return
        if len(self._kept) >= self.size:
            self._kept.pop(next(iter(self._kept)))
        self._kept[key] = shapes


class Decision(NamedTuple):
    """What a gate decided on one call: a :class:`~optaxaccum.GateResult`
    with the window bookkeeping. Its ``emit`` gives an :class:`Emission`
    (or an :class:`~optaxaccum.Emitted`)."""

    state: Any
    may_open: Any
    emit: Any  # () -> Emission, or the Emission itself (eager)
    # The call closed a window of weight 0 (may_open is false): the
    # followers do not step, but a later gate counts it as one call of
    # weight 0. emit is not called for it: state is the gate's state then.
    empty: Any = False
    # A later gate's decision on this one's emission is a branch
    # (lax.cond), not both computed and a select: this gate opens on few of
    # the calls it sees (an accumulate: once per window).
    branches: bool = False
    # Where the emission's ``opened`` is traced, the plain followers' step
    # is a branch, not both computed and a select: their state lies in
    # per-device pieces (a sharded update), so the branch's copy of it is a
    # piece while a select would pass over the whole updates.
    followers_branch: bool = False

    @classmethod
    def of(cls, result: Any) -> Decision:
        """A gate's result (a :class:`~optaxaccum.GateResult` or a
        :class:`Decision`) as a :class:`Decision`: the one place where the
        chain reads what a gate decided."""
        if isinstance(result, Decision):
            return result
        state, may_open, emit = result
        return cls(state=state, may_open=may_open, emit=emit)

    def emission(self) -> Emission:
        """The emission (calling ``emit`` if it is lazy)."""
        out = self.emit() if callable(self.emit) else self.emit
        return out if isinstance(out, Emission) else Emission.of(out)

    def then(self, fn: Callable[[Emission], Emission]) -> Decision:
        """This decision with ``fn`` applied to its emission: at once if it
        is eager (it stays eager), else when it is emitted."""
        emit = self.emit
        if callable(emit):
            return self._replace(emit=lambda: fn(Emission.of(emit())))
        return self._replace(emit=fn(Emission.of(emit)))

    def as_update(
        self, shapes: EmittedShapes | None = None, args: Any = None
    ) -> tuple[optax.Updates, Any]:
        """The plain ``(updates, state)`` of ``update``: zeros with the
        structure, shapes and dtypes of the emitted updates where the gate
        stays closed (or opens but does not let the followers run). Those
        are ``shapes``' entry for the call's arguments ``args`` where it
        has one; else the emission is traced (``jax.eval_shape``) to find
        them, and kept."""

        def opened():
            out = self.emission()
            return flags.mask(out.opened, out.updates), out.state

        def closed():
            def trace():
                return jax.eval_shape(opened)[0]

            like = trace() if shapes is None else shapes.find(args, trace)
            return flags.zeros_of(like), self.state

        def order(out, in_loop):
            state = flags.ordered_after(out[1], out[0], moments=False)
            return out[0], state

        return flags.loop_or_call(self.may_open, opened, closed, order)

    def pass_window_on(self, window: Any, plain: bool) -> Decision:
        """A gate that closes no window of its own (a loss scale, a user's
        gate) passes an earlier accumulate's window weight ``window`` (not
        ``None``) on to its followers: a later accumulate weighs the window
        by it (and counts one of weight 0), and ``plain`` followers do not
        step on a window of weight 0 (docs/concepts.md)."""

        def inherit(out: Emission) -> Emission:
            if out.window_weight is not None:  # the gate closed its own window
                return out
            out = out._replace(window_weight=window)
            if plain:  # they do not step on a window of weight 0
                out = out._replace(
                    opened=flags.both(out.opened, window_counts(window))
                )
            return out

        return self.then(inherit)

    def to_next_gate(self) -> Emission:
        """What a later gate receives where this gate opens or closed an
        empty window (``empty``): its emission where it opens; for the empty
        window, one call of weight 0 from the closed ``state``, ``opened``
        false (``emit`` is not called: followers it holds would step on the
        window). ``passed`` stays the literal ``True`` where the emission's
        is: it crosses the branch as ``None`` (no leaf)."""
        if self.empty is False:
            return self.emission()

        def opened():
            out = self.emission()
            flags = out.with_flags()
            return flags._replace(passed=None) if out.passed is True else flags

        def empty(like):
            true = None if like.passed is None else jnp.asarray(True)
            false = jnp.asarray(False)
            return Emission.shut(like, self.state, opened=false, passed=true)

        out = flags.select_or_call(self.may_open, opened, empty)
        return out._replace(passed=True if out.passed is None else out.passed)


class Followers(NamedTuple):
    """A gate's hook for where :func:`optaxaccum.chain` runs the elements
    after it (``shard_update``: on each device's piece)."""

    gate: GatedTransformation  # what the chain runs in the gate's place
    wrap: Callable[[Any], Any]  # the followers -> the followers, placed
    place: Callable[[Any], Any]  # params -> the followers' init params
    # (followers, params) -> their states, where they are not each
    # initialised on ``place(params)``
    init: Callable[[Any, Any], tuple] | None = None


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
    _followers: Followers | None  # where the chain runs the followers
    _shapes: EmittedShapes  # of the updates its calls emitted

    def __new__(
        cls,
        init: optax.TransformInitFn,
        gate_update: GateUpdateFn,
        gate_flush: GateFlushFn | None = None,
    ):
        _check_takes_ctx(gate_update)
        # The plain update declares what gate_update takes by name, so that
        # chains can tell a near-miss keyword (``acum_weight``) from others.
        names = keywords.declared_extra_args(gate_update, skip=4)

        def update_fn(updates, state, params=None, **extra_args):
            if extra_args:  # near-misses (none to find without keywords)
                keywords.check_extra_args(extra_args, names)
            ctx = base.GateContext()
            res = gate_update(updates, state, params, ctx, **extra_args)
            args = (updates, state, params, extra_args)
            # Read through the transformation, not a closure: a copy keeps
            # one cache for its update and its fused step.
            shapes = update_fn.__dict__["_oa_gate"]._shapes
            return Decision.of(res).as_update(shapes, args)

        self = super().__new__(
            cls, init, keywords.with_signature(update_fn, names)
        )
        self.gate_update = gate_update
        self.gate_flush = gate_flush
        self._followers = None
        self._shapes = EmittedShapes()
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
        signature.bind(None, None, None, base.GateContext(), **required)
    except TypeError as e:
        raise TypeError(
            "gate_update must take (updates, state, params, ctx, "
            f"**extra_args), ctx an oa.GateContext; {gate_update!r} has "
            f"the signature {signature} ({e}). See docs/gates.md."
        ) from None


def with_followers(
    tx: GatedTransformation, hook: Followers | None
) -> GatedTransformation:
    """``tx`` with the follower hook ``hook`` (kept by pytree round trips,
    copies and pickles)."""
    tx._followers = hook
    return tx


def emitted_shapes(tx: GatedTransformation) -> EmittedShapes:
    """The shapes of the updates ``tx``'s calls emitted, by their
    arguments' types."""
    return tx._shapes


def followers_of(tx: Any) -> Followers | None:
    """The follower hook of ``tx``, or ``None`` (not a gate, or none)."""
    return getattr(tx, "_followers", None) if is_gate(tx) else None


def _flatten_gate(tx: GatedTransformation):
    aux = (tx.gate_update, tx.gate_flush, tx._followers)
    return (tx.init, tx.update), aux


def _unflatten_gate(aux, children) -> GatedTransformation:
    init, _ = children  # update is derived from gate_update again
    gate_update, gate_flush, hook = aux
    return with_followers(
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


# A gate's result (a GateResult or a Decision) as a Decision: the chain's
# one entry to the records (chain.py names none of them; test_layering).
decision_of = Decision.of


# ------------------------------------------------- keywords and plain runs

# The keyword under which a plain follower that declares it by name learns
# (at trace time) that the call passed no accum_weight: its window's weight
# then counts micro-batches (oa.scale_by_window warns). The outermost chain
# sets it; oa.flush does not (it passes no weight of its own).
UNWEIGHTED_ARG = "window_unweighted"

# The keyword under which a gate that declares it by name (an accumulate)
# learns the scale of its gradients: that of a loss scale after it in the
# chain, which divides it out of the window (its noise scale does too).
LOSS_SCALE_ARG = "window_loss_scale"
# The keyword under which a gate right after another one gets the peaks of
# its updates (Emission.peaks) if it declares it by name.
PEAKS_ARG = "window_peaks"


def args_for(
    declared: frozenset[str], extra_args: dict[str, Any], window: Any
) -> dict[str, Any]:
    """The keywords an element that declares ``declared`` by name sees:
    exactly the call's, except the accumulate's own keyword
    ``accum_weight`` and the window's noise estimates
    (``base.WINDOW_NOISE_ARG``, put among ``extra_args`` by
    :func:`then_plain`): only an element that declares one by name gets
    it, ``accum_weight`` then as the total weight ``window`` of an earlier
    accumulate's window where there is one (even if the call passed none).
    No other keyword reaches it: optax's linesearches hand unknown keywords
    to ``value_fn``."""
    args = extra_args
    private = (base.WINDOW_NOISE_ARG, UNWEIGHTED_ARG, LOSS_SCALE_ARG, PEAKS_ARG)
    for k in ("accum_weight", *private):
        if k in args and k not in declared:
            args = {n: v for n, v in args.items() if n != k}
    if window is None or "accum_weight" not in declared:
        return args
    return {**args, "accum_weight": window}


def plain_run(transforms: tuple) -> Callable[..., Any]:
    """``optax.chain(*transforms)``'s update (no gates among them) as
    ``run(updates, state, params, window, extra_args)``, where ``window`` is
    the total weight of an accumulate's window before them (or ``None``).
    Its ``transforms`` attribute holds them."""
    txs = [optax.with_extra_args_support(t) for t in transforms]
    names = [keywords.declared_extra_args(tx) for tx in txs]

    def run(updates, state, params, window, extra_args):
        new_state = []
        for tx, declared, s in zip(txs, names, state, strict=True):
            args = extra_args  # as they are, unless some to filter or add
            adds = window is not None and "accum_weight" in declared
            if extra_args or adds:
                args = args_for(declared, extra_args, window)
            updates, s = tx.update(updates, s, params, **args)
            new_state.append(s)
        return updates, tuple(new_state)

    setattr(run, "transforms", tuple(transforms))  # noqa: B010 (for pyright)
    return run


def window_counts(window: Any) -> Any:
    """Whether a call standing for an earlier window of total weight
    ``window`` counts: the window's weight is not 0 (``True`` if there is
    no such window)."""
    return True if window is None else window != 0


# ------------------------------------------------- one gate, then the rest


def followed_by(
    res: Decision,
    head: tuple,
    tail_state: tuple,
    rest: Any,
    params: optax.Params | None,
    extra_args: dict[str, Any],
) -> Decision:
    """The decision of a gate (``res``) followed by the elements after it
    (``rest``: ``None``, a :func:`plain_run`, or a gate; their states
    ``tail_state``), with the states of those before it (``head``): by the
    rule :func:`rule_for` ``rest``."""
    rule = rule_for(rest)
    return rule(res, head, tail_state, rest, params, extra_args)


def rule_for(rest: Any) -> Callable[..., Decision]:
    """The rule that composes a gate's decision with the elements after it,
    ``rest`` (``None``, a :func:`plain_run`, or a gate): :func:`with_head`,
    :func:`then_plain` or :func:`then_gate`. Static: :func:`optaxaccum.chain`
    picks it once."""
    if rest is None:
        return with_head
    return then_gate if isinstance(rest, GatedTransformation) else then_plain


def with_head(res, head, tail_state, rest, params, extra_args) -> Decision:
    """A last gate's decision (nothing after it: no ``tail_state``,
    ``rest``) with the states of the elements before it (``head``) in front
    of its own: an eager gate stays eager."""
    del tail_state, rest, params, extra_args

    def prepend(out: Emission) -> Emission:
        return out._replace(state=(*head, out.state))

    return res.then(prepend)._replace(state=(*head, res.state))


def then_plain(res, head, tail_state, rest, params, extra_args) -> Decision:
    """A gate, then plain followers (``rest``, a :func:`plain_run`): they
    run on its emission where it opens and the emission says ``opened``
    (elsewhere: zeros, their states as they were). The window's weight and
    ``passed`` go on to an enclosing gate; its noise scale estimates go
    with the call's keywords, for the followers that ask for them
    (:func:`args_for`). An empty window passes on as it came: the followers
    do not step on it; an enclosing gate counts it
    (:meth:`Decision.to_next_gate`)."""
    state = (*head, res.state, *tail_state)

    def emit():
        out, args = res.emission(), extra_args
        if out.noise is not None:
            args = {**args, base.WINDOW_NOISE_ARG: out.noise}
        run = functools.partial(
            rest, out.updates, tail_state, params, out.window_weight, args
        )

        def skip(like):
            return flags.zeros_of(like[0]), tail_state

        if res.followers_branch:
            updates, tail = flags.cond_or_call(
                out.opened, run, lambda: skip(jax.eval_shape(run))
            )
        else:
            updates, tail = flags.select_or_call(out.opened, run, skip)
        return out._replace(updates=updates, state=(*head, out.state, *tail))

    return res._replace(state=state, emit=emit)


def then_gate(res, head, tail_state, rest, params, extra_args) -> Decision:
    """A gate, then a later gate (``rest``): after an eager gate, one
    decision for both (:func:`merge_eager`); after a lazy one, the later
    gate decides only where this one opens or closes a window of weight 0
    (which it counts as one call)."""
    if not callable(res.emit):  # an eager gate, then a gate
        return merge_eager(res, head, tail_state, rest, params, extra_args)
    state = (*head, res.state, *tail_state)

    def emit():
        out = res.to_next_gate()
        extra = extra_args
        if out.peaks is not None:
            extra = {**extra_args, PEAKS_ARG: out.peaks}
        args = args_for(
            keywords.declared_extra_args(rest), extra, out.window_weight
        )
        e = through_gate(out, tail_state, rest, params, args)
        # Where the later gates did not step (a loss scale dropped the
        # window), this gate's windows say so.
        own = windows.refused(
            res.state, out.state, e.opened, tail_state, e.state
        )
        return e._replace(state=(*head, own, *e.state))

    may_open = flags.either(res.may_open, res.empty)
    return Decision(
        state=state,
        may_open=may_open,
        emit=emit,
        branches=res.branches,
        followers_branch=res.followers_branch,
    )


def through_gate(out, tail_state, rest, params, args) -> Emission:
    """The emission ``out`` after a later gate ``rest`` decided on it in
    turn (only where this one opened, e.g. once per window); its emit runs
    only where it opens too."""
    # An accumulate's window reaches the later gate as one call of the
    # window's weight (0 for an empty window), where it passed this gate.
    window = out.window_weight
    passed = True if window is None else out.passed
    ctx = base.GateContext(passed=passed, window_weight=window)
    later = Decision.of(
        rest.gate_update(out.updates, tail_state, params, ctx, **args)
    )
    pred = flags.either(later.may_open, later.empty)

    def opened():
        e = later.to_next_gate()
        return e._replace(
            opened=flags.both(later.may_open, e.opened),
            passed=flags.flag_like(e.passed, pred),
        )

    def closed(like):
        false = flags.flag_like(False, pred)
        return Emission.shut(like, later.state, opened=false, passed=false)

    if later.branches:  # a later accumulate: it opens once per its window
        e = flags.cond_or_call(
            pred, opened, lambda: closed(jax.eval_shape(opened))
        )
    else:
        e = flags.select_or_call(pred, opened, closed)
    if window is not None:
        return e
    return e._replace(
        state=flags.select(out.opened, e.state, tail_state),
        opened=flags.both(out.opened, e.opened),
        passed=flags.both(out.opened, e.passed),
    )


def merge_eager(res, head, tail_state, rest, params, extra_args) -> Decision:
    """An eager gate followed by a gated chain: one combined decision, so
    that a step where the later gate stays closed (a non-closing micro-step
    after a loss scale) still skips its followers and keeps the fused fast
    path."""
    out = res.emission()
    passed = flags.both(res.may_open, out.opened)
    gate_state = flags.select(res.may_open, out.state, res.state)
    # A call this gate refused does not count for the later gate (``passed``).
    window = out.window_weight
    ctx = base.GateContext(passed=passed, window_weight=window)
    args = args_for(keywords.declared_extra_args(rest), extra_args, window)
    later = Decision.of(
        rest.gate_update(out.updates, tail_state, params, ctx, **args)
    )

    def prepend(e: Emission) -> Emission:
        return e._replace(state=(*head, gate_state, *cast(tuple, e.state)))

    return later.then(prepend)._replace(
        state=(*head, gate_state, *cast(tuple, later.state)),
        may_open=flags.both(passed, later.may_open),
        empty=flags.both(passed, later.empty),
    )


# ------------------------------------------------- flush


def then_flush(res, rest, at, params, extra_args) -> Decision:
    """After ``res`` (a flush whose window went on into the gated followers
    ``rest``, at position ``at`` of the chain's state), the flush of
    ``rest``'s own partial window: one flush of the whole nested window, as
    that of one accumulate of their product. At most one of the two steps
    the optimizer (a window that ``res`` completes leaves ``rest`` empty)."""

    def run():
        return res.emission().with_flags()

    def skip():
        false = jnp.asarray(False)
        shapes = jax.eval_shape(run)
        return Emission.shut(shapes, res.state, opened=false, passed=false)

    first = flags.cond_or_call(res.may_open, run, skip)
    front = first.state[:at]
    second = Decision.of(
        rest.gate_flush(first.state[at:], params, **extra_args)
    )

    def emit():
        def then():
            out = second.emission()
            return out._replace(state=(*front, *out.state)).with_flags()

        return flags.cond_or_call(first.opened, lambda: first, then)

    return Decision(
        state=(*front, *second.state),
        may_open=first.opened | jnp.asarray(second.may_open, bool),
        emit=emit,
    )
