"""The HTTP service: ``/metrics``, health, the JSON status API and the trainer event API."""

from __future__ import annotations

import asyncio
import errno
import hmac
import json
import logging
import socket
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, fields
from typing import Annotated, Any

import uvicorn
from fastapi import FastAPI, Query, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from fastapi_offline import FastAPIOffline
from pydantic import BaseModel, Field, TypeAdapter, ValidationError

from tqmon import __version__
from tqmon.events import EVENT_TYPE_NAMES, Event, PluginWindow, describe_validation
from tqmon.exporters.html import render as render_status_page
from tqmon.exporters.prometheus import render
from tqmon.httpserver import BACKLOG, BODY_TIMEOUT_SECONDS, UVICORN_LIMITS, GuardedH11Protocol
from tqmon.report import verdict
from tqmon.rules import render as render_rules
from tqmon.service import Service, ServiceConfig, StartupError
from tqmon.snapshot import (
    CheckpointView,
    ResumeRecord,
    RunInfo,
    Snapshot,
    SourceName,
    TQPollView,
    WindowReader,
    WindowView,
)
from tqmon.store import StateUnavailable
from tqmon.versions import VerlVersion

EVENTS_ADAPTER: TypeAdapter[list[Event]] = TypeAdapter(list[Event])
Batch = Annotated[list[Event], Field(min_length=1)]  # an empty batch carries no event: 422
BODY_ADAPTER: TypeAdapter[Event | list[Event]] = TypeAdapter(Event | Batch)


class IngestResult(BaseModel):
    accepted: int
    applied: int
    duplicates: int


class Problem(BaseModel):
    """Every rejection: ``reason`` is the label of the rejected-events tally, ``detail`` names the field."""

    reason: str
    detail: str


class Health(BaseModel):
    status: str


READYZ_RULES = (
    "200 when all three hold, else 503: (1) at least one source has succeeded since tqmon started; (2) every "
    "configured source is up: its last look succeeded and, for a polled source, no longer ago than its horizon "
    "(log and jsonl: max(30 s, 10 x --log-interval); checkpoint: max(30 s, 10 x --checkpoint-interval); tq: "
    "3 x its current poll interval + the kv_list timeout, at least 30 s); (3) the state dir takes writes (not "
    "read-only, full or deleted). The event API is up while tqmon serves. "
    "A checkpoint dir where verl has saved no checkpoint yet is a state, not a failure: the checkpoint source is "
    "up and its series are absent until the first save. A --log or --jsonl file that does not exist yet keeps its "
    "source down. `problems` names each down source with its last error, 'no source has succeeded yet', and "
    "'state: ' with the state dir's error."
)


class Readiness(BaseModel):
    ready: bool
    sources: dict[str, bool]
    problems: list[str]


@dataclass(frozen=True, slots=True)
class VerdictRecord(ResumeRecord):
    """A resume record with its one-line verdict."""

    verdict: str = ""


@dataclass(frozen=True, slots=True)
class WindowObservation(WindowView):
    """A source's newest window of a partition, served or not, and until when it counts as fresh."""

    fresh_until: float = 0.0


class SourceStatus(BaseModel):
    """A source's health (:class:`tqmon.snapshot.SourceHealth`) and whether it is up now."""

    source: str
    ok: bool
    last_success: float | None
    last_duration: float | None
    last_error: str | None
    stale_after: float | None
    up: bool


class PluginStatus(BaseModel):
    """The verl plugin's window reporting: who reads the window now (``tqmon_plugin_window_state``) and the
    plugin's last ``plugin_state_changed`` (all null when it never sent one)."""

    window_reader: WindowReader
    state: PluginWindow | None = Field(description="reporting, off, refused or failed, as the plugin last said")
    reason: str | None
    changed_at: float | None

    @classmethod
    def of(cls, snapshot: Snapshot, now: float) -> PluginStatus:
        plugin = snapshot.plugin
        return cls(
            window_reader=snapshot.window_reader(now),
            state=plugin.window if plugin else None,
            reason=plugin.reason if plugin else None,
            changed_at=plugin.changed_at if plugin else None,
        )


class Status(BaseModel):
    """``/api/v1/status``: everything from one snapshot, so no part of it can disagree with another."""

    version: str
    run: RunInfo | None
    verl_version: VerlVersion  # the release predictions assume, and its source (source null: unknown)
    target_window: int | None
    window_status: str
    windows: list[WindowView]
    window_observations: list[WindowObservation]  # every source's newest (the TQ cross-check beside the plugin's)
    trainer_step: int | None
    trainer_last_event: float | None
    checkpoint: CheckpointView | None
    tq: TQPollView | None
    plugin: PluginStatus
    sources: list[SourceStatus]
    resumes_total: int
    records_total: int
    records_offset: int
    records: list[VerdictRecord]

    @classmethod
    def of(cls, snapshot: Snapshot, now: float, limit: int, offset: int | None) -> Status:
        start = max(0, snapshot.records_total - limit) if offset is None else offset
        return cls(
            version=snapshot.version,
            run=snapshot.run,
            verl_version=snapshot.verl_version,
            target_window=snapshot.target_window,
            window_status=snapshot.window_status(now),
            windows=list(snapshot.fresh_windows(now)),
            window_observations=[
                WindowObservation(**_fields(w), fresh_until=snapshot.fresh_until(w)) for w in snapshot.windows
            ],
            trainer_step=snapshot.trainer_step,
            trainer_last_event=snapshot.trainer_last_event,
            checkpoint=snapshot.checkpoint,
            tq=snapshot.tq,
            plugin=PluginStatus.of(snapshot, now),
            sources=[SourceStatus(**_fields(s), up=s.up(now)) for s in snapshot.sources],
            resumes_total=snapshot.resumes_total,
            records_total=snapshot.records_total,
            records_offset=start,
            records=[VerdictRecord(**_fields(r), verdict=verdict(r)) for r in snapshot.records[start : start + limit]],
        )


def _fields(view: object) -> dict[str, Any]:
    """A dataclass's fields, not copied deeper (``asdict`` would turn nested views into dicts)."""
    return {f.name: getattr(view, f.name) for f in fields(view)}  # type: ignore[arg-type]


def _reject(service: Service, status: int, reason: str, detail: str) -> JSONResponse:
    service.tracker.reject(reason)
    return JSONResponse(Problem(reason=reason, detail=detail).model_dump(), status_code=status)


def create_app(service: Service, clock: Callable[[], float] = time.time) -> FastAPI:
    """The app; ``clock`` decides what is stale at request time (injectable, like the tracker's)."""

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        service.start()
        try:
            yield
        finally:
            service.stop()

    app = FastAPIOffline(  # Swagger UI's assets served from the package, not a CDN
        title="tqmon",
        version=__version__,
        description="Observability sidecar for verl V1 async training's TransferQueue prefetch window.",
        lifespan=lifespan,
    )

    @app.get("/", response_class=HTMLResponse, summary="Status page: the last starts, the window, alerts, sources")
    def status_page() -> str:
        return render_status_page(service.tracker.snapshot, clock())

    @app.get("/rules", response_class=PlainTextResponse, summary="The shipped Prometheus alert rules (YAML)")
    def rules() -> str:
        return render_rules()

    @app.get(
        "/metrics",
        response_class=PlainTextResponse,
        summary="Prometheus text, or OpenMetrics when the Accept header asks for it",
        responses={200: {"content": {"application/openmetrics-text": {}}}},
    )
    def metrics(request: Request) -> Response:
        body, content_type = render(service.registry, request.headers.get("accept"))
        return Response(body, media_type=content_type)

    @app.get("/healthz")
    def healthz() -> Health:
        return Health(status="ok")

    @app.get("/readyz", responses={503: {"model": Readiness}}, description=READYZ_RULES)
    def readyz() -> JSONResponse:
        snapshot = service.tracker.snapshot
        now = clock()
        sources = {s.source: s.up(now) for s in snapshot.sources}
        problems = [f"{s.source}: {s.last_error or 'stale'}" for s in snapshot.sources if not s.up(now)]
        if not any(s.last_success is not None for s in snapshot.sources):
            problems.append("no source has succeeded yet")
        if not snapshot.state.writable:
            problems.append(f"state: {snapshot.state.error}")
        ready = snapshot.ready(now) and snapshot.state.writable
        body = Readiness(ready=ready, sources=sources, problems=problems)
        return JSONResponse(body.model_dump(), status_code=200 if ready else 503)

    @app.get("/api/v1/status")
    def status(
        limit: int = Query(100, ge=1, le=10_000, description="resume records to return, newest last"),
        offset: int | None = Query(None, ge=0, description="first record; default: the last `limit` records"),
    ) -> Status:
        return Status.of(service.tracker.snapshot, clock(), limit, offset)

    @app.post(
        "/api/v1/events",
        response_model=IngestResult,
        responses={
            400: {"model": Problem},
            401: {"model": Problem},
            408: {"model": Problem},
            413: {"model": Problem},
            422: {"model": Problem},
            503: {"model": Problem},
        },
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": {"$ref": "#/components/schemas/EventOrBatch"}}},
            }
        },
    )
    async def post_events(request: Request) -> Response:
        """Accept one event or a JSON array of events; a batch is applied whole or rejected whole."""
        if service.token is not None:
            scheme, _, supplied = request.headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(supplied.encode(), service.token.encode()):
                return _reject(service, 401, "unauthorized", "missing or wrong bearer token in Authorization")
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > service.max_body_bytes:
            return _reject(service, 413, "too_large", f"body of {declared} bytes exceeds {service.max_body_bytes}")
        raw = bytearray()
        try:
            async with asyncio.timeout(BODY_TIMEOUT_SECONDS):  # a slow body must not hold a request for ever
                async for chunk in request.stream():
                    raw += chunk
                    if len(raw) > service.max_body_bytes:
                        return _reject(service, 413, "too_large", f"body exceeds {service.max_body_bytes} bytes")
        except TimeoutError:
            return _reject(service, 408, "too_slow", f"body not received within {BODY_TIMEOUT_SECONDS:g} s")
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            return _reject(service, 400, "malformed_json", f"body is not JSON: {err}")
        items = body if isinstance(body, list) else [body]
        if not items:
            return _reject(service, 422, "invalid_event", "body: an empty batch carries no event")
        for index, item in enumerate(items):
            kind = item.get("type") if isinstance(item, dict) else None
            if not isinstance(kind, str) or kind not in EVENT_TYPE_NAMES:  # a dict or list is unhashable
                where = f"[{index}].type" if isinstance(body, list) else "type"
                return _reject(
                    service, 422, "unknown_type", f"{where}: {kind!r} is not one of {sorted(EVENT_TYPE_NAMES)}"
                )
        try:
            events = EVENTS_ADAPTER.validate_python(items)
        except ValidationError as err:
            return _reject(service, 422, "invalid_event", describe_validation(err, batch=isinstance(body, list)))
        started = time.monotonic()
        try:
            applied, duplicates = service.tracker.ingest(events, SourceName.EVENTS)
        except StateUnavailable as err:  # never a 2xx for an event that is not on disk
            return _reject(service, 503, "state_unavailable", str(err))
        service.tracker.source_succeeded(SourceName.EVENTS, time.monotonic() - started)
        result = IngestResult(accepted=len(events), applied=applied, duplicates=duplicates)
        return JSONResponse(result.model_dump())

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            body = BODY_ADAPTER.json_schema(ref_template="#/components/schemas/{model}")
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            components.update(body.pop("$defs", {}))
            components["EventOrBatch"] = body
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app


Address = tuple[int, int, int, Any]  # getaddrinfo's family, type, proto and sockaddr


def resolve(host: str, port: int) -> Address:
    """``--listen``'s host as an address to bind; an unknown host is named."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as err:
        raise StartupError(f"--listen: cannot resolve host {host!r}: {err.strerror}") from None
    return family, kind, proto, address


def bind(host: str, port: int, resolved: Address) -> socket.socket:
    """The listening socket, before anything says it serves; a refusal is one sentence."""
    family, kind, proto, address = resolved
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(BACKLOG)
    except OSError as err:
        sock.close()
        problem = {
            errno.EADDRINUSE: f"port {port} is already in use (another tqmon?)",
            errno.EADDRNOTAVAIL: f"{host} is not an address of this machine",
            errno.EACCES: f"not allowed to listen on port {port}",
        }.get(err.errno or 0, f"cannot listen: {err.strerror or err}")
        raise StartupError(f"--listen {host}:{port}: {problem}") from None
    return sock


def serve_forever(config: ServiceConfig) -> None:
    """Run until stopped; a setting that cannot work raises :class:`tqmon.service.ConfigError` first, and
    one the machine refuses :class:`tqmon.service.StartupError`; "serving on" comes once the socket listens."""
    logging.basicConfig(level=config.log_level.upper(), format="%(levelname)s:%(asctime)s:%(name)s:%(message)s")
    host, port = config.address
    resolved = resolve(host, port)
    config.validate()
    sock = bind(host, port, resolved)
    try:
        service = Service(config, announce=announce_line)
    except BaseException:
        sock.close()
        raise
    shown = f"[{host}]" if ":" in host else host
    print(f"tqmon {__version__} serving on http://{shown}:{port}/  (metrics: /metrics)", file=sys.stderr, flush=True)
    app = create_app(service)
    settings = uvicorn.Config(
        app, log_level=config.log_level, access_log=False, http=GuardedH11Protocol, **UVICORN_LIMITS
    )
    server = uvicorn.Server(settings)
    server.run(sockets=[sock])


def announce_line(line: str) -> None:
    """A source's state line on stderr in one write: print() writes the text and the newline apart, and
    uvicorn's logger (another thread, the same stream) can land in between."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
