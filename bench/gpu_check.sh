#!/usr/bin/env bash
# The GPU check, for a machine with an NVIDIA GPU, CUDA 13, Python 3.12 with torch, and no network. It installs
# onnxruntime-gpu from wheel chunks carried with the working tree, then runs within 8 minutes: the CUDA
# placement and exactness tests (SPECBEAM_PROVIDER=cuda), the cost curve by tree size, and the e2e and offload
# benchmarks at the realistic scale (a random 16x1024 Llama), quick settings. README, "GPU", says how to carry it.
#
#   bash bench/gpu_check.sh OUT_DIR
#
# One call per chunk: each call hash-checks the chunks it carries into bench/gpu/staged/ (ignored, so it stays
# while the machine stays up) and exits 3 naming the next chunk to carry; the call that completes the set
# reassembles the wheel, checks its hash, installs it into bench/gpu/site/ and runs the checks. Exit 0 when every
# stage passed, 1 when one failed (OUT_DIR/summary.txt says which), 2 on a bad setup, 3 while chunks are missing.
# OUT_DIR gets at most 6 files: summary.txt, check.log and one JSON per benchmark stage.
set -uo pipefail
out="${1:?usage: bench/gpu_check.sh OUT_DIR}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
cd "$(dirname "$0")/.."
g=bench/gpu
mkdir -p "$g/staged"

# 1. stage the carried chunks (a chunk is kept only if its hash matches the one prepare_wheel.sh recorded)
if [ -f "$g/chunks/SHA256SUMS" ]; then
    cp "$g/chunks/SHA256SUMS" "$g/staged/SHA256SUMS"
fi
sums="$PWD/$g/staged/SHA256SUMS"
[ -f "$sums" ] || { echo "no bench/gpu/chunks/SHA256SUMS: run bench/gpu/prepare_wheel.sh and carry it" >&2; exit 2; }
wheel="$(awk 'NR == 1 {print $2}' "$sums")"
mapfile -t parts < <(awk 'NR > 1 {print $2}' "$sums")
for p in "${parts[@]}"; do
    if [ -f "$g/chunks/$p" ] && [ ! -f "$g/staged/$p" ]; then
        if (cd "$g/chunks" && grep " $p\$" ../staged/SHA256SUMS | sha256sum -c --quiet); then
            cp "$g/chunks/$p" "$g/staged/$p"
        else
            echo "$p: hash mismatch, not staged (carry it again)" >&2
        fi
    fi
done
missing=()
for p in "${parts[@]}"; do [ -f "$g/staged/$p" ] || missing+=("$p"); done
if [ ! -f "$g/site/.installed-$wheel" ] && [ ${#missing[@]} -gt 0 ]; then
    echo "staged $(( ${#parts[@]} - ${#missing[@]} )) of ${#parts[@]} chunks of $wheel; carry next: bench/gpu/chunks/${missing[0]}" | tee "$out/summary.txt"
    exit 3
fi

# 2. install: reassemble, check the wheel's hash, install beside (and ahead of) the machine's CPU onnxruntime
if [ ! -f "$g/site/.installed-$wheel" ]; then
    tmp="$(mktemp -d)"
    for p in "${parts[@]}"; do cat "$g/staged/$p"; done > "$tmp/$wheel"
    (cd "$tmp" && grep " $wheel\$" "$sums" | sha256sum -c --quiet) || { echo "$wheel: hash mismatch after reassembly" >&2; exit 2; }
    rm -rf "$g/site"
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$g/site" "$tmp/$wheel" || exit 2
    touch "$g/site/.installed-$wheel"
    rm -rf "$tmp"
fi
# onnxruntime-gpu and onnxruntime are the same module: the one in bench/gpu/site comes first on the path
export PYTHONPATH="$PWD/$g/site:$PWD"
# the CUDA 13 and cuDNN 9 libraries of the machine's nvidia-* packages (torch's), for the CUDA provider to load
purelib="$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
libs="$(find "$purelib/nvidia" -name 'lib*.so*' -printf '%h\n' 2>/dev/null | sort -u | paste -sd: -)"
export LD_LIBRARY_PATH="${libs}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export SPECBEAM_PROVIDER=cuda PYTHONUNBUFFERED=1

# 3. the checks, each under its own limit (together 460 s); every session is a CUDA session that refuses CPU fallback
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || echo "nvidia-smi failed"
  python3 -c 'import onnxruntime as o; print("onnxruntime", o.__version__, o.__file__, o.get_available_providers())'
} > "$out/summary.txt" 2>&1
failed=0
stage() {  # stage NAME SECONDS COMMAND...: its output to check.log, its status and time to summary.txt
    local name=$1 limit=$2 t0=$SECONDS rc
    shift 2
    echo "=== $name (limit $limit s): $*" >> "$out/check.log"
    timeout "$limit" "$@" >> "$out/check.log" 2>&1
    rc=$?
    [ $rc -eq 0 ] || failed=1
    echo "$name: exit $rc$([ $rc -eq 124 ] && echo ' (time limit)') in $((SECONDS - t0)) s" | tee -a "$out/summary.txt"
}
stage probe 70 python3 -m bench.gpu.check probe "$out"
stage tests 110 python3 -m pytest -q -rfE -m "not slow" -p no:cacheprovider tests/test_providers.py \
    tests/test_speculative.py tests/test_beam.py tests/test_topk.py tests/test_offload.py tests/test_resident.py tests/test_fp16_compute.py
stage cost 100 python3 -m bench.gpu.check cost "$out"
stage e2e 60 python3 -m bench.gpu.check e2e "$out"
stage offload 80 python3 -m bench.gpu.check offload "$out"
stage kv 40 python3 -m bench.gpu.check kv "$out"
grep -hE "q64_over_q1|^(cost|synthetic|scale|kv)" "$out/check.log" | tail -n 9 >> "$out/summary.txt"
exit $failed
