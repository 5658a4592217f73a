"""Fixtures shared by the unit tests of the agent gateway."""

from __future__ import annotations

import pytest

from vime_core.agent.gateway import AgentGateway
from vime_core.agent.responders import ScriptedResponder


@pytest.fixture
def gateway(tok):
    """``make(script, template=None, **kw) -> (gateway, backend)``: an :class:`AgentGateway` started on 127.0.0.1
    in front of a :class:`ScriptedResponder` playing ``script`` (the test module's ``tok`` fixture is the tokenizer);
    every gateway made is stopped after the test."""
    started: list[AgentGateway] = []

    def make(script, template=None, **kw) -> tuple[AgentGateway, ScriptedResponder]:
        backend = ScriptedResponder(tok, script)
        gw = AgentGateway(tok, backend, chat_template=template, **kw).start()
        started.append(gw)
        return gw, backend

    yield make
    for gw in started:
        gw.stop()
