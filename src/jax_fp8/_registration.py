"""Loads the compiled FFI handlers and registers them with XLA, once, at import.

The CPU module never links CUDA. The CUDA module links the CUDA runtime statically
and is imported only when present, so a CPU-only machine (no driver, no libcudart)
imports jax_fp8 and runs the CPU kernel even from a CUDA-enabled build.
"""

from __future__ import annotations

import importlib

import jax
import jax.export  # noqa: F401  (jax.export.DisabledSafetyCheck)

FFI_TARGET = "jax_fp8_update"
# Every custom-call target the library emits (the CUDA-only ones on GPUs).
FFI_TARGETS = ("jax_fp8_update", "jax_fp8_transpose_bytes", "jax_fp8_quantize_transpose")


def _register(module_name: str, platform: str):
    try:
        module = importlib.import_module(f"jax_fp8.{module_name}")
    except ImportError as err:  # not built, or its shared libraries are missing
        return None, str(err)
    for name, capsule in module.registrations().items():
        jax.ffi.register_ffi_target(name, capsule, platform=platform)
    return module, None


CPU_MODULE, CPU_IMPORT_ERROR = _register("_jax_fp8_cpu", "cpu")
CUDA_MODULE, CUDA_IMPORT_ERROR = _register("_jax_fp8_cuda", "CUDA")
HAS_CPU_KERNEL = CPU_MODULE is not None
HAS_CUDA_KERNEL = CUDA_MODULE is not None


def export_disabled_checks() -> list:
    """The ``disabled_checks`` that ``jax.export.export`` needs for programs using jax_fp8.

    jax.export refuses custom calls it does not know to be stable; jax_fp8's are stable
    within a jax_fp8 release. A deserialized program runs where ``import jax_fp8`` has
    registered the kernels::

        exp = jax.export.export(jax.jit(step),
                                disabled_checks=jax_fp8.export_disabled_checks())(*args)
    """
    return [jax.export.DisabledSafetyCheck.custom_call(t) for t in FFI_TARGETS]
