#!/usr/bin/env bash
# Run here (a machine with package registries), before a lent GPU window: the packages disttrain needs that the
# GPU machine's image lacks (it has torch, Lightning, transformers, NVML, TensorBoard; no Hydra, Optuna, DeepSpeed,
# torchao, py-spy), as wheels for its Python 3.12 into .whl/ (ignored by git; the window carries it), plus libaio
# (.whl/deb/) for DeepSpeed's async I/O op, which NVMe offload compiles at launch.
#
#     bash benchmarks/gpu_wheels.sh && <device run, carry .whl>: bash benchmarks/gpu_window.sh [gpu_suite.py args]
set -euo pipefail
cd "$(dirname "$0")/.."
PIP=${PIP:-.venv/bin/pip}
grep -qx "/.whl/" .git/info/exclude 2>/dev/null || echo "/.whl/" >>.git/info/exclude
mkdir -p .whl/deb
platforms=()
for p in manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux_2_5 manylinux1; do
  platforms+=(--platform "${p}_x86_64")
done
# Binary wheels for the GPU image's interpreter (cp312), versions as this checkout's venv resolves them.
binary=(hydra-core omegaconf optuna colorlog SQLAlchemy alembic Mako greenlet submitit hydra-submitit-launcher hjson
  pydantic pydantic_core annotated-types typing-inspection torchao py-spy datasets dill multiprocess)
pins=()
for name in "${binary[@]}"; do
  version=$("$PIP" show "$name" 2>/dev/null | awk '/^Version:/ {print $2}')
  pins+=("$name${version:+==$version}")
done
"$PIP" download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
  -d .whl "${pins[@]}"
# Source-only distributions (pure Python), built here without build isolation (DeepSpeed's setup imports torch).
source_only=()
for name in antlr4-python3-runtime deepspeed; do
  version=$("$PIP" show "$name" 2>/dev/null | awk '/^Version:/ {print $2}')
  source_only+=("$name${version:+==$version}")
done
"$PIP" wheel -q --no-deps --no-build-isolation -w .whl "${source_only[@]}"
(cd .whl/deb && apt-get download libaio1 libaio-dev 2>/dev/null || apt-get download libaio1t64 libaio-dev)
du -sh .whl
