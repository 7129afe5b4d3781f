"""`make demo` (specdeploy.demo): the default model with and without the shipped EAGLE-3 head,
printing tokens/s for both, the mean accepted length, and that the greedy texts agree."""
from __future__ import annotations

import re

from specdeploy import demo


def test_demo_prints_both_runs(monkeypatch, capsys):
    monkeypatch.setattr(demo, "PROMPTS", ["List the days of the week."])
    demo.main()
    out = capsys.readouterr().out
    assert re.search(r"\[no speculation\] \d+ tokens in [\d.]+ s = [\d.]+ tokens/s\n", out)
    assert re.search(r"\[EAGLE-3, K=3\] \d+ tokens in [\d.]+ s = [\d.]+ tokens/s, mean accepted "
                     r"length [\d.]+ \(per position \[", out)
    assert re.search(r"\[EAGLE-3 \+ n-gram lookup, K=3\] \d+ tokens in [\d.]+ s = [\d.]+ "
                     r"tokens/s, mean accepted length", out)
    assert "greedy outputs identical with and without speculation: True" in out
