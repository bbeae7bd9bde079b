"""Block scaling (Float8BlockScaling) trained data-parallel, FSDP and tensor-parallel on 8
host devices, on meshes with Auto and with Explicit axes; run by test_block_sharding.py.
Prints one JSON line: per case, the forward output's and gradients' agreement with the
same step on one device, the collectives of the partitioned program, and the GEMMs of the
partitioned program (which of them are the block GEMM's per-device computations); the
delayed recipe's FSDP gathers for the byte comparison; and the block GEMM with K sharded
against its bound."""

import collections
import json
import os

# Bit comparisons against the one-device step need XLA to round every bf16 intermediate
# in both programs (as tests/sharding/fsdp_worker.py).
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_allow_excess_precision=false"

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jax_fp8
from jax_fp8._primitives import base, block_gemm as gemm_lib, block_quantize as bq
from jax_fp8.devtools import compilation, hlo
from jax_fp8.quantization import blockwise
from partition_checks import bits_equal

assert jax.device_count() == 8
DN = (((1,), (0,)), ((), ()))
M, D = 1024, 512       # 128 rows per device on 8 devices; 128-row weight shards on 4
BLOCK = jax_fp8.Float8BlockScaling()
DELAYED = jax_fp8.DelayedScaling(history_len=16)
GEMM_SCOPE = base.per_device_scope(gemm_lib.TARGET)
QUANTIZE_SCOPE = base.per_device_scope(bq.TARGET)

rng = np.random.default_rng(0)
ws_np = [(rng.standard_normal((D, D)) / 16).astype(np.float32) for _ in range(2)]
x_np = rng.standard_normal((M, D)).astype(np.float32)

# mode: (mesh shape, axis names, weight specs, input spec). TP: Megatron's column- then
# row-parallel pair; FSDP: weights on their rows over "fsdp", the batch over every axis.
MODES = {
    "dp": ((8,), ("data",), [P(), P()], P("data", None)),
    "fsdp": ((2, 4), ("data", "fsdp"), [P("fsdp", None)] * 2, P(("data", "fsdp"), None)),
    "tp": ((4, 2), ("data", "model"), [P(None, "model"), P("model", None)], P("data", None)),
    # Column-parallel only: no GEMM contracts over a sharded axis in the forward pass.
    "tp_columns": ((4, 2), ("data", "model"), [P(None, "model")] * 2, P("data", None)),
}


def loss(ws, metas, x):
    h = x.astype(jnp.bfloat16)
    for w, m in zip(ws, metas):
        h = jax.nn.gelu(jax_fp8.fp8_dot_general(h, w.astype(jnp.bfloat16), DN, m)[0])
    return jnp.mean(h.astype(jnp.float32) ** 2), h


step = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))


def collectives(text) -> dict:
    """{opcode: {dtype: [bytes, ...]}} of the partitioned program."""
    out = collections.defaultdict(lambda: collections.defaultdict(list))
    for c in hlo.collectives(text):
        out[c.opcode][c.dtypes[0]].append(c.bytes)
    return {k: dict(v) for k, v in out.items()}


def dots(text) -> list:
    """Every dot of the partitioned program: (result shape, whether it is a block GEMM's
    per-device computation, its operand types)."""
    mod = hlo.parse(text)
    types = {ins.name: ins.shape.split("{")[0] for comp in mod.computations.values()
             for ins in comp}
    out = []
    for comp in mod.computations.values():
        for ins in comp:
            if ins.opcode == "dot":
                out.append([ins.shape.split("{")[0], GEMM_SCOPE in ins.line,
                            [types.get(o, "?") for o in hlo.operands(ins)]])
    return out


def max_rel(a, b) -> float:
    return max(float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64)))
                     / np.max(np.abs(np.asarray(y, np.float64))))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


ONE = jax.devices()[0]
WANT = {}


def run(mode, axis_type, recipe=BLOCK):
    shape, names, w_specs, x_spec = MODES[mode]
    mesh = jax.make_mesh(shape, names, axis_types=(axis_type,) * len(shape))
    metas = [jax_fp8.Fp8Meta.create(recipe) for _ in ws_np]
    args = (ws_np, metas, x_np)
    key = type(recipe).__name__
    if key not in WANT:
        WANT[key] = jax.tree.map(np.asarray, step(*jax.device_put(args, ONE)))
    want = WANT[key]
    with jax.set_mesh(mesh):
        sharded = (jax.device_put(ws_np, [NamedSharding(mesh, s) for s in w_specs]),
                   jax.device_put(metas, NamedSharding(mesh, P())),
                   jax.device_put(x_np, NamedSharding(mesh, x_spec)))
        text = compilation.partitioned(step.lower(*sharded))
        (g_ws, _, g_x), out = step(*sharded)
        specs = [str(jax.typeof(g).sharding.spec) for g in g_ws]
    (w_ws, _, w_x), w_out = want
    lines = text.splitlines()
    return {"out_equal": bits_equal(out, w_out), "dx_equal": bits_equal(g_x, w_x),
            "out_rel": max_rel(out, w_out), "dx_rel": max_rel(g_x, w_x),
            "dw_rel": max_rel(g_ws, w_ws), "dw_specs": specs,
            "collectives": collectives(text), "dots": dots(text),
            "gemm_scope_ops": sum(GEMM_SCOPE in ln for ln in lines),
            "quantize_scope_ops": sum(QUANTIZE_SCOPE in ln for ln in lines)}


def k_sharded_gemm(out_dtype):
    """The block GEMM with K sharded over 8 devices (each device's float32 product summed
    over them) against the reference bound of tests/kernels/test_block_gemm.py:
    |out - E| <= (K + 4) u (1 + u_out) S + u_out |E|, E the float64 product of the
    dequantized operands and S the sum of |products|; also bit-compared with one device."""
    mesh = jax.make_mesh((8,), ("k",), axis_types=(AxisType.Auto,))
    m, n, k = 256, 128, 2048
    a = rng.standard_normal((m, k)).astype(np.float32) * np.exp2(rng.integers(-6, 7, (m, k)))
    b = rng.standard_normal((n, k)).astype(np.float32)
    qa, sa = jax_fp8.quantize_blocks(a, (1, 128))
    qb, sb = jax_fp8.quantize_blocks(b, (128, 128))
    f = jax.jit(lambda *ops: gemm_lib.block_gemm(*ops, a_block_rows=1, b_block_rows=128,
                                                 out_dtype=out_dtype))
    want = np.asarray(f(qa, sa, qb, sb))
    cut = NamedSharding(mesh, P(None, "k"))
    ops = jax.device_put((qa, sa, qb, sb), cut)
    got = np.asarray(f(*ops))
    text = compilation.partitioned(f.lower(*ops))
    x = np.asarray(blockwise.dequantize_blocks(qa, sa, (1, 128)), np.float64)
    y = np.asarray(blockwise.dequantize_blocks(qb, sb, (128, 128)), np.float64)
    e, s = x @ y.T, np.abs(x) @ np.abs(y).T
    u, u_out = 2.0 ** -24, {"float32": 2.0 ** -24, "bfloat16": 2.0 ** -8}[out_dtype]
    bound = (k + 4) * u * (1 + u_out) * s + u_out * np.abs(e)
    err = lambda o: float(np.max(np.abs(o.astype(np.float64) - e) / bound))  # noqa: E731
    return {"err_over_bound": err(got), "one_device_err_over_bound": err(want),
            "equal_one_device": bool(np.array_equal(got, want)),
            "collectives": collectives(text),
            "gemm_shapes": sorted({d[0] for d in dots(text) if d[1]})}


def unaligned_shards():
    """Shards that cut the blocks (64 rows per device): quantized after a gather of the
    high-precision input, the bits still one device's."""
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    x = rng.standard_normal((512, 384)).astype(np.float32)
    f = jax.jit(lambda v: blockwise.quantize_blocks_both(v, (1, 128)))
    want = f(x)
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, NamedSharding(mesh, P("data", None)))
        got = f(xs)
        text = compilation.partitioned(f.lower(xs))
    return {"equal": bits_equal(got, want), "collectives": collectives(text)}


results = {}
for mode in MODES:
    for axis_type in (AxisType.Auto, AxisType.Explicit)[:1 if mode == "tp_columns" else 2]:
        results[f"{mode}/{str(axis_type).split('.')[-1].lower()}"] = run(mode, axis_type)
results["fsdp/delayed"] = run("fsdp", AxisType.Auto, DELAYED)
results["k_sharded_gemm/float32"] = k_sharded_gemm("float32")
results["k_sharded_gemm/bfloat16"] = k_sharded_gemm("bfloat16")
results["unaligned_shards"] = unaligned_shards()
print("RESULTS " + json.dumps(results))
