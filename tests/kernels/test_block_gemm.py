"""The block-scaled FP8 GEMM primitive against the exact (float64) product of the
dequantized operands, within error bounds derived below; on the GPU the handler's
CUTLASS configurations and cuBLASLt path (SM90, cuBLASLt >= 12.9) and its plain kernel,
with block scales that differ by powers of two from block to block, so that any mix-up of
the scale layouts shows.

Notation: a_ik = qa_ik * sa(i, k // 128), b_jk = qb_jk * sb(j, k // 128) (sa, sb the
scale_inv of each operand's block), E_ij = sum_k a_ik b_jk computed in float64 (the
dequantized operands are exact in float64; its sums are within K 2**-53 S_ij, far below
every bound), S_ij = sum_k |a_ik| |b_jk|, u = 2**-24, u_out the
unit roundoff of the output dtype (2**-24 float32, 2**-8 bfloat16, 2**-11 float16).

* Reference (XLA, float32): the dequantized operands are exact (FP8 times a power of two;
  with other scales each is within u of a_ik, b_jk), then a float32 dot of K products:
  whatever the summation order, |dot - E| <= (K + 2) u S (the classic gamma_K bound, with
  the two operand roundings), then one rounding to the output:
  |out - E| <= (K + 4) u S + u_out |E|.
* cuBLASLt and the CUTLASS configurations (Hopper): each 128-wide K block is summed by
  the FP8 tensor cores, whose accumulator keeps about 14 bits (DeepSeek-V3 report,
  section 3.3.2), then scaled by sa * sb and added in float32 (one promotion per scale
  block; CUTLASS multiplies the block sum by sa and sb, or by their rounded product,
  and adds: at most three roundings of relative u per block). Each of the four K=32
  steps of a block aligns its products and the running sum to the largest exponent and
  keeps about 13 bits below it, an error of at most 2**-12 of the block's sum of
  |products| per step (2**-10 for the block; an H200 reached 2**-10.75 on a weight
  gradient), then (K/128 + 2) u S for the float32 sum over blocks:
  |out - E| <= (2**-10 + (K/128 + 4) u) S + u_out |E|.
  A wrong scale layout multiplies whole blocks by other powers of two: errors of order S.
* The plain CUDA kernel: float32 partials per block and a float32 sum over blocks:
  |out - E| <= (K + K/128 + 4) u S + u_out |E|.

The output rounding, for every path: the GEMM's float32 result y (|y - E| <= coef S) is
rounded once to out_dtype (a float16 output is computed in float32 and cast: the kernels
write float32, XLA converts), |out - y| <= u_out |y| <= u_out (|E| + coef S), so
  |out - E| <= coef (1 + u_out) S + u_out |E|   (+ 2**-25 for float16: see below).
For float16 that is one extra rounding of relative 2**-11, valid while |y| stays in
float16's normal range: below 2**-14 the spacing is 2**-24 (an absolute error of at most
2**-25, added to the bound), and at |y| >= 65520 (65504 + half its spacing) the cast
overflows to +-inf, as IEEE's float32 -> float16 conversion must. The random operands
below have block scales spread over 2**-6 .. 2**6 per operand, so |E| reaches 2**26:
float16 cases are brought into range by a power-of-two shift of both operands' scales
(`fit_float16`: max S <= 2**15, which changes no relative error), and
test_float16_overflow_is_inf checks the +-inf side with exact products.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import helpers
from gemm_bounds import (
    assert_within,
    cublas_coef,
    exact,
    fallback_coef,
    reference_coef,
    run,
)
from jax_fp8 import _registration
from jax_fp8._primitives import block_gemm as gemm_lib, block_quantize as bq

F32 = np.float32
E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
TARGET = 'custom_call_target="jax_fp8_block_gemm"'
F16_MAX_S = 2.0 ** 15  # fit_float16's target: |out| <= S (1 + coef) < 65504


def rows_of(block):
    return 1 if block == "1d" else 128


def operand(rng, lead, rows, k, fp8, block, pow2=True):
    """Random finite FP8 data [*lead, rows, k] and scale_inv with per-block magnitudes
    2**-6 .. 2**6 (or random non-power-of-two scales), as quantize_blocks lays them out."""
    vals = rng.normal(size=lead + (rows, k)).astype(F32) * F32(8.0)
    q = np.asarray(vals.astype(np.dtype(fp8)))
    r = rows_of(block)
    shape = lead + (rows if r == 1 else -(-rows // 128), -(-k // 128))
    s = np.exp2(rng.integers(-6, 7, size=shape)).astype(F32)
    if not pow2:
        s = (s * rng.uniform(0.5, 1.0, size=shape)).astype(F32)
    return q, s


def fit_float16(ops, e, s):
    """Operands (qa, sa, qb, sb) and their exact (E, S) with both scales shifted by powers
    of two so that max S <= F16_MAX_S: a float16 output stays finite (the module
    docstring). Powers of two scale the float64 E and S exactly (no under/overflow here),
    and the block-to-block variation of the scales, which catches layout mix-ups, stays."""
    qa, sa, qb, sb = ops
    p = max(0, int(np.ceil(np.log2(max(float(s.max()), 1.0) / F16_MAX_S))))
    pa, pb = (p + 1) // 2, p // 2
    sa = (sa * F32(2.0 ** -pa)).astype(F32)
    sb = (sb * F32(2.0 ** -pb)).astype(F32)
    return (qa, sa, qb, sb), e * 2.0 ** -p, s * 2.0 ** -p


def gemm(ra, rb, out_dtype, impl="auto", scale_layout="spec"):
    """The GEMM through implementation "auto" or "jnp", or impl="fallback": the CUDA
    handler's plain kernel, called directly (what runs where cuBLASLt has no algorithm)."""
    if impl == "fallback":
        return lambda qa, sa, qb, sb: gemm_lib._ffi_gemm(
            qa, sa, qb, sb, a_block_rows=ra, b_block_rows=rb, out_dtype=out_dtype,
            scale_layout=scale_layout, force_fallback=True)
    return lambda qa, sa, qb, sb: gemm_lib.block_gemm(
        qa, sa, qb, sb, a_block_rows=ra, b_block_rows=rb, out_dtype=out_dtype,
        implementation=impl, scale_layout=scale_layout)


def skip_fallback_on_cpu(backend, impl):
    if impl == "fallback" and backend != "gpu":
        pytest.skip("the plain block GEMM kernel is CUDA's")


# (lead, M, N, K, a block, b block, a type, b type, out dtype, power-of-two scales)
CPU_CASES = [((), 130, 72, 300, "1d", "1d", E4M3, E4M3, np.float32, True),
             ((), 256, 136, 256, "1d", "2d", E4M3, E4M3, jnp.bfloat16, True),
             ((2,), 72, 200, 130, "2d", "1d", E5M2, E4M3, np.float32, False),
             ((), 129, 131, 129, "2d", "2d", E4M3, E5M2, np.float16, True)]


def test_reference_within_bound(backend, device):
    """The XLA reference on every backend (on the GPU only where cuBLASLt is not used)."""
    rng = np.random.default_rng(0)
    ops, exacts = [], []
    for lead, m, n, k, ba, bb, ta, tb, out_dtype, pow2 in CPU_CASES:
        o = (*operand(rng, lead, m, k, ta, ba, pow2), *operand(rng, lead, n, k, tb, bb, pow2))
        e, s = exact(*o, rows_of(ba), rows_of(bb))
        if np.dtype(out_dtype) == np.float16:
            o, e, s = fit_float16(o, e, s)
        ops.append(o)
        exacts.append((e, s))

    def fn(ops):
        return [gemm(rows_of(c[4]), rows_of(c[5]), c[8], "jnp")(*o) for c, o in zip(CPU_CASES, ops)]

    for case, (e, s), out in zip(CPU_CASES, exacts, run(device, fn, ops)):
        assert out.shape == e.shape and out.dtype == np.dtype(case[8])
        assert_within(out, e, s, reference_coef(case[3]), case[8], f"reference {case}")


def test_vmap_and_jit_agree(backend, device):
    rng = np.random.default_rng(1)
    qa, sa = operand(rng, (3,), 64, 256, E4M3, "1d")
    qb, sb = operand(rng, (), 48, 256, E4M3, "2d")
    f = gemm(1, 128, np.float32)
    fn = lambda qa, sa, qb, sb: (jax.vmap(f, in_axes=(0, 0, None, None))(qa, sa, qb, sb),  # noqa: E731
                                 [f(qa[i], sa[i], qb, sb) for i in range(3)])
    batched, each = run(device, fn, qa, sa, qb, sb)
    np.testing.assert_array_equal(batched, np.stack(each))


# (lead, M, N, K, a block, b block): cuBLASLt shapes, and M = 102 (padded scale rows;
# not a cuBLASLt shape: the reference on the GPU under "auto").
LAYOUT_CASES = [((), 64, 136, 256, "1d", "2d"), ((2,), 72, 40, 384, "2d", "1d"),
                ((), 8, 8, 16, "1d", "1d"), ((), 102, 64, 640, "1d", "1d")]


@pytest.mark.parametrize("impl", ["jnp", "auto", "fallback"])
def test_gemm_scale_layout_gives_the_same_product(backend, device, impl):
    """scale_layout="gemm": the scales as the quantization kernel writes them for the FP8
    dot (bq.to_gemm_layout of the spec layout, padding included) give the spec layout's
    product: the same bits through the reference and the plain kernel, both within the
    bound through cuBLASLt (on the CPU "auto" is the reference)."""
    skip_fallback_on_cpu(backend, impl)
    rng = np.random.default_rng(5)
    ops = [(*operand(rng, lead, m, k, E4M3, ba), *operand(rng, lead, n, k, E4M3, bb))
           for lead, m, n, k, ba, bb in LAYOUT_CASES]

    def fn(ops):
        outs = []
        for (qa, sa, qb, sb), (_, _, _, _, ba, bb) in zip(ops, LAYOUT_CASES):
            ra, rb = rows_of(ba), rows_of(bb)
            outs.append((gemm(ra, rb, np.float32, impl)(qa, sa, qb, sb),
                         gemm(ra, rb, np.float32, impl, "gemm")(
                             qa, bq.to_gemm_layout(sa, ra), qb, bq.to_gemm_layout(sb, rb))))
        return outs

    for case, o, (spec, in_gemm) in zip(LAYOUT_CASES, ops, run(device, fn, ops)):
        e, s = exact(*o, rows_of(case[4]), rows_of(case[5]))
        coef = fallback_coef(case[3]) if impl == "fallback" else cublas_coef(case[3])
        for out, layout in ((spec, "spec"), (in_gemm, "gemm")):
            assert_within(out, e, s, coef, np.float32, f"{impl} {case} {layout} layout")
        if impl != "auto" or backend == "cpu":
            np.testing.assert_array_equal(in_gemm, spec, err_msg=f"{impl} {case}")


def test_bad_operands_are_rejected():
    qa, sa = operand(np.random.default_rng(2), (), 8, 256, E4M3, "1d")
    with pytest.raises(ValueError, match="b_scale_inv"):
        gemm(1, 1, np.float32)(qa, sa, qa, sa[:, :1])
    with pytest.raises(ValueError, match="need a"):
        gemm(1, 1, np.float32)(qa, sa, qa[:, :128], sa[:, :1])
    with pytest.raises(TypeError, match="FP8"):
        gemm(1, 1, np.float32)(qa.astype(F32), sa, qa, sa)
    with pytest.raises(ValueError, match="a_scale_inv"):  # spec-layout scales, gemm layout
        gemm(1, 1, np.float32, scale_layout="gemm")(qa, sa, qa, bq.to_gemm_layout(sa, 1))


def test_cuda_conditions_are_cublas_shapes():
    """cublas_supports asks the built module (ffi/block_gemm_limits.h, in both modules): the
    cases the GPU tests run through the custom call with "auto" are taken, the shapes
    test_gpu_shapes_cublaslt_does_not_take_use_the_reference runs are not."""
    if _registration.CPU_MODULE is None and _registration.CUDA_MODULE is None:
        pytest.skip("no module built")
    aval = lambda *s, t=E4M3: jax.ShapeDtypeStruct(s, t)  # noqa: E731
    ok = gemm_lib.cublas_supports
    assert ok(aval(64, 256), aval(128, 256), 1, 128, jnp.bfloat16)
    assert not ok(aval(64, 256), aval(128, 256), 128, 128, jnp.bfloat16)   # two tile operands
    assert not ok(aval(64, 250), aval(128, 250), 1, 1, jnp.bfloat16)       # K % 16
    assert not ok(aval(60, 256), aval(128, 256), 1, 1, jnp.bfloat16)       # M % 8
    assert not ok(aval(64, 256), aval(60, 256), 1, 1, jnp.bfloat16)        # N % 8
    assert not ok(aval(64, 256, t=E5M2), aval(64, 256, t=E5M2), 1, 1, np.float32)
    assert ok(aval(64, 256, t=E5M2), aval(64, 256), 1, 1, np.float16)     # float32, converted
    assert not ok(aval(64, 256), aval(64, 256), 1, 1, np.float64)
    assert not ok(aval(64, 256, t=jnp.int8), aval(64, 256), 1, 1, np.float32)
    assert not ok(aval(0, 64, 256), aval(0, 64, 256), 1, 1, np.float32)    # empty batch
    assert ok(aval(3, 64, 256), aval(3, 64, 256), 128, 1, np.float32)
    for case in _gpu_cases():
        (lead, m, n, k), blocks, types, out_dtype, impl = case.values
        if impl == "auto":
            assert ok(aval(*lead, m, k, t=types[0]), aval(*lead, n, k, t=types[1]),
                      rows_of(blocks[0]), rows_of(blocks[1]), out_dtype), case.id
    qa, _, qb, _ = overflow_operands()   # test_float16_overflow_is_inf: the custom call
    assert ok(qa, qb, 1, 1, np.float16)
    for (lead, m, n, k), blocks in NOT_CUBLAS:
        assert not ok(aval(*lead, m, k), aval(*lead, n, k), rows_of(blocks[0]),
                      rows_of(blocks[1]), np.float32), (m, n, k, blocks)


# ----------------------------------------------------------------------------------- GPU

GPU_SHAPES = [((), 128, 128, 128), ((), 256, 512, 1024), ((), 64, 128, 256), ((), 8, 8, 16),
              ((), 136, 264, 400), ((), 1024, 2048, 4096), ((3,), 64, 192, 384),
              ((), 4096, 8, 1280)]
GPU_BLOCKS = [("1d", "1d"), ("1d", "2d"), ("2d", "1d")]
GPU_TYPES = [(E4M3, E4M3), (E5M2, E4M3), (E4M3, E5M2)]
# Shapes and blocks cuBLASLt does not take: M % 8, K % 16, two 128 x 128 tile operands.
NOT_CUBLAS = [(((), 100, 64, 256), ("1d", "1d")), (((), 64, 64, 250), ("1d", "2d")),
              (((), 256, 256, 256), ("2d", "2d"))]


@pytest.mark.gpu
def test_gpu_cublaslt_is_found():
    """The cuBLASLt path needs libcublasLt >= 12.9 from JAX's CUDA install and SM90 GPUs."""
    ok, why = gemm_lib.cublas_status()
    assert ok, why


def _gpu_cases():
    """A covering set rather than the full product (each case compiles a GEMM): every shape
    x block layout on E4M3 x E4M3 -> bf16; every type pair x output type x block layout on
    one shape; the fallback kernel on every shape and on the other types."""
    e4, bf16, mid = (E4M3, E4M3), jnp.bfloat16, ((), 256, 512, 1024)
    cases = [(shape, blocks, e4, bf16, "auto") for shape in GPU_SHAPES for blocks in GPU_BLOCKS]
    cases += [(mid, blocks, types, out, "auto") for blocks in GPU_BLOCKS for types in GPU_TYPES
              for out in (jnp.bfloat16, np.float32, np.float16) if (types, out) != (e4, bf16)]
    cases += [(shape, ("1d", "2d"), e4, np.float32, "fallback") for shape in GPU_SHAPES]
    cases += [(((), 136, 264, 400), blocks, types, out, "fallback") for blocks in GPU_BLOCKS
              for types, out in (((E5M2, E4M3), np.float16), ((E4M3, E5M2), jnp.bfloat16))]
    return [pytest.param(*c, id=f"{c[4]}-{c[0]}-{'x'.join(c[1])}-"
                         f"{'x'.join(np.dtype(d).name[7:] for d in c[2])}-{np.dtype(c[3]).name}")
            for c in cases]


@pytest.mark.gpu
@pytest.mark.parametrize("shape, blocks, types, out_dtype, impl", _gpu_cases())
def test_gpu_gemm_within_bound(gpu_device, shape, blocks, types, out_dtype, impl):
    lead, m, n, k = shape
    rng = np.random.default_rng(m + n + k)
    ops = (*operand(rng, lead, m, k, types[0], blocks[0], pow2=m % 256 != 0),
           *operand(rng, lead, n, k, types[1], blocks[1], pow2=m % 256 != 0))
    ra, rb = rows_of(blocks[0]), rows_of(blocks[1])
    e, s = exact(*ops, ra, rb)
    if np.dtype(out_dtype) == np.float16:  # keep |E| within float16's range
        ops, e, s = fit_float16(ops, e, s)
        assert np.abs(e).max() < 65504, "fit_float16"
    fn = gemm(ra, rb, out_dtype, impl)
    x = jax.device_put(ops, gpu_device)
    hlo = jax.jit(fn).lower(*x).compile().as_text()
    assert TARGET in hlo, f"no custom call ({gemm_lib.cublas_status()})"
    out = helpers.run_on(gpu_device, fn, *ops)
    coef = cublas_coef(k) if impl == "auto" else fallback_coef(k)
    assert_within(out, e, s, coef, out_dtype, f"{impl} {shape} {blocks}")


def overflow_operands():
    """a [8, 128] E4M3 with 1x128 blocks, b [8, 128] with 1x128 blocks, whose products are
    exact in every path (small integers times powers of two; the tensor cores' partial
    sums need 8 significant bits): E[i, j] = sign_i * sa_i * (32768 for j < 4, else
    2048). Row scales put E at 32768, 65504 (float16's max), 65519 (rounds down to it),
    65520 (the first value that rounds to inf), 2**16, 2**20 and 2**-5, with both signs."""
    sa = np.array([1.0, 65504 / 32768, 65519 / 32768, 65520 / 32768, 2.0, 32.0,
                   65520 / 32768, 2.0 ** -20], F32)[:, None]
    sign = np.array([1, 1, -1, 1, -1, 1, -1, 1], F32)[:, None]
    qa = np.asarray((sign * np.full((8, 128), 16.0, F32)).astype(E4M3))
    qb = np.asarray(np.where(np.arange(8)[:, None] < 4, F32(16.0),
                             F32(1.0)) * np.ones((8, 128), F32)).astype(E4M3)
    return qa, sa, np.asarray(qb), np.ones((8, 1), F32)


@pytest.mark.parametrize("impl", ["jnp", "auto", "fallback"])
def test_float16_overflow_is_inf(backend, device, impl):
    """A float16 output is the float32 product cast to float16: an exact result of
    magnitude >= 65520 comes out as +-inf, 65519 as 65504, the rest exactly (every path;
    on the CPU "auto" is the reference too)."""
    skip_fallback_on_cpu(backend, impl)
    ops = overflow_operands()
    e, _ = exact(*ops, 1, 1)
    want = e.astype(F32)
    assert np.array_equal(want, e), "exact in float32"
    with np.errstate(over="ignore"):
        want = want.astype(np.float16)  # IEEE round to nearest even, overflowing to inf
    # rows 3, 4, 6 overflow in their first four columns, row 5 everywhere
    assert np.isinf(want).sum() == 3 * 4 + 8 and np.isfinite(want[[0, 1, 2, 7]]).all()
    fn = gemm(1, 1, np.float16, impl)
    if backend == "gpu" and impl != "jnp":
        hlo = jax.jit(fn).lower(*jax.device_put(ops, device)).compile().as_text()
        assert TARGET in hlo, f"no custom call ({gemm_lib.cublas_status()})"
    out = run(device, fn, *ops)
    assert out.dtype == np.float16
    beyond = np.abs(e) >= 65520
    assert np.isinf(out[beyond]).all() and (np.sign(out[beyond]) == np.sign(e[beyond])).all(), \
        f"{impl}: |exact| >= 65520 must give +-inf, got {out[beyond]}"
    np.testing.assert_array_equal(out, want, err_msg=f"{impl}: float16 output vs the exact product")


@pytest.mark.gpu
@pytest.mark.parametrize("shape, blocks", NOT_CUBLAS)
def test_gpu_shapes_cublaslt_does_not_take_use_the_reference(gpu_device, shape, blocks):
    lead, m, n, k = shape
    rng = np.random.default_rng(3)
    ops = (*operand(rng, lead, m, k, E4M3, blocks[0]), *operand(rng, lead, n, k, E4M3, blocks[1]))
    ra, rb = rows_of(blocks[0]), rows_of(blocks[1])
    fn = gemm(ra, rb, np.float32)
    hlo = jax.jit(fn).lower(*jax.device_put(ops, gpu_device)).compile().as_text()
    assert TARGET not in hlo
    e, s = exact(*ops, ra, rb)
    assert_within(helpers.run_on(gpu_device, fn, *ops), e, s, reference_coef(k), np.float32,
                  "reference on the GPU")


@pytest.mark.gpu
def test_gpu_repeated_calls_and_alternating_shapes_stay_within_the_bound(gpu_device):
    """Repeated calls and shapes that alternate stay within the bound (the handler keeps a
    plan per shape: one reused for another shape would show here; whether plans are
    reused is not observed)."""
    rng = np.random.default_rng(4)
    for rep in range(3):
        for m, n, k in ((64, 64, 128), (128, 256, 512), (64, 64, 128)):
            ops = (*operand(rng, (), m, k, E4M3, "1d"), *operand(rng, (), n, k, E4M3, "2d"))
            out = helpers.run_on(gpu_device, gemm(1, 128, np.float32), *ops)
            e, s = exact(*ops, 1, 128)
            assert_within(out, e, s, cublas_coef(k), np.float32, f"rep {rep} {(m, n, k)}")


# ------------------------------------------------------------------------------ CUTLASS

# (lead, M, N, K): whole and ragged tiles on every side, K not a multiple of 128, tiny,
# a batch, one long K.
CUTLASS_SHAPES = [((), 128, 128, 128), ((), 136, 264, 400), ((), 8, 8, 16), ((3,), 64, 192, 384),
                  ((), 1024, 2048, 4096), ((), 200, 136, 8192)]


def test_kernel_names_are_checked():
    """A kernel name that is neither a path nor a compiled CUTLASS configuration is a
    ValueError naming the choices, at trace time."""
    qa, sa = operand(np.random.default_rng(5), (), 8, 128, E4M3, "1d")
    with pytest.raises(ValueError, match="kernel must be one of"):
        jax.jit(gemm_lib._ffi_gemm, static_argnames=(
            "a_block_rows", "b_block_rows", "out_dtype", "scale_layout", "kernel")).lower(
            qa, sa, qa, sa, a_block_rows=1, b_block_rows=1, out_dtype=np.float32,
            scale_layout="spec", kernel="no_such_kernel")


def _cutlass_ready():
    ok, why = gemm_lib.cutlass_status()
    if not ok:
        if not any(str(getattr(d, "compute_capability", "")).startswith("9")
                   for d in jax.local_devices(backend="gpu")):
            pytest.skip(why)
        pytest.fail(why)  # an SM90 GPU, but the module was built without CUTLASS
    return gemm_lib.cutlass_configs()


@pytest.mark.gpu
def test_gpu_cutlass_is_built():
    """On SM90 GPUs the CUDA module carries the CUTLASS configuration the handler's table
    runs (the build found nvidia-cutlass's headers)."""
    names = _cutlass_ready()
    assert "tile_coop_128x128_c1_bf16" in names, names


def _cutlass_cases():
    module = None
    try:
        module = __import__("jax_fp8._jax_fp8_cuda", fromlist=["cutlass_configs"])
    except ImportError:
        pass
    configs = module.cutlass_configs() if module else []
    cases = [(name, b_tile, bf16, shape) for name, b_tile, bf16 in configs
             for shape in CUTLASS_SHAPES]
    return [pytest.param(*c, id=f"{c[0]}-{c[3]}") for c in cases] or [
        pytest.param(None, None, None, None, id="no-cutlass")]


@pytest.mark.gpu
@pytest.mark.parametrize("name, b_tile, bf16, shape", _cutlass_cases())
def test_gpu_cutlass_within_bound(gpu_device, name, b_tile, bf16, shape):
    """Every compiled CUTLASS configuration, called by name, within cuBLASLt's bound (the
    same per-128-K promotion), on whole and ragged tiles, a batch and a long K; the same
    bits on a second call (no race, no accumulation order that varies between runs)."""
    _cutlass_ready()
    if name is None:
        pytest.skip("no CUTLASS configuration compiled")
    lead, m, n, k = shape
    if bf16 and n % 8:
        pytest.skip("bf16 output rows must be 16-byte multiples")
    out_dtype = jnp.bfloat16 if bf16 else np.float32
    blocks = ("1d", "2d" if b_tile else "1d")
    rng = np.random.default_rng(m * 7 + n + k)
    ops = (*operand(rng, lead, m, k, E4M3, blocks[0], pow2=k != 400),
           *operand(rng, lead, n, k, E4M3, blocks[1], pow2=k != 400))
    ra, rb = rows_of(blocks[0]), rows_of(blocks[1])
    e, s = exact(*ops, ra, rb)
    fn = jax.jit(lambda qa, sa, qb, sb: gemm_lib._ffi_gemm(
        qa, sa, qb, sb, a_block_rows=ra, b_block_rows=rb, out_dtype=out_dtype,
        scale_layout="spec", kernel=name))
    x = jax.device_put(ops, gpu_device)
    out = np.asarray(fn(*x))
    assert_within(out, e, s, cublas_coef(k), out_dtype, f"{name} {shape}")
    np.testing.assert_array_equal(np.asarray(fn(*x)), out, err_msg="second call")


@pytest.mark.gpu
def test_gpu_cutlass_rejects_what_it_does_not_compute(gpu_device):
    """A configuration named for a GEMM it does not compute (E5M2 operands, the other
    block mode, the other output type) fails with an error naming it, rather than
    computing something else."""
    names = _cutlass_ready()
    name = "tile_coop_128x128_c1_bf16"
    assert name in names
    rng = np.random.default_rng(6)
    for fp8, rb, out_dtype in ((E5M2, 128, jnp.bfloat16), (E4M3, 1, jnp.bfloat16),
                               (E4M3, 128, np.float32)):
        ops = (*operand(rng, (), 128, 256, fp8, "1d"),
               *operand(rng, (), 128, 256, E4M3, "2d" if rb == 128 else "1d"))
        fn = jax.jit(lambda qa, sa, qb, sb, rb=rb, out_dtype=out_dtype: gemm_lib._ffi_gemm(
            qa, sa, qb, sb, a_block_rows=1, b_block_rows=rb, out_dtype=out_dtype,
            scale_layout="spec", kernel=name))
        with pytest.raises(Exception, match=f"{name} does not take this GEMM"):
            jax.block_until_ready(fn(*jax.device_put(ops, gpu_device)))


def test_exact_product_helper():
    """The float64 E and S of a hand-computed case."""
    q = np.asarray(np.array([[1.5, -2.0]], F32).astype(ml_dtypes.float8_e4m3fn))
    e, s = exact(q, np.ones((1, 1), F32), q, np.full((1, 1), 0.5, F32), 1, 1)
    assert e[0, 0] == (2.25 + 4.0) * 0.5 and s[0, 0] == e[0, 0]
