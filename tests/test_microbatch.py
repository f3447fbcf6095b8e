"""Tests of ``oa.microbatched_value_and_grad`` and ``oa.plan_microbatches``.

The oracles are ``jax.value_and_grad`` on the whole batch and explicit Python
loops over the micro-batches. Micro-batch ``i`` of ``n`` is the consecutive
slice ``i`` of axis 0 by default, ``x[i::n]`` with ``interleave=True``.
"""

import functools
import math
import re

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optaxaccum as oa
from tests import helpers

JIT_OR_NOT = [lambda f: f, jax.jit]

# Tolerances by dtype of params and inputs. bf16 has an 8-bit significand
# (relative spacing 2**-8 ~ 4e-3): the full-batch reference and the
# micro-batched result round differently in a handful of operations.
TOL = {
    jnp.float32: dict(rtol=1e-5, atol=1e-6),
    jnp.bfloat16: dict(rtol=3e-2, atol=3e-3),
}


def _batch(seed=1, n=16, din=5, dout=3, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    return {
        "x": jnp.asarray(rng.normal(size=(n, din)), dtype),
        "y": jnp.asarray(rng.normal(size=(n, dout)), dtype),
    }


def _predict(params, x):
    h = jnp.tanh(x @ params["w1"] + params["b1"][None, :])
    return h @ params["w2"]


def _loss(params, batch):
    """Mean over examples of the squared error."""
    return jnp.mean((_predict(params, batch["x"]) - batch["y"]) ** 2)


def _loss_aux(params, batch):
    pred = _predict(params, batch["x"])
    aux = {"pred": pred, "max": jnp.max(pred)}
    return jnp.mean((pred - batch["y"]) ** 2), aux


def _masked_loss(params, batch):
    """Mean over the unmasked examples (a per-token mean)."""
    sq = jnp.sum((_predict(params, batch["x"]) - batch["y"]) ** 2, axis=-1)
    return jnp.sum(batch["mask"] * sq) / jnp.sum(batch["mask"])


def _mask_weight(batch):
    return jnp.sum(batch["mask"])


def _slice(batch, i, n, interleave=False):
    """Micro-batch ``i`` of ``n``: the consecutive slice ``i``, or the
    examples i, i + n, i + 2n, ... with ``interleave``."""
    if interleave:
        return jax.tree.map(lambda x: x[i::n], batch)
    return jax.tree.map(
        lambda x: x[i * (len(x) // n) : (i + 1) * (len(x) // n)], batch
    )


# ---------------------------------------------------------------- numerics


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize(
    "wrap, n",
    [(JIT_OR_NOT[0], 4), (jax.jit, 1), (jax.jit, 4), (jax.jit, 16)],
)
def test_microbatched_value_and_grad_equals_value_and_grad(wrap, n, dtype):
    params, batch = helpers.mlp_params(dtype=dtype), _batch(dtype=dtype)
    f = wrap(oa.microbatched_value_and_grad(_loss, n))
    with jax.numpy_dtype_promotion("strict"):
        loss, grads = f(params, batch)
    ref_loss, ref_grads = jax.value_and_grad(_loss)(params, batch)
    assert loss.dtype == ref_loss.dtype == dtype and loss.shape == ()
    chex.assert_trees_all_equal_dtypes(grads, params)
    chex.assert_trees_all_equal_shapes(grads, params)
    chex.assert_trees_all_close(loss, ref_loss, **TOL[dtype])
    chex.assert_trees_all_close(grads, ref_grads, **TOL[dtype])


@pytest.mark.parametrize("wrap", JIT_OR_NOT)
def test_microbatched_value_and_grad_embedding_gradient_equals_whole_batch(
    wrap,
):
    # An embedding lookup's gradient is a scatter-add into the table; summed
    # across micro-batches in a scan it is the pattern an XLA pass was
    # reported to miscompile (scatter gradients accumulated in a loop).
    # Token ids repeat within and across micro-batches, some rows are never
    # used, and the weighted mean counts the unpadded tokens.
    vocab, dim, batch, length = 11, 4, 8, 6
    rng = np.random.default_rng(3)
    params = {
        "embed": jnp.asarray(rng.normal(size=(vocab, dim)), jnp.float32),
        "out": jnp.asarray(rng.normal(size=(dim, vocab)), jnp.float32),
    }
    tokens = jnp.asarray(rng.integers(0, vocab - 3, (batch, length)))
    mask = jnp.asarray(rng.random((batch, length)) < 0.8, jnp.float32)

    def loss_sum(params, batch):
        tokens, mask = batch
        h = jnp.tanh(params["embed"][tokens])  # (b, t, d): a gather
        logits = h @ params["out"]
        logp = jax.nn.log_softmax(logits[:, :-1])
        nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], -1)[..., 0]
        return jnp.sum(nll * mask[:, 1:])

    def loss_mean(params, batch):
        return loss_sum(params, batch) / jnp.sum(batch[1][:, 1:])

    ref_loss, ref_grads = jax.value_and_grad(loss_mean)(params, (tokens, mask))
    fn = oa.microbatched_value_and_grad(
        loss_mean,
        4,
        weight_fn=lambda b: jnp.sum(b[1][:, 1:]),
    )
    loss, grads = wrap(fn)(params, (tokens, mask))
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for name in params:
        np.testing.assert_allclose(
            grads[name], ref_grads[name], rtol=1e-5, atol=1e-6, err_msg=name
        )
    # The rows no token used get exactly zero gradient.
    np.testing.assert_array_equal(grads["embed"][vocab - 3 :], 0.0)


@pytest.mark.parametrize("interleave", [False, True])
@pytest.mark.parametrize("wrap", JIT_OR_NOT)
def test_microbatched_value_and_grad_has_aux_stacks_aux(wrap, interleave):
    params, batch = helpers.mlp_params(), _batch()
    n = 4
    f = wrap(
        oa.microbatched_value_and_grad(
            _loss_aux, n, has_aux=True, interleave=interleave
        )
    )
    with jax.numpy_dtype_promotion("strict"):
        (loss, aux), grads = f(params, batch)
    (ref_loss, ref_aux), ref_grads = jax.value_and_grad(
        _loss_aux, has_aux=True
    )(params, batch)
    chex.assert_trees_all_close(loss, ref_loss, **TOL[jnp.float32])
    chex.assert_trees_all_close(grads, ref_grads, **TOL[jnp.float32])
    m = 16 // n
    assert aux["pred"].shape == (n, m, 3) and aux["max"].shape == (n,)
    for i in range(n):
        want = _slice(ref_aux["pred"], i, n, interleave)
        chex.assert_trees_all_close(aux["pred"][i], want, **TOL[jnp.float32])
        chex.assert_trees_all_close(
            aux["max"][i], jnp.max(want), **TOL[jnp.float32]
        )
    # The documented way back to the batch order.
    back = aux["pred"].swapaxes(0, 1) if interleave else aux["pred"]
    chex.assert_trees_all_close(
        back.reshape(16, 3), ref_aux["pred"], **TOL[jnp.float32]
    )


def _weighted_oracle(loss_fn, params, batch, n, weight_fn):
    """sum_i w_i (loss_i, g_i) / sum_i w_i over the micro-batches with
    w_i != 0, one micro-batch at a time."""
    num_loss, num_grads, total = 0.0, None, 0.0
    vg = jax.jit(jax.value_and_grad(loss_fn))
    for i in range(n):
        mb = _slice(batch, i, n)
        w = float(weight_fn(mb))
        if w == 0:
            continue
        loss, grads = vg(params, mb)
        num_loss += w * float(loss)
        scaled = jax.tree.map(
            lambda g, w=w: w * np.asarray(g, np.float64), grads
        )
        num_grads = (
            scaled
            if num_grads is None
            else jax.tree.map(np.add, num_grads, scaled)
        )
        total += w
    return num_loss / total, jax.tree.map(lambda g: g / total, num_grads)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("wrap", JIT_OR_NOT)
def test_microbatched_value_and_grad_weight_fn(wrap, dtype):
    """Weighted by token count: the explicit weighted oracle and the global
    per-token mean; micro-batch 3 is all padding (weight 0, loss 0/0)."""
    params, batch = helpers.mlp_params(dtype=dtype), _batch(dtype=dtype)
    n = 4
    mask = np.ones(16)
    mask[[3, 7, 11, 15]] = 0  # micro-batch 3: no real example
    mask[[0, 5]] = 0  # uneven counts elsewhere
    batch["mask"] = jnp.asarray(mask, dtype)
    f = wrap(
        oa.microbatched_value_and_grad(_masked_loss, n, weight_fn=_mask_weight)
    )
    with jax.numpy_dtype_promotion("strict"):
        loss, grads = f(params, batch)
    assert loss.dtype == dtype
    chex.assert_trees_all_equal_dtypes(grads, params)
    chex.assert_tree_all_finite((loss, grads))
    ref_loss, ref_grads = _weighted_oracle(
        _masked_loss, params, batch, n, _mask_weight
    )
    as32 = functools.partial(
        jax.tree.map, lambda x: jnp.asarray(x, jnp.float32)
    )
    chex.assert_trees_all_close(
        as32((loss, grads)), as32((ref_loss, ref_grads)), **TOL[dtype]
    )
    if dtype == jnp.float32:
        # The global per-token mean. (In bf16 a full-batch reference rounds
        # its cancelling sums differently; the oracle above covers bf16.)
        glob_loss, glob_grads = jax.value_and_grad(_masked_loss)(params, batch)
        chex.assert_trees_all_close(loss, glob_loss, **TOL[dtype])
        chex.assert_trees_all_close(grads, glob_grads, **TOL[dtype])


@pytest.mark.parametrize("wrap", JIT_OR_NOT)
def test_microbatched_value_and_grad_zero_total_weight_gives_zeros(wrap):
    params, batch = helpers.mlp_params(), _batch()
    batch["mask"] = jnp.zeros(16)
    f = wrap(
        oa.microbatched_value_and_grad(_masked_loss, 4, weight_fn=_mask_weight)
    )
    loss, grads = f(params, batch)
    chex.assert_trees_all_equal(loss, jnp.zeros((), jnp.float32))
    chex.assert_trees_all_equal(grads, jax.tree.map(jnp.zeros_like, params))


def test_microbatched_value_and_grad_accumulates_in_float32():
    """bf16 gradients are summed in float32 and rounded to bf16 once: equal
    to the float32 mean of the micro-batch gradients, rounded once."""
    dtype = jnp.bfloat16
    params, batch = helpers.mlp_params(dtype=dtype), _batch(n=64, dtype=dtype)
    n = 16
    loss, grads = jax.jit(oa.microbatched_value_and_grad(_loss, n))(
        params, batch
    )
    vg = jax.jit(jax.value_and_grad(_loss))
    outs = [vg(params, _slice(batch, i, n)) for i in range(n)]
    ref = jax.tree.map(
        lambda *xs: jnp.mean(
            jnp.stack([x.astype(jnp.float32) for x in xs]), axis=0
        ).astype(dtype),
        *outs,
    )
    # Up to one bf16 rounding step (the micro-batch gradients are computed
    # in differently fused programs).
    chex.assert_trees_all_close((loss, grads), ref, rtol=2.0**-7, atol=2.0**-12)


@pytest.mark.parametrize("wrap", JIT_OR_NOT)
def test_microbatched_value_and_grad_tuple_batch_argnums(wrap):
    """Two batch arguments; weight_fn receives a tuple of both slices."""
    params, batch = helpers.mlp_params(), _batch()
    seen = []

    def loss_fn(params, x, y):
        return _loss(params, {"x": x, "y": y})

    def weight_fn(mb):
        seen.append(jax.tree.map(jnp.shape, mb))
        return mb[1].shape[0]  # equal weights: the unweighted mean

    f = wrap(
        oa.microbatched_value_and_grad(
            loss_fn, 4, batch_argnums=(1, 2), weight_fn=weight_fn
        )
    )
    loss, grads = f(params, batch["x"], batch["y"])
    ref_loss, ref_grads = jax.value_and_grad(loss_fn)(
        params, batch["x"], batch["y"]
    )
    assert seen and seen[0] == ((4, 5), (4, 3))
    chex.assert_trees_all_close(loss, ref_loss, **TOL[jnp.float32])
    chex.assert_trees_all_close(grads, ref_grads, **TOL[jnp.float32])


@pytest.mark.parametrize("wrap", JIT_OR_NOT)
def test_microbatched_value_and_grad_argnums_tuple(wrap):
    params, batch = helpers.mlp_params(), _batch()
    bias = jnp.linspace(-1.0, 1.0, 3)

    def loss_fn(params, batch, bias):
        return _loss(params, batch) + jnp.mean(
            (_predict(params, batch["x"]) + bias[None, :]) ** 2
        )

    f = wrap(
        oa.microbatched_value_and_grad(
            loss_fn, 8, argnums=(0, 2), batch_argnums=-2
        )
    )
    with jax.numpy_dtype_promotion("strict"):
        loss, grads = f(params, batch, bias)
    ref_loss, ref_grads = jax.value_and_grad(loss_fn, argnums=(0, 2))(
        params, batch, bias
    )
    assert isinstance(grads, tuple) and len(grads) == 2
    chex.assert_trees_all_close(loss, ref_loss, **TOL[jnp.float32])
    chex.assert_trees_all_close(grads, ref_grads, **TOL[jnp.float32])


# ---------------------------------------------------------------- state


class _BNNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Dense(8)(x)
        x = nn.BatchNorm(use_running_average=False, momentum=0.8)(x)
        return nn.Dense(3)(jnp.tanh(x))


@pytest.mark.parametrize("has_aux", [False, True])
def test_microbatched_value_and_grad_threads_state(has_aux):
    """Flax batch_stats through state_argnums: each micro-batch sees the
    statistics left by the previous one (oracle: a Python loop)."""
    model = _BNNet()
    batch = _batch()
    variables = model.init(jax.random.key(0), batch["x"])
    params, stats = variables["params"], variables["batch_stats"]

    def loss_fn(params, batch, stats):
        pred, new = model.apply(
            {"params": params, "batch_stats": stats},
            batch["x"],
            mutable=["batch_stats"],
        )
        loss = jnp.mean((pred - batch["y"]) ** 2)
        if has_aux:
            return loss, (new["batch_stats"], jnp.max(pred))
        return loss, new["batch_stats"]

    n = 4
    f = jax.jit(
        oa.microbatched_value_and_grad(
            loss_fn, n, has_aux=has_aux, state_argnums=2
        )
    )
    (loss, out), grads = f(params, batch, stats)
    new_stats, aux = out if has_aux else (out, None)

    ref_stats, losses, gsum, maxes = stats, [], None, []
    vg = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))
    for i in range(n):
        (l_i, out_i), g_i = vg(params, _slice(batch, i, n), ref_stats)
        ref_stats = out_i[0] if has_aux else out_i
        if has_aux:
            maxes.append(out_i[1])
        losses.append(l_i)
        gsum = g_i if gsum is None else jax.tree.map(jnp.add, gsum, g_i)
    ref_grads = jax.tree.map(lambda g: g / n, gsum)
    tol = TOL[jnp.float32]
    chex.assert_trees_all_close(loss, jnp.mean(jnp.stack(losses)), **tol)
    chex.assert_trees_all_close(grads, ref_grads, **tol)
    chex.assert_trees_all_close(new_stats, ref_stats, **tol)
    chex.assert_trees_all_equal_dtypes(new_stats, stats)
    # The state did change, four times.
    assert not np.allclose(new_stats["BatchNorm_0"]["mean"], 0.0)
    if has_aux:
        chex.assert_trees_all_close(aux, jnp.stack(maxes), **tol)


def test_microbatched_value_and_grad_state_must_keep_its_type():
    def loss_fn(w, x, s):
        return jnp.mean(x * w), s.astype(jnp.int32)

    f = oa.microbatched_value_and_grad(loss_fn, 2, state_argnums=2)
    with pytest.raises(ValueError, match="shapes and dtypes"):
        f(jnp.ones(()), jnp.ones(4), jnp.zeros(()))

    def loss_fn2(w, x, s):
        return jnp.mean(x * w), (s, s)

    f = oa.microbatched_value_and_grad(loss_fn2, 2, state_argnums=2)
    with pytest.raises(ValueError, match="tree structure"):
        f(jnp.ones(()), jnp.ones(4), jnp.zeros(()))


# ---------------------------------------------------------------- bad input


def test_microbatched_value_and_grad_indivisible_batch_raises():
    f = oa.microbatched_value_and_grad(_loss, 3)
    with pytest.raises(ValueError, match=r"batch size 16 .*num_microbatches=3"):
        f(helpers.mlp_params(), _batch())


def test_microbatched_value_and_grad_ragged_batch_raises():
    batch = {"x": jnp.ones((16, 5)), "y": jnp.ones((8, 3))}
    f = oa.microbatched_value_and_grad(_loss, 2)
    with pytest.raises(ValueError, match=r"\['x'\]: 16.*\['y'\]: 8"):
        f(helpers.mlp_params(), batch)
    with pytest.raises(ValueError, match="scalar"):
        f(helpers.mlp_params(), {"x": jnp.ones((16, 5)), "y": jnp.ones(())})


@pytest.mark.parametrize(
    "value, error",
    [(0, ValueError), (-2, ValueError), (2.0, TypeError), (True, TypeError)],
)
def test_microbatched_value_and_grad_validates_num_microbatches(value, error):
    with pytest.raises(error, match="num_microbatches"):
        oa.microbatched_value_and_grad(_loss, value)


def test_microbatched_value_and_grad_validates_arguments():
    with pytest.raises(ValueError, match="argnums and batch_argnums"):
        oa.microbatched_value_and_grad(_loss, 2, argnums=1, batch_argnums=1)
    with pytest.raises(ValueError, match="argnums and batch_argnums"):
        oa.microbatched_value_and_grad(
            _loss, 2, argnums=(0, 1), batch_argnums=(1,)
        )
    with pytest.raises(ValueError, match="batch_argnums and state_argnums"):
        oa.microbatched_value_and_grad(_loss, 2, state_argnums=1)
    with pytest.raises(TypeError, match="loss_fn"):
        oa.microbatched_value_and_grad(None, 2)
    with pytest.raises(TypeError, match="has_aux"):
        oa.microbatched_value_and_grad(_loss, 2, has_aux=1)
    with pytest.raises(TypeError, match="weight_fn"):
        oa.microbatched_value_and_grad(_loss, 2, weight_fn=3)
    with pytest.raises(TypeError, match="batch_argnums"):
        oa.microbatched_value_and_grad(_loss, 2, batch_argnums="1")
    # Overlap seen only once the number of arguments is known.
    f = oa.microbatched_value_and_grad(_loss, 2, argnums=0, batch_argnums=-2)
    with pytest.raises(ValueError, match="must not overlap"):
        f(helpers.mlp_params(), _batch())
    f = oa.microbatched_value_and_grad(_loss, 2, batch_argnums=2)
    with pytest.raises(ValueError, match="2 positional"):
        f(helpers.mlp_params(), _batch())
    f = oa.microbatched_value_and_grad(
        _loss, 2, weight_fn=lambda b: jnp.ones(2)
    )
    with pytest.raises(ValueError, match="weight_fn must return a scalar"):
        f(helpers.mlp_params(), _batch())


# ---------------------------------------------------------------- tracing


def test_microbatched_value_and_grad_traces_once_under_jit():
    loss_fn = chex.assert_max_traces(lambda p, b: _loss(p, b), n=1)
    f = oa.microbatched_value_and_grad(loss_fn, 4)

    @jax.jit
    @chex.assert_max_traces(n=1)
    def step(params, batch):
        return f(params, batch)

    params = helpers.mlp_params()
    for seed in range(3):
        loss, grads = step(params, _batch(seed=seed))
        params = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
    chex.assert_tree_all_finite(params)


# ---------------------------------------------------------------- devices


def _mesh4(axis_type=jax.sharding.AxisType.Explicit):
    return jax.make_mesh(
        (4,), ("data",), axis_types=(axis_type,), devices=jax.devices()[:4]
    )


@pytest.mark.devices(4)
def test_microbatched_value_and_grad_shard_map_pmean_equals_global():
    """Per-device micro-batching, params made varying and the gradients
    averaged once: the global value_and_grad."""
    mesh = _mesh4()
    params, batch = helpers.mlp_params(), _batch(n=32)
    f = oa.microbatched_value_and_grad(_loss, 4)

    def step(params, batch):
        params = jax.lax.pcast(params, "data", to="varying")
        return jax.lax.pmean(f(params, batch), "data")

    sharded = jax.jit(
        jax.shard_map(step, mesh=mesh, in_specs=(P(), P("data")), out_specs=P())
    )
    loss, grads = sharded(
        jax.device_put(params, NamedSharding(mesh, P())),
        jax.device_put(batch, NamedSharding(mesh, P("data"))),
    )
    ref_loss, ref_grads = jax.value_and_grad(_loss)(params, batch)
    chex.assert_trees_all_close(loss, ref_loss, **TOL[jnp.float32])
    chex.assert_trees_all_close(grads, ref_grads, **TOL[jnp.float32])


@pytest.mark.devices(4)
def test_microbatched_value_and_grad_shard_map_matches_value_and_grad():
    """With invariant params (check_vma), the same semantics as
    jax.value_and_grad inside shard_map (gradients summed over devices)."""
    mesh = _mesh4()
    params, batch = helpers.mlp_params(), _batch(n=32)

    def run(vg):
        return jax.jit(
            jax.shard_map(
                lambda p, b: jax.lax.pmean(vg(p, b), "data"),
                mesh=mesh,
                in_specs=(P(), P("data")),
                out_specs=P(),
            )
        )(
            jax.device_put(params, NamedSharding(mesh, P())),
            jax.device_put(batch, NamedSharding(mesh, P("data"))),
        )

    got = run(oa.microbatched_value_and_grad(_loss, 2))
    ref = run(jax.value_and_grad(_loss))
    chex.assert_trees_all_close(got, ref, **TOL[jnp.float32])


@pytest.mark.devices(4)
def test_microbatched_value_and_grad_pmap_pmean_equals_global():
    params, batch = helpers.mlp_params(), _batch(n=32)
    f = oa.microbatched_value_and_grad(_loss, 2)
    per_device = jax.tree.map(lambda x: x.reshape((4, 8) + x.shape[1:]), batch)
    loss, grads = jax.pmap(
        lambda p, b: jax.lax.pmean(f(p, b), "data"),
        axis_name="data",
        in_axes=(None, 0),
        devices=jax.devices()[:4],
    )(params, per_device)
    ref_loss, ref_grads = jax.value_and_grad(_loss)(params, batch)
    chex.assert_trees_all_close(loss[0], ref_loss, **TOL[jnp.float32])
    chex.assert_trees_all_close(
        jax.tree.map(lambda g: g[0], grads), ref_grads, **TOL[jnp.float32]
    )


@pytest.mark.devices(4)
@pytest.mark.parametrize(
    "axis_type",
    [jax.sharding.AxisType.Explicit, jax.sharding.AxisType.Auto],
)
def test_microbatched_value_and_grad_sharded_batch_stays_local(axis_type):
    """Under jit with the batch sharded over devices: the global result, and
    no all-gather of the batch (each micro-batch takes local rows)."""
    mesh = _mesh4(axis_type)
    params, batch = helpers.mlp_params(), _batch(n=32)
    f = jax.jit(oa.microbatched_value_and_grad(_loss, 4, interleave=True))
    args = (
        jax.device_put(params, NamedSharding(mesh, P())),
        jax.device_put(batch, NamedSharding(mesh, P("data"))),
    )
    with jax.set_mesh(mesh):
        loss, grads = f(*args)
        hlo = f.lower(*args).compile().as_text()
    ref_loss, ref_grads = jax.value_and_grad(_loss)(params, batch)
    chex.assert_trees_all_close(loss, ref_loss, **TOL[jnp.float32])
    chex.assert_trees_all_close(grads, ref_grads, **TOL[jnp.float32])
    assert not re.search(r"all-gather(-start)?\(", hlo)


# ---------------------------------------------------------------- planning


def _deep_loss(params, x):
    """An MLP whose activations (batch x width per layer) dominate memory."""
    h = x
    for w in params[:-1]:
        h = jnp.tanh(h @ w)
    return jnp.mean((h @ params[-1]) ** 2)


_WIDTH, _BATCH = 64, 256
_DEEP_PARAMS = (
    [jax.ShapeDtypeStruct((8, _WIDTH), jnp.float32)]
    + [jax.ShapeDtypeStruct((_WIDTH, _WIDTH), jnp.float32)] * 2
    + [jax.ShapeDtypeStruct((_WIDTH, 1), jnp.float32)]
)
_DEEP_X = jax.ShapeDtypeStruct((_BATCH, 8), jnp.float32)
_COUNTS = (1, 2, 4)


@functools.cache
def _deep_memory():
    """num_microbatches -> memory analysis of the jitted step."""
    out = {}
    for n in _COUNTS:
        step = oa.microbatched_value_and_grad(_deep_loss, n)
        compiled = jax.jit(step).lower(_DEEP_PARAMS, _DEEP_X).compile()
        out[n] = compiled.memory_analysis()
    return out


def _footprint(stats):
    return (
        stats.argument_size_in_bytes
        + stats.output_size_in_bytes
        - stats.alias_size_in_bytes
        + stats.temp_size_in_bytes
    )


def test_microbatched_value_and_grad_temp_memory_decreases():
    stats = _deep_memory()
    temps = [stats[n].temp_size_in_bytes for n in _COUNTS]
    if jax.default_backend() == "cpu":
        assert all(a > b for a, b in zip(temps, temps[1:], strict=False)), temps
    else:  # XLA:GPU's temporaries need not shrink step by step (H200:
        # 393,232 / 411,488 / 68,704 B); the most slices still need least.
        assert temps[-1] < min(temps[:-1]), temps
    # The arguments and outputs do not change with the number of slices.
    assert len({stats[n].argument_size_in_bytes for n in _COUNTS}) == 1
    assert len({stats[n].output_size_in_bytes for n in _COUNTS}) == 1
    # microbatched_step_memory reports the same footprint.
    assert oa.microbatched_step_memory(
        _deep_loss, _DEEP_PARAMS, _DEEP_X, num_microbatches=4
    ) == _footprint(stats[4])


def test_plan_microbatches_smallest_count_that_fits():
    """Budgets between consecutive footprints pick the count whose step
    fits while the next smaller count's does not; bigger budgets never ask
    for more micro-batches."""
    fp = {n: _footprint(s) for n, s in _deep_memory().items()}
    # Each count's own footprint as the budget, and twice the largest: the
    # answer is the smallest count that fits, whatever the order of the
    # footprints (they need not shrink with the count on every backend).
    budgets = sorted({*fp.values(), 2 * max(fp.values())})
    chosen = [
        oa.plan_microbatches(
            _deep_loss,
            _DEEP_PARAMS,
            _DEEP_X,
            memory_budget=b,
            candidates=_COUNTS,
        )
        for b in budgets
    ]
    assert chosen == [min(c for c in _COUNTS if fp[c] <= b) for b in budgets]
    assert chosen[-1] == 1
    for n, b in zip(chosen, budgets, strict=True):
        assert fp[n] <= b
        assert all(fp[c] > b for c in _COUNTS if c < n)


def test_plan_microbatches_does_not_assume_footprints_shrink(monkeypatch):
    """Footprints that grow, then shrink, with the count (as XLA:GPU's
    temporaries did): the planner returns the smallest count that fits, not
    the first count after which every larger one fits."""
    from optaxaccum._src import microbatch

    fake = {1: 900, 2: 1000, 4: 300, 8: 700, 16: 200}
    monkeypatch.setattr(
        microbatch,
        "microbatched_step_memory",
        lambda *a, num_microbatches, **k: fake[num_microbatches],
    )
    x = jax.ShapeDtypeStruct((16, 3), jnp.float32)
    w = jax.ShapeDtypeStruct((3,), jnp.float32)
    plan = functools.partial(
        oa.plan_microbatches, _deep_loss, w, x, candidates=list(fake)
    )
    for budget, want in ((200, 16), (300, 4), (699, 4), (950, 1), (2000, 1)):
        assert plan(memory_budget=budget) == want, budget
    with pytest.raises(ValueError, match="199"):
        plan(memory_budget=199)


def test_plan_microbatches_impossible_budget_raises():
    fp4 = _footprint(_deep_memory()[4])
    with pytest.raises(
        ValueError, match=rf"memory_budget={fp4 - 1} .*is {fp4} bytes"
    ):
        oa.plan_microbatches(
            _deep_loss,
            _DEEP_PARAMS,
            _DEEP_X,
            memory_budget=fp4 - 1,
            candidates=[2, 4],
        )


def test_plan_microbatches_default_candidates_and_kwargs():
    """All divisors of the batch size; kwargs reach the step (has_aux)."""
    params, batch = helpers.mlp_params(), _batch(n=4)
    assert (
        oa.plan_microbatches(
            _loss_aux, params, batch, memory_budget=2**40, has_aux=True
        )
        == 1
    )
    with pytest.raises(ValueError, match=r"tried \[1, 2, 4\]"):
        oa.plan_microbatches(_loss, params, batch, memory_budget=1)


@pytest.mark.parametrize(
    "budget, error",
    [
        (0, ValueError),
        (-1.0, ValueError),
        (math.inf, ValueError),
        (math.nan, ValueError),
        ("1e9", TypeError),
        (True, TypeError),
    ],
)
def test_plan_microbatches_validates_memory_budget(budget, error):
    with pytest.raises(error, match="memory_budget"):
        oa.plan_microbatches(
            _loss, helpers.mlp_params(), _batch(), memory_budget=budget
        )


def test_plan_microbatches_validates_candidates():
    with pytest.raises(ValueError, match="not divisible"):
        oa.plan_microbatches(
            _loss,
            helpers.mlp_params(),
            _batch(),
            memory_budget=1e9,
            candidates=[3],
        )
    with pytest.raises(ValueError, match="num_microbatches|candidates"):
        oa.plan_microbatches(
            _loss,
            helpers.mlp_params(),
            _batch(),
            memory_budget=1e9,
            candidates=[0],
        )


def test_microbatched_value_and_grad_validates_interleave():
    with pytest.raises(TypeError, match="interleave=1"):
        oa.microbatched_value_and_grad(_loss, 2, interleave=1)


@pytest.mark.devices(4)
def test_weight_fn_under_shard_map_needs_varying_params():
    """Replicated params: the gradient is already summed over the devices
    and a per-device weight cannot apply to it -- a clear error. Varying
    params and psum(W * g) / psum(W): the global per-token mean."""
    mesh = _mesh4()
    params, batch = helpers.mlp_params(), _batch(n=32)
    mask = np.ones(32)
    mask[[1, 2, 9, 17, 18, 19, 30]] = 0  # unequal real counts per device
    batch["mask"] = jnp.asarray(mask, jnp.float32)
    f = oa.microbatched_value_and_grad(_masked_loss, 2, weight_fn=_mask_weight)
    specs = dict(mesh=mesh, in_specs=(P(), P("data")), out_specs=P())
    ref_loss, ref_grads = jax.value_and_grad(_masked_loss)(params, batch)
    params = jax.device_put(params, NamedSharding(mesh, P()))
    batch = jax.device_put(batch, NamedSharding(mesh, P("data")))

    with pytest.raises(ValueError, match="pcast"):
        jax.jit(
            jax.shard_map(lambda p, b: jax.lax.pmean(f(p, b), "data"), **specs)
        )(params, batch)

    def step(p, b):
        p = jax.lax.pcast(p, "data", to="varying")
        loss, grads = f(p, b)
        w = _mask_weight(b)
        total = jax.lax.psum(w, "data")
        return jax.tree.map(
            lambda x: jax.lax.psum(w * x, "data") / total, (loss, grads)
        )

    loss, grads = jax.jit(jax.shard_map(step, **specs))(params, batch)
    chex.assert_trees_all_close(loss, ref_loss, **TOL[jnp.float32])
    chex.assert_trees_all_close(grads, ref_grads, **TOL[jnp.float32])
