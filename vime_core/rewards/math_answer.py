"""The ``math`` reward: the final ``\\boxed{}`` answer, checked for mathematical equivalence with math-verify.

:func:`math_reward` scores 1.0 when the last ``\\boxed{}`` outside any thinking block is equivalent to the label
(:func:`verify_answer`, math-verify's ``parse`` + ``verify``), else 0.0; the check runs in a worker process killed
at ``--math-verify-timeout`` (:func:`verify_with_timeout`), so sympy cannot stall the rollout. The rule:
docs/rewards.md, "math".
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import logging
import multiprocessing
import re
import threading

import pebble

from vime_core.config.context import PluginContext, takes_context
from vime_core.failures import FailureCause, SampleFailure
from vime_core.rewards.simple import strip_thinking
from vime_core.types import Sample

_BOX_OPENERS = ("\\boxed{", "\\fbox{")
_LAST_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?(?:/\d+)?")
_pool: pebble.ProcessPool | None = None
_pool_workers = 0
_pool_lock = threading.Lock()


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` / ``\\fbox{...}`` in ``text`` (nested braces balanced), or ``None``
    when there is none or its braces never close."""
    starts = [(text.rfind(o), o) for o in _BOX_OPENERS]
    start, opener = max(starts)
    if start < 0:
        return None
    depth, i = 1, start + len(opener)
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return None


def extract_math_answer(response: str, last_number_fallback: bool = False) -> str | None:
    """The answer of a response under the rule of the module docstring (steps 1-2), or ``None``."""
    text = strip_thinking(response.replace("\u2212", "-"))
    answer = last_boxed(text)
    if answer is None and last_number_fallback:
        numbers = _LAST_NUMBER.findall(text)
        answer = numbers[-1] if numbers else None
    return answer


def verify_answer(answer: str, gold: str) -> bool:
    """math-verify equivalence of ``answer`` (a boxed content) and ``gold`` (a label, boxed or not), in this process
    and without a time limit (math-verify's own signal-based limit only works on a main thread); the reward calls
    it in a worker process instead.

    :raises ValueError: ``gold`` does not parse as a mathematical answer (a data error).
    """
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    config = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]
    gold = gold.replace("\u2212", "-")
    gold_text = gold if "\\boxed" in gold else f"\\boxed{{{gold}}}"
    parsed_gold = parse(gold_text, extraction_config=config, parsing_timeout=None)
    if not parsed_gold:
        raise ValueError(f"math reward: the label {gold!r} is not a mathematical answer math-verify can parse")
    parsed = parse(f"\\boxed{{{answer}}}", extraction_config=config, parsing_timeout=None)
    return bool(parsed) and bool(verify(parsed_gold, parsed, timeout_seconds=None))


def _init_worker() -> None:
    """Worker start-up: import math-verify (and sympy) before any task, so that the import time does not count
    against ``--math-verify-timeout``; silence its per-call warnings."""
    import math_verify  # noqa: F401 - the import is the point

    logging.getLogger("math_verify").setLevel(logging.ERROR)


def _get_pool(workers: int) -> pebble.ProcessPool:
    """The shared worker pool (spawned processes: safe in a threaded parent such as a Ray actor)."""
    global _pool, _pool_workers
    with _pool_lock:
        if _pool is None or not _pool.active or _pool_workers != workers:
            if _pool is not None:
                _pool.stop()
            _pool = pebble.ProcessPool(
                max_workers=workers, initializer=_init_worker, context=multiprocessing.get_context("spawn")
            )
            _pool_workers = workers
        return _pool


@atexit.register
def shutdown_pool() -> None:
    """Stop the verification workers (also run at interpreter exit)."""
    global _pool
    with _pool_lock:
        if _pool is not None:
            _pool.stop()
            _pool.join(timeout=5)
            _pool = None


async def verify_with_timeout(answer: str, gold: str, timeout_s: float, workers: int = 2) -> bool:
    """:func:`verify_answer` in a worker process, killed after ``timeout_s`` seconds.

    :raises SampleFailure: ``reward_timeout`` at the limit, ``reward_error`` if the worker died.
    :raises ValueError: the label does not parse.
    """
    future = _get_pool(workers).schedule(verify_answer, args=(answer, gold), timeout=timeout_s)
    try:
        return await asyncio.wrap_future(future)
    except concurrent.futures.TimeoutError as e:
        raise SampleFailure(
            FailureCause.REWARD_TIMEOUT,
            f"math-verify did not finish within {timeout_s:g} s on answer {answer[:200]!r} (--math-verify-timeout)",
        ) from e
    except pebble.ProcessExpired as e:
        raise SampleFailure(FailureCause.REWARD_ERROR, f"the math-verify worker died: {e}") from e
    except asyncio.CancelledError:
        future.cancel()  # pebble stops the worker running it
        raise


@takes_context
async def math_reward(ctx: PluginContext, sample: Sample) -> float:
    """1.0 if the last boxed answer of ``sample.response`` is equivalent to ``sample.label``, else 0.0 (the rule
    is in the module docstring).

    Flags (``ctx.reward``, its :class:`~vime_core.config.RewardConfig`): ``--math-verify-timeout`` (seconds),
    ``--math-verify-workers``, ``--math-last-number-fallback``.

    :raises ValueError: the sample has no label, or the label does not parse (the sample fails as ``reward_error``).
    :raises SampleFailure: ``reward_timeout`` when verification exceeds its limit.
    """
    cfg = ctx.reward
    if sample.label is None:
        raise ValueError(f"math reward: sample {sample.group_index}/{sample.index} has no label (--label-key)")
    answer = extract_math_answer(sample.response or "", cfg.math_last_number_fallback)
    if answer is None or not answer.strip():
        return 0.0
    return float(
        await verify_with_timeout(answer, str(sample.label), cfg.math_verify_timeout, cfg.math_verify_workers)
    )
