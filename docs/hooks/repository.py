"""MkDocs hook: the README is the home page, and repository files outside docs/ are pages.

The pages are written to read well in the repository (README.md links `docs/x.md`, a
page links `../bench/README.md`). On the site every such relative link must land on a
page, so this hook

- serves the repository's README.md as the home page (`index.md`);
- gives every repository file outside docs/ that a page links to a place on the site
  under `repo/`: Markdown files as pages (their own links followed the same way), images
  and other binary files as they are, other text files (sources, logs, JSON) as a page
  with the file in a code block, folders as a page listing their files;
- rewrites each relative link and image while a page renders, from the repository's
  layout to the site's, before MkDocs resolves and checks it (so a link to a file that
  does not exist is still MkDocs' warning, and `mkdocs build --strict` fails on it).
"""

from __future__ import annotations

import logging
import posixpath
import re
from pathlib import Path
from urllib.parse import unquote, urlsplit

from markdown import Extension, Markdown
from markdown.treeprocessors import Treeprocessor
from mkdocs.structure.files import File, Files, InclusionLevel

log = logging.getLogger("mkdocs.hooks.repository")

HOME = "README.md"   # the repository file that is the site's home page
MIRROR = "repo"      # where the other repository files land on the site
IMAGES = frozenset({".png", ".jpg", ".jpeg", ".gif", ".svg", ".webp"})
LANGUAGES = {".py": "python", ".json": "json", ".jsonl": "json", ".toml": "toml",
             ".yml": "yaml", ".yaml": "yaml", ".sh": "bash", ".h": "cpp", ".cc": "cpp",
             ".cu": "cpp", ".cmake": "cmake", ".txt": "text", ".log": "text"}
SKIPPED = frozenset({"__pycache__", ".git", ".pytest_cache"})

# Link targets in Markdown, outside code: [text](target), [ref]: target, href= / src=.
_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,}).*?^ {0,3}\1", re.MULTILINE | re.DOTALL)
_CODE = re.compile(r"`[^`\n]*`")
_TARGETS = (re.compile(r"\]\(\s*<?([^)\s>]+)"),
            re.compile(r"^\s*\[[^\]]+\]:\s*(\S+)", re.MULTILINE),
            re.compile(r"""(?:href|src)\s*=\s*["']([^"']+)["']"""))


class _Site:
    """Where each repository path lands on the site, and where each page's links start."""

    def __init__(self, root: Path, docs: str):
        self.root = root
        self.docs = docs                       # docs_dir, relative to the root
        self.mirrored: dict[str, str] = {}     # repository path -> src_uri on the site
        self.base: dict[str, str] = {}         # src_uri of a page -> its links' folder
        self.listings: set[str] = set()        # src_uris of the pages made here from a
                                               # folder or a file that is not Markdown

    def page_base(self, src_uri: str) -> str:
        """The repository folder that the page's relative links start from."""
        if src_uri in self.base:
            return self.base[src_uri]
        return posixpath.dirname(posixpath.join(self.docs, src_uri))

    def site_uri(self, path: str) -> str | None:
        """src_uri on the site of the repository path (file or folder), if it has one."""
        if path == HOME:
            return "index.md"
        if path == self.docs or path.startswith(self.docs + "/"):
            return posixpath.relpath(path, self.docs)
        return self.mirrored.get(path)

    def mirror(self, path: str, files: Files, config, pending: list) -> None:
        """Give the repository path a place under MIRROR/ (once); queue Markdown to scan."""
        if path in self.mirrored:
            return
        full = self.root / path
        if full.is_dir():
            readme = f"{path}/README.md"
            if (self.root / readme).is_file():
                self.mirror(readme, files, config, pending)
                self.mirrored[path] = self.mirrored[readme]
                return
            uri = f"{MIRROR}/{path}/index.md"
            self.mirrored[path] = uri
            self.base[uri] = path
            entries = sorted(e for e in full.iterdir()
                             if e.name not in SKIPPED and not e.name.startswith("."))
            lines = [f"# `{path}/`", ""]
            for entry in entries:
                name = entry.name + ("/" if entry.is_dir() else "")
                lines.append(f"- [`{name}`]({name})")
                self.mirror(f"{path}/{entry.name}", files, config, pending)
            files.append(_generated(config, uri, content="\n".join(lines) + "\n"))
            self.listings.add(uri)
            return
        data = full.read_bytes()
        suffix = full.suffix.lower()
        if suffix == ".md":
            uri = f"{MIRROR}/{path}"
            self.base[uri] = posixpath.dirname(path)
            files.append(_generated(config, uri, abs_src_path=str(full)))
            pending.append((posixpath.dirname(path), data.decode("utf-8")))
        elif suffix in IMAGES or b"\0" in data[:8192]:
            uri = f"{MIRROR}/{path}"
            files.append(_generated(config, uri, abs_src_path=str(full)))
        else:
            uri = f"{MIRROR}/{path}.md"
            text = data.decode("utf-8", "replace")
            if not text.endswith("\n"):
                text += "\n"
            longest = max((len(m) for m in re.findall(r"`{3,}", text)), default=0)
            fence = "`" * max(3, longest + 1)   # longer than any run of backticks inside
            language = LANGUAGES.get(suffix, "text")
            content = f"# `{path}`\n\n{fence}{language}\n{text}{fence}\n"
            files.append(_generated(config, uri, content=content))
            self.listings.add(uri)
        self.mirrored[path] = uri

    def rewrite(self, url: str, src_uri: str) -> str:
        """The page's link `url`, written for the repository, as a link on the site."""
        parts = urlsplit(url)
        if parts.scheme or parts.netloc or not parts.path or url.startswith("/"):
            return url
        path = posixpath.normpath(posixpath.join(self.page_base(src_uri),
                                                 unquote(parts.path)))
        if path.startswith("../") or path == "..":
            return url
        target = self.site_uri(path)
        if target is None:
            return url  # not a file of the repository: MkDocs reports it
        rel = posixpath.relpath(target, posixpath.dirname(src_uri) or ".")
        # An anchor names a heading of a Markdown page; a listing has none to land on.
        keeps_anchor = target.endswith(".md") and target not in self.listings
        return rel + (f"#{parts.fragment}" if parts.fragment and keeps_anchor else "")


_site: _Site | None = None
_page_uri: str | None = None   # the page being rendered (pages render one at a time)


def _generated(config, src_uri: str, **source) -> File:
    return File.generated(config, src_uri, inclusion=InclusionLevel.NOT_IN_NAV, **source)


def _link_targets(text: str):
    text = _CODE.sub("", _FENCE.sub("", text))
    for rx in _TARGETS:
        for m in rx.finditer(text):
            yield m.group(1)


class _RepositoryLinks(Treeprocessor):
    def run(self, root):
        if _site is None or _page_uri is None:
            return
        for element in root.iter():
            attr = {"a": "href", "img": "src"}.get(element.tag)
            if attr and element.get(attr):
                element.set(attr, _site.rewrite(element.get(attr), _page_uri))


class _RepositoryLinksExtension(Extension):
    def extendMarkdown(self, md: Markdown) -> None:
        # After the inline patterns made the links (20), before MkDocs resolves them (0).
        md.treeprocessors.register(_RepositoryLinks(md), "repository_links", 5)


def on_config(config):
    global _site
    root = Path(config.config_file_path).resolve().parent
    docs = Path(config.docs_dir).resolve().relative_to(root).as_posix()
    _site = _Site(root, docs)
    config.markdown_extensions.append(_RepositoryLinksExtension())
    return config


def on_files(files: Files, config):
    if files.get_file_from_path("index.md") is not None:
        raise ValueError(f"{_site.docs}/index.md: the home page is {HOME}; remove the file")
    files.append(_generated(config, "index.md", abs_src_path=str(_site.root / HOME)))
    _site.base["index.md"] = ""
    # Every page's links, then the links of each repository page they reach.
    pending = [(_site.page_base(f.src_uri), f.content_string) for f in files.documentation_pages()
               if f.src_uri != "index.md"]
    pending.append(("", (_site.root / HOME).read_text(encoding="utf-8")))
    while pending:
        base, text = pending.pop()
        for target in _link_targets(text):
            parts = urlsplit(target)
            if parts.scheme or parts.netloc or not parts.path or target.startswith("/"):
                continue
            path = posixpath.normpath(posixpath.join(base, unquote(parts.path)))
            if path.startswith("..") or _site.site_uri(path) is not None:
                continue
            if (_site.root / path).exists():
                _site.mirror(path, files, config, pending)
    # Two sources of one page (e.g. `x.md` and `x/README.md`, both `x/index.html`): one
    # would silently replace the other on the site.
    seen: dict[str, str] = {}
    for f in files:
        if f.dest_uri in seen:
            log.warning(f"'{f.src_uri}' and '{seen[f.dest_uri]}' are both the site's "
                        f"'{f.dest_uri}': rename one of them")
        seen.setdefault(f.dest_uri, f.src_uri)
    return files


def on_page_markdown(markdown, page, config, files):
    global _page_uri
    _page_uri = page.file.src_uri
    return markdown


def on_serve(server, config, builder):
    server.watch(str(_site.root / HOME))
    for path in _site.mirrored:
        server.watch(str(_site.root / path))
