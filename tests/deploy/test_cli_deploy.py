"""`specdeploy deploy --model DIR --list-transforms`: the ordered transforms with match counts, then
the cache plan; a budget too small names `max_cache_gib`."""
from __future__ import annotations

import re

from specdeploy.cli import main
from specdeploy.deploy.pipeline import transforms


def test_list_transforms(tiny_dir, capsys):
    rc = main(["deploy", "--model", str(tiny_dir("qwen3_5_moe")), "--list-transforms",
               "--max-seq-len", "64", "--max-cache-gib", "0.01", "--dtype", "float32"])
    out = capsys.readouterr().out
    assert rc == 0
    rows = re.findall(r"^\s+(\d+)\. (\w+)\s+(\w+)\s+(skipped|\d+ matches)", out, re.M)
    assert [r[2] for r in rows] == [t.name for t in transforms()]
    assert [int(r[0]) for r in rows] == list(range(len(rows)))
    counts = {r[2]: r[3] for r in rows}
    assert counts["gather_logits"] == "1 matches"
    assert counts["insert_cached_attention"] == "1 matches"  # 1 full-attention layer
    assert counts["insert_cached_conv"] == "3 matches"  # 3 gated-delta layers, each with a conv
    assert counts["insert_cached_gdn"] == "3 matches"
    assert counts["insert_cached_ssm"] == "0 matches"
    assert counts["quantize_int8_weights"] == "skipped"
    plan = out[out.index("cache plan:"):]
    assert out.index("cache plan:") > out.index("compile_model")
    assert re.search(r"page_size=\d+ num_pages=\d+ num_slots=\d+ total=", plan)
    for kind in ("paged_kv", "state"):
        assert re.search(rf"^\s+{kind}\s+[\d.]+ MiB", plan, re.M), kind
    assert re.search(r"3 × [\d,]+ B\s+gdn_0_state, gdn_1_state, gdn_2_state", plan)
    # prefix caching (on by default): every recurrent state has a checkpoint pool
    assert re.search(r"insert_cached_gdn\s+3 matches\s+\[state ×3, checkpoint ×3\]", out)
    assert re.search(r"^\s+checkpoint\s+[\d.]+ MiB", plan, re.M)
    assert re.search(r"3 × [\d,]+ B\s+gdn_0_ckpt, gdn_1_ckpt, gdn_2_ckpt", plan)
    # the gated-delta scan's chunk is 64 tokens: pages of 64 by default, a checkpoint at each
    # (their states come free), the pool's bytes and the reason shown
    assert re.search(r"page_size=64 ", plan)
    assert re.search(r"prefix-cache checkpoints: \d+ slots \([\d.]+ MiB\), one every 1 page\(s\) "
                     r"= 64 tokens: every page boundary is a scan-chunk boundary", plan)


def test_list_transforms_without_prefix_caching(tiny_dir, capsys):
    rc = main(["deploy", "--model", str(tiny_dir("nemotron_h")), "--list-transforms",
               "--max-seq-len", "64", "--max-cache-gib", "0.01", "--dtype", "float32",
               "--no-enable-prefix-caching"])
    out = capsys.readouterr().out
    assert rc == 0
    assert re.search(r"insert_cached_ssm\s+3 matches\s+\[state ×3\]", out)
    # no checkpoint pools: no `*_ckpt` resources and no "checkpoint ×" in the cache lines
    # (the text may say "checkpoint" elsewhere, e.g. "not a pre-quantized checkpoint")
    assert not re.search(r"\w+_ckpt\b", out) and "checkpoint ×" not in out


def test_budget_too_small(tiny_dir, capsys):
    rc = main(["deploy", "--model", str(tiny_dir("llama")), "--list-transforms",
               "--max-seq-len", "512", "--max-cache-gib", "0.0001"])
    assert rc == 2
    assert "max_cache_gib" in capsys.readouterr().err
