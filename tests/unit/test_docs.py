"""The docs tell the truth: every registry name is documented under its hook, every doc is linked from the README,
every relative link resolves, and nothing in the repository points at a file outside it."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

from vime_core.plugins.manager import REGISTER_HOOKS, get_plugins
from vime_core.plugins.registry import KNOWN_PROVIDERS

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted((ROOT / "docs").glob("*.md"))
#: the Markdown files whose links are checked: the README, docs/, and the examples' and plugins' READMEs
MARKDOWN = [
    ROOT / "README.md",
    *DOCS,
    *sorted(ROOT.glob("examples/*/README.md")),
    *sorted(ROOT.glob("plugins/*/README.md")),
]
#: where references to files are searched: the Markdown above, and the docstrings and comments of the Python files
#: (string literals in code are data, e.g. the file names a test plants in a sandbox)
PYTHON = sorted(
    p
    for d in ("vime_core", "plugins", "examples", "bench", "tests", "scripts")
    for p in (ROOT / d).rglob("*.py")
    if not any(part.startswith(".") or part == "node_modules" for part in p.relative_to(ROOT).parts)
)
TOP_LEVEL = ("vime_core", "docs", "tests", "examples", "plugins", "bench", "scripts", ".ci", "shared")
#: a file written as if relative to the repository root (``docs/hooks.md``, ``vime_core/rollout/manager.py``,
#: ``shared/design.md``, ``tests/gpu/``): a top-level entry, a slash, path characters, then a file extension or a
#: final slash (so prose like "plugins/hooks" is not taken for a path); not part of a longer path or a URL
REPO_PATH = re.compile(
    r"(?<![\w./~:-])((?:" + "|".join(re.escape(t) for t in TOP_LEVEL) + r")/[\w./*{}<>-]*(?:\.[A-Za-z]\w*|/))(?![\w/])"
)
#: absolute paths of the machine the project was developed on, and local wrapper scripts
OUTSIDE = re.compile(r"(?<![\w.-])(/work/[\w./-]*|/tmp/[\w.-]+\.sh)")
MD_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _rel(p: Path) -> str:
    return str(p.relative_to(ROOT))


def _section(text: str, heading: str) -> str:
    start = text.index(heading)
    end = re.search(r"\n##+ ", text[start + len(heading) :])
    return text[start : start + len(heading) + (end.start() if end else len(text))]


def test_every_registry_name_is_documented_under_its_hook():
    """Built-in names (registered by ``vime_core.builtins``) and the names of the plugins in ``plugins/`` appear, in
    backticks, in their hook's section of docs/hooks.md."""
    text = (ROOT / "docs" / "hooks.md").read_text()
    plugins = get_plugins()
    missing = []
    for kind, hook in REGISTER_HOOKS.items():
        section = _section(text, f"### `{hook}(")
        names = {e.name for e in plugins.registries[kind].entries() if e.provider.startswith("vime_core.builtins.")}
        names |= {name for (k, name) in KNOWN_PROVIDERS if k == kind}
        missing += [f"{hook}: `{n}`" for n in sorted(names) if f"`{n}`" not in section]
    assert missing == []


def test_known_providers_are_the_plugins_in_the_repo():
    """The registry's ``pip install`` hints name exactly the plugin distributions of ``plugins/``."""
    in_repo = {
        d.name for d in (ROOT / "plugins").iterdir() if (d / "pyproject.toml").is_file() and d.name != "_template"
    }
    assert set(KNOWN_PROVIDERS.values()) == in_repo


def test_every_doc_is_linked_from_the_readme():
    readme = (ROOT / "README.md").read_text()
    linked = {target.split("#")[0] for target in MD_LINK.findall(readme)}
    assert [_rel(d) for d in DOCS if _rel(d) not in linked] == []


def _slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces as dashes."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_relative_link_resolves():
    """Every relative Markdown link names an existing file (or directory), and its ``#anchor`` a heading there."""
    broken = []
    for md in MARKDOWN:
        for target in MD_LINK.findall(md.read_text()):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (md.parent / path).resolve() if path else md
            if not dest.exists():
                broken.append(f"{_rel(md)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md":
                headings = re.findall(r"^#+ (.+)$", dest.read_text(), flags=re.M)
                if anchor not in {_slug(h) for h in headings}:
                    broken.append(f"{_rel(md)}: {target} (no such heading)")
    assert broken == []


def _exists(ref: str, base: Path) -> bool:
    """``ref`` exists relative to the repository root or to ``base`` (a plugin's or example's own directory)."""
    if re.search(r"[{<]|[A-Z]{3,}-[A-Z]{3,}", ref):  # a template: ``p_{rollout_id}.pt``, ``vime-KIND-NAME``
        ref = re.split(r"[{<]|[\w-]*[A-Z]{3,}-[A-Z]{3,}", ref)[0].rpartition("/")[0]
    for root in (ROOT, base):
        if any(root.glob(ref.rstrip("/"))) if "*" in ref else (root / ref.rstrip("/")).exists():
            return True
    return False


def _own_root(path: Path) -> Path:
    """The nearest directory above ``path`` holding a ``pyproject.toml`` or ``README.md`` below the repository root
    (a plugin's or example's own tree, which its docs name paths relative to), else the repository root."""
    for d in path.parents:
        if d == ROOT:
            break
        if (d / "pyproject.toml").is_file() or (d / "README.md").is_file():
            return d
    return ROOT


def _docstrings_and_comments(path: Path) -> list[tuple[int, str]]:
    """``(line number, text)`` of every docstring line and comment of a Python file."""
    source = path.read_text()
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                out += [(first.lineno + i, line) for i, line in enumerate(first.value.value.splitlines())]
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            out.append((tok.start[0], tok.string))
    return out


def test_no_reference_to_a_file_outside_the_repo():
    """Docs, docstrings and comments name only files the repository has: no ``shared/...`` design notes, no
    ``/work/...`` paths, no local wrapper scripts, no repo-relative path that does not exist."""
    texts = [(md, list(enumerate(md.read_text().splitlines(), 1))) for md in MARKDOWN]
    texts += [(py, _docstrings_and_comments(py)) for py in PYTHON if py != Path(__file__).resolve()]
    bad, good = [], 0
    for src, lines in texts:
        for lineno, line in lines:
            bad += [f"{_rel(src)}:{lineno}: {m.group(1)}" for m in OUTSIDE.finditer(line)]
            refs = [m.group(1) for m in REPO_PATH.finditer(line)]
            bad += [f"{_rel(src)}:{lineno}: {r}" for r in refs if not _exists(r, _own_root(src))]
            good += sum(_exists(r, _own_root(src)) for r in refs)
    assert bad == []
    assert good > 200  # the pattern does find the many real references (it is not silently matching nothing)
