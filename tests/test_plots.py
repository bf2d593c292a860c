"""Benchmarks write PNG plots beside their JSON (tiny runs on tiny models), and without
matplotlib they still write the JSON and say how to get the plots."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from PIL import Image

from specbench.plots import MISSING, write_plots
from specserve.cli import main

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
TINY_RUN = ["--prompts", "1", "--max-tokens", "6"]


def assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, path
    assert len(data) > 10_000, (path, len(data))  # drawn axes and text, not an empty canvas
    with Image.open(path) as image:
        image.verify()
    with Image.open(path) as image:
        width, height = image.size
        assert width >= 400 and height >= 300, image.size
        assert len(image.getcolors(maxcolors=1 << 16) or range(1 << 16)) > 8  # not blank


def test_bench_writes_its_tokens_plot(tiny_target_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    assert main(["bench", "--target", str(tiny_target_dir), "--dtypes", "float32",
                 "--methods", "spec:ngram", "--no-hf", *TINY_RUN, "--json", str(out)]) == 0
    assert sorted(p.name for p in tmp_path.glob("*.png")) == ["bench-tokens.png"]
    assert_png(tmp_path / "bench-tokens.png")


def test_acceptance_writes_its_plot(tiny_target_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "acc.json"
    assert main(["acceptance", "--target", str(tiny_target_dir), "--drafts",
                 f"ngram,{tiny_target_dir}", "--k", "1,3", "--draft-backend", "torch",
                 *TINY_RUN, "--json", str(out)]) == 0
    assert_png(tmp_path / "acc-acceptance.png")


def test_concurrency_writes_its_plot(tiny_target_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "load.json"
    assert main(["bench", "--target", str(tiny_target_dir), "--concurrency", "1,2",
                 "--modes", "off,on", "--dtypes", "float32", "--prompt-sets", "chat",
                 *TINY_RUN, "--json", str(out)]) == 0
    assert_png(tmp_path / "load-concurrency.png")
    runs = json.loads(out.read_text())["runs"]
    assert {(r["concurrency"], r["mode"]) for r in runs} == {(1, "off"), (1, "on"), (2, "off"),
                                                              (2, "on")}


def test_without_matplotlib_the_json_is_written_and_one_line_says_why(
        tiny_target_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    out = tmp_path / "bench.json"
    assert main(["bench", "--target", str(tiny_target_dir), "--dtypes", "float32",
                 "--methods", "plain", "--no-hf", "--prompt-sets", "chat", *TINY_RUN,
                 "--json", str(out)]) == 0
    assert json.loads(out.read_text())["runs"]
    assert not list(tmp_path.glob("*.png"))
    assert [r.getMessage() for r in caplog.records].count(MISSING) == 1
    assert "pip install 'specserve[plots]'" in MISSING


def test_a_report_with_no_rows_draws_nothing(tmp_path: Path) -> None:
    assert write_plots("bench", {"runs": []}, tmp_path / "empty.json") == []
    assert not list(tmp_path.iterdir())
