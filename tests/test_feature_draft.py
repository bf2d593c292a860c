"""The draft that reads the target's features: its directory format, its KV kept in
step with the target's (fed the target's states for every committed token, its own
states rolled back), and speculation with it lossless."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from decoding.drafter import DraftContext
from decoding.features import FeatureRows
from decoding.policy import FixedSpeculation
from decoding.prompting import encode_chat
from decoding.round import decode
from decoding.types import GenerationRequest, SamplingParams
from drafters.feature import FeatureDrafter
from runtime.drafts import draft_format, feature_draft
from runtime.runner.batched import BatchedLM
from runtime.runner.causal_lm import CausalLM
from runtime.runner.passes import BatchItem
from specbench.acceptance import target_features


def make_feature_draft(target: BatchedLM, out: Path, seed: int = 0, top: int = 4096,
                       layers: tuple[int, ...] = ()) -> Path:
    """A random-weight feature draft for ``target``: its last layer and final norm, a
    random ``fc``, a head over the first ``top`` tokens; with ``layers``, a random fusion
    of those target layers' outputs."""
    config = target.model.config
    model_config = {"hidden_size": config.hidden_size,
                    "intermediate_size": config.intermediate_size,
                    "num_attention_heads": config.num_attention_heads,
                    "num_key_value_heads": config.num_key_value_heads,
                    "head_dim": target.head_dim, "rms_norm_eps": config.rms_norm_eps,
                    "rope_theta": getattr(config, "rope_theta", 10000.0),
                    "max_position_embeddings": config.max_position_embeddings,
                    "vocab_size": target.vocab_size, "hidden_act": "silu"}
    g = torch.Generator().manual_seed(seed)
    hidden = config.hidden_size
    layer = {f"model.layers.0.{k}": v.detach().clone()
             for k, v in target.model.model.layers[-1].state_dict().items()}
    tensors = {**layer, "model.norm.weight": target.model.model.norm.weight.detach().clone(),
               feature_draft.FC: torch.randn(hidden, 2 * hidden, generator=g) * 0.1,
               draft_format.VOCAB_IDS: torch.arange(top)}
    if layers:
        tensors[feature_draft.FUSE] = torch.randn(hidden, len(layers) * hidden, generator=g) * 0.1
        tensors[feature_draft.FUSE_NORM] = 1 + 0.2 * torch.rand(len(layers) * hidden, generator=g)
    feature_draft.save(out, target, model_config, tensors, {"by": "test"}, layers=layers)
    return out


@pytest.fixture(scope="module")
def feature_dir(tiny_target_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    target = BatchedLM.load(str(tiny_target_dir))  # its plain weights: the test reads them
    assert isinstance(target, BatchedLM)
    return make_feature_draft(target, tmp_path_factory.mktemp("feature-draft"))


def test_feature_rows_keep_positions_contiguous_and_a_window() -> None:
    rows = FeatureRows(window=4)
    rows.add(3, torch.arange(6.0).reshape(3, 2))  # positions 3, 4, 5
    assert (rows.start, rows.end) == (3, 6)
    rows.add(5, torch.full((2, 2), 9.0))  # replaces 5, adds 6
    assert rows.end == 7 and rows.get(4, 7)[:, 0].tolist() == [2.0, 9.0, 9.0]
    rows.add(10, torch.ones(1, 2))  # a gap: start again there
    assert (rows.start, rows.end) == (10, 11)
    with pytest.raises(IndexError):
        rows.get(9, 11)
    rows.add(11, torch.arange(16.0).reshape(8, 2))  # past twice the window: the last 4 kept
    assert rows.end == 19 and rows.start == 15
    assert rows.get(15, 19)[:, 0].tolist() == [8.0, 10.0, 12.0, 14.0]


def test_a_feature_draft_is_checked_against_its_target(feature_dir: Path,
                                                       tiny_target: CausalLM,
                                                       default_model_dir: Path) -> None:
    draft = feature_draft.load(feature_dir, tiny_target)
    assert draft.hidden_size == tiny_target.hidden_size
    assert feature_draft.is_feature_draft_dir(feature_dir)
    assert not draft_format.is_draft_dir(feature_dir) or not feature_draft.is_feature_draft_dir(
        draft_format.DEFAULT_DRAFT_DIR)
    other = BatchedLM.load(str(default_model_dir), dtype="float32")
    with pytest.raises(draft_format.DraftFormatError, match="made for"):
        feature_draft.load(feature_dir, other)


def _request(target: CausalLM, text: str, sampling: SamplingParams,
             n: int = 24) -> GenerationRequest:
    ids = encode_chat(target.tokenizer, [{"role": "user", "content": text}])
    return GenerationRequest(prompt_ids=tuple(ids), max_new_tokens=n, sampling=sampling)


@pytest.mark.parametrize("sampling", [SamplingParams(temperature=0.0),
                                      SamplingParams(temperature=0.8, seed=7)],
                         ids=["greedy", "seeded"])
def test_speculation_with_a_feature_draft_is_plain_decoding(
        feature_dir: Path, tiny_target: CausalLM, sampling: SamplingParams) -> None:
    drafter = FeatureDrafter(feature_draft.load(feature_dir, tiny_target), tiny_target)
    for text in ("tell me about the sea", "a b c a b c a b"):
        request = _request(tiny_target, text, sampling)
        plain = [t for e in decode(tiny_target, None, request) for t in e.token_ids]
        events = list(decode(tiny_target, drafter, request, FixedSpeculation(3)))
        assert [t for e in events for t in e.token_ids] == plain
        assert sum(e.draft_tokens for e in events) > len(plain) // 2  # it drafted


def _target_rows(target: CausalLM, tokens: list[int]) -> FeatureRows:
    """The target's states for every token but the last, from one fresh pass."""
    assert isinstance(target, BatchedLM)
    state = target.new_state()
    prepared = target.prepare_pass([BatchItem(state, tokens[:-1], 1, features=True)])
    target.run_pass(prepared)
    target.release(state)
    rows = FeatureRows()
    assert prepared.features[0] is not None
    rows.add(0, prepared.features[0])
    return rows


@pytest.mark.parametrize("accepted", [3, 1, 0])
def test_the_draft_s_kv_holds_the_target_s_states_for_every_committed_token(
        feature_dir: Path, tiny_target: CausalLM, accepted: int) -> None:
    """A round drafts 3 tokens (fed on the draft's own states past the first); the
    target keeps ``accepted`` of them and adds a token. The next draft's KV and tokens
    are bitwise a fresh draft state's, fed every committed token beside the target's
    states from one pass: what was fed on the draft's own states was rolled back, even
    where the target accepted those very tokens."""
    draft = feature_draft.load(feature_dir, tiny_target)
    drafter = FeatureDrafter(draft, tiny_target)
    sampling = SamplingParams(temperature=0.0)
    tokens = [*_request(tiny_target, "count: one two three", sampling).prompt_ids, 77]
    context = DraftContext(tokens, sampling, None, features=_target_rows(tiny_target, tokens))
    state = drafter.begin(tokens)
    first = drafter.propose(state, context, 3)
    assert len(first.tokens) == 3
    tokens = [*tokens, *first.tokens[:accepted], 42 if accepted < 3 else 43]
    context = DraftContext(tokens, sampling, None, features=_target_rows(tiny_target, tokens))
    got = drafter.propose(state, context, 3)
    fresh = drafter.begin(tokens)
    again = drafter.propose(fresh, context, 3)
    assert got.tokens == again.tokens
    runner = draft.runner
    for (k1, v1), (k2, v2) in zip(runner.kv(state.cache), runner.kv(fresh.cache), strict=True):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)
    drafter.release(state)
    drafter.release(fresh)


@pytest.fixture(scope="module")
def fused_dir(tiny_target_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    target = BatchedLM.load(str(tiny_target_dir))
    assert isinstance(target, BatchedLM)
    return make_feature_draft(target, tmp_path_factory.mktemp("fused-draft"), seed=3,
                              layers=(0, 1))


@pytest.fixture()
def own_target(tiny_target_dir: Path) -> BatchedLM:
    """A target of its own: a fused draft makes it capture layers."""
    target = BatchedLM.load(str(tiny_target_dir), dtype="float32", kernels="native")
    assert isinstance(target, BatchedLM)
    return target


@pytest.mark.parametrize("sampling", [SamplingParams(temperature=0.0),
                                      SamplingParams(temperature=0.8, seed=7)],
                         ids=["greedy", "seeded"])
def test_speculation_with_a_fused_feature_draft_is_plain_decoding(
        fused_dir: Path, own_target: BatchedLM, sampling: SamplingParams) -> None:
    """Loading a draft that fuses layers makes the target capture them; its verify passes
    hand them to the drafter and their output stays plain decoding's, token for token."""
    plain_runs = {}
    for text in ("tell me about the sea", "a b c a b c a b"):
        request = _request(own_target, text, sampling)
        plain_runs[text] = [t for e in decode(own_target, None, request) for t in e.token_ids]
    drafter = FeatureDrafter(feature_draft.load(fused_dir, own_target), own_target)
    assert own_target.captured_layers == (0, 1)
    for text, plain in plain_runs.items():
        request = _request(own_target, text, sampling)
        events = list(decode(own_target, drafter, request, FixedSpeculation(3)))
        assert [t for e in events for t in e.token_ids] == plain
        assert sum(e.draft_tokens for e in events) > len(plain) // 2  # it drafted


def test_a_served_fused_draft_drafts_what_its_training_module_drafts(
        fused_dir: Path, own_target: BatchedLM) -> None:
    """The serving drafter, fed the target's captured layers by a verify pass, proposes
    the tokens the PyTorch module that training uses drafts from the same layers."""
    from specdistill.feature_train import load_draft

    drafter = FeatureDrafter(feature_draft.load(fused_dir, own_target), own_target)
    sampling = SamplingParams(temperature=0.0)
    tokens = [*_request(own_target, "count: one two three four", sampling).prompt_ids, 77]
    state = own_target.new_state()
    prepared = own_target.prepare_pass([BatchItem(state, tokens[:-1], 1, features=True)])
    own_target.run_pass(prepared)
    own_target.release(state)
    layers = prepared.layers[0]
    assert layers is not None and layers.shape == (len(tokens) - 1, 2 * own_target.hidden_size)
    final = prepared.features[0]
    assert final is not None
    rows = FeatureRows()
    rows.add(0, torch.cat([final, layers], dim=1))  # as the round hands them
    got = drafter.propose(drafter.begin(tokens), DraftContext(tokens, sampling, None,
                                                              features=rows), 4)
    module = load_draft(fused_dir, own_target)
    want, _ = module.draft_sequential(tokens[1:], layers, 4)
    assert list(got.tokens) == want
    # the fusion matters: the final states in its place draft otherwise
    other = torch.cat([final, final], dim=1)
    assert module.draft_sequential(tokens[1:], other, 4)[0] != want


def test_an_older_single_feature_directory_still_loads(feature_dir: Path,
                                                       own_target: BatchedLM) -> None:
    """A directory without ``layers`` (the first heads' format) loads, reads the final
    states, and leaves the target capturing nothing."""
    draft = feature_draft.load(feature_dir, own_target)
    assert draft.layers == () and draft.fuse is None
    assert own_target.captured_layers == ()
    rows = torch.randn(3, 3 * own_target.hidden_size)  # final states, then captured layers
    assert torch.equal(draft.target_feature(rows), rows[:, :own_target.hidden_size])


def test_a_final_state_head_beside_a_fused_one_reads_the_final_states(
        feature_dir: Path, fused_dir: Path, own_target: BatchedLM,
        tiny_target_dir: Path) -> None:
    """Where another head makes the target capture layers, a head that reads the final
    states drafts what it drafts on a target that captures none, round for round."""
    sampling = SamplingParams(temperature=0.0)

    def rounds(target: BatchedLM) -> list[tuple[list[int], int]]:
        drafter = FeatureDrafter(feature_draft.load(feature_dir, target), target)
        request = _request(target, "tell me about the sea", sampling)
        events = decode(target, drafter, request, FixedSpeculation(3))
        return [(list(e.token_ids), e.draft_tokens) for e in events]

    plain_target = BatchedLM.load(str(tiny_target_dir), dtype="float32", kernels="native")
    assert isinstance(plain_target, BatchedLM)
    want = rounds(plain_target)
    feature_draft.load(fused_dir, own_target)
    assert own_target.captured_layers == (0, 1)
    assert rounds(own_target) == want
    assert sum(n for _, n in want) > 0


def test_a_fused_directory_names_its_layers(fused_dir: Path, tmp_path: Path,
                                            own_target: BatchedLM) -> None:
    import json
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(fused_dir, broken)
    info = json.loads((broken / draft_format.CONFIG_NAME).read_text())
    info.pop("layers")
    (broken / draft_format.CONFIG_NAME).write_text(json.dumps(info))
    with pytest.raises(draft_format.DraftFormatError, match="names its target layers"):
        feature_draft.load(broken, own_target)
    info["layers"] = [0, 5]  # the tiny target has two
    (broken / draft_format.CONFIG_NAME).write_text(json.dumps(info))
    with pytest.raises(draft_format.DraftFormatError, match="fuses layers"):
        feature_draft.load(broken, own_target)


@pytest.mark.parametrize(("dtype", "quantize"), [("bfloat16", "none"), ("float32", "int8"),
                                                 ("float32", "int4")])
def test_the_fusion_runs_in_every_draft_precision(fused_dir: Path, own_target: BatchedLM,
                                                  dtype: str, quantize: str) -> None:
    """The fusion's product takes the draft's own activations, whatever its precision,
    and gives about the float32 fusion."""
    exact = feature_draft.load(fused_dir, own_target)
    draft = feature_draft.load(fused_dir, own_target, dtype, quantize)
    rows = torch.randn(5, 3 * own_target.hidden_size)
    want = exact.target_feature(rows)
    got = draft.target_feature(rows)
    assert got.shape == want.shape and got.dtype == draft.runner.dtype
    error = float((got.float() - want).norm() / want.norm())
    assert error < 0.1


class _KeepAll:
    """A judge that lets every draft token through and asks for the second choice."""

    def worth_proposing(self, confidences: object) -> bool:
        return True

    def worth_continuing(self, confidences: object) -> bool:
        return True

    def worth_alternative(self, confidences: object, confidence: float) -> bool:
        return True


@pytest.mark.parametrize("head", ["final-states", "fused"])
@pytest.mark.parametrize(("dtype", "quantize"), [("float32", "none"), ("bfloat16", "int4")])
def test_the_native_chain_drafts_the_feature_head_s_step_loop_tokens(
        feature_dir: Path, fused_dir: Path, own_target: BatchedLM, head: str, dtype: str,
        quantize: str) -> None:
    """Several sequences at once, each with its own catch-up and draft length (5 takes
    two native calls: the second starts from the state the first left), over rounds that
    keep part of each draft: the chain's tokens and second choices are the step loop's,
    their confidences equal to a few ulp, and a sequence that switches path between
    rounds drafts the same (each round's catch-up is fed beside the target's states)."""
    directory = fused_dir if head == "fused" else feature_dir
    drafter = FeatureDrafter(feature_draft.load(directory, own_target, dtype, quantize),
                             own_target)
    assert drafter.can_chain()
    sampling = SamplingParams(temperature=0.0)

    def rows_for(tokens: list[int]) -> FeatureRows:
        rows = target_features(own_target, tokens[:-1])  # as the verify passes hand them
        assert rows is not None
        return rows

    def rounds(paths: list[bool]) -> list[list[tuple[object, ...]]]:
        prompts = [[*_request(own_target, text, sampling).prompt_ids, 77]
                   for text in ("count: one two", "tell me about the sea and the sky", "hi")]
        states = [drafter.begin(p) for p in prompts]
        out = []
        for chain in paths:
            drafter.native_chain = chain
            contexts = [DraftContext(p, sampling, None, _KeepAll(), features=rows_for(p))
                        for p in prompts]
            proposals = drafter.propose_many(states, contexts, [5, 3, 1])
            out.append([(q.tokens, q.alternative, q.confidence) for q in proposals])
            prompts = [[*p, *q.tokens[:1], 300 + len(p)]
                       for p, q in zip(prompts, proposals, strict=True)]
        for state in states:
            drafter.release(state)
        return out

    steps, chained, mixed = rounds([False] * 4), rounds([True] * 4), rounds([True, False] * 2)
    assert drafter.draft.runner.rows_in_use == 0
    for a, b, c in zip(steps, chained, mixed, strict=True):
        for x, y, z in zip(a, b, c, strict=True):
            assert x[0] == y[0] == z[0] and len(x[0]) >= 1
            assert x[1] == y[1] == z[1] is not None
            assert y[2] == pytest.approx(x[2], rel=1e-5)
    assert [len(p[0]) for p in steps[0]] == [5, 3, 1]


@pytest.mark.real_model
def test_the_shipped_feature_head_chains_natively_beside_the_served_target() -> None:
    """The shipped head beside the served target (bfloat16, 4-bit blocks): the chain
    runs, with the step loop's tokens, from a verify pass's states."""
    from runtime.loaders.loading import load_target
    from wiring.drafts import load_model_drafter

    target = load_target("default", "bfloat16", quantize="auto")
    assert isinstance(target, BatchedLM)
    drafter = load_model_drafter(feature_draft.DEFAULT_FEATURE_DRAFT, target, "bfloat16")
    assert isinstance(drafter, FeatureDrafter) and drafter.can_chain()
    sampling = SamplingParams(temperature=0.0)
    tokens = [*_request(target, "Name three primary colours.", sampling).prompt_ids]
    rows = target_features(target, tokens[:-1])
    assert rows is not None
    drafted = {}
    for chain in (False, True):
        drafter.native_chain = chain
        fresh = drafter.begin(tokens)
        drafted[chain] = drafter.propose(fresh, DraftContext(tokens, sampling, None,
                                                             features=rows), 6)
        drafter.release(fresh)
    assert drafted[True].tokens == drafted[False].tokens and len(drafted[True].tokens) == 6
    assert drafted[True].confidence == pytest.approx(drafted[False].confidence, rel=1e-5)
