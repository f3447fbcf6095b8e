"""Tests of ``oa.accumulate`` inside ``oa.chain``: numerics against the
big-batch update and ``optax.MultiSteps``, windows, weights, flush."""

import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optaxaccum as oa

JIT_OR_NOT = [lambda f: f, jax.jit]

# Tolerances by gradient dtype (params stay float32).
TOL = {
    jnp.float32: dict(rtol=2e-5, atol=2e-6),
    jnp.bfloat16: dict(rtol=3e-2, atol=3e-3),
}


def _problem(seed=0, n=96, din=5, dout=3):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(n, din)), jnp.float32)
    y = jnp.asarray(rng.normal(size=(n, dout)), jnp.float32)
    params = {
        "w": jnp.asarray(rng.normal(size=(din, dout)) * 0.3, jnp.float32),
        "b": jnp.zeros((dout,), jnp.float32),
    }
    return params, x, y


def _loss(params, x, y):
    pred = x @ params["w"] + params["b"][None, :]
    return jnp.mean((pred - y) ** 2)


_grad = jax.jit(jax.grad(_loss))


def _optimizers():
    schedule = optax.linear_schedule(0.1, 0.01, transition_steps=3)
    mask = {"w": True, "b": False}
    return {
        "sgd": optax.sgd(0.1),
        "sgd_momentum": optax.sgd(0.05, momentum=0.9),
        "adamw_masked": optax.adamw(0.05, weight_decay=0.1, mask=mask),
        "clip_adam": optax.chain(
            optax.clip_by_global_norm(1.0), optax.adam(0.05)
        ),
        "adam_schedule": optax.adam(schedule),
    }


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("opt_name", list(_optimizers()))
def test_accumulate_equals_big_batch(opt_name, k, dtype):
    """K micro-batches through accumulate(K) == one step on the big batch."""
    opt = _optimizers()[opt_name]
    params, x, y = _problem()
    windows, batch = 3, 32
    tx = oa.chain(oa.accumulate(k), opt)
    state = tx.init(params)
    ref_params, ref_state = params, opt.init(params)
    update = jax.jit(tx.update)
    for w in range(windows):
        xs = x[w * batch : (w + 1) * batch]
        ys = y[w * batch : (w + 1) * batch]
        g = jax.tree.map(lambda t: t.astype(dtype), _grad(ref_params, xs, ys))
        u, ref_state = jax.jit(opt.update)(g, ref_state, ref_params)
        ref_params = optax.apply_updates(ref_params, u)
        for i in range(k):
            sl = slice(i * batch // k, (i + 1) * batch // k)
            g = _grad(params, xs[sl], ys[sl])
            g = jax.tree.map(lambda t: t.astype(dtype), g)
            u, state = update(g, state, params)
            params = optax.apply_updates(params, u)
        chex.assert_trees_all_close(params, ref_params, **TOL[dtype])
    # The optimizer stepped once per window: its count (if any) is `windows`.
    counts = [c for c in jax.tree.leaves(state[1:]) if c.dtype == jnp.int32]
    for c in counts:
        assert int(c) == windows


def test_schedule_advances_once_per_window():
    def schedule(count):
        return 0.1 * (count + 1)

    tx = oa.chain(oa.accumulate(3), optax.sgd(schedule))
    params = jnp.zeros(2)
    state = tx.init(params)
    update = jax.jit(tx.update)
    lrs = []
    for _ in range(9):
        u, state = update(jnp.ones(2), state, params)
        if bool(oa.has_updated(state)):
            lrs.append(-float(u[0]))
    np.testing.assert_allclose(lrs, [0.1, 0.2, 0.3], rtol=1e-6)


@pytest.mark.parametrize("k", [2, 3])
def test_accumulate_equals_multisteps(k):
    params, x, y = _problem(1)
    opt = optax.adam(0.05)
    ours = oa.chain(oa.accumulate(k), opt)
    theirs = optax.MultiSteps(opt, k)
    s_ours, s_theirs = ours.init(params), theirs.init(params)
    p_ours = p_theirs = params
    ours_update, theirs_update = jax.jit(ours.update), jax.jit(theirs.update)
    for step in range(3 * k):
        xs, ys = x[step * 8 : (step + 1) * 8], y[step * 8 : (step + 1) * 8]
        g = _grad(p_ours, xs, ys)
        inner_before = s_ours[1]
        u_ours, s_ours = ours_update(g, s_ours, p_ours)
        u_theirs, s_theirs = theirs_update(g, s_theirs, p_theirs)
        chex.assert_trees_all_close(u_ours, u_theirs, rtol=1e-5, atol=1e-7)
        if not bool(oa.has_updated(s_ours)):
            # The follower's state is untouched on a non-closing micro-step.
            chex.assert_trees_all_equal(s_ours[1], inner_before)
        assert bool(oa.has_updated(s_ours)) == bool(
            theirs.has_updated(s_theirs)
        )
        p_ours = optax.apply_updates(p_ours, u_ours)
        p_theirs = optax.apply_updates(p_theirs, u_theirs)
    chex.assert_trees_all_close(
        s_ours[1], s_theirs.inner_opt_state, rtol=1e-5, atol=1e-7
    )


@pytest.mark.parametrize("transform", JIT_OR_NOT)
def test_weights_give_exact_per_example_mean(transform):
    """Unequal micro-batch sizes weighted by their sizes give the big-batch
    per-example mean, not the mean of means (transformers #34191)."""
    params, x, y = _problem(2, n=16)
    sizes = [3, 5, 8]
    tx = oa.chain(oa.accumulate(len(sizes)), optax.sgd(1.0))
    state = tx.init(params)
    update = transform(tx.update)
    start = 0
    for n in sizes:
        g = _grad(params, x[start : start + n], y[start : start + n])
        u, state = update(g, state, params, accum_weight=n)
        start += n
    want = jax.tree.map(lambda t: -t, _grad(params, x, y))
    chex.assert_trees_all_close(u, want, rtol=1e-5, atol=1e-7)
    # The unweighted mean of means differs: the weights matter here.
    mean_of_means = jax.tree.map(
        lambda *gs: -sum(gs) / 3,
        *[_grad(params, x[a:b], y[a:b]) for a, b in [(0, 3), (3, 8), (8, 16)]],
    )
    assert not np.allclose(u["w"], mean_of_means["w"], rtol=1e-3)


def test_sum_reduction_weighted():
    tx = oa.chain(oa.accumulate(2, reduction="sum"), optax.sgd(1.0))
    params = jnp.zeros(2)
    state = tx.init(params)
    _, state = tx.update(jnp.array([1.0, 2.0]), state, params, accum_weight=2.0)
    u, state = tx.update(jnp.array([3.0, 5.0]), state, params, accum_weight=0.5)
    np.testing.assert_allclose(u, -np.array([2 * 1 + 0.5 * 3, 2 * 2 + 0.5 * 5]))


def test_zero_weight_window_does_not_step():
    tx = oa.chain(oa.accumulate(2), optax.adam(0.1))
    params = jnp.ones(2)
    state = tx.init(params)
    inner = state[1]
    for _ in range(2):
        u, state = tx.update(jnp.ones(2), state, params, accum_weight=0.0)
    chex.assert_trees_all_equal(u, jnp.zeros(2))
    chex.assert_trees_all_equal(state[1], inner)
    assert not bool(oa.has_updated(state))
    assert int(state[0].gradient_step) == 1 and int(state[0].mini_step) == 0


def test_flush_of_zero_weight_window_closes_it_without_stepping():
    tx = oa.chain(oa.accumulate(4), optax.adam(0.1))
    params = jnp.ones(2)
    state = tx.init(params)
    inner = state[1]
    _, state = tx.update(jnp.ones(2), state, params, accum_weight=0.0)
    u, state = oa.flush(tx, state, params)
    chex.assert_trees_all_equal(u, jnp.zeros(2))
    chex.assert_trees_all_equal(state[1], inner)
    assert not bool(oa.has_updated(state))
    assert int(state[0].gradient_step) == 1 and int(state[0].mini_step) == 0


def test_has_updated_bare_and_chain():
    bare = oa.accumulate(2)
    s = bare.init(jnp.zeros(1))
    flags = []
    for _ in range(4):
        _, s = bare.update(jnp.ones(1), s)
        flags.append(bool(oa.has_updated(s)))
    assert flags == [False, True, False, True]
    with pytest.raises(ValueError, match="AccumulateState"):
        oa.has_updated(optax.sgd(1.0).init(jnp.zeros(1)))


_NESTED_ACCUMULATES = {
    "flat": lambda: oa.chain(
        oa.accumulate(2), oa.accumulate(3), optax.sgd(1.0)
    ),
    "chain_in_chain": lambda: oa.chain(
        oa.chain(oa.accumulate(2), optax.identity()),
        oa.accumulate(3),
        optax.sgd(1.0),
    ),
    "in_optax_chain": lambda: optax.chain(
        optax.scale(1.0),
        oa.chain(oa.accumulate(2), oa.accumulate(3), optax.sgd(1.0)),
    ),
}


@pytest.mark.parametrize("build", list(_NESTED_ACCUMULATES))
def test_has_updated_on_nested_accumulates_answers_for_the_optimizer(build):
    """With nested accumulates (2 then 3) ``oa.has_updated`` answers as
    one ``oa.accumulate(6)`` would: whether the optimizer stepped (every 6
    calls), not whether the first window closed (every 2)."""
    tx = _NESTED_ACCUMULATES[build]()
    params = jnp.zeros(1)
    s = tx.init(params)
    flags, stepped = [], []
    for i in range(12):
        u, s = tx.update(jnp.array([float(i)]), s, params)
        flags.append(bool(oa.has_updated(s)))
        stepped.append(bool(u[0] != 0))
    assert stepped == [i % 6 == 5 for i in range(12)]
    assert flags == stepped


def _bare_skip(every_k):
    return oa.accumulate(every_k, skip_nonfinite=True)


_DROPPING = {
    "skip_nonfinite": lambda: oa.chain(_bare_skip(2), optax.sgd(1.0)),
    "bare": lambda: _bare_skip(2),
    "loss_scale": lambda: oa.chain(
        oa.dynamic_loss_scale(1.0), oa.accumulate(2), optax.sgd(1.0)
    ),
    "multisteps": lambda: oa.MultiSteps(
        optax.sgd(1.0), 2, should_skip_update_fn=optax.skip_not_finite
    ),
    # An outer window of one before the optimizer's window of 2.
    "nested": lambda: oa.chain(_bare_skip(1), oa.accumulate(2), optax.sgd(1.0)),
}


@pytest.mark.parametrize("fused", [False, True], ids=["update", "fused"])
@pytest.mark.parametrize("build", list(_DROPPING))
def test_has_updated_is_false_on_a_dropped_call_after_a_close(build, fused):
    """A micro-batch dropped right after the closing call (``skip_nonfinite``,
    an overflow of the loss scale, MultiSteps' skip function) did not step
    the optimizer: ``oa.has_updated`` says false there, so that a loop
    counting windows with it counts each once ([1, 1, nan, 1, 1]: steps
    on the 2nd and the 5th call)."""
    tx = _DROPPING[build]()
    params = jnp.zeros(1)
    state = tx.init(params)

    def step(g, state, params):
        if fused and build != "bare":
            params, state, u = oa.apply_gradients(
                tx, g, state, params, return_updates=True
            )
            return u, state, params
        u, state = tx.update(g, state, params)
        return u, state, params

    step = jax.jit(step)
    flags, stepped = [], []
    for g in (1.0, 1.0, jnp.nan, 1.0, 1.0):
        u, state, params = step(jnp.array([g]), state, params)
        flags.append(bool(oa.has_updated(state)))
        stepped.append(bool(u[0] != 0))
    assert stepped == [False, True, False, False, True]
    assert flags == stepped


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_counted_with_a_window_of_one(jit):
    """Whether a call counted, asked of ``oa.accumulate(1)``: its window
    position stays 0 on every call, so only the closed windows tell. A
    finite micro-batch counts, one that ``skip_nonfinite`` drops does not
    (the core's answer for the Flax layers' BatchNorm windows)."""
    from optaxaccum._src import windows

    tx = oa.chain(oa.accumulate(1, skip_nonfinite=True), optax.sgd(1.0))
    params = jnp.zeros(2)
    update = jax.jit(tx.update) if jit else tx.update
    s0 = tx.init(params)
    _, s1 = update(jnp.ones(2), s0, params)
    _, s2 = update(jnp.array([1.0, jnp.nan]), s1, params)
    _, s3 = update(jnp.ones(2), s2, params)
    assert [
        bool(windows.counted(a, b)) for a, b in ((s0, s1), (s1, s2), (s2, s3))
    ] == [
        True,
        False,
        True,
    ]


_NESTED_WINDOWS_WITH_A_SKIP = {
    "nested_accumulates": lambda: oa.chain(
        oa.accumulate(2, skip_nonfinite=True),
        oa.accumulate(3),
        optax.sgd(1.0),
    ),
    "accumulate_in_multisteps": lambda: oa.MultiSteps(
        oa.chain(oa.accumulate(3), optax.sgd(1.0)),
        2,
        should_skip_update_fn=optax.skip_not_finite,
    ),
}


@pytest.mark.parametrize("build", list(_NESTED_WINDOWS_WITH_A_SKIP))
def test_counted_with_nested_windows_reads_the_outermost(build):
    """With nested windows, whether a call counted is the outermost
    window's answer (the one every call reaches): every finite micro-batch
    counts, the dropped one does not, whatever the inner window (which
    moves only where the outer one closes) did."""
    from optaxaccum._src import windows

    tx = _NESTED_WINDOWS_WITH_A_SKIP[build]()
    params = jnp.zeros(2)
    update = jax.jit(tx.update)
    s = tx.init(params)
    grads = [jnp.ones(2)] * 3 + [jnp.array([1.0, jnp.nan])] + [jnp.ones(2)] * 3
    got = []
    for g in grads:
        _, new = update(g, s, params)
        got.append(bool(windows.counted(s, new)))
        s = new
    assert got == [True, True, True, False, True, True, True]


@pytest.mark.parametrize("transform", JIT_OR_NOT)
def test_flush_partial_window_uses_true_divisor(transform):
    """Lightning #19987: the last partial window is the mean of what it saw."""
    tx = oa.chain(oa.accumulate(4), optax.sgd(1.0))
    params = {"a": jnp.zeros(2, jnp.bfloat16), "b": jnp.zeros(())}
    state = tx.init(params)
    update = transform(tx.update)
    for v in (1.0, 2.0, 6.0):
        g = {"a": jnp.full(2, v, jnp.bfloat16), "b": jnp.asarray(v)}
        _, state = update(g, state, params)
    u, state = transform(lambda s, p: oa.flush(tx, s, p))(state, params)
    chex.assert_trees_all_equal_dtypes(u, params)
    chex.assert_trees_all_close(
        u, {"a": jnp.full(2, -3.0, jnp.bfloat16), "b": jnp.asarray(-3.0)}
    )
    assert bool(oa.has_updated(state))
    assert int(state[0].mini_step) == 0 and int(state[0].gradient_step) == 1
    # An empty window: zeros, nothing changes.
    u, state2 = oa.flush(tx, state, params)
    chex.assert_trees_all_equal(u, jax.tree.map(jnp.zeros_like, params))
    chex.assert_trees_all_equal(state2, state)


def test_flush_bare_accumulate_and_errors():
    acc = oa.accumulate(3, reduction="sum")
    s = acc.init(jnp.zeros(2))
    _, s = acc.update(jnp.ones(2), s)
    _, s = acc.update(jnp.ones(2), s)
    u, s = oa.flush(acc, s, jnp.zeros(2))
    np.testing.assert_allclose(u, [2.0, 2.0])
    with pytest.raises(ValueError, match="oa.flush needs"):
        oa.flush(optax.sgd(1.0), (), jnp.zeros(2))
    with pytest.raises(ValueError, match="oa.flush needs"):
        oa.flush(oa.chain(optax.sgd(1.0)), ((),), jnp.zeros(2))


def test_flush_skips_elements_before_accumulate():
    tx = oa.chain(optax.scale(2.0), oa.accumulate(3), optax.sgd(1.0))
    params = jnp.zeros(1)
    s = tx.init(params)
    _, s = tx.update(jnp.ones(1), s, params)
    u, s = oa.flush(tx, s, params)
    np.testing.assert_allclose(u, [-2.0])


def test_skip_nonfinite_drops_micro_batch():
    tx = oa.chain(oa.accumulate(2, skip_nonfinite=True), optax.sgd(1.0))
    params = jnp.zeros(2)
    s = tx.init(params)
    _, s = tx.update(jnp.array([1.0, 1.0]), s, params)
    before = s
    u, s = tx.update(jnp.array([jnp.nan, 1.0]), s, params)
    chex.assert_trees_all_equal(u, jnp.zeros(2))
    chex.assert_trees_all_equal(s[0].mini_step, before[0].mini_step)
    chex.assert_trees_all_equal(s[0].acc, before[0].acc)
    u, s = tx.update(jnp.array([3.0, 5.0]), s, params)
    np.testing.assert_allclose(u, [-2.0, -3.0])


def test_nonfinite_accumulated_without_skip():
    tx = oa.chain(oa.accumulate(2), optax.sgd(1.0))
    params = jnp.zeros(2)
    s = tx.init(params)
    _, s = tx.update(jnp.array([jnp.inf, 1.0]), s, params)
    u, s = tx.update(jnp.array([1.0, 1.0]), s, params)
    assert np.isinf(u[0]) and u[1] == -1.0
    # The next window starts clean: the stale accumulator is overwritten.
    _, s = tx.update(jnp.array([1.0, 1.0]), s, params)
    u, s = tx.update(jnp.array([1.0, 3.0]), s, params)
    np.testing.assert_allclose(u, [-1.0, -2.0])


def test_schedule_every_k():
    every_k = lambda step: jnp.where(step < 2, 2, 3)  # noqa: E731
    tx = oa.chain(oa.accumulate(every_k), optax.sgd(1.0))
    params = jnp.zeros(1)
    s = tx.init(params)
    update = jax.jit(tx.update)
    closed = []
    for i in range(10):
        _, s = update(jnp.ones(1), s, params)
        if bool(oa.has_updated(s)):
            closed.append(i + 1)
    assert closed == [2, 4, 7, 10]


def test_nested_inside_stock_optax_chain():
    params, x, y = _problem(3)
    clip = optax.clip_by_global_norm(0.5)
    nested = optax.chain(clip, oa.chain(oa.accumulate(2), optax.adam(0.1)))
    flat = oa.chain(clip, oa.accumulate(2), optax.adam(0.1))
    s_n, s_f = nested.init(params), flat.init(params)
    nested_update, flat_update = jax.jit(nested.update), jax.jit(flat.update)
    for i in range(4):
        g = _grad(params, x[i * 4 : i * 4 + 4], y[i * 4 : i * 4 + 4])
        u_n, s_n = nested_update(g, s_n, params)
        u_f, s_f = flat_update(g, s_f, params)
        chex.assert_trees_all_close(u_n, u_f, rtol=1e-6)
    assert bool(oa.has_updated(s_n))


def test_bare_accumulate_in_optax_chain_with_stateless_follower():
    tx = optax.chain(oa.accumulate(2), optax.scale(-0.5))
    s = tx.init(jnp.zeros(1))
    u1, s = tx.update(jnp.array([2.0]), s)
    u2, s = tx.update(jnp.array([4.0]), s)
    np.testing.assert_allclose([u1[0], u2[0]], [0.0, -1.5])


def test_jit_donated_no_retrace():
    tx = oa.chain(oa.accumulate(3), optax.adam(0.1))
    params = {"a": jnp.ones((4, 3)), "b": jnp.ones(3)}
    state = tx.init(params)

    @jax.jit
    @chex.assert_max_traces(n=1)
    def _step(g, s, p):
        return oa.apply_gradients(tx, g, s, p)

    step = jax.jit(lambda p, s, g: _step(g, s, p), donate_argnums=(0, 1))
    g = jax.tree.map(jnp.ones_like, params)
    for _ in range(7):
        params, state = step(params, state, g)
    assert int(state[0].gradient_step) == 2


@pytest.mark.parametrize("grad_dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_accumulator_dtype_and_emitted_dtype(grad_dtype):
    acc = oa.accumulate(2)
    params = jnp.zeros(3, grad_dtype)
    s = acc.init(params)
    assert s.acc.dtype == jnp.float32 and s.weight.dtype == jnp.float32
    g = jnp.full(3, 0.1, grad_dtype)
    with jax.numpy_dtype_promotion("strict"):
        u, s2 = acc.update(g, s)
        u, s2 = acc.update(g, s2)
    assert u.dtype == grad_dtype
    chex.assert_trees_all_equal_dtypes(s, s2)
    chex.assert_trees_all_equal_shapes(s, s2)
    s16 = oa.accumulate(2, accumulator_dtype=jnp.bfloat16).init(params)
    assert s16.acc.dtype == jnp.bfloat16


def test_apply_gradients_matches_plain_protocol():
    params, x, y = _problem(4)
    tx = oa.chain(
        optax.clip_by_global_norm(1.0), oa.accumulate(3), optax.adamw(0.1)
    )
    s_fused = s_plain = tx.init(params)
    p_fused = p_plain = params
    fused = jax.jit(lambda g, s, p: oa.apply_gradients(tx, g, s, p))
    plain = jax.jit(tx.update)
    for i in range(7):
        g = _grad(p_plain, x[i * 8 : i * 8 + 8], y[i * 8 : i * 8 + 8])
        p_fused, s_fused = fused(g, s_fused, p_fused)
        u, s_plain = plain(g, s_plain, p_plain)
        p_plain = optax.apply_updates(p_plain, u)
        # jit and eager round differently: float32 tolerances.
        chex.assert_trees_all_close(p_fused, p_plain, rtol=1e-6, atol=1e-7)
        chex.assert_trees_all_close(s_fused, s_plain, rtol=1e-6, atol=1e-7)
    # Non-gate transformations take the ordinary path.
    p, s = oa.apply_gradients(
        optax.sgd(1.0), jnp.ones(1), (optax.EmptyState(),) * 2, jnp.zeros(1)
    )
    np.testing.assert_allclose(p, [-1.0])


def test_gradient_step_saturates_not_wraps():
    acc = oa.accumulate(1)
    s = acc.init(jnp.zeros(1))
    s = s._replace(gradient_step=jnp.asarray(np.iinfo(np.int32).max, jnp.int32))
    _, s = acc.update(jnp.ones(1), s)
    assert int(s.gradient_step) == np.iinfo(np.int32).max


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(every_k=0), ValueError, "every_k"),
        (dict(every_k=-1), ValueError, "every_k"),
        (dict(every_k=2.5), TypeError, "every_k=2.5"),
        (dict(every_k=True), TypeError, "every_k=True"),
        (dict(every_k="4"), TypeError, "every_k"),
        (dict(every_k=2, reduction="avg"), ValueError, "reduction='avg'"),
        (
            dict(every_k=2, accumulator_dtype=jnp.int32),
            ValueError,
            "accumulator_dtype",
        ),
        (
            dict(every_k=2, accumulator_dtype="nonsense"),
            TypeError,
            "accumulator_dtype",
        ),
        (dict(every_k=2, skip_nonfinite=1), TypeError, "skip_nonfinite"),
        (dict(every_k=2, axis_name=["d"]), TypeError, "axis_name"),
    ],
)
def test_accumulate_bad_arguments(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        oa.accumulate(**kwargs)


def test_mismatched_gradient_structure_names_both():
    tx = oa.chain(oa.accumulate(2), optax.sgd(1.0))
    s = tx.init({"a": jnp.zeros(2), "b": jnp.zeros(1)})
    with pytest.raises(
        ValueError, match=r"(?s)gradients.*'a'.*'c'.*accumulator.*'b'"
    ):
        tx.update({"a": jnp.zeros(2), "c": jnp.zeros(1)}, s)
    with pytest.raises(ValueError, match="accum_weight must be a scalar"):
        tx.update(
            {"a": jnp.zeros(2), "b": jnp.zeros(1)}, s, accum_weight=jnp.ones(2)
        )


def test_chain_rejects_non_transformations():
    with pytest.raises(TypeError, match="element 1"):
        oa.chain(optax.sgd(1.0), lambda g: g)
    tx = oa.chain(oa.accumulate(2), optax.sgd(1.0))
    with pytest.raises(ValueError, match="expects a tuple of 2 states"):
        tx.update(jnp.zeros(1), (tx.init(jnp.zeros(1))[0],))


@pytest.mark.devices(2)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_axis_name_window_of_zero_total_weight_emits_zeros(reduction):
    """Regression: the window's total weight over the devices is 0, so it
    does not open -- zeros, not the (NaN or non-zero) weighted sums."""
    tx = oa.accumulate(1, reduction=reduction, axis_name="d")
    params = jnp.zeros((2, 2))
    state = jax.tree.map(lambda x: jnp.stack([x, x]), tx.init(params[0]))
    grads = jnp.array([[1.0, 2.0], [jnp.nan, 4.0]])
    # (Weights summing to 0 over the devices must both be 0: a negative
    # weight is invalid input: the contract says so.)
    weights = jnp.zeros(2)

    def step(g, s, w):
        return tx.update(g, s, accum_weight=w)

    u, s = jax.pmap(step, axis_name="d", devices=jax.devices()[:2])(
        grads, state, weights
    )
    chex.assert_trees_all_equal(u, jnp.zeros((2, 2)))
    assert not bool(jnp.any(s.updated))


def test_float16_accumulator_keeps_weights_in_float32():
    """Regression: token-count weights summed in float16 overflowed (40000 x 2
    > 65504) and zeroed the update."""
    tx = oa.chain(
        oa.accumulate(2, accumulator_dtype=jnp.float16), optax.sgd(1.0)
    )
    params = jnp.zeros(2)
    s = tx.init(params)
    assert s[0].weight.dtype == jnp.float32
    g = jnp.array([0.5, 0.25])
    _, s = tx.update(g, s, params, accum_weight=40000.0)
    u, s = tx.update(g, s, params, accum_weight=40000.0)
    np.testing.assert_allclose(u, -g, rtol=1e-3)


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(every_k=2**31), ValueError, "int32"),
        (dict(every_k=2, accumulator_dtype=jnp.float64), ValueError, "64-bit"),
    ],
)
def test_accumulate_more_bad_arguments(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        oa.accumulate(**kwargs)


def test_gradient_leaf_of_another_shape_is_an_error():
    """Not broadcast silently: the error names the leaf and both shapes."""
    tx = oa.chain(oa.accumulate(2), optax.sgd(1.0))
    params = {"w": jnp.zeros(3)}
    s = tx.init(params)
    with pytest.raises(ValueError, match=r"\['w'\].*\(1,\).*\(3,\)"):
        tx.update({"w": jnp.ones(1)}, s, params)


# ----------------------------- windows of weight 0 with a non-finite gradient


@pytest.mark.parametrize("first", [True, False])
@pytest.mark.parametrize("jit", [False, True])
def test_zero_weight_nonfinite_micro_batch_contributes_nothing(first, jit):
    """A fully padded micro-batch (weight 0, 0/0 gradient) is not ``0 * nan``
    in the window: the result is the weighted mean of the others, as
    ``microbatched_value_and_grad(weight_fn=...)`` gives."""
    tx = oa.chain(oa.accumulate(3), optax.sgd(1.0))
    params = jnp.zeros(2)
    state = tx.init(params)
    update = jax.jit(tx.update) if jit else tx.update
    padded = (jnp.array([jnp.nan, jnp.inf]), 0.0)
    seen = [(jnp.array([1.0, 2.0]), 2.0), (jnp.array([4.0, -1.0]), 1.0)]
    calls = [padded, *seen] if first else [*seen[:1], padded, *seen[1:]]
    for g, w in calls:
        u, state = update(g, state, params, accum_weight=w)
    want = -(2 * np.array([1.0, 2.0]) + np.array([4.0, -1.0])) / 3
    np.testing.assert_allclose(u, want, rtol=1e-6)


def test_zero_weight_nonfinite_not_dropped_by_skip_nonfinite():
    """Under skip_nonfinite a weight-0 micro-batch is not non-finite: it
    counts as seen (the window advances) and contributes nothing."""
    tx = oa.chain(oa.accumulate(2, skip_nonfinite=True), optax.sgd(1.0))
    params = jnp.zeros(1)
    state = tx.init(params)
    _, state = tx.update(jnp.array([jnp.nan]), state, params, accum_weight=0.0)
    u, state = tx.update(jnp.array([3.0]), state, params, accum_weight=1.0)
    np.testing.assert_allclose(u, [-3.0])
    assert bool(oa.has_updated(state))


def test_fused_zero_weight_step_adds_no_tree_temporary():
    """The select for weight 0 lives in the accumulator's fusion: the fused
    non-closing step still needs no tree-sized temporary."""
    params = {"w": jnp.zeros((256, 256))}
    tx = oa.chain(oa.accumulate(4), optax.adam(1e-3))
    state = tx.init(params)
    step = jax.jit(
        lambda p, s, g, w: oa.apply_gradients(tx, g, s, p, accum_weight=w),
        donate_argnums=(0, 1),
    )
    mem = step.lower(params, state, params, 1.0).compile().memory_analysis()
    assert mem.temp_size_in_bytes < 256 * 256 * 4 // 64, mem.temp_size_in_bytes


# ---------------------------------------------------------- complex gradients


def test_complex_gradients_keep_their_imaginary_part():
    """Complex params and gradients accumulate in complex64 (float32
    accumulator) and the window equals the big-batch mean; flush too."""
    params = jnp.zeros(2, jnp.complex64)
    gs = [
        jnp.array([1 + 2j, -1j]),
        jnp.array([3 - 1j, 2 + 2j]),
        jnp.array([1j, 1.0]),
    ]
    tx = oa.chain(oa.accumulate(2), optax.sgd(1.0))
    state = tx.init(params)
    assert state[0].acc.dtype == jnp.complex64
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no ComplexWarning / casting warning
        _, state = tx.update(gs[0].astype(jnp.complex64), state, params)
        u, state = tx.update(gs[1].astype(jnp.complex64), state, params)
        np.testing.assert_allclose(u, -(gs[0] + gs[1]) / 2, rtol=1e-6)
        assert u.dtype == jnp.complex64
        _, state = tx.update(gs[2].astype(jnp.complex64), state, params)
        u, state = oa.flush(tx, state, params)
    np.testing.assert_allclose(u, -gs[2], rtol=1e-6)


def test_complex_gradient_into_real_accumulator_is_an_error():
    tx = oa.accumulate(2)
    state = tx.init(jnp.zeros(2))
    with pytest.raises(TypeError, match="complex"):
        tx.update(jnp.array([1j, 1.0]), state)


# ---------------------------------------------------- accum_weight validation


@pytest.mark.parametrize(
    "w",
    [
        -1.0,
        float("nan"),
        float("inf"),
        True,
        1 + 2j,
        np.float32(-2.0),
        jnp.array(float("nan")),
        np.array(-1),
    ],
    ids=[
        "neg",
        "nan",
        "inf",
        "bool",
        "complex",
        "np-neg",
        "jnp-nan",
        "np-int-neg",
    ],
)
def test_concrete_bad_weights_raise(w):
    tx = oa.chain(oa.accumulate(2), optax.sgd(1.0))
    state = tx.init(jnp.zeros(1))
    with pytest.raises(ValueError, match="accum_weight"):
        tx.update(jnp.ones(1), state, accum_weight=w)


def test_huge_python_int_weight_gives_a_clear_error():
    tx = oa.accumulate(2)
    state = tx.init(jnp.zeros(1))
    with pytest.raises(ValueError, match="accum_weight"):
        tx.update(jnp.ones(1), state, accum_weight=10**10)


@pytest.mark.parametrize("bad", [float("nan"), -1.0, float("inf")])
def test_traced_bad_weight_is_dropped_under_skip_nonfinite(bad):
    """A traced NaN/negative/inf weight is a non-finite micro-batch: dropped
    with skip_nonfinite=True (the params stay finite), propagated without."""
    params = jnp.zeros(1)
    for skip in (True, False):
        tx = oa.chain(oa.accumulate(2, skip_nonfinite=skip), optax.sgd(1.0))
        update = jax.jit(
            lambda g, s, p, w, tx=tx: tx.update(g, s, p, accum_weight=w)
        )
        state = tx.init(params)
        _, state = update(jnp.array([1.0]), state, params, 1.0)
        u, state = update(jnp.array([5.0]), state, params, bad)
        if skip:
            assert int(state[0].mini_step) == 1  # dropped, window still open
            u, state = update(jnp.array([3.0]), state, params, 1.0)
            np.testing.assert_allclose(u, [-2.0])
        else:
            assert not np.all(np.isfinite(u)), u


# ------------------------------------ float0 and Python-float gradient leaves


def test_float0_gradient_leaf_gives_a_clear_error():
    params = {"w": jnp.ones(2), "n": jnp.array(3)}
    grads = jax.grad(lambda p: jnp.sum(p["w"]) * p["n"], allow_int=True)(params)
    tx = oa.chain(oa.accumulate(2), optax.sgd(1.0))
    with pytest.raises(TypeError, match=r"\['n'\].*float0"):
        tx.update(grads, tx.init(params), params)


def test_python_float_leaves_are_accepted_like_optax():
    params = {"a": 1.0, "b": jnp.ones(2)}
    tx = oa.chain(oa.accumulate(2), optax.sgd(1.0))
    state = tx.init(params)
    _, state = tx.update({"a": 2.0, "b": jnp.ones(2)}, state, params)
    u, state = tx.update({"a": 4.0, "b": jnp.ones(2)}, state, params)
    np.testing.assert_allclose(u["a"], -3.0)


# ------------------------------------------------ float64 gradients under x64


def test_float64_gradients_accumulate_in_float64_under_x64():
    """The accumulator is at least the gradient's precision: 1e8 + 1 - 1e8
    survives in float64 (it is 0 in float32)."""
    with jax.enable_x64(True):
        params = jnp.zeros(1, jnp.float64)
        tx = oa.chain(oa.accumulate(3, reduction="sum"), optax.sgd(1.0))
        state = tx.init(params)
        assert state[0].acc.dtype == jnp.float64
        for g in (1e8, 1.0, -1e8):
            u, state = tx.update(jnp.array([g], jnp.float64), state, params)
        assert u.dtype == jnp.float64
        np.testing.assert_allclose(u, [-1.0])


# ---------------------------------------------------- float64 means under x64


@pytest.mark.parametrize("accumulator_dtype", [None, jnp.float64])
@pytest.mark.parametrize("case", ["k3", "flush3", "weights"])
def test_float64_mean_is_exact_at_float64_rounding(case, accumulator_dtype):
    """The window's weight and its division are in the
    accumulator's dtype, so a float64 mean is off by float64 rounding only
    (a float32 ``1 / weight`` left errors of ~3e-8 for k=3)."""
    rng = np.random.default_rng(23)
    gs = rng.normal(size=(3, 5))
    ws = [0.3, 1.7, 2.9] if case == "weights" else [1.0, 1.0, 1.0]
    with jax.enable_x64(True):
        params = jnp.zeros(5, jnp.float64)
        acc = oa.accumulate(
            4 if case == "flush3" else 3, accumulator_dtype=accumulator_dtype
        )
        tx = oa.chain(acc, optax.sgd(1.0))
        state = tx.init(params)
        for g, w in zip(gs, ws):
            u, state = tx.update(jnp.asarray(g), state, params, accum_weight=w)
        if case == "flush3":
            u, state = oa.flush(tx, state, params)
        assert u.dtype == jnp.float64
        want = -np.average(gs, axis=0, weights=ws)
        # float64 rounding of a 3-term weighted sum and one division.
        np.testing.assert_allclose(np.asarray(u), want, rtol=1e-14, atol=0)


# ----------------------------------- complex gradients and accumulator dtypes


_COMPLEX_GS = [
    jnp.array([1 + 2j, -1j], jnp.complex64),
    jnp.array([3 - 1j, 2 + 2j], jnp.complex64),
]


@pytest.mark.parametrize(
    "make",
    [
        lambda: oa.chain(
            oa.accumulate(2, accumulator_dtype=jnp.float32), optax.sgd(1.0)
        ),
        lambda: oa.chain(
            oa.accumulate(2, accumulator_dtype=jnp.complex64), optax.sgd(1.0)
        ),
        lambda: oa.MultiSteps(optax.sgd(1.0), 2),  # explicit float32 default
        lambda: oa.MultiSteps(optax.sgd(1.0), 2, True, None, jnp.complex64),
    ],
    ids=["float32", "complex64", "multisteps", "multisteps-complex64"],
)
def test_complex_gradients_with_explicit_accumulator_dtype(make):
    """A real explicit ``accumulator_dtype`` means the
    complex dtype of that precision for complex gradients (the imaginary part
    is kept), and a complex one is accepted."""
    tx = make()
    params = jnp.zeros(2, jnp.complex64)
    state = tx.init(params)
    # The accumulator (the only leaf shaped like the params) is complex64.
    accs = [x for x in jax.tree.leaves(state) if jnp.shape(x) == (2,)]
    assert [x.dtype for x in accs] == [jnp.complex64], accs
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no ComplexWarning
        _, state = tx.update(_COMPLEX_GS[0], state, params)
        u, state = tx.update(_COMPLEX_GS[1], state, params)
    assert u.dtype == jnp.complex64
    want = -(np.asarray(_COMPLEX_GS[0]) + np.asarray(_COMPLEX_GS[1])) / 2
    np.testing.assert_allclose(u, want, rtol=1e-6)


def test_complex_accumulator_dtype_for_real_gradients_is_real():
    """With a complex ``accumulator_dtype``, real leaves
    accumulate in the real dtype of that precision."""
    params = {"r": jnp.zeros(2), "c": jnp.zeros(2, jnp.complex64)}
    tx = oa.chain(
        oa.accumulate(2, accumulator_dtype=jnp.complex64), optax.sgd(1.0)
    )
    state = tx.init(params)
    assert state[0].acc["r"].dtype == jnp.float32
    assert state[0].acc["c"].dtype == jnp.complex64
    grads = {"r": jnp.array([1.0, 3.0]), "c": _COMPLEX_GS[0]}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no ComplexWarning
        _, state = tx.update(grads, state, params)
        u, state = tx.update(grads, state, params)
    np.testing.assert_allclose(u["r"], [-1.0, -3.0])
    np.testing.assert_allclose(u["c"], -np.asarray(_COMPLEX_GS[0]))


# ------------------------------------ integer weights beyond float32's 2**24
# Beyond 2**24 float32 integers step by 2: 2**24 + 1 rounds to 2**24, and
# the window's weight keeps the dropped 1 in its low part (weight_low).


def _beyond_2_to_the_24(tx, extra_ones=10):
    """A window of weight ``2**24 + extra_ones``: a call of weight 2**24
    (gradient 0), then ``extra_ones`` calls of weight 1 (gradient 1). Each
    +1 rounds away in float32 (2**24 + 1 -> 2**24): the low part holds
    them. Returns the states and updates after each call."""
    params = jnp.zeros(2)
    step = jax.jit(lambda s, g, w: tx.update(g, s, params, accum_weight=w))
    state = tx.init(params)
    states, updates = [], []
    calls = [(0.0, 2.0**24)] + [(1.0, 1.0)] * extra_ones
    for g, w in calls:
        u, state = step(state, jnp.full(2, g), jnp.float32(w))
        states.append(state)
        updates.append(np.asarray(u))
    return states, updates


def test_summed_gradient_at_a_known_weight_0_is_added():
    """summed_gradients=True: a gradient is the sum over its micro-batch
    and is added as it is, also at an ``accum_weight=0`` known now (a
    Python 0, no select traced); the mean divides by the weights' total.
    Here (g1 + g2) / (0 + 2), eager and with a traced weight (jit)."""
    tx = oa.chain(oa.accumulate(2, summed_gradients=True), optax.sgd(1.0))
    params = jnp.zeros(2)
    g1, g2 = jnp.array([1.0, 2.0]), jnp.array([3.0, 5.0])
    want = -(np.asarray(g1) + np.asarray(g2)) / 2
    state = tx.init(params)
    _, state = tx.update(g1, state, params, accum_weight=0)
    np.testing.assert_array_equal(state[0].acc, g1)
    u, _ = tx.update(g2, state, params, accum_weight=2)
    np.testing.assert_allclose(u, want, rtol=1e-6)
    step = jax.jit(lambda s, g, w: tx.update(g, s, params, accum_weight=w))
    _, state = step(tx.init(params), g1, 0.0)
    u, _ = step(state, g2, 2.0)
    np.testing.assert_allclose(u, want, rtol=1e-6)


def test_window_mean_beyond_2_to_the_24_divides_by_the_exact_weight():
    """The emitted mean divides the window's sum by its exact weight
    (weight + weight_low): 10 / (2**24 + 10), not 10 / 2**24 (float32's
    rounded weight: 6e-7 off, 10 float32 ulps)."""
    tx = oa.chain(oa.accumulate(11), optax.sgd(1.0))
    states, updates = _beyond_2_to_the_24(tx)
    acc = states[-2][0]  # before the close: the stored sums
    assert float(acc.weight) == 2.0**24 and float(acc.weight_low) == 9.0
    want = -10.0 / (2.0**24 + 10)  # float64
    np.testing.assert_allclose(updates[-1], [want, want], rtol=1e-7)


def test_window_after_one_with_a_low_part_starts_from_zero():
    """A window that closes with a nonzero weight_low leaves it 0: the next
    window of weight 3 emits its mean 3 * g / 3 = g, not 3 * g / 13."""
    tx = oa.chain(oa.accumulate(11), optax.sgd(1.0))
    states, _ = _beyond_2_to_the_24(tx)
    state = states[-1]
    assert float(state[0].weight) == 0.0
    assert float(state[0].weight_low) == 0.0
    params = jnp.zeros(2)
    u = None
    for i in range(11):
        w = 3.0 if i == 0 else 0.0
        u, state = tx.update(jnp.full(2, 2.0), state, params, accum_weight=w)
    np.testing.assert_allclose(u, [-2.0, -2.0], rtol=1e-7)


def test_summed_window_of_weight_0_zeroes_its_accumulator():
    """summed_gradients=True: a window whose calls all weigh 0 still holds
    their (summed) gradients; closing it emits zeros, steps no follower,
    and zeroes the accumulator: the next window's mean is its own."""
    tx = oa.chain(oa.accumulate(2, summed_gradients=True), optax.sgd(1.0))
    params = jnp.zeros(2)
    state = tx.init(params)
    for _ in range(2):
        u, state = tx.update(jnp.ones(2), state, params, accum_weight=0)
    np.testing.assert_array_equal(u, [0.0, 0.0])
    assert not bool(oa.has_updated(state))
    np.testing.assert_array_equal(state[0].acc, [0.0, 0.0])
    for _ in range(2):
        u, state = tx.update(jnp.full(2, 5.0), state, params, accum_weight=1)
    np.testing.assert_allclose(u, [-5.0, -5.0], rtol=1e-7)
