"""Tools for the ``multi_turn`` generate function: plain Python callables with a JSON schema.

:func:`register_tool` (or ``--multi-turn-tools pkg.mod:obj``) makes a :class:`Tool` of a callable, its schema taken
from ``parameters`` or derived from the signature and docstring (:func:`tool_from_callable`); :func:`load_tools`
resolves the flag's specs. Built in: :func:`calculator` (exact arithmetic through the AST, no ``eval``). How tools
are registered and called: docs/agents.md, "multi_turn".
"""

from __future__ import annotations

import ast
import asyncio
import importlib
import inspect
import json
import operator
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

_JSON_TYPES = {int: "integer", float: "number", bool: "boolean", str: "string", list: "array", dict: "object"}


@dataclass
class Tool:
    """A callable the model may call.

    :ivar name: the function name the model uses.
    :ivar fn: ``fn(**arguments)``, sync or async.
    :ivar description: what it does (shown to the model).
    :ivar parameters: JSON schema of the arguments object.
    """

    name: str
    fn: Callable[..., Any]
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})

    def schema(self) -> dict[str, Any]:
        """``{"name", "description", "parameters"}`` (what chat templates and tool parsers take)."""
        return {"name": self.name, "description": self.description, "parameters": self.parameters}

    async def call(self, arguments: dict[str, Any], timeout_s: float | None = None) -> str | list[dict[str, Any]]:
        """Run the tool; sync functions run in a worker thread.

        :return: the result as text; a result that is a list of OpenAI-style content parts (``{"type": "text"}``,
            ``{"type": "image_url"}``, ``{"type": "image"}``) as it is (images for a vision-language model,
            docs/vlm.md).
        :raises TimeoutError: after ``timeout_s`` seconds.
        :raises Exception: whatever the tool raises (the caller reports it to the model).
        """
        if inspect.iscoroutinefunction(self.fn):
            coro = self.fn(**arguments)
        else:
            coro = asyncio.to_thread(self.fn, **arguments)
        out = await asyncio.wait_for(coro, timeout=timeout_s)
        if isinstance(out, str) or is_content_parts(out):
            return out
        try:
            return json.dumps(out, ensure_ascii=False)
        except TypeError:
            return str(out)


def is_content_parts(value: Any) -> bool:
    """Whether ``value`` is a non-empty list of OpenAI-style content parts (text and image parts)."""
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(p, dict) and p.get("type") in ("text", "image_url", "image") for p in value)
    )


def _json_type(annotation: Any) -> dict[str, Any]:
    origin = typing.get_origin(annotation) or annotation
    if origin in _JSON_TYPES:
        return {"type": _JSON_TYPES[origin]}
    if origin is typing.Literal:
        return {"enum": list(typing.get_args(annotation))}
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if len(args) == 1:  # Optional[X]
        return _json_type(args[0])
    return {}


def tool_from_callable(
    fn: Callable[..., Any],
    *,
    name: str | None = None,
    description: str | None = None,
    parameters: dict[str, Any] | None = None,
) -> Tool:
    """A :class:`Tool` for ``fn`` (schema from the signature unless ``parameters`` is given).

    :raises TypeError: if ``fn`` takes ``*args``/``**kwargs`` and no ``parameters`` schema is given.
    """
    if isinstance(fn, Tool):
        return fn
    doc = inspect.getdoc(fn) or ""
    desc = description if description is not None else doc.split("\n\n")[0].strip()
    if parameters is None:
        sig = inspect.signature(fn)
        hints = typing.get_type_hints(fn) if hasattr(fn, "__annotations__") else {}
        props: dict[str, Any] = {}
        required = []
        for p in sig.parameters.values():
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                raise TypeError(f"tool {fn!r}: *args/**kwargs need an explicit parameters schema")
            props[p.name] = _json_type(hints.get(p.name, Any))
            if p.default is p.empty:
                required.append(p.name)
        parameters = {"type": "object", "properties": props, "required": required}
    return Tool(name or getattr(fn, "__name__", "tool"), fn, desc, parameters)


_REGISTRY: dict[str, Tool] = {}


def register_tool(
    fn: Callable[..., Any] | None = None,
    *,
    name: str | None = None,
    description: str | None = None,
    parameters: dict[str, Any] | None = None,
) -> Any:
    """Register a tool by name (decorator, with or without arguments); returns the function unchanged.

    :raises ValueError: if another tool already has the name.
    """

    def deco(f: Callable[..., Any]) -> Callable[..., Any]:
        tool = tool_from_callable(f, name=name, description=description, parameters=parameters)
        old = _REGISTRY.get(tool.name)
        if old is not None and old.fn is not tool.fn:
            raise ValueError(f"tool {tool.name!r} is already registered ({old.fn!r})")
        _REGISTRY[tool.name] = tool
        return f

    return deco(fn) if fn is not None else deco


def registered_tools() -> dict[str, Tool]:
    """The tools registered with :func:`register_tool` so far (a copy)."""
    return dict(_REGISTRY)


def _as_tools(obj: Any) -> list[Tool]:
    if isinstance(obj, Tool):
        return [obj]
    if isinstance(obj, dict):
        return [tool_from_callable(v, name=k) if not isinstance(v, Tool) else v for k, v in obj.items()]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _as_tools(o)]
    if callable(obj):
        return [tool_from_callable(obj)]
    raise TypeError(f"not a tool: {obj!r}")


def load_tools(specs: list[str] | None) -> list[Tool]:
    """Resolve ``--multi-turn-tools`` entries (see the module docstring); ``None``: every registered tool, ``[]``:
    none.

    :raises ValueError: for an unknown name or a duplicate tool name.
    :raises ImportError / AttributeError: for a path that does not resolve.
    """
    tools: list[Tool] = []
    for spec in specs or []:
        if ":" in spec:
            mod, _, attr = spec.partition(":")
            tools += _as_tools(getattr(importlib.import_module(mod), attr))
        elif spec in _REGISTRY:
            tools.append(_REGISTRY[spec])
        else:
            try:
                module = importlib.import_module(spec)
            except ImportError:
                raise ValueError(
                    f"unknown tool {spec!r}; registered: {sorted(_REGISTRY)} "
                    "(or give 'pkg.mod:obj' or a module that registers tools)"
                ) from None
            # the tools that module registered (also when it was imported earlier, e.g. by another run's load_tools)
            tools += [t for _, t in sorted(_REGISTRY.items()) if getattr(t.fn, "__module__", None) == module.__name__]
    if specs is None:
        tools = list(_REGISTRY.values())
    names = [t.name for t in tools]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"duplicate tool names: {dup}")
    return tools


# -- built-in: calculator ------------------------------------------------------------------------------------------
_BIN = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UN = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def _eval(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return Fraction(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _BIN:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow):
            if right.denominator != 1 or abs(right) > 64:
                raise ValueError("exponent must be an integer with |n| <= 64")
            return left ** int(right)
        return _BIN[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UN:
        return _UN[type(node.op)](_eval(node.operand))
    raise ValueError(f"unsupported expression: {ast.dump(node)[:80]}")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly (+, -, *, /, //, %, ** and parentheses) and return the result.

    Results are exact (fractions); a non-integer result is written as a fraction and a 6-digit decimal, e.g.
    ``7/2 = 3.5``. Errors (syntax, division by zero) are returned as ``"Error: ..."`` text for the model to read.
    """
    if len(expression) > 200:
        return "Error: expression longer than 200 characters"
    try:
        value = _eval(ast.parse(expression.replace("^", "**").replace("×", "*").replace("÷", "/"), mode="eval"))
    except ZeroDivisionError:
        return "Error: division by zero"
    except (SyntaxError, ValueError, TypeError, OverflowError) as e:
        return f"Error: {e}"
    if value.denominator == 1:
        return str(value.numerator)
    return f"{value.numerator}/{value.denominator} = {float(value):.6g}"
