"""`specserve distill --kind feature` end to end on a tiny random target, the feature
draft's training-time-test mask, and that its training learns."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from runtime.runner.batched import BatchedLM
from runtime.runner.passes import BatchItem
from specdistill import feature_data, feature_train
from specdistill.feature import (
    FORMAT,
    LAYER,
    FeatureDraft,
    load_feature_draft_weights,
    ttt_mask,
)
from specdistill.feature_eval import evaluate
from specdistill.prompts import Pools
from specserve.cli import main


def _distill(target_dir: Path, out: Path, work: Path, steps: int, *extra: str) -> None:
    threads = torch.get_num_threads()
    code = main(["distill", "--kind", "feature", "--threads", "1", "--target", str(target_dir),
                 "--out", str(out), "--work", str(work), "--tokens", "300",
                 "--max-new-tokens", "12", "--batch-size", "16", "--batch-tokens", "1024",
                 "--vocab-top", "512", "--steps", str(steps), *extra])
    torch.set_num_threads(threads)
    assert code == 0


@pytest.fixture(scope="module")
def feature_run(tmp_path_factory: pytest.TempPathFactory, tiny_target_dir: Path
                ) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("feature-distill")
    _distill(tiny_target_dir, root / "draft", root / "work", steps=4)
    return root / "draft", root / "work"


def test_a_run_writes_a_valid_feature_draft(feature_run: tuple[Path, Path]) -> None:
    out, work = feature_run
    info, tensors = load_feature_draft_weights(out)
    assert info["format"] == FORMAT and info["feature"] == "final_norm"
    assert info["vocab_top_k"] == 512 and info["model"]["num_hidden_layers"] == 1
    assert {"name", "vocab_size", "hidden_size", "num_layers", "embedding_probe"} <= set(
        info["target"])
    assert info["made_with"]["command"].startswith("specserve distill")
    assert tensors["fc.weight"].dtype == torch.float16
    assert tensors["fc.weight"].shape == (64, 128)
    assert LAYER + "self_attn.q_proj.weight" in tensors
    assert "model.embed_tokens.weight" not in tensors and "lm_head.weight" not in tensors
    report = json.loads((out / "report.json").read_text())
    assert report["training"]["steps"] == 4
    assert report["vocabulary"]["tokens"] == 512
    assert 0 < report["vocabulary"]["held_out_coverage"] <= 1
    for name in ("held_out", "chat", "grounded"):
        result = report["evaluation"][name]
        assert 0 <= result["teacher_forced"] <= 1 and len(result["tau"]) == 5
        assert result["tau"] == sorted(result["tau"])  # drafting more never accepts fewer
    train, held = feature_data.load_split(work / "data")
    assert train and held
    texts = {r["text"] for r in train}
    for name in feature_data.BENCH_SETS:  # never trained on the evaluation sets
        assert not texts & set(feature_data.bench_prompts(name))


def test_resume_continues_the_run(tmp_path: Path, tiny_target_dir: Path) -> None:
    _distill(tiny_target_dir, tmp_path / "draft", tmp_path / "work", steps=3)
    shards = {p: p.stat().st_mtime_ns for p in feature_data.existing_shards(tmp_path / "work"
                                                                            / "data")}
    first = json.loads((tmp_path / "draft" / "report.json").read_text())
    with pytest.raises(SystemExit):  # an earlier run is there: not silently restarted
        _distill(tiny_target_dir, tmp_path / "draft", tmp_path / "work", steps=6)
    partial = tmp_path / "work" / "data" / "features-99999.pt.tmp"  # an interrupted write
    partial.write_bytes(b"half a shard")
    _distill(tiny_target_dir, tmp_path / "draft", tmp_path / "work", 6, "--resume")
    assert not partial.exists()  # a resumed run deletes what it no longer needs
    data_report = json.loads((tmp_path / "work" / "data" / "feature-data.json").read_text())
    first_run, resumed = data_report["runs"]  # each run's figures, the rate among them
    assert first_run["answer_tokens"] == data_report["answer_tokens"] >= 300
    assert first_run["answer_tokens_per_second"] > 0 and resumed["answer_tokens"] == 0
    assert sum(s["answer_tokens"] for s in data_report["shards"].values()) >= 300
    report = json.loads((tmp_path / "draft" / "report.json").read_text())
    assert report["training"]["steps"] == 6
    assert report["history"][0] == first["history"][0]  # continued, not restarted
    assert [h["step"] for h in report["history"]] == [3, 6]
    assert {p: p.stat().st_mtime_ns for p in shards} == shards  # the data is reused


def _random_draft(seed: int = 0, layers: tuple[int, ...] = ()) -> FeatureDraft:
    torch.manual_seed(seed)
    config = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 8, "rms_norm_eps": 1e-5,
              "rope_theta": 10000.0, "max_position_embeddings": 128, "vocab_size": 50,
              "num_hidden_layers": 1, "hidden_act": "silu"}
    draft = FeatureDraft(config, torch.randn(50, 32), torch.arange(0, 50, 2), layers=layers)
    with torch.no_grad():
        for p in draft.parameters():
            p.normal_(0.0, 0.3) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    return draft.eval()


def test_the_mask_sees_what_drafting_sees() -> None:
    mask = ttt_mask(4, 2)  # step 2: real keys up to j - 1, then its own step-2 key
    assert mask.tolist() == [[False, False, False, False, True, False, False, False],
                             [True, False, False, False, False, True, False, False],
                             [True, True, False, False, False, False, True, False],
                             [True, True, True, False, False, False, False, True]]


@pytest.mark.parametrize("layers", [(), (1, 4, 7)], ids=["final", "fused"])
def test_unrolled_steps_equal_sequential_drafting(layers: tuple[int, ...]) -> None:
    """Step s's output at row j, unrolled with the mask, is what drafting s tokens after
    the real context ending at row j - s + 1 gives, one step at a time with a cache
    (over the final states, or the fusion of three layers' outputs)."""
    draft = _random_draft(layers=layers)
    n, steps = 9, 5
    tokens = torch.randint(0, 50, (1, n))
    feats = torch.randn(1, n, 32 * max(1, len(layers)))
    with torch.no_grad():
        outs = draft.unroll(tokens, feats, steps)
    checked = 0
    for s in range(1, steps + 1):
        for j in range(s - 1, n):
            c = j - s + 1  # the last row with a real feature
            _, seq = draft.draft_sequential(tokens[0, :c + 1].tolist(), feats[0, :c + 1], s,
                                            feed=tokens[0, c + 1:j + 1].tolist())
            torch.testing.assert_close(outs[s - 1][0, j], seq[s - 1], atol=1e-5, rtol=1e-5)
            checked += 1
    assert checked == sum(n - s + 1 for s in range(1, steps + 1))
    # and a wrong mask would not pass: step 2 with plain causal attention differs
    assert not torch.allclose(outs[1][0, 5], draft.unroll(tokens, feats, 1)[0][0, 5])


def test_training_learns_a_tiny_set(feature_run: tuple[Path, Path],
                                    tiny_target_dir: Path) -> None:
    """On a few sequences, some steps lower the loss and raise teacher-forced acceptance."""
    _, work = feature_run
    target = BatchedLM.load(str(tiny_target_dir), dtype="float32")
    rows, _ = feature_data.load_split(work / "data")
    rows = [r for r in rows if r["answer_ids"].numel() > 4][:6]
    torch.manual_seed(0)
    draft = feature_train.build_draft(target, rows, 512)
    batch = feature_data.make_batch(rows, 512)
    before_acc = evaluate(draft.eval(), rows, 512)["teacher_forced"]
    optimizer = torch.optim.AdamW(draft.parameters(), lr=3e-3)
    draft.train()
    losses = []
    for _ in range(60):
        loss, _ = feature_train.loss_of(draft, batch, 2, 0.1)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    after_acc = evaluate(draft.eval(), rows, 512)["teacher_forced"]
    assert losses[-1] < 0.5 * losses[0]
    assert after_acc > before_acc + 0.2


def _pools(passages: list[str]) -> Pools:
    return Pools(topics=[f"a tool number {i} that converts files" for i in range(40)],
                 everyday=[], python=[], passages=passages,
                 code=[f"def f{i}(x):\n    y = x + {i}\n    z = y * 2\n    return z"
                       for i in range(30)])


def test_a_benchmark_passage_is_dropped_under_any_task_and_counted() -> None:
    """A grounded task over a passage the benchmark quotes is dropped whatever our own
    instruction around it (no prompt of ours equals or contains the benchmark's), and
    every drop is counted."""
    quoted = feature_data.bench_prompts("grounded")[0].split("\n\n", 1)[1]
    ours = [f"Passage {i}: the module reads a file of records and checks each one before "
            f"it writes the result {i} to disk." for i in range(300)]
    items = feature_data.grounded_items(_pools([*ours, quoted]), seed=0)
    with_quoted = [k for k, (_, _, text) in enumerate(items) if text == quoted]
    assert len(with_quoted) == len(feature_data.PASSAGE_TASKS)
    exclusion = feature_data.Exclusion()
    kept: set[tuple[str, str, str]] = set()
    rounds = -(-len(items) // feature_data.ROUND_GROUNDED)  # every item at least once
    for index in range(rounds):
        kept |= {item for _, item in feature_data.grounded_round(items, index, exclusion)}
    assert quoted not in {text for _, _, text in kept}
    assert kept == set(items) - {items[k] for k in with_quoted}  # nothing else dropped
    offered = [items[p % len(items)] for p in range(rounds * feature_data.ROUND_GROUNDED)]
    assert exclusion.dropped == sum(text == quoted for _, _, text in offered)  # each counted


def test_held_out_follows_the_text_whatever_the_seed() -> None:
    passages = [f"Passage {i}: the parser keeps every token of line {i} and stops at the "
                f"first blank line it meets." for i in range(400)]
    pools = _pools(passages)
    splits = []
    for seed in (0, 1, 7):
        items = feature_data.grounded_items(pools, seed)
        splits.append({prompt: feature_data.held_out(feature_data.split_key(prompt, text))
                       for _, prompt, text in items})
        by_text: dict[str, set[bool]] = {}
        for _, prompt, text in items:
            by_text.setdefault(text, set()).add(splits[-1][prompt])
        assert all(len(s) == 1 for s in by_text.values())  # a text's tasks on one side
    assert splits[0] == splits[1] == splits[2]
    held = sum(feature_data.held_out(p) for p in passages)
    assert 0.01 * len(passages) <= held <= 0.12 * len(passages)


def test_the_head_s_vocabulary_is_the_fewest_tokens_covering_the_held_out_share() -> None:
    """Zipf-like answers: the chosen tokens cover 97% of the held-out answer tokens, one
    fewer of the same ranking would not, and the stop token is always in."""
    gen = torch.Generator().manual_seed(0)
    weights = 1.0 / torch.arange(1, 2001, dtype=torch.float) ** 1.1

    def rows(n: int) -> list[dict[str, torch.Tensor]]:
        return [{"answer_ids": torch.multinomial(weights, 64, replacement=True, generator=gen)
                 + 10} for _ in range(n)]

    train, held = rows(400), rows(40)
    ids, covered = feature_train.vocab_for_coverage(train, held, 0.97, 5000, [2])
    assert covered >= 0.97 and 2 in ids.tolist()
    assert covered == feature_train.coverage(ids, held)
    assert 50 < ids.numel() < 2001
    counts = torch.bincount(torch.cat([r["answer_ids"] for r in train]), minlength=5000)
    ranked = sorted(range(5000), key=lambda t: (-int(counts[t]), t))
    chosen = set(ids.tolist()) - {2}
    fewer = torch.tensor(sorted([2, *ranked[:len(chosen) - 1]]))
    assert set(ranked[:len(chosen)]) == chosen  # the most frequent ones
    assert feature_train.coverage(fewer, held) < 0.97


def test_grown_answers_and_their_features_are_what_each_alone_gives(
        tiny_target_dir: Path) -> None:
    """Answers grown together (a prompt run once, its three answers forked from its KV
    rows) are each what the target gives alone, greedy ones its plain greedy answer, and
    the features kept along the way (and a captured layer's) are those of one pass over
    prompt and answer; a record flattens to one row per answer."""
    from specdistill.data import answer_all
    from specdistill.feature_gen import Job, grow

    target = BatchedLM.load(str(tiny_target_dir), dtype="float32", kernels="native")
    target.capture_layers((0,))
    prompts = [[5, 9, 300, 41, 7], [11, 12, 13], [400, 3, 8, 8, 20, 21, 22]]
    jobs = [Job(p, (0.0, 0.2, 0.7), (i, i + 1, i + 2), 12, tag=i)
            for i, p in enumerate(prompts)]
    done: dict[int, Any] = {}
    grow(target, jobs, 4, lambda d: done.__setitem__(d.job.tag, d) or [])
    alone = answer_all(target, prompts, 12, 1, 1)
    for i, p in enumerate(prompts):
        d = done[i]
        assert d.answers[0].tokens == alone[i].answer_ids.tolist()
        for a in d.answers:
            seq = p + a.tokens
            state = target.new_state()
            prepared = target.prepare_pass([BatchItem(state, seq, 1, features=True)])
            target.run_pass(prepared)
            target.release(state)
            feats = torch.cat([d.prompt_features, *a.features]).float()
            layers = torch.cat([d.prompt_layers, *a.layers]).float()
            assert feats.shape == (len(seq), target.hidden_size)
            torch.testing.assert_close(feats, prepared.features[0].half().float())
            torch.testing.assert_close(layers, prepared.layers[0].half().float())
    one = done[0]
    record = {"kind": "rewrite", "text": "t", "held_out": False,
              "prompt_ids": torch.tensor(prompts[0]), "features": one.prompt_features,
              "layers": one.prompt_layers,
              "answers": [{"temperature": a.temperature, "answer_ids": torch.tensor(a.tokens),
                           "features": torch.cat(a.features), "layers": torch.cat(a.layers)}
                          for a in one.answers]}
    rows = feature_data.flatten(record)
    assert [r["greedy"] for r in rows] == [True, False, False] and "layers" not in rows[0]
    assert "layers" in feature_data.flatten(record, layers=True)[0]
    target.capture_layers(())


def _shards(directory: Path, count: int, per: int) -> list[dict[str, Any]]:
    """``count`` shards of ``per`` one-answer records each (every third held out), with
    three layers' outputs; returns every row."""
    directory.mkdir(parents=True)
    gen = torch.Generator().manual_seed(0)
    for s in range(count):
        records = []
        for r in range(per):
            n, m = 3 + r % 4, 2 + (r * 7 + s) % 5
            records.append({
                "version": 2, "kind": "magpie", "text": f"t{s}-{r}", "turn": 1,
                "held_out": r % 3 == 0,
                "prompt_ids": torch.randint(0, 50, (n,), generator=gen, dtype=torch.int32),
                "features": torch.randn(n, 8, generator=gen).half(),
                "layers": torch.randn(n, 24, generator=gen).half(),
                "answers": [{"temperature": 0.0, "features": torch.randn(m, 8).half(),
                             "layers": torch.randn(m, 24).half(),
                             "answer_ids": torch.randint(0, 50, (m,), generator=gen,
                                                         dtype=torch.int32)}]})
        torch.save(records, feature_data.shard_path(directory, s))
    return [r for p in feature_data.existing_shards(directory)
            for r in feature_data.load_rows(p, layers=True)]


def test_training_streams_the_shards_a_few_at_a_time(tmp_path: Path) -> None:
    """One scan keeps only the held-out rows; the training rows come a window of shards
    at a time, each exactly once an epoch, in a new order each epoch, and a stream
    resumed at a position gives the batches the first would have."""
    rows = _shards(tmp_path / "data", count=5, per=9)
    data = feature_data.scan(tmp_path / "data", layers=True)
    assert [r["text"] for r in data.held] == [r["text"] for r in rows if r["held_out"]]
    assert all(r["layers"].shape[1] == 24 for r in data.held)
    train = [r for r in rows if not r["held_out"]]
    assert data.train_sequences == len(train) == 30
    assert data.train_answer_tokens == sum(int(r["answer_ids"].numel()) for r in train)
    assert sum(data.train_counts.values()) == data.train_answer_tokens

    def plan(batch_rows: Any, salt: int) -> list[list[int]]:
        return feature_train.batches(batch_rows, 40, 512, 0, salt)

    stream = feature_data.TrainStream(data.train_shards, 2, 0, True, plan)
    epochs: list[list[str]] = [[], []]
    positions, seen = [], []
    while stream.epoch < 2:
        epoch = stream.epoch
        positions.append(stream.position)
        batch = stream.next()
        seen.append([r["text"] for r in batch])
        epochs[epoch] += seen[-1]
        shards = {t.split("-")[0] for t in seen[-1]}
        assert len(shards) <= 2  # a batch comes from the window in memory
    for texts in epochs:
        assert sorted(texts) == sorted(r["text"] for r in train)  # each once an epoch
    assert epochs[0] != epochs[1]
    middle = len(seen) // 2
    resumed = feature_data.TrainStream(data.train_shards, 2, 0, True, plan, positions[middle])
    assert [[r["text"] for r in resumed.next()] for _ in range(5)] == seen[middle:middle + 5]
    first = feature_data.scan(tmp_path / "data", max_train_tokens=1)  # the same held out
    assert len(first.train_shards) == 1 and all("layers" not in r for r in first.held)
    assert [r["text"] for r in first.held] == [r["text"] for r in data.held]


def test_a_fused_head_trains_from_a_final_state_head(feature_run: tuple[Path, Path],
                                                     tiny_target_dir: Path,
                                                     tmp_path: Path) -> None:
    """``--feature-layers`` with the fused feature writes a draft that fuses those layers
    (``fuse.weight``, ``fuse_norm.weight``); ``--init-from`` a head that reads the final
    states starts its layer and ``fc`` from that head's."""
    first, work = feature_run
    target = BatchedLM.load(str(tiny_target_dir), dtype="float32")
    with pytest.raises(RuntimeError, match="keeps no layers"):  # its data has none
        feature_train.train(target, work, tmp_path / "no-layers",
                            feature_train.FeatureTrainSettings(steps=1, layers=(0, 1)), {})
    _distill(tiny_target_dir, tmp_path / "draft", tmp_path / "work", 2,
             "--feature-layers", "0,1", "--init-from", str(first), "--ttt-steps", "2")
    info, tensors = load_feature_draft_weights(tmp_path / "draft")
    assert info["feature"] == "layers" and info["layers"] == [0, 1]
    assert tensors["fuse.weight"].shape == (64, 128)
    assert tensors["fuse_norm.weight"].shape == (128,)
    report = json.loads((tmp_path / "draft" / "report.json").read_text())
    assert report["training"]["layers"] == [0, 1] and report["training"]["ttt_steps"] == 2
    assert report["training"]["init_from"] == str(first.resolve())
    _, before = load_feature_draft_weights(first)
    moved = (tensors["fc.weight"].float() - before["fc.weight"].float()).abs().max()
    assert 0 < moved < 0.1  # two small steps from the first head's, not a fresh start


def test_a_data_only_resume_answers_for_the_data_settings_alone(tmp_path: Path) -> None:
    """The data run's own command resumes it after the training defaults change; a run
    that trains, or data made differently, is still refused."""
    from specdistill.feature_cli import SETTINGS_NAME, _check_work
    data = feature_data.FeatureDataSettings(layers=(2, 15, 27))
    _check_work(tmp_path, data, feature_train.FeatureTrainSettings(ttt_steps=3), resume=False)
    recorded = json.loads((tmp_path / SETTINGS_NAME).read_text())
    newer = feature_train.FeatureTrainSettings(ttt_steps=5)
    _check_work(tmp_path, data, newer, resume=True, trains=False)
    assert json.loads((tmp_path / SETTINGS_NAME).read_text()) == recorded
    with pytest.raises(SystemExit, match="different settings"):
        _check_work(tmp_path, data, newer, resume=True)
    with pytest.raises(SystemExit, match="different settings"):
        _check_work(tmp_path, feature_data.FeatureDataSettings(layers=()), newer, resume=True,
                    trains=False)
    with pytest.raises(SystemExit, match="pass --resume"):
        _check_work(tmp_path, data, newer, resume=False, trains=False)


def test_a_saved_head_is_evaluated_on_a_work_directory_as_its_run_reported(
        feature_run: tuple[Path, Path], tiny_target_dir: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """``python -m specdistill.feature_report`` on the run's own head and data gives the
    figures the run's report holds at its end, and the later turns of conversations
    alone where the held-out rows have any."""
    from specdistill import feature_eval, feature_report

    out, work = feature_run
    threads = torch.get_num_threads()
    try:
        assert feature_report.main(["--draft", str(out), "--work", str(work), "--target",
                                  str(tiny_target_dir), "--threads", "1",
                                  "--json", str(tmp_path / "eval.json")]) == 0
    finally:
        torch.set_num_threads(threads)
    got = json.loads((tmp_path / "eval.json").read_text())["evaluation"]
    want = json.loads((out / "report.json").read_text())["evaluation"]
    for name in ("held_out", "chat", "grounded"):
        assert got[name]["teacher_forced"] == pytest.approx(want[name]["teacher_forced"])
        assert got[name]["tau"] == pytest.approx(want[name]["tau"])
    held = feature_data.scan(work / "data").held
    assert all(r["turn"] >= 1 for r in held)
    later = [r for r in held if r["turn"] > 1]
    assert ("multi_turn" in got) == bool(later)
    assert "| held_out |" in capsys.readouterr().out
    # a later turn among the held-out rows: measured alone as well
    target = BatchedLM.load(str(tiny_target_dir), dtype="float32")
    draft = feature_train.load_draft(out, target)
    rows = [dict(r) for r in held]
    rows[-1]["turn"] = 2
    both = feature_eval.full_evaluation(draft, rows, [rows[:1], rows[:1]], 512)
    alone = feature_eval.evaluate(draft, rows[-1:], 512)
    assert both["multi_turn"] == alone and both["held_out"]["answer_rows"] > alone["answer_rows"]
