"""Token weighting: the exact per-token mean over micro-batches of varying
length.

A language model's loss is usually the mean over all *real* (unpadded)
target tokens of the batch. Split the batch into micro-batches and average
each micro-batch's own per-token mean, and every micro-batch counts equally,
however many tokens it holds: short sequences are over-weighted and the
gradient is not the one of the big batch. Weighting each micro-batch by its
number of real tokens,

    tx.update(grads_i, state, params, accum_weight=num_tokens_i)

makes ``oa.accumulate(k)`` emit the micro-batches' gradients averaged with
their token counts as weights, which *is* the gradient of the token mean
over the whole batch.

A tiny causal language model (token and position embeddings, one causal
self-attention layer, an MLP, a linear read-out) is given a batch of
synthetic sequences of random lengths, padded to a common length. The script
computes the gradient of the batch's token-mean loss four ways and prints how
far each is from the full-batch one:

* ``jax.value_and_grad`` on the whole batch (the reference);
* ``oa.accumulate(k)`` fed with each micro-batch's mean-loss gradient and
  ``accum_weight`` = its number of real tokens;
* ``oa.accumulate(k)`` without weights: the naive mean of micro-batch means;
* ``oa.microbatched_value_and_grad(loss_fn, k, weight_fn=...)`` (the same
  weighting, inside one jitted ``lax.scan``).

It then takes one Adam step with the weighted and the naive accumulation
and compares the parameters with one Adam step on the full batch.

Run: ``python examples/token_weighting.py [--batch 16] [--accum 4]``.
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optaxaccum as oa

PAD = 0


def make_batch(rng, batch, max_len, vocab):
    """Sequences ``start, start + d, start + 2d, ... (mod vocab)`` over
    tokens 1..vocab-1, of random lengths 2..max_len, padded with ``PAD``.

    Returns ``{"tokens": (batch, max_len) int32, "lengths": (batch,)}``.
    """
    lengths = rng.integers(2, max_len + 1, size=batch)
    start = rng.integers(0, vocab - 1, size=(batch, 1))
    step = rng.integers(1, 4, size=(batch, 1))
    tokens = 1 + (start + step * np.arange(max_len)) % (vocab - 1)
    tokens = np.where(np.arange(max_len) < lengths[:, None], tokens, PAD)
    return {
        "tokens": tokens.astype(np.int32),
        "lengths": lengths.astype(np.int32),
    }


def init_params(key, vocab, max_len, dim):
    ks = jax.random.split(key, 8)

    def dense(k, a, b):
        return jax.random.normal(k, (a, b)) / np.sqrt(a)

    return {
        "embed": 0.5 * jax.random.normal(ks[0], (vocab, dim)),
        "pos": 0.1 * jax.random.normal(ks[1], (max_len, dim)),
        "wq": dense(ks[2], dim, dim),
        "wk": dense(ks[3], dim, dim),
        "wv": dense(ks[4], dim, dim),
        "w1": dense(ks[5], dim, 4 * dim),
        "w2": dense(ks[6], 4 * dim, dim),
        "out": dense(ks[7], dim, vocab),
    }


def logits_fn(params, tokens):
    """Next-token logits, ``(batch, time, vocab)``; position ``t`` sees
    tokens ``0..t`` only, so padding after a sequence never reaches it."""
    time = tokens.shape[1]
    h = params["embed"][tokens] + params["pos"][:time]
    q, k, v = (h @ params[w] for w in ("wq", "wk", "wv"))
    scores = jnp.einsum("btd,bsd->bts", q, k) / np.sqrt(h.shape[-1])
    causal = jnp.tril(jnp.ones((time, time), bool))
    scores = jnp.where(causal, scores, -1e9)
    h = h + jnp.einsum("bts,bsd->btd", jax.nn.softmax(scores), v)
    h = h + jax.nn.relu(h @ params["w1"]) @ params["w2"]
    return h @ params["out"]


def num_tokens(batch):
    """Number of real target tokens: a sequence of length L predicts L - 1."""
    return jnp.sum(batch["lengths"] - 1).astype(jnp.float32)


def loss_fn(params, batch):
    """Mean cross-entropy over the real target tokens of ``batch``."""
    tokens = batch["tokens"]
    logits = logits_fn(params, tokens[:, :-1])
    targets = tokens[:, 1:]
    mask = jnp.arange(targets.shape[1]) < (batch["lengths"][:, None] - 1)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    return jnp.sum(jnp.where(mask, ce, 0.0)) / jnp.maximum(mask.sum(), 1)


def split(batch, k):
    """``k`` consecutive micro-batches of ``batch``."""
    return [
        jax.tree.map(lambda a, i=i: np.split(a, k)[i], batch) for i in range(k)
    ]


grad_fn = jax.jit(jax.value_and_grad(loss_fn))


def accumulated(tx, params, micro_batches, weighted):
    """Feeds ``tx`` one micro-batch gradient per call; returns the update
    of the closing call and the (weighted) mean loss seen."""
    state = tx.init(params)
    update = jax.jit(tx.update)
    losses, weights = [], []
    for mb in micro_batches:
        loss, grads = grad_fn(params, mb)
        weight = num_tokens(mb) if weighted else 1.0
        updates, state = update(grads, state, params, accum_weight=weight)
        losses.append(loss)
        weights.append(weight)
    return updates, float(np.average(losses, weights=weights))


@jax.jit
def relative_distance(grads, reference):
    diff = optax.tree.norm(optax.tree.sub(grads, reference))
    return diff / optax.tree.norm(reference)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--batch", type=int, default=16, help="sequences in the batch"
    )
    parser.add_argument(
        "--accum",
        type=int,
        default=4,
        help="micro-batches (must divide --batch)",
    )
    parser.add_argument("--max-len", type=int, default=24)
    parser.add_argument("--vocab", type=int, default=32)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="smaller batch and model (a smoke test)",
    )
    args = parser.parse_args(argv)
    if args.tiny:
        args.batch, args.max_len, args.dim = 8, 12, 16
    k = args.accum

    rng = np.random.default_rng(args.seed)
    batch = make_batch(rng, args.batch, args.max_len, args.vocab)
    params = jax.jit(init_params, static_argnums=(1, 2, 3))(
        jax.random.key(args.seed), args.vocab, args.max_len, args.dim
    )
    micro_batches = split(batch, k)
    counts = [int(num_tokens(mb)) for mb in micro_batches]
    print(f"{args.batch} sequences of lengths {batch['lengths'].tolist()}")
    print(
        f"{k} micro-batches of {args.batch // k} sequences, with "
        f"{counts} real target tokens ({sum(counts)} in all)\n"
    )

    full_loss, full_grads = grad_fn(params, batch)
    weighted, weighted_loss = accumulated(
        oa.accumulate(k), params, micro_batches, weighted=True
    )
    naive, naive_loss = accumulated(
        oa.accumulate(k), params, micro_batches, weighted=False
    )
    scan_loss, scan_grads = jax.jit(
        oa.microbatched_value_and_grad(loss_fn, k, weight_fn=num_tokens)
    )(params, batch)

    def distance(grads):
        return float(relative_distance(grads, full_grads))

    rows = [
        ("full batch, jax.value_and_grad", float(full_loss), 0.0),
        (
            "oa.accumulate, accum_weight=tokens",
            weighted_loss,
            distance(weighted),
        ),
        ("oa.accumulate, unweighted (naive)", naive_loss, distance(naive)),
        (
            "oa.microbatched_value_and_grad",
            float(scan_loss),
            distance(scan_grads),
        ),
    ]
    print(
        f"{'gradient of the token-mean loss':<36}  {'loss':>8}  "
        f"{'|g - g_full| / |g_full|':>23}"
    )
    for name, loss, dist in rows:
        print(f"{name:<36}  {loss:>8.5f}  {dist:>23.2e}")

    # One Adam step: Adam divides by the gradient's scale, so its first step
    # is about lr * sign(g); compare the new parameters.
    lr = 1e-2
    big_adam = optax.adam(lr)
    big_updates, _ = jax.jit(big_adam.update)(
        full_grads, big_adam.init(params), params
    )
    reference = jax.jit(optax.apply_updates)(params, big_updates)
    print(f"\none Adam step (lr {lr}): max |params - params_full_batch|")
    for name, weighted_flag in (("weighted", True), ("naive", False)):
        tx = oa.chain(oa.accumulate(k), optax.adam(lr))
        updates, _ = accumulated(
            tx, params, micro_batches, weighted=weighted_flag
        )
        new = jax.jit(optax.apply_updates)(params, updates)
        err = max(
            np.max(np.abs(a - b))
            for a, b in zip(
                jax.device_get(jax.tree.leaves(new)),
                jax.device_get(jax.tree.leaves(reference)),
                strict=True,
            )
        )
        print(
            f"  oa.chain(oa.accumulate({k}), optax.adam), {name:<8}  {err:.2e}"
        )
    return {name: dist for name, _, dist in rows}


if __name__ == "__main__":
    main()
