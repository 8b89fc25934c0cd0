# The kvpilot engine: `kvpilot serve` on NVIDIA GPUs. Build from the repository root:
#   docker build -f images/engine.Dockerfile -t ghcr.io/kvpilot/kvpilot-engine:0.1.0 .
# The operator runs it as UID 1000 with no privileges (see operator/render.py).
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04
FROM ${CUDA_IMAGE}

ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev build-essential ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/venv

# torch first, from the CUDA index, so that resolving kvpilot's dependencies keeps this build.
RUN pip install --index-url ${TORCH_INDEX} torch
WORKDIR /src
COPY pyproject.toml README.md ./
COPY engine engine
COPY kernels kernels
COPY operator operator
# `hf download` (huggingface_hub) fetches models in the download-model init container.
RUN pip install . "huggingface_hub>=0.34" && rm -rf /src

RUN useradd --uid 1000 --user-group --create-home --home-dir /home/kvpilot kvpilot \
 && mkdir -p /models && chown 1000:1000 /models
USER 1000:1000
ENV HOME=/home/kvpilot HF_HOME=/models/.cache/huggingface
WORKDIR /home/kvpilot
EXPOSE 8000
CMD ["kvpilot", "serve", "--help"]
