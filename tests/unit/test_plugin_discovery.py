"""Entry-point discovery with real distributions on sys.path (a .dist-info + module written to a temp dir)."""

import pytest

from vime_core.plugins.manager import Plugins
from vime_core.plugins.registry import RegistryError

pytestmark = pytest.mark.unit


def _install_fake_dist(root, dist, version, ep_name, module, source):
    info = root / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(f"[vime]\n{ep_name} = {module}\n")
    (root / f"{module}.py").write_text(source)


GOOD = """
from vime_core import hookimpl

async def shout(args, sample):
    return 1.0

@hookimpl
def vime_register_reward_functions(register):
    register("shout", shout)
"""


@pytest.fixture
def site(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_entry_point_plugin_is_loaded_with_its_distribution(site):
    _install_fake_dist(site, "vime-reward-shout", "1.2.3", "reward-shout", "vime_reward_shout_mod", GOOD)
    p = Plugins().load()
    row = next(r for r in p.describe() if r["name"] == "reward-shout")
    assert (row["distribution"], row["version"], row["provides"]) == (
        "vime-reward-shout",
        "1.2.3",
        {"reward": ["shout"]},
    )


def test_broken_plugin_is_reported_and_fails_only_when_asked_for(site):
    _install_fake_dist(
        site,
        "vime-sandbox-broken",
        "0.3",
        "sandbox-broken",
        "vime_sandbox_broken_mod",
        "raise ImportError('needs the frobnicate SDK')\n",
    )
    p = Plugins().load()  # loading does not fail
    row = next(r for r in p.describe() if r["name"] == "sandbox-broken")
    assert row["error"] == "ImportError: needs the frobnicate SDK" and row["version"] == "0.3"
    assert p.resolve("reward", "exact_match")  # unrelated names still resolve
    with pytest.raises(
        RegistryError, match=r"sandbox-broken \(vime-sandbox-broken 0.3\): ImportError: needs the frobnicate"
    ):
        p.resolve("sandbox", "broken")


def test_misspelled_hook_is_caught_by_check_pending(site):
    _install_fake_dist(
        site,
        "vime-typo",
        "0.1",
        "typo",
        "vime_typo_mod",
        "from vime_core import hookimpl\n\n@hookimpl\ndef vime_register_reward_function(register):\n    pass\n",
    )
    from pluggy import PluginValidationError

    with pytest.raises(PluginValidationError, match="unknown hook 'vime_register_reward_function'"):
        Plugins().load()


def test_duplicate_across_distributions(site):
    _install_fake_dist(site, "vime-a", "1.0", "a", "vime_a_mod", GOOD)
    _install_fake_dist(site, "vime-b", "2.0", "b", "vime_b_mod", GOOD)
    with pytest.raises(RegistryError, match=r"'shout'.*\(vime-a 1.0\).*\(vime-b 2.0\)"):
        Plugins().load()


def test_load_plugins_switch(site, monkeypatch):
    _install_fake_dist(site, "vime-reward-shout", "1.2.3", "reward-shout", "vime_reward_shout_mod", GOOD)
    monkeypatch.setenv("VIME_LOAD_PLUGINS", "")
    names = {r["name"] for r in Plugins().load().describe()}
    assert "reward-shout" not in names and "vime_core.builtins.rewards" in names  # built-ins always load
    monkeypatch.setenv("VIME_LOAD_PLUGINS", "reward-shout")
    assert "reward-shout" in {r["name"] for r in Plugins().load().describe()}
    monkeypatch.delenv("VIME_LOAD_PLUGINS")
    monkeypatch.setenv("VIME_DISABLE_PLUGINS", "reward-shout")
    assert "reward-shout" not in {r["name"] for r in Plugins().load().describe()}
