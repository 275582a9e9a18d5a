"""OTLP push (opt-in, ``--otlp-endpoint``): the catalog over the same snapshot as ``/metrics``, and resume
verdicts as OTel log records, for clusters whose Prometheus cannot reach the trainer (a Collector, Alloy,
Datadog or Grafana Cloud takes the push instead).

- Metrics: every catalog entry is an observable instrument. One export pins one snapshot, derives its
  series once with :func:`~tqmon.exporters.values.metric_values` (what ``/metrics`` renders) and every
  callback reads from that, so the push and a scrape of the same snapshot carry the same series. Names are
  the Prometheus names and units are UCUM codes the OTel-to-Prometheus mapping does not append again.
- Logs: a thread watches the snapshot's last resume record and queues one log record when its warmup is
  decided and one when its first step lands (WARN when the verdict is not ok).
- Failures: exports run on two daemon threads of their own, so a Collector that is down, slow or failing
  never blocks ``/metrics``, the sources or shutdown. A failed metrics export is not retried (the next one
  carries the newer cumulative values); log records wait in a bounded queue for the next attempt. Both are
  counted in ``tqmon_otlp_*``. Shutdown flushes once within :data:`SHUTDOWN_SECONDS`.

This module imports OpenTelemetry at import time: import it only when OTLP is enabled.
"""

from __future__ import annotations

import logging
import math
import os
import re
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from urllib.parse import unquote, urlsplit

from tqmon import __version__
from tqmon.catalog import CATALOG, OTLP_SIGNALS, MetricSpec, MetricType
from tqmon.exporters.prometheus import le_label
from tqmon.exporters.values import HistogramSeries, Series, metric_values
from tqmon.report import verdict
from tqmon.snapshot import OTLPView, ResumeRecord, RunInfo, Snapshot
from tqmon.warmup import WarmupState

try:
    from opentelemetry._logs import LogRecord, SeverityNumber
    from opentelemetry.exporter.otlp.proto.http import Compression
    from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
    from opentelemetry.metrics import CallbackOptions, Observation
    from opentelemetry.sdk._logs import ReadableLogRecord
    from opentelemetry.sdk._logs.export import LogRecordExportResult
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader, MetricExportResult, MetricsData
    from opentelemetry.sdk.resources import OTELResourceDetector, Resource
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope
except ImportError as missing:
    raise ImportError(
        f"OTLP push needs the otel extra: pip install 'tqmon[otel]' ({missing.name or missing} is not installed)"
    ) from missing

log = logging.getLogger(__name__)

SHUTDOWN_SECONDS = 5.0  # the final flush gives up after this; a hung Collector must not hold up a SIGTERM
LOG_POLL_SECONDS = 0.5  # how often the log thread looks at the snapshot's last resume record
LOG_QUEUE_MAX = 1024  # undelivered resume log records kept while the Collector is unreachable
DEFAULT_INTERVAL_MS = 60_000.0
DEFAULT_TIMEOUT_MS = 10_000.0
SIGNAL_PATHS = {"metrics": "v1/metrics", "logs": "v1/logs"}
COMPRESSIONS = {"none": Compression.NoCompression, "gzip": Compression.Gzip, "deflate": Compression.Deflate}
POD_ENV = {"k8s.pod.name": "POD_NAME", "k8s.namespace.name": "POD_NAMESPACE"}  # set by deploy/'s downward API

ENV_VARS: tuple[tuple[str, str], ...] = (
    ("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", "full URL for metrics; wins over --otlp-endpoint for that signal"),
    ("OTEL_EXPORTER_OTLP_LOGS_ENDPOINT", "full URL for logs; wins over --otlp-endpoint for that signal"),
    ("OTEL_EXPORTER_OTLP_ENDPOINT", "base URL; --otlp-endpoint wins over it"),
    ("OTEL_EXPORTER_OTLP_HEADERS", "key=value,... (URL-encoded values), e.g. an auth token; _METRICS_/_LOGS_ too"),
    ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf only (the default); _METRICS_/_LOGS_ too"),
    ("OTEL_EXPORTER_OTLP_COMPRESSION", "none, gzip or deflate; _METRICS_/_LOGS_ too"),
    ("OTEL_EXPORTER_OTLP_TIMEOUT", "milliseconds per export incl. retries (default 10000); _METRICS_/_LOGS_ too"),
    ("OTEL_EXPORTER_OTLP_CERTIFICATE", "CA bundle for https (and _CLIENT_CERTIFICATE/_CLIENT_KEY for mTLS)"),
    ("OTEL_METRIC_EXPORT_INTERVAL", "milliseconds between metric exports (default 60000)"),
    ("OTEL_RESOURCE_ATTRIBUTES", "extra resource attributes, key=value,..."),
    ("OTEL_SERVICE_NAME", "service.name (default tqmon)"),
    ("POD_NAME, POD_NAMESPACE", "Kubernetes downward API: k8s.pod.name and k8s.namespace.name"),
)


class OTLPConfigError(ValueError):
    """A malformed endpoint, header or OTLP variable; refused at start with one line naming it."""


# ---------------------------------------------------------------- settings


@dataclass(frozen=True, slots=True)
class SignalSettings:
    """Where and how one signal is sent."""

    endpoint: str
    headers: Mapping[str, str]
    timeout: float  # seconds, for one export including the SDK's retries
    compression: str


@dataclass(frozen=True, slots=True)
class OTLPSettings:
    metrics: SignalSettings
    logs: SignalSettings
    interval: float  # seconds between metric exports


_HEADER_KEY = re.compile(r"[A-Za-z0-9!#$%&'*+.^_`|~-]+")


def check_url(value: str, what: str) -> str:
    """An http(s) URL with a host (a path prefix is fine, a query or fragment is not)."""
    parts = urlsplit(value)
    try:
        parts.port  # noqa: B018 - raises on a malformed port
    except ValueError:
        raise OTLPConfigError(f"{what}: malformed port in {value!r}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
        raise OTLPConfigError(f"{what}: expected an http(s) URL such as http://collector:4318, got {value!r}")
    if any(c.isspace() for c in value):
        raise OTLPConfigError(f"{what}: whitespace in URL {value!r}")
    return value


def parse_headers(value: str, what: str) -> dict[str, str]:
    """``key=value,...`` with URL-encoded values (W3C baggage format, as the OTel spec says); strict."""
    headers: dict[str, str] = {}
    for item in value.split(","):
        if not item.strip():
            continue
        key, sep, raw = item.partition("=")
        decoded = unquote(raw.strip())
        if not sep or not _HEADER_KEY.fullmatch(key.strip()) or not decoded or any(c in decoded for c in "\r\n\0"):
            raise OTLPConfigError(f"{what}: malformed header {item.strip()!r}; expected key=value (URL-encoded)")
        headers[key.strip().lower()] = decoded
    return headers


def _milliseconds(environ: Mapping[str, str], name: str, default: float) -> float:
    raw = environ.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise OTLPConfigError(f"{name}: expected a positive number of milliseconds, got {raw!r}")
    return value


def _signal(base: str, signal: str, environ: Mapping[str, str]) -> SignalSettings:
    """A signal's settings: its own ``OTEL_EXPORTER_OTLP_<SIGNAL>_*`` variable, else the generic one."""
    upper = signal.upper()

    def var(suffix: str) -> tuple[str, str | None]:
        for name in (f"OTEL_EXPORTER_OTLP_{upper}_{suffix}", f"OTEL_EXPORTER_OTLP_{suffix}"):
            if environ.get(name, "").strip():
                return name, environ[name].strip()
        return f"OTEL_EXPORTER_OTLP_{suffix}", None

    protocol_var, protocol = var("PROTOCOL")
    if protocol not in (None, "http/protobuf"):
        raise OTLPConfigError(f"{protocol_var}={protocol}: tqmon sends OTLP over http/protobuf only")
    endpoint_var = f"OTEL_EXPORTER_OTLP_{upper}_ENDPOINT"
    own = environ.get(endpoint_var, "").strip()
    endpoint = check_url(own, endpoint_var) if own else f"{base.rstrip('/')}/{SIGNAL_PATHS[signal]}"
    headers_var, headers = var("HEADERS")
    compression_var, compression = var("COMPRESSION")
    if compression is not None and compression.lower() not in COMPRESSIONS:
        raise OTLPConfigError(f"{compression_var}={compression}: expected one of {', '.join(COMPRESSIONS)}")
    timeout_var, _ = var("TIMEOUT")
    return SignalSettings(
        endpoint=endpoint,
        headers=parse_headers(headers, headers_var) if headers else {},
        timeout=_milliseconds(environ, timeout_var, DEFAULT_TIMEOUT_MS) / 1e3,
        compression=(compression or "none").lower(),
    )


def settings(endpoint: str, environ: Mapping[str, str] = os.environ) -> OTLPSettings:
    """``--otlp-endpoint`` (a base URL) and the standard OTel variables, validated as a whole."""
    base = check_url(endpoint.strip(), "--otlp-endpoint")
    return OTLPSettings(
        metrics=_signal(base, "metrics", environ),
        logs=_signal(base, "logs", environ),
        interval=_milliseconds(environ, "OTEL_METRIC_EXPORT_INTERVAL", DEFAULT_INTERVAL_MS) / 1e3,
    )


# ---------------------------------------------------------------- the catalog as instruments


@dataclass(frozen=True, slots=True)
class Instrument:
    """One OTel instrument of a catalog entry; ``name`` maps back to itself under OTel's Prometheus rules."""

    name: str
    kind: str  # gauge | counter (monotonic sum) | updowncounter (non-monotonic sum)
    unit: str  # UCUM
    description: str


def ucum(unit: str) -> str:
    """The catalog's unit as UCUM: ``s`` and ``1`` map back to the ``_seconds``/``_ratio`` already in the name;
    counts are ``{annotations}``, which the mapping never appends."""
    return {"": "", "seconds": "s", "ratio": "1"}.get(unit, "{" + unit + "}")


def instruments(spec: MetricSpec) -> tuple[Instrument, ...]:
    """The instruments of one catalog entry (a gaugehistogram needs three: OTel has no gauge histogram)."""
    unit = ucum(spec.unit)
    match spec.type:
        case MetricType.COUNTER:
            return (Instrument(spec.name, "counter", unit, spec.help),)
        case MetricType.STATESET | MetricType.INFO:
            # OTel's compatibility spec maps both to a non-monotonic sum; Prometheus reads it as a gauge.
            return (Instrument(spec.name, "updowncounter", unit, spec.help),)
        case MetricType.GAUGEHISTOGRAM:
            return (
                Instrument(spec.name + "_bucket", "gauge", unit, spec.help + " Cumulative count per `le` bound."),
                Instrument(spec.name + "_gcount", "gauge", unit, spec.help + " Count."),
                Instrument(spec.name + "_gsum", "gauge", unit, spec.help + " Sum."),
            )
        case _:
            return (Instrument(spec.name, "gauge", unit, spec.help),)


Attributes = dict[str, str]


def observations(
    spec: MetricSpec, series: Sequence[Series] | Sequence[HistogramSeries]
) -> dict[str, list[tuple[Attributes, float]]]:
    """A catalog entry's series as (attributes, value) per instrument name; labels become attributes as is."""
    if spec.type is not MetricType.GAUGEHISTOGRAM:
        return {
            spec.name: [
                (dict(zip(spec.label_names, s.labels, strict=True)), s.value) for s in series if isinstance(s, Series)
            ]
        }
    points: dict[str, list[tuple[Attributes, float]]] = {spec.name + s: [] for s in ("_bucket", "_gcount", "_gsum")}
    for h in series:
        assert isinstance(h, HistogramSeries)
        labels = dict(zip(spec.label_names, h.labels, strict=True))
        points[spec.name + "_bucket"] += [(labels | {"le": le_label(le)}, float(n)) for le, n in h.buckets]
        points[spec.name + "_gcount"].append((labels, float(h.buckets[-1][1])))
        points[spec.name + "_gsum"].append((labels, h.sum))
    return points


# ---------------------------------------------------------------- resume records as log records

RESUME_ATTRIBUTES: dict[str, str] = {
    "tqmon.resume.phase": "`decided` (the warmup reported its decision) or `first_step` (the first step landed)",
    "tqmon.resume.index": "position of this start in the run's history (0 = the first)",
    "tqmon.resume.resumed": "true for a resume from a checkpoint, false for a fresh start",
    "tqmon.resume.started_at": "when the start was first observed (Unix seconds)",
    "tqmon.resume.checkpoint_step": "N of global_step_N (0 for a fresh start)",
    "tqmon.resume.restored": "R, restored prompt groups",
    "tqmon.resume.restored.<status>": "R by status (`unknown` where a source gave only the total)",
    "tqmon.resume.reissued": "K, in-flight groups re-issued",
    "tqmon.resume.target": "T, the target window",
    "tqmon.resume.expected": "M expected: max(0, T - R)",
    "tqmon.resume.submitted": "M submitted by the trainer",
    "tqmon.resume.over_restored": "O = max(0, R - T)",
    "tqmon.resume.doomed.<reason>": "doomed restored groups by reason (only the known reasons)",
    "tqmon.resume.under_submitted": "the deficit max(0, T - (R - doomed + M))",
    "tqmon.resume.under_submitted_lower_bound": "true when the deficit is only a lower bound (a doom reason unknown)",
    "tqmon.resume.first_step.evicted.<reason>": "what the first sample really evicted (first_step only)",
    "tqmon.resume.first_step.generation_wait_seconds": "the first step's wait for rollouts (first_step only)",
    "tqmon.resume.self_heal.mode": "the verl plugin's self-heal mode, `on` or `dry-run` (absent when off)",
    "tqmon.resume.self_heal.deficit": "the deficit the self-heal derived before its top-up",
    "tqmon.resume.self_heal.deficit_exact": "false when that deficit was a lower bound",
    "tqmon.resume.self_heal.planned": "what the mode would submit (the deficit, capped)",
    "tqmon.resume.self_heal.submitted": "what it submitted; counts in M for `tqmon.resume.under_submitted`",
    "tqmon.resume.self_heal.reason": "the self-heal's decision in its own words",
    "tqmon.resume.warmup_state": "a `tqmon_resume_warmup_state` state",
    "tqmon.resume.semantics": "verl-0.9.1 or verl-0.9.0 (legacy unconditional warmup)",
    "tqmon.resume.verdict": "`ok` or the problems, as `tqmon analyze` prints them",
    "tqmon.run.id": "run id, when known",
}
PHASES = ("decided", "first_step")

AttributeValue = str | int | float | bool


def resume_attributes(record: ResumeRecord, phase: str) -> dict[str, AttributeValue]:
    """The record's numbers as log attributes (documented in :data:`RESUME_ATTRIBUTES`); unknowns are omitted."""
    known: dict[str, AttributeValue | None] = {
        "tqmon.resume.phase": phase,
        "tqmon.resume.index": record.index,
        "tqmon.resume.resumed": record.resumed,
        "tqmon.resume.started_at": record.started_at,
        "tqmon.resume.checkpoint_step": record.checkpoint_step,
        "tqmon.resume.restored": record.restored,
        "tqmon.resume.reissued": record.reissued,
        "tqmon.resume.target": record.target,
        "tqmon.resume.expected": record.expected,
        "tqmon.resume.submitted": record.submitted,
        "tqmon.resume.over_restored": record.over_restored,
        "tqmon.resume.under_submitted": record.under_submitted,
        "tqmon.resume.under_submitted_lower_bound": (
            record.under_submitted_lower_bound if record.under_submitted is not None else None
        ),
        "tqmon.resume.warmup_state": str(record.warmup_state),
        "tqmon.resume.semantics": record.semantics,
        "tqmon.resume.verdict": verdict(record),
        "tqmon.run.id": record.run_id or None,
    }
    by_key = [("tqmon.resume.restored.", record.restored_by_status), ("tqmon.resume.doomed.", record.doomed)]
    if phase == "first_step":  # a record decided and sealed between two looks still reports its phases apart
        by_key.append(("tqmon.resume.first_step.evicted.", record.first_step_evictions))
        known["tqmon.resume.first_step.generation_wait_seconds"] = record.first_step_generation_wait_seconds
    heal = record.self_heal
    if heal is not None:
        known |= {
            "tqmon.resume.self_heal.mode": heal.mode,
            "tqmon.resume.self_heal.deficit": heal.deficit,
            "tqmon.resume.self_heal.deficit_exact": heal.deficit_exact,
            "tqmon.resume.self_heal.planned": heal.planned,
            "tqmon.resume.self_heal.submitted": heal.submitted,
            "tqmon.resume.self_heal.reason": heal.reason,
        }
    for prefix, counts in by_key:
        known |= {prefix + key: n for key, n in (counts or {}).items()}
    return {key: value for key, value in known.items() if value is not None}


def reached(record: ResumeRecord) -> tuple[str, ...]:
    """The phases a record has reached: decided (or sealed without a decision seen), then first step."""
    first_step = record.first_step_evictions is not None
    decided = record.warmup_state is not WarmupState.UNKNOWN or first_step
    return tuple(phase for phase, done in zip(PHASES, (decided, first_step), strict=True) if done)


# ---------------------------------------------------------------- resource


def base_resource(port: int, environ: Mapping[str, str] = os.environ) -> Resource:
    """tqmon's defaults, overridden by ``OTEL_RESOURCE_ATTRIBUTES`` and ``OTEL_SERVICE_NAME``."""
    defaults: dict[str, str] = {
        "service.name": "tqmon",
        "service.version": __version__,
        "service.instance.id": f"{socket.gethostname()}:{port}",
    }
    defaults |= {attribute: environ[var] for attribute, var in POD_ENV.items() if environ.get(var)}
    detected = OTELResourceDetector().detect().attributes
    return Resource.create({**defaults, **detected})


def run_attributes(run: RunInfo | None) -> dict[str, str]:
    """The run's identity, once a source has told it."""
    if run is None:
        return {}
    identity = {
        "tqmon.run.id": run.run_id,
        "tqmon.run.trainer_mode": run.trainer_mode,
        "tqmon.run.verl_version": run.verl_version,
    }
    return {key: value for key, value in identity.items() if value}


# ---------------------------------------------------------------- the exporter


class OTLPExporter:
    """Pushes the snapshot's catalog series and its resume records to an OTLP/HTTP endpoint."""

    def __init__(
        self,
        config: OTLPSettings,
        source: Callable[[], Snapshot],
        resource: Resource,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self._source = source
        self._clock = clock
        self._base_resource = resource
        self._run_resource: tuple[RunInfo | None, Resource] = (None, resource)
        self._scope = InstrumentationScope("tqmon", __version__)
        self._counts_lock = threading.Lock()
        self._failures = dict.fromkeys(OTLP_SIGNALS, 0)
        self._dropped = 0
        self._metric_exporter = OTLPMetricExporter(
            endpoint=config.metrics.endpoint,
            headers=config.metrics.headers,
            timeout=config.metrics.timeout,
            compression=COMPRESSIONS[config.metrics.compression],
        )
        self._log_exporter = OTLPLogExporter(
            endpoint=config.logs.endpoint,
            headers=config.logs.headers,
            timeout=config.logs.timeout,
            compression=COMPRESSIONS[config.logs.compression],
        )
        # Collection is driven by this exporter's own thread: it pins one snapshot per export. The temporality
        # is the exporter's (OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE), as PeriodicExportingMetricReader does.
        self._reader = InMemoryMetricReader(preferred_temporality=self._metric_exporter._preferred_temporality)
        self._provider = MeterProvider(metric_readers=[self._reader], resource=resource, shutdown_on_exit=False)
        self._collect_lock = threading.Lock()
        self._pinned: dict[str, list[tuple[Attributes, float]]] = {}
        meter = self._provider.get_meter("tqmon", __version__)
        create = {
            "gauge": meter.create_observable_gauge,
            "counter": meter.create_observable_counter,
            "updowncounter": meter.create_observable_up_down_counter,
        }
        for spec in CATALOG:
            for instrument in instruments(spec):
                create[instrument.kind](
                    instrument.name, [self._callback(instrument.name)], instrument.unit, instrument.description
                )
        self._pending: deque[ReadableLogRecord] = deque()
        self._watched: tuple[int, set[str]] = (-1, set())  # the record watched and the phases already queued
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._metrics_loop, name="tqmon-otlp-metrics", daemon=True),
            threading.Thread(target=self._logs_loop, name="tqmon-otlp-logs", daemon=True),
        ]

    @classmethod
    def from_environment(cls, endpoint: str, source: Callable[[], Snapshot], *, port: int) -> OTLPExporter:
        """``--otlp-endpoint`` and the OTel variables of this process; raises :class:`OTLPConfigError`."""
        return cls(settings(endpoint), source, base_resource(port))

    # ------------------------------------------------------------ lifecycle

    def start(self) -> None:
        log.info(
            "OTLP push to %s and %s every %.3g s",
            self.config.metrics.endpoint,
            self.config.logs.endpoint,
            self.config.interval,
        )
        for thread in self._threads:
            thread.start()

    def stop(self, timeout: float = SHUTDOWN_SECONDS) -> None:
        """Flush once (each thread exports a last time) and give up after ``timeout`` whatever the Collector does."""
        self._stop.set()
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            if thread.is_alive():
                thread.join(max(0.0, deadline - time.monotonic()))
        stuck = [thread.name for thread in self._threads if thread.is_alive()]
        if stuck:
            log.warning("OTLP: final flush abandoned after %.0f s (%s still exporting)", timeout, ", ".join(stuck))
        self._metric_exporter.shutdown()  # aborts the SDK's retry backoff; a stuck daemon thread dies with us
        self._log_exporter.shutdown()  # type: ignore[no-untyped-call]
        self._provider.shutdown()

    # ------------------------------------------------------------ the snapshot both exporters render

    def current(self) -> Snapshot:
        """The tracker's snapshot with this exporter's delivery counters; ``/metrics`` renders the same."""
        with self._counts_lock:
            view = OTLPView(dict(self._failures), self._dropped)
        return replace(self._source(), otlp=view)

    def _failed(self, signal: str) -> None:
        with self._counts_lock:
            self._failures[signal] += 1

    def _resource(self, run: RunInfo | None) -> Resource:
        cached_run, resource = self._run_resource
        if run != cached_run:
            resource = self._base_resource.merge(Resource(run_attributes(run)))
            self._run_resource = (run, resource)
        return resource

    # ------------------------------------------------------------ metrics

    def _callback(self, name: str) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def observe(_options: CallbackOptions) -> Iterable[Observation]:
            return [Observation(value, attributes) for attributes, value in self._pinned.get(name, ())]

        return observe

    def collect(self) -> MetricsData | None:
        """One collection of every instrument from one pinned snapshot (its run identity in the resource)."""
        with self._collect_lock:
            snapshot = self.current()
            self._pinned = {
                name: points
                for spec, series in metric_values(snapshot, self._clock())
                for name, points in observations(spec, series).items()
            }
            try:
                data = self._reader.get_metrics_data()
            finally:
                self._pinned = {}
        if data is None:
            return None
        resource = self._resource(snapshot.run)
        return MetricsData([replace(rm, resource=resource) for rm in data.resource_metrics])

    def export_metrics(self) -> bool:
        """Collect and push once; a failure is counted and not retried (the next export is newer)."""
        try:
            data = self.collect()
            ok = data is None or self._metric_exporter.export(data) is MetricExportResult.SUCCESS
        except Exception:  # an SDK bug must not end the export thread
            log.exception("OTLP metrics export failed")
            ok = False
        if not ok:
            self._failed("metrics")
        return ok

    def _metrics_loop(self) -> None:
        while not self._stop.wait(self.config.interval):
            self.export_metrics()
        self.export_metrics()  # the final flush

    # ------------------------------------------------------------ logs

    def watch(self, snapshot: Snapshot) -> None:
        """Queue a log record for each phase the last resume record reached since the last look."""
        record = snapshot.last_record
        if record is None:
            return
        index, queued = self._watched
        if record.index != index:
            index, queued = record.index, set()
            self._watched = (index, queued)
        for phase in reached(record):
            if phase not in queued:
                queued.add(phase)
                self._enqueue(self._log_record(record, phase, snapshot.run))

    def _enqueue(self, item: ReadableLogRecord) -> None:
        if len(self._pending) >= LOG_QUEUE_MAX:
            self._pending.popleft()
            with self._counts_lock:
                self._dropped += 1
        self._pending.append(item)

    def _log_record(self, record: ResumeRecord, phase: str, run: RunInfo | None) -> ReadableLogRecord:
        text = verdict(record)
        healthy = text == "ok"
        start = f"resume from step {record.checkpoint_step}" if record.resumed else "fresh start"
        now = time.time_ns()
        body = f"tqmon: {start} (#{record.index}) {phase.replace('_', ' ')}: {text}"
        entry = LogRecord(
            timestamp=now,
            observed_timestamp=now,
            severity_text="INFO" if healthy else "WARN",
            severity_number=SeverityNumber.INFO if healthy else SeverityNumber.WARN,
            body=body,
            attributes=resume_attributes(record, phase),
            event_name="tqmon.resume",
        )
        return ReadableLogRecord(entry, self._resource(run), self._scope)

    def export_logs(self) -> bool:
        """Push the queued records; on failure they stay queued for the next attempt (and are counted)."""
        batch = list(self._pending)
        if not batch:
            return True
        try:
            ok = self._log_exporter.export(batch) is LogRecordExportResult.SUCCESS
        except Exception:
            log.exception("OTLP logs export failed")
            ok = False
        if ok:
            for _ in batch:
                self._pending.popleft()
        else:
            self._failed("logs")
        return ok

    def _logs_loop(self) -> None:
        retry_at = 0.0
        while not self._stop.wait(LOG_POLL_SECONDS):
            self.watch(self._source())
            if self._pending and time.monotonic() >= retry_at and not self.export_logs():
                retry_at = time.monotonic() + self.config.interval
        self.watch(self._source())
        self.export_logs()  # the final flush


# ---------------------------------------------------------------- docs


def docs() -> str:
    """The OTLP section of ``docs/metrics.md``: the mapping of every catalog entry, resource and log records."""
    rows = ["| catalog metric | OTel instrument(s) | unit |", "| --- | --- | --- |"]
    for spec in CATALOG:
        parts = [f"`{i.name}` ({i.kind})" for i in instruments(spec)]
        rows.append(f"| `{spec.name}` | {'<br>'.join(parts)} | {ucum(spec.unit) or '—'} |")
    attributes = "\n".join(f"| `{key}` | {meaning} |" for key, meaning in RESUME_ATTRIBUTES.items())
    variables = "\n".join(f"| `{name}` | {meaning} |" for name, meaning in ENV_VARS)
    return f"""
## OTLP push

With `--otlp-endpoint URL` (`TQMON_OTLP_ENDPOINT`) tqmon also pushes every catalog metric over OTLP/HTTP
(protobuf) to `URL/v1/metrics`, from the same snapshot `/metrics` renders, every `OTEL_METRIC_EXPORT_INTERVAL`.
The OTel name is the Prometheus name and the unit is a UCUM code, so that OTel's Prometheus mapping (a
Collector's `prometheus`/`prometheusremotewrite` exporter, Prometheus' OTLP receiver, with or without UTF-8
names) gives back the series a scrape gives: a unit of `s` or `1` maps to the `_seconds`/`_ratio` already in
the name and is not appended again; counts carry `{{annotations}}`, which the mapping drops; counters are
monotonic cumulative sums whose name already ends in `_total`, which the mapping keeps. Attributes are the
labels, with the same values.

- **counter**: an observable counter (cumulative monotonic sum; with
  `OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE=delta`, deltas).
- **gauge**: an observable gauge.
- **stateset** and **info**: an observable up-down counter (a non-monotonic sum, as OTel's Prometheus
  compatibility spec maps both), one point per state with value 0/1, or value 1 with the identity
  attributes. Prometheus reads them as the gauges `/metrics` serves.
- **gaugehistogram**: OTel has no gauge histogram (its spec drops Prometheus' on the way in), so the three
  series of the text exposition are three observable gauges: `_bucket` with an `le` attribute
  (`"1.0"`, …, `"+Inf"`, cumulative), `_gcount` and `_gsum`.
- **exposition only**: the `process_*` and `python_*` series of prometheus-client's default collectors.
- **Resource** (`target_info` in Prometheus): `service.name=tqmon` (or `OTEL_SERVICE_NAME`),
  `service.version`, `service.instance.id` (`<hostname>:<port>`), `k8s.pod.name` and `k8s.namespace.name`
  from the downward-API variables `POD_NAME` and `POD_NAMESPACE`, `OTEL_RESOURCE_ATTRIBUTES`, and once a
  source tells the run: `tqmon.run.id`, `tqmon.run.trainer_mode`, `tqmon.run.verl_version`.
- **Delivery**: `tqmon_otlp_export_failures_total{{signal}}` counts exports that failed after the SDK's
  retries; a failed metrics export is not retried (the next carries newer values), resume log records stay
  in a queue of {LOG_QUEUE_MAX} for the next attempt (`tqmon_otlp_log_records_dropped_total` beyond it).
  Shutdown flushes once and gives up after {SHUTDOWN_SECONDS:.0f} s.

{chr(10).join(rows)}

### Resume log records

Each resume record becomes an OTel log record (`event_name` `tqmon.resume`) when its warmup is decided and
again when its first step lands: severity INFO when the verdict is `ok`, WARN otherwise; the body is the
verdict in words. Only the last start is watched: a log read from its beginning gives records for its last
start, not one per start in its history (`tqmon analyze` lists those). A restarted tqmon sends the last
start's phases again (at least once).

| attribute | meaning |
| --- | --- |
{attributes}

### Variables

| variable | meaning |
| --- | --- |
{variables}
"""
