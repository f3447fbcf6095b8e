"""Flax linen ``TrainState`` with the full chain: loss scale, AGC, accumulate.

A small CNN with an ``AccumBatchNorm`` layer learns scikit-learn's bundled
digits with ``optaxaccum.flax.TrainState`` and the chain

    oa.chain(oa.dynamic_loss_scale(), oa.agc(0.01), oa.accumulate(4),
             optax.adam(lr))

Each micro-batch's gradient is unscaled (an overflowing one would be dropped
and the scale halved), clipped unit-wise by AGC, and accumulated; Adam steps
once per window of 4 micro-batches. The step differentiates
``loss * scale`` with ``oa.scaled_value_and_grad(loss_fn, state.opt_state,
has_aux=True)``, which returns the *unscaled* loss for logging and passes the
model's new ``batch_stats`` through as ``aux``. The script prints the loss
scale as it grows (every ``--period`` finite micro-batches: this run computes
in float32, so nothing overflows; see ``fp16_loss_scale.py`` for overflows)
and the loss as it falls. At the end of every epoch ``TrainState.flush``
closes the partial window, for Adam and for the BatchNorm statistics.

Run: ``python examples/flax_trainstate.py [--epochs 8] [--tiny]``.
"""

import functools

import jax
import numpy as np
import optax
from _digits import CNN, accuracy, tiny_data, training_parser

import optaxaccum as oa
from optaxaccum.flax import TrainState

MICRO = 16
MOMENTUM = 0.9


def main(argv=None):
    parser = training_parser(__doc__.split("\n")[0], lr=3e-3)
    parser.add_argument(
        "--period",
        type=int,
        default=200,
        help="finite micro-batches before the scale grows",
    )
    parser.add_argument(
        "--log-every",
        type=int,
        default=100,
        help="micro-batches between log lines",
    )
    args = parser.parse_args(argv)
    epochs, (x_train, y_train, x_test, y_test) = tiny_data(args)
    log_every = 5 if args.tiny else args.log_every
    model = CNN(accum_steps=args.accum, momentum=MOMENTUM)
    variables = model.init(jax.random.key(0), x_train[:MICRO], train=False)
    tx = oa.chain(
        oa.dynamic_loss_scale(period=args.period),
        oa.agc(0.01),
        oa.accumulate(args.accum),
        optax.adam(args.lr),
    )
    state = TrainState.create(
        apply_fn=model.apply,
        params=variables["params"],
        tx=tx,
        batch_stats=variables["batch_stats"],
    )

    @functools.partial(jax.jit, donate_argnums=0)
    def train_step(state, x, y):
        def loss_fn(params):
            logits, updates = state.apply_fn(
                {"params": params, "batch_stats": state.batch_stats},
                x,
                train=True,
                mutable=["batch_stats"],
            )
            loss = optax.softmax_cross_entropy_with_integer_labels(
                logits, y
            ).mean()
            return loss, updates["batch_stats"]

        # Gradients of loss * scale (what the chain's loss scale unscales);
        # the loss returned is the unscaled one.
        (loss, batch_stats), grads = oa.scaled_value_and_grad(
            loss_fn, state.opt_state, has_aux=True
        )(state.params)
        state = state.apply_gradients(grads=grads, batch_stats=batch_stats)
        return state, loss

    # Closes Adam's window and BatchNorm's, with the layer's own momentum.
    flush = jax.jit(TrainState.flush, donate_argnums=0)

    n_micro = len(x_train) // MICRO
    print(
        f"{len(x_train)} training images, {n_micro} micro-batches of "
        f"{MICRO} per epoch, windows of {args.accum}; chain: "
        "dynamic_loss_scale -> agc -> accumulate -> adam"
    )
    print(
        f"{'micro-step':>10}  {'opt steps':>9}  {'loss scale':>10}  {'loss':>7}"
    )
    losses = []
    for epoch in range(epochs):
        perm = np.random.default_rng([0, epoch]).permutation(len(x_train))
        for i in range(n_micro):
            idx = perm[i * MICRO : (i + 1) * MICRO]
            state, loss = train_step(state, x_train[idx], y_train[idx])
            losses.append(loss)
            if int(state.step) % log_every == 0:
                acc_state = state.opt_state[2]  # the AccumulateState
                print(
                    f"{int(state.step):>10}  "
                    f"{int(acc_state.gradient_step):>9}  "
                    f"{float(oa.loss_scale(state.opt_state)):>10.0f}  "
                    f"{float(np.mean(losses[-log_every:])):>7.4f}"
                )
        state = flush(state)  # the epoch's last, partial window
        print(
            f"end of epoch {epoch + 1}: test accuracy "
            f"{float(accuracy(state, x_test, y_test)):.4f}"
        )
    final = float(np.mean(losses[-n_micro:]))
    print(
        f"final: loss scale {float(oa.loss_scale(state.opt_state)):.0f}, "
        f"last epoch's mean loss {final:.4f}"
    )
    return final


if __name__ == "__main__":
    main()
