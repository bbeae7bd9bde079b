"""The block-quantization kernel's own source (ffi/block_quantize_cuda.cu), compiled for the
host with g++ against tests/kernels/cuda/host_cuda.h (CUDA's intrinsics, barriers and warp
reductions on std::threads, the packed FP8 conversions as the PTX ISA specifies them), run
on tiles that hold NaN and on the GPU tests' data and compared bit for bit with the
jax.numpy reference: the kernel's logic (both layouts, the NaN patching path, the
swizzled tile, edge tiles, unaligned buffers) without a GPU. What it cannot see is the
GPU's own code generation and instructions; test_blockwise.py's GPU tests cover those.
Needs g++; skipped without it."""

import ctypes
import itertools
import os
import re
import shutil
import subprocess

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import block_cases as tb
import helpers
from jax_fp8._primitives import block_quantize as bq

HERE = os.path.dirname(os.path.abspath(__file__))
FFI = os.path.join(os.path.dirname(os.path.dirname(HERE)), "ffi")  # the repository's ffi/
IN_TYPE = {np.dtype(np.float32): 0, np.dtype(ml_dtypes.bfloat16): 1, np.dtype(np.float16): 2}
FP8_TYPE = {np.dtype(jnp.float8_e4m3fn): 0, np.dtype(jnp.float8_e5m2): 1}
CXX = shutil.which("g++")
pytestmark = pytest.mark.skipif(CXX is None or not os.path.isdir(FFI),
                                reason="g++ or the ffi/ sources not found")


def host_source(cu: str) -> str:
    """The kernel's source with its shared tile and its launches in host form."""
    src, n_shared = re.subn(r"__shared__\s+(\w+)\s+(\w+);",
                            r"\1& \2 = *static_cast<\1*>(host_shared(sizeof(\1)));", cu)
    src, n_launch = re.subn(r"(\w+<[^<>;]*>)<<<\s*(\w+)\s*,\s*(\w+)\s*,[^>]*>>>\(([^)]*)\)",
                            r"HostLaunch(\1, \2, \3, \4)", src)
    assert n_shared == 1 and n_launch == 2, (
        f"ffi/block_quantize_cuda.cu changed shape ({n_shared} __shared__, {n_launch} "
        f"launches): update host_source")
    return src


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    d = tmp_path_factory.mktemp("block_quantize_host")
    for h in ("cuda_runtime.h", "cuda_bf16.h", "cuda_fp16.h", "cuda_fp8.h"):
        (d / h).write_text('#include "host_cuda.h"\n')
    with open(os.path.join(FFI, "block_quantize_cuda.cu")) as f:
        (d / "block_quantize_host.cc").write_text(host_source(f.read()))
    lib = str(d / "libblock_quantize_host.so")
    build = subprocess.run(
        [CXX, "-std=c++17", "-O1", "-fPIC", "-shared", "-pthread", "-ffp-contract=off",
         "-fno-fast-math", f"-I{d}", f"-I{os.path.join(HERE, 'cuda')}", f"-I{FFI}",
         "-include", "host_cuda.h", str(d / "block_quantize_host.cc"),
         os.path.join(HERE, "cuda", "host_cuda.cc"), "-o", lib],
        capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr[-3000:]
    so = ctypes.CDLL(lib)
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    so.host_block_quantize.argtypes = [ctypes.c_int, ctypes.c_int, p, i64, i64, i64, ctypes.c_int,
                                       p, p, p, p, ctypes.c_float, ctypes.c_int, ctypes.c_int,
                                       ctypes.c_int]
    return so


def run_host(so, x, block_rows, fp8, rowwise=True, colwise=True, pow2=True, eps=0.0,
             gemm=False, nan_keeps_sign=False, offset=0):
    """The host-compiled kernel on x: [q, scale_inv, q_t, scale_inv_t] of the wanted layouts.
    Each FP8 output starts `offset` bytes past a 64-byte boundary; every output sits between
    guard bytes, which must be left as they were."""
    x = np.ascontiguousarray(x)
    *lead, m, k = x.shape
    b = int(np.prod(lead)) if lead else 1
    layout = "gemm" if gemm else "spec"
    shapes = [(b, m, k), bq.scale_shape((b, m, k), block_rows, layout),
              (b, k, m), bq.scale_shape((b, k, m), block_rows, layout)]
    dtypes = [np.uint8, np.float32, np.uint8, np.float32]
    guard, bufs, ptrs = 256, [], []
    for n, (shape, dt) in enumerate(zip(shapes, dtypes)):
        nbytes = int(np.prod(shape)) * np.dtype(dt).itemsize
        raw = np.full(nbytes + 2 * guard + 128, 0xCD, np.uint8)
        start = (-raw.ctypes.data) % 64 + guard + (offset if dt == np.uint8 else 0)
        bufs.append((raw, start, nbytes, shape, dt))
        wanted = rowwise if n < 2 else colwise
        ptrs.append(raw.ctypes.data + start if wanted else None)
    rc = so.host_block_quantize(IN_TYPE[x.dtype], FP8_TYPE[np.dtype(fp8)], x.ctypes.data, b, m,
                                k, int(block_rows == 128), *ptrs, eps, int(pow2), int(gemm),
                                int(nan_keeps_sign))
    assert rc == 0
    outs = []
    for n, (raw, start, nbytes, shape, dt) in enumerate(bufs):
        assert (raw[:start] == 0xCD).all() and (raw[start + nbytes:] == 0xCD).all(), \
            f"output {n} written out of bounds"
        if ptrs[n] is not None:
            a = raw[start:start + nbytes].view(dt).reshape(tuple(lead) + shape[1:])
            outs.append(a.view(fp8) if dt == np.uint8 else a)
    return outs


def reference(xs, block_rows, fp8, rowwise=True, colwise=True, pow2=True, eps=0.0):
    fn = lambda xs: [bq.block_quantize(x, block_rows=block_rows, fp8_dtype=fp8,  # noqa: E731
                                       power_of_2_scale=pow2, amax_epsilon=eps, rowwise=rowwise,
                                       colwise=colwise, implementation="jnp") for x in xs]
    return tb.run(jax.devices("cpu")[0], fn, xs)


def check(got, want, x, layouts, what):
    names = (["row-wise"] if layouts[0] else []) + (["column-wise"] if layouts[1] else [])
    for i, name in enumerate(names):
        a = x if name == "row-wise" else np.swapaxes(x, -1, -2)
        tb.assert_nan_tile_bytes_equal(got[2 * i], want[2 * i], a, f"{what}: {name} data")
        helpers.assert_bits_equal(got[2 * i + 1], want[2 * i + 1], f"{what}: {name} scale_inv")


def nan_cases(dtype):
    cases = tb.nan_tile_cases(np.random.default_rng(14), dtype)
    # a -NaN and a signalling +NaN at two positions, and every case that is not one NaN
    return [c for c in cases if not c[0].startswith("NaN ") or
            (("0xffc00000" in c[0] or "0x7f800001" in c[0]) and
             any(p in c[0] for p in ("(3, 4)", "(127, 127)")))]


@pytest.mark.parametrize("dtype", tb.IN_DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("fp8, block", list(itertools.product(tb.FP8, tb.BLOCKS)),
                         ids=lambda v: np.dtype(v).name if not isinstance(v, tuple) else str(v))
def test_nan_tiles_bits_equal_reference(kernel, dtype, fp8, block):
    """Both layouts from one call, on the NaN tiles of the GPU test
    (test_blockwise.test_gpu_kernel_nan_tiles_bits_equal_reference)."""
    cases = nan_cases(dtype)
    wants = reference([x for _, x in cases], block[0], fp8)
    for (name, x), want in zip(cases, wants):
        check(run_host(kernel, x, block[0], fp8), want, x, (True, True), name)


@pytest.mark.parametrize("layouts", [(False, True), (True, False)], ids=["col", "row"])
@pytest.mark.parametrize("block", tb.BLOCKS, ids=str)
def test_one_layout_and_nan_sign_of_the_conversion(kernel, layouts, block):
    """One layout per call (the NaN test of the tile then reads only that layout's maxima),
    and a conversion instruction whose NaN keeps x's sign instead of giving 0x7F: the
    bytes are the same, the kernel writes every NaN byte itself."""
    cases = nan_cases(ml_dtypes.bfloat16)
    wants = reference([x for _, x in cases], block[0], jnp.float8_e4m3fn, *layouts)
    for (name, x), want in zip(cases, wants):
        for keeps in (False, True):
            got = run_host(kernel, x, block[0], jnp.float8_e4m3fn, *layouts, nan_keeps_sign=keeps)
            check(got, want, x, layouts, f"{name} (NaN keeps sign: {keeps})")


HOST_SHAPES = [(1, 1), (3, 5), (130, 257), (6, 130, 6)]


@pytest.mark.parametrize("dtype", tb.IN_DTYPES, ids=lambda d: np.dtype(d).name)
def test_gpu_test_data_bits_equal_reference(kernel, dtype):
    """test_blockwise's generated data (specials, NaN payloads, subnormal rows, a NaN
    row) in the GPU test's shapes, both FP8 types and block shapes, the scales in both
    layouts, FP8 outputs at offsets that turn the kernel's vector stores off."""
    xs = [tb.block_data(np.random.default_rng(sum(s)), s, dtype) for s in HOST_SHAPES]
    for fp8, block in itertools.product(tb.FP8, tb.BLOCKS):
        wants = reference(xs, block[0], fp8)
        for shape, x, want in zip(HOST_SHAPES, xs, wants):
            what = f"{shape} {np.dtype(fp8).name} {block}"
            check(run_host(kernel, x, block[0], fp8), want, x, (True, True), what)
            gemm = run_host(kernel, x, block[0], fp8, gemm=True, offset=1)
            for i in (0, 2):
                tb.assert_fp8_equal(gemm[i], want[i], what + " (gemm layout, offset 1)")
                helpers.assert_bits_equal(
                    gemm[i + 1], np.asarray(bq.to_gemm_layout(want[i + 1], block[0])),
                    what + " scale_inv in the gemm layout")
