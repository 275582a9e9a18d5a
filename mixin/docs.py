"""Generates ``docs/metrics.md`` from the catalog (``python -m mixin.docs``; a test fails on drift)."""

from __future__ import annotations

import sys

from mixin.repo import write
from tqmon.catalog import CATALOG, MetricSpec, MetricType
from tqmon.exporters import otlp

METRICS_DOC = "docs/metrics.md"

HEADER = """\
# tqmon metrics

Generated from `tqmon/catalog.py` by `make docs`; do not edit by hand (a test fails when this file drifts).

Conventions: prompt groups are counted in `_prompt_groups`, timestamps are `_timestamp_seconds`,
counters end in `_total`. Stability, as kube-state-metrics states it: a `stable` metric changes its name,
labels or meaning only after a release in which it is `deprecated`; an `experimental` one may change in
any release (the live TransferQueue poller's own figures and the age histogram are still settling).
Labels are closed sets; run identity lives only on `tqmon_run_info`.
Statesets are exposed as one 0/1 gauge per state, the state in the label shown. A value no source
has established yet is omitted; a value known to be empty is exported as 0. The `tqmon_resume_*`
series describe the last trainer start (resume or fresh start); `/api/v1/status` has every one.

"""


def _labels(spec: MetricSpec) -> str:
    if not spec.labels:
        return "—"
    parts = []
    for label in spec.labels:
        values = "any" if label.values is None else ", ".join(label.values)
        parts.append(f"`{label.name}` ({values})")
    return "<br>".join(parts)


def render() -> str:
    rows = ["| metric | type | unit | labels | stability | help |", "| --- | --- | --- | --- | --- | --- |"]
    for spec in CATALOG:
        kind = spec.type.value + (" (0/1 gauge per state)" if spec.type is MetricType.STATESET else "")
        row = f"| `{spec.name}` | {kind} | {spec.unit or '—'} | {_labels(spec)} | {spec.stability} | {spec.help} |"
        rows.append(row)
    return HEADER + "\n".join(rows) + "\n" + otlp.docs()


def main() -> int:
    write(METRICS_DOC, render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
