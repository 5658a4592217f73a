"""``vime run`` arguments: framework flags, ``--vllm-*`` / ``--router-*`` pass-through, YAML config files.

:func:`build_parser` is generated from the config sections' flag declarations (:mod:`vime_core.config`) and the
plugins' registered flag classes (``vime_register_flags``; the
``megatron`` backend adds Megatron-LM's names); ``--vllm-<arg>`` and ``--router-<arg>`` are forwarded to every vLLM
engine and to the router, except the flags vime owns (:data:`VIME_OWNED_VLLM_FLAGS`). :func:`parse_run_args` merges
``--config FILE.yaml`` (the command line wins) and runs the cross-flag checks; :func:`default_args` builds a
Namespace without a command line. The namespaces: docs/architecture.md, "Flags".
"""

from __future__ import annotations

import argparse
import copy
import difflib
import functools
import sys
from pathlib import Path
from typing import Any, NoReturn

from vime_core.cli.checks import (
    OFF_POLICY_CORRECTIONS,
    OFF_POLICY_LOOPS,
    check_off_policy_correction,
    check_run_args,
    parse_cpu_list,
)
from vime_core.config import PASSTHROUGH_DESTS, SECTIONS, RunConfig, add_flags
from vime_core.config.errors import ArgumentError
from vime_core.config.passthrough import PassthroughError, split_passthrough
from vime_core.config.sampling import sampling_params as rollout_sampling_params  # its old name here
from vime_core.config.yaml_file import config_to_argv
from vime_core.plugins.manager import get_plugins

__all__ = [
    "OFF_POLICY_CORRECTIONS",
    "OFF_POLICY_LOOPS",
    "VIME_OWNED_ROUTER_FLAGS",
    "VIME_OWNED_VLLM_FLAGS",
    "ArgumentError",
    "HelpFormatter",
    "build_parser",
    "build_run_config",
    "check_off_policy_correction",
    "check_run_args",
    "complete_args",
    "config_to_argv",
    "default_args",
    "flags_without_help",
    "parse_cpu_list",
    "parse_run_args",
    "rollout_sampling_params",
]

# vLLM flags that vime sets itself, and the vime flag that controls each.
VIME_OWNED_VLLM_FLAGS = {
    "model": "--model",
    "tokenizer": "--model",
    "host": "(vime binds 127.0.0.1)",
    "port": "(vime picks free ports)",
    "served-model-name": "(vime names the policy)",
    "worker-extension-cls": "(vime's worker extension is required for weight sync)",
    "tensor-parallel-size": "--rollout-num-gpus-per-engine",
    "seed": "--seed",
}
# Router flags vime sets itself.
VIME_OWNED_ROUTER_FLAGS = {
    "host": "(vime binds 127.0.0.1)",
    "port": "(vime picks a free port)",
    "worker-urls": "--rollout-num-engines (or --vllm-router-ip/--vllm-router-port for a running router)",
    "prometheus-host": "(vime binds 127.0.0.1)",
}


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` that appends ``(default: X)`` to every flag whose help does not already say its default (in any
    case: ``Default: --rollout-temperature``), and the available names to a flag that names a plugin
    (:func:`plugin_choices`)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" not in text.lower():
            text = super()._get_help_string(action) or ""
        names = plugin_choices(action.dest)
        return f"{text}; available: {', '.join(names)}" if names else text


#: flags (by dest) whose value names a plugin: the registry kind it is resolved in
PLUGIN_NAME_FLAGS = {
    "generate": "generate",
    "reward": "reward",
    "eval_reward": "reward",
    "group_reward": "group_reward",
    "advantage_estimator": "advantage",
    "dynamic_sampling_filter": "dynamic_filter",
    "trainer": "trainer",
    "weight_sync": "weight_sync",
    "sandbox": "sandbox",
    "agent": "agent",
}


def plugin_choices(dest: str) -> list[str]:
    """The names a plugin-naming flag (:data:`PLUGIN_NAME_FLAGS`, or a tool-call parser flag) accepts from the
    installed plugins (a dotted ``pkg.mod:obj`` path is accepted too); ``[]`` for any other flag."""
    if dest in ("multi_turn_tool_parser", "agent_tool_parser"):
        from vime_core.agent.tool_parsers import available_tool_parsers

        return list(available_tool_parsers())
    kind = PLUGIN_NAME_FLAGS.get(dest)
    return get_plugins().registries[kind].names() if kind else []


class RunArgumentParser(argparse.ArgumentParser):
    """The ``vime run`` / ``vime eval`` parser: a parse error (a missing required flag, a value of the wrong type,
    not a choice) is an :class:`ArgumentError` — one ``vime: error:`` line from the ``vime`` command, without
    argparse's usage block of every flag."""

    def error(self, message: str) -> NoReturn:
        raise ArgumentError(f"{message} (`{self.prog} --help` lists the flags)")


def flags_without_help(parser: argparse.ArgumentParser) -> list[str]:
    """The option strings (first of each flag) of ``parser``'s flags whose help is missing or blank."""
    return [
        a.option_strings[0]
        for a in parser._actions
        if a.option_strings and a.help != argparse.SUPPRESS and not (a.help or "").strip()
    ]


#: what ``vime eval`` has no use for (it trains nothing): the sections of training, and single flags of the others
EVAL_SKIPPED_SECTIONS = ("algorithm", "trainer", "megatron", "weight_sync", "lora", "cluster")
EVAL_SKIPPED_FLAGS = frozenset(
    {
        "prompt_data",
        "rollout_shuffle",
        "rollout_max_prompt_len",
        "filter_overlong_prompts",
        "num_rollout",
        "rollout_batch_size",
        "n_samples_per_prompt",
        "loop",
        "max_staleness",
        "stale_policy",
        "rollout_inflight_groups",
        "over_sampling_batch_size",
        "dynamic_sampling_max_rounds",
        "overlong_filter",
        "overlong_buffer_len",
        "overlong_penalty_factor",
        "partial_rollout",
        "mask_offpolicy_in_partial_rollout",
        "group_reward",
        "eval_interval",
        "skip_eval_before_train",
        "failure_exit_timeout",
        "save_interval",
        "save_interval_minutes",
        "keep_checkpoints",
        "resume",
        "save_hf",
        "report",
        "debug_rollout_only",
        "debug_train_only",
        "save_debug_rollout_data",
        "load_debug_rollout_data",
    }
)
#: ``vime eval``'s output directory unless ``--output-dir`` is on its command line
EVAL_OUTPUT_DIR = Path("outputs/eval")


def build_parser(add_plugin_arguments: bool = True, command: str = "run") -> argparse.ArgumentParser:
    """The ``vime run`` parser: one group per config section (:data:`vime_core.config.SECTIONS`), one per plugin flag
    class, then the flags of deprecated ``vime_add_arguments`` hooks.

    :param command: ``"eval"``: the flags ``vime eval`` reads (for its ``--help`` and to refuse a training flag on
        its command line): without :data:`EVAL_SKIPPED_SECTIONS` and :data:`EVAL_SKIPPED_FLAGS`, ``--output-dir``
        defaulting to :data:`EVAL_OUTPUT_DIR`.
    """
    if command == "eval":
        p = RunArgumentParser(
            prog="vime eval",
            description="Evaluate a model (a known name, a HF directory, a run's final_hf/) on --eval-prompt-data "
            "sets without training: the engines and router start, every set is generated and scored once, the "
            "metrics go to OUTPUT_DIR/metrics.jsonl and summary.json. A `vime run` config is accepted (--config): "
            "its training keys are ignored, its output_dir too.",
            allow_abbrev=False,
            formatter_class=HelpFormatter,
        )
    else:
        p = RunArgumentParser(
            prog="vime run", description="Run RL post-training.", allow_abbrev=False, formatter_class=HelpFormatter
        )
    p.add_argument(
        "--config",
        type=Path,
        help="YAML file of flags: keys are flag names with dashes or underscores; the command line wins",
    )

    skip = EVAL_SKIPPED_FLAGS if command == "eval" else frozenset()
    for key, section in SECTIONS.items():
        if command == "eval" and key in EVAL_SKIPPED_SECTIONS:
            continue
        add_flags(p.add_argument_group(section.TITLE, section.DESCRIPTION), section, skip=skip)
    if command == "eval":
        p.set_defaults(output_dir=EVAL_OUTPUT_DIR)
        for a in p._actions:
            if a.dest == "output_dir":
                a.help = "where the evaluation's metrics.jsonl, summary.json and logs/ go (never a --config's)"
            elif a.dest == "model":
                a.required = False  # here or in --config; parse_run_args says so when neither has it
                a.help += " to evaluate, e.g. a run's final_hf/ (required: here or in --config; no default)"

    if add_plugin_arguments:
        plugins = get_plugins()
        for cls in plugins.flag_classes():
            add_flags(p.add_argument_group(cls.TITLE), cls)
        plugins.pm.hook.vime_add_arguments(parser=p)  # deprecated: plugins that add flags by hand
    return p


def build_run_config(args: argparse.Namespace) -> RunConfig:
    """The typed config of a run from parsed arguments: every section, and the flags of every installed plugin
    that registers a :class:`~vime_core.config.PluginConfig` (``vime_register_flags``).

    :raises ConfigError: when ``args`` lacks flags (build it with :func:`parse_run_args` or :func:`default_args`).
    """
    return RunConfig.from_args(args, tuple(get_plugins().flag_classes()))


@functools.cache
def _parser_defaults() -> dict[str, Any]:
    parser = build_parser()
    defaults = {a.dest: a.default for a in parser._actions if a.option_strings and a.default is not argparse.SUPPRESS}
    defaults.pop("config", None)
    return defaults | {dest: [] for dest in PASSTHROUGH_DESTS}


def default_args(**overrides: Any) -> argparse.Namespace:
    """A ``vime run`` Namespace without a command line: every flag (framework and installed plugins) at its
    parser default — the one place defaults are defined — then ``overrides`` (flag dests, e.g.
    ``default_args(model="m", advantage_estimator="ppo")``). No combination check runs (that is
    :func:`parse_run_args`'s job), so tests can set exactly the flags they exercise.

    :raises ArgumentError: naming an override that is not a flag.
    """
    defaults = _parser_defaults()
    unknown = sorted(set(overrides) - set(defaults))
    if unknown:
        raise ArgumentError(f"default_args: {', '.join(unknown)} is not a vime run flag; see `vime args`")
    return argparse.Namespace(**(copy.deepcopy(defaults) | overrides))


def complete_args(args: argparse.Namespace) -> argparse.Namespace:
    """A copy of ``args`` with every flag it lacks at its parser default (its own attributes, known flags or not,
    are kept): what the contract kit gives a plugin whose test fixture supplies only the flags it reads."""
    return argparse.Namespace(**(copy.deepcopy(_parser_defaults()) | vars(args)))


def parse_run_args(argv: list[str] | None = None, command: str = "run") -> argparse.Namespace:
    """Parse ``vime run`` argv (config file first, command line wins) and check the combination.

    :param command: ``"run"``, or ``"eval"`` for ``vime eval`` (same flags; ``--prompt-data`` is not needed and
        ``--eval-prompt-data`` is; the output directory is ``--output-dir`` from the command line, else
        ``outputs/eval`` — never a config file's, so evaluating a run's checkpoint does not write into the run).
    :raises ArgumentError: unknown flag (with a "did you mean"), a vime-owned pass-through flag, bad values.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    cli_argv = list(argv)
    if command == "eval" and any(a in ("-h", "--help") for a in argv):
        build_parser(command="eval").parse_args(["--help"])  # prints eval's flags and exits
    parser = build_parser()
    parser.prog = f"vime {command}"
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", type=Path)
    known, _ = pre.parse_known_args(argv)
    if known.config:
        argv = config_to_argv(known.config, parser) + argv
    args, rest = parser.parse_known_args(argv)
    try:
        args.vllm_args, args.router_args, unknown = split_passthrough(
            rest, VIME_OWNED_VLLM_FLAGS, VIME_OWNED_ROUTER_FLAGS
        )
    except PassthroughError as e:
        raise ArgumentError(str(e)) from None
    if unknown:
        flags = [o for a in parser._actions for o in a.option_strings]
        bad = unknown[0]
        close = difflib.get_close_matches(bad.split("=")[0], flags, n=1)
        hint = f"; did you mean {close[0]}?" if close else "; see `vime args` for every flag"
        raise ArgumentError(f"unknown flag {bad}{hint}")
    if command == "eval":
        _refuse_training_flags(cli_argv, parser)
        if "--output-dir" not in cli_argv and not any(a.startswith("--output-dir=") for a in cli_argv):
            args.output_dir = EVAL_OUTPUT_DIR  # never a config's training output dir
        if not args.eval_prompt_data:
            raise ArgumentError("vime eval needs --eval-prompt-data NAME PATH [NAME PATH ...]")
        args.prompt_data = None  # evaluation only: no training data is read (a config's prompt_data is ignored)
        args.debug_rollout_only = True  # no trainer
    check_run_args(args, command)
    return args


def early_trainer_and_model(argv: list[str]) -> tuple[str, str] | None:
    """``(--trainer, --model)`` read from the raw argv (the command line, else ``--config``'s YAML) without building
    the parser, so before the plugins (and torch) load; ``None`` when either is not given, the YAML cannot be read,
    or ``--debug-rollout-only`` says there is no trainer."""
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--config", type=Path)
    pre.add_argument("--model")
    pre.add_argument("--trainer")
    pre.add_argument("--debug-rollout-only", action="store_true", default=None)
    try:
        known, _ = pre.parse_known_args(argv)
    except SystemExit:  # e.g. a flag without its value: the full parser says so
        return None
    model, trainer, no_trainer = known.model, known.trainer, known.debug_rollout_only
    if known.config is not None:
        import yaml

        try:
            data = yaml.safe_load(known.config.read_text())
        except (OSError, yaml.YAMLError):
            return None
        if isinstance(data, dict):
            model = model if model is not None else data.get("model")
            trainer = trainer if trainer is not None else data.get("trainer")
            if no_trainer is None:
                no_trainer = data.get("debug_rollout_only", data.get("debug-rollout-only"))
    if isinstance(model, str) and isinstance(trainer, str) and not no_trainer:
        return trainer, model
    return None


def _refuse_training_flags(cli_argv: list[str], run_parser: argparse.ArgumentParser) -> None:
    """``vime eval`` with a flag of training on its command line (a ``--config`` may hold them: they are ignored).

    :raises ArgumentError: naming the first such flag.
    """
    eval_flags = build_parser(command="eval")._option_string_actions
    for token in cli_argv:
        name = token.split("=", 1)[0]
        if name.startswith("--") and name in run_parser._option_string_actions and name not in eval_flags:
            raise ArgumentError(
                f"{name} is a training flag: vime eval trains nothing (`vime eval --help` lists its flags)"
            )
