"""B5-eager: the cost of one un-jitted call.

Un-jitted calls are what a user meets first (a notebook, a debugger, a
test): every operation dispatches on its own, so a call costs in proportion
to the operations it runs. On a tree of ``N`` small float32 leaves (50; 8
with ``--tiny``) of B5's shapes, this times one eager call of

* ``optax agc+adam update``: ``tx.update`` and ``optax.apply_updates`` of
  ``optax.chain(optax.adaptive_grad_clip(0.01), adam)``: the reference;
* ``MultiSteps non-closing``: ``optax.MultiSteps`` of it, ``k=4``, a call
  that does not close the window;
* ``README fused non-closing`` and ``README fused closing``: the README's
  chain ``oa.chain(oa.accumulate(4), oa.dynamic_loss_scale(),
  oa.agc(0.01), adam)`` stepped with ``oa.apply_gradients``, on a call that
  does not close the window and on one that does;
* ``README plain non-closing``: the same chain, ``tx.update`` +
  ``optax.apply_updates``;
* ``accumulate fused non-closing`` and ``accumulate fused closing``:
  ``oa.chain(oa.accumulate(4), adam)``.

Each call starts from the same state (a fresh copy of the state after
``init``, or after 3 calls for a closing one), in interleaved rounds (see
``_common``), and is reported as a ratio to the reference. A non-closing
call runs only the accumulate's add: it does not trace or run the closing
work, so it costs a fraction of a closing call (``tx.update`` builds its
zeros from the shapes an earlier call of the same types found).

Run: ``python benchmarks/bench_eager.py [--tiny]``.
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

K = 4
N = 50
TINY_N = 8
REFERENCE = "optax agc+adam update"
HEADERS = ["configuration", "ms/call", "vs optax agc+adam update"]


def _variants(n: int) -> dict:
    """name -> ``Timed`` of one eager call on ``n`` leaves."""
    import _common
    import bench_compile
    import jax
    import optax

    import optaxaccum as oa

    adam = optax.adam(bench_compile.LEARNING_RATE)
    agc_adam = optax.chain(optax.adaptive_grad_clip(bench_compile.CLIP), adam)
    readme = oa.chain(
        oa.accumulate(K),
        oa.dynamic_loss_scale(),
        oa.agc(bench_compile.CLIP),
        adam,
    )
    grads = bench_compile.make_tree(n, 1)
    params = bench_compile.make_tree(n, 0)

    def plain(tx, g, s, p):
        updates, s = tx.update(g, s, p)
        return optax.apply_updates(p, updates), s

    def fused(tx, g, s, p):
        return oa.apply_gradients(tx, g, s, p)

    def timed(tx, step, calls_before: int, closes: bool | None = None):
        state = tx.init(params)
        for _ in range(calls_before):
            _, state = step(tx, grads, state, params)
        if closes is not None:  # the call timed is the one named
            _, after = step(tx, grads, state, params)
            ms = isinstance(tx, optax.MultiSteps)
            updated = tx.has_updated(after) if ms else oa.has_updated(after)
            if bool(updated) != closes:
                raise RuntimeError(f"the call timed closes={not closes}")
        # A fresh copy each call: every call starts from the same state.
        copy = lambda: jax.tree.map(lambda x: x.copy(), (grads, state, params))  # noqa: E731
        return _common.Timed(lambda g, s, p: step(tx, g, s, p), copy)

    accumulate = oa.chain(oa.accumulate(K), adam)
    return {
        REFERENCE: timed(agc_adam, plain, 0),
        "MultiSteps non-closing": timed(
            optax.MultiSteps(agc_adam, K), plain, 0, False
        ),
        "README fused non-closing": timed(readme, fused, 0, False),
        "README fused closing": timed(readme, fused, K - 1, True),
        "README plain non-closing": timed(readme, plain, 0, False),
        "accumulate fused non-closing": timed(accumulate, fused, 0, False),
        "accumulate fused closing": timed(accumulate, fused, K - 1, True),
    }


def main(tiny: bool = False, rounds: int | None = None) -> dict:
    """Runs B5-eager; returns the results (see ``run_all.py``)."""
    import _common

    n = TINY_N if tiny else N
    rounds = rounds or (3 if tiny else 20)
    seconds = _common.time_interleaved(_variants(n), rounds=rounds, warmup=2)
    ref = seconds[REFERENCE]
    rows = [
        [name, f"{1e3 * t:.2f}", f"{t / ref:.2f}x"]
        for name, t in seconds.items()
    ]
    fused = seconds["README fused non-closing"]
    closing = seconds["README fused closing"]
    plain = seconds["README plain non-closing"]
    targets = [
        _common.target(
            "README fused non-closing eager call < the optax chain's update",
            fused / ref,
            fused < ref,
        ),
        _common.target(
            "README plain non-closing eager call < the optax chain's update",
            plain / ref,
            plain < ref,
        ),
        _common.target(
            "README fused non-closing eager call <= 0.25x its closing call",
            fused / closing,
            fused <= 0.25 * closing,
        ),
    ]
    return {
        "name": "B5-eager",
        "title": (
            f"B5-eager: one un-jitted call on {n} leaves, k={K}, median of "
            f"{rounds} interleaved rounds"
        ),
        "headers": HEADERS,
        "rows": rows,
        "targets": targets,
        "ratios": {
            f"B5-eager {name}": t / ref
            for name, t in seconds.items()
            if name != REFERENCE
        },
        "ratio_label": f"x {REFERENCE} (eager)",
        "seconds": seconds,
    }


if __name__ == "__main__":
    import _common

    _common.run_script(main)
