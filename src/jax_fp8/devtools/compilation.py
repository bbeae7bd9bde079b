"""What a compile reports besides its HLO text: memory and aliasing, and the program right after
XLA's SPMD partitioner.

Example::

    compiled = jax.jit(step, donate_argnums=0).lower(state).compile()
    compilation.alias_bytes(compiled)    # bytes of outputs that reuse donated inputs
    text = compilation.partitioned(jax.jit(step).lower(sharded_state))
    hlo.collectives(text)                # with the element types the partitioner gave them
"""

from __future__ import annotations

import glob
import os
import secrets
import tempfile
from typing import TYPE_CHECKING, Any

import jax

if TYPE_CHECKING:
    from jax.stages import Compiled, Lowered

__all__ = ["alias_bytes", "compile_partitioned", "memory", "partitioned"]


def memory(compiled: Compiled) -> dict[str, int]:
    """``compiled.memory_analysis()`` as a dict of byte counts (argument, output, alias,
    temp, generated code); empty where the backend does not report it."""
    try:
        stats = compiled.memory_analysis()
    except Exception:  # noqa: BLE001 - not every backend or version reports it
        return {}
    keys = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
            "temp_size_in_bytes", "generated_code_size_in_bytes")
    return {k: int(getattr(stats, k)) for k in keys if getattr(stats, k, None) is not None}


def alias_bytes(compiled: Compiled) -> int | None:
    """Bytes of the outputs that reuse (alias) donated inputs; None where not reported."""
    return memory(compiled).get("alias_size_in_bytes")


def _past_the_persistent_cache() -> dict[str, Any]:
    """Compiler options that make a compile one JAX's persistent compilation cache has
    never seen, where that cache is on: a program it holds comes back without XLA running
    its passes, so nothing would be dumped. The option the cache's key includes only caps
    how many buffers XLA's buffer-assignment debug text lists."""
    if getattr(jax.config, "jax_compilation_cache_dir", None) is None:
        return {}
    return {"xla_debug_buffer_assignment_show_max": 2 ** 20 + secrets.randbelow(2 ** 40)}


def compile_partitioned(lowered: Lowered) -> tuple[Compiled, str]:
    """``(compiled, text)``: ``lowered.compile()`` and, from the same compile, the HLO text
    right after XLA's SPMD partitioner (see `partitioned`), dumped into a temporary
    directory (also where JAX's persistent compilation cache holds the program: this
    compile is keyed apart from it). Raises ValueError for a program that is not
    partitioned (one device)."""
    with tempfile.TemporaryDirectory() as d:
        compiled = lowered.compile(compiler_options={
            "xla_dump_to": d, "xla_dump_hlo_pass_re": "spmd-partitioning",
            **_past_the_persistent_cache()})
        files = sorted(glob.glob(os.path.join(d, "*after_spmd-partitioning*.txt")))
        if not files:
            raise ValueError("the program ran no SPMD partitioner (a one-device program?)")
        with open(files[-1]) as f:
            return compiled, f.read()


def partitioned(lowered: Lowered) -> str:
    """The HLO text of ``lowered`` (a ``jax.jit(f).lower(...)``) right after XLA's SPMD
    partitioner, before the backend's own passes: the collectives the partitioner inserted,
    with the element types the program gives them (e.g. an FP8 weight's all-gather), which
    a backend may change later (XLA:CPU widens FP8 collectives to f16). Compiles the program
    once more (`compile_partitioned`).

    Raises ValueError for a program that is not partitioned (one device)."""
    return compile_partitioned(lowered)[1]
