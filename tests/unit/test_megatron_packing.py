"""The megatron backend's packed micro-batches (``--qkv-format thd``) and float32 LM head, on the CPU, with exact
values: the packed row's layout and index math, per-sample attention and RoPE in megatron-core's ``thd`` layout equal
to each sample computed alone (a wrong segment bound or a position that does not restart would silently train on
wrong log-probs), and the float32 logits with a bf16 ``Linear``'s backward. The whole model packed vs padded needs a
GPU: tests/gpu/test_megatron_packing_gpu.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vime_core.algorithms.logprobs import fp32_logits
from vime_core.trainer.fp32_head import FP32Logits, install_fp32_output_layer
from vime_core.trainer.megatron_packing import thd_batch, thd_sdpa
from vime_core.types import Sample

pytestmark = pytest.mark.unit


def _three() -> list[Sample]:
    return [
        Sample(tokens=[1, 2, 3, 4], response_length=2),
        Sample(tokens=[5, 6, 7], response_length=2),
        Sample(tokens=[8, 9, 10, 11, 12], response_length=2),
    ]


def test_thd_batch_exact_layout_and_the_sequence_parallel_pad_segment():
    b = thd_batch(_three())
    assert b.input_ids.tolist() == [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]]
    assert b.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3, 4]]
    assert b.cu_seq_lens.tolist() == [0, 4, 7, 12] and b.cu_seq_lens.dtype == torch.int32
    assert b.predict_index.tolist() == [1, 2, 4, 5, 9, 10] and b.targets.tolist() == [3, 4, 6, 7, 11, 12]
    assert (b.max_len, b.total) == (5, 12)
    assert thd_batch(_three(), multiple=4).cu_seq_lens.tolist() == [0, 4, 7, 12]  # 12 tokens: no pad
    p = thd_batch(_three(), multiple=5)  # 12 → 15: one more segment of 3 zeros, predicted by nothing
    assert p.input_ids.tolist() == [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 0, 0, 0]]
    assert p.position_ids.tolist()[0][12:] == [0, 1, 2]
    assert p.cu_seq_lens.tolist() == [0, 4, 7, 12, 15]
    assert p.predict_index.tolist() == b.predict_index.tolist() and p.targets.tolist() == b.targets.tolist()
    assert [t.tolist() for t in p.split(torch.arange(6.0))] == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]
    big = thd_batch([Sample(tokens=[1, 2], response_length=1)], multiple=8)  # the pad segment is the longest
    assert big.cu_seq_lens.tolist() == [0, 2, 8] and big.max_len == 6
    moved = thd_batch(_three(), device="meta")  # the row moves; its bounds stay on the CPU (read as ints per layer)
    assert moved.input_ids.device.type == moved.predict_index.device.type == "meta"
    assert moved.cu_seq_lens.device.type == "cpu"


def _core_attention():
    from megatron.core.transformer.enums import AttnMaskType

    from vime_core.trainer.megatron_model import SDPACoreAttention

    config = SimpleNamespace(attention_dropout=0.0, context_parallel_size=1)
    return SDPACoreAttention(config, 1, AttnMaskType.causal, "self").eval()


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_thd_attention_equals_each_sample_alone(kv_heads):
    """SDPACoreAttention on a packed [t, heads, dim] row (megatron-core's thd) gives, row for row, exactly what its
    bshd path gives each sample on its own: no sample attends to another, each is causal."""
    from megatron.core.packed_seq_params import PackedSeqParams

    attn = _core_attention()
    lengths, heads, dim = [5, 1, 7, 3], 4, 8
    g = torch.Generator().manual_seed(0)
    q = torch.randn(sum(lengths), heads, dim, generator=g)
    k = torch.randn(sum(lengths), kv_heads, dim, generator=g)
    v = torch.randn(sum(lengths), kv_heads, dim, generator=g)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=7, max_seqlen_kv=7)
    packed = attn(q, k, v, None, packed_seq_params=params)
    assert packed.shape == (sum(lengths), heads * dim)
    for i, n in enumerate(lengths):
        a, b = int(cu[i]), int(cu[i + 1])
        alone = attn(q[a:b].unsqueeze(1), k[a:b].unsqueeze(1), v[a:b].unsqueeze(1), None)  # [n, 1, heads * dim]
        assert torch.equal(packed[a:b], alone[:, 0]), f"sample {i} ({n} tokens)"
    assert torch.equal(thd_sdpa(q, k, v, cu), packed)
    with pytest.raises(ValueError, match="covers 16 tokens, the packed row has 17"):
        thd_sdpa(torch.cat([q, q[:1]]), torch.cat([k, k[:1]]), torch.cat([v, v[:1]]), cu)


def test_megatron_rope_in_thd_restarts_positions_per_sample():
    """megatron-core's RoPE for the packed row (cu_seqlens, what its attention does with ``--qkv-format thd``) equals
    its RoPE of each sample alone, positions from 0: the frequencies cover the longest sample only."""
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb

    config = SimpleNamespace(
        apply_rope_fusion=False, rotary_interleaved=False, multi_latent_attention=False, mrope_section=None
    )
    cp = SimpleNamespace(size=lambda: 1, rank=lambda: 0)
    lengths, heads, dim = [6, 2, 9], 3, 16
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))

    def freqs(n: int) -> torch.Tensor:  # [n, 1, 1, dim], megatron-core's layout
        f = torch.outer(torch.arange(n, dtype=torch.float32), inv)
        return torch.cat([f, f], dim=-1)[:, None, None, :]

    t = torch.randn(sum(lengths), heads, dim, generator=torch.Generator().manual_seed(1))
    cu = torch.tensor([0, 6, 8, 17], dtype=torch.int32)
    packed = apply_rotary_pos_emb(t, freqs(max(lengths)), config, cu_seqlens=cu, cp_group=cp)
    for i, n in enumerate(lengths):
        a = int(cu[i])
        alone = apply_rotary_pos_emb(t[a : a + n].unsqueeze(1), freqs(n), config, cp_group=cp)[:, 0]
        assert torch.equal(packed[a : a + n], alone), f"sample {i}"
    continuing = apply_rotary_pos_emb(t.unsqueeze(1), freqs(17), config, cp_group=cp)[:, 0]  # positions 0 … 16
    assert torch.equal(continuing[:6], packed[:6]) and not torch.equal(continuing[6:8], packed[6:8])


def test_fp32_logits_are_exact_sums_and_backward_is_a_bf16_linears():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 5, 64, generator=g).to(torch.bfloat16).requires_grad_()
    w = torch.randn(100, 64, generator=g).to(torch.bfloat16).requires_grad_()
    out = FP32Logits.apply(x, w)
    assert out.dtype == torch.float32 and out.shape == (3, 5, 100)
    exact = (x.double() @ w.double().t()).float()  # bf16 products are exact; float64 sums round once
    assert (out - exact).abs().max().item() < 1e-5
    bf16 = torch.nn.functional.linear(x, w).float()  # what the head returned before: each logit rounded to bf16
    assert (bf16 - exact).abs().max().item() > 1e-3
    grad = torch.randn(3, 5, 100, generator=g)
    gx, gw = torch.autograd.grad(out, (x, w), grad)
    rx, rw = torch.autograd.grad(bf16, (x, w), grad)
    assert gx.dtype == gw.dtype == torch.bfloat16
    assert torch.equal(gx, rx) and torch.equal(gw, rw)
    assert torch.equal(fp32_logits(x.detach(), w.detach()), out.detach())


def test_the_installed_output_layer_returns_float32_logits_of_the_passed_weight():
    """A GPTModel's output layer after :func:`install_fp32_output_layer` (one TP rank): ``(logits, None)`` of the
    weight passed at call time (tied embeddings) or its own."""
    g = torch.Generator().manual_seed(4)
    own = torch.randn(50, 16, generator=g).to(torch.bfloat16)
    layer = SimpleNamespace(weight=own, gather_output=False, sequence_parallel=False)
    gpt = SimpleNamespace(output_layer=layer)
    install_fp32_output_layer(gpt)
    h = torch.randn(7, 2, 16, generator=g).to(torch.bfloat16)  # [s, b, hidden], megatron's layout
    logits, bias = layer.forward(h)
    assert bias is None and logits.dtype == torch.float32 and torch.equal(logits, fp32_logits(h, own))
    tied = torch.randn(50, 16, generator=g).to(torch.bfloat16)
    assert torch.equal(layer.forward(h, weight=tied)[0], fp32_logits(h, tied))
