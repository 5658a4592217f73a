"""The up-front checks of ``vime run`` / ``vime eval`` that need more than the flags, all before anything is
written or started (:func:`preflight`, cheapest first): the output directory, every plugin name the run will use
(docs/plugins.md, "Names are checked at start-up"), the eval sets and the prompt data, the model's files, the prompts
against its tokenizer, and the ``--vllm-*`` values parsed by vLLM's own parser. The ``vime`` command runs them
before it imports torch, Ray or vLLM, so a flag or file error takes a second, not the imports' time.
:func:`preflight` returns what the run goes on with (:class:`Preflight`).
"""

from __future__ import annotations

import json
import re
import struct
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vime_core.config import RunConfig
from vime_core.config.errors import ArgumentError
from vime_core.config.passthrough import cheap_value_error, engine_python, vllm_flag_values
from vime_core.plugins.manager import Plugins, get_plugins
from vime_core.run.output_dir import check_output_dir, is_training_run

if TYPE_CHECKING:
    from vime_core.trainer.group import TrainerClasses


@dataclass(frozen=True)
class Preflight:
    """What :func:`preflight` found and resolved, for the run that follows (it does not read or check them again).

    :ivar plugins: the loaded plugins (every name the run uses resolved).
    :ivar estimator: the ``--advantage-estimator`` function (``None`` for ``vime eval``).
    :ivar trainer_classes: the ``--trainer`` backend and ``--weight-sync`` strategy classes the ranks build
        (``None`` for ``vime eval``).
    :ivar rows: the ``--prompt-data`` rows (``None`` for ``vime eval`` and ``--debug-train-only``).
    :ivar model_path: the resolved ``--model`` directory.
    :ivar overlong: prompts left out as longer than ``--rollout-max-prompt-len``.
    :ivar t_setup: ``time.perf_counter()`` when the checks began (the printed setup time counts from it).
    """

    plugins: Plugins
    estimator: Any
    trainer_classes: TrainerClasses | None
    rows: list[dict[str, Any]] | None
    model_path: Path
    overlong: int
    t_setup: float


def preflight(cfg: RunConfig, command: str = "run") -> Preflight:
    """Every up-front check of ``vime run`` (``command="eval"``: of ``vime eval``), cheapest first: the output
    directory, the plugin names (known, or a dotted path that imports), the eval sets and the prompt data, the model
    directory and its weight files (:func:`check_model_weights`); then those that import a library: the prompts
    against the tokenizer (transformers), the LoRA targets, and the ``--vllm-*`` values and sampling parameters
    (vLLM, in a subprocess: :func:`check_vllm_values`). Once all passed, every plugin the run uses is resolved
    (a built-in trainer imports torch only then).

    :raises ArgumentError: (or the checks' own one-line errors: ``DataError``, ``RegistryError``,
        ``LoraFlagError``) naming the flag or file.
    """
    from vime_core.data.source import read_rows
    from vime_core.rollout.evaluation import load_eval_sets

    t_setup = time.perf_counter()
    log, data = cfg.logging, cfg.data
    out = Path(log.output_dir)
    check_output_dir(out)
    if command == "eval" and is_training_run(out):
        raise ArgumentError(
            f"--output-dir {out} holds a training run's records (checkpoints, summary.json): vime eval would write "
            "its own summary.json and metrics.jsonl there; give it another --output-dir (default: outputs/eval)"
        )
    plugins = get_plugins()
    check_plugin_names(plugins, cfg, train=command == "run")
    vllm_args = [] if log.debug_train_only else list(cfg.engine.vllm_args)
    decided = _flags_checked_here(vllm_args, engine_python()) if vllm_args else True  # milliseconds, cached rules
    load_eval_sets(cfg.eval)  # a bad eval set fails before any engine starts
    rows = None
    if command == "run" and not log.debug_train_only:
        rows = read_rows(data.prompt_data, data.input_key, data.label_key, data.metadata_key, image_key=data.image_key)
    model_path = resolved_model(log.model)
    if command == "run":  # the family (config.json) before the weights: the one fact that decides the rest
        if not log.debug_rollout_only:  # family and features against --trainer
            check_trainer_model(cfg.trainer.trainer, log.model, model_path)
        check_moe_flags(cfg, model_path)  # --use-rollout-routing-replay, --expert-model-parallel-size vs the model
        check_vlm_run(cfg, model_path)  # a vision-language model: the torch trainer, no LoRA, no critic
    check_model_weights(model_path)
    if not log.debug_train_only:
        check_response_room(cfg, model_path)
    overlong = 0
    if rows is not None:
        from vime_core.data.prompt_checks import check_prompts

        # no tokenizer, no chat template, an over-long prompt: fails here, before any engine starts
        overlong = check_prompts(data, model_path, rows)
    if command == "run":
        from vime_core.config.lora import check_lora_model

        check_lora_model(cfg.lora, model_path)  # --target-modules / --lora-adapter-path against the model
    if not log.debug_train_only:  # vLLM's own parser and SamplingParams (where needed), before Ray starts
        check_vllm_values([] if decided else vllm_args, engine_sampling(cfg))
    train = command == "run"
    resolve_plugins(plugins, cfg, train=train)
    estimator = plugins.resolve("advantage", cfg.algorithm.advantage_estimator) if train else None
    classes = trainer_classes(plugins, cfg) if train else None
    return Preflight(plugins, estimator, classes, rows, model_path, overlong, t_setup)


def trainer_classes(plugins: Plugins, cfg: RunConfig) -> TrainerClasses:
    """The ``--trainer`` backend and ``--weight-sync`` strategy classes the trainer ranks build, resolved on the
    driver and handed down (:class:`~vime_core.trainer.group.TrainerGroup`).

    :raises RegistryError: an unknown name (:func:`check_plugin_names` names it first).
    """
    from vime_core.trainer.group import TrainerClasses

    return TrainerClasses(
        plugins.resolve("trainer", cfg.cluster.trainer), plugins.resolve("weight_sync", cfg.cluster.weight_sync)
    )


def plugin_names(cfg: RunConfig, *, train: bool = True) -> list[tuple[str, str]]:
    """``(kind, name)`` of every plugin the run uses (``train=False``: those of ``vime eval``)."""
    names = [("generate", cfg.rollout.generate), ("reward", cfg.eval.eval_reward or cfg.eval.reward)]
    names += [("reward", name) for name in (cfg.eval.eval_set_reward or {}).values()]  # --eval-set-reward
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


def check_plugin_names(plugins: Plugins, cfg: RunConfig, *, train: bool = True) -> None:
    """Every plugin name of :func:`plugin_names` is registered (nothing is imported for it: a built-in trainer or
    weight-sync strategy is resolved when the run creates it) or a dotted path that imports, and the tool-call
    parser is known.

    :raises RegistryError: an unknown name (the registry's message names the flag and what exists), or a dotted
        path that does not import (naming the flag, the module and its error).
    :raises ArgumentError: an unknown tool-call parser.
    """
    for kind, name in plugin_names(cfg, train=train):
        if name not in plugins.registries[kind].names():
            plugins.resolve(kind, name)
    _check_tool_parser(cfg)


def resolve_plugins(plugins: Plugins, cfg: RunConfig, *, train: bool = True) -> None:
    """Resolve every plugin name of :func:`plugin_names` and the tool-call parsers the generate function will use.

    :raises RegistryError: an unknown plugin name (the registry's message names the flag and what exists).
    :raises ArgumentError: an unknown tool-call parser.
    """
    for kind, name in plugin_names(cfg, train=train):
        plugins.resolve(kind, name)
    _check_tool_parser(cfg)


def _check_tool_parser(cfg: RunConfig) -> None:
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
    from vime_core.rollout.evaluation import parse_eval_prompt_data

    out = {"training rollouts (--rollout-*)": sampling_params(cfg.rollout)}
    for s in parse_eval_prompt_data(cfg.eval.eval_prompt_data):
        out[f"eval set {s.name} (--eval-*)"] = sampling_params(cfg.eval, s.name)
    return out


def check_vllm_values(
    vllm_args: list[str], sampling: dict[str, dict] | None = None, python: str | None = None
) -> None:
    """Check what the engines will be given with the vLLM they run (a subprocess of
    :func:`~vime_core.config.passthrough.engine_python`: vLLM is imported there, not here): the ``--vllm-*`` flags (as
    forwarded: ``--max-model-len 512``) with its server parser, and each of ``sampling`` (``{where: params}``) as
    its ``SamplingParams``. Nothing beyond the basic sampling fields and no flag: returns at once. Flags whose
    values the cached rules decide (:func:`_flags_checked_here`: nearly all) need no vLLM import: a bad value fails in
    milliseconds, not the 15-20 s vLLM's import takes; the subprocess runs only for the others.

    :raises ArgumentError: naming the ``--vllm-*`` flag and vLLM's reason, e.g. ``--vllm-max-model-len: invalid
        human_readable_int_or_auto value: 'banana'``, or the sampling flags and vLLM's reason.
    """
    sampling = {w: p for w, p in (sampling or {}).items() if set(p) - BASIC_SAMPLING_FIELDS}
    if not vllm_args and not sampling:
        return
    python = python or engine_python()
    if (not vllm_args or _flags_checked_here(list(vllm_args), python)) and not sampling:
        return  # every value decided from the cached rules: vLLM need not be imported (seconds) for the check
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
    raise _vllm_refusal(error["error"])


def forwarded_flags(vllm_args: list[str]) -> list[tuple[str, list[str]]]:
    """The forwarded vLLM argv (``["--max-model-len", "512", "--enforce-eager", "--dtype=half"]``) as ``(name,
    values)`` pairs: ``[("max-model-len", ["512"]), ("enforce-eager", []), ("dtype", ["half"])]``."""
    pairs: list[tuple[str, list[str]]] = []
    for token in vllm_args:
        if token.startswith("--"):
            name, eq, value = token[2:].partition("=")
            pairs.append((name, [value] if eq else []))
        elif pairs:
            pairs[-1][1].append(token)
    return pairs


def _vllm_refusal(message: str) -> ArgumentError:
    """vLLM names its own flag (``--max-model-len``); the user typed ``--vllm-max-model-len``."""
    return ArgumentError("vLLM refuses " + re.sub(r"--(?!vllm-)([a-z0-9][a-z0-9-]*)", r"--vllm-\1", message))


def _flags_checked_here(vllm_args: list[str], python: str) -> bool:
    """Check each forwarded value against the cached value rules of the engines' vLLM
    (:func:`~vime_core.config.passthrough.vllm_flag_values`: ints, floats, choices, vLLM's human-readable ints), in
    milliseconds.

    :return: whether every value was decided here (else vLLM's own parser must see them).
    :raises ArgumentError: a value the rules refuse, in vLLM's parser's words with the ``--vllm-`` name.
    """
    try:
        rules = vllm_flag_values(python)
    except RuntimeError:
        return False  # no vLLM to ask: the subprocess reports it
    decided = True
    for name, values in forwarded_flags(vllm_args):
        rule = rules.get(name)
        if rule is None or len(values) > 1 or (not values and rule["type"] != "switch"):
            decided = False
            continue
        try:
            error = cheap_value_error(name, values[0] if values else "", rule)
        except LookupError:
            decided = False
            continue
        if error is not None:
            raise _vllm_refusal(error)
    return decided


def context_length(vllm_args: list[str], model_path: Path) -> tuple[int, str] | None:
    """The engines' context length in tokens and where it comes from: ``--vllm-max-model-len`` when given as an
    integer, else the model's ``max_position_embeddings`` (what vLLM takes by default); ``None`` when neither says
    (``auto``, a suffixed size, a config without the field)."""
    from vime_core.config.passthrough import passthrough_value

    value = passthrough_value(vllm_args, "max-model-len")
    if value is not None:
        value = value.strip()
        return (int(value), "--vllm-max-model-len") if re.fullmatch(r"[1-9]\d*", value) else None
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    n = config.get("max_position_embeddings") if isinstance(config, dict) else None
    return (n, f"the model's max_position_embeddings ({model_path}/config.json)") if isinstance(n, int) else None


def check_response_room(cfg: RunConfig, model_path: Path) -> None:
    """A response budget must leave room for a prompt in the engines' context: vLLM answers 400 to every request
    whose prompt plus ``max_tokens`` does not fit.

    :raises ArgumentError: ``--rollout-max-response-len`` (or ``--eval-max-response-len``) is not below the
        context length (:func:`context_length`), naming both.
    """
    context = context_length(list(cfg.engine.vllm_args), model_path)
    if context is None:
        return
    n, where = context
    for flag, value in (
        ("--rollout-max-response-len", cfg.rollout.rollout_max_response_len),
        ("--eval-max-response-len", cfg.eval.eval_max_response_len),
    ):
        if value is not None and value >= n:
            raise ArgumentError(
                f"{flag} {value} leaves no room for a prompt in the engines' context of {n} tokens ({where}): "
                "vLLM would refuse every request; lower it or raise --vllm-max-model-len"
            )


def resolved_model(model: str) -> Path:
    """:func:`~vime_core.models.resolve_model` of ``--model`` (a known name is prepared on first use).

    :raises ArgumentError: naming ``--model`` (unknown name, not a model directory).
    """
    from vime_core.models import resolve_model
    from vime_core.models.prepare import ModelPrepareError

    try:
        return resolve_model(model)
    except (ValueError, ModelPrepareError) as e:
        raise ArgumentError(f"--model {model}: {e}") from None


def checked_model(model: str) -> Path:
    """:func:`resolved_model`, with its weights there (:func:`check_model_weights`).

    :raises ArgumentError: naming ``--model`` (unknown name, not a model directory, no weights).
    """
    model_path = resolved_model(model)
    check_model_weights(model_path)
    return model_path


def check_model_weights(model_path: Path) -> None:
    """A local HF model directory needs its weights (``*.safetensors`` or ``*.bin``, sharded or not), and each
    ``*.safetensors`` file must be whole (:func:`check_safetensors`).

    :raises ArgumentError: naming the directory and what it holds instead, or the broken file.
    """
    p = Path(model_path)
    if not p.is_dir():
        return
    safetensors = sorted(p.glob("*.safetensors"))
    for f in safetensors:
        check_safetensors(f)
    if safetensors or any(p.glob("*.bin")):
        return
    held = ", ".join(sorted(f.name for f in p.iterdir())[:8]) or "nothing"
    raise ArgumentError(f"--model {p}: no weights there (*.safetensors or *.bin); it holds {held}")


def check_trainer_model(trainer: str, model: str, model_path: Path | None = None) -> None:
    """``--model`` against ``--trainer``: its ``config.json``'s family and features (RoPE type, attention type, MoE
    layout, ...) by :func:`vime_core.models.families.check_trainer_model` — no torch, no transformers. Without
    ``model_path`` the model is found without preparing anything: a local HF directory, or a known name already in
    the cache; a known name not prepared yet is checked by :func:`vime_core.run.loop.run` once prepared.

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


def check_safetensors(path: Path) -> None:
    """Check a ``.safetensors`` file's framing without reading its tensors: the format's 8-byte little-endian
    header length, a JSON header of that length, and the tensors' byte ranges (``data_offsets``, after the header)
    ending exactly at the end of the file (https://github.com/huggingface/safetensors, "Format").

    :raises ArgumentError: naming ``--model``, the file and what is wrong (shorter than its header, a header that
        is not JSON, tensors that end beyond the file: truncated, or before it: trailing garbage).
    """
    size = path.stat().st_size
    where = f"--model: {path} is not a valid safetensors file"
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ArgumentError(f"{where} ({size} bytes: shorter than the 8-byte header length)")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise ArgumentError(
                f"{where} (its header claims {n} bytes, the file has {size}: truncated or not safetensors)"
            )
        try:
            header = json.loads(f.read(n))
        except (ValueError, UnicodeDecodeError) as e:
            raise ArgumentError(f"{where} (its {n}-byte header is not JSON: {e})") from None
    if not isinstance(header, dict):
        raise ArgumentError(f"{where} (its header is not a JSON object)")
    try:
        end = max((int(t["data_offsets"][1]) for k, t in header.items() if k != "__metadata__"), default=0)
    except (KeyError, TypeError, ValueError, IndexError):
        raise ArgumentError(f"{where} (a tensor of its header has no data_offsets)") from None
    if 8 + n + end != size:
        what = "truncated" if 8 + n + end > size else "trailing bytes after the tensors"
        raise ArgumentError(f"{where} ({what}: the header needs {8 + n + end} bytes, the file has {size})")


def check_vlm_run(cfg: RunConfig, model_path: Path) -> None:
    """A vision-language ``--model`` with a trainer setup that cannot train it (see
    :func:`vime_core.trainer.vision.check_vl_run`); nothing to check for a text model.

    :raises ArgumentError: naming the flag.
    """
    from vime_core.data.vision_prompt import is_vision_language

    if is_vision_language(model_path):  # a text model imports nothing more (vision imports torch)
        from vime_core.trainer.vision import check_vl_run

        try:
            check_vl_run(cfg)
        except ValueError as e:
            raise ArgumentError(f"--model {model_path} is a vision-language model: {e}") from None
