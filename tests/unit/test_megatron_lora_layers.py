"""PEFT's LoRA on megatron-core's parallel linear layers, on the CPU (Gloo, TP = 1), in a fresh process: the layers
are adapted (PEFT 0.21's own Megatron path fails with ``KeyError: 'fan_in_fan_out'``, then ``KeyError: 'default'``,
then multiplies a tuple), a fresh adapter changes nothing, an adapted layer computes ``W x + s · B A x`` exactly,
gradients reach the adapter alone, and a disabled adapter gives the base layer (the KL reference)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from vime_core.cluster.net import find_free_port

pytestmark = pytest.mark.unit
pytest.importorskip("megatron.core")
pytest.importorskip("peft")

ROOT = Path(__file__).resolve().parents[2]


def test_peft_lora_on_megatron_parallel_layers():
    port = find_free_port("127.0.0.1")
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("megatron_lora_layers_main.py")), str(port)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["lora_params"] == [
        f"{layer}.lora_{ab}.default.weight" for layer in ("linear_proj", "linear_qkv") for ab in ("A", "B")
    ]
    for layer in ("linear_qkv", "linear_proj"):
        assert got[f"{layer}_fresh"] == 0.0  # PEFT initialises B to zero
        assert got[f"{layer}_adapted"] < 1e-5
        assert got[f"{layer}_grads"] == ["lora_A.default.weight", "lora_B.default.weight"]
        assert got[f"{layer}_disabled"] == 0.0
