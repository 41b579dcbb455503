# GPU cluster image: CUDA PyTorch base + disttrain, entry point `python -m train`.
#   docker build -t disttrain .
#   docker run --gpus all --ipc=host -v $PWD/outputs:/workspace/disttrain/outputs disttrain hw=8xa100 strategy=fsdp
# The base image brings torch with CUDA and NCCL, so no CPU constraint file here. py-spy hang dumps need
# `--cap-add SYS_PTRACE`.
ARG BASE_IMAGE=pytorch/pytorch:2.9.1-cuda12.8-cudnn9-runtime
FROM ${BASE_IMAGE}

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    WANDB_MODE=offline

RUN apt-get update && apt-get install -y --no-install-recommends git && rm -rf /var/lib/apt/lists/*

WORKDIR /workspace/disttrain
COPY pyproject.toml README.md ./
COPY src ./src
COPY diagnostics ./diagnostics
COPY pipelines ./pipelines
COPY conf ./conf
# Editable install: the pipelines read conf/ from this checkout, and users can mount their own conf/ over it.
RUN pip install -e . && python -c "import train, disttrain, torch; print('torch', torch.__version__)"

ENTRYPOINT ["python", "-m", "train"]
