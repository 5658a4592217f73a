"""The up-front checks of ``vime run`` / ``vime eval`` that need more than the flags: every plugin name the run
will use resolved, and the ``--vllm-*`` values parsed by vLLM's own parser — all before anything is written or
started (docs/plugins.md, "Names are checked at start-up")."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

from vime_core.argument_errors import ArgumentError
from vime_core.config import RunConfig
from vime_core.passthrough import engine_python
from vime_core.plugins import Plugins


def plugin_names(cfg: RunConfig, *, train: bool = True) -> list[tuple[str, str]]:
    """``(kind, name)`` of every plugin the run uses (``train=False``: those of ``vime eval``)."""
    names = [("generate", cfg.rollout.generate), ("reward", cfg.eval.eval_reward or cfg.eval.reward)]
    if train:
        names += [
            ("reward", cfg.rollout.reward),
            ("advantage", cfg.algorithm.advantage_estimator),
            ("trainer", cfg.trainer.trainer),
            ("weight_sync", cfg.weight_sync.weight_sync),
        ]
        if cfg.rollout.group_reward:
            names.append(("group_reward", cfg.rollout.group_reward))
        if cfg.rollout.dynamic_sampling_filter:
            names.append(("dynamic_filter", cfg.rollout.dynamic_sampling_filter))
    names.append(("sandbox", cfg.sandbox.sandbox))
    if cfg.coding_agent.agent or cfg.rollout.generate == "coding_agent":
        if not cfg.coding_agent.agent:
            raise ArgumentError("--generate coding_agent needs --agent NAME (e.g. claude-code, codex; `vime plugins`)")
        names.append(("agent", cfg.coding_agent.agent))
    return names


def resolve_plugins(plugins: Plugins, cfg: RunConfig, *, train: bool = True) -> None:
    """Resolve every plugin name of :func:`plugin_names` and the tool-call parsers the generate function will use.

    :raises RegistryError: an unknown plugin name (the registry's message names the flag and what exists).
    :raises ArgumentError: an unknown tool-call parser.
    """
    for kind, name in plugin_names(cfg, train=train):
        plugins.resolve(kind, name)
    from vime_core.agent.tool_parsers import available_tool_parsers

    used = {"multi_turn": ("--multi-turn-tool-parser", cfg.multi_turn.multi_turn_tool_parser)}
    used["coding_agent"] = ("--agent-tool-parser", cfg.coding_agent.agent_tool_parser)
    if cfg.rollout.generate in used:
        flag, name = used[cfg.rollout.generate]
        if name not in available_tool_parsers() and ":" not in name:
            raise ArgumentError(f"{flag} {name!r}: no such tool-call parser; available: {available_tool_parsers()}")


#: run in the engine interpreter: parse the forwarded flags with vLLM's server parser and build a SamplingParams of
#: each sampling dict; print the first refusal (or none) as JSON
_PARSE_SCRIPT = r"""
import argparse, json, sys
from vllm.utils.argparse_utils import FlexibleArgumentParser
try:
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
except ImportError:
    from vllm.entrypoints.openai.cli_args import make_arg_parser
class Refused(Exception):
    pass
class Parser(FlexibleArgumentParser):
    def error(self, message):
        raise Refused(message)
args, sampling = json.loads(sys.argv[1]), json.loads(sys.argv[2])
error = None
try:
    if args:
        make_arg_parser(Parser()).parse_args(args)
except Refused as e:
    error = {"kind": "flags", "error": str(e)}
if error is None and sampling:
    from vllm import SamplingParams
    for where, params in sampling.items():
        try:
            SamplingParams(**params)
        except Exception as e:
            error = {"kind": "sampling", "where": where, "error": f"{type(e).__name__}: {e}"}
            break
print(json.dumps(error))
"""

#: the sampling fields every vLLM release takes and vime checks itself: a dict with only these needs no vLLM import
BASIC_SAMPLING_FIELDS = frozenset({"temperature", "top_p", "top_k", "max_tokens", "stop", "stop_token_ids"})


def engine_sampling(cfg: RunConfig) -> dict[str, dict]:
    """The sampling parameters the engines will get, by the flags that set them: training rollouts and each eval
    set (for :func:`check_vllm_values`)."""
    from vime_core.arguments import rollout_sampling_params
    from vime_core.evaluation import eval_sampling_params, parse_eval_prompt_data

    out = {"training rollouts (--rollout-*)": rollout_sampling_params(cfg.rollout)}
    for s in parse_eval_prompt_data(cfg.eval.eval_prompt_data):
        out[f"eval set {s.name} (--eval-*)"] = eval_sampling_params(cfg.eval, s.name)
    return out


def check_vllm_values(
    vllm_args: list[str], sampling: dict[str, dict] | None = None, python: str | None = None
) -> None:
    """Check what the engines will be given with the vLLM they run (a subprocess of
    :func:`~vime_core.passthrough.engine_python`: vLLM is imported there, not here): the ``--vllm-*`` flags (as
    forwarded: ``--max-model-len 512``) with its server parser, and each of ``sampling`` (``{where: params}``) as
    its ``SamplingParams``. Nothing beyond the basic sampling fields and no flag: returns at once.

    :raises ArgumentError: naming the ``--vllm-*`` flag and vLLM's reason, e.g. ``--vllm-max-model-len: invalid
        human_readable_int_or_auto value: 'banana'``, or the sampling flags and vLLM's reason.
    """
    sampling = {w: p for w, p in (sampling or {}).items() if set(p) - BASIC_SAMPLING_FIELDS}
    if not vllm_args and not sampling:
        return
    python = python or engine_python()
    proc = subprocess.run(
        [python, "-c", _PARSE_SCRIPT, json.dumps(list(vllm_args)), json.dumps(sampling)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise ArgumentError(f"--vllm-* / sampling flags: {python} could not run vLLM's checks ({tail})")
    error = json.loads(lines[-1])
    if error is None:
        return
    if error["kind"] == "sampling":
        raise ArgumentError(f"vLLM cannot honour the sampling parameters of {error['where']}: {error['error']}")
    # vLLM names its own flag (--max-model-len); the user typed --vllm-max-model-len
    raise ArgumentError("vLLM refuses " + re.sub(r"--(?!vllm-)([a-z0-9][a-z0-9-]*)", r"--vllm-\1", error["error"]))


def checked_model(model: str) -> Path:
    """:func:`~vime_core.models.resolve_model` of ``--model``, with its weights there (:func:`check_model_weights`).

    :raises ArgumentError: naming ``--model`` (unknown name, not a model directory, no weights).
    """
    from vime_core.models import resolve_model
    from vime_core.models.prepare import ModelPrepareError

    try:
        model_path = resolve_model(model)
    except (ValueError, ModelPrepareError) as e:
        raise ArgumentError(f"--model {model}: {e}") from None
    check_model_weights(model_path)
    return model_path


def check_model_weights(model_path: Path) -> None:
    """A local HF model directory needs its weights (``*.safetensors`` or ``*.bin``, sharded or not).

    :raises ArgumentError: naming the directory and what it holds instead.
    """
    p = Path(model_path)
    if not p.is_dir():
        return
    if any(p.glob("*.safetensors")) or any(p.glob("*.bin")):
        return
    held = ", ".join(sorted(f.name for f in p.iterdir())[:8]) or "nothing"
    raise ArgumentError(f"--model {p}: no weights there (*.safetensors or *.bin); it holds {held}")


def check_vlm_run(cfg: RunConfig, model_path: Path) -> None:
    """A vision-language ``--model`` with a trainer setup that cannot train it (see
    :func:`vime_core.trainer.vision.check_vl_run`); nothing to check for a text model.

    :raises ArgumentError: naming the flag.
    """
    from vime_core.data.vision_prompt import is_vision_language
    from vime_core.trainer.vision import check_vl_run

    if is_vision_language(model_path):
        try:
            check_vl_run(cfg)
        except ValueError as e:
            raise ArgumentError(f"--model {model_path} is a vision-language model: {e}") from None
