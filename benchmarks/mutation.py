"""Mutation check: does the suite catch these deliberate bugs?

Applies each mutant (one textual replacement in one source file), runs the
test files that should catch it, restores the file, and prints a table of
killed / survived mutants. Not part of ``make test`` (minutes of runtime):

    .venv/bin/python benchmarks/mutation.py            # all mutants
    .venv/bin/python benchmarks/mutation.py nested_tail # some, by name
"""

from __future__ import annotations

import pathlib
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
SRC = ROOT / "optaxaccum" / "_src"
CORE_TESTS = [
    "tests/test_hardening.py",
    "tests/test_chain.py",
    "tests/test_accumulate.py",
]

_HARD = ["tests/test_hardening.py"]

# name: (file under optaxaccum/_src, original text, mutated text, pytest
# arguments: test files, optionally -k)
MUTANTS = {
    "nested_tail": (  # issue 10 (a): followers' state from the inner branch
        "chain.py",
        "tail = utils.select(out.opened, inner, tail_state)",
        "tail = inner",
        CORE_TESTS,
    ),
    "closed_params_plus_zeros": (  # issue 10 (b)
        "chain.py",
        "return params, res.state, utils.zeros_of(shapes)",
        "return (jax.tree.map(lambda p: p + jnp.zeros_like(p), params), "
        "res.state, utils.zeros_of(shapes))",
        CORE_TESTS,
    ),
    "zero_weight_not_masked": (
        "accumulate.py",
        "wg = jnp.where(zero, jnp.zeros_like(wg), wg)",
        "wg = wg",
        CORE_TESTS,
    ),
    "nested_weight_not_passed": (
        "accumulate.py",
        "weight\n            if cfg.reduction",
        "jnp.ones_like(weight)\n            if cfg.reduction",
        CORE_TESTS,
    ),
    "invalid_weight_counts_as_finite": (
        "accumulate.py",
        "finite = valid & (zero | sharding.globally_finite(updates))",
        "finite = zero | sharding.globally_finite(updates)",
        CORE_TESTS,
    ),
    "stale_accumulator_not_reset": (
        "accumulate.py",
        "jnp.where(fresh, wg, a + wg)",
        "a + wg",
        CORE_TESTS,
    ),
    "zero_weight_window_opens": (
        "accumulate.py",
        "closing & nonzero,",
        "closing,",
        CORE_TESTS,
    ),
    "dropped_micro_batch_advances": (
        "accumulate.py",
        "mini_step = utils.select(counted, state.mini_step + 1, "
        "state.mini_step)",
        "mini_step = state.mini_step + 1",
        CORE_TESTS,
    ),
    "flush_keeps_window_position": (
        "accumulate.py",
        "mini_step=jnp.zeros([], jnp.int32),\n        gradient_step="
        "optax.safe_increment(state.gradient_step),",
        "gradient_step=optax.safe_increment(state.gradient_step),",
        CORE_TESTS,
    ),
    "eager_gate_ignored": (
        "accumulate.py",
        "counted = passed\n",
        "counted = True\n",
        CORE_TESTS + ["tests/test_loss_scale.py"],
    ),
    # ----------------------------------------------- issue 23 (hardening 2)
    "float32_window_weight": (  # item 2
        "accumulate.py",
        "weight=jnp.zeros([], _weight_dtype(cfg, params)),",
        "weight=jnp.zeros([], jnp.float32),",
        _HARD + ["-k", "float64_mean"],
    ),
    "zero_weight_call_overflows": (  # item 4
        "loss_scale.py",
        "new_state = utils.select(empty, state, _adjust(state, finite))",
        "new_state = _adjust(state, finite)",
        _HARD + ["-k", "zero_weight_call"],
    ),
    "complex_explicit_real_accumulator": (  # item 5
        "accumulate.py",
        "        return utils.widen(jnp.complex64, cfg.accumulator_dtype)",
        "        return jnp.finfo(cfg.accumulator_dtype).dtype",
        _HARD + ["-k", "complex"],
    ),
    "loss_scale_ignores_imaginary_part": (  # item 5
        "loss_scale.py",
        "parts = (jnp.abs(g.real), jnp.abs(g.imag))",
        "parts = (jnp.abs(g.real),)",
        _HARD + ["-k", "complex_part"],
    ),
    "nnx_refused_micro_batch_enters_bn": (  # item 6
        "../flax/nnx.py",
        "                module.keep_counted(old_opt_state, opt_state)",
        "                pass",
        ["tests/test_nnx_optimizer.py", "-k", "refused"],
    ),
    "bare_weight_not_a_near_miss": (  # item 7
        "utils.py",
        "        close = close or [d for d in declared "
        'if d.endswith(f"_{key}")]\n',
        "",
        _HARD + ["-k", "bare_weight"],
    ),
    "has_updated_flagless_optax_rule": (  # item 8
        "multisteps.py",
        "(jnp.asarray(mini_step) == 0) & (jnp.asarray(gradient_step) > 0)",
        "jnp.asarray(mini_step) == 0",
        _HARD + ["-k", "multisteps_has_updated"],
    ),
    "nnx_update_returns_none": (  # item 9
        "../flax/nnx.py",
        "        self.step[...] += 1\n        return updates",
        "        self.step[...] += 1\n        return None",
        ["tests/test_nnx_optimizer.py", "-k", "returns_the_updates"],
    ),
    "unreduced_first_argnum_only": (  # item 10
        "sharding.py",
        "        for i in nums:",
        "        for i in nums[:1]:",
        ["tests/test_mesh.py", "-k", "tuple_argnums"],
    ),
    "opened_false_zeros_grads_dtype": (  # zeros of an all-weight-0 window
        "chain.py",
        "        return utils.zeros_of(jax.eval_shape(run)[0]), tail_state",
        "        return jax.tree.map(jnp.zeros_like, out.updates), tail_state",
        _HARD + ["-k", "followers_output_dtype"],
    ),
    "closed_gate_zeros_grads_dtype": (  # a nested gate that stays closed
        "chain.py",
        "        zeros, weight2 = utils.zeros_of(shapes)\n",
        "        zeros, weight2 = utils.zeros_of(shapes)\n"
        "        zeros = jax.tree.map(jnp.zeros_like, out.updates)\n",
        _HARD + ["-k", "nested_closed_gate"],
    ),
    "per_micro_step_pmean": (  # one reduction per window, not per call
        "accumulate.py",
        "    acc = jax.tree.map(add, state.acc, updates)",
        "    if cfg.axis_name is not None and not sharding.is_explicit(\n"
        "        jax.tree.leaves(updates)[0], cfg.axis_name\n"
        "    ):\n"
        "        updates = jax.lax.pmean(updates, cfg.axis_name)\n"
        "    acc = jax.tree.map(add, state.acc, updates)",
        ["tests/test_multidevice.py", "-k", "hlo_gradient"],
    ),
    "no_window_reduction_explicit_mesh": (
        "sharding.py",
        "        return jax.tree.map(reduce, acc), weight",
        "        return acc, weight",
        ["tests/test_mesh.py", "-k", "emits_reduced"],
    ),
    "shard_update_followers_unsharded": (  # issue 27: ZeRO-1 state
        "zero.py",
        "    if at is None:\n        return optax.chain(*transforms).init",
        "    if True:\n        return optax.chain(*transforms).init",
        ["tests/test_shard_update.py", "-k", "born"],
    ),
    "shard_update_all_reduce": (  # issue 27: a reduce-scatter per window
        "accumulate.py",
        "scatter = zero.reduce_scatter if cfg.shard_update else None",
        "scatter = None",
        ["tests/test_shard_update.py", "-k", "hlo"],
    ),
    "shard_update_wrong_piece": (  # issue 27: each device's own piece
        "zero.py",
        "c = lax.psum_scatter(c, axes, scatter_dimension=i, tiled=True)",
        "c = lax.psum_scatter(\n"
        "                lax.rev(c, (i,)), axes, scatter_dimension=i, "
        "tiled=True\n            )",
        ["tests/test_shard_update.py", "-k", "equals"],
    ),
    "shard_update_not_gathered": (  # issue 27: updates back to params'
        "zero.py",
        "        if kept == dims:",
        "        if True:",
        ["tests/test_shard_update.py", "-k", "born"],
    ),
    "shard_update_not_gathered_like_params": (  # issue 27, review
        "zero.py",
        "    return _reshard(x, spec)\n",
        "    return x\n",
        ["tests/test_shard_update.py", "-k", "fsdp_is_named"],
    ),
    "gate_drops_window_weight": (  # review: a gate between accumulates
        "chain.py",
        "    if window is None:\n        return res\n",
        "    if True:\n        return res\n",
        CORE_TESTS + ["-k", "window_weight_on or behind_a_gate"],
    ),
    "zeros_not_device_varying": (  # issue 23: zeros under shard_map
        "utils.py",
        "    return jax.tree.map(jnp.zeros_like, shapes)",
        "    return jax.tree.map(\n"
        "        lambda s: jnp.zeros(s.shape, s.dtype), shapes)",
        _HARD + ["-k", "device_varying"],
    ),
    "replicas_disagree_on_overflow": (
        "loss_scale.py",
        "            finite = sharding.agree(finite, axis_name)\n",
        "",
        _HARD + ["-k", "replicas_agree"],
    ),
    "gate_branch_not_kept": (  # XLA:GPU would turn the gate into a select
        "utils.py",
        "return lax.cond(pred, _kept(true_fn), _kept(false_fn))",
        "return lax.cond(pred, true_fn, false_fn)",
        ["tests/test_gpu_branch.py"],
    ),
    "gate_closed_branch_not_kept": (
        "utils.py",
        "return lax.cond(pred, _kept(true_fn), _kept(false_fn))",
        "return lax.cond(pred, _kept(true_fn), false_fn)",
        ["tests/test_gpu_branch.py"],
    ),
}


def run(name: str) -> tuple[str, float]:
    """Applies mutant ``name``, runs its tests, restores the file."""
    file, old, new, tests = MUTANTS[name]
    path = SRC / file
    text = path.read_text()
    if text.count(old) != 1:
        return "stale (text not found once)", 0.0
    start = time.perf_counter()
    try:
        path.write_text(text.replace(old, new))
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "-x",
                "-q",
                "-p",
                "no:xdist",
                "-p",
                "no:cacheprovider",
                *tests,
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=1200,
        )
    finally:
        path.write_text(text)
    if proc.returncode == 0:
        verdict = "SURVIVED"
    else:  # by an assertion, or only by a crash (an error, an abort)?
        verdict = "killed" if _asserted(proc.stdout) else "killed (crash)"
    return verdict, time.perf_counter() - start


def _asserted(output: str) -> bool:
    """Whether pytest's output shows a failed assertion (``assert``,
    ``AssertionError``, ``pytest.raises`` not raised)."""
    for line in output.splitlines():
        text = line[1:].strip() if line.startswith("E ") else ""
        if text.startswith(("assert ", "AssertionError", "Failed: DID NOT")):
            return True
    return False


def main(names: list[str]) -> int:
    names = names or list(MUTANTS)
    print("| mutant | file | verdict | seconds |")
    print("|---|---|---|---|")
    survived = 0
    for name in names:
        verdict, seconds = run(name)
        survived += verdict != "killed"
        print(
            f"| {name} | {MUTANTS[name][0]} | {verdict} | {seconds:.0f} |",
            flush=True,
        )
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
