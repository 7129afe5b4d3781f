"""The sliding-window page group on a CUDA device (cache/window.py): the torch paths that read
whole block tables (`_decode`, `extend_uniform`) and CUDA-graph replay, with every free window
page NaN, give the logits of a deployment that keeps every page (tests/engine/
test_window_pages.py on the CPU). Run by bench/gpu_check.sh on a GPU machine; not yet run on
one."""
from __future__ import annotations

import pytest
import torch

from specdeploy import SamplingParams
from specdeploy.models import gemma3
from tests.engine.test_window_pages import PROMPTS, _llm, _run, _sampled, _target

pytestmark = pytest.mark.cuda


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return gemma3.make_tiny(tmp_path_factory.mktemp("gemma3"), seed=3)


@pytest.mark.parametrize("spec", [None, {"method": "ngram", "num_speculative_tokens": 3,
                                         "prompt_lookup_max": 2, "controller": "off"}])
def test_window_pages_on_cuda_give_the_kept_pages_logits(tiny, spec):
    torch.backends.cuda.matmul.allow_tf32 = False
    kw = dict(device="cuda", dtype="float32", spec=spec)
    sp = _sampled(24) if spec is None else SamplingParams(max_tokens=24, ignore_eos=True)
    want, ref, _, _ = _run(_llm(tiny, windows=False, **kw), PROMPTS, sp)
    on = _llm(tiny, **kw)
    got, logits, _, _ = _run(on, PROMPTS, sp)
    assert got == want and on.engine.blocks.window.slid > 0
    assert _target(on).graph_runner.replays > 0
    if spec is None:
        for x, y in zip(logits, ref):
            assert (x - y).abs().max() <= 1e-5 * y.abs().max()
