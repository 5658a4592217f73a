"""vime: RL post-training for LLMs.

Megatron/torch trains, vLLM (behind vllm-router) generates, a data buffer feeds both.

Every moving part is a plugin registered through pluggy hooks (see :mod:`vime_core.hookspecs`).
"""

from vime_core.version import __version__

__all__ = ["__version__", "hookimpl"]


def __getattr__(name: str):  # lazy so that `import vime_core` stays cheap
    if name == "hookimpl":
        from vime_core.hookspecs import hookimpl

        return hookimpl
    raise AttributeError(name)
