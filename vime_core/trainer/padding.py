"""The left-padded batch of the ``torch`` backend's forward passes (policy and reference log-probs, critic values).

Sequences are left-padded with explicit ``position_ids``, so every sample's response ends at the last position and
the last ``max(response_length) + 1`` positions hold every response token and the one position before it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vime_core.types import Sample


@dataclass(frozen=True)
class LeftPaddedBatch:
    """Model inputs for a batch of samples, left-padded with zeros.

    :ivar input_ids: ``[batch, seq_len]`` int64 token ids (``tokens`` = prompt + response, padding 0 on the left).
    :ivar attention_mask: ``[batch, seq_len]`` int64, 1 on real tokens.
    :ivar position_ids: ``[batch, seq_len]`` int64, 0 at each sample's first real token (0 on padding too).
    :ivar keep: ``max(response_length) + 1``: how many last positions cover every response token and the position
        that predicts the first of them.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    keep: int

    @property
    def seq_len(self) -> int:
        """The padded length (the longest sample's ``len(tokens)``)."""
        return int(self.input_ids.shape[1])


def left_padded_batch(samples: list[Sample], device: torch.device | str = "cpu") -> LeftPaddedBatch:
    """Left-pad ``samples`` into one batch on ``device``.

    :param samples: at least one sample; ``tokens`` is the prompt followed by the ``response_length`` response tokens.
    :param device: where the tensors go.
    """
    max_len = max(len(s.tokens) for s in samples)
    ids = torch.zeros((len(samples), max_len), dtype=torch.long)
    attn = torch.zeros((len(samples), max_len), dtype=torch.long)
    for i, s in enumerate(samples):
        ids[i, max_len - len(s.tokens) :] = torch.tensor(s.tokens, dtype=torch.long)
        attn[i, max_len - len(s.tokens) :] = 1
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    keep = max(s.response_length for s in samples) + 1
    return LeftPaddedBatch(ids.to(device), attn.to(device), pos.to(device), keep)


def response_slices(x: torch.Tensor, samples: list[Sample]) -> list[torch.Tensor]:
    """Each sample's response part of a right-aligned ``[batch, n, ...]`` tensor: row ``i``'s last
    ``samples[i].response_length`` entries along dim 1 (views, graph kept)."""
    return [x[i, x.shape[1] - s.response_length :] for i, s in enumerate(samples)]
