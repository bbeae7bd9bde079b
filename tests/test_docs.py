"""The documentation stays true to the code: the API reference is current and complete,
relative links resolve, and no tracked file carries notes about how it was produced."""

from __future__ import annotations

import importlib
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
API_MD = ROOT / "docs" / "api.md"
GEN_API = ROOT / "docs" / "gen_api.py"

# The files of the documentation's owner; the rest of the repository belongs to others.
DOCS_OWNED = ("README.md", "CHANGELOG.md", "docs/")
DOCS_NOT_OWNED = ("docs/convergence.md", "docs/convergence/")

# Words about how the project was made, which do not belong in it.
PROVENANCE = re.compile(
    r"session \d|sessions? [0-9]|issue #?\d|the device tool|device tool|\bCEO\b",
    re.IGNORECASE)

PUBLIC_MODULES = ("jax_fp8", "jax_fp8.flax", "jax_fp8.flax.nnx", "jax_fp8.flax.convert",
                  "jax_fp8.devtools")


def _import_or_none(name):
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as err:
        if err.name == name:
            return None
        raise


def test_api_reference_is_current():
    """`python docs/gen_api.py --check` passes (rerun `python docs/gen_api.py` if not)."""
    pytest.importorskip("flax")
    proc = subprocess.run([sys.executable, str(GEN_API), "--check"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (
        "docs/api.md is stale; run `python docs/gen_api.py` and commit it.\n"
        + proc.stdout[-20000:] + proc.stderr[-5000:])


@pytest.mark.parametrize("module_name", PUBLIC_MODULES)
def test_every_public_name_is_in_the_api_reference(module_name):
    pytest.importorskip("flax")
    module = _import_or_none(module_name)
    if module is None:
        pytest.skip(f"{module_name} does not exist")
    text = API_MD.read_text(encoding="utf-8")
    names = getattr(module, "__all__", None)
    assert names is not None, f"{module_name} has no __all__"
    missing = [n for n in names if f'id="{module_name}.{n}"' not in text
               and f'id="{getattr(getattr(module, n), "__name__", "")}"' not in text]
    assert not missing, f"not in docs/api.md: {[f'{module_name}.{n}' for n in missing]}"


# ------------------------------------------------------------------------------ links

_FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
_CODE = re.compile(r"`[^`\n]*`")
_INLINE_LINK = re.compile(r"!?\[[^\]\n]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REF_LINK = re.compile(r"^\s*\[[^\]]+\]:\s*(\S+)", re.MULTILINE)
_HTML_LINK = re.compile(r"""(?:href|src)\s*=\s*["']([^"']+)["']""")


def _markdown_files():
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _relative_links(text):
    text = _CODE.sub("", _FENCE.sub("", text))
    for rx in (_INLINE_LINK, _REF_LINK, _HTML_LINK):
        for m in rx.finditer(text):
            target = m.group(1)
            if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith("#"):
                continue  # http(s):, mailto:, ... or a link within the page
            yield target


def test_relative_links_resolve():
    broken = []
    for md in _markdown_files():
        if not md.exists():
            continue
        for target in _relative_links(md.read_text(encoding="utf-8")):
            path = target.split("#", 1)[0].split("?", 1)[0]
            if not path:
                continue
            if not (md.parent / path).exists():
                broken.append(f"{md.relative_to(ROOT)}: {target}")
    assert not broken, "links to files that do not exist:\n" + "\n".join(broken)


def test_link_checker_finds_links():
    """The checker itself: it sees inline, reference and image links, not code."""
    text = ("[a](docs/x.md) ![b](img.png#frag) `[c](not/this.md)`\n"
            "[d]: ../y.md\n```\n[e](nor/this.md)\n```\n[f](https://example.com) [g](#top)")
    assert list(_relative_links(text)) == ["docs/x.md", "img.png#frag", "../y.md"]


# -------------------------------------------------------------------------- provenance

def _tracked_files():
    try:
        proc = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                              timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if proc.returncode != 0:
        return None
    return [f for f in proc.stdout.decode("utf-8", "replace").split("\0") if f]


def _owned(path):
    if path.startswith(DOCS_NOT_OWNED):
        return False
    return path in DOCS_OWNED or path.startswith(tuple(p for p in DOCS_OWNED
                                                        if p.endswith("/")))


def _provenance_hits():
    files = _tracked_files()
    if files is None:
        pytest.skip("not a git checkout")
    me = pathlib.Path(__file__).resolve().relative_to(ROOT).as_posix()
    hits = []
    for rel in files:
        if rel == me:
            continue
        path = ROOT / rel
        try:
            data = path.read_bytes()
        except OSError:  # listed but not in the work tree (e.g. deleted, not committed)
            continue
        if b"\0" in data[:8192]:
            continue  # binary
        for lineno, line in enumerate(data.decode("utf-8", "replace").splitlines(), 1):
            m = PROVENANCE.search(line)
            if m:
                hits.append((rel, lineno, m.group(0)))
    return hits


def test_no_words_about_how_the_project_was_made():
    hits = _provenance_hits()
    mine = [h for h in hits if _owned(h[0])]
    assert not mine, "\n".join(f"{f}:{n}: {w!r}" for f, n, w in mine)
    if hits:
        # Files outside the documentation: reported, and to be fixed by their owners.
        pytest.xfail("words about how the project was made in files outside the docs: "
                     + "; ".join(f"{f}:{n} {w!r}" for f, n, w in hits))


def test_provenance_pattern():
    for text in ("Session 5", "sessions 2", "issue #12", "Issue 6", "the device tool",
                 "device tool", "our CEO"):
        assert PROVENANCE.search(text), text
    for text in ("the issue's targets", "sessions", "CEOs", "issued", "a device"):
        assert not PROVENANCE.search(text), text
