#!/usr/bin/env python3
"""Build a wheelhouse of ``vime[gpu]`` for an offline GPU machine, and install from it there.

Air-gapped clusters (and this project's GPU machine) have a Python with torch and CUDA but no package index. On a
machine with the index::

    python3.12 scripts/gpu_wheelhouse.py build DIR [--python-version 3.12] [--platform manylinux_2_28_x86_64]
        [--have FREEZE.txt] [--extra gpu]

(run with a Python of the target's version: pip checks ``Requires-Python`` against the running interpreter)

resolves ``vime[gpu]`` (this checkout, built as a wheel) for the target's Python and platform with pip's own
resolver (``pip install --dry-run --report``, binary wheels only), keeps what the target already has (``--have``:
its ``pip freeze``: torch and its companions are pinned to it — local version labels are ignored, so vLLM's
``torch==2.11.0`` pin is met by 2.11.0+cu130 and nothing replaces the cluster's torch — and a package the resolution
picks at the target's version is not downloaded), downloads the rest (``pip download --no-deps``) into ``DIR`` and
writes ``DIR/requirements.txt`` (every wheel, pinned) and ``DIR/resolve.json``. Copy ``DIR`` over, then on the
target::

    python3 scripts/gpu_wheelhouse.py install DIR [--target SITE]

(``pip install --no-index --no-deps --find-links DIR -r DIR/requirements.txt``; ``--target`` for a directory to put on
``PYTHONPATH`` instead of the environment). The tested combination is in docs/gpu.md.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: a glibc 2.35 x86-64 Linux: pip matches a wheel's platform tag exactly, so every manylinux level up to it is listed
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in range(35, 16, -1)] + ["manylinux2014_x86_64", "manylinux1_x86_64"]


def _pip(*args: str, capture: bool = False) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pip", *args]
    proc = subprocess.run(cmd, capture_output=capture, text=True)
    if proc.returncode != 0:
        err = (proc.stderr or "")[-4000:] if capture else ""
        sys.exit(f"gpu_wheelhouse: {' '.join(cmd[:6])} ... failed (exit {proc.returncode})\n{err}")
    return proc


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_have(path: Path | None) -> dict[str, str]:
    """``{normalized name: version without local label}`` of a ``pip freeze`` file (``name==version`` lines)."""
    if path is None:
        return {}
    have = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if "==" in line and not line.startswith("#"):
            name, version = line.split("==", 1)
            have[_norm(name)] = version.split("+", 1)[0].strip()
    return have


def _pinned(name: str, keep: str) -> bool:
    """Whether the target's version of ``name`` must stay (``--keep``: comma-separated names, ``*`` suffix allowed)."""
    return any(name == k or (k.endswith("*") and name.startswith(k[:-1])) for k in map(_norm, keep.split(",")))


def build(args: argparse.Namespace) -> None:
    running = f"{sys.version_info[0]}.{sys.version_info[1]}"
    if running != args.python_version:  # pip's dry run checks Requires-Python against the running interpreter
        sys.exit(f"gpu_wheelhouse: run this with Python {args.python_version} (the target's), not {running}")
    out = Path(args.dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        _pip("wheel", "--quiet", "--no-deps", "-w", tmp, str(ROOT))
        (wheel,) = Path(tmp).glob("vime-*.whl")
        target = [a for p in args.platform for a in ("--platform", p)]
        target += ["--python-version", args.python_version, "--implementation", "cp", "--only-binary=:all:"]
        have = read_have(args.have)
        constraints = Path(tmp) / "have.txt"  # the target's torch stays as it is; the rest may move
        constraints.write_text("".join(f"{n}=={v}\n" for n, v in have.items() if _pinned(n, args.keep)))
        report = out / "resolve.json"
        _pip(
            "install",
            "--quiet",
            "--dry-run",
            "--ignore-installed",
            "--target",
            str(Path(tmp) / "t"),
            *target,
            "--report",
            str(report),
            "-c",
            str(constraints),
            f"{wheel}[{args.extra}]",
            capture=True,
        )
        picked = [(i["metadata"]["name"], i["metadata"]["version"]) for i in json.loads(report.read_text())["install"]]
        needed = [(n, v) for n, v in picked if have.get(_norm(n)) != v.split("+", 1)[0] and _norm(n) != "vime"]
        reqs = Path(tmp) / "needed.txt"
        reqs.write_text("".join(f"{n}=={v}\n" for n, v in needed))
        if needed:
            _pip("download", "--quiet", "--no-deps", *target, "-d", str(out), "-r", str(reqs))
        (out / wheel.name).write_bytes(wheel.read_bytes())
    lines = [f"{n}=={v}" for n, v in needed] + [f"vime[{args.extra}] @ file:./{wheel.name}"]
    (out / "requirements.txt").write_text("\n".join(lines) + "\n")
    kept = sorted(n for n, v in picked if have.get(_norm(n)) == v.split("+", 1)[0])
    size = sum(f.stat().st_size for f in out.glob("*.whl")) / 2**20
    print(f"gpu_wheelhouse: {len(needed)} wheels + vime in {out} ({size:.0f} MiB); kept from the target: {kept}")


def install(args: argparse.Namespace) -> None:
    where = Path(args.dir).resolve()
    reqs = (where / "requirements.txt").read_text().replace("file:./", f"file://{where}/")
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(reqs)
    extra = ["--target", args.target] if args.target else []
    # --no-deps: the build resolved the whole closure against the target's packages
    _pip("install", "--no-index", "--no-deps", "--find-links", str(where), *extra, "-r", f.name)
    print(f"gpu_wheelhouse: installed from {where}" + (f" into {args.target} (put it on PYTHONPATH)" if extra else ""))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="resolve and download the wheels (needs the package index)")
    b.add_argument("dir")
    b.add_argument("--python-version", default="3.12", help="the target's Python (default 3.12)")
    b.add_argument(
        "--platform", action="append", default=None, help="pip platform tags (default: manylinux 2_17 … 2_35 x86-64)"
    )
    b.add_argument("--have", type=Path, default=None, help="the target's `pip freeze` (kept as it is)")
    b.add_argument("--extra", default="gpu", help="vime's extra to install (default gpu)")
    b.add_argument(
        "--keep",
        default="torch,torchvision,torchaudio,triton",
        help="packages of --have whose version must not change (default: torch and its companions; the CUDA "
        "libraries follow torch's own pins); the others are taken from the target where the resolution picks the "
        "same version, else downloaded",
    )
    i = sub.add_parser("install", help="install from the wheelhouse (no index)")
    i.add_argument("dir")
    i.add_argument("--target", default=None, help="install into this directory (PYTHONPATH) instead")
    args = p.parse_args(argv)
    if args.cmd == "build":
        args.platform = args.platform or PLATFORMS
        build(args)
    else:
        install(args)


if __name__ == "__main__":
    main()
