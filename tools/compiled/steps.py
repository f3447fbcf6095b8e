"""The steps whose compiled programs are checked.

``GATED``: every gated path of ``tests/test_gpu_branch.py`` (a window's
optimizer step behind a gate), each as ``() -> (fn, args)``. ``TRAIN``: one
jitted train step computing the gradients and applying them through each
way of calling an accumulating optimizer, on a model from ``MODELS``, as
``model -> (fn, args, weight_counts)`` (the element counts of its dense
weights).
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import nnx

import optaxaccum as oa
from optaxaccum import flax as oa_flax
from optaxaccum.flax import nnx as oa_nnx

K = 4
ADAM = optax.adam(1e-3)
# Sizes kept apart: no activation has a weight's element count.
WIDTHS = (512, 768, 1024, 384)
ROWS = 256
# ``sqrt`` is Adam's (``mu / (sqrt(nu) + eps)``): the followers' work.
FOLLOWER_OPS = ("sqrt", "rsqrt")

CHAINS = {
    "accumulate": lambda: oa.chain(oa.accumulate(K), ADAM),
    "loss_scale": lambda: oa.chain(
        oa.dynamic_loss_scale(), oa.agc(0.01), oa.accumulate(K), ADAM
    ),
    "loss_scale_alone": lambda: oa.chain(oa.dynamic_loss_scale(), ADAM),
    "noise_scale": lambda: oa.chain(
        oa.accumulate(K, noise_scale_decay=0.9), ADAM
    ),
    "nested_in_optax": lambda: optax.chain(
        oa.agc(0.01), oa.chain(oa.accumulate(K), ADAM)
    ),
    "nested_gates": lambda: oa.chain(
        oa.accumulate(K), oa.chain(oa.accumulate(K), ADAM)
    ),
    "skip_nonfinite": lambda: oa.chain(
        oa.accumulate(K, skip_nonfinite=True), ADAM
    ),
    "MultiSteps": lambda: oa.MultiSteps(ADAM, K),
}


def _params():
    return {"w": jnp.ones((64, 128)), "b": jnp.zeros((128,))}


def _fused(name, **extra):
    tx = CHAINS[name]()

    def step(params, state, grads):
        return oa.apply_gradients(tx, grads, state, params, **extra)

    p = _params()
    return step, (p, tx.init(p), p)


def _plain(name):
    tx = CHAINS[name]()

    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    p = _params()
    return step, (p, tx.init(p), p)


def _flush():
    tx = CHAINS["accumulate"]()

    def step(params, state):
        return oa.flush(tx, state, params)

    p = _params()
    return step, (p, tx.init(p))


class _Dense(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(128)(x)


def _train_state():
    params = _Dense().init(jax.random.key(0), jnp.ones((1, 64)))["params"]
    state = oa_flax.TrainState.create(
        apply_fn=_Dense().apply, params=params, tx=CHAINS["accumulate"]()
    )
    return (lambda s, g: s.apply_gradients(grads=g)), (state, params)


def _nnx():
    model = nnx.Linear(64, 128, rngs=nnx.Rngs(0))
    opt = oa_nnx.Optimizer(model, CHAINS["accumulate"]())
    graphdef, state = nnx.split((model, opt))

    def step(state, grads):
        model, opt = nnx.merge(graphdef, state)
        opt.update(model, grads)
        return nnx.state((model, opt))

    return step, (state, nnx.state(model, nnx.Param))


def _cond_gate():
    """A gate written with ``flags.cond_or_call`` (the branch of the
    decisions inside a window's closing work, and of every gate on a mesh):
    Adam behind a ``lax.cond``."""
    from optaxaccum._src import flags

    p = _params()

    def step(params, state, grads, go):
        def opened():
            updates, new = ADAM.update(grads, state, params)
            return optax.apply_updates(params, updates), new

        return flags.cond_or_call(go, opened, lambda: (params, state))

    return step, (p, ADAM.init(p), p, jnp.bool_(False))


GATED = {
    **{f"fused {n}": (lambda n=n: _fused(n)) for n in CHAINS},
    **{f"plain {n}": (lambda n=n: _plain(n)) for n in CHAINS},
    "fused weighted": lambda: _fused("accumulate", accum_weight=3.0),
    "flush": _flush,
    "TrainState": _train_state,
    "nnx Optimizer": _nnx,
    "cond gate": _cond_gate,
}


class MLP(nnx.Module):
    """Dense layers of ``widths`` with tanh between them, computing in
    ``dtype`` (float32 weights)."""

    def __init__(self, rngs: nnx.Rngs, dtype=jnp.float32, widths=WIDTHS):
        pairs = zip(widths[:-1], widths[1:])
        self.layers = nnx.List(
            [nnx.Linear(a, b, dtype=dtype, rngs=rngs) for a, b in pairs]
        )

    def __call__(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x) if i == 0 else layer(jnp.tanh(x))
        return x


def _mlp(dtype=jnp.float32, widths=WIDTHS):
    model = MLP(nnx.Rngs(0), dtype, widths)
    x = jnp.zeros((ROWS, widths[0]))
    y = jnp.zeros((ROWS, widths[-1]))
    loss = lambda m, x, y: jnp.mean((m(x).astype(jnp.float32) - y) ** 2)  # noqa: E731
    return model, loss, (x, y)


def _load_example(name):
    """``examples/<name>.py`` as a module, importing its sibling helper
    modules (``_mesh``, ``_digits``) as the script does."""
    import importlib.util
    import pathlib
    import sys

    path = pathlib.Path(__file__).resolve().parents[2] / "examples"
    spec = importlib.util.spec_from_file_location(name, path / f"{name}.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.path.insert(0, str(path))
    try:
        spec.loader.exec_module(module)  # type: ignore[union-attr]
    finally:
        sys.path.remove(str(path))
    return module


def _transformer():
    lm = _load_example("transformer_lm")
    cfg = lm.Config(dim=512, heads=8, layers=1)
    model = lm.CharLM(cfg, nnx.Rngs(0))
    rows = 3  # activations of 3 x 96 tokens: no weight's element count
    x = jnp.ones((rows, cfg.context), jnp.int32)
    mask = jnp.ones((rows, cfg.context))

    def loss(*args):
        with jax.numpy_rank_promotion("allow"):  # the example broadcasts
            return lm.token_loss(*args)

    return model, loss, (x, x, mask)


MODELS = {
    "mlp": _mlp,
    "transformer": _transformer,
    # bfloat16 products: each weight's gradient is a bfloat16 GEMM output
    # converted to the float32 accumulator.
    "mlp_bf16": lambda: _mlp(jnp.bfloat16),
    # 100M float32 params (a 400 MB tree): past a TPU core's VMEM (128 MiB
    # on v5e), where XLA:TPU keeps a small model's params, state and
    # accumulator across the step and its HBM temporaries are not a big
    # model's. What XLA:TPU's temporaries are measured on.
    "mlp_wide": lambda: _mlp(widths=tuple(8 * w for w in WIDTHS)),
}


def dense_weight_shapes(model) -> set[tuple[int, ...]]:
    """The sorted dimensions of every matrix product's weight."""
    leaves = jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param))
    return {
        tuple(sorted(x.shape))
        for path, x in leaves
        if "kernel" in jax.tree_util.keystr(path)
    }


def dense_weight_counts(model) -> list[int]:
    """The element count of every matrix product's weight (a ``kernel``)."""
    leaves = jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param))
    return [
        int(x.size)
        for path, x in leaves
        if "kernel" in jax.tree_util.keystr(path)
    ]


def _adamw():
    return optax.adamw(1e-3, weight_decay=1e-4)


def _pure(model, loss, batch, make_tx, train_state=False):
    graphdef, params = nnx.split(model, nnx.Param)

    def loss_of(p, *batch):
        return loss(nnx.merge(graphdef, p), *batch)

    tx = make_tx()
    if train_state:
        state = oa_flax.TrainState.create(apply_fn=None, params=params, tx=tx)

        def ts_step(state, *batch):
            grads = jax.grad(loss_of)(state.params, *batch)
            return state.apply_gradients(grads=grads)

        return ts_step, (state, *batch)

    def step(params, opt_state, *batch):
        grads = jax.grad(loss_of)(params, *batch)
        return oa.apply_gradients(tx, grads, opt_state, params)

    return step, (params, tx.init(params), *batch)


def _weighted(model, loss, batch, make_tx, summed):
    """A train step whose window is weighted by a traced ``accum_weight``
    (a token count, an argument of the step): with ``summed`` the loss is
    summed over the rows (``oa.accumulate(..., summed_gradients=True)``),
    else their mean."""
    graphdef, params = nnx.split(model, nnx.Param)
    rows = jax.tree.leaves(batch)[0].shape[0]

    def loss_of(p, *batch):
        mean = loss(nnx.merge(graphdef, p), *batch)
        return mean * rows if summed else mean

    tx = make_tx()

    def step(params, opt_state, weight, *batch):
        grads = jax.grad(loss_of)(params, *batch)
        return oa.apply_gradients(
            tx, grads, opt_state, params, accum_weight=weight
        )

    return step, (params, tx.init(params), jnp.float32(rows), *batch)


def _nnx_train(model, loss, batch):
    opt = oa_nnx.Optimizer(model, oa.chain(oa.accumulate(K), _adamw()))
    graphdef, state = nnx.split((model, opt))

    def step(state, *batch):
        model, opt = nnx.merge(graphdef, state)
        grads = nnx.grad(loss)(model, *batch)
        opt.update(model, grads)
        return nnx.state((model, opt))

    return step, (state, *batch)


TRAIN = {
    "chain": lambda m, f, b: _pure(
        m, f, b, lambda: oa.chain(oa.accumulate(K), _adamw())
    ),
    "MultiSteps": lambda m, f, b: _pure(
        m, f, b, lambda: oa.MultiSteps(_adamw(), K)
    ),
    "TrainState": lambda m, f, b: _pure(
        m, f, b, lambda: oa.chain(oa.accumulate(K), _adamw()), True
    ),
    "nnx Optimizer": _nnx_train,
    "summed weighted": lambda m, f, b: _weighted(
        m,
        f,
        b,
        lambda: oa.chain(oa.accumulate(K, summed_gradients=True), _adamw()),
        summed=True,
    ),
    # The loss scale checked once per window: after the accumulate.
    "window loss_scale": lambda m, f, b: _pure(
        m,
        f,
        b,
        lambda: oa.chain(oa.accumulate(K), oa.dynamic_loss_scale(), _adamw()),
    ),
    # Non-finite windows dropped without a loss scale: optax's own gate.
    "apply_if_finite": lambda m, f, b: _pure(
        m,
        f,
        b,
        lambda: oa.chain(oa.accumulate(K), optax.apply_if_finite(_adamw(), 5)),
    ),
}
# Steps whose micro-step cannot be the GEMM's epilogue alone (a select or a
# multiply by a traced value in front of the add): docs/gpu.md names them.
TRAIN_OFF_FLOOR = {
    "mean weighted": lambda m, f, b: _weighted(
        m, f, b, lambda: oa.chain(oa.accumulate(K), _adamw()), summed=False
    ),
    "skip_nonfinite": lambda m, f, b: _pure(
        m,
        f,
        b,
        lambda: oa.chain(oa.accumulate(K, skip_nonfinite=True), _adamw()),
    ),
    "loss_scale": lambda m, f, b: _pure(
        m,
        f,
        b,
        lambda: oa.chain(oa.dynamic_loss_scale(), oa.accumulate(K), _adamw()),
    ),
}


# The optimizer alone in the same train step (no accumulation): what a
# train step's temporaries are measured against.
TRAIN_BASELINE = {
    "adamw": lambda m, f, b: _pure(m, f, b, _adamw),
}


def train_step(api: str, model: str):
    """``(fn, args, weight_counts, weight_shapes)`` of a train step of
    ``model`` through ``api``, with the first two arguments (params and
    state) donated by the caller. ``args`` are shapes: the model is built
    under ``jax.eval_shape``, so a 400 MB model costs no memory or init."""
    make = {**TRAIN, **TRAIN_OFF_FLOOR, **TRAIN_BASELINE}[api]
    built = {}

    def build():  # traced: the model and the state are never materialized
        m, loss, batch = MODELS[model]()
        built["counts"] = dense_weight_counts(m)
        built["shapes"] = dense_weight_shapes(m)
        built["fn"], args = make(m, loss, batch)
        return args

    args = jax.eval_shape(build)
    return built["fn"], args, built["counts"], built["shapes"]


@functools.cache
def weight_counts(model: str) -> tuple[int, ...]:
    """:func:`dense_weight_counts` of ``MODELS[model]``, built abstractly."""
    return tuple(
        dense_weight_counts(nnx.eval_shape(lambda: MODELS[model]()[0]))
    )


# The memory premises of the suite (tests/test_chain.py,
# tests/test_accumulate.py): 256 x 256 float32, params and state donated.
PREMISE_SHAPE = (256, 256)
TREE_BYTES = 256 * 256 * 4
# XLA:TPU's: 64 MiB float32, four of which (params, accumulator, Adam's
# two moments) are past a v5e core's 128 MiB VMEM (see "mlp_wide").
TPU_PREMISE_SHAPE = (4096, 4096)


def tree_bytes(shape=PREMISE_SHAPE) -> int:
    """The bytes of a premise's tree (one float32 leaf of ``shape``)."""
    return 4 * shape[0] * shape[1]


PREMISE_CHAINS = {
    "accumulate": lambda: oa.chain(oa.accumulate(4), ADAM),
    "loss_scale": lambda: oa.chain(
        oa.dynamic_loss_scale(), oa.accumulate(4), ADAM
    ),
    "eager_gate_own_chain": lambda: oa.chain(
        oa.chain(oa.dynamic_loss_scale()), oa.accumulate(4), ADAM
    ),
    "headline": lambda: oa.chain(
        oa.dynamic_loss_scale(), oa.agc(0.01), oa.accumulate(4), ADAM
    ),
    # Decided again inside the closing branch: the window's finiteness.
    "window_loss_scale": lambda: oa.chain(
        oa.accumulate(4), oa.dynamic_loss_scale(), ADAM
    ),
    "apply_if_finite": lambda: oa.chain(
        oa.accumulate(4), optax.apply_if_finite(ADAM, 5)
    ),
}


def premise_step(
    name: str, fused: bool = True, weighted: bool = False, shape=PREMISE_SHAPE
):
    """``(fn, args)`` of a premise's step on a ``shape`` leaf (donate
    arguments 0 and 1)."""
    tx = PREMISE_CHAINS[name]()
    params = {"w": jax.ShapeDtypeStruct(shape, jnp.float32)}
    args = (params, jax.eval_shape(tx.init, params), params)

    if fused and weighted:
        return (
            lambda p, s, g, w: oa.apply_gradients(tx, g, s, p, accum_weight=w)
        ), (*args, jnp.float32(1.0))
    if fused:
        return (lambda p, s, g: oa.apply_gradients(tx, g, s, p)), args

    def plain(p, s, g):
        updates, s = tx.update(g, s, p)
        return optax.apply_updates(p, updates), s

    return plain, args


# Gather once, hidden: examples/fsdp.py's model (64 -> 128 -> 10: w1, b1
# and w2 sharded over fsdp, b2 replicated), k = 4 interleaved, token-weighted
# micro-batches of 64 rows on data=2 x fsdp=4, gradients left unreduced over
# data; ``hold``: with oa.GatherOnce(("data", "fsdp")).
FSDP_K = 4
FSDP_SIZES = (64, 128, 10)
FSDP_ROWS = 64
# The per-jit options the hidden schedule is checked with (XLA:GPU): no
# combining of all-gathers or reduce-scatters (each held leaf's own can
# then start as soon as it is ready), and up to two collectives in flight.
GPU_OVERLAP_OPTIONS = {
    "xla_gpu_all_gather_combine_threshold_bytes": 0,
    "xla_gpu_reduce_scatter_combine_threshold_bytes": 0,
    "xla_gpu_experimental_parallel_collective_overlap_limit": 2,
}


def fsdp_step(devices, hold: bool, hidden: int = 128, rows: int = FSDP_ROWS):
    """``(fn, args, mesh)``: the step and its arguments as shapes placed on
    a ``data=2 x fsdp=4`` mesh of ``devices`` (8 of them); ``hidden``
    units, ``rows`` rows per micro-batch."""
    import functools

    import numpy as np
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    ex = _load_example("fsdp")
    mesh = jax.sharding.Mesh(
        np.array(devices).reshape(2, 4),
        ex.BATCH_AXES,
        axis_types=(AxisType.Explicit,) * 2,
    )

    def sds(shape, spec, dtype=jnp.float32):
        return jax.ShapeDtypeStruct(
            shape, dtype, sharding=NamedSharding(mesh, spec)
        )

    def leaf(shape):
        return sds(shape, P("fsdp") if shape[0] % 4 == 0 else P())

    sizes = (FSDP_SIZES[0], hidden, FSDP_SIZES[-1])
    pairs = zip(sizes[:-1], sizes[1:])
    params = [{"w": leaf((a, b)), "b": leaf((b,))} for a, b in pairs]
    n = rows * FSDP_K
    rows = P(ex.BATCH_AXES)
    batch = (
        sds((n, FSDP_SIZES[0]), rows),
        sds((n,), rows, jnp.int32),
        sds((n,), rows),
    )
    micro = functools.partial(
        oa.microbatched_value_and_grad,
        num_microbatches=FSDP_K,
        batch_argnums=(1, 2, 3),
        interleave=True,
        weight_fn=lambda b: b[2].sum(),
        gather_once=oa.GatherOnce(ex.BATCH_AXES) if hold else None,
    )
    fn = oa.unreduced_value_and_grad(ex.loss_fn, "data", value_and_grad=micro)
    return fn, (params, *batch), mesh


def fsdp_held_bytes() -> int:
    """Bytes of the smallest held leaf (b1): a weight-sized collective
    moves at least this many."""
    return 4 * FSDP_SIZES[1]
