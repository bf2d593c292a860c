"""This host's pip setup, made portable into a container.

Writes one pip configuration file (the [global] section) holding what `pip config
list` reports on this host, the environment's PIP_* settings included, and prints,
one a line, the host paths it names (CA bundle, constraint files, find-links and
file:// index directories), which a container needs mounted read-only at the same
paths. A file:// index directory named `simple` is printed as its parent, since such
an index links its files beside it (../../files/...).

usage: python scripts/host-pip-config.py OUT.conf
"""

from __future__ import annotations

import ast
import configparser
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlparse

# settings that only make sense on the host (or would break a build inside a container)
LEFT_OUT = {"user", "target", "prefix", "root", "src", "cache-dir", "log", "no-cache-dir"}


def host_settings() -> dict[str, str]:
    """pip's configuration here, files first and the environment over them."""
    listing = subprocess.run([sys.executable, "-m", "pip", "config", "list"],
                             capture_output=True, text=True, check=True).stdout
    from_files: dict[str, str] = {}
    from_env: dict[str, str] = {}
    for line in listing.splitlines():
        key, sep, value = line.partition("=")
        if not sep:
            continue
        section, _, name = key.partition(".")
        if section not in {"global", "install", "download", "wheel", ":env:"}:
            continue
        if name in LEFT_OUT:
            continue
        (from_env if section == ":env:" else from_files)[name] = ast.literal_eval(value)
    return {**from_files, **from_env}


def host_paths(settings: dict[str, str]) -> list[Path]:
    """The existing host paths the settings name, without duplicates or nesting."""
    found: set[Path] = set()
    for value in settings.values():
        for token in value.split():
            if token.startswith("file://"):
                path = Path(urlparse(token).path)
                if path.name == "simple":
                    path = path.parent
            elif token.startswith("/"):
                path = Path(token)
            else:
                continue
            if path.exists():
                found.add(path.resolve())
    ordered = sorted(found, key=lambda p: len(p.parts))
    kept: list[Path] = []
    for path in ordered:
        if not any(path.is_relative_to(parent) for parent in kept):
            kept.append(path)
    return sorted(kept)


def main(out: str) -> None:
    settings = host_settings()
    config = configparser.ConfigParser(interpolation=None)
    config["global"] = settings
    with open(out, "w") as f:
        config.write(f)
    for path in host_paths(settings):
        print(path)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
