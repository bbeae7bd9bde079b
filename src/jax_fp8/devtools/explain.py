"""Which lowering each jax_fp8 primitive of a program gets, and which GEMMs are FP8, and why.

Example::

    from jax_fp8.devtools import explain

    rows = explain.explain(train_step, state, batch)
    print(explain.table(rows))

`explain` traces ``f`` for the arguments given and walks the program (every nested jit,
remat, scan, cond, shard_map and custom-derivative body): each jax_fp8 primitive gets the
decision that lowering it makes (``jax_fp8._primitives.base.decide``: the kernel, one
partitioned call per device, or the jax.numpy reference), each jax_fp8 computation with a
version per platform the version that lowers (``base.decide_platform``), and each
``dot_general`` (and ``ragged_dot_general``, a mixture-of-experts layer's grouped GEMM) says
whether it is an FP8 GEMM. Of a ``lax.platform_dependent``, only the
branch of the platform is walked (the others are never lowered). Nothing is compiled or
run. To run the reference everywhere, set ``JAX_FP8_IMPLEMENTATION=jnp`` in the
environment before importing jax_fp8.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, cast

import jax
import jax.extend.core
import numpy as np

from jax_fp8 import recipe as recipe_lib
from jax_fp8._primitives import base
from jax_fp8.gemm._gemms import WIDENED_REASON, WIDENED_SCOPE
from jax_fp8.gemm.dot_general import KEPT_REASON, KEPT_SCOPE, MEASURED_REASON, MEASURED_SCOPE
from jax_fp8.interception import KEPT_SCOPES

__all__ = ["Row", "explain", "table"]


@dataclasses.dataclass(frozen=True)
class Row:
    """One decision of a program.

    kind: "primitive" (a jax_fp8 primitive), "platform" (a jax_fp8 computation with a
      version per platform) or "gemm" (a ``dot_general`` or ``ragged_dot_general``).
    name: the primitive's or the computation's name, "dot_general" or
      "ragged_dot_general" (a grouped GEMM: ``jax.lax.ragged_dot``'s, or the weight
      gradient of `jax_fp8.fp8_ragged_dot`; the FP8 forward and input gradient of its
      per-group scaled recipes are the grouped GEMM primitive's rows).
    where: the module / name-scope path it is called from, with the transformations
      around it (e.g. ``"transpose(jvp(Model))/mlp/Fp8DotGeneral_0"``); "" at the top.
    operands: the operand types, e.g. ``("bfloat16[8192,4096]", "float8_e4m3fn[...]")``.
    lowering: for a primitive ``"kernel"``, ``"partitioned"`` or ``"reference"``; for a
      computation with a version per platform ``"variant"`` (its platform's) or
      ``"reference"``; for a GEMM ``"fp8"``, the element type it runs in (a GEMM of
      FP8-quantized operands widened to it: ``"fp8 operands in float32"``), or what a
      recipe's own GEMM is (``"mxfp8"`` native, ``"mxfp8 emulated"``).
    why: the reason, in words.
    flops: a GEMM's FLOPs (``2 * batch * M * N * K``; a grouped GEMM's ``2 * M * K * N``,
      each row multiplied by one group's weight), 0 for a primitive.
    """
    kind: str
    name: str
    where: str
    operands: tuple[str, ...]
    lowering: str
    why: str
    flops: int = 0

    def __str__(self) -> str:
        return (f"{self.where or '<top>'}: {self.name}({', '.join(self.operands)}) -> "
                f"{self.lowering}: {self.why}")


def explain(f: Callable[..., Any], *args: Any, platform: str | None = None,
            num_devices: int | None = None, **kwargs: Any) -> list[Row]:
    """The decisions of ``jax.jit(f)(*args, **kwargs)``, in program order.

    Args:
      f: a function of arrays (a train step, a forward pass, ...).
      *args, **kwargs: its arguments (arrays or ``jax.ShapeDtypeStruct``s).
      platform: the platform it will be lowered for, "cpu" or "cuda" (default: that of the
        first argument's devices, else of the default backend).
      num_devices: the devices the jit runs over (default: the most devices any
        argument's sharding spans, or the size of the mesh set with ``jax.set_mesh``).

    Returns:
      One `Row` per jax_fp8 primitive and per ``dot_general``.
    """
    leaves = jax.tree.leaves((args, kwargs))
    platform = platform or _platform(leaves)
    if num_devices is None:
        num_devices = _num_devices(leaves)
    closed = jax.make_jaxpr(f)(*args, **kwargs)
    rows: list[Row] = []
    _walk(closed.jaxpr, "", platform, num_devices, rows)
    return rows


def _platform(leaves: Iterable[Any]) -> str:
    devices = next((d for x in leaves for d in getattr(getattr(x, "sharding", None),
                                                         "device_set", ())), None)
    return base.device_platform(devices or jax.devices()[0])


def _num_devices(leaves: Iterable[Any]) -> int:
    counts = [len(getattr(getattr(x, "sharding", None), "device_set", ()) or ()) for x in leaves]
    mesh = jax.sharding.get_abstract_mesh()
    return cast(int, max(counts + [1 if mesh.empty else mesh.size]))


def _sub_jaxprs(value: Any) -> Iterator[jax.extend.core.Jaxpr]:
    if isinstance(value, jax.extend.core.ClosedJaxpr):
        yield value.jaxpr
    elif isinstance(value, jax.extend.core.Jaxpr):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _sub_jaxprs(v)


def _walk(jaxpr: jax.extend.core.Jaxpr, where: str, platform: str, num_devices: int,
          rows: list[Row]) -> None:
    for eqn in jaxpr.eqns:
        here = "/".join(p for p in (where, str(eqn.source_info.name_stack)) if p)
        name = eqn.primitive.name
        avals = [v.aval for v in eqn.invars]
        if name in base.SPECS:
            params = dict(eqn.params)
            implementation = params.pop("implementation", "auto")
            how, why = base.decide(base.SPECS[name], platform, avals, implementation, params,
                                   num_devices)
            rows.append(Row("primitive", name, here, tuple(map(_fmt, avals)), how, why))
        elif name == "dot_general":
            rows.append(_gemm_row(here, avals, eqn.params["dimension_numbers"]))
        elif name == "ragged_dot_general":   # a grouped GEMM (jax.lax.ragged_dot)
            rows.append(_gemm_row(here, avals[:2], eqn.params[
                "ragged_dot_dimension_numbers"].dot_dimension_numbers, name=name))
        elif name in recipe_lib.GEMM_PRIMITIVES:     # a recipe's GEMM of its own
            lowering, reason = recipe_lib.GEMM_PRIMITIVES[name]
            rows.append(Row("gemm", name, here, tuple(map(_fmt, avals)), lowering, reason()))
        elif "jaxpr" in eqn.params and eqn.params.get("name") in base.BY_PLATFORM:
            how, why = base.decide_platform(base.BY_PLATFORM[eqn.params["name"]], platform)
            rows.append(Row("platform", eqn.params["name"], here, tuple(map(_fmt, avals)),
                            how, why))
        inner = 1 if name == "shard_map" else num_devices
        if name == "cond":
            subs = list(_sub_jaxprs(eqn.params["branches"]))
            lowered = _platform_branch(eqn.params.get("branches_platforms"), platform)
            if lowered is not None:   # lax.platform_dependent: only this branch lowers
                _walk(subs[lowered], here, platform, inner, rows)
                continue
            # Branches that decide the same are listed once.
            branches: list[list[Row]] = []
            for sub in subs:
                branches.append([])
                _walk(sub, here, platform, inner, branches[-1])
            key: Callable[[list[Row]], list[Any]] = \
                lambda rs: [(r.kind, r.name, r.operands, r.lowering) for r in rs]  # noqa: E731
            same = all(key(b) == key(branches[0]) for b in branches)
            rows.extend(r for b in (branches[:1] if same else branches) for r in b)
            continue
        for value in eqn.params.values():
            for sub in _sub_jaxprs(value):
                _walk(sub, here, platform, inner, rows)


def _platform_branch(branches_platforms: Sequence[Sequence[str] | None] | None,
                     platform: str) -> int | None:
    """The branch of a ``lax.platform_dependent`` cond that lowers on `platform` (its
    platforms', else the default's), or None for another cond or no such branch."""
    if branches_platforms is None:
        return None
    for i, platforms in enumerate(branches_platforms):
        if platforms is not None and platform in platforms:
            return i
    return next((i for i, p in enumerate(branches_platforms) if p is None), None)


def _gemm_row(where: str, avals: Sequence[Any], dimension_numbers: Any,
             name: str = "dot_general") -> Row:
    (lc, rc), (lb, rb) = dimension_numbers
    lhs, rhs = avals
    free: Callable[[Any, Any, Any], int] = \
        lambda a, c, b: math.prod(d for i, d in enumerate(a.shape)  # noqa: E731
                                  if i not in c and i not in b)
    if name == "ragged_dot_general":
        # each row (each value along the ragged axis) meets one group: the group axis of
        # rhs ([G, K, N]) is not counted; ragged along the contraction, nothing is.
        free_rhs = math.prod(rhs.shape) // math.prod(rhs.shape[i] for i in rc)
        if rhs.ndim == lhs.ndim + 1 - len(lc) + len(rc):   # rhs has a group axis
            free_rhs //= rhs.shape[0]
        flops = 2 * math.prod(lhs.shape) * free_rhs
    else:
        flops = (2 * math.prod(lhs.shape[i] for i in lb) * math.prod(lhs.shape[i] for i in lc)
                 * free(lhs, lc, lb) * free(rhs, rc, rb))
    fp8 = all(np.dtype(a.dtype).itemsize == 1 and "float8" in np.dtype(a.dtype).name
              for a in avals)
    # A scope is named bare, or inside the transformations around it ("jvp(name)").
    scope = next((s for s in recipe_lib.GEMM_SCOPES
                  if re.search(rf"(^|[/(]){re.escape(s)}($|[/)])", where)), None)
    if scope is not None:
        lowering, reason = recipe_lib.GEMM_SCOPES[scope]
        why = reason()
    elif fp8:
        lowering, why = "fp8", "FP8 GEMM"
    elif _in_scope(WIDENED_SCOPE, where):
        lowering = f"fp8 operands in {np.dtype(lhs.dtype)}"
        why = WIDENED_REASON
    elif _in_scope(KEPT_SCOPE, where):
        lowering = str(np.dtype(lhs.dtype))
        why = KEPT_REASON
    elif _in_scope(MEASURED_SCOPE, where):
        lowering = str(np.dtype(lhs.dtype))
        why = MEASURED_REASON
    elif any(_in_scope(s, where) for s in KEPT_SCOPES):
        lowering = str(np.dtype(lhs.dtype))
        why = next(text for s, text in KEPT_SCOPES.items() if _in_scope(s, where))
    else:
        lowering, why = str(np.dtype(lhs.dtype)), "not an FP8 GEMM"
    for scope_name in (KEPT_SCOPE, MEASURED_SCOPE, WIDENED_SCOPE, *KEPT_SCOPES):
        where = _without_scope(scope_name, where)
    if scope is not None:
        where = re.sub(rf"(^|/){re.escape(scope)}(?=$|/)|\({re.escape(scope)}\)", r"\1", where)
    return Row("gemm", name, where, (_fmt(lhs), _fmt(rhs)), lowering, why, flops)


def _in_scope(name: str, where: str) -> bool:
    """Whether ``where`` runs inside the name scope ``name`` (bare, or inside the
    transformations around it: ``"transpose(jvp(name))"``)."""
    return re.search(rf"(^|[/(]){re.escape(name)}($|[/)])", where) is not None


def _without_scope(name: str, where: str) -> str:
    where = "/".join(p for p in where.split("/") if p != name)
    return re.sub(rf"\({re.escape(name)}\)", "", where)


def _fmt(aval: Any) -> str:
    return f"{np.dtype(aval.dtype).name}[{','.join(map(str, aval.shape))}]"


def table(rows: list[Row]) -> str:
    """The rows as a Markdown table."""
    lines = ["| kind | where | name | operands | lowering | why |", "|---|---|---|---|---|---|"]
    lines += [f"| {r.kind} | {r.where or '—'} | {r.name} | {', '.join(r.operands)} | "
              f"{r.lowering} | {r.why} |" for r in rows]
    return "\n".join(lines)
