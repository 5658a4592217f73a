"""Held-out evaluation: eval sets, the eval schedule, pass@k and the ``eval/<name>/*`` metrics.

The rollout manager generates the eval samples (same engines, router, generate function and reward plugin as
training, at the current weight version; :meth:`vime_core.rollout.manager.RolloutManager.evaluate`); this module
holds everything around that which needs no engine: parsing ``--eval-prompt-data NAME PATH [NAME PATH ...]``,
the eval sampling parameters, when to evaluate, the metrics and the per-step sample dump. Flag names follow slime
(``--eval-interval``, ``--eval-prompt-data``, ``--n-samples-per-eval-prompt``, ``--eval-temperature``, ...).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vime_core.config import EvalConfig
from vime_core.config.sampling import sampling_params as eval_sampling_params  # noqa: F401 - its old name
from vime_core.data.source import read_rows
from vime_core.types import Sample, Status


class EvalArgumentError(ValueError):
    """A malformed eval flag; the message names the flag and what was expected."""


@dataclass(frozen=True)
class EvalSet:
    """One named eval set of ``--eval-prompt-data``.

    :param name: the metric namespace (``eval/<name>/...``); letters, digits, ``_``, ``-`` and ``.``.
    :param path: a ``.jsonl`` or ``.parquet`` file read with ``--input-key``/``--label-key``/``--metadata-key``.
    """

    name: str
    path: Path


def parse_eval_prompt_data(values: Sequence[str] | None) -> list[EvalSet]:
    """``["aime", "a.jsonl", "gsm", "g.jsonl"]`` → ``[EvalSet("aime", a.jsonl), EvalSet("gsm", g.jsonl)]``.

    :raises EvalArgumentError: an odd number of values, an empty or repeated name, or a name with characters other
        than letters, digits, ``_``, ``-``, ``.`` (it becomes part of metric keys and file names).
    """
    if not values:
        return []
    values = [str(v) for v in values]
    if len(values) % 2:
        raise EvalArgumentError(
            f"--eval-prompt-data expects NAME PATH pairs (e.g. --eval-prompt-data aime aime.jsonl gsm8k gsm8k.jsonl); "
            f"got {len(values)} values: {' '.join(values)}"
        )
    sets: list[EvalSet] = []
    for name, path in zip(values[::2], values[1::2], strict=True):
        if not name or not all(c.isalnum() or c in "_-." for c in name):
            raise EvalArgumentError(
                f"--eval-prompt-data: set name {name!r} must be letters, digits, '_', '-' or '.' "
                f"(it names the metrics eval/<name>/*); expected NAME PATH pairs"
            )
        if any(s.name == name for s in sets):
            raise EvalArgumentError(f"--eval-prompt-data: set name {name!r} given twice")
        sets.append(EvalSet(name, Path(path)))
    return sets


def load_eval_sets(cfg: EvalConfig) -> list[tuple[EvalSet, list[dict[str, Any]]]]:
    """Every ``--eval-prompt-data`` set with its rows (read like ``--prompt-data``, with ``--input-key``,
    ``--label-key``, ``--metadata-key``).

    :raises DataError: naming ``--eval-prompt-data NAME``, the file and the line of a bad row.
    """
    return [
        (
            s,
            read_rows(
                s.path,
                cfg.input_key,
                cfg.label_key,
                cfg.metadata_key,
                flag=f"--eval-prompt-data {s.name}",
                image_key=cfg.image_key,
            ),
        )
        for s in parse_eval_prompt_data(cfg.eval_prompt_data)
    ]


def eval_steps(num_rollout: int, interval: int | None, start_step: int = 0, before_train: bool = True) -> list[int]:
    """The steps at which a run evaluates, as numbers of finished training steps (= the weight version).

    Step 0 is before any training (skipped with ``before_train=False`` or when resuming past it), then after every
    ``interval`` training steps, and always after the last one (``num_rollout``). ``interval=None`` evaluates only
    before and after training.
    """
    steps = [0] if before_train and start_step == 0 else []
    for done in range(start_step + 1, num_rollout + 1):
        if done == num_rollout or (interval and done % interval == 0):
            steps.append(done)
    return steps


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt with ``c`` correct out of ``n`` samples: ``1 - C(n-c, k) / C(n, k)``.

    Computed as ``1 - prod_{i=n-c+1}^{n} (1 - k/i)`` (Chen et al. 2021, "Evaluating Large Language Models Trained
    on Code", Fig. 3), which avoids the huge binomials.

    :raises ValueError: unless ``0 <= c <= n`` and ``1 <= k <= n``.
    """
    if not (0 <= c <= n) or not (1 <= k <= n):
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def pass_at_k_values(n: int) -> list[int]:
    """The k reported for ``n`` samples per prompt: powers of two up to ``n``, and ``n`` itself (n=6 → 1, 2, 4, 6)."""
    ks = [1 << i for i in range(n.bit_length()) if 1 << i <= n]
    return ks if ks[-1] == n else ks + [n]


def rollouts(group: list[Sample]) -> list[Sample]:
    """One sample per rollout of a group: the segments a fan-out generate function returned for one rollout share a
    ``episode_id`` and are counted once (their last segment stands for the rollout; all carry the same reward)."""
    last: dict[Any, Sample] = {}
    for s in group:
        last[s.episode_id if s.episode_id is not None else id(s)] = s
    return list(last.values())


def eval_metrics(
    name: str, groups: list[list[Sample]], reward_key: str | None = None, pass_threshold: float = 1.0
) -> dict[str, float]:
    """The ``eval/<name>/*`` metrics of one eval set's groups (one group = one prompt's samples).

    * ``reward_mean``: mean reward (``--reward-key`` of a dict reward) over the scored (completed or truncated)
      samples;
    * ``pass@k`` for ``k`` in :func:`pass_at_k_values` of the group size: mean over prompts of :func:`pass_at_k`,
      where a sample is correct when its reward is ``>= pass_threshold`` (``--eval-pass-threshold``); failed
      samples count as incorrect;
    * ``response_len_mean``: mean response tokens over scored samples;
    * ``truncated_frac`` / ``failed_frac``: fraction of samples stopped by the length limit / failed;
    * ``num_samples``: samples (rollouts) evaluated.

    :raises ValueError: on no group, or groups of different sizes (pass@k needs one ``n``).
    """
    groups = [rollouts(g) for g in groups]
    if not groups:
        raise ValueError(f"eval set {name!r}: no samples")
    n = len(groups[0])
    if any(len(g) != n for g in groups):
        raise ValueError(f"eval set {name!r}: groups of different sizes {sorted({len(g) for g in groups})}")
    samples = [s for g in groups for s in g]
    scored = [s for s in samples if s.status in (Status.COMPLETED, Status.TRUNCATED) and s.reward is not None]
    rewards = [s.reward_value(reward_key) for s in scored]

    def correct(s: Sample) -> bool:
        ok = s.status in (Status.COMPLETED, Status.TRUNCATED) and s.reward is not None
        return ok and s.reward_value(reward_key) >= pass_threshold

    counts = [sum(correct(s) for s in g) for g in groups]
    p = f"eval/{name}/"
    m = {
        p + "reward_mean": statistics.fmean(rewards) if rewards else 0.0,
        p + "response_len_mean": statistics.fmean(s.response_length for s in scored) if scored else 0.0,
        p + "truncated_frac": sum(s.status == Status.TRUNCATED for s in samples) / len(samples),
        p + "failed_frac": sum(s.status == Status.FAILED for s in samples) / len(samples),
        p + "num_samples": float(len(samples)),
    }
    for k in pass_at_k_values(n):
        m[p + f"pass@{k}"] = statistics.fmean(pass_at_k(n, c, k) for c in counts)
    return m


def sample_record(sample: Sample, name: str, step: int, weight_version: int, reward_key: str | None) -> dict:
    """One line of an eval-sample dump (``--save-eval-samples``): ``weight_version`` is the engines' version when the
    evaluation ran, ``token_weight_versions`` the distinct versions the engine tagged the response tokens with."""
    scored = sample.reward is not None and sample.status in (Status.COMPLETED, Status.TRUNCATED)
    return {
        "eval_set": name,
        "step": step,
        "weight_version": weight_version,
        "prompt_index": sample.group_index,
        "sample_index": sample.index,
        "prompt": sample.prompt,
        "response": sample.response,
        "response_length": sample.response_length,
        "label": sample.label,
        "reward": sample.reward_value(reward_key) if scored else None,
        "status": sample.status.value,
        "token_weight_versions": sorted(set(sample.weight_versions)),
    }


def dump_eval_samples(
    out_dir: Path, name: str, step: int, weight_version: int, groups: list[list[Sample]], reward_key: str | None
) -> Path:
    """Write ``OUTPUT_DIR/eval_samples/<name>/step_<step:06d>.jsonl`` (one :func:`sample_record` per line)."""
    path = Path(out_dir) / "eval_samples" / name / f"step_{step:06d}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for g in groups:
            for s in g:
                f.write(json.dumps(sample_record(s, name, step, weight_version, reward_key), default=str) + "\n")
    return path


def eval_line(step: int, metrics: dict[str, float], model: str | None = None) -> str:
    """The progress line of one evaluation: reward and the largest pass@k per set. During a run it is labelled by
    the step and the engines' weight version; ``model`` (``vime eval``): by the model evaluated instead."""
    names = sorted(k.split("/")[1] for k in metrics if k.startswith("eval/") and k.endswith("/reward_mean"))
    parts = []
    for name in names:
        p = f"eval/{name}/"
        ks = sorted(int(k[len(p) + 5 :]) for k in metrics if k.startswith(p + "pass@"))
        text = f"{name} reward {metrics[p + 'reward_mean']:.3f}"
        if ks:
            text += f" pass@{ks[-1]} {metrics[p + f'pass@{ks[-1]}']:.3f}"
        text += f" resp_len {metrics[p + 'response_len_mean']:.1f} truncated {metrics[p + 'truncated_frac']:.2f}"
        parts.append(text)
    head = f"[vime] eval step {step}" if model is None else f"[vime] eval of {model}"
    if model is None and "eval/weight_version" in metrics:
        head += f" (weight version {int(metrics['eval/weight_version'])})"
    return head + " | " + " | ".join(parts)
