"""``make test-gpu-compile``: the compiled-program checks, without a GPU or TPU.

Installs the jax CUDA plugin wheels of the installed jaxlib's version
(``jax-cuda13-pjrt``, ``jax-cuda13-plugin``) and the ``libtpu`` that jax's
``tpu`` extra pins into a cache folder (``--cache``, one subfolder per
jaxlib and Python version; reruns reuse it), then runs the tests marked
``gpu_compile`` in a pytest process of their own with
``JAX_PLATFORMS=cpu JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1`` and that folder on
``PYTHONPATH``. Where the package registry cannot serve the wheels it says
why and exits 0.

Run: ``python tests/gpu_compile/run.py [--cache DIR] [pytest args...]``,
with the Python whose jax is to be checked.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script: the repository's tools/
    sys.path.insert(0, str(ROOT))

from tools.compiled.plugins import SKIP, ensure_site, environment  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cache", default=str(ROOT / "build" / "gpu-compile"))
    args, pytest_args = parser.parse_known_args(argv)
    try:
        site = ensure_site(pathlib.Path(args.cache))
    except importlib.metadata.PackageNotFoundError as err:
        site = f"{err} is not installed"
    if isinstance(site, str):
        print(SKIP, site)
        return 0
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider"]
    cmd += ["-m", "gpu_compile", "-o", "addopts=-ra", *pytest_args]
    cmd += [str(ROOT / "tests" / "gpu_compile")]
    return subprocess.call(cmd, cwd=ROOT, env=environment(site))


if __name__ == "__main__":
    sys.exit(main())
