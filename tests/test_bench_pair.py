"""bench.pair's pure parts: reading llama.cpp's speculative tool's output and report, and the equality and ratio
columns (the benchmark itself runs the real pair, never in CI)."""
import pytest

from bench import pair

STDERR = """
0.06.552.791 I encoded   41 tokens in    0.512 seconds, speed:   80.1 t/s
0.06.552.791 I decoded   68 tokens in    3.659 seconds, speed:   18.582 t/s
0.06.552.817 I n_draft   = 3
0.06.552.843 I n_drafted = 51
0.06.552.856 I n_accept  = 45
"""
PROMPT = "<|im_start|>user\nWrite a loop.<|im_end|>\n<|im_start|>assistant\n"


def test_the_tool_report_is_read():
    r = pair.parse_tool("\n\n" + PROMPT.rstrip() + "```python\nfor i in range(3):\n    pass\n```\n\n", STDERR, PROMPT)
    assert r["text"] == "```python\nfor i in range(3):\n    pass\n```"
    assert r["encoded"] == (41, 0.512) and r["decoded"] == (68, 3.659)
    assert r["n_drafted"] == 51 and r["n_accept"] == 45


def test_a_tool_without_its_report_fails_by_name():
    with pytest.raises(RuntimeError, match="decoded"):
        pair.parse_tool("text", "encoded 3 tokens in 0.1 seconds", PROMPT)


def test_same_text_is_equality_up_to_the_shorter():
    assert pair.same_text("abc def", "abc de")
    assert not pair.same_text("abc def", "abd")
    assert not pair.same_text("", "")


def test_ratios_and_equality_columns():
    def row(n, s, tokens=None, text=""):
        return {"n": n, "seconds": s, "tokens": tokens or [1, 2], "text": text}
    rows = {"plain K=1": [row(10, 2.0, [1, 2], "a b"), row(10, 1.0, [3], "c")],
            "spec K=1": [row(10, 1.0, [1, 2], "a b"), row(10, 1.0, [4], "c")],
            "llama.cpp": [row(10, 1.0, text="a b"), row(10, 0.5, text="c")],
            "llama.cpp speculative": [row(12, 1.0, text="a b c"), row(10, 1.0, text="x")]}
    assert pair.identical(rows) == {"ours K=1: spec == plain": 1, "llama.cpp: speculative == plain": 1,
                                    "ours plain K=1 == llama.cpp (same GGUF, our int8 split export)": 2}
    r = pair.ratios(rows)
    assert r["spec K=1 / plain K=1"] == 1.5            # median of 2.0 and 1.0
    assert r["llama.cpp speculative / llama.cpp"] == pytest.approx(statistics_median([1.2, 0.5]))


def statistics_median(xs):
    import statistics
    return round(statistics.median(xs), 3)
