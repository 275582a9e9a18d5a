"""``python -m tqmon.healthcheck``: the container's HEALTHCHECK, with nothing but the image's own Python.

It asks ``/healthz`` of the tqmon in the same container, at the port of ``TQMON_LISTEN`` on loopback
(a wildcard listen address answers there too), and exits 0 only on HTTP 200; slim images ship no curl.
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request

DEFAULT_LISTEN = "127.0.0.1:9842"
WILDCARDS = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}


def healthz_url(listen: str) -> str:
    """The loopback URL of ``/healthz`` for a ``HOST:PORT`` listen address."""
    host, _, port = listen.rpartition(":")
    host = host.strip("[]")
    host = WILDCARDS.get(host, host)
    return f"http://[{host}]:{port}/healthz" if ":" in host else f"http://{host}:{port}/healthz"


def main() -> int:
    url = healthz_url(os.environ.get("TQMON_LISTEN", DEFAULT_LISTEN))
    try:
        with urllib.request.urlopen(url, timeout=3) as response:
            ok = response.status == 200
    except (urllib.error.URLError, OSError) as err:
        print(f"unhealthy: {url}: {err}", file=sys.stderr)
        return 1
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
