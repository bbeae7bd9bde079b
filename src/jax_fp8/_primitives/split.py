"""A float32 vector split into consecutive pieces, each its own buffer: how a packed FP8
state hands each layer its scales.

``split_rows(a, sizes)`` is ``[a[0:n0], a[n0:n0+n1], ...]``, as one custom call: on CUDA
one launch (ffi/split_cuda.cu), on the CPU copies (ffi/split_cpu.cc). XLA's slices would
be one small fusion per state for the scales cuBLASLt's FP8 GEMMs take by pointer, each
also autotuned on a GPU, and hundreds of users of one operand on the CPU. Other
platforms, and a jit over several devices (whose partitioner handles slices), lower to
the slices themselves; the bits are a copy's everywhere.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.core import ShapedArray
from jax.interpreters import ad

from jax_fp8._primitives import base


def _abstract_eval(a: ShapedArray, *, sizes: tuple[int, ...]) -> list[ShapedArray]:
    if a.ndim != 1 or a.dtype != np.float32 or sum(sizes) != a.shape[0] or min(sizes) < 0:
        raise TypeError(f"jax_fp8_split_rows: takes float32[R] and sizes summing to R, got "
                        f"{a.dtype}{list(a.shape)} and {sizes}")
    # ShapedArray.update is unannotated in JAX.
    return [a.update(shape=(n,), weak_type=False) for n in sizes]  # type: ignore[no-untyped-call]


def _slices(a: jax.Array, *, sizes: Sequence[int]) -> list[jax.Array]:
    out, start = [], 0
    for n in sizes:
        out.append(lax.slice_in_dim(a, start, start + n))
        start += n
    return out


def _transpose(cts: Sequence[Any], a: Any, *, sizes: tuple[int, ...], implementation: str,
               ) -> list[jax.Array]:
    del a, implementation
    pieces = [jnp.zeros((n,), np.float32) if type(ct) is ad.Zero else ct
              for ct, n in zip(cts, sizes)]
    return [jnp.concatenate(pieces)]


def _refuses(a: ShapedArray, *, sizes: tuple[int, ...]) -> str | None:
    """Splits the kernels leave to XLA's slices, and why (the one decision of which runs)."""
    del a
    if len(sizes) < 2:
        return "one piece: the slice is the vector itself"
    if sum(sizes) >= 2 ** 31:
        return "2**31 rows or more: the kernels' offsets are int32"
    return None


_KERNEL = base.Kernel(lambda ctx, a, *, sizes: jax.ffi.ffi_lowering("jax_fp8_split_rows")(ctx, a),
                      refuses=_refuses)
# A split is linear: its tangents are split the same way, its cotangents concatenated.
split_rows_p = base.register(base.Spec(
    "jax_fp8_split_rows", _abstract_eval, _slices, multiple_results=True, batch="reference",
    jvp="linear", transpose=_transpose, kernels={"cpu": _KERNEL, "cuda": _KERNEL}))


def split_rows(a: jax.Array, sizes: Iterable[int]) -> list[jax.Array]:
    """a float32 [R] -> [a[0:n0], a[n0:n0 + n1], ...] for sizes (n0, n1, ...) summing to R
    (the primitive: its kernel or slices, as `base.decide` says); other arrays (dtype,
    rank), which are not the primitive's operands, are split with lax.slice_in_dim along
    axis 0."""
    sizes = tuple(int(n) for n in sizes)
    if getattr(a, "ndim", None) != 1 or jnp.result_type(a) != np.float32 or not sizes:
        return _slices(a, sizes=sizes)
    return cast("list[jax.Array]", split_rows_p.bind(a, sizes=sizes))
