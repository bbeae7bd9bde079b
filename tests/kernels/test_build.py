"""The package under test is the built one: its kernels were compiled and registered.

Guards against testing the jnp fallback by accident (e.g. the source tree's
jax_fp8/, which has no compiled modules, shadowing the installed package).
"""

import os
import shutil

import pytest

import jax_fp8
from jax_fp8 import _registration
from jax_fp8._primitives import base


def _on(platform):
    return {t.name for t in _registration.TARGETS.values() if platform in t.platforms}


def test_cpu_kernel_is_built_and_registered():
    assert jax_fp8.HAS_CPU_KERNEL, _registration.CPU_IMPORT_ERROR
    assert _registration.CPU_TARGETS == _on("cpu")
    assert "jax_fp8_update" in _registration.CPU_TARGETS


def test_target_table_matches_the_primitives():
    """ffi/module.cc's table and the primitives' declared kernels name the same targets on
    the same platforms, and every target is exported."""
    assert _registration.FFI_TARGETS, "the table is read from the built module"
    for target in _registration.TARGETS.values():
        spec = base.SPECS[target.name]
        assert set(spec.kernels) == set(target.platforms), target
        assert target.cuda_kernel.endswith("Kernel"), target
    declared = {name for name, spec in base.SPECS.items() if spec.kernels}
    assert declared == set(_registration.FFI_TARGETS)
    assert set(base.kernels_on("cpu")) == _registration.CPU_TARGETS
    assert {str(c) for c in jax_fp8.export_disabled_checks()} == {
        f"custom_call:{name}" for name in _registration.FFI_TARGETS}


def test_cuda_kernel_is_built_where_asked():
    # .ci/run builds and tests with JAX_FP8_CUDA=ON (nvcc on PATH, no GPU), so CUDA compile
    # errors must have failed the install; here the module must import (static CUDA
    # runtime: no GPU needed). AUTO builds it only where a GPU or architectures were found.
    if os.environ.get("JAX_FP8_CUDA", "AUTO").upper() != "ON" or shutil.which("nvcc") is None:
        pytest.skip("JAX_FP8_CUDA=ON not set (or no nvcc on PATH): the CUDA module may not "
                    "be built")
    assert jax_fp8.HAS_CUDA_KERNEL, _registration.CUDA_IMPORT_ERROR
    assert _registration.CUDA_TARGETS == _on("cuda") == set(_registration.FFI_TARGETS)
