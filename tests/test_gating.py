"""The gate's inner workings (``optaxaccum._src.gating``): the records (a
decision, an emission) and the rules that compose one gate with what follows
it, each checked for what it builds; and the length of a gradient's trip
through the library on a plain, mesh-less step.
"""

import collections
import copy
import os
import sys
import warnings

import chex
import jax
import jax.numpy as jnp
import optax
import pytest

import optaxaccum as oa
from optaxaccum._src import base, flags, gating, reducer

PACKAGE = os.path.dirname(oa.__file__) + os.sep


S, CLOSED, HEAD = jnp.int32(1), jnp.int32(0), jnp.int32(7)  # states


def _emission(**kw):
    return gating.Emission(updates=jnp.ones(2), state=S, **kw)


# ------------------------------------------------- the records


def test_an_emission_is_read_from_an_emitted_a_tuple_or_itself():
    emitted = base.Emitted(updates=jnp.ones(2), state="s")
    out = gating.Emission.of(emitted)
    assert isinstance(out, gating.Emission)
    assert (out.state, out.opened, out.window_weight, out.passed) == (
        "s",
        True,
        None,
        True,
    )
    assert gating.Emission.of(out) is out
    assert gating.Emission.of((1, 2, False)).opened is False


def test_a_shut_emission_holds_zeros_shaped_as_given():
    shapes = jax.eval_shape(
        lambda: _emission(window_weight=jnp.float32(3.0))._replace(
            updates={"a": jnp.ones((2, 3), jnp.bfloat16)}
        )
    )
    out = gating.Emission.shut(shapes, CLOSED, opened=False, passed=True)
    chex.assert_trees_all_equal(
        out.updates, {"a": jnp.zeros((2, 3), jnp.bfloat16)}
    )
    assert out.updates["a"].dtype == jnp.bfloat16
    chex.assert_trees_all_equal(out.window_weight, jnp.float32(0.0))
    assert (out.state, out.opened, out.passed) == (CLOSED, False, True)


def test_with_flags_makes_both_flags_bool_arrays():
    out = _emission(opened=True, passed=jnp.asarray(False)).with_flags()
    for flag in (out.opened, out.passed):
        assert isinstance(flag, jax.Array) and flag.dtype == jnp.bool_


def test_a_decision_is_read_from_a_gate_result_or_itself():
    res = oa.GateResult(state="s", may_open=True, emit=_emission())
    decision = gating.Decision.of(res)
    assert isinstance(decision, gating.Decision)
    assert decision.empty is False and decision.state == "s"
    assert gating.decision_of(decision) is decision
    assert gating.decision_of(decision) is decision


@pytest.mark.parametrize("lazy", [False, True])
def test_a_decision_emits_an_emission_eager_or_lazy(lazy):
    emitted = base.Emitted(updates=jnp.ones(2), state="s")
    emit = (lambda: emitted) if lazy else emitted
    out = gating.Decision(state="s", may_open=True, emit=emit).emission()
    assert isinstance(out, gating.Emission) and out.state == "s"


def test_then_keeps_an_eager_decision_eager_and_a_lazy_one_lazy():
    calls = []

    def fn(out):
        calls.append(out)
        return out._replace(state="after")

    eager = gating.Decision(state="s", may_open=True, emit=_emission())
    after = eager.then(fn)
    assert not callable(after.emit) and after.emit.state == "after"
    lazy = gating.Decision(state="s", may_open=True, emit=_emission)
    calls.clear()
    after = lazy.then(fn)
    assert callable(after.emit) and not calls  # fn runs when emitted
    assert after.emission().state == "after" and len(calls) == 1


@pytest.mark.parametrize(
    "may_open, opened, want",
    [(True, True, 1.0), (False, True, 0.0), (True, False, 0.0)],
)
def test_as_update_gives_zeros_where_closed_or_not_opened(
    may_open, opened, want
):
    res = gating.Decision(
        state=CLOSED,
        may_open=jnp.asarray(may_open),
        emit=lambda: _emission(opened=jnp.asarray(opened)),
    )
    for as_update in (res.as_update, jax.jit(res.as_update)):
        updates, state = as_update()
        chex.assert_trees_all_equal(updates, jnp.full(2, want))
        assert int(state) == (1 if may_open else 0)


def _counted(calls):
    """A plain follower that counts the calls of its update (traced or
    run)."""

    def update_fn(updates, state, params=None):
        del params
        calls.append(1)
        return updates, state

    return optax.GradientTransformation(
        lambda params: optax.EmptyState(), update_fn
    )


def _plain_update(tx, grads, state, params):
    return tx.update(grads, state, params)


def _fused_update(tx, grads, state, params):
    _, state, updates = oa.apply_gradients(
        tx, grads, state, params, return_updates=True
    )
    return updates, state


@pytest.mark.parametrize("update", [_plain_update, _fused_update])
def test_an_eager_update_that_stays_closed_does_not_trace_the_followers(
    update,
):
    """Un-jitted, an update that stays closed (``tx.update``, or the fused
    step returning its updates) builds its zeros from the shapes an earlier
    call of the same types found: the followers' code runs once to find
    them, then only where the window closes."""
    calls = []
    tx = oa.chain(oa.accumulate(4), _counted(calls))
    params = {"w": jnp.zeros((2, 3)), "b": jnp.zeros(3)}
    grads = jax.tree.map(jnp.ones_like, params)
    state = tx.init(params)
    for _ in range(3):
        updates, state = update(tx, grads, state, params)
        chex.assert_trees_all_equal(
            updates, jax.tree.map(jnp.zeros_like, grads)
        )
    assert len(calls) == 1  # the first call's trace of the emission
    updates, state = update(tx, grads, state, params)  # closes the window
    assert len(calls) == 2
    chex.assert_trees_all_close(updates, grads)


def test_the_emitted_shapes_are_kept_by_the_types_of_the_arguments():
    """One transformation updating trees of two shapes (and dtypes) gives
    each its own zeros."""
    tx = oa.chain(oa.accumulate(2), optax.sgd(1.0))
    small = {"w": jnp.zeros(2)}
    big = {"w": jnp.zeros((3, 4), jnp.bfloat16)}
    states = {"small": tx.init(small), "big": tx.init(big)}
    for name, params in (("small", small), ("big", big), ("small", small)):
        grads = jax.tree.map(jnp.ones_like, params)
        updates, _ = tx.update(grads, states[name], params)
        chex.assert_trees_all_equal_shapes_and_dtypes(updates, params)
    assert gating.EmittedShapes.key((small, 3)) != gating.EmittedShapes.key(
        (small, 4)
    )  # another value of a leaf that is not an array
    assert gating.EmittedShapes.key((small, bytearray(b"x"))) is None


def test_emitted_shapes_keep_no_function_nor_what_it_closes_over():
    """A linesearch's ``value_fn`` (a function leaf) is not kept: under
    jit it would hold the step's tracers, eagerly its data."""
    tx = oa.chain(oa.accumulate(2), optax.lbfgs())
    params = jnp.zeros(3)
    state = tx.init(params)

    def step(p, s, batch):
        def loss(q):
            return jnp.sum((q - batch) ** 2)

        value, grad = jax.value_and_grad(loss)(p)
        u, s = tx.update(grad, s, p, value=value, grad=grad, value_fn=loss)
        return optax.apply_updates(p, u), s

    step(params, state, jnp.ones(3))
    assert not gating.emitted_shapes(tx)._kept
    assert gating.EmittedShapes.key((params, {"value_fn": len})) is None
    with jax.check_tracer_leaks():
        jax.jit(step)(params, state, jnp.ones(3))


def test_emitted_shapes_keep_at_most_their_size_and_copies_start_empty():
    shapes = gating.EmittedShapes(size=2)
    for i in range(3):
        shapes.put(i, f"shapes {i}")
    assert shapes.get(0) is None and shapes.get(2) == "shapes 2"
    shapes.put(None, "not kept")
    assert shapes.get(None) is None
    clone = copy.deepcopy(shapes)
    assert clone.size == 2 and clone.get(2) is None


@pytest.mark.parametrize("clone", [copy.copy, copy.deepcopy])
def test_a_copy_of_a_gate_keeps_its_shapes_in_one_place(clone):
    """Its ``update`` fills the shapes its fused step reads."""
    tx = clone(oa.chain(oa.accumulate(2), optax.sgd(1.0)))
    params = jnp.zeros(2)
    tx.update(jnp.ones(2), tx.init(params), params)
    assert len(gating.emitted_shapes(tx)._kept) == 1


def test_pass_window_on_gives_the_window_to_an_emission_without_one():
    res = gating.Decision(state="s", may_open=True, emit=_emission())
    out = res.pass_window_on(jnp.float32(4.0), plain=True).emission()
    assert float(out.window_weight) == 4.0 and bool(out.opened)
    own = res._replace(emit=_emission(window_weight=jnp.float32(2.0)))
    out = own.pass_window_on(jnp.float32(4.0), plain=True).emission()
    assert float(out.window_weight) == 2.0  # it closed its own window


@pytest.mark.parametrize("plain", [False, True])
def test_pass_window_on_a_window_of_weight_0_stops_plain_followers(plain):
    res = gating.Decision(state="s", may_open=True, emit=_emission())
    out = res.pass_window_on(jnp.float32(0.0), plain=plain).emission()
    # Plain followers do not step on it; a later gate counts it.
    assert bool(out.opened) is (not plain)


def test_to_next_gate_is_the_emission_where_no_window_is_empty():
    res = gating.Decision(state=S, may_open=True, emit=_emission)
    out = res.to_next_gate()
    assert out._replace(updates=None) == _emission()._replace(updates=None)
    chex.assert_trees_all_equal(out.updates, jnp.ones(2))


@pytest.mark.parametrize("passed", [True, jnp.asarray(True)])
def test_to_next_gate_of_an_empty_window_is_one_call_of_weight_0(passed):
    """An empty window reaches a later gate from the closed state, opened
    false, weight 0 (its emission is only traced, for its shapes);
    ``passed`` stays the literal ``True`` where the emission's is (no
    select is then built on the next state), eager or traced."""
    shapes_from = _emission(window_weight=jnp.float32(1.0), passed=passed)
    res = gating.Decision(
        state=CLOSED,
        may_open=jnp.asarray(False),
        emit=lambda: shapes_from,
        empty=jnp.asarray(True),
    )
    out = res.to_next_gate()
    assert not bool(out.opened) and int(out.state) == 0
    chex.assert_trees_all_equal(out.updates, jnp.zeros(2))
    assert float(out.window_weight) == 0.0
    if passed is True:
        assert out.passed is True
    else:
        assert isinstance(out.passed, jax.Array) and bool(out.passed)
    literal = []

    def traced(may_open):  # a lax.cond between the two branches
        out = res._replace(may_open=may_open, empty=~may_open).to_next_gate()
        literal.append(out.passed is True)
        return out.updates

    chex.assert_trees_all_equal(jax.jit(traced)(False), jnp.zeros(2))
    assert literal == [passed is True]


# ------------------------------------------------- keywords and plain runs


def test_args_for_keeps_the_private_keywords_for_those_that_declare_them():
    call = {"accum_weight": 2.0, base.WINDOW_NOISE_ARG: "n", "value": 1}
    assert gating.args_for(frozenset(), call, None) == {"value": 1}
    assert gating.args_for(frozenset({"accum_weight"}), call, 5.0) == {
        "accum_weight": 5.0,  # the window's weight, not the call's
        "value": 1,
    }
    assert gating.args_for(frozenset({"accum_weight"}), {}, 3.0) == {
        "accum_weight": 3.0
    }


def test_a_plain_run_is_optax_chain():
    txs = (optax.scale(2.0), optax.sgd(0.1, momentum=0.9))
    run = gating.plain_run(txs)
    assert run.transforms == txs
    ref = optax.chain(*txs)
    params = jnp.ones(3)
    state, ref_state = tuple(t.init(params) for t in txs), ref.init(params)
    for g in (1.0, -2.0):
        u, state = run(jnp.full(3, g), state, params, None, {})
        ur, ref_state = ref.update(jnp.full(3, g), ref_state, params)
        chex.assert_trees_all_close(u, ur)
    chex.assert_trees_all_close(state, ref_state)


def test_window_counts_unless_its_weight_is_0():
    assert gating.window_counts(None) is True
    assert bool(gating.window_counts(jnp.float32(2.0)))
    assert not bool(gating.window_counts(jnp.float32(0.0)))


# ------------------------------------------------- one gate, then the rest


def test_the_rule_is_chosen_from_what_follows():
    assert gating.rule_for(None) is gating.with_head
    assert gating.rule_for(gating.plain_run(())) is gating.then_plain
    assert gating.rule_for(oa.accumulate(2)) is gating.then_gate


def test_with_head_puts_the_earlier_states_in_front():
    res = gating.Decision(state=CLOSED, may_open=True, emit=_emission())
    out = gating.with_head(res, (HEAD,), (), None, None, {})
    assert out.state == (HEAD, CLOSED) and out.emission().state == (HEAD, S)
    assert not callable(out.emit)  # an eager gate stays eager


@pytest.mark.parametrize("opens", [False, True])
def test_then_plain_steps_the_followers_only_where_the_gate_opens(opens):
    sgd = optax.sgd(1.0, momentum=0.5)
    params = jnp.zeros(2)
    tail = (sgd.init(params),)
    res = gating.Decision(
        state=CLOSED, may_open=jnp.asarray(opens), emit=_emission
    )
    out = gating.then_plain(
        res, (HEAD,), tail, gating.plain_run((sgd,)), params, {}
    )
    assert out.state[:2] == (HEAD, CLOSED)  # where it stays closed
    updates, state = out.as_update()
    chex.assert_trees_all_equal(updates, jnp.full(2, -1.0 if opens else 0.0))
    assert (int(state[0]), int(state[1])) == (7, 1 if opens else 0)
    want = jnp.ones(2) if opens else jnp.zeros(2)  # the momentum stepped
    chex.assert_trees_all_equal(state[2][0].trace, want)


def test_then_gate_after_an_eager_gate_is_one_decision():
    """An eager gate then an accumulate: one decision (``merge_eager``),
    which opens only where the accumulate closes its window."""
    rest = oa.chain(oa.accumulate(2))  # the followers: a gated chain
    params = jnp.zeros(2)
    eager = gating.Decision(state=CLOSED, may_open=True, emit=_emission())
    tail = rest.init(params)
    for call, closes in ((1, False), (2, True)):
        out = gating.then_gate(eager, (), tail, rest, params, {})
        assert bool(out.may_open) is closes, call
        assert int(out.state[0]) == 1  # the eager gate's, where it opened
        tail = out.state[1:]
    chex.assert_trees_all_equal(out.emission().updates, jnp.ones(2))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("after", [False, True], ids=["first", "after_acc"])
def test_a_gate_flag_of_shape_1_is_named(after, jit):
    """A user gate whose ``may_open`` is a boolean array of shape (1,) (a
    reduction left out): ``TypeError`` naming ``may_open``, its shape and
    the gate, where the chain receives it (eagerly ``bool()`` would take
    it; under ``jit`` ``lax.cond`` would fail on it without a name)."""

    def one_element_gate_update(updates, state, params, ctx, **extra_args):
        ok = jnp.isfinite(updates).all(keepdims=True) & ctx.passed
        return oa.GateResult(state, ok, oa.Emitted(updates, state))

    gate = oa.GatedTransformation(
        lambda p: optax.EmptyState(), one_element_gate_update
    )
    front = (oa.accumulate(1),) if after else ()
    tx = oa.chain(*front, gate, optax.sgd(1.0))
    p = jnp.zeros(2)
    update = jax.jit(tx.update) if jit else tx.update
    with pytest.raises(TypeError, match="may_open") as info:
        update(jnp.ones(2), tx.init(p), p)
    assert "one_element_gate_update" in str(info.value)
    assert "(1,)" in str(info.value)


def test_flag_like_takes_the_type_of_the_other_flag():
    for flag, like in ((True, jnp.asarray(False)), (False, True)):
        out = flags.flag_like(flag, like)
        assert isinstance(out, jax.Array) and out.dtype == jnp.bool_
        assert bool(out) is flag


# ------------------------------------------------- the mesh-less trip


def test_no_axis_name_and_nothing_unreduced_is_the_local_reducer():
    sums = reducer.of(None, {"w": jnp.ones(2)})
    assert type(sums) is reducer.Local
    assert sums.load("acc") == "acc" and sums.match("acc", None) == "acc"
    chex.assert_trees_all_equal(
        sums.scale(jnp.float32(2.0), jnp.ones(2)), jnp.full(2, 2.0)
    )
    assert not bool(sums.finite(jnp.array([1.0, jnp.inf])))


def _trace(fn):
    """``(files, calls)``: the calls of functions whose code lives under
    ``optaxaccum/`` made while ``fn()`` runs (``sys.setprofile``), by
    file."""
    calls = []

    def profile(frame, event, arg):
        del arg
        if event == "call" and frame.f_code.co_filename.startswith(PACKAGE):
            calls.append(os.path.relpath(frame.f_code.co_filename, PACKAGE))

    before = sys.getprofile()
    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(before)
    return collections.Counter(calls), len(calls)


def test_a_closing_update_without_a_mesh_is_a_short_trip():
    """One closing eager ``update`` of ``chain(accumulate(2), sgd)`` with no
    mesh calls at most 50 library functions, in the chain, the gate's
    records, the accumulate, its reducer and the three helper rooms (flags,
    argument checks, numerics) and nowhere else: none in ``sharding.py``
    (the accumulate asks its reducer), the input checks included. (It was
    99 calls in 7 files, 27 in ``sharding.py``; the helper rooms were one
    file, ``utils.py``, when it was 50 calls in 5 files.)"""
    tx = oa.chain(oa.accumulate(2), optax.sgd(0.1))
    params = {"w": jnp.zeros((3, 2)), "b": jnp.zeros((2,))}
    grads = jax.tree.map(jnp.ones_like, params)
    state = tx.init(params)
    _, state = tx.update(grads, state, params)
    out = []
    files, calls = _trace(lambda: out.append(tx.update(grads, state, params)))
    chex.assert_trees_all_close(
        out[0][0], jax.tree.map(lambda g: -0.1 * g, grads)
    )
    rooms = ("chain", "gating", "accumulate", "reducer")
    rooms += ("flags", "checks", "numerics")
    allowed = {os.path.join("_src", f"{room}.py") for room in rooms}
    assert {f for f, n in files.items() if n} <= allowed, files
    assert calls <= 50, (calls, files)


def test_the_trip_counter_sees_the_library():
    """The counter above counts library calls (no vacuous pass): a call of
    ``sharding.check_mesh_axes`` (here without an axis name) is one call in
    ``sharding.py``."""
    from optaxaccum._src import sharding

    files, calls = _trace(lambda: sharding.check_mesh_axes(None, "x"))
    assert files == {os.path.join("_src", "sharding.py"): 1} and calls == 1


def test_chain_reached_with_a_window_weight_does_not_warn_of_no_weight():
    """A driver of the gate protocol (not an oa.chain) that hands an
    oa.chain a call standing for an earlier window, ``ctx.window_weight``
    given: the call is weighed by it, so oa.scale_by_window does not warn
    that no accum_weight was passed, and its factor reads the windows'
    total (2 x 3 over base 4). A plain call with no accum_weight warns
    (the control)."""
    tx = oa.chain(
        oa.accumulate(2),
        optax.sgd(1.0),
        oa.scale_by_window(4.0, rule="linear"),
    )
    params = jnp.zeros(2)
    ctx = oa.GateContext(window_weight=jnp.float32(3.0))
    state = tx.init(params)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for g in (jnp.array([1.0, 2.0]), jnp.array([3.0, 6.0])):
            res = tx.gate_update(g, state, params, ctx)
            state = res.state
        assert bool(res.may_open)
        assert callable(res.emit)  # the accumulate's emit is lazy
        emitted = res.emit()
    assert [str(w.message) for w in caught] == []
    chex.assert_trees_all_close(emitted.updates, jnp.array([-3.0, -6.0]))
    with pytest.warns(UserWarning, match="passed no accum_weight"):
        tx.update(jnp.ones(2), tx.init(params), params)
