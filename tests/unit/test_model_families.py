"""The family registry (vime_core/models/families.py) and the up-front check of ``vime run``: each model the
``megatron`` trainer does not build is refused with one exact line naming its type, what the trainer supports and
``--trainer torch``, from config.json alone — before the parser loads the plugins (and torch), so nothing is
imported, written or started; ``vime models`` prints the same registry."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vime_core.cli.commands import check_trainer_model_early
from vime_core.config.errors import ArgumentError
from vime_core.models.families import (
    FAMILIES,
    UnsupportedModelError,
    check_trainer_model,
    families_table,
    features_of,
    register_family,
)

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
TORCH = "--trainer torch takes any Hugging Face causal LM"
#: a Qwen3-shaped config.json (what the tiny qwen3 model of vime_core/testing/tiny_model.py writes)
QWEN3 = {
    "model_type": "qwen3",
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "intermediate_size": 128,
    "vocab_size": 4096,
    "tie_word_embeddings": True,
    "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
    "use_sliding_window": False,
    "sliding_window": None,
}
LLAMA = {**QWEN3, "model_type": "llama", "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"}}

#: (config.json, the one line after "--model M: ") of every kind of model the megatron trainer refuses
REFUSED = {
    "unknown family": (
        {"model_type": "gpt2", "n_layer": 2},
        "model_type 'gpt2' is not supported by --trainer megatron (it takes deepseek_v3, llama, mistral, qwen2, "
        f"qwen3, qwen3_moe; `vime models` lists them); {TORCH}",
    ),
    "no model_type": (
        {"hidden_size": 64},
        f"config.json has no model_type, so --trainer megatron cannot tell its family; {TORCH}",
    ),
    "rope dynamic": (
        {**LLAMA, "rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 5e5}},
        "Llama (model_type 'llama') with rope_type 'dynamic' is not supported by --trainer megatron (it supports "
        f"rope_type default, linear or llama3); {TORCH}",
    ),
    "rope yarn on qwen3": (
        {**QWEN3, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}, "rope_parameters": None},
        "Qwen3 (model_type 'qwen3') with rope_type 'yarn' is not supported by --trainer megatron (it supports "
        f"rope_type default); {TORCH}",
    ),
    "sliding window": (
        {**QWEN3, "use_sliding_window": True, "sliding_window": 4096},
        "Qwen3 (model_type 'qwen3') with sliding-window attention (sliding_window 4096) is not supported by "
        f"--trainer megatron (it supports full attention); {TORCH}",
    ),
    "moe layout on a dense family": (
        {**QWEN3, "num_experts": 128},
        "Qwen3 (model_type 'qwen3') with MoE layers (num_experts 128) is not supported by --trainer megatron (it "
        f"supports dense MLP layers); {TORCH}",
    ),
    "multi-latent attention": (
        {**LLAMA, "kv_lora_rank": 512},
        "Llama (model_type 'llama') with multi-latent attention (kv_lora_rank) is not supported by --trainer "
        f"megatron (it supports grouped-query attention); {TORCH}",
    ),
    "activation": (
        {**LLAMA, "hidden_act": "gelu"},
        "Llama (model_type 'llama') with hidden_act 'gelu' is not supported by --trainer megatron (it supports "
        f"hidden_act silu); {TORCH}",
    ),
    "missing size": (
        {k: v for k, v in QWEN3.items() if k != "intermediate_size"},
        f"the model's config has no intermediate_size (model_type 'qwen3'); {TORCH}",
    ),
}


@pytest.mark.parametrize("case", REFUSED)
def test_each_refused_model_gets_its_exact_line(case):
    config, message = REFUSED[case]
    with pytest.raises(UnsupportedModelError) as e:
        check_trainer_model("megatron", config, "/models/m")
    assert str(e.value) == f"--model /models/m: {message}"


def test_supported_models_pass_and_the_torch_trainer_takes_anything():
    check_trainer_model("megatron", QWEN3, "q")
    llama3 = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    llama3 |= {"original_max_position_embeddings": 8192, "rope_theta": 5e5}
    check_trainer_model("megatron", {**LLAMA, "rope_parameters": llama3}, "l")
    for config, _ in REFUSED.values():
        check_trainer_model("torch", config, "m")  # any Hugging Face causal LM
        check_trainer_model("some-plugin-trainer", config, "m")  # a trainer the registry does not know


def test_the_table_lists_each_trainers_families_and_features():
    rows = families_table()
    assert rows[0] == {
        "trainer": "torch",
        "family": "any causal LM",
        "model_types": ["*"],
        "examples": "AutoModelForCausalLM",
        "tp": False,
        "ep": False,
        "routing_replay": False,
        "lora": True,
        "notes": "",
    }
    megatron = {r["family"]: r for r in rows if r["trainer"] == "megatron"}
    for name, model_type in (("Llama", "llama"), ("Mistral", "mistral"), ("Qwen2", "qwen2"), ("Qwen3", "qwen3")):
        r = megatron[name]
        assert r["model_types"] == [model_type]
        assert (r["tp"], r["ep"], r["routing_replay"], r["lora"]) == (True, False, False, True)
    assert megatron["Llama"]["notes"] == "RoPE default, linear or llama3 (Llama 3.1+); attention_bias"
    assert features_of("torch", "qwen3").lora and not features_of("torch", "qwen3").tp
    assert features_of("megatron", "gpt2") is None and features_of("megatron", "qwen3").tp


def test_a_model_type_registers_once():
    with pytest.raises(ValueError, match="model_type 'qwen3' is registered already \\(Qwen3\\)"):
        register_family(FAMILIES["qwen3"])


def write_model(root: Path, config: dict) -> Path:
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps(config))
    (root / "model.safetensors").write_bytes(b"")
    return root


#: run in a fresh interpreter: `vime run` through the CLI's main; what it imported and how long it took
_CLI = r"""
import json, sys, time
t0 = time.perf_counter()
from vime_core.cli.commands import main
rc = main(sys.argv[1:])
heavy = ("torch", "ray", "vllm", "transformers", "megatron", "vime_core.trainer.base", "vime_core.run.loop")
heavy = sorted(m for m in heavy if m in sys.modules)
print(json.dumps({"rc": rc, "seconds": time.perf_counter() - t0, "imported": heavy}))
"""


def test_vime_run_refuses_an_unsupported_model_in_one_line_before_anything_starts(tmp_path):
    config, message = REFUSED["sliding window"]
    model = write_model(tmp_path / "m", config)
    yaml_config = tmp_path / "run.yaml"
    yaml_config.write_text(f"model: {model}\ntrainer: megatron\n")
    out = tmp_path / "out"
    for argv in (
        ["run", "--trainer", "megatron", "--model", str(model), "--prompt-data", "p.jsonl", "--output-dir", str(out)],
        ["run", "--config", str(yaml_config), "--output-dir", str(out)],  # the YAML's model and trainer
    ):
        t0 = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-c", _CLI, *argv], capture_output=True, text=True, cwd=ROOT, timeout=120
        )
        wall = time.perf_counter() - t0
        got = json.loads(proc.stdout.strip().splitlines()[-1])
        print(f"{argv[1]}: refused in {got['seconds']:.2f} s inside main, {wall:.2f} s with interpreter start")
        assert got["rc"] == 2
        assert proc.stderr.splitlines() == [f"vime: error: --model {model}: {message}"]
        assert got["imported"] == []  # no plugin loaded, no torch, transformers, Ray, vLLM or loop: nothing started
        assert not out.exists()


def test_the_early_check_passes_supported_models_and_leaves_what_it_cannot_read(tmp_path):
    model = write_model(tmp_path / "q", QWEN3)
    check_trainer_model_early(["--trainer", "megatron", "--model", str(model)])
    check_trainer_model_early(["--trainer", "megatron", "--model", str(tmp_path / "missing")])  # checked_model's
    check_trainer_model_early(["--model", str(write_model(tmp_path / "g", {"model_type": "gpt2"}))])  # torch
    check_trainer_model_early(["--trainer", "megatron", "--model"])  # the parser's error, not this check's
    gpt2_dir = write_model(tmp_path / "g1", {"model_type": "gpt2"})
    check_trainer_model_early(["--trainer", "megatron", "--model", str(gpt2_dir), "--debug-rollout-only"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    check_trainer_model_early(["--config", str(bad), "--trainer", "megatron"])
    gpt2 = write_model(tmp_path / "g2", {"model_type": "gpt2"})
    (tmp_path / "r.yaml").write_text(f"model: {gpt2}\n")
    with pytest.raises(ArgumentError, match=r"^--model .*g2: model_type 'gpt2' is not supported by --trainer meg"):
        check_trainer_model_early(["--config", str(tmp_path / "r.yaml"), "--trainer", "megatron"])


def test_vime_run_checks_again_once_the_model_is_resolved(tmp_path, monkeypatch):
    """Called as a library (or with a known model name the early check could not resolve),
    :func:`vime_core.run.loop.run` refuses the model after resolving it, before the output directory is written."""
    from vime_core.cli.arguments import build_run_config, parse_run_args
    from vime_core.run.loop import run

    model = write_model(tmp_path / "m", REFUSED["moe layout on a dense family"][0])
    out = tmp_path / "out"
    argv = ["--trainer", "megatron", "--model", str(model), "--output-dir", str(out)]
    argv += ["--prompt-data", str(ROOT / "examples/quickstart/data/train.jsonl")]
    args = parse_run_args(argv)
    with pytest.raises(ArgumentError) as e:
        run(build_run_config(args), vars(args))
    assert str(e.value) == f"--model {model}: {REFUSED['moe layout on a dense family'][1]}"
    assert not out.exists() or not any(out.iterdir())


def test_vime_models_prints_the_registry(capsys):
    from vime_core.cli.commands import main

    assert main(["models", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == families_table()
    assert main(["models"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert (
        lines[0] == "--trainer torch: transformers' AutoModelForCausalLM: any Hugging Face causal LM (CPU or one GPU)"
    )
    qwen3 = next(line for line in lines if line.strip().startswith("Qwen3 "))
    assert qwen3.split()[:6] == ["Qwen3", "qwen3", "yes", "-", "-", "yes"]
