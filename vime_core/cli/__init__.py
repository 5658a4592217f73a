"""The ``vime`` command and its subcommands (:mod:`.commands`), the ``vime run`` parser generated from the typed config
(:mod:`.arguments`) and the cross-flag checks (:mod:`.checks`). Nothing below it imports it.
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:  # `vime = vime_core.cli:main` of installs made before 0.1.x
    if name == "main":
        from vime_core.cli.commands import main

        return main
    raise AttributeError(name)
