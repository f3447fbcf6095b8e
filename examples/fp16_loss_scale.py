"""float16 training with a dynamic loss scale and gradient accumulation.

An MLP learns scikit-learn's bundled digits with its parameters kept in
float32 and every computation (matmuls, activations, logits, the backward
pass) done in float16: the loss function casts the parameters and inputs to
float16. Small float16 gradients would underflow to zero, so the step
differentiates ``loss * scale`` (``oa.scaled_value_and_grad``) and

    oa.chain(oa.dynamic_loss_scale(period=...), oa.accumulate(4),
             optax.adam(lr))

unscales the gradients in float32. When a micro-batch's scaled gradients
overflow float16 (``inf``/``nan``), the loss scale drops that micro-batch --
Adam does not run and the accumulation window does not count it -- and halves
the scale; after ``period`` finite micro-batches in a row it doubles the
scale again. The script prints the loss going down and the scale adapting
(it grows until float16 overflows, then backs off), and at micro-step
``--poison-at`` it multiplies one micro-batch's loss by 1e30 (``inf`` in
float16) to show that step being skipped and training carrying on.

Run: ``python examples/fp16_loss_scale.py [--steps 1200] [--tiny]``.
"""

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _digits import init_mlp, load_data

import optaxaccum as oa

COMPUTE = jnp.float16


def logits_fn(params, x):
    """The MLP, computed in float16 from float32 parameters."""
    params = jax.tree.map(lambda p: p.astype(COMPUTE), params)
    x = x.astype(COMPUTE)
    for layer in params[:-1]:
        x = jax.nn.relu(x @ layer["w"] + layer["b"])
    return x @ params[-1]["w"] + params[-1]["b"]


def loss_fn(params, x, y, poison):
    """Mean cross-entropy, in float16; ``poison`` multiplies it (1 or 1e30,
    which is ``inf`` in float16)."""
    losses = optax.softmax_cross_entropy_with_integer_labels(
        logits_fn(params, x), y
    )
    return losses.mean() * poison.astype(COMPUTE)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--steps", type=int, default=1200, help="micro-steps (micro-batches)"
    )
    parser.add_argument("--accum", type=int, default=4)
    parser.add_argument(
        "--batch", type=int, default=32, help="examples per micro-batch"
    )
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument(
        "--period",
        type=int,
        default=100,
        help="finite micro-batches before the scale grows",
    )
    parser.add_argument(
        "--poison-at",
        type=int,
        default=None,
        help="micro-step whose loss is multiplied by 1e30 (default: half-way)",
    )
    parser.add_argument("--log-every", type=int, default=100)
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="a few dozen micro-steps (a smoke test)",
    )
    args = parser.parse_args(argv)
    if args.tiny:
        args.steps, args.period, args.log_every = 40, 8, 8
    poison_at = args.poison_at or args.steps // 2 + 3

    x_train, y_train, x_test, y_test = load_data(images=False)

    tx = oa.chain(
        oa.dynamic_loss_scale(period=args.period),
        oa.accumulate(args.accum),
        optax.adam(args.lr),
    )
    params = init_mlp(jax.random.key(0), [64, 128, 10])
    opt_state = tx.init(params)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def train_step(params, opt_state, x, y, poison):
        loss, grads = oa.scaled_value_and_grad(loss_fn, opt_state)(
            params, x, y, poison
        )
        new_params, new_state = oa.apply_gradients(tx, grads, opt_state, params)
        # Did the accumulation take this micro-batch into its window?
        old, new = opt_state[1], new_state[1]  # the AccumulateStates
        counted = (new.mini_step != old.mini_step) | (
            new.gradient_step != old.gradient_step
        )
        return new_params, new_state, loss, counted

    @jax.jit
    def accuracy(params, x, y):
        return jnp.mean(jnp.argmax(logits_fn(params, x), -1) == y)

    print(
        f"float16 compute, float32 params; micro-batches of {args.batch}, "
        f"windows of {args.accum}; loss scale period {args.period}"
    )
    print(
        f"{'micro-step':>10}  {'Adam steps':>10}  {'loss scale':>10}  "
        f"{'mean loss':>9}  {'dropped':>7}"
    )
    rng = np.random.default_rng(0)
    losses, dropped, recent_dropped = [], 0, 0
    for t in range(1, args.steps + 1):
        idx = rng.choice(len(x_train), args.batch, replace=False)
        poisoned = t == poison_at
        scale_before = float(oa.loss_scale(opt_state))
        position_before = int(opt_state[1].mini_step)
        params, opt_state, loss, counted = train_step(
            params,
            opt_state,
            x_train[idx],
            y_train[idx],
            np.float32(1e30 if poisoned else 1.0),
        )
        counted = bool(counted)
        dropped += not counted
        recent_dropped += not counted
        if np.isfinite(float(loss)):
            losses.append(float(loss))
        if poisoned:
            print(
                f"--> micro-step {t}: loss x 1e30 = {float(loss)} in "
                f"float16; dropped: {not counted} (window position "
                f"{position_before} -> {int(opt_state[1].mini_step)} of "
                f"{args.accum}: not counted, Adam not run), loss scale "
                f"{scale_before:.0f} -> "
                f"{float(oa.loss_scale(opt_state)):.0f}"
            )
        if t % args.log_every == 0:
            print(
                f"{t:>10}  {int(opt_state[1].gradient_step):>10}  "
                f"{float(oa.loss_scale(opt_state)):>10.0f}  "
                f"{np.mean(losses[-args.log_every :]):>9.4f}  "
                f"{recent_dropped:>7}"
            )
            recent_dropped = 0
    finite = all(bool(jnp.isfinite(p).all()) for p in jax.tree.leaves(params))
    acc = float(accuracy(params, x_test, y_test))
    print(
        f"done: {dropped} of {args.steps} micro-batches dropped by the loss "
        f"scale (the injected one and float16 overflows as the scale "
        f"grew); params finite: {finite}; test accuracy {acc:.4f}"
    )
    return acc


if __name__ == "__main__":
    main()
