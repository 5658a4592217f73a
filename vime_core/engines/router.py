"""The real ``vllm-router`` (Rust, from the ``vllm-router`` pip package) as a managed subprocess, plus its admin API.

Both its HTTP port and its Prometheus port listen on 127.0.0.1 only.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from vime_core.cluster.net import find_free_port
from vime_core.engines.process import ManagedServer

logger = logging.getLogger("vime.rollout")


class VLLMRouterError(RuntimeError):
    """The router failed to start, died, or refused an admin request."""


#: the router policy per generate function when ``--router-policy`` is not given, chosen from
#: ``bench/router_policy.py`` (docs/router.md): episodes that call the engines several times with one session id
#: (``multi_turn``, ``coding_agent``) keep each session on one engine, so every turn reuses the previous turn's
#: prefix cache, while new sessions go to the least-loaded engine
SESSION_POLICY = "sticky_least_loaded"
DEFAULT_POLICIES = {"multi_turn": SESSION_POLICY, "coding_agent": SESSION_POLICY}


def router_policy(generate: str, router_args: list[str]) -> tuple[str, list[str]]:
    """The policy to start the router with and the remaining ``--router-*`` arguments.

    :param generate: the ``--generate`` name (its default policy: :data:`DEFAULT_POLICIES`, else ``round_robin``).
    :param router_args: the forwarded ``--router-*`` arguments; a ``--policy X`` (or ``--policy=X``) there wins and is
        taken out (so the router gets one ``--policy``).
    :return: ``(policy, other arguments)``.
    """
    rest, policy = [], DEFAULT_POLICIES.get(generate, "round_robin")
    i = 0
    while i < len(router_args):
        arg = router_args[i]
        if arg == "--policy" and i + 1 < len(router_args):
            policy, i = router_args[i + 1], i + 2
            continue
        if arg.startswith("--policy="):
            policy = arg.split("=", 1)[1]
        else:
            rest.append(arg)
        i += 1
    return policy, rest


def router_executable() -> str:
    """Path of the ``vllm-router`` console script: next to ``sys.executable`` (same venv), else on ``PATH``.

    :raises FileNotFoundError: if it is not installed (``pip install vllm-router``).
    """
    candidate = Path(sys.executable).parent / "vllm-router"
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return _runnable(str(candidate))
    found = shutil.which("vllm-router")
    if found:
        return _runnable(found)
    raise FileNotFoundError(f"vllm-router not found next to {sys.executable} nor on PATH: pip install vllm-router")


def _runnable(script: str) -> str:
    """``script``, once its ``#!`` interpreter exists (a console script installed with ``pip --target`` on another
    machine names that machine's Python, and starting it fails with a bare ``No such file or directory``).

    :raises FileNotFoundError: naming the script and the missing interpreter.
    """
    with open(script, "rb") as f:
        first = f.readline(4096)
    if first.startswith(b"#!"):
        words = first[2:].decode(errors="replace").split()
        if words and words[0].startswith("/") and not os.path.exists(words[0]):
            raise FileNotFoundError(
                f"{script}: its interpreter {words[0]} does not exist on this machine (installed by another Python, "
                f"e.g. pip --target elsewhere): reinstall vllm-router here, or rewrite its first line to "
                f"#!{sys.executable}"
            )
    return script


class VLLMRouter(ManagedServer):
    """A real vllm-router on 127.0.0.1 in front of vLLM servers, run as a subprocess in its own session (start,
    readiness, log file, stop and context manager: :class:`vime_core.engines.process.ManagedServer`).

    :param worker_urls: base URLs of the vLLM servers (e.g. ``["http://127.0.0.1:8001"]``); may be empty and filled
        later with :meth:`add_worker`.
    :param port: HTTP port; ``None`` picks a free one.
    :param policy: routing policy (``round_robin``, ``cache_aware``, ``consistent_hash``, ...).
    :param extra_args: further vllm-router CLI arguments, passed through unchanged
        (e.g. ``["--request-timeout-secs", "120"]``).
    :param prometheus_port: metrics port on 127.0.0.1; ``None`` picks a free one.
    :param log_path: file receiving the router's stdout and stderr (default: a file in the temp dir).
    :param request_timeout_s: HTTP timeout in seconds for admin requests.
    """

    error_cls = VLLMRouterError
    display_name = "router"
    log_name = "vllm-router"
    default_grace_s = 10.0

    def __init__(
        self,
        worker_urls: list[str] | None = None,
        *,
        port: int | None = None,
        policy: str = "round_robin",
        extra_args: list[str] | None = None,
        prometheus_port: int | None = None,
        log_path: str | Path | None = None,
        request_timeout_s: float = 60.0,
    ) -> None:
        self.worker_urls = list(worker_urls or [])
        self.port = port or find_free_port()
        self.policy = policy
        self.extra_args = list(extra_args or [])
        self.prometheus_port = prometheus_port or find_free_port()
        tmp = Path(os.environ.get("TMPDIR", "/tmp"))
        self.log_path = Path(log_path) if log_path else tmp / f"vllm-router-{self.port}.log"
        self.proc = None
        self._log_file = None
        self._attached_url: str | None = None
        self._http = httpx.Client(base_url=self.url, timeout=request_timeout_s, trust_env=False)

    @classmethod
    def attach(cls, url: str, request_timeout_s: float = 60.0) -> VLLMRouter:
        """A handle on a router that is already running at ``url`` (not started or stopped by vime).

        Only the admin API (:meth:`add_worker`, :meth:`remove_worker`, :meth:`list_workers`) and :meth:`wait_ready`
        are meaningful; :meth:`stop` leaves the router running.
        """
        self = cls.__new__(cls)
        self.worker_urls, self.policy, self.extra_args = [], "", []
        self.port = httpx.URL(url).port or 80
        self.prometheus_port = 0
        self.log_path = Path(os.devnull)
        self.proc, self._log_file = None, None
        self._attached_url = url.rstrip("/")
        self._http = httpx.Client(base_url=self._attached_url, timeout=request_timeout_s, trust_env=False)
        return self

    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:30000``."""
        return self._attached_url or f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        """The argv used to start the router."""
        cmd = [router_executable(), "--host", "127.0.0.1", "--port", str(self.port), "--policy", self.policy]
        cmd += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(self.prometheus_port)]
        if self.worker_urls:
            cmd += ["--worker-urls", *self.worker_urls]
        return cmd + self.extra_args

    # ---------------------------------------------------------------- lifecycle

    def start(self) -> VLLMRouter:
        """Start the subprocess (returns at once; call :meth:`wait_ready`).

        :raises VLLMRouterError: if it is already running, or is an attached router.
        :raises FileNotFoundError: if vllm-router is not installed.
        """
        if self._attached_url is not None:
            raise VLLMRouterError(f"router on {self.url} is attached, not managed: it cannot be started")
        return super().start()

    def environment(self) -> dict[str, str]:
        """The environment of the router process (``NO_COLOR=1``: plain log lines)."""
        return dict(os.environ, NO_COLOR="1")

    def _check_alive(self, what: str) -> None:
        if self._attached_url is not None:
            return
        super()._check_alive(what)

    def wait_ready(self, timeout_s: float = 120.0, require_workers: bool | None = None) -> float:
        """Wait until the router answers ``/liveness``, and ``/readiness`` (≥ 1 healthy worker) if required.

        :param timeout_s: overall limit in seconds (the router itself waits for its workers on startup).
        :param require_workers: wait for a healthy worker; default: whether ``worker_urls`` is non-empty.
        :return: seconds spent waiting.
        :raises VLLMRouterError: if the process dies (message includes the last 40 log lines).
        :raises TimeoutError: if not ready within ``timeout_s``.
        """
        if require_workers is None:
            require_workers = bool(self.worker_urls)
        path = "/readiness" if require_workers else "/liveness"
        t0 = time.monotonic()
        self._wait_http(path, t0=t0, timeout_s=timeout_s, poll_s=0.2, state=f"ready ({path})")
        elapsed = time.monotonic() - t0
        logger.info("vllm-router on %s ready after %.1f s", self.url, elapsed)
        return elapsed

    def is_running(self) -> bool:
        """Whether the router process is alive (for an attached router: whether ``/liveness`` answers 200)."""
        if self._attached_url is not None:
            try:
                return self._http.get("/liveness", timeout=5).status_code == 200
            except httpx.HTTPError:
                return False
        return super().is_running()

    # ---------------------------------------------------------------- admin API

    def _admin(self, path: str, url: str) -> str:
        try:
            resp = self._http.post(path, params={"url": url})
        except httpx.HTTPError as e:
            raise VLLMRouterError(f"POST {self.url}{path}?url={url} failed: {e!r}") from e
        if resp.status_code != 200:
            raise VLLMRouterError(f"POST {self.url}{path}?url={url} returned {resp.status_code}: {resp.text[:2000]}")
        return resp.text

    def add_worker(self, url: str) -> None:
        """Add a vLLM server (``POST /add_worker?url=``). The router first waits for the worker to be healthy
        (up to its ``--worker-startup-timeout-secs``), so add servers that are already ready.

        :raises VLLMRouterError: if refused (e.g. ``Worker ... already exists``, HTTP 400).
        """
        self._admin("/add_worker", url)
        if url not in self.worker_urls:
            self.worker_urls.append(url)

    def remove_worker(self, url: str) -> None:
        """Remove a vLLM server (``POST /remove_worker?url=``); new requests stop going there. Removing an unknown
        URL succeeds. :raises VLLMRouterError: on a non-200 answer."""
        self._admin("/remove_worker", url)
        if url in self.worker_urls:
            self.worker_urls.remove(url)

    def list_workers(self) -> list[str]:
        """URLs of the workers the router currently knows (``GET /list_workers``)."""
        resp = self._http.get("/list_workers")
        resp.raise_for_status()
        return list(resp.json().get("urls", []))

    def workers(self) -> list[dict[str, Any]]:
        """Worker details (``GET /workers``): url, is_healthy, load, ..."""
        resp = self._http.get("/workers")
        resp.raise_for_status()
        return list(resp.json().get("workers", []))
