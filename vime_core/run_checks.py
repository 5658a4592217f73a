"""The up-front checks of ``vime run`` / ``vime eval`` that need more than the flags: every plugin name the run
will use resolved, and the ``--vllm-*`` values parsed by vLLM's own parser — all before anything is written or
started (docs/plugins.md, "Names are checked at start-up"). :func:`preflight` makes all of ``vime run``'s and
returns what the run goes on with (:class:`Preflight`).
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vime_core.argument_errors import ArgumentError
from vime_core.config import RunConfig
from vime_core.passthrough import engine_python
from vime_core.plugins import Plugins, get_plugins

if TYPE_CHECKING:
    from vime_core.trainer.group import TrainerClasses


@dataclass(frozen=True)
class Preflight:
    """What ``vime run`` goes on with once :func:`preflight` passed.

    :ivar plugins: the loaded plugins (every name the run uses resolved).
    :ivar estimator: the ``--advantage-estimator`` function.
    :ivar trainer_classes: the ``--trainer`` backend and ``--weight-sync`` strategy classes the ranks build.
    :ivar rows: the prompt data's rows (``None`` with ``--debug-train-only``).
    :ivar model_path: the resolved ``--model`` directory.
    :ivar overlong: prompts left out as longer than ``--rollout-max-prompt-len``.
    :ivar t_setup: ``time.perf_counter()`` when the setup began (the printed setup time counts from it).
    """

    plugins: Plugins
    estimator: Any
    trainer_classes: TrainerClasses
    rows: list[dict[str, Any]] | None
    model_path: Path
    overlong: int
    t_setup: float


def preflight(cfg: RunConfig) -> Preflight:
    """Every check of ``vime run`` before the output directory changes or anything expensive starts (a typo fails
    in a second): the output directory, every plugin name, the eval sets, the prompt data, the model and its
    tokenizer and chat template, the prompts' lengths, the LoRA targets, the ``--vllm-*`` values.

    :raises ArgumentError / RegistryError / DataError / ValueError: the first problem, naming its flag or file.
    """
    from vime_core.data.source import read_rows
    from vime_core.evaluation import load_eval_sets
    from vime_core.lora.options import check_lora_model
    from vime_core.progress import console
    from vime_core.rollout.prompt_checks import check_prompts
    from vime_core.run_dir import check_output_dir

    log = cfg.logging
    check_output_dir(Path(log.output_dir))
    plugins = get_plugins()
    resolve_plugins(plugins, cfg)
    estimator = plugins.resolve("advantage", cfg.algorithm.advantage_estimator)
    load_eval_sets(cfg.eval)  # a bad eval set fails before any engine starts
    data = cfg.data
    rows = (
        None
        if log.debug_train_only
        else read_rows(data.prompt_data, data.input_key, data.label_key, data.metadata_key)
    )
    t_setup = time.perf_counter()
    model_path = checked_model(log.model)
    if not log.debug_rollout_only:  # family and features against --trainer
        check_trainer_model(cfg.trainer.trainer, log.model, model_path)
    check_moe_flags(cfg, model_path)  # --use-rollout-routing-replay, --expert-model-parallel-size against the model
    console.print(f"[vime] model: {model_path}")
    # no tokenizer, no chat template, an over-long prompt: fails here, before any engine starts
    overlong = 0 if rows is None else check_prompts(data, model_path, rows)
    check_lora_model(cfg.lora, model_path)  # --target-modules / --lora-adapter-path against the model
    if not log.debug_train_only:  # vLLM's own parser and SamplingParams, before Ray starts
        check_vllm_values(list(cfg.engine.vllm_args), engine_sampling(cfg))
    classes = trainer_classes(plugins, cfg)
    return Preflight(plugins, estimator, classes, rows, model_path, overlong, t_setup)


def trainer_classes(plugins: Plugins, cfg: RunConfig) -> TrainerClasses:
    """The ``--trainer`` backend and ``--weight-sync`` strategy classes the trainer ranks build, resolved on the
    driver and handed down (:class:`~vime_core.trainer.group.TrainerGroup`).

    :raises RegistryError: an unknown name (:func:`resolve_plugins` names it first).
    """
    from vime_core.trainer.group import TrainerClasses

    return TrainerClasses(
        plugins.resolve("trainer", cfg.cluster.trainer), plugins.resolve("weight_sync", cfg.cluster.weight_sync)
    )


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
    from vime_core.config.sampling import sampling_params
    from vime_core.evaluation import parse_eval_prompt_data

    out = {"training rollouts (--rollout-*)": sampling_params(cfg.rollout)}
    for s in parse_eval_prompt_data(cfg.eval.eval_prompt_data):
        out[f"eval set {s.name} (--eval-*)"] = sampling_params(cfg.eval, s.name)
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


def check_trainer_model(trainer: str, model: str, model_path: Path | None = None) -> None:
    """``--model`` against ``--trainer``: its ``config.json``'s family and features (RoPE type, attention type, MoE
    layout, ...) by :func:`vime_core.models.families.check_trainer_model` — no torch, no transformers. Without
    ``model_path`` the model is found without preparing anything: a local HF directory, or a known name already in
    the cache; a known name not prepared yet is checked by :func:`vime_core.loop.run` once prepared.

    :raises ArgumentError: one line naming the model type, what ``--trainer`` supports and that ``--trainer torch``
        takes any Hugging Face causal LM.
    """
    from vime_core.models.families import TRAINERS, UnsupportedModelError, read_model_config
    from vime_core.models.families import check_trainer_model as check

    spec = TRAINERS.get(trainer)
    if spec is None or spec.any_causal_lm:
        return
    if model_path is None:
        from vime_core.models import KNOWN_MODELS, default_cache_dir, is_prepared

        path = Path(model).expanduser()
        if model in KNOWN_MODELS and not (path / "config.json").is_file():
            path = default_cache_dir() / model
            if not is_prepared(path):
                return
        if not (path / "config.json").is_file():
            return  # not a model directory: checked_model says so
        model_path = path
    try:
        check(trainer, read_model_config(model_path), model)
    except UnsupportedModelError as e:
        raise ArgumentError(str(e)) from None


def check_moe_flags(cfg: RunConfig, model_path: Path) -> None:
    """``--use-rollout-routing-replay`` and ``--expert-model-parallel-size`` against ``--model``'s ``config.json`` and
    ``--trainer``, before Ray starts: replay needs routed experts (and a trainer that replays that family:
    ``vime models``) and a generate function that records routes; EP > 1 needs the megatron trainer and a number of
    experts it divides; the megatron trainer has no LoRA for MoE models.

    :raises ArgumentError: one line naming the flag, the model type and what it needs.
    """
    from vime_core.models.families import features_of, read_model_config

    r3, ep = cfg.algorithm.use_rollout_routing_replay, int(cfg.megatron.expert_model_parallel_size or 1)
    trainer = cfg.trainer.trainer
    if r3 and cfg.rollout.generate == "coding_agent":
        raise ArgumentError(
            "--use-rollout-routing-replay: --generate coding_agent's agent gateway does not record the engine's "
            "routes yet (the default and multi_turn generate functions do)"
        )
    megatron_lora = trainer == "megatron" and cfg.lora.enabled
    if not r3 and ep == 1 and not megatron_lora:
        return
    config = read_model_config(model_path)
    model_type = config.get("model_type")
    experts = next(
        (int(config[k]) for k in ("num_experts", "n_routed_experts", "num_local_experts") if config.get(k)), 0
    )
    if r3 and not experts:
        raise ArgumentError(
            f"--use-rollout-routing-replay needs an MoE model; --model {cfg.logging.model} (model_type "
            f"{model_type!r}) has no routed experts"
        )
    features = features_of(trainer, str(model_type))
    if r3 and features is not None and not features.routing_replay:
        raise ArgumentError(
            f"--use-rollout-routing-replay: --trainer {trainer} does not replay the routes of model_type "
            f"{model_type!r} (`vime models` lists the families it does)"
        )
    if megatron_lora and experts:
        raise ArgumentError(
            f"--lora-rank {cfg.lora.lora_rank}: the megatron trainer has no LoRA for MoE models (model_type "
            f"{model_type!r}); --trainer torch trains their LoRA adapters"
        )
    if ep > 1 and trainer != "megatron":
        raise ArgumentError(f"--expert-model-parallel-size {ep} needs --trainer megatron (got --trainer {trainer})")
    if ep > 1 and (not experts or experts % ep):
        raise ArgumentError(
            f"--expert-model-parallel-size {ep} must divide the routed experts of --model {cfg.logging.model} "
            f"(model_type {model_type!r}: {experts})"
        )
