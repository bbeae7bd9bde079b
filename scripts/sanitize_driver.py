"""Drives jax_fp8's CUDA kernels through the real JAX path, for compute-sanitizer.

Run by scripts/sanitize.sh (``python scripts/sanitize_driver.py
[transpose|block|split|grouped]``).

Covers: a donated (aliased, in-place) per-tensor pytree, a stacked state, mixed
history lengths (1 .. 5000, several passes per block), skip_unused, amax inputs, and
1,500 states in one call (two launches past the kernel-parameter limit), and 300
donated states whose amaxes lie > 16 GB away (64-bit offsets, one launch). With the
argument "transpose": the FP8 transpose kernels instead (byte transpose; quantize +
transpose + amax), tile edges and batches. With "block" (or "block_kernels", without
cuBLASLt's GEMM): the block quantization kernel
(both block shapes, both layouts, both scale layouts, every input type, edge tiles, NaN
and inf tiles, a batch) and the block-scaled GEMM's custom call (cuBLASLt's kernel and the
handler's own fallback kernel, 1x128 and 128x128 operands, ragged M/N/K). With "split":
the kernel that cuts a packed state's scale vectors into one buffer per state. With
"grouped": the grouped FP8 GEMM's custom call (its setup and zeroing kernels and CUTLASS's
grouped GEMM), the grouped weight gradient's (its setup kernel and CUTLASS's grouped GEMM
on the padded, transposed operands) and the bf16 grouped GEMM's in its three products.
"""

import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jax_fp8
from buffers import (  # tests/buffers.py: sanitize.sh puts tests/ on the path
    buffer_span,
    put_far_from,
)
from jax_fp8._primitives import layout

rng = np.random.default_rng(0)

if sys.argv[1:] == ["transpose"]:
    # The byte-transpose kernel: whole tiles, partial tiles on both edges, one word, a
    # batch (vmap), both FP8 types; inputs copied from the host (initcheck), bits checked.
    for shape in [(4, 4), (128, 128), (132, 260), (4, 1028), (1028, 8), (4096, 2048)]:
        for dtype in (jnp.float8_e4m3fn, jnp.float8_e5m2):
            x = rng.integers(0, 256, shape, dtype=np.uint8)
            y = layout.transpose_bytes_p.bind(jax.device_put(x.view(np.dtype(dtype))))
            assert (np.asarray(y).view(np.uint8) == x.T).all(), (shape, dtype)
    x = rng.integers(0, 256, (3, 8, 136), dtype=np.uint8)
    y = jax.jit(lambda a: layout.rotate_axes(a, 2))(
        jax.device_put(x.view(np.dtype(jnp.float8_e4m3fn))))
    assert (np.asarray(y).view(np.uint8) == np.transpose(x, (2, 0, 1))).all()
    # The quantize + transpose + amax kernel: every input and FP8 type, edge tiles.
    for shape in [(4, 4), (132, 260), (1028, 8), (4096, 2048)]:
        for in_dtype in (np.float32, jnp.bfloat16, jnp.float16):
            for dtype in (jnp.float8_e4m3fn, jnp.float8_e5m2):
                x = jax.device_put(rng.standard_normal(shape).astype(in_dtype))
                q, q_t, amax = layout.quantize_transpose_p.bind(
                    x, jax.device_put(np.float32(0.5)), fp8_dtype=np.dtype(dtype))
                q8 = np.asarray(q).view(np.uint8)
                assert (np.asarray(q_t).view(np.uint8) == q8.T).all(), (shape, dtype)
                # (Compared on the host: a comparison on the device would be an XLA
                # kernel's output, which initcheck does not track.)
                assert np.asarray(amax) == np.abs(np.asarray(x, np.float32)).max(), (shape, dtype)
    # A batch (expert weights), a scale and an amax per matrix.
    from jax_fp8.gemm import _grouped

    for shape in [(3, 4, 8), (5, 132, 260)]:
        w = jax.device_put(rng.standard_normal(shape).astype(jnp.bfloat16))
        s = jax.device_put(np.asarray([0.5, 2.0, 1e-3, 4.0, 1.0][: shape[0]], np.float32))
        q, q_t, amax = layout.quantize_transpose_experts(w, s, jnp.float8_e4m3fn)
        q8 = np.asarray(q).view(np.uint8)
        assert (np.asarray(q_t).view(np.uint8) == np.swapaxes(q8, 1, 2)).all(), shape
        assert (np.asarray(amax) == np.asarray(_grouped.expert_amax(np.asarray(w)))).all()
    print("sanitize driver done")
    sys.exit(0)
if sys.argv[1:] == ["split"]:
    # The packed state's split: empty pieces, one launch's worth and more (2,040 pieces
    # per launch), a long piece; bits checked on the host.
    from jax_fp8._primitives import split

    for sizes in [(1, 0, 3), tuple(range(1, 65)), (2,) * 2100 + (5000, 0, 1)]:
        values = rng.standard_normal(sum(sizes)).astype(np.float32)
        pieces = split.split_rows(jax.device_put(values), sizes)
        assert np.array_equal(np.concatenate([np.asarray(p) for p in pieces]), values), sizes
    print("sanitize driver done")
    sys.exit(0)
if sys.argv[1:] == ["grouped"]:
    # The grouped FP8 GEMM's custom call (setup kernel, zeroing of the rows past the groups,
    # CUTLASS's ptr-array grouped GEMM): uneven, empty, negative and clamped groups, a group
    # count past one scan chunk (256), both lhs types and output types, ragged M; inputs
    # copied from the host (initcheck), bits checked on the host against the exact product
    # (small integers: every summation order is exact).
    from jax_fp8._primitives import grouped_gemm as gg
    ok, why = gg.kernel_status()
    assert ok, why
    cases = [(40, 24, 48, (5, 0, 17, 1, 9)), (40, 24, 48, (0, 0, 0)),
             (40, 32, 64, (30, 0, 30, 7)), (33, 16, 32, (10, -3, 12, -(2 ** 31), 2 ** 31 - 1)),
             (700, 40, 32, tuple(int(v) for v in rng.integers(0, 4, 300))),
             (257, 264, 272, (128, 1, 127))]
    n_calls = 0
    for m, n, k, sizes in cases:
        g = len(sizes)
        for lhs_type in (jnp.float8_e4m3fn, jnp.float8_e5m2):
            for out_dtype in (jnp.bfloat16, np.float32):
                lhs = rng.integers(-3, 4, (m, k)).astype(np.dtype(lhs_type))
                rhs = rng.integers(-3, 4, (g, n, k)).astype(np.dtype(jnp.float8_e4m3fn))
                ls = (2.0 ** rng.integers(-4, 5, g)).astype(np.float32)
                rs = (2.0 ** rng.integers(-4, 5, g)).astype(np.float32)
                out = np.asarray(gg.grouped_gemm(
                    jax.device_put(lhs), jax.device_put(rhs),
                    jax.device_put(np.asarray(sizes, np.int32)), jax.device_put(ls),
                    jax.device_put(rs), out_dtype=out_dtype, implementation="cuda"))
                want = np.zeros((m, n), np.float64)
                start = 0
                for i, size in enumerate(sizes):
                    size = min(max(size, 0), m - start)
                    want[start:start + size] = (lhs[start:start + size].astype(np.float64)
                                                @ rhs[i].astype(np.float64).T) * (ls[i] * rs[i])
                    start += size
                assert np.array_equal(out, want.astype(out_dtype)), (m, n, k, g, lhs_type)
                n_calls += 1
    print(f"grouped gemm: {n_calls} calls")
    # The grouped weight gradient's custom call (setup kernel, CUTLASS's grouped GEMM on the
    # padded operands built in XLA): uneven, empty, all-empty, negative and clamped groups,
    # rows past the groups, more groups than one scan chunk (256), both gradient types and
    # output types, K not a multiple of 16; bits checked on the host (small integers, groups
    # of at most 40 rows below 2**9 in magnitude: every summation order is exact).
    from jax_fp8._primitives import grouped_wgrad as gw
    ok, why = gw.kernel_status()
    assert ok, why
    cases = [(40, 24, 16, (5, 0, 17, 1, 9)), (40, 24, 16, (0, 0, 0)),
             (40, 32, 24, (30, 0, 30, 7)), (33, 16, 32, (10, -3, 12, -(2 ** 31), 2 ** 31 - 1)),
             (700, 40, 32, tuple(int(v) for v in rng.integers(0, 4, 300))),
             (257, 136, 264, (40, 1, 39, 0, 33))]
    n_calls = 0
    for m, k, n, sizes in cases:
        g = len(sizes)
        for grad_type in (jnp.float8_e4m3fn, jnp.float8_e5m2):
            for out_dtype in (jnp.bfloat16, np.float32):
                lhs = rng.integers(-3, 4, (m, k)).astype(np.dtype(jnp.float8_e4m3fn))
                grad = rng.integers(-3, 4, (m, n)).astype(np.dtype(grad_type))
                ls = (2.0 ** rng.integers(-4, 5, g)).astype(np.float32)
                gs = (2.0 ** rng.integers(-4, 5, g)).astype(np.float32)
                out = np.asarray(gw.grouped_wgrad(
                    jax.device_put(lhs), jax.device_put(grad),
                    jax.device_put(np.asarray(sizes, np.int32)), jax.device_put(ls),
                    jax.device_put(gs), out_dtype=out_dtype, implementation="cuda"))
                want = np.zeros((g, k, n), np.float64)
                start = 0
                for i, size in enumerate(sizes):
                    size = min(max(size, 0), m - start)
                    want[i] = (lhs[start:start + size].astype(np.float64).T
                               @ grad[start:start + size].astype(np.float64)) * (ls[i] * gs[i])
                    start += size
                assert np.array_equal(out, want.astype(out_dtype)), (m, k, n, g, grad_type)
                n_calls += 1
    print(f"grouped wgrad: {n_calls} calls")
    # The bf16 grouped GEMM's custom call in its three products (setup kernel, zeroing of the
    # rows past the groups or of empty groups' weight gradients, CUTLASS's grouped GEMM):
    # uneven, empty, all-empty, negative and clamped groups, more groups than one scan chunk;
    # bits checked on the host (small integers: every summation order is exact).
    from jax_fp8._primitives import ragged_dot as rd
    ok, why = rd.kernel_status()
    assert ok, why
    cases = [(40, 24, 16, (5, 0, 17, 1, 9)), (40, 24, 16, (0, 0, 0)),
             (33, 16, 32, (10, -3, 12, -(2 ** 31), 2 ** 31 - 1)),
             (700, 40, 32, tuple(int(v) for v in rng.integers(0, 4, 300)))]
    n_calls = 0
    for m, k, n, sizes in cases:
        g = len(sizes)
        for mode in rd.MODES:
            rhs_shape = {rd.FORWARD: (g, k, n), rd.TRANSPOSED: (g, n, k),
                         rd.WEIGHT_GRAD: (m, n)}[mode]
            lhs = rng.integers(-3, 4, (m, k)).astype(np.dtype(jnp.bfloat16))
            rhs = rng.integers(-3, 4, rhs_shape).astype(np.dtype(jnp.bfloat16))
            for out_dtype in ((jnp.bfloat16, np.float32) if mode == rd.WEIGHT_GRAD
                              else (jnp.bfloat16,)):
                out = np.asarray(rd.ragged_product(
                    jax.device_put(lhs), jax.device_put(rhs),
                    jax.device_put(np.asarray(sizes, np.int32)), mode=mode,
                    out_dtype=out_dtype))
                a, b = lhs.astype(np.float64), rhs.astype(np.float64)
                want = np.zeros(out.shape, np.float64)
                start = 0
                for i, size in enumerate(sizes):
                    size = min(max(size, 0), m - start)
                    rows = slice(start, start + size)
                    if mode == rd.FORWARD:
                        want[rows] = a[rows] @ b[i]
                    elif mode == rd.TRANSPOSED:
                        want[rows] = a[rows] @ b[i].T
                    else:
                        want[i] = a[rows].T @ b[rows]
                    start += size
                assert np.array_equal(out, want.astype(out_dtype)), (m, k, n, g, mode)
                n_calls += 1
    print(f"bf16 ragged dot: {n_calls} calls")
    print("sanitize driver done")
    sys.exit(0)
if sys.argv[1:] in (["block"], ["block_kernels"]):
    from jax_fp8._primitives import block_gemm as bg, block_quantize as bq
    cpu = jax.devices("cpu")[0]
    e4m3, e5m2 = jnp.float8_e4m3fn, jnp.float8_e5m2

    def special(shape, in_dtype):
        x = rng.standard_normal(shape) * 3.0
        flat = x.reshape(-1)
        flat[rng.integers(0, flat.size, max(1, flat.size // 97))] = np.nan
        flat[rng.integers(0, flat.size, max(1, flat.size // 89))] = np.inf
        flat[rng.integers(0, flat.size, max(1, flat.size // 31))] = 0.0
        flat[rng.integers(0, flat.size, max(1, flat.size // 53))] *= 1e-41
        return x.astype(in_dtype)

    # Quantization: every output of the kernel copied back to the host (the kernel's own
    # writes are what initcheck tracks; the inputs come from the host).
    n = 0
    for shape in [(1, 4), (130, 260), (2, 129, 200), (1024, 1024)]:
        for in_dtype, fp8 in ((np.float32, e4m3), (jnp.bfloat16, e5m2), (np.float16, e4m3),
                              (jnp.bfloat16, e4m3)):
            x = jax.device_put(special(shape, in_dtype))
            for rows in (1, 128):
                for rowwise, colwise, layout in ((True, False, "spec"), (False, True, "spec"),
                                                 (True, True, "spec"), (True, True, "gemm")):
                    jax.device_get(bq.block_quantize(
                        x, block_rows=rows, fp8_dtype=fp8, power_of_2_scale=True,
                        amax_epsilon=0.0, rowwise=rowwise, colwise=colwise,
                        scale_layout=layout))
                    n += 1
    print(f"block quantize: {n} calls")

    # The GEMM: operands and scales (in the GEMM's layout) made on the host, so the
    # custom call is the only device work; results compared on the host with the
    # reference (the dequantized float32 product) computed on the CPU.
    def operand(r, k, rows, fp8):
        q = rng.integers(0, 256, (r, k), dtype=np.uint8)
        q[(q & 0x7F) >= (0x7F if fp8 == e4m3 else 0x7C)] = 0x38  # no NaN/inf bytes
        s = np.exp2(rng.integers(-4, 4, (bq.scale_rows(r, rows), -(-k // 128)))).astype(np.float32)
        return q.view(np.dtype(fp8)), s

    n = 0
    for m, nn, k in [(128, 128, 128), (136, 264, 400), (512, 384, 1024), (8, 8, 16)]:
        for a_rows, b_rows in ((1, 1), (1, 128), (128, 1)):
            # "block_kernels": only the handler's own kernel writes the output, so that
            # initcheck (which tracks only instrumented kernels' writes) can follow it.
            for impl in ("fallback",) if sys.argv[1] == "block_kernels" else ("auto", "fallback"):
                a, sa = operand(m, k, a_rows, e4m3)
                b, sb = operand(nn, k, b_rows, e4m3)
                ga = jax.device_get(bq.to_gemm_layout(jax.device_put(sa, cpu), a_rows))
                gb = jax.device_get(bq.to_gemm_layout(jax.device_put(sb, cpu), b_rows))
                # "fallback": the handler's plain kernel, called directly.
                gemm = bg.block_gemm if impl == "auto" else functools.partial(
                    bg._ffi_gemm, force_fallback=True)
                got = gemm(jax.device_put(a), jax.device_put(ga), jax.device_put(b),
                           jax.device_put(gb), a_block_rows=a_rows, b_block_rows=b_rows,
                           out_dtype=jnp.float32, scale_layout="gemm")
                want = bg.block_gemm(*(jax.device_put(v, cpu) for v in (a, sa, b, sb)),
                                     a_block_rows=a_rows, b_block_rows=b_rows,
                                     out_dtype=jnp.float32)
                got, want = np.asarray(got), np.asarray(want)
                # Loose: this is a memory check; tests/kernels/test_block_gemm.py holds the bound.
                assert np.allclose(got, want, rtol=1e-3, atol=1e-3 * np.abs(want).max()), (
                    m, nn, k, a_rows, b_rows, impl)
                n += 1
    print(f"block gemm: {n} calls")
    print("sanitize driver done")
    sys.exit(0)
lengths = [1, 2, 3, 16, 1023, 1024, 1025, 5000]
tree = [jax_fp8.ScalingState(jax.device_put(rng.random((i % 3, L), np.float32)),
                             jax.device_put(np.ones((i % 3,), np.float32)),
                             jax.device_put(np.ones((i % 3,), np.float32)),
                             jnp.float8_e5m2 if i % 2 else jnp.float8_e4m3fn)
        for i, L in enumerate(lengths * 3)]
amaxes = [jax.device_put(rng.random(st.scale.shape, np.float32)) for st in tree]
for skip in (False, True):
    recipe = jax_fp8.DelayedScaling(skip_unused=skip)
    step = jax.jit(lambda t, a: jax_fp8.update_states(t, a, recipe=recipe),  # noqa: B023 (run here)
                   donate_argnums=0)
    for _ in range(3):
        tree = step(tree, amaxes)


def host_state(lead, hist_len):
    # Built on the host and copied in: initcheck tracks host-to-device copies, but not
    # the writes of XLA's own kernels, which --kernel-name leaves uninstrumented (a
    # state XLA fills with zeros would read as "uninitialized" in our kernel).
    return jax_fp8.ScalingState(jax.device_put(rng.random(lead + (hist_len,), np.float32)),
                                jax.device_put(np.ones(lead, np.float32)),
                                jax.device_put(np.ones(lead, np.float32)), jnp.float8_e4m3fn)


big = [host_state((), 16) for _ in range(1500)]
big = jax.jit(jax_fp8.update_states, donate_argnums=0)(big)
stacked = host_state((64,), 1024)
stacked = jax.jit(jax_fp8.update_states, donate_argnums=0)(stacked)
# The wide path: amaxes > 2^32 floats from the states -> 64-bit offsets, 300 states in
# one launch (the host-side plan is checked by tests/kernels/test_launch_plan.py).
wide = [host_state((), 64) for _ in range(300)]
wide_amaxes, keep_alive = put_far_from(
    wide, [np.float32(rng.random() * 4) for _ in wide], jax.devices()[0])
if wide_amaxes is None:  # the allocator kept everything close: no 64-bit case here
    print("wide-span case: skipped (could not place the amaxes 16 GB from the states)")
else:
    print(f"wide-span case: buffers span {buffer_span((wide, wide_amaxes)) / 2**30:.1f} GB")
    wide = jax.jit(jax_fp8.update_states, donate_argnums=0)(wide, wide_amaxes)
jax.block_until_ready((tree, big, stacked, wide))
print("sanitize driver done")
