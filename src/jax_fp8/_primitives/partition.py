"""Partitioning rules: the update's (sharded states) and the block-scaled GEMM's.

Sharded states: each device updates the shards it holds, with no all-gather.

Every leading (non-history) axis of a state indexes independent tensors, so the
update partitions trivially along them; only the history axis must be whole on a
device. `UPDATE` says exactly that to custom_partitioning (base.Partitioning): each
state gets its own leading factors (passed through to its results) and a history
factor that needs replication.

The block-scaled GEMM (`BLOCK_GEMM`): each device multiplies the shards it holds, its
batch and M axes as a's, N as b's, K sharded only where both operands' shards hold whole
128-blocks along it (then each device's float32 product is summed over the K shards);
everything else is gathered, as FP8 with its scales (1 byte a value, plus one float32
per block), before the GEMM.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jax_fp8._primitives import base, block_quantize as bq, common
from jax_fp8._primitives.common import padded_spec as _padded_spec


def _layout(params):
    """(num_states, operand kinds) of a flat operand list."""
    g = len(params["scaled_max"])
    kinds = ["history"] * g + ["scale"] * g
    kinds += ["scale_inv"] * g if params["has_scale_inv"] else []
    kinds += ["amax"] * g if params["has_amax"] else []
    return g, kinds


def _sharding_rule(params, operand_types):
    g, kinds = _layout(params)
    factors, need_replication = [], []
    for i in range(g):
        lead = [f"s{i}d{d}" for d in range(len(operand_types[i].shape) - 1)]
        factors.append(lead)
        need_replication.append(f"s{i}h")
    operands = []
    for k, kind in enumerate(kinds):
        i = k % g
        operands.append(" ".join(factors[i] + ([need_replication[i]] if kind == "history" else [])))
    results = operands[:g] + operands[g:2 * g] + operands[g:2 * g]
    rule = ", ".join(operands) + " -> " + ", ".join(results)
    return rule, {"need_replication_factors": tuple(need_replication)}


def _shardings(params, mesh, arg_shapes):
    """Per-operand and per-result shardings: each state's history's leading spec."""
    g, kinds = _layout(params)
    lead = [_padded_spec(arg_shapes[i].sharding, arg_shapes[i].ndim)[:-1] for i in range(g)]
    hist = [NamedSharding(mesh, PartitionSpec(*lead[i], None)) for i in range(g)]
    small = [NamedSharding(mesh, PartitionSpec(*lead[i])) for i in range(g)]
    args = [hist[k % g] if kind == "history" else small[k % g] for k, kind in enumerate(kinds)]
    return tuple(args), tuple(hist + small + small)


UPDATE = base.Partitioning(shardings=_shardings, rule=_sharding_rule)




# --------------------------------------------------------------------- block-scaled GEMM

def _gemm_fits(n, shards, whole, padded) -> bool:
    """n values in `shards` equal pieces, each of whole 128-blocks where `whole`, and
    `padded` (a count of scales along the GEMM layout's padded axis, or None) needing no
    padding inside the array."""
    return (n % shards == 0 and not (whole and (n // shards) % bq.BLOCK)
            and (padded is None or padded % 4 == 0))


def _gemm_specs(params, mesh, a_shape, a_spec, b_shape, b_spec):
    """(lead, m, n, k) PartitionSpec entries for the GEMM a [..., M, K] . b [..., N, K]:
    a's batch and M axes, b's N axis, and K as a's (else b's), each kept where its shards
    hold whole blocks (and the GEMM layout's scales need no padding) and its mesh axes
    are not taken by an earlier one."""
    ra, rb, gemm = params["a_block_rows"], params["b_block_rows"], params["scale_layout"] == "gemm"
    *lead_shape, m, k = a_shape
    n = b_shape[-2]
    kb = -(-k // bq.BLOCK)
    used: set = set()

    def take(entry, size, whole, padded):
        axes = common.spec_axes(entry)
        if not axes or used & set(axes):
            return None
        if not _gemm_fits(size, common.axes_size(mesh, axes), whole, padded):
            return None
        used.update(axes)
        return entry

    lead = tuple(take(e, d, False, None) for e, d in zip(a_spec[:-2], lead_shape))
    m_entry = take(a_spec[-2], m, ra == bq.BLOCK, m if gemm and ra == 1 else None)
    n_entry = take(b_spec[-2], n, rb == bq.BLOCK, n if gemm and rb == 1 else None)
    k_padded = kb if gemm and bq.BLOCK in (ra, rb) else None
    k_entry = take(a_spec[-1], k, True, k_padded) or take(b_spec[-1], k, True, k_padded)
    return lead, m_entry, n_entry, k_entry


def _scale_spec(lead, rows_entry, k_entry, block_rows, gemm):
    # GEMM layout: 1x128 scales [..., kb, R], 128x128 [..., rb, kb]; spec layout [..., R, kb]
    return lead + ((k_entry, rows_entry) if gemm and block_rows == 1 else (rows_entry, k_entry))


def _gemm_shardings(params, mesh, arg_shapes):
    a, _, b, _ = arg_shapes
    lead, m, n, k = _gemm_specs(params, mesh, a.shape, common.padded_spec(a.sharding, a.ndim),
                                b.shape, common.padded_spec(b.sharding, b.ndim))
    gemm = params["scale_layout"] == "gemm"
    specs = (lead + (m, k), _scale_spec(lead, m, k, params["a_block_rows"], gemm),
             lead + (n, k), _scale_spec(lead, n, k, params["b_block_rows"], gemm))
    named = lambda spec: NamedSharding(mesh, PartitionSpec(*spec))  # noqa: E731
    return tuple(named(s) for s in specs), named(lead + (m, n))


def _gemm_local(bind, operands, *, mesh, shardings, params):
    """One device's GEMM on its shards. With K sharded: the float32 GEMM of its K-shard,
    summed over the devices holding the other K-shards (psum), then rounded once to
    out_dtype. That is the one-device GEMM's sum of float32 block products in another
    order (a summation tree of the same terms), so within the same bound
    (tests/test_block_gemm.py: the bounds hold whatever the order of the float32 sum).
    GEMM-layout scales of a shard are padded (with 1.0) as the kernel reads them."""
    del mesh
    a, sa, b, sb = operands
    if params["scale_layout"] == "gemm":
        sa = _pad4(sa)
        sb = _pad4(sb)
    k_axes = common.spec_axes(common.padded_spec(shardings[0], a.ndim)[-1])
    if not k_axes:
        return bind(a, sa, b, sb, **params)
    partial = bind(a, sa, b, sb, **dict(params, out_dtype=np.dtype(np.float32)))
    return jax.lax.psum(partial, k_axes).astype(params["out_dtype"])


def _pad4(s):
    pad = -s.shape[-1] % 4
    if not pad:
        return s
    return jnp.pad(s, [(0, 0)] * (s.ndim - 1) + [(0, pad)], constant_values=1.0)


def _gemm_rule(params, operand_types):
    lead = tuple(f"b{i}" for i in range(len(operand_types[0].shape) - 2))
    gemm = params["scale_layout"] == "gemm"
    specs = (lead + ("m", "k"), _scale_spec(lead, "m", "k", params["a_block_rows"], gemm),
             lead + ("n", "k"), _scale_spec(lead, "n", "k", params["b_block_rows"], gemm))
    return (", ".join(" ".join(s) for s in specs) + " -> " + " ".join(lead + ("m", "n")),
            {"reduction_factors": ("k",)})


BLOCK_GEMM = base.Partitioning(_gemm_shardings, _gemm_rule, local=_gemm_local,
                               needs_kernel=False, explicit=True)
