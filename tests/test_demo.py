"""`make demo` (specdeploy.demo): the default model without speculation and with
SpecConfig("auto"), printing tokens/s for both, the speedup, the mean accepted length, and that
the greedy texts agree."""
from __future__ import annotations

import re

from specdeploy import demo


def test_demo_prints_both_runs(monkeypatch, capsys):
    monkeypatch.setattr(demo, "PROMPTS", ["List the days of the week."])
    demo.main()
    out = capsys.readouterr().out
    assert re.search(r"\[no speculation\] \d+ tokens in [\d.]+ s = [\d.]+ tokens/s\n", out)
    # auto's pick depends on the CPU (spec_auto.default_model_choice): the controller or not
    assert re.search(r"\[speculative \((ngram|suffix), K=3(, cost controller)?\)\] \d+ tokens "
                     r"in [\d.]+ s = [\d.]+ tokens/s, mean accepted length [\d.]+", out)
    assert re.search(r"speculative decoding: [\d.]+x the tokens/s of no speculation", out)
    assert "greedy outputs identical with and without speculation: True" in out
