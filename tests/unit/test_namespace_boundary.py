"""The argparse Namespace stops at the CLI (issue 25): below the command line and the config package no module
imports ``argparse`` or names ``Namespace``, except the modules :data:`ALLOWED` lists, each with why."""

import ast
from pathlib import Path

import pytest

import vime_core

pytestmark = pytest.mark.unit

ROOT = Path(vime_core.__file__).parent

#: module (relative to vime_core/) → why it may use argparse / a Namespace
ALLOWED: dict[str, str] = {
    "cli/commands.py": "the command line",
    "cli/arguments.py": "the vime run parser",
    "cli/checks.py": "the parser's cross-flag derivations (derive_flags sets Namespace attributes)",
    "config/yaml_file.py": "YAML → argv for the parser",
    "config/passthrough.py": "splits --vllm-*/--router-* argv with vLLM's and the router's own parsers",
    "config/flags.py": "flag declarations (argparse options) and from_args, the one Namespace → tree step",
    "config/rollout.py": "flag declarations name argparse.BooleanOptionalAction",
    "config/run.py": "RunConfig.from_args",
    "config/training.py": "flag declarations name argparse.BooleanOptionalAction",
    "config/context.py": "legacy_namespace: the deprecated (args, ...) plugin path, built from the typed tree",
    "plugins/hookspecs.py": "the deprecated args parameter of the observation hooks and vime_add_arguments",
    "testing/contracts/arguments.py": "the contract kit parses plugin flags",
    "testing/sandbox_leak.py": "a test helper's own command line",
    "testing/trainer_args.py": "the deprecated Namespace helper of trainer tests",
}


def _uses(path: Path) -> list[str]:
    """``import argparse`` / ``from argparse import ...`` and ``Namespace`` names or attributes in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import) and any(a.name == "argparse" for a in node.names):
            found.append(f"{node.lineno}: import argparse")
        elif isinstance(node, ast.ImportFrom) and node.module == "argparse":
            found.append(f"{node.lineno}: from argparse import ...")
        elif (isinstance(node, ast.Name) and node.id == "Namespace") or (
            isinstance(node, ast.Attribute) and node.attr == "Namespace"
        ):
            found.append(f"{node.lineno}: Namespace")
    return found


def test_no_module_below_the_cli_uses_argparse_or_a_namespace():
    offenders = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel not in ALLOWED:
            offenders += [f"vime_core/{rel}:{use}" for use in _uses(path)]
    assert not offenders, "argparse / Namespace below the CLI:\n" + "\n".join(offenders)


def test_the_allow_list_is_current():
    stale = sorted(rel for rel in ALLOWED if not (ROOT / rel).exists() or not _uses(ROOT / rel))
    assert not stale, f"ALLOWED lists modules that no longer use argparse or a Namespace: {stale}"


def test_the_scan_sees_each_form(tmp_path):
    path = tmp_path / "probe.py"
    path.write_text(
        "import argparse\nfrom argparse import Namespace\nx = argparse.Namespace()\ndef f(a: Namespace): ...\n"
    )
    assert [u.split(":")[0] for u in _uses(path)] == ["1", "2", "3", "4"]
