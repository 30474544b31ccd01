# FreeToken operator image: kopf + the kubernetes client, no torch.
# Build from the repository root:  docker build -f docker/operator.Dockerfile -t ghcr.io/freetoken/freetoken-operator:0.1.0 .
# UNTESTED BUILD: no Docker engine was available where this was written (see docs/operator.md).
FROM python:3.11-slim

ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="freetoken-operator" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0"

ENV PYTHONSAFEPATH=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /opt/freetoken
COPY pyproject.toml README.md ./
COPY engine/ engine/
COPY node_agent/ node_agent/
COPY operator/ operator/

# The project's own code without its dependency list (which pulls torch), then only what the
# operator imports; the last two commands fail the build if torch slipped in.
RUN pip install --no-deps . \
 && pip install "kopf>=1.37" "kubernetes>=29" "pyyaml>=6" \
 && python -c "import freetoken_operator.handlers" \
 && ! python -c "import torch" 2>/dev/null

RUN useradd --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin freetoken
USER 10001:10001

EXPOSE 8080
ENTRYPOINT ["freetoken-operator"]
CMD ["--liveness=http://0.0.0.0:8080/healthz"]
