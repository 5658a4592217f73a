"""The cross-flag checks of ``vime run``: combinations of flags that cannot run are refused with an
:class:`~vime_core.config.errors.ArgumentError` naming them (:func:`check_run_config`, on the typed tree), and
flags that follow from others are derived (:func:`derive_flags`); :func:`vime_core.cli.arguments.parse_run_args` calls
both through :func:`check_run_args` after parsing.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import math
import os
from typing import Any

from vime_core.algorithms.options import check_algorithm_config
from vime_core.cluster.net import split_host_port
from vime_core.cluster.placement import PlacementError, ResourceFlags, check_resource_flags, parse_cpu_list
from vime_core.config import AlgorithmConfig, EvalConfig, RolloutConfig, RunConfig, json_object
from vime_core.config.errors import ArgumentError
from vime_core.config.lora import LoraFlagError, check_lora_config
from vime_core.rollout.evaluation import EvalArgumentError, parse_eval_prompt_data
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


def _eval_set_sampling(cfg: EvalConfig) -> dict[str, dict] | None:
    """``--eval-set-sampling-params NAME JSON ...`` as ``{NAME: fields}`` (``None`` when not given).

    :raises ArgumentError: an odd number of values, a NAME that is no eval set, a JSON that is no object.
    """
    pairs = list(cfg.eval_set_sampling_params or [])
    if len(pairs) % 2:
        raise ArgumentError(f"--eval-set-sampling-params expects NAME JSON pairs, got {len(pairs)} values")
    names = [s.name for s in parse_eval_prompt_data(cfg.eval_prompt_data)]
    per_set: dict[str, dict] = {}
    for name, text in zip(pairs[::2], pairs[1::2], strict=True):
        if name not in names:
            raise ArgumentError(f"--eval-set-sampling-params {name}: no such --eval-prompt-data set (sets: {names})")
        try:
            per_set[name] = json_object(f"--eval-set-sampling-params {name}")(text)
        except argparse.ArgumentTypeError as e:
            raise ArgumentError(str(e)) from None
    return per_set or None


def eval_set_rewards(cfg: EvalConfig) -> dict[str, str] | None:
    """``--eval-set-reward NAME REWARD ...`` as ``{NAME: REWARD}`` (``None`` when not given).

    :raises ArgumentError: an odd number of values, a NAME that is no eval set or is given twice.
    """
    pairs = cfg.eval_set_reward or []
    if isinstance(pairs, dict):  # already derived (a config built from a parsed Namespace)
        return dict(pairs) or None
    if len(pairs) % 2:
        raise ArgumentError(f"--eval-set-reward expects NAME REWARD pairs, got {len(pairs)} values: {' '.join(pairs)}")
    names = [s.name for s in parse_eval_prompt_data(cfg.eval_prompt_data)]
    per_set: dict[str, str] = {}
    for name, reward in zip(pairs[::2], pairs[1::2], strict=True):
        if name not in names:
            raise ArgumentError(f"--eval-set-reward {name}: no such --eval-prompt-data set (sets: {names})")
        if name in per_set:
            raise ArgumentError(f"--eval-set-reward {name}: given twice")
        per_set[name] = reward
    return per_set or None


def _check_sampling_json(cfg: RunConfig) -> None:
    per_set = _eval_set_sampling(cfg.eval) or {}
    sources = [("--rollout-sampling-params", cfg.rollout.rollout_sampling_params)]
    sources += [("--eval-sampling-params", cfg.eval.eval_sampling_params)]
    sources += [(f"--eval-set-sampling-params {n}", d) for n, d in per_set.items()]
    for flag, fields in sources:
        for key in fields or {}:
            if key in OWN_SAMPLING_FLAGS and not (flag.startswith("--eval-set") and key in EVAL_SET_FIELDS):
                raise ArgumentError(f"{flag}: {key!r} has its own flag: {OWN_SAMPLING_FLAGS[key]}")


#: per eval set, these may be set in the JSON (there is no per-set flag for them)
EVAL_SET_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_tokens", "stop")


def _finite(v: float) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _whole(v: float) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


#: what vLLM's ``SamplingParams`` accepts per field (the same from 0.24 to 0.33): the test and its wording
SAMPLING_RANGES: dict[str, tuple[Any, str]] = {
    "temperature": (lambda v: _finite(v) and 0.0 <= v <= 2.0, "in [0, 2] (0: greedy)"),
    "top_p": (lambda v: _finite(v) and 0.0 < v <= 1.0, "in (0, 1] (1: off)"),
    "top_k": (lambda v: _whole(v) and v >= -1, "-1 or 0 (off) or a whole number >= 1"),
    "min_p": (lambda v: _finite(v) and 0.0 <= v <= 1.0, "in [0, 1] (0: off)"),
    "repetition_penalty": (lambda v: _finite(v) and v > 0.0, "a number > 0 (1: off)"),
    "max_tokens": (lambda v: _whole(v) and v >= 1, ">= 1 (tokens)"),
    "presence_penalty": (lambda v: _finite(v) and -2.0 <= v <= 2.0, "in [-2, 2]"),
    "frequency_penalty": (lambda v: _finite(v) and -2.0 <= v <= 2.0, "in [-2, 2]"),
}
#: the flags that set each field of :data:`SAMPLING_RANGES`, for training rollouts and for evaluation
_SAMPLING_FLAGS = {
    "temperature": ("rollout_temperature", "eval_temperature"),
    "top_p": ("rollout_top_p", "eval_top_p"),
    "top_k": ("rollout_top_k", "eval_top_k"),
    "min_p": ("rollout_min_p", "eval_min_p"),
    "repetition_penalty": ("rollout_repetition_penalty", "eval_repetition_penalty"),
    "max_tokens": ("rollout_max_response_len", "eval_max_response_len"),
}


def check_sampling_values(cfg: RunConfig) -> None:
    """Every sampling value the engines will get, against vLLM's ranges (:data:`SAMPLING_RANGES`), named by the
    flag that sets it: ``--rollout-*`` and ``--eval-*`` (temperature, top-p, top-k, min-p, repetition penalty,
    response length) and the fields of ``--rollout-sampling-params``, ``--eval-sampling-params`` and
    ``--eval-set-sampling-params NAME``. Checked here, in a millisecond, so no engine answers 400 to every request
    a minute later.

    :raises ArgumentError: e.g. ``--rollout-temperature must be in [0, 2] (0: greedy), got -1.0``.
    """
    sections = (cfg.rollout, cfg.eval)
    for field, dests in _SAMPLING_FLAGS.items():
        ok, what = SAMPLING_RANGES[field]
        for section, dest in zip(sections, dests, strict=True):
            value = getattr(section, dest)
            if value is not None and not ok(value):
                raise ArgumentError(f"--{dest.replace('_', '-')} must be {what}, got {value}")
    sources = [("--rollout-sampling-params", cfg.rollout.rollout_sampling_params)]
    sources += [("--eval-sampling-params", cfg.eval.eval_sampling_params)]
    sources += [(f"--eval-set-sampling-params {n}", d) for n, d in (_eval_set_sampling(cfg.eval) or {}).items()]
    for flag, fields in sources:
        for key, value in (fields or {}).items():
            if key in SAMPLING_RANGES and value is not None and not SAMPLING_RANGES[key][0](value):
                raise ArgumentError(f"{flag}: {key} must be {SAMPLING_RANGES[key][1]}, got {value!r}")


#: the built-in estimators whose advantage compares a sample with the others of its prompt's group
GROUP_ESTIMATORS = ("grpo", "gspo", "rloo", "reinforce_plus_plus_baseline")


def check_group_size(cfg: RunConfig) -> None:
    """A group-relative estimator needs a group: with one sample per prompt every advantage is 0, so the run trains
    nothing (warned about: a run that only tests the plumbing may want that); ``check_reward_nonzero_std`` would
    drop every group (refused: the run could never fill a step). Greedy sampling (temperature 0) makes the samples
    of a group equal, so their advantages are 0 too: warned about (a reward may still differ).

    :raises ArgumentError: ``--n-samples-per-prompt 1`` with the std filter.
    """
    ro, estimator = cfg.rollout, cfg.algorithm.advantage_estimator
    if ro.n_samples_per_prompt == 1 and ro.dynamic_sampling_filter == "check_reward_nonzero_std":
        raise ArgumentError(
            "--dynamic-sampling-filter check_reward_nonzero_std keeps groups whose rewards differ, but "
            "--n-samples-per-prompt is 1: no group could ever pass"
        )
    if ro.n_samples_per_prompt == 1 and estimator in GROUP_ESTIMATORS:
        logger.warning(
            "WARNING: --advantage-estimator %s compares the samples of a prompt's group, but --n-samples-per-prompt "
            "is 1: every advantage is 0 and nothing will be trained; give --n-samples-per-prompt 2 or more, or use "
            "reinforce_plus_plus or ppo",
            estimator,
        )
    if ro.rollout_temperature == 0 and ro.n_samples_per_prompt > 1 and estimator in GROUP_ESTIMATORS:
        logger.warning(
            "WARNING: --rollout-temperature 0 samples greedily: the %d samples of a prompt are the same response, "
            "so --advantage-estimator %s gives them advantage 0 unless the reward differs between equal responses",
            ro.n_samples_per_prompt,
            estimator,
        )


def _check_eval(cfg: RunConfig) -> None:
    ev = cfg.eval
    try:
        parse_eval_prompt_data(ev.eval_prompt_data)
    except EvalArgumentError as e:
        raise ArgumentError(str(e)) from None
    for name in ("eval_interval", "n_samples_per_eval_prompt", "eval_max_response_len"):
        value = getattr(ev, name)
        if value is not None and value < 1:
            raise ArgumentError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if ev.eval_interval is not None and not ev.eval_prompt_data:
        raise ArgumentError("--eval-interval needs --eval-prompt-data NAME PATH [NAME PATH ...]")
    if ev.eval_prompt_data and cfg.logging.debug_train_only:
        raise ArgumentError("--eval-prompt-data needs the rollout engines; it does not work with --debug-train-only")
    _check_sampling_json(cfg)
    eval_set_rewards(ev)


def _at_least(section: object, names: tuple[str, ...], low: int) -> None:
    """Each of ``names`` (fields of ``section``; ``None`` = unset) is at least ``low``."""
    for name in names:
        value = getattr(section, name)
        if value is not None and value < low:
            raise ArgumentError(f"--{name.replace('_', '-')} must be >= {low}, got {value}")


def _positive(section: object, names: tuple[str, ...], unit: str = "") -> None:
    """Each of ``names`` (fields of ``section``; ``None`` = unset) is above 0."""
    for name in names:
        value = getattr(section, name)
        if value is not None and not value > 0:
            raise ArgumentError(f"--{name.replace('_', '-')} must be > 0{unit}, got {value}")


def check_run_args(args: argparse.Namespace, command: str = "run") -> None:
    """Check the combination of parsed ``vime run`` flags (``command`` ``"eval"`` for ``vime eval``) on the typed
    tree (:func:`check_run_config`), then derive the flags that follow from others (:func:`derive_flags`).

    :raises ArgumentError: naming the flags of a combination that cannot run.
    """
    if args.load_debug_rollout_data:
        args.debug_train_only = True
    cfg = RunConfig.from_args(args)
    check_run_config(cfg, command)
    derive_flags(args, cfg)


def check_run_config(cfg: RunConfig, command: str = "run") -> None:
    """Refuse flag combinations that cannot run, reading the typed sections only.

    :raises ArgumentError: naming the flags of the combination.
    """
    ro, eng, log, rew = cfg.rollout, cfg.engine, cfg.logging, cfg.reward
    if ro.loop != "sync" and (log.debug_train_only or log.debug_rollout_only):
        raise ArgumentError(f"--loop {ro.loop} needs both engines and trainer; the debug modes use --loop sync")
    if ro.mask_offpolicy_in_partial_rollout and not ro.partial_rollout:
        raise ArgumentError("--mask-offpolicy-in-partial-rollout needs --partial-rollout")
    if ro.partial_rollout and (
        ro.loop == "fully-async"
        or (ro.dynamic_sampling_filter is None and (ro.over_sampling_batch_size or 0) <= ro.rollout_batch_size)
    ):
        raise ArgumentError(
            "--partial-rollout resumes groups aborted by over-sampling: it needs --dynamic-sampling-filter or "
            "--over-sampling-batch-size above --rollout-batch-size, and --loop sync or one-step-off"
        )
    if ro.max_staleness < 0:
        raise ArgumentError("--max-staleness must be >= 0")
    inflight = ro.rollout_inflight_groups
    if inflight is not None and inflight < ro.rollout_batch_size:
        raise ArgumentError(
            f"--rollout-inflight-groups {inflight} is below --rollout-batch-size {ro.rollout_batch_size}: "
            "a fully-async step could never get its groups"
        )
    if not log.failure_exit_timeout > 0:
        raise ArgumentError(f"--failure-exit-timeout must be > 0 seconds, got {log.failure_exit_timeout}")
    if rew.reward == "remote" and not rew.rm_url:
        raise ArgumentError("--reward remote needs --rm-url (the reward-model service's URL)")
    _at_least(rew, ("rm_concurrency", "math_verify_workers"), 1)
    _positive(rew, ("rm_timeout", "math_verify_timeout", "reward_timeout"), " seconds")
    _at_least(rew, ("rm_max_retries",), 0)
    _at_least(log, ("save_interval",), 1)
    _at_least(log, ("keep_checkpoints",), 0)
    _at_least(cfg.data, ("rollout_max_prompt_len",), 1)
    _positive(log, ("save_interval_minutes",), " minutes")
    _check_sandbox_outlives_agent(cfg)
    check_off_policy_correction(ro, cfg.algorithm)
    if log.debug_rollout_only and log.debug_train_only:
        raise ArgumentError("--debug-rollout-only and --debug-train-only exclude each other")
    _check_eval(cfg)
    check_sampling_values(cfg)
    if command == "run" and not log.debug_train_only:
        check_group_size(cfg)
    if command == "run" and not log.debug_train_only and cfg.data.prompt_data is None:
        raise ArgumentError("--prompt-data is required (a .jsonl or .parquet file of prompts)")
    if log.debug_train_only and not log.load_debug_rollout_data:
        raise ArgumentError("--debug-train-only needs --load-debug-rollout-data PATTERN")
    _at_least(ro, ("num_rollout", "rollout_batch_size", "n_samples_per_prompt"), 1)
    _at_least(cfg.trainer, ("micro_batch_size",), 1)
    _at_least(eng, ("rollout_num_engines",), 1)
    total = ro.rollout_batch_size * ro.n_samples_per_prompt
    gbs = cfg.trainer.global_batch_size
    if gbs is not None and (gbs < 1 or total % gbs):
        raise ArgumentError(
            f"--global-batch-size {gbs} must divide rollout-batch-size × n-samples-per-prompt = {total}"
        )
    if eng.rollout_cpu_bind is not None and len(eng.rollout_cpu_bind) != eng.rollout_num_engines:
        raise ArgumentError(
            f"--rollout-cpu-bind has {len(eng.rollout_cpu_bind)} values for {eng.rollout_num_engines} engines"
        )
    if cfg.trainer.train_cpus is not None:
        parse_cpu_list(cfg.trainer.train_cpus)
    _at_least(cfg.trainer, ("manual_gc_interval",), 0)
    if cfg.trainer.manual_gc_interval and not cfg.trainer.manual_gc:
        raise ArgumentError(
            f"--manual-gc-interval {cfg.trainer.manual_gc_interval} takes effect only with --manual-gc (automatic "
            "collection stays on without it)"
        )
    if not -20 <= cfg.cluster.ray_worker_niceness <= 19:
        raise ArgumentError(
            f"--ray-worker-niceness must be in -20 … 19 (nice(2)), got {cfg.cluster.ray_worker_niceness}"
        )
    _at_least(eng, ("rollout_max_engine_restarts", "rollout_max_request_retries"), 0)
    if eng.rollout_engine_restart_backoff < 0:
        raise ArgumentError(
            f"--rollout-engine-restart-backoff must be >= 0, got {eng.rollout_engine_restart_backoff:g}"
        )
    _positive(eng, ("rollout_health_check_interval", "rollout_engine_hang_timeout"))
    if (eng.vllm_router_ip is None) != (eng.vllm_router_port is None):
        raise ArgumentError("--vllm-router-ip and --vllm-router-port go together")
    if log.use_wandb and importlib.util.find_spec("wandb") is None:
        raise ArgumentError("--use-wandb needs the wandb package: pip install 'vime[wandb]'")
    if cfg.cluster.colocate and ro.loop != "sync":
        raise ArgumentError(f"--colocate needs --loop sync: with --loop {ro.loop} generation overlaps training")
    _check_external_engines(cfg)
    _placed_engines(cfg)
    try:
        check_algorithm_config(cfg.algorithm)
        check_overlong_config(ro)
        check_lr_schedule_config(cfg.trainer)
    except ValueError as e:
        raise ArgumentError(str(e)) from None
    _check_lora(cfg)


def _check_external_engines(cfg: RunConfig) -> None:
    """``--rollout-external`` with ``--rollout-external-engine-addrs HOST:PORT ...`` (slime's flags): the flags that
    start, place or restart engines have nothing to act on, and LoRA serving is not attached to running engines.

    :raises ArgumentError: one flag without the other, an address that is not ``HOST:PORT``, or a flag that
        conflicts (named).
    """
    eng = cfg.engine
    addrs = eng.rollout_external_engine_addrs or []
    if eng.rollout_external != bool(addrs):
        raise ArgumentError("--rollout-external and --rollout-external-engine-addrs HOST:PORT [...] go together")
    if not addrs:
        return
    for addr in addrs:
        try:
            split_host_port(addr)
        except ValueError as e:
            raise ArgumentError(f"--rollout-external-engine-addrs: {e}") from None
    if len(set(addrs)) != len(addrs):
        raise ArgumentError(f"--rollout-external-engine-addrs names an engine twice: {' '.join(addrs)}")
    conflicts = [
        (cfg.cluster.rollout_num_gpus, "--rollout-num-gpus (the external engines' GPUs are not vime's to place)"),
        (eng.rollout_num_engines not in (1, len(addrs)), "--rollout-num-engines (the engine count is the addresses')"),
        (cfg.cluster.colocate, "--colocate (vime cannot put engines it did not start to sleep)"),
        (cfg.lora.enabled, "--lora-rank (the adapters are loaded into engines vime starts with LoRA serving)"),
        (bool(eng.vllm_args), f"the --vllm-* flags ({' '.join(eng.vllm_args)}; set them where the engines start)"),
        (eng.rollout_cpu_bind is not None, "--rollout-cpu-bind (set VLLM_CPU_OMP_THREADS_BIND where they start)"),
        (cfg.logging.debug_train_only, "--debug-train-only (it generates nothing)"),
    ]
    for conflict, what in conflicts:
        if conflict:
            raise ArgumentError(f"--rollout-external: {what} does not apply to engines vime does not start")


def _placed_engines(cfg: RunConfig) -> int:
    """The engine count the placement flags give (0 without ``--rollout-num-gpus``).

    :raises ArgumentError: the placement planner's refusal.
    """
    try:
        return check_resource_flags(ResourceFlags.from_config(cfg.cluster))
    except PlacementError as e:
        raise ArgumentError(str(e)) from None


def derive_flags(args: argparse.Namespace, cfg: RunConfig) -> None:
    """Set the flags that follow from others, on the parsed Namespace (``cfg``: the checked tree built from it):
    ``--eval-reward`` (default ``--reward``), ``--eval-set-sampling-params`` as ``{NAME: fields}``,
    ``--eval-set-reward`` as ``{NAME: reward}``, the engine count
    from ``--rollout-num-gpus``, ``--update-weight-disk-dir`` (default ``OUTPUT_DIR/weights``), and the CPU binding
    of one CPU engine."""
    if args.eval_reward is None:
        args.eval_reward = args.reward
    args.eval_set_sampling_params = _eval_set_sampling(cfg.eval)
    args.eval_set_reward = eval_set_rewards(cfg.eval)
    engines = _placed_engines(cfg)
    if args.rollout_num_gpus and engines:  # engines = --rollout-num-gpus / --rollout-num-gpus-per-engine (slime)
        args.rollout_num_engines = engines
    if args.rollout_external_engine_addrs:  # --rollout-external: one engine per address
        args.rollout_num_engines = len(args.rollout_external_engine_addrs)
    if args.update_weight_disk_dir is None:
        args.update_weight_disk_dir = args.output_dir / "weights"
    cores = sorted(os.sched_getaffinity(0))
    if (
        args.rollout_cpu_bind is None
        and not args.rollout_external
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


def _check_lora(cfg: RunConfig) -> None:
    """The LoRA flags against the chosen weight-sync strategy and trainer (their classes' ``CARRIES_LORA`` and
    ``SUPPORTS_LORA``; an unknown name is left to the run's own resolution, which names it)."""
    lora = cfg.lora
    classes: list[type | None] = [None, None]
    if lora.enabled:
        from vime_core.plugins.manager import get_plugins
        from vime_core.plugins.registry import RegistryError

        for i, (kind, name) in enumerate((("weight_sync", lora.weight_sync), ("trainer", lora.trainer))):
            try:
                classes[i] = get_plugins().resolve(kind, name)
            except RegistryError:
                pass
    try:
        check_lora_config(lora, classes[0], classes[1] if not cfg.logging.debug_rollout_only else None)
    except LoraFlagError as e:
        raise ArgumentError(str(e)) from None


def _check_sandbox_outlives_agent(cfg: RunConfig) -> None:
    """``--generate coding_agent`` runs the agent and then collects and scores its workspace in the same sandbox:
    a sandbox that lives no longer than the agent expires first, and every episode would fail.

    :raises ArgumentError: ``--sandbox-wall-time`` (when not 0 = unlimited) is not above ``--agent-wall-time``.
    """
    sandbox_s, agent_s = cfg.sandbox.sandbox_wall_time, cfg.coding_agent.agent_wall_time
    if cfg.rollout.generate != "coding_agent" or not sandbox_s or agent_s is None:
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


def check_off_policy_correction(rollout: RolloutConfig, algorithm: AlgorithmConfig) -> None:
    """Refuse an off-policy loop (``--loop one-step-off`` / ``fully-async``) without a correction for the policy
    that generated the tokens: ``--use-tis`` or ``--use-mis`` (importance weights against the engine's log-probs)
    or ``--use-rollout-logprobs`` (the engine's log-probs as the PPO ratio's old policy). Without one, the trainer
    anchors the ratio to its own current policy, one or more versions newer than the sampling policy.

    ``--allow-off-policy-without-correction`` lets the run start anyway, with a warning.

    :raises ArgumentError: naming the loop and the three flags.
    """
    loop = rollout.loop
    if loop not in OFF_POLICY_LOOPS or algorithm.use_tis or algorithm.use_mis or algorithm.use_rollout_logprobs:
        return
    what = (
        f"--loop {loop} trains on tokens generated by an older policy, but none of "
        f"{', '.join(OFF_POLICY_CORRECTIONS)} is set, so the PPO ratio would be anchored to the trainer's current "
        "policy instead of the policy that generated the tokens"
    )
    if not algorithm.allow_off_policy_without_correction:
        raise ArgumentError(
            f"{what}. Add --use-tis (truncated importance sampling, the usual choice), --use-mis or "
            "--use-rollout-logprobs, or pass --allow-off-policy-without-correction to train uncorrected."
        )
    logger.warning("WARNING: %s (--allow-off-policy-without-correction). The updates are biased.", what)
