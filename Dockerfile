# GPU cluster image: Python + the torch the test suite runs (2.13.0) + disttrain, entry point `python -m train`.
#   docker build -t disttrain .
#   docker run --gpus all --ipc=host -v $PWD/outputs:/workspace/disttrain/outputs disttrain hw=8xa100 strategy=fsdp
# No pytorch/pytorch base: no tag of it with torch 2.13.0 could be verified from where this was written, and the
# image must run the torch the suite tests. The Linux torch wheel on PyPI is the CUDA build: it brings CUDA, cuDNN
# and NCCL as pip packages (the host needs only the NVIDIA driver and container toolkit). py-spy hang dumps need
# `--cap-add SYS_PTRACE`.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
FROM ${PYTHON_IMAGE}
ARG TORCH_VERSION=2.13.0

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    WANDB_MODE=offline

# git: run.json records the commit; g++: DeepSpeed JIT-compiles its ops on first use on GPUs.
RUN apt-get update && apt-get install -y --no-install-recommends git g++ && rm -rf /var/lib/apt/lists/*

WORKDIR /workspace/disttrain
# torch first, pinned as in .ci/run (there through constraints-cpu.txt): the dependencies below must not move it.
RUN pip install "torch==${TORCH_VERSION}"
COPY pyproject.toml README.md ./
COPY src ./src
COPY diagnostics ./diagnostics
COPY pipelines ./pipelines
COPY conf ./conf
# Editable install: the pipelines read conf/ from this checkout, and users can mount their own conf/ over it.
RUN echo "torch==${TORCH_VERSION}" > /tmp/torch.txt && pip install -c /tmp/torch.txt -e . \
    && python -c "import train, disttrain, torch; assert torch.__version__.split('+')[0] == '${TORCH_VERSION}', torch.__version__; print('torch', torch.__version__)"

ENTRYPOINT ["python", "-m", "train"]
