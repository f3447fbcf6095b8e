"""Shared helpers of the benchmark scripts: timing, memory, tables.

Timing discipline (the machine running these may be shared and noisy):
every variant is warmed up first (compilation and first-call effects stay out
of the figures), then timed in interleaved rounds (one call of each variant
per round, in a fresh random order each round) so that a burst of outside
load hits all variants alike and no variant always follows the same one;
each variant's figure is the median of its rounds and is reported as a ratio
to a reference variant.
"""

from __future__ import annotations

import datetime
import os
import platform
import random
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import _devices
import jax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tools.mesh_mlp import init_mlp  # noqa: E402
from tools.tables import markdown_table  # noqa: E402

__all__ = [
    "Timed",
    "windows_alike_then_timed",
    "floor_add",
    "init_mlp",
    "format_bytes",
    "machine_info",
    "markdown_table",
    "memory_stats",
    "reset_peak_rss",
    "run_worker",
    "rss_kib",
    "target",
    "targets_table",
    "time_interleaved",
    "today",
    "versions",
]


class Timed:
    """One benchmark variant: an untimed ``prepare`` and a timed ``call``.

    Args:
      call: the function to time; its result is waited for with
        ``jax.block_until_ready``.
      prepare: run before every timed call, outside the timing; returns the
        positional arguments of ``call`` (e.g. re-creating donated buffers).
      after: receives ``call``'s result, outside the timing (e.g. to keep
        donated outputs as the next call's inputs).
    """

    def __init__(
        self,
        call: Callable[..., Any],
        prepare: Callable[[], Sequence[Any]],
        after: Callable[[Any], None] = lambda out: None,
    ):
        self.call = call
        self.prepare = prepare
        self.after = after

    def run_once(self) -> float:
        """Seconds taken by one ``call`` (``prepare``/``after`` excluded)."""
        args = jax.block_until_ready(self.prepare())
        start = time.perf_counter()
        out = jax.block_until_ready(self.call(*args))
        elapsed = time.perf_counter() - start
        self.after(out)
        return elapsed


def floor_add(acc: Any, grads: Any) -> tuple[Timed, Any]:
    """The floor of a micro-step: a jitted tree add ``acc + grads`` with
    ``acc`` donated, each call's output kept as the next call's ``acc``.

    Returns:
      ``(timed, compiled)``: the :class:`Timed` variant and the compiled
      add (for its ``memory_analysis()`` or HLO).
    """
    add = jax.jit(
        lambda a, g: jax.tree.map(jax.numpy.add, a, g), donate_argnums=0
    )
    compiled = add.lower(acc, grads).compile()
    box = [acc]

    def keep(out: Any) -> None:
        box[0] = out

    return Timed(compiled, lambda: (box[0], grads), keep), compiled


def time_interleaved(
    variants: Mapping[str, Timed],
    *,
    rounds: int,
    warmup: int = 2,
    settle_s: float = 0.0,
) -> dict[str, float]:
    """Median seconds per call of each variant, timed in interleaved rounds.

    Args:
      variants: name -> :class:`Timed`.
      rounds: timed rounds; each round calls every variant once, in a
        random (seeded) order.
      warmup: untimed calls of each variant before the first round.
      settle_s: seconds to sleep after each timed call, so that work the
        previous call left behind (freeing large buffers) is not charged to
        the next one.

    Returns:
      name -> median seconds of one call.
    """
    names = list(variants)
    for _ in range(warmup):
        for name in names:
            variants[name].run_once()
    samples: dict[str, list[float]] = {name: [] for name in names}
    rng = random.Random(0)
    for _ in range(rounds):
        # A fresh order each round: no variant always follows the same one
        # (a heavy predecessor's deferred frees would bias its successor).
        order = rng.sample(names, len(names))
        for name in order:
            samples[name].append(variants[name].run_once())
            time.sleep(settle_s)
    return {name: _median(s) for name, s in samples.items()}


def windows_alike_then_timed(
    steps: Mapping[str, Callable[..., Any]],
    loops: Mapping[str, dict[str, Any]],
    batches: Sequence[tuple[Any, Any]],
    reference: str,
    atol: float,
    cfg: Mapping[str, int],
) -> dict[str, float]:
    """Median seconds of one window of each variant.

    A window is one call of ``steps[name](params, state, x, y)`` per
    ``(x, y)`` of ``batches``, from ``loops[name]``'s ``params`` and
    ``state`` and back into them (the donated buffers carry on). First one
    untimed window of each, whose params must match ``reference``'s to
    ``atol`` (a sanity check: from the same params they move alike); then
    :func:`time_interleaved` with ``cfg``'s ``rounds`` and ``warmup``.
    """
    import numpy as np

    def window(name: str) -> Timed:
        step, loop = steps[name], loops[name]

        def call(p, s):
            for x, y in batches:
                p, s = step(p, s, x, y)
            return p, s

        def prepare():
            return loop["params"], loop["state"]

        def keep(out):
            loop["params"], loop["state"] = out

        return Timed(call, prepare, keep)

    variants = {name: window(name) for name in steps}
    for variant in variants.values():
        variant.run_once()
    ref = jax.tree.leaves(loops[reference]["params"])
    for name in variants:
        got = jax.tree.leaves(loops[name]["params"])
        for a, b in zip(got, ref, strict=True):
            np.testing.assert_allclose(
                np.asarray(a), np.asarray(b), rtol=0, atol=atol, err_msg=name
            )
    return time_interleaved(
        variants, rounds=cfg["rounds"], warmup=cfg["warmup"]
    )


def _median(xs: Sequence[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


def memory_stats(compiled: Any) -> dict[str, int]:
    """Argument, output, alias and temp bytes of a compiled computation.

    ``temp`` is reported separately: on CPU, ``peak_memory_in_bytes`` leaves
    the temporaries out.
    """
    ma = compiled.memory_analysis()
    return {
        "argument": int(ma.argument_size_in_bytes),
        "output": int(ma.output_size_in_bytes),
        "alias": int(ma.alias_size_in_bytes),
        "temp": int(ma.temp_size_in_bytes),
    }


def rss_kib() -> dict[str, int]:
    """This process's resident memory now (``rss``) and at its peak
    (``peak``), in KiB, from ``/proc/self/status``.

    Not ``resource.getrusage(...).ru_maxrss``: on Linux a child process
    started from a big parent reports at least the parent's peak there (it
    survives fork and exec), so a benchmark worker started by ``run_all.py``
    after B1 would report B1's memory. ``VmHWM`` is the process's own.
    Falls back to ``ru_maxrss`` for both where ``/proc`` is missing.
    """
    try:
        with open("/proc/self/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        return {
            "rss": int(fields["VmRSS"].split()[0]),
            "peak": int(fields["VmHWM"].split()[0]),
        }
    except (OSError, KeyError, ValueError):
        import resource

        peak = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
        return {"rss": peak, "peak": peak}


def run_worker(script: str, args: Sequence[str], timeout: float | None) -> dict:
    """``python script --worker *args`` in a fresh process on the CPU: the
    JSON object its last stdout line holds, or ``{"error": ...}`` (a
    timeout, or a failure with the tail of its output)."""
    import json
    import subprocess

    cmd = [sys.executable, os.path.abspath(script), "--worker", *args]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    try:
        out = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timeout {timeout} s"}
    if out.returncode != 0:
        tail = (out.stderr or out.stdout).strip().splitlines()[-3:]
        return {"error": f"exit {out.returncode}: " + " / ".join(tail)}
    return json.loads(out.stdout.strip().splitlines()[-1])


def reset_peak_rss() -> bool:
    """Resets this process's peak RSS (``VmHWM``) to its current RSS, where
    Linux allows it; returns whether it did."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def format_bytes(n: float) -> str:
    """``n`` bytes in MiB (or B/KiB for small numbers), for tables."""
    if abs(n) < 1024:
        return f"{int(n)} B"
    if abs(n) < 1024**2:
        return f"{n / 1024:.1f} KiB"
    return f"{n / 1024**2:.1f} MiB"


def target(what: str, value: Any, met: bool, suffix: str = "x") -> dict:
    """One target of a benchmark: what it asks, the measured value, met?"""
    shown = f"{value:.2f}{suffix}" if isinstance(value, float) else str(value)
    return {"target": what, "measured": shown, "met": bool(met)}


def targets_table(targets: Sequence[Mapping[str, Any]]) -> str:
    """The targets of a benchmark as a markdown table."""
    return markdown_table(
        ["target", "measured", "met"],
        [
            [t["target"], t["measured"], "yes" if t["met"] else "NO"]
            for t in targets
        ],
    )


def print_result(res: Mapping[str, Any]) -> None:
    """Prints one benchmark's title, table and targets (its ``__main__``)."""
    print(res["title"])
    print(markdown_table(res["headers"], res["rows"]))
    print()
    print(targets_table(res["targets"]))


def machine_info() -> dict[str, str]:
    """Platform, CPU count, JAX backend and device kind."""
    dev = jax.devices()[0]
    return {
        "platform": platform.platform(),
        "cpu_count": str(os.cpu_count()),
        "backend": jax.default_backend(),
        "device_kind": f"{dev.device_kind} x{jax.device_count()}",
    }


def versions() -> dict[str, str]:
    """Versions of python, jax, jaxlib and optax."""
    import jaxlib
    import optax

    return {
        "python": sys.version.split()[0],
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "optax": optax.__version__,
    }


def today() -> str:
    """The current date and time (UTC), ISO format, to the minute."""
    now = datetime.datetime.now(datetime.UTC)
    return now.strftime("%Y-%m-%d %H:%M UTC")


def all_reduce_summary(compiled: Any, mesh: Any) -> dict:
    """All-reduce ops and the bytes they reduce, at the top level of a
    compiled step (run on every call) and inside a conditional's branch
    (run only when the branch is taken), from ``oa.collective_census``."""
    import optaxaccum as oa

    ops = oa.collective_census(compiled, mesh)
    ops = [o for o in ops if o["op"] == "all-reduce"]
    summary: dict[str, Any] = {}
    for where, runs_always in (("top", True), ("branch", False)):
        group = [o for o in ops if (not o["branches"]) == runs_always]
        summary[f"{where}_ops"] = len(group)
        summary[f"{where}_bytes"] = sum(o["bytes"] for o in group)
    summary["true_branch_only"] = all(
        o["branches"][-1] == 1 for o in ops if o["branches"]
    )
    return summary


def on_devices(
    script: str, measure: Callable[[bool], dict], tiny: bool, n: int
) -> dict:
    """``measure(tiny)`` here if this process has ``n`` devices, else
    ``script --json`` in a fresh process with ``n`` simulated CPU devices
    (the device count is fixed when JAX starts); its results either way."""
    import json
    import subprocess

    if jax.device_count() >= n:
        return measure(tiny)
    env = _devices.environment(n)
    cmd = [sys.executable, os.path.abspath(script), "--json"]
    if tiny:
        cmd.append("--tiny")
    proc = subprocess.run(
        cmd, env=env, capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr}"
        )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_script(main: Callable[..., dict]) -> None:
    """A benchmark's ``__main__``: ``--tiny`` for toy sizes, ``--json`` to
    print the results as one JSON line (for :func:`on_devices`)."""
    import json

    args = sys.argv[1:]
    res = main(tiny="--tiny" in args)
    if "--json" in args:
        print(json.dumps(res))
    else:
        print_result(res)
