"""Names resolve through the pluggy registry: duplicates, unknown names, dotted paths, built-ins, and every
registered object checked against its kind (protocol parameter names, base class, ``NAME``) with exact messages."""

import re

import pytest

from vime_core.agent.harness import AgentHarness
from vime_core.plugins.manager import Plugins, get_plugins
from vime_core.plugins.protocols import AdvantageEstimator, GenerateFn, RewardFn
from vime_core.plugins.registry import (
    Registry,
    RegistryError,
    check_callable_signature,
    check_protocol,
    check_subclass,
)
from vime_core.sandbox.local import LocalSandbox

pytestmark = pytest.mark.unit


async def _gen(ctx, sample, sampling_params):
    return sample


def test_builtins_register_through_hooks():
    plugins = get_plugins()
    assert {"default"} <= set(plugins.registries["generate"].names())
    assert {"reasoning_gym", "exact_match"} <= set(plugins.registries["reward"].names())
    assert {"torch"} <= set(plugins.registries["trainer"].names())
    assert {"disk"} <= set(plugins.registries["weight_sync"].names())
    entry = plugins.registries["trainer"].entries()[0]
    assert entry.provider == "vime_core.builtins.trainers" and entry.distribution.startswith("vime ")


def test_duplicate_name_names_both_providers():
    r = Registry("generate", "--generate")
    r.add("x", _gen, "plugin-a", "vime-a 1.0")
    with pytest.raises(
        RegistryError, match=r"plugin 'plugin-a' \(vime-a 1.0\) and by plugin 'plugin-b' \(vime-b 2.0\)"
    ):
        r.add("x", _gen, "plugin-b", "vime-b 2.0")


def test_unknown_name_lists_available_and_pip_hint():
    plugins = get_plugins()
    with pytest.raises(RegistryError, match="available: coding_agent, default, multi_turn"):
        plugins.resolve("generate", "nope")
    with pytest.raises(RegistryError, match="pip install vime-sandbox-docker"):
        Registry("sandbox", "--sandbox").get("docker")  # as on a machine without the docker plugin


def test_dotted_path_goes_through_the_same_check():
    r = Registry("generate", "--generate", check_callable_signature("ctx", "sample", "sampling_params", is_async=True))
    from vime_core.rollout.generators.default import generate

    assert r.get("vime_core.rollout.generators.default:generate") is generate
    assert r.get("vime_core.rollout.generators.default.generate") is generate
    with pytest.raises(RegistryError, match="cannot import module"):
        r.get("no_such_mod:fn")
    with pytest.raises(RegistryError, match="has no attribute"):
        r.get("vime_core.rollout.generators.default:missing")
    with pytest.raises(RegistryError) as e:
        r.get("vime_core.rewards.simple:normalize_answer")
    assert str(e.value) == (
        "--generate 'vime_core.rewards.simple:normalize_answer' = vime_core.rewards.simple.normalize_answer: "
        "expected async def (ctx, sample, sampling_params), found def (text)"
    )


def test_disable_plugins_env_blocks_a_builtin(monkeypatch):
    monkeypatch.setenv("VIME_DISABLE_PLUGINS", "vime_core.builtins.weight_sync")
    plugins = Plugins().load()
    assert plugins.registries["weight_sync"].names() == []
    assert "vime_core.builtins.weight_sync" not in {r["name"] for r in plugins.describe()}


async def _gen_renamed(ctx, s, params):
    return s


def _gen_sync(ctx, sample, sampling_params):
    return sample


async def _gen_extra(ctx, sample, sampling_params, tokenizer, *, seed=0):
    return sample


async def _gen_defaults(ctx, sample, sampling_params, tokenizer=None, *extra, seed=0, **kw):
    return sample


def _adv(ctx, group):
    return [[0.0] for _ in group]


def _where(name: str, obj) -> str:
    return f"plugin 'plugin-a' (vime-a 1.0) registers {name} 'x' = {obj.__module__}.{obj.__qualname__}"


def test_protocols_give_the_checked_parameter_names():
    gen = Registry("generate", "--generate", check_protocol(GenerateFn))
    gen.add("ok", _gen, "plugin-a", "vime-a 1.0")
    gen.add("defaults", _gen_defaults, "plugin-a", "vime-a 1.0")  # further parameters with defaults are fine
    assert gen.get("ok") is _gen
    cases = [
        (_gen_renamed, "found async def (ctx, s, params)"),
        (_gen_sync, "found def (ctx, sample, sampling_params)"),
        (_gen_extra, "found async def (ctx, sample, sampling_params, tokenizer, *, seed=0)"),
    ]
    for fn, found in cases:
        with pytest.raises(RegistryError) as e:
            gen.add("x", fn, "plugin-a", "vime-a 1.0")
        assert str(e.value) == f"{_where('generate', fn)}: expected async def (ctx, sample, sampling_params), {found}"
    reward = Registry("reward", "--reward", check_protocol(RewardFn))
    with pytest.raises(RegistryError) as e:
        reward.add("x", _gen, "plugin-a", "vime-a 1.0")  # a generate function given as a reward
    assert str(e.value) == (
        f"{_where('reward', _gen)}: expected async def (ctx, sample), found async def (ctx, sample, sampling_params)"
    )
    adv = Registry("advantage", "--advantage-estimator", check_protocol(AdvantageEstimator))
    adv.add("ok", _adv, "plugin-a", "vime-a 1.0")
    with pytest.raises(RegistryError) as e:
        adv.add("x", 3, "plugin-a", "vime-a 1.0")
    assert str(e.value) == "plugin 'plugin-a' (vime-a 1.0) registers advantage 'x' = 3: expected a callable " + (
        "def (ctx, group), found a int object"
    )
    any_sync = Registry("x", "--x", check_callable_signature("ctx", "group"))  # is_async=None: either is fine
    any_sync.add("sync", _adv, "plugin-a", "vime-a 1.0")
    with pytest.raises(RegistryError) as e:
        any_sync.add("x", _gen, "plugin-a", "vime-a 1.0")
    assert str(e.value).endswith(": expected def (ctx, group), found async def (ctx, sample, sampling_params)")


class _Harness(AgentHarness):
    NAME = "scripted"

    async def install(self, sandbox):
        pass

    async def run(self, sandbox, *, prompt, endpoint, budget, cwd=None):
        raise NotImplementedError


def test_agent_harnesses_are_checked_like_every_other_kind():
    agents = get_plugins().registries["agent"]
    assert agents._check is not None
    r = Registry("agent", "--agent", check_subclass(AgentHarness))
    r.add("scripted", _Harness, "plugin-a", "vime-a 1.0")
    with pytest.raises(RegistryError) as e:
        r.add("x", LocalSandbox, "plugin-a", "vime-a 1.0")
    assert str(e.value) == (
        "plugin 'plugin-a' (vime-a 1.0) registers agent 'x' = vime_core.sandbox.local.LocalSandbox: "
        "expected a subclass of vime_core.agent.harness.AgentHarness, found vime_core.sandbox.local.LocalSandbox"
    )


def test_a_class_registers_under_its_own_name():
    r = Registry("agent", "--agent", check_subclass(AgentHarness))
    with pytest.raises(RegistryError) as e:
        r.add("claude", _Harness, "plugin-a", "vime-a 1.0")
    assert str(e.value) == (
        f"plugin 'plugin-a' (vime-a 1.0) registers agent 'claude' = {__name__}._Harness: its NAME is 'scripted'; "
        "a class registers under its own NAME (register(_Harness.NAME, _Harness), or set NAME = 'claude')"
    )
    assert r.names() == []
    # a dotted path names the class by its import path, not by NAME: no NAME check there
    assert Registry("sandbox", "--sandbox").get("vime_core.sandbox.local:LocalSandbox") is LocalSandbox


def test_every_builtin_fits_its_kind():
    """The built-ins (and installed plugins) all pass their kind's check; classes are registered under NAME. Names
    registered by import path (``Lazy``) are resolved here, which runs their check."""
    plugins = get_plugins()
    for kind, registry in plugins.registries.items():
        for entry in registry.entries():
            obj = registry.get(entry.name)
            if kind == "flags":  # flag classes are registered under their PREFIX
                assert obj.PREFIX == entry.name, entry.name
            elif isinstance(obj, type):
                assert obj.NAME == entry.name, (kind, entry.name)
            assert re.fullmatch(r"[a-z0-9_-]+", entry.name), (kind, entry.name)
