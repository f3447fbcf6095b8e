"""Tests of the gating ``oa.chain`` and the fused ``oa.apply_gradients``."""

import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optaxaccum as oa
from optaxaccum._src import gating as _gating
from tests import hlo_queries as _hlo


def _only_positive_gate():
    """A custom gate: lets updates through only when their sum is > 0."""

    def init(params):
        del params
        return jnp.zeros([], jnp.int32)  # how many times it opened

    def gate_update(updates, state, params, ctx, **extra_args):
        del params, extra_args
        ok = sum(jnp.sum(x) for x in jax.tree.leaves(updates)) > 0
        ok = ok & ctx.passed  # a call an earlier gate refused does not count
        new = jnp.where(ok, state + 1, state)

        def emit():
            return oa.Emitted(updates=updates, state=new)

        return oa.GateResult(state=new, may_open=ok, emit=emit)

    return oa.GatedTransformation(init, gate_update)


def test_custom_gate_plugs_in_without_touching_chain():
    tx = oa.chain(_only_positive_gate(), optax.adam(0.1))
    params = jnp.zeros(2)
    s = tx.init(params)
    update = jax.jit(tx.update)
    u, s1 = update(jnp.array([-1.0, -1.0]), s, params)
    chex.assert_trees_all_equal(u, jnp.zeros(2))
    chex.assert_trees_all_equal(s1[1], s[1])  # Adam untouched
    u, s2 = update(jnp.array([1.0, 1.0]), s1, params)
    np.testing.assert_allclose(u, [-0.1, -0.1], rtol=1e-5)
    assert int(s2[0]) == 1 and int(s2[1][0].count) == 1
    assert oa.is_gate(tx) and not oa.is_gate(optax.adam(0.1))


def test_chain_without_gate_equals_optax_chain():
    parts = (optax.clip_by_global_norm(1.0), optax.adam(0.1))
    ours, theirs = oa.chain(*parts), optax.chain(*parts)
    params = {"a": jnp.ones(3)}
    s1, s2 = ours.init(params), theirs.init(params)
    for g in (jnp.arange(3.0), -jnp.arange(3.0)):
        u1, s1 = ours.update({"a": g}, s1, params)
        u2, s2 = theirs.update({"a": g}, s2, params)
        chex.assert_trees_all_close(u1, u2)
    assert not oa.is_gate(ours)


def test_two_gates_in_one_chain():
    """accumulate(2) then a gate that drops negative windows."""
    tx = oa.chain(oa.accumulate(2), _only_positive_gate(), optax.sgd(1.0))
    params = jnp.zeros(1)
    s = tx.init(params)
    update = jax.jit(tx.update)
    out = []
    for g in (1.0, 1.0, -1.0, -3.0, 2.0, 4.0):
        u, s = update(jnp.array([g]), s, params)
        out.append(float(u[0]))
    assert out == [0.0, -1.0, 0.0, 0.0, 0.0, -3.0]
    assert int(s[1]) == 2


def test_closed_gate_zeros_have_open_dtypes():
    """Adam emits float32 updates for bf16 grads with float32 params; so do
    the zeros of a closed gate."""
    tx = oa.chain(oa.accumulate(2), optax.adam(0.1))
    params = jnp.zeros(3, jnp.float32)
    s = tx.init(params)
    g = jnp.ones(3, jnp.bfloat16)
    u_closed, s = tx.update(g, s, params)
    u_open, s = tx.update(g, s, params)
    assert u_closed.dtype == u_open.dtype == jnp.float32


def test_extra_args_reach_every_element():
    """Every element sees the call's keywords, except ``accum_weight``:
    the accumulate's own, which reaches only those declaring it."""
    seen = {}

    def spy_update(updates, state, params=None, **extra_args):
        seen.update(extra_args)
        return updates, state

    spy = optax.GradientTransformationExtraArgs(
        lambda p: optax.EmptyState(), spy_update
    )
    tx = oa.chain(spy, oa.accumulate(1), spy, optax.sgd(1.0))
    s = tx.init(jnp.zeros(1))
    tx.update(jnp.ones(1), s, jnp.zeros(1), accum_weight=2.0, foo=3)
    assert seen == {"foo": 3}


def test_nested_chains_are_gates():
    inner = oa.chain(oa.accumulate(2), optax.adam(0.1))
    outer = oa.chain(optax.scale(2.0), inner)
    assert oa.is_gate(outer)
    params = jnp.zeros(2)
    s = outer.init(params)
    fused = jax.jit(lambda g, s, p: oa.apply_gradients(outer, g, s, p))
    p, s = fused(jnp.ones(2), s, params)
    chex.assert_trees_all_equal(p, params)
    p, s = fused(jnp.ones(2), s, p)
    np.testing.assert_allclose(p, [-0.1, -0.1], rtol=1e-5)
    assert bool(oa.has_updated(s))


def _split_hlo(tx, params):
    state = tx.init(params)
    text = jax.jit(tx.update).lower(params, state, params).compile().as_text()
    return _hlo.split(text)


def test_hlo_non_closing_step_skips_follower():
    """Adam's square root runs only inside the conditional's branch; optax's
    MultiSteps computes it on every micro-step (optax #472)."""
    params = {"w": jnp.zeros((64, 32)), "b": jnp.zeros(32)}
    always, branch = _split_hlo(
        oa.chain(oa.accumulate(4), optax.adam(1e-3)), params
    )
    assert _hlo.count(always, "sqrt") == 0
    assert _hlo.count(branch, "sqrt") >= 1
    assert _hlo.count(always, "divide") == 0  # no mean on non-closing steps
    ms_always, _ = _split_hlo(optax.MultiSteps(optax.adam(1e-3), 4), params)
    assert _hlo.count(ms_always, "sqrt") >= 1


def _compiled_fused_step():
    """``oa.apply_gradients`` with params and state donated, compiled for a
    256x256 float32 tree and ``oa.chain(oa.accumulate(4), optax.adam)``,
    with no compiler option (the premise holds by default)."""
    params = {"w": jnp.zeros((256, 256))}
    tx = oa.chain(oa.accumulate(4), optax.adam(1e-3))
    state = tx.init(params)
    step = jax.jit(
        lambda p, s, g: oa.apply_gradients(tx, g, s, p),
        donate_argnums=(0, 1),
    )
    return step.lower(params, state, params).compile()


def test_hlo_fused_non_closing_step_is_one_pass():
    """With params and state donated (in the order they are returned), the
    fused step's unconditional work on the tree is the accumulator update: one
    fusion writing one tree, and no copy of params or optimizer state."""
    text = _compiled_fused_step().as_text()
    comps, entry = _hlo.parse_hlo(text)
    always, branch = _hlo.split(text)
    tree_sized = [
        line
        for line in comps[entry]
        if "f32[256,256]" in line.split("=", 1)[1].split("(")[0]
        and " parameter(" not in line
        and " get-tuple-element(" not in line
        and " tuple(" not in line
    ]
    assert len(tree_sized) == 1 and " fusion(" in tree_sized[0], tree_sized
    # Scalars only (counters, flags, the window's weight in the loop's
    # carry): no copy of params or optimizer state.
    assert _hlo.count(always, "copy") == sum(
        bool(re.search(r"= (s32|f32|pred)\[\] copy\(", line)) for line in always
    )
    assert _hlo.count(branch, "sqrt") >= 1


def test_fused_step_needs_no_tree_sized_temporaries():
    """The compiled fused step (params and state donated) allocates no
    temporary buffer of the tree's size: the accumulator is updated in place
    and the zero-update tree of the plain protocol is never built."""
    params = {"w": jnp.zeros((256, 256))}
    tx = oa.chain(oa.accumulate(4), optax.adam(1e-3))
    state = tx.init(params)
    mem = _compiled_fused_step().memory_analysis()
    tree_bytes = 256 * 256 * 4
    assert mem.temp_size_in_bytes < tree_bytes // 64, mem.temp_size_in_bytes
    plain = jax.jit(
        lambda p, s, g: (lambda u, s2: (optax.apply_updates(p, u), s2))(
            *tx.update(g, s, p)
        ),
        donate_argnums=(0, 1),
    )
    mem_plain = plain.lower(params, state, params).compile().memory_analysis()
    assert mem_plain.temp_size_in_bytes >= tree_bytes, (
        mem_plain.temp_size_in_bytes
    )


def test_apply_gradients_extra_args_and_non_gate():
    tx = oa.chain(oa.accumulate(2), optax.sgd(1.0))
    params = jnp.zeros(1)
    s = tx.init(params)
    params, s = oa.apply_gradients(
        tx, jnp.array([4.0]), s, params, accum_weight=3.0
    )
    params, s = oa.apply_gradients(
        tx, jnp.array([0.0]), s, params, accum_weight=1.0
    )
    np.testing.assert_allclose(params, [-3.0])
    p2, _ = oa.apply_gradients(
        optax.sgd(0.5), jnp.ones(1), optax.sgd(0.5).init(params), params
    )
    np.testing.assert_allclose(p2, [-3.5])


def test_apply_gradients_casts_to_param_dtype():
    tx = oa.chain(oa.accumulate(1), optax.adam(0.1))
    params = jnp.zeros(2, jnp.bfloat16)
    s = tx.init(params)
    p, _ = oa.apply_gradients(tx, jnp.ones(2, jnp.bfloat16), s, params)
    assert p.dtype == jnp.bfloat16


# ------------------------------------------------------- nested and eager gates


def _grads_with_overflow():
    return [
        jnp.array([1.0, 2.0]),
        jnp.array([jnp.inf, 1.0]),
        jnp.array([3.0, -1.0]),
        jnp.array([0.5, 0.5]),
        jnp.array([2.0, 2.0]),
        jnp.array([-1.0, 4.0]),
    ]


@pytest.mark.parametrize(
    "nested",
    [
        lambda: oa.chain(
            oa.chain(oa.dynamic_loss_scale(4.0), oa.accumulate(2)),
            optax.adam(0.1),
        ),
        lambda: oa.chain(
            oa.chain(oa.agc(0.5), oa.dynamic_loss_scale(4.0), oa.accumulate(2)),
            optax.adam(0.1),
        ),
        lambda: oa.chain(
            oa.dynamic_loss_scale(4.0),
            oa.chain(oa.accumulate(2), optax.adam(0.1)),
        ),
    ],
)
def test_nested_gated_chains_equal_the_flat_chain(nested):
    """Regression: a nested chain whose first gate opened but whose second
    stayed closed used to let the outer followers step (Adam counted 4
    steps instead of 2 over two windows)."""
    has_agc = "agc" in str(nested.__code__.co_names)
    flat_elems = ([oa.agc(0.5)] if has_agc else []) + [
        oa.dynamic_loss_scale(4.0),
        oa.accumulate(2),
        optax.adam(0.1),
    ]
    flat = oa.chain(*flat_elems)
    tx = nested()
    params = jnp.array([1.0, -2.0])
    s, s_flat = tx.init(params), flat.init(params)
    for g in _grads_with_overflow():
        u, s = tx.update(4.0 * g, s, params)
        u_flat, s_flat = flat.update(4.0 * g, s_flat, params)
        chex.assert_trees_all_equal(u, u_flat)
    counts = [
        int(x.count)
        for x in jax.tree.leaves(
            s, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState)
        )
        if isinstance(x, optax.ScaleByAdamState)
    ]
    assert counts == [2]  # two windows of two finite micro-batches


def test_second_gate_closed_on_window_close_keeps_followers():
    """accumulate closes the window on an overflowing micro-batch caught by a
    later loss-scale gate: nothing steps."""
    tx = oa.chain(
        oa.chain(oa.accumulate(2), oa.dynamic_loss_scale(1.0)), optax.adam(0.1)
    )
    params = jnp.zeros(2)
    s = tx.init(params)
    _, s = tx.update(jnp.ones(2), s, params)
    u, s = tx.update(jnp.array([jnp.inf, 1.0]), s, params)
    chex.assert_trees_all_equal(u, jnp.zeros(2))
    assert int(s[1][0].count) == 0


def test_closed_opened_flag_gives_zeros_everywhere():
    """A gate whose emission says opened=False (the private record an
    accumulate across devices emits) emits zeros, alone, last in a chain,
    and through apply_gradients (params untouched)."""

    def gate_update(updates, state, params, ctx, **extra_args):
        return _gating.Decision(
            state=state,
            may_open=jnp.asarray(True),
            emit=lambda: _gating.Emission(
                updates=updates, state=state, opened=jnp.asarray(False)
            ),
        )

    gate = oa.GatedTransformation(lambda p: optax.EmptyState(), gate_update)
    params = jnp.ones(2)
    for tx in (gate, oa.chain(optax.scale(2.0), gate)):
        s = tx.init(params)
        u, _ = jax.jit(tx.update)(jnp.ones(2), s, params)
        chex.assert_trees_all_equal(u, jnp.zeros(2))
        p, _ = jax.jit(lambda p, s: oa.apply_gradients(tx, jnp.ones(2), s, p))(
            params, s
        )
        chex.assert_trees_all_equal(p, params)


def test_gates_survive_deepcopy():
    import copy

    tx = oa.chain(oa.dynamic_loss_scale(), oa.accumulate(2), optax.sgd(1.0))
    params = jnp.zeros(2)
    for clone in (copy.copy(tx), copy.deepcopy(tx)):
        assert oa.is_gate(clone)
        s = clone.init(params)
        _, s = clone.update(jnp.ones(2), s, params)
        u, s = clone.update(jnp.ones(2), s, params)
        assert u.shape == (2,)


def test_fused_fast_path_with_a_loss_scale_in_front():
    """The loss-scale gate composes with the accumulation: a non-closing
    micro-step needs no tree-sized temporary and returns the params bit for
    bit (-0.0 keeps its sign). With AGC between them, the unscaled gradient
    has two readers (AGC's unit norms, then the accumulator update) and is
    held once: at most one tree, no more than the plain protocol."""
    tree_bytes = 256 * 256 * 4
    params = {"w": jnp.full((256, 256), -0.0)}

    def compiled(tx, fused=True):
        state = tx.init(params)
        if fused:
            fn = lambda p, s, g: oa.apply_gradients(tx, g, s, p)  # noqa: E731
        else:

            def fn(p, s, g):
                u, s = tx.update(g, s, p)
                return optax.apply_updates(p, u), s

        step = jax.jit(fn, donate_argnums=(0, 1))
        return step, state, step.lower(params, state, params).compile()

    step, state, comp = compiled(
        oa.chain(oa.dynamic_loss_scale(), oa.accumulate(4), optax.adam(1e-3))
    )
    assert comp.memory_analysis().temp_size_in_bytes < tree_bytes // 64
    p, _ = step(params, state, {"w": jnp.ones((256, 256))})
    assert bool(jnp.all(jnp.signbit(p["w"])))

    headline = oa.chain(
        oa.dynamic_loss_scale(),
        oa.agc(0.01),
        oa.accumulate(4),
        optax.adam(1e-3),
    )
    step, state, comp = compiled(headline)
    temp = comp.memory_analysis().temp_size_in_bytes
    _, _, plain = compiled(headline, fused=False)
    # One tree (the unscaled gradient, held for its two readers), 4 KiB of
    # scalars, and AGC's unit norms of params and gradients (one float32 per
    # unit, 256 units each): XLA:CPU fuses them into their readers, XLA:GPU
    # may keep them (H200: 266,864 B, 624 B over the tree and the scalars).
    unit_norms = 2 * 256 * 4
    assert temp <= tree_bytes + unit_norms + 4096, temp
    assert temp <= plain.memory_analysis().temp_size_in_bytes
    fresh = {"w": jnp.full((256, 256), -0.0)}  # the first params were donated
    p, _ = step(fresh, state, {"w": jnp.ones((256, 256))})
    assert bool(jnp.all(jnp.signbit(p["w"])))


def _counting_follower(counter):
    """A stateless transformation that counts (on the host) its runs."""

    def update(updates, state, params=None):
        jax.debug.callback(lambda: counter.append(1))
        return updates, state

    return optax.GradientTransformation(lambda p: optax.EmptyState(), update)


@pytest.mark.parametrize(
    "build",
    [
        lambda f: oa.chain(oa.accumulate(2), oa.accumulate(2), f),
        lambda f: oa.chain(oa.accumulate(2), oa.chain(oa.accumulate(2), f)),
        lambda f: oa.chain(oa.accumulate(1), oa.accumulate(4), f),
    ],
    ids=["flat", "nested", "1x4"],
)
def test_second_lazy_gate_runs_its_followers_only_when_it_opens(build):
    """Regression: after a lazy gate opened, a later gate's emit and its
    followers ran even when that later gate stayed closed."""
    counter = []
    tx = build(_counting_follower(counter))
    params = jnp.zeros(2)
    s = tx.init(params)
    step = jax.jit(tx.update)
    for _ in range(8):
        _, s = step(jnp.ones(2), s, params)
    jax.effects_barrier()
    assert len(counter) == 2  # 8 micro-steps, windows of 4


def test_eager_gate_in_its_own_chain_keeps_the_fast_path():
    params = {"w": jnp.zeros((256, 256))}
    tx = oa.chain(
        oa.chain(oa.dynamic_loss_scale()), oa.accumulate(4), optax.adam(1e-3)
    )
    state = tx.init(params)
    step = jax.jit(
        lambda p, s, g: oa.apply_gradients(tx, g, s, p),
        donate_argnums=(0, 1),
    )
    mem = step.lower(params, state, params).compile().memory_analysis()
    assert mem.temp_size_in_bytes < 256 * 256 * 4 // 64


def test_gates_survive_pytree_round_trips():
    """Containers that flatten their fields (e.g. equinox modules) rebuild
    a gate through jax.tree_util; it must stay a working gate."""
    tx = oa.chain(oa.accumulate(2), optax.sgd(1.0))
    clone = jax.tree.map(lambda x: x, tx)
    assert oa.is_gate(clone)
    params = jnp.zeros(2)
    s = clone.init(params)
    _, s = clone.update(jnp.ones(2), s, params)
    u, _ = clone.update(jnp.ones(2), s, params)
    chex.assert_trees_all_equal(u, -jnp.ones(2))


# ------------------------------- followers see exactly the call's keywords


def _window_loss(p, batch):
    return jnp.mean((batch @ p - 1.0) ** 2)


_LINESEARCH_OPTIMIZERS = {
    "lbfgs": optax.lbfgs,
    "sgd+backtracking": lambda: optax.chain(
        optax.sgd(1.0), optax.scale_by_backtracking_linesearch(15)
    ),
}


def _linesearch_args(params, batch):
    """The window's ``value``/``grad``/``value_fn``, as a linesearch needs."""
    value_fn = lambda p: _window_loss(p, batch)  # noqa: E731
    value, grad = jax.value_and_grad(value_fn)(params)
    return {"value": value, "grad": grad, "value_fn": value_fn}


@pytest.mark.parametrize("path", ["update", "apply_gradients", "flush"])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("name", list(_LINESEARCH_OPTIMIZERS))
def test_linesearch_optimizer_after_accumulate(name, jit, path):
    """``accum_weight`` reached optax's linesearches,
    which hand unknown keywords to ``value_fn`` (a TypeError on every call).
    Over a window of two micro-batches (``flush``: of one), the chain equals the optimizer run on the window means with the window's
    ``value``/``grad``/``value_fn``."""
    make = _LINESEARCH_OPTIMIZERS[name]
    tx, ref = oa.chain(oa.accumulate(2), make()), make()
    rng = np.random.default_rng(0)
    batches = jnp.asarray(rng.normal(size=(2, 3, 2)), jnp.float32)
    params = p_ref = jnp.array([0.5, -0.5])
    state, s_ref = tx.init(params), ref.init(p_ref)
    per_window = 1 if path == "flush" else 2

    def call(params, state, batch, window):
        args = _linesearch_args(params, window)
        grad = jax.grad(_window_loss)(params, batch)
        if path == "apply_gradients":
            return oa.apply_gradients(tx, grad, state, params, **args)
        updates, state = tx.update(grad, state, params, **args)
        if path == "flush":
            updates, state = oa.flush(tx, state, params, **args)
        return optax.apply_updates(params, updates), state

    step = jax.jit(call) if jit else call
    window = batches[:per_window]
    for batch in window:
        params, state = step(params, state, batch, jnp.concatenate(window))
    args = _linesearch_args(p_ref, jnp.concatenate(window))
    u_ref, s_ref = ref.update(args["grad"], s_ref, p_ref, **args)
    p_ref = optax.apply_updates(p_ref, u_ref)
    assert not np.allclose(p_ref, [0.5, -0.5])  # the optimizer stepped
    np.testing.assert_allclose(params, p_ref, rtol=1e-5, atol=1e-6)


# --------------------------- a nested window of weight 0 is one micro-batch


@pytest.mark.parametrize("fused", [False, True], ids=["update", "fused"])
def test_nested_window_of_weight_0_counts_as_one_micro_batch(fused):
    """With weights 1, 2, 0, 0, 1, 1, 4, 4 nested
    accumulates of 2 and 2 stepped once, at call 6; ``oa.accumulate(4)``
    steps at calls 4 and 8, and so must they, with the same result."""
    nested = oa.chain(oa.accumulate(2), oa.accumulate(2), optax.sgd(1.0))
    flat = oa.chain(oa.accumulate(4), optax.sgd(1.0))
    rng = np.random.default_rng(0)
    grads = jnp.asarray(rng.normal(size=(8, 2)), jnp.float32)
    weights = [1.0, 2.0, 0.0, 0.0, 1.0, 1.0, 4.0, 4.0]

    def step(tx, params, state, g, w):
        if fused:
            return oa.apply_gradients(tx, g, state, params, accum_weight=w)
        u, state = tx.update(g, state, params, accum_weight=w)
        return optax.apply_updates(params, u), state

    params = {"nested": jnp.zeros(2), "flat": jnp.zeros(2)}
    states = {"nested": nested.init(params["nested"]), "flat": None}
    states["flat"] = flat.init(params["flat"])
    stepped = {"nested": [], "flat": []}
    for i, (g, w) in enumerate(zip(grads, weights, strict=True)):
        for name, tx in (("nested", nested), ("flat", flat)):
            old = params[name]
            params[name], states[name] = jax.jit(step, static_argnums=0)(
                tx, params[name], states[name], g, w
            )
            if not np.array_equal(old, params[name]):
                stepped[name].append(i + 1)
    assert stepped["flat"] == [4, 8]
    assert stepped["nested"] == stepped["flat"]
    np.testing.assert_allclose(
        params["nested"], params["flat"], rtol=1e-6, atol=1e-7
    )


def test_gate_without_ctx_is_refused_when_built():
    """A gate_update written without the context (the protocol before issue
    25) is named when the gate is built, not deep inside a chain."""

    def gate_update(updates, state, params=None, **extra_args):
        return oa.GateResult(state, True, oa.Emitted(updates, state))

    with pytest.raises(TypeError, match="ctx"):
        oa.GatedTransformation(lambda p: optax.EmptyState(), gate_update)


def _pass_through_gate():
    """A user's gate written as docs/gates.md teaches: it opens on every
    call that reached it and emits the updates it got."""

    def gate_update(updates, state, params, ctx, **extra_args):
        del params, extra_args
        return oa.GateResult(
            state, ctx.passed & True, lambda: oa.Emitted(updates, state)
        )

    return oa.GatedTransformation(lambda p: optax.EmptyState(), gate_update)


_MIDDLE_GATES = {
    "dynamic_loss_scale": lambda: oa.dynamic_loss_scale(1.0),
    "static_loss_scale": lambda: oa.static_loss_scale(1.0),
    "user_gate": _pass_through_gate,
}


@pytest.mark.parametrize("middle", list(_MIDDLE_GATES))
def test_gate_between_accumulates_passes_the_window_weight_on(middle):
    """API.md 2: a nested accumulate gets the window's total weight even
    when the call passed none, also with another gate between the two
    accumulates (it was weighted 1 per window: the mean of window means)."""
    ref = oa.chain(oa.accumulate(2), oa.accumulate(3), optax.sgd(1.0))
    tx = oa.chain(
        oa.accumulate(2),
        _MIDDLE_GATES[middle](),
        oa.accumulate(3),
        optax.sgd(1.0),
    )
    got = []
    for t in (ref, tx):
        p = jnp.zeros(1)
        s = t.init(p)
        for g in (1.0, 2.0, 3.0, 4.0, 5.0):
            u, s = t.update(jnp.array([g]), s, p)
            p = optax.apply_updates(p, u)
        u, s = oa.flush(t, s, p)
        got.append(optax.apply_updates(p, u))
    np.testing.assert_allclose(got[0], [-3.0], rtol=1e-6)
    np.testing.assert_allclose(got[1], got[0], rtol=1e-6)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("middle", list(_MIDDLE_GATES))
def test_window_of_weight_0_does_not_step_followers_behind_a_gate(
    middle, fused
):
    """API.md 2: a window of total weight 0 emits zeros and does not step
    the followers, also with a gate between the accumulate and them (Adam
    stepped on it before)."""
    tx = oa.chain(oa.accumulate(2), _MIDDLE_GATES[middle](), optax.adam(0.1))
    p = jnp.ones(2)
    s = tx.init(p)
    g = jnp.array([1.0, -1.0])
    for w in (1.0, 1.0):
        p, s = oa.apply_gradients(tx, g, s, p, accum_weight=w)
    before = p
    for w in (0.0, 0.0):
        if fused:
            p, s = oa.apply_gradients(tx, g, s, p, accum_weight=w)
        else:
            u, s = tx.update(g, s, p, accum_weight=w)
            np.testing.assert_array_equal(u, jnp.zeros(2))
            p = optax.apply_updates(p, u)
    np.testing.assert_array_equal(p, before)
    assert int(s[-1][0].count) == 1


# ------------------------- nested chains and windows of weight 0 (API.md 2)

_PADDED_WEIGHTS = {
    "padding_first": (0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0),
    "token_counts": (1.0, 2.0, 0.0, 0.0, 1.0, 1.0, 4.0, 3.0),
    "uneven": (1.0, 2.0, 1.0, 1.0, 4.0, 3.0, 0.5, 0.5),
}

_NESTED_TWO_BY_TWO = {
    "chain_in_chain": lambda: oa.chain(
        oa.chain(oa.accumulate(2), optax.identity()),
        oa.accumulate(2),
        optax.sgd(1.0),
    ),
    "flat": lambda: oa.chain(
        oa.accumulate(2), optax.identity(), oa.accumulate(2), optax.sgd(1.0)
    ),
    "chain_of_gated_chains": lambda: oa.chain(
        oa.chain(oa.accumulate(2), optax.identity()),
        oa.chain(oa.accumulate(2), optax.sgd(1.0)),
    ),
}


@pytest.mark.parametrize("fused", [False, True], ids=["update", "fused"])
@pytest.mark.parametrize("weights", list(_PADDED_WEIGHTS))
@pytest.mark.parametrize("nested", list(_NESTED_TWO_BY_TWO))
def test_nested_chain_steps_as_one_accumulate_of_4(nested, weights, fused):
    """API.md 2: a window of weight 0 closed by an inner chain counts, for
    the enclosing accumulate, as one micro-batch of weight 0: accumulates of
    2 and 2 step where ``oa.accumulate(4)`` does (calls 4 and 8), with the
    same result (the exact weighted mean). The chain of a chain stepped
    once, at call 6: the inner chain dropped the window, and weighed its
    windows by the closing call's weight, not by their total."""
    tx = _NESTED_TWO_BY_TWO[nested]()
    weights = _PADDED_WEIGHTS[weights]
    flat = oa.chain(oa.accumulate(4), optax.sgd(1.0))
    rng = np.random.default_rng(1)
    grads = jnp.asarray(rng.normal(size=(8, 2)), jnp.float32)
    # A fully padded micro-batch under a per-token mean loss: 0/0.
    grads = jnp.where(jnp.asarray(weights)[:, None] == 0, jnp.nan, grads)

    def step(tx, params, state, g, w):
        if fused:
            return oa.apply_gradients(tx, g, state, params, accum_weight=w)
        u, state = tx.update(g, state, params, accum_weight=w)
        return optax.apply_updates(params, u), state

    step = jax.jit(step, static_argnums=0)
    stepped, params = {}, {}
    for name, t in (("nested", tx), ("flat", flat)):
        p = jnp.zeros(2)
        s = t.init(p)
        stepped[name] = []
        for i, (g, w) in enumerate(zip(grads, weights, strict=True)):
            new, s = step(t, p, s, g, w)
            if not np.array_equal(new, p):
                stepped[name].append(i + 1)
            p = new
        params[name] = p
    assert stepped["flat"] == [4, 8]
    assert stepped["nested"] == stepped["flat"]
    np.testing.assert_allclose(
        params["nested"], params["flat"], rtol=1e-6, atol=1e-7
    )


@pytest.mark.parametrize("fused", [False, True], ids=["update", "fused"])
@pytest.mark.parametrize("weights", ["padding_first", "token_counts"])
@pytest.mark.parametrize("middle", list(_MIDDLE_GATES))
def test_window_of_weight_0_reaches_a_second_accumulate_through_a_gate(
    middle, weights, fused
):
    """API.md 2: a window of weight 0 that reaches a second accumulate
    through another gate (a loss scale, a user's gate) counts there as one
    micro-batch of weight 0: the second accumulate's position advances, its
    weight stays 0, and accumulates of 2 and 2 step where
    ``oa.accumulate(4)`` does (calls 4 and 8), with its result."""
    tx = oa.chain(
        oa.accumulate(2),
        _MIDDLE_GATES[middle](),
        oa.accumulate(2),
        optax.sgd(1.0),
    )
    flat = oa.chain(oa.accumulate(4), optax.sgd(1.0))
    weights = _PADDED_WEIGHTS[weights]
    zero = weights.index(0.0) // 2  # the inner window of weight 0
    rng = np.random.default_rng(4)
    grads = jnp.asarray(rng.normal(size=(8, 2)), jnp.float32)
    grads = jnp.where(jnp.asarray(weights)[:, None] == 0, jnp.nan, grads)

    def step(tx, params, state, g, w):
        if fused:
            return oa.apply_gradients(tx, g, state, params, accum_weight=w)
        u, state = tx.update(g, state, params, accum_weight=w)
        return optax.apply_updates(params, u), state

    step = jax.jit(step, static_argnums=0)
    stepped, params = {}, {}
    for name, t in (("nested", tx), ("flat", flat)):
        p = jnp.zeros(2)
        s = t.init(p)
        stepped[name] = []
        for i, (g, w) in enumerate(zip(grads, weights, strict=True)):
            new, s = step(t, p, s, g, w)
            if not np.array_equal(new, p):
                stepped[name].append(i + 1)
            p = new
            if name == "nested" and i == 2 * zero + 1:
                # The second accumulate after the window of weight 0: one
                # more micro-batch seen (the first of its window, or the
                # second, which closed it), nothing added to its weight.
                second = s[2]
                assert int(second.mini_step) == (zero + 1) % 2
                assert int(second.gradient_step) == zero
                if zero == 0:
                    assert float(second.weight) == 0.0
        params[name] = p
    assert stepped["flat"] == [4, 8]
    assert stepped["nested"] == stepped["flat"]
    np.testing.assert_allclose(
        params["nested"], params["flat"], rtol=1e-6, atol=1e-7
    )


_ADAM_BEFORE_A_NESTED_GATE = {
    "flat": lambda: oa.chain(
        oa.accumulate(2),
        optax.scale_by_adam(),
        oa.accumulate(2),
        optax.sgd(1.0),
    ),
    "chain_in_chain": lambda: oa.chain(
        oa.chain(oa.accumulate(2), optax.scale_by_adam()),
        oa.accumulate(2),
        optax.sgd(1.0),
    ),
}


@pytest.mark.parametrize("fused", [False, True], ids=["update", "fused"])
@pytest.mark.parametrize("build", list(_ADAM_BEFORE_A_NESTED_GATE))
def test_stateful_element_before_a_nested_gate_skips_a_window_of_weight_0(
    build, fused
):
    """Weights 1, 1, 0, 0: the second inner window has weight 0, so Adam
    between the accumulates steps once (its count is 1, its moments those
    of one step) and the outer window's mean is that one Adam update."""
    tx = _ADAM_BEFORE_A_NESTED_GATE[build]()
    rng = np.random.default_rng(2)
    grads = jnp.asarray(rng.normal(size=(4, 3)), jnp.float32)
    grads = grads.at[2:].set(jnp.nan)  # padding: 0/0 gradients
    p = jnp.zeros(3)
    s = tx.init(p)
    for g, w in zip(grads, (1.0, 1.0, 0.0, 0.0), strict=True):
        if fused:
            p, s = oa.apply_gradients(tx, g, s, p, accum_weight=w)
        else:
            u, s = tx.update(g, s, p, accum_weight=w)
            p = optax.apply_updates(p, u)
    adam = optax.scale_by_adam()
    want_u, want_s = adam.update(jnp.mean(grads[:2], axis=0), adam.init(p))
    (got_s,) = [
        x
        for x in jax.tree.leaves(
            s, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState)
        )
        if isinstance(x, optax.ScaleByAdamState)
    ]
    assert int(got_s.count) == 1
    chex.assert_trees_all_close(got_s, want_s, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(p, -want_u, rtol=1e-6, atol=1e-7)


_ADAM_BEHIND_A_LOSS_SCALE = {
    "flat": lambda: oa.chain(
        oa.dynamic_loss_scale(1.0),
        optax.scale_by_adam(),
        oa.accumulate(2),
        optax.sgd(1.0),
    ),
    "nested": lambda: oa.chain(
        oa.dynamic_loss_scale(1.0),
        oa.chain(optax.scale_by_adam(), oa.accumulate(2), optax.sgd(1.0)),
    ),
}


@pytest.mark.parametrize("fused", [False, True], ids=["update", "fused"])
@pytest.mark.parametrize("build", list(_ADAM_BEHIND_A_LOSS_SCALE))
def test_element_before_a_nested_accumulate_skips_an_overflow(build, fused):
    """Behind a loss scale, Adam in front of an accumulate (the head of the
    chain that follows the scale) steps only on the micro-batches the
    scale lets through: with overflows at calls 1 and 4 its state is that
    of Adam on the three finite gradients (count 3, finite moments), and
    the one closed window (calls 2 and 3) is the mean of those two Adam
    updates."""
    tx = _ADAM_BEHIND_A_LOSS_SCALE[build]()
    rng = np.random.default_rng(3)
    grads = jnp.asarray(rng.normal(size=(5, 3)), jnp.float32)
    grads = grads.at[0, 1].set(jnp.inf).at[3, 0].set(jnp.nan)

    def step(params, state, g):
        if fused:
            return oa.apply_gradients(tx, g, state, params)
        u, state = tx.update(g, state, params)
        return optax.apply_updates(params, u), state

    step = jax.jit(step)
    p = jnp.zeros(3)
    s = tx.init(p)
    for g in grads:
        p, s = step(p, s, g)
    adam = optax.scale_by_adam()
    want_s, want_u = adam.init(p), []
    for g in grads[jnp.array([1, 2, 4])]:
        u, want_s = adam.update(g, want_s)
        want_u.append(u)
    (got_s,) = [
        x
        for x in jax.tree.leaves(
            s, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState)
        )
        if isinstance(x, optax.ScaleByAdamState)
    ]
    assert int(got_s.count) == 3
    chex.assert_trees_all_close(got_s, want_s, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(
        p, -(want_u[0] + want_u[1]) / 2, rtol=1e-6, atol=1e-7
    )


# ------------------------------------------------- gates users write (gates.md)


def _min_weight_gate(min_weight):
    """A gate that refuses micro-batches of ``accum_weight`` below
    ``min_weight``, reading the keyword as docs/gates.md says: declared by
    name, keyword-only, here without a default."""

    def gate_update(updates, state, params, ctx, *, accum_weight, **extra):
        del params, extra
        opens = ctx.passed & (jnp.asarray(accum_weight) >= min_weight)
        return oa.GateResult(state, opens, oa.Emitted(updates, state))

    try:
        return oa.GatedTransformation(lambda p: optax.EmptyState(), gate_update)
    except TypeError as e:  # refused when built
        raise AssertionError(f"a required keyword was refused: {e}") from e


@pytest.mark.parametrize("fused", [False, True], ids=["update", "fused"])
def test_gate_with_a_required_keyword_only_argument(fused):
    """A gate whose ``gate_update`` declares ``accum_weight`` keyword-only
    without a default is accepted: it gets the call's weight, and an
    accumulate after it sees only the micro-batches it let through (the
    reference: the weighted mean of those by hand). A call without the
    keyword raises ``TypeError`` naming it; a misspelling is caught."""
    tx = oa.chain(_min_weight_gate(2.0), oa.accumulate(2), optax.sgd(1.0))
    grads = [jnp.array([1.0]), jnp.array([5.0]), jnp.array([3.0])]
    weights = [2.0, 1.0, 4.0]  # the second is refused
    p = jnp.zeros(1)
    s = tx.init(p)
    for g, w in zip(grads, weights, strict=True):
        if fused:
            p, s = oa.apply_gradients(tx, g, s, p, accum_weight=w)
        else:
            u, s = tx.update(g, s, p, accum_weight=w)
            p = optax.apply_updates(p, u)
    np.testing.assert_allclose(p, [-(2.0 * 1.0 + 4.0 * 3.0) / 6.0], rtol=1e-6)
    with pytest.raises(TypeError, match="accum_weight"):
        tx.update(grads[0], s, p)
    with pytest.raises(TypeError, match="did you mean 'accum_weight'"):
        tx.update(grads[0], s, p, acum_weight=1.0)


def _int_flag_gate():
    """A gate whose ``may_open`` is an integer: ``ctx.passed & -1`` (-1 is
    what ``~False`` gives) is int32 (or the int 1), not a bool."""

    def flawed_gate_update(updates, state, params, ctx, **extra_args):
        return oa.GateResult(state, ctx.passed & -1, oa.Emitted(updates, state))

    return oa.GatedTransformation(
        lambda p: optax.EmptyState(), flawed_gate_update
    )


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize(
    "build",
    [
        lambda g: oa.chain(g, optax.sgd(1.0)),
        lambda g: oa.chain(oa.accumulate(2), g, optax.sgd(1.0)),
        lambda g: oa.chain(
            oa.accumulate(2), oa.dynamic_loss_scale(1.0), g, optax.sgd(1.0)
        ),
    ],
    ids=["first", "after_accumulate", "after_loss_scale"],
)
def test_gate_with_a_non_boolean_may_open_is_named(build, jit):
    """The chain checks the flag where it receives it: ``TypeError`` naming
    ``may_open``, its dtype and the gate's function (it crashed inside
    ``lax.cond`` about branch types, or silently took 1 for true)."""
    tx = build(_int_flag_gate())
    p = jnp.zeros(1)
    s = tx.init(p)
    update = jax.jit(tx.update) if jit else tx.update
    with pytest.raises(TypeError, match="may_open") as info:
        update(jnp.ones(1), s, p)
    assert "flawed_gate_update" in str(info.value)
    assert "int" in str(info.value)


@pytest.mark.parametrize("gated", [True, False])
def test_apply_gradients_returns_the_updates_on_request(gated):
    """``return_updates=True``: also the updates ``update`` gives (zeros
    where the window stays open), for a gate and a plain transformation."""
    tx = oa.chain(oa.accumulate(2), optax.sgd(0.5)) if gated else optax.sgd(0.5)
    params = jnp.ones(2)
    fused_state = plain_state = tx.init(params)
    for g in (jnp.ones(2), 3 * jnp.ones(2), jnp.ones(2)):
        want, plain_state = tx.update(g, plain_state, params)
        out = oa.apply_gradients(
            tx, g, fused_state, params, return_updates=True
        )
        new_params, fused_state, updates = out
        chex.assert_trees_all_close(updates, want)
        chex.assert_trees_all_close(
            new_params, optax.apply_updates(params, want)
        )
        two = oa.apply_gradients(tx, g, plain_state, params)
        assert len(two) == 2


# --------------------------------------------------------- nested accumulates


@pytest.mark.parametrize("fused", [False, True])
def test_nested_accumulates_give_the_weighted_mean(fused):
    """accumulate(2) inside accumulate(2): weights 1, 3, 5, 1 give the
    weighted mean over all four micro-batches (2.6), not 2.104."""
    tx = oa.chain(oa.accumulate(2), oa.accumulate(2), optax.sgd(1.0))
    gs, ws = [1.0, 2.0, 3.0, 4.0], [1.0, 3.0, 5.0, 1.0]
    params = jnp.zeros(1)
    state = tx.init(params)
    for g, w in zip(gs, ws):
        if fused:
            params, state = oa.apply_gradients(
                tx, jnp.array([g]), state, params, accum_weight=w
            )
        else:
            u, state = tx.update(jnp.array([g]), state, params, accum_weight=w)
            params = optax.apply_updates(params, u)
    want = -np.dot(gs, ws) / np.sum(ws)
    np.testing.assert_allclose(params, [want], rtol=1e-6)


def test_nested_chains_of_accumulates_equal_the_flat_window():
    """oa.chain(acc(2), oa.chain(acc(3), adam)) == oa.chain(acc(6), adam)
    with unequal weights, over two windows."""
    rng = np.random.default_rng(0)
    params = jnp.zeros(3)
    nested = oa.chain(
        oa.accumulate(2), oa.chain(oa.accumulate(3), optax.adam(0.1))
    )
    flat = oa.chain(oa.accumulate(6), optax.adam(0.1))
    s1, s2 = nested.init(params), flat.init(params)
    p1 = p2 = params
    for _ in range(12):
        g = jnp.asarray(rng.normal(size=3), jnp.float32)
        w = float(rng.integers(1, 20))
        u1, s1 = nested.update(g, s1, p1, accum_weight=w)
        u2, s2 = flat.update(g, s2, p2, accum_weight=w)
        p1, p2 = optax.apply_updates(p1, u1), optax.apply_updates(p2, u2)
    chex.assert_trees_all_close(p1, p2, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------- near-miss keywords


@pytest.mark.parametrize("entry", ["update", "apply_gradients", "flush"])
def test_near_miss_keyword_raises_naming_both(entry):
    tx = oa.chain(oa.agc(0.1), oa.accumulate(2), optax.sgd(1.0))
    params = jnp.ones(1)
    state = tx.init(params)
    call = {
        "update": lambda: tx.update(
            jnp.ones(1), state, params, acum_weight=2.0
        ),
        "apply_gradients": lambda: oa.apply_gradients(
            tx, jnp.ones(1), state, params, acum_weight=2.0
        ),
        "flush": lambda: oa.flush(tx, state, params, acum_weight=2.0),
    }[entry]
    with pytest.raises(TypeError, match="acum_weight.*accum_weight"):
        call()


def test_near_miss_of_a_follower_keyword_raises():
    """``valeu=`` for reduce_on_plateau's ``value=`` inside a gated chain."""
    tx = oa.chain(
        oa.accumulate(1), optax.sgd(1.0), optax.contrib.reduce_on_plateau()
    )
    params = jnp.ones(1)
    state = tx.init(params)
    tx.update(jnp.ones(1), state, params, value=1.0)  # the right name works
    with pytest.raises(TypeError, match="valeu.*value"):
        tx.update(jnp.ones(1), state, params, valeu=1.0)


def test_unrelated_extra_keywords_still_pass():
    tx = oa.chain(oa.accumulate(1), optax.sgd(1.0))
    state = tx.init(jnp.ones(1))
    tx.update(jnp.ones(1), state, jnp.ones(1), loss=3.0)  # optax tolerates


# ----------------------------- optax wrappers inside and around a gated chain


def _schedule(count):
    return 0.1 * (count + 1)


def test_inject_hyperparams_inside_the_chain_advances_once_per_window():
    """The right placement: the schedule counts windows (0.1, 0.2, 0.3)."""
    tx = oa.chain(
        oa.accumulate(2),
        optax.inject_hyperparams(optax.sgd)(learning_rate=_schedule),
    )
    params = jnp.zeros(1)
    state = tx.init(params)
    steps = []
    for _ in range(6):
        u, state = tx.update(jnp.ones(1), state, params)
        if bool(oa.has_updated(state)):
            steps.append(-float(u[0]))
    np.testing.assert_allclose(steps, [0.1, 0.2, 0.3], rtol=1e-6)


def test_inject_hyperparams_around_a_gated_chain_warns():
    """The wrong placement counts micro-steps; it is detected."""
    tx = optax.inject_hyperparams(
        lambda learning_rate: oa.chain(
            oa.accumulate(2), optax.sgd(learning_rate)
        )
    )(learning_rate=_schedule)
    params = jnp.zeros(1)
    state = tx.init(params)
    with pytest.warns(UserWarning, match="counts every call"):
        oa.apply_gradients(tx, jnp.ones(1), state, params)
    with pytest.warns(UserWarning, match="counts every call"):
        oa.has_updated(state)


def test_lookahead_inside_the_chain_syncs_once_per_sync_period_of_windows():
    """lookahead inside oa.chain: equals lookahead driven by hand with the
    window means, once per window."""
    inner = optax.lookahead(optax.sgd(0.5), sync_period=2, slow_step_size=0.5)
    tx = oa.chain(oa.accumulate(2), inner)
    params = optax.LookaheadParams.init_synced(jnp.zeros(2))
    ref_params, ref_state = params, inner.init(params)
    state = tx.init(params)
    rng = np.random.default_rng(1)
    for _ in range(4):
        gs = [jnp.asarray(rng.normal(size=2), jnp.float32) for _ in range(2)]
        for g in gs:
            params, state = oa.apply_gradients(tx, g, state, params)
        u, ref_state = inner.update((gs[0] + gs[1]) / 2, ref_state, ref_params)
        ref_params = optax.apply_updates(ref_params, u)
    chex.assert_trees_all_close(params, ref_params, rtol=1e-6)


# -------------------- gates that stay closed, fused steps, wrappers, keywords


def _opens_only_on_positive_gate():
    """May open on every call; lets the followers run only when the sum of
    the updates is > 0 (``opened`` decided inside emit)."""

    def gate_update(updates, state, params, ctx, **extra_args):
        del params, ctx, extra_args  # first in its chain: ctx.passed is True
        ok = jnp.sum(updates) > 0
        return oa.GateResult(
            state, jnp.array(True), lambda: (updates, state, ok)
        )

    return oa.GatedTransformation(
        lambda params: optax.EmptyState(), gate_update
    )


@pytest.mark.parametrize("fused", [False, True])
def test_outer_gate_not_opened_leaves_inner_gate_state_untouched(fused):
    """Mutant (a): the followers' state taken from the inner branch when the
    outer gate's ``opened`` is false. The inner accumulate must not count a
    micro-batch that the outer gate refused."""
    tx = oa.chain(
        _opens_only_on_positive_gate(), oa.accumulate(2), optax.sgd(1.0)
    )
    params = jnp.zeros(1)
    state = tx.init(params)
    for g, pos in ((-1.0, 0), (2.0, 1), (-5.0, 1), (4.0, 0)):  # -: refused
        if fused:
            params, state = oa.apply_gradients(
                tx, jnp.array([g]), state, params
            )
        else:
            u, state = tx.update(jnp.array([g]), state, params)
            params = optax.apply_updates(params, u)
        acc = state[1]
        assert int(acc.mini_step) == pos, (g, acc)
    np.testing.assert_allclose(params, [-3.0])  # mean of 2 and 4


def test_fused_closed_step_returns_params_bit_for_bit():
    """Mutant (b): the closed branch computing ``params + zeros`` instead of
    returning ``params``: equal values except the sign of -0.0."""
    tx = oa.chain(oa.accumulate(2), optax.adam(0.1))
    params = {"w": jnp.array([-0.0, 1.0, -0.0]), "b": jnp.array([-0.0])}
    state = tx.init(params)
    # Eager: under jit XLA folds ``x + 0`` to ``x`` and hides the mutant.
    new, _ = oa.apply_gradients(
        tx, jax.tree.map(jnp.ones_like, params), state, params
    )
    for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.signbit(a), np.signbit(b))
        np.testing.assert_array_equal(
            np.asarray(a).view(np.uint32), np.asarray(b).view(np.uint32)
        )


@pytest.mark.parametrize("wrap", ["lookahead", "multisteps"])
def test_other_counting_wrappers_around_a_gated_chain_warn(wrap):
    """optax.lookahead / optax.MultiSteps around an oa.chain count
    micro-batches too (lookahead syncs, MultiSteps steps per call): warned."""
    inner = oa.chain(oa.accumulate(2), optax.sgd(0.1))
    params = jnp.zeros(1)
    if wrap == "lookahead":
        tx = optax.lookahead(inner, sync_period=2, slow_step_size=0.5)
        params = optax.LookaheadParams.init_synced(params)
        grads = jnp.ones(1)
    else:
        tx = optax.MultiSteps(
            inner, every_k_schedule=2
        ).gradient_transformation()
        grads = jnp.ones(1)
    state = tx.init(params)
    with pytest.warns(UserWarning, match="counts every call"):
        oa.apply_gradients(tx, grads, state, params)


def test_user_keyword_passed_cannot_drop_a_micro_batch():
    """'passed' used to be a keyword of the gate protocol inside the user's
    own extra arguments, where a user's passed=False would have silently
    dropped the micro-batch. The protocol's flag now travels in
    ``oa.GateContext``: a user's ``passed`` is an ordinary
    keyword that no gate reads, and the micro-batch counts."""
    tx = oa.chain(oa.accumulate(2), optax.sgd(1.0))
    params = jnp.zeros(1)
    state = tx.init(params)
    _, s = tx.update(jnp.ones(1), state, params, passed=jnp.array(False))
    assert int(s[0].mini_step) == 1
    _, s = oa.apply_gradients(tx, jnp.ones(1), state, params, passed=False)
    assert int(s[0].mini_step) == 1


def test_follower_keyword_close_to_accum_weight_is_not_a_near_miss():
    """A keyword some element declares is never taken for a typo of another
    element's (accumulate used to check against accum_weight alone)."""

    def update(updates, state, params=None, *, accum_weights=None, **extra):
        del params, extra
        return jax.tree.map(lambda u: u * accum_weights, updates), state

    scaler = optax.GradientTransformationExtraArgs(
        lambda p: optax.EmptyState(), update
    )
    tx = oa.chain(oa.accumulate(1), scaler)
    params = jnp.zeros(1)
    u, _ = tx.update(jnp.ones(1), tx.init(params), params, accum_weights=3.0)
    np.testing.assert_allclose(u, [3.0])


# --------------------------------- bare `weight` and non-numeric accum_weight


@pytest.mark.parametrize(
    "entry", ["update", "apply_gradients", "flush", "nnx", "trainstate"]
)
def test_bare_weight_keyword_is_a_near_miss_of_accum_weight(entry):
    """``weight=3.`` was silently ignored."""
    tx = oa.chain(oa.agc(0.1), oa.accumulate(2), optax.sgd(1.0))
    params = {"w": jnp.ones(1)}
    state = tx.init(params)
    grads = {"w": jnp.ones(1)}

    def call():
        if entry == "update":
            return tx.update(grads, state, params, weight=3.0)
        if entry == "apply_gradients":
            return oa.apply_gradients(tx, grads, state, params, weight=3.0)
        if entry == "flush":
            return oa.flush(tx, state, params, weight=3.0)
        if entry == "nnx":
            from flax import nnx

            from optaxaccum.flax import nnx as oa_nnx

            model = nnx.Linear(1, 1, rngs=nnx.Rngs(0))
            opt = oa_nnx.Optimizer(model, tx)
            g = nnx.grad(lambda m: m(jnp.ones((1, 1))).sum())(model)
            return opt.update(model, g, weight=3.0)
        from optaxaccum.flax import TrainState

        ts = TrainState.create(apply_fn=None, params=params, tx=tx)
        return ts.apply_gradients(grads=grads, weight=3.0)

    with pytest.raises(TypeError, match="'weight'.*'accum_weight'"):
        call()


@pytest.mark.parametrize("loss_scale", [False, True])
@pytest.mark.parametrize("entry", ["update", "apply_gradients"])
def test_string_accum_weight_raises_naming_it(entry, loss_scale):
    """A string ``accum_weight`` gave numpy's raw
    ``ufunc 'isfinite' not supported``."""
    head = (oa.dynamic_loss_scale(),) if loss_scale else ()
    tx = oa.chain(*head, oa.accumulate(2), optax.sgd(1.0))
    params = jnp.ones(1)
    state = tx.init(params)
    with pytest.raises(TypeError, match="accum_weight"):
        if entry == "update":
            tx.update(jnp.ones(1), state, params, accum_weight="2")
        else:
            oa.apply_gradients(tx, jnp.ones(1), state, params, accum_weight="2")


# ---------------------- zeros of a closed gate: the followers' dtype and type


def _to_float32():
    """A follower that casts the updates to float32 (as Adam does for bf16
    gradients of float32 params)."""
    return optax.GradientTransformationExtraArgs(
        lambda params: optax.EmptyState(),
        lambda u, s, p=None, **kw: (
            jax.tree.map(lambda x: x.astype(jnp.float32), u),
            s,
        ),
    )


@pytest.mark.parametrize("jit", [False, True])
def test_zeros_take_the_followers_output_dtype(jit):
    """bf16 gradients, a follower casting to
    float32. Every call emits float32: a non-closing call (the closed gate's
    zeros), a closing one, and a flush of an all-weight-0 window (the gate
    opens with ``opened=False``): never zeros in the gradients' dtype."""
    tx = oa.chain(oa.accumulate(2), _to_float32(), optax.sgd(1.0))
    params = jnp.zeros(2, jnp.bfloat16)
    state = tx.init(params)
    update = jax.jit(tx.update) if jit else tx.update
    flush = (
        jax.jit(lambda s, p: oa.flush(tx, s, p))
        if jit
        else (lambda s, p: oa.flush(tx, s, p))
    )
    g = jnp.ones(2, jnp.bfloat16)
    dtypes = []
    u, state = update(g, state, params)  # non-closing: the closed gate
    dtypes.append(u.dtype)
    u, state = update(g, state, params)  # closing
    dtypes.append(u.dtype)
    np.testing.assert_array_equal(u, [-1.0, -1.0])
    _, state = update(g, state, params, accum_weight=0.0)
    u, state = flush(state, params)  # opens with opened=False: weight 0
    dtypes.append(u.dtype)
    np.testing.assert_array_equal(u, [0.0, 0.0])
    assert dtypes == [jnp.float32] * 3, dtypes


def test_nested_closed_gate_zeros_take_the_followers_output_dtype():
    """Where the outer window closes but an
    inner gate after a float32-casting follower stays closed, the zeros are
    float32 (the followers' output), not the bf16 gradients' dtype."""
    # The outer window closes on every call (so no branch is traced before
    # the dtype is checked); the inner one on every second.
    tx = oa.chain(
        oa.accumulate(1), _to_float32(), oa.accumulate(2), optax.sgd(1.0)
    )
    params = jnp.zeros(2, jnp.bfloat16)
    state = tx.init(params)
    dtypes = []
    for i in range(2):
        u, state = tx.update(jnp.full(2, i + 1.0, jnp.bfloat16), state, params)
        dtypes.append(u.dtype)
    assert dtypes == [jnp.float32] * 2, dtypes
    np.testing.assert_array_equal(u, [-1.5, -1.5])


@pytest.mark.devices(4)
def test_closed_gate_zeros_keep_the_device_varying_type_under_shard_map():
    """Inside
    ``shard_map`` the zeros a closed gate emits are built from the shapes of
    what the open branch would emit, so they keep its device-varying type
    (``vma``) and dtype; zeros typed as the incoming gradients, or built
    without the varying type, make ``lax.cond``'s branches disagree. Checked
    on the helper the chain builds its zeros with, before any branch."""
    from optaxaccum._src import flags
    from optaxaccum._src.microbatch import _vma as _varying

    mesh = jax.make_mesh((4,), ("d",))
    seen = {}

    def body(g):
        shapes = jax.eval_shape(lambda: g.astype(jnp.float32))
        zeros = flags.zeros_of(shapes)
        seen["want"] = (_varying(g), jnp.float32)
        seen["got"] = (_varying(zeros), zeros.dtype)
        return zeros

    g = jax.device_put(jnp.ones(8, jnp.bfloat16), NamedSharding(mesh, P("d")))
    jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d")))(
        g
    )
    assert seen["want"][0] == frozenset({"d"}), seen
    assert seen["got"] == seen["want"], seen


# ------------------------------------------ nested windows: flush, has_updated


def _run_with_flushes(tx, grads, weights, flush_after, jit):
    """Feeds ``grads`` (with ``weights``) to ``tx``; after the calls in
    ``flush_after`` (positions), two ``oa.flush`` (the second must do
    nothing). Returns each call's updates, has_updated and the optimizer's
    step count."""
    update = jax.jit(tx.update) if jit else tx.update
    flush = jax.jit(lambda s, p: oa.flush(tx, s, p)) if jit else None
    flush = flush or (lambda s, p: oa.flush(tx, s, p))
    params = jnp.zeros(2)
    state = tx.init(params)
    seen = []

    def record(u, s):
        count = optax.tree_utils.tree_get(s, "count")
        seen.append((u, oa.has_updated(s), count))
        return s

    for t, (g, w) in enumerate(zip(grads, weights, strict=True)):
        u, state = update(g, state, params, accum_weight=w)
        state = record(u, state)
        if t in flush_after:
            for _ in range(2):
                state = record(*flush(state, params))
    return seen


@pytest.mark.parametrize(
    "flush_after,jit",
    [((0,), False), ((4,), False), ((5,), True), ((7, 8), False)]
    + [((3, 13), True)],
)
def test_nested_accumulates_flush_and_has_updated_as_one_window(
    flush_after, jit
):
    """``oa.flush`` of nested accumulates closes the whole nested window
    (the inner one's partial window enters the outer one, whose partial
    window then closes), and ``oa.has_updated`` says whether Adam stepped:
    both as for one ``oa.accumulate(6)``, over several windows, with
    weights, a flush at various positions (after a full inner window, mid
    inner window, right after the outer one closed)."""
    rng = np.random.default_rng(0)
    n = 15
    grads = [jnp.asarray(rng.normal(size=2), jnp.float32) for _ in range(n)]
    weights = [float(w) for w in rng.integers(1, 4, size=n)]
    nested = oa.chain(oa.accumulate(2), oa.accumulate(3), optax.adam(0.1))
    one = oa.chain(oa.accumulate(6), optax.adam(0.1))
    got = _run_with_flushes(nested, grads, weights, flush_after, jit)
    want = _run_with_flushes(one, grads, weights, flush_after, jit)
    assert len(got) == len(want)
    for t, ((u, up, c), (u1, up1, c1)) in enumerate(zip(got, want)):
        assert bool(up) == bool(up1), t
        assert int(c) == int(c1), t
        chex.assert_trees_all_close(u, u1, rtol=1e-6, atol=1e-7)


def test_nested_chains_of_accumulates_flush_as_one_window():
    """The same through chains nested in chains (``oa.chain(acc,
    oa.chain(acc, adam))``) and an outer optax.chain."""
    rng = np.random.default_rng(1)
    grads = [jnp.asarray(rng.normal(size=2), jnp.float32) for _ in range(9)]
    weights = [1.0] * 9
    inner = oa.chain(oa.accumulate(3), optax.adam(0.1))
    for nested in (
        oa.chain(oa.accumulate(2), inner),
        optax.chain(optax.scale(2.0), oa.chain(oa.accumulate(2), inner)),
    ):
        one = optax.chain(
            optax.scale(2.0), oa.chain(oa.accumulate(6), optax.adam(0.1))
        )
        if isinstance(nested, _gating.GatedTransformation):
            one = oa.chain(oa.accumulate(6), optax.adam(0.1))
        got = _run_with_flushes(nested, grads, weights, (4, 7), False)
        want = _run_with_flushes(one, grads, weights, (4, 7), False)
        for t, ((u, up, c), (u1, up1, c1)) in enumerate(zip(got, want)):
            assert (bool(up), int(c)) == (bool(up1), int(c1)), t
            chex.assert_trees_all_close(u, u1, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("weighted", [False, True])
def test_lbfgs_after_an_accumulate_with_and_without_accum_weight(weighted):
    """``optax.lbfgs`` after an accumulate (its zoom line search hands
    every keyword it gets to ``value_fn``) steps like optax.lbfgs on the
    window's weighted mean, ``accum_weight=`` passed or not: the
    accumulate's keyword does not reach it (it raised TypeError 'not
    consumed by value_fn')."""

    def f(p):
        return jnp.sum((p - jnp.array([1.0, -2.0])) ** 2 * jnp.array([1, 3]))

    grads = [jnp.array([1.0, 2.0]), jnp.array([3.0, -1.0])] * 2
    weights = [1.0, 3.0, 2.0, 2.0]
    tx = oa.chain(oa.accumulate(2), optax.lbfgs())
    ref = optax.lbfgs()
    params = ref_params = jnp.zeros(2)
    state, ref_state = tx.init(params), ref.init(ref_params)
    for t, (g, w) in enumerate(zip(grads, weights)):
        first = t - t % 2  # the window's first micro-batch
        ws = weights[first : first + 2] if weighted else [1.0, 1.0]
        pair = grads[first : first + 2]
        mean = (ws[0] * pair[0] + ws[1] * pair[1]) / sum(ws)
        kw = {"accum_weight": w} if weighted else {}
        args = dict(value=f(params), grad=mean, value_fn=f)
        u, state = tx.update(g, state, params, **args, **kw)
        params = optax.apply_updates(params, u)
        if t % 2 == 1:
            u, ref_state = ref.update(
                mean,
                ref_state,
                ref_params,
                value=f(ref_params),
                grad=mean,
                value_fn=f,
            )
            ref_params = optax.apply_updates(ref_params, u)
    chex.assert_trees_all_close(params, ref_params, rtol=1e-6)


def test_accum_weight_reaches_only_elements_declaring_it():
    """Followers see exactly the call's keywords except ``accum_weight``:
    a plain follower taking ``**extra_args`` never sees it; a gate after an
    accumulate that declares it gets the window's total weight, also when
    the call passed none."""
    seen = []

    def record(updates, state, params=None, **extra_args):
        seen.append(("plain", tuple(sorted(extra_args))))
        return updates, state

    plain = optax.GradientTransformationExtraArgs(lambda p: (), record)

    def gate_update(updates, state, params, ctx, *, accum_weight=None, **kw):
        seen.append(("gate", accum_weight is None, tuple(sorted(kw))))
        weight = jnp.full_like(updates, accum_weight)  # emitted: seen below
        return oa.GateResult(state, True, oa.Emitted(weight, state))

    gate = oa.GatedTransformation(lambda p: (), gate_update)
    tx = oa.chain(plain, oa.accumulate(2), gate, plain)
    params = jnp.zeros(1)
    state = tx.init(params)
    for w in (2.0, 3.0):
        u, state = tx.update(jnp.ones(1), state, params, accum_weight=w, x=1)
    assert float(u[0]) == 5.0
    for _ in range(2):
        u, state = tx.update(jnp.ones(1), state, params, x=1)
    assert float(u[0]) == 2.0
    # (traced more than once per call: the same each time)
    assert set(seen) == {("plain", ("x",)), ("gate", False, ("x",))}
