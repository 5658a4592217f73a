"""How many policy tokens Codex's first request takes, and what they are made of.

Runs one real ``coding_agent`` episode on HumanEval/0 — the real Codex CLI (``vime agent prepare codex``) in a
sandbox of ``--sandbox`` (``local`` or ``docker``), through the real :class:`AgentGateway` — with a
:class:`ScriptedResponder` as the engine (one answer: ``Done.``), captures the Responses API body Codex sent first, and
prints the rendered prompt's token count (the gateway's chat template and SmolLM2-135M-Instruct's tokenizer by
default) split into its parts:

* ``tools`` — the tool schemas as the template renders them (full prompt − the same prompt rendered without tools),
* each message: ``input[0]`` is Codex's base instructions (a developer message; ``model_instructions_file`` replaces
  them), then skills/permissions text, ``<environment_context>``, the task prompt,
* ``template`` — what remains (role markers).

Usage::

    python bench/codex_prompt_tokens.py                       # the harness's default configuration
    python bench/codex_prompt_tokens.py --compact             # --agent-codex-compact
    python bench/codex_prompt_tokens.py --sandbox docker -c 'features.goals=false' --dump /tmp/body.json

Prints one ``tokens part`` line per part and ``total N``; ``--dump`` writes the captured body (JSON).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from vime_core.agent.apis import openai_responses
from vime_core.agent.responders import ScriptedResponder
from vime_core.cli.arguments import default_args
from vime_core.data.humaneval_export import load_problems, problem_to_row
from vime_core.plugins.manager import get_plugins
from vime_core.rollout.context import RolloutContext, set_rollout_context
from vime_core.types import Sample


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct", help="a name under ~/.cache/vime/models or a path")
    ap.add_argument("--sandbox", default="local", help="sandbox backend (local, docker)")
    ap.add_argument("--compact", action="store_true", help="--agent-codex-compact")
    ap.add_argument("--instructions-file", help="--agent-codex-instructions-file")
    ap.add_argument("-c", "--config", action="append", default=[], help="extra `codex -c KEY=VALUE` overrides")
    ap.add_argument("--dump", help="write the captured request body (JSON) here")
    a = ap.parse_args()

    from transformers import AutoTokenizer

    model = Path(a.model)
    if not model.exists():
        model = Path.home() / ".cache" / "vime" / "models" / a.model
    tok = AutoTokenizer.from_pretrained(str(model))
    bodies: list[dict] = []
    orig = openai_responses.parse_responses

    def capture(body, history=None):
        bodies.append(body)
        return orig(body, history)

    openai_responses.parse_responses = capture  # the name the /v1/responses route calls
    get_plugins().resolve("agent", "codex")().prepare(log=lambda *x: None)
    extra = {}
    if a.sandbox == "docker":
        from vime_sandbox_docker.image import build_image
        from vime_sandbox_docker.sandbox import DEFAULT_IMAGE

        extra["sandbox_docker_image"] = build_image(DEFAULT_IMAGE)
    args = default_args(
        agent="codex", sandbox=a.sandbox, agent_max_turns=2, agent_wall_time=120.0, agent_max_tokens=16,
        agent_codex_config=a.config, agent_codex_compact=a.compact, agent_codex_instructions_file=a.instructions_file,
        **extra,
    )  # fmt: skip
    row = problem_to_row(load_problems()[0])
    backend = ScriptedResponder(tok, ["Done."])
    ctx = RolloutContext(client=backend, tokenizer=tok, weight_version=0)
    set_rollout_context(ctx)
    try:
        generate = get_plugins().resolve("generate", "coding_agent")
        out = asyncio.run(generate(args, Sample(prompt=row["prompt"], metadata=row["metadata"]), {"max_tokens": 16}))
        gw = ctx.extras["agent_gateway"]
    finally:
        if ctx.extras.get("agent_gateway") is not None:
            ctx.extras["agent_gateway"].stop()
        set_rollout_context(None)
    if not bodies or not backend.calls:
        meta = out.metadata if isinstance(out, Sample) else {}
        sys.exit(f"codex made no request: {meta.get('error') or meta.get('agent')}")
    body = bodies[0]
    if a.dump:
        Path(a.dump).write_text(json.dumps(body, indent=1))
    req = orig(body)
    total = len(backend.calls[0].prompt_ids)
    no_tools = len(gw.renderer.encode(gw.renderer.render(req.messages, None)))
    names = ",".join(t["name"] for t in req.tools or [])
    parts: list[tuple[str, int]] = [(f"tools ({len(req.tools or [])}: {names})", total - no_tools)]
    for i, m in enumerate(req.messages):
        first = m.content.strip().splitlines()[0][:60] if m.content.strip() else ""
        parts.append((f"input[{i}] {m.role} ({first!r})", len(gw.renderer.encode(m.content))))
    parts.append(("template", no_tools - sum(k for _, k in parts[1:])))
    for name, k in parts:
        print(f"{k:6d}  {name}")
    kinds = [t.get("type") for t in body.get("tools") or []]
    print(f"total {total}  ({a.sandbox} sandbox; body: {len(kinds)} tools {kinds}, {len(json.dumps(body))} chars)")


if __name__ == "__main__":
    main()
