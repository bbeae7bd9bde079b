"""Block-quantization test cases shared by the tests of the jax.numpy lowering
(tests/recipes/test_blockwise.py) and of the CUDA kernel's host code
(tests/kernels/test_block_quantize_host.py): the FP8 types, block shapes and input dtypes,
data full of special values, NaN tiles, and byte-exact comparisons."""

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from gemm_bounds import FAST_COMPILE, run  # noqa: F401  (shared by the block tests)

F32 = np.float32
FP8 = [jnp.float8_e4m3fn, jnp.float8_e5m2]
BLOCKS = [(1, 128), (128, 128)]
IN_DTYPES = [np.float32, ml_dtypes.bfloat16, np.float16]
SPECIALS = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 1e-40, -3e-39, 1e-45,
                     3e38, -3.3e38, 6e-8, -1e-5, 65504.0, 448.0, 57344.0], np.float32)
NAN_PAYLOADS = np.array([0x7FC00000, 0xFFC00000, 0x7FC12345, 0xFF800001], np.uint32).view(F32)


def block_data(rng, shape, dtype=np.float32):
    """Random values whose magnitude varies by row (scales differ from block to block),
    sprinkled with SPECIALS and NaN payloads, plus whole rows of subnormals, tiny normals
    (whose scale overflows to FLT_MAX and 1/scale is subnormal), zeros and NaN."""
    lo, hi = (-14, 10) if np.dtype(dtype) == np.float16 else (-30, 30)
    x = rng.normal(size=shape).astype(F32)
    x *= np.exp2(rng.integers(lo, hi, size=shape[:-1] + (1,))).astype(F32)
    flat = x.reshape(-1)
    if flat.size:
        idx = rng.choice(flat.size, size=min(flat.size, 64), replace=False)
        flat[idx] = rng.choice(np.concatenate([SPECIALS, NAN_PAYLOADS]), size=idx.size)
    if len(shape) >= 2 and shape[-2] > 6:
        x[..., 1, :] = F32(1e-40) * rng.normal(size=shape[-1]).astype(F32)
        x[..., 2, :] = F32(3e-37) * rng.normal(size=shape[-1]).astype(F32)
        x[..., 3, :] = 0.0
        x[..., 4, :] = np.nan
        x[..., 5, :] = F32(6e-8) * rng.normal(size=shape[-1]).astype(F32)
    with np.errstate(over="ignore"):
        return x.astype(dtype)


def assert_fp8_equal(got, want, what):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, want.shape,
                                                                 got.dtype, want.dtype)
    a, b = got.view(np.uint8), want.view(np.uint8)
    if not np.array_equal(a, b):
        bad = np.argwhere(a != b)
        lines = [f"{what}: {len(bad)} of {a.size} bytes differ"]
        for idx in bad[:6]:
            idx = tuple(int(i) for i in idx)
            lines.append(f"  at {idx}: got 0x{a[idx]:02x}, want 0x{b[idx]:02x}")
        raise AssertionError("\n".join(lines))


NAN_BITS = np.array([0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FFFFFFF, 0xFFFFFFFF],
                    np.uint32)


def nan_tile_cases(rng, dtype):
    """(name, x) pairs whose tiles hold NaNs: one NaN of each sign at positions all over a
    128 x 128 tile (each of the 4 x 4 byte groups a thread transposes, other warps and
    lanes, the corners), a whole NaN row, whole NaN columns of both signs, a NaN column
    with +-inf, NaN and inf sprinkled over edge tiles, a tile that is mostly NaN, and a
    batch whose edge tile holds NaNs. Values vary in magnitude by row, so that columns
    and rows get different scales."""
    nans = NAN_BITS.view(F32)

    def base(shape):
        scale = np.exp2(rng.integers(-8, 8, size=shape[:-1] + (1,))).astype(F32)
        return rng.normal(size=shape).astype(F32) * scale

    cases = []
    for pos in [(0, 0), (0, 1), (1, 0), (3, 4), (4, 3), (15, 127), (16, 0), (64, 65),
                (127, 0), (127, 127)]:
        for bits in NAN_BITS[:4]:
            x = base((128, 128))
            x[pos] = bits.view(F32)
            cases.append((f"NaN 0x{int(bits):08x} at {pos}", x))
    x = base((256, 256))
    x[5, :] = nans[1]
    cases.append(("a whole -NaN row", x))
    x = base((256, 256))
    x[:, 7], x[:, 8] = nans[0], nans[1]
    cases.append(("whole NaN columns, +NaN and -NaN", x))
    x = base((256, 256))
    x[:, 9] = nans[1]
    x[3, 9], x[200, 9], x[10, 10] = np.inf, -np.inf, np.inf
    cases.append(("a -NaN column with +-inf", x))
    x = base((130, 257))
    mask = rng.random(x.shape) < 0.05
    x[mask] = rng.choice(np.concatenate([nans, np.array([np.inf, -np.inf], F32)]), mask.sum())
    cases.append(("5% NaN and inf, edge tiles", x))
    x = np.full((128, 128), nans[1], F32)
    x[::3, ::5] = rng.normal(size=x[::3, ::5].shape).astype(F32)
    cases.append(("mostly -NaN", x))
    x = base((2, 128, 132))
    x[1, 40:44, 128:] = nans[1]
    x[0, 127, :] = nans[0]
    cases.append(("a batch, NaNs in an edge tile", x))
    with np.errstate(over="ignore", invalid="ignore"):
        return [(name, a.astype(dtype)) for name, a in cases]


def assert_nan_tile_bytes_equal(got, want, x, what):
    """assert_fp8_equal, naming the input value (its bits) behind each differing byte."""
    got, want = np.asarray(got).view(np.uint8), np.asarray(want).view(np.uint8)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    if np.array_equal(got, want):
        return
    bits = x.view(np.uint32 if x.dtype.itemsize == 4 else np.uint16)
    bad = np.argwhere(got != want)
    lines = [f"{what}: {len(bad)} of {got.size} bytes differ"]
    for idx in bad[:8]:
        idx = tuple(int(i) for i in idx)
        lines.append(f"  at {idx}: got 0x{got[idx]:02x}, want 0x{want[idx]:02x}, "
                     f"x = 0x{int(bits[idx]):0{2 * x.dtype.itemsize}x}")
    raise AssertionError("\n".join(lines))
