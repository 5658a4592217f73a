"""A generate function for end-to-end tests of code-running rollouts with a tiny random model.

It is the real ``multi_turn`` generate function (:mod:`vime_core.rollout.generators.multi_turn`: the episode's sandbox
from ``--sandbox``/``--sandbox-*``, the shell tool of ``--multi-turn-sandbox-tool``, tool results as non-trainable
tokens), with one change: every engine call is constrained by vLLM structured outputs (a regex) to be exactly one call
of that shell tool running :data:`FORCED_COMMAND`. A random model then exercises the sandbox deterministically: with
``--multi-turn-max-turns 2`` each episode runs the command once, and its result (``exit code: 0\\nstdout:\\n42\\n``) is
in ``sample.metadata["tool_calls"]``.

Use: ``vime run --generate vime_core.testing.forced_tool_call:generate --multi-turn-sandbox-tool bash --sandbox NAME
--multi-turn-max-turns 2 ...`` (the engine must support ``structured_outputs``, as vLLM does).
"""

from __future__ import annotations

import json
from typing import Any

from vime_core.config.context import PluginContext, takes_context
from vime_core.rollout.generators.multi_turn import generate as multi_turn
from vime_core.types import Sample

FORCED_COMMAND = "python3 -c 'print(6*7)'"
_REGEX_SPECIAL = set(".^$*+?{}[]|()\\")


def forced_call_regex(tool: str, command: str = FORCED_COMMAND) -> str:
    """The regex matching exactly the hermes-style call ``<tool_call>\\n{json}\\n</tool_call>`` of ``tool``."""
    call = "<tool_call>\n" + json.dumps({"name": tool, "arguments": {"command": command}}) + "\n</tool_call>"
    return "".join("\\n" if c == "\n" else f"\\{c}" if c in _REGEX_SPECIAL else c for c in call)


@takes_context
async def generate(ctx: PluginContext, sample: Sample, sampling_params: dict[str, Any]) -> Sample:
    """``multi_turn``'s generate with every turn forced to call ``--multi-turn-sandbox-tool`` with
    :data:`FORCED_COMMAND`.

    :raises ValueError: ``--multi-turn-sandbox-tool`` is not set.
    """
    tool = ctx.multi_turn.multi_turn_sandbox_tool
    if not tool:
        raise ValueError("vime_core.testing.forced_tool_call needs --multi-turn-sandbox-tool NAME")
    constrained = {**sampling_params, "structured_outputs": {"regex": forced_call_regex(tool)}}
    return await multi_turn(ctx, sample, constrained)
