"""Why a model turn's tool call did not parse, and the per-step counts of it.

Every parser reports each ill-formed call with a :class:`ToolParseFailure` reason
(:attr:`~vime_core.agent.tool_parsers.ParseResult.error_reasons`, counted by
:meth:`~vime_core.agent.tool_parsers.ParseResult.failure_counts`); the agent gateway and ``multi_turn`` record the
counts on their samples (``metadata["tool_parse_failures"]``) and :func:`tool_parse_metrics` sums a step's samples
into ``agent/tool_parse_failures/<reason>``.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Iterable

from vime_core.types import Sample, Status


class ToolParseFailure(str, enum.Enum):
    """Why (part of) a model turn's tool call did not parse as written; the value is the metric suffix
    (``agent/tool_parse_failures/<value>``, :func:`tool_parse_metrics`)."""

    NOT_A_CALL = "not_a_call"  # the start tag is not followed by a call (no JSON object, no <function=NAME>)
    BAD_JSON = "bad_json"  # the call's JSON does not decode
    BAD_CALL = "bad_call"  # decoded, but no name or arguments that are not an object
    TRAILING_TEXT = "trailing_text"  # text between the call and its end tag
    UNCLOSED = "unclosed"  # a call still open at the end of the turn (e.g. cut by a stop string)
    VALUE_TYPE = "value_type"  # an argument kept as raw text: it does not fit the tool's schema (the call is kept)


def tool_parse_metrics(samples: Iterable[Sample]) -> dict[str, float]:
    """Parse failures of one step's samples, summed by reason: ``agent/tool_parse_failures/<reason>`` for every
    :class:`ToolParseFailure` (0.0 when none) and for any other reason a custom parser reported.

    Each sample counts the turns it holds (``metadata["tool_parse_failures"]``, reason → count: the agent gateway
    writes it per trajectory segment, the ``multi_turn`` generate function per episode), so a turn counts once. A
    ``failed`` sample without the key (a placeholder that holds no turn) adds nothing.

    :raises KeyError: a sample that is not ``failed`` lacks ``metadata["tool_parse_failures"]``.
    """
    counts = Counter({r.value: 0 for r in ToolParseFailure})
    for s in samples:
        if s.status == Status.FAILED and "tool_parse_failures" not in s.metadata:
            continue
        counts.update(s.metadata["tool_parse_failures"])
    return {f"agent/tool_parse_failures/{r}": float(n) for r, n in counts.items()}
