"""What a GEMM of a running matched module becomes: which operand is a weight
(`_weight_side`), converted or kept out of FP8 and why (`KEPT_SCOPES`, `check_body`,
`note_gemm`), and the report's text for each reason. Part of `jax_fp8.interception`, which
re-exports its public names.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_fp8 import recipe as recipe_lib
from jax_fp8.gemm import _gemms
from jax_fp8.gemm.dot_general import KEPT_SCOPE, gemm_flops, kept_out
from jax_fp8.interception._follow import _FLOAT64, _FLOATS, follow
from jax_fp8.interception._report import note
from jax_fp8.interception._running import weight_of
from jax_fp8.interception._site import Site
from jax_fp8.rules import Fp8Rule

__all__ = ["KEPT_SCOPES", "check_body", "einsum_dimension_numbers", "einsum_flops",
           "note_gemm"]

# The name scopes a GEMM a matched module leaves out of FP8 runs under, by reason (what
# jax_fp8.devtools.explain says); a GEMM below min_fp8_flops runs under KEPT_SCOPE.
KEPT_SCOPES = {
    "fp8_model_no_weight": "kept by fp8_model: neither operand is one of the module's "
                           "parameters as the conversion follows them",
    "fp8_model_traced_body": "kept by fp8_model: its weight was passed into a jax.jit or "
                             "jax.checkpoint body, where a recipe that keeps state cannot "
                             "run",
    "fp8_model_dtype": "kept by fp8_model: the recipe does not take its operands' dtype",
    "fp8_model_form": "kept by fp8_model: a form of the GEMM the FP8 GEMMs do not take (a "
                      "matrix product that broadcasts its operands' batch axes, a grouped "
                      "GEMM other than a mixture-of-experts layer's)",
}


def _takes(rule: Fp8Rule, dtype: np.dtype) -> bool:
    """Whether the rule's recipe takes operands of ``dtype``: float32, bfloat16, float16;
    float64 too where the recipe says so (`Recipe.takes_float64`, as its layers do, under
    x64)."""
    return dtype in _FLOATS or (dtype == _FLOAT64 and rule.recipe is not None
                                and rule.recipe.takes_float64)


def _weight_side(site: Site, lhs: Any,
                 rhs: Any) -> tuple[tuple[str, str | None] | None, str | None]:
    """``((side, weight), None)``: convert, quantizing ``side`` ("rhs" / "lhs") as the
    kernel, the parameter ``weight`` (None: a layer's kernel, or an activation); or
    ``(None, scope)``: leave the GEMM alone, for the reason `KEPT_SCOPES` ``scope`` gives
    (None: not a GEMM the conversion is about, e.g. two activations)."""
    if not all(hasattr(x, "dtype") for x in (lhs, rhs)):
        return None, None
    found: tuple[str, str | None] | None = None
    if site.rhs_is_weight:
        found = ("rhs", None)
    else:
        for side, x in (("rhs", rhs), ("lhs", lhs)):
            name = weight_of(site, x)
            if name is not None:
                found = (side, name)
                break
    dtypes = {np.dtype(x.dtype) for x in (lhs, rhs)}
    floating = all(jnp.issubdtype(d, jnp.floating) for d in dtypes)
    if found is None:
        if site.rule.activations and all(_takes(site.rule, d) for d in dtypes):
            return ("rhs", None), None
        # A module holding a weight whose GEMM has none of its weights as an operand.
        weights = any(getattr(w, "ndim", 0) >= 2 for _, w in site.weights)
        return None, ("fp8_model_no_weight" if weights and floating and len(dtypes) == 1
                      and _takes(site.rule, dtypes.pop()) else None)
    if not all(_takes(site.rule, d) for d in dtypes):
        return None, "fp8_model_dtype" if floating else None
    if found[1] is not None:
        scope = check_body(site, rhs if found[0] == "rhs" else lhs)
        if scope is not None:
            return None, scope
    return found, None


def _why(scope: str, site: Site, lhs: Any, rhs: Any, kind: str) -> str:
    names = ", ".join(sorted({np.dtype(x.dtype).name for x in (lhs, rhs)}))
    if scope == "fp8_model_dtype" and kind.startswith("ragged_dot"):
        return (f"its {kind} has {names} operands, which the grouped FP8 GEMM does not take "
                f"(float32, bfloat16, float16): it runs in {names}. Cast the expert weights "
                f"and tokens to one of those")
    if scope == "fp8_model_dtype":
        wide = [c.__name__ for c in recipe_lib.registered() if c.takes_float64]
        also = f"; {recipe_lib.spoken(wide)} also float64" if wide else ""
        use = f", or use {recipe_lib.spoken(wide)}" if wide else ""
        return (f"its {kind} has {names} operands, which {type(site.rule.recipe).__name__} "
                f"does not take (float32, bfloat16, float16{also}): it runs in {names}. Cast "
                f"the model to a dtype the recipe takes{use}")
    if scope == "fp8_model_traced_body":
        lead = recipe_lib.without_state(site.rule.recipe)[0]
        return (f"its {kind} multiplies its weight inside a jax.jit or jax.checkpoint body "
                f"it was passed into, where {type(site.rule.recipe).__name__}, which keeps "
                f"state, cannot run: it runs as written. Give this module a recipe without "
                f"state (Fp8Rule(path=..., recipe=jax_fp8.{lead}())), or call the GEMM "
                f"outside the body")
    if scope == "fp8_model_form":
        shapes = " and ".join(str(tuple(np.shape(x))) for x in (lhs, rhs))
        if kind.startswith("ragged_dot"):
            return (f"its {kind} of shapes {shapes} is not a mixture-of-experts layer's "
                    f"grouped GEMM (tokens [M, K] ragged along M, an expert weight [G, K, N] "
                    f"or [G, N, K] grouped along its axis 0), the one FP8 grouped GEMM: it "
                    f"runs as written")
        return (f"its {kind} of shapes {shapes} broadcasts its operands' batch axes, which "
                f"the FP8 GEMMs do not: it runs as written. Write it as jax.lax.dot_general "
                f"or jnp.einsum with the weight as one operand")
    names = ", ".join(repr(n) for n in dict.fromkeys(
        n for n, w in site.weights if getattr(w, "ndim", 0) >= 2))
    return (f"neither operand of its {kind} is one of its parameters ({names}) as the "
            f"conversion follows them: the parameter itself, or made from it by casts, "
            f"reshapes, transposes, squeezes and sharding constraints only; a weight "
            f"changed otherwise before the GEMM (scaled, sliced, concatenated, ...) is not "
            f"recognised. Give the GEMM the parameter (through those operations)"
            + ("" if kind.startswith("ragged_dot") else
               ", or convert every GEMM of the module with Fp8Rule(activations=True)"))


def check_body(site: Site, weight_operand: Any) -> str | None:
    """None: a GEMM of the weight ``weight_operand`` converts. A weight passed into a traced
    body (`TRACED_BODIES`) cannot take a recipe that keeps state there (its state's
    gradient, the amax record, cannot leave the body, and linen would create the state
    inside it): inside ``jax.shard_map``, where MaxText's mixture-of-experts layer runs its
    experts, refused naming the rule that fixes it; inside ``jax.jit`` / ``jax.checkpoint``,
    the GEMM is kept, reported for the reason `KEPT_SCOPES` ``"fp8_model_traced_body"``."""
    recipe = site.rule.recipe
    if recipe is None or not recipe.keeps_state:
        return None
    steps = follow(weight_operand)[1]
    if "argument of shard_map" in steps:
        path = site.rule_path
        where = site.where or (f"module {path!r}" if path else "the root module")
        lead, *others = recipe_lib.without_state(recipe)
        alternatives = f" (or {' / '.join(others)})" if others else ""
        raise TypeError(
            f"jax_fp8 fp8_model: {where} ({site.module_type}) runs a GEMM of its weight "
            f"inside a jax.shard_map, where {type(recipe).__name__}, which keeps state, "
            f"cannot run. Give this module a recipe without state: "
            f"Fp8Rule(path={'...' if path is None else repr(path)}, "
            f"recipe=jax_fp8.{lead}()){alternatives} before the other rules")
    if any(step.startswith("argument of ") for step in steps):
        return "fp8_model_traced_body"
    return None


def _kept(site: Site, scope: str, kind: str, lhs: Any, rhs: Any,
          original: Callable[[], Any]) -> Any:
    note(site, scope, _why(scope, site, lhs, rhs, kind))
    with jax.named_scope(scope):   # what jax_fp8.devtools.explain reads
        return original()


def einsum_dimension_numbers(
        eqn: str) -> tuple[tuple[list[int], list[int]], tuple[list[int], list[int]]]:
    """The ``dot_general`` dimension numbers of the explicit two-operand einsum ``eqn``
    (`explicit_einsum`)."""
    ins, res = eqn.split("->")
    a, b = ins.split(",")
    contracted = [i for i, c in enumerate(a) if c in b and c not in res]
    batch = [i for i, c in enumerate(a) if c in b and c in res]
    return ((contracted, [b.index(a[i]) for i in contracted]),
            (batch, [b.index(a[i]) for i in batch]))


def einsum_flops(eqn: str, lhs_shape: Sequence[int], rhs_shape: Sequence[int]) -> int:
    """`gemm_flops` of the explicit two-operand einsum ``eqn`` (`explicit_einsum`)."""
    return gemm_flops(lhs_shape, rhs_shape, einsum_dimension_numbers(eqn))


def note_gemm(site: Site, kind: str, lhs: Any, rhs: Any,
              dimension_numbers: Any = None) -> None:
    """Records for the report a GEMM of ``site``'s module that its FP8 layer runs: in FP8,
    or kept by the rule's ``min_fp8_flops`` (below its FLOPs, or where FP8 is not faster:
    the decision `jax_fp8.fp8_dot_general` / `fp8_ragged_dot` takes on the same sizes).
    ``dimension_numbers``: the ``dot_general``'s; None for a grouped GEMM (lhs [M, K], rhs
    [G, K, N])."""
    if dimension_numbers is None:
        (m, k), n, batch = jnp.shape(lhs), jnp.shape(rhs)[-1], 1
        formula = "2 * M * K * N"
    else:
        try:
            batch, m, n, k = _gemms.gemm_sizes(jnp.shape(lhs), jnp.shape(rhs),
                                               dimension_numbers)
        except (TypeError, ValueError):
            note(site, None)
            return
        formula = "2 * batch * M * N * K"
    kept = kept_out(site.rule.recipe, site.rule.min_fp8_flops, batch * m, k, n)
    if kept is None:
        note(site, None)
        return
    dtype = np.dtype(jnp.result_type(lhs, rhs)).name
    shapes = f"shapes {tuple(jnp.shape(lhs))} and {tuple(jnp.shape(rhs))}"
    if kept[0] == KEPT_SCOPE:
        note(site, KEPT_SCOPE,
             f"its {kind} of {2 * batch * m * n * k} FLOPs ({formula}, {shapes}) is below "
             f"the rule's min_fp8_flops ({float(site.rule.min_fp8_flops):.0f}): it runs in "
             f"{dtype}. Lower min_fp8_flops (0: every GEMM in FP8)")
    else:
        note(site, kept[0], f"its {kind} ({shapes}) runs in {dtype}: {kept[1]}")
