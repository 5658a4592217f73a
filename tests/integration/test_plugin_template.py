"""A new user's path: make a plugin from the template, pip install it, see it in `vime plugins`, run the kit."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


def _run(*cmd, **kw):
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, **kw)
    assert out.returncode == 0, f"{cmd} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


def test_plugin_from_template_installs_lists_and_passes_the_kit(tmp_path):
    _run(sys.executable, str(ROOT / "scripts" / "new_plugin.py"), "reward", "demo", "--dest", str(tmp_path))
    plugin = tmp_path / "vime-reward-demo"
    assert (plugin / "src" / "vime_reward_demo" / "hooks.py").exists()
    _run(sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "-q", str(plugin))
    try:
        rows = {
            r["name"]: r
            for r in json.loads(_run(sys.executable, "-m", "vime_core.cli", "plugins", "--json").stdout)
        }
        assert rows["reward-demo"]["distribution"] == "vime-reward-demo"
        assert rows["reward-demo"]["version"] == "0.1.0"
        assert rows["reward-demo"]["provides"] == {"reward": ["demo"], "flags": ["reward-demo"]}
        assert rows["reward-demo"]["hooks"] == ["vime_register_flags", "vime_register_reward_functions"]
        result = _run(
            sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(plugin / "tests"), cwd=tmp_path
        )
        assert "8 passed" in result.stdout  # discovery, 3 reward + 4 flag contract tests (no_overrides in each)
        args = _run(sys.executable, "-m", "vime_core.cli", "args").stdout
        assert "--reward-demo-example" in args
    finally:
        subprocess.run([sys.executable, "-m", "pip", "uninstall", "-y", "-q", "vime-reward-demo"], timeout=120)
