"""A vLLM server that vime attaches to instead of starting (``--rollout-external``, slime's flags): the control
plane of :class:`~vime_core.engines.engine.VLLMServer` over an address, without a process to start, stop or
restart. How to start one: docs/external_engines.md.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import httpx

from vime_core.cluster.net import split_host_port
from vime_core.engines.engine import WORKER_EXTENSION_CLS, VLLMServer, VLLMServerError

logger = logging.getLogger("vime.rollout")

#: what an engine log path reads as in messages about an external engine (vime keeps no log of it)
EXTERNAL_LOG = "its own log, where it was started (vime keeps none of an external engine)"


class ExternalVLLMServer(VLLMServer):
    """A running vLLM OpenAI-compatible server at ``addr`` that vime did not start.

    It answers like a :class:`~vime_core.engines.engine.VLLMServer` (pause, resume, weight loads through the worker
    extension, weight-version labels, LoRA routes), but :meth:`start` and :meth:`stop` leave its process alone and
    :meth:`start_again` refuses: whoever started it owns its lifecycle. :meth:`wait_ready` reads the served model
    name from ``GET /v1/models`` and checks that vime's worker extension answers.

    :param addr: ``HOST:PORT`` (one value of ``--rollout-external-engine-addrs``).
    :param request_timeout_s: HTTP timeout in seconds for control-plane requests.
    :raises ValueError: ``addr`` is not ``HOST:PORT``.
    """

    display_name = log_name = "external vLLM server"

    def __init__(self, addr: str, *, request_timeout_s: float = 120.0) -> None:
        self.host, self.port = split_host_port(addr)
        self.addr = addr
        self.model = f"(external engine {addr})"
        self.python = None
        self.capabilities = None
        self.served_model_name = ""  # what GET /v1/models answers (wait_ready)
        self.log_path = EXTERNAL_LOG  # type: ignore[assignment]  # messages name it like a log file
        self.request_timeout_s = request_timeout_s
        self.proc = None
        self._log_file = None
        self._http = self._control_client()

    def command(self) -> list[str]:
        """:raises VLLMServerError: always: vime does not start an external engine."""
        raise VLLMServerError(f"{self.addr} is an external engine: vime does not start it")

    def start(self) -> ExternalVLLMServer:
        """Nothing to start: the server already runs (:meth:`wait_ready` checks it)."""
        return self

    def stop(self, grace_s: float | None = None) -> None:
        """Leave the server running (vime did not start it)."""
        logger.info("leaving the external engine %s running", self.url)

    def start_again(self) -> int:
        """:raises VLLMServerError: always: vime does not restart an engine it did not start."""
        raise VLLMServerError(f"the external engine {self.url} is down; vime restarts only engines it started")

    def _check_alive(self, what: str) -> None:
        """:raises VLLMServerError: the server no longer accepts connections."""
        if not self.is_running():
            raise VLLMServerError(f"the external engine {self.url} stopped accepting connections {what}")

    def is_running(self) -> bool:
        """Whether the server accepts connections (a server that accepts and does not answer is the health
        monitor's to time as hung)."""
        try:
            self._http.get("/health", timeout=5.0)
        except httpx.ConnectError:
            return False
        except httpx.HTTPError:
            return True
        return True

    def wait_ready(self, timeout_s: float = 300.0) -> float:
        """Wait until ``GET /health`` answers 200, then read the served model and probe the release.

        :param timeout_s: overall limit in seconds.
        :return: seconds spent waiting.
        :raises TimeoutError: not healthy within ``timeout_s`` (with the last answer or error).
        :raises VLLMServerError: it serves no model, or vime's worker extension does not answer (how to start
            it: docs/external_engines.md).
        """
        t0 = time.monotonic()
        while True:
            try:
                resp = self._http.get("/health", timeout=5.0)
                if resp.status_code == 200:
                    break
                last = f"GET /health answered {resp.status_code}"
            except httpx.HTTPError as e:
                last = repr(e)
            if time.monotonic() - t0 > timeout_s:
                raise TimeoutError(f"the external engine {self.url} is not healthy after {timeout_s:.0f} s: {last}")
            time.sleep(0.5)
        self.served_model_name = self._base_model()
        self.capabilities = self.probe()
        try:
            self.collective_rpc("vime_get_weight_version")
        except VLLMServerError as e:
            raise VLLMServerError(
                f"the external engine {self.url} does not answer vime's worker extension: start it with "
                f"--worker-extension-cls {WORKER_EXTENSION_CLS} and VLLM_SERVER_DEV_MODE=1 "
                f"(docs/external_engines.md); {e}"
            ) from None
        elapsed = time.monotonic() - t0
        logger.info("external engine %s ready: %s, %s", self.url, self.served_model_name, self.capabilities.describe())
        return elapsed

    def _base_model(self) -> str:
        """The served base model's name (``GET /v1/models``: the entry without a ``parent``; LoRA adapters have one).

        :raises VLLMServerError: no model, or an answer without the ``data`` list.
        """
        try:
            resp = self._http.get("/v1/models")
            resp.raise_for_status()
            models: list[dict[str, Any]] = resp.json()["data"]
        except (httpx.HTTPError, KeyError, ValueError) as e:
            raise VLLMServerError(f"GET {self.url}/v1/models failed: {e!r}") from None
        names = [m["id"] for m in models if not m.get("parent")]
        if not names:
            raise VLLMServerError(f"the external engine {self.url} serves no base model: {models!r:.500}")
        return names[0]

    def serve_initial_weights(self, model_path: str | Path, version: int) -> None:
        """Serve ``model_path``'s weights labelled ``version``, as an engine vime started from ``model_path`` would:
        a full load through the worker extension (the ``disk-delta`` base becomes ``model_path`` at version 0), a
        prefix-cache reset and the weight-version label. Whatever an earlier run left in the engine is gone.

        :raises VLLMServerError: the load was refused (e.g. another architecture: names and shapes are checked
            before anything is loaded).
        """
        self.collective_rpc("vime_load_weights", args=[str(Path(model_path).resolve())], kwargs={"version": 0})
        self.reset_prefix_cache()
        self.set_weight_version(version)
