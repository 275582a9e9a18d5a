"""A real OTLP/HTTP receiver on 127.0.0.1 for the tests and the benchmark.

It decodes ``ExportMetricsServiceRequest`` and ``ExportLogsServiceRequest`` with opentelemetry-proto (the
wire format a Collector reads, not the SDK's in-memory objects) and can misbehave on demand: answer an
error status, accept and never answer, or be down (its port closed) and come back on the same port.
"""

from __future__ import annotations

import gzip
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

from tests.conftest import free_port

Labels = frozenset[tuple[str, str]]


@dataclass(frozen=True)
class Received:
    path: str
    headers: dict[str, str]
    at: float
    request: Any  # ExportMetricsServiceRequest | ExportLogsServiceRequest


def any_value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    return None if kind is None else getattr(value, kind)


def attributes(items: Any) -> dict[str, Any]:
    return {kv.key: any_value(kv.value) for kv in items if isinstance(kv, KeyValue)}


class OTLPReceiver:
    """``mode``: ``ok`` (200), ``error`` (``error_status``), ``hang`` (read the request, never answer)."""

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.mode = "ok"
        self.error_status = 500
        self.received: list[Received] = []
        self.attempts = 0  # requests read, whatever was answered
        self._lock = threading.Lock()
        self._release = threading.Event()
        self._server: ThreadingHTTPServer | None = None

    def start(self) -> OTLPReceiver:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", "0")))
                with receiver._lock:
                    receiver.attempts += 1
                if receiver.mode == "hang":
                    receiver._release.wait()
                    return
                if receiver.mode == "error":
                    self.send_response(receiver.error_status)
                    self.end_headers()
                    return
                encoding = self.headers.get("content-encoding", "")
                if encoding == "gzip":
                    body = gzip.decompress(body)
                elif encoding == "deflate":
                    body = zlib.decompress(body)
                message: Any = (
                    ExportMetricsServiceRequest() if self.path == "/v1/metrics" else ExportLogsServiceRequest()
                )
                message.ParseFromString(body)
                headers = {k.lower(): v for k, v in self.headers.items()}
                with receiver._lock:
                    receiver.received.append(Received(self.path, headers, time.time(), message))
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._release.clear()
        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, name="otlp-receiver", daemon=True).start()
        return self

    def stop(self) -> None:
        """Close the port (clients get connection refused) and release hung requests."""
        self._release.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def requests(self, path: str) -> list[Received]:
        with self._lock:
            return [r for r in self.received if r.path == path]

    def wait_for(self, predicate: Callable[[], Any], timeout: float = 20.0, what: str = "") -> Any:
        return wait_until(predicate, timeout, f"receiver: {what}")

    def log_records(self) -> list[tuple[dict[str, Any], Any]]:
        """(resource attributes, LogRecord) of every log record received, in order."""
        return [
            (attributes(rl.resource.attributes), record)
            for r in self.requests("/v1/logs")
            for rl in r.request.resource_logs
            for sl in rl.scope_logs
            for record in sl.log_records
        ]


def points(request: ExportMetricsServiceRequest) -> list[tuple[str, str, str, Labels, float]]:
    """(name, unit, kind, attributes, value) of every data point; kind is gauge, counter or updowncounter."""
    out = []
    for rm in request.resource_metrics:
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                data = metric.WhichOneof("data")
                if data == "gauge":
                    kind, dps = "gauge", metric.gauge.data_points
                elif data == "sum":
                    kind = "counter" if metric.sum.is_monotonic else "updowncounter"
                    dps = metric.sum.data_points
                else:
                    raise AssertionError(f"unexpected OTLP data {data} for {metric.name}")
                for dp in dps:
                    value = dp.as_double if dp.WhichOneof("value") == "as_double" else float(dp.as_int)
                    labels = frozenset((k, str(v)) for k, v in attributes(dp.attributes).items())
                    out.append((metric.name, metric.unit, kind, labels, value))
    return out


def wait_until(predicate: Callable[[], Any], timeout: float = 20.0, what: str = "") -> Any:
    """The first truthy result of ``predicate``, polled every 50 ms; an AssertionError naming ``what`` at the
    timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = predicate()
        if result:
            return result
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what or predicate}")
