"""Health monitor of the rollout's vLLM engines and router: a dead or hung engine is replaced, a dead router restarted.

:class:`EngineMonitor` is a background thread of the rollout manager: it takes a down engine out of the router,
starts a replacement in its slot (with backoff, a bounded number of times), brings it to the current weight version
and re-adds it; :func:`generate_with_retries` regenerates samples whose engine died under them; when every slot is
lost the next rollout or weight update raises :class:`EnginesLostError`. What is watched, the flags, metrics and
events: docs/engine_health.md.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from vime_core.config import EngineConfig
from vime_core.config.context import PluginContext
from vime_core.engines.answers import is_client_error
from vime_core.engines.weight_recovery import WeightRecovery
from vime_core.engines.weight_update import update_engines
from vime_core.failures import FailureCause, classify_failure
from vime_core.weight_sync.base import WeightSyncStrategy, WeightUpdate

logger = logging.getLogger("vime.rollout")

EVENTS_FILE = "health_events.jsonl"
#: failure causes of a generation attempt that a regeneration on another engine can cure
RETRYABLE = (FailureCause.ENGINE_ERROR, FailureCause.TIMEOUT)
#: the per-step counters of :meth:`EngineMonitor.take_metrics` (``rollout/<key>``)
RESTART_KEYS = ("engine_restarts", "router_restarts", "requests_retried")


class EnginesLostError(RuntimeError):
    """Every engine is gone and no restart is left; the message names each engine, its exit and its log."""


def engines_lost(error: BaseException) -> bool:
    """Whether ``error`` is (or, raised in a Ray actor, wraps) an :class:`EnginesLostError`."""
    return isinstance(error, EnginesLostError) or isinstance(getattr(error, "cause", None), EnginesLostError)


@dataclass(frozen=True)
class MonitorConfig:
    """The monitor's settings (``vime run`` flags, see :meth:`from_args`).

    :ivar max_restarts: replacements per engine slot (and router restarts) over the run; 0: a dead engine is lost.
    :ivar backoff_s: seconds before a slot's first restart; doubled for each further one.
    :ivar interval_s: seconds between two health checks.
    :ivar hang_timeout_s: seconds of failing ``/health`` after which a running engine counts as hung.
    :ivar startup_timeout_s: seconds a replacement may take to become ready.
    :ivar max_request_retries: regenerations per sample after engine/connection errors.
    """

    max_restarts: int
    backoff_s: float
    interval_s: float
    hang_timeout_s: float
    startup_timeout_s: float
    max_request_retries: int

    @classmethod
    def from_config(cls, engine: EngineConfig, restarts: bool = True) -> MonitorConfig:
        """From ``--rollout-max-engine-restarts``, ``--rollout-engine-restart-backoff``,
        ``--rollout-health-check-interval``, ``--rollout-engine-hang-timeout``, ``--rollout-engine-startup-timeout``
        and ``--rollout-max-request-retries`` (their defaults are the flags'); ``restarts=False`` (engines vime did
        not start, ``--rollout-external``): a dead engine stays out."""
        return cls(
            max_restarts=engine.rollout_max_engine_restarts if restarts else 0,
            backoff_s=engine.rollout_engine_restart_backoff,
            interval_s=engine.rollout_health_check_interval,
            hang_timeout_s=engine.rollout_engine_hang_timeout,
            startup_timeout_s=engine.rollout_engine_startup_timeout,
            max_request_retries=engine.rollout_max_request_retries,
        )


@dataclass
class EngineSlot:
    """One engine position: the engine object in it and its state (``up``, ``down``: being replaced, ``lost``)."""

    index: int
    engine: Any
    state: str = "up"
    restarts: int = 0
    down_since: float | None = None
    unhealthy_since: float | None = None
    last_exit: str = ""


def exit_code(engine: Any) -> int | None:
    """The exit code of ``engine``'s server process (``None`` while it runs or when unknown)."""
    own = getattr(engine, "exit_code", None)
    if callable(own):
        return own()
    proc = getattr(engine, "proc", None)
    return proc.poll() if proc is not None else None


def keep_log(path: str | Path, n: int) -> Path | None:
    """Rename a crashed process's log ``x.log`` to ``x.exit<n>.log`` (a restart would overwrite it); the new name."""
    path = Path(path)
    if not path.is_file():
        return None
    kept = path.with_name(f"{path.stem}.exit{n}{path.suffix}")
    os.replace(path, kept)
    return kept


def restart_engine(engine: Any) -> None:
    """Stop what is left of ``engine`` and start it again (returns at once): on the same port, or on a fresh one when
    the old process still holds it (``engine.url`` then changes; the caller adds the new URL to the router).

    An engine with its own ``restart`` (a :class:`~vime_core.engines.engine_actor.RemoteEngine`, whose actor restarts
    the server on its node) uses it; a local :class:`~vime_core.engines.engine.VLLMServer` uses ``start_again``.
    """
    own = getattr(engine, "restart", None)
    if callable(own):
        own()
        return
    again = getattr(engine, "start_again", None)
    if callable(again):
        again()
        return
    engine.stop()
    engine.start()


class EngineMonitor:
    """Watches the engines and the router, replaces what died (see the module docstring).

    :param engines: the engines, ready and at weight version ``recovery.version``; the list is not copied: a slot's
        engine object stays the same across restarts.
    :param router: the :class:`~vime_core.engines.router.VLLMRouter` in front of them.
    :param recovery: how a replacement is brought to the current weight version.
    :param config: the settings.
    :param manage_router: restart the router when its process exits (``False`` for an attached router).
    :param log_dir: where ``health_events.jsonl`` is written (``None``: nowhere).
    """

    def __init__(
        self,
        engines: list[Any],
        router: Any,
        recovery: WeightRecovery,
        config: MonitorConfig,
        *,
        manage_router: bool = True,
        log_dir: str | Path | None = None,
    ) -> None:
        self.slots = [EngineSlot(i, e) for i, e in enumerate(engines)]
        self.router = router
        self.recovery = recovery
        self.config = config
        self.manage_router = manage_router
        self.events_path = Path(log_dir) / EVENTS_FILE if log_dir is not None else None
        self.lock = threading.RLock()  # weights and router membership: sync_weights, a replacement's load, restarts
        self._state = threading.Lock()  # slot states and counters
        self._events_lock = threading.Lock()
        self.counts: Counter[str] = Counter()
        self.totals: Counter[str] = Counter()
        self.recoveries: list[float] = []
        self.router_restarts = 0
        self.polls = 0
        self._retrying: list[tuple[str, str]] = []  # samples waiting to be regenerated: (group/index, error)
        self.fatal: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._http = httpx.Client(timeout=5.0, trust_env=False, headers={"Connection": "close"})

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> EngineMonitor:
        """Start the checking thread (a daemon)."""
        self._thread = threading.Thread(target=self._run, name="vime-health", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop checking and restarting (a replacement being started is left to the manager's shutdown)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        self._http.close()

    def _run(self) -> None:
        while not self._stop.wait(self.config.interval_s):
            try:
                self.check_once()
            except Exception:  # noqa: BLE001 - the monitor must outlive any single check
                logger.exception("health check failed")

    # ---------------------------------------------------------------- checks
    def check_once(self) -> None:
        """One round: the router, then every serving engine; bumps :attr:`polls` when done."""
        if self.manage_router and self.router is not None and not self.router.is_running():
            self._restart_router()
        for slot in self.slots:
            if slot.state == "up":
                why = self._probe(slot)
                if why is not None:
                    self.mark_down(slot, why)
        self.polls += 1

    def _healthy(self, engine: Any) -> bool:
        try:
            return self._http.get(f"{engine.url}/health").status_code == 200
        except httpx.HTTPError:
            return False

    def _probe(self, slot: EngineSlot) -> str | None:
        """``None`` if the engine is fine (or not yet hung long enough), else why it is down."""
        if not slot.engine.is_running():
            return f"exited with code {exit_code(slot.engine)}"
        if self._healthy(slot.engine):
            slot.unhealthy_since = None
            return None
        now = time.monotonic()
        if slot.unhealthy_since is None:
            slot.unhealthy_since = now
        elif now - slot.unhealthy_since >= self.config.hang_timeout_s:
            return f"hung: GET /health failing for {now - slot.unhealthy_since:.0f} s"
        return None

    def _confirm_down(self, slot: EngineSlot, wait_s: float = 10.0) -> str | None:
        """After a request to ``slot`` failed: why it is down, or ``None`` if it answers ``/health`` (a real error)."""
        deadline = time.monotonic() + wait_s
        while True:
            if not slot.engine.is_running():
                return f"exited with code {exit_code(slot.engine)}"
            if self._healthy(slot.engine):
                return None
            if time.monotonic() > deadline:
                return f"hung: GET /health failing for {wait_s:.0f} s after a failed request"
            time.sleep(0.2)

    def mark_down(self, slot: EngineSlot, why: str) -> None:
        """Take ``slot`` out of the router and start replacing it (once; later calls for a down slot do nothing)."""
        with self._state:
            if slot.state != "up":
                return
            slot.state, slot.down_since, slot.last_exit = "down", time.monotonic(), why
        url = slot.engine.url
        logger.error("engine %d (%s) %s (log: %s); removing it from the router", slot.index, url, why, self._log(slot))
        self._event("engine_down", engine=slot.index, url=url, reason=why, log=self._log(slot))
        try:
            self.router.remove_worker(url)
        except Exception as e:  # noqa: BLE001 - a dead router is restarted with the engines that are up
            logger.warning("removing %s from the router failed: %s", url, e)
        threading.Thread(target=self._replace, args=(slot,), name=f"vime-restart-{slot.index}", daemon=True).start()

    @staticmethod
    def _log(slot: EngineSlot) -> str:
        return str(getattr(slot.engine, "log_path", "?"))

    # ---------------------------------------------------------------- recovery
    def _replace(self, slot: EngineSlot) -> None:
        """Restart ``slot`` until it serves the current version again, or its restarts are spent (then ``lost``)."""
        while not self._stop.is_set():
            if slot.restarts >= self.config.max_restarts or not self.recovery.supported:
                why = (
                    f"--rollout-max-engine-restarts {self.config.max_restarts} spent"
                    if self.recovery.supported
                    else f"weight version {self.recovery.version} cannot be recovered with {self.recovery.kind!r}"
                )
                with self._state:
                    slot.state = "lost"
                self._event("engine_lost", engine=slot.index, url=slot.engine.url, reason=why)
                logger.error("engine %d (%s) is lost: %s", slot.index, slot.engine.url, why)
                self._check_all_lost()
                return
            delay = self.config.backoff_s * 2**slot.restarts
            if self._stop.wait(delay):
                return
            slot.restarts += 1
            t0 = time.monotonic()
            try:
                if getattr(slot.engine, "restart", None) is None:  # a remote engine's actor keeps its own log
                    keep_log(self._log(slot), slot.restarts)
                restart_engine(slot.engine)
                slot.engine.wait_ready(timeout_s=self.config.startup_timeout_s)
                with self.lock:
                    load_s = self.recovery.load(slot.engine)
                    try:
                        self.router.add_worker(slot.engine.url)
                    except Exception:
                        if self.router.is_running() or not self.manage_router:
                            raise
                        # the router is down: its restart (under this lock) includes every engine that is up
                    seconds = time.monotonic() - (slot.down_since or t0)
                    # logged and recorded before the slot reads "up": whoever sees it up finds its engine_up event
                    logger.warning(
                        "engine %d (%s) replaced: serving weight version %d again %.1f s after it went down "
                        "(load %.2f s)",
                        slot.index,
                        slot.engine.url,
                        self.recovery.version,
                        seconds,
                        load_s,
                    )
                    self._event(
                        "engine_up",
                        engine=slot.index,
                        url=slot.engine.url,
                        restart=slot.restarts,
                        seconds=round(seconds, 3),
                        load_seconds=round(load_s, 3),
                        weight_version=self.recovery.version,
                    )
                    with self._state:
                        slot.state, slot.unhealthy_since = "up", None
                        self.recoveries.append(seconds)
                        self.counts["engine_restarts"] += 1
                        self.totals["engine_restarts"] += 1
            except Exception as e:  # noqa: BLE001 - the next attempt (or the loss) follows
                if self._stop.is_set():  # shutting down: the manager stops the engines under the replacement
                    return
                slot.last_exit = f"restart {slot.restarts} failed: {e}"
                logger.error("restarting engine %d (%s) failed: %s", slot.index, slot.engine.url, e)
                self._event("engine_restart_failed", engine=slot.index, url=slot.engine.url, error=str(e)[:2000])
                try:
                    slot.engine.stop()
                except Exception:  # noqa: BLE001
                    logger.exception("stopping the failed replacement of engine %d", slot.index)
                continue
            return

    def _restart_router(self) -> None:
        """Restart the dead router on its port with the engines that are up (or declare the run lost)."""
        router = self.router
        rc = router.proc.poll() if getattr(router, "proc", None) is not None else None
        with self.lock:
            if self.router_restarts >= self.config.max_restarts:
                self._fail(
                    f"the router {router.url} exited with code {rc} (log: {router.log_path}) and "
                    f"--rollout-max-engine-restarts {self.config.max_restarts} restarts are spent"
                )
                return
            t0 = time.monotonic()
            self.router_restarts += 1
            logger.error("router %s exited with code %s (log: %s); restarting it", router.url, rc, router.log_path)
            self._event("router_down", url=router.url, exit_code=rc, log=str(router.log_path))
            router.stop()
            keep_log(router.log_path, self.router_restarts)
            with self._state:
                router.worker_urls = [s.engine.url for s in self.slots if s.state == "up"]
            router.start()
            router.wait_ready(timeout_s=120, require_workers=bool(router.worker_urls))
            seconds = time.monotonic() - t0
            with self._state:
                self.counts["router_restarts"] += 1
                self.totals["router_restarts"] += 1
        logger.warning("router %s restarted in %.1f s with workers %s", router.url, seconds, router.worker_urls)
        self._event("router_up", url=router.url, seconds=round(seconds, 3), workers=list(router.worker_urls))

    def _check_all_lost(self) -> None:
        if all(s.state == "lost" for s in self.slots):
            self._fail("every vLLM engine is gone and no restart is left")

    def _fail(self, what: str) -> None:
        lines = [
            f"engine {s.index} ({s.engine.url}): {s.last_exit or 'state ' + s.state}, restarted {s.restarts} "
            f"time(s); log: {self._log(s)}"
            for s in self.slots
        ]
        self.fatal = f"{what}:\n" + "\n".join(lines)
        self._event("fatal", message=self.fatal)
        logger.error("%s", self.fatal)

    def raise_if_lost(self) -> None:
        """:raises EnginesLostError: if the run cannot go on (:attr:`fatal`)."""
        if self.fatal is not None:
            raise EnginesLostError(self.fatal)

    # ---------------------------------------------------------------- for the rollout manager
    def serving(self) -> list[Any]:
        """The engines that are up now."""
        with self._state:
            return [s.engine for s in self.slots if s.state == "up"]

    def count(self, key: str, n: int = 1) -> None:
        """Add ``n`` to the counter ``rollout/<key>`` of this step."""
        with self._state:
            self.counts[key] += n
            self.totals[key] += n

    def take_metrics(self) -> dict[str, float]:
        """This step's ``rollout/engine_restarts``, ``rollout/router_restarts``, ``rollout/requests_retried``,
        ``rollout/engine_recovery_seconds`` (longest recovery finished since the last call, 0 if none) and
        ``rollout/engines_down`` (slots not serving now); the counters restart from 0."""
        with self._state:
            m = {f"rollout/{k}": float(self.counts.get(k, 0)) for k in RESTART_KEYS}
            m["rollout/engine_recovery_seconds"] = max(self.recoveries, default=0.0)
            m["rollout/engines_down"] = float(sum(s.state != "up" for s in self.slots))
            self.counts.clear()
            self.recoveries.clear()
        return m

    def note_retry(self, sample: str, error: BaseException) -> None:
        """Count a sample whose generation failed on an engine error and that waits to be regenerated (reported in
        one line by :meth:`report_retries`, not one line per sample)."""
        with self._state:
            self._retrying.append((sample, f"{type(error).__name__}: {str(error)[:300]}"))
            self.counts["requests_retried"] += 1
            self.totals["requests_retried"] += 1

    def report_retries(self) -> None:
        """Log one line for the samples :meth:`note_retry` counted since the last report (the first sample to be
        regenerated after an engine came back reports them all): how many, and the first one's error."""
        with self._state:
            waiting, self._retrying = self._retrying, []
        if waiting:
            logger.warning(
                "%d sample(s) failed on an engine error and are generated again now that an engine serves "
                "(first: sample %s: %s)",
                len(waiting),
                *waiting[0],
            )

    async def wait_serving(self, after_poll: int) -> None:
        """Wait until a health check started after ``after_poll`` finished, an engine is up and the router runs.

        :raises EnginesLostError: when the run is lost meanwhile.
        """
        while True:
            self.raise_if_lost()
            router_up = not self.manage_router or self.router is None or self.router.is_running()
            if self.polls > after_poll + 1 and router_up and self.serving():
                return
            await asyncio.sleep(0.2)

    def sync_weights(
        self, weight_sync: WeightSyncStrategy, update: WeightUpdate, mode: str, timeout_s: float
    ) -> tuple[dict[str, float], list[WeightUpdate]]:
        """Pause the engines that are up, apply ``update``, reset prefix caches, label the version, resume: the one
        sequence of :func:`~vime_core.engines.weight_update.update_engines`, each engine call guarded.

        An engine that fails a step and is then found dead (or hung) is taken down and replaced (the replacement
        loads ``update``); any other failure raises, as without the monitor. Holds :attr:`lock`, waiting at most
        ``timeout_s`` for it (a replacement loading); every engine call is bounded by ``timeout_s`` too.

        :param mode: the pause mode (``"wait"``, or ``"keep"`` in fully-async).
        :return: ``(metrics, updates whose files may be removed now)``; metrics ``weight_sync/engines_synced`` and
            the seconds of each phase over all engines: ``weight_sync/pause_seconds``, ``weight_sync/load_seconds``
            (the strategy's transfer and load), ``weight_sync/label_seconds`` (prefix-cache reset and version
            label), ``weight_sync/resume_seconds``.
        :raises EnginesLostError: if no engine is left and none can come back.
        :raises TimeoutError: if the lock or a living engine's call is not had within ``timeout_s``.
        :raises RuntimeError: from a living engine or the strategy.
        """
        # a replacement loading the current version holds the lock: the update waits for it, within the timeout
        if not self.lock.acquire(timeout=timeout_s):
            raise TimeoutError(
                f"weight update {update.version}: the engines were not free for it within --weight-sync-timeout "
                f"{timeout_s:g} s (a replacement engine was being loaded)"
            )
        try:
            self.raise_if_lost()
            slots = [s for s in self.slots if s.state == "up"]
            metrics = update_engines(slots, weight_sync, update, mode, timeout_s, self._guard)
            cleanup = self.recovery.applied(update)
        finally:
            self.lock.release()
        return metrics, cleanup

    def _guard(self, slot: EngineSlot, fn: Callable[[], Any]) -> bool:
        """Run ``fn``; on an error take ``slot`` down if it is dead or hung (``False``), else re-raise."""
        try:
            fn()
            return True
        except Exception:
            why = self._confirm_down(slot)
            if why is None:
                raise
            self.mark_down(slot, why)
            return False

    # ---------------------------------------------------------------- events
    def _event(self, kind: str, **fields: Any) -> None:
        if self.events_path is None:
            return
        record = {"time": time.time(), "event": kind, **fields}
        try:
            with self._events_lock, open(self.events_path, "a") as f:
                f.write(json.dumps(record) + "\n")
        except OSError as e:
            logger.warning("cannot write %s: %s", self.events_path, e)


async def generate_with_retries(
    monitor: EngineMonitor | None,
    generate_fn: Callable[..., Awaitable[Any]],
    ctx: PluginContext,
    sample: Any,
    params: dict[str, Any],
) -> Any:
    """``await generate_fn(ctx, sample, params)``, regenerated after an engine or connection failure.

    Before each attempt the sample's state is copied; after a retryable failure (:data:`RETRYABLE`) it is restored
    (so no token or log-prob of the failed attempt survives), the call waits until the monitor has seen the failure
    and an engine and the router serve (:meth:`EngineMonitor.wait_serving`), and the attempt is repeated, at most
    ``--rollout-max-request-retries`` times; each repeat counts in ``rollout/requests_retried``. The samples
    regenerated after one engine failure are logged in one line (:meth:`EngineMonitor.report_retries`). A 4xx
    answer (:func:`~vime_core.engines.answers.is_client_error`: the request itself is refused) is never retried.

    :param monitor: the engine monitor (``None``: a single attempt).
    :raises Exception: the last attempt's error, or :class:`EnginesLostError`.
    """
    if monitor is None:
        return await generate_fn(ctx, sample, params)
    before = copy.deepcopy(sample.__dict__)
    attempt = 0
    while True:
        poll = monitor.polls
        try:
            return await generate_fn(ctx, sample, params)
        except Exception as e:
            if (
                attempt >= monitor.config.max_request_retries
                or is_client_error(e)
                or classify_failure(e, "generate") not in RETRYABLE
            ):
                raise
            attempt += 1
            monitor.note_retry(f"{getattr(sample, 'group_index', '?')}/{getattr(sample, 'index', '?')}", e)
            sample.__dict__.clear()
            sample.__dict__.update(copy.deepcopy(before))
            await monitor.wait_serving(poll)
            monitor.report_retries()
