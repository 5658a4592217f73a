"""What a generate function may use besides its arguments: the router client, the tokenizer, the weight version.

Generate functions keep slime's signature ``generate(args, sample, sampling_params)``; the rollout manager sets
the process-wide :class:`RolloutContext` before it calls them (slime's ``GenerateState``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class RolloutContext:
    """:ivar client: a :class:`vime_core.rollout.client.RouterClient` to the router.
    :ivar tokenizer: the policy's Hugging Face tokenizer.
    :ivar weight_version: the version of the weights the engines serve now.
    :ivar extras: room for plugins (sandbox factories, gateways, …).
    """

    client: Any
    tokenizer: Any
    weight_version: int = 0
    extras: dict[str, Any] = field(default_factory=dict)


_CONTEXT: RolloutContext | None = None


def set_rollout_context(ctx: RolloutContext | None) -> None:
    """Install (or clear) the context generate functions see."""
    global _CONTEXT
    _CONTEXT = ctx


def get_rollout_context() -> RolloutContext:
    """The current context.

    :raises RuntimeError: if no rollout manager is running in this process.
    """
    if _CONTEXT is None:
        raise RuntimeError("no rollout context: generate functions run inside vime's rollout manager")
    return _CONTEXT
