"""The FP8 custom VJPs under JAX's remat policies and under second-order differentiation.

Remat: every ``jax.checkpoint_policies`` policy (and linen ``nn.remat`` / ``nnx.remat`` with
``policy=``) gives, bit for bit, the gradient of the un-rematerialized function for every
recipe, with quantized values at fp8_max, at 288 and at the smallest normals (the
values JAX's ``reduce_precision`` on saved FP8 residuals would turn into NaN or 0).

Second order: differentiating an FP8 GEMM's gradient again (``jax.hessian``,
``jax.jacfwd(jax.grad)``, ``jax.grad(jax.grad)``, a Hessian-vector product, also through
``jax.jit``) raises at trace time, through every public GEMM and for every recipe.

The recipe matrices: every recipe under every policy through ``jax.checkpoint`` (jitted),
under vmap and scan, and through every public GEMM under ``jax.hessian``; a further
framework (linen's ``nn.remat``, ``nnx.remat``) runs delayed scaling, the recipe whose FP8
state those lift (helpers.E2E_RECIPES); remat without jit, the other second-order
transformations and the second order of other variables run one recipe per custom VJP
(helpers.VJP_RECIPES): they check the VJP, not the recipe's quantization.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

import helpers
import jax_fp8
import jax_fp8.flax as jfl
import jax_fp8.flax.nnx as jfnnx
from jax_fp8 import Fp8Meta
from jax_fp8.devtools import hlo
from jax_fp8.gemm.scaled_dot import scaled_dot_general

F32 = np.float32
DN = (((1,), (0,)), ((), ()))
CP = jax.checkpoint_policies
RECIPES = helpers.RECIPES
NAME = "fp8_out"


@pytest.fixture(autouse=True)
def _on_cpu_unless_gpu(request):
    """Bit-for-bit comparisons of two programs run on the CPU (on a GPU the two may run a
    GEMM with different cuBLASLt algorithms); the gpu-marked test picks its device."""
    if "gpu" in request.keywords:
        yield
        return
    with jax.default_device(jax.devices("cpu")[0]):
        yield


def _offload_policies():
    # Host offloading needs a "pinned_host" memory space on the device the tests run on.
    try:
        kinds = {m.kind for m in jax.devices("cpu")[0].addressable_memories()}
    except Exception:  # noqa: BLE001 (a backend without memory spaces)
        kinds = set()
    if "pinned_host" not in kinds:
        return {}
    return {
        "offload_dot_with_no_batch_dims": CP.offload_dot_with_no_batch_dims(
            "device", "pinned_host"),
        "save_and_offload_only_these_names": CP.save_and_offload_only_these_names(
            names_which_can_be_saved=[], names_which_can_be_offloaded=[NAME],
            offload_src="device", offload_dst="pinned_host"),
    }


POLICIES = {
    "everything_saveable": CP.everything_saveable,
    "nothing_saveable": CP.nothing_saveable,
    "dots_saveable": CP.dots_saveable,
    "checkpoint_dots": CP.checkpoint_dots,
    "dots_with_no_batch_dims_saveable": CP.dots_with_no_batch_dims_saveable,
    "checkpoint_dots_with_no_batch_dims": CP.checkpoint_dots_with_no_batch_dims,
    "save_anything_except_these_names": CP.save_anything_except_these_names(NAME),
    "save_any_names_but_these": CP.save_any_names_but_these(NAME),
    "save_only_these_names": CP.save_only_these_names(NAME),
    "save_from_both_policies": CP.save_from_both_policies(CP.dots_saveable,
                                                          CP.everything_saveable),
    **_offload_policies(),
}


def operands(m=32, k=256, n=128):
    """x, w and a cotangent c whose quantized copies (current scaling: scale fp8_max / amax)
    hold 448, 288 and 2**-6, 2**-7 (E4M3 values JAX's reduce_precision turns into NaN or 0
    on the CPU), next to ordinary normal values; x has a row of tiny values."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(m, k)).astype(F32)
    x[0, :4] = [4.0, -2.5714285, 4.0 * 2.0**-6 / 448, 4.0 * 2.0**-7 / 448]   # amax 4
    x[0, 4:] = np.clip(x[0, 4:], -3.9, 3.9)
    x[1] *= F32(1e-3)
    w = (rng.normal(size=(k, n)) * 0.05).astype(F32)
    w[3, :3] = [0.5, 0.5 * 288 / 448, -0.5]
    w[3, 3:] = np.clip(w[3, 3:], -0.49, 0.49)
    c = rng.normal(size=(m, n)).astype(F32)
    return jnp.asarray(x), jnp.asarray(w), jnp.asarray(c)


def meta_for(name, x, w, c):
    """A fresh stateless meta, or for delayed scaling one after a step (scales from the
    amaxes: quantized values up to fp8_max)."""
    meta = Fp8Meta.create(RECIPES[name])
    if name != "delayed":
        return meta
    grads = jax.grad(loss, argnums=2)(x, w, meta, c)
    return jax_fp8.new_fp8_state(meta, grads, RECIPES[name])


def loss(x, w, meta, c):
    out, _ = jax_fp8.fp8_dot_general(x, w, DN, meta)
    out = checkpoint_name(out, NAME)
    return jnp.sum(out * c) + jnp.sum(jnp.tanh(out))


def assert_trees_equal(got, want):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@functools.cache
def _without_remat(recipe):
    """(operands, meta, the jitted gradient without remat) of `recipe`: computed once for
    all the policies."""
    x, w, c = operands()
    meta = meta_for(recipe, x, w, c)
    want = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x, w, meta, c)
    assert all(np.isfinite(np.asarray(a)).all() for a in jax.tree.leaves(want))
    return (x, w, meta, c), want


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_every_remat_policy_gives_the_gradient_without_remat(recipe, policy):
    args, want = _without_remat(recipe)
    remat = jax.checkpoint(loss, policy=POLICIES[policy])
    got = jax.jit(jax.grad(remat, argnums=(0, 1, 2)))(*args)
    assert_trees_equal(got, want)


@pytest.mark.parametrize("recipe", helpers.VJP_RECIPES)   # every recipe: the jitted test above
def test_remat_policy_without_jit(recipe):
    x, w, c = operands()
    meta = meta_for(recipe, x, w, c)
    remat = jax.checkpoint(loss, policy=CP.everything_saveable)
    assert_trees_equal(jax.grad(remat, argnums=(0, 1, 2))(x, w, meta, c),
                       jax.grad(loss, argnums=(0, 1, 2))(x, w, meta, c))


def test_the_issue_repro_everything_saveable_current_scaling_is_finite():
    x, w, _ = operands(16, 32, 16)
    m = Fp8Meta.create(jax_fp8.Float8CurrentScaling())
    f = lambda w: jnp.sum(jax_fp8.fp8_dot_general(x, w, DN, m)[0] ** 2)  # noqa: E731
    got = jax.grad(jax.checkpoint(f, policy=CP.everything_saveable))(w)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jax.grad(f)(w)))
    assert np.isfinite(np.asarray(got)).all()


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_remat_of_einsum_and_scan_of_remat(recipe):
    """fp8_einsum under a saving policy, and a remat'd layer inside lax.scan."""
    x, w, c = operands()
    meta = meta_for(recipe, x, w, c)

    def f(x, w, meta):
        out, _ = jax_fp8.fp8_einsum("mk,kn->mn", x, w, meta)
        return jnp.sum(out * c)

    want = jax.grad(f, argnums=(0, 1, 2))(x, w, meta)
    got = jax.grad(jax.checkpoint(f, policy=CP.everything_saveable), argnums=(0, 1, 2))(
        x, w, meta)
    assert_trees_equal(got, want)


def test_remat_under_vmap_and_inside_scan_bf16(recipe):
    """bfloat16 operands; vmap of the gradient of a remat'd function, and a remat'd
    function in a lax.scan body: the gradients without remat."""
    rng = np.random.default_rng(5)
    xs = jnp.asarray(rng.normal(size=(3, 16, 128)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(128, 32)), jnp.bfloat16)
    meta = Fp8Meta.create(recipe)

    def f(w, x):
        out, _ = jax_fp8.fp8_dot_general(x, w, DN, meta)
        return jnp.sum(out.astype(jnp.float32) ** 2)

    remat = jax.checkpoint(f, policy=CP.everything_saveable)

    def scanned(g):
        return lambda w: jax.lax.scan(lambda a, x: (a + g(w, x), None), 0.0, xs)[0]

    with jax_fp8.frozen_scales():   # delayed scaling: gradients w.r.t. the operands only
        assert_trees_equal(jax.jit(jax.vmap(jax.grad(remat), in_axes=(None, 0)))(w, xs),
                           jax.jit(jax.vmap(jax.grad(f), in_axes=(None, 0)))(w, xs))
        assert_trees_equal(jax.jit(jax.grad(scanned(remat)))(w),
                           jax.jit(jax.grad(scanned(f)))(w))


class _LinenMlp(nn.Module):
    recipe: object
    policy: object

    @nn.compact
    def __call__(self, x):
        def dense(features):
            dg = lambda: jfl.Fp8DotGeneral(recipe=self.recipe)  # noqa: E731
            return nn.Dense(features, use_bias=False, dot_general_cls=dg)
        Block = nn.remat(_LinenBlock, policy=self.policy) if self.policy else _LinenBlock
        return Block(dense, name="block")(x)


class _LinenBlock(nn.Module):
    dense: object

    @nn.compact
    def __call__(self, x):
        return self.dense(128)(jnp.tanh(self.dense(256)(x)))


def _linen_grads(model, variables):
    x, _, c = operands()

    def f(params, rest):
        return jnp.sum(model.apply({"params": params, **rest}, x) * c)
    params = variables["params"]
    rest = {k: v for k, v in variables.items() if k != "params"}
    return jax.jit(jax.grad(f, argnums=(0, 1)))(params, rest)


@functools.cache
def _linen_without_remat(name):
    """(variables, gradients) of the linen MLP without remat: once for all the policies."""
    plain = _LinenMlp(RECIPES[name], None)
    variables = jax.jit(plain.init)(jax.random.key(0), operands()[0])
    return variables, _linen_grads(plain, variables)


@pytest.mark.parametrize("policy", ["everything_saveable", "save_anything_except_these_names",
                                    "dots_saveable", "nothing_saveable"])
@pytest.mark.parametrize("name", helpers.E2E_RECIPES)   # every recipe: jax.checkpoint's test
def test_linen_remat_with_policy(name, policy):
    recipe = RECIPES[name]
    x = operands()[0]
    variables, want = _linen_without_remat(name)
    remat = _LinenMlp(recipe, POLICIES[policy])
    # the remat'd module's variables sit under the same names
    assert (jax.tree.structure(jax.eval_shape(remat.init, jax.random.key(0), x))
            == jax.tree.structure(variables))
    assert_trees_equal(_linen_grads(remat, variables), want)


class _NnxBlock(nnx.Module):
    def __init__(self, recipe, rngs):
        self.a = jfnnx.Fp8Linear(256, 256, recipe=recipe, rngs=rngs)
        self.b = jfnnx.Fp8Linear(256, 128, recipe=recipe, rngs=rngs)

    def __call__(self, x):
        return self.b(jnp.tanh(self.a(x)))


@pytest.mark.parametrize("policy", ["everything_saveable", "save_anything_except_these_names",
                                    "nothing_saveable"])
@pytest.mark.parametrize("name", helpers.E2E_RECIPES)   # every recipe: jax.checkpoint's test
def test_nnx_remat_with_policy(name, policy):
    x, _, c = operands()
    model = _NnxBlock(RECIPES[name], nnx.Rngs(0))

    def plain(model, x):
        return jnp.sum(model(x) * c)

    @nnx.remat(policy=POLICIES[policy])
    def block(model, x):
        return model(x)

    def remat(model, x):
        return jnp.sum(block(model, x) * c)

    def grads(f):
        wrt = nnx.DiffState(0, nnx.Any(nnx.Param, jfnnx.Fp8State))
        return nnx.grad(f, argnums=wrt)(model, x)

    assert_trees_equal(grads(remat), grads(plain))


# ------------------------------------------------------------------ GPU: FP8 GEMMs kept

@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["everything_saveable", "save_anything_except_these_names",
                                    "nothing_saveable"])
@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_gpu_remat_keeps_every_gemm_an_fp8_cublaslt_gemm(gpu_device, recipe, policy):
    """Residuals stored as integers still reach the backward's GEMMs as FP8 operands:
    the compiled forward + backward under the policy has as many cuBLASLt FP8 GEMMs as
    without remat (3, or 4 where the policy recomputes the forward GEMM), and the same
    gradients. The loss is linear in the output, so every GEMM's FP8 operands are the
    same bits in both programs (the amaxes equal bit for bit); the two programs may
    still run a GEMM with different cuBLASLt algorithms, whose accumulations differ by
    at most 2**-10 of S = sum |a||b| each (tests/kernels/test_block_gemm.py), so the gradients
    are compared to 2**-9 of S (S from the unquantized operands, with 2**-3 of E5M2
    rounding on top)."""
    x, w, c = jax.device_put(operands(128, 256, 128), gpu_device)
    meta = jax.device_put(meta_for(recipe, x, w, c), gpu_device)

    def linear(x, w, meta):
        out, _ = jax_fp8.fp8_dot_general(x, w, DN, meta)
        return jnp.sum(checkpoint_name(out, NAME) * c)

    # value_and_grad: the loss keeps the forward GEMM live (jax.grad alone would let XLA
    # drop it, the loss being linear in the output).
    step = jax.jit(jax.value_and_grad(linear, argnums=(0, 1, 2)))
    remat = jax.jit(jax.value_and_grad(jax.checkpoint(linear, policy=POLICIES[policy]),
                                       argnums=(0, 1, 2)))
    plain_gemms = hlo.fp8_gemms(step.lower(x, w, meta).compile())
    remat_gemms = hlo.fp8_gemms(remat.lower(x, w, meta).compile())
    assert set(plain_gemms) == set(remat_gemms) == {"__cublas$lt$matmul$f8"}, \
        (plain_gemms, remat_gemms)
    assert plain_gemms["__cublas$lt$matmul$f8"] == 3, plain_gemms
    assert remat_gemms["__cublas$lt$matmul$f8"] in (3, 4), remat_gemms
    (_, (dx, dw, dmeta)), (_, (dx0, dw0, dmeta0)) = remat(x, w, meta), step(x, w, meta)
    assert_trees_equal(dmeta, dmeta0)
    xa, wa, ca = (np.abs(np.asarray(a, np.float64)) for a in (x, w, c))
    for got, want, s in ((dx, dx0, ca @ wa.T), (dw, dw0, xa.T @ ca)):
        got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
        assert np.isfinite(got).all()
        assert np.all(np.abs(got - want) <= 2.0**-9 * 1.25 * s)


# ------------------------------------------------------------------------ second order

def _gemm_fns():
    """name -> (recipe name -> f(v, w, meta) -> scalar), for every public GEMM."""
    def dot(v, w, meta):
        return jnp.sum(jax_fp8.fp8_dot_general(v, w, DN, meta)[0] ** 2)

    def einsum(v, w, meta):
        return jnp.sum(jax_fp8.fp8_einsum("mk,kn->mn", v, w, meta)[0] ** 2)

    def scaled(v, w, meta):
        return jnp.sum(scaled_dot_general(v, w, DN, meta.recipe) ** 2)

    return {"fp8_dot_general": dot, "fp8_einsum": einsum, "scaled_dot_general": scaled}


GEMMS = _gemm_fns()
SECOND_ORDER = {
    "hessian": lambda f: jax.hessian(f),
    "jacfwd_grad": lambda f: jax.jacfwd(jax.grad(f)),
    "jacrev_grad": lambda f: jax.jacrev(jax.grad(f)),
    "grad_grad": lambda f: jax.grad(lambda v: jnp.sum(jax.grad(f)(v) ** 2)),
    "hvp": lambda f: lambda v: jax.jvp(jax.grad(f), (v,), (jnp.ones_like(v),))[1],
    "grad_jit_grad": lambda f: jax.grad(lambda v: jnp.sum(jax.jit(jax.grad(f))(v))),
}


def _second_order_cases():
    """(recipe, gemm, how): every recipe through every public GEMM under jax.hessian, and
    each other way of differentiating a gradient again with one recipe per custom VJP
    (helpers.VJP_RECIPES; the guard sits in the VJP, the recipe only picks the
    quantization). scaled_dot_general takes the recipes without state only."""
    takes = lambda recipe, gemm: gemm != "scaled_dot_general" or recipe != "delayed"  # noqa: E731
    return ([(r, g, "hessian") for r in sorted(RECIPES) for g in sorted(GEMMS) if takes(r, g)]
            + [(r, g, h) for r in helpers.VJP_RECIPES for g in sorted(GEMMS)
               for h in sorted(SECOND_ORDER) if h != "hessian" and takes(r, g)])


@pytest.mark.parametrize("recipe, gemm, how", _second_order_cases())
def test_second_order_ad_raises_at_trace_time(recipe, gemm, how):
    x, w, c = operands(16, 128, 16)
    meta = meta_for(recipe, x, w, c)
    fn = GEMMS[gemm]
    second = SECOND_ORDER[how]
    wrt = {"lhs": (lambda v: fn(v, w, meta), x), "rhs": (lambda v: fn(x, v, meta), w)}
    with jax_fp8.frozen_scales():   # delayed scaling: the meta is deliberately not differentiated
        for f, v in wrt.values():
            with pytest.raises(NotImplementedError, match=r"differentiated again"):
                second(f)(v)


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_second_order_names_the_op_and_the_fix(recipe):
    x, w, c = operands(16, 128, 16)
    meta = meta_for(recipe, x, w, c)
    f = lambda v: jnp.sum(jax_fp8.fp8_dot_general(v, w, DN, meta)[0] ** 2)  # noqa: E731
    with jax_fp8.frozen_scales(), pytest.raises(NotImplementedError) as e:
        jax.hessian(f)(x[:1])
    assert "fp8_dot_general" in str(e.value) and "jax.lax.dot_general" in str(e.value)


@pytest.mark.parametrize("recipe", helpers.VJP_RECIPES)
def test_first_order_and_second_order_of_other_variables_still_work(recipe):
    """Only a derivative of the FP8 GEMM's own derivative is refused: the Hessian of a
    loss w.r.t. a parameter applied after the GEMM (which never differentiates the GEMM
    twice) is computed, and equals the one of the same loss with the GEMM's output
    given as a constant."""
    x, w, c = operands(16, 128, 16)
    meta = meta_for(recipe, x, w, c)
    out = jax_fp8.fp8_dot_general(x, w, DN, meta)[0]

    def f(s):
        y = jax_fp8.fp8_dot_general(x, w, DN, meta)[0]
        return jnp.sum(jnp.tanh(y * s) ** 2)

    s = jnp.full((16,), 0.3, jnp.float32)
    want = jax.hessian(lambda s: jnp.sum(jnp.tanh(out * s) ** 2))(s)
    np.testing.assert_array_equal(np.asarray(jax.hessian(f)(s)), np.asarray(want))


def test_the_issue_repro_hessian_raises():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(3,)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(3, 16)), jnp.float32)
    for recipe in (jax_fp8.Float8CurrentScaling(), jax_fp8.Float8BlockScaling()):
        m = Fp8Meta.create(recipe)
        f = lambda v: jnp.sum(jax_fp8.fp8_dot_general(v[None], w, DN, m)[0] ** 2)  # noqa: E731
        with pytest.raises(NotImplementedError, match="fp8_dot_general"):
            jax.hessian(f)(x)


