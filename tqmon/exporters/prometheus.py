"""Prometheus pull exposition: a custom collector that renders the current snapshot on each scrape.

``collect()`` does no I/O and takes no lock: it reads one immutable snapshot reference, so a scrape
costs the same whatever the TQ size or the length of the resume history.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

from prometheus_client import CollectorRegistry, GCCollector, PlatformCollector, ProcessCollector
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeHistogramMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from tqmon.catalog import CATALOG, MetricSpec, MetricType
from tqmon.exporters.values import HistogramSeries, Series, metric_values
from tqmon.snapshot import Snapshot

S = TypeVar("S", Series, HistogramSeries)


def _unit(spec: MetricSpec) -> str:
    stem = spec.name.removesuffix("_total")
    return spec.unit if spec.unit and stem.endswith("_" + spec.unit) else ""


def _of(kind: type[S], spec: MetricSpec, series: list[Series] | list[HistogramSeries]) -> list[S]:
    """The series of a family, all of the one kind its metric type takes (a histogram's or a sample's)."""
    typed = [item for item in series if isinstance(item, kind)]
    if len(typed) != len(series):
        raise TypeError(f"{spec.name} is a {spec.type.value}: its series must all be {kind.__name__}")
    return typed


def build_family(spec: MetricSpec, series: list[Series] | list[HistogramSeries]) -> Metric:
    """One fresh metric family for a catalog entry."""
    labels = list(spec.label_names)
    family: Metric
    match spec.type:
        case MetricType.COUNTER:
            family = CounterMetricFamily(spec.name, spec.help, labels=labels, unit=_unit(spec))
        case MetricType.INFO:
            family = InfoMetricFamily(spec.name.removesuffix("_info"), spec.help, labels=labels)
            for s in _of(Series, spec, series):
                family.add_metric(list(s.labels), {})
            return family
        case MetricType.GAUGEHISTOGRAM:
            family = GaugeHistogramMetricFamily(spec.name, spec.help, labels=labels, unit=_unit(spec))
            for h in _of(HistogramSeries, spec, series):
                buckets = [(le_label(le), float(n)) for le, n in h.buckets]
                family.add_metric(list(h.labels), buckets, h.sum)
            return family
        case _:  # gauges and statesets (a 0/1 gauge per state)
            family = GaugeMetricFamily(spec.name, spec.help, labels=labels, unit=_unit(spec))
    for s in _of(Series, spec, series):
        family.add_metric(list(s.labels), s.value)
    return family


def le_label(le: float) -> str:
    """A bucket bound as the ``le`` label value (OTLP's bucket gauges use the same)."""
    return "+Inf" if math.isinf(le) else f"{le:.1f}"


class SnapshotCollector(Collector):
    """prometheus_client collector over whatever snapshot ``current`` returns at scrape time."""

    def __init__(self, current: Callable[[], Snapshot], clock: Callable[[], float] = time.time) -> None:
        self._current = current
        self._clock = clock

    def describe(self) -> Iterator[Metric]:
        """Every catalog family, empty: the registry refuses a collector whose names collide with these."""
        for spec in CATALOG:
            yield build_family(spec, [])

    def collect(self) -> Iterator[Metric]:
        snapshot = self._current()
        for spec, series in metric_values(snapshot, self._clock()):
            yield build_family(spec, series)


def build_registry(
    current: Callable[[], Snapshot], *, process_metrics: bool = True, clock: Callable[[], float] = time.time
) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(SnapshotCollector(current, clock))
    if process_metrics:
        ProcessCollector(registry=registry)
        PlatformCollector(registry=registry)
        GCCollector(registry=registry)
    return registry


def render(registry: CollectorRegistry, accept: str | None) -> tuple[bytes, str]:
    """Encode for the scraper: OpenMetrics when its Accept header asks for it, else text 0.0.4."""
    encoder, content_type = choose_encoder(accept or "")
    return encoder(registry), content_type
