"""The JSON-lines reader both agent harnesses parse their CLI's stdout with (Claude Code's ``--output-format json``
result, Codex's ``exec --json`` events)."""

import pytest

from vime_core.agent.harness import json_lines

pytestmark = pytest.mark.unit


def test_json_lines_keeps_objects_in_order_and_skips_everything_else():
    stdout = (
        'warning: not json\n  {"type": "thread.started"}  \n{"type": "item.completed", "item": {"text": "hi"}}\n'
        '[1, 2]\n{"type": "cut off\n\n{"type": "turn.completed"}'
    )
    assert json_lines(stdout) == [
        {"type": "thread.started"},
        {"type": "item.completed", "item": {"text": "hi"}},
        {"type": "turn.completed"},
    ]
    assert json_lines("") == []
