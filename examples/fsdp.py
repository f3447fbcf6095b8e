"""FSDP + data parallelism under ``jax.jit``: one data reduction per window.

Trains a small MLP classifier on scikit-learn's digits (bundled, no download)
on a ``("data", "fsdp")`` mesh of 8 devices with explicit sharding: every
weight is sharded over ``fsdp`` (each device holds a quarter of it), each
micro-batch over both axes. The step

    loss, grads = oa.unreduced_value_and_grad(loss_fn, "data")(params, ...)
    params, state = oa.apply_gradients(tx, grads, state, params,
                                       accum_weight=num_real_examples)

with ``tx = oa.chain(oa.accumulate(k, axis_name="data"), optax.adam(lr))``
leaves the gradients *unreduced* over ``data`` (each data-parallel group
holds its partial sum); the accumulator (sharded like the params) adds them
locally and reduces over ``data`` once, when the window closes. The script
prints the collectives of the compiled step per window next to those of the
naive way (``jax.value_and_grad`` + ``oa.accumulate``), which reduces every
micro-batch's gradient over ``data``.

The forward pass gathers each weight with ``gather`` below: a weight that
arrives reduced over ``data`` must stay reduced (over every batch axis) when
gathered, or JAX reduces its gradient in the backward pass after all (see
docs/scaling.md).

Then it compiles the same model's in-step variant: one jitted step of
``k`` micro-batches (``oa.microbatched_value_and_grad``), with and without
``gather_once=oa.GatherOnce(("data", "fsdp"))``, and prints the weights'
all-gathers and reduce-scatters per step (those inside the scan's loop run
once per micro-batch) and the step's per-device memory: held, each weight
is gathered once before the micro-batches and its gradient reduce-scattered
once after them.

On CPU the script asks XLA for 8 host devices (unless ``XLA_FLAGS`` sets a
count). Run: ``python examples/fsdp.py [--steps 80] [--accum 4]``.
"""

from _mesh import ask_for_host_devices, census_line, training_parser

ask_for_host_devices()  # before JAX starts its CPU backend

import functools  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from _digits import init_mlp, load_data  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import optaxaccum as oa  # noqa: E402

BATCH_AXES = ("data", "fsdp")


def gather(w):
    """All-gathers an fsdp-sharded leaf for the forward pass. Reduced over
    ``data`` (from ``oa.unreduced_value_and_grad``), ``oa.fsdp_gather``
    keeps it reduced over both batch axes, so its gradient is
    reduce-scattered over ``fsdp`` but stays unreduced over ``data``."""
    if jax.typeof(w).sharding.spec.reduced:
        return oa.fsdp_gather(w, BATCH_AXES)
    return jax.reshard(w, P(*(None,) * w.ndim))


def logits_fn(params, x):
    for i, layer in enumerate(params):
        x = x @ gather(layer["w"])
        # A reduced bias is broadcast to the activations' sharding (JAX
        # rejects an elementwise op of a reduced and a sharded operand).
        b = jnp.broadcast_to(gather(layer["b"]), x.shape)
        x = x + jax.reshard(b, jax.typeof(x).sharding.spec)
        if i < len(params) - 1:
            x = jax.nn.relu(x)
    return x


def loss_fn(params, x, y, mask):
    """Mean cross-entropy over the micro-batch's real (mask == 1) examples."""
    losses = optax.softmax_cross_entropy_with_integer_labels(
        logits_fn(params, x), y
    )
    return (mask * losses).sum() / jnp.maximum(mask.sum(), 1.0)


def make_step(tx, ours):
    grad_fn = (
        oa.unreduced_value_and_grad(loss_fn, "data")
        if ours
        else jax.value_and_grad(loss_fn)
    )

    def step(params, state, x, y, mask):
        loss, grads = grad_fn(params, x, y, mask)
        params, state = oa.apply_gradients(
            tx, grads, state, params, accum_weight=mask.sum()
        )
        return params, state, loss

    return jax.jit(step, donate_argnums=(0, 1))


def census_per_window(compiled, mesh, k):
    """(ops, bytes) per window of the collectives over ``data`` that carry
    more than a few scalars: every call's k times, the closing branch's
    once."""
    ops = [
        o
        for o in oa.collective_census(compiled, mesh)
        if "data" in o["axes"] and o["bytes"] > 64
    ]
    runs = [k if not o["branches"] else 1 for o in ops]
    return sum(runs), sum(r * o["bytes"] for r, o in zip(runs, ops))


def gather_once_report(mesh, params, batch, k):
    """Prints, for one jitted step of ``k`` in-step micro-batches with and
    without ``oa.GatherOnce``, the weights' all-gathers and reduce-scatters
    per step (in the scan's loop: once per micro-batch) and the step's
    per-device memory (argument + output - alias + temp bytes)."""
    print(f"in-step, {k} micro-batches: weight collectives per step, memory")
    for name, hold in (
        ("default", None),
        ("gather_once", oa.GatherOnce(BATCH_AXES)),
    ):
        micro = functools.partial(
            oa.microbatched_value_and_grad,
            num_microbatches=k,
            batch_argnums=(1, 2, 3),
            interleave=True,
            weight_fn=lambda b: b[2].sum(),
            gather_once=hold,
        )
        f = oa.unreduced_value_and_grad(loss_fn, "data", value_and_grad=micro)
        compiled = jax.jit(f).lower(params, *batch).compile()
        print(f"  {name:12s} {census_line(compiled, mesh, k)}")


def main(argv=None):
    parser = training_parser(
        __doc__.split("\n")[0],
        steps=80,
        batch=64,
        batch_help="examples per micro-batch (all devices)",
        hidden=128,
    )
    args = parser.parse_args(argv)

    mesh = jax.make_mesh(
        (2, 4),
        BATCH_AXES,
        axis_types=(AxisType.Explicit,) * 2,
        devices=jax.devices()[:8],
    )
    print(
        f"mesh data=2 x fsdp=4 of {mesh.devices.size} "
        f"{jax.devices()[0].platform} devices; window of {args.accum} "
        f"micro-batches of {args.batch} examples"
    )
    x_all, y_all, _, _ = load_data(images=False)
    rng = np.random.default_rng(0)
    batch_sharding = NamedSharding(mesh, P(BATCH_AXES))

    def put_params(params):
        def put(a):  # first axis over fsdp where it divides evenly
            spec = P("fsdp") if a.shape[0] % mesh.shape["fsdp"] == 0 else P()
            return jax.device_put(a, NamedSharding(mesh, spec))

        return jax.tree.map(put, params)

    def micro_batch():
        idx = rng.choice(len(x_all), args.batch, replace=False)
        # Ragged: a random number of real examples; the weights make the
        # window's gradient the exact mean over all its real examples.
        keep = rng.integers(args.batch // 2, args.batch + 1)
        mask = (np.arange(args.batch) < keep).astype(np.float32)
        return [
            jax.device_put(a, batch_sharding)
            for a in (x_all[idx], y_all[idx], mask)
        ]

    sizes = [64, args.hidden, 10]
    with jax.set_mesh(mesh):
        print(f"{'':28s}{'data-axis reductions / window':>32s}")
        for name, ours, axis in (
            ("naive jit", False, None),
            ("oa.unreduced_value_and_grad", True, "data"),
        ):
            tx = oa.chain(
                oa.accumulate(args.accum, axis_name=axis), optax.adam(args.lr)
            )
            params = put_params(init_mlp(jax.random.key(0), sizes))
            state = jax.jit(tx.init)(params)
            step = make_step(tx, ours)
            compiled = step.lower(params, state, *micro_batch()).compile()
            n, nbytes = census_per_window(compiled, mesh, args.accum)
            print(f"  {name:28s}{n:8d} ops {nbytes / 1024:10.1f} KiB")
        batches = [micro_batch() for _ in range(args.accum)]
        gather_once_report(
            mesh,
            params,
            [jnp.concatenate(parts) for parts in zip(*batches, strict=True)],
            args.accum,
        )
        losses = []
        for _ in range(args.steps):
            params, state, loss = step(params, state, *micro_batch())
            losses.append(float(loss))
        x_replicated = jax.device_put(x_all, NamedSharding(mesh, P()))
        logits = jax.jit(logits_fn)(params, x_replicated)
    acc = state[0].acc[0]["w"]  # one row per device's partial sum
    print(
        f"accumulator w0: {jax.typeof(acc)} (stacked over data), "
        f"{acc.addressable_shards[0].data.nbytes} of {acc.nbytes} bytes "
        "per device"
    )
    accuracy = float(jnp.mean(jnp.argmax(logits, -1) == y_all))
    print(f"optimizer steps {int(state[0].gradient_step)}")
    print(
        f"final loss {np.mean(losses[-args.accum :]):.4f}  "
        f"train accuracy {accuracy:.3f}"
    )


if __name__ == "__main__":
    main()
