"""Grammar constraints as the speculative round sees them: which tokens may come next.

A ``Grammar`` is compiled once (a JSON schema, any JSON object, a Lark grammar) and
shared; each sequence gets its own ``Constraint`` (a matcher) from it, which advances over
committed and drafted tokens and rolls back rejected ones. These are the protocols; the
engine behind them (llguidance, and the compiler that caches its grammars) plugs in from
``grammars.guidance``, as the drafters plug in from ``drafters``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch


class Constraint(Protocol):
    """One sequence's position in a grammar."""

    def allowed(self) -> torch.Tensor:
        """The tokens allowed next. # [vocab] bool"""
        ...

    def advance(self, tokens: Sequence[int]) -> bool:
        """Consume ``tokens``; False (and nothing consumed past it) at a forbidden one."""
        ...

    def rollback(self, n: int) -> None:
        """Forget the last ``n`` consumed tokens."""
        ...

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of ``tokens`` the grammar allows in a row from here (nothing consumed)."""
        ...

    def is_terminated(self) -> bool:
        """The grammar is complete and allows nothing but EOS."""
        ...

    def forced(self) -> list[int]:
        """Tokens the grammar forces from here (keys, punctuation): free drafts."""
        ...


class Grammar(Protocol):
    """A compiled grammar; ``matcher()`` starts a sequence in it."""

    def matcher(self) -> Constraint: ...
