"""Reward from reasoning-gym's own verifier (``score_answer``) for rows written by
:func:`vime_core.data.reasoning_gym_export.export_reasoning_gym`.

A row's ``metadata`` carries ``task`` (the reasoning-gym dataset name), ``rg_entry`` (the generated entry, which
``score_answer`` needs) and optionally ``rg_config`` (the dataset config used to generate it). The answer is pulled out
of the free-form response by :func:`extract_answer`, then scored by the task's dataset object, rebuilt by name with
``reasoning_gym.create_dataset`` and cached per (task, config).
"""

from __future__ import annotations

import functools
import json
import logging
import re
from collections.abc import Callable
from typing import Any

from vime_core.config.context import takes_context

logger = logging.getLogger("vime.rewards")

_NUMBER = r"[-+]?\d+(?:,\d{3})*(?:\.\d+)?"
_TAG_RE = re.compile(r"<answer>\s*(.*?)\s*</answer>", re.DOTALL | re.IGNORECASE)
_BOXED_RE = re.compile(r"\\boxed\{([^{}]*)\}")
# "Answer: 7", "**Final answer:** 7", "the answer to the problem is 7", "answer = 7": from "answer" to the first
# ":", "=" or "is" on the same line, then the rest of the line (the last such phrase in the response wins)
_ANSWER_LINE_RE = re.compile(r"\banswer\b[^\n]*?(?:\bis\b|:|=)[ \t]*(?:\*\*)?[ \t]*([^\n]*)", re.IGNORECASE)
_BARE_NUMBER_RE = re.compile(rf"\s*\**\s*({_NUMBER})\s*\**\s*\.?\s*")
_EQUALS_NUMBER_RE = re.compile(rf"=\s*\**\s*({_NUMBER})(?![\d.]*\s*[-+*/x×÷])")
_STRIP_CHARS = " \t\r\n*`$\"'"


def _clean(text: str) -> str | None:
    """Strip markdown/latex decoration and trailing punctuation; for ``a + b = c`` keep ``c``."""
    text = text.strip(_STRIP_CHARS)
    if "=" in text:
        text = text.rsplit("=", 1)[1].strip(_STRIP_CHARS)
    text = text.rstrip(".,;:!)").strip(_STRIP_CHARS)
    # "7 apples" / "7 because ..." -> "7" when the text starts with a number
    m = re.match(rf"({_NUMBER})(?=[\s.,;:!)]|$)", text)
    if m:
        text = m.group(1)
    return text or None


def extract_answer(response: str) -> str | None:
    """Pull the final answer out of a model response.

    Tried in order, the last match in the response winning each time: ``<answer>X</answer>``, ``\\boxed{X}``, a line
    with ``Answer: X`` / ``the answer is X`` / ``answer = X`` (X is cut after ``=`` so that ``Answer: 3 + 4 = 7``
    gives ``7``, and trailing punctuation or markdown is dropped), a response that is just a number, and finally the
    number after the last ``=`` (``3 + 4 = 7``). Numbers elsewhere in free text are not guessed at, so rambling that
    happens to contain the result earns nothing.

    Args:
        response: the generated text (no prompt).

    Returns:
        The answer string, or ``None`` when nothing answer-like is found (reasoning-gym scores ``None`` as 0).
    """
    if not response:
        return None
    for regex in (_TAG_RE, _BOXED_RE):
        matches = regex.findall(response)
        if matches:
            return _clean(matches[-1])
    matches = [m for m in _ANSWER_LINE_RE.findall(response) if m.strip(_STRIP_CHARS)]
    if matches:
        answer = _clean(matches[-1])
        if answer is not None:
            return answer
    bare = _BARE_NUMBER_RE.fullmatch(response)
    if bare:
        return bare.group(1)
    results = _EQUALS_NUMBER_RE.findall(response)
    return results[-1] if results else None


@functools.lru_cache(maxsize=64)
def _score_fn(task: str, config_json: str) -> Callable[[str | None, dict[str, Any]], float]:
    """The bound ``score_answer`` of ``task``'s dataset built with the given config (JSON, cached)."""
    import reasoning_gym
    from reasoning_gym.factory import DATASETS

    if task not in DATASETS:
        raise ValueError(f"unknown reasoning-gym task {task!r}; known tasks: {', '.join(sorted(DATASETS))}")
    config = json.loads(config_json)
    config.setdefault("size", 1)
    try:
        dataset = reasoning_gym.create_dataset(task, **config)
    except TypeError:  # a config class without `size`
        config.pop("size")
        dataset = reasoning_gym.create_dataset(task, **config)
    return dataset.score_answer


def score(task: str, answer: str | None, entry: dict[str, Any], config: dict[str, Any] | None = None) -> float:
    """Score ``answer`` with reasoning-gym's ``score_answer`` for ``task`` (0.0 … 1.0).

    Raises:
        ValueError: ``task`` is not a registered reasoning-gym dataset.
    """
    fn = _score_fn(task, json.dumps(config or {}, sort_keys=True))
    try:
        return float(fn(answer, entry))
    except Exception as exc:  # a verifier crashing on a malformed answer is the answer's fault
        logger.warning("reasoning-gym %s score_answer raised on answer %r: %r; scoring 0.0", task, answer, exc)
        return 0.0


@takes_context
async def reasoning_gym_reward(ctx: Any, sample: Any) -> float:
    """Reward one sample with reasoning-gym's verifier for the task named in its metadata.

    Args:
        ctx: the run's configuration (unused).
        sample: has ``response`` (str) and ``metadata`` (dict with ``task``, ``rg_entry`` and optionally
            ``rg_config``).

    Returns:
        ``score_answer(extract_answer(sample.response), rg_entry)``, in [0, 1] (1.0 = correct).

    Raises:
        ValueError: ``sample.metadata`` is not a dict or lacks ``task`` or ``rg_entry``, or the task is unknown.
    """
    metadata = getattr(sample, "metadata", None)
    if not isinstance(metadata, dict):
        raise ValueError(f"reasoning_gym reward needs sample.metadata as a dict, got {type(metadata).__name__}")
    for key in ("task", "rg_entry"):
        if key not in metadata:
            raise ValueError(
                f"reasoning_gym reward: sample.metadata is missing key {key!r} (present: {sorted(metadata)}); "
                "write the data with vime_core.data.reasoning_gym_export.export_reasoning_gym"
            )
    entry = metadata["rg_entry"]
    if not isinstance(entry, dict) or "answer" not in entry:
        raise ValueError("reasoning_gym reward: sample.metadata['rg_entry'] must be a dict with an 'answer' key")
    answer = extract_answer(getattr(sample, "response", "") or "")
    return score(metadata["task"], answer, entry, metadata.get("rg_config"))
