"""The ``dapo_math`` reward: DAPO's rule-based math score, +1.0 for a correct answer and -1.0 otherwise.

DAPO (arXiv:2503.14476, §3.4) as implemented in verl's ``verl/utils/reward_score/math_dapo.py`` (non-strict), which
slime's ``dapo`` reward also uses, reproduced so that scores match exactly: the text after the last ``Answer:`` in
the last 300 characters, normalised by :func:`normalize_final_answer` (Minerva's rule), equal to the label. The
rule: docs/rewards.md, "dapo_math".
"""

from __future__ import annotations

import re

from vime_core.config.context import PluginContext, takes_context
from vime_core.rewards.simple import strip_thinking
from vime_core.types import Sample

#: How much of the response's end the rule reads (verl: "the longest answer in MATH-500 has 159 characters").
TAIL_CHARS = 300
_ANSWER = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")
INVALID = "[INVALID]"

# (old, new) replacements, applied in order (Minerva's normalisation, as in verl's math_dapo.py)
_REPLACE = (
    ("an ", ""),
    ("a ", ""),
    (".$", "$"),
    ("\\$", ""),
    ("\\ ", ""),
    (" ", ""),
    ("mbox", "text"),
    (",\\text{and}", ","),
    ("\\text{and}", ","),
    ("\\text{m}", "\\text{}"),
)
# substrings deleted, in order
_DELETE = (
    *"square ways integers dollars mph inches hours km units".split(),
    "\\ldots",
    *"sue points feet minutes digits cents degrees cm gm pounds meters meals edges students childrentickets".split(),
    "multiples",
    "\\text{s}",
    "\\text{.}",
    "\\text{\ns}",
    "\\text{}^2",
    "\\text{}^3",
    "\\text{\n}",
    "\\text{}",
    "\\mathrm{th}",
    "^\\circ",
    "^{\\circ}",
    "\\;",
    ",\\!",
    "{,}",
    '"',
    "\\dots",
)
# (pattern, replacement) regex rewrites, in order
_REWRITE = (
    (re.compile(r"(.*?)(\$)(.*?)(\$)(.*)"), "$\\3$"),
    (re.compile(r"(\\text\{)(.*?)(\})"), "\\2"),
    (re.compile(r"(\\textbf\{)(.*?)(\})"), "\\2"),
    (re.compile(r"(\\overline\{)(.*?)(\})"), "\\2"),
    (re.compile(r"(\\boxed\{)(.*)(\})"), "\\2"),
    (re.compile(r"(frac)([^{])(.)"), "frac{\\2}{\\3}"),
    (re.compile(r"(sqrt)([^{])"), "sqrt{\\2}"),
)


def normalize_final_answer(answer: str) -> str:
    """Minerva's answer normalisation (step 3 of the module docstring), e.g. ``"x = \\$1,000"`` → ``"1000"``,
    ``"\\boxed{\\frac12}"`` → ``"\\frac{1}{2}"``, ``"10 \\text{ cm}"`` → ``"10"``."""
    answer = answer.split("=")[-1]
    for old, new in _REPLACE:
        answer = answer.replace(old, new)
    for gone in _DELETE:
        answer = answer.replace(gone, "")
    for pattern, repl in _REWRITE:
        answer = pattern.sub(repl, answer)
    answer = answer.replace("$", "")
    if answer.replace(",", "").isdigit():
        answer = answer.replace(",", "")
    return answer.strip()


def dapo_answer(response: str) -> str:
    """The normalised answer DAPO reads from ``response`` (steps 1-3); ``"[INVALID]"`` when there is none."""
    found = _ANSWER.findall(strip_thinking(response)[-TAIL_CHARS:])
    return normalize_final_answer(found[-1] if found else INVALID)


@takes_context
async def dapo_math(ctx: PluginContext, sample: Sample) -> float:
    """+1.0 if the answer after the last ``Answer:`` equals the label after normalisation, else -1.0.

    :raises ValueError: the sample has no label.
    """
    if sample.label is None:
        raise ValueError(f"dapo_math: sample {sample.group_index}/{sample.index} has no label (--label-key)")
    return 1.0 if dapo_answer(sample.response or "") == normalize_final_answer(str(sample.label)) else -1.0
