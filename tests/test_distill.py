"""`specserve distill` end to end on a tiny random target, and the distilled draft it makes."""

from __future__ import annotations

import itertools
import json
import logging
import random
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from decoding.drafter import DraftContext
from decoding.prompting import encode_chat
from decoding.round import decode
from decoding.types import GenerationRequest, SamplingParams, SpeculationParams
from drafters.model import ModelDrafter
from runtime.drafts import draft_format as distilled
from runtime.runner.causal_lm import CausalLM
from specdistill import data as distill_data
from specdistill import prompts as prompt_source
from specdistill.data import (
    HELD_OUT_NAME,
    POOLS_NAME,
    answer_all,
    existing_shards,
    load_or_make_pools,
    load_shard,
)
from specdistill.train import CHECKPOINT_NAME, collate, loss_and_hits, subset_index
from specserve.cli import main
from wiring.drafts import auto_draft, load_drafter

VOCAB_TOP = 512


def _distill(target_dir: Path, out: Path, work: Path, steps: int, *extra: str) -> None:
    threads = torch.get_num_threads()
    code = main(["distill", "--threads", "1", "--target", str(target_dir), "--out", str(out),
                 "--work", str(work),
                 "--layers", "1", "--from-layers", "0", "--vocab-top", str(VOCAB_TOP),
                 "--tokens", "120",
                 "--max-new-tokens", "12", "--batch-size", "8", "--held-out-prompts", "4",
                 "--batch-tokens", "512", "--steps", str(steps), "--lr", "3e-3", *extra])
    torch.set_num_threads(threads)
    assert code == 0


@pytest.fixture(scope="module")
def distilled_run(tmp_path_factory: pytest.TempPathFactory, tiny_target_dir: Path
                  ) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("distill")
    _distill(tiny_target_dir, root / "draft", root / "work", steps=40)
    return root / "draft", root / "work"


def _mean_loss(model: object, work: Path, pad: int) -> float:
    examples = [e for p in existing_shards(work / "data") for e in load_shard(p)]
    index = subset_index(model.lm_head.ids, model.lm_head.vocab_size)  # type: ignore[attr-defined]
    with torch.no_grad():
        loss, _, _ = loss_and_hits(model, collate(examples, 512, pad), index)
    return float(loss)


def test_distill_writes_a_small_self_describing_draft_and_lowers_the_loss(
        distilled_run: tuple[Path, Path], tiny_target: CausalLM) -> None:
    out, work = distilled_run
    info = distilled.DraftInfo.load(out)
    assert info.vocab_top_k == VOCAB_TOP and info.source_layers == [0]
    assert info.made_with["command"].startswith("specserve distill")
    assert info.made_with["results"]["steps"] == 40
    assert info.made_with["held_out_by"] == prompt_source.BY_SUBJECT
    stored = load_file(str(out / distilled.WEIGHTS_NAME))
    assert distilled.EMBEDDING not in stored  # shared with the target, never stored
    assert stored["lm_head.weight"].dtype == torch.float16
    assert stored["lm_head.weight"].shape[0] == VOCAB_TOP
    assert (work / CHECKPOINT_NAME).exists() and (work / "data" / HELD_OUT_NAME).exists()

    pad = int(tiny_target.tokenizer.pad_token_id)
    examples = [e for p in existing_shards(work / "data") for e in load_shard(p)]
    ids = distilled.load_model(out, tiny_target.model).lm_head.ids
    before = distilled.init_from_target(tiny_target.model, [0], ids)
    trained = distilled.load_model(out, tiny_target.model)
    assert examples
    assert _mean_loss(trained, work, pad) < _mean_loss(before, work, pad) - 0.05


def test_resume_continues_to_the_same_weights(
        tmp_path: Path, tiny_target_dir: Path, distilled_run: tuple[Path, Path]) -> None:
    out, _ = distilled_run
    _distill(tiny_target_dir, tmp_path / "d", tmp_path / "w", steps=20)
    with pytest.raises(SystemExit, match="--resume"):
        _distill(tiny_target_dir, tmp_path / "d", tmp_path / "w", steps=40)
    _distill(tiny_target_dir, tmp_path / "d", tmp_path / "w", 40, "--resume")
    resumed = load_file(str(tmp_path / "d" / distilled.WEIGHTS_NAME))
    straight = load_file(str(out / distilled.WEIGHTS_NAME))
    assert resumed.keys() == straight.keys()
    for name, tensor in straight.items():
        assert torch.equal(tensor, resumed[name]), name


def test_a_run_can_start_from_an_earlier_draft(
        distilled_run: tuple[Path, Path], tiny_target_dir: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    first, _ = distilled_run
    _distill(tiny_target_dir, tmp_path / "d", tmp_path / "w", 1, "--init-from", str(first),
             "--lr", "1e-12")  # one step that changes nothing: the start is the earlier draft
    info = distilled.DraftInfo.load(tmp_path / "d")
    assert info.made_with["init_from"]["draft"] == str(first)
    assert info.made_with["init_from"]["made_with"].startswith("specserve distill")
    assert info.made_with["held_out_by"] == prompt_source.BY_SUBJECT
    assert "may have trained on this run's held-out subjects" not in capsys.readouterr().err
    before = load_file(str(first / distilled.WEIGHTS_NAME))
    after = load_file(str(tmp_path / "d" / distilled.WEIGHTS_NAME))
    assert before.keys() == after.keys()
    for name, tensor in before.items():
        torch.testing.assert_close(after[name], tensor, msg=name)
    # refused before any data is made
    with pytest.raises(SystemExit, match="--layers 1 --vocab-top 512"):
        _distill(tiny_target_dir, tmp_path / "d2", tmp_path / "w2", 1, "--init-from", str(first),
                 "--layers", "2")
    with pytest.raises(SystemExit, match="not a draft directory"):
        _distill(tiny_target_dir, tmp_path / "d2", tmp_path / "w2", 1, "--init-from",
                 str(tmp_path))
    assert not (tmp_path / "w2").exists()


def test_a_stage_after_a_draft_of_the_seed_split_says_its_held_out_figure_may_overstate(
        distilled_run: tuple[Path, Path], tiny_target_dir: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A draft made before every seed held out the same subjects (as the shipped one) may
    have trained on any run's held-out subjects: a run starting from it says so, and its own
    draft records the weaker split, so the stage after it says so too."""
    import shutil

    first, _ = distilled_run
    older = tmp_path / "older"
    shutil.copytree(first, older)
    described = json.loads((older / "draft.json").read_text())
    del described["made_with"]["held_out_by"]
    (older / "draft.json").write_text(json.dumps(described))
    capsys.readouterr()
    _distill(tiny_target_dir, tmp_path / "d", tmp_path / "w", 1, "--init-from", str(older),
             "--lr", "1e-12")
    assert "may have trained on this run's held-out subjects" in capsys.readouterr().err
    made = distilled.DraftInfo.load(tmp_path / "d").made_with
    assert made["held_out_by"] == prompt_source.BY_ORDER
    _distill(tiny_target_dir, tmp_path / "d2", tmp_path / "w2", 1, "--init-from",
             str(tmp_path / "d"), "--lr", "1e-12")
    assert "may have trained on this run's held-out subjects" in capsys.readouterr().err


def test_the_subject_pools_are_kept_with_the_data(
        distilled_run: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    _, work = distilled_run
    data = work / "data"
    assert (data / POOLS_NAME).exists()
    kept = load_or_make_pools(data, seed=0)

    def elsewhere(seed: int) -> prompt_source.Pools:  # another machine's apt lists
        raise AssertionError("a resumed run must not read the subjects again")

    monkeypatch.setattr(prompt_source, "load_pools", elsewhere)
    assert load_or_make_pools(data, seed=0) == kept
    assert kept.everyday and kept.passages
    assert kept.held_out_by == prompt_source.BY_SUBJECT


def _shuffled(subjects: list[str], seed: int) -> list[str]:
    pool = list(subjects)
    random.Random(seed).shuffle(pool)
    return pool


def test_every_seed_holds_out_the_same_subjects() -> None:
    """A later stage with another seed (``--init-from``) must not be measured on subjects an
    earlier stage trained on."""
    subjects = [f"tool {i}" for i in range(3000)]
    chores = [f"chore {i}" for i in range(40)]
    pools = {seed: prompt_source.Pools(topics=_shuffled(subjects, seed), everyday=["hobby"],
                                       python=["mod.f"], passages=["text"],
                                       chat=_shuffled(chores, seed))
             for seed in (0, 1)}
    held = {seed: prompt_source.split(p.topics, held_out=True) for seed, p in pools.items()}
    assert set(held[0]) == set(held[1])
    assert 0.02 < len(held[0]) / len(subjects) < 0.04
    assert not set(held[0]) & set(prompt_source.split(pools[1].topics, held_out=False))
    # a pool too small for the share still holds one out, the same one whatever the order
    small = {seed: prompt_source.split(p.chat, held_out=True) for seed, p in pools.items()}
    assert len(small[0]) >= 1 and set(small[0]) == set(small[1])
    assert prompt_source.split(["only"], held_out=True) == []
    assert prompt_source.split(["only"], held_out=False) == ["only"]
    # the streams: held-out prompts only on held-out subjects, training prompts never
    def named(seed: int, held_out: bool, n: int) -> set[str]:
        stream = prompt_source.prompts(pools[seed], seed, held_out=held_out, chat=0.3)
        return {m for p in itertools.islice(stream, n)
                for m in re.findall(r"\b(?:tool|chore) \d+\b", p.text)}

    out = set(held[0]) | set(small[0])
    assert named(0, True, 300) <= out and named(1, True, 300) <= out
    trained = named(1, False, 3000)
    assert len(trained) > 500 and not trained & out


def test_pools_kept_by_earlier_versions_keep_their_held_out_subjects(tmp_path: Path) -> None:
    """A work directory made before subjects were held out by their text resumes with the
    split its held-out answers were made with: the first share of each pool."""
    topics = [f"tool {i}" for i in range(200)]
    data = tmp_path / "data"
    data.mkdir()
    (data / POOLS_NAME).write_text(json.dumps(
        {"topics": topics, "everyday": ["hobby 1", "hobby 2"], "python": ["mod.f"],
         "passages": ["text"]}), encoding="utf-8")
    pools = load_or_make_pools(data, seed=0)
    assert pools.held_out_by == prompt_source.BY_ORDER
    assert prompt_source.split(pools.topics, True, pools.held_out_by) == topics[:6]
    named = {m for p in itertools.islice(prompt_source.prompts(pools, 0, held_out=True), 200)
             for m in re.findall(r"\btool \d+\b", p.text)}
    assert named and named <= set(topics[:6])
    with pytest.raises(ValueError, match="held-out split"):
        prompt_source.Pools(topics, [], [], [], held_out_by="seed")


def test_data_made_before_pools_were_kept_counts_as_split_by_order(
        tiny_target_dir: Path, tmp_path: Path) -> None:
    _distill(tiny_target_dir, tmp_path / "d", tmp_path / "w", 1)
    (tmp_path / "w" / "data" / POOLS_NAME).unlink()  # as an early version left its data
    _distill(tiny_target_dir, tmp_path / "d", tmp_path / "w", 2, "--resume")
    made = distilled.DraftInfo.load(tmp_path / "d").made_with
    assert made["results"]["steps"] == 2
    assert made["held_out_by"] == prompt_source.BY_ORDER
    assert not (tmp_path / "w" / "data" / POOLS_NAME).exists()


@pytest.mark.parametrize(("reply", "question"), [
    ('A person might ask, "What\'s the best text editor for Python?"',
     "What's the best text editor for Python?"),
    ("Can you suggest a backup tool that works for a small server?",
     "Can you suggest a backup tool that works for a small server?"),
    ("Question: How do I keep basil alive indoors?", "How do I keep basil alive indoors?"),
    ('\u201cWhy do cats purr when they are happy?\u201d', "Why do cats purr when they are happy?"),
    ("Sure! Here are some ideas:\n\n1. Ask about recipes.\n2. Ask about timing?", None),
    ('I would say "hello there" to them.', None),  # quoted, but no question
    ("Why?", None),  # too short to be a user's message
])
def test_a_question_is_read_out_of_the_targets_reply(reply: str, question: str | None) -> None:
    assert prompt_source.extract_question(reply) == question


def test_asks_take_their_share_of_the_stream_and_only_when_asked_for() -> None:
    pools = prompt_source.Pools(topics=[f"tool {i}" for i in range(200)],
                                everyday=[f"hobby {i}" for i in range(200)],
                                python=[f"mod.f{i}" for i in range(200)],
                                passages=[f"Passage {i}. " * 20 for i in range(200)])
    plain = list(itertools.islice(prompt_source.prompts(pools, seed=3), 2000))
    assert not any(p.ask for p in plain)
    mixed = list(itertools.islice(prompt_source.prompts(pools, seed=3, questions=0.3), 2000))
    asks = [p for p in mixed if p.ask]
    assert 0.25 < len(asks) / len(mixed) < 0.35
    assert all(p.text in {t.format(t=s) for t in prompt_source.ASK_TEMPLATES
                          for s in pools.everyday + pools.topics} for p in asks)
    assert mixed == list(itertools.islice(
        prompt_source.prompts(pools, seed=3, questions=0.3), 2000))  # deterministic


def test_chat_requests_take_their_share_of_the_stream_on_subjects_of_their_own() -> None:
    pools = prompt_source.Pools(topics=[f"tool {i}" for i in range(200)],
                                everyday=[f"hobby {i}" for i in range(200)],
                                python=[f"mod.f{i}" for i in range(200)],
                                passages=[f"Passage {i}. " * 20 for i in range(200)],
                                chat=[f"chore {i}" for i in range(200)])

    def requests(stream: list[prompt_source.Prompt], subjects: list[str]) -> list[str]:
        made = {t.format(t=s) for t in prompt_source.CHAT_TEMPLATES for s in subjects}
        return [p.text for p in stream if p.text in made]

    mixed = list(itertools.islice(prompt_source.prompts(pools, 3, questions=0.2, chat=0.5),
                                  2000))
    assert 0.45 < len(requests(mixed, pools.chat)) / len(mixed) < 0.55
    assert 0.15 < sum(p.ask for p in mixed) / len(mixed) < 0.25
    assert not any("chore" in p.text for p in mixed if p.text not in requests(mixed, pools.chat))
    held = prompt_source.split(pools.chat, held_out=True)
    assert not requests(mixed, held)  # held-out subjects are never trained on
    held_stream = list(itertools.islice(
        prompt_source.prompts(pools, 3, held_out=True, questions=0.2, chat=0.5), 200))
    assert requests(held_stream, held)
    assert mixed == list(itertools.islice(
        prompt_source.prompts(pools, 3, questions=0.2, chat=0.5), 2000))  # deterministic
    # without chat requests, the stream of pools that have none (earlier versions)
    earlier = prompt_source.Pools(pools.topics, pools.everyday, pools.python, pools.passages)
    assert (list(itertools.islice(prompt_source.prompts(pools, 3, questions=0.3), 500))
            == list(itertools.islice(prompt_source.prompts(earlier, 3, questions=0.3), 500)))


def test_chat_subjects_stay_off_the_benchmark_prompts() -> None:
    from specbench.compare import PROMPT_SETS, load_prompts

    texts = [m["content"].lower() for name in PROMPT_SETS for p in load_prompts(name)
             for m in p.messages]
    assert len(prompt_source.CHAT_SUBJECTS) == len(set(prompt_source.CHAT_SUBJECTS)) > 200
    for subject in prompt_source.CHAT_SUBJECTS:
        assert not any(subject.lower() in t for t in texts), subject
    assert not set(prompt_source.CHAT_SUBJECTS) & set(prompt_source.EVERYDAY)


def test_a_run_of_a_version_without_chat_requests_resumes(tmp_path: Path,
                                                           tiny_target_dir: Path) -> None:
    import json

    from specdistill.cli import SETTINGS_NAME

    _distill(tiny_target_dir, tmp_path / "d", tmp_path / "w", 1)
    for path, key in ((tmp_path / "w" / SETTINGS_NAME, "data"),
                      (tmp_path / "w" / "data" / POOLS_NAME, None)):
        kept = json.loads(path.read_text())
        (kept[key] if key else kept).pop("chat")  # as those versions wrote them
        path.write_text(json.dumps(kept))
    _distill(tiny_target_dir, tmp_path / "d", tmp_path / "w", 2, "--resume")
    assert load_or_make_pools(tmp_path / "w" / "data", seed=0).chat == []
    with pytest.raises(SystemExit, match="different settings"):
        _distill(tiny_target_dir, tmp_path / "d", tmp_path / "w", 3, "--resume", "--chat", "0.5")


def test_the_default_model_writes_questions_that_can_be_read_out(
        default_target: CausalLM) -> None:
    from decoding.prompting import encode_chat
    from specdistill.data import ASK_MAX_NEW_TOKENS, ASK_TEMPERATURE

    subjects = ["cooking rice on the stove", "a text editor for programmers", "the water cycle",
                "backing up photos", "learning to play the guitar", "time zones"]
    asks = [t.format(t=s) for s, t in zip(subjects, itertools.cycle(prompt_source.ASK_TEMPLATES))]
    ids = [encode_chat(default_target.tokenizer, [{"role": "user", "content": a}]) for a in asks]
    replies = answer_all(default_target, ids, ASK_MAX_NEW_TOKENS, 1, 8, ASK_TEMPERATURE,
                         seeds=list(range(len(ids))))
    texts = [default_target.tokenizer.decode(r.answer_ids.tolist(), skip_special_tokens=True)
             for r in replies]
    questions = [q for q in map(prompt_source.extract_question, texts) if q is not None]
    assert len(questions) >= 2, texts  # about 6 in 10 replies hold one
    assert all(q.endswith("?") and "\n" not in q for q in questions)


def test_sampled_answers_follow_their_seed_alone_and_greedy_ones_are_unchanged(
        tiny_target: CausalLM) -> None:
    prompts = [tiny_target.tokenizer.encode(t) for t in ("Write a question", "Ask me", "Hi")]

    def run(seeds: list[int] | None, streams: int = 2) -> list[list[int]]:
        out = answer_all(tiny_target, prompts, 10, 1, streams, 0.0 if seeds is None else 0.8,
                         seeds)
        return [e.answer_ids.tolist() for e in out]

    sampled = run([1, 2, 3])
    assert sampled == run([1, 2, 3], streams=3)  # the batch does not change an answer
    assert sampled[1:] == run([9, 2, 3])[1:] and sampled[0] != run([9, 2, 3])[0]
    greedy = run(None)
    assert greedy == [[t for e in decode(tiny_target, None, _request(p, 10)) for t in e.token_ids]
                      for p in prompts]
    with pytest.raises(ValueError, match="one seed per prompt"):
        run([1])


def test_answers_grow_together_as_the_device_allows(tmp_path: Path, default_model_dir: Path,
                                                   tiny_target_dir: Path) -> None:
    """32 answers at once on a CPU; on a GPU as many as its free memory holds (the default
    model's float32 KV rows for a prompt and 128 answer tokens: ~24 MB each), within
    at most 2048; a batch size below 1 is refused."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(default_model_dir)
    assert distill_data.default_streams("cpu", str(default_model_dir), 128) == 32
    assert distill_data.gpu_streams(139 << 30, config, 128) == 2048  # an H200
    assert distill_data.gpu_streams(24 << 30, config, 128) == 256
    assert distill_data.gpu_streams(24 << 30, config, 1024) == 128  # longer answers: fewer
    assert distill_data.gpu_streams(1 << 30, config, 128) == 16  # a small GPU
    assert distill_data.gpu_streams(1 << 20, config, 128) == 1
    with pytest.raises(SystemExit, match="--batch-size must be at least 1"):
        _distill(tiny_target_dir, tmp_path / "d", tmp_path / "w", 1, "--batch-size", "0")


def test_a_share_of_questions_outside_0_to_1_is_refused(tmp_path: Path,
                                                        tiny_target_dir: Path) -> None:
    for share in ("1", "-0.1"):
        with pytest.raises(SystemExit, match="--questions is a share"):
            _distill(tiny_target_dir, tmp_path / "d", tmp_path / "w", 1, "--questions", share)
    with pytest.raises(ValueError, match="share of questions"):
        next(prompt_source.prompts(prompt_source.Pools(["a"], ["b"], ["c"], ["d"]), 0,
                                   questions=1.5))
    for extra in (("--chat", "1"), ("--chat", "-0.5"), ("--chat", "0.8", "--questions", "0.2")):
        with pytest.raises(SystemExit, match="--chat is a share"):
            _distill(tiny_target_dir, tmp_path / "d", tmp_path / "w", 1, *extra)
    with pytest.raises(ValueError, match="share of chat requests"):
        next(prompt_source.prompts(prompt_source.Pools(["a"], ["b"], ["c"], ["d"], ["e"]), 0,
                                   questions=0.5, chat=0.5))


def test_a_missing_gpu_is_a_clear_error(tmp_path: Path, tiny_target_dir: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU")
    with pytest.raises(SystemExit, match="no CUDA GPU"):
        _distill(tiny_target_dir, tmp_path / "d", tmp_path / "w", 1, "--device", "cuda")


@pytest.mark.gpu
def test_distilling_on_a_gpu_makes_a_lossless_draft_that_resumes_on_cpu(
        tmp_path: Path, tiny_target_dir: Path, tiny_target: CausalLM) -> None:
    _distill(tiny_target_dir, tmp_path / "d", tmp_path / "w", 20, "--device", "cuda")
    _distill(tiny_target_dir, tmp_path / "d", tmp_path / "w", 30, "--device", "cpu", "--resume")
    assert distilled.DraftInfo.load(tmp_path / "d").made_with["results"]["steps"] == 30
    drafter = load_drafter(str(tmp_path / "d"), tiny_target)
    prompt = tiny_target.tokenizer.encode("A short note about")
    plain = [t for e in decode(tiny_target, None, _request(prompt)) for t in e.token_ids]
    spec = [t for e in decode(tiny_target, drafter, _request(prompt)) for t in e.token_ids]
    assert spec == plain


def _request(prompt: list[int], new: int = 24) -> GenerationRequest:
    return GenerationRequest(prompt_ids=tuple(prompt), max_new_tokens=new,
                             sampling=SamplingParams(temperature=0.0),
                             speculation=SpeculationParams(enabled=True))


def test_truncated_vocabulary_draft_is_lossless_and_stays_in_its_set(
        distilled_run: tuple[Path, Path], tiny_target: CausalLM) -> None:
    out, _ = distilled_run
    drafter = load_drafter(str(out), tiny_target)
    assert isinstance(drafter, ModelDrafter)
    allowed = set(distilled.load_model(out, tiny_target.model).lm_head.ids.tolist())
    prompts = [tiny_target.tokenizer.encode(t) for t in
               ("The quick brown fox", "def main():\n    return", "Once upon a time there")]
    for prompt in prompts:
        plain = [t for e in decode(tiny_target, None, _request(prompt)) for t in e.token_ids]
        spec = [t for e in decode(tiny_target, drafter, _request(prompt)) for t in e.token_ids]
        assert spec == plain

        state = drafter.begin(prompt)
        greedy = drafter.propose(state, DraftContext(prompt, SamplingParams(), None), 6)
        assert len(greedy.tokens) == 6 and set(greedy.tokens) <= allowed
        generator = torch.Generator().manual_seed(0)
        sampling = SamplingParams(temperature=1.0)
        sampled = drafter.propose(state, DraftContext(prompt, sampling, generator), 6)
        assert set(sampled.tokens) <= allowed
        assert sampled.probs is not None  # [6, vocab]
        outside = torch.ones(sampled.probs.shape[-1], dtype=torch.bool)
        outside[sorted(allowed)] = False
        assert float(sampled.probs[:, outside].sum()) == 0.0
        torch.testing.assert_close(sampled.probs.sum(-1), torch.ones(6))


def test_acceptance_reports_how_much_of_the_targets_output_the_head_can_propose(
        distilled_run: tuple[Path, Path], tiny_target: CausalLM, tiny_target_dir: Path,
        tmp_path: Path) -> None:
    out, _ = distilled_run
    texts = ["Name three colours.", "Write a line about the sea.", "What is a verb?"]
    prompt_file = tmp_path / "mine.jsonl"
    prompt_file.write_text("\n".join(json.dumps(t) for t in texts))
    report_path = tmp_path / "acceptance.json"
    assert main(["acceptance", "--target", str(tiny_target_dir), "--drafts", f"ngram,{out}",
                 "--k", "2", "--prompt-sets", str(prompt_file), "--max-tokens", "12",
                 "--draft-backend", "torch", "--json", str(report_path)]) == 0
    rows = {r["draft"]: r for r in json.loads(report_path.read_text())["rows"]}
    assert rows["ngram"]["head_coverage"] is None  # lookup can propose any token
    ids = distilled.head_ids(out)
    assert ids is not None and len(ids) == VOCAB_TOP
    inside = set(ids.tolist())
    drafted = []  # every output token after the first (the prefill's, never drafted)
    for text in texts:
        prompt = encode_chat(tiny_target.tokenizer, [{"role": "user", "content": text}])
        output = [t for e in decode(tiny_target, None, _request(prompt, 12)) for t in e.token_ids]
        drafted += output[1:]
    expected = sum(t in inside for t in drafted) / len(drafted)
    assert rows[str(out)]["head_coverage"] == pytest.approx(expected)
    assert rows[str(out)]["prompt_set"] == str(prompt_file)
    # no draft is accepted more often than its head covers the target's tokens
    assert rows[str(out)]["accepted"] <= sum(t in inside for t in drafted)


def test_a_draft_refuses_another_target(distilled_run: tuple[Path, Path],
                                        tiny_draft: CausalLM) -> None:
    out, _ = distilled_run
    with pytest.raises(distilled.DraftFormatError, match="made for"):
        load_drafter(str(out), tiny_draft)


def test_distilled_draft_exports_to_onnx_and_stays_lossless(
        distilled_run: tuple[Path, Path], tiny_target: CausalLM, tmp_path: Path) -> None:
    pytest.importorskip("onnxruntime")
    from trt.backends import load_draft

    out, _ = distilled_run
    drafter, backend = load_draft(str(out), tiny_target, "onnx", export_root=tmp_path)
    assert backend == "onnx" and drafter is not None
    torch_drafter = load_drafter(str(out), tiny_target)
    assert torch_drafter is not None
    prompt = tiny_target.tokenizer.encode("A short note about")
    plain = [t for e in decode(tiny_target, None, _request(prompt)) for t in e.token_ids]
    spec = [t for e in decode(tiny_target, drafter, _request(prompt)) for t in e.token_ids]
    assert spec == plain
    context = DraftContext(prompt, SamplingParams(), None)
    onnx_tokens = drafter.propose(drafter.begin(prompt), context, 5).tokens
    torch_tokens = torch_drafter.propose(torch_drafter.begin(prompt), context, 5).tokens
    assert onnx_tokens == torch_tokens


def test_the_shipped_default_draft_is_small_and_lossless(default_target: CausalLM) -> None:
    directory = distilled.resolve_draft_dir(distilled.DEFAULT_DRAFT)
    assert directory is not None
    size = sum(p.stat().st_size for p in directory.iterdir())
    assert size < 25 * 2**20
    drafter = load_drafter(f"ngram+{distilled.DEFAULT_DRAFT}", default_target)
    prompt = default_target.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Give me two tips for writing clear emails."}],
        add_generation_prompt=True, tokenize=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    plain = [t for e in decode(default_target, None, _request(prompt, 32)) for t in e.token_ids]
    spec = [t for e in decode(default_target, drafter, _request(prompt, 32)) for t in e.token_ids]
    assert spec == plain


def test_auto_adds_the_shipped_draft_only_for_the_target_it_fits(
        default_target: CausalLM, tiny_target: CausalLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without a stored measurement (as for any target but the default model), ``auto``
    is lookup plus the draft made for the target."""
    from wiring import drafts

    monkeypatch.setattr(drafts, "read_choice", lambda: None)
    assert auto_draft(default_target, prefix_cache=True) == \
        f"ngram+cache+{distilled.DEFAULT_DRAFT}"
    assert auto_draft(default_target, prefix_cache=False) == f"ngram+{distilled.DEFAULT_DRAFT}"
    assert auto_draft(tiny_target, prefix_cache=True) == "ngram+cache"
    assert load_drafter("auto", tiny_target).name == "ngram"  # type: ignore[union-attr]


def test_auto_serves_the_stored_measured_choice_for_the_default_model(
        default_target: CausalLM, tiny_target: CausalLM) -> None:
    """The shipped measurement names the mix ``auto`` serves the default model, the
    continuation cache joining it where a prefix cache runs; it never applies to another
    target."""
    from runtime.drafts.draft_choice import choice_path, read_choice
    from specbench import draft_choice
    from wiring.drafts import auto_choice

    measured = read_choice()
    assert measured is not None, f"{choice_path()} is shipped and readable"
    stored = json.loads(choice_path().read_text())
    assert measured.spec == stored["choice"]
    assert measured.spec == draft_choice.choose(stored["mixes"])
    spec, reason = auto_choice(default_target, prefix_cache=False)
    assert spec == measured.spec and "chosen by measurement" in reason
    with_cache, _ = auto_choice(default_target, prefix_cache=True)
    parts = with_cache.split("+")
    assert "cache" in parts and [p for p in parts if p != "cache"] == \
        ([] if measured.spec == "none" else measured.spec.split("+"))
    assert load_drafter(spec, default_target) is not None or spec == "none"
    assert auto_choice(tiny_target, prefix_cache=True)[0] == "ngram+cache"


def test_a_stored_choice_that_cannot_be_read_is_ignored_with_a_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from runtime.drafts.draft_choice import CHOICE_FORMAT, read_choice

    assert read_choice(tmp_path / "missing.json") is None
    good = {"format": CHOICE_FORMAT, "version": 1, "choice": "ngram", "threads": 2,
            "command": "python -m specbench.draft_choice", "machine": {"cpu": "a CPU"},
            "mixes": [{"spec": "ngram", "speedup": {"chat": 1.1, "grounded": 1.5}}]}
    path = tmp_path / "choice.json"
    path.write_text(json.dumps(good))
    measured = read_choice(path)
    assert measured is not None and measured.spec == "ngram"
    assert "chat 1.10x, grounded 1.50x" in measured.reason()
    for broken in ({**good, "version": 99}, {**good, "choice": "ngram+default-draft"},
                   {k: v for k, v in good.items() if k != "mixes"}):
        path.write_text(json.dumps(broken))
        with caplog.at_level(logging.WARNING, logger="runtime.drafts.draft_choice"):
            assert read_choice(path) is None
        assert "ignoring the stored draft choice" in caplog.text
        caplog.clear()
    path.write_text("{ not json")
    assert read_choice(path) is None
