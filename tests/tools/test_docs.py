"""The documentation stays true to the code: the site and its API reference build with
every warning an error and list every public name, relative links resolve, the docs and
docstrings name only files and modules that exist, the pages' snippets run, and no
tracked file carries notes about how it was produced."""

from __future__ import annotations

import functools
import html as html_lib
import importlib
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]  # the repository
MKDOCS_YML = ROOT / "mkdocs.yml"

# The files of the documentation's owner; the rest of the repository belongs to others.
DOCS_OWNED = ("README.md", "CHANGELOG.md", "docs/")
DOCS_NOT_OWNED = ("docs/convergence.md", "docs/convergence/")

# The public modules and their reference pages (docs/reference/<page>.md).
PUBLIC_MODULES = {"jax_fp8": "jax_fp8", "jax_fp8.flax": "flax", "jax_fp8.flax.nnx": "nnx",
                  "jax_fp8.flax.interop": "interop", "jax_fp8.equinox": "equinox"}


def _import_or_none(name):
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as err:
        if err.name == name:
            return None
        raise


# ------------------------------------------------------------------- the site (mkdocs)

@functools.cache
def _built_site():
    """(returncode, output, site folder) of `mkdocs build --strict`, built once."""
    site = pathlib.Path(os.environ.get("TMPDIR", "/tmp")) / f"jax_fp8_site_{os.getpid()}"
    shutil.rmtree(site, ignore_errors=True)
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                           str(site)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    return proc.returncode, proc.stdout + proc.stderr, site


def _site():
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings_handlers.python")
    pytest.importorskip("material")  # the theme (mkdocs-material, in the docs extra)
    code, output, site = _built_site()
    assert code == 0, "mkdocs build --strict failed:\n" + output[-20000:]
    return site


def test_site_builds_with_warnings_as_errors():
    """`mkdocs build --strict` (what CI runs) succeeds: no broken page, anchor or
    docstring that griffe cannot read."""
    _site()
    assert "strict: true" in MKDOCS_YML.read_text(encoding="utf-8")


@pytest.mark.parametrize("module_name", sorted(PUBLIC_MODULES))
def test_every_public_name_is_in_the_api_reference(module_name):
    """Each name of the module's __all__ has its entry (an anchor `module.name`) on the
    module's reference page, or a page of its own for a submodule."""
    pytest.importorskip("flax")
    module = _import_or_none(module_name)
    if module is None:
        pytest.skip(f"{module_name} does not exist")
    html = (_site() / "reference" / PUBLIC_MODULES[module_name] / "index.html").read_text(
        encoding="utf-8")
    ids = set(re.findall(r'id="([^"]+)"', html))
    names = getattr(module, "__all__", None)
    assert names is not None, f"{module_name} has no __all__"
    missing = [n for n in names if f"{module_name}.{n}" not in ids
               and f"{module_name}.{n}" not in PUBLIC_MODULES]
    assert not missing, f"not in the API reference: {[f'{module_name}.{n}' for n in missing]}"


def test_api_reference_shows_only_public_names():
    """No private module, internal alias or tool module on the reference pages."""
    for page in PUBLIC_MODULES.values():
        html = (_site() / "reference" / page / "index.html").read_text(encoding="utf-8")
        ids = re.findall(r'id="(jax_fp8[^"]*)"', html)
        private = [i for i in ids if re.search(r"\._[a-z]|\.devtools\b", i)]
        assert not private, f"{page}: {private}"
        text = html_lib.unescape(re.sub(r"<[^>]+>", "", html))
        aliases = re.findall(r"\b\w+_lib\.\w+", text)
        assert not aliases, f"{page}: internal aliases in signatures: {sorted(set(aliases))}"
        # An attribute's value is the code that sets it (HAS_CPU_KERNEL = CPU_MODULE is
        # not None, use_bias: bool = use_bias): the reference shows names and types.
        code = re.findall(r"\b[A-Za-z_]\w* = (?:[A-Z_]+ is not None|use_bias)\b", text)
        assert not code, f"{page}: attribute values from the code: {sorted(set(code))}"


_SITE_LINK = re.compile(r'<(?:a|img|link|script)\b[^>]*?\b(?:href|src)="([^"]*)"')


def _broken_site_links(site):
    """'page: target' for each relative href / src of the built site's HTML that names no
    file of the site, or an anchor (`page.html#id`, `#id`) that its page does not have."""
    ids = {}

    def page_ids(path):
        if path not in ids:
            ids[path] = set(re.findall(r"""\bid=["']([^"']+)["']""",
                                       path.read_text(encoding="utf-8", errors="replace")))
        return ids[path]

    broken = []
    for page in sorted(site.rglob("*.html")):
        if page == site / "404.html":
            continue  # served for any missing path, so its links start at the server's root
        html = page.read_text(encoding="utf-8", errors="replace")
        for raw in _SITE_LINK.findall(html):
            target = html_lib.unescape(raw)
            if not target or re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) \
                    or target.startswith("//"):
                continue  # another site's address, mailto:, data:, javascript:
            path, _, anchor = target.split("?", 1)[0].partition("#")
            dest = page if not path else (page.parent / path)
            if path.endswith("/") or dest.is_dir():
                dest = dest / "index.html"
            where = f"{page.relative_to(site)}: {target}"
            if not dest.exists() or (anchor and dest.suffix == ".html"
                                     and anchor not in page_ids(dest)):
                broken.append(where)
    return broken


def test_built_site_has_no_broken_link_or_image():
    """Every relative link and image of the built site lands on a file of the site (and
    on an element of that page where it names one): links written for the repository
    (README.md, ../bench/..., ../tests/...) were turned into pages of the site."""
    site = _site()
    assert (site / "index.html").exists()
    broken = _broken_site_links(site)
    assert not broken, "broken links on the built site:\n" + "\n".join(broken)


def test_site_link_checker_finds_broken_links(tmp_path):
    """The checker itself, on a made-up site."""
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "index.html").write_text('<h1 id="top">A</h1>', encoding="utf-8")
    (tmp_path / "index.html").write_text(
        '<a href="a/">ok</a> <a href="a/#top">ok</a> <img src="a/index.html"> '
        '<a href="https://example.com/x">ok</a> <a href="#here">?</a> <p id="here"></p>'
        '<a href="b/">no</a> <a href="a/#nowhere">no</a> <img src="plot.png">',
        encoding="utf-8")
    assert _broken_site_links(tmp_path) == [
        "index.html: b/", "index.html: a/#nowhere", "index.html: plot.png"]


def test_home_page_is_the_readme():
    """The site's home page shows the README (its first section and its install
    command), not a pointer to it."""
    html = (_site() / "index.html").read_text(encoding="utf-8")
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    install = re.search(r'^python -m pip install (?:-v )?"\.\[[a-z,]+\]"', readme, re.MULTILINE)
    assert install and html_lib.escape(install.group(0), quote=False) in html.replace(
        "&quot;", '"')
    assert 'href="getting_started/"' in html


def test_docs_requirements_match_the_docs_extra():
    """docs/requirements.txt (the docs-only install) and pyproject's `docs` extra list
    the same packages, so either install builds the same site."""
    tomllib = pytest.importorskip("tomllib")
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))[
        "project"]["optional-dependencies"]["docs"]
    lines = (ROOT / "docs" / "requirements.txt").read_text(encoding="utf-8").splitlines()
    requirements = [line.split("#")[0].strip() for line in lines]
    assert sorted(r for r in requirements if r) == sorted(extra)


def test_api_reference_renders_docstrings_as_markdown():
    """No reST left on the reference pages: no literal '::' in the text, and no box titled
    by a parameter's description (a `name: text` paragraph outside an Args section)."""
    for page in PUBLIC_MODULES.values():
        html = (_site() / "reference" / page / "index.html").read_text(encoding="utf-8")
        prose = re.sub(r"<(pre|code)\b.*?</\1>", "", html, flags=re.DOTALL)
        text = html_lib.unescape(re.sub(r"<[^>]+>", "", prose))
        literal = [text[max(0, m.start() - 60):m.end()] for m in re.finditer("::", text)]
        assert not literal, f"{page}: reST '::' shown as text: {literal}"
        boxes = set(re.findall(r'<details class="([^"]*)"', html))
        assert boxes <= {"example", "note", "warning", "tip"}, f"{page}: boxes {boxes}"


def test_every_reference_page_is_in_the_nav():
    text = MKDOCS_YML.read_text(encoding="utf-8")
    for page in PUBLIC_MODULES.values():
        assert f"reference/{page}.md" in text, page
        assert (ROOT / "docs" / "reference" / f"{page}.md").exists(), page


# ------------------------------------------------------------------------------ links

_FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
_CODE = re.compile(r"`[^`\n]*`")
_INLINE_LINK = re.compile(r"!?\[[^\]\n]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REF_LINK = re.compile(r"^\s*\[[^\]]+\]:\s*(\S+)", re.MULTILINE)
_HTML_LINK = re.compile(r"""(?:href|src)\s*=\s*["']([^"']+)["']""")


def _pages():
    """(path, text) of every documentation page that exists."""
    paths = [ROOT / "README.md", ROOT / "CHANGELOG.md", ROOT / "examples" / "README.md",
             ROOT / "bench" / "README.md", *sorted((ROOT / "docs").glob("*.md")),
             *sorted((ROOT / "docs" / "reference").glob("*.md"))]
    return [(md, md.read_text(encoding="utf-8")) for md in paths if md.exists()]


def _relative_links(text):
    text = _CODE.sub("", _FENCE.sub("", text))
    for rx in (_INLINE_LINK, _REF_LINK, _HTML_LINK):
        for m in rx.finditer(text):
            target = m.group(1)
            if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith("#"):
                continue  # http(s):, mailto:, ... or a link within the page
            yield target


def _slug(heading):
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to '-'."""
    text = re.sub(r"<[^>]+>", "", heading).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(md):
    text = _FENCE.sub("", md.read_text(encoding="utf-8"))
    seen, out = {}, set(re.findall(r"""<a\s+(?:id|name)=["']([^"']+)["']""", text))
    for heading in re.findall(r"^#{1,6}\s+(.*?)\s*#*\s*$", text, re.MULTILINE):
        slug = _slug(heading)
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def _broken_links():
    """(missing files, missing sections): `page.md`, `page.md#section` and `#section`
    links that name no file, or no heading or <a id> of that page."""
    files, sections = [], []
    for md, text in _pages():
        stripped = _CODE.sub("", _FENCE.sub("", text))
        targets = list(_relative_links(text)) + [
            m.group(1) for m in _INLINE_LINK.finditer(stripped) if m.group(1).startswith("#")]
        for target in targets:
            path, _, anchor = target.split("?", 1)[0].partition("#")
            page = md.parent / path if path else md
            where = f"{md.relative_to(ROOT)}: {target}"
            if not page.exists():
                files.append(where)
            elif anchor and page.suffix == ".md" and anchor not in _anchors(page):
                sections.append(where)
    return files, sections


def test_relative_links_resolve():
    broken = _broken_links()[0]
    assert not broken, "links to files that do not exist:\n" + "\n".join(broken)


def test_anchors_resolve():
    broken = _broken_links()[1]
    assert not broken, "links to sections that do not exist:\n" + "\n".join(broken)


def test_link_checker_finds_links():
    """The checker itself: it sees inline, reference and image links, not code."""
    text = ("[a](docs/x.md) ![b](img.png#frag) `[c](not/this.md)`\n"
            "[d]: ../y.md\n```\n[e](nor/this.md)\n```\n[f](https://example.com) [g](#top)")
    assert list(_relative_links(text)) == ["docs/x.md", "img.png#frag", "../y.md"]
    assert _slug("Floating point: IEEE float32, no flush-to-zero") == \
        "floating-point-ieee-float32-no-flush-to-zero"
    assert _slug("The update (H200)") == "the-update-h200"
    assert _slug("`quantize_blocks`") == "quantize_blocks"


# ---------------------------------------------------------------------------- snippets

_PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)


def _snippets(md):
    """The page's ```python blocks that run as written: all but those naming a path the
    reader fills in (/path/to/...)."""
    blocks = _PYTHON_BLOCK.findall(md.read_text(encoding="utf-8"))
    return [b for b in blocks if "/path/to/" not in b]


# Pages whose ```python blocks run as written, each block on its own (as a reader pastes
# one block into a fresh interpreter).
SNIPPET_PAGES = ("README.md", "docs/reference/nnx.md", "docs/convert.md",
                 "docs/training_loops.md", "docs/moe.md")


def _snippet_cases():
    return [pytest.param(page, n, id=f"{page}[{n}]") for page in SNIPPET_PAGES
            if (ROOT / page).exists() for n in range(len(_snippets(ROOT / page)))]


def _run_snippet(code, tmp_path):
    script = tmp_path / "snippet.py"
    script.write_text(code, encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
    env.update(JAX_PLATFORMS="cpu", PYTHONDONTWRITEBYTECODE="1")
    return subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("page, index", _snippet_cases())
def test_snippet_runs_on_its_own(page, index, tmp_path):
    """Each ```python block of the page runs on CPU in a fresh interpreter: it imports
    and defines everything it uses."""
    pytest.importorskip("flax")
    pytest.importorskip("optax")
    proc = _run_snippet(_snippets(ROOT / page)[index], tmp_path)
    assert proc.returncode == 0, f"{page}, python block {index}:\n" + proc.stderr[-5000:]


# Pages whose ```python blocks continue each other within a section: each `## ` section's
# blocks, in order, form one program (as a reader pastes them into one session).
PROGRAM_PAGES = ("docs/getting_started.md", "docs/equinox.md")


def _section_programs(md):
    """{title: its ```python blocks joined in order} for each `## ` section of the page
    that holds any."""
    text = md.read_text(encoding="utf-8")
    fences = [m.span() for m in _FENCE.finditer(text)]
    headings = [(m.start(), m.group(1).strip())
                for m in re.finditer(r"^## (.+)$", text, re.MULTILINE)
                if not any(a <= m.start() < b for a, b in fences)]
    programs = {}
    for m in _PYTHON_BLOCK.finditer(text):
        titles = [title for start, title in headings if start < m.start()]
        if titles and "/path/to/" not in m.group(1):
            programs.setdefault(titles[-1], []).append(m.group(1))
    return {title: "\n".join(blocks) for title, blocks in programs.items()}


def _program_cases():
    return [pytest.param(page, title, id=f"{page}[{title}]") for page in PROGRAM_PAGES
            if (ROOT / page).exists() for title in _section_programs(ROOT / page)]


@pytest.mark.parametrize("page, section", _program_cases())
def test_section_runs_as_one_program(page, section, tmp_path):
    """The section's ```python blocks, run in order in one fresh interpreter on CPU,
    import and define everything they use and run without error."""
    pytest.importorskip("flax")
    pytest.importorskip("optax")
    pytest.importorskip("orbax.checkpoint")
    proc = _run_snippet(_section_programs(ROOT / page)[section], tmp_path)
    assert proc.returncode == 0, f"{page}, section {section!r}:\n" + proc.stderr[-5000:]


def test_getting_started_runs_both_loops():
    """The getting-started page holds a linen and an NNX program, each with a train step,
    an evaluation and an orbax save and a restore through jax_fp8.flax.orbax_restore (which
    names a changed variable and the fix, where orbax's own restore dumps tree structures),
    and the linen program shows that error."""
    programs = _section_programs(ROOT / "docs" / "getting_started.md")
    assert {"Flax linen", "Flax NNX"} <= set(programs), sorted(programs)
    for title in ("Flax linen", "Flax NNX"):
        code = programs[title]
        for needle in ("train_step(", "eval_loss(", "StandardCheckpointer()", ".save(",
                       "orbax_restore(checkpointer"):
            assert needle in code, (title, needle)
        assert "checkpointer.restore(" not in code, title
    assert "nnx.eval_shape(" in programs["Flax NNX"] and "nnx.split(" in programs["Flax NNX"]
    assert "except ValueError as err:" in programs["Flax linen"]


def test_readme_has_snippets_to_run():
    assert len(_snippets(ROOT / "README.md")) >= 2


def test_snippet_runner_fails_on_a_missing_name(tmp_path):
    """The runner itself: a block that uses a name it does not define fails."""
    proc = _run_snippet("import jax.numpy as jnp\nstates = jax_fp8.ScalingState.create()\n",
                        tmp_path)
    assert proc.returncode != 0 and "NameError" in proc.stderr


# ----------------------------------------------------- files and modules the text names

# Where names are looked for: the documentation pages and the library's sources
# (docstrings and comments).
NAMING_PAGES = ("README.md", "examples/README.md", "bench/README.md")
TOP_DIRS = ("src", "docs", "bench", "ffi", "tests", "examples", "scripts")
_PATH = re.compile(r"(?<![\w./-])((?:" + "|".join(TOP_DIRS) + r")/[\w./-]*[\w/])")
_SRC_PATH = re.compile(r"(?<![\w./-])((?:_primitives|flax|devtools)/\w+\.py)\b")
_BARE_FILE = re.compile(r"(?<![\w./-])([A-Za-z_][\w-]*\.(?:py|md|cc|cu|h|sh|toml|yml))\b")
_DOTTED = re.compile(r"(?<![\w.])(jax_fp8(?:\.[A-Za-z_]\w*)+)")


def _naming_sources():
    """(label, text) of every page and library source whose names are checked."""
    paths = [ROOT / p for p in NAMING_PAGES]
    paths += sorted((ROOT / "docs").glob("*.md")) + sorted((ROOT / "docs").glob("*/*.md"))
    paths += sorted((ROOT / "src" / "jax_fp8").rglob("*.py"))
    return [(p.relative_to(ROOT).as_posix(), p.read_text(encoding="utf-8")) for p in paths
            if p.exists() and not p.relative_to(ROOT).as_posix().startswith(DOCS_NOT_OWNED)]


@functools.cache
def _file_names():
    names = set()
    for base in ("src", "ffi", "tests", "bench", "docs", "examples", "scripts"):
        names.update(p.name for p in (ROOT / base).rglob("*") if p.is_file())
    names.update(p.name for p in ROOT.iterdir() if p.is_file())
    return names


def _path_exists(path, label):
    path = path.rstrip(".")
    if any(c in path for c in "*<{"):
        return True  # a pattern or a placeholder, not a file
    candidates = [ROOT / path, (ROOT / label).parent / path, ROOT / "src" / "jax_fp8" / path]
    return any(c.exists() for c in candidates)


@functools.cache
def _extension_modules():
    """The compiled modules CMakeLists.txt builds (present only where they were built)."""
    text = (ROOT / "CMakeLists.txt").read_text(encoding="utf-8")
    return frozenset(re.findall(r"nanobind_add_module\((\w+)", text))


def _dotted_exists(name):
    parts = name.split(".")
    if len(parts) >= 2 and parts[1] in _extension_modules():
        return True
    for n in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:n]))
        except ImportError:
            continue
        for attr in parts[n:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def _names_that_do_not_exist(sources):
    missing = []
    for label, text in sources:
        for lineno, line in enumerate(text.splitlines(), 1):
            if "://" in line:
                line = re.sub(r"\S+://\S+", "", line)  # URLs name other sites' files
            for m in _PATH.finditer(line):
                if not _path_exists(m.group(1), label):
                    missing.append(f"{label}:{lineno}: {m.group(1)}")
            for m in _SRC_PATH.finditer(line):
                if not _path_exists(m.group(1), label):
                    missing.append(f"{label}:{lineno}: {m.group(1)}")
            for m in _BARE_FILE.finditer(line):
                if m.group(1) not in _file_names():
                    missing.append(f"{label}:{lineno}: {m.group(1)}")
            for m in _DOTTED.finditer(line):
                name = m.group(1).rstrip(".")
                if re.search(r"\.(py|md|so|json)$", name):
                    continue  # a file name such as jax_fp8.md
                if not _dotted_exists(name):
                    missing.append(f"{label}:{lineno}: {name}")
    return missing


def test_docs_and_docstrings_name_only_files_and_modules_that_exist():
    """A path (`src/...`, `docs/...`, `bench/...`, `ffi/...`, `_primitives/x.py`), a file
    name (`x.md`, `x.cc`) or a dotted `jax_fp8.x.y` name in a page, a docstring or a
    comment names something that exists."""
    pytest.importorskip("flax")
    missing = _names_that_do_not_exist(_naming_sources())
    assert not missing, "names of files or modules that do not exist:\n" + "\n".join(missing)


def test_name_checker_finds_names_that_do_not_exist():
    """The checker itself, on made-up text."""
    pytest.importorskip("flax")
    text = ("see docs/semantics.md and src/jax_fp8/update.py, `jax_fp8.update_states`,\n"
            "`jax_fp8.flax.nnx.Fp8Linear`, _primitives/update.py, README.md,\n"
            "jax_fp8._jax_fp8_cpu (built or not), reference/jax_fp8.md\n"
            "but not docs/nothing.md, bench/results/none/, `jax_fp8.no_such_name`,\n"
            "jax_fp8.flax.nowhere, _primitives/nothing.py, SPEC_NONE.md\n"
            "nor https://example.com/src/x.py, docs/<page>.md, bench/results/*.json")
    missing = _names_that_do_not_exist([("docs/made_up.md", text)])
    assert sorted(m.split(": ", 1)[1] for m in missing) == sorted([
        "docs/nothing.md", "bench/results/none/", "jax_fp8.no_such_name",
        "jax_fp8.flax.nowhere", "_primitives/nothing.py", "SPEC_NONE.md"]), missing


# ------------------------------------------------------------- measurements in the code

# A time or a GPU model in the library's text is a measurement or a note about one run:
# those belong in docs/benchmarks.md, docstrings state contracts.
MEASUREMENT = re.compile(r"\b[0-9]+(\.[0-9]+)? ?(ms|µs|us)\b|\bH[12]00\b")


def test_library_sources_carry_no_measurements():
    hits = []
    for path in sorted((ROOT / "src" / "jax_fp8").rglob("*.py")):
        for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if MEASUREMENT.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{lineno}: {line.strip()}")
    assert not hits, "measurements in the library (move them to docs/benchmarks.md):\n" \
        + "\n".join(hits)


def test_measurement_pattern():
    for text in ("takes 27 ms", "5.5 µs", "12us", "on an H200", "H100"):
        assert MEASUREMENT.search(text), text
    for text in ("128 x 128 blocks", "msgpack", "status", "H2000", "2 ** 35 FLOPs"):
        assert not MEASUREMENT.search(text), text
