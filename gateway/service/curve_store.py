"""Verify curves measured at earlier start-ups, kept on disk so that a restart does not
time them again.

A target's verify curve and its draft models' steps (``decoding.policy.curve``) depend on
the models, what they run in (dtype, weights, kernels, batch invariance), the CPU and the
number of threads, never on the text served. Each measurement is one JSON file under
``$SPECSERVE_HOME/curves`` (``--verify-curve-dir``), named by the target's file and a
digest of all of that (the key), and holds the key in readable form beside the figures, so
that an operator can see what it was measured on. A file that cannot be read, does not
parse, or was measured for another key is ignored with a log line and the curve measured
again; a directory that cannot be written only costs the next start a measurement.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from decoding.engine import Engine
from decoding.policy.cost import MAX_DRAFT_TOKENS, VerifyCurve
from decoding.policy.curve import CONTEXT, REPEATS
from gateway.service.settings import Settings
from runtime.files import model_store
from runtime.loaders.loading import target_precision
from runtime.native import kernels
from runtime.runner.causal_lm import CausalLM

log = logging.getLogger(__name__)

FORMAT = 1  # of the files: a file of another format is measured again
MODEL_FILES = {".json", ".safetensors", ".bin", ".gguf"}  # a model directory's shape and weights
MEASURED, STORED = "measured", "stored"  # where a start's curve came from (/v1/models)

CurveKey = dict[str, Any]  # plain JSON values, as the file holds them


@dataclass(frozen=True)
class StoredCurve:
    """A target's verify curve and each draft model's step in target steps, by drafter
    name (``Engine.measure_verify_curve``), and when they were measured (ISO 8601, UTC)."""

    curve: VerifyCurve
    draft_costs: dict[str, float]
    measured_at: str


def model_identity(model: CausalLM) -> dict[str, Any]:
    """What a model's passes cost depends on, readable: its files (the path, their total
    size, the newest modification, and a digest of each one's name, size and modification
    time; a hub id is only its name) and what it runs in."""
    path = Path(model.name)
    files = (sorted(p for p in path.iterdir() if p.suffix in MODEL_FILES and p.is_file())
             if path.is_dir() else [path] if path.is_file() else [])
    stats = [(file.name, file.stat()) for file in files]
    listing = json.dumps([[name, st.st_size, st.st_mtime_ns] for name, st in stats])
    dtype = str(model.dtype).removeprefix("torch.")
    return {
        "path": str(path.resolve()) if files else model.name,
        "bytes": sum(st.st_size for _, st in stats),
        "modified": (datetime.fromtimestamp(max(st.st_mtime for _, st in stats), UTC)
                     .isoformat(timespec="seconds") if stats else None),
        "files": hashlib.blake2b(listing.encode(), digest_size=8).hexdigest(),
        "dtype": dtype,
        "weights": target_precision(model),
        "product_activations": getattr(model, "product_activations", dtype),
        "kernels": getattr(model, "kernels", "torch"),
        "batch_invariant": getattr(model, "batch_invariant", None),
    }


def curve_key(target: CausalLM, drafts: Mapping[str, CausalLM], threads: int) -> CurveKey:
    """Everything a measured curve depends on: the target, each draft model by drafter
    name, the CPU and the best instruction-set level it runs, the native kernels' level
    and sources where a model runs on them, the threads a pass runs on, PyTorch's version
    and how the curve is measured."""
    native = kernels.loaded() is not None
    return {
        "target": model_identity(target),
        "drafts": {name: model_identity(draft) for name, draft in sorted(drafts.items())},
        "cpu": kernels.cpu_name(),
        "cpu_level": kernels.host_levels()[-1],
        "native_kernels": ({"level": kernels.capability(),
                            "sources": kernels.source_digest()[:16]} if native else None),
        "threads": threads,
        "torch": torch.__version__,
        "measured_with": {"context": CONTEXT, "draft_tokens": MAX_DRAFT_TOKENS,
                          "repeats": REPEATS},
    }


class CurveStore:
    """Measured curves in ``directory``, one JSON file per key."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def path(self, key: CurveKey) -> Path:
        """The key's file: the target's file name, for an operator's eye, and the key's
        digest."""
        digest = hashlib.blake2b(json.dumps(key, sort_keys=True).encode(), digest_size=10)
        name = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(str(key["target"]["path"])).name)
        return self.directory / f"{name[:64]}-{digest.hexdigest()}.json"

    def load(self, key: CurveKey) -> StoredCurve | None:
        """The curve stored for ``key``, or None: none stored, or one that is unreadable,
        malformed or recorded for another key (said in the log)."""
        path = self.path(key)
        if not path.exists():
            return None
        try:
            return _parse(json.loads(path.read_text(encoding="utf-8")), key)
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
            log.warning("ignoring the stored verify curve %s (%s); measuring it again",
                        path, exc)
            return None

    def save(self, key: CurveKey, stored: StoredCurve) -> Path | None:
        """Write ``stored`` as ``key``'s file (whole or not at all: a file beside it, then
        renamed); None, with a warning, where the directory cannot be written."""
        record = {"format": FORMAT, "key": key, "measured_at": stored.measured_at,
                  "steps": list(stored.curve.steps), "step_s": stored.curve.step_s,
                  "draft_costs": stored.draft_costs}
        path, written = self.path(key), None
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("w", encoding="utf-8", dir=self.directory,
                                             prefix=f".{path.name}.", delete=False) as out:
                written = Path(out.name)
                json.dump(record, out, indent=1, sort_keys=True)
            os.replace(written, path)
        except OSError as exc:
            log.warning("cannot store the verify curve in %s (%s); the next start measures "
                        "it again", self.directory, exc)
            if written is not None:
                written.unlink(missing_ok=True)
            return None
        return path


def _parse(record: Any, key: CurveKey) -> StoredCurve:
    """A stored file's curve, checked against ``key`` and for figures a measurement
    makes; raises ValueError saying what is wrong."""
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise ValueError(f"not a verify curve file of format {FORMAT}")
    if record.get("key") != key:
        raise ValueError("it was measured for another target, host or setting")
    steps = tuple(float(s) for s in record["steps"])
    step_s = float(record["step_s"])
    costs = {str(name): float(cost) for name, cost in record["draft_costs"].items()}
    if (len(steps) != MAX_DRAFT_TOKENS + 1 or steps[0] != 1.0 or list(steps) != sorted(steps)
            or not all(map(math.isfinite, [*steps, step_s, *costs.values()]))
            or step_s <= 0 or min(costs.values(), default=0.0) < 0
            or set(costs) != set(key["drafts"])):
        raise ValueError("its figures are not a measured curve and draft costs")
    return StoredCurve(VerifyCurve(steps, step_s), costs, str(record["measured_at"]))


def curve_dir(settings: Settings) -> Path:
    """Where measured curves are kept: ``--verify-curve-dir``, else
    ``$SPECSERVE_HOME/curves``."""
    return Path(settings.verify_curve_dir or model_store.home() / "curves")


def set_verify_curve(engine: Engine, target: CausalLM, drafts: Mapping[str, CausalLM],
                     settings: Settings) -> str:
    """Give ``engine`` (not yet started) its verify curve and draft costs: with
    ``--verify-curve stored`` those stored for this key where there are, else measured now
    and stored for the next start. ``engine.info`` says where they came from
    (``curve_source``, ``curve_measured_at``); returns the start-up log's words for it."""
    store = CurveStore(curve_dir(settings))
    key = curve_key(target, drafts, torch.get_num_threads())
    stored = store.load(key) if settings.verify_curve == STORED else None
    if stored is not None:
        engine.measure_verify_curve(stored=(stored.curve, stored.draft_costs))
        source, said = STORED, f"read from {store.path(key)}, measured {stored.measured_at}"
    else:
        curve, costs = engine.measure_verify_curve(drafts)
        stored = StoredCurve(curve, costs, datetime.now(UTC).isoformat(timespec="seconds"))
        saved = store.save(key, stored)
        source, said = MEASURED, (f"measured now, stored in {saved}" if saved
                                  else "measured now, not stored")
    engine.info.update(curve_source=source, curve_measured_at=stored.measured_at)
    return said
