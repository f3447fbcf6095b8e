"""Test configuration shared by every test module.

As in equinox's test suite: rank promotion raises, and the CPU backend exposes
several devices so that ``pmap``/``shard_map`` tests run on one machine. The
device count must be set before any test touches the backend, which is why it
lives here and not in the tests.
"""

import os

import jax

NUM_CPU_DEVICES = 8
# The scripts that write the saved fixtures run against other versions of
# the code (or compilers): not test modules, and not doctested.
collect_ignore_glob = ["fixtures/*"]

jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_num_cpu_devices", NUM_CPU_DEVICES)
os.environ.setdefault("MPLBACKEND", "Agg")

# References run at full float32 precision on every backend: GPUs default to
# TF32 matrix products (relative errors of 1e-5 to 3e-3), which the
# tolerances of the tests, derived for float32, do not allow for. On CPU
# this changes nothing (float32 products there are already full precision).
jax.config.update("jax_default_matmul_precision", "highest")


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "devices(n): needs n devices of the default backend (a machine with "
        "one GPU has one); skipped with the count where there are fewer",
    )


def pytest_collection_modifyitems(items):
    """Marks the package's docstring examples ``installed``: they run the
    modules as installed (collecting them imports every module)."""
    import pytest

    for item in items:
        if isinstance(item, pytest.DoctestItem):
            item.add_marker(pytest.mark.installed)


def pytest_runtest_setup(item):
    import pytest

    for mark in item.iter_markers("devices"):
        have = len(jax.devices())
        if have < mark.args[0]:
            pytest.skip(
                f"needs {mark.args[0]} devices of the default backend "
                f"({jax.default_backend()}), has {have}"
            )
