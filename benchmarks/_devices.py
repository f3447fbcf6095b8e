"""The eight host CPU devices of the multi-device benchmarks.

JAX fixes its device count when its backend starts. A script that wants
eight devices asks for them before it uses JAX (:func:`ask_for`); a process
that started with fewer runs the script again in a fresh one with
:func:`environment` (see ``_common.on_devices``). Imports no JAX.
"""

from __future__ import annotations

import os

N_DEVICES = 8
_KEY = "xla_force_host_platform_device_count"


def flag(n: int = N_DEVICES) -> str:
    """The XLA flag that gives ``n`` host CPU devices."""
    return f"--{_KEY}={n}"


def ask_for(n: int = N_DEVICES) -> None:
    """Asks XLA for ``n`` host CPU devices, unless ``XLA_FLAGS`` already
    sets a count; call before JAX starts its CPU backend."""
    flags = os.environ.get("XLA_FLAGS", "")
    if _KEY not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {flag(n)}"


def ask_as_a_script(module_name: str, n: int = N_DEVICES) -> None:
    """:func:`ask_for` where ``module_name`` (the caller's ``__name__``) is
    ``"__main__"``: a benchmark run as a script gets ``n`` devices, one
    imported by ``run_all.py`` keeps the process's (``_common.on_devices``
    then measures in a fresh process)."""
    if module_name == "__main__":
        ask_for(n)


def environment(n: int = N_DEVICES) -> dict[str, str]:
    """This process's environment for a fresh one on ``n`` CPU devices."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {flag(n)}"
    env["JAX_PLATFORMS"] = "cpu"
    return env
