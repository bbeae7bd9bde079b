"""Test helpers: backends, running on a device, bit-exact comparisons, case making."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fp8

# Buffer placement for the 64-bit-offset launch (re-exported for the tests).
from buffers import WIDE_SPAN_BYTES, buffer_span, put_far_from  # noqa: F401

F32 = np.float32
FLT_MAX = F32(np.finfo(np.float32).max)

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))

# One instance of every registered recipe, by a short name: the `recipe` fixture
# (conftest.py) and the recipe-parametrised tests run each; test_recipes.py checks that
# no registered recipe is missing. history_len=4 keeps delayed-scaling states small.
RECIPES = {
    "delayed": jax_fp8.DelayedScaling(history_len=4),
    "current": jax_fp8.Float8CurrentScaling(),
    "block": jax_fp8.Float8BlockScaling(),
    "mxfp8": jax_fp8.MXFP8BlockScaling(),
}


# End-to-end model tests do not run every recipe with every variant of a framework: the
# recipes' numbers are pinned in tests/recipes/ and tests/kernels/, so a matrix of recipes x
# training-loop variants runs every recipe with one variant and delayed scaling (the
# default) with the others (recipe_variant_cases), and a further framework or codebase
# runs delayed scaling alone (E2E_RECIPES).
E2E_RECIPES = ["delayed"]


def recipe_variant_cases(variants, every_recipe_with) -> list[tuple[str, str]]:
    """(recipe, variant) pairs: every recipe of RECIPES with the variant
    ``every_recipe_with``, and "delayed" with each other variant."""
    return ([(name, every_recipe_with) for name in sorted(RECIPES)]
            + [("delayed", v) for v in sorted(variants) if v != every_recipe_with])


# The FP8 GEMMs have two custom VJPs: delayed scaling's (jax_fp8/recipes/delayed.py) and the
# one the recipes without state share (jax_fp8/gemm/scaled_dot.py, where the recipe only
# picks the quantization). Where a test checks what that VJP does under a further
# transformation (remat without jit, a second-order derivative) and the same contract is
# checked for every recipe in another case of the file, it runs one recipe of each VJP.
VJP_RECIPES = ["current", "delayed"]


def _test_dirs() -> list[str]:
    """tests/, then each folder directly under it that holds Python files, sorted."""
    subs = [e.path for e in os.scandir(TESTS_DIR)
            if e.is_dir() and any(n.endswith(".py") for n in os.listdir(e.path))]
    return [TESTS_DIR, *sorted(subs)]


# Every module under tests/ is imported by its basename, from any folder: the shared
# modules here, a test module that another reuses (test_block_gemm's bounds), a worker
# script. conftest.py puts these folders on sys.path and with_test_path on a subprocess's
# PYTHONPATH. Basenames are therefore unique across tests/: pytest refuses two test
# modules of one name, and of any other duplicate only the first found would be imported.
TEST_DIRS = _test_dirs()


def with_test_path(env: dict[str, str]) -> dict[str, str]:
    """A copy of the environment `env` with TEST_DIRS before its PYTHONPATH, so that a
    Python subprocess imports the modules under tests/ by basename as the tests do."""
    rest = [env["PYTHONPATH"]] if env.get("PYTHONPATH") else []
    return dict(env, PYTHONPATH=os.pathsep.join([*TEST_DIRS, *rest]))


def find_test_file(name: str) -> str:
    """The absolute path of the file `name` (a basename such as "fsdp_worker.py") in
    TEST_DIRS. Raises FileNotFoundError naming the folders searched when there is none."""
    for d in TEST_DIRS:
        path = os.path.join(d, name)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(f"{name!r} is in none of the test folders {TEST_DIRS}")


def _gpu_devices():
    # Ask for the GPU backend by name: jax.devices() alone is only the default
    # backend (which may be the CPU, e.g. under JAX_PLATFORMS=cpu,gpu ordering).
    try:
        return [d for d in jax.devices("gpu") if d.platform == "gpu"]
    except RuntimeError:  # no GPU backend at all
        return []


GPU_DEVICES = _gpu_devices()
HAS_GPU = bool(GPU_DEVICES) and jax_fp8.HAS_CUDA_KERNEL
GPU_SKIP_REASON = (f"needs a CUDA GPU and the CUDA kernel (gpu devices: {len(GPU_DEVICES)}, "
                   f"HAS_CUDA_KERNEL: {jax_fp8.HAS_CUDA_KERNEL})")
BACKENDS = ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)]


def backend_device(backend: str):
    if backend == "gpu":
        if not HAS_GPU:
            pytest.skip(GPU_SKIP_REASON)
        return GPU_DEVICES[0]
    return jax.devices("cpu")[0]


def run_on(device, fn, *args, jit=True, check_device=True, **jit_kwargs):
    """Runs fn(*args) on `device` (inputs are put there; the computation follows
    them) and returns the outputs as NumPy arrays (a pytree like fn's result).

    check_device: assert every output lives on `device` (off where an output is a
    constant, e.g. a zero gradient, which jax places on the default device)."""
    args = jax.device_put(args, device)
    f = jax.jit(fn, **jit_kwargs) if jit else fn
    out = f(*args)
    for leaf in jax.tree.leaves(out) if check_device else ():
        if isinstance(leaf, jax.Array):
            assert leaf.devices() == {device}, (leaf.devices(), device)
    return jax.tree.map(lambda x: np.array(x), out)


def bits(x):
    return np.array(x, np.float32, copy=True).view(np.uint32)  # keeps 0-d shapes


def assert_bits_equal(actual, expected, what="", context=None):
    """Bit-for-bit equality of float32 arrays (NaN payloads and signed zeros count).

    `context`: optional dict of arrays with the same leading shape as `actual`'s
    mismatching rows, printed for the first mismatches to make failures readable.
    """
    actual = np.asarray(actual, np.float32)
    expected = np.asarray(expected, np.float32)
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    a, e = bits(actual), bits(expected)
    if not np.array_equal(a, e):
        bad = np.argwhere(a != e)
        lines = [f"{what}: {len(bad)} of {a.size} elements differ"]
        for idx in bad[:8]:
            idx = tuple(int(i) for i in idx)
            lines.append(f"  at {idx}: got {actual[idx]!r} (0x{a[idx]:08x}), "
                         f"want {expected[idx]!r} (0x{e[idx]:08x})")
            if context:
                for name, arr in context.items():
                    arr = np.asarray(arr)
                    sub = arr[idx[:arr.ndim]] if arr.ndim else arr
                    sub_text = np.array2string(np.asarray(sub), threshold=20)
                    lines.append(f"    {name}{idx[:arr.ndim]} = {sub_text}")
        np.testing.assert_array_equal(a, e, err_msg="\n".join(lines))


UPDATE_OUTPUTS = ("history", "scale", "scale_inv")


def assert_update_equal(got, want, what="", context=None):
    """assert_bits_equal on each of an update's (history, scale, scale_inv)."""
    for name, g, w in zip(UPDATE_OUTPUTS, got, want):
        assert_bits_equal(g, w, f"{what} {name}".strip(), context)


# ----------------------------------------------------------------------------
# Random cases full of edge values.

def _from_bits(*b):
    return np.array(b, np.uint32).view(np.float32)


NANS = _from_bits(0x7FC00000, 0xFFC00000, 0x7FC12345, 0xFFFFFFFF, 0x7FA00001)  # last: signaling
SUBNORMALS = np.array([1e-45, 1e-40, 2.9387359e-39, 1.1754942e-38, -1e-45, -1e-40],
                      np.float32)
SPECIAL_AMAX = np.concatenate([
    NANS,
    np.array([np.inf, -np.inf, 0.0, -0.0, FLT_MAX, -FLT_MAX, 1e38, 3e38,
              np.finfo(np.float32).tiny, 448 / float(FLT_MAX) / 2, 1e-37, 5e-36, 1e-35,
              -1.0, -3.5, 3.5, 1.0, 448.0, 57344.0, 0.5, 2.0 ** -20], np.float32),
    SUBNORMALS,
]).astype(np.float32)
SPECIAL_SCALE = np.concatenate([
    NANS[:3],
    np.array([1.0, 0.0, -0.0, -1.0, -2.5, np.inf, -np.inf, FLT_MAX, 3.0, 0.1, 2.0 ** 126,
              2.0 ** 127, 1e38, 2.0 ** -126, 2.0 ** -140], np.float32),
    SUBNORMALS,
]).astype(np.float32)


def random_amax_values(rng, shape, special_p=0.3):
    """Mostly positive normals over the whole exponent range, some edge values."""
    n = int(np.prod(shape))
    kind = rng.random(n)
    out = np.empty(n, np.float32)
    lg = kind < 0.4
    out[lg] = (10.0 ** rng.uniform(-38, 38.5, lg.sum())).astype(np.float32)
    small = (kind >= 0.4) & (kind < 1 - special_p)
    out[small] = rng.uniform(0, 1000, small.sum()).astype(np.float32)
    sp = kind >= 1 - special_p
    out[sp] = rng.choice(SPECIAL_AMAX, sp.sum())
    return out.reshape(shape)


def make_cases(rng, lead, L, with_amax, special_p=0.3, scrub_subnormals=0.0):
    """history [*lead, L], scale [*lead], amax [*lead] or None, full of edge cases.

    Rows get extra zero / -0 / NaN staging slots (h0 == 0 drives skip_unused), and
    some whole-history rows are all zeros, all NaN, or all negative. A fraction
    `scrub_subnormals` of the tensors has every subnormal input replaced by 0.
    """
    lead = tuple(lead)
    h = random_amax_values(rng, lead + (L,), special_p)
    n = int(np.prod(lead)) if lead else 1
    flat = h.reshape(n, L)
    r = rng.random(n)
    flat[r < 0.15, 0] = 0.0
    flat[(r >= 0.15) & (r < 0.25), 0] = -0.0
    flat[(r >= 0.25) & (r < 0.3), 0] = np.nan
    # Whole rows: all +0, all -0, all NaN, all negative, one subnormal among zeros.
    r2 = rng.random(n)
    flat[r2 < 0.04] = 0.0
    flat[(r2 >= 0.04) & (r2 < 0.07)] = -0.0
    flat[(r2 >= 0.07) & (r2 < 0.09)] = NANS[2]
    neg = (r2 >= 0.09) & (r2 < 0.11)
    flat[neg] = -np.abs(flat[neg])
    sub = np.flatnonzero((r2 >= 0.11) & (r2 < 0.13))
    flat[sub] = 0.0
    if L > 1 and sub.size:
        flat[sub, rng.integers(1, L, sub.size)] = F32(1e-45)
    h = flat.reshape(lead + (L,))

    scale = rng.choice(SPECIAL_SCALE, n)
    normal = rng.random(n) < 0.4
    scale[normal] = (2.0 ** rng.uniform(-20, 20, normal.sum())).astype(np.float32)
    scale = scale.reshape(lead).astype(np.float32)

    amax = None
    if with_amax:
        amax = random_amax_values(rng, (n,), special_p)
        ra = rng.random(n)
        amax[ra < 0.15] = 0.0
        amax[(ra >= 0.15) & (ra < 0.22)] = -0.0
        amax[(ra >= 0.22) & (ra < 0.27)] = NANS[1]
        amax = amax.reshape(lead).astype(np.float32)
    if scrub_subnormals:
        rows = (rng.random(n) < scrub_subnormals).reshape(lead)
        for arr, hist in ((h, True), (scale, False), (amax, False)):
            if arr is None:
                continue
            b = bits(arr) & np.uint32(0x7FFFFFFF)
            sub = (b != 0) & (b < np.uint32(0x00800000))
            sub &= rows[..., None] if hist else rows
            arr[sub] = 0.0
    return np.ascontiguousarray(h, np.float32), scale, amax


def subnormal_rows(*arrays_and_lead):
    """Per tensor (leading index): True where any of the arrays has a subnormal.

    Each argument is (array, has_history_axis)."""
    out = None
    for arr, is_hist in arrays_and_lead:
        if arr is None:
            continue
        b = bits(arr) & np.uint32(0x7FFFFFFF)
        sub = (b != 0) & (b < np.uint32(0x00800000))
        if is_hist:
            sub = sub.any(axis=-1)
        out = sub if out is None else (out | sub)
    return out


def mse_fp8_step(state, x, y):
    """One step of an `Fp8TrainState` on the mean squared error of the model's output (in
    float32) against y: the parameters' and the FP8 state's gradients go to
    apply_gradients. Returns (new state, loss)."""
    def loss(params, fp8):
        return jnp.mean((state.apply_model(params, fp8, x).astype(jnp.float32) - y) ** 2)
    val, (g, fg) = jax.value_and_grad(loss, argnums=(0, 1))(state.params, state.fp8)
    return state.apply_gradients(grads=g, fp8_grads=fg), val


def mean_squared_error(out, y):
    return jnp.mean((out - y) ** 2)


def train_steps(state, x, y, steps, loss=mean_squared_error, **apply_kwargs):
    """`steps` jitted steps of an `Fp8TrainState` on loss(the model's output for x, y), the
    model applied with `apply_kwargs`, the gradient w.r.t. the parameters and the FP8 state
    taken by ``state.value_and_grad`` (one tree, as apply_gradients takes it). Returns (the
    losses, a list of arrays; the final state)."""
    @jax.jit
    def step(state):
        def loss_fn(params, fp8):
            return loss(state.apply_model(params, fp8, x, **apply_kwargs), y)
        loss_value, grads = state.value_and_grad(loss_fn)()
        return state.apply_gradients(grads=grads), loss_value

    losses = []
    for _ in range(steps):
        state, loss_value = step(state)
        losses.append(loss_value)
    return losses, state


def recorder(results: dict):
    """For the *_worker.py scripts: a decorator that runs the function at once and records
    "ok", or its traceback, under its name in `results` (one failing check does not stop
    the others; the worker prints `results` for the parent test)."""
    import traceback

    def check(fn):
        try:
            fn()
            results[fn.__name__] = "ok"
        except Exception:  # noqa: BLE001 - reported to the parent test
            results[fn.__name__] = traceback.format_exc()
        return fn
    return check


def run_8_device_worker(script: str, *args: str, timeout: int = 300) -> dict:
    """Runs the worker `script` (a basename, found by find_test_file) in a fresh process
    with 8 host CPU devices, in the script's folder with the test folders on its path, and
    returns the dict it printed on its "RESULTS <json>" line (the pytest process may
    already hold a 1-device jax, so multi-device checks run in a subprocess)."""
    import json
    import subprocess
    import sys

    path = find_test_file(script)
    env = with_test_path(dict(os.environ, JAX_PLATFORMS="cpu"))
    env["XLA_FLAGS"] = env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    proc = subprocess.run([sys.executable, path, *args], cwd=os.path.dirname(path), env=env,
                          capture_output=True, text=True, timeout=timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(lines[-1][len("RESULTS "):])


def rand(key, shape, scale=1.0, dtype=jnp.float32):
    """Standard normals from NumPy's generator seeded with `key`, in float32 times `scale`,
    as a `dtype` array."""
    x = np.random.default_rng(key).standard_normal(shape).astype(np.float32) * scale
    return jnp.asarray(x, dtype)


def assert_trees_equal(a, b):
    """The same tree structure and every leaf equal, bit for bit."""
    assert jax.tree.structure(a) == jax.tree.structure(b)
    jax.tree.map(np.testing.assert_array_equal, a, b)
