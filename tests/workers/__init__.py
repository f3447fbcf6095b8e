"""The subprocess workers of the two-process tests, and how a test loads
one (for its problem: data, loss, constants) or runs one as two
``jax.distributed`` processes."""

import importlib.util
import os
import pathlib
import socket
import subprocess
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
WORKERS = pathlib.Path(__file__).resolve().parent


def load(name):
    """The worker module ``tests/workers/<name>.py``, imported from its file
    (importing it changes no jax configuration and starts no backend)."""
    spec = importlib.util.spec_from_file_location(name, WORKERS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_GLOO_MISSING = (
    "not available",
    "unavailable",
    "not supported",
    "unsupported",
    "not built",
    "unimplemented",
)

_MULTIHOST_TIMEOUT = 120  # seconds, both processes together


def _run_two_workers(tmp_path, out, attempt, script):
    """Starts both worker processes, waits for them (killing any still
    running at the deadline); returns ``(all succeeded, report)``."""
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT), *filter(None, [env.get("PYTHONPATH")])]
    )
    logs = [tmp_path / f"worker{i}-{attempt}.log" for i in range(2)]
    procs = []
    deadline = time.monotonic() + _MULTIHOST_TIMEOUT
    try:
        for i, log in enumerate(logs):
            with open(log, "w") as f:
                procs.append(
                    subprocess.Popen(
                        [
                            sys.executable,
                            script,
                            str(i),
                            "2",
                            str(port),
                            str(out),
                        ],
                        stdout=f,
                        stderr=subprocess.STDOUT,
                        env=env,
                        cwd=tmp_path,
                    )
                )
        for p in procs:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass  # reported below
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    report = "\n".join(
        f"--- worker {i} (exit {p.returncode}):\n{log.read_text()[-3000:]}"
        for i, (p, log) in enumerate(zip(procs, logs, strict=True))
    )
    return all(p.returncode == 0 for p in procs), report


def run_two_processes(tmp_path, script):
    """Runs ``script`` (``tests/workers/<script>``) as two ``jax.distributed``
    processes; returns the path of the params process 0 saved. Skips where
    gloo CPU collectives are missing; fails with both logs otherwise."""
    out = tmp_path / "params.npy"
    script = str(WORKERS / script)
    ok, report = _run_two_workers(tmp_path, out, 0, script)
    if not ok and "address already in use" in report.lower():
        ok, report = _run_two_workers(tmp_path, out, 1, script)  # port race
    if not ok:
        lowered = report.lower()
        if "gloo" in lowered and any(r in lowered for r in _GLOO_MISSING):
            pytest.skip(f"gloo CPU collectives unavailable here:\n{report}")
        pytest.fail(
            f"a worker failed or ran past {_MULTIHOST_TIMEOUT} s:\n{report}"
        )
    return out
