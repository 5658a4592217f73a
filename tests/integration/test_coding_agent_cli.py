"""``coding_agent`` with the **real agent CLIs** (Claude Code, Codex; prepared from npm) in real sandboxes (docker,
local), the real gateway and the real ``tests`` reward: the engine is a :class:`ScriptedResponder` whose turns make the
agent write HumanEval/0's canonical solution with its own shell tool, so the reward must be exactly 1.0 and the
episode's trained tokens exactly the scripted turns' tokens. (The same with the real policy: test_coding_agent_run.py.)
"""

from __future__ import annotations

import asyncio
import json
import shlex

import pytest

from vime_core.agent.responders import ScriptedResponder
from vime_core.data.humaneval_export import load_problems, problem_to_row
from vime_core.plugins.manager import get_plugins
from vime_core.rollout.context import RolloutContext, set_rollout_context
from vime_core.testing.plugin_context import plugin_context
from vime_core.types import Sample, Status

pytestmark = pytest.mark.integration


def _call(name: str, arguments: dict) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def _write_turns(agent: str, path: str, content: str) -> list[str]:
    cmd = f"printf %s {shlex.quote(content)} > {shlex.quote(path)}"
    if agent == "claude-code":
        return [_call("Bash", {"command": cmd, "description": "write the solution"}), "Implemented."]
    return [_call("exec_command", {"cmd": cmd}), "Implemented."]


def _prepared(agent: str):
    try:
        cls = get_plugins().resolve("agent", agent)
    except Exception as e:  # noqa: BLE001 - the plugin is not installed
        pytest.skip(f"agent {agent!r} unavailable: {e}")
    h = cls()
    h.prepare(log=lambda *a: None)  # npm into ~/.cache/vime/agents, idempotent (scripts/install.sh prepares it)
    return h


def _docker_args() -> dict:
    try:
        from vime_sandbox_docker.image import build_image
        from vime_sandbox_docker.sandbox import DEFAULT_IMAGE, docker_client

        docker_client(timeout_s=10).ping()
    except Exception as e:  # noqa: BLE001 - any failure to reach the daemon
        reason = f"dockerd unreachable ({type(e).__name__}: {e}); start it with scripts/ci_services.sh"
        print(f"SKIP: {reason}")
        pytest.skip(reason)
    return {"sandbox_docker_image": build_image(DEFAULT_IMAGE)}


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


@pytest.mark.parametrize(
    "agent,sandbox", [("claude-code", "docker"), ("codex", "docker"), ("claude-code", "local"), ("codex", "local")]
)
def test_scripted_cli_episode_reward_one_token_exact(tok, agent, sandbox):
    _prepared(agent)
    extra = _docker_args() if sandbox == "docker" else {}
    problem = load_problems()[0]
    row = problem_to_row(problem, include_solution=True)
    script = _write_turns(agent, "solution.py", row["metadata"]["canonical_solution"])
    backend = ScriptedResponder(tok, script)
    ctx = RolloutContext(client=backend, tokenizer=tok, weight_version=0)
    set_rollout_context(ctx)
    args = plugin_context(
        agent=agent,
        sandbox=sandbox,
        agent_max_turns=4,
        agent_wall_time=240.0,
        agent_max_tokens=1024,
        reward_tests_timeout=60.0,
        **extra,
    )
    try:
        generate = get_plugins().resolve("generate", "coding_agent")
        sample = Sample(prompt=row["prompt"], metadata=json.loads(json.dumps(row["metadata"])))
        samples = asyncio.run(generate(args, sample, {"temperature": 1.0, "max_tokens": 1024}))
        assert isinstance(samples, list), samples.metadata.get("error") or samples.metadata.get("excluded")
        # the agent made exactly the scripted calls; every trained token is a scripted one, sampled in that context
        assert len(backend.calls) == len(script)
        turns = [c.output for c in backend.calls]
        trained = [t for s in samples for t, m in zip(s.tokens[s.prompt_length :], s.loss_mask, strict=True) if m]
        assert trained == [t for o in turns for t in o.token_ids]
        assert all(s.status is Status.COMPLETED for s in samples) and len({s.episode_id for s in samples}) == 1
        for s in samples:  # each segment is the last engine call it holds, exactly
            last = next(c for c in reversed(backend.calls) if s.tokens[: len(c.prompt_ids)] == c.prompt_ids)
            assert s.tokens == last.prompt_ids + last.output.token_ids
        result = samples[0].metadata["agent_result"]
        assert result["changed"] == {"solution.py": row["metadata"]["canonical_solution"]}
        assert samples[0].metadata["agent"]["status"] == "completed"
        reward = asyncio.run(get_plugins().resolve("reward", "tests")(args, samples[0]))
        assert reward == 1.0
        assert samples[0].metadata["reward_tests"]["passed"] == 7
    finally:
        gw = ctx.extras.get("agent_gateway")
        if gw is not None:
            gw.stop()
        set_rollout_context(None)
