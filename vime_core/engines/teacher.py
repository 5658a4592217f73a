"""The teacher engine group of on-policy distillation (``--distill-teacher``): its own vLLM servers behind its own
vllm-router, started next to the policy engines by the rollout manager and never updated.

:meth:`TeacherEngines.score` prefills each scored sample's prompt + response with ``prompt_logprobs`` and stores the
teacher's log-prob of each response token in ``Sample.teacher_log_probs`` (:mod:`vime_core.algorithms.distill` makes
the advantage); the teacher must share the policy's tokenizer (:func:`check_same_tokenizer`). Details:
docs/algorithms.md, "On-policy distillation".
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

from vime_core.config import EngineConfig
from vime_core.engines.client import RouterClient, eos_token_ids
from vime_core.engines.engine import VLLMServer
from vime_core.engines.engine_api import enforce_eager, engine_dtype
from vime_core.engines.router import VLLMRouter
from vime_core.models import resolve_model
from vime_core.types import Sample

logger = logging.getLogger("vime.rollout")

TEACHER_MODEL_NAME = "teacher"


def resolve_teacher(name_or_path: str) -> Path:
    """The teacher's HF directory from ``--distill-teacher`` (a directory or a known model name).

    :raises ValueError: naming ``--distill-teacher`` if it is neither.
    """
    try:
        return resolve_model(name_or_path)
    except Exception as e:  # noqa: BLE001 - re-raised with the flag named
        raise ValueError(f"--distill-teacher {name_or_path}: {e}") from e


def check_same_tokenizer(teacher_path: Path, policy_tokenizer: Any) -> None:
    """:raises ValueError: if the teacher's vocabulary (token → id) differs from the policy's."""
    from transformers import AutoTokenizer

    teacher_vocab = AutoTokenizer.from_pretrained(str(teacher_path)).get_vocab()
    policy_vocab = policy_tokenizer.get_vocab()
    if teacher_vocab != policy_vocab:
        diff = len(set(teacher_vocab.items()) ^ set(policy_vocab.items()))
        raise ValueError(
            f"--distill-teacher {teacher_path}: its tokenizer differs from the policy's ({len(teacher_vocab)} vs "
            f"{len(policy_vocab)} tokens, {diff} differing entries); on-policy distillation scores the student's "
            "token ids with the teacher, so both must share one tokenizer"
        )


class TeacherEngines:
    """``--distill-num-engines`` vLLM servers of the teacher (served as ``teacher``) behind a vllm-router.

    Engine flags are the policy's (``--vllm-*``, the trainer dtype, ``--rollout-enforce-eager``,
    ``--rollout-kv-cache-gib``), so the teacher fits the sequences the policy produces; ``--router-*`` flags are
    forwarded to its router too.

    :param cfg: the engine flags (``--distill-teacher``, ``--distill-num-engines`` and the policy engines' flags).
    :param policy_tokenizer: the policy's tokenizer (the teacher's must equal it).
    :param log_dir: where ``vllm_teacher_{i}.log`` and ``teacher_router.log`` go.
    :raises ValueError: if ``--distill-teacher`` is not a model or its tokenizer differs.
    """

    def __init__(self, cfg: EngineConfig, policy_tokenizer: Any, log_dir: Path) -> None:
        self.config = cfg
        self.path = resolve_teacher(cfg.distill_teacher)
        check_same_tokenizer(self.path, policy_tokenizer)
        self.tokenizer = policy_tokenizer  # equal to the teacher's (checked)
        self.log_dir = Path(log_dir)
        vllm_args = list(cfg.vllm_args) + engine_dtype(cfg.vllm_args, cfg.train_dtype, on_gpu=False)
        self.engines = [
            VLLMServer(
                self.path,
                served_model_name=TEACHER_MODEL_NAME,
                enforce_eager=enforce_eager(cfg.rollout_enforce_eager, on_gpu=False),
                extra_args=vllm_args + ["--seed", str(cfg.seed + 1000 + i)],
                kv_cache_space_gib=cfg.rollout_kv_cache_gib,
                # vLLM's default binding puts every server's worker on core 0, next to the policy's
                omp_threads_bind="nobind",
                log_path=self.log_dir / f"vllm_teacher_{i}.log",
                request_timeout_s=cfg.weight_sync_timeout,
            )
            for i in range(cfg.distill_num_engines)
        ]
        self.router: Any = None
        self.client: Any = None

    def start(self) -> None:
        """Start the teacher servers (returns at once; :meth:`wait_ready` finishes the start)."""
        for engine in self.engines:
            engine.start()

    def wait_ready(self, timeout_s: float) -> str:
        """Wait for the servers, then start the teacher's router and client.

        :return: the teacher router's URL.
        :raises RuntimeError / TimeoutError: a server or the router did not become ready (with its log tail).
        """
        for engine in self.engines:
            engine.wait_ready(timeout_s=timeout_s)
        self.router = VLLMRouter(
            [e.url for e in self.engines],
            extra_args=list(self.config.router_args),
            log_path=self.log_dir / "teacher_router.log",
        )
        self.router.start()
        self.router.wait_ready(timeout_s=120)
        self.client = RouterClient(
            self.router.url,
            model=TEACHER_MODEL_NAME,
            timeout_s=600,
            eos_token_ids=eos_token_ids(self.tokenizer),
            capabilities=self.engines[0].capabilities,
            tokenizer=self.tokenizer,
        )
        logger.info("teacher %s: router %s → engines %s", self.path, self.router.url, [e.url for e in self.engines])
        return self.router.url

    async def score(self, samples: list[Sample]) -> None:
        """Set ``teacher_log_probs`` of each sample: the teacher's log-prob of every response token given the prompt
        and the response tokens before it (``[response_length]`` floats; ``[]`` for an empty response).

        :raises RouterClientError / httpx.HTTPError: the teacher did not answer (the sample then fails).
        """

        async def one(s: Sample) -> None:
            if s.response_length == 0:
                s.teacher_log_probs = []
                return
            lps = await self.client.prompt_log_probs(list(s.tokens))  # log p(tokens[i] | tokens[:i]), i >= 1
            s.teacher_log_probs = lps[len(lps) - s.response_length :]

        await asyncio.gather(*(one(s) for s in samples))

    def shutdown(self, loop: asyncio.AbstractEventLoop) -> None:
        """Close the client, stop the router and every server; never raises."""
        if self.client is not None:
            try:
                loop.run_until_complete(self.client.aclose())
            except Exception:  # noqa: BLE001
                logger.exception("closing the teacher client")
        if self.router is not None:
            try:
                self.router.stop()
            except Exception:  # noqa: BLE001
                logger.exception("stopping the teacher router")
        for e in self.engines:
            try:
                e.stop()
            except Exception:  # noqa: BLE001
                logger.exception("stopping teacher engine %s", getattr(e, "url", "?"))
