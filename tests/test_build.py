"""The package under test is the built one: its kernels were compiled and registered.

Guards against testing the jnp fallback by accident (e.g. the source tree's
jax_fp8/, which has no compiled modules, shadowing the installed package).
"""

import os
import shutil

import jax_fp8


def test_cpu_kernel_is_built_and_registered():
    assert jax_fp8.HAS_CPU_KERNEL, jax_fp8._registration.CPU_IMPORT_ERROR
    assert jax_fp8._registration.CPU_TARGETS == {"jax_fp8_update", "jax_fp8_split_rows"}


def test_cuda_kernel_is_built_where_nvcc_is():
    # .ci/run builds with nvcc on PATH, so CUDA compile errors must have failed the
    # install; here the module must import (static CUDA runtime: no GPU needed).
    if os.environ.get("JAX_FP8_CUDA", "AUTO").upper() == "OFF" or shutil.which("nvcc") is None:
        return
    assert jax_fp8.HAS_CUDA_KERNEL, jax_fp8._registration.CUDA_IMPORT_ERROR
    assert jax_fp8._registration.CUDA_TARGETS == set(jax_fp8._registration.FFI_TARGETS)
