"""FP8 formats, the `Recipe` interface every scaling recipe implements, and the registry of
recipes (each in its own module under ``jax_fp8.recipes``; Transformer Engine's names)."""

from __future__ import annotations

import abc
import dataclasses
import enum
import math
import typing
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, TypeVar, cast

import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

ALGORITHMS = ("max", "most_recent")

# The FP8 dtypes the library quantizes to (docs/semantics.md), with their largest finite
# value. Others (float8_e8m0fnu, float8_e3m4, float8_e4m3, float8_e4m3b11fnuz) are refused:
# their ranges and NaN/inf encodings do not follow the saturating cast used here.
FP8_DTYPES = (np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2),
              np.dtype(jnp.float8_e4m3fnuz), np.dtype(jnp.float8_e5m2fnuz))


def canonical_fp8_dtype(fp8_dtype: Any, name: str = "fp8_dtype") -> np.dtype:
    """`fp8_dtype` as a NumPy dtype, or a TypeError naming `name`."""
    try:
        dtype: np.dtype | None = np.dtype(fp8_dtype)
    except TypeError:
        dtype = None
    if dtype is None or dtype not in FP8_DTYPES:
        raise TypeError(f"{name} must be one of the FP8 dtypes "
                        f"{', '.join('jnp.' + d.name for d in FP8_DTYPES)}; got {fp8_dtype!r}")
    return dtype


def fp8_max(fp8_dtype: DTypeLike) -> float:
    """Largest finite value of an FP8 dtype: 448 for e4m3fn, 57344 for e5m2, ..."""
    # jnp.finfo is unannotated in JAX.
    return float(jnp.finfo(canonical_fp8_dtype(fp8_dtype)).max)  # type: ignore[no-untyped-call]


def check_margin(margin: Any) -> float:
    if isinstance(margin, bool) or not isinstance(margin, (int, float, np.integer, np.floating)):
        raise TypeError(f"margin must be a real number, got {margin!r}")
    if not math.isfinite(margin):
        raise ValueError(f"margin must be finite, got {margin!r}")
    return float(margin)


def scaled_max(fp8_dtype: DTypeLike, margin: float) -> float:
    """float32(fp8_max) * float32(2 ** -margin), computed once in float32 (docs/semantics.md).

    Returned as the Python float equal to that float32 value.
    """
    margin = check_margin(margin)
    try:
        factor = 2.0 ** -margin
    except OverflowError:  # a hugely negative margin: report it below, naming margin
        factor = math.inf
    with np.errstate(over="ignore", under="ignore"):
        value = np.float32(fp8_max(fp8_dtype)) * np.float32(factor)
    if not (np.isfinite(value) and value >= np.finfo(np.float32).tiny):
        raise ValueError(f"margin={margin} leaves no usable range: fp8_max * 2**-margin = "
                         f"{value} in float32")
    return float(value)


def check_algorithm(amax_compute_algo: Any) -> str:
    if amax_compute_algo not in ALGORITHMS:
        raise ValueError(f"amax_compute_algo must be one of {ALGORITHMS}, "
                         f"got {amax_compute_algo!r}")
    return cast(str, amax_compute_algo)


class Format(enum.Enum):
    """Which FP8 dtype forward tensors and gradients use."""

    E4M3 = "E4M3"      # E4M3 everywhere
    HYBRID = "HYBRID"  # E4M3 forward (inputs, weights), E5M2 gradients

    @property
    def fwd_dtype(self) -> np.dtype:
        return cast(np.dtype, np.dtype(jnp.float8_e4m3fn))

    @property
    def bwd_dtype(self) -> np.dtype:
        return cast(np.dtype,
                    np.dtype(jnp.float8_e5m2 if self is Format.HYBRID else jnp.float8_e4m3fn))


def _check_bool(obj: Any, *names: str) -> None:
    for name in names:
        if not isinstance(getattr(obj, name), (bool, np.bool_)):
            raise TypeError(f"{name} must be a bool, got {getattr(obj, name)!r}")


def _check_epsilon(amax_epsilon: Any) -> None:
    if isinstance(amax_epsilon, bool) or not isinstance(
            amax_epsilon, (int, float, np.integer, np.floating)) \
            or not math.isfinite(amax_epsilon) or amax_epsilon < 0:
        raise ValueError(f"amax_epsilon must be a finite number >= 0, got {amax_epsilon!r}")


RecipeT = TypeVar("RecipeT", bound="Recipe")


class Recipe(abc.ABC):
    """The interface of a scaling recipe: every recipe is a frozen, hashable dataclass
    subclassing it, registered with `register` (one module per recipe under
    ``jax_fp8.recipes``). Code outside a recipe asks these members, never the type.

    Attributes:
      keeps_state: whether a GEMM of the recipe keeps FP8 state between steps (its meta
        holds `ScalingState`s, updated by `jax_fp8.new_fp8_state`) or takes its scales
        from the operands themselves (its meta holds only the recipe).
      auto_min_fp8_flops: the forward FLOPs below which ``Fp8Rule(min_fp8_flops="auto")``
        keeps a converted GEMM in its operands' dtype (the recipe's measured break-even,
        docs/benchmarks.md, "One Dense layer").
      takes_float64: whether its GEMM takes float64 operands (under ``jax_enable_x64``)
        besides the float32, bfloat16 and float16 every recipe takes.
      stand_in: for a recipe that keeps state, the name of the registered recipe without
        state that messages offer first in its place where no state can be kept (inside a
        ``shard_map``, a grouped GEMM of an Equinox model); None for one that keeps none.
    """

    keeps_state: ClassVar[bool]
    auto_min_fp8_flops: ClassVar[float]
    takes_float64: ClassVar[bool] = False
    stand_in: ClassVar[str | None] = None

    def state_dtypes(self) -> dict[str, np.dtype]:
        """The FP8 dtype of each state a GEMM keeps, by role (``input``, ``kernel``,
        ``grad``); empty for a recipe that keeps none."""
        return {}

    def state_history_len(self) -> int | None:
        """The amax history length L of each state a GEMM keeps (its ``amax_history`` is
        ``[..., L]``); None for a recipe that keeps none."""
        return None

    def create_state(self, role: str, shape: Sequence[int] = (),
                     history_len: int | None = None) -> Any:
        """A fresh `jax_fp8.ScalingState` (zero history, scale 1) for the ``role`` of
        `state_dtypes`, of leading axes ``shape`` and history length ``history_len``
        (default `state_history_len`): the one place a recipe's states are made (its
        `create_meta`, the layers' variables). A recipe that keeps state implements it
        (`jax_fp8.state.new_state` makes one from these members); TypeError for one that
        keeps none, ValueError for a role it has no state for."""
        raise TypeError(f"{type(self).__name__} keeps no state: it has no {role!r} state "
                        f"to create")

    def to_fields(self) -> dict[str, Any]:
        """The recipe as JSON-able fields: what a serialized meta stores besides the
        recipe's registered name (jax.export, a packed state's layout); `from_fields`
        reads them back into an equal recipe. The default: every dataclass field in
        declaration order, an `enum.Enum` as its value. A recipe with a field JSON cannot
        hold overrides both; no field may be called ``recipe`` (the name's key)."""
        return {f.name: _json_value(getattr(self, f.name))
                for f in dataclasses.fields(self)}  # type: ignore[arg-type]

    @classmethod
    def from_fields(cls: type[RecipeT], fields: dict[str, Any]) -> RecipeT:
        """The recipe `to_fields` gave ``fields`` for (a field it lacks takes its default).
        The default: each field passed to the constructor, one annotated with an
        `enum.Enum` type converted from its value (annotations must resolve in the
        recipe's module, as ``typing.get_type_hints`` reads them)."""
        hints = typing.get_type_hints(cls)
        return cls(**{name: hints[name](value) if _is_enum(hints.get(name)) else value
                      for name, value in fields.items()})

    @abc.abstractmethod
    def create_meta(self, shape: Sequence[int] = (), history_len: int | None = None
                    ) -> Any:
        """The `jax_fp8.Fp8Meta` of one GEMM (``shape``: leading axes of its states)."""

    @abc.abstractmethod
    def check_meta(self, meta: Any, name: str = "meta", shape: tuple[int, ...] = ()) -> None:
        """Raises TypeError / ValueError when ``meta`` is not a meta of this recipe for a
        GEMM whose states have leading axes ``shape`` (``(G,)`` for a grouped GEMM)."""

    @abc.abstractmethod
    def dot_general(self, lhs: Any, rhs: Any, dimension_numbers: Any, meta: Any,
                    out_dtype: np.dtype) -> tuple[Any, Any]:
        """The recipe's FP8 ``lax.dot_general`` with its custom VJP: ``(out, meta)``.

        Called by `jax_fp8.fp8_dot_general` with canonical ``dimension_numbers``, floating
        float32 / bfloat16 operands and a float32 / bfloat16 ``out_dtype`` (float16 runs
        as float32 around it), and a ``meta`` that passed `check_meta`."""

    def ragged_dot(self, lhs: Any, rhs: Any, group_sizes: Any, meta: Any,
                   out_dtype: np.dtype) -> tuple[Any, Any]:
        """The recipe's FP8 ``lax.ragged_dot`` (G GEMMs, docs/moe.md) with its custom VJP:
        ``(out, meta)``.

        Called by `jax_fp8.fp8_ragged_dot` with lhs [M, K] and rhs [G, K, N] (float32 /
        bfloat16 / float16), int32 ``group_sizes`` [G], an ``out_dtype`` of bfloat16,
        float16 or float32, and a ``meta`` that passed ``check_meta(meta, shape=(G,))``."""
        raise NotImplementedError(f"{type(self).__name__} has no grouped (ragged_dot) GEMM")

    def replace(self, **changes: Any) -> Any:
        """A copy with the given fields replaced (as ``dataclasses.replace``)."""
        return dataclasses.replace(self, **changes)  # type: ignore[type-var]


_REGISTRY: dict[str, type[Recipe]] = {}
# What `jax_fp8.devtools.explain` says of a recipe's GEMM that is not an FP8 dot_general of
# the program: a dot_general under one of these name scopes (e.g. an emulated GEMM), and
# these primitives: name -> (lowering, a function giving the reason in words).
GEMM_SCOPES: dict[str, tuple[str, Callable[[], str]]] = {}
GEMM_PRIMITIVES: dict[str, tuple[str, Callable[[], str]]] = {}
# The recipe of a meta made without one (Fp8Meta.create(), Fp8Rule(), the layers' default).
DEFAULT = "DelayedScaling"

R = TypeVar("R", bound=type[Recipe])


def _json_value(value: Any) -> Any:
    return value.value if isinstance(value, enum.Enum) else value


def _is_enum(hint: Any) -> bool:
    return isinstance(hint, type) and issubclass(hint, enum.Enum)


def register(cls: R) -> R:
    """Class decorator: makes ``cls`` a recipe every part of jax_fp8 accepts (by its name
    in checkpoints and exported functions). At most one registered recipe keeps state: a
    meta of states runs that recipe's GEMM."""
    if not (isinstance(cls, type) and issubclass(cls, Recipe)):
        raise TypeError(f"register takes a jax_fp8.recipe.Recipe subclass, got {cls!r}")
    if cls.keeps_state and any(c.keeps_state for c in _REGISTRY.values() if c is not cls):
        raise ValueError(f"{cls.__name__}: only one registered recipe may keep state")
    _REGISTRY[cls.__name__] = cls
    return cls


def registered() -> tuple[type[Recipe], ...]:
    """The registered recipe classes, in registration order."""
    return tuple(_REGISTRY.values())


def by_name(name: str) -> type[Recipe]:
    """The registered recipe class called ``name`` (KeyError naming the known ones)."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"no recipe {name!r}; the registered ones are "
                       f"{', '.join(_REGISTRY)}") from None


def default() -> Recipe:
    """The default recipe (``DelayedScaling()``)."""
    return _REGISTRY[DEFAULT]()


class _Default:
    """`default()` in a signature evaluated before the recipe classes are registered (a
    module the recipes themselves import); `or_default` resolves it."""

    def __repr__(self) -> str:
        return f"{DEFAULT}()"


DEFAULT_RECIPE: Any = _Default()


def or_default(recipe: Any) -> Any:
    """`recipe`, or `default()` for `DEFAULT_RECIPE`."""
    return default() if recipe is DEFAULT_RECIPE else recipe


def of_states() -> Recipe:
    """The registered recipe that keeps state, with its defaults: the one whose GEMM a
    meta of states runs (its states carry their FP8 dtypes; the recipe's other fields
    matter only to the update)."""
    return next(c for c in _REGISTRY.values() if c.keeps_state)()


def without_state(recipe: Recipe | None = None) -> tuple[str, ...]:
    """The names of the registered recipes that keep no state, in registration order but
    for ``recipe``'s `Recipe.stand_in` first (default: the default recipe's): what a
    message offers where no state can be kept."""
    names = [n for n, c in _REGISTRY.items() if not c.keeps_state]
    lead = (recipe if recipe is not None else _REGISTRY[DEFAULT]).stand_in
    if lead in names:
        names.insert(0, names.pop(names.index(lead)))
    return tuple(names)


def spoken(names: Sequence[str], conjunction: str = "or") -> str:
    """``names`` as a message lists them: ``"A, B or C"`` (``"A"`` for one)."""
    if len(names) < 2:
        return "".join(names)
    return f"{', '.join(names[:-1])} {conjunction} {names[-1]}"


def _names() -> str:
    return spoken([f"jax_fp8.{n}" if i == 0 else n for i, n in enumerate(_REGISTRY)])


def check_recipe(recipe: Any, name: str = "recipe") -> Recipe:
    """`recipe` if it is an instance of a registered recipe, else a TypeError naming `name`."""
    if isinstance(recipe, type) and issubclass(recipe, Recipe):
        raise TypeError(f"{name} must be a recipe instance, got the class {recipe.__name__}: "
                        f"pass `{recipe.__name__}()`, an instance (e.g. "
                        f"`{recipe.__name__}()` for the defaults)")
    if not isinstance(recipe, Recipe) or type(recipe).__name__ not in _REGISTRY:
        raise TypeError(f"{name} must be a {_names()} instance (e.g. `{DEFAULT}()`), got "
                        f"{type(recipe).__name__}")
    return recipe


def check_delayed(recipe: Any, name: str = "recipe") -> Any:
    """`recipe` if it keeps state (delayed scaling), else a TypeError."""
    check_recipe(recipe, name)
    if not recipe.keeps_state:
        stateful = type(of_states()).__name__
        raise TypeError(f"{name} must be a jax_fp8.{stateful} here (the recipe with FP8 "
                        f"state), got {type(recipe).__name__}")
    return recipe


def __getattr__(name: str) -> Any:
    # The recipe classes live in their own modules (jax_fp8.recipes.*), registered when
    # jax_fp8 is imported; they stay importable from here, as are all of them (RECIPES).
    if name == "RECIPES":
        return registered()
    if name in _REGISTRY:
        return _REGISTRY[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
