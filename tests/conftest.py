"""Test configuration shared by every test module.

As in equinox's test suite: rank promotion raises, and the CPU backend exposes
several devices so that ``pmap``/``shard_map`` tests run on one machine. The
device count must be set before any test touches the backend, which is why it
lives here and not in the tests.
"""

import os

import jax

NUM_CPU_DEVICES = 8

jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_num_cpu_devices", NUM_CPU_DEVICES)
os.environ.setdefault("MPLBACKEND", "Agg")
