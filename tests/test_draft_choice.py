"""Choosing the drafter mix ``--draft auto`` serves, by measurement."""

from __future__ import annotations

import json
from pathlib import Path

from runtime.drafts.draft_choice import CHOICE_FORMAT, read_choice
from specbench import draft_choice


def _set(tok_s: float, identical: bool = True) -> dict[str, object]:
    return {"tokens": 100, "seconds": 100 / tok_s, "tokens_per_s": tok_s,
            "identical_to_plain": identical}


def test_mixes_are_ranked_by_the_geometric_mean_of_their_speedups() -> None:
    results = {
        "none": {"chat": _set(100), "grounded": _set(100)},
        "ngram": {"chat": _set(105), "grounded": _set(200)},  # 1.449
        "default-draft": {"chat": _set(150), "grounded": _set(130)},  # 1.396
        "ngram+default-draft": {"chat": _set(140), "grounded": _set(180)},  # 1.587
        "feature-draft": {"chat": _set(300), "grounded": _set(300, identical=False)},
    }
    rows = draft_choice.score(results)
    assert [r["spec"] for r in rows] == ["feature-draft", "ngram+default-draft", "ngram",
                                        "default-draft", "none"]
    assert rows[1]["speedup"] == {"chat": 1.4, "grounded": 1.8}
    assert rows[1]["score"] == round((1.4 * 1.8) ** 0.5, 3)
    assert rows[0]["identical_to_plain"] is False  # never chosen: main skips it
    assert rows[-1]["score"] == 1.0


def test_a_short_real_measurement_writes_a_choice_that_auto_reads(
        tmp_path: Path, default_target: object) -> None:
    """The whole command on the default model, two prompts of each set and 12 tokens:
    every mix's output equals plain decoding's, and the report reads back as a choice."""
    out = tmp_path / "choice.json"
    assert draft_choice.main(["--prompts", "2", "--max-tokens", "12", "--threads", "2",
                              "--repeats", "1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["format"] == CHOICE_FORMAT
    specs = [row["spec"] for row in report["mixes"]]
    assert set(specs) == {"none", "ngram", "default-draft", "feature-draft",
                          "ngram+default-draft", "ngram+feature-draft"}
    assert all(row["identical_to_plain"] for row in report["mixes"])
    assert all(report["mixes"][0]["score"] >= row["score"] for row in report["mixes"][:-1])
    measured = read_choice(out)
    assert measured is not None and measured.spec == report["choice"]
    assert report["machine"]["cpu"] in measured.reason()


def test_the_choice_breaks_a_tie_by_chat_and_never_takes_a_mix_that_loses() -> None:
    def row(spec: str, chat: float, grounded: float, identical: bool = True
            ) -> dict[str, object]:
        return {"spec": spec, "speedup": {"chat": chat, "grounded": grounded},
                "score": round((chat * grounded) ** 0.5, 3), "identical_to_plain": identical}

    plain = row("none", 1.0, 1.0)
    lookup, both = row("ngram", 1.13, 1.53), row("ngram+default-draft", 1.18, 1.46)
    assert draft_choice.choose([lookup, both, plain]) == "ngram+default-draft"  # a tie
    ahead = row("ngram", 1.13, 1.70)  # 1.386 against 1.312: a clear win
    assert draft_choice.choose([ahead, both, plain]) == "ngram"
    wrong = row("feature-draft", 2.0, 2.0, identical=False)
    assert draft_choice.choose([wrong, lookup, plain]) == "ngram"
    assert draft_choice.choose([row("ngram", 0.9, 1.05), plain]) == "none"


def test_another_targets_choice_is_measured_with_its_drafts_and_stored_beside_it(
        tmp_path: Path, tiny_target_dir: Path, tiny_draft_dir: Path) -> None:
    """A target other than the default model: the mixes are lookup and the drafts named
    for it, on the sets named, and ``--write`` stores the choice beside the target, where
    ``--draft auto`` then reads it."""
    import shutil

    from runtime.drafts.draft_choice import choice_path_for
    from runtime.loaders.loading import load_target
    from runtime.runner.causal_lm import CausalLM
    from wiring import drafts

    target_dir = tmp_path / "target"
    shutil.copytree(tiny_target_dir, target_dir)
    out = tmp_path / "report.json"
    assert draft_choice.main(["--target", str(target_dir), "--drafts", str(tiny_draft_dir),
                              "--sets", "code_chat_tune", "--prompts", "1", "--max-tokens",
                              "8", "--repeats", "1", "--json", str(out), "--write"]) == 0
    report = json.loads(out.read_text())
    assert report["sets"] == ["code_chat_tune"]
    assert {row["spec"] for row in report["mixes"]} == {
        "none", "ngram", str(tiny_draft_dir), f"ngram+{tiny_draft_dir}"}
    stored = choice_path_for(str(target_dir))
    assert stored == target_dir / "choice.json" and stored.is_file()
    target = load_target(str(target_dir))
    assert isinstance(target, CausalLM)
    spec, reason = drafts.auto_choice(target, prefix_cache=False)
    assert spec == report["choice"] and reason.startswith("chosen by measurement")
    assert choice_path_for("/models/x.gguf") == Path("/models/x.gguf.choice.json")
