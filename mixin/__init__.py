"""Tooling that runs from a checkout, never shipped: the generators and linters of the committed outputs.

``python -m mixin.docs``, ``python -m mixin.rules`` and ``python -m mixin.dashboards`` (``make docs``)
write ``docs/metrics.md``, ``deploy/prometheus/tqmon-rules.yml`` and ``grafana/dashboards/*.json``; tests
fail when a committed output drifts from what its generator writes.
"""
