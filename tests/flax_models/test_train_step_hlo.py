"""The compiled train step: ONE fused update for the whole model, in place when donated.

On a GPU with FP8 tensor cores (Hopper/Ada) it also checks that the FP8 GEMMs became
cuBLASLt FP8 matmuls; elsewhere that test is skipped.
"""

import functools
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import helpers
import jax_fp8
from jax_fp8.flax import FP8_COLLECTION, Fp8DotGeneral, Fp8TrainState

L = 24                       # a history length no other tensor in the step has
N_LAYERS = 8
RECIPE = jax_fp8.DelayedScaling(history_len=L)
DG = functools.partial(Fp8DotGeneral, recipe=RECIPE)
UPDATE = 'custom_call_target="jax_fp8_update"'
needs_kernel = pytest.mark.skipif(not (jax_fp8.HAS_CPU_KERNEL or jax_fp8.HAS_CUDA_KERNEL),
                                  reason="jax_fp8 kernels not built")


class Deep(nn.Module):
    width: int = 32
    n_layers: int = N_LAYERS

    @nn.compact
    def __call__(self, x):
        for _ in range(self.n_layers):
            x = nn.gelu(nn.Dense(self.width, dot_general_cls=DG)(x))
        return x


class Layer(nn.Module):
    width: int

    @nn.compact
    def __call__(self, x, _):
        return nn.gelu(nn.Dense(self.width, dot_general_cls=DG)(x)), None


class ScannedDeep(nn.Module):
    width: int = 32
    n_layers: int = N_LAYERS

    @nn.compact
    def __call__(self, x):
        stack = nn.scan(Layer, variable_axes={"params": 0, FP8_COLLECTION: 0},
                        split_rngs={"params": True}, length=self.n_layers)
        return stack(self.width, name="layers")(x, None)[0]


def _state(model, x, pack=True):
    v = jax.jit(model.init)(jax.random.key(0), x)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    return Fp8TrainState.create(apply_fn=model.apply, variables=v, tx=tx, recipe=RECIPE,
                                pack_fp8=pack)


train_step = helpers.mse_fp8_step


def split_step(rest, fp8, x, y):
    """train_step with the FP8 state as its own argument (to donate it alone)."""
    new, val = train_step(rest.replace(fp8=fp8), x, y)
    return new.replace(fp8=None), new.fp8, val


def _fp8_bytes(fp8):
    return sum(a.nbytes for a in jax.tree.leaves(fp8))


def _n_states(fp8):
    return sum(isinstance(s, jax_fp8.ScalingState)
               for s in jax.tree.leaves(fp8, is_leaf=lambda s: isinstance(
                   s, jax_fp8.ScalingState)))


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    return (jnp.asarray(rng.standard_normal((16, 32)), jnp.float32),
            jnp.asarray(rng.standard_normal((16, 32)), jnp.float32))


@needs_kernel
@pytest.mark.parametrize("pack", [True, False], ids=["packed", "per_tensor"])
def test_one_fused_update_and_in_place_fp8_state(data, pack):
    x, y = data
    state = _state(Deep(), x, pack)
    assert _n_states(jax_fp8.unpack_states(state.fp8)) == 3 * N_LAYERS
    # Packed (the default): one stacked state per (FP8 dtype, L): E4M3 and E5M2.
    assert _n_states(state.fp8) == (2 if pack else 3 * N_LAYERS)
    rest = state.replace(fp8=None)
    compiled = jax.jit(split_step, donate_argnums=(1,)).lower(rest, state.fp8, x, y).compile()
    hlo = compiled.as_text()
    # The whole model's 24 FP8 states: one custom call.
    assert hlo.count(UPDATE) == 1
    # Donated: every FP8 byte is aliased input -> output ...
    assert compiled.memory_analysis().alias_size_in_bytes == _fp8_bytes(state.fp8)
    # ... and no amax history is copied (only 4-byte scales read by the GEMMs may be).
    assert not re.search(rf"f32\[{L}\]\{{0\}} copy\(", hlo)
    # It runs, and the step's amaxes land in the (aliased) new state.
    _, fp8, _ = compiled(rest, jax.tree.map(jnp.copy, state.fp8), x, y)
    fp8 = jax_fp8.unpack_states(fp8)
    assert float(fp8["Dense_0"]["Fp8DotGeneral_0"]["input"].amax_history[-1]) == float(
        jnp.max(jnp.abs(x)))


@needs_kernel
def test_donating_the_whole_train_state(data):
    x, y = data
    state = _state(Deep(), x)
    compiled = jax.jit(train_step, donate_argnums=(0,)).lower(state, x, y).compile()
    assert compiled.as_text().count(UPDATE) == 1
    assert compiled.memory_analysis().alias_size_in_bytes >= _fp8_bytes(state.fp8)
    new, _ = compiled(state, x, y)      # runs, and the result is usable
    assert int(new.step) == 1


@needs_kernel
def test_scanned_layers_one_fused_update(data):
    x, y = data
    state = _state(ScannedDeep(), x)
    st = jax_fp8.unpack_states(state.fp8)["layers"]["Dense_0"]["Fp8DotGeneral_0"]["grad"]
    assert st.amax_history.shape == (N_LAYERS, L)
    hlo = jax.jit(train_step).lower(state, x, y).compile().as_text()
    assert hlo.count(UPDATE) == 1


def _gpu_with_fp8():
    try:
        devs = jax.devices("gpu")
    except RuntimeError:
        return None
    if not devs:
        return None
    cc = getattr(devs[0], "compute_capability", "0")
    major, minor = (int(p) for p in (str(cc).split(".") + ["0"])[:2])
    return devs[0] if (major, minor) >= (8, 9) else None


# Run with the test folders on PYTHONPATH (helpers.with_test_path).
_GPU_SCRIPT = r"""
import functools, sys
import jax, jax.numpy as jnp, numpy as np
import test_train_step_hlo as t
width, n = 128, t.N_LAYERS
rng = np.random.default_rng(0)
x = jnp.asarray(rng.standard_normal((64, width)), jnp.bfloat16)
y = jnp.asarray(rng.standard_normal((64, width)), jnp.bfloat16)
state = t._state(t.Deep(width=width, n_layers=n), x)
compiled = jax.jit(t.train_step, donate_argnums=(0,)).lower(state, x, y).compile()
hlo = compiled.as_text()
# The same step on the CPU backend: the GPU's FP8 GEMMs must give about the same loss.
cpu = jax.devices("cpu")[0]
_, loss_cpu = jax.jit(t.train_step)(*jax.device_put((state, x, y), cpu))
new, loss = compiled(state, x, y)
close = abs(float(loss) - float(loss_cpu)) <= 0.02 * abs(float(loss_cpu))
print("RESULT", hlo.count("__cublas$lt$matmul$f8"), t.count_fp8_dots(hlo),
      hlo.count(t.UPDATE), bool(jnp.isfinite(loss)) and close, float(loss), float(loss_cpu))
"""


def count_fp8_dots(hlo):
    """GEMMs on FP8 operands in optimized HLO: cuBLASLt FP8 calls, plus fused dots (XLA's
    Triton GEMM fusions) whose two operands are FP8 parameters of their fusion."""
    count = hlo.count("__cublas$lt$matmul$f8")
    for block in re.split(r"\n(?=\S)", hlo):
        types = dict(re.findall(r"%(\S+) = (\w+)\[[^\]]*\]\S* parameter\(", block))
        for a, b in re.findall(r" dot\(%([^,\s]+), %([^,\s)]+)\)", block):
            if types.get(a, "").startswith("f8e") and types.get(b, "").startswith("f8e"):
                count += 1
    return count


def _run_gpu_script(xla_flags):
    import os
    import subprocess
    import sys
    env = helpers.with_test_path(dict(os.environ))
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + xla_flags).strip()
    out = subprocess.run([sys.executable, "-c", _GPU_SCRIPT], env=env,
                         capture_output=True, text=True, timeout=300)
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT")]
    assert line, out.stdout[-2000:] + out.stderr[-4000:]
    cublaslt, fp8_dots, updates, ok = line[0].split()[1:5]
    return int(cublaslt), int(fp8_dots), int(updates), ok == "True"


@pytest.mark.gpu
def test_fp8_gemms_become_cublaslt_fp8_on_gpu():
    if _gpu_with_fp8() is None:
        pytest.skip("needs a GPU with FP8 tensor cores (compute capability >= 8.9)")
    n = N_LAYERS
    # Forward, input-gradient and kernel-gradient GEMM of every layer (the first layer's
    # input gradient is not needed and may be pruned): at least 3n - 1 FP8 GEMMs.
    # XLA's default may give some of them to its Triton GEMM emitter (still FP8 dots);
    # with Triton GEMMs off, every one must be a cuBLASLt FP8 matmul.
    # The loss must be finite and within 2% of the same step on the CPU backend.
    _, fp8_dots, updates, ok = _run_gpu_script("")
    assert fp8_dots >= 3 * n - 1, fp8_dots
    assert updates == 1 and ok
    cublaslt, _, updates, ok = _run_gpu_script("--xla_gpu_enable_triton_gemm=false")
    assert cublaslt >= 3 * n - 1, cublaslt
    assert updates == 1 and ok
