"""Renders docs/api.md, the API reference, from the docstrings of jax_fp8's public names.

    python docs/gen_api.py            # rewrite docs/api.md
    python docs/gen_api.py --check    # exit 1 with a diff when docs/api.md is stale

Every name of each module's ``__all__`` (or, without one, every name not starting with
``_``) is listed with its signature (``inspect.signature``) and its docstring, module by
module in a fixed order and, inside a module, grouped by the file that defines the name.
Standard library only; the output depends on the sources alone (no dates, no memory
addresses, no values that depend on the machine, such as which kernels were built).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import enum
import importlib
import inspect
import pathlib
import re
import sys
import types

OUT = pathlib.Path(__file__).resolve().parent / "api.md"

# The public modules, in the order of the reference. A module that does not exist
# (yet) is left out.
MODULES = ("jax_fp8", "jax_fp8.flax", "jax_fp8.flax.nnx", "jax_fp8.flax.convert",
           "jax_fp8.devtools")

# Inside a module, names are grouped by the file that defines them, in this order (by
# role); files not listed follow in alphabetical order.
DEFINING_ORDER = (
    "jax_fp8.recipe", "jax_fp8.state", "jax_fp8.update", "jax_fp8.quantization",
    "jax_fp8.blockwise", "jax_fp8.meta", "jax_fp8.dot_general", "jax_fp8.einsum",
    "jax_fp8.packing", "jax_fp8._registration",
    "jax_fp8.flax.linen", "jax_fp8.flax.nnx", "jax_fp8.flax.convert",
)

# Values that depend on the machine are not printed; these say what they are.
CONSTANT_NOTES = {
    "HAS_CPU_KERNEL": "True when the CPU kernel was built and registered with XLA at import.",
    "HAS_CUDA_KERNEL": "True when the CUDA kernels were built and registered with XLA at "
                       "import (the package still imports without them).",
}

# Dataclass fields that Flax adds to every linen Module.
LINEN_FIELDS = ("parent", "name")

SECTIONS_AS_LIST = ("Args", "Arguments", "Attributes", "Raises", "Parameters", "Keyword args")
SECTIONS_AS_TEXT = ("Returns", "Yields", "Example", "Examples", "Note", "Notes", "Usage")


# ------------------------------------------------------------------ values and signatures

def _short_class(obj: type) -> str:
    module = getattr(obj, "__module__", "") or ""
    qual = getattr(obj, "__qualname__", getattr(obj, "__name__", repr(obj)))
    if module in ("builtins",):
        return qual
    if module == "jax.numpy" or module.startswith("ml_dtypes"):
        return f"jnp.{qual}"
    if module.startswith("jax_fp8"):
        return qual
    if module.startswith("flax.nnx"):
        try:
            import flax.nnx as nnx
            if getattr(nnx, qual, None) is obj:
                return f"nnx.{qual}"
        except ImportError:  # pragma: no cover
            pass
    return f"{module}.{qual}"


def format_value(value) -> str:
    """A deterministic, short spelling of a default value."""
    if isinstance(value, enum.Enum):
        return f"{type(value).__name__}.{value.name}"
    if isinstance(value, type):
        return _short_class(value)
    if type(value).__name__ == "dtype" and hasattr(value, "name"):  # a NumPy dtype
        return f"jnp.{value.name}"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        cls = type(value)
        changed = []
        try:
            default = cls()
        except Exception:  # no default constructor: list every field
            default = None
        for field in dataclasses.fields(value):
            if not field.init:
                continue
            v = getattr(value, field.name)
            if default is None or getattr(default, field.name) != v:
                changed.append(f"{field.name}={format_value(v)}")
        return f"{cls.__name__}({', '.join(changed)})"
    if isinstance(value, (types.FunctionType, types.BuiltinFunctionType)):
        return f"{getattr(value, '__module__', '')}.{value.__qualname__}".lstrip(".")
    text = repr(value)
    if " at 0x" in text or re.search(r"0x[0-9a-fA-F]{6,}", text):
        return f"<{type(value).__name__}>"
    return text


def format_annotation(annotation) -> str | None:
    """String annotations (the library's sources use ``from __future__ import
    annotations``) as written; a builtin or jax_fp8 class by its name; anything else
    left out."""
    if annotation is inspect.Parameter.empty:
        return None
    if isinstance(annotation, str):
        if len(annotation) >= 2 and annotation[0] == annotation[-1] and annotation[0] in "'\"":
            return annotation[1:-1]
        return annotation
    if isinstance(getattr(annotation, "__forward_arg__", None), str):  # typing.ForwardRef
        return annotation.__forward_arg__
    if isinstance(annotation, type) and (annotation.__module__ == "builtins"
                                         or annotation.__module__.startswith("jax_fp8")):
        return _short_class(annotation)
    return None  # another library's type: its spelling changes between its versions


def format_signature(sig: inspect.Signature, drop_first: bool = False,
                     drop: tuple = ()) -> str:
    params = list(sig.parameters.values())
    if drop_first and params:
        params = params[1:]
    params = [p for p in params if p.name not in drop]
    parts, star_done, slash_pending = [], False, False
    for p in params:
        if p.kind is p.POSITIONAL_ONLY:
            slash_pending = True
        elif slash_pending:
            parts.append("/")
            slash_pending = False
        if p.kind is p.KEYWORD_ONLY and not star_done:
            parts.append("*")
            star_done = True
        if p.kind is p.VAR_POSITIONAL:
            star_done = True
            text = f"*{p.name}"
        elif p.kind is p.VAR_KEYWORD:
            text = f"**{p.name}"
        else:
            text = p.name
        ann = format_annotation(p.annotation)
        if ann is not None:
            text += f": {ann}"
        if p.default is not p.empty:
            text += (" = " if ann is not None else "=") + format_value(p.default)
        parts.append(text)
    if slash_pending:
        parts.append("/")
    out = f"({', '.join(parts)})"
    ret = format_annotation(sig.return_annotation)
    if ret is not None and ret != "None":
        out += f" -> {ret}"
    return out


def safe_signature(obj, **kwargs) -> str | None:
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return None
    return format_signature(sig, **kwargs)


# --------------------------------------------------------------- docstrings to markdown

_CODE_SPAN = re.compile(r"(``.+?``|`[^`]+`)")


def _inline(text: str) -> str:
    """Escapes what markdown would misread outside code spans (``*``, ``<``)."""
    pieces = _CODE_SPAN.split(text)
    for i in range(0, len(pieces), 2):
        pieces[i] = pieces[i].replace("*", r"\*").replace("<", "&lt;")
    return "".join(pieces)


def _indent_of(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def _text_line(line: str) -> str:
    stripped = line.lstrip(" ")
    bullet = re.match(r"([*-]|\d+\.)\s+", stripped)
    if bullet:
        return " " * _indent_of(line) + bullet.group(0) + _inline(stripped[bullet.end():])
    return " " * _indent_of(line) + _inline(stripped)


def docstring_to_markdown(doc: str | None) -> str:
    """Google-style sections, ``::`` literal blocks and RST underlined titles to markdown."""
    if not doc:
        return "*(no docstring)*"
    lines = inspect.cleandoc(doc).splitlines()
    out, i = [], 0
    while i < len(lines):
        line = lines[i]
        stripped = line.strip()
        nxt = lines[i + 1] if i + 1 < len(lines) else ""
        # An RST title: a line underlined with ---- or ====.
        if stripped and re.fullmatch(r"[-=~]{3,}", nxt.strip()) and \
                len(nxt.strip()) >= len(stripped) - 2:
            out += ["", f"**{_inline(stripped)}**", ""]
            i += 2
            continue
        # A literal block: a line ending with "::", then an indented block.
        if stripped.endswith("::"):
            lead = stripped[:-2].rstrip()
            if lead:
                out.append(_text_line(" " * _indent_of(line) + lead + ":"))
            i += 1
            block = []
            base = _indent_of(line)
            while i < len(lines) and (not lines[i].strip() or _indent_of(lines[i]) > base):
                block.append(lines[i])
                i += 1
            while block and not block[-1].strip():
                block.pop()
            while block and not block[0].strip():
                block.pop(0)
            if block:
                width = min(_indent_of(b) for b in block if b.strip())
                out += ["", "```python", *[b[width:] for b in block], "```", ""]
            continue
        # A Google-style section: "Args:" and an indented body.
        section = re.fullmatch(r"([A-Z][A-Za-z ]*):", stripped)
        if section and section.group(1) in SECTIONS_AS_LIST + SECTIONS_AS_TEXT \
                and nxt.strip() and _indent_of(nxt) > _indent_of(line):
            name = section.group(1)
            base = _indent_of(line)
            i += 1
            body = []
            while i < len(lines) and (not lines[i].strip() or _indent_of(lines[i]) > base):
                body.append(lines[i])
                i += 1
            while body and not body[-1].strip():
                body.pop()
            width = min(_indent_of(b) for b in body if b.strip())
            body = [b[width:] if b.strip() else "" for b in body]
            out += ["", f"**{name}:**", ""]
            if name in SECTIONS_AS_LIST:
                for item in _section_items(body):
                    out.append(item)
            else:
                out.append(docstring_to_markdown("\n".join(body)))
            out.append("")
            continue
        # An indented block after a blank line (not a list item): shown as it is.
        if stripped and _indent_of(line) > 0 and (i == 0 or not lines[i - 1].strip()) \
                and not re.match(r"([*-]|\d+\.)\s+", stripped):
            block = []
            while i < len(lines) and (_indent_of(lines[i]) > 0 or (
                    not lines[i].strip() and i + 1 < len(lines)
                    and _indent_of(lines[i + 1]) > 0)):
                block.append(lines[i])
                i += 1
            width = min(_indent_of(b) for b in block if b.strip())
            block = [b[width:] for b in block]
            out += ["", f"```{_code_language(block)}", *block, "```", ""]
            continue
        out.append(_text_line(line) if stripped else "")
        i += 1
    text = "\n".join(out)
    text = re.sub(r"\n{3,}", "\n\n", text).strip()
    return text


def _code_language(block: list) -> str:
    try:
        ast.parse("\n".join(block))
    except SyntaxError:
        return "text"
    return "python"


def _section_items(body: list) -> list:
    """The entries of an Args/Attributes section as a markdown list."""
    items, current = [], None
    for line in body:
        if not line.strip():
            continue
        if _indent_of(line) == 0:
            if current is not None:
                items.append(current)
            m = re.match(r"([\w.*, ]+?)(\s*\([^)]*\))?:\s*(.*)", line)
            if m:
                current = f"- `{m.group(1)}`{_inline(m.group(2) or '')}: {_inline(m.group(3))}"
            else:
                current = f"- {_inline(line)}"
        else:
            current = (current or "-") + " " + _inline(line.strip())
    if current is not None:
        items.append(current)
    return items


# ------------------------------------------------------------------------- the entries

def public_names(module) -> list:
    names = getattr(module, "__all__", None)
    if names is None:
        names = [n for n in vars(module) if not n.startswith("_")
                 and not isinstance(vars(module)[n], types.ModuleType)
                 and getattr(vars(module)[n], "__module__", module.__name__)
                 .startswith("jax_fp8")]
    return sorted(dict.fromkeys(names), key=lambda n: (n.lower(), n))


def _kind(obj) -> str:
    if isinstance(obj, types.ModuleType):
        return "module"
    if isinstance(obj, type):
        return "class"
    if callable(obj):
        return "function"
    return "constant"


def _own_doc(obj) -> str | None:
    """The object's own docstring (none inherited from a base class)."""
    if isinstance(obj, type):
        return obj.__dict__.get("__doc__")
    return getattr(obj, "__doc__", None)


def _is_linen_module(cls) -> bool:
    try:
        import flax.linen as nn
    except ImportError:  # pragma: no cover
        return False
    return isinstance(cls, type) and issubclass(cls, nn.Module)


def _is_namedtuple(cls) -> bool:
    return isinstance(cls, type) and issubclass(cls, tuple) and hasattr(cls, "_fields")


def _class_signature(cls) -> str | None:
    if issubclass(cls, enum.Enum):
        return None
    if _is_namedtuple(cls):
        return safe_signature(cls)
    drop = LINEN_FIELDS if _is_linen_module(cls) else ()
    for base in cls.__mro__:
        if base.__module__.startswith("jax_fp8") and "__init__" in base.__dict__ \
                and not dataclasses.is_dataclass(base):
            return safe_signature(base.__dict__["__init__"], drop_first=True, drop=drop)
    if dataclasses.is_dataclass(cls):
        return safe_signature(cls, drop=drop)
    return None


def _members(cls) -> list:
    """(name, kind, object) of the public methods, classmethods, staticmethods and
    properties that jax_fp8 itself defines on ``cls`` or its jax_fp8 bases."""
    seen, out = set(), []
    for base in cls.__mro__:
        if not base.__module__.startswith("jax_fp8"):
            continue
        for name, raw in base.__dict__.items():
            if name in seen or (name.startswith("_") and name != "__call__"):
                continue
            if isinstance(raw, property):
                func, kind = raw.fget, "property"
            elif isinstance(raw, classmethod):
                func, kind = raw.__func__, "classmethod"
            elif isinstance(raw, staticmethod):
                func, kind = raw.__func__, "staticmethod"
            elif inspect.isfunction(raw):
                func, kind = raw, "method"
            else:
                continue
            func = inspect.unwrap(func)
            if not getattr(func, "__module__", "").startswith("jax_fp8"):
                continue
            seen.add(name)
            out.append((name, kind, func))
    return sorted(out, key=lambda m: (m[0] != "__call__", m[0].lower()))


def _public_bases(cls) -> list:
    """The direct bases, a private jax_fp8 base replaced by its own bases."""
    out = []
    for base in cls.__bases__:
        if base is object:
            continue
        if base.__name__.startswith("_") and base.__module__.startswith("jax_fp8"):
            out += [b for b in _public_bases(base) if b not in out]
        elif base not in out:
            out.append(base)
    return out


def _anchor(qualname: str) -> str:
    return f'<a id="{qualname}"></a>'


def render_entry(module_name: str, name: str, obj, documented: dict) -> list:
    qual = f"{module_name}.{name}"
    kind = _kind(obj)
    if kind == "module":  # its own section has the anchor
        return [f"- [`{qual}`](#{obj.__name__}): {_inline(_first_line(obj))}", ""]
    lines = [_anchor(qual), f"#### `{qual}`", ""]
    if kind != "constant" and id(obj) in documented and documented[id(obj)] != qual:
        lines += [f"The same object as [`{documented[id(obj)]}`](#{documented[id(obj)]}).",
                  ""]
        return lines
    if kind == "constant":
        note = CONSTANT_NOTES.get(name)
        if isinstance(obj, str):
            lines += [f"`{name} = {obj!r}`", ""]
        else:
            lines += [f"`{name}: {type(obj).__name__}`", ""]
        if note:
            lines += [note, ""]
        return lines
    documented[id(obj)] = qual
    if kind == "class":
        tags = []
        if issubclass(obj, enum.Enum):
            tags.append("enum")
        elif dataclasses.is_dataclass(obj):
            tags.append("dataclass" + (", frozen" if obj.__dataclass_params__.frozen else ""))
        elif _is_namedtuple(obj):
            tags.append("named tuple")
        bases = [b for b in _public_bases(obj) if not (_is_namedtuple(obj) and b is tuple)]
        if bases:
            tags.append("subclass of " + ", ".join(f"`{_short_class(b)}`" for b in bases))
        sig = _class_signature(obj)
        lines += ["```python", f"class {name}{sig or ''}", "```", ""]
        if tags:
            lines += [f"*{'; '.join(tags)}*", ""]
        lines += [docstring_to_markdown(_own_doc(obj)), ""]
        if issubclass(obj, enum.Enum):
            lines += ["**Members:**", ""]
            lines += [f"- `{name}.{m.name}` = `{m.value!r}`" for m in obj]
            lines.append("")
        members = _members(obj)
        if members:
            lines += ["**Methods and properties:**", ""]
        for mname, mkind, func in members:
            if mkind == "property":
                head = f"`{name}.{mname}` *(property)*"
            else:
                sig = safe_signature(func, drop_first=mkind in ("method", "classmethod"))
                head = f"`{name}.{mname}{sig or '(...)'}`"
                if mkind != "method":
                    head += f" *({mkind})*"
            doc = func.__doc__
            lines += [f"- {head}"]
            if doc:
                body = docstring_to_markdown(doc)
                lines += ["", *["  " + b if b else "" for b in body.splitlines()], ""]
        lines.append("")
        return lines
    sig = safe_signature(obj)
    lines += ["```python", f"{name}{sig or '(...)'}", "```", "",
              docstring_to_markdown(_own_doc(obj)), ""]
    return lines


def _first_line(obj) -> str:
    doc = (getattr(obj, "__doc__", None) or "").strip().splitlines()
    return doc[0].rstrip(".") if doc else ""


def _group_key(obj, documented):
    if isinstance(obj, types.ModuleType):
        return "~submodules"
    if _kind(obj) != "constant" and id(obj) in documented:
        return "~reexports"
    defining = getattr(obj, "__module__", None) if _kind(obj) != "constant" else None
    return defining or "~constants"


def _group_sort(key):
    if key in DEFINING_ORDER:
        return (0, DEFINING_ORDER.index(key), key)
    return (1 if not key.startswith("~") else 2, 0, key)


def _group_title(key) -> str:
    if key == "~constants":
        return "Constants"
    if key == "~submodules":
        return "Submodules"
    if key == "~reexports":
        return "Names documented above"
    try:
        first = (inspect.getdoc(importlib.import_module(key)) or "").strip().splitlines()
    except ImportError:
        first = []
    path = key.replace(".", "/") + ".py"
    title = f"`{path}`"
    if first:
        title += f": {_inline(first[0].rstrip('.'))}"
    return title


def render_module(module, documented: dict) -> list:
    name = module.__name__
    lines = [_anchor(name), f"## `{name}`", "", docstring_to_markdown(module.__doc__), ""]
    groups = {}
    for n in public_names(module):
        obj = getattr(module, n)
        groups.setdefault(_group_key(obj, documented), []).append((n, obj))
    order = {"class": 0, "function": 1, "constant": 2, "module": 3}
    for key in sorted(groups, key=_group_sort):
        entries = sorted(groups[key], key=lambda e: (order[_kind(e[1])], e[0].lower(), e[0]))
        if len(groups) > 1 or key != name:
            lines += [f"### {_group_title(key)}", ""]
        for n, obj in entries:
            lines += render_entry(name, n, obj, documented)
    return lines


def load_modules() -> list:
    """The modules of MODULES that exist, each followed by the public submodules it
    exports that MODULES does not name (e.g. ``jax_fp8.devtools.hlo``)."""
    mods, names = [], list(MODULES)
    while names:
        name = names.pop(0)
        if any(m.__name__ == name for m in mods):
            continue
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as err:
            if err.name == name:  # not there (yet): left out
                continue
            raise  # the module exists but something it imports is missing
        mods.append(mod)
        subs = [getattr(mod, n).__name__ for n in public_names(mod)
                if isinstance(getattr(mod, n), types.ModuleType)
                and getattr(mod, n).__name__.startswith("jax_fp8.")
                and getattr(mod, n).__name__ not in MODULES]
        names[:0] = subs
    return mods


def render() -> str:
    mods = load_modules()
    version = getattr(mods[0], "__version__", "?")
    lines = [
        "# API reference",
        "",
        f"<!-- Generated by `python docs/gen_api.py` from the docstrings of jax_fp8 "
        f"{version}. Do not edit by hand: edit the docstrings and rerun it "
        f"(`python docs/gen_api.py --check` says whether this file is current). -->",
        "",
        "Every public name, by module; the numbers each function computes are specified "
        "in [semantics.md](semantics.md).",
        "",
    ]
    for mod in mods:
        names = public_names(mod)
        links = ", ".join(f"[`{n}`](#{mod.__name__}.{n})" for n in names)
        lines.append(f"- [`{mod.__name__}`](#{mod.__name__}): {links}")
    lines.append("")
    documented: dict = {}
    for mod in mods:
        lines += render_module(mod, documented)
    text = "\n".join(line.rstrip() for line in lines)
    text = re.sub(r"\n{3,}", "\n\n", text).strip() + "\n"
    return text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true",
                    help="do not write; exit 1 with a diff when docs/api.md is stale")
    ap.add_argument("--out", type=pathlib.Path, default=OUT, help="default: docs/api.md")
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        current = args.out.read_text(encoding="utf-8") if args.out.exists() else ""
        if current == text:
            print(f"{args.out.name} is up to date")
            return 0
        diff = difflib.unified_diff(current.splitlines(keepends=True),
                                    text.splitlines(keepends=True),
                                    fromfile=f"{args.out} (committed)",
                                    tofile=f"{args.out} (from the docstrings)")
        sys.stdout.writelines(diff)
        print(f"\n{args.out} is stale: run `python docs/gen_api.py` and commit it.",
              file=sys.stderr)
        return 1
    args.out.write_text(text, encoding="utf-8")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
