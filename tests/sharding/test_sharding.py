"""Sharded states on a (4, 2) mesh of 8 host CPU devices, checked in a subprocess.

The pytest process may already have initialised jax with one device, so the
checks run in a fresh interpreter (sharding_worker.py) started with
XLA_FLAGS=--xla_force_host_platform_device_count=8 and JAX_PLATFORMS=cpu; it
reports every check's outcome as JSON, and each test below asserts one of them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import helpers

HERE = os.path.dirname(os.path.abspath(__file__))
PREFIX = "JAX_FP8_SHARDING_RESULTS "
CHECKS = [
    "sharded_update_has_no_collectives_and_one_local_custom_call",
    "sharded_results_equal_single_device_and_reference",
    "donated_sharded_update_aliases_per_device_bytes",
    "sharded_without_amax_and_stack_api",
    "history_axis_sharded_is_still_correct",
    "jnp_implementation_sharded",
]


@pytest.fixture(scope="module")
def sharding_results():
    env = helpers.with_test_path(dict(os.environ))
    flags = env.get("XLA_FLAGS", "")
    env["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=8").strip()
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run([sys.executable, os.path.join(HERE, "sharding_worker.py")],
                          cwd=HERE, env=env, capture_output=True, text=True, timeout=300)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(PREFIX)]
    assert proc.returncode == 0 and lines, (
        f"sharding worker failed (rc={proc.returncode})\nstdout:\n{proc.stdout[-5000:]}\n"
        f"stderr:\n{proc.stderr[-5000:]}")
    return json.loads(lines[-1][len(PREFIX):])


def test_worker_ran_every_check(sharding_results):
    assert sorted(sharding_results) == sorted(CHECKS)


@pytest.mark.parametrize("name", CHECKS)
def test_sharding(sharding_results, name):
    result = sharding_results.get(name, "missing from the worker's report")
    if result != "ok":
        pytest.fail(f"{name}:\n{result}", pytrace=False)
