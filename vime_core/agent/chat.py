"""Chat rendering for the agent gateway and the ``multi_turn`` generate function.

Every API (Anthropic Messages, OpenAI Chat Completions, OpenAI Responses) is first converted to one canonical form,
a list of :class:`ChatMessage` plus tool schemas, which :class:`ChatRenderer` renders to *text* with the model's chat
template. Tokenisation is done by the caller (incrementally, see :meth:`vime_core.agent.trajectory.Trajectory.plan`).

Templates with tool support (they use ``tools`` and ``tool_calls``, e.g. Qwen2.5/Qwen3, Llama 3.1+) get the tools and
the assistant calls natively. Templates without (SmolLM2, plain ChatML) get them written by the tool parser's format
(:mod:`vime_core.agent.tool_parsers`): the tool list appended to the system prompt, calls in the assistant text, tool
results as a user turn — so any chat model can be driven by a tool-using agent.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from vime_core.agent.tool_parsers import ToolCall, ToolParser, get_tool_parser


@dataclass
class ChatMessage:
    """One message in canonical form.

    :ivar role: ``system``, ``user``, ``assistant`` or ``tool``.
    :ivar content: the text (parts already joined).
    :ivar tool_calls: assistant tool calls.
    :ivar tool_call_id: for ``tool`` messages, the call answered.
    :ivar name: for ``tool`` messages, the tool's name when known.
    """

    role: str
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    tool_call_id: str | None = None
    name: str | None = None


@dataclass
class ModelTurn:
    """An assistant message as the model wrote it (for :meth:`ChatRenderer.render_with_turns`).

    :ivar raw: the sampled ids decoded with special tokens kept (:meth:`ChatRenderer.decode`).
    :ivar end_of_turn: the text of the special token the output ends with (the end-of-turn token the model
        emitted: ``<|im_end|>``, ``<|eot_id|>``, a role tag such as GLM's ``<|observation|>``), ``""`` if none.
    """

    raw: str
    end_of_turn: str = ""


@dataclass
class SplicedRender:
    """A conversation rendered with model turns written as the model wrote them.

    :ivar text: the rendered text.
    :ivar ends: per spliced turn (in message order), the offset in ``text`` just past it: past the model's
        end-of-turn token when the template puts the same token there; otherwise past the output without it,
        so that ``text[ends[k]:]`` starts with what the template writes after the message.
    """

    text: str
    ends: list[int]


def template_supports_tools(template: str) -> bool:
    """Whether a chat template renders ``tools`` and ``tool_calls`` itself (a source-text heuristic)."""
    return "tools" in template and "tool_calls" in template


class ChatRenderer:
    """Render canonical messages with a tokenizer's chat template; encode/decode helpers for the same tokenizer.

    :param tokenizer: a Hugging Face tokenizer.
    :param chat_template: template source overriding the tokenizer's own (``None``: the tokenizer's).
    :param tool_parser: parser name, ``pkg.mod:Class`` path or instance (the model's tool-call format).
    :param template_kwargs: extra variables for the template (e.g. ``{"enable_thinking": False}``).
    :raises ValueError: if there is no chat template at all.
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        chat_template: str | None = None,
        tool_parser: str | ToolParser = "hermes",
        template_kwargs: dict[str, Any] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.template = chat_template or getattr(tokenizer, "chat_template", None)
        if not self.template:
            raise ValueError("the tokenizer has no chat template; pass chat_template=")
        self.parser = get_tool_parser(tool_parser)
        self.native_tools = template_supports_tools(self.template)
        self.template_kwargs = dict(template_kwargs or {})
        self.eos_token_id: int | None = getattr(tokenizer, "eos_token_id", None)
        self.special_ids = set(getattr(tokenizer, "all_special_ids", []) or [])

    # -- text ------------------------------------------------------------------------------------------------
    def to_template_messages(
        self, messages: list[ChatMessage], tools: list[dict[str, Any]] | None
    ) -> list[dict[str, Any]]:
        """Messages as the template expects them (native tool fields, or tool calls/results written as text)."""
        out: list[dict[str, Any]] = []
        if self.native_tools:
            for m in messages:
                d: dict[str, Any] = {"role": m.role, "content": m.content}
                if m.tool_calls:
                    d["tool_calls"] = [
                        {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                        for c in m.tool_calls
                    ]
                if m.role == "tool":
                    if m.tool_call_id:
                        d["tool_call_id"] = m.tool_call_id
                    if m.name:
                        d["name"] = m.name
                out.append(d)
            return out
        pending: list[str] = []

        def flush() -> None:
            if pending:
                out.append({"role": "user", "content": self.parser.format_results(pending)})
                pending.clear()

        for m in messages:
            if m.role == "tool":
                pending.append(m.content)
                continue
            flush()
            content = m.content
            if m.tool_calls:
                calls = self.parser.format_calls(m.tool_calls)
                content = f"{content}\n{calls}" if content else calls
            out.append({"role": m.role, "content": content})
        flush()
        if tools:
            prompt = self.parser.tools_prompt(tools)
            if out and out[0]["role"] == "system":
                out[0] = {
                    "role": "system",
                    "content": f"{out[0]['content']}\n\n{prompt}" if out[0]["content"] else prompt,
                }
            else:
                out.insert(0, {"role": "system", "content": prompt})
        return out

    def render(
        self,
        messages: list[ChatMessage],
        tools: list[dict[str, Any]] | None = None,
        *,
        add_generation_prompt: bool = True,
    ) -> str:
        """The prompt text (``tools``: normalised by :func:`~vime_core.agent.tool_parsers.tool_schema`).

        :raises jinja2.TemplateError: if the template rejects the conversation.
        """
        msgs = self.to_template_messages(messages, tools)
        native = [{"type": "function", "function": t} for t in tools] if (tools and self.native_tools) else None
        text = self.tokenizer.apply_chat_template(
            msgs,
            tools=native,
            chat_template=self.template,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **self.template_kwargs,
        )
        if not isinstance(text, str):
            raise TypeError(f"apply_chat_template(tokenize=False) returned {type(text).__name__}")
        return text

    def render_with_turns(
        self,
        messages: list[ChatMessage],
        tools: list[dict[str, Any]] | None,
        turns: Mapping[int, ModelTurn],
        *,
        add_generation_prompt: bool = True,
    ) -> SplicedRender | None:
        """Render ``messages`` with each assistant message ``messages[i]`` (``i`` in ``turns``) written as the model's
        own output ``turns[i]`` instead of the template's rendering of it.

        This is how every text that *follows* a model turn is found, for any template: each such message is
        rendered with a unique sentinel as its only content (its tool calls dropped: the output already holds them),
        the sentinel is replaced by the raw output, and the model's end-of-turn token absorbs the same token the
        template writes after the content. No assumption is made that the render with the assistant message last
        is a prefix of the render that continues it — templates break that (Qwen3 renders an empty thinking block
        only on the last assistant message; GLM ends a turn with the role tag of the next message; Qwen merges
        consecutive tool results into one user turn). Used by the ``multi_turn`` generate function (the text between
        the model's turn and its next generation prompt) and by the agent gateway's ``history="model"``.

        :param turns: message index → the model's output; every index must hold an assistant message.
        :return: the render, or ``None`` when the template does not write a content verbatim exactly once (then
            the caller falls back or reports it).
        :raises ValueError: if an index of ``turns`` is not an assistant message.
        :raises jinja2.TemplateError: if the template rejects the conversation.
        """
        msgs = list(messages)
        order = sorted(turns)
        sentinels = []
        for k, i in enumerate(order):
            if not 0 <= i < len(msgs) or msgs[i].role != "assistant":
                raise ValueError(f"render_with_turns: message {i} is not an assistant message")
            sentinels.append(f"\ue000vime-turn-{k}\ue001")
            msgs[i] = ChatMessage("assistant", sentinels[-1])
        text = self.render(msgs, tools, add_generation_prompt=add_generation_prompt)
        parts: list[str] = []
        ends: list[int] = []
        pos, length = 0, 0
        for sentinel, i in zip(sentinels, order, strict=True):
            at = text.find(sentinel, pos)
            if at < 0 or text.find(sentinel, at + 1) >= 0:
                return None
            j = at + len(sentinel)
            raw, eot = turns[i].raw, turns[i].end_of_turn
            if eot and text.startswith(eot, j):
                j += len(eot)  # the output carries the end-of-turn token the template writes here
            elif eot and raw.endswith(eot):
                raw = raw[: -len(eot)]
            parts += [text[pos:at], raw]
            length += at - pos + len(raw)
            ends.append(length)
            pos = j
        parts.append(text[pos:])
        return SplicedRender("".join(parts), ends)

    # -- tokens ----------------------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; special-token text maps to its id, no BOS/EOS added."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids`` with special tokens kept (the inverse of :meth:`encode` on rendered text)."""
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def model_turn(self, ids: list[int]) -> ModelTurn:
        """An output as a :class:`ModelTurn`: its text with special tokens, and its last token's text as the
        end-of-turn when that token is special."""
        eot = self.decode(ids[-1:]) if ids and ids[-1] in self.special_ids else ""
        return ModelTurn(self.decode(ids), eot)

    def visible_text(self, ids: list[int]) -> str:
        """What a client sees of an output: special tokens (the end-of-turn token included) removed."""
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


#: an image part inside a message's text (:func:`text_of`): ``IMAGE_REF_START type IMAGE_REF_SEP reference
#: IMAGE_REF_END`` (private-use characters); the gateway replaces it with the model's image placeholder, or with
#: ``[type]`` for a text-only model (docs/vlm.md, "The agent gateway")
IMAGE_REF_START, IMAGE_REF_SEP, IMAGE_REF_END = "\ue000", "\ue001", "\ue002"
IMAGE_REF = re.compile(f"{IMAGE_REF_START}([a-z_]+){IMAGE_REF_SEP}(.*?){IMAGE_REF_END}", re.S)


def image_ref(part: dict[str, Any]) -> str | None:
    """The image an API content part carries (a ``data:`` URI, URL or path), or ``None``: OpenAI Chat's
    ``{"type": "image_url", "image_url": {"url"}}``, Responses' ``{"type": "input_image", "image_url"}``,
    Anthropic's ``{"type": "image", "source": {"type": "base64", "media_type", "data"} | {"type": "url", "url"}}``."""
    kind = part.get("type")
    if kind == "image_url":
        url = part.get("image_url")
        return url.get("url") if isinstance(url, dict) else url
    if kind == "input_image":
        return part.get("image_url")
    if kind == "image":
        src = part.get("source") or {}
        if src.get("type") == "base64" and src.get("data"):
            return f"data:{src.get('media_type', 'image/png')};base64,{src['data']}"
        return src.get("url")
    return None


def text_of(content: Any, *, part_types: tuple[str, ...] = ("text", "input_text", "output_text")) -> str:
    """Join the text parts of an API ``content`` (a string, a list of parts joined by newlines, or ``None``).

    Image parts become an image reference (:data:`IMAGE_REF`, resolved by the gateway); other non-text parts
    (documents, an image without data) a ``[<type>]`` placeholder so the conversation stays renderable.
    """
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, dict):
        content = [content]
    parts: list[str] = []
    for p in content:
        if isinstance(p, str):
            parts.append(p)
        elif isinstance(p, dict):
            t = p.get("type")
            if t in part_types or (t is None and "text" in p):
                parts.append(str(p.get("text", "")))
            elif t == "tool_result" or t == "tool_reference":
                parts.append(text_of(p.get("content")))
            elif (ref := image_ref(p)) is not None:
                parts.append(f"{IMAGE_REF_START}{t}{IMAGE_REF_SEP}{ref}{IMAGE_REF_END}")
            else:
                parts.append(f"[{t}]")
        else:
            parts.append(json.dumps(p))
    return "\n".join(parts)
