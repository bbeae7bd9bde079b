"""The 16-bit grouped GEMM primitive `jax_fp8_ragged_dot`: ``jax.lax.ragged_dot`` (a
mixture-of-experts layer's G GEMMs without FP8) and the two products of its gradients, so that
a GPU runs each as one grouped kernel instead of XLA's expansion into a dense product over all
G experts.

One primitive, three products (``mode``), groups of consecutive rows of the token axis M
(sizes int32 [G], clamped in order as `grouped_gemm.clamped_group_ends` clamps them):

* ``FORWARD``: lhs [M, K] . rhs [G, K, N] -> [M, N], each group's rows times its rhs[g];
* ``TRANSPOSED``: lhs [M, K] . rhs [G, N, K] -> [M, N], each group's rows times rhs[g]^T (the
  input gradient of ``FORWARD``);
* ``WEIGHT_GRAD``: lhs [M, K], rhs [M, N] -> [G, K, N], the sum over each group's rows r of
  lhs[r]^T rhs[r] (the weight gradient, ragged along its contraction).

The numbers: every product of the operands summed in float32 (in an order the implementation
picks), one rounding to ``out_dtype``; rows past the groups are 0 (``FORWARD``,
``TRANSPOSED``) and so is an empty group's product (``WEIGHT_GRAD``). The reference is
``jax.lax.ragged_dot_general`` with float32 accumulation, then the rounding. Each product is
bilinear: its JVP and transposes are the other two products (so ``jax.grad``, ``jax.jvp`` and
their compositions stay on the kernel), and under ``jax.vmap`` it is the vmapped reference.

On CUDA the kernel (ffi/ragged_dot_cuda.cc: CUTLASS's SM90 ptr-array grouped GEMM,
ffi/ragged_dot_sm90.cuh) reads the sizes on the device (no host synchronization); it takes
bfloat16 operands and output, K % 8 == 0 and N % 8 == 0 (ffi/ragged_dot_limits.h), and a
float32 output for ``WEIGHT_GRAD`` (the per-device partial sums below). Elsewhere the
reference runs, and ``explain`` says why.

Under a jit over several devices (and on meshes with Explicit axes, `PARTITIONING`) each
device runs the kernel on the rows of the token axis it holds, the global groups clamped to
them on the device: ``FORWARD`` and ``TRANSPOSED`` keep M's sharding (G and the contraction
gathered); ``WEIGHT_GRAD`` sums each device's float32 partial products with one float32
all-reduce and rounds once. On a mesh with Explicit axes the primitive runs per device under
``shard_map``, and JAX differentiates it there: the weight gradient of ``FORWARD`` is then
each device's product rounded to the weight's dtype, summed by one all-reduce (as XLA's own
sharded ``dot_general`` does), not one rounding of the float32 sum.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.core import ShapedArray
from jax.interpreters import ad, mlir
from jax.sharding import NamedSharding, PartitionSpec
from jax.typing import DTypeLike

from jax_fp8 import _registration
from jax_fp8._primitives import axis_types, base, grouped_gemm as gg, partition_specs as specs

TARGET = "jax_fp8_ragged_dot"
FORWARD, TRANSPOSED, WEIGHT_GRAD = 0, 1, 2
MODES = (FORWARD, TRANSPOSED, WEIGHT_GRAD)
IMPLEMENTATIONS = ("auto", "jnp")
_FLOAT = (np.dtype(jnp.bfloat16), np.dtype(np.float16), np.dtype(np.float32),
          np.dtype(np.float64))
# The operand and output types each product's kernel takes (ffi/ragged_dot_limits.h and the
# configurations compiled: ragged_dot_configs).
_KERNEL_TYPES = {
    FORWARD: ((np.dtype(jnp.bfloat16), np.dtype(jnp.bfloat16)),),
    TRANSPOSED: ((np.dtype(jnp.bfloat16), np.dtype(jnp.bfloat16)),),
    WEIGHT_GRAD: ((np.dtype(jnp.bfloat16), np.dtype(jnp.bfloat16)),
                  (np.dtype(jnp.bfloat16), np.dtype(np.float32))),
}


def _shapes(lhs: Any, rhs: Any, groups: int, mode: int) -> tuple[int, int, int, int]:
    """(m, k, n, g) of the product, or raises naming the shapes it needs."""
    need = {FORWARD: "lhs [M, K] and rhs [G, K, N]", TRANSPOSED: "lhs [M, K] and rhs [G, N, K]",
            WEIGHT_GRAD: "lhs [M, K] and rhs [M, N]"}[mode]
    bad = ValueError(f"{TARGET}: mode {mode} needs {need}, got {list(lhs.shape)} and "
                     f"{list(rhs.shape)}")
    if lhs.ndim != 2 or rhs.ndim != (2 if mode == WEIGHT_GRAD else 3):
        raise bad
    m, k = lhs.shape
    if mode == WEIGHT_GRAD:
        if rhs.shape[0] != m:
            raise bad
        return m, k, rhs.shape[1], groups
    g, a, b = rhs.shape
    if (a if mode == FORWARD else b) != k:
        raise bad
    return m, k, (b if mode == FORWARD else a), g


def _abstract_eval(lhs: ShapedArray, rhs: ShapedArray, group_sizes: ShapedArray, *, mode: int,
                   out_dtype: np.dtype) -> ShapedArray:
    if mode not in MODES:
        raise ValueError(f"{TARGET}: mode must be one of {MODES}, got {mode!r}")
    for label, x in (("lhs", lhs), ("rhs", rhs)):
        if np.dtype(x.dtype) not in _FLOAT:
            raise TypeError(f"{TARGET}: {label} must be a floating-point array (bfloat16, "
                            f"float16, float32, float64), got {x.dtype}")
    if np.dtype(out_dtype) not in _FLOAT:
        raise TypeError(f"{TARGET}: out_dtype must be floating point, got {out_dtype}")
    if group_sizes.ndim != 1 or group_sizes.dtype != np.int32:
        raise ValueError(f"{TARGET}: group_sizes must be int32[G], got "
                         f"{group_sizes.dtype}{list(group_sizes.shape)}")
    m, k, n, g = _shapes(lhs, rhs, group_sizes.shape[0], mode)
    if mode != WEIGHT_GRAD and g != group_sizes.shape[0]:
        raise ValueError(f"{TARGET}: group_sizes must be int32[{g}] (one size per group of "
                         f"rhs), got {group_sizes.dtype}{list(group_sizes.shape)}")
    if m > gg.MAX_ROWS:
        raise ValueError(f"{TARGET}: M = {m} rows exceed int32 group sizes")
    shape = (g, k, n) if mode == WEIGHT_GRAD else (m, n)
    sharding = getattr(lhs, "sharding", None)
    # PartitionSpec's constructor and ShapedArray.update are unannotated in JAX.
    extra = {} if sharding is None or mode != WEIGHT_GRAD else {
        "sharding": NamedSharding(sharding.mesh, PartitionSpec())}  # type: ignore[no-untyped-call]
    return cast(ShapedArray, lhs.update(  # type: ignore[no-untyped-call]
        shape=shape, dtype=np.dtype(out_dtype), weak_type=False, **extra))


def _numbers(mode: int) -> lax.RaggedDotDimensionNumbers:
    # lax.RaggedDotDimensionNumbers' constructor is unannotated in JAX.
    if mode == WEIGHT_GRAD:
        return lax.RaggedDotDimensionNumbers(  # type: ignore[no-untyped-call]
            dot_dimension_numbers=(((0,), (0,)), ((), ())), lhs_ragged_dimensions=(0,),
            rhs_group_dimensions=())
    return lax.RaggedDotDimensionNumbers(  # type: ignore[no-untyped-call]
        dot_dimension_numbers=(((1,), (1 if mode == FORWARD else 2,)), ((), ())),
        lhs_ragged_dimensions=(0,), rhs_group_dimensions=(0,))


def reference(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *, mode: int,
              out_dtype: np.dtype) -> jax.Array:
    """The module's numbers in jax.numpy: ``jax.lax.ragged_dot_general`` of the clamped
    sizes, float32 accumulation (float64 for float64 operands), one rounding. Where rhs has
    an infinite or NaN weight (``FORWARD``, ``TRANSPOSED``), each group's rows come from its
    own dense product: jax's ragged_dot masks the rows of lhs, not the products, so such a
    weight of one expert would reach every group's rows as 0 * inf = NaN."""
    m = lhs.shape[0]
    g = group_sizes.shape[0]
    acc_type = jnp.result_type(lhs.dtype, rhs.dtype, np.float32)
    if g == 0 or m == 0:
        shape = _abstract_eval(jax.typeof(lhs), jax.typeof(rhs), jax.typeof(group_sizes),
                               mode=mode, out_dtype=out_dtype).shape
        return jnp.zeros(shape, out_dtype)
    ends = gg.clamped_group_ends(group_sizes, m)
    sizes = jnp.diff(ends, prepend=jnp.zeros((1,), jnp.int32))

    def ragged(_: None) -> jax.Array:
        return lax.ragged_dot_general(lhs, rhs, sizes, _numbers(mode),
                                      preferred_element_type=acc_type)

    if mode == WEIGHT_GRAD:   # both operands masked per group: a NaN stays in its group
        return ragged(None).astype(out_dtype)
    group = gg.row_groups(ends, m)
    contract = 1 if mode == FORWARD else 2

    def per_group(_: None) -> jax.Array:
        def body(i: jax.Array, acc: jax.Array) -> jax.Array:
            prod = lax.dot_general(lhs, rhs[i], (((1,), (contract - 1,)), ((), ())),
                                   preferred_element_type=acc_type)
            return jnp.where((group == i)[:, None], prod, acc)
        n = rhs.shape[2] if mode == FORWARD else rhs.shape[1]
        init = axis_types.vary_like([jnp.zeros((m, n), acc_type), lhs, rhs])[0]
        return cast(jax.Array, lax.fori_loop(0, g, body, init))

    acc = lax.cond(jnp.all(jnp.isfinite(rhs)), ragged, per_group, None)
    return cast(jax.Array, acc.astype(out_dtype))


# ---------------------------------------------------------------------------- the kernel

def kernel_configs() -> tuple[str, ...]:
    """Names of the configurations compiled into the CUDA module."""
    return gg.compiled_configs("ragged_dot_configs")


@functools.cache
def kernel_status() -> tuple[bool, str]:
    """(whether the kernel can run in this process, why not)."""
    return gg.cutlass_status(kernel_configs(), "grouped GEMM")


def kernel_supports(lhs: Any, rhs: Any, group_sizes: Any, *, mode: int,
                    out_dtype: DTypeLike) -> bool:
    """Whether the kernel takes this product (abstract values or anything with shape and
    dtype): the types compiled and ffi/ragged_dot_limits.h's RaggedDotSupports."""
    module = _registration.CUDA_MODULE or _registration.CPU_MODULE
    if module is None or not hasattr(module, "ragged_dot_supports"):
        return False
    in_type, out = np.dtype(lhs.dtype), np.dtype(out_dtype)
    if np.dtype(rhs.dtype) != in_type or (in_type, out) not in _KERNEL_TYPES[mode]:
        return False
    m, k, n, g = _shapes(lhs, rhs, group_sizes.shape[0], mode)
    return cast(bool, module.ragged_dot_supports(mode, in_type.name, out.name, int(m), int(k),
                                                 int(n), int(g)))


def _refuses(lhs: ShapedArray, rhs: ShapedArray, group_sizes: ShapedArray, *, mode: int,
             out_dtype: np.dtype) -> str | None:
    ok, why = kernel_status()
    if not ok:
        return why
    if not kernel_supports(lhs, rhs, group_sizes, mode=mode, out_dtype=out_dtype):
        return ("the grouped GEMM kernel does not take these operands (it takes bfloat16 lhs "
                "and rhs into bfloat16, or float32 for the weight gradient, K % 8 == 0, "
                "N % 8 == 0, 1 <= G <= 2**20)")
    return None


def _ffi_ragged_dot(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *, mode: int,
                    out_dtype: np.dtype) -> jax.Array:
    shape = _abstract_eval(jax.typeof(lhs), jax.typeof(rhs), jax.typeof(group_sizes),
                           mode=mode, out_dtype=out_dtype).shape
    g = group_sizes.shape[0]
    # jax.ShapeDtypeStruct's constructor is unannotated in JAX.
    call = jax.ffi.ffi_call(TARGET, (
        jax.ShapeDtypeStruct(shape, out_dtype),  # type: ignore[no-untyped-call]
        jax.ShapeDtypeStruct((gg.workspace_bytes(g),), jnp.uint8)))  # type: ignore[no-untyped-call]
    out, _ = call(lhs, rhs, group_sizes, mode=np.int64(mode))
    return out


def _kernel_lowering(ctx: Any, *operands: Any, **params: Any) -> Any:
    return mlir.lower_fun(functools.partial(_ffi_ragged_dot, **params),
                          multiple_results=False)(ctx, *operands)


# ----------------------------------------------------------------------- differentiation
# Bilinear in (lhs, rhs): the JVP is the product of each tangent with the other primal, and
# each product's transposes are the other two products.

def _transpose(ct: Any, lhs: Any, rhs: Any, group_sizes: Any, *, mode: int,
               out_dtype: np.dtype, implementation: str) -> list[Any]:
    del out_dtype
    # ad.is_undefined_primal is unannotated in JAX.
    if type(ct) is ad.Zero:
        return [None if not ad.is_undefined_primal(x) else ad.Zero(x.aval)  # type: ignore[no-untyped-call]
                for x in (lhs, rhs)] + [None]
    kw = {"implementation": implementation}
    ct_lhs = ct_rhs = None
    if ad.is_undefined_primal(lhs):  # type: ignore[no-untyped-call]
        lhs_dtype = lhs.aval.dtype
        if mode == FORWARD:        # [M, N] . rhs[g]^T ([G, K, N] read as [G, N', K'])
            ct_lhs = ragged_dot_p.bind(ct, rhs, group_sizes, mode=TRANSPOSED,
                                       out_dtype=lhs_dtype, **kw)
        elif mode == TRANSPOSED:   # [M, N] . rhs[g] ([G, N, K] read as [G, K', N'])
            ct_lhs = ragged_dot_p.bind(ct, rhs, group_sizes, mode=FORWARD,
                                       out_dtype=lhs_dtype, **kw)
        else:                      # rhs [M, N] . ct[g]^T ([G, K, N])
            ct_lhs = ragged_dot_p.bind(rhs, ct, group_sizes, mode=TRANSPOSED,
                                       out_dtype=lhs_dtype, **kw)
    if ad.is_undefined_primal(rhs):  # type: ignore[no-untyped-call]
        rhs_dtype = rhs.aval.dtype
        if mode == FORWARD:        # sum over each group's rows of lhs^T ct
            ct_rhs = ragged_dot_p.bind(lhs, ct, group_sizes, mode=WEIGHT_GRAD,
                                       out_dtype=rhs_dtype, **kw)
        elif mode == TRANSPOSED:   # sum over each group's rows of ct^T lhs
            ct_rhs = ragged_dot_p.bind(ct, lhs, group_sizes, mode=WEIGHT_GRAD,
                                       out_dtype=rhs_dtype, **kw)
        else:                      # lhs [M, K] . ct[g] ([G, K, N])
            ct_rhs = ragged_dot_p.bind(lhs, ct, group_sizes, mode=FORWARD,
                                       out_dtype=rhs_dtype, **kw)
    return [ct_lhs, ct_rhs, None]


def _jvp(primals: Sequence[Any], tangents: Sequence[Any],
         **params: Any) -> tuple[Any, Any]:
    lhs, rhs, group_sizes = primals
    out = ragged_dot_p.bind(lhs, rhs, group_sizes, **params)
    terms = []
    if type(tangents[0]) is not ad.Zero:
        terms.append(ragged_dot_p.bind(tangents[0], rhs, group_sizes, **params))
    if type(tangents[1]) is not ad.Zero:
        terms.append(ragged_dot_p.bind(lhs, tangents[1], group_sizes, **params))
    if not terms:
        return out, ad.Zero(jax.typeof(out).to_tangent_aval())
    return out, functools.reduce(jnp.add, terms)


# ----------------------------------------------------------------------- partitioning
# Each device runs the kernel on the rows of the token axis it holds, the global groups
# clamped to them (computed on the device, as the FP8 grouped GEMM's rule does).

def _m_entry(mesh: jax.sharding.Mesh, x: Any) -> Any:
    entry = specs.padded_spec(x.sharding, x.ndim)[0]
    axes = specs.spec_axes(entry)
    if not axes or x.shape[0] % specs.axes_size(mesh, axes):
        return None
    return entry


def _shardings(params: dict[str, Any], mesh: jax.sharding.Mesh, arg_shapes: Sequence[Any],
               ) -> tuple[tuple[NamedSharding, ...], NamedSharding]:
    lhs, rhs = arg_shapes[:2]
    # PartitionSpec's constructor is unannotated in JAX.
    named: Callable[..., NamedSharding] = \
        lambda *spec: NamedSharding(mesh, PartitionSpec(*spec))  # type: ignore[no-untyped-call]  # noqa: E731
    m = _m_entry(mesh, lhs)
    if params["mode"] == WEIGHT_GRAD:
        return (named(m, None), named(m, None), named()), named(None, None, None)
    return (named(m, None), named(), named()), named(m, None)


def _local(bind: Callable[..., Any], operands: Sequence[jax.Array], *,
           mesh: jax.sharding.Mesh, shardings: Sequence[NamedSharding],
           params: dict[str, Any]) -> Any:
    lhs, rhs, group_sizes = operands
    m_axes = specs.spec_axes(specs.padded_spec(shardings[0], 2)[0])
    if not m_axes:
        return bind(*operands, **params)
    local_m = lhs.shape[0]
    local = gg.local_group_sizes(group_sizes, local_m, mesh, m_axes)
    if params["mode"] != WEIGHT_GRAD:
        return bind(lhs, rhs, local, **params)
    acc = bind(lhs, rhs, local, **dict(params, out_dtype=np.dtype(np.float32)))
    return lax.psum(acc, m_axes).astype(params["out_dtype"])  # type: ignore[no-untyped-call]  # unannotated in JAX


def _rule(params: dict[str, Any], operand_types: Sequence[Any],
          ) -> tuple[str, dict[str, Any]]:
    del operand_types
    if params["mode"] == WEIGHT_GRAD:
        return "m k, m n, g -> g k n", {"reduction_factors": ("m",)}
    rhs = "g k n" if params["mode"] == FORWARD else "g n k"
    return f"m k, {rhs}, g -> m n", {"need_replication_factors": ("k", "g")}


PARTITIONING = base.Partitioning(_shardings, _rule, local=_local, explicit=True)

ragged_dot_p = base.register(base.Spec(
    TARGET, _abstract_eval, reference, cache_reference=True, jvp="zero", batch="reference",
    kernels={"cuda": base.Kernel(_kernel_lowering, refuses=_refuses)}, same_varying=True,
    partitioning=PARTITIONING))
ad.primitive_jvps[ragged_dot_p] = _jvp
ad.primitive_transposes[ragged_dot_p] = _transpose


def ragged_product(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *, mode: int,
                   out_dtype: DTypeLike, implementation: str = "auto") -> jax.Array:
    """Binds the primitive (the module docstring's products and numbers).

    implementation: "auto" (the CUDA kernel where it is built and takes the operands, else
    the reference) or "jnp" (the reference).
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"{TARGET}: implementation must be one of {IMPLEMENTATIONS}, got "
                         f"{implementation!r}")
    return cast(jax.Array, ragged_dot_p.bind(lhs, rhs, group_sizes, mode=int(mode),
                                             out_dtype=np.dtype(out_dtype),
                                             implementation=implementation))
