"""Loads the compiled FFI handlers and registers them with XLA, once, at import.

The CPU module never links CUDA. The CUDA module links the CUDA runtime statically
and is imported only when present, so a CPU-only machine (no driver, no libcudart)
imports jax_fp8 and runs the CPU kernel even from a CUDA-enabled build.
"""

from __future__ import annotations

import importlib

import jax

FFI_TARGET = "jax_fp8_update"


def _register(module_name: str, platform: str) -> tuple[bool, str | None]:
    try:
        module = importlib.import_module(f"jax_fp8.{module_name}")
    except ImportError as err:  # not built, or its shared libraries are missing
        return False, str(err)
    for name, capsule in module.registrations().items():
        jax.ffi.register_ffi_target(name, capsule, platform=platform)
    return True, None


HAS_CPU_KERNEL, CPU_IMPORT_ERROR = _register("_jax_fp8_cpu", "cpu")
HAS_CUDA_KERNEL, CUDA_IMPORT_ERROR = _register("_jax_fp8_cuda", "CUDA")
