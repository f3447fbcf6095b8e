"""The end-to-end micro-step: the gradient and its accumulation in one jit.

An MLP of ``layers`` tanh layers ``width`` wide (float32, no biases), a
mean-square loss, one micro-batch of ``rows`` rows. Each variant is jitted
with ``compiler_options=oa.fold_compiler_options()``, its weights (and
state) donated, and timed pipelined (``_pipeline.pipelined``: calls back to
back, one sync):

* ``gradient alone``: ``jax.grad`` of the loss (the backward pass's own
  work);
* ``gradient + donated add``: ``acc + g`` by hand, the accumulator
  donated (the floor: the least an accumulating step can cost);
* ``oa non-closing``: ``oa.apply_gradients`` of
  ``oa.chain(oa.accumulate(NEVER), adam)`` (every call non-closing);
* ``oa non-closing, summed weighted``: the loss summed over the rows and
  ``oa.accumulate(NEVER, summed_gradients=True)`` with a traced
  ``accum_weight`` (a token count);
* ``oa closing``: ``oa.accumulate(1)``: every call closes its window and
  runs Adam.

Per variant it also reads the compiled program (``census``): conditionals;
the GEMMs by backend (a cuBLAS or cuBLAS-LT custom call, or a Triton
fusion); the GEMMs that take an accumulator (the micro-step is their
epilogue); the weight-sized copies and passes outside the GEMMs on the
path of a non-closing call (``tools/compiled/hlo.py``).
"""

from __future__ import annotations

import collections
import os
import re
import sys
from typing import Any

import _pipeline
import jax
import jax.numpy as jnp
import optax

import optaxaccum as oa

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tools.compiled import hlo  # noqa: E402


def _loss(params, x):
    h = x
    for i in range(len(params)):
        h = jnp.tanh(h @ params[f"w{i}"])
    return jnp.mean(h**2)


def _grad(params, x):
    return jax.grad(_loss)(params, x)


def _summed_grad(params, x):
    return jax.grad(lambda p, x: _loss(p, x) * x.shape[0])(params, x)


def _backend(instr) -> str:
    if "__cublas$lt$matmul" in instr.attrs:
        return "cuBLAS-LT"
    if "__cublas" in instr.attrs:
        return "cuBLAS"
    return "Triton" if "__triton" in instr.attrs else "other"


def _is_accumulator(path: str) -> bool:
    # oa.accumulate's ``acc``, or the donated add's accumulator ``s``.
    return bool(re.search(r"\.acc\[|^s\[", path))


def census(compiled, width: int) -> dict[str, Any]:
    """Counts in the compiled program of a step: conditionals, GEMMs per
    backend, GEMMs that take an accumulator (folded), and the weight-sized
    copies and passes outside the GEMMs on a non-closing call's path."""
    module = hlo.Module.parse(compiled.as_text())
    names = [module.entry]
    names += [
        c
        for i in module.computations[module.entry]
        if i.opcode == "call"
        for e, c in i.called
    ]
    gemms = [i for n in names for i in module.computations[n] if hlo.is_gemm(i)]
    tally = collections.Counter(_backend(i) for i in gemms)
    where = hlo.fold(module, _is_accumulator)
    path = hlo.non_closing(module, {(width, width)}, ("sqrt", "rsqrt"))
    return {
        "conditionals": len(hlo.conditionals(module)),
        "GEMMs": ", ".join(f"{k} {v}" for k, v in sorted(tally.items()))
        or "none",
        "folded": sum(v == "gemm" for v in where.values()),
        "weight copies": path["copies"],
        "weight passes": path["passes"],
    }


def _variants() -> dict[str, tuple[Any, Any]]:
    """``name -> (step, tx)``; ``step(params, state, x, w)``."""
    adam = optax.adam(_pipeline.LEARNING_RATE)
    tx = oa.chain(oa.accumulate(_pipeline.NEVER), adam)
    summed = oa.chain(
        oa.accumulate(_pipeline.NEVER, summed_gradients=True), adam
    )
    closing = oa.chain(oa.accumulate(1), adam)

    def step_of(tx, grad=_grad, weighted=False):
        def step(p, s, x, w):
            kw = {"accum_weight": w} if weighted else {}
            return oa.apply_gradients(tx, grad(p, x), s, p, **kw)

        return step

    def add(p, s, x, w):
        return p, jax.tree.map(jnp.add, s, _grad(p, x))

    return {
        "gradient + donated add": (add, None),
        "oa non-closing": (step_of(tx), tx),
        "oa non-closing, summed weighted": (
            step_of(summed, _summed_grad, True),
            summed,
        ),
        "oa closing": (step_of(closing), closing),
    }


def measure(
    width: int, layers: int, rows: int, *, calls: int, rounds: int = 3
) -> dict[str, dict[str, Any]]:
    """Seconds per call (pipelined) and the census of each variant, with
    ``gradient alone`` first."""
    shapes = {f"w{i}": (width, width) for i in range(layers)}
    x = jax.random.normal(jax.random.key(2), (rows, width), jnp.float32)
    options = oa.fold_compiler_options()
    grad = jax.jit(_grad, donate_argnums=(0,), compiler_options=options)
    grad = grad.lower(_pipeline.tree(shapes, 0), x).compile()
    out = {
        "gradient alone": {
            **census(grad, width),
            "seconds": _pipeline.pipelined(
                grad,
                (_pipeline.tree(shapes, 0), x),
                lambda o, a: (o, a[1]),  # the gradient as the next weights
                calls=calls,
                rounds=rounds,
            ),
        }
    }
    weight = jnp.float32(rows)
    for name, (step, tx) in _variants().items():
        params = _pipeline.tree(shapes, 0)
        state = tx.init(params) if tx else jax.tree.map(jnp.zeros_like, params)
        jitted = jax.jit(step, donate_argnums=(0, 1), compiler_options=options)
        compiled = jitted.lower(params, state, x, weight).compile()
        out[name] = {
            "seconds": _pipeline.pipelined(
                compiled,
                (params, state, x, weight),
                lambda o, a: (o[0], o[1], a[2], a[3]),
                calls=calls,
                rounds=rounds,
            ),
            **census(compiled, width),
        }
        del params, state, compiled
    return out
