"""The batched runner: many sequences in one forward pass give each the logits it would
have had alone, whatever the mix of prompts, drafts and cache lengths."""

from __future__ import annotations

import random

import pytest
import torch

from drafters.ngram import NgramDrafter
from runtime.matrices import weights
from runtime.runner import layout
from runtime.runner.batched import BatchedLM, BatchedState
from runtime.runner.causal_lm import CausalLM, TransformersLM
from runtime.runner.layout import attention_blocks
from runtime.runner.memory import FileRows
from runtime.runner.passes import BLOCK, BatchItem, blocks_for
from tests.batching import (
    PROMPTS,
    _alone,
    _greedy,
    _ids,
    _serve,
    _tokens,
    check_alternatives,
)


def test_batched_forward_matches_each_sequence_alone(tiny_target: BatchedLM) -> None:
    """Ragged rows (different cached lengths, different numbers of new tokens, prompt
    chunks among decoding rounds) in one pass give the logits each would get alone."""
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 20000) for _ in range(n)] for n in (3, 17, 40, 1, 9)]
    # short additions (decoding rounds) share one attention block; long ones (prompt
    # chunks riding along) get their own
    news = [[rng.randrange(1000, 20000) for _ in range(n)] for n in (1, 40, 2, 9, 25)]
    alone = []
    for prompt, new in zip(prompts, news, strict=True):
        state = tiny_target.new_state()
        tiny_target.prefill(state, prompt)
        alone.append(tiny_target.score(state, new))
        tiny_target.release(state)
    states = [tiny_target.new_state() for _ in prompts]
    tiny_target.forward_batch([BatchItem(s, p, 1) for s, p in zip(states, prompts, strict=True)])
    got = tiny_target.forward_batch([BatchItem(s, n, len(n))
                                     for s, n in zip(states, news, strict=True)])
    for expected, logits, state, prompt, new in zip(alone, got, states, prompts, news,
                                                    strict=True):
        assert logits.shape == expected.shape
        torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
        assert state.length == len(prompt) + len(new)
    for state in states:
        tiny_target.release(state)


@pytest.mark.parametrize("news", [
    (1, 9, 1, 1, 1, 1),  # one stream verifying among one-token streams: a block apart
    (3, 1, 1, 3, 1, 5),  # a few short drafts spread over the rows: each alone
    (2, 2, 2, 2, 2, 2),  # every stream drafting alike: one block
    (1, 1, 4, 4, 4, 4),
])
@pytest.mark.parametrize("fold_single", [False, True])
def test_attention_blocks_give_the_model_s_own_logits(
        tiny_target: BatchedLM, tiny_reference: CausalLM, news: tuple[int, ...],
        fold_single: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """However a decoding pass's rows are split into attention blocks, and with the query
    heads of a multi-token row (on a GPU, of every row) folded onto their shared
    key/value heads, each row gets the logits the model's own (transformers) forward
    pass gives it."""
    monkeypatch.setattr(tiny_target.stack.attention, "_fold_single", fold_single)
    rng = random.Random(len(news) + sum(news))
    reference = tiny_reference
    prompts = [[rng.randrange(1000, 20000) for _ in range(n)] for n in (5, 30, 12, 60, 2, 21)]
    added = [[rng.randrange(1000, 20000) for _ in range(n)] for n in news]
    expected = []
    for prompt, new in zip(prompts, added, strict=True):
        state = reference.new_state()
        reference.prefill(state, prompt)
        expected.append(reference.score(state, new))
    states = [tiny_target.new_state() for _ in prompts]
    tiny_target.forward_batch([BatchItem(s, p, 1) for s, p in zip(states, prompts, strict=True)])
    items = [BatchItem(s, n, len(n)) for s, n in zip(states, added, strict=True)]
    got = tiny_target.forward_batch(items)
    for want, logits in zip(expected, got, strict=True):
        torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4)
    for state in states:
        tiny_target.release(state)


def test_attention_blocks_keep_one_token_rows_apart_from_a_long_draft() -> None:
    """The layout is chosen by the padded (query, key) pairs it computes."""
    def items(news: list[int], length: int = 300) -> list[BatchItem]:
        return [BatchItem(BatchedState(length=length), [1] * n, n)
                for i, n in enumerate(news)]

    everyone = list(range(8))
    # 8 rows x 9 queries in one block would be 4x the work of 8 + 9 in two
    assert attention_blocks(items([9] + [1] * 7)) == [list(range(1, 8)), [0]]
    # one block when every row adds the same: splitting would only add calls
    assert attention_blocks(items([2] * 8)) == [everyone]
    assert attention_blocks(items([1] * 8)) == [everyone]
    # short drafts spread over the rows: over a long context each alone rather than one
    # 8 x 5 block; over a short one the extra calls cost more than the padding
    spread = [3, 1, 1, 3, 1, 1, 1, 5]
    assert attention_blocks(items(spread, 800)) == [[1, 2, 4, 5, 6], [0], [3], [7]]
    assert attention_blocks(items(spread, 300)) == [everyone]
    assert attention_blocks([]) == []


def test_prompts_joining_together_share_a_block_where_calls_cost_more() -> None:
    """Prompt chunks are attended each alone on a CPU, where a call is cheap next to the
    padding; with a GPU's per-call cost several prompts joining in one pass share one
    block. A prompt chunk never shares a block with decoding rounds."""
    def item(row: int, length: int, n: int) -> BatchItem:
        return BatchItem(BatchedState(length=length), [1] * n, 1)

    joining = [item(0, 200, 1), item(1, 150, 1), item(2, 0, 90), item(3, 0, 40),
               item(4, 0, 60)]
    assert attention_blocks(joining) == [[0, 1], [2], [3], [4]]
    assert attention_blocks(joining, overhead=250_000) == [[0, 1], [2, 3, 4]]
    # a long prompt chunk and a short one: padding the short one to 500 costs more
    uneven = [item(0, 0, 500), item(1, 0, 20)]
    assert attention_blocks(uneven, overhead=10_000) == [[0], [1]]


def test_prompts_sharing_a_block_get_the_model_s_own_logits(
        tiny_target: BatchedLM, tiny_reference: CausalLM,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Prompts of different lengths prefilled in one padded block, beside decoding rows,
    give each the logits of the model's own (transformers) forward."""
    monkeypatch.setattr(layout, "BLOCK_OVERHEAD", 10**9)  # as if calls were dear
    rng = random.Random(7)
    reference = tiny_reference
    running = [[rng.randrange(1000, 20000) for _ in range(n)] for n in (14, 33)]
    joining = [[rng.randrange(1000, 20000) for _ in range(n)] for n in (50, 17, 29)]
    step = [rng.randrange(1000, 20000) for _ in running]
    expected = []
    for prompt, token in zip(running, step, strict=True):
        state = reference.new_state()
        reference.prefill(state, prompt)
        expected.append(reference.score(state, [token]))
    for prompt in joining:
        expected.append(reference.score(reference.new_state(), prompt)[-1:])
    states = [tiny_target.new_state() for _ in running]
    tiny_target.forward_batch([BatchItem(s, p, 1) for s, p in zip(states, running, strict=True)])
    items = [BatchItem(s, [t], 1) for s, t in zip(states, step, strict=True)]
    fresh = [tiny_target.new_state() for _ in joining]
    items += [BatchItem(s, p, 1) for s, p in zip(fresh, joining, strict=True)]
    assert attention_blocks(items, overhead=10**9) == [[0, 1], [2, 3, 4]]
    got = tiny_target.forward_batch(items)
    for want, logits in zip(expected, got, strict=True):
        torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4)
    for state in states + fresh:
        tiny_target.release(state)


@pytest.mark.parametrize("kernels", ["native", "torch"])
def test_a_pass_gives_final_hidden_states_and_starts_from_given_rows(
        tiny_target_dir: object, kernels: str) -> None:
    """``BatchItem.features``: each new token's final hidden state, which the output head
    turns into exactly the pass's logits; ``BatchItem.inputs``: rows in place of the
    tokens' embeddings, here the embeddings themselves (the same logits) and other rows
    (other logits), beside a sequence that embeds its tokens as usual."""
    target = BatchedLM.load(str(tiny_target_dir), kernels=kernels)
    assert target.capabilities.features
    ids, other = [5, 9, 300, 41, 7], [11, 12, 13]
    a, b = target.new_state(), target.new_state()
    prepared = target.prepare_pass([BatchItem(a, ids, len(ids), features=True),
                                    BatchItem(b, other, 1)])
    logits = target.run_pass(prepared)
    features, none = prepared.features
    assert none is None and features is not None
    assert features.shape == (len(ids), target.hidden_size)
    assert torch.equal(target._logits(features), logits[0])
    rows = target.model.model.embed_tokens(torch.tensor(ids)).to(target.dtype)
    c, d = target.new_state(), target.new_state()
    same = target.forward_batch([BatchItem(c, ids, len(ids), inputs=rows.clone()),
                                 BatchItem(b, [14], 1)])
    assert torch.equal(same[0], logits[0])  # batch invariance: bitwise
    moved = target.forward_batch([BatchItem(d, ids, len(ids), inputs=rows * 2)])
    assert not torch.allclose(moved[0], logits[0], atol=1e-2)
    with pytest.raises(ValueError, match="input rows"):
        target.forward_batch([BatchItem(target.new_state(), ids, 1, inputs=rows[:2])])
    for state in (a, b, c, d):
        target.release(state)


def test_captured_layers_are_the_model_s_hidden_states_and_change_no_logit(
        tiny_target_dir: object) -> None:
    """``capture_layers``: each asked-for layer's output is the model's own hidden state
    after that layer (transformers' ``hidden_states``), the same whether a sequence comes
    in one pass or in steps, and the logits stay bitwise what they are without it."""
    target = BatchedLM.load(str(tiny_target_dir), kernels="native")
    last = len(target.model.model.layers) - 1
    ids = [(7 * i + 3) % 400 + 5 for i in range(40)]

    def run(pieces: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        state = target.new_state()
        logits, feats, layers = [], [], []
        for piece in pieces:
            prepared = target.prepare_pass([BatchItem(state, piece, len(piece), features=True)])
            logits += target.run_pass(prepared)
            feats.append(prepared.features[0])
            layers.append(prepared.layers[0] if prepared.layers else None)
        target.release(state)
        return (torch.cat(logits), torch.cat(feats),
                None if layers[0] is None else torch.cat(layers))

    plain_logits, plain_feats, none = run([ids])
    assert none is None
    target.capture_layers((0, last))
    whole = run([ids])
    steps = run([ids[i:i + 3] for i in range(0, len(ids), 3)])
    assert torch.equal(whole[0], plain_logits) and torch.equal(whole[1], plain_feats)
    assert whole[2] is not None and steps[2] is not None
    assert whole[2].shape == (len(ids), 2 * target.hidden_size)
    assert torch.equal(steps[2], whole[2]) and torch.equal(steps[0], whole[0])
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(str(tiny_target_dir),
                                                     dtype=torch.float32)
    with torch.no_grad():
        states = reference(torch.tensor([ids]), output_hidden_states=True).hidden_states
    h = target.hidden_size
    torch.testing.assert_close(whole[2][:, :h], states[1][0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(target.model.model.norm(whole[2][:, h:]), whole[1],
                               rtol=1e-4, atol=1e-4)
    assert not torch.allclose(whole[2][:, :h], whole[2][:, h:], atol=1e-2)
    target.capture_layers(())
    assert torch.equal(run([ids])[0], plain_logits)
    with pytest.raises(ValueError, match="captured layers"):
        target.capture_layers((last + 1,))


def test_release_keeps_the_other_sequences_intact(tiny_target: BatchedLM) -> None:
    """Freeing a sequence's blocks leaves the others' as they were: a sequence still
    running continues exactly as before, and a new one takes the freed blocks."""
    ids = list(_ids(tiny_target, "one two three four five six seven"))
    first = tiny_target.new_state()
    middle = tiny_target.new_state()
    last = tiny_target.new_state()
    for state in (first, middle, last):
        tiny_target.prefill(state, ids)
    expected = tiny_target.score(last, [42])
    tiny_target.rollback(last, len(ids))
    freed = list(middle.blocks)
    tiny_target.release(middle)
    assert middle.blocks == [] and middle.length == 0
    again = tiny_target.new_state()
    tiny_target.prefill(again, [7] * len(ids))
    assert set(again.blocks) & set(freed)  # the freed blocks are handed out again
    torch.testing.assert_close(tiny_target.score(last, [42]), expected)
    for state in (first, last, again):
        tiny_target.release(state)
    tiny_target.release(last)  # idempotent
    assert tiny_target.rows_in_use == 0
    assert tiny_target.kv_usage().used == 0


def test_the_pool_grows_past_its_first_size(tiny_long_target: BatchedLM) -> None:
    target = tiny_long_target
    first = target.kv_blocks.size
    states = [target.new_state() for _ in range(9)]
    long_prompt = list(range(1000, 1000 + first * BLOCK + 30))  # more than the pool held
    target.prefill(states[0], long_prompt)
    assert target.kv_blocks.size >= blocks_for(len(long_prompt))
    assert len(states[0].blocks) == blocks_for(len(long_prompt))
    expected = target.score(states[0], [5])
    target.rollback(states[0], len(long_prompt))
    for state in states[1:]:
        target.release(state)  # the sequence still running keeps its cache
    torch.testing.assert_close(target.score(states[0], [5]), expected)
    target.release(states[0])
    assert target.kv_blocks.size == first  # idle: the pools shrank back


def test_the_stack_holds_the_pools_as_they_are_made_anew(
        tiny_long_target: BatchedLM) -> None:
    """The layer paths read the KV pools through ``BatchedLM.stack``, one object for
    the runner's life: when the runner makes them anew (more blocks, back to their first
    size when idle), the stack holds the new ones, and a pass writes there."""
    target = tiny_long_target
    stack = target.stack
    first = stack.keys[0]
    states = [target.new_state() for _ in range(3)]
    prompt = list(range(1000, 1000 + target.kv_blocks.size * BLOCK + 30))
    target.prefill(states[2], prompt)
    assert target.stack is stack and stack.keys[0] is not first
    assert len(stack.keys) == len(stack.values) == len(stack.weights) == len(stack.layers)
    for pool in (*stack.keys, *stack.values):
        assert pool.shape[0] == target.kv_blocks.size + 1 and pool.shape[2] == BLOCK
    n = len(prompt)
    for (keys, values), k, v in zip(target.kv(states[2]), stack.keys, stack.values,
                                    strict=True):
        last = states[2].blocks[-1]
        assert torch.equal(keys[0, :, n - 1], k[last, :, (n - 1) % BLOCK])
        assert torch.equal(values[0, :, n - 1], v[last, :, (n - 1) % BLOCK])
        assert keys.abs().sum() > 0 and values.abs().sum() > 0
    for state in states:
        target.release(state)
    assert stack.keys[0].shape[0] * BLOCK < n  # idle: smaller ones
    state = target.new_state()
    target.prefill(state, [5, 6, 7])
    assert all(k[state.blocks[0], :, :3].abs().sum() > 0 for k in stack.keys)
    target.release(state)


def test_kv_round_trip(tiny_target: BatchedLM) -> None:
    ids = list(_ids(tiny_target, "prefix caching stores these keys and values"))
    state = tiny_target.new_state()
    tiny_target.prefill(state, ids)
    saved = [(k.clone(), v.clone()) for k, v in tiny_target.kv(state)]
    expected = tiny_target.score(state, [7])
    other = tiny_target.new_state()
    tiny_target.load_kv(other, saved)
    torch.testing.assert_close(tiny_target.score(other, [7]), expected)
    tiny_target.release(state)
    tiny_target.release(other)


def test_an_alternative_sees_only_what_precedes_the_token_it_stands_in_for(
        tiny_target: BatchedLM, tiny_reference: CausalLM) -> None:
    """A row verifying drafts plus an alternative for its first draft, among other rows:
    the drafts' logits are those of the chain alone, the alternative's those it would
    get as the next token; once adopted, the cache continues as if it had been fed."""
    rng = random.Random(5)
    prompts = [[rng.randrange(1000, 20000) for _ in range(n)] for n in (7, 23, 3)]
    added = [[rng.randrange(1000, 20000) for _ in range(n)] for n in (4, 1, 3)]
    alternative = [True, False, True]  # the last token of those rows is an alternative
    later = [rng.randrange(1000, 20000) for _ in range(3)]
    check_alternatives(tiny_target, tiny_reference, prompts, added, alternative, later)
    plain = tiny_reference
    assert not plain.capabilities.branches
    with pytest.raises(ValueError, match="token trees"):
        plain.forward_batch([BatchItem(plain.new_state(), [1, 2, 3], 3, alternative=True)])


@pytest.mark.gpu
def test_batched_greedy_on_cuda_matches_each_sequence_alone(tiny_target_dir: object) -> None:
    """The same identity on a GPU, float32: several streams sharing forward passes in the
    engine produce what each produces alone."""
    target = BatchedLM.load(str(tiny_target_dir), dtype="float32", device="cuda")
    assert target.capabilities.batched
    requests = _greedy(target, PROMPTS, 24)
    results = _serve(target, {"ngram": NgramDrafter()}, requests)
    for request, events in zip(requests, results, strict=True):
        assert _tokens(events) == _alone(target, NgramDrafter(), request)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("packed", [True, False])
def test_weight_products_match_the_plain_product_on_every_path(
        dtype: torch.dtype, packed: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Packed for oneDNN (a CPU that has it) or not, for a step, a verify pass, a batch and a
    prefill chunk, with and without a bias: the plain ``x @ w.T + b``, to rounding."""
    if packed and dtype not in weights.onednn_dtypes():
        pytest.skip(f"this PyTorch build's oneDNN does not pack {dtype}")
    if not packed:
        monkeypatch.setattr(weights, "onednn_dtypes", frozenset)
    torch.manual_seed(0)
    rows = torch.randn(96, 64).to(dtype)
    bias = torch.randn(96).to(dtype)
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    for b in (None, bias):
        matrix = weights.Matrix(rows, b)
        assert (matrix.packed is not None) == packed
        for tokens in (1, 2, 5, weights.ONEDNN_MAX_TOKENS, weights.ONEDNN_MAX_TOKENS + 8):
            x = torch.randn(tokens, 64).to(dtype)
            want = x.float() @ rows.float().t() + (0 if b is None else b.float())
            got = matrix(x)
            assert got.dtype == dtype and got.shape == (tokens, 96)
            torch.testing.assert_close(got.float(), want, atol=tolerance * 8, rtol=tolerance)


@pytest.mark.parametrize("kernels", ["auto", "torch"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_releasing_the_plain_weights_keeps_every_logit(tiny_target_dir: object,
                                                      dtype: str, kernels: str) -> None:
    """A server keeps only what the products read (the native kernels' packing, or
    oneDNN's with ``--kernels torch``): the packed matrices' plain rows and
    the modules' views of them go (their bytes counted once), the tied head's input
    embedding reads its rows from the weights file instead of holding the table, the rest
    of the model is copied out of the file's mapping, and every pass gives the logits it
    gave before."""
    from pathlib import Path

    target = BatchedLM.load(str(Path(str(tiny_target_dir))), dtype=dtype, kernels=kernels)
    ids = [random.Random(0).randrange(target.vocab_size) for _ in range(40)]

    def logits() -> list[torch.Tensor]:
        a, b = target.new_state(), target.new_state()
        try:
            out = [target.score(a, ids)]
            out += target.forward_batch([BatchItem(a, ids[:3], 3), BatchItem(b, ids[5:6], 1)])
            return out
        finally:
            target.release(a)
            target.release(b)

    before = logits()
    mats = [m for w in target.stack.weights for m in (w.qkv, w.o, w.gate_up, w.down)]
    packed = [m for m in mats
              if isinstance(m, weights.Matrix) and (m.runs_native or m.packed is not None)]
    if not packed:
        pytest.skip("nothing packs a float matrix here (no native kernels; this PyTorch "
                    "build has no oneDNN for this dtype)")
    assert all(m.runs_native == (kernels == "auto") for m in packed)
    embed = target.model.model.embed_tokens
    table = embed.weight.detach().clone()
    stack = target.stack.layer_stack
    released = target.release_plain_weights()
    remade = target.stack.layer_stack
    assert (remade is None) == (stack is None) and (stack is None or remade
                                                    is not stack)  # made anew
    assert released == sum(m.nbytes for m in packed) + table.nbytes
    assert all(m.rows is None for m in packed)
    layer = target.model.model.layers[0]
    assert layer.self_attn.q_proj.weight.device.type == "meta"
    assert layer.mlp.down_proj.weight.device.type == "meta"
    assert target.model.lm_head.weight.device.type == "meta"
    assert embed.weight.numel() == 0 and embed.weight.dtype == table.dtype
    if kernels == "auto":  # the tied head's native packing holds the table's rows
        assert embed.rows == target.stack.head.take
    else:
        assert isinstance(embed.rows, FileRows) and embed.rows.dtype == torch.float32  # the file's
    every = torch.arange(target.vocab_size)
    assert torch.equal(embed(every), table)
    after = logits()
    assert all(torch.equal(x, y) for x, y in zip(before, after, strict=True))
    assert target.release_plain_weights() == 0  # once


@pytest.mark.parametrize(("config_name", "says"), [
    ("Gemma2Config", "soft-caps"), ("PhiConfig", "LayerNorm"), ("GemmaConfig", "1 + weight")])
def test_a_family_the_batched_runner_lacks_is_named_with_what_it_needs(
        config_name: str, says: str, caplog: pytest.LogCaptureFixture) -> None:
    """Such a model runs one sequence per pass, and the one-line reason says what its
    layers do that the batched ones do not."""
    import types

    import transformers
    from transformers import AutoModelForCausalLM

    from runtime.models.families import supports

    config = getattr(transformers, config_name)(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=256, pad_token_id=0)
    model = AutoModelForCausalLM.from_config(config)
    reason = supports(model)
    assert reason is not None and f"model type {config.model_type!r}" in reason
    assert says in reason and "\n" not in reason
    tokenizer = types.SimpleNamespace(eos_token_id=None)  # the runner reads no more of it
    with caplog.at_level("WARNING"):
        runner = BatchedLM.wrap(model, tokenizer, name="tiny")
    assert type(runner) is TransformersLM
    assert reason in caplog.text
    ids = [1, 5, 9, 3]
    state = runner.new_state()
    got = runner.forward_batch([BatchItem(state, ids, len(ids))])[0]
    want = model(torch.tensor([ids])).logits[0]
    assert torch.allclose(got, want, atol=1e-5)


def test_a_layout_knows_its_largest_position_and_the_rotary_rows_agree(
        tiny_target: BatchedLM) -> None:
    """``Layout.positions_end`` is one past the largest position, an alternative's
    included, and the rotary rows looked up with it are the rows read from the tensor."""
    a, b = tiny_target.new_state(), tiny_target.new_state()
    try:
        tiny_target.forward_batch([BatchItem(a, list(range(5, 25)), 1),
                                   BatchItem(b, list(range(5, 9)), 1)])
        items = [BatchItem(a, [7, 8, 9], 3, alternative=True), BatchItem(b, [6, 5], 2)]
        batch = layout.Layout.build(items, tiny_target.device, native=True)
        assert batch.positions_end == int(batch.positions.max()) + 1 == 22  # 20, 21, 21
        hidden = torch.zeros(len(batch.positions), 1, dtype=tiny_target.dtype)
        rotary = tiny_target.stack.rotary
        for got, want in zip(rotary(hidden, batch.positions, batch.positions_end),
                             rotary(hidden, batch.positions), strict=True):
            assert torch.equal(got, want)
    finally:
        tiny_target.release(a)
        tiny_target.release(b)
