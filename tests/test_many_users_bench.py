"""The many-users benchmark's accounting, without servers: how each server's chunks are
counted, which rounds run, and the ratios of its table."""

from __future__ import annotations

from specbench.many_users import Round, Stream, plan_rounds, ratios, server_count, take


def test_each_server_s_own_count_is_read() -> None:
    assert server_count({"timings": {"predicted_n": 7}}) == (7, "timings.predicted_n")
    assert server_count({"speculation": {"round": 3, "rounds": 4, "accepted_tokens": 5}}) == (
        9, "speculation")
    assert server_count({"usage": {"completion_tokens": 12}}) == (12, "usage")
    assert server_count({"choices": []}) == (None, "chunks")


def test_a_stream_counts_a_round_s_tokens_not_its_chunks() -> None:
    stream = Stream(sent=0.0)
    take(stream, {"choices": [{"delta": {"content": "a"}}],
                  "speculation": {"round": 0, "rounds": 1, "accepted_tokens": 0}}, 1.0)
    take(stream, {"choices": [{"delta": {"content": "bcd"}}],
                  "speculation": {"round": 1, "rounds": 2, "accepted_tokens": 2}}, 2.0)
    assert stream.tokens == 4 and stream.counted_by == "speculation"
    assert stream.ttft_s == 1.0 and stream.tokens_per_s == 3.0
    plain = Stream(sent=0.0)
    for t in (1.0, 1.5, 2.0):
        take(plain, {"choices": [{"delta": {"content": "x"}}]}, t)
    take(plain, {"choices": [{"delta": {}, "finish_reason": "stop"}]}, 2.5)
    assert plain.tokens == 3 and plain.finish == "stop" and plain.tokens_per_s == 2.0


def test_the_busy_round_is_added_where_the_streams_lack_it() -> None:
    assert plan_rounds([1, 4], busy=7, probes=5) == [
        Round(1, True, False), Round(4, True, False), Round(8, False, True)]
    assert plan_rounds([8], busy=7, probes=5) == [Round(8, True, True)]
    assert plan_rounds([2], busy=7, probes=0) == [Round(2, True, False)]


def test_ratios_are_per_n_and_absent_where_a_server_failed() -> None:
    records = [{"n": 4, "server": "llama-server", "throughput": {"tokens_per_s": 20.0}},
               {"n": 4, "server": "specserve-none", "throughput": {"tokens_per_s": 30.0}},
               {"n": 4, "server": "specserve", "throughput": {"tokens_per_s": 40.0}},
               {"n": 8, "server": "specserve", "throughput": {"tokens_per_s": 50.0}},
               {"n": 8, "server": "llama-server", "failure": "it crashed"}]
    four, eight = ratios(records)
    assert four["specserve/llama-server"] == 2.0 and four["specserve/specserve-none"] == 1.333
    assert eight["n"] == 8 and eight["specserve/llama-server"] is None
