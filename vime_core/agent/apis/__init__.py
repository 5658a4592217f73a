"""The three chat APIs the gateway speaks, each converted to and from one canonical form and served by its own
routes: :mod:`.anthropic_messages` (Anthropic Messages, as Claude Code uses it), :mod:`.openai_chat` (OpenAI Chat
Completions) and :mod:`.openai_responses` (OpenAI Responses, as Codex uses it); what they share (canonical request and
result, errors, tool-result pairing, the HTTP plumbing of a turn) is in :mod:`.common`.

The codec functions are re-exported here.
"""

from vime_core.agent.apis.anthropic_messages import (
    anthropic_blocks,
    anthropic_error,
    anthropic_events,
    anthropic_message,
    anthropic_start_event,
    parse_anthropic,
)
from vime_core.agent.apis.common import (
    CONTEXT_LENGTH_EXCEEDED,
    APIError,
    ChatRequest,
    ChatResult,
    context_overflow_error,
    openai_error,
    pair_tool_results,
)
from vime_core.agent.apis.openai_chat import chat_chunks, chat_completion, parse_chat
from vime_core.agent.apis.openai_responses import (
    parse_responses,
    responses_events,
    responses_object,
    responses_output,
)

__all__ = [
    "CONTEXT_LENGTH_EXCEEDED",
    "APIError",
    "ChatRequest",
    "ChatResult",
    "anthropic_blocks",
    "anthropic_error",
    "anthropic_events",
    "anthropic_message",
    "anthropic_start_event",
    "chat_chunks",
    "chat_completion",
    "context_overflow_error",
    "openai_error",
    "pair_tool_results",
    "parse_anthropic",
    "parse_chat",
    "parse_responses",
    "responses_events",
    "responses_object",
    "responses_output",
]
