"""The engine side of in-memory adapter sync against vLLM's own LoRA model class: a staged adapter loads exactly as
its PEFT files would, any other directory still loads from its files, and a dropped one is gone."""

from __future__ import annotations

import json
import types

import pytest
import torch
from safetensors.torch import save_file

from vime_core.engines.lora_stash import AdapterStash, stage_dir

pytestmark = pytest.mark.unit

lora_model = pytest.importorskip("vllm.lora.lora_model")
peft_helper = pytest.importorskip("vllm.lora.peft_helper")

CONFIG = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj", "v_proj"], "bias": "none"}
PREFIX = "base_model.model.model.layers.0.self_attn"


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        f"{PREFIX}.{proj}.lora_{ab}.weight": torch.randn(shape, generator=g)
        for proj in ("q_proj", "v_proj")
        for ab, shape in (("A", (2, 8)), ("B", (8, 2)))
    }


def _load(manager, path) -> object:
    helper = peft_helper.PEFTHelper.from_local_dir(str(path), 512)
    return manager._lora_model_cls.from_local_checkpoint(
        str(path), {"q_proj", "v_proj"}, helper, lora_model_id=7, device="cpu", dtype=torch.float32
    )


def _weights(model) -> dict[str, tuple[list, list]]:
    return {name: (lora.lora_a.tolist(), lora.lora_b.tolist()) for name, lora in model.loras.items()}


def test_a_staged_adapter_loads_exactly_as_its_files(tmp_path):
    on_disk = tmp_path / "files"
    on_disk.mkdir()
    save_file(_tensors(), str(on_disk / "adapter_model.safetensors"))
    (on_disk / "adapter_config.json").write_text(json.dumps(CONFIG))
    manager = types.SimpleNamespace(_lora_model_cls=lora_model.LoRAModel)  # vLLM's LRU manager's one attribute
    want = _weights(_load(manager, on_disk))

    stash = AdapterStash()
    stash.install(manager)
    stash.install(manager)  # once: not a subclass of a subclass
    assert manager._lora_model_cls.__mro__[1] is lora_model.LoRAModel
    key = "127.0.0.1_8000/policy-lora-v3"
    staged = stash.stage(key, CONFIG, _tensors())
    try:
        assert staged == stage_dir(key)
        assert sorted(p.name for p in staged.iterdir()) == ["adapter_config.json"]  # no tensor file
        got = _load(manager, staged)
        assert got.id == 7
        assert _weights(got) == want
        assert sorted(want) == ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj"]
        assert _weights(_load(manager, on_disk)) == want  # a directory that is not staged loads from its files
    finally:
        assert stash.drop(key)
    assert not staged.exists()
    assert not stash.drop(key)


def test_stage_refuses_what_is_not_a_lora_adapter():
    stash = AdapterStash()
    with pytest.raises(ValueError, match=r"^adapter k: adapter_config has peft_type 'IA3', not 'LORA'$"):
        stash.stage("k", {**CONFIG, "peft_type": "IA3"}, _tensors())
    with pytest.raises(ValueError, match=r"^adapter k: no tensors arrived$"):
        stash.stage("k", CONFIG, {})
    with pytest.raises(RuntimeError, match=r"started without --enable-lora"):
        stash.install(None)
