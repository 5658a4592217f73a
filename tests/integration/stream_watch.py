"""A watch on a :class:`~vime_core.engines.client.RouterClient`'s HTTP transport for the abort tests: when each
streamed answer delivers its first generated tokens, when it ends, and when an abort is sent — seen from the client
itself, not from vLLM's ``num_requests_running`` gauge (which read 0 through a whole generation once)."""

from __future__ import annotations

import asyncio
import re
import time

import httpx

_TOKENS = re.compile(rb'"token_ids":\s*\[\s*\d')


class StreamWatch(httpx.AsyncBaseTransport):
    """Wraps ``inner``; a streamed answer to a request whose JSON body contains ``marker`` counts in
    :attr:`first_tokens` (monotonic seconds) once a chunk with generated tokens arrives. :attr:`events` holds
    ``(monotonic s, what)`` of everything noted, :meth:`timeline` shows them."""

    def __init__(self, inner: httpx.AsyncBaseTransport, marker: bytes = b'"ignore_eos"') -> None:
        self.inner, self.marker = inner, marker
        self.first_tokens: list[float] = []
        self.events: list[tuple[float, str]] = []

    def note(self, what: str) -> None:
        self.events.append((time.monotonic(), what))

    def timeline(self) -> str:
        t0 = self.events[0][0] if self.events else 0.0
        return "; ".join(f"{t - t0:.2f}s {what}" for t, what in self.events)

    async def wait_first_tokens(self, n: int, timeout_s: float) -> bool:
        """Until ``n`` watched streams have delivered tokens (``True``) or ``timeout_s`` passed (``False``)."""
        deadline = time.monotonic() + timeout_s
        while len(self.first_tokens) < n and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        return len(self.first_tokens) >= n

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/abort_requests"):
            self.note("abort sent")
        resp = await self.inner.handle_async_request(request)
        if self.marker in request.content:
            resp.stream = _Watched(resp.stream, self)
        return resp

    async def aclose(self) -> None:
        await self.inner.aclose()


class _Watched(httpx.AsyncByteStream):
    def __init__(self, inner, watch: StreamWatch) -> None:
        self.inner, self.watch, self.seen = inner, watch, False

    async def __aiter__(self):
        async for chunk in self.inner:
            if not self.seen and _TOKENS.search(chunk):
                self.seen = True
                self.watch.first_tokens.append(time.monotonic())
                self.watch.note("watched stream: first tokens")
            yield chunk
        self.watch.note("watched stream: end")

    async def aclose(self) -> None:
        await self.inner.aclose()
