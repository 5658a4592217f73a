"""``coding_agent`` end to end without an engine: a real ``local`` sandbox, the real agent gateway (HTTP on
127.0.0.1, reached from inside the sandbox through ``expose_host_port``), a real OpenAI-API client (the ``openai``
SDK in a script run inside the sandbox, applying the model's ``write_file`` tool calls) and the real ``tests`` reward
in a fresh sandbox. The engine is a :class:`ScriptedResponder`: the scripted turns write HumanEval/0's canonical
solution (and try to overwrite the hidden tests), so the reward must be exactly 1.0 and the Samples' trained tokens
exactly the scripted turns' tokens. Failed episodes must come back as excluded placeholders."""

from __future__ import annotations

import asyncio
import json
import sys
import time

import pytest

from vime_core.agent.harness import AgentHarness, AgentHarnessError, AgentRunResult
from vime_core.agent.responders import ScriptedResponder
from vime_core.config.context import PluginContext
from vime_core.data.humaneval_export import load_problems, problem_to_row
from vime_core.plugins.manager import get_plugins
from vime_core.rollout.context import RolloutContext, set_rollout_context
from vime_core.sandbox.local import LocalSandbox
from vime_core.testing.plugin_context import plugin_context
from vime_core.types import Sample, Status

pytestmark = pytest.mark.contract

AGENT_SCRIPT = r"""
import json, sys
import openai

base, key, model, prompt, max_turns = sys.argv[1:6]
client = openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0, timeout=120)
tools = [{"type": "function", "function": {
    "name": "write_file", "description": "Write a text file in the current directory.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
                   "required": ["path", "content"]}}}]
messages = [{"role": "system", "content": "You are a coding agent. Edit files with write_file."},
            {"role": "user", "content": prompt}]
for turn in range(int(max_turns)):
    r = client.chat.completions.create(model=model, messages=messages, tools=tools)
    m = r.choices[0].message
    messages.append(m.model_dump(exclude_none=True))
    if not m.tool_calls:
        print(json.dumps({"final": m.content, "turns": turn + 1}))
        sys.exit(0)
    for c in m.tool_calls:
        a = json.loads(c.function.arguments)
        with open(a["path"], "w") as f:
            f.write(a["content"])
        messages.append({"role": "tool", "tool_call_id": c.id, "content": "wrote " + a["path"]})
print(json.dumps({"final": "", "turns": int(max_turns)}))
sys.exit(3)
"""


class ScriptedOpenAIAgent(AgentHarness):
    """A minimal agent for tests: a Python script (the ``openai`` SDK of this interpreter) that loops chat
    completions with one ``write_file`` tool against the endpoint and applies the calls in ``cwd``."""

    NAME = "scripted-openai"
    api = "openai-chat"
    python = sys.executable

    async def install(self, sandbox):
        r = await sandbox.exec([self.python, "-c", "import openai"], timeout=60)
        if r.exit_code != 0:
            raise AgentHarnessError(f"{self.python} cannot import openai in the sandbox: {r.stderr[-300:]}")
        await sandbox.write_file("/tmp/vime-scripted-agent.py", AGENT_SCRIPT)

    async def run(self, sandbox, *, prompt, endpoint, budget, cwd=None):
        t0 = time.monotonic()
        argv = [self.python, "/tmp/vime-scripted-agent.py", endpoint.base_url, endpoint.api_key, endpoint.model]
        r = await sandbox.exec([*argv, prompt, str(budget.max_turns)], timeout=budget.wall_time_s, cwd=cwd)
        status = "timeout" if r.timed_out else "completed" if r.exit_code == 0 else "error"
        final = json.loads(r.stdout.strip().splitlines()[-1])["final"] if r.exit_code == 0 else ""
        return AgentRunResult(status, r.exit_code, time.monotonic() - t0, final, r.stdout, r.stderr)


class NoStartAgent(ScriptedOpenAIAgent):
    async def install(self, sandbox):
        raise AgentHarnessError("the agent CLI is not installed")


class BrokenSandbox(LocalSandbox):
    async def _create(self):
        raise ConnectionError("sandbox service unreachable")


def _call(path: str, content: str) -> str:
    return (
        "<tool_call>\n"
        + json.dumps({"name": "write_file", "arguments": {"path": path, "content": content}})
        + ("\n</tool_call>")
    )


@pytest.fixture(scope="module")
def he0():
    return problem_to_row(load_problems()[0], include_solution=True)


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


@pytest.fixture
def context(tok):
    made: list[RolloutContext] = []

    def make(script):
        backend = ScriptedResponder(tok, script)
        ctx = RolloutContext(client=backend, tokenizer=tok, weight_version=3)
        set_rollout_context(ctx)
        made.append(ctx)
        return ctx, backend

    yield make
    set_rollout_context(None)
    for ctx in made:
        gw = ctx.extras.get("agent_gateway")
        if gw is not None:
            gw.stop()


def _args(agent: str = "ScriptedOpenAIAgent", **kw) -> PluginContext:
    base = dict(
        agent=f"{__name__}:{agent}",
        sandbox="local",
        agent_max_turns=4,
        agent_wall_time=120.0,
        agent_max_tokens=512,
        rollout_max_response_len=512,
        reward_tests_timeout=60.0,
        rollout_concurrency=1,
        rollout_temperature=1.0,
        rollout_top_p=1.0,
        rollout_top_k=-1,
        rollout_stop=None,
        rollout_stop_token_ids=None,
    )
    base.update(kw)
    return plugin_context(**base)


def _sample(row, index=0) -> Sample:
    return Sample(group_index=0, index=index, prompt=row["prompt"], metadata=json.loads(json.dumps(row["metadata"])))


def test_scripted_episode_reward_one_and_token_exact(context, he0):
    solution = he0["metadata"]["canonical_solution"]
    hack = "def test_check_00():\n    pass\n"
    script = [_call("solution.py", solution) + "\n" + _call("test_solution.py", hack), "Done: implemented."]
    ctx, backend = context(script)
    generate = get_plugins().resolve("generate", "coding_agent")
    args = _args()
    out = asyncio.run(generate(args, _sample(he0), {"temperature": 1.0, "top_p": 1.0, "max_tokens": 512}))

    assert isinstance(out, list) and len(out) == 1  # history="model": one segment, no drift
    (s,) = out
    s.validate()
    assert s.status is Status.COMPLETED and s.episode_id
    assert len(backend.calls) == 2
    # tokens: exactly the last engine prompt + its output; trained tokens: exactly the two scripted turns
    assert s.tokens == backend.calls[1].prompt_ids + backend.calls[1].output.token_ids
    trained = [t for t, m in zip(s.tokens[s.prompt_length :], s.loss_mask, strict=True) if m]
    scripted = backend.turn_ids(script[0])[0] + backend.turn_ids(script[1])[0]
    assert trained == scripted
    assert sum(s.loss_mask) == len(scripted)
    assert [lp for lp, m in zip(s.rollout_log_probs, s.loss_mask, strict=True) if m] == [-0.5] * len(scripted)
    assert set(s.trained_weight_versions()) == {0}  # the scripted engine reports version 0 for its tokens
    assert s.tokens[: s.prompt_length] == backend.calls[0].prompt_ids
    # the episode's sampling parameters were forced on the agent's requests
    assert [(c.sampling_params["temperature"], c.sampling_params["max_tokens"]) for c in backend.calls] == [
        (1.0, 512),
        (1.0, 512),
    ]

    result = s.metadata["agent_result"]
    assert result["changed"] == {"solution.py": solution, "test_solution.py": hack}
    assert "+    for idx, elem in enumerate(numbers):" in result["diff"]
    assert result["agent_status"] == "completed" and result["exit_code"] == 0
    assert s.metadata["agent"]["final_message"] == "Done: implemented."

    reward = asyncio.run(get_plugins().resolve("reward", "tests")(args, s))
    assert reward == 1.0
    rt = s.metadata["reward_tests"]
    assert (rt["passed"], rt["total"], rt["ignored"]) == (7, 7, ["test_solution.py"])


def test_through_the_rollout_manager(context, he0):
    """Two episodes of one group (sequential: the script is shared): the first writes the canonical solution
    (reward 1.0), the second a solution returning True (exactly 4 of 7 checks); rewards land on the segments."""
    from vime_core.rollout.runner import GroupRunner

    prompt = load_problems()[0]["prompt"]
    script = [
        _call("solution.py", he0["metadata"]["canonical_solution"]),
        "done",
        _call("solution.py", prompt + "    return True\n"),
        "done",
    ]
    ctx, backend = context(script)
    args = _args()
    plugins = get_plugins()
    runner = GroupRunner(
        args,
        generate_fn=plugins.resolve("generate", "coding_agent"),
        reward_fn=plugins.resolve("reward", "tests"),
        hook=plugins.pm.hook,
    )
    group = [_sample(he0, 0), _sample(he0, 1)]
    asyncio.run(runner.run([group], 0))
    assert [(s.index, s.status, s.reward) for s in group] == [(0, Status.COMPLETED, 1.0), (1, Status.COMPLETED, 4 / 7)]
    assert group[0].episode_id != group[1].episode_id
    assert len(backend.calls) == 4


def test_agent_that_cannot_start_is_an_excluded_placeholder(context, he0):
    ctx, backend = context(["unused"])
    generate = get_plugins().resolve("generate", "coding_agent")
    s = asyncio.run(generate(_args("NoStartAgent"), _sample(he0), {"max_tokens": 64}))
    assert isinstance(s, Sample) and s.status is Status.FAILED and not s.is_trainable()
    assert s.metadata["error"] == "AgentHarnessError: the agent CLI is not installed"
    assert s.reward is None and backend.calls == []
    assert ctx.extras["agent_gateway"]._sessions == {}  # the episode's session was dropped


def test_sandbox_failure_is_an_excluded_placeholder(context, he0):
    ctx, backend = context(["unused"])
    generate = get_plugins().resolve("generate", "coding_agent")
    s = asyncio.run(generate(_args(sandbox=f"{__name__}:BrokenSandbox"), _sample(he0), {"max_tokens": 64}))
    assert s.status is Status.FAILED and s.metadata["error"].startswith("SandboxInfraError: ")
    assert "sandbox service unreachable" in s.metadata["error"]
    # an infrastructure failure: excluded by cause, never scored (so never trained as 0)
    assert s.metadata["failure"] == "sandbox_error" and s.reward is None


def test_misconfiguration_raises(context, he0):
    context(["unused"])
    generate = get_plugins().resolve("generate", "coding_agent")
    with pytest.raises(ValueError, match="needs --agent NAME"):
        asyncio.run(generate(_args(agent="x", **{}) if False else plugin_context(sandbox="local"), _sample(he0), {}))
