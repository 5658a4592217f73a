"""MemAgent on vime: read a long document chunk by chunk into a fixed-size memory, answer from the memory alone.

Per prompt (one rollout), after MemAgent (Yu et al. 2025, "MemAgent: Reshaping Long-Context LLM with Multi-Conv
RL-based Memory Agent", arXiv:2507.02259; prompts after its released templates):

1. the document (``metadata["context"]``) is cut into chunks of ``chunk_tokens`` policy tokens
   (:func:`chunk_document`);
2. for each chunk, the policy gets the question, the current memory and the chunk, and writes the **new memory**,
   at most ``memory_tokens`` tokens — it overwrites the old one (:data:`MEMORY_TEMPLATE`; ``No previous memory``
   at first);
3. the policy gets the question and the final memory only and answers (:data:`ANSWER_TEMPLATE`, at most
   ``answer_tokens`` tokens).

Every turn is its own :class:`~vime_core.types.Sample` (its own prompt, its output trained with mask 1, the engine's
log-probs and versions): context-independent trajectories. The function returns them as a list (a fan-out): the
rollout manager gives them one ``episode_id`` and scores the rollout once with :func:`reward` (exact match of the
final answer), so every turn of a rollout gets the rollout's reward and, with GRPO, the rollout's advantage within
its group (docs/agents.md, "coding_agent": fan-out). Per-turn metadata: ``mem_turn`` (0-based), ``mem_role``
(``memory`` / ``answer``), ``num_chunks``, ``memory`` (the memory after the turn), ``final_response``.

Sizes (tokens) are the keyword defaults of :func:`generate`, overridable per run with the environment variables
``MEM_AGENT_CHUNK_TOKENS``, ``MEM_AGENT_MEMORY_TOKENS``, ``MEM_AGENT_ANSWER_TOKENS`` (Ray workers inherit them).
"""

from __future__ import annotations

import copy
import os
import re
from typing import Any

from vime_core.config.context import PluginContext, rollout_engines
from vime_core.rewards.simple import normalize_answer
from vime_core.rollout.generators.default import generate as default_generate
from vime_core.types import Sample, Status

CHUNK_TOKENS = 160
MEMORY_TOKENS = 48
ANSWER_TOKENS = 16
NO_MEMORY = "No previous memory"
MEMORY_TEMPLATE = (
    "You are presented with a problem, a section of an article that may contain the answer to the problem, and a "
    "previous memory. Read the section and update the memory with the new information that helps to answer the "
    "problem. Keep every relevant detail of the previous memory.\n\n"
    "<problem>\n{question}\n</problem>\n\n<memory>\n{memory}\n</memory>\n\n<section>\n{chunk}\n</section>\n\n"
    "Updated memory:"
)
ANSWER_TEMPLATE = (
    "You are presented with a problem and a previous memory. Answer the problem from the memory, with one line of "
    "the form 'Answer: X'.\n\n<problem>\n{question}\n</problem>\n\n<memory>\n{memory}\n</memory>\n\nYour answer:"
)
DONE = (Status.COMPLETED, Status.TRUNCATED)
_ANSWER = re.compile(r"answer\s*:\s*(.+)", re.IGNORECASE)


def _size(name: str, default: int) -> int:
    """A positive int from environment variable ``name``, else ``default``.

    :raises ValueError: naming the variable when it is set to something else.
    """
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{name}={raw!r}: expected a positive number of tokens")
    return value


def chunk_document(tokenizer: Any, text: str, chunk_tokens: int) -> list[str]:
    """``text`` cut into consecutive pieces of ``chunk_tokens`` tokens (the last may be shorter), each decoded back to
    text; their concatenation is the decoded document.

    :raises ValueError: on an empty document or ``chunk_tokens`` < 1.
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if not ids:
        raise ValueError("mem_agent: empty document (metadata.context)")
    return [tokenizer.decode(ids[i : i + chunk_tokens]) for i in range(0, len(ids), chunk_tokens)]


def memory_prompt(question: str, memory: str, chunk: str) -> list[dict[str, str]]:
    """The chat messages of a memory turn."""
    return [{"role": "user", "content": MEMORY_TEMPLATE.format(question=question, memory=memory, chunk=chunk)}]


def answer_prompt(question: str, memory: str) -> list[dict[str, str]]:
    """The chat messages of the answer turn."""
    return [{"role": "user", "content": ANSWER_TEMPLATE.format(question=question, memory=memory)}]


def _question(sample: Sample) -> str:
    p = sample.prompt
    if isinstance(p, str):
        return p
    users = [m["content"] for m in p if m.get("role") == "user" and isinstance(m.get("content"), str)]
    if not users:
        raise ValueError("mem_agent: the prompt has no user message (the question)")
    return users[-1]


def _turn(parent: Sample, messages: list[dict[str, str]], turn: int, role: str) -> Sample:
    meta = copy.deepcopy(parent.metadata)
    meta.pop("context", None)  # the document is read chunk by chunk; no turn carries all of it
    meta.update(mem_turn=turn, mem_role=role)
    return Sample(
        group_index=parent.group_index, index=parent.index, prompt=messages, label=parent.label, metadata=meta
    )


async def generate(
    ctx: PluginContext,
    sample: Sample,
    sampling_params: dict[str, Any],
    chunk_tokens: int | None = None,
    memory_tokens: int | None = None,
    answer_tokens: int | None = None,
) -> list[Sample] | Sample:
    """Read ``sample.metadata["context"]`` chunk by chunk into memory, then answer (see the module docstring).

    :param sampling_params: engine parameters of every turn; each turn's ``max_tokens`` is the smaller of theirs
        and ``memory_tokens`` / ``answer_tokens``.
    :return: one sample per turn (memory turns, then the answer), or the turn sample that did not finish
        (``aborted`` or ``failed``), which is then neither scored nor trained.
    :raises ValueError: a row without ``metadata.context`` or a question; a bad ``MEM_AGENT_*`` variable.
    """
    chunk_tokens = chunk_tokens or _size("MEM_AGENT_CHUNK_TOKENS", CHUNK_TOKENS)
    memory_tokens = memory_tokens or _size("MEM_AGENT_MEMORY_TOKENS", MEMORY_TOKENS)
    answer_tokens = answer_tokens or _size("MEM_AGENT_ANSWER_TOKENS", ANSWER_TOKENS)
    context = sample.metadata.get("context")
    if not isinstance(context, str):
        raise ValueError("mem_agent: the row has no metadata.context (the document to read)")
    question = _question(sample)
    chunks = chunk_document(rollout_engines(ctx).tokenizer, context, chunk_tokens)
    cap = sampling_params.get("max_tokens")
    turns: list[Sample] = []
    memory = NO_MEMORY
    for i, chunk in enumerate(chunks):
        params = {**sampling_params, "max_tokens": min(cap or memory_tokens, memory_tokens)}
        t = await default_generate(ctx, _turn(sample, memory_prompt(question, memory, chunk), i, "memory"), params)
        if t.status not in DONE:
            return t
        memory = t.response.strip() or NO_MEMORY  # overwrite: the new memory replaces the old one
        t.metadata["memory"] = memory
        turns.append(t)
    params = {**sampling_params, "max_tokens": min(cap or answer_tokens, answer_tokens)}
    final = await default_generate(ctx, _turn(sample, answer_prompt(question, memory), len(chunks), "answer"), params)
    if final.status not in DONE:
        return final
    final.metadata["memory"] = memory
    turns.append(final)
    for t in turns:
        t.metadata["num_chunks"] = len(chunks)
        t.metadata["final_response"] = final.response
    return turns


def extract_answer(text: str) -> str | None:
    """The text after the last ``Answer:`` on its line (stripped), or None."""
    found = _ANSWER.findall(text or "")
    return found[-1].strip() if found else None


async def reward(ctx: PluginContext, sample: Sample) -> float:
    """Exact match of the rollout's final answer (``metadata["final_response"]``, the answer turn's text) with the
    label, after SQuAD normalisation: 1.0 or 0.0.

    :raises ValueError: a sample without ``final_response`` (not produced by :func:`generate`) or without a label.
    """
    if "final_response" not in sample.metadata:
        raise ValueError("mem_agent reward: metadata.final_response missing (use --generate mem_agent:generate)")
    if sample.label is None or str(sample.label) == "":
        raise ValueError(f"mem_agent reward: sample {sample.group_index}/{sample.index} has no label")
    answer = extract_answer(sample.metadata["final_response"])
    return float(answer is not None and normalize_answer(answer) == normalize_answer(str(sample.label)))
