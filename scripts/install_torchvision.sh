#!/usr/bin/env bash
# torchvision for vision-language models in a venv whose torch is a CPU build (scripts/install.sh) or PyPI's plain
# build without a GPU (scripts/install_vllm_compat.sh): PyPI's torchvision release of the venv's torch (torch 2.N →
# torchvision 0.(N+15)), without its dependencies, plus the import hook that lets it import beside torch's +cpu build
# (scripts/vime_torchvision_cpu.py, started by a .pth file). transformers builds Qwen-VL processors only with
# torchvision. Idempotent. Usage: bash scripts/install_torchvision.sh VENV
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:?usage: install_torchvision.sh VENV}
tv=$("$VENV/bin/python" -c "import torch; major, minor, patch = torch.__version__.split('+')[0].split('.')[:3]; print(f'0.{int(minor) + 15}.{patch}')")
site=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
cp scripts/vime_torchvision_cpu.py "$site/vime_torchvision_cpu.py"
echo "import vime_torchvision_cpu" > "$site/vime_torchvision_cpu.pth"
if ! "$VENV/bin/python" -c "import torchvision; assert torchvision.__version__.split('+')[0] == '$tv'" >/dev/null 2>&1; then
  "$VENV/bin/python" -m pip install --quiet --progress-bar off --no-deps "torchvision==$tv" 2>&1 | grep -v "^WARNING: Location" || true
fi
"$VENV/bin/python" -c "import torchvision, transformers.models.qwen2_vl.image_processing_qwen2_vl" || {
  echo "install_torchvision.sh: torchvision $tv does not import in $VENV" >&2; exit 1; }
echo "install_torchvision.sh: torchvision $tv in $VENV"
