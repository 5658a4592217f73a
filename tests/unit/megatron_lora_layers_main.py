"""Run by tests/unit/test_megatron_lora_layers.py in a fresh process (it initialises torch.distributed and Megatron's
parallel state, which must not leak into the test process): PEFT's LoRA on megatron-core's parallel linear layers
through :func:`vime_core.trainer.megatron_lora.register_megatron_layers`; prints one JSON line."""

from __future__ import annotations

import copy
import json
import os
import sys

import torch
import torch.distributed as dist


def main(port: int) -> dict:
    import peft
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.transformer_config import TransformerConfig

    from vime_core.trainer.megatron_lora import register_megatron_layers

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    torch.manual_seed(0)
    cfg = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, use_cpu_initialization=True)
    init = torch.nn.init.normal_

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear_qkv = ColumnParallelLinear(
                16, 48, config=cfg, init_method=init, bias=False, gather_output=False
            )
            self.linear_proj = RowParallelLinear(
                16, 16, config=cfg, init_method=init, bias=False, input_is_parallel=True, skip_bias_add=True
            )

    block = Block()
    config = peft.LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["linear_qkv", "linear_proj"],
        megatron_config=copy.copy(cfg),
        megatron_core="megatron.core",
    )
    register_megatron_layers(config)
    peft.inject_adapter_in_model(config, block, adapter_name="default")
    out: dict = {"lora_params": sorted(n for n, _ in block.named_parameters() if ".lora_" in n)}
    x = torch.randn(3, 1, 16)
    for name in ("linear_qkv", "linear_proj"):
        layer = getattr(block, name)
        out[f"{name}_fresh"] = (layer(x)[0] - x @ layer.base_layer.weight.T).abs().max().item()  # B = 0
        torch.nn.init.normal_(layer.lora_B["default"].weight)
        w, a, b = layer.base_layer.weight, layer.lora_A["default"].weight, layer.lora_B["default"].weight
        want = x @ w.T + (x @ a.T @ b.T) * layer.scaling["default"]
        got, _ = layer(x)
        out[f"{name}_adapted"] = (got - want).abs().max().item()
        got.sum().backward()
        out[f"{name}_grads"] = sorted(n for n, p in layer.named_parameters() if p.grad is not None)
        layer.enable_adapters(False)
        out[f"{name}_disabled"] = (layer(x)[0] - x @ w.T).abs().max().item()
        layer.enable_adapters(True)
    dist.destroy_process_group()
    return out


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]))))
