"""Helpers for exact checks on multi-turn samples (used by vime's tests of ``multi_turn`` and the agent gateway)."""

from __future__ import annotations

from typing import Any

from vime_core.types import Sample


def mask_runs(tokenizer: Any, sample: Sample) -> list[tuple[int, str]]:
    """The response as runs of equal loss mask: ``[(mask, decoded text), ...]`` (special tokens kept).

    :param tokenizer: the tokenizer that made ``sample.tokens``.
    """
    runs: list[tuple[int, list[int]]] = []
    for m, t in zip(sample.loss_mask, sample.tokens[sample.prompt_length :], strict=True):
        if not runs or runs[-1][0] != m:
            runs.append((m, []))
        runs[-1][1].append(t)
    return [(m, tokenizer.decode(ids)) for m, ids in runs]


def chain_mask(calls: list[Any]) -> list[int]:
    """The loss mask of a sample built from a chain of engine calls, each prompt extending the previous prompt and
    output: 1 on every output token, 0 on everything between them.

    :param calls: engine calls with ``prompt_ids`` and ``output.token_ids``
        (:class:`~vime_core.agent.responders.EngineCall`), in order.
    """
    mask: list[int] = []
    held = len(calls[0].prompt_ids)
    for c in calls:
        mask += [0] * (len(c.prompt_ids) - held) + [1] * len(c.output.token_ids)
        held = len(c.prompt_ids) + len(c.output.token_ids)
    return mask
