"""Writes ``deploy/prometheus/tqmon-rules.yml`` with the default ``RuleConfig`` (``python -m mixin.rules``).

The rules themselves are rendered by the runtime package (:func:`tqmon.rules.render`, also ``tqmon rules``).
"""

from __future__ import annotations

import sys

from mixin.repo import write
from tqmon.rules import render

RULES_FILE = "deploy/prometheus/tqmon-rules.yml"


def main() -> int:
    write(RULES_FILE, render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
