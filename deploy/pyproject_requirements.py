"""Print the project's requirements (plus chosen extras) from pyproject.toml, one per line.

The image build installs these before copying the source, so that a source
change does not re-install the dependencies.

usage: python pyproject_requirements.py pyproject.toml [extra,extra,...]
"""

from __future__ import annotations

import sys
import tomllib


def requirements(pyproject: str, extras: str = "") -> list[str]:
    with open(pyproject, "rb") as f:
        project = tomllib.load(f)["project"]
    wanted = [name.strip() for name in extras.split(",") if name.strip()]
    optional = project.get("optional-dependencies", {})
    found = list(project.get("dependencies", []))
    for name in wanted:
        if name not in optional:  # like pip: warn, and go on without it
            print(f"warning: {pyproject} has no extra {name!r}", file=sys.stderr)
            continue
        found.extend(optional[name])
    return found


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        raise SystemExit(__doc__)
    print("\n".join(requirements(*sys.argv[1:])))
