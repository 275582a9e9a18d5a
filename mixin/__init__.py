"""Tooling that runs from a checkout, never shipped: the generators and linters of the committed outputs.

``python -m mixin.docs``, ``python -m mixin.rules``, ``python -m mixin.dashboards`` and
``python -m mixin.kubernetes`` (``make docs``) write ``docs/metrics.md``, ``deploy/prometheus/tqmon-rules.yml``,
``grafana/dashboards/*.json`` and the generated manifests under ``deploy/kubernetes/base/``; tests fail when
a committed output drifts from what its generator writes.
"""
