"""`capture_hidden_states`: the extra graph output is the residual stream after the requested
layers (checked with forward hooks on the plain model) or, for MTP, the final-normed hidden state;
logits are unchanged, and `gather_logits` afterwards leaves the capture at full length."""
from __future__ import annotations

import copy

import pytest
import torch

from specdeploy.deploy.build import name_inputs
from specdeploy.deploy.context import DeployContext
from specdeploy.deploy.export import export_model
from specdeploy.deploy.passes.capture_hidden import FINAL
from specdeploy.deploy.pipeline import run_transform
from specdeploy.loading import load_model

FAMILIES = ("llama", "nemotron_h", "qwen3_5_moe")
T = 9
EXACT = 1e-6


@pytest.fixture(scope="module", params=FAMILIES)
def exported(request, tiny_dir):
    model = load_model(tiny_dir(request.param), dtype="float32")
    gm = export_model(model, max_tokens=512)
    name_inputs(gm)
    torch.manual_seed(0)
    ids = torch.randint(3, model.cfg.vocab_size, (1, T))
    pos = torch.arange(T)[None]
    captured = {}
    layers = model.model.layers
    hooks = [layer.register_forward_hook(
        lambda mod, args, out, i=i: captured.__setitem__(i, out)) for i, layer in enumerate(layers)]
    with torch.inference_mode():
        logits = model(ids, pos)
        final = model.forward_hidden(ids, pos)
    for h in hooks:
        h.remove()
    return dict(model=model, gm=gm, ids=ids, pos=pos, logits=logits, layers=captured,
                final=final, num_layers=len(layers))


def _capture(exported, layers):
    gm = copy.deepcopy(exported["gm"])
    ctx = DeployContext(model=exported["model"], capture_layers=tuple(layers))
    info, _ = run_transform("capture_hidden_states", gm, ctx)
    return gm, ctx, info


def test_capture_layers_equal_hooks(exported, close):
    n = exported["num_layers"]
    layers = (0, n // 2, n - 1)  # EAGLE-3-style low / middle / high
    gm, _, info = _capture(exported, layers)
    assert info.num_matches == 3 and not info.skipped
    with torch.inference_mode():
        logits, hidden = gm(exported["ids"], exported["pos"])
    close(logits, exported["logits"], rtol=EXACT)
    want = torch.cat([exported["layers"][i] for i in layers], dim=-1)
    assert hidden.shape == want.shape
    close(hidden, want, rtol=EXACT)


def test_capture_order_is_the_requested_order(exported, close):
    n = exported["num_layers"]
    gm, _, _ = _capture(exported, (n - 1, 0))
    with torch.inference_mode():
        _, hidden = gm(exported["ids"], exported["pos"])
    close(hidden, torch.cat([exported["layers"][n - 1], exported["layers"][0]], -1), rtol=EXACT)


def test_capture_final_hidden_for_mtp(exported, close):
    gm, ctx, info = _capture(exported, (FINAL,))
    assert info.num_matches == 1
    run_transform("gather_logits", gm, ctx)  # runs after capture in the pipeline
    idx = torch.tensor([T - 1, 2])
    with torch.inference_mode():
        logits, hidden = gm(exported["ids"], exported["pos"], idx)
    close(hidden, exported["final"], rtol=EXACT)  # every token, not just the gathered rows
    close(logits, exported["logits"][:, idx], rtol=EXACT)


def test_gather_logits_picks_requested_rows(exported, close):
    gm = copy.deepcopy(exported["gm"])
    info, _ = run_transform("gather_logits", gm, DeployContext(model=exported["model"]))
    assert info.num_matches == 1
    for rows in ([0], [T - 1], [4, 0, 8, 8], list(range(T))):
        idx = torch.tensor(rows)
        with torch.inference_mode():
            (logits,) = gm(exported["ids"], exported["pos"], idx)
        assert logits.shape == (1, len(rows), exported["logits"].shape[-1])
        close(logits, exported["logits"][:, idx], rtol=EXACT)


def test_capture_errors_and_skip(exported):
    _, _, info = _capture(exported, ())
    assert info.skipped and info.num_matches == 0
    with pytest.raises(ValueError, match="capture_layers"):
        _capture(exported, (exported["num_layers"] + 3,))
