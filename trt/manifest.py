"""The manifest written next to an exported draft: what it is, where it came from.

Its presence marks a complete export (it is written last). ``source_hash`` ties
the export to the exact weights it was made from, so a changed model is noticed.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

MANIFEST_NAME = "manifest.json"
ONNX_NAME = "draft.onnx"
FORMAT_VERSION = 1

INPUT_IDS = "input_ids"
LOGITS = "logits"
SEQ_DIM = "seq"  # tokens fed in one step
PAST_DIM = "past"  # tokens already in the KV cache


def past_names(num_layers: int) -> list[str]:
    """KV-cache inputs in the order the step takes them: key then value, layer by layer."""
    return [f"past_{kind}_{i}" for i in range(num_layers) for kind in ("key", "value")]


def present_names(num_layers: int) -> list[str]:
    return [f"present_{kind}_{i}" for i in range(num_layers) for kind in ("key", "value")]


class ManifestError(ValueError):
    """A manifest that is missing, unreadable or from another format version."""


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int | str, ...]  # symbolic dimensions by name
    dtype: str


@dataclass(frozen=True)
class ExportCheck:
    """How the export was checked against PyTorch before it was declared good."""

    runtime: str  # e.g. "onnxruntime 1.20.1 (CPUExecutionProvider)"
    cases: tuple[tuple[int, int], ...]  # (past length, new tokens)
    max_abs_logits_diff: float
    tolerance: float | None  # the largest diff accepted; None: judged by top-k agreement
    top_k: int = 0
    # Share of cases where each side's most likely token is among the other's top_k.
    top_k_agreement: float | None = None

    @property
    def summary(self) -> str:
        judged = (f"<= {self.tolerance:g}" if self.tolerance is not None
                  else "(not judged)")
        agreement = ("" if self.top_k_agreement is None
                     else f", top-{self.top_k} agreement {self.top_k_agreement:.0%}")
        return (f"max |logits diff| {self.max_abs_logits_diff:.3g} {judged}{agreement} "
                f"on {self.runtime}")


@dataclass(frozen=True)
class Manifest:
    source_spec: str
    source_path: str
    source_hash: str  # DraftSource.fingerprint of the weights it was made from
    architecture: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_positions: int
    dtype: str
    opset: int
    onnx_file: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    check: ExportCheck | None
    versions: dict[str, str] = field(default_factory=dict)
    created: str = ""
    format_version: int = FORMAT_VERSION

    @property
    def past_names(self) -> list[str]:
        return past_names(self.num_layers)

    @property
    def present_names(self) -> list[str]:
        return present_names(self.num_layers)

    def save(self, directory: Path) -> Path:
        """Write atomically, so a reader never sees half a manifest."""
        path = directory / MANIFEST_NAME
        fd, tmp = tempfile.mkstemp(prefix=".manifest-", dir=directory)
        with os.fdopen(fd, "w") as f:
            json.dump(asdict(self), f, indent=2)
            f.write("\n")
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, directory: Path) -> Manifest:
        path = directory / MANIFEST_NAME
        try:
            raw: dict[str, Any] = json.loads(path.read_text())
        except FileNotFoundError as exc:
            raise ManifestError(f"no export in {directory} (no {MANIFEST_NAME})") from exc
        except (OSError, json.JSONDecodeError) as exc:
            raise ManifestError(f"unreadable manifest {path}: {exc}") from exc
        if raw.get("format_version") != FORMAT_VERSION:
            raise ManifestError(
                f"{path} has format version {raw.get('format_version')}, expected "
                f"{FORMAT_VERSION}; export the draft again")
        try:
            check = raw.pop("check")
            return cls(
                inputs=tuple(_tensor(t) for t in raw.pop("inputs")),
                outputs=tuple(_tensor(t) for t in raw.pop("outputs")),
                check=None if check is None else ExportCheck(
                    runtime=check["runtime"],
                    cases=tuple((int(p), int(n)) for p, n in check["cases"]),
                    max_abs_logits_diff=float(check["max_abs_logits_diff"]),
                    tolerance=_optional_float(check["tolerance"]),
                    top_k=int(check.get("top_k", 0)),
                    top_k_agreement=_optional_float(check.get("top_k_agreement")),
                ),
                **raw,
            )
        except (KeyError, TypeError) as exc:
            raise ManifestError(f"malformed manifest {path}: {exc}") from exc


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _tensor(raw: dict[str, Any]) -> TensorSpec:
    return TensorSpec(name=raw["name"], shape=tuple(raw["shape"]), dtype=raw["dtype"])
