"""The tau_bench example's agent episode: the policy serves a simulated customer through vime's agent gateway.

:func:`generate` (``--generate tau_agent:generate``) runs one task (:class:`tau_retail.Task`) per rollout:

1. a session on the rollout process's agent gateway (the one ``--generate coding_agent`` uses, with its
   ``--agent-*`` flags: tool parser, per-call ``--agent-max-tokens``, ``--agent-max-turns``, ``--agent-history``),
   and a fresh copy of the database (:class:`tau_retail.RetailEnv`);
2. the user's first message; then the loop: an OpenAI Chat Completions request to the gateway (HTTP, with the
   environment's tools) — the gateway renders it, samples the policy through the router and records the turn; the
   tool calls of the reply are run on the database and their results sent back as ``tool`` messages; a reply
   without a call goes to the user, whose answer is the next message; the episode ends when the user says
   ``###STOP###``, after ``--agent-max-turns`` model calls or when a call is cut by its token budget;
3. the session closes into token-exact Samples (one per trajectory segment, one ``episode_id``), with
   ``metadata["tau"]``: the final database hash, the agent's messages, the tool calls and how the episode ended
   (and, with ``--agent-record-turns``, ``metadata["agent_turns"]``: the gateway's record of every engine call).

:func:`reward` is tau-bench's (:func:`tau_retail.task_reward`). The user is :class:`ScriptedUser` (the task's
``user_turns``, then ``###STOP###``) unless ``TAU_USER=llm``: then :class:`LLMUser`, a model behind any
OpenAI-compatible endpoint (``TAU_USER_BASE_URL``, e.g. ``http://127.0.0.1:8001/v1``; ``TAU_USER_MODEL``;
optional ``TAU_USER_API_KEY``), which is not trained — a second vLLM server started apart from the run is one.
"""

from __future__ import annotations

import asyncio
import json
import os
import uuid
from typing import Any

import httpx
import tau_retail

from vime_core.agent.gateway import TURN_BUDGET_MESSAGE
from vime_core.config.context import PluginContext, rollout_engines
from vime_core.failures import FailureCause, mark_failed
from vime_core.rollout.generators.coding_agent import gateway_for, turn_record_dict
from vime_core.types import Sample

STOP = "###STOP###"
LLM_USER_SYSTEM = (
    "You are a customer talking to a shop's support agent. Your situation and goal: {instruction}\n"
    "Write only the customer's next message, one or two sentences, revealing details only when asked. When your "
    "goal is done (or cannot be done), write {stop}."
)


class ScriptedUser:
    """The task's ``user_turns`` in order, whatever the agent says; then :data:`STOP`."""

    def __init__(self, turns: tuple[str, ...]) -> None:
        self.turns = list(turns)
        self.pos = 0

    async def reply(self, agent_message: str | None) -> str:
        """The next scripted message (the first when ``agent_message`` is None), or :data:`STOP` when none is left."""
        if self.pos >= len(self.turns):
            return STOP
        self.pos += 1
        return self.turns[self.pos - 1]


class LLMUser:
    """A customer played by a model behind an OpenAI-compatible ``/chat/completions`` endpoint (not trained).

    The model sees :data:`LLM_USER_SYSTEM` with the task's instruction; the agent's messages are its ``user`` turns
    and its own earlier messages its ``assistant`` turns (the roles flipped, as tau-bench's user simulator does).

    :param base_url: the endpoint's base, e.g. ``http://127.0.0.1:8001/v1``.
    :param model: the served model name.
    :param instruction: the task's instruction.
    :param api_key: sent as a bearer token when given.
    :param temperature: sampling temperature of the user.
    :param max_tokens: the user's message budget (tokens).
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        instruction: str,
        api_key: str | None = None,
        temperature: float = 0.0,
        max_tokens: int = 64,
    ) -> None:
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model = model
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.temperature, self.max_tokens = temperature, max_tokens
        self.messages: list[dict[str, str]] = [
            {"role": "system", "content": LLM_USER_SYSTEM.format(instruction=instruction, stop=STOP)},
            {"role": "user", "content": "Hi! How can I help you today?"},
        ]

    async def reply(self, agent_message: str | None) -> str:
        """The user's next message (:data:`STOP` when the model wrote it).

        :raises httpx.HTTPError: the endpoint failed (the episode fails: excluded, not scored 0).
        """
        if agent_message is not None:
            self.messages.append({"role": "user", "content": agent_message})
        body = {
            "model": self.model,
            "messages": self.messages,
            "temperature": self.temperature,
            "max_tokens": self.max_tokens,
        }
        async with httpx.AsyncClient(timeout=120) as http:
            r = await http.post(self.url, json=body, headers=self.headers)
            r.raise_for_status()
        text = (r.json()["choices"][0]["message"].get("content") or "").strip()
        self.messages.append({"role": "assistant", "content": text})
        return STOP if STOP in text else text


def user_for(task: tau_retail.Task) -> ScriptedUser | LLMUser:
    """The user simulator ``TAU_USER`` selects (``scripted``, the default, or ``llm``).

    :raises ValueError: an unknown ``TAU_USER``, or ``llm`` without ``TAU_USER_BASE_URL`` / ``TAU_USER_MODEL``.
    """
    kind = os.environ.get("TAU_USER", "scripted")
    if kind == "scripted":
        return ScriptedUser(task.user_turns)
    if kind != "llm":
        raise ValueError(f"TAU_USER={kind!r}: expected 'scripted' or 'llm'")
    missing = [k for k in ("TAU_USER_BASE_URL", "TAU_USER_MODEL") if not os.environ.get(k)]
    if missing:
        raise ValueError(f"TAU_USER=llm needs {' and '.join(missing)} (the user model's OpenAI-compatible endpoint)")
    env = os.environ
    return LLMUser(env["TAU_USER_BASE_URL"], env["TAU_USER_MODEL"], task.instruction, env.get("TAU_USER_API_KEY"))


async def generate(ctx: PluginContext, sample: Sample, sampling_params: dict[str, Any]) -> list[Sample] | Sample:
    """One customer episode (see the module docstring).

    :return: the episode's Samples, or the input sample marked ``failed`` (excluded) when the user simulator's
        endpoint failed or the policy made no call.
    :raises ValueError: a malformed task row, a bad ``TAU_USER*`` setting.
    """
    cfg = ctx.coding_agent
    task = tau_retail.Task.from_metadata(sample.metadata)
    user = user_for(task)
    engines = rollout_engines(ctx)
    gw = gateway_for(engines, cfg)
    gw.weight_version = engines.weight_version
    env = tau_retail.RetailEnv(tau_retail.load_db())
    max_tokens = int(cfg.agent_max_tokens or sampling_params.get("max_tokens") or 256)
    max_turns = int(cfg.agent_max_turns) or None
    forced = {k: sampling_params[k] for k in ("temperature", "top_p", "top_k", "seed", "structured_outputs")
              if k in sampling_params}  # fmt: skip
    forced["max_tokens"] = max_tokens
    sid = f"vime-tau-{uuid.uuid4().hex}"
    gw.open_session(sid, sampling_params=forced, max_turns=max_turns)
    system = [m for m in sample.prompt if m.get("role") == "system"] if isinstance(sample.prompt, list) else []
    agent_texts: list[str] = []
    end = "max_turns"
    try:
        first = await user.reply(None)
        messages: list[dict[str, Any]] = [*system, {"role": "user", "content": first}]
        async with httpx.AsyncClient(base_url=gw.url, headers={"Authorization": f"Bearer {sid}"}, timeout=600) as http:
            while True:
                body = {"model": gw.served_model_name, "messages": messages, "tools": env.schemas()}
                r = await http.post("/v1/chat/completions", json=body)
                if r.status_code == 400 and TURN_BUDGET_MESSAGE in r.text:
                    break  # the gateway refused a call past --agent-max-turns
                r.raise_for_status()
                choice = r.json()["choices"][0]
                msg = choice["message"]
                messages.append({k: v for k, v in msg.items() if k in ("role", "content", "tool_calls")})
                if msg.get("content"):
                    agent_texts.append(msg["content"])
                if choice["finish_reason"] == "length":
                    end = "length"
                    break
                if msg.get("tool_calls"):
                    for call in msg["tool_calls"]:
                        fn = call["function"]
                        try:
                            arguments = json.loads(fn["arguments"] or "{}")
                        except ValueError:
                            arguments = None
                        result = (
                            env.step(fn["name"], arguments)
                            if isinstance(arguments, dict)
                            else f"Error: arguments of {fn['name']} are not a JSON object"
                        )
                        messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
                    continue
                answer = await user.reply(msg.get("content") or "")
                if answer == STOP:
                    end = "user_stop"
                    break
                messages.append({"role": "user", "content": answer})
    except httpx.HTTPError as e:
        gw.drop_session(sid)
        mark_failed(sample, FailureCause.GENERATE_ERROR, e)
        sample.metadata["excluded"] = f"tau_bench episode failed: {type(e).__name__}: {e}"
        return sample
    except BaseException:
        gw.drop_session(sid)
        raise
    meta = {
        "tau": {
            "task_id": sample.metadata["task"].get("task_id"),
            "db_hash": tau_retail.db_hash(env.db),
            "agent_texts": agent_texts,
            "actions": env.actions,
            "end": end,
            "user": type(user).__name__,
        }
    }
    if cfg.agent_record_turns:  # --agent-record-turns: the engine calls, to audit the samples (check_token_exact)
        meta["agent_turns"] = [turn_record_dict(t) for t in gw.session_turns(sid)]
    samples = await asyncio.to_thread(gw.close_session, sid, sample, None, extra_metadata=meta)
    if not samples:
        sample.metadata.update(meta)
        mark_failed(sample, FailureCause.GENERATE_ERROR, "the policy made no model call")
        return sample
    return samples


async def reward(ctx: PluginContext, sample: Sample) -> float:
    """tau-bench's reward of the episode (:func:`tau_retail.task_reward`): 1.0 iff the final database is the goal's
    and the agent said every required output.

    :raises ValueError: a sample without ``metadata["tau"]`` (not produced by :func:`generate`) or a bad task.
    """
    tau = sample.metadata.get("tau")
    if not isinstance(tau, dict) or "db_hash" not in tau:
        raise ValueError("tau_bench reward: metadata.tau missing (use --generate tau_agent:generate)")
    task = tau_retail.Task.from_metadata(sample.metadata)
    return tau_retail.task_reward(task, tau_retail.load_db(), tau["db_hash"], tau["agent_texts"])
