# FreeToken node agent with the engine (one image: the agent starts `freetoken serve` processes).
# Build from the repository root:  docker build -f docker/agent.Dockerfile -t ghcr.io/freetoken/freetoken-agent:0.1.0 .
# UNTESTED BUILD: no Docker engine was available where this was written (see docs/operator.md).
# Runs with the NVIDIA container toolkit (RuntimeClass "nvidia"), which mounts the driver and NVML.
FROM nvidia/cuda:12.8.1-runtime-ubuntu24.04

ARG VERSION=0.1.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128
LABEL org.opencontainers.image.title="freetoken-agent" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0"

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONSAFEPATH=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH

# g++: the engine builds its CPU expert kernel on first use.
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev g++ ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/venv

WORKDIR /opt/freetoken
COPY pyproject.toml README.md ./
COPY engine/ engine/
COPY node_agent/ node_agent/
COPY operator/ operator/

# torch from the CUDA wheel index first, so the project's "torch>=2.4" is already satisfied.
RUN pip install torch --index-url "${TORCH_INDEX}" \
 && pip install ".[triton]" \
 && python -c "import freetoken_agent.cli, freetoken_engine"

RUN useradd --uid 10001 --user-group --create-home --shell /usr/sbin/nologin freetoken
USER 10001:10001

EXPOSE 9400
ENTRYPOINT ["freetoken-agent"]
CMD ["run"]
