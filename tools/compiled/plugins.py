"""The jax CUDA plugin wheels and ``libtpu`` the compiled-program checks and
benchmarks compile with, installed into a cache folder, and the
environment of a process that compiles with them (no GPU or TPU needed).

``ensure_site`` installs the jax CUDA plugin wheels of the installed
jaxlib's version (``jax-cuda13-pjrt``, ``jax-cuda13-plugin``) and the
``libtpu`` that jax's ``tpu`` extra pins into one subfolder of the cache
per jaxlib and Python version (reruns reuse it); ``environment`` sets
``JAX_PLATFORMS=cpu JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1`` and puts that
folder on ``PYTHONPATH``.
"""

from __future__ import annotations

import importlib.metadata
import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
SKIP = "test-gpu-compile: skipped:"


def wheels() -> list[str]:
    """The requirements to install: the CUDA plugin of jaxlib's version and
    libtpu as jax's ``tpu`` extra pins it."""
    jaxlib = importlib.metadata.version("jaxlib")
    reqs = [f"jax-cuda13-pjrt=={jaxlib}", f"jax-cuda13-plugin=={jaxlib}"]
    for req in importlib.metadata.requires("jax") or []:
        m = re.match(r"libtpu\s*([^;]*);.*extra\s*==\s*['\"]tpu['\"]", req)
        if m:
            reqs.append(f"libtpu{m.group(1).strip()}")
    return reqs


def ensure_site(cache: pathlib.Path) -> pathlib.Path | str:
    """The folder holding the wheels (installed there if missing), or the
    reason it could not be made."""
    jaxlib = importlib.metadata.version("jaxlib")
    tag = f"jaxlib-{jaxlib}-py{sys.version_info[0]}{sys.version_info[1]}"
    site = cache / tag
    stamp = site / ".installed"
    reqs = wheels()
    if stamp.exists() and stamp.read_text() == "\n".join(reqs):
        return site
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps"]
    cmd += ["--disable-pip-version-check", "--target", str(site), *reqs]
    print("test-gpu-compile: installing", " ".join(reqs), "into", site)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        errors = [ln for ln in proc.stderr.splitlines() if "ERROR" in ln]
        return "pip could not install them: " + (
            " / ".join(errors[:2]) or proc.stderr.strip()[-300:]
        )
    stamp.write_text("\n".join(reqs))
    return site


def environment(site: pathlib.Path) -> dict[str, str]:
    env = dict(os.environ)
    path = [str(ROOT), str(site), env.get("PYTHONPATH", "")]
    env.update(
        JAX_PLATFORMS="cpu",
        JAX_SKIP_CUDA_CONSTRAINTS_CHECK="1",
        OPTAXACCUM_GPU_COMPILE="1",
        PYTHONPATH=os.pathsep.join(p for p in path if p),
        # libtpu asks the environment which TPU it runs on (there is none)
        # and, by default, lets one process at a time load it.
        TPU_SKIP_MDS_QUERY="1",
        ALLOW_MULTIPLE_LIBTPU_LOAD="1",
    )
    return env
