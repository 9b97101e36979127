#!/usr/bin/env bash
# Fetch the onnxruntime-gpu wheel for the GPU machines (Python 3.12, x86-64, CUDA 13) on a machine with
# network, and cut it into chunks small enough to travel with one GPU run each. Nothing here is committed:
# bench/gpu/wheel/ and bench/gpu/chunks/ are ignored.
#
#   bash bench/gpu/prepare_wheel.sh               # onnxruntime-gpu 1.31.1 in 56 MiB chunks
#   VERSION=1.25.0 CHUNK_MIB=40 bash bench/gpu/prepare_wheel.sh
#
# A GPU run takes at most 64 MiB of files: the working tree that travels plus the carried chunk, so
# CHUNK_MIB must be at most 64 minus the tree's size (prints both).
set -euo pipefail
cd "$(dirname "$0")"
version="${VERSION:-1.31.1}"
chunk_mib="${CHUNK_MIB:-56}"
python="${PYTHON_VERSION:-3.12}"
rm -rf wheel chunks && mkdir -p wheel chunks
# the GPU machine's interpreter, not this one's: cp312 manylinux wheels whatever Python runs here
python3 -m pip download "onnxruntime-gpu==$version" --no-deps --only-binary=:all: -d wheel -q \
    --python-version "$python" --implementation cp --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
whl="$(ls wheel/*.whl)"
name="$(basename "$whl")"
split -b "${chunk_mib}M" -d -a 2 "$whl" "chunks/$name.part-"
(cd wheel && sha256sum "$name") > chunks/SHA256SUMS
(cd chunks && sha256sum "$name".part-* >> SHA256SUMS)
n=$(ls chunks/"$name".part-* | wc -l)
tree_kib=$(cd .. && cd .. && git ls-files -z --cached --others --exclude-standard | du -ck --files0-from=- 2>/dev/null | tail -1 | cut -f1)
echo "$name: $(du -m "$whl" | cut -f1) MiB in $n chunks of at most $chunk_mib MiB under bench/gpu/chunks/"
echo "the working tree that travels: $((tree_kib / 1024)) MiB; with one chunk: $((tree_kib / 1024 + chunk_mib)) MiB of 64"
if [ $((tree_kib / 1024 + chunk_mib)) -gt 64 ]; then
    echo "too large for one GPU run: lower CHUNK_MIB, or make the tree smaller (see README, GPU)" >&2
fi
