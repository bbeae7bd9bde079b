"""scaled_dot_general with Float8BlockScaling and Float8CurrentScaling: forward and both
gradients against the exact (float64) products of the operands the recipe prescribes,
quantized by the NumPy oracle (tests/block_reference.py), within the GEMM error bounds
derived in tests/kernels/test_block_gemm.py; general dimension_numbers, dtypes, finite
differences, jit / vmap / disable_jit, and the 8-device check in a subprocess.

With a loss sum(out * c), the output cotangent is c, so the three GEMMs' operands are
known exactly: forward x . w (x row-wise, w as [N, K]), dgrad c . w^T (c row-wise, w
row-wise along N), wgrad x^T . c (x and c column-wise, blocks along M).
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import gemm_bounds as tg
import helpers
import jax_fp8
from gemm_bounds import expected
from jax_fp8 import Format
from jax_fp8.gemm.scaled_dot import scaled_dot_general

F32 = np.float32
DENSE = (((1,), (0,)), ((), ()))
RECIPES = {
    "block": jax_fp8.Float8BlockScaling(),
    "block_hybrid_x2d": jax_fp8.Float8BlockScaling(
        fp8_format=Format.HYBRID, x_block_scaling_dim=2, w_block_scaling_dim=1,
        power_of_2_scale=False, amax_epsilon=1e-6),
    "current": jax_fp8.Float8CurrentScaling(),
    "current_e4m3_pow2": jax_fp8.Float8CurrentScaling(fp8_format=Format.E4M3,
                                                      power_of_2_scale=True),
}


def data(rng, m, k, n):
    """x [m, k] with rows of different magnitudes, w [k, n], the cotangent c [m, n]."""
    x = (rng.normal(size=(m, k)) * np.exp2(rng.integers(-4, 5, (m, 1)))).astype(F32)
    w = (rng.normal(size=(k, n)) * 0.05).astype(F32)
    c = (rng.normal(size=(m, n)) * np.exp2(rng.integers(-3, 4, (1, n)))).astype(F32)
    return x, w, c


def coefficient(recipe, k, backend):
    """The GEMM bound of tests/kernels/test_block_gemm.py; current scaling also rounds the factor
    scale_inv_a * scale_inv_b and multiplies by it (two more roundings)."""
    coef = tg.cublas_coef(k) if backend == "gpu" else tg.reference_coef(k)
    return coef if isinstance(recipe, jax_fp8.Float8BlockScaling) else coef + 2 * tg.U


def loss_and_grads(recipe, out_dtype=None):
    def f(x, w, c):
        out = scaled_dot_general(x, w, DENSE, recipe, preferred_element_type=out_dtype)
        return jnp.sum(out.astype(F32) * c), out
    return jax.value_and_grad(f, argnums=(0, 1), has_aux=True)


def test_forward_and_gradients_within_bounds(backend, device):
    """Every recipe (one program): forward, dgrad and wgrad within their GEMM bounds of
    the exact products of the oracle's operands. Sizes cuBLASLt takes on a GPU."""
    m, k, n = 96, 256, 136
    x, w, c = data(np.random.default_rng(0), m, k, n)
    fn = lambda x, w, c: [loss_and_grads(r)(x, w, c) for r in RECIPES.values()]  # noqa: E731
    for (name, recipe), ((_, out), (dx, dw)) in zip(RECIPES.items(), tg.run(device, fn, x, w, c)):
        (e_out, s_out), (e_dx, s_dx), (e_dw, s_dw) = expected(recipe, x, w, c)
        tg.assert_within(out, e_out, s_out, coefficient(recipe, k, backend), F32,
                         f"{name} forward")
        tg.assert_within(dx, e_dx, s_dx, coefficient(recipe, n, backend), F32, f"{name} dgrad")
        tg.assert_within(dw, e_dw, s_dw, coefficient(recipe, m, backend), F32, f"{name} wgrad")


def test_general_dimension_numbers_bf16_and_edge_sizes(backend, device):
    """lhs [K1, M, K2] contracting (2, 0) with rhs [N, K2, K1] contracting (1, 2), in
    bfloat16 (gradients come back in bfloat16), float32 output, edge blocks everywhere:
    the Dense product of lhs as [M, K2 K1] and rhs as [K2 K1, N], within the bounds."""
    rng = np.random.default_rng(2)
    recipe = RECIPES["block"]
    x, w, c = data(rng, 50, 3 * 70, 36)              # the Dense form: K = K2 * K1 = 70 * 3
    lhs = np.transpose(x.reshape(50, 70, 3), (2, 0, 1)).astype(ml_dtypes.bfloat16)
    rhs = np.transpose(w.reshape(70, 3, 36), (2, 0, 1)).astype(ml_dtypes.bfloat16)
    dims = (((2, 0), (1, 2)), ((), ()))

    def f(lhs, rhs):
        out = scaled_dot_general(lhs, rhs, dims, recipe, preferred_element_type=F32)
        return jnp.sum(out * c), out

    (_, out), (dl, dr) = tg.run(device, jax.value_and_grad(f, (0, 1), has_aux=True), lhs, rhs)
    assert out.dtype == F32 and dl.dtype == dr.dtype == np.dtype(jnp.bfloat16)
    xd = np.transpose(lhs, (1, 2, 0)).reshape(50, 210).astype(F32)
    wd = np.transpose(rhs, (1, 2, 0)).reshape(210, 36).astype(F32)
    (e_out, s_out), (e_dx, s_dx), (e_dw, s_dw) = expected(recipe, xd, wd, c)
    tg.assert_within(out, e_out, s_out, tg.reference_coef(210), F32, "forward")
    dx = np.transpose(dl, (1, 2, 0)).reshape(50, 210)
    dw = np.transpose(dr, (1, 2, 0)).reshape(210, 36)
    tg.assert_within(dx, e_dx, s_dx, tg.reference_coef(36), jnp.bfloat16, "dgrad")
    tg.assert_within(dw, e_dw, s_dw, tg.reference_coef(50), jnp.bfloat16, "wgrad")


def test_gradient_direction_matches_finite_differences(backend, device):
    """The FP8 gradients against central differences of the float32 loss: along the
    direction sign(gradient) (no cancellation: to FP8 accuracy, E4M3 rounds by up to 2**-4
    relative) and along a random direction (to 2**-4 of sum |g_i d_i|)."""
    rng = np.random.default_rng(3)
    x, w, c = data(rng, 64, 128, 32)
    h = F32(1e-2)
    recipes = (RECIPES["block"], RECIPES["current"])

    def exact_loss(x, w):
        return jnp.sum(jnp.dot(x, w, precision="highest") * c)

    def fn(x, w, dx, dw):
        fp8 = [jax.grad(lambda x, w: jnp.sum(scaled_dot_general(x, w, DENSE, r) * c),
                        (0, 1))(x, w) for r in recipes]
        fd = ((exact_loss(x + h * dx, w) - exact_loss(x - h * dx, w)) / (2 * h),
              (exact_loss(x, w + h * dw) - exact_loss(x, w - h * dw)) / (2 * h))
        return fp8, fd

    g_exact = jax.jit(jax.grad(exact_loss, (0, 1)))(x, w)
    for dirs in ([np.sign(g) for g in g_exact],
                 [rng.normal(size=x.shape).astype(F32), rng.normal(size=w.shape).astype(F32)]):
        fp8, fd = tg.run(device, fn, x, w, *dirs)
        for grads in fp8:
            for g, g0, d, f in zip(grads, g_exact, dirs, fd):
                scale = float(np.sum(np.abs(np.asarray(g0) * d)))
                assert abs(float(np.vdot(g, d)) - float(f)) <= 2.0 ** -4 * scale, (f, scale)


def test_jit_vmap_and_disable_jit(backend, device):
    """vmap over a leading axis is the per-example computation (each example its own
    tensor: current scaling takes each example's amax); eager execution gives the jit's
    numbers."""
    rng = np.random.default_rng(4)
    xs = rng.normal(size=(3, 32, 128)).astype(F32)
    w = (rng.normal(size=(128, 48)) * 0.1).astype(F32)
    recipes = (RECIPES["block"], RECIPES["current"])
    fs = [lambda x, w, r=r: scaled_dot_general(x, w, DENSE, r) for r in recipes]
    fn = lambda xs, w: [(jax.vmap(f, in_axes=(0, None))(xs, w),  # noqa: E731
                         [f(xs[i], w) for i in range(3)]) for f in fs]
    # Two programs on a GPU may run the same FP8 GEMM with different cuBLASLt algorithms,
    # whose FP8 tensor-core accumulation differs in its low bits (test_block_gemm's
    # bound: 2**-10 of S per 128-wide block); on CPU eager and jit give the same numbers.
    tol = (2.0 ** -10 * (np.abs(xs[0]) @ np.abs(w)) if device.platform == "gpu"
           else 1e-6 * (1 + np.abs(xs[0]) @ np.abs(w)))
    for f, (batched, each) in zip(fs, tg.run(device, fn, xs, w)):
        np.testing.assert_allclose(batched, np.stack(each), rtol=1e-6, atol=1e-6)
        with jax.disable_jit():
            eager = f(jax.device_put(xs[0], device), jax.device_put(w, device))
        assert np.all(np.abs(np.asarray(eager) - each[0]) <= tol)


def _flat_heads(a):
    """[b, t, h, d] -> [b * h, t, d]: two batch axes as one."""
    return jnp.transpose(a, (0, 2, 1, 3)).reshape(-1, a.shape[1], a.shape[3])


# Batch dimensions: lhs shape, rhs shape, dimension_numbers, the vmapped 2-D reference
# (scaled_dot_general without batch axes, vmapped over the batch axes flattened into
# one), and the per-element
# Dense operands x [M, K], w [K, N], c [M, N] of batch element `i` with how dx, dw map back.
BATCHED = {
    "leading": ((3, 32, 128), (3, 128, 48), (((2,), (1,)), ((0,), (0,))),
                lambda f: jax.vmap(lambda a, b: f(a, b, DENSE))),
    "attention": ((2, 32, 3, 128), (2, 48, 3, 128), (((3,), (3,)), ((0, 2), (0, 2))),
                  lambda f: lambda a, b: jax.vmap(
                      lambda a, b: f(a, b, (((1,), (1,)), ((), ()))))(
                      _flat_heads(a), _flat_heads(b)).reshape(2, 3, 32, 48)),
    "inner": ((32, 3, 128), (128, 48, 3), (((2,), (0,)), ((1,), (2,))),
              lambda f: jax.vmap(lambda a, b: f(a, b, DENSE), in_axes=(1, 2))),
}


def _dense_slices(case, lhs, rhs, c, dl, dr):
    """[(x, w, c, dx, dw)] per batch element, as the Dense form [M, K] . [K, N]."""
    if case == "leading":
        return [(lhs[b], rhs[b], c[b], dl[b], dr[b]) for b in range(lhs.shape[0])]
    if case == "inner":
        return [(lhs[:, b], rhs[:, :, b], c[b], dl[:, b], dr[:, :, b])
                for b in range(lhs.shape[1])]
    return [(lhs[b, :, h], rhs[b, :, h].T, c[b, h], dl[b, :, h], dr[b, :, h].T)
            for b in range(lhs.shape[0]) for h in range(lhs.shape[2])]


@pytest.mark.parametrize("case", sorted(BATCHED))
@pytest.mark.parametrize("recipe", ["block", "current"])
def test_batch_dimensions_are_the_vmapped_2d_product(recipe, case):
    """Batch axes (leading, attention-style two of them, inner): forward and both
    gradients equal, bit for bit, the vmap of the call without batch axes, and each batch
    element is within its GEMM bounds of the exact product of the oracle's operands. On
    the CPU (two programs on a GPU may pick different GEMM algorithms)."""
    _check_batched(recipe, case, jax.devices("cpu")[0])


def _check_batched(recipe, case, device):
    r = RECIPES[recipe]
    lhs_shape, rhs_shape, dims, vmapped = BATCHED[case]
    rng = np.random.default_rng(7)
    lhs = (rng.normal(size=lhs_shape) * np.exp2(rng.integers(-3, 4, lhs_shape[:2] + (1,) * (
        len(lhs_shape) - 2)))).astype(F32)
    rhs = (rng.normal(size=rhs_shape) * 0.05).astype(F32)
    out_shape = jax.eval_shape(lambda a, b: jax.lax.dot_general(a, b, dims), lhs, rhs).shape
    c = rng.normal(size=out_shape).astype(F32)
    # The jitted programs run where their inputs are (the CPU, also on a GPU machine).
    on_device = jax.device_put((lhs, rhs), device)

    def step(gemm):
        def f(lhs, rhs):
            out = gemm(lhs, rhs)
            return jnp.sum(out * c), out
        return jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))

    sdg = lambda a, b, d: scaled_dot_general(a, b, d, r)  # noqa: E731
    got = step(lambda a, b: sdg(a, b, dims))(*on_device)
    want = step(vmapped(sdg))(*on_device)
    (_, out), (dl, dr) = got
    assert out.shape == out_shape and dl.shape == lhs.shape and dr.shape == rhs.shape
    assert out.devices() == {device}
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # the public entry points take them too, with the same bits
    meta = jax_fp8.Fp8Meta.create(r)
    got_public = step(lambda a, b: jax_fp8.fp8_dot_general(a, b, dims, meta)[0])(*on_device)
    for a, b in zip(jax.tree.leaves(got_public), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    out_d = out if case != "attention" else np.asarray(out)
    outs = ([out_d[b] for b in range(out.shape[0])] if case != "attention" else
            [out_d[b, h] for b in range(out.shape[0]) for h in range(out.shape[1])])
    m, k = lhs_shape[1 if case != "inner" else 0], 128
    for o, (x, w, cc, dx, dw) in zip(outs, _dense_slices(case, lhs, rhs, c, np.asarray(dl),
                                                         np.asarray(dr))):
        (e_out, s_out), (e_dx, s_dx), (e_dw, s_dw) = expected(r, x, w, cc)
        tg.assert_within(o, e_out, s_out, coefficient(r, k, "cpu"), F32, f"{case} forward")
        tg.assert_within(dx, e_dx, s_dx, coefficient(r, w.shape[1], "cpu"), F32, "dgrad")
        tg.assert_within(dw, e_dw, s_dw, coefficient(r, m, "cpu"), F32, "wgrad")


def test_attention_einsum_switches_recipe_by_one_argument():
    """The same attention-style fp8_einsum runs under all three recipes; the stateless ones
    give the vmap of the per-(batch, head) product."""
    rng = np.random.default_rng(8)
    q = rng.normal(size=(2, 32, 3, 128)).astype(F32)
    k = rng.normal(size=(2, 48, 3, 128)).astype(F32)
    want = np.einsum("bqhd,bkhd->bhqk", q.astype(np.float64), k.astype(np.float64))
    for recipe in (jax_fp8.DelayedScaling(), RECIPES["current"], RECIPES["block"]):
        meta = jax_fp8.Fp8Meta.create(recipe)
        with jax_fp8.frozen_scales():
            out, _ = jax_fp8.fp8_einsum("bqhd,bkhd->bhqk", q, k, meta)
        assert out.shape == want.shape
        # E4M3's relative rounding of each operand (2**-4 each) bounds the error by
        # (2 * 2**-4 + 2**-8) * sum |q||k| (scale 1 for the delayed state: no underflow)
        s = np.einsum("bqhd,bkhd->bhqk", np.abs(q).astype(np.float64), np.abs(k))
        assert np.all(np.abs(np.asarray(out, np.float64) - want) <= 0.13 * s + 1e-6), recipe


def test_errors():
    x, w = np.ones((8, 16), F32), np.ones((16, 4), F32)
    with pytest.raises(ValueError, match="batch"):
        scaled_dot_general(x[None], np.stack([w, w]), (((2,), (1,)), ((0,), (0,))),
                           RECIPES["block"])   # batch sizes 1 and 2
    with pytest.raises(ValueError, match="batch"):
        scaled_dot_general(x[None], w[None], (((2,), (1,)), ((0, 1), (0,))), RECIPES["block"])
    with pytest.raises(TypeError, match="recipe"):
        scaled_dot_general(x, w, DENSE, jax_fp8.DelayedScaling())
    with pytest.raises(ValueError, match="contracting"):
        scaled_dot_general(x, w, (((0,), (0,)), ((), ())), RECIPES["block"])
    with pytest.raises(TypeError, match="lhs"):
        scaled_dot_general(x.astype(np.int32), w, DENSE, RECIPES["block"])


def test_eight_devices_equal_one_device():
    """On 8 host CPU devices (x sharded along M or K; data and tensor parallel steps): the
    FP8 operands are one device's bits (the oracle's), current scaling's amax the global
    one, and forward, dgrad and wgrad within the GEMM bounds (scaled_dot_worker.py)."""
    results = helpers.run_8_device_worker("scaled_dot_worker.py")
    bad = {k: v for k, v in results.items() if v != "ok"}
    assert results and not bad, "\n\n".join(f"{k}:\n{v}" for k, v in bad.items())


def _block_step(x, w):
    """jit(value_and_grad) of a block-scaled fp8_dot_general x [M, K] . w [K, N]."""
    meta = jax_fp8.Fp8Meta.create(RECIPES["block"])

    def loss(x, w):
        return jnp.sum(jax_fp8.fp8_dot_general(x, w, DENSE, meta)[0].astype(F32))
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def _count(jaxpr, counts):
    for eqn in jaxpr.eqns:
        counts[eqn.primitive.name] = counts.get(eqn.primitive.name, 0) + 1
        for p in eqn.params.values():
            inner = getattr(p, "jaxpr", p)
            if hasattr(inner, "eqns"):
                _count(inner, counts)
    return counts


def test_block_scaled_step_is_three_quantizations_and_three_block_gemms():
    """Forward and both gradients: x, w and the gradient are each quantized once (one
    pass gives both layouts), and the three GEMMs are block-scaled GEMMs, no plain dot."""
    x, w = jnp.ones((256, 512), jnp.bfloat16), jnp.ones((512, 384), jnp.bfloat16)
    counts = _count(jax.make_jaxpr(_block_step(x, w))(x, w).jaxpr, {})
    assert counts.get("jax_fp8_block_quantize") == 3, counts
    assert counts.get("jax_fp8_block_gemm") == 3, counts
    assert "dot_general" not in counts, counts


@pytest.mark.gpu
def test_gpu_block_scaled_step_runs_its_kernels_and_no_dequantized_copy(gpu_device):
    """On the GPU the compiled step runs one block-quantize kernel per tensor and one
    cuBLASLt block-scaled GEMM per GEMM, and holds no float32 copy of an operand (what
    the reference path, dequantize then dot, would make)."""
    x, w = (jax.device_put(jnp.ones(s, jnp.bfloat16), gpu_device)
            for s in ((256, 512), (512, 384)))
    hlo = _block_step(x, w).lower(x, w).compile().as_text()
    assert hlo.count('custom_call_target="jax_fp8_block_quantize"') == 3, hlo
    assert hlo.count('custom_call_target="jax_fp8_block_gemm"') == 3, hlo
    # x [256, 512] and its column-wise copy, w as [512, 384] and [384, 512], the
    # gradient's column-wise copy [384, 256] (the loss's own f32 [256, 384] is allowed)
    for shape in ("256,512", "512,256", "512,384", "384,512", "384,256"):
        assert f"f32[{shape}]" not in hlo, shape
