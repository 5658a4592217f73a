"""``vime run --config FILE.yaml``: a YAML mapping of flags turned into the argv it stands for (keys are flag names
with dashes or underscores; the command line, parsed after it, wins). Every key and value is checked against the
parser's flags, and an error names the file, line and key.
"""

from __future__ import annotations

import argparse
import difflib
import json
from pathlib import Path
from typing import Any

import yaml

from vime_core.config.errors import ArgumentError


def _yaml_key_lines(text: str) -> dict[str, int]:
    """Top-level key → 1-based line of a YAML mapping (for error messages)."""
    node = yaml.compose(text)
    if not isinstance(node, yaml.MappingNode):
        return {}
    return {str(k.value): k.start_mark.line + 1 for k, _ in node.value}


def _check_config_value(where: str, key: str, action: argparse.Action, value: Any) -> None:
    """Raise :class:`ArgumentError` naming ``where`` (file:line) and ``key`` when ``value`` cannot be ``action``'s."""
    flag = action.option_strings[0]
    takes_value = action.nargs != 0
    if not takes_value:  # store_true / BooleanOptionalAction / store_false: only booleans
        if not isinstance(value, bool) and value is not None:
            raise ArgumentError(f"{where}: key {key!r} ({flag}): expected true or false, got {value!r}")
        return
    if isinstance(value, bool):
        raise ArgumentError(f"{where}: key {key!r} ({flag}): expected a value, got {value!r}")
    values = value if isinstance(value, list) else [value]
    if isinstance(value, list) and action.nargs in (None, "?"):
        raise ArgumentError(f"{where}: key {key!r} ({flag}): expected one value, got a list {value!r}")
    if isinstance(value, dict):
        raise ArgumentError(f"{where}: key {key!r} ({flag}): expected a value, got a mapping {value!r}")
    for v in values:
        if isinstance(v, bool) and action.type in (int, float):
            raise ArgumentError(f"{where}: key {key!r} ({flag}): expected {action.type.__name__}, got {v!r}")
        if callable(action.type):
            try:
                converted = action.type(str(v))
            except (TypeError, ValueError, argparse.ArgumentTypeError):
                name = getattr(action.type, "__name__", "a valid value")
                raise ArgumentError(f"{where}: key {key!r} ({flag}): expected {name}, got {v!r}") from None
        else:
            converted = str(v)
        if action.choices is not None and converted not in action.choices:
            choices = ", ".join(map(str, action.choices))
            raise ArgumentError(f"{where}: key {key!r} ({flag}): expected one of {choices}, got {v!r}")


#: flags of NAME VALUE pairs, one per eval set, that a config may also give as a mapping ``{NAME: VALUE}`` (a mapping
#: value of ``eval_set_sampling_params`` is written as its JSON)
PER_EVAL_SET = ("--eval-set-sampling-params", "--eval-set-reward")


def _per_set_value(where: str, key: str, value: Any) -> str:
    """One value of a per-eval-set mapping as its argv string: a mapping as JSON, a string as it is.

    :raises ArgumentError: naming ``where`` and ``key`` for anything else (a list, a number, a boolean, null).
    """
    if isinstance(value, dict):
        return json.dumps(value)
    if isinstance(value, str):
        return value
    raise ArgumentError(f"{where}: key {key!r}: expected a mapping of eval set NAME to a value, got {value!r}")


def config_to_argv(path: Path, parser: argparse.ArgumentParser) -> list[str]:
    """The argv equivalent of a YAML config (keys are flag names, dashes or underscores).

    :raises ArgumentError: naming the file (and line and key): missing file, invalid YAML, not a mapping, an
        unknown key (with the closest flag), or a value the flag cannot take (wrong type, not a choice).
    """
    try:
        text = path.read_text()
        data = yaml.safe_load(text)
    except FileNotFoundError:
        raise ArgumentError(f"--config {path}: file not found") from None
    except yaml.YAMLError as e:
        raise ArgumentError(f"--config {path}: invalid YAML: {e}") from None
    if data is None:
        return []
    if not isinstance(data, dict):
        raise ArgumentError(f"--config {path}: expected a mapping of flag: value")
    lines = _yaml_key_lines(text)
    actions = parser._option_string_actions
    argv: list[str] = []
    for key, value in data.items():
        flag = "--" + str(key).replace("_", "-")
        where = f"{path}:{lines.get(str(key), '?')}"
        if flag == "--config":
            raise ArgumentError(f"{where}: key {key!r}: a config file cannot include another (--config)")
        passthrough = flag.startswith(("--vllm-", "--router-")) and flag not in actions
        if not passthrough:
            if flag not in actions:
                keys = sorted({o[2:].replace("-", "_") for o in actions if o.startswith("--")})
                close = difflib.get_close_matches(str(key).replace("-", "_"), keys, n=1)
                hint = (
                    f"; did you mean {close[0]} (--{close[0].replace('_', '-')})?"
                    if close
                    else "; see `vime args` for every flag"
                )
                raise ArgumentError(f"{where}: unknown key {key!r}{hint}")
            if flag in PER_EVAL_SET and isinstance(value, dict):  # NAME: value, as NAME VALUE pairs
                value = [x for name, v in value.items() for x in (name, _per_set_value(where, str(key), v))]
            if flag != "--eval-prompt-data":  # a mapping or a list; checked by _config_eval_sets
                _check_config_value(where, str(key), actions[flag], value)
        if value is False and not passthrough:
            if "--no-" + flag[2:] not in actions:  # store_true flag set to false: its default
                continue
            argv.append("--no-" + flag[2:])
        elif value is True:
            argv.append(flag)
        elif value is None or value is False:
            continue
        elif flag == "--eval-prompt-data":
            argv.append(flag)
            argv.extend(_config_eval_sets(path, value))
        elif isinstance(value, list):
            argv.append(flag)
            argv.extend(str(v) for v in value)
        else:
            if isinstance(value, str) and not Path(value).is_absolute() and key in ("prompt_data", "prompt-data"):
                value = str((path.parent / value).resolve())
            argv.extend([flag, str(value)])
    return argv


def _config_eval_sets(path: Path, value: Any) -> list[str]:
    """A config's ``eval_prompt_data`` (a ``{NAME: PATH}`` mapping or a ``[NAME, PATH, ...]`` list) as argv values,
    with relative paths resolved against the config file's directory."""
    if isinstance(value, dict):
        pairs = [(str(k), str(v)) for k, v in value.items()]
    elif isinstance(value, list) and len(value) % 2 == 0:
        pairs = [(str(value[i]), str(value[i + 1])) for i in range(0, len(value), 2)]
    else:
        raise ArgumentError(
            f"--config {path}: eval_prompt_data must be a mapping NAME: PATH or a list of NAME, PATH pairs; "
            f"got {value!r}"
        )
    argv: list[str] = []
    for name, p in pairs:
        argv += [name, p if Path(p).is_absolute() else str((path.parent / p).resolve())]
    return argv
