"""The AMX path of the tiled integer-dot GGUF kernels (ops/ggml_tiled.c): where this CPU has
AMX-INT8 and the OS lets the process use it, steps of enough rows on the avx512_vnni path run
their block dot products on the tile unit. The oracle is the portable scalar path (itself
checked against gguf's dequantization in test_ggml_tiled.py): AMX must give its bits exactly,
at every row count (groups of 16 rows and their remainders), block count (odd, one), thread
count, kind; rows stay batch-invariant where a step's row count crosses the threshold; and a
deployed default model generates the same greedy tokens with AMX at every row count as
without it. Skipped, with the reason, on CPUs without AMX.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from specdeploy.ops import ggml_tiled as gt
from tests.ops.test_ggml_int import KINDS as INT_KINDS
from tests.ops.test_ggml_int import _weight, _x

pytest.importorskip("gguf")
KINDS = {k: v for k, v in INT_KINDS.items() if k in gt.TILED_KINDS}
pytestmark = pytest.mark.skipif(
    not gt.amx_usable(), reason="no AMX-INT8 on this CPU (or the OS did not grant the tile "
    "state): the AMX path cannot run here")
# N = 1, 3 and 60 tiles; K = 32 * (1, 3, 19) blocks (odd: the pipeline's last single block) and
# the default model's 18
SHAPES = [(16, 32), (48, 96), (960, 608), (960, 576)]


def _threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    return before


@pytest.mark.parametrize("kind", list(KINDS))
def test_amx_at_every_row_count_is_bit_identical_to_scalar(kind):
    """Rows 1..34 (one group of 16, two, three partial) on AMX at every row count against the
    scalar path, at 1 and 2 threads."""
    for n, k in SHAPES:
        tw = gt.repack(_weight(kind, n, k, seed=n + k)[0])
        x = _x(34, k, seed=k)
        rows_set = range(1, 35) if n < 960 else (1, 5, 16, 17, 33)  # NOTE: suite time
        for threads in (1, 2):
            before = _threads(threads)
            try:
                for rows in rows_set:
                    want = gt.tiled_linear(x[:rows], tw, isa="scalar")
                    with gt.amx(1):
                        got = gt.tiled_linear(x[:rows], tw, isa="avx512_vnni")
                    assert torch.equal(got, want), (kind, n, k, rows, threads)
            finally:
                torch.set_num_threads(before)


@pytest.mark.parametrize("kind", list(KINDS))
def test_rows_stay_batch_invariant_across_the_threshold(kind):
    """With the shipped thresholds a row alone (AVX-512) equals the same row inside a step of
    40 rows (AMX for every kind), and a step at the threshold equals one just under it."""
    tw = gt.repack(_weight(kind, 208, 96, seed=2)[0])  # 13 tiles: uneven thread ranges
    x = _x(40, 96, seed=3)
    assert gt.amx_min_rows() == gt.AMX_MIN_ROWS  # the shipped thresholds are in force
    full = gt.tiled_linear(x, tw)
    alone = torch.cat([gt.tiled_linear(x[i:i + 1], tw) for i in range(40)])
    assert torch.equal(full, alone)
    at = gt.AMX_MIN_ROWS[kind]
    assert torch.equal(gt.tiled_linear(x[:at], tw)[:at - 1], gt.tiled_linear(x[:at - 1], tw))


def test_nonfinite_inputs_poison_their_rows_as_on_avx512():
    """A NaN / inf in a row makes that row's outputs NaN on AMX as on the AVX-512 path (the
    block scale carries it; q = -128 there), and leaves the other rows alone."""
    for kind in KINDS:
        tw = gt.repack(_weight(kind, 48, 96, seed=7)[0])
        x = _x(20, 96, seed=8)
        x[3, 5], x[11, 70] = float("nan"), float("inf")
        with gt.amx(0):
            want = gt.tiled_linear(x, tw, isa="avx512_vnni")
        with gt.amx(1):
            got = gt.tiled_linear(x, tw, isa="avx512_vnni")
        assert torch.equal(got.isnan(), want.isnan()) and got[3].isnan().all()
        ok = ~want.isnan()
        assert torch.equal(got[ok], want[ok]), kind


def test_thresholds_are_scoped_and_checked():
    shipped = gt.amx_min_rows()
    with gt.amx(0):
        assert set(gt.amx_min_rows().values()) == {0}
        with gt.amx({"q8_0": 3}):
            assert gt.amx_min_rows() == {"q4_1": 0, "q8_0": 3, "q4_0": 0}
    assert gt.amx_min_rows() == shipped
    for bad in (-1, {"q5_k": 4}, {"q4_1": -2}):
        with pytest.raises(ValueError, match="min_rows"):
            with gt.amx(bad):
                pass
    assert gt.amx_min_rows() == shipped


def test_env_turns_amx_off():
    code = "from specdeploy.ops import ggml_tiled as g; print(sorted(g.amx_min_rows().values()))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "SPECDEPLOY_GGML_AMX": "0"}, check=True)
    assert out.stdout.split() == ["[0,", "0,", "0]"]


def test_default_model_greedy_tokens_are_the_same_with_amx_everywhere():
    """The default model (Q4_1 layers, Q8_0 head) with the fast kernels and EAGLE-free n-gram
    speculation: prefill (> 32 rows), decode and verify steps with AMX at every row count give
    the tokens of a deployment without AMX. Both deploy inside their setting (the fused layers
    bind the kernel's calls at build time)."""
    from specdeploy import LLM, SamplingParams, SpecConfig
    from specdeploy.default_model import default_model_path

    default_model_path()  # NOTE: `make test` installs it; a missing model must fail, not skip
    sp = SamplingParams(max_tokens=24, temperature=0)
    outs = {}
    for name, rows in (("off", 0), ("everywhere", 1)):
        with gt.amx(rows):
            llm = LLM(max_batch_size=2, max_seq_len=256, spec=SpecConfig("ngram", 3))
            prompts = [llm.chat_ids([{"role": "user", "content": q}]) for q in (
                "Repeat after me: the quick brown fox jumps over the lazy dog, twice.",
                "Name three colours of the rainbow and say one thing about each.")]
            assert all(len(p) > 32 for p in prompts)
            outs[name] = [o.token_ids for o in llm.generate(prompts, sp)]
            del llm
    assert outs["everywhere"] == outs["off"]
    assert sum(len(t) for t in outs["off"]) >= 24
