"""Sandboxes and agent harnesses are built from the run's typed configuration (``from_context`` →
``from_config(section, own flags)``); the Namespace forms of vime 0.x (``from_args``) still work for one minor
version, and a backend or harness that overrides only ``from_args`` is still built by it, with a
``DeprecationWarning`` naming the new form."""

from __future__ import annotations

import dataclasses
import warnings

import pytest

from vime_core.agent.harness import AgentHarness
from vime_core.cli.arguments import default_args
from vime_core.config import PluginConfig, flag
from vime_core.sandbox.limits import SandboxLimits
from vime_core.sandbox.local import LocalSandbox
from vime_core.testing.plugin_context import plugin_context

pytestmark = pytest.mark.unit

FLAGS = {"sandbox_memory_mb": 256, "sandbox_wall_time": 90.0, "sandbox_network": True, "sandbox_exec_timeout": 7}


def _facts(sb) -> tuple:
    return (sb.limits, sb.network, sb.default_timeout_s)


EXPECTED = (SandboxLimits(memory_bytes=256 << 20, wall_time_s=90.0, pids=512), True, 7.0)


def test_the_generic_flags_reach_the_sandbox_through_the_context():
    ctx = plugin_context(**FLAGS)
    assert _facts(LocalSandbox.from_context(ctx)) == EXPECTED
    assert _facts(LocalSandbox.from_config(ctx.sandbox)) == EXPECTED
    assert _facts(LocalSandbox.from_context(ctx, network=False))[1] is False  # keywords win
    assert _facts(LocalSandbox.from_config()) == (SandboxLimits(), False, 300.0)  # outside a run: the defaults


def test_from_args_of_vime_0x_gives_the_same_sandbox():
    assert _facts(LocalSandbox.from_args(default_args(**FLAGS))) == EXPECTED
    assert _facts(LocalSandbox.from_args(None)) == (SandboxLimits(), False, 300.0)


def test_a_backend_that_overrides_only_from_args_is_built_by_it_with_a_warning():
    seen = []

    class OldBackend(LocalSandbox):
        NAME = "old"

        @classmethod
        def from_args(cls, args, **kwargs):
            seen.append(args.sandbox_memory_mb)
            return super().from_args(args, **kwargs)

    match = r"OldBackend is built from an argparse.Namespace .*from_config"
    with pytest.warns(DeprecationWarning, match=match) as rec:
        sb = OldBackend.from_context(plugin_context(**FLAGS))
    assert seen == [256] and _facts(sb) == EXPECTED
    # the warning points at the line that called from_context
    assert [w.filename for w in rec if "OldBackend is built" in str(w.message)] == [__file__]


@dataclasses.dataclass(frozen=True, kw_only=True)
class _EchoFlags(PluginConfig):
    PREFIX = "agent-echo"
    TITLE = "agent-echo"
    agent_echo_greeting: str = flag(default="hi", help="what the agent says")


class _Echo(AgentHarness):
    NAME = "echo"
    FLAGS = _EchoFlags

    def __init__(self, greeting: str = "hi") -> None:
        self.greeting = greeting

    @classmethod
    def from_config(cls, flags: _EchoFlags | None = None) -> _Echo:
        return cls(greeting=(flags or _EchoFlags()).agent_echo_greeting)

    async def install(self, sandbox):  # not run here
        raise NotImplementedError

    async def run(self, sandbox, *, prompt, endpoint, budget, cwd=None):  # not run here
        raise NotImplementedError


class _Ctx:
    """A context whose run holds the harness's flag class (a run with the plugin installed)."""

    def __init__(self, own: PluginConfig) -> None:
        self.own = own

    def plugin(self, cls):
        assert cls is type(self.own)
        return self.own


def test_a_harness_reads_its_own_flags_from_the_context():
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        assert _Echo.from_context(_Ctx(_EchoFlags(agent_echo_greeting="hello"))).greeting == "hello"
    assert _Echo.from_config().greeting == "hi"
    assert _Echo.from_args(None).greeting == "hi"  # 0.x form, outside a run: the defaults


def test_a_harness_that_overrides_only_from_args_is_built_by_it_with_a_warning():
    class Old(_Echo):
        FLAGS = None
        from_config = AgentHarness.__dict__["from_config"]

        @classmethod
        def from_args(cls, args):
            return cls(greeting=f"model {args.model}")

    with pytest.warns(DeprecationWarning, match=r"agent harness Old is built from an argparse.Namespace") as rec:
        h = Old.from_context(plugin_context(model="m"))
    assert h.greeting == "model m"
    assert [w.filename for w in rec if "Old is built" in str(w.message)] == [__file__]
