"""The engine actor's shared-directory check (:func:`vime_core.engines.engine_actor.check_nonce`), exact texts."""

import pytest

from vime_core.engines.engine_actor import check_nonce

pytestmark = pytest.mark.unit


def test_nonce_read_back_is_ok(tmp_path):
    (tmp_path / ".vime-nonce-abc").write_text("abc")
    assert check_nonce(tmp_path / ".vime-nonce-abc", "abc") is None


def test_missing_file_names_the_path(tmp_path):
    path = tmp_path / ".vime-nonce-abc"
    assert check_nonce(path, "abc") == f"cannot read {path}: No such file or directory"


def test_other_content_is_a_different_filesystem(tmp_path):
    path = tmp_path / ".vime-nonce-abc"
    path.write_text("stale")
    assert check_nonce(path, "abc") == f"{path} holds 'stale', not the nonce 'abc' just written"
