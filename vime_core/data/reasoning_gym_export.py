"""Write reasoning-gym problems as vime prompt data (jsonl) that :mod:`vime_core.rewards.reasoning_gym` can score.

Each row is ``{"prompt": [chat messages], "label": answer, "metadata": {"task", "rg_entry", "rg_config"}}``; vime
renders ``prompt`` with the tokenizer's chat template (``add_generation_prompt=True``).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vime_core.rewards.reasoning_gym import score

logger = logging.getLogger("vime.data")

#: System prompt for small instruct models (measured on SmolLM2-135M-Instruct, see examples/quickstart/README.md):
#: a fixed one-line answer format that :func:`vime_core.rewards.reasoning_gym.extract_answer` parses.
DEFAULT_SYSTEM_PROMPT = (
    "You are a calculator. Reply with one line of the form 'Answer: N' where N is the final number. Do not explain."
)

#: Worked examples put before the question as earlier chat turns (user, assistant).
DEFAULT_FEW_SHOT: tuple[tuple[str, str], ...] = ()


def build_messages(
    question: str,
    system_prompt: str | None = DEFAULT_SYSTEM_PROMPT,
    few_shot: Sequence[tuple[str, str]] = DEFAULT_FEW_SHOT,
) -> list[dict[str, str]]:
    """Chat messages for one question: optional system prompt, few-shot (user, assistant) turns, then the question."""
    messages: list[dict[str, str]] = []
    if system_prompt:
        messages.append({"role": "system", "content": system_prompt})
    for user, assistant in few_shot:
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
    messages.append({"role": "user", "content": question})
    return messages


def to_jsonable(obj: Any) -> Any:
    """Recursively convert a reasoning-gym entry to JSON types (tuples → lists, sets → sorted lists, other → str)."""
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, (set, frozenset)):
        return sorted((to_jsonable(v) for v in obj), key=repr)
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    return str(obj)


def export_reasoning_gym(
    task: str,
    size: int,
    seed: int,
    out: str | os.PathLike[str],
    config: dict[str, Any] | None = None,
    *,
    system_prompt: str | None = DEFAULT_SYSTEM_PROMPT,
    few_shot: Sequence[tuple[str, str]] = DEFAULT_FEW_SHOT,
) -> Path:
    """Generate ``size`` problems of reasoning-gym ``task`` and write them as jsonl.

    Args:
        task: reasoning-gym dataset name (e.g. ``"chain_sum"``).
        size: number of rows.
        seed: dataset seed (same seed and config → same rows).
        out: output ``.jsonl`` path (parent directories are created; written via a temp file and rename).
        config: extra dataset config (e.g. ``{"min_terms": 2, "max_terms": 2}``), stored in each row as
            ``metadata.rg_config`` so the reward rebuilds the same dataset.
        system_prompt: system message, or ``None`` for none.
        few_shot: (user, assistant) example turns placed before the question.

    Returns:
        The path written.

    Raises:
        ValueError: unknown task, bad config, or ``size < 1``.
    """
    import reasoning_gym
    from reasoning_gym.factory import DATASETS

    if size < 1:
        raise ValueError(f"size must be >= 1, got {size}")
    if task not in DATASETS:
        raise ValueError(f"unknown reasoning-gym task {task!r}; known tasks: {', '.join(sorted(DATASETS))}")
    rg_config = to_jsonable(dict(config or {}))
    try:
        dataset = reasoning_gym.create_dataset(task, **{**rg_config, "seed": seed, "size": size})
    except (TypeError, AssertionError) as exc:
        raise ValueError(f"bad config for reasoning-gym task {task!r}: {rg_config}: {exc}") from exc

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    not_self_consistent = 0
    with open(tmp, "w") as fh:
        for i in range(size):
            entry = to_jsonable(dataset[i])
            # The stored entry must still score its own answer as correct after the JSON round trip.
            if score(task, entry["answer"], entry, rg_config) != 1.0:
                not_self_consistent += 1
            row = {
                "prompt": build_messages(entry["question"], system_prompt, few_shot),
                "label": str(entry["answer"]),
                "metadata": {"task": task, "rg_entry": entry, "rg_config": rg_config},
            }
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")
    os.replace(tmp, out)
    if not_self_consistent:
        logger.warning("%s: %d of %d entries do not score their own answer as 1.0", task, not_self_consistent, size)
    logger.info("wrote %d %s rows (seed %d) to %s", size, task, seed, out)
    return out
