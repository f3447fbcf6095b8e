"""``oa.flush``: the last, partial window of an epoch.

An epoch of 10 micro-batches with ``oa.accumulate(4)`` is two full windows
and a partial one of 2 micro-batches. Without a flush, those 2 micro-batches
stay in the accumulator: at the end of training they are never applied, and
in the next epoch they open a window that mixes them with 2 micro-batches of
the next epoch. ``oa.flush(tx, opt_state, params)`` closes the partial window
as if its last micro-batch had just arrived: it emits the mean of the 2
gradients actually seen (divided by 2, not by 4) and the optimizer steps
once more.

The script trains a softmax regression on scikit-learn's bundled digits with
``oa.chain(oa.accumulate(4), optax.sgd(lr, momentum=0.9))``, with and without
``oa.flush`` at the end of each epoch, and compares both with the big-batch
reference: plain ``optax.sgd`` on the windows themselves (batches of 64, 64
and 32 examples per epoch). It also checks the divisor of the flushed window
directly.

Run: ``python examples/flush_epoch.py [--epochs 3] [--tiny]``.
"""

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits
from sklearn.preprocessing import StandardScaler

import optaxaccum as oa

K = 4  # micro-batches per window
MICRO = 16  # examples per micro-batch
N_MICRO = 10  # micro-batches per epoch: windows of 4, 4 and 2


def loss_fn(params, x, y):
    logits = x @ params["w"] + params["b"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


grad_fn = jax.jit(jax.grad(loss_fn))


def distance(a, b):
    return float(optax.tree.norm(optax.tree.sub(a, b)))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument(
        "--tiny", action="store_true", help="a single epoch (a smoke test)"
    )
    args = parser.parse_args(argv)
    epochs = 1 if args.tiny else args.epochs

    digits = load_digits()
    n = N_MICRO * MICRO
    x = StandardScaler().fit_transform(digits.data[:n]).astype(np.float32)
    y = digits.target[:n].astype(np.int32)
    params0 = {"w": jnp.zeros((64, 10)), "b": jnp.zeros(10)}

    tx = oa.chain(oa.accumulate(K), optax.sgd(args.lr, momentum=0.9))

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, opt_state, xb, yb):
        grads = jax.grad(loss_fn)(params, xb, yb)
        return oa.apply_gradients(tx, grads, opt_state, params)

    @jax.jit
    def flush(params, opt_state):
        updates, opt_state = oa.flush(tx, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    ref_tx = optax.sgd(args.lr, momentum=0.9)

    @jax.jit
    def ref_step(params, opt_state, xb, yb):
        updates, opt_state = ref_tx.update(
            jax.grad(loss_fn)(params, xb, yb), opt_state, params
        )
        return optax.apply_updates(params, updates), opt_state

    print(
        f"an epoch: {N_MICRO} micro-batches of {MICRO} examples, "
        f"accumulate({K}) -> windows of 4, 4 and 2 micro-batches"
    )
    runs = {
        "big-batch reference": [params0, ref_tx.init(params0)],
        "with oa.flush": [params0, tx.init(params0)],
        "without flush": [params0, tx.init(params0)],
    }
    # Fresh copies: the jitted steps donate (consume) their inputs.
    for run in runs.values():
        run[:] = jax.tree.map(jnp.array, run)
    for epoch in range(epochs):
        perm = np.random.default_rng(epoch).permutation(n)
        xs, ys = x[perm], y[perm]
        # Reference: one SGD step per window, on the window's examples.
        ref = runs["big-batch reference"]
        for start in range(0, N_MICRO, K):
            sl = slice(start * MICRO, min(start + K, N_MICRO) * MICRO)
            ref[:] = ref_step(*ref, xs[sl], ys[sl])
        for name in ("with oa.flush", "without flush"):
            run = runs[name]
            for i in range(N_MICRO):
                sl = slice(i * MICRO, (i + 1) * MICRO)
                run[:] = step(*run, xs[sl], ys[sl])
            if name == "with oa.flush":
                run[:] = flush(*run)
        print(f"\nafter epoch {epoch + 1}:")
        print(
            f"  {'':<20}  {'SGD steps':>9}  {'left in window':>14}  "
            f"{'|params - reference|':>20}"
        )
        for name, (params, opt_state) in runs.items():
            if name == "big-batch reference":
                steps, pending = 3 * (epoch + 1), 0
            else:
                acc = opt_state[0]  # the AccumulateState
                steps, pending = int(acc.gradient_step), int(acc.mini_step)
            print(
                f"  {name:<20}  {steps:>9}  {pending:>14}  "
                f"{distance(params, ref[0]):>20.2e}"
            )

    # The divisor: flushing after micro-batches 8 and 9 emits their mean.
    acc = oa.accumulate(K)
    state = acc.init(params0)
    grads = [
        grad_fn(
            params0,
            x[i * MICRO : (i + 1) * MICRO],
            y[i * MICRO : (i + 1) * MICRO],
        )
        for i in (8, 9)
    ]
    for g in grads:
        _, state = acc.update(g, state, params0)
    flushed, state = oa.flush(acc, state, params0)
    total = optax.tree.add(*grads)
    print("\nthe flushed window of 2 micro-batches emits (g8 + g9) / 2:")
    print(
        f"  |flushed - (g8 + g9) / 2| = "
        f"{distance(flushed, optax.tree.scale(0.5, total)):.2e}"
    )
    print(
        f"  |flushed - (g8 + g9) / 4| = "
        f"{distance(flushed, optax.tree.scale(0.25, total)):.2e}"
        "   (the window length, 4, as divisor)"
    )
    params, _ = runs["with oa.flush"]
    return distance(params, runs["big-batch reference"][0])


if __name__ == "__main__":
    main()
