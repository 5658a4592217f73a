"""Fully-async rollout: a background producer keeps groups in flight across training steps.

The producer runs the rollout manager's event loop in a thread: it keeps up to ``--rollout-inflight-groups``
groups generating, puts finished groups on a queue (at most ``--rollout-queue-groups`` waiting), and never blocks
on training. Weight updates happen while requests are in flight (engines paused with ``mode=keep``), so one
response can mix versions; every token carries the version that produced it.

The staleness bound holds **per sample**: when the trainer takes a group at version ``V``, a group whose oldest
token was produced by a version older than ``V - --max-staleness`` is dropped (``--stale-policy drop``) or its
prompt goes back to the buffer to be generated again (``--stale-policy regenerate``). The bound is checked on the
recorded per-token versions, not on an average (AReaL/SkyRL bound the aggregate; see
``shared/reference/peer-frameworks.md``).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from typing import TYPE_CHECKING, Any

from vime_core.types import Sample

if TYPE_CHECKING:
    from vime_core.rollout.manager import RolloutManager

logger = logging.getLogger("vime.rollout.async")


def fresh_copy(group: list[Sample]) -> list[Sample]:
    """The group's prompts as new, ungenerated samples (same group/index ids; the segments of a fanned-out rollout
    become one sample again)."""
    seen: set[tuple[int, int]] = set()
    out = []
    for s in group:
        if (s.group_index, s.index) in seen:
            continue
        seen.add((s.group_index, s.index))
        meta = {k: v for k, v in s.metadata.items() if k not in ("error", "trajectory")}
        out.append(Sample(group_index=s.group_index, index=s.index, prompt=s.prompt, label=s.label, metadata=meta))
    return out


def oldest_version(group: list[Sample]) -> int | None:
    """The smallest per-token weight version of the group's trainable tokens (None if it has none)."""
    versions = [v for s in group for v in s.trained_weight_versions()]
    return min(versions) if versions else None


class AsyncRolloutProducer:
    """Background generation for ``--loop fully-async`` (owned by a :class:`RolloutManager`).

    :param manager: the rollout manager (engines, router client, buffer, generate and reward functions).
    :param inflight_groups: groups generating at once.
    :param queue_groups: finished groups allowed to wait for the trainer (bounds how far generation runs ahead).
    """

    def __init__(self, manager: RolloutManager, inflight_groups: int, queue_groups: int) -> None:
        self.manager = manager
        self.inflight_groups = inflight_groups
        self.queue_groups = queue_groups
        self.ready: queue.Queue[list[Sample]] = queue.Queue()
        self.requeue: queue.Queue[list[Sample]] = queue.Queue()
        self.lock = threading.Lock()  # guards the data source and the in-flight set
        self.inflight: dict[int, list[Sample]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    # -- producer thread ---------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the producer thread (the manager's event loop runs there from now on)."""
        self._thread = threading.Thread(target=self._run, name="vime-async-rollout", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        loop = self.manager.loop
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self._produce())
        except BaseException as e:  # noqa: BLE001 - surfaced to the consumer
            logger.exception("async rollout producer died")
            self._error = e

    async def _produce(self) -> None:
        from vime_core.rollout.manager import _run_groups

        tasks: set[asyncio.Task] = set()
        while not self._stop.is_set():
            while (
                len(tasks) < self.inflight_groups
                and self.ready.qsize() + len(tasks) < self.inflight_groups + self.queue_groups
            ):
                group = self._next_group()
                tasks.add(asyncio.create_task(self._generate(group, _run_groups)))
            if not tasks:
                await asyncio.sleep(0.05)
                continue
            done, tasks = await asyncio.wait(tasks, timeout=0.2, return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                group = t.result()
                with self.lock:
                    self.inflight.pop(id(group), None)
                    self.ready.put(group)
        for t in tasks:
            t.cancel()

    def _next_group(self) -> list[Sample]:
        with self.lock:
            try:
                group = self.requeue.get_nowait()
            except queue.Empty:
                group = self.manager.data_source.get_groups(1)[0]
            self.inflight[id(group)] = group
        return group

    async def _generate(self, group: list[Sample], run_groups: Any) -> list[Sample]:
        await run_groups(self.manager, [group], -1)
        return group

    # -- consumer side (the rollout actor's method thread) ------------------------------------------------------
    def get_groups(
        self, num_groups: int, current_version: int, max_staleness: int, policy: str, timeout_s: float = 3600.0
    ) -> tuple[list[list[Sample]], dict[str, float]]:
        """Take ``num_groups`` finished groups that respect the staleness bound at ``current_version``.

        :return: ``(groups, metrics)`` with ``rollout/stale_dropped``, ``rollout/stale_regenerated``,
            ``rollout/staleness_max``, ``rollout/staleness_mean`` (over the kept groups' tokens).
        :raises RuntimeError: if the producer died (with its error) or no group arrived within ``timeout_s``.
        """
        kept: list[list[Sample]] = []
        dropped = regenerated = 0
        deadline = time.monotonic() + timeout_s
        while len(kept) < num_groups:
            if self._error is not None:
                raise RuntimeError(f"async rollout producer failed: {self._error!r}") from self._error
            try:
                group = self.ready.get(timeout=0.5)
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"no rollout group finished within {timeout_s:.0f} s") from None
                continue
            oldest = oldest_version(group)
            if oldest is not None and current_version - oldest > max_staleness:
                if policy == "regenerate":
                    self.requeue.put(fresh_copy(group))
                    regenerated += 1
                else:
                    dropped += 1
                continue
            kept.append(group)
        staleness = [current_version - v for g in kept for s in g for v in s.trained_weight_versions()]
        metrics = {
            "rollout/stale_dropped": float(dropped),
            "rollout/stale_regenerated": float(regenerated),
            "rollout/staleness_max": float(max(staleness, default=0)),
            "rollout/staleness_mean": sum(staleness) / len(staleness) if staleness else 0.0,
        }
        return kept, metrics

    def buffer_state(self) -> dict[str, Any]:
        """The data-buffer state with every in-flight, queued or re-queued group returned as fresh prompts, so a
        resume generates them again instead of skipping them."""
        with self.lock:
            state = self.manager.data_source.state_dict()
            pending = list(self.inflight.values()) + list(self.ready.queue) + list(self.requeue.queue)
        state["returned"] = state["returned"] + [[s.to_dict() for s in fresh_copy(g)] for g in pending]
        return state

    def stop(self) -> None:
        """Stop producing; in-flight requests are cancelled."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=60)
