"""Cancellation at every await point of a sandbox's life, for any backend.

:func:`await_sites` runs one life (``start``, ``exec``, ``close``) and records every await point its task suspends
at; :func:`cancel_at_every_await_point` then cancels ``concurrency`` lives at each point in turn and reports what
was left behind, a swallowed cancellation, a life that did not finish after being cancelled, and a life that failed
uncancelled. The contract test built on it: docs/sandboxes.md, "Writing a backend".
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from collections.abc import Callable, Generator
from typing import Any

Site = tuple[tuple[str, int], ...]
_ASYNCIO_DIR = os.path.dirname(asyncio.__file__)


def _site(coro: Any) -> Site:
    """The await point a suspended coroutine is at: ``(file, line)`` of every frame down its ``await`` chain."""
    frames = []
    obj = coro
    for _ in range(200):
        if obj is None:
            break
        frame = getattr(obj, "cr_frame", None) or getattr(obj, "gi_frame", None) or getattr(obj, "ag_frame", None)
        if frame is not None:
            frames.append((frame.f_code.co_filename, frame.f_lineno))
        nxt = getattr(obj, "cr_await", None)
        obj = nxt if nxt is not None else getattr(obj, "gi_yieldfrom", None)
    return tuple(frames)


def describe_site(site: Site) -> str:
    """The await point for reports: ``file:line`` of the innermost frames of vime's own code (``<-`` callers, up to
    three), preceded by the innermost library frame (``sdk.py:12 in ...``) when the suspension is inside a library."""

    def short(f: str, n: int) -> str:
        return f"{os.path.basename(f)}:{n}"

    outside = [(f, n) for f, n in site if not f.startswith(_ASYNCIO_DIR)]
    own = [(f, n) for f, n in outside if "site-packages" not in f]
    text = " <- ".join(short(f, n) for f, n in reversed(own[-3:])) or short(*site[-1])
    if outside and outside[-1] not in own:
        text = f"{short(*outside[-1])} in {text}"
    return text


class CancelAt:
    """Awaitable that runs ``coro`` in the awaiting task, records every suspension's await point in
    :attr:`sites`, and cancels that task at the first suspension at ``target`` (``None``: never).

    The cancellation is the task's own (``asyncio.current_task().cancel()`` while it suspends), so the future it
    awaits is cancelled and ``CancelledError`` rises at that ``await`` — as with any outside cancellation.
    """

    def __init__(self, coro: Any, target: Site | None = None) -> None:
        self.coro, self.target = coro, target
        self.sites: list[Site] = []
        self.fired_at: float | None = None  # time.monotonic() of the cancellation

    def __await__(self) -> Generator[Any, Any, Any]:
        coro = self.coro
        value: Any = None
        exc: BaseException | None = None
        while True:
            try:
                yielded = coro.send(value) if exc is None else coro.throw(exc)
            except StopIteration as stop:
                return stop.value
            site = _site(coro)
            self.sites.append(site)
            if self.fired_at is None and self.target is not None and site == self.target:
                self.fired_at = time.monotonic()
                task = asyncio.current_task()
                assert task is not None
                task.cancel()
            try:
                value, exc = (yield yielded), None
            except BaseException as e:  # noqa: BLE001 - handed to the driven coroutine, like a task does
                value, exc = None, e


@dataclasses.dataclass
class RoundResult:
    """One round: ``concurrency`` lives cancelled at one await point."""

    site: str
    cancelled: int  # lives whose cancellation fired
    seconds: float
    leftovers: dict[str, int]
    problems: list[str]


@dataclasses.dataclass
class CancelReport:
    """What :func:`cancel_at_every_await_point` found; ``problems`` empty means no leak and no swallowed cancel."""

    points: int
    rounds: list[RoundResult]
    seconds: float

    @property
    def problems(self) -> list[str]:
        return [f"at {r.site}: {p}" for r in self.rounds for p in r.problems]

    def summary(self) -> str:
        lines = [
            f"{self.points} await points, {sum(r.cancelled for r in self.rounds)} cancelled lives, "
            f"{self.seconds:.1f} s"
        ]
        for r in self.rounds:
            mark = "LEAK/ERR" if r.problems else "ok"
            lines.append(
                f"  {mark:8s} {r.cancelled:2d} cancelled {r.seconds:5.1f} s  {r.site}"
                + (f"  {r.problems}" if r.problems else "")
            )
        return "\n".join(lines)


def _recording(factory: Callable[[], Any], into: list[Any]) -> Callable[[], Any]:
    def make() -> Any:
        into.append(factory())
        return into[-1]

    return make


async def _life(factory: Callable[[], Any], command: str, expect: str) -> None:
    async with factory() as sb:
        r = await sb.exec(command, timeout=120)
        if r.stdout != expect:
            raise AssertionError(f"exec returned {r.stdout!r}, expected {expect!r}")


async def await_sites(factory: Callable[[], Any], *, command: str = "echo ok", expect: str = "ok\n") -> list[Site]:
    """The await points of one full life (start, ``exec(command)``, close), in order of first suspension."""
    driver = CancelAt(_life(factory, command, expect))
    await driver
    seen: dict[Site, None] = {}
    for s in driver.sites:
        seen.setdefault(s, None)
    return list(seen)


async def cancel_at_every_await_point(
    factory: Callable[[], Any],
    leftovers: Callable[[set[str]], dict[str, int]],
    *,
    concurrency: int = 10,
    command: str = "echo ok",
    expect: str = "ok\n",
    finish_timeout_s: float = 120.0,
    max_points: int | None = None,
    before_round: Callable[[], None] | None = None,
) -> CancelReport:
    """For each await point of a life, run ``concurrency`` lives at once, cancel each at that point, and count
    what the backend still lists of those sandboxes.

    :param factory: ``() -> Sandbox``, not started.
    :param leftovers: ``fn(sandbox_ids) -> {"containers": n, ...}``: what the backend's own listing (its service,
        ``/proc``, the filesystem — not the Python objects) still holds of the sandboxes with these
        :attr:`~vime_core.sandbox.Sandbox.sandbox_id`; run in a worker thread after every round. Every value
        must be 0.
    :param finish_timeout_s: seconds a cancelled life may take to finish its teardown.
    :param max_points: look only at the first this many await points (``None``: all).
    :param before_round: called before the probe life and before every round (e.g.
        :func:`vime_core.sandbox.base.forget_reaps`, so that the first start of each round reaps again and that
        await point is cancelled too).
    :returns: the :class:`CancelReport`; the caller asserts ``not report.problems``.
    """
    t_all = time.monotonic()
    if before_round is not None:
        before_round()
    sites = (await await_sites(factory, command=command, expect=expect))[:max_points]
    rounds = []
    for site in sites:
        if before_round is not None:
            before_round()
        t0 = time.monotonic()
        boxes: list[Any] = []
        drivers = [CancelAt(_life(_recording(factory, boxes), command, expect), site) for _ in range(concurrency)]

        async def run(d: CancelAt) -> Any:
            return await d

        tasks = [asyncio.ensure_future(run(d)) for d in drivers]
        _, pending = await asyncio.wait(tasks, timeout=finish_timeout_s)
        problems = []
        for d, t in zip(drivers, tasks, strict=True):
            if t in pending:
                problems.append("a life did not finish (cancellation ignored or teardown stuck)")
                t.cancel()
                continue
            err = None if t.cancelled() else t.exception()
            if d.fired_at is None:
                if t.cancelled() or err is not None:
                    problems.append(f"a life not cancelled failed: {'cancelled' if t.cancelled() else repr(err)}")
                continue
            if not t.cancelled():
                problems.append("cancellation swallowed: " + (f"raised {err!r}" if err else "returned normally"))
        left = await asyncio.to_thread(leftovers, {b.sandbox_id for b in boxes})
        if any(left.values()):
            problems.append(f"left behind: {left}")
        fired = sum(d.fired_at is not None for d in drivers)
        rounds.append(RoundResult(describe_site(site), fired, time.monotonic() - t0, left, problems))
    return CancelReport(len(sites), rounds, time.monotonic() - t_all)
