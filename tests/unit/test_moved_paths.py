"""The import paths of vime 0.1 that moved when vime_core's folders became floors keep working until vime
0.2 (:mod:`vime_core._moved`): an old path warns once, naming its new path, and is the same module."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from vime_core._moved import GONE, MOVED, REMOVED_IN

pytestmark = pytest.mark.unit

#: run in a fresh interpreter: a path imported earlier in the test session would not warn again
PROBE = r"""
import warnings
import vime_core
import vime_core.config.context as new_context
import vime_core.engines.client as new_client
with warnings.catch_warnings(record=True) as first:
    warnings.simplefilter("always")
    from vime_core.rollout.client import RouterClient
    import vime_core.context as old_context
    from vime_core.plugins import get_plugins
with warnings.catch_warnings(record=True) as again:
    warnings.simplefilter("always")
    import vime_core.rollout.client as old_client
    from vime_core.context import PluginContext
    from vime_core.plugins import get_plugins as get_plugins_again
from vime_core.plugins.manager import get_plugins as new_get_plugins
assert RouterClient is new_client.RouterClient and old_client is new_client and old_context is new_context
assert PluginContext is new_context.PluginContext and get_plugins is get_plugins_again is new_get_plugins
print([(w.category.__name__, w.filename == __file__, str(w.message)) for w in first])
print(len(again))
"""


def test_an_old_path_warns_once_and_is_the_new_module(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    out = subprocess.run([sys.executable, str(probe)], capture_output=True, text=True, check=True).stdout
    first, again = out.strip().splitlines()
    assert first == str(
        [
            (
                "DeprecationWarning",
                True,
                f"vime_core.rollout.client moved to vime_core.engines.client; the old import "
                f"path goes in vime {REMOVED_IN}",
            ),
            (
                "DeprecationWarning",
                True,
                f"vime_core.context moved to vime_core.config.context; the old import path goes in vime {REMOVED_IN}",
            ),
            (
                "DeprecationWarning",
                True,
                f"vime_core.plugins.get_plugins moved to vime_core.plugins.manager.get_plugins; "
                f"the old path goes in vime {REMOVED_IN}",
            ),
        ]
    )
    assert again == "0"


def test_every_alias_names_a_module_that_exists_and_no_old_file_is_left():
    assert MOVED and all(importlib.util.find_spec(new) is not None for new in MOVED.values())
    root = Path(importlib.util.find_spec("vime_core").origin).parent.parent
    left = [
        old
        for old in [*MOVED, *GONE]
        if (root / (old.replace(".", "/") + ".py")).exists() or (root / old.replace(".", "/") / "__init__.py").exists()
    ]
    assert left == []
