"""The stream profile's arithmetic: per-token parts from the server's timers."""

from __future__ import annotations

import argparse

from specbench.stream_profile import format_table, summarise


def test_the_parts_of_a_token_add_up_to_its_time() -> None:
    seconds = {"round": 0.9, "layers": 0.5, "head": 0.2, "hand_over": 0.05,
               "prefill_round": 0.1, "chunk": 0.01, "chunk_json": 0.02, "metrics": 0.01,
               "loop_idle": 0.8}
    args = argparse.Namespace(serve=["--draft", "none"], prompt_set="chat", prompts=1,
                              max_tokens=100)
    report = summarise({"seconds": seconds, "calls": {}, "window_s": 1.0}, 100, [0.009], args)
    model, loop = report["model_thread"], report["event_loop"]
    assert report["ms_per_token"] == 10.0
    assert round(sum(model.values()), 9) == 10.0  # every part of the window, once
    assert round(sum(loop.values()), 9) == 10.0
    assert round(model["rest of the round (Python)"], 9) == 0.5  # 9 - 5 - 2 - 0.5 - 1
    assert round(loop["SSE, ASGI server, asyncio"], 9) == 1.6  # 2 busy - 0.3 - 0.1
    assert "hand-over to the event loop" in format_table(report)
