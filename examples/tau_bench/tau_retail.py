"""A small retail environment after tau-bench (Yao et al. 2024, "τ-bench: A Benchmark for Tool-Agent-User
Interaction in Real-World Domains", arXiv:2406.12045; sierra-research/tau-bench ``envs/retail``): a database of
users, products and orders, the tools an agent changes it with, tasks, and tau-bench's reward.

* :class:`RetailEnv` holds one episode's copy of the database; :meth:`RetailEnv.step` runs a tool call on it and
  returns the text the agent sees (``Error: ...`` for a refused action: the database is then unchanged).
* A task (``metadata["task"]`` of a prompt row, :class:`Task`) is a customer's instruction, the scripted user's
  turns, the **goal actions** (the write actions a correct agent performs) and the **outputs** the agent must say.
* :func:`task_reward`: 1.0 iff the database at the end of the episode equals the database the goal actions produce
  from the initial one (compared by :func:`db_hash`; read-only calls do not matter) **and** every output appears in
  the agent's messages (case-insensitive, commas ignored) — tau-bench's ``r_actions`` × ``r_outputs``; else 0.0.
"""

from __future__ import annotations

import copy
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: the database every episode starts from (``make_data.py`` writes it)
DB_PATH = Path(__file__).resolve().parent / "data" / "db.json"
CANCEL_REASONS = ("no longer needed", "ordered by mistake")


def load_db(path: Path = DB_PATH) -> dict[str, Any]:
    """The database at ``path``: ``{"users": {...}, "products": {...}, "orders": {...}}``.

    :raises FileNotFoundError: naming the file and how to make it.
    :raises ValueError: a file without those three tables.
    """
    if not path.is_file():
        raise FileNotFoundError(f"tau_bench database {path} not found (python examples/tau_bench/make_data.py)")
    db = json.loads(path.read_text())
    missing = [k for k in ("users", "products", "orders") if not isinstance(db.get(k), dict)]
    if missing:
        raise ValueError(f"{path}: the database lacks the tables {missing}")
    return db


def db_hash(db: dict[str, Any]) -> str:
    """SHA-256 of the database's canonical JSON (sorted keys): equal iff the databases are equal."""
    return hashlib.sha256(json.dumps(db, sort_keys=True).encode()).hexdigest()


def _money(x: float) -> float:
    return round(x + 1e-9, 2)


class RetailEnv:
    """One episode's retail database and its tools (each a method named like the tool).

    :param db: the initial database (deep-copied; the caller's stays unchanged).
    :ivar actions: every tool call made, ``{"name", "arguments", "result"}``, in order.
    """

    TOOLS: tuple[str, ...] = (
        "find_user_id_by_email",
        "get_user_details",
        "get_order_details",
        "cancel_pending_order",
        "return_delivered_order_items",
    )

    def __init__(self, db: dict[str, Any]) -> None:
        self.db = copy.deepcopy(db)
        self.actions: list[dict[str, Any]] = []

    # -- tools -----------------------------------------------------------------------------------------------------
    def find_user_id_by_email(self, email: str) -> str:
        """Find a user's id by their email address."""
        for uid, u in sorted(self.db["users"].items()):
            if u["email"].lower() == str(email).strip().lower():
                return uid
        return "Error: user not found"

    def get_user_details(self, user_id: str) -> str:
        """Get a user's name, email, payment methods and order ids."""
        u = self.db["users"].get(user_id)
        return json.dumps(u) if u is not None else "Error: user not found"

    def get_order_details(self, order_id: str) -> str:
        """Get an order's status, items, payment method and total."""
        o = self.db["orders"].get(order_id)
        return json.dumps(o) if o is not None else "Error: order not found"

    def cancel_pending_order(self, order_id: str, reason: str) -> str:
        """Cancel a pending order; reason is 'no longer needed' or 'ordered by mistake'. The total is refunded to the
        order's payment method."""
        o = self.db["orders"].get(order_id)
        if o is None:
            return "Error: order not found"
        if o["status"] != "pending":
            return f"Error: order {order_id} is {o['status']}, only pending orders can be cancelled"
        if reason not in CANCEL_REASONS:
            return f"Error: reason must be one of {list(CANCEL_REASONS)}"
        o["status"] = "cancelled"
        o["cancel_reason"] = reason
        self._refund(o["user_id"], o["payment_method_id"], o["total"])
        return json.dumps(o)

    def return_delivered_order_items(self, order_id: str, item_ids: list, payment_method_id: str) -> str:
        """Return items of a delivered order; the refund (the items' prices) goes to payment_method_id, which must be
        the order's payment method or one of the user's gift cards."""
        o = self.db["orders"].get(order_id)
        if o is None:
            return "Error: order not found"
        if o["status"] != "delivered":
            return f"Error: order {order_id} is {o['status']}, only delivered orders can be returned"
        if not isinstance(item_ids, list) or not item_ids:
            return "Error: item_ids must be a non-empty list of item ids of the order"
        prices = {it["item_id"]: it["price"] for it in o["items"]}
        unknown = [i for i in item_ids if i not in prices]
        if unknown or len(set(item_ids)) != len(item_ids):
            return f"Error: not items of order {order_id} (or repeated): {unknown or item_ids}"
        user = self.db["users"][o["user_id"]]
        pm = user["payment_methods"].get(payment_method_id)
        if pm is None or (payment_method_id != o["payment_method_id"] and pm["source"] != "gift_card"):
            return "Error: the refund goes to the order's payment method or one of the user's gift cards"
        refund = _money(sum(prices[i] for i in item_ids))
        o["status"] = "return requested"
        o["return_items"] = sorted(item_ids)
        o["refund"] = refund
        self._refund(o["user_id"], payment_method_id, refund)
        return json.dumps({"order_id": order_id, "status": o["status"], "refund": refund})

    def _refund(self, user_id: str, payment_method_id: str, amount: float) -> None:
        pm = self.db["users"][user_id]["payment_methods"][payment_method_id]
        if pm["source"] == "gift_card":
            pm["balance"] = _money(pm["balance"] + amount)

    # -- dispatch ----------------------------------------------------------------------------------------------------
    def schemas(self) -> list[dict[str, Any]]:
        """The tools in the OpenAI Chat ``tools`` format (for the request to the agent gateway)."""
        str_ = {"type": "string"}
        params = {
            "find_user_id_by_email": {"email": str_},
            "get_user_details": {"user_id": str_},
            "get_order_details": {"order_id": str_},
            "cancel_pending_order": {"order_id": str_, "reason": {"type": "string", "enum": list(CANCEL_REASONS)}},
            "return_delivered_order_items": {
                "order_id": str_,
                "item_ids": {"type": "array", "items": str_},
                "payment_method_id": str_,
            },
        }
        return [
            {
                "type": "function",
                "function": {
                    "name": name,
                    "description": " ".join(getattr(self, name).__doc__.split()),
                    "parameters": {"type": "object", "properties": params[name], "required": list(params[name])},
                },
            }
            for name in self.TOOLS
        ]

    def step(self, name: str, arguments: dict[str, Any]) -> str:
        """Run tool ``name`` with ``arguments``; its text result (an ``Error: ...`` for an unknown tool or bad
        arguments, the database unchanged). Every call is appended to :attr:`actions`."""
        if name not in self.TOOLS:
            result = f"Error: unknown tool {name!r}; available: {', '.join(self.TOOLS)}"
        else:
            try:
                result = getattr(self, name)(**arguments)
            except TypeError as e:
                result = f"Error: bad arguments for {name}: {e}"
        self.actions.append({"name": name, "arguments": arguments, "result": result})
        return result


@dataclass(frozen=True)
class Task:
    """One customer task (``metadata["task"]`` of a prompt row).

    :ivar user_id: the customer.
    :ivar instruction: what the customer wants, in the customer's words (the LLM user's brief).
    :ivar user_turns: the scripted user's messages, in order (the first opens the conversation).
    :ivar actions: the goal's write actions, ``[{"name", "arguments"}]``.
    :ivar outputs: strings the agent must say (e.g. a refund amount).
    """

    user_id: str
    instruction: str
    user_turns: tuple[str, ...]
    actions: tuple[dict[str, Any], ...]
    outputs: tuple[str, ...] = field(default=())

    @classmethod
    def from_metadata(cls, metadata: dict[str, Any]) -> Task:
        """The task of a row's metadata.

        :raises ValueError: naming the missing or malformed field.
        """
        t = metadata.get("task")
        if not isinstance(t, dict):
            raise ValueError("tau_bench: the row has no metadata.task")
        for key, kind in (("user_id", str), ("instruction", str), ("user_turns", list), ("actions", list)):
            if not isinstance(t.get(key), kind):
                raise ValueError(f"tau_bench: metadata.task.{key} missing or not a {kind.__name__}")
        if not t["user_turns"]:
            raise ValueError("tau_bench: metadata.task.user_turns is empty (the user's first message is needed)")
        outputs = t.get("outputs", [])
        if not isinstance(outputs, list):
            raise ValueError("tau_bench: metadata.task.outputs must be a list of strings")
        return cls(t["user_id"], t["instruction"], tuple(t["user_turns"]), tuple(t["actions"]), tuple(outputs))

    def goal_hash(self, db: dict[str, Any]) -> str:
        """:func:`db_hash` of ``db`` after the goal actions."""
        env = RetailEnv(db)
        for a in self.actions:
            result = env.step(a["name"], a["arguments"])
            if result.startswith("Error"):
                raise ValueError(f"tau_bench: goal action {a} fails on the database: {result}")
        return db_hash(env.db)


def _norm(text: str) -> str:
    return text.lower().replace(",", "")


def task_reward(task: Task, initial_db: dict[str, Any], final_db_hash: str, agent_texts: list[str]) -> float:
    """tau-bench's reward (see the module docstring): 1.0 iff the final database is the goal's and every output was
    said, else 0.0."""
    if final_db_hash != task.goal_hash(initial_db):
        return 0.0
    said = _norm(" ".join(agent_texts))
    return float(all(_norm(o) in said for o in task.outputs))
