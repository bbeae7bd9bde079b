"""`Fp8Rule`: which GEMMs a converter (`jax_fp8.flax.fp8_model`, linen and NNX) makes FP8,
and with which recipe. Framework-neutral: the converters of each framework ask these rules;
the interception of the GEMM calls they share is `jax_fp8.interception`.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jax_fp8.recipes  # noqa: F401  (registers the recipes whose default() is asked below)
from jax_fp8 import recipe as recipe_lib
from jax_fp8.gemm.dot_general import check_min_fp8_flops
from jax_fp8.recipe import default as default_recipe

__all__ = ["AUTO_MIN_FP8_FLOPS", "Fp8ConversionWarning", "Fp8Rule", "as_rules", "rule_for"]


class Fp8ConversionWarning(UserWarning):
    """A module a rule of `fp8_model` matched runs its GEMMs outside FP8.

    Emitted once per converted model, module and reason, at the first call (trace) of the
    converted model that shows it (linen: an ``apply``, not ``init``): the message names
    the module's path, the rule and why (a GEMM below the rule's ``min_fp8_flops``,
    neither operand a parameter the conversion follows, operands of a dtype the recipe
    does not take). ``jax_fp8.devtools.explain`` gives the same reason per GEMM. Filter it
    as any warning: ``warnings.filterwarnings("ignore", category=Fp8ConversionWarning)``,
    or ``"error"`` to make it an exception.
    """



# Per recipe class, the forward FLOPs below which a converted GEMM stays in the operands'
# dtype (Fp8Rule's min_fp8_flops="auto"): each recipe's `auto_min_fp8_flops`, above its
# measured break-even, where one layer's FP8 casts, amaxes and transposes cost as much as
# its faster GEMMs save (docs/benchmarks.md, "One Dense layer: where FP8 starts to pay").
AUTO_MIN_FP8_FLOPS = {cls: cls.auto_min_fp8_flops for cls in recipe_lib.registered()}


@dataclasses.dataclass(frozen=True)
class Fp8Rule:
    """Which GEMMs of a model `fp8_model` makes FP8, and with which recipe.

    Rules are tried in order for the module that calls a GEMM; the first whose ``path``
    matches decides; a GEMM of a module no rule matches stays as it is.

    Attributes:
      path: a regular expression matched in full (``re.fullmatch``) against the module's
        path: its names joined by ``/``, e.g. ``"encoder/layers_0/attention/query"``
        (``""`` for the root module). The default ``".*"`` matches every module.
      recipe: ``DelayedScaling()`` (the default), ``Float8CurrentScaling()``,
        ``Float8BlockScaling()`` or another registered recipe: the recipe of the FP8
        layers the rule creates. None keeps the matched GEMMs as they are (an exclusion,
        e.g. for an LM head).
      min_fp8_flops: which GEMMs of the matched modules become FP8 (the FP8 layers'
        attribute of that name). ``"measured"`` (the default): those FP8 makes faster on
        the platform they are traced for, from their sizes (M, K, N), the recipe and the
        GPU's measured table (`jax_fp8.fp8_pays`: a conservative rule on a GPU without a
        table; every GEMM on the CPU, where FP8 is emulated), so that converting a model
        does not make it slower. 0: every GEMM in FP8 (as the hand-written FP8 layers).
        A number: GEMMs with fewer FLOPs (``2 * batch * M * N * K`` of the forward product)
        run in the operands' dtype; ``"auto"``: the recipe's `AUTO_MIN_FP8_FLOPS`. Every
        GEMM kept is reported (`Fp8ConversionWarning`, ``jax_fp8.devtools.explain``).
      activations: False (the default): only GEMMs with a parameter operand become FP8
        (a layer's kernel; in a hand-written module, an array the module read from its
        own ``params``). True: every GEMM of the matched modules, the attention scores
        (``q @ k``) and the attention-weighted values (``p @ v``) included.

    Raises:
      TypeError / ValueError: a bad path, recipe, min_fp8_flops or activations.
    """

    path: str = ".*"
    recipe: Any = default_recipe()
    min_fp8_flops: float | str = "measured"
    activations: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.path, str):
            raise TypeError(f"Fp8Rule.path must be a regular expression (str), got "
                            f"{self.path!r}")
        try:
            re.compile(self.path)
        except re.error as err:
            raise ValueError(f"Fp8Rule.path {self.path!r} is not a regular expression: "
                             f"{err}") from None
        if self.recipe is not None:
            recipe_lib.check_recipe(self.recipe, "Fp8Rule.recipe")
        flops = self.min_fp8_flops
        if isinstance(flops, str) and flops != "measured":
            if flops != "auto":
                raise ValueError(f"Fp8Rule.min_fp8_flops must be a number of FLOPs, "
                                 f"'measured' or 'auto', got {flops!r}")
            flops = 0 if self.recipe is None else self.recipe.auto_min_fp8_flops
        object.__setattr__(self, "min_fp8_flops",
                           check_min_fp8_flops(flops, "Fp8Rule.min_fp8_flops"))
        if not isinstance(self.activations, bool):
            raise TypeError(f"Fp8Rule.activations must be True or False, got "
                            f"{self.activations!r}")

    def matches(self, path: str) -> bool:
        """Whether the rule applies to the module at ``path`` (names joined by ``/``)."""
        return re.fullmatch(self.path, path) is not None


def as_rules(rules: Any, name: str = "rules") -> tuple[Fp8Rule, ...]:
    """``rules`` (None, one `Fp8Rule` or a sequence of them) as a tuple; None: every GEMM
    with a parameter operand in delayed scaling (``(Fp8Rule(),)``)."""
    if rules is None:
        return (Fp8Rule(),)
    if isinstance(rules, Fp8Rule):
        return (rules,)
    if isinstance(rules, (str, bytes, Mapping)) or not isinstance(rules, Sequence):
        raise TypeError(f"{name} must be an Fp8Rule or a sequence of them, got {rules!r}")
    for i, rule in enumerate(rules):
        if not isinstance(rule, Fp8Rule):
            raise TypeError(f"{name}[{i}] must be a jax_fp8.Fp8Rule, got {rule!r}")
    return tuple(rules)


def rule_for(rules: tuple[Fp8Rule, ...], path: str) -> Fp8Rule | None:
    """The first rule matching ``path``, or None (also when that rule's recipe is None)."""
    for rule in rules:
        if rule.matches(path):
            return rule if rule.recipe is not None else None
    return None
