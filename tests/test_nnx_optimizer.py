"""Tests for ``optaxaccum.flax.nnx.Optimizer``.

The reference is flax's own ``nnx.Optimizer`` holding the same ``oa.chain``
(the plain protocol), with the partial window closed by hand as the issue's
users had to: ``oa.flush`` on the pure states plus ``flush_batch_stats``.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx

import optaxaccum as oa
from optaxaccum.flax import nnx as oa_nnx

K = 3  # window length
MICRO = 6  # examples per micro-batch


class Net(nnx.Module):
    """Linear -> AccumBatchNorm -> relu -> (LoRA-wrapped) Linear -> BN.

    The linear layers have no bias: a bias before a BatchNorm has a zero
    gradient, whose rounding noise Adam would blow up to steps of size lr.
    """

    def __init__(self, rngs, *, accum_steps=1, lora=False):
        self.l1 = nnx.Linear(4, 8, use_bias=False, rngs=rngs)
        self.bn = oa_nnx.AccumBatchNorm(
            8, accum_steps=accum_steps, momentum=0.8, rngs=rngs
        )
        self.bn2 = oa_nnx.AccumBatchNorm(
            3, accum_steps=accum_steps, momentum=0.5, rngs=rngs
        )
        head = nnx.Linear(8, 3, use_bias=False, rngs=rngs)
        self.head = (
            nnx.LoRA(8, 2, 3, base_module=head, rngs=rngs) if lora else head
        )

    def __call__(self, x):
        return self.bn2(self.head(nnx.relu(self.bn(self.l1(x)))))


def _batch(i, n=MICRO):
    key = jax.random.key(100 + i)
    x = jax.random.normal(key, (n, 4))
    y = jax.random.randint(jax.random.fold_in(key, 1), (n,), 0, 3)
    return x, y


def _loss(model, x, y, scale=1.0):
    logits = model(x)
    return (
        scale
        * optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    )


_flush = nnx.jit(lambda model, opt: opt.flush(model), donate_argnums=(0, 1))


def _stock_flush(model, opt):
    """What users wrote before the nnx Optimizer: close both windows by
    hand."""
    oa_nnx.flush_batch_stats(model)
    params = nnx.as_pure(nnx.state(model, opt.wrt))
    updates, opt_state = oa.flush(opt.tx, nnx.as_pure(opt.opt_state), params)
    nnx.update(model, optax.apply_updates(params, updates))
    nnx.update(opt.opt_state, nnx.state(opt_state))


def _train(
    opt_cls,
    tx,
    *,
    wrt=nnx.Param,
    lora=False,
    accum_steps=K,
    poison=(),
    weights=None,
    epochs=2,
    per_epoch=2 * K + 1,
    scale=1.0,
):
    """Trains a fresh Net; returns (model, optimizer). ``poison``: the
    micro-steps whose gradients are multiplied by inf (loss-scale overflow)."""
    model = Net(nnx.Rngs(0), accum_steps=accum_steps, lora=lora)
    opt = opt_cls(model, tx, wrt=wrt)

    @nnx.jit(donate_argnums=(0, 1))
    def step(model, opt, x, y, w, bad):
        before = nnx.as_pure(nnx.state(model, nnx.BatchStat))
        diff = nnx.DiffState(0, wrt)
        grads = nnx.grad(_loss, argnums=diff)(model, x, y, scale)
        grads = jax.tree.map(lambda g: jnp.where(bad, jnp.inf, 1.0) * g, grads)
        opt.update(model, grads, accum_weight=w)
        if opt_cls is not oa_nnx.Optimizer:
            # By hand, as users had to: the BatchNorm
            # statistics of a dropped micro-batch are thrown away.
            after = nnx.as_pure(nnx.state(model, nnx.BatchStat))
            kept = jax.tree.map(
                lambda b, a: jnp.where(bad, b, a), before, after
            )
            nnx.update(model, kept)

    if opt_cls is oa_nnx.Optimizer:
        end = _flush
    else:
        end = nnx.jit(_stock_flush, donate_argnums=(0, 1))
    i = 0
    for _ in range(epochs):
        for _ in range(per_epoch):
            w = 1.0 if weights is None else weights[i % len(weights)]
            step(model, opt, *_batch(i), w, i in poison)
            i += 1
        end(model, opt)
    return model, opt


CASES = {
    "weights": dict(
        tx=lambda: oa.chain(oa.agc(0.1), oa.accumulate(K), optax.adam(1e-2)),
        weights=(1.0, 3.0, 0.5, 2.0, 0.0),
    ),
    "loss_scale_overflow": dict(
        tx=lambda: oa.chain(
            oa.dynamic_loss_scale(2.0**4, period=2),
            oa.accumulate(K),
            optax.adam(1e-2),
        ),
        poison=(1, 5, 6, 9),
        scale=2.0**4,
    ),
    "wrt_lora": dict(
        tx=lambda: oa.chain(oa.accumulate(K), optax.adamw(1e-2)),
        wrt=nnx.LoRAParam,
        lora=True,
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_optimizer_equals_stock_nnx_optimizer_over_windows(case):
    kw = dict(CASES[case])
    tx = kw.pop("tx")
    ours, ours_opt = _train(oa_nnx.Optimizer, tx(), **kw)
    ref, ref_opt = _train(nnx.Optimizer, tx(), **kw)
    # The last counted statistics, which only oa's Optimizer records, aside.
    observable = lambda path, _: not str(path[-1]).startswith("counted_")  # noqa: E731
    chex.assert_trees_all_close(
        nnx.state(ours, observable),
        nnx.state(ref, observable),
        rtol=1e-6,
        atol=1e-7,
    )
    not_acc = lambda path, _: "acc" not in path  # noqa: E731
    chex.assert_trees_all_close(
        nnx.state(ours_opt, not_acc),
        nnx.state(ref_opt, not_acc),
        rtol=1e-6,
        atol=1e-7,
    )
    # The accumulator (the raw weighted gradient sum) on
    # its own. Each element sums a window's K * MICRO per-example gradient
    # terms, computed in float32 by two different XLA programs (fused step vs
    # stock); each result is within (K * MICRO) * eps of the exact sum,
    # relative to the terms' magnitude, bounded here by the leaf's largest
    # element; twice that between the two. A fixed atol of 1e-7 was below
    # this bound (one element was 1.45e-7 off on some runs).
    is_acc = lambda path, _: "acc" in path  # noqa: E731
    ours_acc = jax.tree.leaves(nnx.as_pure(nnx.state(ours_opt, is_acc)))
    ref_acc = jax.tree.leaves(nnx.as_pure(nnx.state(ref_opt, is_acc)))
    assert len(ours_acc) == len(ref_acc) > 0
    eps = np.finfo(np.float32).eps
    for a, b in zip(ours_acc, ref_acc):
        atol = 2 * K * MICRO * eps * np.max(np.abs(b))
        np.testing.assert_allclose(a, b, rtol=0, atol=atol)
    # The windows really closed, the last partial one by the flush:
    state = nnx.as_pure(ours_opt.opt_state)
    found = [
        s
        for s in jax.tree.leaves(
            state, is_leaf=lambda s: isinstance(s, oa.AccumulateState)
        )
        if isinstance(s, oa.AccumulateState)
    ]
    # 2 epochs of 7 micro-batches, K = 3: 2 windows + 1 flushed per epoch;
    # with the loss scale, 3 of the first epoch's and 1 of the second's are
    # dropped: 4 + 6 counted = (1 + 1 flushed) + 2 windows.
    windows = {"weights": 6, "loss_scale_overflow": 4, "wrt_lora": 6}
    assert int(found[0].gradient_step) == windows[case]
    assert int(found[0].mini_step) == 0
    assert int(ours.bn.window_step[...]) == 0
    if kw.get("lora"):  # the base kernel was not optimized
        fresh = Net(nnx.Rngs(0), accum_steps=K, lora=True)
        np.testing.assert_array_equal(
            ours.head.base_module.kernel[...],
            fresh.head.base_module.kernel[...],
        )
        assert not np.array_equal(ours.head.lora_a[...], fresh.head.lora_a[...])


def test_optimizer_equals_big_batch_adam_with_token_weights():
    """Outside reference: Adam on the per-example mean over the window."""
    model = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
    ref = nnx.clone(model)
    opt = oa_nnx.Optimizer(model, oa.chain(oa.accumulate(K), optax.adam(1e-2)))
    ref_opt = nnx.Optimizer(ref, optax.adam(1e-2), wrt=nnx.Param)
    sizes = (2, 5, 3)
    batches = [_batch(i, n) for i, n in enumerate(sizes)]

    @nnx.jit
    def step(model, opt, x, y):
        opt.update(model, nnx.grad(_loss)(model, x, y), accum_weight=len(x))

    for x, y in batches:
        step(model, opt, x, y)
    x = jnp.concatenate([b[0] for b in batches])
    y = jnp.concatenate([b[1] for b in batches])
    nnx.jit(lambda m, o: o.update(m, nnx.grad(_loss)(m, x, y)))(ref, ref_opt)
    chex.assert_trees_all_close(
        nnx.state(model), nnx.state(ref), rtol=1e-5, atol=1e-6
    )


def _param_bytes(model):
    return sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def test_non_closing_update_writes_no_params_and_builds_no_update_tree():
    model = nnx.Sequential(
        nnx.Linear(256, 512, rngs=nnx.Rngs(0)),
        nnx.Linear(512, 256, rngs=nnx.Rngs(1)),
    )
    # A -0.0 survives only if the param is not written: -0.0 + 0.0 == +0.0.
    model.layers[0].bias[...] = jnp.full((512,), -0.0)
    tx = oa.chain(oa.accumulate(4), optax.adam(1e-3))
    grads = jax.tree.map(jnp.ones_like, nnx.state(model, nnx.Param))

    def step(model, opt, grads):
        opt.update(model, grads)

    temps = {}
    for cls in (nnx.Optimizer, oa_nnx.Optimizer):
        opt = cls(model, tx, wrt=nnx.Param)
        f = nnx.jit(step, donate_argnums=(0, 1))
        compiled = f.lower(model, opt, grads).compile()
        mem = compiled.memory_analysis()
        temps[cls] = mem.temp_size_in_bytes
    # The stock path builds a tree of zero updates (param-sized) on XLA:CPU;
    # ours does not, on any backend (XLA:GPU may write the stock path's
    # zeros in place, so its premise is checked on CPU only).
    if jax.default_backend() == "cpu":
        assert temps[nnx.Optimizer] >= _param_bytes(model)
    assert temps[oa_nnx.Optimizer] < _param_bytes(model) // 100

    opt = oa_nnx.Optimizer(model, tx)
    before = jax.tree.map(
        lambda a: np.asarray(a).copy(), nnx.state(model, nnx.Param)
    )
    f = nnx.jit(step, donate_argnums=(0, 1))
    for _ in range(3):  # the window stays open
        f(model, opt, grads)
        chex.assert_trees_all_equal(nnx.state(model, nnx.Param), before)
        assert np.signbit(model.layers[0].bias[...]).all()
    assert int(opt.step[...]) == 3 and int(opt.opt_state[0].mini_step[...]) == 3
    f(model, opt, grads)  # closes: Adam's first step moves every param
    assert not np.array_equal(
        model.layers[0].kernel[...], before["layers"][0]["kernel"]
    )


class TwoBN(nnx.Module):
    """Two AccumBatchNorm layers (momentum 0.8 and 0.5) on the same input."""

    def __init__(self, rngs, bn=oa_nnx.AccumBatchNorm, **kw):
        self.l1 = nnx.Linear(4, 3, use_bias=False, rngs=rngs)
        self.bn = bn(3, momentum=0.8, rngs=rngs, **kw)
        self.bn2 = bn(3, momentum=0.5, rngs=rngs, **kw)

    def __call__(self, x):
        h = self.l1(x)
        return self.bn(h) * self.bn2(h)


def test_flush_closes_optimizer_and_batchnorm_windows():
    model = TwoBN(nnx.Rngs(0), accum_steps=4)
    ref = TwoBN(nnx.Rngs(0), bn=nnx.BatchNorm)
    opt = oa_nnx.Optimizer(model, oa.chain(oa.accumulate(4), optax.sgd(0.5)))
    ref_opt = nnx.Optimizer(ref, optax.sgd(0.5), wrt=nnx.Param)
    batches = [_batch(i) for i in range(2)]  # 2 of 4: a partial window
    loss = lambda m, x, y: optax.squared_error(
        m(x)[:, 0], y.astype(float)
    ).mean()

    @nnx.jit
    def step(model, opt, x, y):
        grads = nnx.grad(loss)(model, x, y)
        opt.update(model, grads)
        return grads

    grads = [step(model, opt, x, y) for x, y in batches]
    assert int(model.bn.window_step[...]) == 2
    # nnx.BatchNorm run once on the concatenated partial window.
    ref(jnp.concatenate([b[0] for b in batches]))
    nnx.jit(lambda m, o: o.flush(m))(model, opt)
    # Optimizer: one SGD step on the mean of the two gradients (not / 4).
    ref_opt.update(ref, jax.tree.map(lambda a, b: (a + b) / 2, *grads))
    chex.assert_trees_all_close(
        nnx.state(model, nnx.Param),
        nnx.state(ref, nnx.Param),
        rtol=1e-6,
        atol=1e-7,
    )
    acc = opt.opt_state[0]
    assert (int(acc.mini_step[...]), int(acc.gradient_step[...])) == (0, 1)
    assert int(opt.step[...]) == 2
    # BatchNorm: each layer with its own momentum.
    for name in ("bn", "bn2"):
        ours, want = getattr(model, name), getattr(ref, name)
        assert int(ours.window_step[...]) == 0
        np.testing.assert_allclose(
            ours.mean[...], want.mean[...], rtol=1e-5, atol=1e-6
        )
        np.testing.assert_allclose(
            ours.var[...], want.var[...], rtol=1e-5, atol=1e-6
        )
    assert not np.allclose(model.bn.var[...], model.bn2.var[...])
    # A second flush finds both windows empty and changes nothing.
    before = jax.tree.map(np.asarray, (nnx.state(model), nnx.state(opt)))
    opt.flush(model)
    chex.assert_trees_all_equal((nnx.state(model), nnx.state(opt)), before)


def test_flush_passes_extra_args_and_needs_an_accumulate():
    model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    tx = oa.chain(
        oa.accumulate(4),
        optax.sgd(0.1),
        optax.contrib.reduce_on_plateau(patience=0, factor=0.5),
    )
    opt = oa_nnx.Optimizer(model, tx)
    grads = nnx.grad(lambda m: m(jnp.ones((1, 2))).sum())(model)
    opt.update(model, grads, value=1.0)
    nnx.jit(lambda m, o, v: o.flush(m, value=v))(model, opt, 2.0)
    assert int(opt.opt_state[0].gradient_step[...]) == 1
    assert float(opt.opt_state[2].best_value[...]) == 2.0  # saw value=2.0
    with pytest.raises(TypeError, match="accum_weight"):
        opt.update(model, grads, value=1.0, acum_weight=2.0)
    plain = oa_nnx.Optimizer(model, optax.sgd(0.1))
    with pytest.raises(ValueError, match="oa.flush needs an oa.accumulate"):
        plain.flush(model)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("gated", [False, True])
def test_update_returns_the_updates_as_stock_nnx_optimizer(gated, jit):
    """``update`` returns the updates tree, as flax's
    ``nnx.Optimizer.update`` does since 0.12.3: the optimizer's update
    without a gate; with one, zeros on the non-closing micro-step and the
    window's update on the closing one."""
    model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    ref_model = nnx.clone(model)

    def make():
        adam = optax.adam(0.1)
        return oa.chain(oa.accumulate(2), adam) if gated else adam

    opt = oa_nnx.Optimizer(model, make())
    assert isinstance(opt, nnx.Optimizer) and opt.wrt is nnx.Param
    ref = nnx.Optimizer(ref_model, make(), wrt=nnx.Param)

    def step(model, opt, x):
        grads = nnx.grad(lambda m: (m(x) ** 2).sum())(model)
        return opt.update(model, grads)

    step = nnx.jit(step) if jit else step
    for i in range(4):
        x = jnp.full((1, 2), i + 1.0)
        got, want = step(model, opt, x), step(ref_model, ref, x)
        chex.assert_trees_all_close(got, want, rtol=1e-6, atol=0)
        if gated and i % 2 == 0:  # non-closing: zeros
            chex.assert_trees_all_equal(got, jax.tree.map(jnp.zeros_like, got))
        else:
            assert all(bool(jnp.any(u != 0)) for u in jax.tree.leaves(got))
    chex.assert_trees_all_close(
        nnx.state(model), nnx.state(ref_model), rtol=1e-6
    )
    assert int(opt.step[...]) == int(ref.step[...]) == 4


def test_orbax_checkpoint_mid_window_resumes_bit_identically(tmp_path):
    tx = oa.chain(
        oa.dynamic_loss_scale(2.0**8, period=2),
        oa.agc(0.05),
        oa.accumulate(K),
        optax.adam(1e-2),
    )
    n_steps, stop = 3 * K + 1, K + 2  # stop mid-window

    @nnx.jit(donate_argnums=(0, 1))
    def step(model, opt, x, y):
        grads = nnx.grad(_loss)(model, x, y)
        opt.update(model, grads)

    def fresh():
        model = Net(nnx.Rngs(0), accum_steps=K)
        return model, oa_nnx.Optimizer(model, tx)

    full, full_opt = fresh()
    for i in range(n_steps):
        step(full, full_opt, *_batch(i))
    _flush(full, full_opt)

    first, first_opt = fresh()
    for i in range(stop):
        step(first, first_opt, *_batch(i))
    assert int(first_opt.opt_state[2].mini_step[...]) == stop - K
    assert int(first.bn.window_step[...]) == stop - K
    assert float(first_opt.opt_state[0].scale[...]) > 2.0**8  # it moved
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(
        tmp_path / "ckpt",
        {"model": nnx.state(first), "opt": nnx.state(first_opt)},
    )
    ckptr.wait_until_finished()

    model, opt = nnx.eval_shape(fresh)
    target = {"model": nnx.state(model), "opt": nnx.state(opt)}
    restored = ckptr.restore(tmp_path / "ckpt", target)
    model, opt = fresh()
    nnx.update(model, restored["model"])
    nnx.update(opt, restored["opt"])
    chex.assert_trees_all_equal(
        (nnx.state(model), nnx.state(opt)),
        (nnx.state(first), nnx.state(first_opt)),
    )
    for i in range(stop, n_steps):
        step(model, opt, *_batch(i))
    _flush(model, opt)
    chex.assert_trees_all_equal(nnx.state(model), nnx.state(full))
    chex.assert_trees_all_equal(nnx.state(opt), nnx.state(full_opt))


def test_bench_nnx_runs_and_measures_memory():
    """Smoke test of benchmarks/bench_nnx.py on toy sizes: it runs end to
    end and its compile-time memory targets hold (timings are not checked)."""
    import importlib.util
    import pathlib

    path = (
        pathlib.Path(__file__).resolve().parent.parent
        / "benchmarks"
        / "bench_nnx.py"
    )
    spec = importlib.util.spec_from_file_location("bench_nnx", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    res = bench.main(tiny=True, rounds=1)
    assert all(len(row) == len(res["headers"]) for row in res["rows"])
    assert len(res["rows"]) == 8 and all(r > 0 for r in res["ratios"].values())
    memory = [t for t in res["targets"] if "temp" in t["target"]]
    assert len(memory) == 2 and all(t["met"] for t in memory), memory


# ---------------------------------------- refused micro-batches and BN


class BNFirst(nnx.Module):
    """AccumBatchNorm on the input, then a linear head: the BatchNorm sees
    the raw micro-batches, whatever the optimizer did to the head."""

    def __init__(self, rngs, bn=oa_nnx.AccumBatchNorm, **kw):
        self.bn = bn(4, momentum=0.8, rngs=rngs, **kw)
        self.head = nnx.Linear(4, 1, rngs=rngs)

    def __call__(self, x):
        return self.head(self.bn(x))[:, 0]


REFUSING = {
    "skip_nonfinite": lambda: oa.chain(
        oa.accumulate(4, skip_nonfinite=True), optax.sgd(0.1)
    ),
    "loss_scale": lambda: oa.chain(
        oa.dynamic_loss_scale(2.0**4), oa.accumulate(4), optax.sgd(0.1)
    ),
}


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("refusing", sorted(REFUSING))
def test_refused_micro_batch_stays_out_of_the_batchnorm_window(refusing, jit):
    """A micro-batch whose labels are NaN (finite forward
    pass, NaN gradients) is refused by the chain and must not enter the
    AccumBatchNorm window: both windows close on the same calls, and the
    running statistics equal stock ``nnx.BatchNorm`` on the concatenation
    of the counted micro-batches."""
    model = BNFirst(nnx.Rngs(0), accum_steps=4)
    opt = oa_nnx.Optimizer(model, REFUSING[refusing]())
    ref = BNFirst(nnx.Rngs(0), bn=nnx.BatchNorm)
    refused = (1, 6)

    def step(model, opt, x, y):
        loss = lambda m: ((m(x) - y) ** 2).mean()  # noqa: E731
        opt.update(model, nnx.grad(loss)(model))

    step = nnx.jit(step) if jit else step
    batches = [_batch(i) for i in range(10)]
    opt_closed, bn_closed = [], []
    for i, (x, y) in enumerate(batches):
        y = y.astype(jnp.float32)
        step(model, opt, x, jnp.full_like(y, jnp.nan) if i in refused else y)
        opt_closed.append(bool(oa.has_updated(nnx.as_pure(opt.opt_state))))
        bn_closed.append(int(model.bn.window_step[...]) == 0)
    counted = [x for i, (x, _) in enumerate(batches) if i not in refused]
    # Counted: 0 2 3 4 | 5 7 8 9: the windows close on calls 4 and 9.
    want = [i in (4, 9) for i in range(10)]
    assert (opt_closed, bn_closed) == (want, want)
    for window in (counted[:4], counted[4:]):
        ref.bn(jnp.concatenate(window))
    for name in ("mean", "var"):
        np.testing.assert_allclose(
            getattr(model.bn, name)[...],
            getattr(ref.bn, name)[...],
            rtol=1e-5,
            atol=1e-6,
        )


def _bn_step(jit):
    """One micro-batch through ``opt`` (labels NaN where ``refused``: a
    finite forward pass, NaN gradients)."""

    def step(model, opt, x, y, refused):
        y = jnp.where(refused, jnp.nan, y.astype(jnp.float32))
        loss = lambda m: ((m(x) - y) ** 2).mean()  # noqa: E731
        opt.update(model, nnx.grad(loss)(model))

    return nnx.jit(step) if jit else step


def _assert_bn_equals(model, ref):
    for name in ("mean", "var"):
        np.testing.assert_allclose(
            getattr(model.bn, name)[...],
            getattr(ref.bn, name)[...],
            rtol=1e-5,
            atol=1e-6,
        )


@pytest.mark.parametrize("jit", [False, True])
def test_refused_micro_batch_stays_out_with_a_window_of_one_in_front(jit):
    """An ``oa.accumulate(1, skip_nonfinite=True)`` in front of the window
    (a filter of non-finite micro-batches) is the chain's first window: a
    call counted where it closed a window of one. A NaN micro-batch stays
    out of the AccumBatchNorm window, the finite ones go in: the running
    statistics equal ``nnx.BatchNorm`` on the counted micro-batches."""
    tx = oa.chain(
        oa.accumulate(1, skip_nonfinite=True),
        oa.accumulate(4),
        optax.sgd(0.1),
    )
    model = BNFirst(nnx.Rngs(0), accum_steps=4)
    opt = oa_nnx.Optimizer(model, tx)
    ref = BNFirst(nnx.Rngs(0), bn=nnx.BatchNorm)
    step, refused = _bn_step(jit), (1, 6)
    batches = [_batch(i) for i in range(10)]
    opt_closed, bn_closed = [], []
    for i, (x, y) in enumerate(batches):
        step(model, opt, x, y, i in refused)
        opt_closed.append(bool(opt.opt_state[1].updated[...]))
        bn_closed.append(int(model.bn.window_step[...]) == 0)
    want = [i in (4, 9) for i in range(10)]
    assert (opt_closed, bn_closed) == (want, want)
    counted = [x for i, (x, _) in enumerate(batches) if i not in refused]
    for window in (counted[:4], counted[4:]):
        ref.bn(jnp.concatenate(window))
    _assert_bn_equals(model, ref)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize(
    "tx",
    [lambda: optax.MultiSteps(optax.sgd(0.1), 4), lambda: optax.adam(0.1)],
    ids=["optax_multisteps", "adam"],
)
def test_plain_optax_optimizer_counts_every_call_for_batchnorm(tx, jit):
    """A plain optax optimizer (no ``oa.accumulate`` in its state, e.g.
    ``optax.MultiSteps``) counts every call: AccumBatchNorm updates its
    window on each micro-batch and its running statistics equal
    ``nnx.BatchNorm`` once per window of four."""
    model = BNFirst(nnx.Rngs(0), accum_steps=4)
    opt = oa_nnx.Optimizer(model, tx())
    ref = BNFirst(nnx.Rngs(0), bn=nnx.BatchNorm)
    step = _bn_step(jit)
    batches = [_batch(i) for i in range(8)]
    steps = []
    for x, y in batches:
        step(model, opt, x, y, False)
        steps.append(int(model.bn.window_step[...]))
    assert steps == [1, 2, 3, 0] * 2
    for window in (batches[:4], batches[4:]):
        ref.bn(jnp.concatenate([x for x, _ in window]))
    _assert_bn_equals(model, ref)


@pytest.mark.parametrize("jit", [False, True])
def test_micro_batch_refused_right_after_flush_keeps_flushed_statistics(jit):
    """``flush`` closes the optimizer's and the BatchNorm's partial windows;
    a micro-batch the chain refuses right after must not bring back the
    statistics from before the flush. Then a full window of counted
    micro-batches closes as ``nnx.BatchNorm`` on it."""
    model = BNFirst(nnx.Rngs(0), accum_steps=4)
    opt = oa_nnx.Optimizer(model, REFUSING["skip_nonfinite"]())
    ref = BNFirst(nnx.Rngs(0), bn=nnx.BatchNorm)
    step = _bn_step(jit)
    batches = [_batch(i) for i in range(7)]
    for x, y in batches[:2]:  # a partial window of two
        step(model, opt, x, y, False)
    if jit:
        nnx.jit(lambda m, o: o.flush(m))(model, opt)
    else:
        opt.flush(model)
    ref.bn(jnp.concatenate([x for x, _ in batches[:2]]))
    _assert_bn_equals(model, ref)
    step(model, opt, *batches[2], True)  # refused right after the flush
    assert int(model.bn.window_step[...]) == 0
    _assert_bn_equals(model, ref)
    for x, y in batches[3:]:
        step(model, opt, x, y, False)
    ref.bn(jnp.concatenate([x for x, _ in batches[3:]]))
    _assert_bn_equals(model, ref)


@pytest.mark.parametrize("jit", [False, True])
def test_batchnorm_windows_close_with_a_critical_batch_window(jit):
    """With ``every_k=oa.critical_batch_every_k(...)`` the optimizer's
    windows change length; the AccumBatchNorm windows (``accum_steps`` the
    longest) close exactly on the calls where the optimizer's closes, and
    the running statistics equal ``nnx.BatchNorm`` on each concatenated
    window."""
    every_k = oa.critical_batch_every_k(2, 5, micro_batch_weight=1)
    tx = oa.chain(oa.accumulate(every_k, noise_scale_decay=0.0), optax.sgd(0.1))
    model = BNFirst(nnx.Rngs(0), accum_steps=5)
    opt = oa_nnx.Optimizer(model, tx)
    ref = BNFirst(nnx.Rngs(0), bn=nnx.BatchNorm)
    step = _bn_step(jit)
    batches = [_batch(i) for i in range(18)]
    opt_closed, bn_closed = [], []
    for x, y in batches:
        step(model, opt, x, y, False)
        opt_closed.append(bool(oa.has_updated(nnx.as_pure(opt.opt_state))))
        bn_closed.append(int(model.bn.window_step[...]) == 0)
    ends = [i for i, c in enumerate(opt_closed) if c]
    windows = [range(a + 1, b + 1) for a, b in zip([-1, *ends], ends)]
    assert len({len(w) for w in windows}) > 1, windows  # lengths change
    assert bn_closed == opt_closed
    for w in windows:
        ref.bn(jnp.concatenate([batches[i][0] for i in w]))
    _assert_bn_equals(model, ref)


def test_getting_started_says_a_dropped_micro_batch_leaves_batchnorm_alone():
    """docs/getting_started.md says what
    test_refused_micro_batch_stays_out_of_the_batchnorm_window measures: a
    micro-batch the loss scale drops leaves the AccumBatchNorm window
    unchanged; no passage says its statistics enter the window (a stale
    one did, contradicting the page's own nnx paragraph)."""
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parent.parent
    text = " ".join((root / "docs" / "getting_started.md").read_text().split())
    assert "leaves every `AccumBatchNorm` window as it was" in text
    stale = r"statistics enter the `AccumBatchNorm` window|window can then "
    stale += r"close before the optimizer"
    assert not re.search(stale, text)


def test_has_updated_of_the_optimizer_state_is_a_plain_array():
    """``oa.has_updated(optimizer.opt_state)`` answers with a plain boolean
    array, like ``oa.loss_scale`` and ``oa.noise_scale`` on the same state
    (it returned an nnx OptArray, on which ``bool()`` raised TypeError)."""
    model = Net(nnx.Rngs(0))
    tx = oa.chain(
        oa.dynamic_loss_scale(2.0**4),
        oa.accumulate(2, noise_scale_decay=0.5),
        optax.sgd(0.1),
    )
    opt = oa_nnx.Optimizer(model, tx)
    flags = []
    for i in range(3):
        x, y = _batch(i)
        opt.update(model, nnx.grad(_loss)(model, x, y))
        readers = (oa.has_updated, oa.loss_scale, oa.noise_scale)
        for reader in readers:
            got = reader(opt.opt_state)
            for leaf in jax.tree.leaves(got):
                assert type(leaf) is type(jnp.zeros(())), (reader, leaf)
        flags.append(bool(oa.has_updated(opt.opt_state)))
    assert flags == [False, True, False]


@pytest.mark.parametrize("jit", [False, True])
def test_batchnorm_accum_steps_shorter_than_the_window_raises(jit):
    """AccumBatchNorm(accum_steps=4) under an Optimizer whose windows are 6
    long closes on its own after 4 micro-batches, a window the optimizer
    does not have: that call raises ValueError naming the mismatch (under
    jit when the step runs) instead of silently wrong running statistics;
    accum_steps of the window's length steps on."""

    def run(accum_steps, calls):
        model = BNFirst(nnx.Rngs(0), accum_steps=accum_steps)
        tx = oa.chain(oa.accumulate(6), optax.sgd(0.1))
        opt = oa_nnx.Optimizer(model, tx)
        step = _bn_step(jit)
        for i in range(calls):
            x, y = _batch(i)
            step(model, opt, x, y, False)
        return int(jax.block_until_ready(model.bn.window_step[...]))

    with pytest.raises(Exception, match=r"accum_steps=4\).*optimizer's"):
        run(4, 5)
    assert run(6, 8) == 2


def test_batchnorm_window_follows_nested_accumulates():
    """Under ``oa.chain(oa.accumulate(2), oa.accumulate(3), opt)`` every
    call counts (the outermost window takes each one), and the
    AccumBatchNorm window (accum_steps=6) closes with the optimizer's, on
    calls 6 and 12: its running statistics equal nnx.BatchNorm on each
    concatenated window (a reading of the innermost window counted only
    the calls that reached it)."""
    model = BNFirst(nnx.Rngs(0), accum_steps=6)
    tx = oa.chain(oa.accumulate(2), oa.accumulate(3), optax.sgd(0.1))
    opt = oa_nnx.Optimizer(model, tx)
    ref = BNFirst(nnx.Rngs(0), bn=nnx.BatchNorm)
    step = _bn_step(False)
    batches = [_batch(i) for i in range(12)]
    closed = []
    for x, y in batches:
        step(model, opt, x, y, False)
        closed.append(int(model.bn.window_step[...]) == 0)
    assert closed == [i in (5, 11) for i in range(12)]
    for w in range(2):
        ref.bn(jnp.concatenate([x for x, _ in batches[6 * w : 6 * w + 6]]))
    _assert_bn_equals(model, ref)
