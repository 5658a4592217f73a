"""Multi-agent example: a *solver* and a *verifier* — two roles played by the one policy — in a custom generate
function, loaded by dotted path (no plugin distribution needed)::

    PYTHONPATH=examples/multi_agent vime run --config examples/multi_agent/config.yaml

Per prompt (one rollout):

1. **solver** answers the question (the prompt's own chat messages);
2. **verifier** sees the question and the solver's answer and replies ``Verdict: correct`` or ``Verdict: incorrect``;
3. on ``incorrect`` the **solver revises** once, with the verifier's objection as the next user turn.

Each role's turn is one :class:`~vime_core.types.Sample` (its own prompt, its own response tokens, mask 1 on them,
the engine's log-probs and weight versions), produced by the built-in ``default`` generate function against the real
engine. The function returns the segments as a list — a *fan-out*: the rollout manager gives them one
``episode_id`` and scores the rollout once, so every role is trained on the same **team reward**
(:func:`team_reward`: reasoning-gym's verifier on the *final* answer — the revision if there was one). A verifier
that wrongly rejects a right answer (and talks the solver out of it) lowers the reward of all the rollout's tokens;
one that catches a wrong answer that the revision fixes raises it.

Per-segment metadata: ``role`` (``solver`` / ``verifier`` / ``solver_revision``), ``final_response``,
``solver_correct`` (the first answer's score), and on the verifier ``verdict`` (``correct`` / ``incorrect`` /
``None`` when unparseable) and ``verdict_right``.
"""

from __future__ import annotations

import copy
import re
from typing import Any

from vime_core.config.context import PluginContext
from vime_core.rewards.reasoning_gym import extract_answer, reasoning_gym_reward, score
from vime_core.rollout.generators.default import generate as default_generate
from vime_core.types import Sample, Status

VERIFIER_SYSTEM = "You check arithmetic. Reply with exactly one line: 'Verdict: correct' or 'Verdict: incorrect'."
REVISION_REQUEST = (
    "A checker believes your answer is wrong. Check the calculation again and reply with one line of the form "
    "'Answer: N'."
)
VERIFIER_MAX_TOKENS = 16
_VERDICT = re.compile(r"verdict\s*:\s*(correct|incorrect)", re.IGNORECASE)
# SmolLM2-135M rarely keeps the format ("The proposed answer is indeed incorrect. ..."): the first judgement word
_JUDGEMENT = re.compile(r"\b(incorrect|not correct|wrong|correct|right)\b", re.IGNORECASE)
DONE = (Status.COMPLETED, Status.TRUNCATED)


def parse_verdict(text: str) -> str | None:
    """``"correct"`` / ``"incorrect"`` from the first ``Verdict: ...`` in ``text``, else from its first judgement
    word (``incorrect``, ``not correct``, ``wrong`` → incorrect; ``correct``, ``right`` → correct); None if neither."""
    m = _VERDICT.search(text or "")
    if m:
        return m.group(1).lower()
    m = _JUDGEMENT.search(text or "")
    if not m:
        return None
    return "correct" if m.group(1).lower() in ("correct", "right") else "incorrect"


def _messages(prompt: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    return copy.deepcopy(prompt) if isinstance(prompt, list) else [{"role": "user", "content": prompt}]


def _question(prompt: str | list[dict[str, Any]]) -> str:
    return prompt if isinstance(prompt, str) else str(prompt[-1]["content"])


def _segment(parent: Sample, role: str, messages: list[dict[str, Any]]) -> Sample:
    meta = copy.deepcopy(parent.metadata)
    meta["role"] = role
    return Sample(
        group_index=parent.group_index, index=parent.index, prompt=messages, label=parent.label, metadata=meta
    )


async def generate(ctx: PluginContext, sample: Sample, sampling_params: dict[str, Any]) -> list[Sample]:
    """Solver → verifier → (revision) for one prompt; returns the role segments (see the module docstring).

    :param sampling_params: engine parameters; the verifier's ``max_tokens`` is capped at 16.
    :return: 1 to 3 samples (a solver that did not finish gets no verifier).
    """
    solver = await default_generate(ctx, _segment(sample, "solver", _messages(sample.prompt)), dict(sampling_params))
    segments, final = [solver], solver
    solver_correct = None
    if solver.status in DONE:
        entry, task = sample.metadata.get("rg_entry"), sample.metadata.get("task")
        if entry is not None and task is not None:
            solver_correct = score(task, extract_answer(solver.response), entry, sample.metadata.get("rg_config"))
        check = [
            {"role": "system", "content": VERIFIER_SYSTEM},
            {
                "role": "user",
                "content": f"Problem: {_question(sample.prompt)}\nProposed answer: {solver.response.strip()}\n"
                "Is the proposed answer correct?",
            },
        ]
        params = {**sampling_params, "max_tokens": min(sampling_params.get("max_tokens") or 16, VERIFIER_MAX_TOKENS)}
        verifier = await default_generate(ctx, _segment(sample, "verifier", check), params)
        segments.append(verifier)
        verdict = parse_verdict(verifier.response)
        verifier.metadata["verdict"] = verdict
        if solver_correct is not None and verdict is not None:
            verifier.metadata["verdict_right"] = (verdict == "correct") == (solver_correct == 1.0)
        if verdict == "incorrect" and verifier.status in DONE:
            retry = _messages(sample.prompt) + [
                {"role": "assistant", "content": solver.response.strip()},
                {"role": "user", "content": REVISION_REQUEST},
            ]
            final = await default_generate(ctx, _segment(sample, "solver_revision", retry), dict(sampling_params))
            segments.append(final)
    for s in segments:
        s.metadata["final_response"] = final.response
        s.metadata["solver_correct"] = solver_correct
    return segments


async def team_reward(ctx: PluginContext, sample: Sample) -> float:
    """The rollout's reward: reasoning-gym's verifier on ``metadata["final_response"]`` (0.0 … 1.0).

    :raises ValueError: from :func:`~vime_core.rewards.reasoning_gym.reasoning_gym_reward` when the sample's
        metadata lacks ``task`` / ``rg_entry``.
    """
    final = copy.copy(sample)
    final.response = sample.metadata.get("final_response", sample.response)
    return await reasoning_gym_reward(ctx, final)
