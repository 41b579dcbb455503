#!/usr/bin/env bash
# Run on a lent GPU machine, in the checkout's root, with .whl/ carried (benchmarks/gpu_wheels.sh made it): installs
# the wheels into /tmp/site, unpacks libaio beside them, prints what the machine is, then runs
# `benchmarks/gpu_suite.py "$@"`. $OUT gets few files (the device tool returns at most 8, 16 MiB each):
# results.json, logs.tar.gz (every command's log) and one torch_extensions_<op>.tar.gz per DeepSpeed JIT op.
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-$PWD/gpu_suite_out}
mkdir -p "$OUT"
logs=/tmp/gpu_suite_logs
mkdir -p "$logs"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl ||
    exit 1
fi
# libaio (DeepSpeed's async I/O for NVMe offload) outside / : headers and the library for its JIT build and load.
for deb in .whl/deb/*.deb; do
  [ -e "$deb" ] && dpkg -x "$deb" /tmp/debroot
done
lib=/tmp/debroot/usr/lib/x86_64-linux-gnu
export CPATH=/tmp/debroot/usr/include${CPATH:+:$CPATH}
export LIBRARY_PATH=$lib${LIBRARY_PATH:+:$LIBRARY_PATH} LD_LIBRARY_PATH=$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export PYTHONPATH=/tmp/site:$PWD/src:$PWD:$PWD/pipelines${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1 PATH=/tmp/site/bin:$PATH
# ZeRO-Infinity's test swaps with O_DIRECT, which a tmpfs /tmp refuses: the checkout's drive instead.
export DISTTRAIN_NVME_DIR=${DISTTRAIN_NVME_DIR:-$PWD/.nvme_swap}
df -hT /tmp "$PWD" | tail -n +2
# DeepSpeed's JIT ops (CPU Adam ~100 s, async I/O) are built once per machine: a window returns each in
# $OUT/torch_extensions_<op>.tar.gz, and the next one starts from them when they are copied into .whl/ and carried.
export TORCH_EXTENSIONS_DIR=/tmp/torch_extensions
mkdir -p "$TORCH_EXTENSIONS_DIR"
for ext in .whl/torch_extensions*.tar.gz; do
  [ -e "$ext" ] && tar -xzf "$ext" -C "$TORCH_EXTENSIONS_DIR"
done
nvidia-smi --query-gpu=name,driver_version,memory.total,power.limit --format=csv,noheader
python3 - <<'EOF'
import torch, lightning, hydra, deepspeed, torchao
print(f"torch {torch.__version__} cuda {torch.version.cuda} lightning {lightning.__version__} hydra {hydra.__version__}"
      f" deepspeed {deepspeed.__version__} torchao {torchao.__version__}")
from deepspeed.ops.op_builder import AsyncIOBuilder, CPUAdamBuilder
print("deepspeed async_io compatible:", AsyncIOBuilder().is_compatible(verbose=True),
      "cpu_adam compatible:", CPUAdamBuilder().is_compatible())
EOF
# Built in the background with the arch list the strategy hands DeepSpeed's JIT builder (it cannot parse entries
# such as 9.0a), so a run finds them built; the runs themselves see the machine's own setting.
# DS_OPS=0: a window that runs no DeepSpeed offload leaves the host's cores to the runs' compiles.
ops=
if [ "${DS_OPS:-1}" != 0 ]; then
  python3 -c "import os
from disttrain.strategies.deepspeed import deepspeed_arch_list
if os.environ.get('TORCH_CUDA_ARCH_LIST'):
    os.environ['TORCH_CUDA_ARCH_LIST'] = deepspeed_arch_list(os.environ['TORCH_CUDA_ARCH_LIST'])
from deepspeed.ops.op_builder import AsyncIOBuilder, CPUAdamBuilder
for b in (CPUAdamBuilder(), AsyncIOBuilder()): b.load()" >"$logs/ds_ops_build.log" 2>&1 &
  ops=$!
fi
python3 benchmarks/gpu_suite.py --out "$logs" "$@"
status=$?
if [ -n "$ops" ]; then
  wait $ops && echo "deepspeed ops built" || echo "deepspeed ops build failed: $(tail -c 600 "$logs/ds_ops_build.log")"
fi
cp "$logs/results.json" "$OUT/" 2>/dev/null
tar -czf "$OUT/logs.tar.gz" -C "$logs" .
for op in "$TORCH_EXTENSIONS_DIR"/*/; do
  [ -d "$op" ] && tar -czf "$OUT/torch_extensions_$(basename "$op").tar.gz" -C "$TORCH_EXTENSIONS_DIR" "$(basename "$op")"
done
exit $status
