"""``ipc`` and ``nccl`` weight sync on real GPUs (marked ``gpu``; CI deselects them).

* ``ipc``: the contract kit; :meth:`IpcWeightSync.read` maps the handles in a second process, as an engine would.
* ``nccl``: the strategy's trainer side on ``cuda:0`` (NCCL group), a receiver process on ``cuda:1`` running the
  engine-side :func:`vime_core.weight_sync.nccl.receive_weights` — needs two GPUs.
"""

from __future__ import annotations

import io

import pytest
import torch
import torch.multiprocessing as mp

from vime_core.cli.arguments import default_args
from vime_core.config import RunConfig
from vime_core.plugins.manager import get_plugins
from vime_core.testing import WeightSyncContract

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)


class TestIpcWeightSync(WeightSyncContract):
    capabilities = {"cleanup"}

    @pytest.fixture
    def strategy(self):
        return get_plugins().resolve("weight_sync", "ipc")(
            RunConfig.from_args(default_args(update_weight_buffer_size=4096))
        )


def _receiver(port: int, versions: int, conn) -> None:
    from vime_core.weight_sync.nccl import receive_weights, stateless_group

    torch.cuda.set_device(1)
    group = stateless_group("127.0.0.1", port, 1, 2, "nccl", 120.0)
    for _ in range(versions):
        buf = io.BytesIO()  # bytes: torch would pass CPU tensors by a handle that dies with this process
        torch.save({n: t.to("cpu", copy=True) for n, t in receive_weights(src=0, group=group)}, buf)
        conn.send(buf.getvalue())


def _recv(conn) -> dict[str, torch.Tensor]:
    return torch.load(io.BytesIO(conn.recv()), weights_only=True)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_nccl_strategy_broadcasts_bit_exactly_to_a_second_gpu():
    torch.cuda.set_device(0)
    strategy = get_plugins().resolve("weight_sync", "nccl")(
        RunConfig.from_args(
            default_args(
                rollout_num_engines=1,
                rollout_num_gpus_per_engine=1,
                weight_sync_timeout=120.0,
                update_weight_buffer_size=4096,
                update_weight_checksums=True,
            )
        )
    )
    sent = {n: t.cuda() for n, t in WeightSyncContract.reference_tensors().items()}
    first = strategy.push(iter(sent.items()), 1)
    assert first.payload["backend"] == "nccl" and first.payload["init"]
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_receiver, args=(first.payload["port"], 2, child))
    proc.start()
    try:
        WeightSyncContract.assert_bit_exact(_recv(parent), {n: t.cpu() for n, t in sent.items()})
        sent2 = {
            n: t.cuda()
            for n, t in WeightSyncContract.changed_tensors({n: t.cpu() for n, t in sent.items()}, 2).items()
        }
        second = strategy.push(iter(sent2.items()), 2)
        assert not second.payload["init"]
        WeightSyncContract.assert_bit_exact(_recv(parent), {n: t.cpu() for n, t in sent2.items()})
        strategy._wait_sender()
        assert strategy.last_stats.num_buckets >= 2
    finally:
        proc.join(timeout=60)
    assert proc.exitcode == 0
