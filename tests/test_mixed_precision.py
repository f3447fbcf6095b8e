"""``oa.mixed_precision_dot_general``: bfloat16 products, float32 weight
gradients straight out of the GEMM.

References: ``jax.lax.dot_general`` (``compute_dtype=float32``, and the
float32 GEMM of the bfloat16-rounded operands and cotangent), a float64
NumPy forward and backward pass (accuracy, against flax's own bfloat16
path), the big-batch step (a window of ``oa.accumulate``, in-step
microbatching), a Python loop (``vmap``) and one device (explicit meshes).
"""

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import optaxaccum as oa
from optaxaccum._src import sharding

BF16 = jnp.bfloat16
MATMUL = (((1,), (0,)), ((), ()))
# (lhs shape, rhs shape, dimension_numbers): a dense layer, a contraction
# over the lhs's first axis (a weight gradient's), two contracting axes
# paired out of order with a batch axis, and two batch axes in other
# places on each side.
DIMS = {
    "matmul": ((8, 4), (4, 3), MATMUL),
    "lhs transposed": ((4, 8), (4, 3), (((0,), (0,)), ((), ()))),
    "two contracting, batch": (
        (2, 5, 3, 4),
        (4, 2, 6, 3),
        (((2, 3), (3, 0)), ((0,), (1,))),
    ),
    "two batch": ((5, 2, 7, 3), (3, 6, 5, 2), (((3,), (0,)), ((1, 0), (3, 2)))),
}
JITS = {"eager": lambda f: f, "jit": jax.jit}


def _operands(name, seed=0):
    ls, rs, dims = DIMS[name]
    rng = np.random.default_rng(seed)
    lhs = jnp.asarray(rng.normal(size=ls), jnp.float32)
    rhs = jnp.asarray(rng.normal(size=rs), jnp.float32)
    return lhs, rhs, dims


def _weights(shape):
    """A fixed cotangent (not all ones: a mixed-up axis shows)."""
    return jnp.cos(jnp.arange(np.prod(shape), dtype=jnp.float32)).reshape(shape)


def _vjp(dot, lhs, rhs, dims):
    out, vjp = jax.vjp(lambda a, b: dot(a, b, dims), lhs, rhs)
    return out, vjp(_weights(out.shape))


def _rounded(x):
    return x.astype(BF16).astype(jnp.float32)


@pytest.mark.parametrize("jit", list(JITS))
@pytest.mark.parametrize("name", list(DIMS))
def test_float32_compute_is_lax_dot_general(name, jit):
    lhs, rhs, dims = _operands(name)
    dot = oa.mixed_precision_dot_general(jnp.float32)
    got = JITS[jit](lambda a, b: _vjp(dot, a, b, dims))(lhs, rhs)
    want = JITS[jit](lambda a, b: _vjp(jax.lax.dot_general, a, b, dims))(
        lhs, rhs
    )
    chex.assert_trees_all_equal(got, want)


@pytest.mark.parametrize("jit", list(JITS))
@pytest.mark.parametrize("name", list(DIMS))
def test_bf16_gradients_are_float32_gemms_of_rounded_operands(name, jit):
    """The output and each cotangent are the float32 products of the
    bfloat16-rounded operands and cotangent: float32, never rounded to
    bfloat16 on the way."""
    lhs, rhs, dims = _operands(name)
    dot = oa.mixed_precision_dot_general()
    out, grads = JITS[jit](lambda a, b: _vjp(dot, a, b, dims))(lhs, rhs)
    want_out, vjp = jax.vjp(
        lambda a, b: jax.lax.dot_general(a, b, dims),
        _rounded(lhs),
        _rounded(rhs),
    )
    want = vjp(_rounded(_weights(out.shape)))
    chex.assert_trees_all_equal_dtypes((out, *grads), (lhs, lhs, rhs))
    for got, ref in zip((out, *grads), (want_out, *want), strict=True):
        scale = float(jnp.abs(ref).max())
        np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6 * scale)


def test_products_accumulate_in_float32():
    """257 is no bfloat16 number: a sum of 257 ones accumulated in
    bfloat16 stops at 256."""
    ones = jnp.ones((1, 257))
    dot = oa.mixed_precision_dot_general()
    assert float(dot(ones, ones.T, MATMUL)[0, 0]) == 257.0
    low = dot(ones, ones.T, MATMUL, preferred_element_type=BF16)
    assert low.dtype == BF16 and float(low[0, 0]) == 256.0


def test_dtypes_of_mixed_operands():
    """A bfloat16 activation with a float32 weight: the output is float32
    (the wider), each cotangent has its operand's dtype."""
    x, w = jnp.ones((8, 4), BF16), jnp.full((4, 3), 0.5)
    dot = oa.mixed_precision_dot_general()
    out, (dx, dw) = _vjp(dot, x, w, MATMUL)
    assert (out.dtype, dx.dtype, dw.dtype) == (jnp.float32, BF16, jnp.float32)
    assert dot(x, x.T, MATMUL).dtype == BF16
    assert dot(x, w.astype(jnp.float16), MATMUL).dtype == jnp.float32


def test_float16_compute_and_strict_promotion():
    lhs, rhs, dims = _operands("two contracting, batch")
    dot = oa.mixed_precision_dot_general(jnp.float16)
    with jax.numpy_dtype_promotion("strict"):
        out, (dl, dr) = jax.jit(lambda a, b: _vjp(dot, a, b, dims))(lhs, rhs)
    half = lambda x: x.astype(jnp.float16).astype(jnp.float32)  # noqa: E731
    want = jax.lax.dot_general(half(lhs), half(rhs), dims)
    np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-5)
    assert dl.dtype == dr.dtype == jnp.float32


@pytest.mark.parametrize("bad", [jnp.int32, jnp.bool_, jnp.complex64])
def test_non_floating_compute_dtype_raises(bad):
    with pytest.raises(ValueError, match="compute_dtype"):
        oa.mixed_precision_dot_general(bad)


@pytest.mark.parametrize("bad", ["not a dtype", object()])
def test_compute_dtype_that_is_no_dtype_raises(bad):
    with pytest.raises(TypeError, match="compute_dtype"):
        oa.mixed_precision_dot_general(bad)


def test_integer_operands_raise():
    dot = oa.mixed_precision_dot_general()
    with pytest.raises(TypeError, match="lhs.dtype=int32"):
        dot(jnp.ones((2, 3), jnp.int32), jnp.ones((3, 2)), MATMUL)
    with pytest.raises(TypeError, match="preferred_element_type"):
        dot(jnp.ones((2, 3)), jnp.ones((3, 2)), MATMUL, None, jnp.int32)


# ----------------------------------------------------------- accuracy

D_IN, HIDDEN, D_OUT, ROWS = 32, 48, 8, 64


def _mlp_data(seed=0):
    rng = np.random.default_rng(seed)
    params = {
        "w1": rng.normal(size=(D_IN, HIDDEN)) / np.sqrt(D_IN),
        "w2": rng.normal(size=(HIDDEN, D_OUT)) / np.sqrt(HIDDEN),
    }
    params = {k: v.astype(np.float32) for k, v in params.items()}
    x = rng.normal(size=(ROWS, D_IN)).astype(np.float32)
    y = rng.normal(size=(ROWS, D_OUT)).astype(np.float32)
    return params, x, y


def _float64_grads(params, x, y):
    """The gradient of the mean squared error of ``tanh(x w1) w2``, by
    hand in float64."""
    w1, w2 = (np.float64(params[k]) for k in ("w1", "w2"))
    x, y = np.float64(x), np.float64(y)
    h = np.tanh(x @ w1)
    d_out = 2 * (h @ w2 - y) / y.size
    d_pre = (d_out @ w2.T) * (1 - h**2)
    return {"w1": x.T @ d_pre, "w2": h.T @ d_out}


class _NnxMLP(nnx.Module):
    def __init__(self, params, **linear):
        self.l1 = nnx.Linear(
            D_IN, HIDDEN, use_bias=False, rngs=nnx.Rngs(0), **linear
        )
        self.l2 = nnx.Linear(
            HIDDEN, D_OUT, use_bias=False, rngs=nnx.Rngs(0), **linear
        )
        self.l1.kernel[...] = params["w1"]
        self.l2.kernel[...] = params["w2"]

    def __call__(self, x):
        return self.l2(jnp.tanh(self.l1(x)))


def _nnx_grads(params, x, y, **linear):
    def loss(model):
        return jnp.mean((model(x).astype(jnp.float32) - y) ** 2)

    @jax.jit
    def grads_of(params):
        grads = nnx.grad(loss)(_NnxMLP(params, **linear))
        return {"w1": grads.l1.kernel[...], "w2": grads.l2.kernel[...]}

    return grads_of(params)


def _relative_error(got, want):
    return float(np.linalg.norm(np.float64(got) - want) / np.linalg.norm(want))


def test_closer_to_float64_than_flax_bfloat16():
    """Float32 master weights: the weight gradients of an nnx MLP through
    the mixed dot (``dtype=None``) are closer to the float64 gradient
    than those of the same model computing in bfloat16 (``dtype=bfloat16``,
    flax's bfloat16 path), and float32."""
    params, x, y = _mlp_data()
    exact = _float64_grads(params, x, y)
    dot = oa.mixed_precision_dot_general()
    mixed = _nnx_grads(params, x, y, dot_general=dot)
    stock = _nnx_grads(params, x, y, dtype=BF16)
    for k in exact:
        assert mixed[k].dtype == jnp.float32
        err, stock_err = (
            _relative_error(g[k], exact[k]) for g in (mixed, stock)
        )
        assert err <= stock_err, (k, err, stock_err)
        assert err < 1e-2, (k, err)


# ------------------------------------------------------------- flax


def test_flax_linen_dense_and_dense_general():
    """As ``dot_general=`` of ``nn.Dense``/``nn.DenseGeneral`` (float32
    params, ``dtype=None``): the layer's output and gradients are those of
    the plain dot with the layer's kernel."""
    dot = oa.mixed_precision_dot_general()
    x = jnp.asarray(np.random.default_rng(0).normal(size=(6, 4, 5)))
    layers = {
        "dense": (nn.Dense(3, use_bias=False, dot_general=dot), (((2,), (0,)))),
        "general": (
            nn.DenseGeneral(
                (3, 2), axis=(-2, -1), use_bias=False, dot_general=dot
            ),
            (((1, 2), (0, 1))),
        ),
    }
    for layer, contract in layers.values():
        params = layer.init(jax.random.key(0), x)
        kernel = params["params"]["kernel"]
        assert kernel.dtype == jnp.float32

        def plain(k, x, contract=contract):
            return dot(x, k, (contract, ((), ())))

        out, g = jax.value_and_grad(lambda p: layer.apply(p, x).sum())(params)
        want, g_want = jax.value_and_grad(lambda k: plain(k, x).sum())(kernel)
        chex.assert_trees_all_equal(
            (out, g["params"]["kernel"]), (want, g_want)
        )


def test_flax_nnx_linear_and_linear_general():
    dot = oa.mixed_precision_dot_general()
    x = jnp.asarray(np.random.default_rng(0).normal(size=(6, 4, 5)))
    layers = {
        "linear": (
            nnx.Linear(5, 3, use_bias=False, dot_general=dot, rngs=nnx.Rngs(0)),
            ((2,), (0,)),
        ),
        "general": (
            nnx.LinearGeneral(
                (4, 5),
                (3, 2),
                axis=(-2, -1),
                use_bias=False,
                dot_general=dot,
                rngs=nnx.Rngs(0),
            ),
            ((1, 2), (0, 1)),
        ),
    }
    for layer, contract in layers.values():
        kernel = layer.kernel[...]
        assert kernel.dtype == jnp.float32
        out = layer(x).sum()
        grads = nnx.grad(lambda m: m(x).sum())(layer)
        want, g_want = jax.value_and_grad(
            lambda k, contract=contract: dot(x, k, (contract, ((), ()))).sum()
        )(kernel)
        chex.assert_trees_all_equal((out, grads.kernel[...]), (want, g_want))


# ------------------------------------------------------ transformations


def _mlp_loss(dot):
    def loss(params, x, y):
        h = jnp.tanh(dot(x, params["w1"], MATMUL))
        return jnp.mean((dot(h, params["w2"], MATMUL) - y) ** 2)

    return loss


def _integer_data(seed=0):
    """A linear model whose every product and sum is exact in float32 and
    every value a bfloat16 number: small integers, scaled by powers of 2."""
    rng = np.random.default_rng(seed)
    w = {"w": rng.integers(-4, 5, size=(D_IN, D_OUT)) / 4}
    x = rng.integers(-4, 5, size=(ROWS, D_IN)) / 2
    y = rng.integers(-8, 9, size=(ROWS, D_OUT)) / 1
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    return jax.tree.map(f32, w), f32(x), f32(y)


def test_window_of_micro_batches_equals_the_big_batch():
    """``oa.chain(oa.accumulate(4), adam)`` fed the float32 gradients of
    four micro-batches takes the step adam takes on their concatenation:
    the window's gradient is the big batch's exactly (every value here is
    exact in bfloat16 and float32), the step to float32 rounding."""
    dot = oa.mixed_precision_dot_general()
    params, x, y = _integer_data()

    def loss(p, x, y):
        return jnp.mean((dot(x, p["w"], MATMUL) - y) ** 2)

    tx = oa.chain(oa.accumulate(4), optax.adam(0.1))
    acc = oa.accumulate(4)
    state, acc_state, p = tx.init(params), acc.init(params), params
    step = jax.jit(
        lambda p, s, x, y: oa.apply_gradients(tx, jax.grad(loss)(p, x, y), s, p)
    )
    for xs, ys in zip(jnp.split(x, 4), jnp.split(y, 4), strict=True):
        window, acc_state = acc.update(
            jax.grad(loss)(params, xs, ys), acc_state
        )
        p, state = step(p, state, xs, ys)
    big = jax.grad(loss)(params, x, y)
    chex.assert_trees_all_equal(window, big)
    ref = optax.adam(0.1)
    updates, _ = ref.update(big, ref.init(params), params)
    want = optax.apply_updates(params, updates)
    chex.assert_trees_all_close(p, want, rtol=1e-6, atol=1e-7)


def test_window_of_an_mlp_equals_the_big_batch_gradient():
    dot = oa.mixed_precision_dot_general()
    params, x, y = _mlp_data()
    loss = _mlp_loss(dot)
    acc = oa.accumulate(4)
    state = acc.init(params)
    for xs, ys in zip(jnp.split(x, 4), jnp.split(y, 4), strict=True):
        window, state = acc.update(jax.grad(loss)(params, xs, ys), state)
    want = jax.grad(loss)(params, x, y)
    chex.assert_trees_all_close(window, want, rtol=2e-5, atol=2e-7)


def test_microbatched_value_and_grad():
    dot = oa.mixed_precision_dot_general()
    params, x, y = _mlp_data()
    loss = _mlp_loss(dot)
    got = jax.jit(
        oa.microbatched_value_and_grad(loss, 4, batch_argnums=(1, 2))
    )(params, x, y)
    want = jax.jit(jax.value_and_grad(loss))(params, x, y)
    chex.assert_trees_all_equal_dtypes(got, want)
    chex.assert_trees_all_close(got, want, rtol=2e-5, atol=2e-7)


def test_vmap_per_example_gradients():
    dot = oa.mixed_precision_dot_general()
    params, x, y = _mlp_data()
    loss = _mlp_loss(dot)
    one = lambda p, x, y: loss(p, x[None], y[None])  # noqa: E731
    got = jax.jit(jax.vmap(jax.grad(one), (None, 0, 0)))(params, x[:8], y[:8])
    grad_of_one = jax.jit(jax.grad(one))
    for i in range(8):
        want = grad_of_one(params, x[i], y[i])
        mine = jax.tree.map(lambda g, i=i: g[i], got)
        chex.assert_trees_all_close(mine, want, rtol=2e-5, atol=1e-7)


# ---------------------------------------------------------------- mesh


def _mesh():
    return jax.make_mesh(
        (2, 4),
        ("data", "fsdp"),
        axis_types=(AxisType.Explicit,) * 2,
        devices=jax.devices()[:8],
    )


BATCH = P(("data", "fsdp"))


def _gather(w):
    """The forward's whole weight; kept reduced over the batch axes when
    the gradient is left unreduced (as tests/test_mesh.py does)."""
    if jax.typeof(w).sharding.spec.reduced:
        return oa.fsdp_gather(w, ("data", "fsdp"))
    return jax.reshard(w, P(None, None))


def _mesh_loss(dot):
    def loss(params, x, y):
        params = {k: _gather(w) for k, w in params.items()}
        return _mlp_loss(dot)(params, x, y)

    return loss


@pytest.mark.devices(8)
@pytest.mark.parametrize("layout", ["replicated", "fsdp", "unreduced"])
def test_explicit_mesh_keeps_the_shardings(layout):
    """On a ``data=2 x fsdp=4`` mesh under ``jax.jit``, the batch sharded
    over both axes: each gradient has its weight's sharding (unreduced over
    ``data`` from ``oa.unreduced_value_and_grad``) and the value the single
    device computes."""
    dot = oa.mixed_precision_dot_general()
    params, x, y = _mlp_data()
    want = jax.jit(jax.grad(_mlp_loss(dot)))(params, x, y)
    spec = P(None, None) if layout == "replicated" else P("fsdp", None)
    loss, seen = _mesh_loss(dot), {}

    def grads_of(params, x, y):
        if layout != "unreduced":
            return jax.grad(loss)(params, x, y)
        _, g = oa.unreduced_value_and_grad(loss, "data")(params, x, y)
        seen.update(jax.tree.map(jax.typeof, g))
        unreduce = lambda g: jax.reshard(  # noqa: E731
            g, sharding.without_unreduced(jax.typeof(g).sharding.spec)
        )
        return jax.tree.map(unreduce, g)

    mesh = _mesh()
    with jax.set_mesh(mesh):
        put = lambda a, s: jax.device_put(a, s)  # noqa: E731
        p = {k: put(w, spec) for k, w in params.items()}
        got = jax.jit(grads_of)(p, put(x, BATCH), put(y, BATCH))
    for k, g in got.items():
        assert g.sharding.spec == spec, (k, g.sharding)
        if layout == "unreduced":
            assert seen[k].sharding.spec.unreduced == {"data"}, seen[k]
    chex.assert_trees_all_close(got, want, rtol=2e-5, atol=2e-7)


@pytest.mark.devices(8)
def test_shard_map_and_pmap_sum_a_replicated_weights_gradient():
    """Inside ``shard_map`` (vma checked) a replicated weight's gradient
    comes out summed over the devices, as through ``jax.lax.dot_general``;
    under ``pmap`` the per-device gradients are the local ones."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("data",))
    w = jnp.asarray(np.random.default_rng(0).normal(size=(4, 3)), jnp.float32)
    x = jnp.asarray(np.random.default_rng(1).normal(size=(16, 4)), jnp.float32)
    results = {}
    for name, dot in [
        ("lax", jax.lax.dot_general),
        ("mixed", oa.mixed_precision_dot_general(jnp.float32)),
    ]:

        def grad(w, x, dot=dot):
            return jax.grad(lambda w: (dot(x, w, MATMUL) ** 2).sum())(w)

        mapped = jax.shard_map(
            grad, mesh=mesh, in_specs=(P(), P("data")), out_specs=P()
        )
        local = jax.pmap(grad, in_axes=(None, 0))(w, x.reshape(8, 2, 4))
        results[name] = (jax.jit(mapped)(w, x), local)
    chex.assert_trees_all_close(
        results["mixed"], results["lax"], rtol=1e-6, atol=1e-6
    )
    chex.assert_trees_all_close(
        results["lax"][0], results["lax"][1].sum(0), rtol=1e-5, atol=1e-5
    )
