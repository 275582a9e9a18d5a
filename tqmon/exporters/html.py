"""The status page ``/``: one snapshot rendered as a self-contained HTML page an operator reads at a glance.

A pure function of the snapshot and the clock: no I/O, no external asset (styles and the refresh script
are inline), every value escaped. The page refreshes itself by fetching ``/`` again and swapping its main
element, so the server's rendering is the only one (a ``<noscript>`` meta refresh does the same without
JavaScript).
"""

from __future__ import annotations

import html
from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime

from tqmon.conditions import Condition, ConditionState, evaluate
from tqmon.report import describe_regression, self_heal, verdict
from tqmon.snapshot import CheckpointView, Evidence, ResumeRecord, Snapshot, SourceHealth, Tally, WindowView
from tqmon.versions import VerlVersion
from tqmon.warmup import DOOM_REASONS, PROMPT_STATUSES, TRAIN, WarmupState, doomed_complete, unknown_doom_reasons

REFRESH_SECONDS = 5
RECENT_STARTS = 10  # starts shown in the table, newest last
LINKS = (
    ("/metrics", "metrics"),
    ("/api/v1/status", "status JSON"),
    ("/rules", "alert rules"),
    ("/docs", "API docs"),
    ("/healthz", "healthz"),
    ("/readyz", "readyz"),
)
SEGMENT_CLASSES = (*PROMPT_STATUSES, "unknown", "warmup")

STYLE = """
:root{--fg:#1d2330;--muted:#5b6475;--line:#d9dde5;--bg:#f5f6f8;--card:#fff;--bad:#c62828;--warn:#b26a00;
--ok:#2e7d32;--pending:#5b8bd0;--running:#e8a33d;--finished:#3f9b5a;--failure:#d64541;--unknown:#9aa1ad;
--warmup:#8a63c9}
*{box-sizing:border-box}
body{margin:0;font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,"DejaVu Sans",sans-serif;color:var(--fg);
background:var(--bg)}
header{background:#222a38;color:#fff;padding:10px 24px;display:flex;gap:16px;align-items:baseline;flex-wrap:wrap}
header h1{font-size:18px;margin:0}
header .meta{color:#c8cedb;font-size:13px}
header .live{margin-left:auto;font-size:12px;color:#c8cedb}
header .live.failed{color:#ffb4a9;font-weight:600}
main{padding:16px 24px 32px;max-width:1400px}
section{background:var(--card);border:1px solid var(--line);border-radius:6px;padding:12px 16px;margin:0 0 14px}
h2{font-size:15px;margin:0 0 8px}
.banner{border-left:6px solid var(--muted);font-size:16px}
.banner.bad{border-color:var(--bad)}.banner.warn{border-color:var(--warn)}.banner.ok{border-color:var(--ok)}
.banner .verdict{font-size:20px;font-weight:700}
.bad .verdict,.flag{color:var(--bad)}.warn .verdict{color:var(--warn)}.ok .verdict{color:var(--ok)}
.numbers{display:grid;grid-template-columns:repeat(auto-fill,minmax(128px,1fr));gap:8px;margin:10px 0}
.numbers div{border:1px solid var(--line);border-radius:4px;padding:6px 8px}
.numbers dt{font-size:12px;color:var(--muted)}
.numbers dd{margin:0;font-size:22px;font-weight:700}
.numbers dd small{font-size:12px;font-weight:400;color:var(--muted)}
.story{margin:6px 0 10px;padding-left:18px}
table{border-collapse:collapse;width:100%;font-size:13px}
th,td{border-bottom:1px solid var(--line);padding:4px 8px;text-align:left;vertical-align:top}
th{color:var(--muted);font-weight:600;background:#fafbfc}
td.n{text-align:right;font-variant-numeric:tabular-nums}
td.when{white-space:nowrap}
.bar{position:relative;display:flex;height:24px;border:1px solid var(--line);border-radius:3px;margin:18px 0 4px;
background:repeating-linear-gradient(45deg,#fff,#fff 4px,#f1f2f5 4px,#f1f2f5 8px)}
.bar span{display:block;height:100%;color:#fff;font-size:12px;line-height:24px;text-align:center;overflow:hidden;
white-space:nowrap}
.bar .target{position:absolute;top:-16px;bottom:-3px;width:0;border-left:2px dashed var(--fg)}
.bar .target b{position:absolute;top:-2px;left:4px;font-size:11px;white-space:nowrap}
.bar .target.end b{left:auto;right:4px}
.pending{background:var(--pending)}.running{background:var(--running)}.finished{background:var(--finished)}
.failure{background:var(--failure)}.unknown{background:var(--unknown)}.warmup{background:var(--warmup)}
.legend{font-size:12px;color:var(--muted)}
.legend i{display:inline-block;width:10px;height:10px;border-radius:2px;margin:0 4px 0 10px;vertical-align:-1px}
.tag{display:inline-block;padding:0 6px;border-radius:3px;font-size:12px;font-weight:600;white-space:nowrap}
.tag.true,.tag.down{background:#fde7e6;color:var(--bad)}.tag.false,.tag.up{background:#e7f4ea;color:var(--ok)}
.tag.needs{background:#eef0f3;color:var(--muted)}.tag.lower{background:#fff3dc;color:var(--warn)}
.tag.exact{background:#e7f4ea;color:var(--ok)}
.muted{color:var(--muted)}
header nav a{color:#9cc3ff;margin-right:12px;font-size:13px}
code{font-size:12px}
"""

REFRESH_SCRIPT = """
(() => {
  const every = %d * 1000;
  const live = () => document.getElementById("live");
  let refreshed = 0;
  async function refresh() {
    try {
      const response = await fetch(location.pathname, {cache: "no-store"});
      if (!response.ok) throw new Error("HTTP " + response.status);
      const page = new DOMParser().parseFromString(await response.text(), "text/html");
      const open = [...document.querySelectorAll("details[open]")].map((d) => d.id);
      document.querySelector("main").replaceWith(page.querySelector("main"));
      for (const id of open) { const d = document.getElementById(id); if (d) d.open = true; }
      refreshed += 1;
      live().className = "live";
      live().dataset.refreshed = String(refreshed);
      live().textContent = "updated " + new Date().toISOString().slice(11, 19) + " UTC, every %ds";
    } catch (error) {
      live().className = "live failed";
      live().textContent = "NOT UPDATING: tqmon unreachable (" + error.message + ") since "
        + new Date().toISOString().slice(11, 19) + " UTC; figures below are old";
    }
  }
  setInterval(refresh, every);
})();
"""


def _e(value: object) -> str:
    return html.escape(str(value), quote=True)


def _num(value: float | None) -> str:
    return '<span class="muted" title="not known">–</span>' if value is None else _e(value)


def _utc(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _ago(seconds: float) -> str:
    seconds = max(0.0, seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit} ago"
    return f"{seconds:.0f}s ago"


def _when(ts: float | None, now: float) -> str:
    if ts is None:
        return _num(None)
    return f'<time datetime="{_e(_utc(ts))}">{_e(_utc(ts))}</time> <span class="muted">({_e(_ago(now - ts))})</span>'


def _statuses(counts: Mapping[str, int] | None) -> str:
    if counts is None:
        return _num(None)
    if set(counts) == {"unknown"}:
        return f"unknown {_e(counts['unknown'])} <span class='muted'>(only the total was reported)</span>"
    return " · ".join(f"{_e(status)} {_e(counts.get(status, 0))}" for status in PROMPT_STATUSES)


def _doomed_total(doomed: Mapping[str, int] | None) -> str:
    """The doomed total, ``≥`` when some reason is not known (it counts as 0), a dash when none is."""
    if not doomed:
        return _num(None)
    bound = "" if doomed_complete(doomed) else "≥ "
    return f"{bound}{_e(sum(doomed.values()))}"


def _doomed(doomed: Mapping[str, int] | None) -> str:
    """Each reason with its count, ``?`` where the reason is not known, and the total."""
    known = doomed or {}
    parts = " · ".join(f"{r} {_e(known[r])}" if r in known else f"{r} <b title='not known'>?</b>" for r in DOOM_REASONS)
    return f"{parts} <span class='muted'>(total {_doomed_total(doomed)})</span>"


def _deficit(record: ResumeRecord) -> str:
    """The deficit with whether it is exact: unknown doomed reasons count as 0, which makes it a lower bound."""
    if record.under_submitted is None:
        return f'<span data-k="deficit">{_num(None)}</span>'
    if record.under_submitted_lower_bound:
        why = f"doomed {', '.join(unknown_doom_reasons(record.doomed))} not known, counted as 0"
        return (
            f'<span data-k="deficit">≥ {_e(record.under_submitted)}</span> '
            f'<span class="tag lower" data-k="deficit-kind" title="{_e(why)}">lower bound</span>'
        )
    return (
        f'<span data-k="deficit">{_e(record.under_submitted)}</span> '
        '<span class="tag exact" data-k="deficit-kind">exact</span>'
    )


def _bar(segments: Sequence[tuple[str, int]], target: int | None, label: str) -> str:
    """A stacked bar of ``(css class, count)`` segments, scaled so that both the total and T fit."""
    total = sum(n for _, n in segments)
    scale = max(total, target or 0)
    if scale == 0:
        return f'<div class="bar" role="img" aria-label="{_e(label)}: empty"></div>'
    parts = "".join(
        f'<span class="{_e(css)}" style="width:{100 * n / scale:.3f}%" title="{_e(css)} {_e(n)}">{_e(n)}</span>'
        for css, n in segments
        if n > 0
    )
    marker = ""
    if target is not None:
        at = 100 * target / scale
        end = " end" if at > 85 else ""  # the label sits left of a marker near the right edge
        marker = f'<div class="target{end}" style="left:{at:.3f}%"><b>T = {_e(target)}</b></div>'
    return f'<div class="bar" role="img" aria-label="{_e(label)}">{parts}{marker}</div>'


def _legend(classes: Iterable[str]) -> str:
    return '<div class="legend">' + "".join(f'<i class="{_e(c)}"></i>{_e(c)}' for c in classes) + "</div>"


def _status_segments(counts: Mapping[str, int]) -> list[tuple[str, int]]:
    return [(status, counts.get(status, 0)) for status in (*PROMPT_STATUSES, "unknown")]


# ---------------------------------------------------------------- sections


def _banner(snapshot: Snapshot, conditions: Sequence[Condition], now: float) -> str:
    record = snapshot.last_record
    firing = [c for c in conditions if c.state is ConditionState.TRUE]
    serious = [c for c in firing if c.severity in ("critical", "warning")]
    if record is None:
        level, text, line = ("bad" if serious else "idle"), "no trainer start observed yet", ""
    else:
        text = verdict(record)
        level = "ok" if text == "ok" else "warn" if text.startswith("incomplete") else "bad"
        if serious and level == "ok":
            level = "bad"
        origin = f"resumed from global_step_{record.checkpoint_step}" if record.resumed else "fresh start"
        line = f"Last start #{_e(record.index)}: {_e(origin)}, {_when(record.started_at, now)}"
        if record.under_submitted is not None:
            line += f" · deficit {_deficit(record)}"
    alerts = (
        f"{len(firing)} alert condition{'s' if len(firing) != 1 else ''} true now: "
        + ", ".join(f"<b>{_e(c.alert)}</b> ({_e(c.severity)})" for c in firing)
        if firing
        else "no alert condition true now"
    )
    return (
        f'<section class="banner {level}" id="banner"><div class="verdict" data-k="verdict">{_e(text)}</div>'
        f"<div>{line}</div><div>{alerts} <a href='#conditions'>details</a></div></section>"
    )


def _story(record: ResumeRecord) -> str:
    """The last start in sentences: what verl did, in its own terms."""
    lines = []
    if record.resumed:
        lines.append(f"The trainer resumed from <b>global_step_{_e(record.checkpoint_step)}</b>.")
    else:
        lines.append("The trainer started from scratch (nothing restored).")
    if record.restored is not None:
        reissued = ""
        if record.reissued is not None:
            cleared = record.cleared_trajectories
            reissued = f"; re-issued K = {_e(record.reissued)} in-flight"
            reissued += "" if cleared is None else f" (cleared {_e(cleared)} old trajectories)"
        statuses = _statuses(record.restored_by_status)
        lines.append(f"TransferQueue restored R = {_e(record.restored)}: {statuses}{reissued}.")
    if record.target is not None:
        warmup = f"Target window T = {_e(record.target)}; the warmup should submit max(0, T − R) = "
        warmup += f"{_num(record.expected)} and submitted M = {_num(record.submitted)} ({_e(record.warmup_state)})."
        lines.append(warmup)
    else:
        lines.append(f"No target window T is known ({_e(record.warmup_state)}).")
    lines.append(f"Doomed at the first sample after the start: {_doomed(record.doomed)}.")
    if record.under_submitted is not None:
        missing = ", ".join(unknown_doom_reasons(record.doomed))
        bound = f" — a lower bound: doomed {missing} not known, counted as 0"
        bound = bound if record.under_submitted_lower_bound else " — exact"
        lines.append(f"Deficit max(0, T − (R − doomed + M)) = {_e(record.under_submitted)}{_e(bound)}.")
    if record.warmup_state is WarmupState.LOST_WINDOW:
        lost = "an unknown number of" if record.cost.lost_prompt_groups is None else _e(record.cost.lost_prompt_groups)
        lines.append(
            f"<b class='flag'>Its checkpoint held no transfer_queue/</b>: the saved window was lost ({lost} prompt"
            " groups) and the warmup re-generated it."
        )
    for regression in record.step_regressions:  # the evidence below says why, with both steps' sources
        lines.append(
            f"<b class='flag' data-k='step-regression'>Step regression</b>: {_e(describe_regression(regression))}."
        )
    disagreed = {disagreement.quantity for disagreement in record.disagreements}
    agreed = [quantity for quantity in record.compared if quantity not in disagreed]
    if agreed:  # a quantity not compared is not listed: one report alone is no agreement
        lines.append(f"Sources agree on <span data-k='agreed'>{_e(', '.join(agreed))}</span>.")
    for disagreement in record.disagreements:
        said = ", ".join(f"{_e(c.source)} said {_e(c.value)} ({_utc(c.at)})" for c in disagreement.claims)
        lines.append(
            f"<b class='flag' data-k='disagreement'>Sources disagree on {_e(disagreement.quantity)}</b>: {said};"
            f" {_e(disagreement.tolerance)}."
        )
    if record.first_step_evictions is not None:
        evicted = " · ".join(f"{_e(r)} {_e(n)}" for r, n in record.first_step_evictions.items())
        wait = record.first_step_generation_wait_seconds
        waited = "" if wait is None else f"; it waited {_e(f'{wait:g}')} s for generation"
        lines.append(f"The first step after it evicted {evicted}{waited}.")
    else:
        lines.append("The first step after it has not completed yet.")
    return '<ul class="story">' + "".join(f"<li>{line}</li>" for line in lines) + "</ul>"


def _evidence(evidence: Sequence[Evidence], now: float) -> str:
    if not evidence:
        return '<p class="muted">no evidence recorded</p>'
    rows = "".join(
        f"<tr><td>{_e(e.source)}</td><td><code>{_e(e.event_type)}</code></td><td class='when'>{_when(e.at, now)}</td>"
        f"<td>{_e(e.detail)}</td><td><code>{_e(e.event_id)}</code></td></tr>"
        for e in evidence
    )
    return (
        "<table><thead><tr><th>source</th><th>said</th><th>when</th><th>what</th><th>event id</th></tr></thead>"
        f"<tbody>{rows}</tbody></table>"
    )


def _last_start(record: ResumeRecord | None, now: float) -> str:
    if record is None:
        return (
            '<section id="last-start"><h2>Last start</h2><p class="muted">No trainer start observed yet: '
            "tqmon has no log line, event or checkpoint restore of this run.</p></section>"
        )
    expected_submitted = f"{_num(record.expected)} / {_num(record.submitted)}"
    numbers: tuple[tuple[str, str, str], ...] = (
        ("R restored", "restored", _num(record.restored)),
        ("K re-issued", "reissued", _num(record.reissued)),
        ("T target", "target", _num(record.target)),
        ("M expected / sent", "warmup", expected_submitted),
        ("O over-restored", "over_restored", _num(record.over_restored)),
        ("doomed", "doomed", _doomed_total(record.doomed)),
        ("deficit", "deficit-box", _deficit(record)),
    )
    if record.self_heal is not None:  # the plugin's top-up, with its inputs (absent when the self-heal is off)
        numbers += (("self-heal", "self-heal", _e(self_heal(record))),)
    cells = "".join(f'<div><dt>{_e(label)}</dt><dd data-k="{key}">{value}</dd></div>' for label, key, value in numbers)
    bar = ""
    if record.restored_by_status is not None:
        segments = [*_status_segments(record.restored_by_status), ("warmup", record.submitted or 0)]
        bar = _bar(segments, record.target, "restored prompt groups by status, then the warmup, against T")
        bar += _legend(SEGMENT_CLASSES)
    return (
        f'<section id="last-start"><h2>Last start #{_e(record.index)} — {_e(record.warmup_state)}, '
        f"{_e(record.semantics)}</h2><dl class='numbers'>{cells}</dl>{bar}{_story(record)}"
        f'<details id="evidence-last" open><summary>Evidence: which source said what, when '
        f"({len(record.evidence)})</summary>{_evidence(record.evidence, now)}</details></section>"
    )


def _starts(records: Sequence[ResumeRecord], total: int, now: float) -> str:
    if not records:
        return ""
    head = "".join(
        f"<th>{_e(c)}</th>"
        for c in ("#", "started", "from", "R by status", "K", "T", "M exp/sent", "O", "doomed", "deficit", "verdict")
    )
    rows = []
    for r in reversed(records):
        origin = f"global_step_{r.checkpoint_step}" if r.resumed else "scratch"
        rows.append(
            f'<tr data-index="{_e(r.index)}"><td class="n">{_e(r.index)}</td><td>{_when(r.started_at, now)}</td>'
            f"<td>{_e(origin)}</td><td>{_num(r.restored)}: {_statuses(r.restored_by_status)}</td>"
            f'<td class="n">{_num(r.reissued)}</td><td class="n">{_num(r.target)}</td>'
            f'<td class="n">{_num(r.expected)} / {_num(r.submitted)}</td><td class="n">{_num(r.over_restored)}</td>'
            f"<td>{_doomed(r.doomed)}</td><td>{_deficit(r)}</td><td>{_e(verdict(r))}"
            f'<details id="evidence-{_e(r.index)}"><summary class="muted">evidence ({len(r.evidence)})</summary>'
            f"{_evidence(r.evidence, now)}</details></td></tr>"
        )
    shown = f"the last {len(records)} of {total}" if total > len(records) else f"all {total}"
    return (
        f'<section id="starts"><h2>Trainer starts ({_e(shown)}, newest first)</h2>'
        f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table></section>"
    )


def _window(window: WindowView, target: int | None, status: str, now: float) -> str:
    against = "" if target is None else f" of T = {_e(target)}"
    extra = ""
    if window.trajectories is not None:
        extra = f"; {_e(window.trajectories)} trajectories, {_num(window.orphan_trajectories)} orphaned"
    verdict_of_train = f' — <b data-k="window-status">{_e(status)}</b>' if window.partition == TRAIN else ""
    return (
        f'<div class="window" data-partition="{_e(window.partition)}"><b>{_e(window.partition)}</b>: '
        f'<span data-k="window-total">{_e(window.total)}</span> prompt groups{against}{verdict_of_train}'
        f" ({_statuses(window.by_status)}{extra}); seen by {_e(window.source)} {_when(window.observed_at, now)}"
        f"{_bar(_status_segments(window.by_status), target, f'live {window.partition} window by status')}</div>"
    )


def _windows(snapshot: Snapshot, now: float) -> str:
    windows = sorted(snapshot.fresh_windows(now), key=lambda w: w.partition != TRAIN)
    if not windows:
        body = (
            '<p class="muted">No fresh live window: no source reported one within the last '
            f"{_e(f'{snapshot.stale_after:g}')} s (the TransferQueue poller, <code>--ray-address</code>, or "
            "<code>window_observed</code> events).</p>"
        )
    else:
        status = snapshot.window_status(now)
        body = "".join(
            _window(w, snapshot.target_window if w.partition == TRAIN else None, status, now) for w in windows
        )
        body += _legend((*PROMPT_STATUSES, "unknown"))
    return f'<section id="window"><h2>Live prefetch window</h2>{body}</section>'


def _checkpoint(checkpoint: CheckpointView | None, target: int | None, version: VerlVersion) -> str:
    if checkpoint is None:
        return (
            '<section id="checkpoint"><h2>Checkpoint preflight</h2><p class="muted">No checkpoint seen '
            "(<code>--checkpoint-dir</code>, or <code>checkpoint_saved</code> events).</p></section>"
        )
    if checkpoint.by_status is None:
        composition = '<p class="muted">Its TransferQueue composition is not known (only its step was reported).</p>'
    else:
        restored = sum(checkpoint.by_status.values())
        against = "" if target is None else f" of T = {_e(target)}"
        composition = (
            f'<p>A resume from it would restore R = <b data-k="checkpoint-restored">{_e(restored)}</b>'
            f"{against}: {_statuses(checkpoint.by_status)}.</p>"
            f"{_bar(_status_segments(checkpoint.by_status), target, 'checkpoint composition by status')}"
        )
    orphans = checkpoint.orphan_trajectories
    return (
        f'<section id="checkpoint"><h2>Checkpoint preflight: global_step_<span data-k="checkpoint-step">'
        f"{_e(checkpoint.step)}</span> <span class='muted'>(from {_e(checkpoint.source)})</span></h2>{composition}"
        f"<p>Doomed at its first sample: {_doomed(checkpoint.doomed)}. Orphan trajectories: {_num(orphans)}.</p>"
        f"{_outcomes(checkpoint, version)}</section>"
    )


def _outcomes(checkpoint: CheckpointView, version: VerlVersion) -> str:
    """The warmup a resume from the checkpoint would run: the known verl version's, or each while it is unknown."""
    said = f'Its warmup, for <span data-k="verl-version">{_e(version.describe())}</span>:'
    if not checkpoint.outcomes:
        needs = "its composition" if checkpoint.by_status is None else "the trainer config"
        return f"<p>{said} <span class='muted'>not predicted without {needs}.</span></p>"
    rows = "".join(
        f'<tr data-semantics="{_e(o.semantics)}"><td>{_e(o.semantics)}</td><td>{_e(o.warmup_state)}</td>'
        f'<td class="n">{_num(o.submitted)}</td><td class="n">{_num(o.over_restored)}</td>'
        f'<td class="n">{_num(o.over_filled)}</td><td class="n">'
        f"{'≥ ' if o.under_submitted_lower_bound and o.under_submitted is not None else ''}"
        f"{_num(o.under_submitted)}</td></tr>"
        for o in checkpoint.outcomes
    )
    return (
        f"<p>{said}</p><table><thead><tr><th>warmup of</th><th>state</th><th>M submitted</th><th>O over-restored</th>"
        "<th>over-filled R + M − T</th><th>deficit T − (R − doomed + M)</th></tr></thead>"
        f"<tbody>{rows}</tbody></table>"
    )


def _conditions(conditions: Sequence[Condition]) -> str:
    css = {ConditionState.TRUE: "true", ConditionState.FALSE: "false", ConditionState.NEEDS_PROMETHEUS: "needs"}
    order = {ConditionState.TRUE: 0, ConditionState.FALSE: 1, ConditionState.NEEDS_PROMETHEUS: 2}
    rows = "".join(
        f'<tr data-alert="{_e(c.alert)}"><td><span class="tag {css[c.state]}">{_e(c.state)}</span></td>'
        f"<td><b>{_e(c.alert)}</b><br><span class='muted'>{_e(c.summary)}</span></td><td>{_e(c.severity)}</td>"
        f"<td>{_e(c.duration)}</td><td>{_e(c.detail)}</td></tr>"
        for c in sorted(conditions, key=lambda c: order[c.state])
    )
    return (
        '<section id="conditions"><h2>Alert conditions</h2><p class="muted">The shipped rules '
        '(<a href="/rules">/rules</a>) evaluated by tqmon on this snapshot with their default thresholds. Prometheus '
        "fires an alert only once its condition has held for <i>for</i>, and alone knows scrape health and "
        "history: this is a preview, not Prometheus's verdict.</p>"
        "<table><thead><tr><th>now</th><th>alert</th><th>severity</th><th>for</th><th>values</th></tr></thead>"
        f"<tbody>{rows}</tbody></table></section>"
    )


def _source_row(source: SourceHealth, errors: int, now: float) -> str:
    up = source.up(now)
    stale = "never (push)" if source.stale_after is None else f"after {source.stale_after:g} s"
    duration = "" if source.last_duration is None else f"{source.last_duration * 1000:.1f} ms"
    return (
        f'<tr data-source="{_e(source.source)}"><td>{_e(source.source)}</td>'
        f'<td><span class="tag {"up" if up else "down"}">{"up" if up else "DOWN"}</span></td>'
        f"<td>{_when(source.last_success, now)}</td><td>{_e(duration)}</td><td>{_e(stale)}</td>"
        f'<td class="n">{_e(errors)}</td><td class="{"" if source.last_error is None else "flag"}">'
        f"{_e(source.last_error or '')}</td></tr>"
    )


def _sources(snapshot: Snapshot, now: float) -> str:
    errors: dict[str, int] = {}
    for labels, n in snapshot.counters.get(Tally.SOURCE_ERRORS, {}).items():
        errors[labels[0]] = errors.get(labels[0], 0) + n
    rows = "".join(_source_row(s, errors.get(s.source, 0), now) for s in snapshot.sources)
    step = snapshot.trainer_step_seconds
    trainer = (
        f"<p>Trainer: global step <b data-k='trainer-step'>{_num(snapshot.trainer_step)}</b>, last heard "
        f"{_when(snapshot.trainer_last_event, now)}"
        f"{'' if step is None else f', {step:.1f} s per step'}.</p>"
    )
    tq = snapshot.tq
    if tq is not None:
        busy = "" if tq.busy_ratio is None else f", ~{tq.busy_ratio:.2%} of the controller's request thread"
        trainer += (
            f"<p>TransferQueue poller: controller {_e(tq.controller_id or 'not found')}, epoch {_e(tq.epochs)}, "
            f"every {_e(f'{tq.interval:g}')} s{_e(busy)}"
            f"{', only as a cross-check: the verl plugin feeds the window' if tq.cross_check else ''}.</p>"
        )
    trainer += _plugin(snapshot, now)
    return (
        f'<section id="sources"><h2>Sources</h2>{trainer}<table><thead><tr><th>source</th><th>state</th>'
        "<th>last success</th><th>last poll</th><th>stale</th><th>errors</th><th>last error</th></tr></thead>"
        f"<tbody>{rows}</tbody></table></section>"
    )


WINDOW_READERS = {
    "reporting": "the verl plugin reports it from the replay buffer's own sync",
    "kv_list": "tqmon's kv_list poll reads it; the verl plugin does not report it",
    "unobserved": "nothing reads it: the verl plugin does not report it and tqmon has no <code>--ray-address</code>",
}


def _plugin(snapshot: Snapshot, now: float) -> str:
    """Who reads the live window (``tqmon_plugin_window_state``), and the plugin's last word on it."""
    reader = snapshot.window_reader(now)
    plugin = snapshot.plugin
    said = ""
    if plugin is not None:
        said = (
            f' The plugin last said <b data-k="plugin-state">{_e(plugin.window)}</b> at {_when(plugin.changed_at, now)}'
            f"{f': {_e(plugin.reason)}' if plugin.reason else ''}."
        )
    return f'<p data-k="plugin" data-reader="{_e(reader)}">Live window: {WINDOW_READERS[reader]}.{said}</p>'


def _run(snapshot: Snapshot) -> str:
    run, told = snapshot.run, snapshot.verl_version
    verl = "verl version unknown" if told.source is None else f"verl {told.version} (from {told.source})"
    if run is None:
        return f"run not identified yet · {verl}"
    return " · ".join([f"run {run.run_id or '(no id)'}", run.trainer_mode, verl, f"config from {run.config_source}"])


def render(snapshot: Snapshot, now: float) -> str:
    """The whole page for one snapshot, as of ``now``."""
    conditions = evaluate(snapshot, now)
    links = "".join(f'<a href="{href}">{_e(label)}</a>' for href, label in LINKS)
    main = (
        f"<main>{_banner(snapshot, conditions, now)}{_last_start(snapshot.last_record, now)}{_windows(snapshot, now)}"
        f"{_checkpoint(snapshot.checkpoint, snapshot.target_window, snapshot.verl_version)}{_conditions(conditions)}"
        f"{_starts(snapshot.records[-RECENT_STARTS:], snapshot.records_total, now)}{_sources(snapshot, now)}"
        f'<p class="muted">Rendered {_e(_utc(now))} from the snapshot built {_e(_utc(snapshot.built_at))}; '
        f"{_e(snapshot.resumes_total)} resumes, {_e(snapshot.records_total)} starts in all.</p></main>"
    )
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>tqmon — {_e(verdict(snapshot.last_record) if snapshot.last_record else 'no start yet')}</title>"
        f'<link rel="icon" href="data:,"><noscript><meta http-equiv="refresh" content="{REFRESH_SECONDS}"></noscript>'
        f"<style>{STYLE}</style></head><body>"
        f'<header><h1>tqmon {_e(snapshot.version)}</h1><span class="meta" id="header-meta">{_e(_run(snapshot))}</span>'
        f'<nav>{links}</nav><span class="live" id="live" data-refreshed="0">rendered '
        f"{_e(_utc(now)[11:19])} UTC, every {REFRESH_SECONDS}s</span></header>{main}"
        f"<script>{REFRESH_SCRIPT % (REFRESH_SECONDS, REFRESH_SECONDS)}</script></body></html>"
    )
