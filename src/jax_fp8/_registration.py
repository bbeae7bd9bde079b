"""Loads the compiled FFI handlers and registers them with XLA, once, at import.

The table of targets is ffi/module.cc's, read back from the built modules: each target's
name, the platforms with a handler and the CUDA kernel it launches. The CPU module never
links CUDA. The CUDA module links the CUDA runtime statically and is imported only when
present, so a CPU-only machine (no driver, no libcudart) imports jax_fp8 and runs the
CPU kernel even from a CUDA-enabled build.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from typing import Any

import jax
import jax.export  # noqa: F401  (jax.export.DisabledSafetyCheck)


@dataclasses.dataclass(frozen=True)
class Target:
    """One row of ffi/module.cc's table: a custom-call target, the platforms ("cpu",
    "cuda") a full build has a handler for, and the CUDA kernel it launches."""
    name: str
    platforms: tuple[str, ...]
    cuda_kernel: str


def _register(module_name: str, platform: str) -> tuple[Any, str | None, frozenset[str]]:
    try:
        module = importlib.import_module(f"jax_fp8.{module_name}")
    except ImportError as err:  # not built, or its shared libraries are missing
        return None, str(err), frozenset()
    targets = module.registrations()
    for name, capsule in targets.items():
        jax.ffi.register_ffi_target(name, capsule, platform=platform)
    return module, None, frozenset(targets)


CPU_MODULE, CPU_IMPORT_ERROR, CPU_TARGETS = _register("_jax_fp8_cpu", "cpu")
CUDA_MODULE, CUDA_IMPORT_ERROR, CUDA_TARGETS = _register("_jax_fp8_cuda", "CUDA")
HAS_CPU_KERNEL = CPU_MODULE is not None
HAS_CUDA_KERNEL = CUDA_MODULE is not None

_BUILT = CPU_MODULE if HAS_CPU_KERNEL else CUDA_MODULE
# Every custom-call target the library emits (none without a built module).
TARGETS = {name: Target(name, tuple(platforms), kernel)
           for name, platforms, kernel in (_BUILT.targets() if _BUILT is not None else ())}
FFI_TARGETS = tuple(TARGETS)


def has_kernel(name: str, platform: str | None) -> bool:
    """Whether this process registered a handler of target `name` for `platform` ("cpu"
    or "cuda"): a module built from older sources may lack one."""
    return platform is not None and name in {"cpu": CPU_TARGETS,
                                             "cuda": CUDA_TARGETS}.get(platform, frozenset())


def export_disabled_checks() -> list[jax.export.DisabledSafetyCheck]:
    """The ``disabled_checks`` that ``jax.export.export`` needs for programs using jax_fp8.

    jax.export refuses custom calls it does not know to be stable; jax_fp8's are stable
    within a jax_fp8 release. A deserialized program runs where ``import jax_fp8`` has
    registered the kernels:

        exp = jax.export.export(jax.jit(step),
                                disabled_checks=jax_fp8.export_disabled_checks())(*args)
    """
    return [jax.export.DisabledSafetyCheck.custom_call(t) for t in FFI_TARGETS]


def local_gpu_capabilities() -> list[str]:
    """The distinct compute capabilities ("9.0", ...) of this process's local GPUs, sorted;
    empty where JAX has no GPU backend. Probed once per process (every gate on the GPUs'
    generation asks this)."""
    return list(_local_gpu_capabilities())


@functools.cache
def _local_gpu_capabilities() -> tuple[str, ...]:
    try:
        gpus = jax.local_devices(backend="gpu")
    except RuntimeError:
        return ()
    return tuple(sorted({str(getattr(d, "compute_capability", "")) for d in gpus}))


def local_gpus_are_sm90() -> tuple[bool, list[str]]:
    """(whether there are local GPUs and every one is SM90 (Hopper), their capabilities):
    the condition of jax_fp8's sm_90a kernels."""
    caps = local_gpu_capabilities()
    return bool(caps) and all(c.split(".")[0] == "9" for c in caps), caps


def cublaslt_path() -> str | None:
    """The libcublasLt.so.* of JAX's CUDA install (the nvidia-cublas wheel), or None.

    ``JAX_FP8_CUBLASLT`` (a path) overrides. Otherwise the wheels' directories under the
    ``nvidia`` namespace package: ``cu13/lib`` (CUDA 13 wheels), ``cublas/lib`` and
    ``cu12/lib`` (CUDA 12), preferring the major version of JAX's CUDA plugin. Only looks
    at files; the library is loaded where jax_fp8_block_gemm is first lowered.
    """
    import glob
    import importlib.util
    import os

    if os.environ.get("JAX_FP8_CUBLASLT"):
        return os.environ["JAX_FP8_CUBLASLT"]
    try:
        roots = list(importlib.import_module("nvidia").__path__)
    except ImportError:
        return None
    found = []
    for root in roots:
        for sub in ("cu13/lib", "cublas/lib", "cu12/lib"):
            found += sorted(glob.glob(os.path.join(root, sub, "libcublasLt.so.*")))
    majors = [m for m in ("13", "12") if importlib.util.find_spec(f"jax_cuda{m}_plugin")]
    for major in majors:
        for path in found:
            if path.endswith(f".so.{major}") or f".so.{major}." in path:
                return path
    return found[0] if found else None
