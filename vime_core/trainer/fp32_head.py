"""The trainer's LM head with float32 logits (``--fp32-lm-head``, both trainers): bf16 hidden states times the bf16
output weight, summed and returned in float32, never rounded to bf16.

A bf16 ``Linear`` rounds each logit to bf16: up to 1/32 nat at magnitudes 8–16, 1/16 at 16–32, and the engine rounds
its own logits from slightly different sums, so the two roundings alone put a mean |Δlogp| of that order between a
bf16 vLLM engine and a bf16 trainer (docs/gpu.md, "|Δlogp|"). :func:`install_fp32_output_layer` (a megatron-core
``GPTModel``) and :func:`install_fp32_lm_head` (a Hugging Face model, the torch trainer) compute the logits with
:func:`~vime_core.algorithms.logprobs.fp32_logits`, the product the engine uses with ``--fp32-lm-head``
(``VimeWorkerExtension.vime_fp32_lm_head``); its backward is a bf16 ``Linear``'s (the gradient rounded to bf16, then
bf16 products), so training costs what it did.
"""

from __future__ import annotations

from typing import Any

import torch

from vime_core.algorithms.logprobs import fp32_logits


class FP32Logits(torch.autograd.Function):
    """:func:`fp32_logits` with the backward of a ``Linear`` in the inputs' dtype: the float32 gradient of the logits
    is rounded to that dtype (as the bf16 head's ``.float()`` did in its backward), then ``grad @ weight`` and
    ``grad.T @ x`` in that dtype."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        return fp32_logits(x, weight)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        x, weight = ctx.saved_tensors
        g = grad.to(x.dtype).reshape(-1, weight.shape[0])
        gx = (g @ weight).reshape(x.shape) if ctx.needs_input_grad[0] else None
        gw = (g.t() @ x.reshape(-1, x.shape[-1])) if ctx.needs_input_grad[1] else None
        return gx, gw


def install_fp32_output_layer(gpt: Any, tp: int = 1, tp_group: Any = None) -> None:
    """Make a megatron-core ``GPTModel``'s output layer (a ``ColumnParallelLinear``) return float32 logits
    (:class:`FP32Logits`), keeping its tensor- and sequence-parallel communication: the input is all-gathered from
    the sequence-parallel region (reduce-scattered in backward) or copied to the tensor-parallel region (all-reduced
    in backward), and the output stays split over the vocabulary unless the layer gathers it.

    :param gpt: the model (its ``output_layer`` is replaced in place; tied embeddings pass the weight at call time).
    :param tp: the tensor-parallel size.
    :param tp_group: the tensor-parallel group (``None``: Megatron's default).
    """
    layer = gpt.output_layer

    def forward(input_: torch.Tensor, weight: torch.Tensor | None = None, runtime_gather_output: Any = None):
        from megatron.core.tensor_parallel import mappings

        w = layer.weight if weight is None else weight
        if getattr(layer, "sequence_parallel", False) and tp > 1:
            x = mappings.gather_from_sequence_parallel_region(input_, tensor_parallel_output_grad=True, group=tp_group)
        elif tp > 1:
            x = mappings.copy_to_tensor_model_parallel_region(input_, group=tp_group)
        else:
            x = input_
        out = FP32Logits.apply(x, w)
        gather = runtime_gather_output if runtime_gather_output is not None else layer.gather_output
        if gather and tp > 1:
            out = mappings.gather_from_tensor_model_parallel_region(out, group=tp_group)
        return out, None

    layer.forward = forward
    layer.vime_fp32_logits = True


def install_fp32_lm_head(model: torch.nn.Module) -> bool:
    """Make a Hugging Face model's LM head (``get_output_embeddings()``) return float32 logits (:class:`FP32Logits`)
    when it is a bias-free ``Linear`` with bf16 or fp16 weights; a tied head keeps sharing the embedding's weight.

    :return: whether the head was switched: False for float32 weights (their logits are float32 already), a head
        with a bias, or one that is not a plain ``Linear``.
    """
    head = model.get_output_embeddings()
    if type(head) is not torch.nn.Linear or head.bias is not None:
        return False
    if head.weight.dtype not in (torch.bfloat16, torch.float16):
        return False

    def forward(x: torch.Tensor) -> torch.Tensor:
        return FP32Logits.apply(x, head.weight)

    head.forward = forward
    head.vime_fp32_logits = True
    return True
