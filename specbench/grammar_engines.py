"""llguidance vs xgrammar on this tokenizer: build, compile, mask time per token and
rollback, over one schema-heavy JSON answer. xgrammar is not a dependency: install it
(``pip install xgrammar apache-tvm-ffi --no-deps``) to include it. Prints a table:

    python -m specbench.grammar_engines [--target default] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

from specbench.structured import SCHEMA

ANSWER = {"name": "Ada Lovelace", "email": "ada@example.com", "age": 36,
          "address": {"street": "12 St James's Square", "city": "London",
                      "country": "United Kingdom"},
          "status": "active", "skills": [{"skill_name": "mathematics", "skill_level": "expert"},
                                         {"skill_name": "poetry",
                                          "skill_level": "intermediate"}]}


def _llguidance(tok: Any, ids: list[int]) -> dict[str, float]:
    import llguidance
    import llguidance.hf

    start = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tok)
    built = time.perf_counter() - start
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        json.dumps(SCHEMA), defaults={"whitespace_flexible": False})
    start = time.perf_counter()
    matcher = llguidance.LLMatcher(lltok, grammar)
    compiled = time.perf_counter() - start
    masks = []
    for token in ids:
        start = time.perf_counter()
        matcher.compute_logit_bias()
        masks.append(time.perf_counter() - start)
        assert matcher.consume_token(token), matcher.get_error()
    rollback = matcher.rollback(5)
    return {"build_s": built, "compile_s": compiled, "first_mask_s": masks[0],
            "mask_s": sum(masks[1:]) / (len(masks) - 1), "rollback": float(bool(rollback))}


def _xgrammar(tok: Any, ids: list[int]) -> dict[str, float] | None:
    try:
        import xgrammar as xgr
    except ImportError:
        return None
    start = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok))
    compiler = xgr.GrammarCompiler(info)
    built = time.perf_counter() - start
    start = time.perf_counter()
    compiled_grammar = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False,
                                                    separators=(",", ":"))
    compiled = time.perf_counter() - start
    matcher = xgr.GrammarMatcher(compiled_grammar)
    bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)
    masks = []
    for token in ids:
        start = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask, 0)
        masks.append(time.perf_counter() - start)
        assert matcher.accept_token(token)
    matcher.rollback(5)
    return {"build_s": built, "compile_s": compiled, "first_mask_s": masks[0],
            "mask_s": sum(masks[1:]) / (len(masks) - 1), "rollback": 1.0}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default="default")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    from runtime.files import model_store

    tok = AutoTokenizer.from_pretrained(model_store.resolve(args.target))
    text = json.dumps(ANSWER, separators=(",", ":"))
    ids = [*tok.encode(text, add_special_tokens=False), tok.eos_token_id]
    sys.stdout.write(f"vocabulary {len(tok)}, answer {len(ids)} tokens\n")
    sys.stdout.write(f"{'engine':<11} {'build s':>8} {'compile ms':>10} {'1st mask ms':>11} "
                     f"{'mask us/token':>13} rollback\n")
    for _ in range(args.repeat):
        for name, result in (("llguidance", _llguidance(tok, ids)),
                             ("xgrammar", _xgrammar(tok, ids))):
            if result is None:
                continue
            sys.stdout.write(
                f"{name:<11} {result['build_s']:8.2f} {1e3 * result['compile_s']:10.2f} "
                f"{1e3 * result['first_mask_s']:11.2f} {1e6 * result['mask_s']:13.1f} "
                f"{'yes' if result['rollback'] else 'no'}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
