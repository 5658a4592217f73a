"""Finding the ``vllm-router`` console script: one whose ``#!`` names a Python that does not exist here (installed
with ``pip --target`` on another machine, as for the offline GPU site of docs/gpu.md) is refused with its name and
the missing interpreter, not left to fail at start with a bare ``No such file or directory``."""

from __future__ import annotations

import sys

import pytest

from vime_core.engines import router

pytestmark = pytest.mark.unit


def _script(tmp_path, shebang: str):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "vllm-router"
    script.write_text(f"{shebang}\nimport sys\n")
    script.chmod(0o755)
    return bin_dir, script


def test_a_script_whose_interpreter_is_missing_is_refused_naming_both(tmp_path, monkeypatch):
    bin_dir, script = _script(tmp_path, "#!/nonexistent/build-host/bin/python3.12")
    monkeypatch.setenv("PATH", str(bin_dir))
    monkeypatch.setattr(sys, "executable", str(tmp_path / "elsewhere" / "python3"))
    with pytest.raises(FileNotFoundError) as e:
        router.router_executable()
    assert str(e.value) == (
        f"{script}: its interpreter /nonexistent/build-host/bin/python3.12 does not exist on this machine "
        "(installed by another Python, e.g. pip --target elsewhere): reinstall vllm-router here, or rewrite its "
        f"first line to #!{tmp_path / 'elsewhere' / 'python3'}"
    )


def test_a_script_with_a_present_interpreter_is_used(tmp_path, monkeypatch):
    bin_dir, script = _script(tmp_path, f"#!{sys.executable}")
    monkeypatch.setenv("PATH", str(bin_dir))
    monkeypatch.setattr(sys, "executable", str(tmp_path / "elsewhere" / "python3"))
    assert router.router_executable() == str(script)
