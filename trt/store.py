"""Where exported drafts live, and whether an export still matches its model.

An export for a draft is looked for in two places, in this order:

1. ``<draft dir>/onnx/`` -- next to the draft (not for truncated drafts), e.g.
   written there with ``specserve export-draft --draft DIR --out DIR/onnx``;
2. the cache, ``$SPECSERVE_HOME/exports/<key>-<dtype>/``, where ``<key>`` hashes
   the draft's location and truncation; ``export-draft`` writes here by default.

An export is current when its manifest's ``source_hash`` equals the hash of the
draft's weights now and its dtype is the one asked for. A stale export (the
model changed) is never used: ``ensure_export`` exports again into the cache.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from runtime.files import model_store
from trt import export
from trt.manifest import MANIFEST_NAME, Manifest, ManifestError
from trt.sources import DraftSource

log = logging.getLogger(__name__)

EXPORTS_DIR = "exports"
NEXT_TO_DRAFT = "onnx"


def exports_root() -> Path:
    return model_store.home() / EXPORTS_DIR


def cache_dir(source: DraftSource, dtype: str, root: Path | None = None) -> Path:
    return (root or exports_root()) / f"{source.key}-{dtype}"


def candidates(source: DraftSource, dtype: str, root: Path | None = None) -> list[Path]:
    dirs = [] if source.layers is not None else [source.path / NEXT_TO_DRAFT]
    return [*dirs, cache_dir(source, dtype, root)]


def is_export_dir(path: str | Path) -> bool:
    return (Path(path).expanduser() / MANIFEST_NAME).is_file()


@dataclass(frozen=True)
class Lookup:
    """The first current export found, and why any others were passed over."""

    directory: Path | None
    manifest: Manifest | None
    rejected: tuple[str, ...] = ()


def find_export(source: DraftSource, dtype: str, root: Path | None = None) -> Lookup:
    rejected: list[str] = []
    for directory in candidates(source, dtype, root):
        if not is_export_dir(directory):
            continue
        try:
            manifest = Manifest.load(directory)
        except ManifestError as exc:
            rejected.append(str(exc))
            continue
        problem = mismatch(manifest, source, dtype, directory)
        if problem is None:
            return Lookup(directory, manifest, tuple(rejected))
        rejected.append(f"{directory}: {problem}")
    return Lookup(None, None, tuple(rejected))


def mismatch(manifest: Manifest, source: DraftSource, dtype: str, directory: Path) -> str | None:
    """Why this export cannot stand in for ``source`` at ``dtype``; None when it can."""
    if manifest.dtype != dtype:
        return f"the export is {manifest.dtype}, not {dtype}"
    if manifest.source_hash != source.fingerprint:
        return "the draft's weights or config changed since it was exported"
    if not (directory / manifest.onnx_file).is_file():
        return f"{manifest.onnx_file} is missing"
    return None


def ensure_export(
    source: DraftSource,
    dtype: str,
    root: Path | None = None,
    *,
    check: bool = True,
    progress: bool = False,
) -> tuple[Path, Manifest]:
    """A current export of ``source``: reused when there is one, else made now (in the cache)."""
    found = find_export(source, dtype, root)
    for reason in found.rejected:
        log.warning("not using export %s", reason)
    if found.directory is not None and found.manifest is not None:
        log.info("reusing the %s export of %s in %s", dtype, source.spec, found.directory)
        return found.directory, found.manifest
    out = cache_dir(source, dtype, root)
    log.warning("exporting draft %s to ONNX (%s) in %s; later starts reuse it",
                source.spec, dtype, out)
    manifest = export.export_onnx(source, out, dtype, check=check, progress=progress)
    return out, manifest
