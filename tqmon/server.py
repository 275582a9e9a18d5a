"""The HTTP service: ``/metrics``, health, the JSON status API and the trainer event API."""

from __future__ import annotations

import asyncio
import hmac
import html
import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import asdict
from typing import Annotated, Any

import click
import uvicorn
from fastapi import FastAPI, Query, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse, JSONResponse, Response
from pydantic import BaseModel, Field, TypeAdapter, ValidationError

from tqmon import __version__
from tqmon.events import EVENT_TYPE_NAMES, Event, describe_validation
from tqmon.exporters.prometheus import render
from tqmon.httpserver import BODY_TIMEOUT_SECONDS, UVICORN_LIMITS, GuardedH11Protocol
from tqmon.report import verdict
from tqmon.service import ConfigError, Service, ServiceConfig
from tqmon.statelock import StateError
from tqmon.store import StateUnavailable

EVENTS_ADAPTER: TypeAdapter[list[Event]] = TypeAdapter(list[Event])
Batch = Annotated[list[Event], Field(min_length=1)]  # an empty batch carries no event: 422
BODY_ADAPTER: TypeAdapter[Event | list[Event]] = TypeAdapter(Event | Batch)


class IngestResult(BaseModel):
    accepted: int
    applied: int
    duplicates: int


class Problem(BaseModel):
    """Every rejection: ``reason`` is the ``tqmon_events_rejected_total`` label, ``detail`` names the field."""

    reason: str
    detail: str


class Health(BaseModel):
    status: str


class Readiness(BaseModel):
    ready: bool
    sources: dict[str, bool]
    problems: list[str]


def _reject(service: Service, status: int, reason: str, detail: str) -> JSONResponse:
    service.tracker.reject(reason)
    return JSONResponse(Problem(reason=reason, detail=detail).model_dump(), status_code=status)


def create_app(service: Service) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        service.start()
        try:
            yield
        finally:
            service.stop()

    app = FastAPI(
        title="tqmon",
        version=__version__,
        description="Observability sidecar for verl V1 async training's TransferQueue prefetch window.",
        lifespan=lifespan,
    )

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    def landing() -> str:
        snapshot = service.tracker.snapshot
        record = snapshot.last_record
        summary = "no resume observed yet" if record is None else f"last start: {verdict(record)}"
        links = "".join(
            f'<li><a href="{href}">{html.escape(label)}</a></li>'
            for href, label in (
                ("/metrics", "metrics"),
                ("/api/v1/status", "status (JSON)"),
                ("/healthz", "healthz"),
                ("/readyz", "readyz"),
                ("/docs", "API docs"),
            )
        )
        return (
            f"<!doctype html><html><head><title>tqmon</title></head><body><h1>tqmon {__version__}</h1>"
            f"<p>{html.escape(summary)}; {snapshot.resumes_total} resumes.</p><ul>{links}</ul></body></html>"
        )

    @app.get("/metrics", include_in_schema=False)
    def metrics(request: Request) -> Response:
        body, content_type = render(service.registry, request.headers.get("accept"))
        return Response(body, media_type=content_type)

    @app.get("/healthz")
    def healthz() -> Health:
        return Health(status="ok")

    @app.get("/readyz", responses={503: {"model": Readiness}})
    def readyz() -> JSONResponse:
        snapshot = service.tracker.snapshot
        now = time.time()
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
    ) -> dict[str, Any]:
        snapshot = service.tracker.snapshot
        now = time.time()
        start = max(0, snapshot.records_total - limit) if offset is None else offset
        return {
            "version": __version__,
            "run": None if snapshot.run is None else asdict(snapshot.run),
            "target_window": snapshot.target_window,
            "window_status": snapshot.window_status(now),
            "windows": [asdict(w) for w in snapshot.fresh_windows(now)],
            "trainer_step": snapshot.trainer_step,
            "trainer_last_event": snapshot.trainer_last_event,
            "checkpoint": None if snapshot.checkpoint is None else asdict(snapshot.checkpoint),
            "tq": None if snapshot.tq is None else asdict(snapshot.tq),
            "sources": [asdict(s) | {"up": s.up(now)} for s in snapshot.sources],
            "resumes_total": snapshot.resumes_total,
            "records_total": snapshot.records_total,
            "records_offset": start,
            "records": [r.to_json() | {"verdict": verdict(r)} for r in service.tracker.records(start, limit)],
        }

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
            applied, duplicates = service.tracker.ingest(events, "events")
        except StateUnavailable as err:  # never a 2xx for an event that is not on disk
            return _reject(service, 503, "state_unavailable", str(err))
        service.tracker.source_succeeded("events", time.monotonic() - started)
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


def serve_forever(config: ServiceConfig, log_level: str = "info") -> None:
    logging.basicConfig(level=log_level.upper(), format="%(levelname)s:%(asctime)s:%(name)s:%(message)s")
    try:
        service = Service(config)
    except ConfigError as err:
        raise click.UsageError(str(err)) from err
    except StateError as err:
        raise click.ClickException(str(err)) from None
    host = f"[{config.host}]" if ":" in config.host else config.host
    click.echo(f"tqmon {__version__} serving on http://{host}:{config.port}/  (metrics: /metrics)", err=True)
    uvicorn.run(
        create_app(service),
        host=config.host,
        port=config.port,
        log_level=log_level,
        access_log=False,
        http=GuardedH11Protocol,
        **UVICORN_LIMITS,
    )
