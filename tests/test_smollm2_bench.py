"""The real-model speculation benchmark's summary (bench/smollm2.py): ratios to the right plain arm, exactness
counted token for token, beam steps per target pass summed over prompts (not averaged per prompt)."""
from bench.smollm2 import summarize


def row(tokens, tps, passes=None, steps=None):
    r = {"tokens": tokens, "generated": len(tokens), "seconds": 1.0, "tokens_per_second": tps}
    if passes is not None:
        r.update(target_passes=passes, beam_steps=steps, plain_passes=0, draft_accepted=0, draft_proposed=0)
    return r


def test_summary_compares_each_arm_with_its_own_plain_arm():
    rows = {
        "greedy llama.cpp": [row([1, 2], 100.0), row([1, 3], 50.0)],
        "greedy plain": [row([1, 2], 80.0, 2, 2), row([1, 3], 40.0, 2, 2)],
        "greedy draft forced": [row([1, 2], 160.0, 1, 2), row([1, 4], 60.0, 1, 3)],
        "beam4 plain": [row([5], 20.0, 4, 4), row([6], 10.0, 6, 6)],
        "beam4 draft forced": [row([5], 30.0, 2, 4), row([6], 20.0, 2, 6)],
        "sample4 plain": [row([9], 10.0, 3, 3), row([8], 10.0, 3, 3)],
        "sample4 draft": [row([7], 15.0, 1, 3), row([8], 12.0, 1, 3)],
    }
    d = summarize(rows, ["a", "b"], 16, 2, "m.gguf")
    assert d["median_ratio_to_plain"]["greedy draft forced"] == 1.75          # 2.0 and 1.5
    assert d["median_ratio_to_plain"]["beam4 draft forced"] == 1.75           # 1.5 and 2.0
    assert d["identical_to_plain"]["greedy draft forced"] == {"identical": 1, "of": 2}
    assert d["identical_to_plain"]["beam4 draft forced"] == {"identical": 2, "of": 2}
    assert "sample4 draft" not in d["identical_to_plain"]                     # a sample, not the same sample
    assert d["beam_steps_per_target_pass"]["greedy draft forced"] == 2.5      # (2 + 3) / (1 + 1)
    assert d["beam_steps_per_target_pass"]["beam4 plain"] == 1.0
    assert d["median_ratio_to_llama_cpp"] == {"greedy plain": 0.8, "greedy draft forced": 1.4}
    assert "tokens" not in d["rows"]["greedy plain"][0]
