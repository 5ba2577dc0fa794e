# syntax=docker/dockerfile:1
# The batcher image: one image for cells (`batcher serve`) and gateways (`batcher gateway`),
# the command chosen by the pod (deploy/kubernetes/). Build it with the extras it needs:
#
#     docker build -t batcher:0.1.0 .                                   # gateway (the default)
#     docker build -t batcher:0.1.0-onnx --build-arg EXTRAS=gateway,onnx .
#
# The install steps are README.md's "Container image" ones (tests/test_deploy.py checks).
# On a GPU node, a cell needs a CUDA-capable onnxruntime-gpu in EXTRAS' place and the
# NVIDIA device plugin on the node (docs/kubernetes.md).

ARG PYTHON_VERSION=3.12

# --- build: a virtual environment holding batcher and its extras ------------------------
FROM python:${PYTHON_VERSION}-slim AS build
ARG EXTRAS=gateway
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY batcher ./batcher
COPY workers ./workers
RUN python3 -m venv /opt/batcher
RUN /opt/batcher/bin/pip install ".[${EXTRAS}]"

# --- run: the environment alone, as a user without privileges ---------------------------
FROM python:${PYTHON_VERSION}-slim
ARG EXTRAS=gateway
LABEL org.opencontainers.image.title="batcher" \
      org.opencontainers.image.description="A dynamic-batching inference broker over ZeroMQ and msgpack, with an Open Inference Protocol gateway" \
      org.opencontainers.image.version="0.1.0" \
      org.opencontainers.image.licenses="MIT" \
      org.opencontainers.image.documentation="docs/kubernetes.md" \
      org.opencontainers.image.base.name="docker.io/library/python:${PYTHON_VERSION}-slim" \
      io.batcher.extras="${EXTRAS}"
RUN groupadd --system --gid 10001 batcher \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin batcher
COPY --from=build /opt/batcher /opt/batcher
ENV PATH=/opt/batcher/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
USER 10001:10001
WORKDIR /tmp
# 5555 the broker's frontend, 9090 its metrics; 8000 and 8001 the gateway's HTTP and gRPC.
EXPOSE 5555 8000 8001 9090
# A cell is healthy once every configured model has a worker (`batcher ready` asks the
# broker on its default frontend, tcp://127.0.0.1:5555, in plaintext: the default CMD's
# cell). Kubernetes ignores HEALTHCHECK and uses the pods' probes instead (with the
# cell's CurveZMQ keys); a gateway or a CurveZMQ cell run alone overrides it.
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s --retries=3 \
  CMD ["batcher", "ready", "--timeout-s", "3"]
ENTRYPOINT ["batcher"]
CMD ["serve", "--frontend", "tcp://0.0.0.0:5555", "--backend", "tcp://127.0.0.1:5556", "--metrics-port", "9090", "--metrics-host", "0.0.0.0"]
