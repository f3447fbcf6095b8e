"""Figures for AccumBatchNorm: pooled running statistics vs ``nn.BatchNorm``
on the concatenated window, and the bias of averaging micro-batch variances
(what the TensorFlow GradientAccumulator package does) on the same data.

Run: ``python benchmarks/bn_pooling.py`` (seconds; deterministic).
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from optaxaccum.flax import AccumBatchNorm

CASES = [
    ("4 x 16, i.i.d.", (16, 16, 16, 16), 0.0),
    ("sizes 5, 27, 16, 16, drifting means", (5, 27, 16, 16), 1.0),
]


def main():
    rng = np.random.default_rng(0)
    for label, sizes, drift in CASES:
        batches = [
            jnp.asarray(
                rng.normal(3 + drift * i, 2.0, (n, 6, 6, 8)), jnp.float32
            )
            for i, n in enumerate(sizes)
        ]
        bn = AccumBatchNorm(
            use_running_average=False, momentum=0.0, accum_steps=len(sizes)
        )
        variables = bn.init(jax.random.key(0), batches[0])
        stats = variables["batch_stats"]
        for b in batches:
            _, upd = bn.apply(
                {**variables, "batch_stats": stats}, b, mutable=["batch_stats"]
            )
            stats = upd["batch_stats"]
        ref = nn.BatchNorm(use_running_average=False, momentum=0.0)
        _, upd = ref.apply(
            ref.init(jax.random.key(0), batches[0]),
            jnp.concatenate(batches),
            mutable=["batch_stats"],
        )
        want = upd["batch_stats"]
        averaged = jnp.mean(
            jnp.stack([jnp.var(b, axis=(0, 1, 2)) for b in batches]), axis=0
        )
        bias = jnp.mean((averaged - want["var"]) / want["var"])

        def max_diff(a, b):
            return float(jnp.max(jnp.abs(a - b)))

        print(
            f"{label}: AccumBatchNorm vs nn.BatchNorm on the concatenation: "
            f"max |d mean| {max_diff(stats['mean'], want['mean']):.1e}, "
            f"max |d var| {max_diff(stats['var'], want['var']):.1e} "
            f"(var ~ {float(jnp.mean(want['var'])):.2f}); averaged variances "
            f"(TF package): {100 * float(bias):+.2f}% "
            f"(max |d var| {max_diff(averaged, want['var']):.3f})"
        )


if __name__ == "__main__":
    main()
