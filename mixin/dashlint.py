"""A Python re-implementation of the Grafana dashboard lint rules tqmon cares about.

The Go linters (grafana/dashboard-linter, mixtool) are not installable here, so this checks the same
things on the generated JSON: templated datasource on every panel and target, every panel titled,
described and with a unit, ``$__rate_interval`` in every rate window, counters only inside
``rate``/``increase``, every query parsed by ``promtool`` (Prometheus's own parser, via ``check rules``)
and every metric a query names present in the catalog, the recording rules, or ``up``/``ALERTS``.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterable, Iterator, Mapping, Set
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from mixin.dashboards import DATASOURCE_UID
from tqmon.catalog import CATALOG, MetricType

RATE_FUNCTIONS = frozenset({"rate", "irate", "increase"})
RATE_WINDOW = "[$__rate_interval]"
PROMETHEUS_SERIES = frozenset({"up", "ALERTS"})
GAUGEHISTOGRAM_SUFFIXES = ("_bucket", "_gcount", "_gsum")
_GROUPING = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right"})
_KEYWORDS = _GROUPING | {"and", "or", "unless", "bool", "offset", "atan2", "inf", "nan"}
_TOKEN = re.compile(
    r"""(?P<space>\s+)
    |(?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|`[^`]*`)
    |(?P<range>\[[^\]]*\])
    |(?P<number>(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?[a-zA-Z0-9]*)
    |(?P<ident>[a-zA-Z_:][a-zA-Z0-9_:]*)
    |(?P<var>\$\{[^}]*\}|\$\w+)
    |(?P<open>\()|(?P<close>\))|(?P<lbrace>\{)|(?P<rbrace>\})
    |(?P<other>.)""",
    re.VERBOSE,
)
# Grafana's interval variables become a duration and every other variable a plain word, so promtool
# parses the query Grafana would send (a variable outside a string then fails to parse, as it should).
_INTERVAL_VARIABLES = re.compile(r"\$(?:\{__(?:rate_interval|interval|range)\}|__(?:rate_interval|interval|range)\b)")
_VARIABLE = re.compile(r"\$\{[^}]*\}|\$\w+")
_LABEL_VALUES = re.compile(r"^\s*label_values\((?P<expr>.*),\s*\w+\s*\)\s*$", re.DOTALL)
_QUERY_RESULT = re.compile(r"^\s*query_result\((?P<expr>.*)\)\s*$", re.DOTALL)


@dataclass(frozen=True, slots=True)
class Finding:
    where: str  # e.g. "panel 'Live window' target A"
    rule: str
    message: str

    def __str__(self) -> str:
        return f"{self.where}: [{self.rule}] {self.message}"


@dataclass(frozen=True, slots=True)
class Selector:
    """A metric a query names, with the function whose argument list directly holds it (None at top level)."""

    metric: str
    enclosing: str | None


@dataclass(frozen=True, slots=True)
class Scan:
    selectors: tuple[Selector, ...]
    ranges: tuple[Selector, ...]  # the range text (e.g. "[5m]") as ``metric``, with its enclosing function


@dataclass
class _Walk:
    stack: list[str | None] = field(default_factory=list)
    selectors: list[Selector] = field(default_factory=list)
    ranges: list[Selector] = field(default_factory=list)


def _tokens(expr: str) -> list[tuple[str, str]]:
    tokens = []
    for match in _TOKEN.finditer(expr):
        kind = match.lastgroup or "other"
        if kind != "space":
            tokens.append((kind, match.group()))
    return tokens


def scan(expr: str) -> Scan:
    """Metric names and range windows of a PromQL expression, each with its enclosing function.

    A lexer, not a parser: promtool checks the syntax; this only needs to tell metric names from function
    names, keywords and grouping labels, skipping label matchers and strings.
    """
    tokens = _tokens(expr)
    walk = _Walk()
    depth_in_braces = 0
    for i, (kind, text) in enumerate(tokens):
        following = tokens[i + 1] if i + 1 < len(tokens) else ("", "")
        if kind == "lbrace":
            depth_in_braces += 1
        elif kind == "rbrace":
            depth_in_braces -= 1
        elif depth_in_braces:
            continue
        elif kind == "open":
            previous = tokens[i - 1] if i else ("", "")
            called = previous[0] == "ident" and previous[1].lower() not in _KEYWORDS - _GROUPING
            walk.stack.append(previous[1] if called else None)
        elif kind == "close":
            if walk.stack:
                walk.stack.pop()
        elif kind == "range":
            walk.ranges.append(Selector(text, _enclosing(walk.stack)))
        elif kind == "ident" and _is_metric(text, following, walk.stack):
            walk.selectors.append(Selector(text, _enclosing(walk.stack)))
    return Scan(tuple(walk.selectors), tuple(walk.ranges))


def _enclosing(stack: list[str | None]) -> str | None:
    return stack[-1] if stack else None


def _is_metric(word: str, following: tuple[str, str], stack: list[str | None]) -> bool:
    if word.lower() in _KEYWORDS or (stack and stack[-1] in _GROUPING):
        return False
    return following[0] != "open" and following[1] not in {"by", "without"}


def known_metrics(recording_rules: Iterable[str]) -> frozenset[str]:
    """Every series name a query may use: the catalog as exposed, the recording rules, ``up`` and ``ALERTS``."""
    names = set(PROMETHEUS_SERIES) | set(recording_rules)
    for spec in CATALOG:
        if spec.type is MetricType.GAUGEHISTOGRAM:
            names.update(spec.name + suffix for suffix in GAUGEHISTOGRAM_SUFFIXES)
        else:
            names.add(spec.name)
    return frozenset(names)


def counters() -> frozenset[str]:
    return frozenset(spec.name for spec in CATALOG if spec.type is MetricType.COUNTER)


def query_findings(where: str, expr: str, known: Set[str], *, rate_interval: bool = True) -> list[Finding]:
    """Catalog, counter and rate-window rules for one query (promtool parsing is batched separately)."""
    result = scan(expr)
    findings = []
    counter_names = counters()
    for selector in result.selectors:
        if selector.metric not in known:
            findings.append(Finding(where, "unknown-metric", f"{selector.metric} is not in the catalog or the rules"))
        if selector.metric in counter_names and selector.enclosing not in RATE_FUNCTIONS:
            findings.append(
                Finding(where, "counter-outside-rate", f"counter {selector.metric} must sit inside rate/increase")
            )
    if rate_interval:
        for window in result.ranges:
            if window.enclosing in RATE_FUNCTIONS and window.metric != RATE_WINDOW:
                findings.append(
                    Finding(where, "rate-interval", f"{window.enclosing}() window {window.metric} is not {RATE_WINDOW}")
                )
    return findings


def promql_of_variable(query: str) -> str | None:
    """The PromQL inside a Grafana Prometheus variable query, or None for ``label_values(label)``."""
    for pattern in (_QUERY_RESULT, _LABEL_VALUES):
        match = pattern.match(query)
        if match:
            return match.group("expr")
    return None if query.strip().startswith("label_values(") else query


def _panels(panels: Iterable[Mapping[str, Any]]) -> Iterator[Mapping[str, Any]]:
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))


def _is_templated(datasource: object) -> bool:
    return isinstance(datasource, Mapping) and datasource.get("uid") == DATASOURCE_UID


def queries(dashboard: Mapping[str, Any]) -> Iterator[tuple[str, str]]:
    """(where, PromQL) for every panel target, variable and annotation of a dashboard."""
    for panel in _panels(dashboard.get("panels", [])):
        for target in panel.get("targets", []):
            yield f"panel {panel.get('title')!r} target {target.get('refId')}", target.get("expr", "")
    for variable in dashboard.get("templating", {}).get("list", []):
        if variable.get("type") == "query":
            query = variable.get("query")
            text = query.get("query", "") if isinstance(query, Mapping) else str(query)
            expr = promql_of_variable(text)
            if expr is not None:
                yield f"variable {variable.get('name')}", expr
    for annotation in dashboard.get("annotations", {}).get("list", []):
        if "expr" in annotation:
            yield f"annotation {annotation.get('name')!r}", annotation["expr"]


def structure_findings(dashboard: Mapping[str, Any]) -> list[Finding]:
    """Datasource, title, description and unit of every panel, datasource of every target and annotation."""
    findings = []
    ids = [panel.get("id") for panel in _panels(dashboard.get("panels", []))]
    if None in ids or len(set(ids)) != len(ids):
        findings.append(Finding("dashboard", "panel-id", f"panel ids must be set and unique, got {ids}"))
    for panel in _panels(dashboard.get("panels", [])):
        title = panel.get("title")
        where = f"panel {title!r}"
        if not title:
            findings.append(Finding(where, "panel-title", "panel has no title"))
        if panel.get("type") == "row":
            continue
        if not panel.get("description"):
            findings.append(Finding(where, "panel-description", "panel has no description"))
        if not panel.get("fieldConfig", {}).get("defaults", {}).get("unit"):
            findings.append(Finding(where, "panel-unit", "panel has no unit"))
        if not _is_templated(panel.get("datasource")):
            findings.append(Finding(where, "panel-datasource", f"datasource is not {DATASOURCE_UID}"))
        if not panel.get("targets"):
            findings.append(Finding(where, "panel-targets", "panel has no query"))
        for target in panel.get("targets", []):
            if not _is_templated(target.get("datasource")):
                findings.append(
                    Finding(f"{where} target {target.get('refId')}", "target-datasource", "not the datasource variable")
                )
    for annotation in dashboard.get("annotations", {}).get("list", []):
        if "expr" in annotation and not _is_templated(annotation.get("datasource")):
            findings.append(Finding(f"annotation {annotation.get('name')!r}", "annotation-datasource", "not templated"))
    for variable in dashboard.get("templating", {}).get("list", []):
        if variable.get("type") == "query" and not _is_templated(variable.get("datasource")):
            findings.append(Finding(f"variable {variable.get('name')}", "variable-datasource", "not templated"))
    return findings


def for_promtool(expr: str) -> str:
    """The query with Grafana's variables replaced the way Grafana would before sending it."""
    return _VARIABLE.sub("x", _INTERVAL_VARIABLES.sub("5m", expr))


def promtool_findings(named: Mapping[str, str]) -> list[Finding]:
    """Parse every query with promtool in one call: each becomes a recording rule in its own group."""
    if not named:
        return []
    promtool = shutil.which("promtool")
    if promtool is None:
        raise RuntimeError("promtool is not installed (Debian's prometheus package; `make test` installs it)")
    wheres = list(named)
    groups = [
        {"name": f"q{i}", "rules": [{"record": "lint:query", "expr": for_promtool(named[where])}]}
        for i, where in enumerate(wheres)
    ]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "queries.yml"
        path.write_text(yaml.safe_dump({"groups": groups}))
        result = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, check=False)
    if result.returncode == 0:
        return []
    output = result.stdout + result.stderr
    failed = [(int(i), message) for i, message in re.findall(r'group "q(\d+)", rule \d+, "[^"]*": (.*)', output)]
    if not failed:  # promtool refused the file as a whole: report it once, verbatim
        return [Finding("all queries", "promql-parse", output.strip())]
    return [Finding(wheres[i], "promql-parse", f"{named[wheres[i]]!r}: {message}") for i, message in failed]


def lint(dashboard: Mapping[str, Any], known: Set[str]) -> list[Finding]:
    """Every finding for one dashboard; empty means it passes."""
    findings = structure_findings(dashboard)
    named: dict[str, str] = {}
    for where, expr in queries(dashboard):
        named[where] = expr
        findings += query_findings(where, expr, known)
    return findings + promtool_findings(named)
