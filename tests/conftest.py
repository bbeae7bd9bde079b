"""Shared fixtures: which backends the kernel tests run on, and a guard that the
NumPy reference keeps IEEE subnormals for the whole session; the import path.

The tests are grouped in folders by area (kernels/, recipes/, flax_models/, equinox_models/,
moe/, sharding/, training/, tools/); the modules they share (helpers, buffers, the NumPy
references) are here. Every folder is put on sys.path (helpers.TEST_DIRS), so any module
under tests/ imports another by its basename, whether pytest runs tests/ or one file;
basenames are unique across tests/.

Kernel tests take the `backend` fixture (or `device`), parametrized over "cpu"
(always) and "gpu" (marked `gpu`; it runs when jax has a GPU device *and* the
CUDA kernel was built, and skips cleanly otherwise). Computations follow their
data: inputs are `jax.device_put` on the chosen device, and a jitted function
runs there (see helpers.run_on).
"""

from __future__ import annotations

import os
import pathlib
import shutil
import sys
import tempfile

import jax
import pytest

import helpers
import ieee_reference

# pytest put this folder on sys.path to import this file; the others go on here, before
# any test module is imported.
sys.path[:0] = [d for d in helpers.TEST_DIRS if d not in sys.path]



# XLA's persistent compilation cache, one per run, shared by the pytest-xdist workers and
# the fresh processes the long cases start (both inherit the environment): many cases
# compile a program another case already compiled (one model under several
# parametrizations, the reference beside each converted step), and XLA's compile is most of
# a case's time. A hit is keyed by the program's text, jax's version and XLA's flags: the
# executable XLA would build. The run's controller makes the folder and removes it at the
# end; a JAX_COMPILATION_CACHE_DIR of the caller's is used as it is and kept;
# JAX_FP8_TEST_XLA_CACHE=0 switches the cache off.
_XLA_CACHE_ENV = "JAX_COMPILATION_CACHE_DIR"
_OWN_XLA_CACHE = None


def _use_xla_cache(config):
    global _OWN_XLA_CACHE
    if os.environ.get("JAX_FP8_TEST_XLA_CACHE", "1") == "0":
        return
    if _XLA_CACHE_ENV not in os.environ and not hasattr(config, "workerinput"):
        _OWN_XLA_CACHE = tempfile.mkdtemp(prefix="jax_fp8_tests_xla_cache_")
        os.environ[_XLA_CACHE_ENV] = _OWN_XLA_CACHE
    if _XLA_CACHE_ENV not in os.environ:    # a worker of a controller that set none
        return
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
    jax.config.update("jax_compilation_cache_dir", os.environ[_XLA_CACHE_ENV])
    jax.config.update("jax_persistent_cache_min_compile_time_secs",
                      float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]))
    jax.config.update("jax_persistent_cache_min_entry_size_bytes",
                      int(os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"]))


def pytest_configure(config):
    _use_xla_cache(config)


def pytest_unconfigure(config):
    if _OWN_XLA_CACHE is not None:
        shutil.rmtree(_OWN_XLA_CACHE, ignore_errors=True)


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False,
                     help="also run tests marked slow (or set JAX_FP8_RUN_SLOW=1)")


def _run_slow(config):
    return config.getoption("--runslow") or os.environ.get("JAX_FP8_RUN_SLOW") == "1"


# The cases marked `long`: tests that run fresh Python processes (the multi-device
# workers but sharding_worker.py's, the examples, the benchmarks' smoke runs, the
# documentation's snippets), each paying an interpreter, jax's import and its compiles,
# the long runs (100,000 updates in a scan) and the property test whose every example
# builds and compiles a model of its own (test_flax_use_patterns.py). README.md's test command
# deselects them (pyproject.toml's addopts: -m "not long"); .ci/run runs them in a step of
# their own (pytest -m long). By file (under tests/), and by test function.
LONG_FILES = frozenset({
    "sharding/test_axis_name.py", "sharding/test_block_sharding.py",
    "sharding/test_codebase_sharding.py", "sharding/test_equinox_fsdp.py",
    "sharding/test_explicit_mesh.py", "sharding/test_fsdp.py", "sharding/test_multiprocess.py",
    "sharding/test_equinox_pmap.py", "sharding/test_pmap.py",
    "sharding/test_ragged_dot_sharding.py", "sharding/test_moe_sharding.py",
    "sharding/test_grouped_wgrad_sharding.py",
    "sharding/test_sequence_sharding.py",
    "sharding/test_tensor_parallel.py",
    "tools/test_bench_llm_smoke.py", "tools/test_bench_multigpu_smoke.py",
    "tools/test_bench_smoke.py", "tools/test_bench_train_step_smoke.py",
    "tools/test_bench_moe_smoke.py", "tools/test_bench_grouped_gemm_smoke.py",
    "tools/test_examples.py",
    "kernels/test_long_run.py",    # 100,000 updates in a scan against the reference
})
LONG_FUNCTIONS = frozenset({
    "test_snippet_runs_on_its_own", "test_section_runs_as_one_program",   # tools/test_docs.py
    "test_mxfp8_partitions_on_8_devices", "test_eight_devices_equal_one_device",  # recipes/
    # recipes/test_trust.py: trust_worker.py's 8 devices
    "test_shard_map_type_check_sees_a_varying_amax",
    "test_axis_name_reduces_the_staged_amaxes_without_explicit_amaxes",
    "test_sharded_programs_export_and_run_with_the_same_bits",
    # flax_models/test_conversion_cases.py: its 8-device worker
    "test_linen_partitioned_params_under_a_mesh_equal_the_hand_written_model",
    "test_staged_amaxes_are_the_max_over_all_uses",     # flax_models/test_flax_use_patterns.py
})


def _is_long(item) -> bool:
    path = pathlib.Path(str(item.fspath)).resolve()
    relative = path.relative_to(pathlib.Path(helpers.TESTS_DIR).resolve()).as_posix()
    return (relative in LONG_FILES
            or getattr(item, "originalname", item.name) in LONG_FUNCTIONS)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        if _is_long(item):
            item.add_marker(pytest.mark.long)
    skip_gpu = pytest.mark.skip(reason=helpers.GPU_SKIP_REASON)
    skip_slow = pytest.mark.skip(reason="slow: run with --runslow or JAX_FP8_RUN_SLOW=1")
    run_slow = _run_slow(config)
    for item in items:
        if "gpu" in item.keywords and not helpers.HAS_GPU:
            item.add_marker(skip_gpu)
        if "slow" in item.keywords and not run_slow:
            item.add_marker(skip_slow)


@pytest.fixture
def on_cpu():
    """Runs a test on the CPU backend: for tests that pin bits (CPU GEMMs accumulate in one
    order for differently compiled programs, where a GPU's FP8 GEMMs may not, and one E5M2
    rounding flip then moves an amax)."""
    with jax.default_device(jax.devices("cpu")[0]):
        yield


@pytest.fixture(params=sorted(helpers.RECIPES))
def recipe(request):
    """Every registered recipe (helpers.RECIPES), one test each."""
    return helpers.RECIPES[request.param]


@pytest.fixture(params=helpers.BACKENDS)
def backend(request):
    """"cpu", or "gpu" where a GPU and the CUDA kernel are present (skips otherwise)."""
    if request.param == "gpu" and not helpers.HAS_GPU:
        pytest.skip(helpers.GPU_SKIP_REASON)
    return request.param


@pytest.fixture
def device(backend):
    """The first jax device of `backend`."""
    return helpers.backend_device(backend)


@pytest.fixture
def gpu_device():
    """The first GPU device; skips when there is none or no CUDA kernel."""
    if not helpers.HAS_GPU:
        pytest.skip(helpers.GPU_SKIP_REASON)
    return helpers.GPU_DEVICES[0]


@pytest.fixture(autouse=True)
def _numpy_keeps_subnormals():
    """XLA runs its own float32 code with flush-to-zero; it must never leave that
    mode on the Python thread, or the NumPy reference would stop being IEEE."""
    yield
    ieee_reference.assert_no_ftz()
