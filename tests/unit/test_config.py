"""The typed run configuration (vime_core/config/): every flag is declared once, as a section field; every field
is a flag, a ref to one or a pass-through; defaults come from the declarations alone, and no module reads the
Namespace for framework flags directly."""

import argparse
import ast
import dataclasses
import pickle
from pathlib import Path

import pytest

import vime_core
from vime_core.cli.arguments import ArgumentError, build_parser, complete_args, default_args, parse_run_args
from vime_core.config import (
    PASSTHROUGH_DESTS,
    SECTIONS,
    AlgorithmConfig,
    ConfigError,
    PluginConfig,
    RolloutConfig,
    RunConfig,
    SandboxConfig,
    Section,
    add_flags,
    check_tree,
    declared_flags,
    flag,
    ref,
)

pytestmark = pytest.mark.unit

BASE = ["--model", "m", "--prompt-data", "d.jsonl"]
# Flags only the command line itself reads (arguments.py / cli.py): the config file, help, and the opt-out checked
# once at parse time.
CLI_ONLY = {"help", "config"}
# The modules that may read the Namespace: the parser and its cross-flag checks, the config builder and the command
# line.
NAMESPACE_READERS = {
    "vime_core/cli/arguments.py",
    "vime_core/cli/checks.py",
    "vime_core/config/flags.py",
    "vime_core/config/run.py",
    "vime_core/cli/commands.py",
}


def _framework_dests() -> set[str]:
    """The dests of vime_core's own flags: the parser without plugins (generated from the config sections)."""
    return {a.dest for a in build_parser(add_plugin_arguments=False)._actions} | set(PASSTHROUGH_DESTS)


def _section_fields() -> dict[str, set[str]]:
    return {name: {f.name for f in dataclasses.fields(cls)} for name, cls in SECTIONS.items()}


def test_every_field_is_a_flag():
    dests = _framework_dests()
    for name, fields in _section_fields().items():
        assert fields <= dests, f"{name}: fields that are no flag: {sorted(fields - dests)}"


def test_every_framework_flag_is_in_a_section():
    covered = set().union(*_section_fields().values())
    missing = _framework_dests() - covered - CLI_ONLY
    assert not missing, f"framework flags in no config section: {sorted(missing)}"


def test_run_config_from_parsed_flags_is_typed_and_frozen():
    args = parse_run_args(BASE + ["--rollout-batch-size", "4", "--kl-coef", "0.1", "--advantage-estimator", "ppo"])
    cfg = RunConfig.from_args(args)
    assert [f.name for f in dataclasses.fields(RunConfig)] == [*SECTIONS, "plugins"]
    assert (cfg.rollout.rollout_batch_size, cfg.trainer.rollout_batch_size) == (4, 4)
    assert (cfg.algorithm.kl_coef, cfg.algorithm.advantage_estimator) == (0.1, "ppo")
    assert cfg.weight_sync.update_weight_disk_dir == Path("outputs/run/weights")  # set by parse_run_args
    assert cfg.engine.vllm_args == [] and cfg.engine.router_args == []
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.rollout.rollout_batch_size = 8  # type: ignore[misc]
    assert not hasattr(cfg.rollout, "__dict__")  # slots: no stray attribute can be added
    assert pickle.loads(pickle.dumps(cfg)) == cfg  # crosses Ray actor boundaries


def test_defaults_come_from_the_flag_definitions():
    parser = build_parser()
    defaults = {a.dest: a.default for a in parser._actions if a.option_strings and a.dest not in CLI_ONLY}
    args = default_args()
    assert {k: getattr(args, k) for k in defaults} == defaults
    assert default_args(gamma=0.5).gamma == 0.5
    cfg = AlgorithmConfig.from_args(args)
    assert (cfg.advantage_estimator, cfg.eps_clip, cfg.kl_loss_type, cfg.tis_clip) == ("grpo", 0.2, "k1", 2.0)
    with pytest.raises(ArgumentError, match="default_args: gama is not a vime run flag"):
        default_args(gama=0.5)


def test_a_partial_namespace_is_refused_naming_the_flags():
    with pytest.raises(ConfigError, match=r"SandboxConfig needs the flags .*--sandbox-network.*default_args"):
        SandboxConfig.from_args(argparse.Namespace(sandbox="local"))
    # complete_args keeps what is given and fills the rest (a plugin's own attributes included)
    full = complete_args(argparse.Namespace(sandbox="docker", my_plugin_flag=3))
    assert (SandboxConfig.from_args(full).sandbox, full.my_plugin_flag, full.sandbox_cpus) == ("docker", 3, 1.0)
    assert RolloutConfig.from_args(full).rollout_batch_size == 8


def _namespace_reads(tree: ast.AST, dests: set[str]) -> list[tuple[int, str]]:
    """``args.<flag>``, ``self.args.<flag>`` (any ``X.args`` / ``X._args``), ``getattr(args, "<flag>", ...)`` and
    calls of a function named ``opt`` / ``_opt``, with their line numbers."""

    def is_namespace(node: ast.AST) -> bool:
        return (isinstance(node, ast.Name) and node.id in ("args", "_args")) or (
            isinstance(node, ast.Attribute) and node.attr in ("args", "_args")
        )

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in dests and is_namespace(node.value):
            found.append((node.lineno, f"{ast.unparse(node)}"))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id in ("opt", "_opt"):
                found.append((node.lineno, ast.unparse(node)))
            elif (
                node.func.id == "getattr"
                and len(node.args) >= 2
                and is_namespace(node.args[0])
                and isinstance(node.args[1], ast.Constant)
                and node.args[1].value in dests
            ):
                found.append((node.lineno, ast.unparse(node)))
    return found


def test_no_module_reads_framework_flags_from_the_namespace():
    """Outside the parser, the config builder and the CLI, framework flags are read from a config section
    (``XConfig.from_args(args)``), never as ``args.<flag>`` / ``getattr(args, "<flag>")`` / ``opt(args, ...)``.
    Plugins still receive ``args`` and read their own prefixed flags from it
    (:func:`test_no_plugin_reads_framework_flags_from_the_namespace` scans them)."""
    dests = _framework_dests()
    root = Path(vime_core.__file__).parent
    offenders = []
    for path in sorted(root.rglob("*.py")):
        rel = f"vime_core/{path.relative_to(root).as_posix()}"
        if rel in NAMESPACE_READERS:
            continue
        for line, what in _namespace_reads(ast.parse(path.read_text(), str(path)), dests):
            offenders.append(f"{rel}:{line}: {what}")
    assert not offenders, "framework flags read from the Namespace:\n" + "\n".join(offenders)


def _plugin_sources() -> list[Path]:
    """Every module of the plugin packages (``plugins/*/src``; the template, a placeholder, left out)."""
    root = Path(vime_core.__file__).parent.parent / "plugins"
    return sorted(p for src in root.glob("[!_]*/src") for p in src.rglob("*.py"))


def test_no_plugin_reads_framework_flags_from_the_namespace():
    """Plugins read the framework's flags through a config section (``SandboxConfig.from_args(args).sandbox``),
    like vime_core; their own prefixed flags through their :class:`~vime_core.config.PluginConfig` class (defaults from
    the declaration), never with an inline default (``getattr(args, "<own flag>", default)``)."""
    dests = _framework_dests()
    plugin_dests = {a.dest for a in build_parser()._actions} - dests
    sources = _plugin_sources()
    assert len(sources) > 10, "the plugins' sources were not found"
    offenders = []
    for path in sources:
        tree = ast.parse(path.read_text(), str(path))
        rel = path.relative_to(Path(vime_core.__file__).parent.parent).as_posix()
        for line, what in _namespace_reads(tree, dests):
            offenders.append(f"{rel}:{line}: framework flag read from the Namespace: {what}")
        for line, what in _inline_defaults(tree, plugin_dests):
            offenders.append(f"{rel}:{line}: own flag read with an inline default (use its PluginConfig): {what}")
    assert not offenders, "\n".join(offenders)


def _inline_defaults(tree: ast.AST, dests: set[str]) -> list[tuple[int, str]]:
    """``getattr(<anything>, "<flag>", <default>)`` calls: a flag's default repeated where it is read."""
    return [
        (node.lineno, ast.unparse(node))
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "getattr"
        and len(node.args) == 3
        and isinstance(node.args[1], ast.Constant)
        and node.args[1].value in dests
    ]


def test_the_scan_finds_each_kind_of_read():
    src = (
        "def f(args, self):\n"
        "    a = args.rollout_batch_size\n"
        "    b = self.args.lr\n"
        "    c = getattr(args, 'gamma', 1.0)\n"
        "    d = opt(args, 'kl_coef')\n"
        "    e = args.strip()\n"  # not a flag: a local string called args
        "    f = run.args.get('loop')\n"  # a dict attribute, not a flag read
    )
    got = _namespace_reads(ast.parse(src), {"rollout_batch_size", "lr", "gamma", "kl_coef", "loop"})
    assert sorted(line for line, _ in got) == [2, 3, 4, 5]
    assert [line for line, _ in _inline_defaults(ast.parse(src), {"gamma", "lr"})] == [4]


def test_each_flag_is_declared_once_and_refs_follow_it():
    """The tree's check: one declaration per flag; a ref names a declared flag of the same type."""
    declaring = {}
    for cls in SECTIONS.values():
        for f in declared_flags(cls):
            assert f.name not in declaring, f"{f.name} declared by {declaring[f.name]} and {cls.__name__}"
            declaring[f.name] = cls.__name__
    assert len(declaring) == len(_framework_dests() - CLI_ONLY - set(PASSTHROUGH_DESTS)) == 232
    # the parser's flag for a declared field is that field: same default, same help
    parser = build_parser(add_plugin_arguments=False)
    action = next(a for a in parser._actions if a.dest == "rollout_batch_size")
    field = next(f for f in dataclasses.fields(RolloutConfig) if f.name == "rollout_batch_size")
    assert (action.default, action.help, action.type) == (field.default, field.metadata["vime_flag"]["help"], int)
    assert RolloutConfig.__dataclass_fields__["seed"].metadata == {"vime_ref": True}


def _section(name: str, **annotated_fields):
    cls = type(name, (Section,), {"__annotations__": {k: t for k, (t, _) in annotated_fields.items()}, "TITLE": name})
    for k, (_, value) in annotated_fields.items():
        setattr(cls, k, value)
    return dataclasses.dataclass(frozen=True, kw_only=True)(cls)


def test_a_drifted_tree_is_refused_naming_the_field():
    a = _section("A", lr=("float", flag(type=float, default=1.0, help="learning rate")))
    twice = _section("B", lr=("float", flag(type=float, default=2.0, help="learning rate again")))
    with pytest.raises(ConfigError, match="flag --lr declared twice: A and B"):
        check_tree([a, twice])
    dangling = _section("C", gamma=("float", ref()))
    with pytest.raises(ConfigError, match=r"C.gamma is a ref\(\) but no section declares --gamma"):
        check_tree([a, dangling])
    wrong_type = _section("D", lr=("int", ref()))
    with pytest.raises(ConfigError, match="D.lr: type int differs from the declaring A's float"):
        check_tree([a, wrong_type])
    bare = _section("E", x=("int", dataclasses.field(default=0)))
    with pytest.raises(ConfigError, match=r"E.x: declare it with flag\(\), ref\(\) or passthrough\(\)"):
        check_tree([bare])
    check_tree([a, _section("F", lr=("float", ref()))])  # a ref of the right type is fine


@dataclasses.dataclass(frozen=True, kw_only=True)
class _MyFlags(PluginConfig):
    PREFIX = "my-plugin"
    TITLE = "my-plugin"
    my_plugin_timeout: float = flag(type=float, default=120.0, help="seconds")
    my_plugin_tags: list[str] = flag(action="append", default=[], help="repeatable")
    my_plugin_fast: bool = flag(action="store_true", help="go fast")


def test_a_plugin_reads_its_flags_typed_with_declared_defaults_for_what_args_lacks():
    got = _MyFlags.from_args(argparse.Namespace(my_plugin_timeout=5.0, sandbox="docker"))
    assert got == _MyFlags(my_plugin_timeout=5.0, my_plugin_tags=[], my_plugin_fast=False)
    assert _MyFlags.from_args(None) == _MyFlags()
    # a list default is copied per instance: appending to one does not change the declaration's
    _MyFlags.from_args(None).my_plugin_tags.append("x")
    assert _MyFlags().my_plugin_tags == []
    parser = argparse.ArgumentParser()
    add_flags(parser, _MyFlags)
    args = parser.parse_args(["--my-plugin-fast", "--my-plugin-tags", "a"])
    assert _MyFlags.from_args(args) == _MyFlags(my_plugin_timeout=120.0, my_plugin_tags=["a"], my_plugin_fast=True)


def test_flat_flag_reads_on_the_run_config_still_work_with_a_warning():
    """A class plugin written against ``args`` (``self.args.lr``) keeps working for one minor version."""
    import copy

    cfg = RunConfig.from_args(default_args(model="m", lr=3e-4), (_MyFlags,))
    with pytest.warns(DeprecationWarning, match=r"read config\.trainer\.lr"):
        assert cfg.lr == 3e-4
    with pytest.warns(DeprecationWarning, match=r"config\.plugin\(_MyFlags\)\.my_plugin_timeout"):
        assert cfg.my_plugin_timeout == 120.0
    with pytest.raises(AttributeError, match="no section or flag 'lrr'"):
        cfg.lrr  # noqa: B018
    assert not hasattr(cfg, "__deepcopy_hook__")
    assert pickle.loads(pickle.dumps(cfg)) == cfg == copy.deepcopy(cfg)
