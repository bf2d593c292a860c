"""``specserve bench``: the prompt sets, the report's arithmetic, and a tiny end-to-end run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from specbench.compare import PROMPT_SETS, load_prompts, select_methods
from specbench.methods import ALL_METHODS, FEATURE_METHODS, HF_METHODS, Generation
from specbench.report import format_table, summarise
from specserve.cli import main

RUN_KEYS: dict[str, type | tuple[type, ...]] = {
    "prompt_set": str, "method": str, "dtype": str, "tokens_per_s": float, "tokens": int,
    "seconds": float, "acceptance_rate": (float, type(None)),
    "mean_acceptance_length": (float, type(None)), "identical_to_plain": (bool, type(None)),
    "draft_ms_per_round": (float, type(None)), "verify_ms_per_round": (float, type(None)),
    "bookkeeping_ms_per_round": (float, type(None)), "rounds": (int, type(None)),
}
OUR_METHODS = [m for m in ALL_METHODS if m not in HF_METHODS]


@pytest.mark.parametrize("name", PROMPT_SETS)
def test_prompt_sets_are_shipped_and_varied(name: str) -> None:
    prompts = load_prompts(name)
    assert len(prompts) >= 12
    assert len({p.id for p in prompts}) == len(prompts)
    for prompt in prompts:
        assert prompt.messages and all(m["role"] == "user" for m in prompt.messages)
    assert len(load_prompts(name, 3)) == 3


def test_a_prompt_file_of_ones_own_reads_in_every_form(tmp_path: Path) -> None:
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"}]
    items = ["How do I fix a flat tyre?", chat, {"id": "soup", "messages": chat}]
    forms = {"object.json": json.dumps({"prompts": items}), "list.json": json.dumps(items),
             "lines.jsonl": "\n".join(json.dumps(i) for i in items) + "\n\n"}
    for name, text in forms.items():
        path = tmp_path / name
        path.write_text(text)
        prompts = load_prompts(str(path))
        stem = name.split(".")[0]
        assert [p.id for p in prompts] == [f"{stem}-1", f"{stem}-2", "soup"], name
        assert prompts[0].messages == ({"role": "user", "content": "How do I fix a flat tyre?"},)
        assert prompts[1].messages == prompts[2].messages == tuple(chat)
        assert len(load_prompts(str(path), 1)) == 1


@pytest.mark.parametrize(("text", "error"), [
    ("[1, 2", "line 1: not JSON"),
    ('{"questions": []}', "a list of prompts"),
    ("[]", "holds no prompts"),
    ("[3]", "prompt 1: expected a string"),
    ('[{"messages": []}]', "prompt 1: expected a string"),
    ('["ok", [{"role": "bot", "content": "hi"}]]', "prompt 2: each message needs a role"),
    ('[[{"role": "user", "content": 7}]]', "string content"),
    ('[[{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]]',
     "nothing to answer"),
])
def test_a_bad_prompt_file_is_refused_with_where_and_why(tmp_path: Path, text: str,
                                                          error: str) -> None:
    path = tmp_path / "prompts.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=error):
        load_prompts(str(path))
    with pytest.raises(ValueError, match="neither a shipped set"):
        load_prompts(str(tmp_path / "missing.json"))


def test_grounded_prompts_carry_a_passage_of_60_to_200_words() -> None:
    for prompt in load_prompts("grounded"):
        instruction, passage = prompt.messages[0]["content"].split("\n\n", 1)
        assert 60 <= len(passage.split()) <= 200, prompt.id
        assert instruction.strip()


def test_select_methods_always_keeps_plain_as_the_reference() -> None:
    assert select_methods(None, has_draft=True, hf=True, has_feature=True) == ALL_METHODS
    assert "spec:feature" not in select_methods(None, has_draft=True, hf=True)
    assert select_methods("hf:plain", has_draft=False, hf=True) == ("plain", "hf:plain")
    assert "spec:draft" not in select_methods(None, has_draft=False, hf=True)
    assert not HF_METHODS & set(select_methods(None, has_draft=True, hf=False))
    with pytest.raises(ValueError, match="unknown method"):
        select_methods("spec:magic", has_draft=False, hf=True)


def test_summarise_counts_rounds_after_prefill() -> None:
    plain = [Generation((1, 2, 3), 1.0, rounds=2, committed=2, has_rounds=True)]
    spec = [Generation((1, 2, 3), 0.5, rounds=1, drafted=4, accepted=1, committed=2,
                       draft_s=0.01, verify_s=0.02, bookkeeping_s=0.001, has_rounds=True)]
    other = [Generation((1, 2, 4), 0.25)]
    base = summarise("chat", "plain", "float32", ["a"], plain, plain)
    fast = summarise("chat", "spec:ngram", "float32", ["a"], spec, plain)
    hf = summarise("chat", "hf:plain", "float32", ["a"], other, plain)
    assert base["identical_to_plain"] and base["acceptance_rate"] is None
    assert base["mean_acceptance_length"] == 1.0
    assert fast["acceptance_rate"] == 0.25 and fast["mean_acceptance_length"] == 2.0
    assert fast["draft_ms_per_round"] == pytest.approx(10.0)
    assert fast["tokens_per_s"] == pytest.approx(6.0)
    assert hf["identical_to_plain"] is False and hf["rounds"] is None
    table = format_table([base, fast, hf])
    assert "2.00x" in table and "no (0/1)" in table


def _bench(tmp_path: Path, *flags: str) -> dict[str, Any]:
    out = tmp_path / "results" / "bench.json"  # the folder is created
    assert main(["bench", "--dtypes", "float32", "--prompts", "1", "--max-tokens", "8",
                 "--json", str(out), *flags]) == 0
    report: dict[str, Any] = json.loads(out.read_text())
    return report


def test_bench_on_tiny_models_reports_every_method(
    tiny_target_dir: Path, tiny_draft_dir: Path, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    report = _bench(tmp_path, "--target", str(tiny_target_dir), "--draft", str(tiny_draft_dir))
    assert {"cpu", "threads", "torch", "transformers"} <= report["machine"].keys()
    assert report["config"]["max_new_tokens"] == 8
    assert report["config"]["draft_dtype"] == "auto"
    assert report["config"]["draft_dtype_on_torch"]["float32"] in ("float32", "bfloat16")
    runs = report["runs"]
    methods = [m for m in ALL_METHODS if m not in FEATURE_METHODS]  # made for another model
    assert {(r["prompt_set"], r["method"]) for r in runs} == {
        (s, m) for s in PROMPT_SETS for m in methods}
    for run in runs:
        for key, kind in RUN_KEYS.items():
            assert isinstance(run[key], kind), (run["method"], key, run[key])
        assert run["dtype"] == "float32" and run["tokens"] > 0
        if run["method"] in OUR_METHODS:
            assert run["identical_to_plain"] is True, run["method"]
            assert run["rounds"] > 0 and run["mean_acceptance_length"] >= 1.0
        else:
            assert run["identical_to_plain"] is not None and run["rounds"] is None
    table = capsys.readouterr().out
    assert all(method in table for method in methods)


def test_bench_methods_filter(tiny_target_dir: Path, tmp_path: Path) -> None:
    report = _bench(tmp_path, "--target", str(tiny_target_dir), "--methods", "spec:ngram",
                    "--prompt-sets", "grounded")
    assert [(r["prompt_set"], r["method"]) for r in report["runs"]] == [
        ("grounded", "plain"), ("grounded", "spec:ngram")]


@pytest.mark.parametrize("flags", [["--methods", "spec:magic"], ["--dtypes", "float8"],
                                   ["--prompt-sets", "poetry"],
                                   ["--prompt-sets", "/nonexistent/prompts.json"]])
def test_bench_refuses_bad_flags_before_loading_anything(flags: list[str]) -> None:
    assert main(["bench", "--target", "/nonexistent", *flags]) == 2
