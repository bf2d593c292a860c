"""The stored verify curve: a measurement kept per target, draft models, CPU and threads,
read back at the next start instead of timing the passes again."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from decoding.engine import Engine
from decoding.policy import MAX_DRAFT_TOKENS
from decoding.policy.curve import from_seconds
from gateway.server import create_app
from gateway.service import curve_store
from gateway.service.curve_store import CurveStore, StoredCurve, curve_key, set_verify_curve
from gateway.service.settings import Settings
from runtime.native import kernels
from runtime.runner.batched import BatchedLM
from runtime.runner.causal_lm import CausalLM
from tests.gateway.conftest import in_process, tiny_settings

READY_CEILING_S = 600.0  # loading and measuring the default model: only a hang reaches it


def _stored(costs: dict[str, float] | None = None) -> StoredCurve:
    """A curve of figures no rounding leaves alone, as a measurement makes them."""
    seconds = [0.0123456789 * (1 + 0.0371 * k + (0.5 if k > 7 else 0.0))
               for k in range(MAX_DRAFT_TOKENS + 1)]
    return StoredCurve(from_seconds(seconds), costs if costs is not None else {},
                       "2025-01-02T03:04:05+00:00")


def _copied_model(source: Path, into: Path) -> Path:
    into.mkdir()
    for file in source.iterdir():
        shutil.copy2(file, into / file.name)
    return into


def test_the_key_follows_the_threads_the_target_files_the_kernels_and_the_drafts(
        tiny_target_dir: Path, tiny_draft: CausalLM, tiny_target: CausalLM,
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model_dir = _copied_model(tiny_target_dir, tmp_path / "target")
    target = BatchedLM.load(str(model_dir), dtype="float32")
    assert kernels.loaded() is not None  # the tiny target runs on the native kernels
    drafts = {"draft": tiny_draft}
    key = curve_key(target, drafts, threads=2)
    store = CurveStore(tmp_path / "curves")
    assert curve_key(target, drafts, threads=2) == key  # nothing changed: the same key
    assert key["threads"] == 2 and key["target"]["path"] == str(model_dir.resolve())
    assert key["native_kernels"]["sources"] == kernels.source_digest()[:16]
    assert key["drafts"]["draft"]["path"] == str(Path(tiny_draft.name).resolve())
    changed = {
        "threads": curve_key(target, drafts, threads=1),
        "draft set": curve_key(target, {}, threads=2),
        "drafter name": curve_key(target, {"other": tiny_draft}, threads=2),
        "draft model": curve_key(target, {"draft": tiny_target}, threads=2),
    }
    weights = next(model_dir.glob("*.safetensors"))
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    changed["target modified"] = curve_key(target, drafts, threads=2)
    with weights.open("ab") as out:
        out.write(b"\0")
    changed["target size"] = curve_key(target, drafts, threads=2)
    sources = tmp_path / "csrc"
    shutil.copytree(kernels.SOURCE_DIR, sources)
    monkeypatch.setattr(kernels, "SOURCE_DIR", sources)
    with (sources / "vec.h").open("a") as out:
        out.write("\n// another build of the kernels\n")
    changed["kernel sources"] = curve_key(target, drafts, threads=2)
    assert changed["target modified"]["target"]["bytes"] == key["target"]["bytes"]
    assert changed["target size"]["target"]["bytes"] == key["target"]["bytes"] + 1
    for what, other in changed.items():
        assert other != key, what
        assert store.path(other) != store.path(key), what
    assert store.path(key).name.startswith("target-")  # the target's name, for the eye


def test_a_saved_curve_loads_back_exactly(tiny_target: CausalLM, tiny_draft: CausalLM,
                                          tmp_path: Path) -> None:
    key = curve_key(tiny_target, {"draft": tiny_draft}, threads=3)
    stored = _stored({"draft": 0.123456789012345})
    store = CurveStore(tmp_path / "made" / "on" / "save")
    path = store.save(key, stored)
    assert path == store.path(key) and path.is_file()
    assert store.load(key) == stored
    record = json.loads(path.read_text())
    assert record["key"] == key  # what it was measured on, readable
    assert record["key"]["threads"] == 3 and record["key"]["cpu"] == kernels.cpu_name()
    assert record["steps"] == list(stored.curve.steps)
    assert record["step_s"] == stored.curve.step_s
    assert record["measured_at"] == "2025-01-02T03:04:05+00:00"
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # nothing left beside it
    assert CurveStore(tmp_path / "elsewhere").load(key) is None


@pytest.mark.parametrize("content", [
    "{not json", "", "[1, 2]", '{"format": 1}',
    # figures no measurement makes: too few steps, falling steps, a negative cost, the
    # costs of other drafters than the key's
    "SHORT", "FALLING", "NEGATIVE_COST", "OTHER_DRAFTS",
])
def test_a_corrupt_file_is_ignored_and_the_curve_measured_again(
        content: str, tiny_target: CausalLM, tiny_draft: CausalLM, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    drafts = {"draft": tiny_draft}
    key = curve_key(tiny_target, drafts, threads=torch.get_num_threads())
    store = CurveStore(tmp_path)
    good = _stored({"draft": 0.5})
    record: dict[str, Any] = {"format": 1, "key": key, "measured_at": good.measured_at,
                              "steps": list(good.curve.steps), "step_s": good.curve.step_s,
                              "draft_costs": good.draft_costs}
    broken = {"SHORT": {**record, "steps": record["steps"][:4]},
              "FALLING": {**record, "steps": [1.0, 1.5, *record["steps"][2:]]},
              "NEGATIVE_COST": {**record, "draft_costs": {"draft": -0.5}},
              "OTHER_DRAFTS": {**record, "draft_costs": {"another": 0.5}}}
    store.directory.mkdir(exist_ok=True)
    store.path(key).write_text(json.dumps(broken[content]) if content in broken else content)
    with caplog.at_level(logging.WARNING, logger=curve_store.__name__):
        assert store.load(key) is None
    assert f"ignoring the stored verify curve {store.path(key)}" in caplog.text
    if content == "{not json":  # through the start-up's own path: measured, then stored
        engine = Engine(tiny_target, {})
        settings = tiny_settings(verify_curve_dir=str(tmp_path))
        set_verify_curve(engine, tiny_target, drafts, settings)
        assert engine.info["curve_source"] == "measured"
        assert store.load(key) == StoredCurve(engine.scheduler.verify_curve,
                                              engine.scheduler.draft_costs,
                                              engine.info["curve_measured_at"])


def test_a_file_recorded_for_another_key_is_ignored(
        tiny_target: CausalLM, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A file at this key's name whose recorded key differs (the threads here) is not
    taken: the curve is measured again and the file replaced."""
    threads = torch.get_num_threads()  # those the start-up measures on
    key = curve_key(tiny_target, {}, threads=threads)
    store = CurveStore(tmp_path)
    assert store.save(curve_key(tiny_target, {}, threads=threads + 1), _stored()) is not None
    (other,) = tmp_path.iterdir()
    other.rename(store.path(key))
    with caplog.at_level(logging.WARNING, logger=curve_store.__name__):
        assert store.load(key) is None
    assert "measured for another target, host or setting" in caplog.text
    engine = Engine(tiny_target, {})
    set_verify_curve(engine, tiny_target, {}, tiny_settings(verify_curve_dir=str(tmp_path)))
    assert engine.info["curve_source"] == "measured"
    assert json.loads(store.path(key).read_text())["key"] == key


@pytest.mark.parametrize("how", ["under a file", "read-only"])
def test_a_directory_that_cannot_be_written_does_not_stop_the_start(
        how: str, tiny_target: CausalLM, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    if how == "under a file":
        (tmp_path / "file").write_text("")
        directory = tmp_path / "file" / "curves"
    else:
        directory = tmp_path / "curves"
        directory.mkdir()
        directory.chmod(0o555)
        if os.access(directory, os.W_OK):
            pytest.skip("this user writes into a read-only directory (root)")
    try:
        key = curve_key(tiny_target, {}, threads=1)
        with caplog.at_level(logging.WARNING, logger=curve_store.__name__):
            assert CurveStore(directory).save(key, _stored()) is None
        assert f"cannot store the verify curve in {directory}" in caplog.text
        engine = Engine(tiny_target, {})
        said = set_verify_curve(engine, tiny_target, {},
                                tiny_settings(verify_curve_dir=str(directory)))
        assert said.endswith("not stored") and engine.info["curve_source"] == "measured"
        assert engine.scheduler.verify_curve is not None
        assert engine.speculation_profile is not None
    finally:
        if directory.exists():
            directory.chmod(0o755)


async def _start(settings: Settings) -> dict[str, Any]:
    """The default model served as ``specserve serve`` loads it (the lifespan builds the
    engine): its model card once ready."""
    app = create_app(settings)
    async with in_process(app) as client:
        deadline = time.monotonic() + READY_CEILING_S
        while (await client.get("/ready")).status_code != 200:
            assert app.state.gateway.load_error is None, app.state.gateway.load_error
            assert time.monotonic() < deadline, "the server did not get ready"
            await asyncio.sleep(0.2)
        (card,) = (await client.get("/v1/models")).json()["data"]
    return dict(card["metadata"]["speculation"])


@pytest.mark.real_model
async def test_a_second_start_reads_the_curve_the_first_measured(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    settings = Settings(api_keys=[], cors_origins=[], verify_curve_dir=str(tmp_path))
    with caplog.at_level(logging.INFO, logger="gateway.server"):
        first = await _start(settings)
    assert first["curve_source"] == "measured"
    (path,) = tmp_path.glob("*.json")
    written = path.read_text()
    record = json.loads(written)
    assert record["steps"] == first["verify_steps"]
    assert round(record["step_s"] * 1000, 3) == first["step_ms"]
    assert record["measured_at"] == first["measured_at"]
    assert set(record["draft_costs"]) == set(first["draft_cost"]) - {"lookup"}
    assert any(r.getMessage().startswith("verify curve") and f"measured now, stored in {path}"
               in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="gateway.server"):
        second = await _start(settings)
    assert second["curve_source"] == "stored"
    assert {k: v for k, v in second.items() if k != "curve_source"} == {
        k: v for k, v in first.items() if k != "curve_source"}
    assert path.read_text() == written  # read, not measured and written again
    assert any(f"read from {path}, measured {first['measured_at']}" in r.getMessage()
               for r in caplog.records)
    third = await _start(settings.model_copy(update={"verify_curve": "measure"}))
    assert third["curve_source"] == "measured"
    assert list(tmp_path.glob("*.json")) == [path]  # the same key's file, replaced
    record = json.loads(path.read_text())
    assert record["steps"] == third["verify_steps"]
    assert record["measured_at"] == third["measured_at"]
    assert round(record["step_s"] * 1000, 3) == third["step_ms"]
