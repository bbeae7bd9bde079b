"""Kernel families of a compiled step (HLO and profiler events), its GEMMs by shape, and one FP8
GEMM timed alone."""

from __future__ import annotations

import collections
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np

from jax_fp8.devtools import hlo, trace

# --------------------------------------------------------------------------------------
# Kernel families: from the compiled HLO (fusion bodies, custom-call targets, GEMM operand
# types) and, for library kernels the trace names otherwise, from the kernel's name.
# --------------------------------------------------------------------------------------

FAMILIES = ("fp8_gemm", "bf16_gemm", "attention", "norm_quantize", "act_quantize",
            "quantize_transpose", "amax", "jax_fp8_kernels", "optimizer", "other")
FAMILY_LABELS = {"fp8_gemm": "FP8 GEMM", "bf16_gemm": "bf16 GEMM", "attention": "attention",
                 "norm_quantize": "norm+quantize", "act_quantize": "act+quantize",
                 "quantize_transpose": "quantize/transpose",
                 "amax": "amax", "jax_fp8_kernels": "jax_fp8 kernels",
                 "optimizer": "optimizer", "other": "other"}
GEMM_FAMILIES = ("fp8_gemm", "bf16_gemm")
FAMILY_NOTE = (
    "Kernel families: FP8 GEMM / bf16 GEMM (a GEMM with FP8 operands / any other GEMM: the "
    "compiled HLO's dots and GEMM custom calls, cuBLASLt's `nvjet_*` kernels by the operand "
    "types in their name); attention (cuDNN's fused attention); norm+quantize and act+quantize (a "
    "fusion that writes FP8 or takes a max-of-abs amax, with an RMSNorm's or the SwiGLU's "
    "ops in it, by the HLO's op_name scopes); quantize/transpose (other fusions, copies and "
    "transposes that write FP8, or transpose FP8 data); amax (other fusions with a max-of-abs "
    "reduction); jax_fp8 kernels (jax_fp8's own CUDA kernels other than its GEMM); optimizer "
    "(a fusion whose largest output is computed outside the model's forward and backward, "
    "i.e. with no `jvp(` in its op_name: adamw's update, with any weight amax that XLA reads "
    "in the same pass); other (everything else: bf16 norms and activations, residual adds, "
    "RoPE, softmax and cross-entropy, the embedding, copies).")
FLOOR_NOTE = (
    "Floor of an FP8 variant: its own GEMM time (FP8 GEMMs and any bf16 GEMM left, e.g. the "
    "LM head) + bf16's attention time + bf16's other time (everything but GEMMs and "
    "attention): the step if FP8 cost nothing beyond its GEMMs. FP8 overhead: the "
    "variant's time outside GEMMs and attention minus bf16's.")

_CALLS = re.compile(r"\b(?:calls|to_apply)=(\{[^}]*\}|%?[\w.\-]+)")
_F8 = re.compile(r"\bf8e\w*\[")
_NVJET_TYPES = re.compile(r"nvjet_(?:sm\d+_)?([a-z]+)_")
_GEMM_NAME = re.compile(r"nvjet|cublas|cutlass|xmma|gemm|matmul", re.I)
_FP8_NAME = re.compile(r"e4m3|e5m2|f8e|fp8|float8", re.I)
_ATTENTION_NAME = re.compile(r"cudnn|fmha|sdpa|flash", re.I)
_OWN_NAME = re.compile(r"jax_fp8::")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
# The model's module scopes in the HLO's op_name metadata: its RMSNorms ("norm",
# "final_norm") and SwiGLU (in "mlp_out", outside its projection "proj").
_NORM_SCOPE = re.compile(r"/\w*norm/")
_ACT_SCOPE = re.compile(r"/mlp_out/(?!proj/)")
# The model's forward and backward: every op_name under jax.value_and_grad has "jvp(" in
# it ("jvp(Decoder)", "transpose(jvp(Decoder))"); the optimizer's ops do not.
_MODEL_SCOPE = re.compile(r"\bjvp\(")


def _callees(line: str) -> list[str]:
    out = []
    for group in _CALLS.findall(line):
        out += re.findall(r"%?([\w.\-]+)", group)
    return out


def _body(mod, ins, depth=0) -> list:
    """The instructions of the computations ``ins`` calls, recursively (a fusion's body)."""
    out = []
    for c in _callees(ins.line):
        for i in mod.computations.get(c, ()):
            out.append(i)
            if depth < 8:
                out += _body(mod, i, depth + 1)
    return out


def _largest_output_outside_model(mod, ins) -> bool:
    """Whether the largest output of fusion ``ins`` is computed outside the model's forward
    and backward (its op_name has no ``jvp(``): the optimizer's update."""
    for callee in _callees(ins.line):
        body = mod.computations.get(callee, ())
        root = next((i for i in body if i.line.lstrip().startswith("ROOT")), None)
        if root is None:
            continue
        outputs = [root]
        if root.opcode == "tuple":
            by_name = {i.name: i for i in body}
            outputs = [by_name[n] for n in hlo.operands(root) if n in by_name]
        if not outputs:
            continue
        largest = max(outputs, key=lambda i: hlo.shape_bytes(i.shape))
        names = _OP_NAME.findall(largest.line)
        return bool(names) and not _MODEL_SCOPE.search(names[0])
    return False


def _fusion_family(mod, ins) -> str:
    body = _body(mod, ins)
    ops = {i.opcode for i in body}
    scopes = " ".join(m for i in body for m in _OP_NAME.findall(i.line))
    writes_fp8 = bool(_F8.search(ins.shape)) or any(
        i.opcode == "convert" and _F8.search(i.shape) for i in body)
    reads_fp8 = any(i.opcode == "parameter" and _F8.search(i.shape) for i in body)
    amax = "abs" in ops and any(
        i.opcode == "reduce" and any(j.opcode == "maximum"
                                     for c in _callees(i.line) for j in mod.computations.get(c, ()))
        for i in body)
    if writes_fp8 or amax:
        if "rsqrt" in ops or _NORM_SCOPE.search(scopes):
            return "norm_quantize"
        if _ACT_SCOPE.search(scopes):
            return "act_quantize"
    if _largest_output_outside_model(mod, ins):
        return "optimizer"
    if writes_fp8 or (reads_fp8 and ("transpose" in ops or "transpose" in ins.name)):
        return "quantize_transpose"
    return "amax" if amax else "other"


def hlo_families(program, gemms=None) -> dict[str, str]:
    """{kernel name (`hlo.kernel_name`): family} of every kernel-level instruction
    (``gemms``: `hlo.gemms` of the program, where already found)."""
    mod = hlo.parse(program)
    gemms = hlo.gemms(mod) if gemms is None else gemms
    out = {hlo.kernel_name(g.name): "fp8_gemm" if g.fp8 else "bf16_gemm" for g in gemms}
    for ins in hlo.kernel_instructions(mod):
        key = hlo.kernel_name(ins.name)
        if key in out:
            continue
        if ins.opcode == "custom-call":
            target = (re.search(r'custom_call_target="([^"]+)"', ins.line) or [None, ""])[1]
            if _ATTENTION_NAME.search(target):
                out[key] = "attention"
            elif target.startswith(("jax_fp8_block_gemm", "jax_fp8_grouped_gemm",
                                     "jax_fp8_grouped_wgrad")):
                out[key] = "fp8_gemm"
            elif target.startswith("jax_fp8_ragged_dot"):   # the 16-bit grouped GEMM
                out[key] = "bf16_gemm"
            elif target.startswith("jax_fp8"):
                out[key] = "jax_fp8_kernels"
            else:
                out[key] = "other"
        elif ins.opcode == "fusion":
            out[key] = _fusion_family(mod, ins)
        elif ins.opcode in ("copy", "transpose") and _F8.search(ins.shape):
            out[key] = "quantize_transpose"
        else:
            out[key] = "other"
    return out


def _gemm_name_fp8(name: str):
    """True/False where a GEMM kernel's name says whether its operands are FP8 (cuBLASLt's
    ``nvjet_sm90_qqtst_...``: q = E4M3, r = E5M2; ``..._tst_...``: bf16), else None."""
    if _FP8_NAME.search(name):
        return True
    m = _NVJET_TYPES.search(name)
    return None if m is None else bool(set(m.group(1)) & set("qr"))


def event_family(event, families) -> tuple[str, str]:
    """(family, how it was decided) of one trace event, ``families`` from `hlo_families`."""
    name = str(event.get("name", ""))
    hlo_op = (event.get("args") or {}).get("hlo_op")
    key = hlo.kernel_name(name)
    if key in families:
        return families[key], "hlo name"
    if _OWN_NAME.search(name):
        return ("fp8_gemm" if "BlockGemm" in name else "jax_fp8_kernels"), "kernel name"
    by_op = families.get(hlo.kernel_name(str(hlo_op))) if hlo_op else None
    if _ATTENTION_NAME.search(name):
        return "attention", "kernel name"
    if _GEMM_NAME.search(name):
        fp8 = _gemm_name_fp8(name)
        if fp8 is None:
            fp8 = by_op == "fp8_gemm"
        return ("fp8_gemm" if fp8 else "bf16_gemm"), "kernel name"
    if by_op:
        return by_op, "hlo_op"
    return "other", "unmatched"


def split_by_family(events, families, steps, top, kernel_bytes=None):
    """({family: ms per step}, {how decided: events}, top kernels, {family: bandwidth}) of
    the traced events. ``kernel_bytes``: `hlo.kernel_bytes` of the program; the kernels XLA
    names after an HLO instruction (fusions, copies) then get the bytes they move and the
    TB/s that makes, and each family the TB/s of those kernels together ("tb_per_s") and
    the share of the family's time they are ("of_time"). Custom calls' kernels (GEMMs,
    attention, jax_fp8's) are named by their library and get none."""
    kernel_bytes = kernel_bytes or {}
    ms = dict.fromkeys(FAMILIES, 0.0)
    how = collections.Counter()
    per_kernel: dict = {}
    moved = collections.Counter()     # family: bytes of the kernels with known bytes
    timed = collections.Counter()     # family: their time, us
    for e in events:
        fam, decided = event_family(e, families)
        dur = float(e.get("dur", 0.0))
        ms[fam] += dur / steps / 1e3
        how[decided] += 1
        name = str(e.get("name", "?"))
        slot = per_kernel.setdefault(name, [fam, 0, 0.0, kernel_bytes.get(hlo.kernel_name(name))])
        slot[1] += 1
        slot[2] += dur
        if slot[3] is not None:
            moved[fam] += slot[3]
            timed[fam] += dur
    ranked = sorted(per_kernel.items(), key=lambda kv: -kv[1][2])[:top]
    top_kernels = []
    for k, (f, n, us, nbytes) in ranked:
        entry = {"name": k[:160], "family": f, "per_step": n / steps,
                 "ms_per_step": round(us / steps / 1e3, 5)}
        if nbytes is not None:
            entry["bytes"] = nbytes
            entry["tb_per_s"] = round(nbytes * n / (us * 1e-6) / 1e12, 3) if us else None
        top_kernels.append(entry)
    bandwidth = {f: {"tb_per_s": round(moved[f] / (timed[f] * 1e-6) / 1e12, 3),
                     "of_time": round(timed[f] / steps / 1e3 / ms[f], 3)}
                 for f in FAMILIES if timed[f] and ms[f]}
    return {k: round(v, 5) for k, v in ms.items()}, dict(how), top_kernels, bandwidth


def gemm_info(mod, gemms) -> dict[str, dict]:
    """{kernel name: {"fp8", "kind", "role", "dtypes", "batch", "m", "n", "k"}} of the step's
    GEMMs (`hlo.gemms`, `hlo.gemm_sizes`; kind: `hlo.Gemm`'s); role "backward" where the
    GEMM's op_name is under a ``transpose(`` (JAX's name for the backward pass), else
    "forward"; dtypes: its two operands' element types (e.g. ``["f8e5m2", "f8e4m3fn"]``)."""
    kernels = {i.name: i for i in hlo.kernel_instructions(mod)}
    shapes = {i.name: i.shape for comp in mod.computations.values() for i in comp}
    sizes = hlo.gemm_sizes(mod)
    out = {}
    for g in gemms:
        ins = kernels.get(g.name)
        op_name = re.search(r'op_name="([^"]*)"', ins.line if ins else "")
        dtypes = [re.match(r"\(?\s*([a-z][a-z0-9]*)\[", shapes.get(op.partition("#")[0], ""))
                  for op in (hlo.gemm_operands(ins) if ins else [])]
        entry = {"fp8": g.fp8, "kind": g.kind,
                 "role": "backward" if op_name and "transpose(" in op_name.group(1) else "forward",
                 "dtypes": [m.group(1) if m else None for m in dtypes]}
        if g.name in sizes:
            entry.update(sizes[g.name]._asdict())
        out[hlo.kernel_name(g.name)] = entry
    return out


def gemm_table(events, gemms, steps) -> dict:
    """The traced GEMM kernels by shape: {"rows": [{fp8, role, batch, m, n, k, per_step,
    ms_per_step, tflops}], "unattributed_ms": ..., "attributed_by": ...}.

    A kernel event is attributed to the GEMM its ``hlo_op`` names (``gemms`` from
    `gemm_info`, in the compiled program's order). Where no event names one (kernels
    launched from a command buffer carry no ``hlo_op``) and the trace has exactly one GEMM
    kernel per GEMM of the program per step, each in time order is the GEMM at the same
    place in the program's order, provided every kernel's name agrees with its GEMM on
    FP8 or not ("order"). GEMM kernels left over are summed unattributed."""
    named, is_gemm = [], []
    for e in events:
        hlo_op = (e.get("args") or {}).get("hlo_op")
        info = gemms.get(hlo.kernel_name(str(hlo_op))) if hlo_op else None
        name = str(e.get("name", ""))
        if _is_gemm_kernel(name):
            is_gemm.append(e)
        elif info is None:
            continue
        named.append((e, info))
    how = "hlo_op"
    if not any(info for _, info in named) and is_gemm:
        by_order = _gemms_by_order(is_gemm, list(gemms.values()), steps)
        if by_order is not None:
            named, how = by_order, "order"
    groups: dict = {}
    unattributed = 0.0
    for e, info in named:
        if info is None:
            unattributed += float(e.get("dur", 0.0))
            continue
        key = tuple(info.get(f) for f in ("fp8", "kind", "role", "batch", "m", "n", "k")) + (
            tuple(info.get("dtypes") or ()),)
        slot = groups.setdefault(key, [0, 0.0])
        slot[0] += 1
        slot[1] += float(e.get("dur", 0.0))
    rows = []
    for (fp8, kind, role, batch, m, n, k, dtypes), (count, us) in sorted(
            groups.items(), key=lambda kv: -kv[1][1]):
        flops = 2 * batch * m * n * k if None not in (batch, m, n, k) else None
        rows.append({"fp8": fp8, "kind": kind, "role": role, "dtypes": list(dtypes),
                     "batch": batch, "m": m, "n": n, "k": k,
                     "per_step": count / steps, "ms_per_step": round(us / steps / 1e3, 5),
                     "tflops": flops * count / (us * 1e-6) / 1e12 if flops and us else None})
    return {"rows": rows, "unattributed_ms": round(unattributed / steps / 1e3, 5),
            "attributed_by": how if groups else None}


def _is_gemm_kernel(name: str) -> bool:
    """Whether `event_family` names a kernel a GEMM's by its name alone."""
    return event_family({"name": name}, {})[0] in ("fp8_gemm", "bf16_gemm")


def _gemms_by_order(gemm_events, infos, steps):
    """[(event, info)] pairing the GEMM kernels in time order with the program's GEMMs in
    its order, step after step; None unless the counts match and every kernel's name
    agrees with its GEMM on FP8 or not (`gemm_table`)."""
    if not infos or len(gemm_events) != steps * len(infos):
        return None
    ordered = sorted(gemm_events, key=lambda e: float(e.get("ts", 0.0)))
    pairs = [(e, infos[i % len(infos)]) for i, e in enumerate(ordered)]
    for e, info in pairs:
        fp8 = _gemm_name_fp8(str(e.get("name", "")))
        if fp8 is not None and fp8 != bool(info.get("fp8")):
            return None
    return pairs


_HLO_DTYPES = {"f8e4m3fn": jnp.float8_e4m3fn, "f8e5m2": jnp.float8_e5m2}


def time_fp8_gemm_alone(g, steps, seed=0) -> dict:
    """One FP8 GEMM row of `gemm_table` timed on its own, the way jax_fp8 runs it
    (``_gemms.gemm``: both operands contracted over their minor axis, a bfloat16 result,
    cuBLASLt's algorithm as XLA autotunes it for that GEMM alone): {"tflops": with the
    row's accumulation (fast for a forward GEMM, float32 for a backward one),
    "tflops_other_accumulation": with the other}. GPU kernel time of ``steps`` calls."""
    from jax_fp8.gemm import _gemms
    if g.get("batch") != 1 or None in (g.get("m"), g.get("n"), g.get("k")) \
            or not str(g.get("kind", "")).startswith("__cublas"):
        return {}   # (a block-scaled GEMM is not a per-tensor one)
    dtypes = [_HLO_DTYPES.get(d) for d in g.get("dtypes") or ()]
    if len(dtypes) != 2 or None in dtypes:
        return {}
    rng = np.random.default_rng(seed)
    a = jnp.asarray(rng.normal(size=(g["m"], g["k"])).astype(np.float32)).astype(dtypes[0])
    b = jnp.asarray(rng.normal(size=(g["n"], g["k"])).astype(np.float32)).astype(dtypes[1])
    one = jnp.float32(1)
    flops = 2 * g["m"] * g["n"] * g["k"]
    out = {}
    fast = g["role"] == "forward"
    for key, precision in (("tflops", None if fast else jax.lax.Precision.HIGHEST),
                           ("tflops_other_accumulation",
                            jax.lax.Precision.HIGHEST if fast else None)):
        gemm = jax.jit(functools.partial(_gemms.gemm, dimension_numbers=(((1,), (1,)), ((), ())),
                                         scale_inv_a=one, scale_inv_b=one,
                                         out_dtype=jnp.bfloat16, precision=precision))
        jax.block_until_ready(gemm(a, b))
        _, events = trace.capture(lambda c: (c[0], c[1], gemm(c[0], c[1])),  # noqa: B023 (run here)
                                  (a, b, gemm(a, b)), steps=steps)
        kernels = [e for e in trace.device_events(events, platform="gpu")
                   if _GEMM_NAME.search(str(e.get("name", "")))]
        us = sum(float(e.get("dur", 0.0)) for e in kernels)
        out[key] = flops * steps / (us * 1e-6) / 1e12 if us else None
    return out


def analyze(mod):
    """(HLO summary for the row, `hlo_families`, `hlo.kernel_bytes`, `gemm_info`) of the
    compiled step (a parsed module)."""
    gemms = hlo.gemms(mod)
    calls = hlo.custom_calls(mod)
    summary = {
        "kernels": len(hlo.kernel_instructions(mod)), "gemms_fp8": sum(g.fp8 for g in gemms),
        "gemms_other": sum(not g.fp8 for g in gemms),
        "fp8_gemms": dict(sorted(collections.Counter(g.kind for g in gemms if g.fp8).items())),
        "custom_calls": calls,
        "attention_calls": sum(n for t, n in calls.items() if _ATTENTION_NAME.search(t)),
        "jax_fp8_update": calls.get("jax_fp8_update", 0)}
    return summary, hlo_families(mod, gemms), hlo.kernel_bytes(mod), gemm_info(mod, gemms)
