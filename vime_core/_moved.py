"""The import paths of vime 0.1 whose modules moved when vime_core's folders became floors (issue 36): importing
an old path still works, with one ``DeprecationWarning`` naming the new path; the old name is the same module object
as the new one. The old paths go in vime 0.2. :func:`install` (run by ``vime_core/__init__``) puts the finder
after the path finder on ``sys.meta_path``, so it answers only for names no module has any more.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

REMOVED_IN = "0.2"
#: old module -> new module
MOVED: dict[str, str] = {
    "vime_core.argument_checks": "vime_core.cli.checks",
    "vime_core.argument_errors": "vime_core.config.errors",
    "vime_core.arguments": "vime_core.cli.arguments",
    "vime_core.checkpoint": "vime_core.run.checkpoint",
    "vime_core.config_file": "vime_core.config.yaml_file",
    "vime_core.context": "vime_core.config.context",
    "vime_core.evaluation": "vime_core.rollout.evaluation",
    "vime_core.hookspecs": "vime_core.plugins.hookspecs",
    "vime_core.loop": "vime_core.run.loop",
    "vime_core.lora.options": "vime_core.config.lora",
    "vime_core.metrics": "vime_core.run.metrics",
    "vime_core.net": "vime_core.cluster.net",
    "vime_core.orchestration": "vime_core.cluster.orchestration",
    "vime_core.passthrough": "vime_core.config.passthrough",
    "vime_core.placement": "vime_core.cluster.placement",
    "vime_core.progress": "vime_core.run.progress",
    "vime_core.protocols": "vime_core.plugins.protocols",
    "vime_core.registry": "vime_core.plugins.registry",
    "vime_core.report": "vime_core.run.report",
    "vime_core.rollout.answers": "vime_core.engines.answers",
    "vime_core.rollout.client": "vime_core.engines.client",
    "vime_core.rollout.coding_agent": "vime_core.rollout.generators.coding_agent",
    "vime_core.rollout.engine": "vime_core.engines.engine",
    "vime_core.rollout.engine_actor": "vime_core.engines.engine_actor",
    "vime_core.rollout.engine_api": "vime_core.engines.engine_api",
    "vime_core.rollout.external_engine": "vime_core.engines.external_engine",
    "vime_core.rollout.fleet": "vime_core.engines.fleet",
    "vime_core.rollout.generate": "vime_core.rollout.generators.default",
    "vime_core.rollout.health": "vime_core.engines.health",
    "vime_core.rollout.image_input": "vime_core.engines.image_input",
    "vime_core.rollout.lora_serving": "vime_core.engines.lora_serving",
    "vime_core.rollout.lora_stash": "vime_core.engines.lora_stash",
    "vime_core.rollout.multi_turn": "vime_core.rollout.generators.multi_turn",
    "vime_core.rollout.process": "vime_core.engines.process",
    "vime_core.rollout.process_guard": "vime_core.engines.process_guard",
    "vime_core.rollout.prompt_checks": "vime_core.data.prompt_checks",
    "vime_core.rollout.router": "vime_core.engines.router",
    "vime_core.rollout.teacher": "vime_core.engines.teacher",
    "vime_core.rollout.tools": "vime_core.rollout.generators.tools",
    "vime_core.rollout.weight_recovery": "vime_core.engines.weight_recovery",
    "vime_core.rollout.weight_update": "vime_core.engines.weight_update",
    "vime_core.rollout.worker_extension": "vime_core.engines.worker_extension",
    "vime_core.run_checks": "vime_core.run.preflight",
    "vime_core.run_dir": "vime_core.run.output_dir",
    "vime_core.run_signals": "vime_core.run.signals",
    "vime_core.run_summary": "vime_core.run.summary",
}
#: old packages that no longer exist: importing one gives an empty package, so that its moved modules import
GONE: frozenset[str] = frozenset({"vime_core.lora"})


class MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old path of :data:`MOVED` and loads it as its new module (see the module docstring)."""

    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname in MOVED:
            return importlib.machinery.ModuleSpec(fullname, self)
        if fullname in GONE:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        if spec.name in GONE:
            return None  # a plain empty package
        new = MOVED[spec.name]
        warnings.warn(
            f"{spec.name} moved to {new}; the old import path goes in vime {REMOVED_IN}",
            DeprecationWarning,
            stacklevel=2,  # the import statement (warnings skips importlib's own frames)
        )
        return importlib.import_module(new)

    def exec_module(self, module: ModuleType) -> None:
        if module.__name__ in GONE:
            module.__path__ = []  # type: ignore[attr-defined]


def install() -> None:
    """Put the finder on ``sys.meta_path`` (once), right after the path finder: a module that exists is always
    found first (an editable install's finder, which may still map an old name to a stale file, comes after)."""
    if any(isinstance(f, MovedFinder) for f in sys.meta_path):
        return
    at = next((i + 1 for i, f in enumerate(sys.meta_path) if f is importlib.machinery.PathFinder), len(sys.meta_path))
    sys.meta_path.insert(at, MovedFinder())
