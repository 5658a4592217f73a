"""On-policy distillation: a per-token advantage from a teacher's log-probs of the student's own samples.

:func:`distill_advantages` gives ``A_t = λ · (logπ_T(y_t | x, y_<t) - logπ_s(y_t | x, y_<t))``, the negative
per-token reverse KL on the sampled token, so a policy-gradient step lowers the reverse KL to the teacher on the
student's own distribution. Formula and sources (GKD, Thinking Machines, slime's ``--use-opd``): docs/algorithms.md,
"On-policy distillation".
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vime_core.types import Sample


def distill_advantages(
    teacher_log_probs: Sequence[float],
    student_log_probs: Sequence[float],
    mask: Sequence[int],
    coef: float = 1.0,
) -> list[float]:
    """Per-token reverse-KL advantage ``coef · (teacher_t - student_t)`` of one response.

    :param teacher_log_probs: ``[T]`` teacher log-probs (nats, ≤ 0) of the response tokens given their prefixes.
    :param student_log_probs: ``[T]`` the student's log-probs of the same tokens at sampling time (the engine's
        ``rollout_log_probs``).
    :param mask: ``[T]`` 0/1 loss mask; masked tokens (tool output, context) get ``0.0`` and may hold any value.
    :param coef: ``λ``, the weight of the term.
    :return: ``[T]`` advantages (floats).
    :raises ValueError: on a length mismatch or a non-finite log-prob on a trained token.
    """
    n = len(mask)
    if len(teacher_log_probs) != n or len(student_log_probs) != n:
        raise ValueError(
            f"distillation: {len(teacher_log_probs)} teacher log-probs, {len(student_log_probs)} student log-probs, "
            f"{n} mask entries"
        )
    out = [0.0] * n
    for t in range(n):
        if not mask[t]:
            continue
        teacher, student = float(teacher_log_probs[t]), float(student_log_probs[t])
        if not (math.isfinite(teacher) and math.isfinite(student)):
            raise ValueError(f"distillation: non-finite log-prob at token {t} (teacher {teacher}, student {student})")
        out[t] = coef * (teacher - student)
    return out


def teacher_and_student_log_probs(sample: Sample) -> tuple[list[float], list[float]]:
    """``(teacher_log_probs, rollout_log_probs)`` of a sample (both ``[response_length]``).

    :raises ValueError: if the sample has no teacher log-probs (the teacher engine group did not score it).
    """
    if sample.teacher_log_probs is None:
        raise ValueError(
            f"sample {sample.group_index}/{sample.index} has no teacher_log_probs: on-policy distillation needs the "
            "rollout manager's teacher engines (--distill-teacher) to score every response"
        )
    return sample.teacher_log_probs, sample.rollout_log_probs
