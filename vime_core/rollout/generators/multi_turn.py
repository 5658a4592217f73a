"""The ``multi_turn`` generate function: a tool loop driven from token ids (``--generate multi_turn``).

Per episode (one :class:`~vime_core.types.Sample`): generate a turn through the router (its tokens trained, end of
turn included), parse tool calls, run the tools, append their results as non-trainable tokens
(:func:`bridge_text`: the chat template's own text between turns), repeat until no call, length, abort, the turn
limit or the response budget. No token is ever re-tokenised. The steps, flags and metadata: docs/agents.md,
"multi_turn".
"""

from __future__ import annotations

import contextlib
import functools
import logging
import uuid
from pathlib import Path
from typing import Any

from vime_core.agent.apis import parse_chat
from vime_core.agent.chat import ChatMessage, ChatRenderer, ModelTurn
from vime_core.agent.responders import engine_versions
from vime_core.agent.tool_parse_failures import tool_parse_metrics
from vime_core.agent.tool_parsers import ToolCall, parse_with_tools
from vime_core.config import MultiTurnConfig
from vime_core.config.context import PluginContext, rollout_engines, takes_context
from vime_core.data.images import ImageDataError
from vime_core.data.prompt_checks import encode_sample_prompt
from vime_core.data.vision_prompt import (
    expand_image_pads,
    image_placeholder_text,
    image_token_counts,
    image_token_id,
    messages_as_text,
    processor_for,
    tool_result_parts,
)
from vime_core.plugins.manager import get_plugins
from vime_core.rollout.generators.default import FINISH_TO_STATUS
from vime_core.rollout.generators.tools import Tool, load_tools
from vime_core.types import Sample, Status

logger = logging.getLogger("vime.rollout")

# seconds a sandboxed shell call may take beyond its timeout (the sandbox kills it at the timeout; this bounds a
# sandbox that stops answering, e.g. a stuck SSH connection)
SANDBOX_TOOL_GRACE_S = 30.0


@functools.lru_cache(maxsize=8)
def _template_file(path: str) -> str:
    return Path(path).read_text()


_RENDERERS: dict[tuple[int, str | None, str], ChatRenderer] = {}


def _renderer(tokenizer: Any, cfg: MultiTurnConfig) -> ChatRenderer:
    path = cfg.multi_turn_chat_template
    parser = cfg.multi_turn_tool_parser
    key = (id(tokenizer), str(path) if path else None, parser)
    r = _RENDERERS.get(key)
    if r is None:
        r = _RENDERERS[key] = ChatRenderer(
            tokenizer, chat_template=_template_file(str(path)) if path else None, tool_parser=parser
        )
    return r


@functools.lru_cache(maxsize=16)
def _tools_for(specs: tuple[str, ...] | None) -> tuple[Tool, ...]:
    return tuple(load_tools(list(specs) if specs is not None else None))


def bridge_text(
    renderer: ChatRenderer,
    conversation: list[ChatMessage],
    model_turns: dict[int, ModelTurn],
    tools: list[dict[str, Any]] | None,
) -> str:
    """The text between the model's last turn and the next assistant generation prompt, from the template itself.

    ``conversation`` is the episode so far (prompt messages, the model's turns as assistant messages, tool
    results), ``model_turns`` the model's own output for each of its assistant messages. The conversation is
    rendered with those outputs spliced in (:meth:`~vime_core.agent.chat.ChatRenderer.render_with_turns`, shared
    with the agent gateway) and the text after the last one is returned: the template's end of the turn when the
    model did not emit it, the tool results as the template writes them (one user turn for consecutive results
    where the template merges them), and the generation prompt.

    :raises ValueError: if the template does not render an assistant message's content verbatim.
    """
    spliced = renderer.render_with_turns(conversation, tools, model_turns, add_generation_prompt=True)
    if spliced is None:
        raise ValueError(
            "multi_turn: the chat template does not write an assistant message's content verbatim (exactly once), "
            "so the text after the model's turn cannot be located; use --multi-turn-chat-template with a template "
            "that renders message content as given"
        )
    return spliced.text[spliced.ends[-1] :]


async def _run_tool(tools: dict[str, Tool], call: ToolCall, timeout_s: float) -> str | list[dict[str, Any]]:
    tool = tools.get(call.name)
    if tool is None:
        return f"Error: unknown tool {call.name!r}; available: {', '.join(sorted(tools))}"
    # a sandboxed shell call is timed by the sandbox itself (which kills it there and keeps its partial output);
    # the bound here only catches a sandbox that does not answer
    bound = timeout_s + SANDBOX_TOOL_GRACE_S if isinstance(tool, _SandboxTool) else timeout_s
    try:
        return await tool.call(call.arguments, timeout_s=bound)
    except TimeoutError:
        return f"Error: {call.name} timed out after {timeout_s:g} s"
    except TypeError as e:
        return f"Error: bad arguments for {call.name}: {e}"
    except Exception as e:  # noqa: BLE001 - a failing tool is information for the model, not a crash
        if _is_sandbox_infra_error(e):
            raise  # the sandbox itself failed: the sample fails (excluded), it is not the model's doing
        return f"Error: {type(e).__name__}: {e}"


def _is_sandbox_infra_error(e: BaseException) -> bool:
    try:
        from vime_core.sandbox.base import SandboxInfraError
    except ImportError:  # the sandbox package is optional
        return False
    return isinstance(e, SandboxInfraError)


class _SandboxTool(Tool):
    """The shell tool: its ``--multi-turn-tool-timeout`` is enforced by the sandbox (``exec(timeout=...)``)."""


def _sandbox_tool(name: str, sandbox: Any, timeout_s: float) -> Tool:
    """``NAME(command)`` running ``command`` in ``sandbox`` with ``timeout_s`` seconds per call.

    At the timeout the sandbox kills the command and the model sees ``exit code: 137 (timed out)`` with the output
    so far; the sandbox's wall time (``--sandbox-wall-time``) also caps each call, and once it is spent the model
    sees ``Error: SandboxExpiredError: ...``.
    """

    async def run(command: str) -> str:
        r = await sandbox.exec(command, timeout=timeout_s)
        out = f"exit code: {r.exit_code}" + (" (timed out)" if r.timed_out else "")
        if r.stdout:
            out += f"\nstdout:\n{r.stdout}"
        if r.stderr:
            out += f"\nstderr:\n{r.stderr}"
        return out

    return _SandboxTool(
        name,
        run,
        "Run a shell command in the sandbox and return its exit code, stdout and stderr.",
        {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
    )


@contextlib.asynccontextmanager
async def _episode_sandbox(ctx: PluginContext):  # type: ignore[no-untyped-def]
    """A sandbox for one episode when ``--multi-turn-sandbox-tool`` is set, else ``None`` (the backend is built
    from the run's configuration: :meth:`~vime_core.sandbox.base.Sandbox.from_context`)."""
    cfg = ctx.multi_turn
    if not cfg.multi_turn_sandbox_tool:
        yield None
        return
    backend = cfg.sandbox
    if not backend:
        raise ValueError("--multi-turn-sandbox-tool needs a sandbox backend (--sandbox NAME)")

    cls = get_plugins().resolve("sandbox", backend)
    async with cls.from_context(ctx) as sb:
        yield sb


def _expand(tokenizer: Any, ids: list[int], images: list[str]) -> list[int]:
    """``ids`` with the single image placeholder of each of ``images`` expanded as the processor expands it (no
    images: ``ids`` as they are)."""
    if not images:
        return ids
    processor = processor_for(tokenizer)
    return expand_image_pads(ids, image_token_id(processor), image_token_counts(processor, images))


def _truncate(renderer: ChatRenderer, text: str, max_tokens: int) -> str:
    ids = renderer.encode(text)
    if len(ids) <= max_tokens:
        return text
    return renderer.visible_text(ids[:max_tokens]) + "\n[truncated]"


@takes_context
async def generate(ctx: PluginContext, sample: Sample, sampling_params: dict[str, Any]) -> Sample:
    """Run one tool-using episode (see the module docstring).

    :param sampling_params: engine parameters; ``max_tokens`` is the budget of the whole response (model + tool
        tokens).
    :raises ValueError: on a misconfiguration (sandbox tool without ``--sandbox``, a template that cannot be
        bridged, ``--multi-turn-max-turns`` < 1).
    """
    cfg = ctx.multi_turn
    engines = rollout_engines(ctx)
    renderer = _renderer(engines.tokenizer, cfg)
    specs = cfg.multi_turn_tools
    base_tools = list(_tools_for(tuple(specs) if specs is not None else None))
    async with _episode_sandbox(ctx) as sb:
        tools = list(base_tools)
        if sb is not None:
            tools.append(_sandbox_tool(cfg.multi_turn_sandbox_tool, sb, cfg.multi_turn_tool_timeout))
        return await _episode(cfg, sample, sampling_params, engines, renderer, tools)


async def _episode(
    cfg: MultiTurnConfig,
    sample: Sample,
    sampling_params: dict[str, Any],
    ctx: Any,
    renderer: ChatRenderer,
    tools: list[Tool],
) -> Sample:
    by_name = {t.name: t for t in tools}
    schemas = [t.schema() for t in tools]
    native_prompt = bool(schemas) and cfg.multi_turn_tool_prompt == "auto"
    # the conversation so far, in canonical form (OpenAI-style messages, tool calls included); the model's turns are
    # added as assistant messages whose text is the model's own output (model_turns)
    conversation = _start_conversation(cfg, sample, ctx.tokenizer, renderer, schemas if native_prompt else None)
    model_turns: dict[int, ModelTurn] = {}
    render_tools = schemas if native_prompt else None
    params = dict(sampling_params)
    budget = int(params.pop("max_tokens", None) or cfg.rollout_max_response_len)
    max_ctx = cfg.rollout_max_context_len
    ctx_bound = bool(max_ctx) and max_ctx - len(sample.tokens) < budget  # the context window is the tighter limit
    if max_ctx:
        budget = min(budget, max_ctx - len(sample.tokens))
    per_turn = cfg.multi_turn_max_tokens_per_turn
    max_turns = int(cfg.multi_turn_max_turns)
    if max_turns < 1:
        raise ValueError(f"--multi-turn-max-turns must be at least 1, got {max_turns}")
    timeout_s = float(cfg.multi_turn_tool_timeout)
    max_tool_tokens = int(cfg.multi_turn_max_tool_output_tokens)
    session_id = sample.metadata.get("session_id") or uuid.uuid4().hex
    calls_log: list[dict[str, Any]] = sample.metadata.setdefault("tool_calls", [])
    ill_formed: list[int] = sample.metadata.setdefault("ill_formed_turns", [])
    failures: dict[str, int] = sample.metadata.setdefault("tool_parse_failures", {})
    pending: list[int] = []
    pending_text = ""
    pending_images: list[str] = []  # the images of the pending tool results (docs/vlm.md, "Multi-turn")
    status, stop_reason, turn = Status.TRUNCATED, "budget", 0
    for turn in range(max_turns):  # noqa: B007 - the last value is reported
        left = budget - sample.response_length - len(pending)
        if left <= 0:
            status, stop_reason = Status.TRUNCATED, "budget"
            break
        params["max_tokens"] = min(left, per_turn) if per_turn else left
        images = sample.images + pending_images
        extra = {"images": images} if images else {}
        out = await ctx.client.generate(sample.tokens + pending, params, session_id=session_id, **extra)
        versions = engine_versions(out, ctx.weight_version)
        if pending:  # the tool context the engine just read, tagged with the version that read it
            sample.append_response_tokens(
                pending,
                trainable=False,
                weight_version=min(versions) if versions else ctx.weight_version,
                text=pending_text,
            )
            sample.images.extend(pending_images)
            pending, pending_text, pending_images = [], "", []
        ids = list(out.token_ids)
        text = renderer.visible_text(ids)
        sample.append_response_tokens(ids, trainable=True, log_probs=out.log_probs, weight_version=versions, text=text)
        sample.routed_experts = out.routed_experts  # R3: this request covered the whole sequence so far
        if out.finish_reason != "stop":
            status, stop_reason = FINISH_TO_STATUS[out.finish_reason], out.finish_reason
            break
        parsed = parse_with_tools(renderer.parser, text, schemas) if tools else None
        if parsed is not None and parsed.ill_formed:
            ill_formed.append(turn)
        for reason, n in (parsed.failure_counts() if parsed is not None else {}).items():
            failures[reason] = failures.get(reason, 0) + n
        if parsed is None or not parsed.tool_calls:
            status, stop_reason = Status.COMPLETED, "no_tool_call"
            break
        if turn == max_turns - 1:
            status, stop_reason = Status.TRUNCATED, "max_turns"
            break
        results, new_images = await _tool_results(
            by_name, parsed.tool_calls, renderer, ctx.tokenizer, (timeout_s, max_tool_tokens), turn, calls_log
        )
        conversation.append(ChatMessage("assistant", parsed.content, list(parsed.tool_calls)))
        model_turns[len(conversation) - 1] = renderer.model_turn(ids)
        conversation += [
            ChatMessage("tool", r, tool_call_id=c.id, name=c.name)
            for c, r in zip(parsed.tool_calls, results, strict=True)
        ]
        pending_text = bridge_text(renderer, conversation, model_turns, render_tools)
        pending = _expand(ctx.tokenizer, renderer.encode(pending_text), new_images)
        pending_images = new_images
        if budget - sample.response_length - len(pending) <= 0:
            status, stop_reason = Status.TRUNCATED, "budget"
            pending, pending_images = [], []
            break
    return _finish(sample, status, stop_reason, turn + 1, ctx_bound, budget)


def _start_conversation(
    cfg: MultiTurnConfig, sample: Sample, tokenizer: Any, renderer: ChatRenderer, schemas: list[dict] | None
) -> list[ChatMessage]:
    """The episode's conversation from ``sample``'s prompt (a vision-language prompt's image parts as the template
    writes them: the renderer takes text content); ``sample.tokens`` set to the prompt's ids unless it has them (a
    resumed sample): rendered with the tools' ``schemas`` when they go in the template's own tool prompt, else
    :func:`~vime_core.data.prompt_checks.encode_sample_prompt`."""
    prompt = sample.prompt
    chat = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    if sample.images:
        chat = messages_as_text(chat, image_placeholder_text(processor_for(tokenizer)))
    conversation = parse_chat({"messages": chat}, strict_tool_ids=False).messages
    if not sample.tokens:
        if schemas is not None:
            sample.tokens = _expand(tokenizer, renderer.encode(renderer.render(conversation, schemas)), sample.images)
        else:
            sample.tokens = encode_sample_prompt(tokenizer, sample.prompt, sample.images, cfg.apply_chat_template)
    return conversation


async def _tool_results(
    by_name: dict[str, Tool],
    calls: list[ToolCall],
    renderer: ChatRenderer,
    tokenizer: Any,
    limits: tuple[float, int],
    turn: int,
    calls_log: list[dict[str, Any]],
) -> tuple[list[str], list[str]]:
    """Run one turn's tool ``calls`` (``limits``: the timeout in seconds and the most tokens of a result) and log
    each in ``calls_log``.

    :return: each call's result text (truncated; an image's placeholders after its text) and the images the
        results returned, in order (a tool's image that does not load is an error text the model reads).
    """
    timeout_s, max_tool_tokens = limits
    results: list[str] = []
    new_images: list[str] = []
    for call in calls:
        try:
            text, result_images = tool_result_parts(await _run_tool(by_name, call, timeout_s), Path.cwd())
        except ImageDataError as e:  # the tool returned an image that does not load: the model is told
            text, result_images = f"Error: {call.name} returned an unreadable image: {e}", []
        result = _truncate(renderer, text, max_tool_tokens)
        if result_images:  # images after the result's text, as the template writes image parts
            result += image_placeholder_text(processor_for(tokenizer)) * len(result_images)
            new_images += result_images
        results.append(result)
        logged = {"turn": turn, "name": call.name, "arguments": call.arguments, "result": result[:200]}
        calls_log.append({**logged, "images": len(result_images)} if result_images else logged)
    return results, new_images


def _finish(sample: Sample, status: Status, stop_reason: str, turns: int, ctx_bound: bool, budget: int) -> Sample:
    """``sample`` with the episode's status, ``num_turns``, ``stop_reason`` and ``context_exhausted``: the episode
    filled ``--rollout-max-context-len`` (``ctx_bound``: the context window, not ``max_tokens``, set the response
    ``budget``), as the agent gateway records a prompt that no longer fits."""
    sample.status = status
    sample.metadata["num_turns"] = turns
    sample.metadata["stop_reason"] = stop_reason
    sample.metadata["context_exhausted"] = ctx_bound and (
        stop_reason == "budget" or (stop_reason == "length" and sample.response_length >= budget)
    )
    return sample


def rollout_metrics(samples: list[Sample]) -> dict[str, float]:
    """``multi_turn/*`` metrics of one step (logged through ``vime_on_rollout_end`` when ``--generate multi_turn``):
    mean model turns, fraction of episodes with at least one tool call, tool calls per episode, fraction with an
    ill-formed call, fraction stopped by ``--multi-turn-max-turns``; and the tool-call parse failures by reason
    (``agent/tool_parse_failures/<reason>``, :func:`~vime_core.agent.tool_parse_failures.tool_parse_metrics`)."""
    n = max(len(samples), 1)
    calls = [len(s.metadata.get("tool_calls") or []) for s in samples]
    return {
        "multi_turn/turns_mean": sum(int(s.metadata.get("num_turns") or 0) for s in samples) / n,
        "multi_turn/tool_call_frac": sum(c > 0 for c in calls) / n,
        "multi_turn/tool_calls_mean": sum(calls) / n,
        "multi_turn/ill_formed_frac": sum(bool(s.metadata.get("ill_formed_turns")) for s in samples) / n,
        "multi_turn/max_turns_frac": sum(s.metadata.get("stop_reason") == "max_turns" for s in samples) / n,
        **tool_parse_metrics(samples),
    }
