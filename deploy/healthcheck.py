"""Container health check: exit 0 when the server answers 200 on a path (default /health).

Used by the image's HEALTHCHECK and by docker-compose (with /ready); it needs
nothing beyond the standard library, so the slim images need no curl.

usage: python healthcheck.py [PATH]
"""

from __future__ import annotations

import os
import sys
import urllib.request


def main(path: str = "/health") -> int:
    port = os.environ.get("SPECSERVE_PORT", "8000")
    url = f"http://127.0.0.1:{port}{path}"
    try:
        with urllib.request.urlopen(url, timeout=4) as response:
            return 0 if response.status == 200 else 1
    except OSError as exc:  # URLError, HTTPError and timeouts included
        print(f"{url}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:2]))
