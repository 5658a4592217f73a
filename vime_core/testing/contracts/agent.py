"""Contract of agent harnesses."""

from __future__ import annotations

import asyncio
from typing import Any, ClassVar

import pytest

from vime_core.testing.contracts.base import _Contract
from vime_core.types import Sample, Status


class AgentHarnessContract(_Contract):
    """Contract of ``vime_register_agent_harnesses`` providers (:class:`vime_core.agent.harness.AgentHarness`).

    The kit runs the harness **for real**: a real :class:`~vime_core.agent.gateway.AgentGateway` on 127.0.0.1 backed
    by a :class:`~vime_core.agent.responders.ScriptedResponder` (the kit's tiny model tokenizer; the fixed assistant
    turns come from the plugin), a real sandbox from the plugin's factory with the gateway exposed inside
    (:meth:`~vime_core.sandbox.base.Sandbox.expose_host_port`), the agent CLI run through :meth:`AgentHarness.run`.

    Fixtures to supply:

    * ``harness``: an :class:`~vime_core.agent.harness.AgentHarness` instance, prepared on the host;
    * ``sandbox_factory``: ``factory(**kwargs) -> Sandbox`` (not started) of a backend with capability
      ``host_port``;
    * ``write_file_turns``: ``fn(path, content) -> list[str]``: the raw assistant turns (Hermes
      ``<tool_call>{json}</tool_call>`` format, the gateway's default parser) that make this agent write ``content``
      to ``path`` (relative to its working directory) with its own tools and then finish with a text answer;
    * ``sleep_turns``: ``fn(seconds) -> list[str]``: turns that make the agent run ``sleep <seconds>``.

    Checked with exact values: the file exists with exactly ``content``; the agent made exactly the scripted calls;
    the session's Samples train exactly the scripted turns' tokens (``loss_mask`` 1 exactly there, log-probs and
    versions as scripted, every trained token sampled in that context); status ``completed``; the wall-time budget
    kills a sleeping agent (``timeout``); the turn budget stops a looping agent (``max_turns``).
    """

    MODEL: ClassVar[str] = "vime-policy"
    PROMPT: ClassVar[str] = "Create the file requested by the task and then stop."
    #: seconds a contract episode may take (the CLIs start in a few seconds)
    EPISODE_WALL_S: ClassVar[float] = 240.0

    @pytest.fixture(scope="class")
    @classmethod
    def agent_tokenizer(cls, tmp_path_factory: pytest.TempPathFactory) -> Any:
        from transformers import AutoTokenizer

        from vime_core.testing.tiny_model import build_tiny_model

        d = build_tiny_model(tmp_path_factory.getbasetemp() / "vime-kit-agent-tiny", seed=0)
        return AutoTokenizer.from_pretrained(str(d))

    @staticmethod
    def _run(coro: Any) -> Any:
        return asyncio.run(coro)

    def _episode(self, harness, sandbox_factory, tok, turns, budget, read: str | None = None) -> dict[str, Any]:
        """One real episode; returns the run result, the file read back, the backend, turns and samples."""
        import uuid

        from vime_core.agent.gateway import AgentGateway
        from vime_core.agent.harness import AgentEndpoint
        from vime_core.agent.responders import ScriptedResponder

        backend = ScriptedResponder(tok, list(turns))
        gw = AgentGateway(tok, backend, served_model_name=self.MODEL).start()
        sid = f"sk-vime-kit-{uuid.uuid4().hex[:12]}"
        out: dict[str, Any] = {"backend": backend}

        async def body() -> None:
            async with sandbox_factory() as sb:
                addr = await sb.expose_host_port(gw.port)
                endpoint = AgentEndpoint(f"http://{addr}", sid, self.MODEL)
                await harness.install(sb)
                out["result"] = await harness.run(sb, prompt=self.PROMPT, endpoint=endpoint, budget=budget)
                if read is not None:
                    try:
                        out["file"] = await sb.read_file(read)
                    except FileNotFoundError:
                        out["file"] = None

        try:
            gw.open_session(sid, sampling_params={"max_tokens": budget.max_tokens}, max_turns=budget.max_turns)
            self._run(body())
            out["turns"] = gw.session_turns(sid)
            out["samples"] = gw.close_session(sid, Sample(prompt=self.PROMPT))
        finally:
            gw.stop()
        return out

    def test_is_an_agent_harness(self, harness: Any) -> None:
        from vime_core.agent.harness import AgentHarness

        assert isinstance(harness, AgentHarness) and type(harness).NAME, "a harness subclasses AgentHarness with NAME"
        assert harness.api in ("anthropic", "openai-chat", "openai-responses")

    def test_scripted_episode_writes_file_token_exact(
        self, harness: Any, sandbox_factory: Any, agent_tokenizer: Any, write_file_turns: Any
    ) -> None:
        from vime_core.agent.harness import AgentBudget
        from vime_core.agent.trajectory import check_token_exact

        content = "vime contract: the agent wrote this\nline 2\n"
        turns = write_file_turns("answer.txt", content)
        budget = AgentBudget(max_turns=len(turns) + 2, max_tokens=512, wall_time_s=self.EPISODE_WALL_S)
        ep = self._episode(harness, sandbox_factory, agent_tokenizer, turns, budget, read="answer.txt")
        res, backend, samples = ep["result"], ep["backend"], ep["samples"]
        assert res.status == "completed" and res.exit_code == 0, (res.status, res.exit_code, res.stderr[-2000:])
        assert ep["file"] == content.encode(), ep["file"]
        assert len(backend.calls) == len(turns), f"{len(backend.calls)} model calls for {len(turns)} scripted turns"
        expected = [t for turn in turns for t in backend.turn_ids(turn)[0]]
        trained = [s.tokens[s.prompt_length + i] for s in samples for i, m in enumerate(s.loss_mask) if m == 1]
        assert trained == expected, "the trained tokens are exactly the scripted turns' tokens"
        lps = [s.rollout_log_probs[i] for s in samples for i, m in enumerate(s.loss_mask) if m == 1]
        assert lps == [-0.5] * len(expected)
        assert all(set(s.loss_mask) <= {0, 1} and len(s.loss_mask) == s.response_length for s in samples)
        assert len({s.episode_id for s in samples}) == 1 and samples[0].episode_id
        assert all(s.status == Status.COMPLETED and not s.remove_sample for s in samples)
        check_token_exact(samples, ep["turns"])

    def test_wall_time_budget_kills_the_agent(
        self, harness: Any, sandbox_factory: Any, agent_tokenizer: Any, sleep_turns: Any
    ) -> None:
        from vime_core.agent.harness import AgentBudget

        turns = sleep_turns(600)
        budget = AgentBudget(max_turns=len(turns) + 2, max_tokens=512, wall_time_s=10.0)
        ep = self._episode(harness, sandbox_factory, agent_tokenizer, turns, budget)
        res = ep["result"]
        assert res.status == "timeout", (res.status, res.exit_code, res.stdout[-1000:], res.stderr[-1000:])
        assert res.duration_s < budget.wall_time_s + 60

    def test_turn_budget_stops_the_agent(
        self, harness: Any, sandbox_factory: Any, agent_tokenizer: Any, write_file_turns: Any
    ) -> None:
        from vime_core.agent.harness import AgentBudget

        tool_turns = write_file_turns("loop.txt", "again\n")[:-1]
        budget = AgentBudget(max_turns=2, max_tokens=512, wall_time_s=self.EPISODE_WALL_S)
        ep = self._episode(harness, sandbox_factory, agent_tokenizer, tool_turns * 6, budget)
        res = ep["result"]
        assert res.status == "max_turns", (res.status, res.exit_code, res.stdout[-1500:], res.stderr[-1000:])
        assert len(ep["backend"].calls) == 2
