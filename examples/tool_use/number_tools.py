"""The tool_use example's own tools, registered on import (``--multi-turn-tools number_tools``).

Exact integer arithmetic from :mod:`math`; arguments arrive as JSON numbers (or numeric strings, which some models
write) and are converted with ``int``.
"""

from __future__ import annotations

import math

from vime_core.rollout.generators.tools import register_tool


@register_tool
def lcm(a: int, b: int) -> str:
    """Least common multiple of two integers."""
    return str(math.lcm(int(a), int(b)))


@register_tool
def gcd(a: int, b: int) -> str:
    """Greatest common divisor of two integers."""
    return str(math.gcd(int(a), int(b)))
