"""The import structure of vime_core (and of each plugin's package) stays acyclic and layered.

Every module is parsed with :mod:`ast` (nothing is imported); its imports of vime_core / plugin modules are
collected — top-level ones and those inside functions alike, ``if TYPE_CHECKING:`` blocks left out — and

* the module graph must have no cycle (each cycle found is printed, with the import lines that close it), not even
  when the imports of ``if TYPE_CHECKING:`` blocks are counted too;
* no module may import a module of a higher layer of :data:`LAYERS`;
* docs/architecture.md's "Layers" list is :data:`LAYERS` (same layers, names and entries, in order).

An import of ``a.b.c`` counts as an edge to ``a.b.c`` only (not to the packages ``a`` and ``a.b`` Python also
initialises on the way).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]

#: vime_core's floors, bottom first: a module may import modules of its own floor and of the floors below, never
#: of one above. Each entry is a module or a package (a package covers its submodules); the longest entry that
#: covers a module gives its layer. Each entry is a room (folders are floors: test_every_layer_entry_is_a_room).
#: ``vime_core`` alone means the root package's ``__init__`` only.
LAYERS: list[tuple[str, list[str]]] = [
    ("foundation", ["vime_core.config", "vime_core.models", "vime_core.types", "vime_core.version"]),
    (
        "sandbox, algorithms, cluster and failures",
        ["vime_core.sandbox", "vime_core.algorithms", "vime_core.cluster", "vime_core.failures"],
    ),
    ("rewards and weight sync", ["vime_core.rewards", "vime_core.weight_sync"]),
    ("engines, trainer and data", ["vime_core.engines", "vime_core.trainer", "vime_core.data"]),
    ("agent", ["vime_core.agent"]),
    ("plugins", ["vime_core.plugins"]),
    ("rollout", ["vime_core.rollout"]),
    ("driver and built-ins", ["vime_core.run", "vime_core.builtins"]),
    ("command", ["vime_core.cli"]),
    ("kit", ["vime_core.testing"]),
    ("face", ["vime_core", "vime_core._moved"]),
]


def documented_layers(text: str) -> list[tuple[str, list[str]]]:
    """The layer list of the "## Layers" section of docs/architecture.md: items ``N. **name** — `a`, `b.c`: ...``
    (entries relative to ``vime_core``, up to the first colon; ``vime_core`` itself as is)."""
    section = text.split("\n## Layers\n", 1)[1].split("\n## ", 1)[0]
    items = re.findall(r"^\d+\. \*\*(.+?)\*\* — (.*?)(?=^\d+\. |^\S|\Z)", section, re.M | re.S)
    layers = []
    for name, body in items:
        names = re.findall(r"`([^`]+)`", body.split(": ", 1)[0])
        layers.append((name, [n if n == "vime_core" else f"vime_core.{n}" for n in names]))
    return layers


def _packages() -> list[Path]:
    """vime_core and every plugin's top-level package (``plugins/*/src/<pkg>``; the template excluded)."""
    pkgs = [ROOT / "vime_core"]
    for src in sorted((ROOT / "plugins").glob("*/src")):
        if not src.parent.name.startswith("_"):
            pkgs += sorted(p for p in src.iterdir() if (p / "__init__.py").is_file())
    return pkgs


def _modules() -> dict[str, tuple[Path, bool]]:
    """``{dotted name: (file, is_package)}`` of every module of :func:`_packages`."""
    mods = {}
    for pkg in _packages():
        for f in sorted(pkg.rglob("*.py")):
            parts = list(f.relative_to(pkg.parent).with_suffix("").parts)
            is_pkg = parts[-1] == "__init__"
            mods[".".join(parts[:-1] if is_pkg else parts)] = (f, is_pkg)
    return mods


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST, type_checking: bool = False) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement of ``tree``, at any depth, outside ``if TYPE_CHECKING:`` bodies (``type_checking``:
    those too)."""
    out: list[ast.Import | ast.ImportFrom] = []
    todo: list[ast.AST] = list(ast.iter_child_nodes(tree))
    while todo:
        node = todo.pop()
        if isinstance(node, ast.If) and _is_type_checking(node) and not type_checking:
            todo.extend(node.orelse)  # the `else:` of `if TYPE_CHECKING:` runs
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out.append(node)
        todo.extend(ast.iter_child_nodes(node))
    return out


def import_graph(type_checking: bool = False) -> dict[str, dict[str, list[str]]]:
    """``{module: {imported module: ["file:line", ...]}}`` over the modules of :func:`_modules` (``type_checking``:
    counting the imports of ``if TYPE_CHECKING:`` blocks too)."""
    mods = _modules()
    graph: dict[str, dict[str, list[str]]] = {m: {} for m in mods}
    for name, (path, is_pkg) in mods.items():
        for node in _imports(ast.parse(path.read_text(), str(path)), type_checking):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:  # relative: from the module's package, one level up per extra dot
                    pkg = name.split(".") if is_pkg else name.split(".")[:-1]
                    pkg = pkg[: len(pkg) - (node.level - 1)]
                    base = ".".join(pkg + ([node.module] if node.module else []))
                # `from pkg import sub` imports the submodule pkg.sub when there is one
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            for target in targets:
                while target and target not in mods:  # `import a.b.c` of a symbol-less path: its module
                    target = target.rpartition(".")[0]
                if target and target != name:
                    where = f"{path.relative_to(ROOT)}:{node.lineno}"
                    graph[name].setdefault(target, []).append(where)
    return graph


def find_cycles(graph: dict[str, dict[str, list[str]]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each as a sorted list."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def layer_of(module: str) -> int | None:
    """The index in :data:`LAYERS` of ``module``'s layer (its longest covering entry), or None if none covers it."""
    best: tuple[int, int] | None = None  # (entry length, layer)
    for i, (_, entries) in enumerate(LAYERS):
        for entry in entries:
            covers = module == entry or (entry != "vime_core" and module.startswith(entry + "."))
            if covers and (best is None or len(entry) > best[0]):
                best = (len(entry), i)
    return None if best is None else best[1]


def test_the_graph_sees_local_imports_and_skips_type_checking(tmp_path):
    """The parser counts a function-local import and ignores an ``if TYPE_CHECKING:`` one (the rule's premise)."""
    tree = ast.parse(
        "from typing import TYPE_CHECKING\n"
        "import vime_core.types\n"
        "if TYPE_CHECKING:\n"
        "    from vime_core.rollout.manager import RolloutManager\n"
        "else:\n"
        "    from vime_core import net\n"
        "def f():\n"
        "    from vime_core.plugins.registry import Registry\n"
    )
    assert [(type(n).__name__, n.lineno) for n in sorted(_imports(tree), key=lambda n: n.lineno)] == [
        ("ImportFrom", 1),
        ("Import", 2),
        ("ImportFrom", 6),
        ("ImportFrom", 8),
    ]
    assert find_cycles({"a": {"b": []}, "b": {"c": []}, "c": {"a": []}, "d": {"a": []}}) == [["a", "b", "c"]]


def test_the_docs_list_the_layers():
    """docs/architecture.md's "Layers" list and :data:`LAYERS` are the same (neither is edited alone)."""
    doc = documented_layers((ROOT / "docs" / "architecture.md").read_text())
    assert doc == LAYERS, (
        "docs/architecture.md's Layers list differs from LAYERS:\n"
        + "\n".join(f"  doc {d}\n  LAYERS {t}" for d, t in zip(doc, LAYERS, strict=False) if d != t)
        + ("" if len(doc) == len(LAYERS) else f"\n  {len(doc)} layers in the doc, {len(LAYERS)} in LAYERS")
    )
    # the parser reads what the section holds, not nothing
    sample = (
        "# Doc\n\n## Layers\n\nIntro `q`.\n\n1. **a** — `vime_core`, `x.y`: text with `z`\n   more.\n"
        "2. **b** — `w`: end\n\nAfter `r`.\n\n## Next\n\n1. **c** — `v`: no layer\n"
    )
    assert documented_layers(sample) == [("a", ["vime_core", "vime_core.x.y"]), ("b", ["vime_core.w"])]


def cycle_report(graph: dict[str, dict[str, list[str]]]) -> list[str]:
    """One message per cycle of ``graph``: its modules and the import lines that close it."""
    problems = []
    for comp in find_cycles(graph):
        edges = [
            f"    {a} -> {b}  ({', '.join(dict.fromkeys(graph[a][b]))})"
            for a in comp
            for b in sorted(graph[a])
            if b in set(comp)
        ]
        problems.append(f"import cycle among {', '.join(comp)}:\n" + "\n".join(edges))
    return problems


def test_no_import_cycles():
    graph = import_graph()
    assert "vime_core.rollout.runner" in graph and len(graph) > 100  # the walk found the tree
    problems = cycle_report(graph)
    assert not problems, "\n".join(problems)


def test_no_cycle_even_through_type_checking_imports():
    """Not even an ``if TYPE_CHECKING:`` import closes a circle, in vime_core or a plugin: a lower module names what
    it uses of a higher one through a small protocol (``rollout.fleet_view``'s ``EngineHealth``,
    ``sandbox.reaper``'s ``SandboxBackend`` and ``LiveSandbox``, ``agent.apis.common``'s ``TurnServer``,
    ``trainer.megatron_view``'s ``MegatronPolicy``), never the concrete class. Inside the rollout package nothing
    imports the rollout manager, which only composes the group producer and the engine fleet."""
    graph = import_graph(type_checking=True)
    assert "vime_core.rollout.runner" in graph and len(graph) > 100
    problems = cycle_report(graph)
    assert not problems, "\n".join(problems)
    importers = sorted(m for m, ts in graph.items() if "vime_core.rollout.manager" in ts)
    assert [m for m in importers if m.startswith("vime_core.rollout.")] == []


def test_every_vime_core_module_has_a_layer():
    missing = sorted(m for m in _modules() if m.split(".")[0] == "vime_core" and layer_of(m) is None)
    assert not missing, f"modules in no layer of LAYERS (add them where they belong): {missing}"


def test_no_module_imports_a_higher_layer():
    """Not even an ``if TYPE_CHECKING:`` import runs back up a layer."""
    graph = import_graph(type_checking=True)
    problems = []
    for module, targets in sorted(graph.items()):
        if module.split(".")[0] != "vime_core":
            continue
        mine = layer_of(module)
        for target, where in sorted(targets.items()):
            theirs = layer_of(target)
            if mine is not None and theirs is not None and theirs > mine:
                problems.append(
                    f"{module} (layer {LAYERS[mine][0]!r}) imports {target} (layer {LAYERS[theirs][0]!r}) "
                    f"at {', '.join(where)}"
                )
    assert not problems, "lower layer imports a higher one:\n" + "\n".join(problems)


def test_vime_core_imports_no_plugin():
    graph = import_graph()
    core = {m: ts for m, ts in graph.items() if m.split(".")[0] == "vime_core"}
    bad = sorted((m, t) for m, ts in core.items() for t in ts if t.split(".")[0] != "vime_core")
    assert not bad, f"vime_core imports plugin packages: {bad}"
