"""Data-parallel training with gradient accumulation: one all-reduce per window.

Trains a small MLP classifier on scikit-learn's digits (bundled, no download)
over every device with ``jax.shard_map``. Each device computes the plain
*local* gradient of its own micro-batch -- no ``pmean`` in the step -- and

    oa.chain(oa.accumulate(k, axis_name="data"), optax.adam(lr))

sums those over ``k`` micro-batches and averages over the devices *once*,
when the window closes, weighting every micro-batch by its number of real
(unpadded) examples, so that the update is the gradient of the mean loss over
all the window's examples on all devices.

On CPU the script asks XLA for 8 host devices (unless ``XLA_FLAGS`` already
sets a count), so it shows 8-way data parallelism on a laptop; on GPUs it uses
however many there are.

Run: ``python examples/data_parallel.py [--steps 200] [--accum 4]``.
"""

from _mesh import ask_for_host_devices, training_parser

ask_for_host_devices()  # before JAX starts its CPU backend

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from _digits import init_mlp  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

import optaxaccum as oa  # noqa: E402

AXIS = "data"


def logits_fn(params, x):
    for layer in params[:-1]:
        x = jax.nn.relu(x @ layer["w"] + layer["b"])
    return x @ params[-1]["w"] + params[-1]["b"]


def loss_fn(params, x, y, mask):
    """Mean cross-entropy over this device's real (mask == 1) examples."""
    losses = optax.softmax_cross_entropy_with_integer_labels(
        logits_fn(params, x), y
    )
    return (mask * losses).sum() / jnp.maximum(mask.sum(), 1.0)


def main(argv=None):
    parser = training_parser(
        __doc__.split("\n")[0],
        steps=200,
        batch=16,
        batch_help="examples per device and micro-batch",
        hidden=64,
    )
    parser.add_argument("--log-every", type=int, default=50)
    args = parser.parse_args(argv)

    devices = jax.devices()
    n = len(devices)
    mesh = jax.make_mesh(
        (n,), (AXIS,), axis_types=(jax.sharding.AxisType.Explicit,)
    )
    print(
        f"{n} {devices[0].platform} device(s); window of {args.accum} "
        f"micro-batches of {n} x {args.batch} examples"
    )

    digits = load_digits()
    x_all = (digits.data / 16.0).astype(np.float32)
    y_all = digits.target.astype(np.int32)
    rng = np.random.default_rng(0)

    tx = oa.chain(
        oa.accumulate(args.accum, axis_name=AXIS), optax.adam(args.lr)
    )
    params = init_mlp(jax.random.key(0), [64, args.hidden, 10])
    # The state's accumulators get a leading device axis (one row per
    # device); everything else, like the params, is replicated.
    state = oa.map_accumulators(
        tx.init(params), lambda a: jnp.broadcast_to(a, (n, *a.shape))
    )
    state_specs = oa.map_accumulators(
        jax.tree.map(lambda _: P(), state), lambda _: P(AXIS)
    )

    def train_step(params, state, x, y, mask):
        state = oa.map_accumulators(state, lambda a: a[0])
        # Cast the replicated params to device-varying before differentiating:
        # the gradient then stays local (JAX would otherwise all-reduce the
        # gradient of a replicated input on every micro-batch).
        local = lax.pcast(params, AXIS, to="varying")
        loss, grads = jax.value_and_grad(loss_fn)(local, x, y, mask)
        params, state = oa.apply_gradients(
            tx, grads, state, params, accum_weight=mask.sum()
        )
        # For the log: the mean loss over all devices' real examples.
        count = mask.sum()
        mean_loss = lax.psum(loss * count, AXIS) / lax.psum(count, AXIS)
        state = oa.map_accumulators(state, lambda a: a[None])
        return params, state, mean_loss

    batch = P(AXIS)
    step = jax.jit(
        jax.shard_map(
            train_step,
            mesh=mesh,
            in_specs=(P(), state_specs, batch, batch, batch),
            out_specs=(P(), state_specs, P()),
        ),
        donate_argnums=(0, 1),
    )

    def put(tree, specs):
        return jax.tree.map(
            lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), tree, specs
        )

    params = put(params, jax.tree.map(lambda _: P(), params))
    state = put(state, state_specs)
    global_batch = n * args.batch
    losses = []
    for t in range(args.steps):
        idx = rng.choice(len(x_all), global_batch, replace=False)
        # Ragged micro-batches: each device keeps a random number of its
        # examples (as with padded sequences); the weights make it exact.
        keep = rng.integers(args.batch // 2, args.batch + 1, size=n)
        mask = (np.arange(args.batch) < keep[:, None]).reshape(-1)
        params, state, loss = step(
            params,
            state,
            *put(
                (x_all[idx], y_all[idx], mask.astype(np.float32)),
                (batch, batch, batch),
            ),
        )
        losses.append(float(loss))
        if (t + 1) % args.log_every == 0 or t + 1 == args.steps:
            windows = int(state[0].gradient_step)
            print(
                f"micro-step {t + 1:4d}  optimizer steps {windows:3d}  "
                f"loss {np.mean(losses[-args.log_every :]):.4f}"
            )
    accuracy = float(
        jnp.mean(jnp.argmax(logits_fn(params, x_all), -1) == y_all)
    )
    print(f"final loss {losses[-1]:.4f}  train accuracy {accuracy:.3f}")
    return losses[-1]


if __name__ == "__main__":
    main()
