"""`Site`: how the GEMMs of one running module method are converted (the record that the
interception, its report and each framework's converter pass between them)."""

from __future__ import annotations

import dataclasses
from typing import Any

from jax_fp8.rules import Fp8Rule


@dataclasses.dataclass(frozen=True)
class Site:
    """How the GEMMs of one running module method are converted.

    ``convert(kind, args, precision, preferred_element_type, weight)`` runs the FP8 GEMM
    in the module's scope: kind "dot_general" with ``args = (lhs, rhs, dimension_numbers)``
    or "einsum" with ``args = (eqn, lhs, rhs)``, the rhs quantized as the kernel;
    ``weight`` is the name of the module's parameter the rhs is (its FP8 state is that
    weight's), or None (a layer's kernel, or an activation).
    """

    rule: Fp8Rule
    convert: Any
    # (name, array) of the module's parameters (by identity)
    weights: tuple[tuple[str, Any], ...] = ()
    rhs_is_weight: bool = False  # a layer whose GEMM's rhs is its kernel (nn.Dense, ...)
    path: str | None = None      # the module's path and type, for the report; None: no
    module_type: str = ""        # report (e.g. while linen initializes)
    where: str = ""              # how the report names the module (default: by its path)
    rule_path: str | None = None  # the module's path as a rule names it, for the fixes an
                                  # error gives (also while linen initializes)

    @property
    def key(self) -> tuple[Fp8Rule, bool]:
        """What decides how a GEMM of this site converts when its operands are not the
        module's weights (a ``jax.jit`` helper's arguments): part of ``jax.jit``'s cache
        key while it runs (`jax_fp8.interception.running`)."""
        return (self.rule, self.rhs_is_weight)
