"""The micro-step's arithmetic (API.md 2): ``acc + g`` on a call that does
not close the window, the accumulator zeroed from its own value when the
window closes, summed gradients, and the compiler options of an in-place
micro-step."""

from __future__ import annotations

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optaxaccum as oa


def _grads(seed, shape=(3, 4)):
    return {"w": jax.random.normal(jax.random.key(seed), shape)}


def _acc_states(state):
    """Every AccumulateState in a chain's state."""
    return [
        s
        for s in jax.tree.leaves(
            state, is_leaf=lambda s: isinstance(s, oa.AccumulateState)
        )
        if isinstance(s, oa.AccumulateState)
    ]


# ------------------------------------------------ zero between windows


@pytest.mark.parametrize("summed", [False, True])
def test_accumulator_is_zero_between_windows(summed):
    """A closing call and a flush leave the accumulator and its weight at
    exactly zero: the next window adds to them."""
    tx = oa.chain(oa.accumulate(2, summed_gradients=summed), optax.sgd(1.0))
    params = {"w": jnp.zeros((3, 4))}
    state = tx.init(params)
    for i in range(2):
        _, state = tx.update(_grads(i), state, params, accum_weight=2.0)
    (acc,) = _acc_states(state)
    assert int(acc.mini_step) == 0
    np.testing.assert_array_equal(acc.acc["w"], np.zeros((3, 4)))
    assert float(acc.weight) == 0.0
    _, state = tx.update(_grads(5), state, params, accum_weight=2.0)
    _, state = oa.flush(tx, state, params)
    (acc,) = _acc_states(state)
    np.testing.assert_array_equal(acc.acc["w"], np.zeros((3, 4)))
    assert float(acc.weight) == 0.0


def test_multisteps_accumulator_is_zero_between_windows():
    ms = oa.MultiSteps(optax.adam(1e-3), 2)
    params = {"w": jnp.zeros((3, 4))}
    state = ms.init(params)
    for i in range(2):
        _, state = ms.update(_grads(i), state, params)
    np.testing.assert_array_equal(state.acc_grads["w"], np.zeros((3, 4)))


@pytest.mark.parametrize("bad", [jnp.nan, jnp.inf, -jnp.inf])
def test_nonfinite_window_does_not_poison_the_next(bad):
    """Without skip_nonfinite a non-finite micro-batch is emitted with its
    window; the zero written at the close is NaN-safe, so the next window
    equals a fresh one."""
    tx = oa.chain(oa.accumulate(2), optax.sgd(1.0))
    params = {"w": jnp.zeros((3, 4))}
    state = tx.init(params)
    poisoned = {"w": _grads(0)["w"].at[0, 0].set(bad)}
    _, state = tx.update(poisoned, state, params)
    u, state = tx.update(_grads(1), state, params)
    assert not np.isfinite(np.asarray(u["w"])[0, 0])
    _, state = tx.update(_grads(2), state, params)
    u, state = tx.update(_grads(3), state, params)
    want = -(_grads(2)["w"] + _grads(3)["w"]) / 2
    np.testing.assert_allclose(u["w"], want, rtol=1e-6)


# ------------------------------------------------ the micro-step itself


def _outside_cond(jaxpr):
    """The equations of a jaxpr outside the gate's branch (recursing into
    pjit/custom calls but not into a cond's branches, nor into the body of
    the loop of 0 or 1 trips the fused step branches with)."""
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in ("cond", "while"):
            continue
        out.append(eqn)
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            out += _outside_cond(sub)
    return out


def _tree_sized_ops(step, args, shape):
    """Primitive names of the equations outside the conditional whose
    output has the tree's ``shape``."""
    jaxpr = jax.make_jaxpr(step)(*args).jaxpr
    return sorted(
        e.primitive.name
        for e in _outside_cond(jaxpr)
        for v in e.outvars
        if getattr(v.aval, "shape", None) == shape
    )


@pytest.mark.parametrize(
    ("summed", "weight"),
    [(False, None), (False, 3.0), (True, "traced")],
)
def test_non_closing_micro_step_is_one_add(summed, weight):
    """Outside the gate's conditional the fused step does one thing to the
    accumulator: ``acc + g`` (no select, no multiply by a weight), the form
    XLA folds into the GEMM that makes ``g``. A weight known at trace time
    is 1 or multiplied in as a constant; a traced weight with summed
    gradients only adds to the window's total."""
    shape = (8, 16)
    tx = oa.chain(oa.accumulate(4, summed_gradients=summed), optax.adam(0.1))
    params = {"w": jnp.zeros(shape)}
    state = tx.init(params)
    if weight == "traced":

        def step(p, s, g, w):
            return oa.apply_gradients(tx, g, s, p, accum_weight=w)

        args = (params, state, params, jnp.float32(2.0))
    else:
        extra = {} if weight is None else {"accum_weight": weight}

        def step(p, s, g):
            return oa.apply_gradients(tx, g, s, p, **extra)

        args = (params, state, params)
    ops = _tree_sized_ops(step, args, shape)
    want = ["add"] if weight in (None, "traced") else ["add", "mul"]
    assert ops == want, ops


# ------------------------------------------------ summed gradients


def _run(tx, grads, weights, params, flush=False, jit=False):
    wrap = jax.jit if jit else (lambda f: f)
    update = wrap(lambda g, s, w: tx.update(g, s, params, accum_weight=w))
    state = tx.init(params)
    outs = []
    for g, w in zip(grads, weights):
        u, state = update(g, state, w)
        outs.append(u)
    if flush:
        u, state = wrap(lambda s: oa.flush(tx, s, params))(state)
        outs.append(u)
    return outs, state


def _means_and_sums(counts):
    """Per-micro-batch mean gradients and the sums they stand for (each
    mean times its micro-batch's count)."""
    means = [_grads(i) for i in range(len(counts))]
    sums = [
        jax.tree.map(lambda g, n=n: n * g, m) for m, n in zip(means, counts)
    ]
    return means, sums


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("jit", [False, True])
def test_summed_gradients_equal_weighted_means(reduction, jit):
    """Summed micro-batch gradients with their counts give what the
    per-micro-batch means with the same ``accum_weight`` give, including a
    partial window closed by flush."""
    counts = [3.0, 1.0, 4.0, 2.0, 5.0]
    means, sums = _means_and_sums(counts)
    params = {"w": jnp.zeros((3, 4))}

    def make(summed):
        return oa.chain(
            oa.accumulate(2, reduction=reduction, summed_gradients=summed),
            optax.adam(0.1),
        )

    got, s1 = _run(make(True), sums, counts, params, True, jit)
    want, _ = _run(make(False), means, counts, params, True, jit)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a["w"], b["w"], rtol=2e-5, atol=1e-7)
    assert int(_acc_states(s1)[0].gradient_step) == 3


def test_summed_gradients_need_accum_weight():
    tx = oa.chain(oa.accumulate(2, summed_gradients=True), optax.sgd(1.0))
    params = {"w": jnp.zeros(2)}
    with pytest.raises(ValueError, match="accum_weight"):
        tx.update({"w": jnp.ones(2)}, tx.init(params), params)


def test_summed_gradients_must_be_a_bool():
    with pytest.raises(TypeError, match="summed_gradients"):
        oa.accumulate(2, summed_gradients="yes")


def test_summed_gradients_nested_follower_weighs_the_window():
    """An inner summed accumulate closing a window hands its mean on to an
    outer one; nested accumulates equal one accumulate of the product."""
    counts = [3.0, 1.0, 4.0, 2.0]
    sums = [
        jax.tree.map(lambda g, n=n: n * g, _grads(i))
        for i, n in enumerate(counts)
    ]
    params = {"w": jnp.zeros((3, 4))}
    nested = oa.chain(
        oa.accumulate(2, summed_gradients=True),
        oa.accumulate(2, summed_gradients=True),
        optax.sgd(1.0),
    )
    one = oa.chain(oa.accumulate(4, summed_gradients=True), optax.sgd(1.0))
    got, _ = _run(nested, sums, counts, params)
    want, _ = _run(one, sums, counts, params)
    np.testing.assert_allclose(got[-1]["w"], want[-1]["w"], rtol=1e-6)


def test_summed_gradients_skip_nonfinite_drops_an_empty_nan():
    """Summed gradients are added as they are, so under skip_nonfinite a
    non-finite one is dropped even at weight 0 (the mean form counts such a
    call and adds nothing)."""
    tx = oa.chain(
        oa.accumulate(2, summed_gradients=True, skip_nonfinite=True),
        optax.sgd(1.0),
    )
    params = {"w": jnp.zeros(1)}
    outs, state = _run(
        tx,
        [{"w": jnp.array([jnp.nan])}, {"w": jnp.array([6.0])}],
        [0.0, 3.0],
        params,
    )
    assert not bool(oa.has_updated(state))
    u, state = tx.update({"w": jnp.array([2.0])}, state, params, accum_weight=1)
    np.testing.assert_allclose(u["w"], [-2.0])


def test_summed_gradients_noise_scale_equals_the_mean_form():
    counts = [3.0, 1.0, 4.0, 2.0, 2.0, 5.0]
    means, sums = _means_and_sums(counts)
    params = {"w": jnp.zeros((3, 4))}

    def make(summed):
        return oa.chain(
            oa.accumulate(3, summed_gradients=summed, noise_scale_decay=0.5),
            optax.sgd(1.0),
        )

    _, s1 = _run(make(True), sums, counts, params)
    _, s2 = _run(make(False), means, counts, params)
    for a, b in zip(oa.noise_scale(s1), oa.noise_scale(s2)):
        np.testing.assert_allclose(a, b, rtol=1e-5)


# ------------------------------------------------ compiler options


def test_fold_compiler_options_name_both_backends():
    options = oa.fold_compiler_options()
    assert options == {
        "xla_cpu_copy_insertion_use_region_analysis": True,
        "xla_gpu_copy_insertion_use_region_analysis": True,
    }
    options.clear()  # a new dict on every call
    assert oa.fold_compiler_options()


def test_fold_compiler_options_change_no_result():
    """The same fused steps with and without the options: bit-identical
    params and state over two windows."""
    tx = oa.chain(oa.accumulate(2), optax.adam(0.1))
    params = {"w": jnp.ones((8, 16))}

    def run(**jit_kwargs):
        step = jax.jit(
            lambda p, s, g: oa.apply_gradients(tx, g, s, p), **jit_kwargs
        )
        p, s = params, tx.init(params)
        for i in range(4):
            p, s = step(p, s, _grads(i, (8, 16)))
        return p, s

    plain = run()
    folded = run(compiler_options=oa.fold_compiler_options())
    jax.tree.map(np.testing.assert_array_equal, plain, folded)


# ------------------------------------------------ states of earlier versions


def test_a_state_of_an_earlier_version_is_converted():
    """Earlier versions kept the last window's sum in the accumulator at a
    window's end and had no weight_low; the first update zeroes it there,
    so the next window equals a fresh one (chain and MultiSteps)."""
    params = {"w": jnp.zeros((3, 4))}
    tx = oa.chain(oa.accumulate(2), optax.sgd(1.0))
    fresh = tx.init(params)
    old = (
        fresh[0]._replace(
            acc={"w": jnp.full((3, 4), 10.0)},
            weight=jnp.float32(2.0),
            weight_low=None,
        ),
        fresh[1],
    )
    ms = oa.MultiSteps(optax.sgd(1.0), 2)
    old_ms = ms.init(params)._replace(
        acc_grads={"w": jnp.full((3, 4), 10.0)},
        acc_weight=jnp.float32(2.0),
        acc_weight_low=None,
    )
    want = -(_grads(0)["w"] + _grads(1)["w"]) / 2
    for t, state in ((tx, old), (ms, old_ms)):
        step = jax.jit(lambda g, s, t=t: t.update(g, s, params))
        _, state = step(_grads(0), state)
        u, state = step(_grads(1), state)
        np.testing.assert_allclose(u["w"], want, rtol=1e-6)
    _, flushed = oa.flush(tx, old, params)
    assert flushed[0].weight_low is not None


@pytest.mark.parametrize("options", [False, True])
@pytest.mark.parametrize("form", ["chain", "MultiSteps", "weighted"])
def test_fused_step_holds_no_tree_without_and_with_options(form, options):
    """The fused donated step of the default path allocates no tree-sized
    temporary with no compiler option, and none with
    ``oa.fold_compiler_options()`` either (XLA:CPU, gradients passed in)."""
    params = {"w": jnp.zeros((256, 256)), "v": jnp.zeros((128, 256))}
    tx = (
        oa.MultiSteps(optax.adam(1e-3), 4)
        if form == "MultiSteps"
        else oa.chain(oa.accumulate(4), optax.adam(1e-3))
    )
    extra = {"accum_weight": jnp.float32(2.0)} if form == "weighted" else {}
    step = jax.jit(
        lambda p, s, g, kw: oa.apply_gradients(tx, g, s, p, **kw),
        donate_argnums=(0, 1),
        compiler_options=oa.fold_compiler_options() if options else None,
    )
    compiled = step.lower(params, tx.init(params), params, extra).compile()
    tree = sum(x.size * 4 for x in jax.tree.leaves(params))
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp < tree // 64, (temp, tree)


# ------------------------------------------- the closing branch's memory


def _temp_of(tx, params, extra):
    """Temporary bytes of ``tx``'s fused donated step, no compiler option
    (XLA:CPU; gradients passed in)."""
    step = jax.jit(
        lambda p, s, g, kw: oa.apply_gradients(tx, g, s, p, **kw),
        donate_argnums=(0, 1),
    )
    compiled = step.lower(params, tx.init(params), params, extra).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_summed_weighted_window_closes_in_no_tree():
    """A summed-gradient window (its weight traced) decides whether it is
    empty before the step's branch: the fused step, closing branch
    included, allocates no tree-sized temporary with no option."""
    params = {"w": jnp.zeros((256, 256)), "v": jnp.zeros((128, 256))}
    tx = oa.chain(oa.accumulate(4, summed_gradients=True), optax.adam(1e-3))
    temp = _temp_of(tx, params, {"accum_weight": jnp.float32(8.0)})
    tree = sum(x.size * 4 for x in jax.tree.leaves(params))
    assert temp < tree // 64, (temp, tree)


def test_window_loss_scale_closes_in_no_more_than_the_scale_alone():
    """The loss scale after the accumulate decides on the window inside the
    closing branch without a second copy of the optimizer's state: the
    fused step holds no more than the loss scale in front of the
    optimizer alone (no accumulation) holds, with no option."""
    params = {"w": jnp.zeros((256, 256)), "v": jnp.zeros((128, 256))}
    adam = optax.adam(1e-3)
    windowed = oa.chain(oa.accumulate(4), oa.dynamic_loss_scale(), adam)
    alone = oa.chain(oa.dynamic_loss_scale(), adam)
    tree = sum(x.size * 4 for x in jax.tree.leaves(params))
    temp = _temp_of(windowed, params, {})
    assert temp <= _temp_of(alone, params, {}) + tree // 64, (temp, tree)


def _bytes_accessed(fn, *args):
    compiled = jax.jit(fn, donate_argnums=(0, 1)).lower(*args).compile()
    cost = compiled.cost_analysis()
    return (cost[0] if isinstance(cost, list) else cost)["bytes accessed"]


def test_fused_step_moves_the_optimizer_and_two_tree_adds():
    """The fused step of ``chain(accumulate(4), adam)`` (its closing
    branch included: the compiled program holds both) moves no more bytes
    than Adam's step alone plus two tree adds (the add, the accumulator's
    zeroing) and its scalars: ordering Adam's moments after the new params
    where nothing is selected back split its pass in two (half as many
    bytes more)."""
    params = {f"w{i}": jnp.zeros((512, 256)) for i in range(3)}
    adam = optax.adam(1e-3)
    tx = oa.chain(oa.accumulate(4), adam)

    def alone(p, s, g):
        updates, s = adam.update(g, s, p)
        return optax.apply_updates(p, updates), s

    def tree_add(p, s, g):
        return jax.tree.map(jnp.add, p, g), s

    fused = _bytes_accessed(
        lambda p, s, g: oa.apply_gradients(tx, g, s, p),
        params,
        tx.init(params),
        params,
    )
    floor = _bytes_accessed(tree_add, params, (), params)
    bound = _bytes_accessed(alone, params, adam.init(params), params)
    assert fused <= bound + 2 * floor + 1024, (fused, bound, floor)  # scalars


def test_window_loss_scale_closes_in_no_tree():
    """The loss scale after the accumulate checks the window's finiteness
    from the accumulator's own peaks (a reduce of a buffer it holds), not
    from the window's mean, which the optimizer also reads: the fused
    step, closing branch included, allocates no tree-sized temporary with
    no option (XLA:CPU kept the mean in memory for its two readers)."""
    params = {"w": jnp.zeros((256, 256)), "v": jnp.zeros((128, 256))}
    tx = oa.chain(oa.accumulate(4), oa.dynamic_loss_scale(), optax.adam(1e-3))
    tree = sum(x.size * 4 for x in jax.tree.leaves(params))
    temp = _temp_of(tx, params, {})
    assert temp < tree // 64, (temp, tree)


@pytest.mark.parametrize("jit", [False, True])
def test_empty_summed_window_resets_its_accumulator(jit):
    """A summed window whose calls all weigh 0 closes empty: the optimizer
    does not step, and the accumulator starts the next window from zero
    (what those calls added is dropped), as a fresh window would."""
    params = {"w": jnp.zeros((3, 4))}
    tx = oa.chain(oa.accumulate(2, summed_gradients=True), optax.sgd(1.0))

    def update(g, s, w):
        return tx.update(g, s, params, accum_weight=w)

    if jit:
        update = jax.jit(update)
    state = tx.init(params)
    for seed in (0, 1):  # the empty window: gradients, weight 0
        u, state = update(_grads(seed), state, jnp.float32(0.0))
    assert not bool(oa.has_updated(state))
    np.testing.assert_array_equal(u["w"], np.zeros((3, 4)))
    np.testing.assert_array_equal(_acc_states(state)[0].acc["w"], 0)
    fresh = tx.init(params)
    for seed in (2, 3):
        got, state = update(_grads(seed), state, jnp.float32(1.0))
        want, fresh = update(_grads(seed), fresh, jnp.float32(1.0))
    np.testing.assert_array_equal(got["w"], want["w"])
    assert bool(oa.has_updated(state))
