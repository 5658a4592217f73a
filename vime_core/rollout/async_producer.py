"""Fully-async rollout: a background producer keeps groups generating across training steps.

The producer runs the rollout manager's event loop in a thread and never blocks on training. Weight updates happen
while requests are in flight (engines paused with ``mode=keep``), so one response can mix versions; every token
carries the version that produced it.

**Admission is version-aware** (AReaL's staleness-controlled admission, ``areal/infra/staleness_manager.py``): with
batch ``B`` (``--rollout-batch-size`` groups), bound ``η`` (``--max-staleness``) and the engines at version ``v``
(``v0`` when the producer started — also after a resume at a later version), a new group is admitted only while

    admitted − rejected ≤ (η + v − v0 + 1) · B        (and, optionally, running < ``--rollout-inflight-groups``)

so at most ``(η + 1) · B`` groups start before the first weight update and ``B`` more after each. Admission runs
when the producer starts and synchronously inside every weight update, so the number admitted per update interval
is exact. "Rejected" groups (dropped or regenerated as stale, or handed to a step that trained nothing — a batch
taken again at the same version) give their place back.

**Taking a batch**: the trainer at version ``u`` must take every group admitted at version ``u − η`` or earlier
(the next step would be too late for them) — it waits for them if they are still generating, however slow — and
fills the batch with the oldest-admitted finished groups. With that rule no group outlives the bound, so slow
prompts are trained as often as fast ones instead of being dropped. The per-token check remains as a safety net:
a taken group whose oldest trained token is more than ``η`` versions old is dropped (``--stale-policy drop``) or its
prompt goes back to be generated again (``--stale-policy regenerate``); the check uses the recorded per-token
versions, not an average.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass
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
        out.append(
            Sample(
                group_index=s.group_index,
                index=s.index,
                prompt=s.prompt,
                label=s.label,
                metadata=meta,
                prompt_index=s.prompt_index,
            )
        )
    return out


def oldest_version(group: list[Sample]) -> int | None:
    """The smallest per-token weight version of the group's trainable tokens (None if it has none)."""
    versions = [v for s in group for v in s.trained_weight_versions()]
    return min(versions) if versions else None


@dataclass
class StalenessBudget:
    """How many groups may start generating now (AReaL's ``StalenessManager.get_capacity``, counted in groups).

    :param batch_groups: groups the trainer takes per step (``--rollout-batch-size``).
    :param max_staleness: ``--max-staleness``.
    :param base_version: the engines' weight version when admission started (a resumed run starts above 0).
    :param max_running: at most this many groups generating at once (``--rollout-inflight-groups``), or ``None``.
    """

    batch_groups: int
    max_staleness: int
    base_version: int
    max_running: int | None = None
    running: int = 0  # admitted, still generating
    accepted: int = 0  # finished and not rejected (waiting, or taken by a step that trained)

    def capacity(self, version: int) -> int:
        """Groups that may be admitted at engine version ``version`` (0 or more).

        ``(max_staleness + version − base_version + 1) · batch_groups − (accepted + running)``, capped by
        ``max_running − running``.
        """
        bound = (self.max_staleness + version - self.base_version + 1) * self.batch_groups
        cap = bound - (self.accepted + self.running)
        if self.max_running is not None:
            cap = min(cap, self.max_running - self.running)
        return max(cap, 0)


class AsyncRolloutProducer:
    """Background generation for ``--loop fully-async`` (owned by a :class:`RolloutManager`); see the module doc.

    :param manager: the rollout manager (engines, router client, buffer, generate and reward functions, and
        ``weight_version``, the version the engines serve).
    :param batch_groups: groups per training step (``--rollout-batch-size``).
    :param max_staleness: ``--max-staleness``.
    :param max_running: ``--rollout-inflight-groups`` (``None``: only the staleness bound limits admission).
    :ivar admitted_by_version: ``{engine version: groups admitted while the engines served it}``.
    """

    def __init__(
        self, manager: RolloutManager, batch_groups: int, max_staleness: int, max_running: int | None = None
    ) -> None:
        self.manager = manager
        self.max_staleness = max_staleness
        self.budget = StalenessBudget(batch_groups, max_staleness, manager.weight_version, max_running)
        self.requeue: queue.Queue[list[Sample]] = queue.Queue()
        self.cond = threading.Condition()  # guards the budget, the data source, the in-flight and ready sets
        self.inflight: dict[int, list[Sample]] = {}
        self.ready: dict[int, list[Sample]] = {}
        self.admitted: dict[int, tuple[int, int]] = {}  # id(group) -> (admission order, engine version then)
        self.admitted_by_version: dict[int, int] = {}
        self._seq = 0
        self._last_take: tuple[int, int] | None = None  # (version, groups) of the previous batch taken
        self._tasks: set[asyncio.Task] = set()
        self._sem: asyncio.Semaphore | None = None
        self._wake: asyncio.Event | None = None
        self._stop = threading.Event()
        self._started = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    # -- producer thread ---------------------------------------------------------------------------------------
    def start(self, timeout_s: float = 60.0) -> None:
        """Start the producer thread (the manager's event loop runs there from now on); returns once the first
        groups are admitted."""
        self._thread = threading.Thread(target=self._run, name="vime-async-rollout", daemon=True)
        self._thread.start()
        if not self._started.wait(timeout_s):
            raise RuntimeError(f"async rollout producer did not start within {timeout_s:g} s")
        if self._error is not None:
            raise RuntimeError(f"async rollout producer failed: {self._error!r}") from self._error

    def _run(self) -> None:
        loop = self.manager.loop
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self._produce())
        except BaseException as e:  # noqa: BLE001 - surfaced to the consumer
            logger.exception("async rollout producer died")
            self._error = e
            self._started.set()
            with self.cond:
                self.cond.notify_all()

    async def _produce(self) -> None:
        self._sem = asyncio.Semaphore(self.manager.config.rollout_concurrency)  # one bound for every group
        self._wake = asyncio.Event()
        self._admit()
        self._started.set()
        while not self._stop.is_set():
            if not self._tasks:
                try:
                    await asyncio.wait_for(self._wake.wait(), timeout=0.2)
                except asyncio.TimeoutError:
                    pass
            else:
                done, _ = await asyncio.wait(self._tasks, timeout=0.2, return_when=asyncio.FIRST_COMPLETED)
                for t in done:
                    self._tasks.discard(t)
                    group = t.result()
                    with self.cond:
                        self.inflight.pop(id(group), None)
                        self.ready[id(group)] = group
                        self.budget.running -= 1
                        self.budget.accepted += 1
                        self.cond.notify_all()
            self._wake.clear()
            self._admit()
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _admit(self) -> int:
        """Admit as many groups as the budget allows at the engines' current version (producer thread).

        :return: the number admitted.
        """
        n = 0
        with self.cond:
            version = self.manager.weight_version
            for _ in range(self.budget.capacity(version)):
                try:
                    group = self.requeue.get_nowait()
                except queue.Empty:
                    group = self.manager.data_source.get_groups(1)[0]
                self.inflight[id(group)] = group
                self.admitted[id(group)] = (self._seq, version)
                self._seq += 1
                self.budget.running += 1
                self.admitted_by_version[version] = self.admitted_by_version.get(version, 0) + 1
                self._tasks.add(asyncio.ensure_future(self._generate(group)))
                n += 1
        return n

    async def _generate(self, group: list[Sample]) -> list[Sample]:
        await self.manager.runner.run([group], -1, self._sem)
        return group

    def admit_now(self, timeout_s: float = 60.0) -> int:
        """Admit what the budget allows at the engines' current version before returning (called by the
        rollout manager right after a weight update, from another thread).

        :return: the number admitted.
        :raises RuntimeError: if the producer died or did not answer within ``timeout_s``.
        """
        if self._error is not None:
            raise RuntimeError(f"async rollout producer failed: {self._error!r}") from self._error

        async def admit() -> int:
            return self._admit()

        return asyncio.run_coroutine_threadsafe(admit(), self.manager.loop).result(timeout_s)

    def _release(self, n: int) -> None:
        """Give ``n`` accepted groups' places back (rejected, or not trained) and wake the producer."""
        if n <= 0:
            return
        with self.cond:
            self.budget.accepted -= n
        if self._wake is not None:
            self.manager.loop.call_soon_threadsafe(self._wake.set)

    # -- consumer side (the rollout actor's method thread) ------------------------------------------------------
    def _take(self, num: int, version: int) -> list[list[Sample]] | None:
        """Under ``cond``: ``num`` finished groups for a step at ``version`` — first every group that must be
        trained now (admitted at ``version − max_staleness`` or earlier), then the oldest admitted — or ``None``
        if one of those that must be trained is still generating or fewer than ``num`` are ready."""
        oldest_allowed = version - self.max_staleness
        must = [k for k in list(self.inflight) + list(self.ready) if self.admitted[k][1] <= oldest_allowed]
        if any(k in self.inflight for k in must) and len([k for k in must if k in self.ready]) < num:
            return None
        if len(self.ready) < num:
            return None
        must_set = set(must)
        order = sorted(self.ready, key=lambda k: (k not in must_set, self.admitted[k][0]))[:num]
        out = []
        for k in order:
            out.append(self.ready.pop(k))
            self.admitted.pop(k)
        return out

    def get_groups(
        self, num_groups: int, current_version: int, max_staleness: int, policy: str, timeout_s: float = 3600.0
    ) -> tuple[list[list[Sample]], dict[str, float]]:
        """Take ``num_groups`` finished groups for a training step at ``current_version`` (see the module doc).

        A call at the same version as the previous one means the previous batch was not trained (the step was
        skipped): its groups' places are given back to the admission budget.

        :return: ``(groups, metrics)`` with ``rollout/stale_dropped``, ``rollout/stale_regenerated``,
            ``rollout/staleness_max``, ``rollout/staleness_mean`` (over the kept groups' tokens),
            ``rollout/async_admitted_groups`` (admitted so far) and ``rollout/async_running_groups``.
        :raises RuntimeError: if the producer died (with its error) or the groups did not finish within
            ``timeout_s``.
        """
        if self._last_take is not None and self._last_take[0] == current_version:
            self._release(self._last_take[1])
        kept: list[list[Sample]] = []
        dropped = regenerated = 0
        deadline = time.monotonic() + timeout_s
        while len(kept) < num_groups:
            with self.cond:
                taken = None
                while taken is None:
                    if self._error is not None:
                        raise RuntimeError(f"async rollout producer failed: {self._error!r}") from self._error
                    taken = self._take(num_groups - len(kept), current_version)
                    if taken is None:
                        if time.monotonic() > deadline:
                            raise RuntimeError(f"rollout groups did not finish within {timeout_s:.0f} s")
                        self.cond.wait(0.5)
            rejected = 0
            for group in taken:
                oldest = oldest_version(group)
                if oldest is not None and current_version - oldest > max_staleness:
                    if policy == "regenerate":
                        self.requeue.put(fresh_copy(group))
                        regenerated += 1
                    else:
                        dropped += 1
                    rejected += 1
                    continue
                kept.append(group)
            self._release(rejected)
        self._last_take = (current_version, len(kept))
        staleness = [current_version - v for g in kept for s in g for v in s.trained_weight_versions()]
        with self.cond:
            admitted, running = float(self._seq), float(self.budget.running)
        metrics = {
            "rollout/stale_dropped": float(dropped),
            "rollout/stale_regenerated": float(regenerated),
            "rollout/staleness_max": float(max(staleness, default=0)),
            "rollout/staleness_mean": sum(staleness) / len(staleness) if staleness else 0.0,
            "rollout/async_admitted_groups": admitted,
            "rollout/async_running_groups": running,
        }
        return kept, metrics

    def give_back(self, groups: list[list[Sample]]) -> None:
        """Take back groups :meth:`get_groups` handed out that will not be trained (the step failed): they are
        re-queued as fresh prompts, so :meth:`buffer_state` returns them."""
        for g in groups:
            self.requeue.put(fresh_copy(g))

    def buffer_state(self) -> dict[str, Any]:
        """The data-buffer state with every in-flight, finished-but-not-taken or re-queued group returned as fresh
        prompts, so a resume generates them again instead of skipping them (in admission order, then the
        re-queued ones: the order in which the producer would have handed them out)."""
        with self.cond:
            state = self.manager.data_source.state_dict()
            admitted = {**self.inflight, **self.ready}
            pending = [admitted[k] for k in sorted(admitted, key=lambda k: self.admitted[k][0])]
            pending += list(self.requeue.queue)
        state["returned"] = state["returned"] + [[s.to_dict() for s in fresh_copy(g)] for g in pending]
        return state

    def stop(self) -> None:
        """Stop producing; in-flight requests are cancelled."""
        self._stop.set()
        if self._wake is not None:
            self.manager.loop.call_soon_threadsafe(self._wake.set)
        if self._thread is not None:
            self._thread.join(timeout=60)
