"""Simple rule rewards."""

from __future__ import annotations

import argparse

from vime_core.types import Sample


def normalize_answer(text: str) -> str:
    """Lower-case, strip whitespace and a trailing period."""
    return text.strip().rstrip(".").strip().lower()


async def exact_match(args: argparse.Namespace, sample: Sample) -> float:
    """1.0 if the response equals the label after :func:`normalize_answer`, else 0.0.

    :raises ValueError: if the sample has no label.
    """
    if sample.label is None:
        raise ValueError(f"exact_match: sample {sample.group_index}/{sample.index} has no label (--label-key)")
    return float(normalize_answer(sample.response) == normalize_answer(str(sample.label)))
