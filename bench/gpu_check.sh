#!/usr/bin/env bash
# The offloading comparison with the CUDA provider, for a machine with an NVIDIA GPU; writes JSON into $1.
# Budget: within 8 minutes. Usage: bash bench/gpu_check.sh OUT_DIR
set -euo pipefail
out="${1:?usage: bench/gpu_check.sh OUT_DIR}"
cd "$(dirname "$0")/.."
python3 -m venv /tmp/specbeam-gpu
. /tmp/specbeam-gpu/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q torch==2.13.0
python -m pip install -q -e ".[export,bench]"
# onnxruntime-gpu ships the same module as onnxruntime: never both in one environment
python -m pip uninstall -q -y onnxruntime
python -m pip install -q "onnxruntime-gpu[cuda,cudnn]"
nvidia-smi --query-gpu=name,memory.total --format=csv > "$out/gpu.txt" || true
timeout 420 python -m bench --scenario offload --provider cuda --out "$out" --quick
