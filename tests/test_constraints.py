"""Grammar-constrained decoding under speculation: the output is exactly what plain
constrained decoding of the target gives, greedy token for token and sampled in
distribution; forbidden drafts are cut, rejected drafts rolled back, forced tokens
drafted for free."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from decoding.drafter import BaseDrafter, DraftContext, Drafter, DraftProposal
from decoding.policy import FixedSpeculation
from decoding.prompting import encode_chat
from decoding.round import decode
from decoding.types import (
    FinishReason,
    GenerationRequest,
    RoundEvent,
    SamplingParams,
    SpeculationParams,
)
from drafters.combined import CombinedDrafter
from drafters.model import ModelDrafter
from drafters.ngram import NgramDrafter
from grammars.guidance import GrammarCompiler, GrammarError
from runtime.runner.causal_lm import CausalLM

GREEDY = SamplingParams(temperature=0.0)
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "colour": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 2},
    },
    "required": ["name", "age", "colour", "tags"],
    "additionalProperties": False,
}
PROMPTS = ["Describe Alice, 30, who likes green, as JSON.",
           "Return a JSON person: Bob, 41, blue, tags x and y.",
           "{\"name\": \"Carol\", \"age\": 5"]


@pytest.fixture(scope="module")
def compiler(tiny_target: CausalLM) -> GrammarCompiler:
    return GrammarCompiler(tiny_target.tokenizer, tiny_target.vocab_size)


def _run(target: CausalLM, drafter: Drafter | None, request: GenerationRequest,
         k: int | None = 4) -> tuple[list[int], list[RoundEvent]]:
    events = list(decode(target, drafter, request, FixedSpeculation(k) if k else None))
    return [t for e in events for t in e.token_ids], events


def _request(target: CausalLM, prompt: str, grammar: Any, sampling: SamplingParams = GREEDY,
             max_new: int = 60, enabled: bool = True) -> GenerationRequest:
    ids = tuple(encode_chat(target.tokenizer, [{"role": "user", "content": prompt}]))
    return GenerationRequest(prompt_ids=ids, max_new_tokens=max_new, sampling=sampling,
                             grammar=grammar, speculation=SpeculationParams(enabled=enabled))


def _drafters(target: CausalLM, tiny_draft: CausalLM) -> dict[str, Drafter | None]:
    return {
        "grammar-only": None,
        "ngram": NgramDrafter(),
        "model-poor": ModelDrafter(tiny_draft, target),
        "model-self": ModelDrafter(target, target),
        "ngram+model-poor": CombinedDrafter([NgramDrafter()], ModelDrafter(tiny_draft, target)),
    }


def test_constrained_greedy_speculation_is_plain_constrained_decoding(
        tiny_target: CausalLM, tiny_draft: CausalLM, compiler: GrammarCompiler) -> None:
    grammar = compiler.json_schema(PERSON)
    drafters = _drafters(tiny_target, tiny_draft)
    for prompt in PROMPTS:
        plain, plain_events = _run(tiny_target, None, _request(
            tiny_target, prompt, grammar, enabled=False), k=None)
        assert all(e.draft_tokens == 0 for e in plain_events)
        text = tiny_target.tokenizer.decode(plain, skip_special_tokens=True)
        if plain_events[-1].finish_reason is FinishReason.STOP:
            value = json.loads(text)
            assert set(value) == set(PERSON["properties"]) and value["colour"] in (
                "red", "green", "blue")
        for name, drafter in drafters.items():
            for k in (None, 1, 5):
                out, events = _run(tiny_target, drafter, _request(tiny_target, prompt, grammar), k)
                assert out == plain, (prompt, name, k)
                assert events[-1].finish_reason == plain_events[-1].finish_reason


def test_forced_tokens_are_free_drafts(tiny_target: CausalLM,
                                       compiler: GrammarCompiler) -> None:
    grammar = compiler.json_schema(PERSON)
    out, events = _run(tiny_target, None, _request(tiny_target, PROMPTS[0], grammar), k=None)
    forced = sum(e.forced_tokens for e in events)
    assert forced > 0  # '{"name":"', '","age":', ... are proposed for free
    assert sum(e.forced_accepted for e in events) > 0
    plain, plain_events = _run(tiny_target, None, _request(
        tiny_target, PROMPTS[0], grammar, enabled=False), k=None)
    assert out == plain and len(events) < len(plain_events)


def test_rejected_drafts_are_rolled_back(tiny_target: CausalLM, tiny_draft: CausalLM,
                                         compiler: GrammarCompiler) -> None:
    """A poor draft model: its tokens are cut or rejected round after round, and the
    matcher must follow the committed output exactly every time."""
    grammar = compiler.json_schema(PERSON)
    drafter = ModelDrafter(tiny_draft, tiny_target)
    plain, _ = _run(tiny_target, None, _request(tiny_target, PROMPTS[1], grammar,
                                                enabled=False), k=None)
    out, events = _run(tiny_target, CombinedDrafter([NgramDrafter()], drafter),
                       _request(tiny_target, PROMPTS[1], grammar), k=6)
    assert out == plain
    assert any(e.accepted_tokens < e.draft_tokens for e in events)  # rejections happened


def test_a_grammar_that_cannot_finish_in_max_tokens_ends_with_length(
        tiny_target: CausalLM, compiler: GrammarCompiler) -> None:
    grammar = compiler.json_schema(PERSON)
    out, events = _run(tiny_target, NgramDrafter(),
                       _request(tiny_target, PROMPTS[0], grammar, max_new=5))
    assert len(out) == 5 and events[-1].finish_reason is FinishReason.LENGTH


def test_grammar_termination_inside_a_draft_window_stops(
        tiny_target: CausalLM, compiler: GrammarCompiler) -> None:
    """A grammar of one fixed string: every token is forced, the whole answer and its
    end fit in one draft window, and the sequence stops at the grammar's EOS."""
    grammar = compiler.json_schema({"const": {"ok": True}})
    out, events = _run(tiny_target, None, _request(tiny_target, "hi", grammar), k=None)
    text = tiny_target.tokenizer.decode(out, skip_special_tokens=True)
    assert json.loads(text) == {"ok": True}
    assert events[-1].finish_reason is FinishReason.STOP
    assert len(events) <= 3


def _word_probs(target: CausalLM, prompt_ids: tuple[int, ...], compiler: GrammarCompiler,
                grammar: Any) -> dict[str, float]:
    """The exact probability plain constrained sampling gives each answer: every token
    path the grammar allows (any tokenization), each the product of the masked,
    renormalised target distribution along it (paths under 1e-6 are left out)."""
    eos = compiler.eos_id
    result: dict[str, float] = {}

    def walk(path: list[int], prob: float) -> None:
        matcher = grammar.matcher()
        assert matcher.advance(path)
        state = target.new_state()
        logits = target.prefill(state, [*prompt_ids, *path])  # [vocab] after the last
        target.release(state)
        allowed = matcher.allowed()
        probs = logits.float().masked_fill(~allowed[: logits.shape[-1]], float("-inf"))
        probs = probs.softmax(-1)
        for token in allowed.nonzero().flatten().tolist():
            p = prob * float(probs[token])
            if p < 1e-6:
                continue
            if token == eos:
                word = json.loads(target.tokenizer.decode(path))
                result[word] = result.get(word, 0.0) + p
            else:
                walk([*path, token], p)

    walk([], 1.0)
    return result


def test_constrained_sampling_under_speculation_has_the_masked_target_distribution(
        tiny_target: CausalLM, tiny_draft: CausalLM, compiler: GrammarCompiler) -> None:
    """A sampled poor draft model: its tokens are mostly forbidden and cut. Sampling is
    keyed here, so each token is the masked target's keyed draw whatever was drafted (the
    residual correction for a cut is rejection sampling's, tested below)."""
    from scipy.stats import chisquare

    words = ["cat", "dog", "bird", "fish"]
    grammar = compiler.json_schema({"enum": words})
    tok = tiny_target.tokenizer
    prompt_ids = tuple(encode_chat(tok, [{"role": "user", "content": "An animal?"}]))
    by_word = _word_probs(tiny_target, prompt_ids, compiler, grammar)
    exact = [by_word.get(w, 0.0) for w in words]
    assert abs(sum(exact) - 1.0) < 0.01  # every way to write every answer
    drafter = ModelDrafter(tiny_draft, tiny_target)
    counts = dict.fromkeys(words, 0)
    samples = 300
    for seed in range(samples):
        request = GenerationRequest(prompt_ids=prompt_ids, max_new_tokens=12, grammar=grammar,
                                    sampling=SamplingParams(temperature=1.0, seed=seed))
        out, _ = _run(tiny_target, drafter, request, k=3)
        counts[json.loads(tok.decode(out, skip_special_tokens=True))] += 1
    expected = [p / sum(exact) * samples for p in exact]
    keep = [i for i, e in enumerate(expected) if e >= 5]
    observed = [counts[words[i]] for i in keep]
    scale = sum(observed) / sum(expected[i] for i in keep)
    assert chisquare(observed, [expected[i] * scale for i in keep]).pvalue > 1e-3


class _Skewed(BaseDrafter):
    """A sampled drafter far from the target: one token a round, either one the grammar
    forbids (cut before scoring, so the round keeps no draft at all) or one it allows."""

    name = "skewed"

    def __init__(self, vocab: int, forbidden: int, allowed: int, p_allowed: float) -> None:
        self.probs = torch.zeros(vocab)  # [vocab]
        self.probs[forbidden], self.probs[allowed] = 1.0 - p_allowed, p_allowed

    def begin(self, prompt_ids: Sequence[int]) -> None:
        return None

    def propose(self, state: Any, context: DraftContext, k: int) -> DraftProposal:
        assert isinstance(context.generator, torch.Generator)  # rejection sampling's
        token = int(torch.multinomial(self.probs, 1, generator=context.generator).item())
        return DraftProposal((token,), self.probs[None], (float(self.probs[token]),))

    def rollback(self, state: Any, length: int) -> None:
        pass

    def release(self, state: Any) -> None:
        pass


def test_constrained_rejection_sampling_with_a_cut_first_draft_token_is_exact(
        tiny_target: CausalLM, compiler: GrammarCompiler) -> None:
    """Rejection sampling (not keyed) where the grammar leaves the choice free: the
    prompt's pass gives the forced '"', and the next round's draft starts at the word.
    The drafter proposes the target's likeliest first token with its own probability p,
    else a forbidden token that is cut, and the round verifies an empty draft. The word
    must then come from the residual (never that token); drawn from the target instead,
    that token comes with probability p(2 - p), not p."""
    from scipy.stats import binomtest, chisquare

    grammar = compiler.json_schema({"enum": ["cat", "dog", "bird", "fish"]})
    tok = tiny_target.tokenizer
    prompt_ids = tuple(encode_chat(tok, [{"role": "user", "content": "An animal?"}]))
    quote = tok.encode('"')[0]
    matcher = grammar.matcher()
    assert matcher.allowed().nonzero().flatten().tolist() == [quote]
    assert matcher.advance([quote])
    allowed = matcher.allowed()  # [vocab]: the word's first token
    state = tiny_target.new_state()
    logits = tiny_target.prefill(state, [*prompt_ids, quote])  # [vocab]
    tiny_target.release(state)
    exact = logits.float().masked_fill(~allowed[: logits.shape[-1]], float("-inf")).softmax(-1)
    favoured = int(exact.argmax())
    forbidden = tok.encode("a")[0]
    assert not allowed[forbidden]
    drafter = _Skewed(tiny_target.vocab_size, forbidden, favoured, float(exact[favoured]))
    samples = 200
    counts: dict[int, int] = {}
    cut_first = 0
    for seed in range(samples):
        request = GenerationRequest(  # three tokens: the quote, then a draft and the next
            prompt_ids=prompt_ids, max_new_tokens=3, grammar=grammar,
            sampling=SamplingParams(temperature=1.0, seed=seed, keyed=False))
        out, events = _run(tiny_target, drafter, request, k=1)
        assert out[0] == quote and events[0].token_ids == (quote,)  # the prompt's pass
        counts[out[1]] = counts.get(out[1], 0) + 1
        cut_first += events[1].draft_tokens == 0
    assert samples // 2 < cut_first < samples  # the case under test happened, not always
    test = binomtest(counts.get(favoured, 0), samples, float(exact[favoured]))
    assert test.pvalue > 1e-3, (counts.get(favoured, 0), samples, float(exact[favoured]))
    big = [t for t in allowed.nonzero().flatten().tolist() if exact[t] * samples >= 5]
    observed = [counts.get(t, 0) for t in big]
    expected = [float(exact[t]) for t in big]
    expected = [e * sum(observed) / sum(expected) for e in expected]
    assert chisquare(observed, expected).pvalue > 1e-3, (counts, favoured)


def test_hostile_schemas_are_refused_in_bounded_time(compiler: GrammarCompiler) -> None:
    deep: dict[str, Any] = {"type": "string"}
    for _ in range(2000):
        deep = {"type": "array", "items": deep}
    hostile = [
        {"type": "string", "pattern": "(a|aa)*" * 60 + "[" },  # invalid regex
        {"type": "string", "pattern": "(" * 500 + "a" + ")*" * 500},
        {"enum": [f"value-{i}-" + "x" * 50 for i in range(20000)]},
        deep,
        {"type": "object", "properties": {"a": {"$ref": "#/definitions/missing"}}},
        {"type": "integer", "minimum": 5, "maximum": 1},
    ]
    for schema in hostile:
        start = time.monotonic()
        with pytest.raises(GrammarError):
            compiler.json_schema(schema)
        assert time.monotonic() - start < 20, schema  # bounded: no hang


def test_compiled_grammars_are_cached_and_bounded(tiny_target: CausalLM) -> None:
    compiler = GrammarCompiler(tiny_target.tokenizer, tiny_target.vocab_size, max_entries=3)
    first = compiler.json_schema({"type": "integer"})
    assert compiler.json_schema({"type": "integer"}) is first and compiler.hits == 1
    for i in range(5):
        compiler.json_schema({"type": "integer", "maximum": i})
    assert compiler.cached == 3
    matcher = first.matcher()  # an evicted grammar still works
    assert matcher.valid_prefix(list(tiny_target.tokenizer.encode("42"))) > 0
    assert not bool(matcher.allowed()[tiny_target.tokenizer.encode("a")[0]])


def test_masks_forbid_and_allow(tiny_target: CausalLM, compiler: GrammarCompiler) -> None:
    tok = tiny_target.tokenizer
    matcher = compiler.json_schema({"type": "boolean"}).matcher()
    allowed = matcher.allowed()
    assert allowed.dtype == torch.bool and allowed.shape[0] == tiny_target.vocab_size
    assert allowed[tok.encode("true")[0]] and not allowed[tok.encode("1")[0]]
    assert matcher.advance(tok.encode("true"))
    assert matcher.is_terminated() and matcher.allowed().nonzero().flatten().tolist() == [
        compiler.eos_id]
    matcher.rollback(len(tok.encode("true")))
    assert not matcher.is_terminated() and matcher.allowed()[tok.encode("false")[0]]


@pytest.mark.real_model
def test_default_model_constrained_speculation_is_plain_constrained(
        default_target: CausalLM) -> None:
    """The real model, its shipped draft's architecture stood in by the target itself and
    by lookup: constrained greedy output is token-identical to plain constrained."""
    compiler = GrammarCompiler(default_target.tokenizer, default_target.vocab_size)
    grammar = compiler.json_schema(PERSON)
    prompt = "Alice is 30, likes green, and her tags are a and b. Her record as JSON:"
    plain, _ = _run(default_target, None, _request(default_target, prompt, grammar,
                                                   max_new=40, enabled=False), k=None)
    for drafter in (None, NgramDrafter(),
                    CombinedDrafter([NgramDrafter()], ModelDrafter(default_target,
                                                                   default_target))):
        out, events = _run(default_target, drafter,
                           _request(default_target, prompt, grammar, max_new=40), k=None)
        assert out == plain
        assert sum(e.forced_accepted for e in events) > 0


class _Replay(BaseDrafter):
    """Drafts a known answer from wherever the sequence is in it (as the continuation
    cache does for a repeated request), its stop token included."""

    name = "replay"

    def __init__(self, prompt: Sequence[int], answer: Sequence[int]) -> None:
        self.full = [*prompt, *answer]

    def begin(self, prompt_ids: Sequence[int]) -> None:
        return None

    def propose(self, state: Any, context: DraftContext, k: int) -> DraftProposal:
        n = len(context.token_ids)
        if list(context.token_ids) != self.full[:n]:
            return DraftProposal.empty()
        return DraftProposal(tuple(self.full[n : n + k]))

    def rollback(self, state: Any, length: int) -> None:
        pass


@pytest.mark.real_model
def test_a_drafted_stop_token_after_the_grammar_completes(default_target: CausalLM) -> None:
    """A draft running past the end of the JSON into the stop token: the matcher takes
    no token once the grammar is complete, yet the round verifies the stop token like any
    other and the output is plain constrained decoding's."""
    compiler = GrammarCompiler(default_target.tokenizer, default_target.vocab_size)
    grammar = compiler.json_schema({"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
        "required": ["name", "age"], "additionalProperties": False})
    request = _request(default_target, "A person, as JSON.", grammar, max_new=60,
                       enabled=False)
    plain, events = _run(default_target, None, request, k=None)
    assert events[-1].finish_reason is FinishReason.STOP
    assert plain[-1] in default_target.eos_token_ids
    for k in (4, 16):  # the stop token inside a draft, or the whole answer in one round
        replay = _Replay(request.prompt_ids, plain)
        got, events = _run(default_target, replay, _request(default_target, "A person, as JSON.",
                                                             grammar, max_new=60), k=k)
        assert got == plain
        assert events[-1].finish_reason is FinishReason.STOP


def test_other_stop_tokens_end_the_answer_where_eos_may(tiny_target: CausalLM) -> None:
    """A chat model's end of turn ends a constrained answer wherever the grammar lets the
    tokenizer's end of sequence end it, and nowhere else."""
    eos = int(tiny_target.tokenizer.eos_token_id)
    end_of_turn = next(t for t in range(tiny_target.vocab_size) if t != eos)
    compiler = GrammarCompiler(tiny_target.tokenizer, tiny_target.vocab_size,
                               stop_ids=frozenset({end_of_turn}))
    matcher = compiler.matcher(compiler.json_schema({"type": "boolean"}))
    allowed = matcher.allowed()
    assert not allowed[eos] and not allowed[end_of_turn]  # nothing written yet
    assert matcher.advance(tiny_target.tokenizer.encode("true", add_special_tokens=False))
    allowed = matcher.allowed()
    assert allowed[eos] and allowed[end_of_turn] and int(allowed.sum()) == 2
