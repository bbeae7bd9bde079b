"""jax_fp8.devtools.explain: each primitive's lowering, each per-platform choice and each
GEMM's FP8-or-not with the reason, for a program and its arguments; the
JAX_FP8_IMPLEMENTATION switch."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import textwrap

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_fp8
from jax_fp8._primitives import base
from jax_fp8.devtools import explain
from jax_fp8.flax import Fp8DotGeneral


class TwoLayers(nn.Module):
    recipe: object
    min_fp8_flops: float = 0

    @nn.compact
    def __call__(self, x):
        dense = functools.partial(nn.Dense, dot_general_cls=functools.partial(
            Fp8DotGeneral, recipe=self.recipe, min_fp8_flops=self.min_fp8_flops))
        return dense(128, name="small")(dense(256, name="big")(x)[:, :16])


def _grad_rows(recipe, min_fp8_flops=0, **kw):
    model = TwoLayers(recipe, min_fp8_flops)
    x = jnp.ones((256, 128), jnp.bfloat16)
    variables = model.init(jax.random.key(0), x)

    def loss(v, x):
        return model.apply(v, x).astype(jnp.float32).sum()
    return explain.explain(jax.grad(loss), variables, x, **kw)


@pytest.mark.parametrize("recipe", [jax_fp8.DelayedScaling(history_len=4),
                                    jax_fp8.Float8CurrentScaling(),
                                    jax_fp8.Float8BlockScaling()], ids=type)
def test_gemms_of_each_layer_and_the_one_kept_by_min_fp8_flops(recipe):
    # small: 2 * 256 * 16 * 128 = 2**20 FLOPs, below 2**21; big: 2**24.
    rows = _grad_rows(recipe, min_fp8_flops=2 ** 21)
    gemms = [r for r in rows if r.kind == "gemm"]
    small = [r for r in gemms if "/small/" in r.where]
    assert len(small) == 3          # forward, input and kernel gradients
    assert all(r.lowering == "float32" and "min_fp8_flops" in r.why for r in small)
    assert {r.flops for r in small} == {2 ** 20}
    big = [r for r in rows if "/big/" in r.where]
    assert any(r.where.startswith("transpose(jvp(TwoLayers))/big/") for r in big)
    if isinstance(recipe, jax_fp8.Float8BlockScaling):
        # block-scaled GEMMs are a primitive of their own: three of them per layer
        assert [r.name for r in big].count("jax_fp8_block_gemm") == 3
    else:
        assert {r.lowering for r in big if r.kind == "gemm"} == {"fp8"}
    assert all(r.lowering in ("kernel", "partitioned", "reference") and r.why
               for r in rows if r.kind == "primitive")


def test_a_primitive_gets_the_decision_of_its_lowering():
    rows = _grad_rows(jax_fp8.Float8BlockScaling())
    prims = [r for r in rows if r.kind == "primitive"]
    assert prims and all(r.lowering == "reference" for r in prims)   # no CPU block kernels
    assert all(r.why == "no cpu kernel" for r in prims if r.name == "jax_fp8_block_gemm")
    # Under a jit over several devices the frame partitions or hands XLA the reference.
    spread = [r for r in _grad_rows(jax_fp8.Float8BlockScaling(), num_devices=8)
              if r.kind == "primitive"]
    assert all("8 devices" in r.why for r in spread)
    quantize = base.SPECS["jax_fp8_block_quantize"]
    want = "partitioned" if quantize.partitioning is not None and \
        not quantize.partitioning.needs_kernel else "reference"
    assert {r.lowering for r in spread if r.name == "jax_fp8_block_quantize"} == {want}


def test_the_fused_update_is_the_cpu_kernel():
    state = jax_fp8.ScalingState.create(history_len=4)
    rows = explain.explain(lambda s: jax_fp8.update_states(
        s, recipe=jax_fp8.DelayedScaling(history_len=4)), {"a": state}, platform="cpu")
    kinds = {(r.name, r.lowering) for r in rows if r.kind == "primitive"}
    assert ("jax_fp8_update", "kernel" if jax_fp8.HAS_CPU_KERNEL else "reference") in kinds


@pytest.mark.parametrize("platform", ["cuda", "cpu"])
def test_each_fp8_gemm_reports_its_platform_version(platform):
    """The FP8 GEMMs of the per-tensor recipes take their accumulation from a choice per
    platform (base.ByPlatform): on CUDA the dot-algorithm variant, elsewhere the
    reference; each is followed by the one FP8 GEMM its platform lowers."""
    rows = _grad_rows(jax_fp8.DelayedScaling(history_len=4), platform=platform)
    chosen = [r for r in rows if r.kind == "platform"]
    assert len(chosen) == 6 and {r.name for r in chosen} == {"jax_fp8_fp8_gemm"}
    if platform == "cuda":
        assert {(r.lowering, r.why.split(":")[0]) for r in chosen} == {
            ("variant", "the cuda variant")}
    else:
        assert {(r.lowering, r.why) for r in chosen} == {("reference", "no cpu variant")}
    after = [rows[i + 1] for i, r in enumerate(rows) if r.kind == "platform"]
    assert all(r.kind == "gemm" and r.lowering == "fp8" for r in after)
    assert sum(r.kind == "gemm" and r.lowering == "fp8" for r in rows) == 6


def test_table_has_one_line_per_row():
    rows = _grad_rows(jax_fp8.DelayedScaling(history_len=4))
    text = explain.table(rows)
    assert len(text.splitlines()) == len(rows) + 2 and "| gemm |" in text
    assert str(rows[0]).startswith(rows[0].where or "<top>")


SWITCH = textwrap.dedent("""
    import jax, jax.numpy as jnp, jax_fp8
    from jax_fp8.devtools import explain
    x = jnp.ones((256, 256), jnp.float32)
    rows = explain.explain(lambda x: jax_fp8.quantize_blocks(x, (128, 128)), x)
    print(sorted({(r.lowering, r.why) for r in rows if r.kind == "primitive"}))
    w = jnp.ones((256, 128), jnp.bfloat16)
    dot = lambda x, w: jax_fp8.fp8_dot_general(x, w, (((1,), (0,)), ((), ())),
                                               jax_fp8.Fp8Meta.create())[0]
    rows = explain.explain(dot, x.astype(jnp.bfloat16), w, platform="cuda")
    print("gemm:", [(r.lowering, r.why) for r in rows if r.kind == "platform"])
    cuda = jax.jit(dot).trace(x.astype(jnp.bfloat16), w).lower(lowering_platforms=("cuda",))
    print("dot algorithm:", "algorithm = " in cuda.as_text())
""")


def test_one_switch_runs_the_reference_everywhere():
    env = dict(os.environ, JAX_FP8_IMPLEMENTATION="jnp", JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", SWITCH], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "('reference', \"implementation='jnp' (JAX_FP8_IMPLEMENTATION=jnp)\")" in out.stdout
    # the FP8 GEMM's CUDA variant (its accumulation as a dot algorithm) follows the switch
    assert "gemm: [('reference', \"implementation='jnp' (JAX_FP8_IMPLEMENTATION=jnp)\")]" \
        in out.stdout
    assert "dot algorithm: False" in out.stdout
    env["JAX_FP8_IMPLEMENTATION"] = "fast"
    out = subprocess.run([sys.executable, "-c", "import jax_fp8"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode != 0 and "JAX_FP8_IMPLEMENTATION must be one of" in out.stderr


def test_decisions_once_made_in_wrappers_are_rows_with_their_reasons():
    """The amax inside shard_map and on a mesh with Explicit axes, the byte transpose on
    such a mesh and a split into one piece: each a row of its primitive with the reason
    its decision gives, and the numbers of the XLA ops it stands for."""
    from jax_fp8._primitives import amax, layout, split

    cpu = jax.devices("cpu")[:1]
    x = jnp.asarray(np.arange(-24.0, 24.0, dtype=np.float32).reshape(8, 6))
    mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,),
                         devices=cpu)
    auto = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=cpu)
    per_device = jax.shard_map(lambda x: amax.amax(x)[None], mesh=auto, in_specs=P("data"),
                               out_specs=P("data"))
    rows = explain.explain(per_device, x)
    assert [(r.name, r.lowering) for r in rows] == [("jax_fp8_amax", "reference")]
    assert rows[0].why.startswith("inside shard_map")
    np.testing.assert_array_equal(jax.jit(per_device)(x), [24.0])

    q = x.astype(jnp.float8_e4m3fn).reshape(2, 4, 6)
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, jax.sharding.NamedSharding(mesh, P("data", None)))
        qs = jax.device_put(q, jax.sharding.NamedSharding(mesh, P("data", None, None)))
        rows = explain.explain(lambda x, q: (amax.amax(x), layout.rotate_axes(q, 1)), xs, qs,
                               platform="cuda")
        got_amax, got_t = jax.jit(lambda x, q: (amax.amax(x), layout.rotate_axes(q, 1)))(xs, qs)
    assert [(r.name, r.lowering) for r in rows] == [("jax_fp8_amax", "reference"),
                                                    ("jax_fp8_transpose_bytes", "reference")]
    assert all("mesh with Explicit axes" in r.why for r in rows)
    assert float(got_amax) == 24.0
    assert got_t.sharding.spec == P(None, None, "data")
    np.testing.assert_array_equal(np.asarray(got_t).view(np.uint8),
                                  np.transpose(np.asarray(q).view(np.uint8), (1, 2, 0)))

    a = jnp.arange(10.0, dtype=jnp.float32)
    for sizes, kernel in (((10,), False), ((4, 6), jax_fp8.HAS_CPU_KERNEL)):
        rows = explain.explain(lambda a, sizes=sizes: split.split_rows(a, sizes), a,
                               platform="cpu")
        assert [(r.name, r.lowering) for r in rows] == [
            ("jax_fp8_split_rows", "kernel" if kernel else "reference")]
        text = jax.jit(lambda a, sizes=sizes: split.split_rows(a, sizes)).lower(a).as_text()
        assert ("jax_fp8_split_rows" in text) == kernel
    assert explain.explain(lambda a: split.split_rows(a, (10,)), a, platform="cpu")[0].why == \
        "one piece: the slice is the vector itself"
