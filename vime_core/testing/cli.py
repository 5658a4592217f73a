"""Run the ``vime`` command in a subprocess, as end-to-end tests do."""

from __future__ import annotations

import os
import subprocess
import sys


def run_vime(*argv: str, timeout: float = 900) -> subprocess.CompletedProcess:
    """``python -m vime_core.cli ARGV`` with unbuffered output (this interpreter, this environment).

    :param timeout: seconds before :class:`subprocess.TimeoutExpired`.
    :return: the finished process (``stdout``/``stderr`` as text).
    :raises AssertionError: on a non-zero exit, with the command and the tails of stdout (4000 characters) and
        stderr (6000 characters).
    """
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.run(
        [sys.executable, "-m", "vime_core.cli", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    if proc.returncode != 0:
        raise AssertionError(
            f"vime {' '.join(argv)} exited {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
        )
    return proc
