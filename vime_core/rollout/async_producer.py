"""Fully-async rollout: a background producer keeps groups generating across training steps.

:class:`AsyncRolloutProducer` runs the rollout actor's event loop in a thread, admits groups by weight version
(at most ``(η + 1) · B`` before the first update, ``B`` more after each), keeps at most ``--rollout-inflight-groups``
generating or waiting, and hands each step the groups that would otherwise outlive ``--max-staleness``. The rules,
counters and metrics: docs/loop_modes.md, "Fully-async admission and the staleness bound".
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vime_core.data.images import count_image_parts
from vime_core.data.source import DataSource
from vime_core.failures import RunFailedError
from vime_core.rollout.runner import GroupRunner
from vime_core.types import Sample

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
                images=list(s.images[: count_image_parts(s.prompt)]),  # the prompt's, not a tool result's
            )
        )
    return out


def oldest_version(group: list[Sample]) -> int | None:
    """The smallest per-token weight version of the group's trainable tokens (None if it has none)."""
    versions = [v for s in group for v in s.trained_weight_versions()]
    return min(versions) if versions else None


#: why an admitted group was not trained (``rollout/async_dropped/<reason>``); its prompt goes back to the buffer
DROP_REASONS = ("stale", "untrained_step", "step_failed")


@dataclass
class StalenessBudget:
    """How many groups may start generating now (AReaL's ``StalenessManager.get_capacity``, counted in groups).

    :param batch_groups: groups the trainer takes per step (``--rollout-batch-size``).
    :param max_staleness: ``--max-staleness``.
    :param base_version: the engines' weight version when admission started (a resumed run starts above 0).
    :param inflight_bound: at most this many groups running and waiting together (``--rollout-inflight-groups``).
    """

    batch_groups: int
    max_staleness: int
    base_version: int
    inflight_bound: int
    running: int = 0  # admitted, still generating
    accepted: int = 0  # finished and not rejected (waiting, or taken by a step that trained)
    waiting: int = 0  # finished, not taken by a step yet

    def capacity(self, version: int) -> int:
        """Groups that may be admitted at engine version ``version`` (0 or more).

        ``(max_staleness + version − base_version + 1) · batch_groups − (accepted + running)``, capped by
        ``inflight_bound − (running + waiting)``.
        """
        bound = (self.max_staleness + version - self.base_version + 1) * self.batch_groups
        cap = min(bound - (self.accepted + self.running), self.inflight_bound - (self.running + self.waiting))
        return max(cap, 0)


class AsyncRolloutProducer:
    """Background generation for ``--loop fully-async`` (owned by the group producer,
    :class:`~vime_core.rollout.group_producer.GroupProducer`); see the module doc.

    :param runner: generates and scores the groups; its ``weight_version`` is the version the engines serve.
    :param data_source: the data buffer the groups are admitted from (and their prompts go back to).
    :param loop: the rollout actor's event loop (runs in the producer thread from :meth:`start` on).
    :param concurrency: ``--rollout-concurrency``: one bound for the requests of every group.
    :param batch_groups: groups per training step (``--rollout-batch-size``).
    :param max_staleness: ``--max-staleness``.
    :param inflight_bound: ``--rollout-inflight-groups`` (``None``: ``(max_staleness + 1) · batch_groups``).
    :ivar admitted_by_version: ``{engine version: groups admitted while the engines served it}``.
    :ivar trained: groups handed to training steps (a batch that was not trained moves to ``dropped``).
    :ivar dropped: ``{reason: groups}`` admitted and not trained (:data:`DROP_REASONS`).
    :ivar peak: the most groups running and waiting at once so far.
    """

    def __init__(
        self,
        runner: GroupRunner,
        data_source: DataSource,
        loop: asyncio.AbstractEventLoop,
        concurrency: int,
        batch_groups: int,
        max_staleness: int,
        inflight_bound: int | None = None,
    ) -> None:
        self.runner = runner
        self.data_source = data_source
        self.loop = loop
        self.concurrency = concurrency
        self.max_staleness = max_staleness
        bound = inflight_bound if inflight_bound is not None else (max_staleness + 1) * batch_groups
        self.budget = StalenessBudget(batch_groups, max_staleness, runner.weight_version, bound)
        self.cond = threading.Condition()  # guards the budget, the data source, the in-flight and ready sets
        self.inflight: dict[int, list[Sample]] = {}
        self.ready: dict[int, list[Sample]] = {}
        self.admitted: dict[int, tuple[int, int]] = {}  # id(group) -> (admission order, engine version then)
        self.admitted_by_version: dict[int, int] = {}
        self.trained = 0
        self.dropped: Counter[str] = Counter({r: 0 for r in DROP_REASONS})
        self.peak = 0
        self._seq = 0
        self._last_take: tuple[int, list[list[Sample]]] | None = None  # (version, groups) of the last batch taken
        self._tasks: set[asyncio.Task] = set()
        self._sem: asyncio.Semaphore | None = None
        self._wake: asyncio.Event | None = None
        self._stop = threading.Event()
        self._started = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    # -- producer thread ---------------------------------------------------------------------------------------
    def start(self, timeout_s: float = 60.0) -> None:
        """Start the producer thread (the actor's event loop runs there from now on); returns once the first
        groups are admitted."""
        self._thread = threading.Thread(target=self._run, name="vime-async-rollout", daemon=True)
        self._thread.start()
        if not self._started.wait(timeout_s):
            raise RuntimeError(f"async rollout producer did not start within {timeout_s:g} s")
        self._raise_if_died()

    def _run(self) -> None:
        loop = self.loop
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self._produce())
        except BaseException as e:  # noqa: BLE001 - surfaced to the consumer
            logger.exception("async rollout producer died")
            if self._error is None:  # else the data source's own error, already recorded
                self._error = e
            self._started.set()
            with self.cond:
                self.cond.notify_all()

    async def _produce(self) -> None:
        self._sem = asyncio.Semaphore(self.concurrency)  # one bound for every group
        self._wake = asyncio.Event()
        try:
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
                            self.budget.waiting += 1
                            self.budget.accepted += 1
                            self.cond.notify_all()
                self._wake.clear()
                self._admit()
        finally:  # stopped or died: no request of the producer keeps running
            for t in self._tasks:
                t.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            self._tasks.clear()

    def _admit(self) -> int:
        """Admit as many groups as the budget allows at the engines' current version (producer thread).

        :return: the number admitted.
        :raises RunFailedError: the data source raised (the producer stops; every later call raises it too).
        """
        n = 0
        with self.cond:
            version = self.runner.weight_version
            for _ in range(self.budget.capacity(version)):
                try:
                    group = self.data_source.get_groups(1)[0]
                except Exception as e:  # systemic: the producer stops, every later call raises this error
                    self._error = e
                    self._stop.set()
                    self.cond.notify_all()
                    self._raise_if_died()
                self.inflight[id(group)] = group
                self.admitted[id(group)] = (self._seq, version)
                self._seq += 1
                self.budget.running += 1
                self.admitted_by_version[version] = self.admitted_by_version.get(version, 0) + 1
                self._tasks.add(asyncio.ensure_future(self._generate(group)))
                n += 1
            self.peak = max(self.peak, self.budget.running + self.budget.waiting)
        return n

    async def _generate(self, group: list[Sample]) -> list[Sample]:
        await self.runner.run([group], -1, self._sem)
        return group

    def admit_now(self, timeout_s: float = 60.0) -> int:
        """Admit what the budget allows at the engines' current version before returning (called by the
        rollout manager right after a weight update, from another thread).

        :return: the number admitted.
        :raises RunFailedError: if the producer died (with its error).
        :raises TimeoutError: if the producer did not answer within ``timeout_s``.
        """
        self._raise_if_died()

        async def admit() -> int:
            return self._admit()

        return asyncio.run_coroutine_threadsafe(admit(), self.loop).result(timeout_s)

    def _raise_if_died(self) -> None:
        if self._error is not None:
            e = self._error
            raise RunFailedError(f"the fully-async rollout producer failed: {type(e).__name__}: {e}") from e

    def _wake_producer(self) -> None:
        if self._wake is not None:
            self.loop.call_soon_threadsafe(self._wake.set)

    def _drop(self, groups: list[list[Sample]], reason: str) -> None:
        """Under ``cond``: ``groups`` (handed out or taken) are not trained: count them under ``reason``, log each,
        and put their prompts back into the data buffer (handed out again before fresh prompts)."""
        for g in groups:
            logger.warning(
                "group %d (prompt %s) not trained: %s; its prompt goes back to the data buffer",
                g[0].group_index,
                g[0].prompt_index,
                reason,
            )
        self.dropped[reason] += len(groups)
        self.data_source.add_groups([fresh_copy(g) for g in groups])

    def _release(self, n: int) -> None:
        """Under ``cond``: give ``n`` accepted groups' places back to the staleness budget."""
        self.budget.accepted -= n

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
        self.budget.waiting -= len(out)
        return out

    def get_groups(
        self,
        num_groups: int,
        current_version: int,
        max_staleness: int,
        policy: str,
        timeout_s: float = 3600.0,
        check: Callable[[], None] | None = None,
    ) -> tuple[list[list[Sample]], dict[str, float]]:
        """Take ``num_groups`` finished groups for a training step at ``current_version`` (see the module doc).

        A call at the same version as the previous one means the previous batch was not trained (the step was
        skipped): its groups are dropped as ``untrained_step`` (prompts back to the buffer, places given back).

        :param check: called about every 0.5 s while waiting (the manager's engine check); what it raises ends the
            wait.
        :return: ``(groups, metrics)`` with ``rollout/stale_dropped``, ``rollout/stale_regenerated`` (this step),
            ``rollout/staleness_max``, ``rollout/staleness_mean`` (over the kept groups' tokens), and the counters
            after the take, which add up: ``rollout/async_admitted_groups`` (taken from the data buffer so far) =
            ``rollout/async_trained_groups`` (handed to steps, this one included) + ``rollout/async_waiting_groups``
            + ``rollout/async_running_groups`` + ``rollout/async_dropped_groups`` (each reason also as
            ``rollout/async_dropped/<reason>``); ``rollout/async_inflight_bound`` and ``rollout/async_peak_groups``
            (the most running + waiting at once so far).
        :raises RunFailedError: if the producer died (with its error).
        :raises RuntimeError: if the groups did not finish within ``timeout_s``.
        """
        with self.cond:
            if self._last_take is not None and self._last_take[0] == current_version:
                untrained = self._last_take[1]
                self.trained -= len(untrained)
                self._drop(untrained, "untrained_step")
                self._release(len(untrained))
        self._wake_producer()
        kept: list[list[Sample]] = []
        counters = self.counters() if num_groups <= 0 else {}
        dropped = regenerated = 0
        deadline = time.monotonic() + timeout_s
        while len(kept) < num_groups:
            with self.cond:
                taken = None
                while taken is None:
                    self._raise_if_died()
                    taken = self._take(num_groups - len(kept), current_version)
                    if taken is None:
                        if time.monotonic() > deadline:
                            raise RuntimeError(f"rollout groups did not finish within {timeout_s:.0f} s")
                        if check is not None:
                            check()
                        self.cond.wait(0.5)
                stale = []
                for group in taken:
                    oldest = oldest_version(group)
                    if oldest is not None and current_version - oldest > max_staleness:
                        stale.append(group)
                    else:
                        kept.append(group)
                if policy == "regenerate":
                    regenerated += len(stale)
                else:
                    dropped += len(stale)
                self._drop(stale, "stale")
                self._release(len(stale))
                self.trained += len(taken) - len(stale)
                if len(kept) == num_groups:  # the counters right after the take, before the producer refills
                    self._last_take = (current_version, kept)
                    counters = self._counters()
            self._wake_producer()  # places were freed: generate up to the bound again
        staleness = [current_version - v for g in kept for s in g for v in s.trained_weight_versions()]
        metrics = {
            "rollout/stale_dropped": float(dropped),
            "rollout/stale_regenerated": float(regenerated),
            "rollout/staleness_max": float(max(staleness, default=0)),
            "rollout/staleness_mean": sum(staleness) / len(staleness) if staleness else 0.0,
            **counters,
        }
        return kept, metrics

    def counters(self) -> dict[str, float]:
        """The producer's counters now (the ``rollout/async_*`` metrics of :meth:`get_groups`)."""
        with self.cond:
            return self._counters()

    def _counters(self) -> dict[str, float]:
        return {
            "rollout/async_admitted_groups": float(self._seq),
            "rollout/async_trained_groups": float(self.trained),
            "rollout/async_waiting_groups": float(self.budget.waiting),
            "rollout/async_running_groups": float(self.budget.running),
            "rollout/async_dropped_groups": float(sum(self.dropped.values())),
            **{f"rollout/async_dropped/{r}": float(n) for r, n in self.dropped.items()},
            "rollout/async_inflight_bound": float(self.budget.inflight_bound),
            "rollout/async_peak_groups": float(self.peak),
        }

    def give_back(self, groups: list[list[Sample]], reason: str = "step_failed") -> None:
        """Take back the groups :meth:`get_groups` just handed out, which will not be trained (the step failed):
        dropped with ``reason``, their prompts back in the data buffer (so :meth:`buffer_state` returns them)."""
        with self.cond:
            self.trained -= len(groups)
            self._drop(groups, reason)
            self._release(len(groups))
            self._last_take = None
        self._wake_producer()

    def buffer_state(self) -> dict[str, Any]:
        """The data-buffer state with every in-flight or finished-but-not-taken group returned as fresh prompts
        (after the prompts already back in the buffer, in admission order: the order in which the producer would
        have handed them out), so a resume generates them again instead of skipping them."""
        with self.cond:
            state = self.data_source.state_dict()
            admitted = {**self.inflight, **self.ready}
            pending = [admitted[k] for k in sorted(admitted, key=lambda k: self.admitted[k][0])]
        state["returned"] = state["returned"] + [[s.to_dict() for s in fresh_copy(g)] for g in pending]
        return state

    def stop(self) -> None:
        """Stop producing; in-flight requests are cancelled."""
        self._stop.set()
        if self._wake is not None:
            self.loop.call_soon_threadsafe(self._wake.set)
        if self._thread is not None:
            self._thread.join(timeout=60)
