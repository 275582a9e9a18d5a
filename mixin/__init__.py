"""Generators of tqmon's shipped artefacts (docs, rules, dashboards, manifests), run from the checkout."""
