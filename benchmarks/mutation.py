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

# name: (file, original text, mutated text, test files)
MUTANTS = {
    "nested_tail": (  # issue 10 (a): followers' state from the inner branch
        "chain.py",
        "tail = base.select(out.opened, inner, tail_state)",
        "tail = inner",
        CORE_TESTS,
    ),
    "closed_params_plus_zeros": (  # issue 10 (b)
        "chain.py",
        "lambda: (params, res.state))",
        "lambda: (jax.tree.map(lambda p: p + jnp.zeros_like(p), params), "
        "res.state))",
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
        'weight if cfg.reduction == "mean" else jnp.ones_like(weight)',
        "jnp.ones_like(weight)",
        CORE_TESTS,
    ),
    "invalid_weight_counts_as_finite": (
        "accumulate.py",
        "finite = valid & (zero | utils.all_finite(updates))",
        "finite = zero | utils.all_finite(updates)",
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
        "closing & (weight != 0),",
        "closing,",
        CORE_TESTS,
    ),
    "dropped_micro_batch_advances": (
        "accumulate.py",
        "mini_step = base.select(counted, state.mini_step + 1, state.mini_step)",
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
    verdict = "killed" if proc.returncode != 0 else "SURVIVED"
    return verdict, time.perf_counter() - start


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
