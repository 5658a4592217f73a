"""Names resolve through the pluggy registry: duplicates, unknown names, dotted paths, built-ins."""

import pytest

from vime_core.plugins import Plugins, get_plugins
from vime_core.registry import Registry, RegistryError, check_callable_signature

pytestmark = pytest.mark.unit


async def _gen(args, sample, sampling_params):
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
    r = Registry(
        "generate", "--generate", check_callable_signature("args", "sample", "sampling_params", is_async=True)
    )
    from vime_core.rollout.generate import generate

    assert r.get("vime_core.rollout.generate:generate") is generate
    assert r.get("vime_core.rollout.generate.generate") is generate
    with pytest.raises(RegistryError, match="cannot import module"):
        r.get("no_such_mod:fn")
    with pytest.raises(RegistryError, match="has no attribute"):
        r.get("vime_core.rollout.generate:missing")
    with pytest.raises(RegistryError, match="must take parameters"):
        r.get("vime_core.rewards.simple:normalize_answer")
    with pytest.raises(RegistryError, match="must be an async function"):
        r.get("vime_core.rollout.generate:encode_prompt")


def test_disable_plugins_env_blocks_a_builtin(monkeypatch):
    monkeypatch.setenv("VIME_DISABLE_PLUGINS", "vime_core.builtins.weight_sync")
    plugins = Plugins().load()
    assert plugins.registries["weight_sync"].names() == []
    assert "vime_core.builtins.weight_sync" not in {r["name"] for r in plugins.describe()}
