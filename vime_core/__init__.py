"""vime: RL post-training for LLMs.

Megatron/torch trains, vLLM (behind vllm-router) generates, a data buffer feeds both.

Every moving part is a plugin registered through pluggy hooks (see :mod:`vime_core.plugins.hookspecs`).
"""

import os

# Ray reads these when it is first imported (ray._private.ray_constants), so they are set on `import vime_core`,
# before anything can import Ray: the node address is 127.0.0.1 and every Ray process listens on loopback only.
# A multi-machine Ray cluster needs RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1 in the environment (setdefault keeps it).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

from vime_core import _moved  # noqa: E402  (the 0.1 import paths that moved, until vime 0.2)
from vime_core.version import __version__  # noqa: E402

_moved.install()

__all__ = ["__version__", "hookimpl"]


def __getattr__(name: str):  # lazy so that `import vime_core` stays cheap
    if name == "hookimpl":
        from vime_core.plugins.hookspecs import hookimpl

        return hookimpl
    raise AttributeError(name)
