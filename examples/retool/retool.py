"""ReTool on vime: a code interpreter as a tool, run in the sandbox backend of the user's choice (``--sandbox``,
``local`` by default), inside the built-in ``multi_turn`` loop::

    generate: retool:generate                       # this module, on PYTHONPATH: one sandbox per episode
    multi_turn_tools: [retool:code_interpreter]     # the tool the model calls
    multi_turn_tool_parser: hermes                  # <tool_call>{"name": "code_interpreter", ...}</tool_call>
    sandbox: local                                  # or docker, localvm, e2b, modal (their plugins)

:func:`generate` opens one sandbox of ``--sandbox`` per episode (its limits: ``--sandbox-*``) and runs the built-in
``multi_turn`` generate function in it; every :func:`code_interpreter` call of that episode runs ``python3`` on the
code in that sandbox (files written by one call are there for the next), and its output comes back as the tool
turn (context tokens, mask 0). The final ``Answer: N`` is rewarded (``--reward reasoning_gym``). After ReTool (Feng
et al. 2025, arXiv:2504.11536): interleaved code execution in RL rollouts, the interpreter's output in the
trajectory but not trained.
"""

from __future__ import annotations

import contextvars
from typing import Any

from vime_core.config.context import PluginContext
from vime_core.plugins.manager import get_plugins
from vime_core.types import Sample

#: seconds one code run may take (then it is killed and the model sees the timeout)
CODE_TIMEOUT_S = 10.0
#: characters of output the model gets back (the rest is cut; --multi-turn-max-tool-output-tokens also applies)
MAX_OUTPUT_CHARS = 2000

_SANDBOX: contextvars.ContextVar[Any] = contextvars.ContextVar("retool_sandbox")


def format_result(exit_code: int, stdout: str, stderr: str, timed_out: bool) -> str:
    """What the model sees of one run: stdout; then stderr and the exit code when the run failed; ``(no output)``
    when it printed nothing and succeeded. Cut to :data:`MAX_OUTPUT_CHARS` characters."""
    if timed_out:
        text = f"{stdout}Error: timed out after {CODE_TIMEOUT_S:g} s"
    elif exit_code != 0:
        text = f"{stdout}{stderr}exit code {exit_code}"
    else:
        text = stdout if stdout else "(no output)"
    text = text.rstrip("\n")
    return text if len(text) <= MAX_OUTPUT_CHARS else text[:MAX_OUTPUT_CHARS] + "\n[output truncated]"


async def code_interpreter(code: str) -> str:
    """Run Python 3 code and return what it printed (use print to see results)."""
    sb = _SANDBOX.get(None)
    if sb is None:
        raise RuntimeError(
            "code_interpreter runs inside retool:generate, which opens the episode's sandbox "
            "(--generate retool:generate)"
        )
    r = await sb.exec(["python3", "-I", "-"], stdin=code.encode(), timeout=CODE_TIMEOUT_S)
    return format_result(r.exit_code, r.stdout, r.stderr, r.timed_out)


async def generate(ctx: PluginContext, sample: Sample, sampling_params: dict[str, Any]) -> Sample:
    """One ``multi_turn`` episode with :func:`code_interpreter` bound to a fresh sandbox of ``--sandbox``.

    :raises SandboxInfraError: the sandbox could not be created (the rollout manager marks the sample failed).
    """
    backend = get_plugins().resolve("sandbox", ctx.sandbox.sandbox)
    multi_turn = get_plugins().resolve("generate", "multi_turn")
    async with backend.from_context(ctx) as sb:
        token = _SANDBOX.set(sb)
        try:
            out = await multi_turn(ctx, sample, sampling_params)
        finally:
            _SANDBOX.reset(token)
    out.metadata["sandbox"] = ctx.sandbox.sandbox
    return out
