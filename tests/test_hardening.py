"""Regression tests for issue 10 (hardening): wrong results and silent traps.

Each test names the item of the issue it pins and fails on the code before
the fix. References are outside ones where one exists: the big-batch update,
plain NumPy weighted means, ``optax.inject_hyperparams``/``optax.lookahead``
driven by hand once per window.
"""

import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optaxaccum as oa

# ------------------------------------------- 1. weight 0 with a NaN gradient


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


# ----------------------------------------------------- 2. complex gradients


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


# ------------------------------------------------------ 3. nested accumulates


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


# ------------------------------------------------------ 4. weight validation


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


# ------------------------------------------------- 5. near-miss keywords


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


# ------------------------------------------------ 6. wrappers and gates


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


# ------------------------------------------- 9. float0 and Python-float leaves


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


# --------------------------------------------------- 10. float64 under x64


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


# ------------------------------- mutants that survived the suite (issue 10)


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
    ``oa.GateContext`` (issue 25): a user's ``passed`` is an ordinary
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


# =========================================== issue 23 (hardening 2)
# ------------------------------------------- 2. float64 means under x64


@pytest.mark.parametrize("accumulator_dtype", [None, jnp.float64])
@pytest.mark.parametrize("case", ["k3", "flush3", "weights"])
def test_float64_mean_is_exact_at_float64_rounding(case, accumulator_dtype):
    """Issue 23, item 2: the window's weight and its division are in the
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


# ----------------------------- 4. the loss scale and weight-0 (padding) calls


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("jit", [False, True])
def test_loss_scale_zero_weight_call_is_not_an_overflow(fused, jit):
    """Issue 23, item 4: a weight-0 micro-batch's NaN gradient (0/0 of an
    empty mask) behind ``dynamic_loss_scale`` leaves the scale and its
    counter as they were and passes on: the window is the one of
    ``oa.accumulate`` alone on the unscaled gradients."""
    scale = 8.0
    nan = jnp.array([jnp.nan, jnp.nan])
    calls = [
        (jnp.array([1.0, 2.0]), 1.0),
        (nan, 0.0),
        (jnp.array([3.0, 1.0]), 2.0),
        (jnp.array([jnp.nan, jnp.inf]), 0.0),
        (jnp.array([2.0, -2.0]), 1.0),
        (jnp.array([5.0, 1.0]), 3.0),
    ]
    tx = oa.chain(
        oa.dynamic_loss_scale(scale, period=2), oa.accumulate(2), optax.sgd(1.0)
    )
    ref = oa.chain(oa.accumulate(2), optax.sgd(1.0))
    params = ref_params = jnp.zeros(2)
    state, ref_state = tx.init(params), ref.init(params)

    def step(params, state, g, w):
        if fused:
            return oa.apply_gradients(tx, g, state, params, accum_weight=w)
        u, state = tx.update(g, state, params, accum_weight=w)
        return optax.apply_updates(params, u), state

    step = jax.jit(step) if jit else step
    for g, w in calls:
        before = state[0]
        params, state = step(params, state, g * oa.loss_scale(state), w)
        u, ref_state = ref.update(g, ref_state, ref_params, accum_weight=w)
        ref_params = optax.apply_updates(ref_params, u)
        if w == 0:
            chex.assert_trees_all_equal(state[0], before)
        np.testing.assert_array_equal(
            state[1].mini_step, ref_state[0].mini_step
        )
        np.testing.assert_allclose(params, ref_params, rtol=1e-6)
    # 4 calls with data, all finite: grown twice (period 2).
    assert float(oa.loss_scale(state)) == scale * 4


def test_loss_scale_without_accumulate_passes_zero_weight_call_on():
    """Issue 23, item 4: the loss scale alone (no accumulate) also reads a
    weight-0 call as no data: the scale stays, the followers run."""
    tx = oa.chain(oa.dynamic_loss_scale(4.0), optax.scale(0.5))
    state = tx.init(jnp.zeros(1))
    u, new = tx.update(jnp.array([8.0]), state, accum_weight=0)
    np.testing.assert_allclose(u, [1.0])
    chex.assert_trees_all_equal(new, state)


# ---------------------------------------------------- 5. complex edges


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
    """Issue 23, item 5: a real explicit ``accumulator_dtype`` means the
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
    """Issue 23, item 5: with a complex ``accumulator_dtype``, real leaves
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


@pytest.mark.parametrize("part", ["imag", "real"])
def test_loss_scale_overflow_in_a_complex_part(part):
    """Issue 23, item 5: an ``inf`` in the imaginary part of a complex
    gradient is an overflow: scale halved, micro-batch not counted."""
    tx = oa.chain(oa.dynamic_loss_scale(4.0), oa.accumulate(2), optax.sgd(1.0))
    params = jnp.zeros(2, jnp.complex64)
    state = tx.init(params)
    bad = complex(1, np.inf) if part == "imag" else complex(np.inf, 1)
    g = jnp.array([bad, 1j], jnp.complex64)
    _, state = tx.update(g, state, params)
    assert float(oa.loss_scale(state)) == 2.0
    assert int(state[1].mini_step) == 0


# ------------------------------------------------ 8. MultiSteps drop-in traps


def test_multisteps_has_updated_on_an_optax_state_answers_as_optax():
    """Issue 23, item 8: ``has_updated`` of a state made by
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


def test_multisteps_takes_accumulator_dtype_fifth_positional():
    """Issue 23, item 8: optax's constructor order, ``accumulator_dtype``
    fifth positional included."""
    ms = oa.MultiSteps(optax.adam(0.1), 3, True, None, jnp.bfloat16)
    theirs = optax.MultiSteps(optax.adam(0.1), 3, True, None, jnp.bfloat16)
    params = jnp.zeros(2)
    assert ms.init(params).acc_grads.dtype == jnp.bfloat16
    assert theirs.init(params).acc_grads.dtype == jnp.bfloat16


# ------------------------------------ 7. bare `weight`, non-numeric weights


@pytest.mark.parametrize(
    "entry", ["update", "apply_gradients", "flush", "nnx", "trainstate"]
)
def test_bare_weight_keyword_is_a_near_miss_of_accum_weight(entry):
    """Issue 23, item 7: ``weight=3.`` was silently ignored."""
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
    """Issue 23, item 7: a string ``accum_weight`` gave numpy's raw
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


# ------------------------------------------ tests the suite lacked (issue 23)


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
    """Issue 23, tests the suite lacks: bf16 gradients, a follower casting to
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


@pytest.mark.devices(4)
def test_dynamic_loss_scale_replicas_agree_on_one_device_overflow():
    """Issue 23, tests the suite lacks: with ``axis_name``, one device's
    overflow skips the step on all and every replica's scale and params
    stay equal (no collective after the gate, so a disagreement shows as
    values, not as a crash)."""
    n = 4
    tx = oa.chain(oa.dynamic_loss_scale(16.0, axis_name="d"), optax.sgd(1.0))
    params = jnp.ones(2)
    rep = lambda t: jax.tree.map(lambda a: jnp.stack([a] * n), t)  # noqa: E731
    params_r, state_r = rep(params), rep(tx.init(params))
    step = jax.pmap(
        lambda g, s, p: oa.apply_gradients(tx, g, s, p),
        axis_name="d",
        devices=jax.devices()[:n],
    )
    g = jnp.ones((n, 2)).at[2, 1].set(jnp.inf)
    params_r, state_r = step(g, state_r, params_r)
    np.testing.assert_array_equal(state_r[0].scale, np.full(n, 8.0))
    np.testing.assert_array_equal(params_r, np.ones((n, 2)))


def test_nested_closed_gate_zeros_take_the_followers_output_dtype():
    """Issue 23, tests the suite lacks: where the outer window closes but an
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
    """Issue 23, tests the suite lacks (a kill that was only a crash): inside
    ``shard_map`` the zeros a closed gate emits are built from the shapes of
    what the open branch would emit, so they keep its device-varying type
    (``vma``) and dtype; zeros typed as the incoming gradients, or built
    without the varying type, make ``lax.cond``'s branches disagree. Checked
    on the helper the chain builds its zeros with, before any branch."""
    from optaxaccum._src import utils
    from optaxaccum._src.microbatch import _vma as _varying

    mesh = jax.make_mesh((4,), ("d",))
    seen = {}

    def body(g):
        shapes = jax.eval_shape(lambda: g.astype(jnp.float32))
        zeros = utils.zeros_of(shapes)
        seen["want"] = (_varying(g), jnp.float32)
        seen["got"] = (_varying(zeros), zeros.dtype)
        return zeros

    g = jax.device_put(jnp.ones(8, jnp.bfloat16), NamedSharding(mesh, P("d")))
    jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d")))(
        g
    )
    assert seen["want"][0] == frozenset({"d"}), seen
    assert seen["got"] == seen["want"], seen
