# tqmon sidecar image. The live TransferQueue source needs the `tq` extra (and a CPU torch first);
# the log and event-API sources need only the base install below.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY tqmon ./tqmon
RUN pip install --no-cache-dir . && useradd --system --uid 10001 tqmon && mkdir /state && chown tqmon /state
USER tqmon
ENV TQMON_LISTEN=0.0.0.0:9842 TQMON_STATE_DIR=/state
EXPOSE 9842
# Off loopback the event API needs a bearer token: set TQMON_TOKEN (e.g. from a Kubernetes Secret).
ENTRYPOINT ["tqmon", "serve"]
