"""Contract of weight-sync strategies."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from vime_core.testing.contracts.base import _Contract


class WeightSyncContract(_Contract):
    """Contract of ``vime_register_weight_sync_strategies`` providers.

    Fixture to supply: ``strategy`` (an instance ready to :meth:`push`/:meth:`read`, a fresh one per test).
    Capabilities: ``"cleanup"``: :meth:`cleanup` removes what an update left behind; ``"timeout"``:
    :meth:`apply` talks to a :class:`vime_core.engines.engine.VLLMServer` over HTTP and raises ``TimeoutError``
    when it does not answer within ``timeout_s``; ``"delta"``: versions are incremental (:meth:`read` applies
    them to a receiver held by the strategy, in order, verified, retry-safe; ``payload["path"]`` holds the files).
    """

    @staticmethod
    def reference_tensors() -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(0)
        return {
            "model.embed_tokens.weight": torch.randn(64, 32, generator=g),
            "model.layers.0.self_attn.q_proj.weight": torch.randn(32, 32, generator=g).to(torch.bfloat16),
            "model.layers.0.mlp.up_proj.weight": torch.randn(48, 32, generator=g).to(torch.float16),
            "model.norm.weight": torch.tensor([1.0, -0.0, float("inf"), 1e-38] * 8),
            "buffer.int": torch.arange(10, dtype=torch.int64),
        }

    def test_round_trip_is_bit_exact(self, strategy: Any) -> None:
        sent = self.reference_tensors()
        update = strategy.push(iter(sent.items()), 1)
        got = strategy.read(update)
        assert sorted(got) == sorted(sent)
        for name, t in sent.items():
            r = got[name]
            assert r.dtype == t.dtype and r.shape == t.shape, name
            assert torch.equal(r.view(torch.uint8), t.contiguous().view(torch.uint8)), f"{name} differs bitwise"

    def test_version_bytes_seconds(self, strategy: Any) -> None:
        sent = self.reference_tensors()
        update = strategy.push(iter(sent.items()), 7)
        assert update.version == 7
        assert update.num_bytes >= sum(t.numel() * t.element_size() for t in sent.values()) or update.num_bytes > 0
        assert update.seconds >= 0.0

    def test_cleanup(self, strategy: Any) -> None:
        self.require("cleanup")
        update = strategy.push(iter(self.reference_tensors().items()), 2)
        strategy.cleanup(update)
        with pytest.raises(Exception):  # noqa: B017 - any error: the update is gone
            strategy.read(update)

    # -- appended: timeouts and delta semantics (capabilities "timeout", "delta") ----------------------------------
    @staticmethod
    def changed_tensors(base: dict[str, torch.Tensor], step: int) -> dict[str, torch.Tensor]:
        """``base`` after a small update: a few elements of some tensors change, ``model.norm.weight`` does not."""
        out = {n: t.clone() for n, t in base.items()}
        out["model.embed_tokens.weight"][step % 64, :4] += 1e-3 * step
        out["model.layers.0.self_attn.q_proj.weight"][:, step % 32] *= 1.0 + 2**-6
        out["model.layers.0.mlp.up_proj.weight"][step % 48] = -out["model.layers.0.mlp.up_proj.weight"][step % 48]
        out["buffer.int"][step % 10] += step
        return out

    @staticmethod
    def assert_bit_exact(got: dict[str, torch.Tensor], sent: dict[str, torch.Tensor]) -> None:
        assert sorted(got) == sorted(sent)
        for name, t in sent.items():
            r = got[name]
            assert r.dtype == t.dtype and r.shape == t.shape, name
            assert torch.equal(r.reshape(-1).view(torch.uint8), t.contiguous().reshape(-1).view(torch.uint8)), name

    def test_apply_times_out_on_a_receiver_that_never_answers(self, strategy: Any) -> None:
        """``apply`` on an engine whose server accepts connections but never answers raises ``TimeoutError``
        within about ``timeout_s`` (capability ``"timeout"``; the engine is a real
        :class:`vime_core.engines.engine.VLLMServer` client pointed at a silent socket)."""
        self.require("timeout")
        import time

        from vime_core.engines.engine import VLLMServer

        update = strategy.push(iter(self.reference_tensors().items()), 1)
        with _SilentServer() as port:
            engine = VLLMServer("unused", port=port, request_timeout_s=120.0)
            try:
                t0 = time.monotonic()
                with pytest.raises(TimeoutError, match="within"):
                    strategy.apply(engine, update, timeout_s=1.0)
                assert time.monotonic() - t0 < 10.0
            finally:
                engine._http.close()

    def test_delta_versions_are_bit_exact_and_small(self, strategy: Any) -> None:
        """Successive versions round-trip bit-exactly and a small change moves fewer bytes than the first version
        (capability ``"delta"``)."""
        self.require("delta")
        sent = self.reference_tensors()
        first = strategy.push(iter(sent.items()), 1)
        self.assert_bit_exact(strategy.read(first), sent)
        for version in (2, 3):
            sent = self.changed_tensors(sent, version)
            update = strategy.push(iter(sent.items()), version)
            assert update.version == version
            assert 0 < update.num_bytes < first.num_bytes
            self.assert_bit_exact(strategy.read(update), sent)

    def test_out_of_order_delta_is_refused(self, strategy: Any) -> None:
        """Reading version N+2 on a receiver at version N fails and changes nothing; in order, both apply
        (capability ``"delta"``)."""
        self.require("delta")
        t1 = self.reference_tensors()
        strategy.read(strategy.push(iter(t1.items()), 1))
        t2 = self.changed_tensors(t1, 2)
        t3 = self.changed_tensors(t2, 3)
        u2 = strategy.push(iter(t2.items()), 2)
        u3 = strategy.push(iter(t3.items()), 3)
        with pytest.raises(Exception, match="(?i)order|version"):
            strategy.read(u3)
        self.assert_bit_exact(strategy.read(u2), t2)
        self.assert_bit_exact(strategy.read(u3), t3)

    def test_retry_after_an_interrupted_delta(self, strategy: Any) -> None:
        """A version whose files were cut short (an interrupted transfer) or had a byte flipped is refused and
        leaves the receiver on its old version; once the files are whole again the same version applies
        bit-exactly, and applying it once more is harmless (capability ``"delta"``; ``payload["path"]`` is the
        directory of the version's files)."""
        self.require("delta")
        t1 = self.reference_tensors()
        strategy.read(strategy.push(iter(t1.items()), 1))
        t2 = self.changed_tensors(t1, 2)
        u2 = strategy.push(iter(t2.items()), 2)
        files = [f for f in sorted(Path(u2.payload["path"]).rglob("*")) if f.is_file()]
        assert files, "a delta update must leave files under payload['path']"
        saved = {f: f.read_bytes() for f in files}
        for f, data in saved.items():  # interrupted: every file cut in half
            f.write_bytes(data[: len(data) // 2])
        with pytest.raises(Exception):  # noqa: B017 - any error, as long as nothing is applied
            strategy.read(u2)
        for f, data in saved.items():  # corrupted: the last payload byte flipped
            f.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))
        with pytest.raises(Exception, match="(?i)checksum|corrupt"):
            strategy.read(u2)
        for f, data in saved.items():
            f.write_bytes(data)
        self.assert_bit_exact(strategy.read(u2), t2)
        self.assert_bit_exact(strategy.read(u2), t2)  # a retry of an applied version changes nothing
        t3 = self.changed_tensors(t2, 3)
        self.assert_bit_exact(strategy.read(strategy.push(iter(t3.items()), 3)), t3)


class _SilentServer:
    """A TCP listener on 127.0.0.1 that accepts connections and never answers (a hung receiver); yields its port."""

    def __enter__(self) -> int:
        import socket
        import threading

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.conns: list[Any] = []
        self.closed = threading.Event()

        def accept() -> None:
            while not self.closed.is_set():
                try:
                    conn, _ = self.sock.accept()
                except OSError:
                    return
                self.conns.append(conn)

        threading.Thread(target=accept, daemon=True).start()
        return int(self.sock.getsockname()[1])

    def __exit__(self, *exc: object) -> None:
        self.closed.set()
        for c in self.conns:
            c.close()
        self.sock.close()
