"""Core data types: :class:`Sample` (one trajectory) and :class:`RolloutBatch` (what a trainer consumes).

The rules about masks and statuses live here and nowhere else:

* ``tokens`` = prompt ids + response ids; ``response_length`` = number of response ids.
* ``loss_mask``, ``rollout_log_probs`` and ``weight_versions`` each have exactly ``response_length`` entries,
  one per response token. ``loss_mask[i] == 1`` means response token ``i`` was sampled by the engine and is
  trained; ``0`` means it is context (tool output, environment text, a masked off-policy prefix).
* A sample is **trained** iff its status is ``completed`` or ``truncated``, ``remove_sample`` is False and at
  least one response token has ``loss_mask == 1``. ``pending``/``aborted``/``failed`` samples never reach the
  loss (an infrastructure failure is not a zero reward). See :meth:`Sample.is_trainable`.
* ``routed_experts`` (MoE models with ``--use-rollout-routing-replay``): int16 ``[len(tokens) - 1, layers, top_k]``,
  the experts the engine routed each token to in each layer, prompt and response alike (the last token is sampled
  but never forwarded, so it has none); docs/routing_replay.md.
"""

from __future__ import annotations

import base64
import enum
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np


class Status(str, enum.Enum):
    """Lifecycle of a :class:`Sample` (slime's ``Sample.Status``)."""

    PENDING = "pending"
    COMPLETED = "completed"  # the engine stopped on EOS / a stop string
    TRUNCATED = "truncated"  # hit the token budget; still trained (flagged), unless --overlong-filter masks it
    ABORTED = "aborted"  # generation cancelled (weight update, over-sampling); may be resumed later
    FAILED = "failed"  # infrastructure failure (engine, sandbox, reward service); excluded from the loss


TRAINABLE_STATUSES = frozenset({Status.COMPLETED, Status.TRUNCATED})


@dataclass
class Sample:
    """One trajectory: a prompt, the engine's response tokens and everything needed to train on them.

    Lengths: ``len(tokens) == prompt_length + response_length``; ``loss_mask``, ``rollout_log_probs`` and
    ``weight_versions`` have ``response_length`` entries. Use :meth:`append_response_tokens` to grow a response
    so the invariants hold; :meth:`validate` checks them.
    """

    group_index: int = 0  # which prompt group this sample belongs to
    index: int = 0  # position inside the group, 0 .. n_samples_per_prompt - 1
    prompt: str | list[dict[str, Any]] = ""
    tokens: list[int] = field(default_factory=list)
    response: str = ""
    response_length: int = 0
    loss_mask: list[int] = field(default_factory=list)
    rollout_log_probs: list[float] = field(default_factory=list)
    weight_versions: list[int] = field(default_factory=list)
    reward: float | dict[str, float] | None = None
    label: Any = None
    status: Status = Status.PENDING
    metadata: dict[str, Any] = field(default_factory=dict)
    # one episode (one call of the generate function) that fanned out into several samples (agent trajectory
    # segments, multi-agent roles) gives them all this id; the loss counts the episode once. Not slime's
    # ``rollout_id``, which is the step index (``{rollout_id}`` in --save-debug-rollout-data paths).
    episode_id: str | None = None
    remove_sample: bool = False
    # on-policy distillation (--distill-teacher): the teacher's log-prob of each response token given its prefix
    teacher_log_probs: list[float] | None = None
    # the --prompt-data row (0-based, in file order) the prompt came from; None for samples not from the data buffer
    prompt_index: int | None = None
    # rollout routing replay: int16 [len(tokens) - 1, layers, top_k], the engine's experts of every forwarded token
    routed_experts: np.ndarray | None = None
    # vision-language models: the images of the sample, RGB PNG ``data:`` URIs in the order their placeholder token
    # runs appear in ``tokens`` (the prompt's, then those of tool results and later turns); [] for text
    images: list[str] = field(default_factory=list)

    @property
    def prompt_length(self) -> int:
        """Number of prompt tokens (``len(tokens) - response_length``)."""
        return len(self.tokens) - self.response_length

    def append_response_tokens(
        self,
        tokens: list[int],
        *,
        trainable: bool,
        log_probs: list[float] | None = None,
        weight_version: int | list[int] = -1,
        text: str = "",
    ) -> None:
        """Append response tokens with their mask, log-probs and weight versions.

        :param tokens: token ids to append.
        :param trainable: True for tokens the engine sampled (mask 1; ``log_probs`` required), False for context
            such as tool output (mask 0; log-probs recorded as 0.0).
        :param log_probs: one engine log-prob per token (required when ``trainable``).
        :param weight_version: the policy version that produced the tokens (one int, or one per token).
        :param text: decoded text appended to ``response``.
        :raises ValueError: on a length mismatch or a trainable span without log-probs.
        """
        n = len(tokens)
        if trainable and (log_probs is None or len(log_probs) != n):
            raise ValueError(f"trainable tokens need one log-prob each: got {n} tokens, log_probs={log_probs!r:.80}")
        if log_probs is not None and len(log_probs) != n:
            raise ValueError(f"{n} tokens but {len(log_probs)} log-probs")
        versions = [weight_version] * n if isinstance(weight_version, int) else list(weight_version)
        if len(versions) != n:
            raise ValueError(f"{n} tokens but {len(versions)} weight versions")
        self.tokens.extend(tokens)
        self.response_length += n
        self.loss_mask.extend([1 if trainable else 0] * n)
        self.rollout_log_probs.extend(log_probs if log_probs is not None else [0.0] * n)
        self.weight_versions.extend(versions)
        self.response += text

    def validate(self) -> None:
        """Check the length invariants.

        :raises ValueError: naming the field whose length is wrong.
        """
        if self.response_length < 0 or self.response_length > len(self.tokens):
            raise ValueError(f"response_length={self.response_length} but len(tokens)={len(self.tokens)}")
        for name in ("loss_mask", "rollout_log_probs", "weight_versions"):
            got = len(getattr(self, name))
            if got != self.response_length:
                raise ValueError(f"len({name})={got} != response_length={self.response_length}")
        if self.teacher_log_probs is not None and len(self.teacher_log_probs) != self.response_length:
            raise ValueError(
                f"len(teacher_log_probs)={len(self.teacher_log_probs)} != response_length={self.response_length}"
            )
        if any(m not in (0, 1) for m in self.loss_mask):
            raise ValueError("loss_mask entries must be 0 or 1")
        if self.routed_experts is not None:
            check_routed_experts(self)

    def is_trainable(self) -> bool:
        """True iff this sample contributes to the loss (see the module docstring for the rule)."""
        return self.status in TRAINABLE_STATUSES and not self.remove_sample and any(self.loss_mask)

    def trained_weight_versions(self) -> list[int]:
        """The weight versions of the trainable (``loss_mask == 1``) response tokens, in order."""
        return [v for v, m in zip(self.weight_versions, self.loss_mask, strict=True) if m]

    def reward_value(self, key: str | None = None) -> float:
        """The scalar reward; ``key`` picks an entry of a dict reward.

        :raises ValueError: if the reward is missing, NaN, or a dict without ``key``.
        """
        r = self.reward
        if isinstance(r, dict):
            if key is None or key not in r:
                raise ValueError(f"sample {self.group_index}/{self.index}: dict reward {sorted(r)} needs --reward-key")
            r = r[key]
        if r is None or r != r:  # None or NaN
            raise ValueError(f"sample {self.group_index}/{self.index} has no reward (got {self.reward!r})")
        return float(r)

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable dict (status as its string value, ``routed_experts`` as
        :func:`encode_routed_experts`)."""
        routes, self.routed_experts = self.routed_experts, None  # asdict would deep-copy the array for nothing
        try:
            d = asdict(self)
        finally:
            self.routed_experts = routes
        d["status"] = self.status.value
        d["routed_experts"] = None if routes is None else encode_routed_experts(routes)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Sample:
        """Inverse of :meth:`to_dict`. Also reads dicts written before ``episode_id`` was named ``rollout_id``
        (debug rollout dumps, data-source checkpoints).

        :raises ValueError: if ``d`` holds both ``episode_id`` and the old ``rollout_id``.
        """
        d = dict(d)
        if "rollout_id" in d:
            if "episode_id" in d:
                raise ValueError("a sample dict holds both 'episode_id' and its old name 'rollout_id'")
            d["episode_id"] = d.pop("rollout_id")
        d["status"] = Status(d.get("status", "pending"))
        routes = d.get("routed_experts")
        if routes is not None and not isinstance(routes, np.ndarray):
            where = f"sample {d.get('group_index', 0)}/{d.get('index', 0)}"
            d["routed_experts"] = decode_routed_experts(routes, where)
        return cls(**d)


ROUTED_EXPERTS_DTYPE = np.dtype(np.int16)


def sample_name(sample: Sample) -> str:
    """``sample GROUP/INDEX``, how errors name a sample."""
    return f"sample {sample.group_index}/{sample.index}"


def check_routed_experts(sample: Sample, layers: int | None = None, top_k: int | None = None) -> np.ndarray:
    """The sample's routed experts, checked: an int16 array ``[len(tokens) - 1, layers, top_k]``.

    :param layers: the model's decoder layers (``num_hidden_layers``); ``None``: not checked.
    :param top_k: experts per token (``num_experts_per_tok``); ``None``: not checked.
    :raises ValueError: naming the sample: no routed experts, not an int16 array, or a shape other than expected.
    """
    routes = sample.routed_experts
    if routes is None:
        raise ValueError(
            f"{sample_name(sample)} has no routed_experts: --use-rollout-routing-replay needs the experts the engine "
            "routed each token to (docs/routing_replay.md)"
        )
    expected = (len(sample.tokens) - 1, layers, top_k)
    shown = tuple("?" if e is None else e for e in expected)
    if (
        not isinstance(routes, np.ndarray)
        or routes.dtype != ROUTED_EXPERTS_DTYPE
        or routes.ndim != 3
        or any(e is not None and e != n for e, n in zip(expected, routes.shape, strict=True))
    ):
        got = f"{routes.dtype} {tuple(routes.shape)}" if isinstance(routes, np.ndarray) else type(routes).__name__
        raise ValueError(
            f"{sample_name(sample)}: routed_experts is {got}, expected int16 {shown} "
            f"([len(tokens) - 1, layers, top_k] for {len(sample.tokens)} tokens)"
        )
    return routes


def encode_routed_experts(routes: np.ndarray) -> dict[str, Any]:
    """A JSON-safe form of a routed-experts array: ``{"dtype": "int16", "shape": [...], "data": base64 of the
    little-endian bytes}`` (what :meth:`Sample.to_dict` writes into checkpoints and rollout dumps)."""
    arr = np.ascontiguousarray(routes, dtype=np.dtype("<i2"))
    return {"dtype": "int16", "shape": list(arr.shape), "data": base64.b64encode(arr.tobytes()).decode("ascii")}


def decode_routed_experts(value: dict[str, Any], where: str) -> np.ndarray:
    """Inverse of :func:`encode_routed_experts` (an int16 array in native byte order).

    :param where: what the value belongs to, for the error (e.g. ``sample 3/1``).
    :raises ValueError: naming ``where`` on anything but an encoded int16 array whose data fills its shape.
    """
    try:
        if value["dtype"] != "int16":
            raise ValueError(f"dtype {value['dtype']!r}")
        shape = tuple(int(n) for n in value["shape"])
        data = np.frombuffer(base64.b64decode(value["data"], validate=True), dtype=np.dtype("<i2"))
        return data.reshape(shape).astype(ROUTED_EXPERTS_DTYPE)
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(
            f"{where}: routed_experts is not an encoded int16 array {{'dtype', 'shape', 'data'}} ({e}): {value!r:.200}"
        ) from None


@dataclass
class RolloutBatch:
    """What a trainer backend consumes for one step: trainable samples flattened, with per-sample advantages.

    ``advantages[i]`` has ``samples[i].response_length`` float entries (the per-token advantage; GRPO broadcasts
    one value per sample). Samples with the same ``episode_id`` are segments of one episode.
    """

    samples: list[Sample]
    advantages: list[list[float]]
    step: int = 0
    metrics: dict[str, float] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.samples)

    def num_response_tokens(self) -> int:
        """Total trained response tokens (``sum(loss_mask)``) in the batch."""
        return sum(sum(s.loss_mask) for s in self.samples)
