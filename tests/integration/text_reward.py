"""A reward computed from the response text alone, for tests that check rewards come from the engine's text."""

from __future__ import annotations

import argparse

from vime_core.types import Sample


async def text_length_mod3(args: argparse.Namespace, sample: Sample) -> float:
    """``len(sample.response) % 3`` as a float: varies between samples (so GRPO's advantages are not all 0) and is
    0 only for some texts, never for all of them because of an empty response."""
    return float(len(sample.response) % 3)
