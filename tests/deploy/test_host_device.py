"""Host/device metadata (DESIGN.md invariant 8), checked without a GPU: the engine builds host
metadata; a deployment feeds its graph's `*_host` inputs those host tensors and every other
metadata input from one device copy per forward (a fresh buffer, never aliasing a host tensor).
Plus the `device` option's validation."""
from __future__ import annotations

import pytest
import torch

import specdeploy.deploy.runner as runner_mod
from specdeploy import LLM, SamplingParams, SpecConfig
from specdeploy.deploy.build import BuildOptions


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


@pytest.mark.parametrize("spec", [None, "mtp"])
def test_host_inputs_are_host_tensors_and_one_copy_per_forward(tmp_path, spec, monkeypatch):
    from specdeploy.models.registry import family_module

    path = family_module("nemotron_h").make_tiny(tmp_path / "ckpt", seed=0, mtp_layers=1)
    spec_cfg = SpecConfig("mtp", 2) if spec else None
    # (eager steps: a CPU graph's replays read one static buffer, engine/cpu_graphs.py)
    llm = LLM(str(path), dtype="float32", max_batch_size=2, max_seq_len=64, max_cache_gib=0.01,
              spec=spec_cfg, cpu_graphs=False)
    copies, fed = [], []
    real = runner_mod.to_device

    def spy(tensors, device):
        out = real(tensors, device)
        copies.append(out)
        return out

    real_lists = runner_mod.lists_to_device

    def spy_lists(parts, device):  # the same copy, from the engine's host lists
        out = real_lists(parts, device)
        copies.append(out)
        return out

    monkeypatch.setattr(runner_mod, "to_device", spy)
    monkeypatch.setattr(runner_mod, "lists_to_device", spy_lists)
    graphs = [llm.deployed] if spec is None else [llm.deployed.target, llm.deployed.draft]
    for g in graphs:
        names, fn = list(g._input_names), g._fn

        def recording(*args, _names=names, _fn=fn):
            fed.append(dict(zip(_names, args)))
            return _fn(*args)

        monkeypatch.setattr(g, "_fn", recording)
    forwards = []
    for g in graphs:
        real_forward = g.forward

        def counting(meta, *a, _f=real_forward):
            forwards.append(meta)
            return _f(meta, *a)

        monkeypatch.setattr(g, "forward", counting)
    llm.generate([[5, 6, 7, 8, 9] * 3, [11, 12]], SamplingParams(max_tokens=6, ignore_eos=True))
    assert len(copies) == len(forwards) == len(fed) > 0  # one copy per forward
    for meta, feed, dev in zip(forwards, fed, copies):
        host = {"cu_seqlens_host": meta.cu_seqlens, "cache_lens_host": meta.cache_lens,
                "seg_kind_host": meta.seg_kind}
        for name, t in host.items():
            if name in feed:
                assert feed[name] is t, name  # the engine's host tensor itself
        host_storages = {_storage(t) for t in vars(meta).values() if isinstance(t, torch.Tensor)}
        buffer = {_storage(t) for t in dev.values()}
        assert len(buffer) == 1  # one buffer for all of them
        for name, t in feed.items():
            if name.endswith("_host") or name == "hidden" or t is None:
                continue
            if name in dev:
                assert _storage(t) in buffer and _storage(t) not in host_storages, name


def test_device_option_is_validated():
    for bad in ("tpu", "not a device", "meta"):
        with pytest.raises(ValueError, match="device"):
            BuildOptions(device=bad)
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="CPU-only"):
            BuildOptions(device="cuda", backend="eager")
    else:
        with pytest.raises(ValueError, match="no CUDA device"):
            BuildOptions(device="cuda")
    assert BuildOptions(device="cpu").device == torch.device("cpu")


def test_auto_dtype_by_device():
    from specdeploy.loading import resolve_dtype

    assert resolve_dtype("auto", device="cpu") == torch.float32
    assert resolve_dtype("auto", device="cuda") == torch.bfloat16
    assert resolve_dtype("float32", device="cuda") == torch.float32
