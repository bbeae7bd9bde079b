"""jax_fp8.devtools: the HLO and trace parsers on hand-written snippets and real CPU programs."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

import jax_fp8
from jax_fp8.devtools import compilation, hlo, trace

# A command buffer (looked into), fusions, a copy, the update custom call.
HLO = """HloModule jit_f, is_scheduled=true

%fused_computation (param_0: f32[16]) -> f32[16] {
  %param_0 = f32[16]{0} parameter(0)
  ROOT %copy.2 = f32[16]{0} copy(%param_0)
}

%command_buffer (p: f32[16], q: f32[]) -> (f32[16], f32[]) {
  %p = f32[16]{0} parameter(0)
  %q = f32[] parameter(1)
  %loop_fusion = f32[16]{0} fusion(%p), kind=kLoop, calls=%fused_computation
  %loop_fusion.1 = f32[] fusion(%q), kind=kLoop, calls=%fused_computation
  ROOT %t = (f32[16]{0}, f32[]) tuple(%loop_fusion, %loop_fusion.1)
}

ENTRY %main.1 (a: f32[16], b: f32[]) -> (f32[16], f32[], /*index=2*/f32[16]) {
  %a = f32[16]{0} parameter(0), metadata={op_name="a"}
  %b = f32[] parameter(1)
  %c = f32[] constant(1)
  %call = (f32[16]{0}, f32[]) call(%a, %b), to_apply=%command_buffer
  %gte = f32[16]{0} get-tuple-element(%call), index=0
  %cc = (f32[16]{0}, f32[16]{0}, f32[]) custom-call(%a, %b), custom_call_target="jax_fp8_update", output_to_operand_aliasing={{0}: (0, {})}
  %copy.1 = f32[16]{0} copy(%gte), metadata={op_name="jit(f)/copy"}
  ROOT %tuple = (f32[16]{0}, f32[], /*index=2*/f32[16]{0}) tuple(%copy.1, %b, %gte)
}
"""

# cuBLASLt FP8 GEMMs inside a command buffer, an FP8 and a bf16 Triton GEMM fusion.
GPU_HLO = """HloModule jit_step, is_scheduled=true

%triton_gemm_computation (p0: f8e4m3fn[64,32], p1: f8e4m3fn[32,16]) -> bf16[64,16] {
  %p0 = f8e4m3fn[64,32]{1,0} parameter(0)
  %p1 = f8e4m3fn[32,16]{1,0} parameter(1)
  ROOT %dot.1 = bf16[64,16]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%loop_body (a: bf16[64,16]) -> bf16[64,16] {
  %a = bf16[64,16]{1,0} parameter(0)
  ROOT %neg = bf16[64,16]{1,0} negate(%a)
}

%bf16_gemm (q0: bf16[64,32], q1: bf16[32,16]) -> bf16[64,16] {
  %q0 = bf16[64,32]{1,0} parameter(0)
  %q1 = bf16[32,16]{1,0} parameter(1)
  ROOT %dot.2 = bf16[64,16]{1,0} dot(bf16[64,32]{1,0} %q0, bf16[32,16]{1,0} %q1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%command_buffer (x: f8e4m3fn[64,32], w: f8e4m3fn[32,16], s: f32[]) -> (bf16[64,16], s8[1024]) {
  %x = f8e4m3fn[64,32]{1,0} parameter(0)
  %w = f8e4m3fn[32,16]{1,0} parameter(1)
  %s = f32[] parameter(2)
  %cublas-gemm.1 = (bf16[64,16]{1,0}, s8[1024]{0}) custom-call(%x, %w, %s, %s), custom_call_target="__cublas$lt$matmul$f8", backend_config={"gemm_backend_config":{"alpha_real":1}}
  ROOT %t = (bf16[64,16]{1,0}, s8[1024]{0}) tuple(%cublas-gemm.1)
}

ENTRY %main (x: f8e4m3fn[64,32], w: f8e4m3fn[32,16], s: f32[], h: f32[3,16]) -> bf16[64,16] {
  %x = f8e4m3fn[64,32]{1,0} parameter(0)
  %w = f8e4m3fn[32,16]{1,0} parameter(1)
  %s = f32[] parameter(2)
  %h = f32[3,16]{1,0} parameter(3)
  %call = (bf16[64,16]{1,0}, s8[1024]{0}) call(%x, %w, %s), to_apply=%command_buffer
  %gte = bf16[64,16]{1,0} get-tuple-element(%call), index=0
  %gemm_fusion = bf16[64,16]{1,0} fusion(%x, %w), kind=kCustom, calls=%triton_gemm_computation, backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}
  %bf16_fusion = bf16[64,16]{1,0} fusion(%gte, %gte), kind=kCustom, calls=%bf16_gemm, backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}
  %loop_fusion = bf16[64,16]{1,0} fusion(%gemm_fusion), kind=kLoop, calls=%loop_body
  %upd = (f32[3,16]{1,0}) custom-call(%h), custom_call_target="jax_fp8_update", output_to_operand_aliasing={{0}: (0, {})}
  ROOT %add = bf16[64,16]{1,0} add(%loop_fusion, %bf16_fusion)
}
"""

# Collectives: a max all-reduce, an async add all-reduce, an async all-gather, a
# reduce-scatter; and a conditional with two branches (both looked into).
COLLECTIVE_HLO = """HloModule jit_c

%max (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %m = f32[] maximum(%a, %b)
}

%sum (a: bf16[], b: bf16[]) -> bf16[] {
  %a = bf16[] parameter(0)
  %b = bf16[] parameter(1)
  ROOT %s = bf16[] add(%a, %b)
}

%then (p: f32[8]) -> f32[8] {
  %p = f32[8]{0} parameter(0)
  ROOT %f1 = f32[8]{0} fusion(%p), kind=kLoop, calls=%max
}

%else (p: f32[8]) -> f32[8] {
  %p = f32[8]{0} parameter(0)
  ROOT %f2 = f32[8]{0} fusion(%p), kind=kLoop, calls=%max
}

ENTRY %main (x: f32[4], g: bf16[1024,2], y: f32[8], k: pred[]) -> f32[8] {
  %x = f32[4]{0} parameter(0)
  %g = bf16[1024,2]{1,0} parameter(1)
  %y = f32[8]{0} parameter(2)
  %k = pred[] parameter(3)
  %all-reduce.1 = f32[4]{0} all-reduce(%x), replica_groups={}, to_apply=%max
  %all-reduce-start = bf16[1024,2]{1,0} all-reduce-start(%g), replica_groups={}, to_apply=%sum
  %all-reduce-done = bf16[1024,2]{1,0} all-reduce-done(%all-reduce-start)
  %all-gather-start = (f32[8]{0}, f32[32]{0}) all-gather-start(%y), dimensions={0}
  %all-gather-done = f32[32]{0} all-gather-done(%all-gather-start)
  %reduce-scatter.2 = f32[2]{0} reduce-scatter(%y), dimensions={0}, to_apply=%max
  ROOT %cond = f32[8]{0} conditional(%k, %y, %y), true_computation=%then, false_computation=%else
}
"""


def test_parse():
    mod = hlo.parse(HLO)
    assert mod.entry == "main.1"
    assert set(mod.computations) == {"fused_computation", "command_buffer", "main.1"}
    cc = [i for i in mod.computations["main.1"] if i.opcode == "custom-call"]
    assert cc[0].name == "cc" and cc[0].shape == "(f32[16]{0}, f32[16]{0}, f32[])"
    assert hlo.parse(mod) is mod


def test_kernels_custom_calls():
    assert hlo.count_kernels(HLO) == {"copy": 1, "custom-call": 1, "fusion": 2}
    assert [i.name for i in hlo.kernel_instructions(HLO)] == ["loop_fusion", "loop_fusion.1",
                                                              "cc", "copy.1"]
    assert hlo.custom_calls(HLO) == {"jax_fp8_update": 1}
    assert hlo.count_custom_calls(HLO, "jax_fp8_update") == 1
    assert hlo.count_custom_calls(HLO, "other") == 0
    assert hlo.computations_calling(HLO, "jax_fp8_update") == ["main.1"]
    assert hlo.fusion_kinds(HLO) == {"kLoop": 2}
    assert hlo.source_ops(HLO) == {"copy_1": "jit(f)/copy"}
    assert hlo.op_families(HLO) == {"loop_fusion": "loop fusion", "loop_fusion_1": "loop fusion",
                                    "cc": "custom-call:jax_fp8_update"}


def test_gemm_sizes_gpu_style():
    sizes = hlo.gemm_sizes(GPU_HLO)
    assert sizes == {"cublas-gemm.1": hlo.GemmSize(1, 64, 16, 32),
                     "gemm_fusion": hlo.GemmSize(1, 64, 16, 32),
                     "bf16_fusion": hlo.GemmSize(1, 64, 16, 32)}
    assert sizes["cublas-gemm.1"].flops == 2 * 64 * 16 * 32


def test_gemm_sizes_from_a_gemm_library_calls_dimension_numbers():
    """cuBLASLt's FP8 GEMMs take both operands contracted over their minor axis (TN): the
    sizes come from the call's dot_dimension_numbers, batch axes included; jax_fp8's
    block-scaled GEMM takes (a, a's scales, b, b's scales), both contracted over their
    minor axis."""
    config = ('{"gemm_backend_config":{"alpha_real":1,"dot_dimension_numbers":{'
              '"lhs_contracting_dimensions":["%s"],"rhs_contracting_dimensions":["%s"],'
              '"lhs_batch_dimensions":[%s],"rhs_batch_dimensions":[%s]}}}')
    text = f"""HloModule m

ENTRY %main (x: f8e4m3fn[8192,4096], w: f8e4m3fn[14336,4096], y: f8e4m3fn[3,64,32], z: f8e4m3fn[3,16,32]) -> bf16[8192,14336] {{
  %x = f8e4m3fn[8192,4096]{{1,0}} parameter(0)
  %w = f8e4m3fn[14336,4096]{{1,0}} parameter(1)
  %y = f8e4m3fn[3,64,32]{{2,1,0}} parameter(2)
  %z = f8e4m3fn[3,16,32]{{2,1,0}} parameter(3)
  %g1 = (bf16[8192,14336]{{1,0}}, s8[4]{{0}}) custom-call(%x, %w), custom_call_target="__cublas$lt$matmul$f8", backend_config={config % ("1", "1", "", "")}
  %g2 = (bf16[3,64,16]{{2,1,0}}, s8[4]{{0}}) custom-call(%y, %z), custom_call_target="__cublas$lt$matmul$f8", backend_config={config % ("2", "2", '"0"', '"0"')}
  %sx = f32[32,8192]{{1,0}} parameter(4)
  %sw = f32[32,112]{{1,0}} parameter(5)
  %g3 = bf16[8192,14336]{{1,0}} custom-call(%x, %sx, %w, %sw), custom_call_target="jax_fp8_block_gemm"
  ROOT %r = bf16[8192,14336]{{1,0}} get-tuple-element(%g1), index=0
}}
"""
    assert hlo.gemm_sizes(text) == {"g1": hlo.GemmSize(1, 8192, 14336, 4096),
                                    "g2": hlo.GemmSize(3, 64, 16, 32),
                                    "g3": hlo.GemmSize(1, 8192, 14336, 4096)}
    calls = {i.name: i for i in hlo.kernel_instructions(text)}
    assert hlo.gemm_operands(calls["g1"]) == ["x", "w"]
    assert hlo.gemm_operands(calls["g3"]) == ["x", "w"]


def test_gemm_sizes_of_a_compiled_cpu_program():
    def f(a, b, c):
        return a @ b, jnp.einsum("bij,bjk->bik", c, c)

    compiled = jax.jit(f).lower(jnp.ones((64, 32)), jnp.ones((32, 16)),
                                jnp.ones((3, 8, 8))).compile()
    sizes = sorted(hlo.gemm_sizes(compiled).values())
    assert sizes == [hlo.GemmSize(1, 64, 16, 32), hlo.GemmSize(3, 8, 8, 8)]
    assert len(hlo.gemm_sizes(compiled)) == len(hlo.gemms(compiled))


def test_gemms_gpu_style():
    assert hlo.custom_calls(GPU_HLO) == {"__cublas$lt$matmul$f8": 1, "jax_fp8_update": 1}
    assert hlo.computations_calling(GPU_HLO, "__cublas$lt$matmul$f8") == ["command_buffer"]
    assert sorted(hlo.gemms(GPU_HLO)) == sorted([
        hlo.Gemm("cublas-gemm.1", "__cublas$lt$matmul$f8", True),
        hlo.Gemm("gemm_fusion", "__triton_gemm", True),
        hlo.Gemm("bf16_fusion", "__triton_gemm", False)])
    assert hlo.fp8_gemms(GPU_HLO) == {"__cublas$lt$matmul$f8": 1, "__triton_gemm": 1}
    assert sum(hlo.count_kernels(GPU_HLO).values()) == 6   # 3 fusions, 2 custom calls, add
    assert hlo.fusion_kinds(GPU_HLO) == {"__triton_gemm": 2, "kLoop": 1}
    assert hlo.op_families(GPU_HLO) == {
        "cublas_gemm_1": "fp8 gemm", "gemm_fusion": "fp8 gemm", "bf16_fusion": "gemm",
        "loop_fusion": "loop fusion", "upd": "custom-call:jax_fp8_update"}


# jax_fp8's grouped GEMMs as XLA:GPU compiles them (4 experts, 256 routed rows): the FP8
# grouped GEMM, its weight gradient (operands transposed, rows padded to 320) and the bf16
# grouped kernel, each a custom call with its workspace.
GROUPED_HLO = """HloModule jit_moe, is_scheduled=true

ENTRY %main (x: f8e4m3fn[256,64], w: f8e4m3fn[4,32,64], n: s32[4], s: f32[4], xt: f8e4m3fn[64,320], gt: f8e5m2[32,320], xb: bf16[256,64], wb: bf16[4,64,32]) -> (bf16[256,32], bf16[4,64,32], bf16[256,32]) {
  %x = f8e4m3fn[256,64]{1,0} parameter(0)
  %w = f8e4m3fn[4,32,64]{2,1,0} parameter(1)
  %n = s32[4]{0} parameter(2)
  %s = f32[4]{0} parameter(3)
  %xt = f8e4m3fn[64,320]{1,0} parameter(4)
  %gt = f8e5m2[32,320]{1,0} parameter(5)
  %xb = bf16[256,64]{1,0} parameter(6)
  %wb = bf16[4,64,32]{2,1,0} parameter(7)
  %grouped = (bf16[256,32]{1,0}, u8[4096]{0}) custom-call(%x, %w, %n, %s, %s), custom_call_target="jax_fp8_grouped_gemm", api_version=API_VERSION_TYPED_FFI
  %wgrad = (bf16[4,64,32]{2,1,0}, u8[4096]{0}) custom-call(%xt, %gt, %n, %s, %s), custom_call_target="jax_fp8_grouped_wgrad", api_version=API_VERSION_TYPED_FFI
  %ragged = (bf16[256,32]{1,0}, u8[4096]{0}) custom-call(%xb, %wb, %n), custom_call_target="jax_fp8_ragged_dot", api_version=API_VERSION_TYPED_FFI
  %o1 = bf16[256,32]{1,0} get-tuple-element(%grouped), index=0
  %o2 = bf16[4,64,32]{2,1,0} get-tuple-element(%wgrad), index=0
  %o3 = bf16[256,32]{1,0} get-tuple-element(%ragged), index=0
  ROOT %t = (bf16[256,32]{1,0}, bf16[4,64,32]{2,1,0}, bf16[256,32]{1,0}) tuple(%o1, %o2, %o3)
}
"""


def test_grouped_gemms_are_gemms_fp8_by_their_operands():
    assert sorted(hlo.gemms(GROUPED_HLO)) == sorted([
        hlo.Gemm("grouped", "jax_fp8_grouped_gemm", True),
        hlo.Gemm("wgrad", "jax_fp8_grouped_wgrad", True),
        hlo.Gemm("ragged", "jax_fp8_ragged_dot", False)])
    assert hlo.fp8_gemms(GROUPED_HLO) == {"jax_fp8_grouped_gemm": 1, "jax_fp8_grouped_wgrad": 1}
    # Summed over the groups: the product's rows; the weight gradient's padded rows.
    assert hlo.gemm_sizes(GROUPED_HLO) == {"grouped": hlo.GemmSize(1, 256, 32, 64),
                                           "wgrad": hlo.GemmSize(1, 64, 32, 320),
                                           "ragged": hlo.GemmSize(1, 256, 32, 64)}
    families = hlo.op_families(GROUPED_HLO)
    assert {k: families[k] for k in ("grouped", "wgrad", "ragged")} == {
        "grouped": "fp8 gemm", "wgrad": "fp8 gemm", "ragged": "gemm"}


def test_collectives():
    got = hlo.collectives(COLLECTIVE_HLO)
    assert got == [
        hlo.Collective("all-reduce.1", "all-reduce", ("f32",), 16, "maximum"),
        hlo.Collective("all-reduce-start", "all-reduce", ("bf16",), 4096, "add"),
        hlo.Collective("all-gather-start", "all-gather", ("f32",), 128, None),
        hlo.Collective("reduce-scatter.2", "reduce-scatter", ("f32",), 8, "maximum")]
    assert hlo.count_collectives(COLLECTIVE_HLO) == {"all-gather": 1, "all-reduce": 2,
                                                     "reduce-scatter": 1}
    assert hlo.all_reduce_kinds(COLLECTIVE_HLO) == {"add": 1, "maximum": 1}
    # Both branches of the conditional are looked into.
    assert [i.name for i in hlo.kernel_instructions(COLLECTIVE_HLO)][-2:] == ["f1", "f2"]


def test_shape_bytes():
    assert hlo.shape_bytes("f32[16,4]{1,0}") == 256
    assert hlo.shape_bytes("(f32[16,4]{1,0}, bf16[8])") == 272
    assert hlo.shape_bytes("f8e4m3fn[64,32]{1,0}") == 2048
    assert hlo.shape_bytes("f32[]") == 4 and hlo.shape_bytes("pred[3]") == 3
    assert hlo.shape_bytes("token[]") == 0


def test_tuple_elements():
    assert hlo.tuple_elements("f32[2]{0}") == ["f32[2]{0}"]
    assert hlo.tuple_elements("(f32[2]{0}, (bf16[], s8[4]), f8e5m2[3,4]{1,0})") == [
        "f32[2]{0}", "(bf16[], s8[4])", "f8e5m2[3,4]{1,0}"]
    assert hlo.tuple_elements("()") == []


BYTES_HLO = """HloModule m

%f (p0: f32[64,32], p1: f32[64,32]) -> (f32[64,32], bf16[64]) {
  %p0 = f32[64,32]{1,0} parameter(0)
  %p1 = f32[64,32]{1,0} parameter(1)
  %a = f32[64,32]{1,0} add(%p0, %p1)
  %z = bf16[64]{0} constant({...})
  ROOT %t = (f32[64,32]{1,0}, bf16[64]{0}) tuple(%a, %z)
}

%g (p0: bf16[64]) -> f8e4m3fn[64] {
  %p0 = bf16[64]{0} parameter(0)
  ROOT %c = f8e4m3fn[64]{0} convert(%p0)
}

ENTRY %main (x: f32[64,32], y: f32[64,32]) -> f8e4m3fn[64] {
  %x = f32[64,32]{1,0} parameter(0)
  %y = f32[64,32]{1,0} parameter(1)
  %two = (f32[64,32]{1,0}, bf16[64]{0}) fusion(%x, %y), kind=kLoop, calls=%f
  %same = (f32[64,32]{1,0}, bf16[64]{0}) fusion(%x, %x), kind=kLoop, calls=%f
  ROOT %cast = f8e4m3fn[64]{0} fusion(%two#1), kind=kLoop, calls=%g
}
"""


def test_kernel_bytes():
    # two: reads x and y (8192 B each), writes 8192 + 128 B; same: reads x once;
    # cast: reads element 1 of two's tuple (bf16[64]), writes 64 B.
    assert hlo.kernel_bytes(BYTES_HLO) == {"two": 8192 * 3 + 128, "same": 8192 * 2 + 128,
                                           "cast": 128 + 64}


def test_text_of_rejects_other_objects():
    with pytest.raises(TypeError):
        hlo.text_of(3)


def test_partitioned_refuses_a_one_device_program():
    lowered = jax.jit(lambda x: x * 2).lower(jnp.ones(4))
    with pytest.raises(ValueError, match="SPMD partitioner"):
        compilation.partitioned(lowered)


def test_one_update_custom_call_in_a_compiled_update():
    tree = [jax_fp8.ScalingState.create((), 16) for _ in range(5)]
    compiled = jax.jit(jax_fp8.update_states).lower(tree).compile()
    want = 1 if jax_fp8.HAS_CPU_KERNEL else 0
    assert hlo.count_custom_calls(compiled, "jax_fp8_update") == want
    assert hlo.count_custom_calls(compiled.as_text(), "jax_fp8_update") == want
    assert hlo.count_kernels(compiled).get("custom-call", 0) == want
    mem = compilation.memory(compiled)
    assert mem["argument_size_in_bytes"] == 5 * (16 + 2) * 4


def test_donated_update_aliases_its_state():
    tree = jax_fp8.ScalingState.create((8,), 16)
    compiled = jax.jit(jax_fp8.update_states, donate_argnums=0).lower(tree).compile()
    alias = compilation.alias_bytes(compiled)
    if alias is not None:
        assert alias == sum(x.nbytes for x in jax.tree.leaves(tree))


def test_fp8_train_step_compiled_on_cpu():
    """A real FP8 step: its GEMMs are found (XLA:CPU widens FP8 operands before its dots,
    so none is FP8 there), one fused update."""
    recipe = jax_fp8.DelayedScaling(history_len=16)
    dn = (((1,), (0,)), ((), ()))

    def loss(w, meta, x):
        out, _ = jax_fp8.fp8_dot_general(x, w, dn, meta)
        return jnp.mean(out.astype(jnp.float32) ** 2)

    def step(w, meta, x):
        g, meta_grads = jax.grad(loss, argnums=(0, 1))(w, meta, x)
        return w - g, jax_fp8.new_fp8_state(meta, meta_grads, recipe)

    args = (jnp.ones((32, 16), jnp.bfloat16), jax_fp8.Fp8Meta.create(recipe),
            jnp.ones((8, 32), jnp.bfloat16))
    compiled = jax.jit(step).lower(*args).compile()
    gemms = hlo.gemms(compiled)
    assert len(gemms) >= 2                       # the forward and the kernel gradient
    assert hlo.count_custom_calls(compiled, "jax_fp8_update") == int(jax_fp8.HAS_CPU_KERNEL)
    families = hlo.op_families(compiled)
    assert all(families[hlo.kernel_name(g.name)] in ("gemm", "fp8 gemm") for g in gemms)


_COLLECTIVE_SCRIPT = r"""
import json, jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
from jax_fp8.devtools import hlo
mesh = jax.make_mesh((4,), ("d",))
x = jax.device_put(jnp.ones((8, 64)), NamedSharding(mesh, P("d")))
f = jax.jit(lambda x: (x.sum(axis=0), jnp.max(jnp.abs(x))), out_shardings=NamedSharding(mesh, P()))
c = f.lower(x).compile()
print("RESULT " + json.dumps([c._asdict() for c in hlo.collectives(c)]))
"""


def test_collectives_of_a_sharded_cpu_program():
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=4")
    proc = subprocess.run([sys.executable, "-c", _COLLECTIVE_SCRIPT], env=env,
                          capture_output=True, text=True, timeout=120)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert line, proc.stderr[-3000:]
    got = json.loads(line[0][len("RESULT "):])
    assert {c["opcode"] for c in got} == {"all-reduce"}
    assert {c["reduction"] for c in got} == {"add", "maximum"}
    assert all(c["dtypes"] == ["f32"] for c in got)
    assert sorted(c["bytes"] for c in got) == [4, 256]   # a scalar max, 64 summed floats


_CACHED_PARTITION_SCRIPT = r"""
import json, sys, jax, jax.numpy as jnp
jax.config.update("jax_compilation_cache_dir", sys.argv[1])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
from jax.sharding import NamedSharding, PartitionSpec as P
from jax_fp8.devtools import compilation, hlo
mesh = jax.make_mesh((4,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
x = jax.device_put(jnp.ones((8, 64)), NamedSharding(mesh, P("d")))
lowered = jax.jit(lambda x: x.sum(axis=0), out_shardings=NamedSharding(mesh, P())).lower(x)
lowered.compile()   # the program now in the persistent cache
print("RESULT " + json.dumps([[c.opcode for c in hlo.collectives(compilation.partitioned(lowered))]
                              for _ in range(2)]))
"""


def test_partitioned_where_the_persistent_cache_holds_the_program(tmp_path):
    """JAX's persistent compilation cache returns a program it holds without running XLA's
    passes: `partitioned` still gets the partitioner's text, every time."""
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=4")
    proc = subprocess.run([sys.executable, "-c", _CACHED_PARTITION_SCRIPT, str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=120)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert line, proc.stderr[-3000:]
    assert json.loads(line[0][len("RESULT "):]) == [["all-reduce"], ["all-reduce"]]


# ---------------------------------------------------------------------------- traces

def _gpu_events():
    meta = [
        {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
        {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/device:GPU:0 (NVIDIA)"}},
        {"ph": "M", "pid": 2, "tid": 7, "name": "thread_name", "args": {"name": "Stream #7"}},
        {"ph": "M", "pid": 2, "tid": 9, "name": "thread_name", "args": {"name": "XLA Ops"}},
    ]
    kernels = [
        {"ph": "X", "pid": 2, "tid": 7, "ts": 0, "dur": 10.0, "name": "nvjet_sm90_qqtst_128x128"},
        {"ph": "X", "pid": 2, "tid": 7, "ts": 20, "dur": 4.0, "name": "gemm_fusion_dot_3"},
        {"ph": "X", "pid": 2, "tid": 7, "ts": 30, "dur": 2.0, "name": "loop_add_fusion_71"},
        {"ph": "X", "pid": 2, "tid": 7, "ts": 40, "dur": 1.5, "name": "loop_add_fusion_72"},
        {"ph": "X", "pid": 2, "tid": 7, "ts": 50, "dur": 0.5,
         "name": "void jax_fp8::(anonymous namespace)::UpdateKernel<32, unsigned int>(...)"},
    ]
    derived = [{"ph": "X", "pid": 2, "tid": 9, "ts": 0, "dur": 50.0, "name": "fusion"}]
    host = [{"ph": "X", "pid": 1, "tid": 3, "ts": 0, "dur": 99.0, "name": "PjitFunction",
             "args": {"hlo_op": "x"}}]
    return meta + kernels + derived + host


def test_gpu_device_events():
    events = _gpu_events()
    dev = trace.device_events(events)
    assert len(dev) == 5 and trace.total_us(dev) == pytest.approx(18.0)
    assert trace.device_events(events, "gpu") == dev
    assert list(trace.by_name(dev))[0] == "nvjet_sm90_qqtst_128x128"
    assert trace.by_name(dev)["loop_add_fusion_71"] == (1, 2.0)
    assert trace.per_run_us(dev) is None
    assert trace.by_family(dev) == {"gemm": 14.0, "loop fusion": 3.5,
                                    "custom-call:jax_fp8_update": 0.5}
    # What the HLO knows (the Triton GEMM is FP8) decides first.
    assert trace.by_family(dev, {"gemm_fusion_dot_3": "fp8 gemm"})["fp8 gemm"] == 4.0


def test_cpu_device_events():
    events = [{"ph": "X", "pid": 1, "tid": 1, "dur": d, "name": n,
               "args": {"hlo_op": n, "run_id": r}}
              for n, d, r in (("dot.3", 5.0, "1"), ("jax_fp8_update.10", 1.0, "1"),
                              ("dot.3", 4.0, "2"), ("jax_fp8_update.10", 2.0, "2"))]
    events += [{"ph": "X", "pid": 1, "tid": 1, "dur": 1.0, "name": "end: dot.3",
                "args": {"hlo_op": "dot.3"}},
               {"ph": "X", "pid": 1, "tid": 2, "dur": 30.0, "name": "PjitFunction(f)"}]
    # A jax with a CUDA plugin names a GPU process even when nothing ran there.
    events.append({"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/device:GPU:0"}})
    dev = trace.device_events(events)
    assert len(dev) == 4
    assert trace.per_run_us(dev) == [6.0, 6.0]
    assert trace.by_family(dev) == {"gemm": 9.0, "custom-call:jax_fp8_update": 3.0}
    assert trace.by_family(dev, {"dot_3": "fp8 gemm"}) == {"fp8 gemm": 9.0,
                                                          "custom-call:jax_fp8_update": 3.0}


@pytest.mark.parametrize("name, family", [
    ("nvjet_sm90_rqtst_256x64_128x5_1x2_h_bz_coopB_algo2_TNN", "gemm"),
    ("sm90_xmma_gemm_e4m3e4m3_bf16", "gemm"),
    ("gemm_fusion_dot_general_291", "gemm"),
    ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", "collective"),
    ("memcpy32_post", "copy"),
    ("MemcpyDtoD", "copy"),
    ("copy_fusion_3", "copy"),
    ("input_add_reduce_fusion_46", "input fusion"),
    ("loop_convert_fusion", "loop fusion"),
    ("wrapped_transpose_135", "wrapped fusion"),
    ("triton_softmax_2", "triton fusion"),
    ("fusion.12", "fusion"),
    ("jax_fp8::(anonymous namespace)::TransposeBytesKernel(unsigned int const*)",
     "custom-call:jax_fp8_transpose_bytes"),
    ("void jax_fp8::QuantizeTransposeKernel<__nv_bfloat16>", "custom-call:jax_fp8_quantize_transpose"),
    ("jax_fp8_update.10", "custom-call:jax_fp8_update"),
    ("void jax_fp8::(anonymous namespace)::BlockQuantizeKernel<__nv_bfloat16, "
     "(jax_fp8::Fp8Type)0, false>(jax_fp8::BlockQuantizeArgs)", "custom-call:jax_fp8_block_quantize"),
    ("void jax_fp8::BlockGemmFallbackKernel<float>", "custom-call:jax_fp8_block_gemm"),
    ("while.3", "other"),
])
def test_kernel_family(name, family):
    assert trace.kernel_family(name) == family


def test_load_finds_the_newest_trace(tmp_path):
    d = tmp_path / "plugins" / "profile" / "run1"
    d.mkdir(parents=True)
    with gzip.open(d / "host.perfetto_trace.json.gz", "wt") as fp:
        json.dump({"traceEvents": _gpu_events()}, fp)
    assert trace.load(str(tmp_path)) == _gpu_events()
    with pytest.raises(FileNotFoundError):
        trace.load(str(tmp_path / "nothing"))


def test_capture_a_cpu_program():
    # On the CPU device also where jax has a GPU (its default device then).
    tree = jax.device_put([jax_fp8.ScalingState.create((), 16) for _ in range(3)],
                          jax.devices("cpu")[0])
    step = jax.jit(jax_fp8.update_states, donate_argnums=0)
    tree, events = trace.capture(step, step(tree), steps=3)
    assert len(tree) == 3
    dev = trace.device_events(events)
    assert dev, "no XLA op events in the trace"
    runs = trace.per_run_us(dev)
    assert runs is not None and len(runs) == 3
    if jax_fp8.HAS_CPU_KERNEL:
        families = trace.by_family(dev, hlo.op_families(step.lower(tree).compile()))
        assert families.get("custom-call:jax_fp8_update", 0) > 0, families
