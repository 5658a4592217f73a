"""A bad ``--vllm-*`` value fails in milliseconds (issue 35, part 2): the value rules of vLLM's server flags are
read from its parser once per release and cached (:func:`vime_core.config.passthrough.vllm_flag_values`); a value they
decide is checked without importing vLLM (15-20 s on 2 cores). The verdicts and messages are compared with vLLM's
own parser, run on the same values in one subprocess."""

from __future__ import annotations

import json
import subprocess

import pytest

from vime_core.config.errors import ArgumentError
from vime_core.config.passthrough import cheap_value_error, engine_python, vllm_flag_values
from vime_core.run.preflight import check_vllm_values, forwarded_flags

pytestmark = pytest.mark.unit

CASES = [
    ("max-model-len", "512"),
    ("max-model-len", "auto"),
    ("max-model-len", "-1"),
    ("max-model-len", "1k"),
    ("max-model-len", "2K"),
    ("max-model-len", "25.6k"),
    ("max-model-len", "1.5K"),
    ("max-model-len", "banana"),
    ("max-num-batched-tokens", "2k"),
    ("max-num-batched-tokens", "auto"),
    ("dtype", "half"),
    ("dtype", "fp99"),
    ("gpu-memory-utilization", "0.5"),
    ("gpu-memory-utilization", "lots"),
    ("max-num-seqs", "4"),
    ("max-num-seqs", "1.5"),
    ("max-lora-rank", "8"),
    ("max-lora-rank", "7"),
    ("quantization", "None"),
    ("seed", "x"),
]

#: vLLM's own parser on every case, in one interpreter (one import of vLLM)
PARSE_ALL = r"""
import json, sys
from vllm.utils.argparse_utils import FlexibleArgumentParser
try:
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
except ImportError:
    from vllm.entrypoints.openai.cli_args import make_arg_parser
class Refused(Exception):
    pass
class Parser(FlexibleArgumentParser):
    def error(self, message):
        raise Refused(message)
out = []
for flag, value in json.loads(sys.argv[1]):
    try:
        make_arg_parser(Parser()).parse_args([f"--{flag}", value])
        out.append(None)
    except Refused as e:
        out.append(str(e))
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def rules():
    return vllm_flag_values(engine_python())


def test_the_cached_rules_decide_as_vllms_parser_does(rules):
    proc = subprocess.run([engine_python(), "-c", PARSE_ALL, json.dumps(CASES)], capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    vllm = json.loads(proc.stdout.strip().splitlines()[-1])
    for (flag, value), theirs in zip(CASES, vllm, strict=True):
        assert cheap_value_error(flag, value, rules[flag]) == theirs, (flag, value)


def test_the_common_flags_are_decided_without_vllm(rules):
    for flag in ("max-model-len", "gpu-memory-utilization", "dtype", "max-num-seqs", "enforce-eager", "kv-cache-dtype",
                 "block-size", "max-num-batched-tokens", "enable-prefix-caching", "seed", "swap-space"):  # fmt: skip
        if flag in rules:
            assert rules[flag]["type"] != "other", flag


def test_a_bad_vllm_value_is_refused_without_importing_vllm(monkeypatch):
    """The subprocess that imports vLLM is not run for values the rules decide (it would fail this test)."""

    def no_vllm_import(*a, **k):
        raise AssertionError("vLLM's parser was run")

    monkeypatch.setattr("vime_core.run.preflight.subprocess.run", no_vllm_import)
    with pytest.raises(ArgumentError) as e:
        check_vllm_values(["--max-model-len", "banana"])
    assert str(e.value) == "vLLM refuses argument --vllm-max-model-len: invalid human_readable_int_or_auto value: " \
        "'banana'"  # fmt: skip
    with pytest.raises(ArgumentError) as e:
        check_vllm_values(["--dtype=fp99"])
    assert str(e.value) == (
        "vLLM refuses argument --vllm-dtype: invalid choice: 'fp99' (choose from 'auto', 'bfloat16', 'float', "
        "'float16', 'float32', 'half')"
    )
    check_vllm_values(["--max-model-len", "1024", "--enforce-eager", "--dtype", "float32"])  # all decided: passes


def test_forwarded_flags_pairs_names_and_values():
    assert forwarded_flags(["--max-model-len", "512", "--enforce-eager", "--dtype=half", "--x", "a", "b"]) == [
        ("max-model-len", ["512"]),
        ("enforce-eager", []),
        ("dtype", ["half"]),
        ("x", ["a", "b"]),
    ]
