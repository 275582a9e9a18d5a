# tqmon sidecar image (docs/deploy.md). Two variants, chosen with build arguments:
#   default:                          log, JSONL, checkpoint and event-API sources; no Ray, no torch.
#   --build-arg TQMON_EXTRAS=tq:      also the live TransferQueue source (Ray, TransferQueue, CPU torch).
#     Its Ray and Python must match the trainer cluster's exactly (a Ray driver refuses other versions):
#     set BASE_IMAGE to the cluster's Python, and TORCH_VERSION / TORCH_INDEX_URL to the trainer's torch.
#     Installing tqmon into the trainer's own image (`pip install tqmon[tq]`) matches them by construction.
#   --build-arg TQMON_EXTRAS=otel (or tq,otel): also OTLP push (--otlp-endpoint / TQMON_OTLP_ENDPOINT).
ARG BASE_IMAGE=python:3.11-slim
# checkov:skip=CKV_DOCKER_7:The tag is in BASE_IMAGE's default (python:3.11-slim); checkov cannot resolve build arguments

FROM ${BASE_IMAGE} AS build
# A package index other than PyPI (e.g. a mirror), passed through to pip; unset unless given.
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ARG PIP_TRUSTED_HOST
ARG PIP_FIND_LINKS
WORKDIR /src
COPY pyproject.toml README.md ./
COPY tqmon ./tqmon
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM ${BASE_IMAGE}
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ARG PIP_TRUSTED_HOST
ARG PIP_FIND_LINKS
ARG TQMON_EXTRAS=""
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="tqmon" \
      org.opencontainers.image.description="Prometheus exporter sidecar for verl V1 async training: TransferQueue prefetch window and resume warmup" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.source="https://github.com/tqmon/tqmon" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=build /wheels /tmp/wheels
# torch first and from its CPU index: transferqueue depends on torch, and PyPI's build pulls in CUDA (GBs).
RUN if [ "${TQMON_EXTRAS}" != "${TQMON_EXTRAS#tq}" ]; then \
      pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"; \
    fi \
    && pip install --no-cache-dir "/tmp/wheels/tqmon-${VERSION}-py3-none-any.whl${TQMON_EXTRAS:+[${TQMON_EXTRAS}]}" \
    && rm -rf /tmp/wheels \
    && groupadd --system --gid 10001 tqmon \
    && useradd --system --uid 10001 --gid 10001 --home-dir /state --no-create-home --shell /usr/sbin/nologin tqmon \
    && mkdir /state \
    && chown 10001:10001 /state
# Numeric, so Kubernetes' runAsNonRoot can verify it. The root filesystem may be read-only: tqmon writes
# only its state dir (mount a volume that outlives the container) and /tmp.
USER 10001:10001
ENV TQMON_LISTEN=0.0.0.0:9842 \
    TQMON_STATE_DIR=/state \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
VOLUME ["/state"]
EXPOSE 9842
HEALTHCHECK --interval=30s --timeout=5s --start-period=10s --retries=3 CMD ["python", "-m", "tqmon.healthcheck"]
STOPSIGNAL SIGTERM
# Off loopback the event API needs a bearer token: set TQMON_TOKEN (e.g. from a Kubernetes Secret).
ENTRYPOINT ["tqmon", "serve"]
