"""LoRA (docs/lora.md) without an engine: the torch backend's PEFT adapter gets every gradient and all optimizer
state, the KL reference is the base model, merged export / adapter files / checkpoints round-trip, the engines'
adapter set is named and retired per version, and bad flag combinations fail naming the flag."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import httpx
import pytest
import torch

from vime_core.cli.arguments import ArgumentError, default_args, parse_run_args
from vime_core.config import LoraConfig
from vime_core.config.lora import (
    LoraFlagError,
    adapters_to_keep,
    check_lora_model,
    engine_max_lora_rank,
    module_names,
)
from vime_core.engines.client import RouterClient
from vime_core.engines.engine_api import lora_launch
from vime_core.engines.lora_serving import AdapterServing
from vime_core.engines.weight_recovery import WeightRecovery
from vime_core.testing.plugin_context import run_config
from vime_core.testing.trainer_args import trainer_config
from vime_core.types import RolloutBatch, Sample, Status
from vime_core.weight_sync.base import WeightUpdate
from vime_core.weight_sync.disk import DiskWeightSync

pytestmark = pytest.mark.unit

BASE = ["--model", "m", "--prompt-data", "d.jsonl"]


def _samples(vocab: int, seed: int = 0) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, (p, r) in enumerate(((4, 6), (8, 3), (5, 5))):
        s = Sample(index=i, tokens=torch.randint(0, vocab, (p,), generator=g).tolist(), status=Status.COMPLETED)
        s.append_response_tokens(
            torch.randint(0, vocab, (r,), generator=g).tolist(), trainable=True, log_probs=[0.0] * r, weight_version=0
        )
        out.append(s)
    return out


def _batch(samples: list[Sample]) -> RolloutBatch:
    return RolloutBatch(
        samples=samples, advantages=[[1.0 if s.index % 2 else -1.0] * s.response_length for s in samples]
    )


def _trainer(model_dir: Path, **kw):
    from vime_core.trainer.torch_backend import TorchTrainer

    return TorchTrainer(trainer_config(lora_rank=4, lora_alpha=8.0, **kw), model_dir)


# -- training ------------------------------------------------------------------------------------------------------
def test_only_adapter_parameters_get_gradients_and_optimizer_state(tiny_model_dir):
    trainer = _trainer(tiny_model_dir)
    named = dict(trainer.model.named_parameters())
    lora = {n for n, p in named.items() if p.requires_grad}
    assert lora and all(".lora_A." in n or ".lora_B." in n for n in lora)
    # all-linear on Qwen2: q/k/v/o and gate/up/down of each layer, A and B each; never the embeddings or lm_head
    assert {n.split(".")[-4] for n in lora} == {
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    }
    before = {n: p.detach().clone() for n, p in named.items()}
    trainer.train_step(_batch(_samples(4096)))
    changed = {n for n, p in named.items() if not torch.equal(p.detach(), before[n])}
    # the first step moves B (A's gradient is B·… = 0 while B is zero); every base weight stays bit-exact
    assert changed and changed <= lora and all(".lora_B." in n for n in changed)
    state_params = {id(p) for p in trainer.optimizer.state}
    assert state_params == {id(named[n]) for n in lora}  # Adam moments only for the adapter
    assert sum(p.numel() for p in trainer.optimizer.param_groups[0]["params"]) == sum(named[n].numel() for n in lora)


def test_reference_is_the_base_model_with_the_adapter_disabled(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from vime_core.trainer.lora_torch import AdapterDisabledReference
    from vime_core.trainer.torch_backend import response_log_probs

    trainer = _trainer(tiny_model_dir, use_kl_loss=True, kl_loss_coef=0.1)
    assert isinstance(trainer.ref_model, AdapterDisabledReference)  # no second model
    samples = _samples(4096)
    for _ in range(2):
        trainer.train_step(_batch(samples))  # B is no longer zero: the policy differs from the base
    ref = trainer.ref_model.log_probs(samples, 8)
    assert trainer.model.training  # the policy is back in training mode
    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    with torch.no_grad():
        expected = response_log_probs(base, samples, torch.device("cpu"))[0]
        policy = trainer.policy_log_probs(samples, False)[0]
    for s, e, p in zip(samples, expected, policy, strict=True):
        torch.testing.assert_close(ref[id(s)], e, atol=1e-6, rtol=0)
        assert (p - e).abs().max() > 1e-4
    # --ref-load still names a model of its own
    from vime_core.trainer.torch_backend import ReferenceModel

    other = _trainer(tiny_model_dir, use_kl_loss=True, ref_load=str(tiny_model_dir))
    assert isinstance(other.ref_model, ReferenceModel)


def test_merged_weights_adapter_files_and_final_dirs(tiny_model_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    trainer = _trainer(tiny_model_dir)
    samples = _samples(4096)
    trainer.train_step(_batch(samples))
    ids = torch.tensor([samples[0].tokens])
    with torch.no_grad():
        want = trainer.model(input_ids=ids).logits
    # final_hf: the merged model, a plain HF directory
    trainer.save_hf(tmp_path / "final_hf")
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "final_hf"), dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, want, atol=1e-5, rtol=0)
    assert not any("lora" in n for n in dict(trainer.named_hf_tensors()))
    # final_adapter: what PEFT loads on top of the base model
    trainer.save_adapter(tmp_path / "final_adapter")
    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    loaded = PeftModel.from_pretrained(base, str(tmp_path / "final_adapter"))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, want, atol=1e-6, rtol=0)
    # the weight-sync files: PEFT's names and config, loadable by PEFT, read back bit-exactly
    tensors, config = trainer.lora_adapter()
    sync = DiskWeightSync(run_config(model="m", update_weight_disk_dir=tmp_path / "w"))
    update = sync.push_adapter(tensors, config, 3)
    assert update.payload == {"path": str(tmp_path / "w" / "weight_v000003"), "lora": True}
    assert update.num_bytes == sum(t.numel() * 4 for t in tensors.values())
    assert sorted(p.name for p in Path(update.payload["path"]).iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    files = json.loads((Path(update.payload["path"]) / "adapter_config.json").read_text())
    assert (files["peft_type"], files["r"], files["lora_alpha"], files["inference_mode"]) == ("LORA", 4, 8.0, True)
    assert all(torch.equal(sync.read(update)[n], t) for n, t in tensors.items())
    again = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32), update.payload["path"]
    )
    with torch.no_grad():
        torch.testing.assert_close(again(input_ids=ids).logits, want, atol=1e-6, rtol=0)


def test_checkpoint_holds_adapter_and_optimizer_and_resumes_exactly(tiny_model_dir, tmp_path):
    samples = _samples(4096)
    a = _trainer(tiny_model_dir)
    a.train_step(_batch(samples))
    a.save_checkpoint(tmp_path / "ckpt")
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["adapter", "optimizer.pt", "trainer_state.pt"]
    a.train_step(_batch(samples))
    b = _trainer(tiny_model_dir, seed=5)  # another adapter init: the checkpoint must replace it
    b.load_checkpoint(tmp_path / "ckpt")
    b.train_step(_batch(samples))
    sa, sb = a.lora_adapter()[0], b.lora_adapter()[0]
    assert sa.keys() == sb.keys() and all(torch.equal(sa[n], sb[n]) for n in sa)


def test_start_from_an_adapter_path(tiny_model_dir, tmp_path):
    a = _trainer(tiny_model_dir)
    a.train_step(_batch(_samples(4096)))
    a.save_adapter(tmp_path / "start")
    b = _trainer(tiny_model_dir, lora_adapter_path=tmp_path / "start")
    sa, sb = a.lora_adapter()[0], b.lora_adapter()[0]
    assert all(torch.equal(sa[n], sb[n]) for n in sa)
    assert all(p.requires_grad for p in b.trainable_parameters()) and b.trainable_parameters()


# -- the engines' adapters -----------------------------------------------------------------------------------------
class _Engine:
    def __init__(self, url: str = "http://e", fail_unload: bool = False) -> None:
        self.url, self.fail_unload = url, fail_unload
        self.calls: list[tuple] = []

    def load_lora_adapter(self, name, path):
        self.calls.append(("load", name, str(path)))

    def unload_lora_adapter(self, name):
        self.calls.append(("unload", name))
        if self.fail_unload:
            raise RuntimeError("engine gone")

    def set_weight_version(self, v):
        self.calls.append(("label", v))

    def reset_prefix_cache(self):
        self.calls.append(("reset",))


def _update(sync: DiskWeightSync, version: int) -> WeightUpdate:
    return sync.push_adapter({"base_model.model.x.lora_A.weight": torch.ones(2, 2)}, {"r": 2}, version)


def test_each_version_is_its_own_adapter_and_older_ones_are_unloaded(tmp_path):
    sync = DiskWeightSync(run_config(model="m", update_weight_disk_dir=tmp_path))
    serving = AdapterServing("policy", keep=2, start_adapter=None, weight_sync=sync)
    assert [serving.model_for(v) for v in (0, 1, 12)] == ["policy", "policy-lora-v1", "policy-lora-v12"]
    engines = [_Engine("http://a"), _Engine("http://b", fail_unload=True)]
    serving.start(engines)  # nothing to load at version 0 without --lora-adapter-path
    assert engines[0].calls == []
    updates = {}
    for v in (1, 2, 3):
        updates[v] = u = _update(sync, v)
        serving.prepare(u)
        assert u.payload["adapter"] == f"policy-lora-v{v}"
        for e in engines:
            sync.apply(e, u, 5.0)
        serving.record(u)
        serving.retire(engines, serving.to_retire())  # the failing engine's unload is logged, not raised
    assert serving.versions() == [2, 3]
    assert engines[0].calls == [
        ("load", "policy-lora-v1", updates[1].payload["path"]),
        ("load", "policy-lora-v2", updates[2].payload["path"]),
        ("load", "policy-lora-v3", updates[3].payload["path"]),
        ("unload", "policy-lora-v1"),
    ]
    assert not Path(updates[1].payload["path"]).exists() and Path(updates[2].payload["path"]).exists()
    # a replacement engine gets every kept adapter, and the recovery labels it
    recovery = WeightRecovery(sync, tmp_path, serving)
    assert recovery.applied(updates[3]) == [] and recovery.supported
    fresh = _Engine("http://c")
    recovery.load(fresh)
    assert fresh.calls == [
        ("load", "policy-lora-v2", updates[2].payload["path"]),
        ("load", "policy-lora-v3", updates[3].payload["path"]),
        ("label", 3),
    ]
    serving.close()
    assert not Path(updates[3].payload["path"]).exists()


def test_start_adapter_is_version_0_and_its_files_are_never_removed(tmp_path):
    start = tmp_path / "start"
    start.mkdir()
    sync = DiskWeightSync(run_config(model="m", update_weight_disk_dir=tmp_path / "w"))
    serving = AdapterServing("policy", keep=1, start_adapter=start, weight_sync=sync)
    engine = _Engine()
    serving.start([engine])
    assert serving.model_for(0) == "policy-lora-v0"
    u = _update(sync, 1)
    serving.prepare(u)
    serving.record(u)
    serving.retire([engine], serving.to_retire())
    assert engine.calls == [("load", "policy-lora-v0", str(start.resolve())), ("unload", "policy-lora-v0")]
    assert start.is_dir()


def test_adapters_kept_follow_the_staleness_bound():
    def cfg(**kw):
        return LoraConfig.from_args(default_args(**({"lora_rank": 8} | kw)))

    assert adapters_to_keep(cfg(loop="sync")) == 1
    assert adapters_to_keep(cfg(loop="one-step-off", max_staleness=3)) == 1
    assert adapters_to_keep(cfg(loop="fully-async", max_staleness=2)) == 3
    assert lora_launch([], 16, 3) == (
        ["--enable-lora", "--max-lora-rank", "16", "--max-loras", "3", "--max-cpu-loras", "4"],
        {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"},
    )
    assert lora_launch(["--max-loras=5", "--enable-lora"], 16, 3)[0] == [
        "--max-lora-rank",
        "16",
        "--max-cpu-loras",
        "4",
    ]
    assert engine_max_lora_rank(cfg(lora_rank=16)) == 16
    assert engine_max_lora_rank(cfg(lora_rank=17)) == 32
    assert engine_max_lora_rank(cfg(lora_rank=4, vllm_args=["--max-lora-rank", "8"])) == 8
    assert module_names(["q_proj,v_proj", " o_proj "]) == ["q_proj", "v_proj", "o_proj"]


def test_requests_name_their_versions_adapter_and_its_tokens_carry_that_version():
    """The engine's per-token labels follow its latest update; a LoRA request is generated by the adapter it named
    alone, so the client labels its tokens with that adapter's version."""
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append((request.url.path, body["model"]))
        if "prompt_logprobs" in body.get("sampling_params", {}):
            entries = [None] + [{str(t): {"logprob": -0.5}} for t in body["token_ids"][1:]]
            return httpx.Response(200, json={"prompt_logprobs": entries})
        choice = {
            "token_ids": [7, 8],
            "logprobs": {"content": [{"logprob": -0.1}, {"logprob": -0.2}]},
            "text": "ab",
            "finish_reason": "length",
            "weight_versions": [{"start": 0, "end": 2, "version": "9"}],  # the engine's label: not the adapter's
        }
        return httpx.Response(200, json={"choices": [choice]})

    import asyncio

    async def go():
        client = RouterClient("http://router", "policy")
        client._http = httpx.AsyncClient(base_url="http://router", transport=httpx.MockTransport(handler))
        serving = AdapterServing("policy", 1, None, weight_sync=None)  # type: ignore[arg-type]
        client.model_for = serving.model_for
        first = await client.generate([1, 2], {"max_tokens": 2})
        client.weight_version = 4
        second = await client.generate([1, 2], {"max_tokens": 2})
        lps = await client.prompt_log_probs([1, 2, 3])
        client.model_for = None
        plain = await client.generate([1, 2], {"max_tokens": 2})
        await client.aclose()
        return first, second, lps, plain

    first, second, lps, plain = asyncio.run(go())
    assert [m for _, m in seen] == ["policy", "policy-lora-v4", "policy-lora-v4", "policy"]
    assert (first.weight_versions, second.weight_versions, plain.weight_versions) == (
        ["0", "0"],
        ["4", "4"],
        ["9", "9"],
    )
    assert lps == [-0.5, -0.5]


# -- flag checks ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--lora-rank", "-1"], "--lora-rank must be >= 0 (0: full fine-tuning), got -1"),
        (["--lora-adapter-path", "a"], "--lora-adapter-path needs --lora-rank > 0 (the adapter's rank)"),
        (["--lora-rank", "8", "--lora-alpha", "0"], "--lora-alpha must be > 0, got 0"),
        (["--lora-rank", "8", "--lora-dropout", "1"], "--lora-dropout must be in [0, 1), got 1"),
        (
            ["--lora-rank", "8", "--target-modules", "all-linear", "q_proj"],
            "--target-modules: all-linear stands alone, got all-linear q_proj",
        ),
        (
            ["--lora-rank", "32", "--vllm-max-lora-rank", "16"],
            "--lora-rank 32 exceeds the engines' --vllm-max-lora-rank 16: vLLM refuses an adapter above its max "
            "LoRA rank; raise --vllm-max-lora-rank or lower --lora-rank",
        ),
        (["--lora-rank", "1024"], "--lora-rank 1024 exceeds vLLM's largest --max-lora-rank 512"),
        (
            ["--lora-rank", "16", "--weight-sync", "disk-delta"],
            "--weight-sync disk-delta cannot carry a LoRA adapter (--lora-rank 16): use --weight-sync disk (PEFT "
            "adapter files loaded through vLLM's runtime LoRA API), ipc or nccl (the adapter handed over in memory)",
        ),
    ],
)
def test_bad_lora_flags_fail_at_startup_naming_the_flag(argv, message):
    with pytest.raises(ArgumentError) as e:
        parse_run_args(BASE + argv)
    assert str(e.value) == message


def test_good_lora_flags_parse_into_the_section():
    cfg = LoraConfig.from_args(parse_run_args(BASE + ["--lora-rank", "16", "--target-modules", "q_proj,v_proj"]))
    assert (cfg.enabled, cfg.lora_rank, cfg.lora_alpha, cfg.target_modules) == (True, 16, 16.0, ["q_proj,v_proj"])
    assert not LoraConfig.from_args(parse_run_args(BASE)).enabled


def test_target_modules_the_model_lacks_fail_naming_the_flag(tiny_model_dir, tmp_path):
    def cfg(**kw) -> LoraConfig:
        return LoraConfig.from_args(default_args(lora_rank=4, **kw))

    check_lora_model(cfg(target_modules=["q_proj,v_proj"], exclude_modules=["down_proj"]), tiny_model_dir)
    linear = "down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj"
    with pytest.raises(LoraFlagError) as e:
        check_lora_model(cfg(target_modules=["q_proj", "qkv_proj"]), tiny_model_dir)
    assert str(e.value) == f"--target-modules qkv_proj: the model {tiny_model_dir} has no such linear layer ({linear})"
    with pytest.raises(LoraFlagError) as e:
        check_lora_model(cfg(exclude_modules=["mlp"]), tiny_model_dir)
    assert str(e.value) == f"--exclude-modules mlp: the model {tiny_model_dir} has no such linear layer ({linear})"
    with pytest.raises(LoraFlagError) as e:
        check_lora_model(cfg(target_modules=["lm_head"]), tiny_model_dir)
    assert (
        str(e.value)
        == f"--target-modules lm_head: the output layer; vLLM serves LoRA on the decoder's linear layers ({linear})"
    )
    with pytest.raises(LoraFlagError) as e:
        check_lora_model(cfg(lora_adapter_path=tmp_path), tiny_model_dir)
    assert str(e.value) == (
        f"--lora-adapter-path {tmp_path}: not a PEFT adapter directory (adapter_config.json and "
        "adapter_model.safetensors)"
    )
    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8}))
    (tmp_path / "adapter_model.safetensors").write_bytes(b"")
    with pytest.raises(LoraFlagError) as e:
        check_lora_model(cfg(lora_adapter_path=tmp_path), tiny_model_dir)
    assert str(e.value) == f"--lora-rank 4 differs from the rank of --lora-adapter-path {tmp_path} (r=8)"


def test_a_trainer_without_lora_support_is_refused():
    from vime_core.config.lora import check_lora_config

    cfg = LoraConfig.from_args(default_args(lora_rank=8, trainer="mine"))
    with pytest.raises(LoraFlagError) as e:
        check_lora_config(cfg, DiskWeightSync, argparse.Namespace)
    assert str(e.value) == "--trainer mine has no LoRA support (--lora-rank 8)"
