"""Token-correct training samples from the turns of one agent episode.

:class:`Trajectory` places each recorded :class:`TurnRecord` (prompt ids, sampled ids, log-probs, weight versions)
into segments (CLEAN, REALIGN, FORK), each one :class:`~vime_core.types.Sample` whose every trained token the engine
sampled in exactly that context; :meth:`Trajectory.plan` builds the next prompt tokenising only new text. The rules
and their reasons: docs/agents.md, "The trajectory manager".
"""

from __future__ import annotations

import bisect
import copy
import enum
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vime_core.types import Sample, Status

FINISH_REASONS = ("stop", "length", "abort")
DEFAULT_MAX_REALIGN_TOKENS = 16
_CHUNK = 256


@dataclass
class TurnRecord:
    """One engine call of an episode: what the engine was given and what it sampled.

    :ivar prompt_ids: the prompt token ids exactly as sent to the engine.
    :ivar output_ids: the sampled token ids (including the end-of-turn token when the engine emitted it).
    :ivar output_log_probs: the engine's log-prob of each sampled token (``len(output_ids)`` floats, ≤ 0).
    :ivar weight_versions: the weight version that produced each sampled token (``len(output_ids)`` ints).
    :ivar finish_reason: ``"stop"`` (the model ended its turn: EOS or stop string), ``"length"`` (``max_tokens`` or
        the context limit) or ``"abort"``.
    :ivar ill_formed: the output could not be parsed into a valid API response (e.g. a broken tool call).
    :ivar prompt_text: the text ``prompt_ids`` encode (the rendered conversation); optional, enables
        :meth:`Trajectory.plan`'s incremental tokenisation.
    :ivar output_text: ``output_ids`` decoded *with* special tokens; optional, likewise.
    :ivar metadata: free-form; the gateway records ``api``, ``tools`` (the tool names the request declared),
        ``tool_calls`` (how many the output made), ``stop``, ``constrained``, ``tool_value_errors`` and
        ``tool_parse_failures`` (reason → count).
    :ivar images: a vision-language prompt's images (``data:`` URIs), one per placeholder run of ``prompt_ids``, in
        order, as the engine got them.
    """

    prompt_ids: list[int]
    output_ids: list[int]
    output_log_probs: list[float]
    weight_versions: list[int]
    finish_reason: str
    ill_formed: bool = False
    prompt_text: str | None = None
    output_text: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    images: list[str] = field(default_factory=list)

    @property
    def trainable(self) -> bool:
        """Whether this turn's output is trained: the engine stopped on its own and the output parsed."""
        return self.finish_reason == "stop" and not self.ill_formed

    def validate(self) -> None:
        """Check lengths and the finish reason.

        :raises ValueError: on an empty prompt, a length mismatch or an unknown finish reason.
        """
        n = len(self.output_ids)
        if not self.prompt_ids:
            raise ValueError("TurnRecord.prompt_ids is empty")
        if len(self.output_log_probs) != n or len(self.weight_versions) != n:
            raise ValueError(
                f"TurnRecord: {n} output ids, {len(self.output_log_probs)} log-probs, "
                f"{len(self.weight_versions)} weight versions"
            )
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"TurnRecord.finish_reason must be one of {FINISH_REASONS}, not {self.finish_reason!r}")


class Drift(str, enum.Enum):
    """How a turn was placed (see the module docstring); ``NEW`` is the first turn of an episode."""

    NEW = "new"
    CLEAN = "clean"
    REALIGN = "realign"
    FORK = "fork"


@dataclass
class Placement:
    """Where :meth:`Trajectory.record` put a turn.

    :ivar kind: NEW (first turn), CLEAN, REALIGN or FORK.
    :ivar segment: index of the segment that received the turn.
    :ivar common_prefix: tokens the prompt shared with the closest held segment before placement (``L``).
    :ivar dropped_trainable: trained tokens removed by a realign (0 otherwise).
    :ivar context_tokens: prompt tokens appended as context (mask 0).
    """

    kind: Drift
    segment: int
    common_prefix: int
    dropped_trainable: int
    context_tokens: int


@dataclass
class PromptPlan:
    """A prompt built by :meth:`Trajectory.plan`: ``prompt_ids[:shared_len] == segment's tokens[:shared_len]``.

    :ivar prompt_ids: the token ids to send to the engine.
    :ivar prompt_text: the text they encode.
    :ivar segment: the segment whose held tokens were reused (``None``: none, the whole text was tokenised).
    :ivar shared_len: number of leading ids taken from that segment.
    :ivar epoch: the segment's truncation counter at planning time (a plan outlives a realign only as a hint).
    :ivar tokenized_chars: characters tokenised to build the prompt.
    :ivar images: the prompt's images (a vision-language model; set by the gateway), in placeholder order.
    """

    prompt_ids: list[int]
    prompt_text: str
    segment: int | None
    shared_len: int
    epoch: int
    tokenized_chars: int
    images: list[str] = field(default_factory=list)


def common_prefix_len(a: list[int], b: list[int], start: int = 0) -> int:
    """Length of the common prefix of ``a`` and ``b``, given that they agree on ``[:start]``.

    Compares in C-level slices (one comparison when they agree to the end), then scans at most one chunk of
    ``_CHUNK`` ids in Python. O(n - start).
    """
    n = min(len(a), len(b))
    if start >= n:
        return n
    if a[start:n] == b[start:n]:
        return n
    pos = start
    while pos < n:
        end = min(pos + _CHUNK, n)
        if a[pos:end] != b[pos:end]:
            while a[pos] == b[pos]:
                pos += 1
            return pos
        pos = end
    return n  # pragma: no cover - unreachable: the slices differed


def _common_prefix_str(a: str, b: str) -> int:
    """Length of the common prefix of two strings (binary search over C-level prefix comparisons, O(n log n))."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


@dataclass
class _Checkpoint:
    tok: int  # tokens[:tok] encode text[:txt]
    txt: int
    output: bool  # the span ending here is an engine output


class _Segment:
    """One growing token sequence (becomes one Sample)."""

    def __init__(self, prompt_ids: list[int], prompt_text: str | None) -> None:
        self.tokens: list[int] = list(prompt_ids)
        self.prompt_length = len(prompt_ids)
        self.loss_mask: list[int] = []  # per response token
        self.log_probs: list[float] = []
        self.versions: list[int] = []
        self.text: str | None = prompt_text
        self.prompt_text_len = len(prompt_text) if prompt_text is not None else 0
        self.checkpoints: list[_Checkpoint] = [_Checkpoint(0, 0, False)]
        if prompt_text is not None:
            self.checkpoints.append(_Checkpoint(len(prompt_ids), len(prompt_text), False))
        self.epoch = 0
        self.turns: list[int] = []
        self.truncated_turns: list[int] = []
        self.ill_formed_turns: list[int] = []
        self.aborted_turns: list[int] = []
        self.drift = {k.value: 0 for k in Drift}
        self.realign_dropped = 0
        self.last_finish = "stop"
        self.images: list[str] = []  # the last turn's: its prompt + output are the segment's tokens

    def trained_after(self, pos: int) -> int:
        return sum(self.loss_mask[pos - self.prompt_length :])

    def truncate(self, pos: int) -> int:
        """Cut back to ``tokens[:pos]`` (``pos >= prompt_length``); return the trained tokens removed."""
        r = pos - self.prompt_length
        dropped = sum(self.loss_mask[r:])
        del self.tokens[pos:], self.loss_mask[r:], self.log_probs[r:], self.versions[r:]
        self.epoch += 1
        return dropped

    def append(self, ids: list[int], mask: int, log_probs: list[float] | None, versions: list[int]) -> None:
        self.tokens.extend(ids)
        self.loss_mask.extend([mask] * len(ids))
        self.log_probs.extend(log_probs if log_probs is not None else [0.0] * len(ids))
        self.versions.extend(versions)

    # -- text anchoring ------------------------------------------------------------------------------------------
    def anchor(self, text: str, decode: Callable[[list[int]], str] | None) -> tuple[int, int]:
        """The longest ``(tok, txt)`` with ``tokens[:tok]`` encoding ``text[:txt]`` (checkpoints, refined into the
        output the text diverges in when ``decode`` is given)."""
        assert self.text is not None
        if text.startswith(self.text):
            return len(self.tokens), len(self.text)
        c = _common_prefix_str(text, self.text)
        i = bisect.bisect_right(self.checkpoints, c, key=lambda cp: cp.txt) - 1  # last checkpoint with txt <= c
        best = self.checkpoints[i]
        nxt = self.checkpoints[i + 1] if i + 1 < len(self.checkpoints) else None
        if decode is None or nxt is None or not nxt.output or c <= best.txt:
            return best.tok, best.txt
        out = self.tokens[best.tok : nxt.tok]
        rest = text[best.txt : c]  # the part of the output the new text still agrees with

        def fits(j: int) -> str | None:
            d = decode(out[:j])
            return d if rest.startswith(d) else None

        lo, hi = 0, len(out)  # fits(lo) holds; find the largest j that fits (binary search, verified)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if fits(mid) is not None:
                lo = mid
            else:
                hi = mid
        d = fits(lo) or ""
        return best.tok + lo, best.txt + len(d)

    def reset_text(
        self, keep_upto_tok: int, prompt_ids: list[int], prompt_text: str | None, n_out: int, output_text: str | None
    ) -> None:
        """After a turn: the segment is ``prompt_ids + output``; its text is ``prompt_text + output_text``.
        Checkpoints at or below ``keep_upto_tok`` whose text the new prompt text still starts with are kept."""
        if prompt_text is None or output_text is None:
            self.text, self.checkpoints = None, [_Checkpoint(0, 0, False)]
            return
        kept = [self.checkpoints[0]]
        if self.text is not None:
            c = len(self.text) if prompt_text.startswith(self.text) else _common_prefix_str(prompt_text, self.text)
            n = min(
                bisect.bisect_right(self.checkpoints, c, key=lambda cp: cp.txt),
                bisect.bisect_right(self.checkpoints, keep_upto_tok, key=lambda cp: cp.tok),
            )
            kept = self.checkpoints[: max(n, 1)]
        p, pt = len(prompt_ids), len(prompt_text)
        if kept[-1].tok != p:
            kept.append(_Checkpoint(p, pt, False))
        kept.append(_Checkpoint(p + n_out, pt + len(output_text), True))
        self.checkpoints = kept
        self.text = prompt_text + output_text


class Trajectory:
    """The turns of one episode (one agent session), placed into segments; see the module docstring.

    Not thread-safe: callers serialise :meth:`plan`/:meth:`record`/:meth:`to_samples` (the gateway holds a lock).

    :param max_realign_tokens: the most trained tokens a REALIGN may drop; above that the turn forks. With 0 no
        sampled token is ever lost (only drift in untrained context realigns); must be ≥ 0.
    :raises ValueError: if ``max_realign_tokens`` is negative.
    """

    def __init__(self, *, max_realign_tokens: int = DEFAULT_MAX_REALIGN_TOKENS) -> None:
        if max_realign_tokens < 0:
            raise ValueError(f"max_realign_tokens must be >= 0, got {max_realign_tokens}")
        self.max_realign_tokens = max_realign_tokens
        self.segments: list[_Segment] = []
        self.num_turns = 0
        self.placements: list[Placement] = []
        self.tokenized_chars = 0  # characters tokenised by plan() over the episode

    # -- building prompts ----------------------------------------------------------------------------------------
    def plan(
        self, text: str, encode: Callable[[str], list[int]], decode: Callable[[list[int]], str] | None = None
    ) -> PromptPlan:
        """The prompt ids for a newly rendered conversation ``text``, reusing held token ids where possible.

        :param text: the full rendered prompt (chat template applied, generation prompt included).
        :param encode: text → ids without adding special tokens (special-token *text* must map to their ids, as
            ``tokenizer(text, add_special_tokens=False)`` does).
        :param decode: ids → text with special tokens kept; enables splitting inside the output where the text
            diverges (keeps the model's tokens up to the divergence).
        :return: a :class:`PromptPlan`; pass it to :meth:`record` with the turn.
        """
        best_tok, best_txt, best_seg = 0, 0, None
        for i in range(len(self.segments) - 1, -1, -1):
            seg = self.segments[i]
            if seg.text is None:
                continue
            tok, txt = seg.anchor(text, decode)
            if tok > best_tok:
                best_tok, best_txt, best_seg = tok, txt, i
        suffix = text[best_txt:]
        suffix_ids = list(encode(suffix)) if suffix else []
        self.tokenized_chars += len(suffix)
        if best_seg is not None and decode is not None and suffix and decode(suffix_ids) != suffix:
            # the tokenizer does not encode this text on its own the way it reads (e.g. SentencePiece's leading
            # space): splicing would change the text, so tokenise the whole prompt instead
            best_tok, best_txt, best_seg = 0, 0, None
            suffix, suffix_ids = text, list(encode(text))
            self.tokenized_chars += len(text)
        head = self.segments[best_seg].tokens[:best_tok] if best_seg is not None else []
        ids = head + suffix_ids
        epoch = self.segments[best_seg].epoch if best_seg is not None else 0
        return PromptPlan(ids, text, best_seg, best_tok, epoch, len(suffix))

    # -- recording turns -----------------------------------------------------------------------------------------
    def _candidate(self, prompt: list[int], plan: PromptPlan | None) -> tuple[int, int] | None:
        """(segment, common prefix) for ``prompt``: a fully extended segment (the longest) if any, else the one
        sharing the longest prefix."""
        if plan is not None and plan.segment is not None and plan.segment < len(self.segments):
            seg = self.segments[plan.segment]
            if seg.epoch == plan.epoch and plan.shared_len <= len(seg.tokens) and plan.prompt_ids is prompt:
                return plan.segment, common_prefix_len(seg.tokens, prompt, plan.shared_len)
        best: tuple[int, int] | None = None
        best_clean: tuple[int, int] | None = None
        for i in range(len(self.segments) - 1, -1, -1):
            seg = self.segments[i]
            n = common_prefix_len(seg.tokens, prompt)
            if n == len(seg.tokens) and (best_clean is None or n > best_clean[1]):
                best_clean = (i, n)
            if best is None or n > best[1]:
                best = (i, n)
        return best_clean or best

    def record(self, turn: TurnRecord, plan: PromptPlan | None = None) -> Placement:
        """Place one turn (CLEAN, REALIGN or FORK; see the module docstring) and append its output.

        :param turn: the turn; ``turn.prompt_ids`` must be the ids the engine was given.
        :param plan: the :class:`PromptPlan` the prompt came from, if any (then only tokens past its shared prefix
            are compared; a stale plan is ignored).
        :raises ValueError: if the turn is inconsistent (:meth:`TurnRecord.validate`).
        """
        turn.validate()
        idx = self.num_turns
        prompt = turn.prompt_ids
        cand = self._candidate(prompt, plan)
        kind, dropped = Drift.FORK, 0
        if cand is not None:
            si, L = cand
            seg = self.segments[si]
            if L == len(seg.tokens):
                kind = Drift.CLEAN
            elif L >= seg.prompt_length and seg.trained_after(L) <= self.max_realign_tokens:
                kind = Drift.REALIGN
        else:
            L = 0
        outs = turn.weight_versions
        ctx_version = min(outs) if outs else None
        if kind is Drift.FORK and not self.segments:
            kind = Drift.NEW
        if kind in (Drift.FORK, Drift.NEW):
            seg = _Segment(prompt, turn.prompt_text)
            self.segments.append(seg)
            si, context = len(self.segments) - 1, 0
            keep_upto = len(prompt)
        else:
            if kind is Drift.REALIGN:
                dropped = seg.truncate(L)
                seg.realign_dropped += dropped
            tail = prompt[len(seg.tokens) :]
            context = len(tail)
            if ctx_version is None:
                ctx_version = seg.versions[-1] if seg.versions else 0
            seg.append(tail, 0, None, [ctx_version] * context)
            keep_upto = L
        seg.drift[kind.value] += 1
        mask = 1 if turn.trainable else 0
        seg.append(turn.output_ids, mask, turn.output_log_probs, list(turn.weight_versions))
        seg.reset_text(keep_upto, prompt, turn.prompt_text, len(turn.output_ids), turn.output_text)
        seg.turns.append(idx)
        seg.images = list(turn.images)
        if turn.finish_reason == "length":
            seg.truncated_turns.append(idx)
        elif turn.finish_reason == "abort":
            seg.aborted_turns.append(idx)
        if turn.ill_formed:
            seg.ill_formed_turns.append(idx)
        seg.last_finish = turn.finish_reason
        self.num_turns += 1
        placement = Placement(kind, si, cand[1] if cand else 0, dropped, context)
        self.placements.append(placement)
        return placement

    # -- samples -------------------------------------------------------------------------------------------------
    def to_samples(
        self,
        base_sample: Sample,
        reward: float | dict[str, float] | None = None,
        *,
        extra_metadata: dict[str, Any] | None = None,
        episode_id: str | None = None,
    ) -> list[Sample]:
        """One Sample per segment, in creation order (``[]`` if no turn was recorded).

        Each copies ``group_index``, ``index``, ``prompt``, ``label`` and ``metadata`` from ``base_sample``; gets the
        episode ``reward`` (the same on every segment: the loss counts the episode once through the shared
        ``episode_id``) and ``metadata["trajectory"]`` (segment index, turns, drift counts, flagged turns, realign
        losses). ``tokens`` = the segment's first prompt + response; ``loss_mask``/``rollout_log_probs``/
        ``weight_versions`` cover the response; ``images`` = the segment's last turn's (its prompt + output are the
        segment's tokens). Status: ``truncated`` if the segment's last turn hit the length limit, else
        ``completed``; ``remove_sample`` when no token is trained.

        :param episode_id: shared id; default ``base_sample.episode_id`` or a fresh uuid.
        """
        rid = episode_id or base_sample.episode_id or uuid.uuid4().hex
        out: list[Sample] = []
        for i, seg in enumerate(self.segments):
            meta = copy.deepcopy(base_sample.metadata)
            meta.update(copy.deepcopy(extra_metadata or {}))
            meta["trajectory"] = {
                "segment": i,
                "num_segments": len(self.segments),
                "turns": list(seg.turns),
                "num_turns": self.num_turns,
                "drift": dict(seg.drift),
                "realign_dropped_tokens": seg.realign_dropped,
                "truncated_turns": list(seg.truncated_turns),
                "ill_formed_turns": list(seg.ill_formed_turns),
                "aborted_turns": list(seg.aborted_turns),
            }
            s = Sample(
                group_index=base_sample.group_index,
                index=base_sample.index,
                prompt=copy.deepcopy(base_sample.prompt),
                tokens=list(seg.tokens),
                response=seg.text[seg.prompt_text_len :] if seg.text is not None else "",
                response_length=len(seg.tokens) - seg.prompt_length,
                loss_mask=list(seg.loss_mask),
                rollout_log_probs=list(seg.log_probs),
                weight_versions=list(seg.versions),
                reward=copy.deepcopy(reward),
                label=copy.deepcopy(base_sample.label),
                status=Status.TRUNCATED if seg.last_finish == "length" else Status.COMPLETED,
                metadata=meta,
                episode_id=rid,
                prompt_index=base_sample.prompt_index,
                images=list(seg.images),
            )
            if not any(seg.loss_mask):
                s.remove_sample = True
                meta["excluded"] = "no trained token (every turn truncated, aborted, ill-formed or realigned away)"
            s.validate()
            out.append(s)
        return out


def check_token_exact(samples: list[Sample], turns: list[TurnRecord]) -> None:
    """Verify the invariant of this module on built samples: every trained token is a token the engine sampled in
    one of ``turns``, preceded by exactly the tokens the engine had before it, with that turn's log-prob and weight
    version. O(samples × turns × length); for tests and debugging.

    :raises ValueError: naming the first sample position that breaks it.
    """
    for si, s in enumerate(samples):
        covered = [False] * s.response_length
        for t in turns:
            seq = t.prompt_ids + t.output_ids
            n = common_prefix_len(s.tokens, seq)
            for p in range(max(len(t.prompt_ids), s.prompt_length), n):
                r, j = p - s.prompt_length, p - len(t.prompt_ids)
                if s.rollout_log_probs[r] == t.output_log_probs[j] and s.weight_versions[r] == t.weight_versions[j]:
                    covered[r] = True
        for r, m in enumerate(s.loss_mask):
            if m and not covered[r]:
                raise ValueError(
                    f"sample {si}: trained token {s.tokens[s.prompt_length + r]} at response position {r} "
                    "was not sampled by the engine in this context"
                )
