"""The cross-flag checks of ``vime run``: combinations of flags that cannot run are refused with an
:class:`~vime_core.argument_errors.ArgumentError` naming them, and flags that follow from others are derived
(:func:`check_run_args`, which :func:`vime_core.arguments.parse_run_args` calls after parsing).
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os

from vime_core.algorithms.options import check_algorithm_config
from vime_core.argument_errors import ArgumentError
from vime_core.config import AlgorithmConfig, ClusterConfig, LoraConfig, RolloutConfig, TrainerConfig, json_object
from vime_core.evaluation import EvalArgumentError, parse_eval_prompt_data
from vime_core.lora.options import LoraFlagError, check_lora_config
from vime_core.placement import PlacementError, ResourceFlags, check_resource_flags
from vime_core.rollout.overlong import check_overlong_config
from vime_core.trainer.lr_schedule import check_lr_schedule_config

logger = logging.getLogger("vime.arguments")


#: sampling fields that have their own flag (a JSON of --*-sampling-params may not set them) or that vime sets
OWN_SAMPLING_FLAGS = {
    "temperature": "--rollout-temperature / --eval-temperature",
    "top_p": "--rollout-top-p / --eval-top-p",
    "top_k": "--rollout-top-k / --eval-top-k",
    "min_p": "--rollout-min-p / --eval-min-p",
    "repetition_penalty": "--rollout-repetition-penalty / --eval-repetition-penalty",
    "max_tokens": "--rollout-max-response-len / --eval-max-response-len",
    "stop": "--rollout-stop",
    "stop_token_ids": "--rollout-stop-token-ids",
    "n": "(one sample per request; --n-samples-per-prompt)",
    "logprobs": "(vime asks for the sampled token's log-prob)",
}


def _check_sampling_json(args: argparse.Namespace) -> None:
    pairs = list(args.eval_set_sampling_params or [])
    if len(pairs) % 2:
        raise ArgumentError(f"--eval-set-sampling-params expects NAME JSON pairs, got {len(pairs)} values")
    names = [s.name for s in parse_eval_prompt_data(args.eval_prompt_data)]
    per_set: dict[str, dict] = {}
    for name, text in zip(pairs[::2], pairs[1::2], strict=True):
        if name not in names:
            raise ArgumentError(f"--eval-set-sampling-params {name}: no such --eval-prompt-data set (sets: {names})")
        try:
            per_set[name] = json_object(f"--eval-set-sampling-params {name}")(text)
        except argparse.ArgumentTypeError as e:
            raise ArgumentError(str(e)) from None
    args.eval_set_sampling_params = per_set or None
    sources = [("--rollout-sampling-params", args.rollout_sampling_params)]
    sources += [("--eval-sampling-params", args.eval_sampling_params)]
    sources += [(f"--eval-set-sampling-params {n}", d) for n, d in per_set.items()]
    for flag, fields in sources:
        for key in fields or {}:
            if key in OWN_SAMPLING_FLAGS and not (flag.startswith("--eval-set") and key in EVAL_SET_FIELDS):
                raise ArgumentError(f"{flag}: {key!r} has its own flag: {OWN_SAMPLING_FLAGS[key]}")


#: per eval set, these may be set in the JSON (there is no per-set flag for them)
EVAL_SET_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_tokens", "stop")


def _check_eval(args: argparse.Namespace) -> None:
    try:
        parse_eval_prompt_data(args.eval_prompt_data)
    except EvalArgumentError as e:
        raise ArgumentError(str(e)) from None
    for name in ("eval_interval", "n_samples_per_eval_prompt", "eval_max_response_len"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ArgumentError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.eval_interval is not None and not args.eval_prompt_data:
        raise ArgumentError("--eval-interval needs --eval-prompt-data NAME PATH [NAME PATH ...]")
    if args.eval_prompt_data and args.debug_train_only:
        raise ArgumentError("--eval-prompt-data needs the rollout engines; it does not work with --debug-train-only")
    if args.eval_reward is None:
        args.eval_reward = args.reward
    _check_sampling_json(args)


def check_run_args(args: argparse.Namespace, command: str = "run") -> None:
    """Check the combination of parsed ``vime run`` flags (``command`` ``"eval"`` for ``vime eval``) and derive the
    flags that follow from others (``--load-debug-rollout-data`` implies ``--debug-train-only``, the engine count
    from ``--rollout-num-gpus``, ``--update-weight-disk-dir``, the CPU binding of one CPU engine, ``--eval-reward``).

    :raises ArgumentError: naming the flags of a combination that cannot run.
    """
    if args.load_debug_rollout_data:
        args.debug_train_only = True
    if args.loop != "sync" and (args.debug_train_only or args.debug_rollout_only):
        raise ArgumentError(f"--loop {args.loop} needs both engines and trainer; the debug modes use --loop sync")
    if args.mask_offpolicy_in_partial_rollout and not args.partial_rollout:
        raise ArgumentError("--mask-offpolicy-in-partial-rollout needs --partial-rollout")
    if args.partial_rollout and (
        args.loop == "fully-async"
        or (args.dynamic_sampling_filter is None and (args.over_sampling_batch_size or 0) <= args.rollout_batch_size)
    ):
        raise ArgumentError(
            "--partial-rollout resumes groups aborted by over-sampling: it needs --dynamic-sampling-filter or "
            "--over-sampling-batch-size above --rollout-batch-size, and --loop sync or one-step-off"
        )
    if args.max_staleness < 0:
        raise ArgumentError("--max-staleness must be >= 0")
    inflight = args.rollout_inflight_groups
    if inflight is not None and inflight < args.rollout_batch_size:
        raise ArgumentError(
            f"--rollout-inflight-groups {inflight} is below --rollout-batch-size {args.rollout_batch_size}: "
            "a fully-async step could never get its groups"
        )
    if not args.failure_exit_timeout > 0:
        raise ArgumentError(f"--failure-exit-timeout must be > 0 seconds, got {args.failure_exit_timeout}")
    if args.reward == "remote" and not args.rm_url:
        raise ArgumentError("--reward remote needs --rm-url (the reward-model service's URL)")
    for name in ("rm_concurrency", "math_verify_workers"):
        if getattr(args, name) < 1:
            raise ArgumentError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("rm_timeout", "math_verify_timeout", "reward_timeout"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise ArgumentError(f"--{name.replace('_', '-')} must be > 0 seconds, got {value}")
    if args.rm_max_retries < 0:
        raise ArgumentError(f"--rm-max-retries must be >= 0, got {args.rm_max_retries}")
    for name in ("save_interval", "max_checkpoints", "rollout_max_prompt_len"):
        value = getattr(args, name, None)
        if value is not None and value < 1:
            raise ArgumentError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if getattr(args, "save_interval_minutes", None) is not None and not args.save_interval_minutes > 0:
        raise ArgumentError(f"--save-interval-minutes must be > 0 minutes, got {args.save_interval_minutes}")
    _check_sandbox_outlives_agent(args)
    check_off_policy_correction(args)
    if args.debug_rollout_only and args.debug_train_only:
        raise ArgumentError("--debug-rollout-only and --debug-train-only exclude each other")
    _check_eval(args)
    if command == "run" and not args.debug_train_only and args.prompt_data is None:
        raise ArgumentError("--prompt-data is required (a .jsonl or .parquet file of prompts)")
    if args.debug_train_only and not args.load_debug_rollout_data:
        raise ArgumentError("--debug-train-only needs --load-debug-rollout-data PATTERN")
    for name in (
        "num_rollout",
        "rollout_batch_size",
        "n_samples_per_prompt",
        "micro_batch_size",
        "rollout_num_engines",
    ):
        if getattr(args, name) < 1:
            raise ArgumentError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    total = args.rollout_batch_size * args.n_samples_per_prompt
    if args.global_batch_size is not None and (args.global_batch_size < 1 or total % args.global_batch_size):
        raise ArgumentError(
            f"--global-batch-size {args.global_batch_size} must divide "
            f"rollout-batch-size × n-samples-per-prompt = {total}"
        )
    if args.rollout_cpu_bind is not None and len(args.rollout_cpu_bind) != args.rollout_num_engines:
        raise ArgumentError(
            f"--rollout-cpu-bind has {len(args.rollout_cpu_bind)} values for {args.rollout_num_engines} engines"
        )
    if args.train_cpus is not None:
        parse_cpu_list(args.train_cpus)
    if not -20 <= args.ray_worker_niceness <= 19:
        raise ArgumentError(f"--ray-worker-niceness must be in -20 … 19 (nice(2)), got {args.ray_worker_niceness}")
    for name in ("rollout_max_engine_restarts", "rollout_max_request_retries"):
        if getattr(args, name, 0) < 0:
            raise ArgumentError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if getattr(args, "rollout_engine_restart_backoff", 0.0) < 0:
        raise ArgumentError(
            f"--rollout-engine-restart-backoff must be >= 0, got {args.rollout_engine_restart_backoff:g}"
        )
    for name in ("rollout_health_check_interval", "rollout_engine_hang_timeout"):
        if getattr(args, name, 1.0) <= 0:
            raise ArgumentError(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    if (args.vllm_router_ip is None) != (args.vllm_router_port is None):
        raise ArgumentError("--vllm-router-ip and --vllm-router-port go together")
    if args.use_wandb and importlib.util.find_spec("wandb") is None:
        raise ArgumentError("--use-wandb needs the wandb package: pip install 'vime[wandb]'")
    if args.colocate and args.loop != "sync":
        raise ArgumentError(f"--colocate needs --loop sync: with --loop {args.loop} generation overlaps training")
    try:
        engines = check_resource_flags(ResourceFlags.from_config(ClusterConfig.from_args(args)))
    except PlacementError as e:
        raise ArgumentError(str(e)) from None
    if args.rollout_num_gpus and engines:  # engines = --rollout-num-gpus / --rollout-num-gpus-per-engine (slime)
        args.rollout_num_engines = engines
    if args.update_weight_disk_dir is None:
        args.update_weight_disk_dir = args.output_dir / "weights"
    cores = sorted(os.sched_getaffinity(0))
    if (
        args.rollout_cpu_bind is None
        and args.loop == "sync"
        and args.rollout_num_engines == 1
        and not args.rollout_num_gpus
        and not args.ray_address
        and len(cores) > 1
    ):
        # sync loop, one CPU engine: generation and training never overlap, so the engine's OpenMP threads get every
        # core. vLLM's "auto" keeps one core for its engine-core process, which spin-waits on it: 189 vs 316 tokens/s
        # on 2 cores (bench/rollout_throughput.py, docs/performance.md)
        args.rollout_cpu_bind = [",".join(map(str, cores))]
    try:
        check_algorithm_config(AlgorithmConfig.from_args(args))
        check_overlong_config(RolloutConfig.from_args(args))
        check_lr_schedule_config(TrainerConfig.from_args(args))
    except ValueError as e:
        raise ArgumentError(str(e)) from None
    _check_lora(args)


def _check_lora(args: argparse.Namespace) -> None:
    """The LoRA flags against the chosen weight-sync strategy and trainer (their classes' ``CARRIES_LORA`` and
    ``SUPPORTS_LORA``; an unknown name is left to the run's own resolution, which names it)."""
    cfg = LoraConfig.from_args(args)
    classes: list[type | None] = [None, None]
    if cfg.enabled:
        from vime_core.plugins import get_plugins
        from vime_core.registry import RegistryError

        for i, (kind, name) in enumerate((("weight_sync", cfg.weight_sync), ("trainer", cfg.trainer))):
            try:
                classes[i] = get_plugins().resolve(kind, name)
            except RegistryError:
                pass
    try:
        check_lora_config(cfg, classes[0], classes[1] if not args.debug_rollout_only else None)
    except LoraFlagError as e:
        raise ArgumentError(str(e)) from None


def _check_sandbox_outlives_agent(args: argparse.Namespace) -> None:
    """``--generate coding_agent`` runs the agent and then collects and scores its workspace in the same sandbox:
    a sandbox that lives no longer than the agent expires first, and every episode would fail.

    :raises ArgumentError: ``--sandbox-wall-time`` (when not 0 = unlimited) is not above ``--agent-wall-time``.
    """
    sandbox_s, agent_s = getattr(args, "sandbox_wall_time", None), getattr(args, "agent_wall_time", None)
    if getattr(args, "generate", None) != "coding_agent" or not sandbox_s or agent_s is None:
        return
    if sandbox_s <= agent_s:
        raise ArgumentError(
            f"--sandbox-wall-time {sandbox_s:g} s is not longer than --agent-wall-time {agent_s:g} s: the sandbox "
            "would expire while the agent still runs or before its workspace is collected and scored, so every "
            f"episode would fail. Give the sandbox headroom, e.g. --sandbox-wall-time {agent_s + 300:g} (or lower "
            "--agent-wall-time, or --sandbox-wall-time 0 for no limit)"
        )


OFF_POLICY_LOOPS = ("one-step-off", "fully-async")
OFF_POLICY_CORRECTIONS = ("--use-tis", "--use-mis", "--use-rollout-logprobs")


def check_off_policy_correction(args: argparse.Namespace) -> None:
    """Refuse an off-policy loop (``--loop one-step-off`` / ``fully-async``) without a correction for the policy
    that generated the tokens: ``--use-tis`` or ``--use-mis`` (importance weights against the engine's log-probs)
    or ``--use-rollout-logprobs`` (the engine's log-probs as the PPO ratio's old policy). Without one, the trainer
    anchors the ratio to its own current policy, one or more versions newer than the sampling policy.

    ``--allow-off-policy-without-correction`` lets the run start anyway, with a warning.

    :raises ArgumentError: naming the loop and the three flags.
    """
    loop = getattr(args, "loop", "sync")
    if loop not in OFF_POLICY_LOOPS or any(
        getattr(args, f[2:].replace("-", "_"), False) for f in OFF_POLICY_CORRECTIONS
    ):
        return
    what = (
        f"--loop {loop} trains on tokens generated by an older policy, but none of "
        f"{', '.join(OFF_POLICY_CORRECTIONS)} is set, so the PPO ratio would be anchored to the trainer's current "
        "policy instead of the policy that generated the tokens"
    )
    if not getattr(args, "allow_off_policy_without_correction", False):
        raise ArgumentError(
            f"{what}. Add --use-tis (truncated importance sampling, the usual choice), --use-mis or "
            "--use-rollout-logprobs, or pass --allow-off-policy-without-correction to train uncorrected."
        )
    logger.warning("WARNING: %s (--allow-off-policy-without-correction). The updates are biased.", what)


def parse_cpu_list(spec: str) -> set[int]:
    """``"1"``, ``"0-3"``, ``"2-3,6"`` → a set of core ids (taskset's list syntax).

    :raises ArgumentError: naming ``--train-cpus`` on a malformed list.
    """
    cpus: set[int] = set()
    try:
        for part in str(spec).split(","):
            lo, _, hi = part.strip().partition("-")
            cpus.update(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise ArgumentError(f"--train-cpus {spec!r}: expected core ids like '1', '0-3' or '2-3,6'") from None
    if not cpus:
        raise ArgumentError(f"--train-cpus {spec!r}: no core")
    return cpus
