"""Per-token log-probabilities of a causal LM, the trainer side of every train/inference comparison."""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger("vime.algorithms")

# rows per chunk of the no-grad entropy (a [rows, vocab] float32 temporary: 256 × 152k vocab ≈ 150 MB)
ENTROPY_CHUNK_ROWS = 256


def token_log_probs(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Log-probability of each next token under ``logits``.

    :param logits: ``[batch, seq, vocab]`` float logits where position ``t`` predicts token ``t + 1``.
    :param token_ids: ``[batch, seq]`` int64 token ids (the same sequence the logits were computed from).
    :return: ``[batch, seq - 1]`` float32 log-probs; entry ``t`` is ``log p(token_ids[t + 1] | token_ids[: t + 1])``.

    Computed in float32 with ``log_softmax`` + ``gather`` (no temperature: vLLM's default ``raw_logprobs`` mode
    reports the unscaled distribution too).
    """
    logits = logits[:, :-1, :].float()
    targets = token_ids[:, 1:].unsqueeze(-1)
    return torch.log_softmax(logits, dim=-1).gather(-1, targets).squeeze(-1)


def token_log_probs_and_entropy(logits: torch.Tensor, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token log-probs (as :func:`token_log_probs`) and the entropy of each next-token distribution.

    :param logits: ``[batch, seq, vocab]`` float logits where position ``t`` predicts token ``t + 1`` (finite).
    :param token_ids: ``[batch, seq]`` int64 token ids.
    :return: ``(log_probs, entropy)``, both ``[batch, seq - 1]`` float32 (nats);
        ``entropy[t] = -sum_v p_v log p_v`` of the distribution that predicts token ``t + 1`` (differentiable;
        ``p·log p`` is taken as 0 where ``p`` underflows, so never NaN for finite logits).
    """
    logp_all = torch.log_softmax(logits[:, :-1, :].float(), dim=-1)
    log_probs = logp_all.gather(-1, token_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return log_probs, entropy


def sequence_log_probs(model: torch.nn.Module, token_ids: list[int], response_start: int) -> torch.Tensor:
    """Log-probs the model assigns to ``token_ids[response_start:]`` given everything before.

    :param model: a Hugging Face causal LM (``model(input_ids).logits`` of shape ``[1, seq, vocab]``).
    :param token_ids: prompt + response token ids (length ``seq``).
    :param response_start: index of the first response token, ``>= 1``.
    :return: ``[seq - response_start]`` float32 log-probs, aligned with the engine's per-token log-probs.
    :raises ValueError: if ``response_start`` is not in ``[1, seq]``.
    """
    if not 1 <= response_start <= len(token_ids):
        raise ValueError(f"response_start={response_start} must be in [1, {len(token_ids)}]")
    ids = torch.tensor([token_ids], dtype=torch.long)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    return token_log_probs(logits, ids)[0, response_start - 1 :]


def selected_log_probs_and_entropy(
    logits: torch.Tensor, targets: torch.Tensor, with_entropy: bool = False, entropy_grad: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of ``targets`` (and the entropies) under next-token logits computed only where they are needed.

    :param logits: ``[M, vocab]`` float logits, row ``j`` the distribution that predicts ``targets[j]`` (finite).
    :param targets: ``[M]`` int64 token ids.
    :param with_entropy: also return each row's entropy ``-sum_v p_v log p_v`` (nats).
    :param entropy_grad: keep the entropies' graph (needed only when the loss has an entropy term); False computes
        them under ``no_grad`` in chunks of :data:`ENTROPY_CHUNK_ROWS` rows, so no ``[M, vocab]`` temporary beyond
        the log-softmax is kept or allocated at once.
    :return: ``(log_probs [M], entropy [M] or None)``, float32; the values equal :func:`token_log_probs_and_entropy`
        on the same rows (the same ``log_softmax``; ``p·log p`` is 0 where ``p`` underflows).
    """
    logp_all = torch.log_softmax(logits.float(), dim=-1)
    log_probs = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    if not with_entropy:
        return log_probs, None
    if entropy_grad:
        return log_probs, -(logp_all.exp() * logp_all).sum(-1)
    with torch.no_grad():
        parts = [-(c.exp() * c).sum(-1) for c in torch.split(logp_all.detach(), ENTROPY_CHUNK_ROWS)]
        entropy = torch.cat(parts) if parts else logp_all.new_zeros(0)
    return log_probs, entropy


_MM_OUT_DTYPE: bool | None = None  # whether torch.mm(..., out_dtype=float32) works here (None: not tried yet)


def fp32_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` in float32 without differentiating (the engine's logits).

    :param x: ``[..., hidden]`` (bf16 or fp16; float32 is multiplied as it is).
    :param weight: ``[vocab, hidden]``, the dtype of ``x``.
    :return: ``[..., vocab]`` float32: every product exact and summed in float32 — torch's ``mm`` with
        ``out_dtype=float32`` on CUDA, else (CPU, or a torch without it) the inputs widened to float32 and multiplied
        with TF32 allowed, which is exact for bf16 inputs (a bf16 value is a TF32 value) and as fast as TF32.
    """
    global _MM_OUT_DTYPE
    flat = x.reshape(-1, x.shape[-1])
    if x.dtype == torch.float32:
        out = flat @ weight.t()
    else:
        out = None
        if x.is_cuda and _MM_OUT_DTYPE is not False:
            try:
                out = torch.mm(flat, weight.t(), out_dtype=torch.float32)
                _MM_OUT_DTYPE = True
            except (RuntimeError, TypeError, NotImplementedError) as e:
                _MM_OUT_DTYPE = False
                logger.info("torch.mm(out_dtype=float32) is not available (%s): widening to float32 instead", e)
        if out is None:
            prev = torch.backends.cuda.matmul.allow_tf32
            torch.backends.cuda.matmul.allow_tf32 = True  # exact for bf16 inputs; only this product
            try:
                out = flat.float() @ weight.float().t()
            finally:
                torch.backends.cuda.matmul.allow_tf32 = prev
    return out.reshape(*x.shape[:-1], weight.shape[0])
