"""The load test's summary: medians over rounds, each ratio taken within one round."""

from specdec.server.loadtest import LevelResult, summarize


def _level(mode, c, tokens, wall, texts):
    return LevelResult(mode, c, len(texts), tokens, wall, 1.0, dict(enumerate(texts)))


def test_summary_takes_ratios_within_rounds_and_medians_over_them():
    # Round 2 ran on a slower machine throughout: its own ratios are what round 1's are, so the
    # medians of the ratios stay put while the medians of tokens/s move.
    results = {}
    for r, slow in enumerate((1.0, 2.0, 1.0)):
        results[r, 1, "plain"] = _level("plain", 1, 100, 2.0 * slow, ["a", "b"])
        results[r, 1, "spec"] = _level("spec", 1, 100, 1.0 * slow, ["a", "b"])
        results[r, 16, "plain"] = _level("plain", 16, 100, 0.4 * slow, ["a", "b"])
        results[r, 16, "spec"] = _level("spec", 16, 100, 0.5 * slow, ["a", "b" if r != 1 else "x"])
    rows = summarize(results, [1, 16], 3)
    assert [row["concurrency"] for row in rows] == [1, 16]
    one, sixteen = rows
    assert one["plain_tokens_per_s"] == 50.0 and one["plain_scaling"] == 1.0 and one["speedup"] == 2.0
    assert sixteen["plain_tokens_per_s"] == 250.0 and sixteen["plain_rounds"] == [250.0, 125.0, 250.0]
    assert sixteen["plain_scaling"] == 5.0 and sixteen["speedup"] == 0.8
    assert one["outputs_differ"] == 0 and sixteen["outputs_differ"] == 1  # request 1 of round 2
