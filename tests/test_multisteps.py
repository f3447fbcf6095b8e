"""Tests of ``oa.MultiSteps``: the drop-in for ``optax.MultiSteps``.

The reference is ``optax.MultiSteps`` itself, run side by side on the same
gradients; optax's own test cases are in ``test_multisteps_optax.py``.
"""

import copy
import inspect
import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optaxaccum as oa
from tests import helpers
from tests import hlo_queries as _hlo

TOL = dict(rtol=2e-5, atol=2e-6)


def _optimizers():
    mask = {"w": True, "b": False}
    return {
        "sgd": optax.sgd(0.1),
        "adam": optax.adam(0.05),
        "adamw_masked": optax.adamw(0.05, weight_decay=0.1, mask=mask),
        "clip_adam": optax.chain(
            optax.clip_by_global_norm(1.0), optax.adam(0.05)
        ),
    }


def _side_by_side(ours, theirs, grads, params, tol=TOL, mean=True, **kw):
    """Runs both wrappers (jitted) on ``grads``, applying their updates, and
    checks updates, counters, has_updated and the inner state on each call.
    Returns both final states and the number of closing calls."""
    s_ours, s_theirs = ours.init(params), theirs.init(params)
    p_ours = p_theirs = params
    up_ours, up_theirs = jax.jit(ours.update), jax.jit(theirs.update)
    closed = 0
    for g in grads:
        inner_before = s_ours.inner_opt_state
        gradient_step_before = s_ours.gradient_step
        steps_theirs = s_theirs.gradient_step
        u_ours, s_ours = up_ours(g, s_ours, p_ours, **kw)
        u_theirs, s_theirs = up_theirs(g, s_theirs, p_theirs)
        chex.assert_trees_all_close(u_ours, u_theirs, **tol)
        chex.assert_trees_all_equal_dtypes(u_ours, u_theirs)
        assert int(s_ours.mini_step) == int(s_theirs.mini_step)
        assert int(s_ours.gradient_step) == int(s_theirs.gradient_step)
        # has_updated: whether this call stepped the optimizer. optax's
        # agrees except on a call refused right after a close (it still
        # says true there: its rule reads the counters).
        stepped_theirs = int(s_theirs.gradient_step) > int(steps_theirs)
        assert bool(ours.has_updated(s_ours)) == stepped_theirs
        chex.assert_trees_all_close(
            s_ours.inner_opt_state, s_theirs.inner_opt_state, **tol
        )
        if int(s_ours.mini_step) != 0:
            # Mid-window: the inner state is bit-for-bit untouched ...
            chex.assert_trees_all_equal(s_ours.inner_opt_state, inner_before)
            # ... and acc_grads holds the sum (optax: the running mean).
            n = s_ours.acc_weight if mean else 1
            want = jax.tree.map(lambda a: a * n, s_theirs.acc_grads)
            chex.assert_trees_all_close(s_ours.acc_grads, want, **tol)
        closed += int(s_ours.gradient_step) > int(gradient_step_before)
        p_ours = optax.apply_updates(p_ours, u_ours)
        p_theirs = optax.apply_updates(p_theirs, u_theirs)
    chex.assert_trees_all_close(p_ours, p_theirs, **tol)
    return s_ours, s_theirs, closed


@pytest.mark.parametrize("opt_name", list(_optimizers()))
def test_equals_optax_multisteps(opt_name):
    opt = _optimizers()[opt_name]
    params = helpers.linear_params()
    _, _, closed = _side_by_side(
        oa.MultiSteps(opt, 3),
        optax.MultiSteps(opt, 3),
        helpers.gradient_trees(12, params),
        params,
    )
    assert closed == 4


@pytest.mark.parametrize("use_grad_mean", [True, False])
def test_every_k_schedule_callable_and_sum(use_grad_mean):
    schedule = lambda step: jnp.where(step < 2, 1, 3)  # noqa: E731
    params = helpers.linear_params()
    opt = optax.sgd(0.1, momentum=0.9)
    s, _, closed = _side_by_side(
        oa.MultiSteps(opt, schedule, use_grad_mean=use_grad_mean),
        optax.MultiSteps(opt, schedule, use_grad_mean=use_grad_mean),
        helpers.gradient_trees(11, params),
        params,
        mean=use_grad_mean,
    )
    assert closed == 5 and int(s.gradient_step) == 5  # 1, 1, 3, 3, 3


@pytest.mark.parametrize("use_grad_mean", [True, False])
def test_skip_not_finite_matches_optax(use_grad_mean):
    """Inf/NaN micro-batches, one of them where a window would close, are
    dropped as if never seen; skip_state records them as optax's does."""
    params = helpers.linear_params()
    bad = {1: jnp.inf, 3: jnp.nan, 6: -jnp.inf}  # 3 would close a window
    opt = optax.adam(0.05)

    def make(cls, opt, k):
        return cls(
            opt,
            k,
            use_grad_mean=use_grad_mean,
            should_skip_update_fn=optax.skip_not_finite,
        )

    s_ours, s_theirs, closed = _side_by_side(
        make(oa.MultiSteps, opt, 3),
        make(optax.MultiSteps, opt, 3),
        helpers.gradient_trees(11, params, bad=bad),
        params,
        mean=use_grad_mean,
    )
    assert closed == 2  # 11 micro-batches, 3 of them dropped: 8 = 2 * 3 + 2
    chex.assert_trees_all_equal(s_ours.skip_state, s_theirs.skip_state)
    assert int(s_ours.mini_step) == 2


def test_custom_skip_fn_gets_gradient_step_and_params():
    """The skip function sees the window count and the params (here:
    refuse large gradients only in the first two windows)."""
    seen = []

    def skip_fn(updates, gradient_step, params):
        seen.append(jax.tree.structure(params))
        norm = optax.tree.norm(updates)
        skip = jnp.logical_and(gradient_step < 2, norm > 10.0)
        return skip, {"norm": norm, "step": gradient_step}

    params = helpers.linear_params()
    grads = helpers.gradient_trees(10, params)
    grads[2] = jax.tree.map(lambda g: 10 * g, grads[2])
    grads[7] = jax.tree.map(lambda g: 10 * g, grads[7])
    opt = optax.sgd(0.1)
    s, _, _ = _side_by_side(
        oa.MultiSteps(opt, 2, should_skip_update_fn=skip_fn),
        optax.MultiSteps(opt, 2, should_skip_update_fn=skip_fn),
        grads,
        params,
    )
    assert all(t == jax.tree.structure(params) for t in seen)
    assert int(s.gradient_step) == 4  # grads[2] refused, grads[7] counted


def test_skip_fn_must_return_a_boolean_scalar():
    bad = lambda u, step, p: (jnp.zeros([2], bool), ())  # noqa: E731
    ms = oa.MultiSteps(optax.sgd(0.1), 2, should_skip_update_fn=bad)
    with pytest.raises(ValueError, match="boolean scalar"):
        ms.init(helpers.linear_params())


def test_bf16_params_float32_accumulation():
    params = helpers.linear_params(jnp.bfloat16)
    opt = optax.adam(0.05)
    s, _, closed = _side_by_side(
        oa.MultiSteps(opt, 4),
        optax.MultiSteps(opt, 4),
        helpers.gradient_trees(8, params),
        params,
        tol=dict(rtol=2e-2, atol=2e-3),
    )
    assert closed == 2
    assert all(a.dtype == jnp.float32 for a in jax.tree.leaves(s.acc_grads))


def test_scan_with_state_as_carry_is_dtype_stable():
    params = helpers.linear_params(jnp.bfloat16)
    grads = helpers.gradient_trees(8, params)
    stacked = jax.tree.map(lambda *g: jnp.stack(g), *grads)

    def run(ms):
        def body(carry, g):
            p, s = carry
            u, s = ms.update(g, s, p)
            return (optax.apply_updates(p, u), s), None

        return jax.lax.scan(body, (params, ms.init(params)), stacked)[0]

    opt = optax.adam(0.05)
    p_ours, s_ours = jax.jit(lambda: run(oa.MultiSteps(opt, 3)))()
    p_theirs, _ = jax.jit(lambda: run(optax.MultiSteps(opt, 3)))()
    chex.assert_trees_all_close(p_ours, p_theirs, rtol=2e-2, atol=2e-3)
    init = oa.MultiSteps(opt, 3).init(params)
    chex.assert_trees_all_equal_shapes_and_dtypes(s_ours, init)
    assert int(s_ours.gradient_step) == 2


def test_jit_with_donation_and_fused_path_params_untouched():
    """Donated params and state; on a non-closing micro-step the fused step
    returns the params bit for bit (-0.0 keeps its sign) and the inner
    state untouched; the results equal the plain protocol's."""
    opt = optax.adam(0.05)
    ms = oa.MultiSteps(opt, 3, should_skip_update_fn=optax.skip_not_finite)
    params = jax.tree.map(
        lambda p: jnp.full_like(p, -0.0), helpers.linear_params()
    )
    grads = helpers.gradient_trees(7, params, bad={2: jnp.nan})

    fused = jax.jit(
        lambda p, s, g: oa.apply_gradients(ms, g, s, p), donate_argnums=(0, 1)
    )

    @jax.jit
    def plain(p, s, g):
        u, s = ms.update(g, s, p)
        return optax.apply_updates(p, u), s

    p_ref, s_ref = params, ms.init(params)
    p, s = jax.tree.map(jnp.copy, (params, ms.init(params)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. "donated buffers not usable"
        for i, g in enumerate(grads):
            p_ref, s_ref = plain(p_ref, s_ref, g)
            inner_before = jax.tree.map(jnp.copy, s.inner_opt_state)
            p, s = fused(p, s, g)
            # (XLA may fuse the two programs' arithmetic differently.)
            chex.assert_trees_all_close(p, p_ref, rtol=1e-6, atol=0)
            chex.assert_trees_all_close(s, s_ref, rtol=1e-6, atol=0)
            if i < 3:  # grads[2] is dropped: the first window closes at 3
                assert all(
                    bool(jnp.all(jnp.signbit(x))) for x in jax.tree.leaves(p)
                )
                chex.assert_trees_all_equal(s.inner_opt_state, inner_before)
    assert int(s.gradient_step) == 2


def test_inner_optimizer_runs_once_per_window():
    """Counted on the host: optax's MultiSteps runs the inner optimizer on
    every call, oa.MultiSteps once per window (plain and fused)."""
    counter = []

    def update(updates, state, params=None):
        jax.debug.callback(lambda: counter.append(1))
        return updates, state

    counting = optax.GradientTransformation(
        lambda p: optax.EmptyState(), update
    )
    params = helpers.linear_params()
    grads = helpers.gradient_trees(8, params)
    runs = {}
    for name, ms in (
        ("optax", optax.MultiSteps(counting, 4)),
        ("oa", oa.MultiSteps(counting, 4)),
    ):
        counter.clear()
        step = jax.jit(ms.update)
        s = ms.init(params)
        for g in grads:
            _, s = step(g, s, params)
        jax.effects_barrier()
        runs[name] = len(counter)
    counter.clear()
    ms = oa.MultiSteps(counting, 4)
    fused = jax.jit(lambda p, s, g: oa.apply_gradients(ms, g, s, p))
    p, s = params, ms.init(params)
    for g in grads:
        p, s = fused(p, s, g)
    jax.effects_barrier()
    runs["oa fused"] = len(counter)
    assert runs == {"optax": 8, "oa": 2, "oa fused": 2}


def test_flush_closes_the_partial_window():
    opt = optax.sgd(1.0, momentum=0.5)
    ms = oa.MultiSteps(opt, 4)
    params = helpers.linear_params()
    grads = helpers.gradient_trees(6, params)
    s = ms.init(params)
    step = jax.jit(ms.update)
    for g in grads:  # one window of 4, then 2 of the next
        _, s = step(g, s, params)
    flush = jax.jit(lambda s, p: oa.flush(ms, s, p))
    u, s = flush(s, params)
    # Reference: optax.MultiSteps over the same windows, 4 then 2.
    ref = optax.MultiSteps(opt, lambda step: jnp.where(step < 1, 4, 2))
    r = ref.init(params)
    ref_step = jax.jit(ref.update)
    for g in grads:
        want, r = ref_step(g, r, params)
    chex.assert_trees_all_close(u, want, **TOL)
    assert int(s.mini_step) == 0 and int(s.gradient_step) == 2
    assert bool(ms.has_updated(s))
    chex.assert_trees_all_close(s.inner_opt_state, r.inner_opt_state, **TOL)
    # An empty window: zeros, nothing changes.
    u, s2 = flush(s, params)
    chex.assert_trees_all_equal(u, jax.tree.map(jnp.zeros_like, params))
    chex.assert_trees_all_equal(s2, s)


def test_accum_weight_gives_the_weighted_mean():
    opt = optax.sgd(1.0)
    params = helpers.linear_params()
    grads = helpers.gradient_trees(3, params)
    weights = [3.0, 0.0, 5.0]
    want = jax.tree.map(
        lambda *g: -sum(w * x for w, x in zip(weights, g)) / sum(weights),
        *grads,
    )
    for use_grad_mean in (True, False):
        ms = oa.MultiSteps(opt, 3, use_grad_mean=use_grad_mean)
        s = ms.init(params)
        step = jax.jit(ms.update)
        for g, w in zip(grads, weights):
            u, s = step(g, s, params, accum_weight=w)
        scale = 1.0 if use_grad_mean else sum(weights)
        chex.assert_trees_all_close(
            u, jax.tree.map(lambda x: scale * x, want), **TOL
        )


def test_in_optax_chain_and_oa_chain():
    opt = optax.adam(0.05)
    params = helpers.linear_params()
    grads = helpers.gradient_trees(8, params)
    # In optax.chain, next to optax's (whose wrapper needs
    # gradient_transformation() there; ours is a transformation itself).
    ours = optax.chain(optax.clip(0.5), oa.MultiSteps(opt, 4))
    theirs = optax.chain(
        optax.clip(0.5), optax.MultiSteps(opt, 4).gradient_transformation()
    )
    s_o, s_t = ours.init(params), theirs.init(params)
    up_o, up_t = jax.jit(ours.update), jax.jit(theirs.update)
    for g in grads:
        u_o, s_o = up_o(g, s_o, params)
        u_t, s_t = up_t(g, s_t, params)
        chex.assert_trees_all_close(u_o, u_t, **TOL)

    # After a loss scale in an oa.chain: the same as oa.accumulate there; an
    # overflowing micro-batch does not count toward the window, nor reaches
    # the skip function's state (here: one that never skips).
    def never(updates, gradient_step, params):
        return jnp.array(False), {"norm": optax.tree.norm(updates)}

    scaled = [jax.tree.map(lambda x: 256.0 * x, g) for g in grads]
    scaled[2] = jax.tree.map(lambda x: x.at[0].set(jnp.inf), scaled[2])
    ours = oa.chain(
        oa.dynamic_loss_scale(256.0),
        oa.MultiSteps(opt, 3, should_skip_update_fn=never),
    )
    ref = oa.chain(oa.dynamic_loss_scale(256.0), oa.accumulate(3), opt)
    s_o, s_r = ours.init(params), ref.init(params)
    fused = jax.jit(lambda p, s, g: oa.apply_gradients(ours, g, s, p))
    fused_ref = jax.jit(lambda p, s, g: oa.apply_gradients(ref, g, s, p))
    p_o = p_r = params
    for i, g in enumerate(scaled):
        p_o, s_o = fused(p_o, s_o, g)
        p_r, s_r = fused_ref(p_r, s_r, g)
        chex.assert_trees_all_close(p_o, p_r, **TOL)
        if i in (1, 2):  # the norm of grads[1], kept through the overflow
            norm = s_o[1].skip_state["norm"]
            np.testing.assert_allclose(norm, optax.tree.norm(grads[1]), 1e-5)
    assert int(s_o[1].gradient_step) == 2 and int(s_o[1].mini_step) == 1
    chex.assert_trees_all_close(s_o[1].inner_opt_state, s_r[2], **TOL)


def _compiled_text(fn, *args):
    return jax.jit(fn).lower(*args).compile().as_text()


def test_hlo_inner_optimizer_only_in_the_closing_branch():
    """Adam's square root is inside a conditional's branch only, the skip
    check (is-finite) runs on every call; optax's MultiSteps computes the
    square root on every micro-step."""
    params = {"w": jnp.zeros((64, 32)), "b": jnp.zeros(32)}
    opt = optax.adam(1e-3)
    plain = oa.MultiSteps(opt, 4)
    skipping = oa.MultiSteps(
        opt, 4, should_skip_update_fn=optax.skip_not_finite
    )
    for ms, fn in (
        (plain, plain.update),
        (skipping, lambda g, s, p: oa.apply_gradients(skipping, g, s, p)),
    ):
        text = _compiled_text(fn, params, ms.init(params), params)
        always, branch = _hlo.split(text)
        assert _hlo.count(always, "sqrt") == 0
        assert _hlo.count(branch, "sqrt") >= 1
        assert _hlo.count(always, "divide") == 0  # no mean mid-window
    assert _hlo.count(always, "is-finite") >= 1  # the skip check: every call
    theirs = optax.MultiSteps(opt, 4)
    always, _ = _hlo.split(
        _compiled_text(theirs.update, params, theirs.init(params), params)
    )
    assert _hlo.count(always, "sqrt") >= 1


def test_fused_step_needs_no_tree_sized_temporary():
    """As oa.chain(oa.accumulate(k), adam): params and state donated, the
    compiled fused step allocates no temporary of the tree's size beyond
    what the skip function itself needs (optax.skip_not_finite counts the
    non-finite entries in an int32 tree on CPU)."""
    params = {"w": jnp.zeros((256, 256))}
    tree_bytes = 256 * 256 * 4
    skip_alone = jax.jit(lambda g: optax.skip_not_finite(g, 0, None))
    skip_temp = skip_alone.lower(params).compile().memory_analysis()
    for skip, allowed in (
        (None, 0),
        (optax.skip_not_finite, skip_temp.temp_size_in_bytes),
    ):
        ms = oa.MultiSteps(optax.adam(1e-3), 4, should_skip_update_fn=skip)
        step = jax.jit(
            lambda p, s, g, ms=ms: oa.apply_gradients(ms, g, s, p),
            donate_argnums=(0, 1),
        )
        compiled = step.lower(params, ms.init(params), params).compile()
        temp = compiled.memory_analysis().temp_size_in_bytes
        assert temp < allowed + tree_bytes // 64, (skip, temp, allowed)


def test_survives_copy_deepcopy_and_pytree_round_trips():
    ms = oa.MultiSteps(
        optax.adam(0.05),
        2,
        False,
        optax.skip_not_finite,
        accumulator_dtype=jnp.bfloat16,
    )
    params = helpers.linear_params()
    g1, g2 = helpers.gradient_trees(2, params)
    s = ms.init(params)
    _, s = ms.update(g1, s, params)
    want, _ = ms.update(g2, s, params)
    for clone in (
        copy.copy(ms),
        copy.deepcopy(ms),
        jax.tree.map(lambda x: x, ms),
        jax.tree.unflatten(*reversed(jax.tree.flatten(ms))),
    ):
        assert type(clone) is oa.MultiSteps and oa.is_gate(clone)
        assert clone._config[1:] == ms._config[1:]
        u, s2 = clone.update(g2, s, params)
        chex.assert_trees_all_equal(u, want)
        assert s2.acc_grads["w"].dtype == jnp.bfloat16
        assert bool(clone.has_updated(s2))
    init, update = ms.gradient_transformation()  # unpacks as optax's
    assert ms.gradient_transformation() is ms and init is ms.init
    assert ms.inner_opt.update is not None


def test_from_optax_state_continues_the_window():
    """An optax.MultiSteps state (e.g. a restored checkpoint) taken
    mid-window and converted continues exactly as optax would."""
    opt = optax.adam(0.05)
    params = helpers.linear_params()
    grads = helpers.gradient_trees(9, params)
    for use_grad_mean in (True, False):
        theirs = optax.MultiSteps(opt, 3, use_grad_mean=use_grad_mean)
        ours = oa.MultiSteps(opt, 3, use_grad_mean=use_grad_mean)
        r = theirs.init(params)
        up_theirs, up_ours = jax.jit(theirs.update), jax.jit(ours.update)
        for g in grads[:5]:  # one window and 2 of the next
            _, r = up_theirs(g, r, params)
        s = ours.from_optax_state(r)
        assert not bool(ours.has_updated(s))
        for g in grads[5:]:
            want, r = up_theirs(g, r, params)
            u, s = up_ours(g, s, params)
            chex.assert_trees_all_close(u, want, **TOL)
        assert int(s.gradient_step) == 3 and int(s.mini_step) == 0
        chex.assert_trees_all_close(s.inner_opt_state, r.inner_opt_state, **TOL)
        with pytest.raises(TypeError, match="from_optax_state"):
            ours.update(grads[0], r, params)


@pytest.mark.parametrize(
    "args, kwargs, exc, match",
    [
        ((optax.sgd(0.1), 0), {}, ValueError, "every_k_schedule"),
        ((optax.sgd(0.1), True), {}, TypeError, "every_k_schedule"),
        ((optax.sgd(0.1), 2.0), {}, TypeError, "every_k_schedule"),
        ((lambda g: g, 2), {}, TypeError, "opt"),
        ((optax.sgd(0.1), 2, "yes"), {}, TypeError, "use_grad_mean"),
        ((optax.sgd(0.1), 2, True, 3), {}, TypeError, "should_skip_update_fn"),
        (
            (optax.sgd(0.1), 2),
            {"accumulator_dtype": jnp.int32},
            ValueError,
            "accumulator_dtype",
        ),
    ],
)
def test_bad_arguments(args, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        oa.MultiSteps(*args, **kwargs)


def test_accumulator_dtype_none_means_float32():
    ms = oa.MultiSteps(optax.sgd(0.1), 2, accumulator_dtype=None)
    s = ms.init(helpers.linear_params(jnp.bfloat16))
    assert all(a.dtype == jnp.float32 for a in jax.tree.leaves(s.acc_grads))


def test_near_miss_keyword_raises_everywhere():
    """A misspelt accum_weight is an error (the chain underneath declares
    it), in update, apply_gradients, flush and inside an outer chain."""
    ms = oa.MultiSteps(optax.sgd(0.1), 2)
    params = helpers.linear_params()
    (g,) = helpers.gradient_trees(1, params)
    s = ms.init(params)
    outer = oa.chain(oa.dynamic_loss_scale(), ms)
    calls = (
        lambda: ms.update(g, s, params, acum_weight=2.0),
        lambda: oa.apply_gradients(ms, g, s, params, acum_weight=2.0),
        lambda: oa.flush(ms, s, params, acum_weight=2.0),
        lambda: outer.update(g, outer.init(params), params, acum_weight=2.0),
    )
    for call in calls:
        with pytest.raises(TypeError, match="accum_weight"):
            call()
    ms.update(g, s, params, accum_weight=2.0)  # the right spelling works
    # Its update declares the keyword, as oa.chain's does, for outer chains.
    assert "accum_weight" in inspect.signature(ms.update).parameters


def test_flax_train_states():
    """The usual home of optax.MultiSteps: flax's TrainState with
    tx=ms.gradient_transformation(); and optaxaccum.flax.TrainState (fused
    step, flush) with tx=oa.MultiSteps(...) as is."""
    from flax.training import train_state

    from optaxaccum.flax import TrainState

    params = helpers.linear_params()
    grads = helpers.gradient_trees(5, params)
    states = {
        name: cls.create(apply_fn=None, params=params, tx=tx)
        for name, cls, tx in (
            (
                "optax",
                train_state.TrainState,
                optax.MultiSteps(optax.adam(0.05), 2).gradient_transformation(),
            ),
            (
                "oa",
                train_state.TrainState,
                oa.MultiSteps(optax.adam(0.05), 2).gradient_transformation(),
            ),
            ("oa fused", TrainState, oa.MultiSteps(optax.adam(0.05), 2)),
        )
    }
    step = jax.jit(lambda s, g: s.apply_gradients(grads=g))
    for g in grads:
        states = {n: step(s, g) for n, s in states.items()}
        for name in ("oa", "oa fused"):
            chex.assert_trees_all_close(
                states[name].params, states["optax"].params, **TOL
            )
    flushed = states["oa fused"].flush()  # the 5th micro-batch's window
    assert int(flushed.opt_state.gradient_step) == 3
    assert not bool(jnp.all(flushed.params["w"] == states["oa"].params["w"]))


def test_oa_has_updated_reads_a_multisteps_state():
    """oa.has_updated works on oa.MultiSteps' state as on a chain's."""
    ms = oa.MultiSteps(optax.sgd(1.0), every_k_schedule=2)
    params = jnp.zeros(1)
    state = ms.init(params)
    _, state = ms.update(jnp.ones(1), state, params)
    assert not bool(oa.has_updated(state))
    _, state = ms.update(jnp.ones(1), state, params)
    assert bool(oa.has_updated(state)) and bool(ms.has_updated(state))


# ------------------------------ optax drop-in: has_updated, constructor order


def test_multisteps_has_updated_on_an_optax_state_answers_as_optax():
    """``has_updated`` of a state made by
    ``optax.MultiSteps`` (no ``updated`` flag) answers as optax's does,
    on every call of a window, and ``oa.has_updated`` finds our state."""
    params = jnp.zeros(2)
    theirs = optax.MultiSteps(optax.adam(0.1), 3)
    ours = oa.MultiSteps(optax.adam(0.1), 3)
    state = theirs.init(params)
    for i in range(4):
        np.testing.assert_array_equal(
            ours.has_updated(state), theirs.has_updated(state)
        )
        _, state = theirs.update(jnp.full(2, i + 1.0), state, params)
        assert bool(ours.has_updated(state)) == (i == 2)
    our_state = ours.init(params)
    for _ in range(3):
        _, our_state = ours.update(jnp.ones(2), our_state, params)
    assert bool(oa.has_updated(our_state)) and bool(ours.has_updated(our_state))


def test_oa_has_updated_on_a_flagless_state_answers_as_optax():
    """``oa.has_updated`` of an ``oa.MultiStepsState`` without its
    ``updated`` flag (built from optax's fields, as an older checkpoint
    restores it) follows optax's rule, on every call of two windows: false
    before the first window closes and inside a window, true where one just
    closed (position 0 after at least one step)."""
    params = jnp.zeros(2)
    theirs = optax.MultiSteps(optax.adam(0.1), 3)
    state = theirs.init(params)
    got, want = [], []
    for i in range(7):
        flagless = oa.MultiStepsState(*state)
        assert flagless.updated is None
        got.append(bool(oa.has_updated(flagless)))
        want.append(bool(theirs.has_updated(state)))
        _, state = theirs.update(jnp.full(2, i + 1.0), state, params)
    assert want == [False, False, False, True, False, False, True]
    assert got == want


def test_multisteps_takes_accumulator_dtype_fifth_positional():
    """Optax's constructor order, ``accumulator_dtype``
    fifth positional included."""
    ms = oa.MultiSteps(optax.adam(0.1), 3, True, None, jnp.bfloat16)
    theirs = optax.MultiSteps(optax.adam(0.1), 3, True, None, jnp.bfloat16)
    params = jnp.zeros(2)
    assert ms.init(params).acc_grads.dtype == jnp.bfloat16
    assert theirs.init(params).acc_grads.dtype == jnp.bfloat16


def test_windows_closed_sees_a_window_inside_a_window():
    """``windows.closed`` (where the BatchNorm layers close their windows)
    answers for the optimizer's window when an accumulate sits inside
    ``oa.MultiSteps``: the optimizer steps once per 2 x 3 calls, and
    ``closed`` is true on exactly those calls."""
    from optaxaccum._src import windows

    tx = oa.MultiSteps(oa.chain(oa.accumulate(3), optax.sgd(1.0)), 2)
    params = jnp.zeros(2)
    state = tx.init(params)
    closed, stepped = [], []
    for _ in range(12):
        updates, new = tx.update(jnp.ones(2), state, params)
        closed.append(bool(windows.closed(state, new)))
        stepped.append(bool(jnp.any(updates != 0)))
        state = new
    assert stepped == [i % 6 == 5 for i in range(12)], stepped
    assert closed == stepped, closed


def test_from_optax_state_answers_has_updated_as_optax():
    """Converted, a fresh optax state (no window closed yet) has not
    updated, one taken mid-window neither, and one taken right after a
    window closed has: as optax.MultiSteps.has_updated answers."""
    params = helpers.linear_params()
    grads = helpers.gradient_trees(3, params)
    theirs = optax.MultiSteps(optax.sgd(0.1), 3)
    ours = oa.MultiSteps(optax.sgd(0.1), 3)
    r = theirs.init(params)
    answers = []
    for g in (None, *grads):  # fresh, 1 and 2 into the window, closed
        if g is not None:
            _, r = theirs.update(g, r, params)
        mine = bool(ours.has_updated(ours.from_optax_state(r)))
        answers.append((mine, bool(theirs.has_updated(r))))
    assert answers == [(a, a) for a in (False, False, False, True)], answers


def test_multisteps_window_beyond_2_to_the_24_keeps_its_low_part():
    """oa.MultiSteps keeps the accumulate's compensated weight in its state
    (acc_weight_low): a window of a call of weight 2**24 (gradient 0) and
    ten of weight 1 (gradient 1) has weight 2**24 + 10 (float32 alone
    rounds each +1 away) and emits the mean 10 / (2**24 + 10)."""
    ms = oa.MultiSteps(optax.sgd(1.0), 11)
    params = jnp.zeros(2)
    step = jax.jit(lambda s, g, w: ms.update(g, s, params, accum_weight=w))
    state = ms.init(params)
    u = None
    for i in range(11):
        g, w = (0.0, 2.0**24) if i == 0 else (1.0, 1.0)
        if i == 10:  # the stored weight: 2**24 + 9, as (high, low)
            low = state.acc_weight_low
            assert low is not None, "acc_weight_low not stored"
            assert (float(state.acc_weight), float(low)) == (2.0**24, 9.0)
        u, state = step(state, jnp.full(2, g), jnp.float32(w))
    assert bool(ms.has_updated(state))
    want = -10.0 / (2.0**24 + 10)  # float64
    np.testing.assert_allclose(u, [want, want], rtol=1e-7)
