"""What ``--draft auto`` serves: the drafter mix measured fastest for the target, where a
measurement was stored (``python -m specbench.draft_choice --write``), else a rule.

The default model's measurement is stored beside the draft shipped for it, so it applies
to the target that draft was made for; another target's beside its own file
(``choice_path_for``). It names the mix whose geometric mean of
speed-ups over plain decoding, on the shipped ``chat`` and ``grounded`` sets, was the
highest (of mixes within a run's noise of it, the one faster on chat), with outputs
equal to plain decoding's. The continuation cache joins the mix
wherever a prefix cache runs: it drafts only on a cache hit, so it costs nothing where
it has nothing to offer, and distinct benchmark prompts cannot measure it.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtime.drafts import draft_format

log = logging.getLogger(__name__)

CHOICE_FORMAT = "specserve-draft-choice"
CHOICE_VERSION = 1
CHOICE_NAME = "choice.json"


def choice_path() -> Path:
    return draft_format.DEFAULT_DRAFT_DIR / CHOICE_NAME


def choice_path_for(target: str) -> Path:
    """Where a choice measured for another target is stored: beside its GGUF file
    (``<file>.choice.json``), or in its model directory."""
    path = Path(target)
    return path.with_name(path.name + "." + CHOICE_NAME) if path.suffix == ".gguf" else (
        path / CHOICE_NAME)


@dataclass(frozen=True)
class Measured:
    """A stored choice: the mix, and what it measured."""

    spec: str
    speedup: dict[str, float]  # per prompt set, against plain decoding
    cpu: str
    threads: int
    command: str

    def reason(self) -> str:
        gains = ", ".join(f"{name} {ratio:.2f}x" for name, ratio in self.speedup.items())
        return (f"chosen by measurement ({gains} against none; {self.cpu}, "
                f"{self.threads} threads; {self.command})")


def read_choice(path: Path | None = None) -> Measured | None:
    """The stored choice, or None where there is none or it cannot be read (a log line
    says why)."""
    path = path or choice_path()
    if not path.is_file():
        return None
    try:
        data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
        if data.get("format") != CHOICE_FORMAT or data.get("version") != CHOICE_VERSION:
            raise ValueError(f"not a version {CHOICE_VERSION} {CHOICE_FORMAT} file")
        spec = str(data["choice"])
        row = next(r for r in data["mixes"] if r["spec"] == spec)
        return Measured(spec, {k: float(v) for k, v in row["speedup"].items()},
                        str(data["machine"].get("cpu", "unknown CPU")), int(data["threads"]),
                        str(data["command"]))
    except (OSError, ValueError, KeyError, TypeError, StopIteration) as exc:
        log.warning("ignoring the stored draft choice %s: %s", path, exc)
        return None
