"""The status page ``/`` in a real headless Chromium against ``tqmon serve``, fed through the HTTP event API.

For a flagged and a healthy resume the numbers are read from the DOM Chromium rendered (``--dump-dom``), with
every host but 127.0.0.1 unresolvable and a net log proving that no request left the machine; the page's own
refresh script runs under virtual time and must swap in a fresh rendering. ``/docs`` must render Swagger UI
from tqmon's own assets. The flagged page's screenshot is checked as a PNG; with ``TQMON_UPDATE_SCREENSHOT=1``
it is written to ``docs/status-page.png``, the picture the README shows.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from html.parser import HTMLParser
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from tests.conftest import TqmonProcess
from tqmon.cost import ResumeCost
from tqmon.exporters.html import render
from tqmon.rules import RuleConfig, alerts
from tqmon.snapshot import (
    CheckpointView,
    Claim,
    Disagreement,
    Evidence,
    PluginView,
    ResumeRecord,
    SelfHeal,
    Snapshot,
    SourceHealth,
    Tally,
    TQPollView,
    WarmupOutcome,
    WindowView,
)
from tqmon.versions import VerlVersion
from tqmon.warmup import WarmupState

Factory = Callable[..., TqmonProcess]
SCREENSHOT = Path(__file__).resolve().parent.parent / "docs" / "status-page.png"
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--hide-scrollbars",
    # Every name but the loopback address fails to resolve: an asset from elsewhere could not load.
    "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
]


# ---------------------------------------------------------------- a minimal DOM of Chromium's dump


@dataclass
class Node:
    tag: str
    attrs: dict[str, str]
    children: list[Node | str] = field(default_factory=list)

    def text(self) -> str:
        """The text content, whitespace collapsed as a reader sees it."""
        return " ".join(self._raw().split())

    def _raw(self) -> str:
        return "".join(c if isinstance(c, str) else c._raw() for c in self.children)

    def iter(self) -> Iterator[Node]:
        yield self
        for child in self.children:
            if isinstance(child, Node):
                yield from child.iter()

    def find(self, **attrs: str) -> Node:
        found = self.find_all(**attrs)
        assert len(found) == 1, f"{len(found)} elements match {attrs}"
        return found[0]

    def find_all(self, **attrs: str) -> list[Node]:
        wanted = {k.replace("_", "-"): v for k, v in attrs.items()}
        return [n for n in self.iter() if all(n.attrs.get(k) == v for k, v in wanted.items())]


VOID = {"meta", "link", "br", "img", "input", "hr", "col", "area", "base", "source", "wbr"}


class _Builder(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.root = Node("#document", {})
        self.stack = [self.root]

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        node = Node(tag, {k: v or "" for k, v in attrs})
        self.stack[-1].children.append(node)
        if tag not in VOID:
            self.stack.append(node)

    def handle_endtag(self, tag: str) -> None:
        while len(self.stack) > 1 and self.stack.pop().tag != tag:
            pass

    def handle_data(self, data: str) -> None:
        self.stack[-1].children.append(data)


def parse(markup: str) -> Node:
    builder = _Builder()
    builder.feed(markup)
    return builder.root


# ---------------------------------------------------------------- Chromium


# Chromium's own background calls (component updater, account list, network time), which the flags above do
# not all switch off; the resolver rule makes them fail. They carry no page origin as their initiator.
CHROMIUM_SERVICE_HOSTS = {"update.googleapis.com", "accounts.google.com", "clients2.google.com"}
BROWSER = "not an origin"  # the net log's initiator of requests the browser itself starts


@dataclass(frozen=True)
class Request:
    url: str
    initiator: str


def chromium(tmp_path: Path, url: str, *extra: str) -> tuple[str, list[Request]]:
    """Run headless Chromium on ``url`` with a fresh profile; returns its stdout and every request of its net log."""
    binary = shutil.which("chromium")
    if binary is None:
        pytest.fail("chromium is not installed: run `make test`, which installs Debian's chromium")
    run_dir = tmp_path / f"chromium-{time.monotonic_ns()}"
    netlog = run_dir / "netlog.json"
    command = [binary, *CHROMIUM_FLAGS, f"--user-data-dir={run_dir / 'profile'}", f"--log-net-log={netlog}"]
    done = subprocess.run([*command, *extra, url], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    log = json.loads(netlog.read_text())
    start_job = log["constants"]["logEventTypes"]["URL_REQUEST_START_JOB"]
    requests = {
        Request(event["params"]["url"], event["params"].get("initiator", BROWSER))
        for event in log["events"]
        if event["type"] == start_job and "url" in event.get("params", {})
    }
    return done.stdout, sorted(requests, key=lambda r: (r.url, r.initiator))


def assert_loopback_only(requests: list[Request], proc: TqmonProcess, url: str) -> None:
    """Everything the page asked for (and the navigation to it) went to this tqmon; the rest is Chromium's own."""
    page = [r for r in requests if r.initiator != BROWSER or r.url == url]
    assert url in {r.url for r in page}, f"{url} not in the net log"
    assert [r.url for r in page if urlsplit(r.url).netloc != f"127.0.0.1:{proc.port}"] == []
    browser = [r for r in requests if r not in page]
    assert [r.url for r in browser if urlsplit(r.url).hostname not in CHROMIUM_SERVICE_HOSTS] == []


def dump_dom(tmp_path: Path, proc: TqmonProcess, path: str = "/", budget_ms: int = 0) -> tuple[Node, list[Request]]:
    extra = ["--dump-dom"] + ([f"--virtual-time-budget={budget_ms}"] if budget_ms else [])
    out, requests = chromium(tmp_path, proc.url + path, *extra)
    assert_loopback_only(requests, proc, proc.url + path)
    return parse(out), requests


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


# ---------------------------------------------------------------- scenarios, through the real event API


def post(proc: TqmonProcess, events: list[dict[str, Any]]) -> None:
    response = httpx.post(proc.url + "/api/v1/events", json=events, timeout=10)
    assert response.status_code == 200, response.text
    assert response.json()["applied"] == len(events)


def resume(run: str, now: float, restore: dict[str, Any], submitted: int, run_id: str = "") -> list[dict[str, Any]]:
    """A resume from global_step_20 two minutes ago with T = 3 x 4 = 12 (async: gen batch 1)."""
    return [
        {
            "id": f"{run}/run",
            "type": "run_started",
            "time": now - 130,
            "run_id": run_id or run,
            "trainer_mode": "colocate_async",
            "verl_version": "0.9.1",
            "config": {"train_batch_size": 4, "num_warmup_batches": 3},
        },
        {"id": f"{run}/start", "type": "training_started", "time": now - 120, "resumed_from_step": 20},
        {"id": f"{run}/restore", "type": "checkpoint_restored", "time": now - 119, "step": 20, **restore},
        {
            "id": f"{run}/reissue",
            "type": "inflight_reissued",
            "time": now - 118,
            "step": 21,
            "reissued_prompt_groups": 3,
            "cleared_trajectories": 4,
        },
        {
            "id": f"{run}/warmup",
            "type": "warmup_decided",
            "time": now - 117,
            "target_prompt_groups": 12,
            "restored_prompt_groups": restore["restored_prompt_groups"],
            "submitted_prompt_groups": submitted,
        },
    ]


def flagged(now: float) -> list[dict[str, Any]]:
    """R = 10 with 4 failed (stale unknown: by_status gives no submission steps), M = 2:
    deficit >= max(0, 12 - (10 - 4 + 2)) = 4, a lower bound; the live window holds 8 of 12."""
    restore = {"restored_prompt_groups": 10, "by_status": {"pending": 2, "running": 1, "finished": 3, "failure": 4}}
    return [
        *resume("grpo-flagged", now, restore, submitted=2),
        {
            "id": "grpo-flagged/step/21",
            "type": "step_completed",
            "time": now - 60,
            "global_step": 21,
            "evicted_prompt_groups": {"failure": 4},
            "generation_wait_seconds": 41.5,
        },
        {
            "id": "grpo-flagged/save/25",
            "type": "checkpoint_saved",
            "time": now - 20,
            "step": 25,
            "by_status": {"pending": 5, "running": 2, "finished": 1, "failure": 1},
            "orphan_trajectories": 7,
        },
        {
            "id": "grpo-flagged/window",
            "type": "window_observed",
            "partition": "train",
            "by_status": {"pending": 4, "running": 3, "finished": 1, "failure": 0},
        },
    ]


HOSTILE_RUN_ID = 'grpo <script>document.title="owned"</script> & "7b"'


def healthy(now: float) -> list[dict[str, Any]]:
    """R = 8, every group submitted at step 20 (none stale, none failed): doomed exactly 0, M = 4, deficit 0."""
    groups = [
        {"status": "pending", "global_steps": 20, "count": 2},
        {"status": "running", "global_steps": 20, "count": 1},
        {"status": "finished", "global_steps": 20, "count": 5},
    ]
    return [
        *resume(
            "grpo-healthy", now, {"restored_prompt_groups": 8, "groups": groups}, submitted=4, run_id=HOSTILE_RUN_ID
        ),
        {"id": "grpo-healthy/step/21", "type": "step_completed", "time": now - 60, "global_step": 21},
        {
            "id": "grpo-healthy/save/22",
            "type": "checkpoint_saved",
            "time": now - 20,
            "step": 22,
            "by_status": {"pending": 4, "running": 4, "finished": 4, "failure": 0},
        },
        {
            "id": "grpo-healthy/window",
            "type": "window_observed",
            "partition": "train",
            "by_status": {"pending": 6, "running": 4, "finished": 2, "failure": 0},
        },
    ]


def values(dom: Node) -> dict[str, str]:
    """The text of every ``data-k`` element of the last start's numbers."""
    numbers = dom.find(id="last-start")
    return {n.attrs["data-k"]: n.text() for n in numbers.iter() if "data-k" in n.attrs}


def conditions(dom: Node) -> dict[str, str]:
    """Each alert on the page with the state the page gives its condition."""
    rows = [n for n in dom.iter() if "data-alert" in n.attrs]
    return {row.attrs["data-alert"]: next(c for c in row.children if isinstance(c, Node)).text() for row in rows}


# ---------------------------------------------------------------- tests


@pytest.mark.e2e
def test_flagged_resume_in_chromium(tqmon_factory: Factory, tmp_path: Path) -> None:
    missing_jsonl = tmp_path / "verl-metrics.jsonl"  # never created: the jsonl source reads down
    proc = tqmon_factory(["--jsonl", str(missing_jsonl), "--log-interval", "0.2"]).start()
    post(proc, flagged(time.time()))

    # Two refresh periods of virtual time: the page's script must have fetched / and swapped in a fresh main.
    dom, requests = dump_dom(tmp_path, proc, budget_ms=11_000)
    assert any(r.url == proc.url + "/" and r.initiator == proc.url for r in requests)  # the script's own fetch
    live = dom.find(id="live")
    assert live.attrs["class"] == "live" and int(live.attrs["data-refreshed"]) >= 1, live.text()

    assert (
        dom.find(data_k="verdict").text() == "UNDER-SUBMITTED by at least 4 (doomed stale not known)"
    )  # the verdict agrees
    assert values(dom) == {
        "restored": "10",
        "reissued": "3",
        "target": "12",
        "warmup": "2 / 2",
        "over_restored": "0",
        "doomed": "≥ 4",
        "deficit-box": "≥ 4 lower bound",
        "deficit": "≥ 4",
        "deficit-kind": "lower bound",
        "agreed": "restored, target, submitted",  # R said twice, T and M against the config
    }
    last = dom.find(id="last-start").text()
    assert "pending 2 · running 1 · finished 3 · failure 4" in last
    assert "failure 4 · stale ? · filtered 0 (total ≥ 4)" in last
    assert "doomed stale not known, counted as 0" in last
    evidence = dom.find(id="evidence-last").text()
    for said in ("training_started", "checkpoint_restored", "inflight_reissued", "warmup_decided", "step_completed"):
        assert said in evidence
    assert "grpo-flagged/restore" in evidence

    window = dom.find(data_partition="train")
    assert window.find(data_k="window-total").text() == "8"
    assert window.find(data_k="window-status").text() == "under_filled"
    assert "of T = 12" in window.text()

    checkpoint = dom.find(id="checkpoint")
    assert checkpoint.find(data_k="checkpoint-step").text() == "25"
    assert checkpoint.find(data_k="checkpoint-restored").text() == "9"
    assert "failure 1 · stale ? · filtered 0 (total ≥ 1)" in checkpoint.text()
    assert "Orphan trajectories: 7" in checkpoint.text()

    jsonl = dom.find(data_source="jsonl")
    assert "DOWN" in jsonl.text() and f"{missing_jsonl} does not exist (yet): waiting" in jsonl.text()
    assert "up" in dom.find(data_source="events").text()

    states = conditions(dom)
    assert {name for name, state in states.items() if state == "true"} == {
        "TQMonWindowUnderFilledAfterResume",  # 8 / 12 = 67% < 90%, two minutes after the resume
        "TQMonWarmupUnderSubmitted",
        "TQMonDoomedRestoredGroupsHigh",  # 4 / 12 = 33% > 25%
        "TQMonSourceDown",
    }
    # Only scrape health needs Prometheus: the stall reads when the last step moved the global step on.
    assert {name for name, state in states.items() if state == "needs Prometheus"} == {"TQMonDown", "TQMonAbsent"}

    starts = dom.find(id="starts")
    assert [row.attrs["data-index"] for row in starts.iter() if "data-index" in row.attrs] == ["0"]
    links = {n.attrs["href"] for n in dom.iter() if n.tag == "a"}
    assert {"/metrics", "/api/v1/status", "/rules", "/docs"} <= links
    sources = [n.attrs[a] for n in dom.iter() for a in ("src", "href") if a in n.attrs]
    assert all(s.startswith(("/", "#", "data:")) for s in sources), sources

    # The screenshot the README shows: this very page, as Chromium paints it.
    shot = tmp_path / "status-page.png"
    chromium(tmp_path, proc.url + "/", f"--screenshot={shot}", "--window-size=1280,1500")
    assert png_size(shot) == (1280, 1500)
    if os.environ.get("TQMON_UPDATE_SCREENSHOT") == "1":
        shutil.copyfile(shot, SCREENSHOT)


@pytest.mark.e2e
def test_healthy_resume_in_chromium(tqmon_factory: Factory, tmp_path: Path) -> None:
    proc = tqmon_factory().start()
    post(proc, healthy(time.time()))

    dom, _ = dump_dom(tmp_path, proc)
    assert dom.find(data_k="verdict").text() == "ok"
    assert "ok" in dom.find(id="banner").attrs["class"]
    assert values(dom) == {
        "restored": "8",
        "reissued": "3",
        "target": "12",
        "warmup": "4 / 4",
        "over_restored": "0",
        "doomed": "0",
        "deficit-box": "0 exact",
        "deficit": "0",
        "deficit-kind": "exact",
        "agreed": "restored, target, submitted",  # R said twice, T and M against the config
    }
    assert "failure 0 · stale 0 · filtered 0 (total 0)" in dom.find(id="last-start").text()
    window = dom.find(data_partition="train")
    assert (window.find(data_k="window-total").text(), window.find(data_k="window-status").text()) == ("12", "ok")
    assert dom.find(id="checkpoint").find(data_k="checkpoint-restored").text() == "12"
    states = conditions(dom)
    assert [name for name, state in states.items() if state == "true"] == []
    assert sorted(states) == sorted(alert.name for alert in alerts(RuleConfig()))  # every shipped alert

    # A run id is data, never markup: shown literally, no element made of it, the title untouched.
    header = next(n for n in dom.iter() if n.tag == "header")
    assert f"run {HOSTILE_RUN_ID} · colocate_async" in header.text()
    assert [n.tag for n in dom.iter() if n.tag == "script"] == ["script"]  # the page's own refresh script
    assert next(n for n in dom.iter() if n.tag == "title").text() == "tqmon — ok"


@pytest.mark.e2e
def test_docs_render_offline_and_openapi_lists_the_page(tqmon_factory: Factory, tmp_path: Path) -> None:
    proc = tqmon_factory().start()
    schema = httpx.get(proc.url + "/openapi.json", timeout=10).json()
    assert {"/", "/metrics", "/rules", "/api/v1/status", "/api/v1/events"} <= set(schema["paths"])
    assert "text/html" in schema["paths"]["/"]["get"]["responses"]["200"]["content"]
    metrics = schema["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert {"text/plain", "application/openmetrics-text"} <= set(metrics)

    rules = httpx.get(proc.url + "/rules", timeout=10)
    assert rules.status_code == 200 and "alert: TQMonWarmupUnderSubmitted" in rules.text

    # Swagger UI builds its page from /openapi.json in the browser; with no CDN reachable it must still do so.
    dom, requests = dump_dom(tmp_path, proc, "/docs", budget_ms=5_000)
    paths = {urlsplit(r.url).path for r in requests}
    assert {"/docs", "/openapi.json", "/static-offline-docs/swagger-ui-bundle.js"} <= paths
    operations = {n.attrs["data-path"] for n in dom.iter() if "data-path" in n.attrs}
    assert {"/", "/metrics", "/api/v1/events"} <= operations


@pytest.mark.e2e
def test_page_says_when_it_stops_updating(tqmon_factory: Factory, tmp_path: Path) -> None:
    """tqmon's page, served once and then answered 503 (tqmon gone): the header must say the figures are old."""
    proc = tqmon_factory().start()
    post(proc, healthy(time.time()))
    page = httpx.get(proc.url + "/", timeout=10).content
    served: list[int] = []

    class Once(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            served.append(1)
            status, body = (200, page) if len(served) == 1 else (503, b"gone")
            self.send_response(status)
            self.send_header("content-type", "text/html; charset=utf-8")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Once)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        out, _ = chromium(
            tmp_path, f"http://127.0.0.1:{server.server_port}/", "--dump-dom", "--virtual-time-budget=6000"
        )
    finally:
        server.shutdown()
    live = parse(out).find(id="live")
    assert live.attrs["class"] == "live failed"
    assert live.text().startswith("NOT UPDATING: tqmon unreachable (HTTP 503)")
    assert parse(out).find(data_k="verdict").text() == "ok"  # the last good rendering stays
    assert len(served) >= 2


# ---------------------------------------------------------------- the renderer alone, on hand-made snapshots

T1 = 1_764_550_000.0


def snapshot(record: ResumeRecord | None, sources: tuple[SourceHealth, ...] = ()) -> Snapshot:
    return Snapshot(
        built_at=T1,
        version="0.1.0",
        stale_after=300.0,
        run=None,
        target_window=None if record is None else record.target,
        windows=(),
        trainer_step=None,
        trainer_last_event=None,
        trainer_stepped_at=None,
        trainer_step_seconds=None,
        resumes_total=0 if record is None else int(record.resumed),
        records_total=0 if record is None else 1,
        last_record=record,
        checkpoint=None,
        tq=None,
        sources=sources,
        counters={Tally.SOURCE_ERRORS: {("log", "unavailable"): 3}},
        records=() if record is None else (record,),
    )


def test_a_log_only_start_shows_every_unknown_and_a_lower_bound() -> None:
    """The log gives only R's total and no doom reason: the deficit counts all three as 0."""
    record = ResumeRecord(
        index=0,
        resumed=True,
        started_at=T1 - 30,
        checkpoint_step=6,
        restored=6,
        restored_by_status={"unknown": 6},
        reissued=0,
        target=8,
        expected=2,
        submitted=2,
        over_restored=0,
        doomed=None,
        under_submitted=0,
        under_submitted_lower_bound=True,  # as the derivation sets it with no doom reason known
        warmup_state=WarmupState.TOPPED_UP,
        evidence=(Evidence("log", "checkpoint_restored", "log:a:3", T1 - 29, "restored_prompt_groups=6"),),
    )
    down = SourceHealth("log", False, None, None, 'no file matches <b>"/x/*.log"</b>', 300.0)
    dom = parse(render(snapshot(record, (down,)), T1))
    assert values(dom)["deficit"] == "≥ 0" and values(dom)["deficit-kind"] == "lower bound"
    assert values(dom)["doomed"] == "–"
    last = dom.find(id="last-start").text()
    assert "failure ? · stale ? · filtered ? (total –)" in last
    assert "unknown 6 (only the total was reported)" in last
    assert "doomed failure, stale, filtered not known, counted as 0" in last
    assert "No fresh live window" in dom.find(id="window").text()
    assert "No checkpoint seen" in dom.find(id="checkpoint").text()
    log = dom.find(data_source="log")
    cells = [td.text() for td in log.children if isinstance(td, Node)]
    assert cells == ["log", "DOWN", "–", "", "after 300 s", "3", 'no file matches <b>"/x/*.log"</b>']  # literal
    assert [n.tag for n in log.iter() if n.tag == "b"] == []
    assert conditions(dom)["TQMonSourceDown"] == "true"


def test_the_plugin_feeds_the_window_and_the_poll_cross_checks() -> None:
    """Of two fresh windows the newer is served and named; the poller says it only cross-checks."""
    plugin = WindowView("train", "replay_buffer", T1 - 1, {"pending": 3, "running": 1, "finished": 2, "failure": 0})
    polled = WindowView("train", "tq", T1 - 200, {"pending": 9, "running": 0, "finished": 0, "failure": 0})
    poll = TQPollView("c1", 1, 600.0, 0.001, 42, None, cross_check=True)
    dom = parse(render(replace(snapshot(None), windows=(polled, plugin), tq=poll), T1))
    window = dom.find(id="window")
    assert window.find(data_k="window-total").text() == "6"
    assert "seen by replay_buffer" in window.text() and "seen by tq" not in window.text()
    said = "every 600 s, ~0.10% of the controller's request thread, only as a cross-check: the verl plugin feeds"
    assert f"{said} the window." in dom.find(id="sources").text()
    line = dom.find(data_k="plugin")
    assert (line.attrs["data-reader"], line.text()) == (
        "reporting",
        "Live window: the verl plugin reports it from the replay buffer's own sync.",
    )


@pytest.mark.parametrize(("tq", "reader"), [(True, "kv_list"), (False, "unobserved")])
def test_a_plugin_that_refused_says_so_and_who_reads_the_window_instead(tq: bool, reader: str) -> None:
    poll = TQPollView("c1", 1, 1.0, 0.001, 42, None) if tq else None
    stopped = PluginView("refused", "ReplayBufferAsync has no attribute <i>_materialize_batch</i>", T1 - 30)
    dom = parse(render(replace(snapshot(None), tq=poll, plugin=stopped), T1))
    line = dom.find(data_k="plugin")
    assert line.attrs["data-reader"] == reader
    instead = {
        "kv_list": "tqmon's kv_list poll reads it; the verl plugin does not report it",
        "unobserved": "nothing reads it: the verl plugin does not report it and tqmon has no --ray-address",
    }[reader]
    said = "The plugin last said refused at 2025-12-01 00:46:10 UTC (30s ago): ReplayBufferAsync has no attribute "
    said += "<i>_materialize_batch</i>."
    assert line.text() == f"Live window: {instead}. {said}"  # the plugin's words are text, not markup
    assert line.find(data_k="plugin-state").text() == "refused"


def test_no_start_yet() -> None:
    dom = parse(render(snapshot(None), T1))
    assert dom.find(data_k="verdict").text() == "no trainer start observed yet"
    assert "No trainer start observed yet" in dom.find(id="last-start").text()
    assert dom.find_all(id="starts") == []
    assert {name for name, state in conditions(dom).items() if state == "true"} == set()


def test_a_lost_window_whose_sources_disagree_is_flagged_with_each_source() -> None:
    record = ResumeRecord(
        index=1,
        resumed=True,
        started_at=T1 - 30,
        checkpoint_step=6,
        restored=0,
        restored_by_status=dict.fromkeys(("pending", "running", "finished", "failure"), 0),
        reissued=0,
        target=8,
        expected=8,
        submitted=8,
        over_restored=0,
        doomed={"failure": 0, "stale": 0, "filtered": 0},
        under_submitted=0,
        warmup_state=WarmupState.LOST_WINDOW,
        disagreements=(
            Disagreement(
                "window_after_warmup", (Claim("log R + M", 8, T1 - 29), Claim("tq", 3, T1 - 20)), "allowed 8..12"
            ),
        ),
        compared=("restored", "target", "window_after_warmup"),
        cost=ResumeCost(lost_prompt_groups=12),
    )
    dom = parse(render(snapshot(record), T1))
    assert dom.find(data_k="agreed").text() == "restored, target"  # K and M were not compared: not listed
    assert dom.find(data_k="verdict").text() == (
        "LOST WINDOW: resumed without transfer_queue/ (12 prompt groups lost, all re-generated); sources disagree:"
        " window_after_warmup: log R + M said 8; tq said 3 (allowed 8..12)"
    )
    last = dom.find(id="last-start").text()
    assert "Its checkpoint held no transfer_queue/: the saved window was lost (12 prompt groups)" in last
    assert dom.find(data_k="disagreement").text() == "Sources disagree on window_after_warmup"
    assert "tq said 3 (2025-12-01 00:46:20 UTC); allowed 8..12." in last
    true = {name for name, state in conditions(dom).items() if state == "true"}
    assert true == {"TQMonResumeLostWindow", "TQMonResumeSourcesDisagree"}


def test_the_checkpoint_preflight_names_the_verl_version_and_shows_each_warmup_while_it_is_unknown() -> None:
    """R = 12 of T = 12 with one failed group: 0.9.1 skips and is 1 short, 0.9.0 stacks 12 on top (over-filled)."""
    composition = {"pending": 1, "running": 1, "finished": 9, "failure": 1}
    outcomes = (
        WarmupOutcome("verl-0.9.1", 12, 0, WarmupState.SKIPPED_FULL, 0, 0, 1, False),
        WarmupOutcome("verl-0.9.0", 12, 12, WarmupState.LEGACY_UNCONDITIONAL, 0, 12, 0, False),
    )
    view = CheckpointView(45, "checkpoint", composition, {"failure": 1, "stale": 0, "filtered": 0}, 0, (), outcomes)
    dom = parse(render(replace(snapshot(None), checkpoint=view), T1))
    section = dom.find(id="checkpoint")
    said = "verl version unknown: no source named a release, so both warmups are predicted"
    assert section.find(data_k="verl-version").text() == said
    assert "verl version unknown" in dom.find(id="header-meta").text()

    def cells(semantics: str) -> list[str]:
        row = section.find(data_semantics=semantics)
        return [td.text() for td in row.children if isinstance(td, Node)]

    assert cells("verl-0.9.1") == ["verl-0.9.1", "skipped_full", "0", "0", "0", "1"]
    assert cells("verl-0.9.0") == ["verl-0.9.0", "legacy_unconditional", "12", "0", "12", "0"]

    # A known version: its source is named and only its warmup is shown.
    known = VerlVersion("0.9.0", "flag", "verl-0.9.0", "--verl-version (TQMON_VERL_VERSION)")
    page = replace(snapshot(None), checkpoint=replace(view, outcomes=outcomes[1:]), verl_version=known)
    section = parse(render(page, T1)).find(id="checkpoint")
    assert section.find(data_k="verl-version").text() == "verl 0.9.0 (from flag: --verl-version (TQMON_VERL_VERSION))"
    assert section.find_all(data_semantics="verl-0.9.1") == [] and cells("verl-0.9.0")[2] == "12"
    # Without the trainer config the warmup is not predicted, and the page says why.
    section = parse(render(replace(page, checkpoint=replace(view, outcomes=())), T1)).find(id="checkpoint")
    assert "not predicted without the trainer config" in section.text()


def test_an_on_top_up_shows_its_inputs_and_the_deficit_it_closed() -> None:
    """The self-heal's decision is shown with T, R, doomed, M and the cap; its groups count in M, so the
    record's deficit is 0 and the page says exact, not hidden."""
    heal = SelfHeal("on", 12, 9, {"failure": 1, "stale": 2, "filtered": 0}, 3, 3, True, 12, 3, 3, "submitted 3", "e:1")
    record = ResumeRecord(
        index=0,
        resumed=True,
        started_at=T1 - 30,
        checkpoint_step=10,
        restored=9,
        restored_by_status={"pending": 1, "running": 1, "finished": 6, "failure": 1},
        reissued=2,
        target=12,
        expected=3,
        submitted=3,
        over_restored=0,
        doomed={"failure": 1, "stale": 2, "filtered": 0},
        under_submitted=0,
        warmup_state=WarmupState.TOPPED_UP,
        self_heal=heal,
    )
    dom = parse(render(snapshot(record, ()), T1))
    assert values(dom)["deficit"] == "0" and values(dom)["deficit-kind"] == "exact"
    assert values(dom)["self-heal"] == (
        "on: submitted 3 of deficit 3 (T 12, R 9, doomed failure 1, stale 2, filtered 0, M 3, cap 12)"
    )
    without = parse(render(snapshot(replace(record, self_heal=None), ()), T1))
    assert "self-heal" not in values(without)
