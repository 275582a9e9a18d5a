"""The shipped alert rules' conditions, evaluated on one snapshot, for readers without Prometheus at hand.

Prometheus evaluates the real rules over time (``for:``, scrape health); this module only says whether each
rule's condition holds in this snapshot, with the default thresholds of :class:`tqmon.rules.RuleConfig`. The
condition is the one declared beside the alert's PromQL (``Alert.check``), so every shipped alert appears:
evaluated, or marked as needing Prometheus with the reason its declaration gives.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from tqmon.rules import RuleConfig, alerts
from tqmon.snapshot import Snapshot


class ConditionState(enum.StrEnum):
    TRUE = "true"  # the condition holds now; Prometheus fires once it has held for the rule's `for:`
    FALSE = "false"
    NEEDS_PROMETHEUS = "needs Prometheus"


@dataclass(frozen=True, slots=True)
class Condition:
    alert: str
    severity: str
    summary: str
    duration: str  # the rule's `for:`
    state: ConditionState
    detail: str  # the values behind the state


def evaluate(snapshot: Snapshot, now: float, config: RuleConfig | None = None) -> list[Condition]:
    """Every shipped alert with its condition's state in this snapshot, in the rules file's order."""
    config = config or RuleConfig()
    result = []
    for alert in alerts(config):
        if alert.check is None:
            state, detail = ConditionState.NEEDS_PROMETHEUS, alert.prometheus_only
        else:
            holds, detail = alert.check(snapshot, now, config)
            state = ConditionState.TRUE if holds else ConditionState.FALSE
        result.append(Condition(alert.name, alert.severity, alert.summary, alert.duration, state, detail))
    return result
