"""The fully-async tests' rollout side: ``vime run --loop fully-async`` flags, a generate function that sleeps (slow
and fast prompts, versions tagged per token, failures on demand) and a weight push that reaches zero engines."""

from __future__ import annotations

import asyncio

from tests.support.rollout import manager_with_hooks
from vime_core.cli.arguments import parse_run_args
from vime_core.types import Status
from vime_core.weight_sync.base import WeightUpdate

FAST_S = 0.02  # seconds per generation of a fast prompt
SLOW_FACTOR = 3  # odd-numbered prompts take 3x as long


def async_run_args(tiny_model_dir, tmp_path, **flags):
    """Parsed flags of a fully-async run (batch 4, n 1, max-staleness 1, TIS) plus ``flags``, and the subset to
    apply to :func:`~tests.support.rollout.manager_with_hooks` (everything but its data and plugin choices)."""
    data = tmp_path / "unused.jsonl"
    data.write_text('{"prompt": "p", "label": "x"}\n')
    argv = ["--model", str(tiny_model_dir), "--prompt-data", str(data), "--output-dir", str(tmp_path / "out")]
    argv += ["--loop", "fully-async", "--use-tis", "--rollout-batch-size", "4", "--n-samples-per-prompt", "1"]
    argv += ["--max-staleness", "1", "--train-dtype", "float32", "--micro-batch-size", "4"]
    argv += ["--save-debug-rollout-data", str(tmp_path / "debug" / "rollout_{rollout_id}.pt")]
    for k, v in flags.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    args = parse_run_args(argv)
    skip = {"generate", "reward", "prompt_data", "input_key", "label_key", "metadata_key", "rollout_shuffle"}
    return args, {k: v for k, v in vars(args).items() if k not in skip}


def sleeping_generate(box, fail_once=(), fast_s=FAST_S, untrainable_once=()):
    """Generate function: prompt ``pN`` takes ``fast_s`` seconds (3x for odd N); one token is produced at the start and
    one at the end, each tagged with the engines' version at that moment (a request paused across a weight update
    mixes versions). Prompts in ``fail_once`` raise the first time they are generated; prompts in
    ``untrainable_once`` complete the first time with no trainable token (``loss_mask`` 0)."""
    failed: set[str] = set()
    untrained: set[str] = set()

    async def gen(args, sample, sampling_params):
        m = box["m"]
        no = int(sample.prompt[1:])
        box.setdefault("calls", []).append(sample.prompt)
        if sample.prompt in fail_once and sample.prompt not in failed:
            failed.add(sample.prompt)
            raise RuntimeError(f"engine error on {sample.prompt}")
        trainable = sample.prompt not in untrainable_once or sample.prompt in untrained
        untrained.add(sample.prompt)
        sample.tokens = [1, 2, 3 + no]
        sample.append_response_tokens([5], trainable=trainable, log_probs=[-0.5], weight_version=m.weight_version)
        await asyncio.sleep(fast_s * (SLOW_FACTOR if no % 2 else 1))
        sample.append_response_tokens([6], trainable=trainable, log_probs=[-0.6], weight_version=m.weight_version)
        sample.response = "x"
        sample.status = Status.COMPLETED
        return sample

    return gen


def async_manager(tiny_model_dir, tmp_path, gen, overrides):
    """A manager over 8 prompts generating with ``gen(box)``; ``box["m"]`` is the manager (the generate function
    reads its weight version) and ``box["calls"]`` the prompts generated, in order."""
    box: dict = {}
    m = manager_with_hooks(tiny_model_dir, tmp_path, generate=gen(box), num_prompts=8, **overrides)
    box["m"] = m
    return m, box


def push_update(m, version):
    """Push weight version ``version`` to ``m``'s engines (none here: only the bookkeeping runs)."""
    return m.update_weights(WeightUpdate(version, {"path": str(m.engine_config.update_weight_disk_dir / "none")}))
