"""The grammar engine behind ``decoding.constraints``: llguidance (see
docs/structured-outputs.md for why), imported lazily. ``GrammarCompiler`` builds grammars
for one tokenizer and keeps the compiled ones in a cache bounded in entries and in source
bytes; each sequence's matcher is a ``GuidanceConstraint``.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch

from decoding.constraints import Constraint

if TYPE_CHECKING:
    from types import ModuleType

    from llguidance import LLMatcher, LLParserLimits, LLTokenizer
    from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

MAX_CACHED_GRAMMARS = 128
MAX_CACHED_BYTES = 32 << 20  # grammar source kept in the cache, all entries together
MAX_SCHEMA_BYTES = 256 << 10  # a larger schema is refused before compiling
# The engine's own resource limits: work per mask and per grammar stay bounded, so a
# pathological schema fails (a clear error) instead of stalling the model thread.
LEXER_FUEL = 1_000_000
STEP_LEXER_FUEL = 200_000
STEP_MAX_ITEMS = 50_000
MAX_LEXER_STATES = 50_000
MAX_GRAMMAR_SIZE = 200_000


class GrammarError(ValueError):
    """A grammar that cannot be compiled or is too costly; the message names why."""


@dataclass(frozen=True)
class CompiledGrammar:
    """A compiled grammar (``decoding.constraints.Grammar``); ``matcher()`` starts a
    sequence in it."""

    key: str  # what it was compiled from, canonical
    source: str  # the engine's grammar text
    compiler: GrammarCompiler

    def matcher(self) -> Constraint:
        return self.compiler.matcher(self)


class GuidanceConstraint:
    """``Constraint`` on an llguidance matcher."""

    def __init__(self, matcher: LLMatcher, vocab_size: int, eos_id: int,
                 stop_ids: frozenset[int] = frozenset()) -> None:
        self._m = matcher
        self.vocab_size = vocab_size
        self.eos_id = eos_id
        # every token that ends the answer where the grammar lets it end (a chat model's
        # end of turn, not only the tokenizer's end of sequence)
        self.stop_ids = [t for t in sorted(stop_ids | {eos_id}) if 0 <= t < vocab_size]

    def allowed(self) -> torch.Tensor:  # [vocab] bool
        mask = torch.zeros(self.vocab_size, dtype=torch.bool)
        if self._m.is_stopped() or self._m.is_error():
            mask[self.stop_ids] = True
            return mask
        bias = torch.frombuffer(bytearray(self._m.compute_logit_bias()), dtype=torch.uint8)
        n = min(self.vocab_size, bias.numel())
        mask[:n] = bias[:n] != 0
        if self._m.is_error() or not bool(mask.any()):  # ran out of fuel: end the answer
            mask.zero_()
            mask[self.stop_ids] = True
        elif mask[self.eos_id]:
            mask[self.stop_ids] = True
        return mask

    def advance(self, tokens: Sequence[int]) -> bool:
        # A forbidden token would put the matcher in an error state for good: check first.
        valid = self.valid_prefix(tokens)
        if valid and not self._m.consume_tokens([int(t) for t in tokens[:valid]]):
            raise RuntimeError(f"the grammar matcher failed: {_short(self._m.get_error())}")
        return valid == len(tokens)

    def rollback(self, n: int) -> None:
        if n > 0 and not self._m.rollback(n):
            raise RuntimeError(f"the grammar matcher cannot roll back: {self._m.get_error()}")

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        if not tokens:
            return 0
        return int(self._m.validate_tokens([int(t) for t in tokens]))

    def is_terminated(self) -> bool:
        return bool(self._m.is_stopped())

    def forced(self) -> list[int]:
        if self._m.is_stopped() or self._m.is_error():
            return []
        return [int(t) for t in self._m.compute_ff_tokens()]


class GrammarCompiler:
    """Compiles grammars for one tokenizer and caches them (thread-safe)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int,
                 eos_id: int | None = None,
                 max_entries: int = MAX_CACHED_GRAMMARS,
                 max_bytes: int = MAX_CACHED_BYTES,
                 stop_ids: frozenset[int] = frozenset()) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_id = int(tokenizer.eos_token_id if eos_id is None else eos_id)
        self.stop_ids = stop_ids  # the model's other end-of-answer tokens
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._engine_tokenizer: LLTokenizer | None = None
        self._cache: OrderedDict[str, tuple[CompiledGrammar, LLMatcher]] = OrderedDict()
        self._bytes = 0
        self.hits = 0
        self.misses = 0

    # -- building grammars ------------------------------------------------------------

    def json_schema(self, schema: object) -> CompiledGrammar:
        """A grammar for JSON values matching ``schema`` (compact, no extra whitespace)."""
        if not isinstance(schema, dict):
            raise GrammarError("the JSON schema must be an object")
        text = _canonical(schema)
        key = "schema:" + text
        return self._cached(key, lambda: self._from_schema(text))

    def json_object(self) -> CompiledGrammar:
        """Any JSON object."""
        return self.json_schema({"type": "object"})

    def lark(self, grammar: str) -> CompiledGrammar:
        """A grammar in llguidance's Lark dialect (the tool-call grammars use it)."""
        if len(grammar.encode()) > MAX_SCHEMA_BYTES:
            raise GrammarError(f"the grammar is larger than {MAX_SCHEMA_BYTES} bytes")
        llg = _llguidance()
        return self._cached("lark:" + grammar, lambda: llg.LLMatcher.grammar_from_lark(grammar))

    def _from_schema(self, text: str) -> str:
        if len(text.encode()) > MAX_SCHEMA_BYTES:
            raise GrammarError(f"the JSON schema is larger than {MAX_SCHEMA_BYTES} bytes")
        llg = _llguidance()
        try:
            return str(llg.LLMatcher.grammar_from_json_schema(
                text, defaults={"whitespace_flexible": False}))
        except ValueError as exc:
            raise GrammarError(f"invalid JSON schema: {exc}") from exc

    # -- matching ---------------------------------------------------------------------

    def matcher(self, grammar: CompiledGrammar) -> GuidanceConstraint:
        with self._lock:
            entry = self._cache.get(grammar.key)
        template = entry[1] if entry is not None else self._compile(grammar.source)
        return GuidanceConstraint(template.deep_copy(), self.vocab_size, self.eos_id,
                                  self.stop_ids)

    def _cached(self, key: str, source: Callable[[], str]) -> CompiledGrammar:
        with self._lock:
            entry = self._cache.get(key)
            if entry is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return entry[0]
            self.misses += 1
        text = source()
        template = self._compile(text)
        grammar = CompiledGrammar(key=key, source=text, compiler=self)
        with self._lock:
            if key not in self._cache:
                self._cache[key] = (grammar, template)
                self._bytes += len(key) + len(text)
            while self._cache and (len(self._cache) > self.max_entries
                                   or self._bytes > self.max_bytes):
                old_key, (old, _) = self._cache.popitem(last=False)
                self._bytes -= len(old_key) + len(old.source)
        return grammar

    def _compile(self, source: str) -> LLMatcher:
        """A matcher at the grammar's start, with its first mask computed (so a grammar
        whose lexer blows up fails here, not on the model thread)."""
        llg = _llguidance()
        matcher = llg.LLMatcher(self._tokenizer(), source, log_level=0, limits=_limits(llg))
        if matcher.is_error():
            raise GrammarError(_short(matcher.get_error()))
        matcher.compute_logit_bias()
        if matcher.is_error():
            raise GrammarError(_short(matcher.get_error()))
        return matcher

    def prepare(self) -> None:
        """Build the tokenizer's table for the matcher, once (seconds for a large
        vocabulary; separate, so that a compile's time limit does not count it)."""
        self._tokenizer()

    def _tokenizer(self) -> LLTokenizer:
        with self._lock:
            if self._engine_tokenizer is None:
                import llguidance.hf

                self._engine_tokenizer = llguidance.hf.from_tokenizer(
                    cast("PreTrainedTokenizerFast", self.tokenizer), n_vocab=self.vocab_size,
                    eos_token=self.eos_id)
            return self._engine_tokenizer

    @property
    def cached(self) -> int:
        return len(self._cache)


def _llguidance() -> ModuleType:
    try:
        import llguidance
    except ImportError as exc:  # pragma: no cover - a dependency of the package
        raise GrammarError("structured outputs need the 'llguidance' package") from exc
    return llguidance


def _limits(llg: ModuleType) -> LLParserLimits:
    return llg.LLParserLimits(
        initial_lexer_fuel=LEXER_FUEL, step_lexer_fuel=STEP_LEXER_FUEL,
        step_max_items=STEP_MAX_ITEMS, max_lexer_states=MAX_LEXER_STATES,
        max_grammar_size=MAX_GRAMMAR_SIZE)


def _canonical(schema: Mapping[str, object]) -> str:
    try:
        return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
    except (TypeError, ValueError, RecursionError) as exc:
        raise GrammarError(f"the JSON schema cannot be serialised: {exc}") from exc


def _short(message: str, limit: int = 300) -> str:
    """The engine's error without its dump of the grammar."""
    first = message.split("<state>")[0].split("<grammar>")[0].strip()
    return first if len(first) <= limit else first[: limit - 3] + "..."
