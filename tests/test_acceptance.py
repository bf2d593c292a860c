"""``specserve acceptance``: replayed rounds are the engine's rounds, and the command's report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from decoding.drafter import Drafter
from decoding.policy import FixedSpeculation
from decoding.prompting import encode_chat
from decoding.round import decode
from decoding.types import GenerationRequest, SamplingParams
from drafters.model import ModelDrafter
from drafters.ngram import NgramDrafter
from runtime.runner.causal_lm import CausalLM
from specbench.acceptance import replay
from specserve.cli import main
from wiring.drafts import load_drafter

GREEDY = SamplingParams(temperature=0.0)
PROMPTS = [
    "List the days of the week, then list them again in the same order.",
    "Explain what a hash table is, and give one example of where it is used.",
]


def _engine_totals(target: CausalLM, drafter: Drafter, ids: list[int], k: int,
                   max_new: int) -> tuple[tuple[int, ...], dict[str, int]]:
    request = GenerationRequest(prompt_ids=tuple(ids), max_new_tokens=max_new, sampling=GREEDY)
    events = list(decode(target, drafter, request, FixedSpeculation(k)))
    later = events[1:]  # round 0 is the prefill
    return tuple(t for e in events for t in e.token_ids), {
        "rounds": len(later), "drafted": sum(e.draft_tokens for e in later),
        "accepted": sum(e.accepted_tokens for e in later),
        "committed": sum(len(e.token_ids) for e in later)}


def _replay_totals(drafter: Drafter, ids: list[int], output: tuple[int, ...], k: int,
                   max_new: int) -> dict[str, int]:
    r = replay(drafter, ids, output, k, max_new)
    return {"rounds": r.rounds, "drafted": r.drafted, "accepted": r.accepted,
            "committed": r.committed}


@pytest.mark.parametrize("k", [1, 4])
def test_replayed_rounds_are_the_engines_with_the_default_draft(
        default_target: CausalLM, k: int) -> None:
    max_new = 40
    seen_accepted = 0
    for spec in ("ngram", "default-draft", "ngram+default-draft"):
        for text in PROMPTS:
            ids = encode_chat(default_target.tokenizer, [{"role": "user", "content": text}])
            # fresh drafters: a combined drafter learns across requests
            engine_drafter = load_drafter(spec, default_target)
            replay_drafter = load_drafter(spec, default_target)
            assert engine_drafter is not None and replay_drafter is not None
            output, engine = _engine_totals(default_target, engine_drafter, ids, k, max_new)
            replayed = _replay_totals(replay_drafter, ids, output, k, max_new)
            assert replayed == engine, (spec, text)
            seen_accepted += engine["accepted"]
    assert seen_accepted > 0


def test_the_target_as_its_own_draft_has_every_token_accepted(tiny_target: CausalLM) -> None:
    ids = encode_chat(tiny_target.tokenizer, [{"role": "user", "content": PROMPTS[0]}])
    output, _ = _engine_totals(tiny_target, NgramDrafter(), ids, 1, 24)
    result = replay(ModelDrafter(tiny_target, tiny_target), ids, output, 4, 24)
    assert result.drafted > 0 and result.accepted == result.drafted
    assert result.position_rates() == [1.0] * 4
    assert result.committed == len(output) - 1  # all but the prefill's token


def test_acceptance_command_reports_each_draft_and_length(
        tiny_target_dir: Path, tiny_draft_dir: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "acceptance.json"
    rc = main(["acceptance", "--target", str(tiny_target_dir), "--drafts",
               f"ngram,{tiny_target_dir},ngram+{tiny_draft_dir}", "--k", "1,4", "--quick",
               "--prompts", "2", "--max-tokens", "12", "--draft-backend", "torch",
               "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert [(r["prompt_set"], r["draft"], r["k"]) for r in rows] == [
        (s, d, k) for s in ("chat", "grounded")
        for d in ("ngram", str(tiny_target_dir), f"ngram+{tiny_draft_dir}") for k in (1, 4)]
    for row in rows:
        assert row["prompts"] == 2 and row["rounds"] > 0
        # each round commits its accepted drafts and one token of the target's (the last
        # round may stop short, at the end of the output)
        assert row["rounds"] <= row["committed"] <= row["accepted"] + row["rounds"]
        if row["draft"] == str(tiny_target_dir):  # the target drafting for itself
            assert row["acceptance_rate"] == 1.0
    assert report["config"]["max_new_tokens"] == 12
    assert "tokens/round" in capsys.readouterr().out


@pytest.mark.parametrize("flags", [["--k", "0"], ["--k", "two"], ["--dtypes", "float8"],
                                   ["--prompt-sets", "poetry"], ["--drafts", ","],
                                   ["--max-tokens", "1"]])
def test_acceptance_refuses_bad_flags_before_loading_anything(flags: list[str]) -> None:
    assert main(["acceptance", "--target", "/nonexistent", *flags]) == 2


def test_acceptance_refuses_a_spec_that_drafts_nothing(tiny_target_dir: Path) -> None:
    assert main(["acceptance", "--target", str(tiny_target_dir), "--drafts", "none",
                 "--quick", "--prompts", "1", "--max-tokens", "4"]) == 2
