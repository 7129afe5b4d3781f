"""vLLM's and Hugging Face's conventions outside the server: SpecConfig / CLI spellings,
`--config FILE.yaml`, Hub ids from the local HF cache, generation_config defaults, vLLM-shaped
outputs, progress bars, the bench table and `specdeploy plot`."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from specdeploy import LLM, SamplingParams, SpecConfig
from specdeploy.checkpoint import CheckpointError
from specdeploy.cli import build_parser, main


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from specdeploy.models.registry import family_module

    return family_module("llama").make_tiny(tmp_path_factory.mktemp("surface") / "ckpt", seed=0)


def test_spec_config_speaks_vllm():
    s = SpecConfig.from_dict({"method": "deepseek_mtp", "num_speculative_tokens": 2})
    assert (s.method, s.num_draft_tokens) == ("mtp", 2)
    s = SpecConfig("eagle3", model="drafter_dir", num_speculative_tokens=4)
    assert (s.draft_model, s.num_draft_tokens) == ("drafter_dir", 4)
    s = SpecConfig.from_dict({"method": "ngram", "num_speculative_tokens": 5,
                              "prompt_lookup_max": 3, "prompt_lookup_min": 1})
    assert (s.method, s.prompt_lookup_max, s.prompt_lookup_min) == ("ngram", 3, 1)
    assert SpecConfig("qwen3_next_mtp").method == "mtp"
    with pytest.raises(ValueError, match="draft_tensor_parallel_size"):
        SpecConfig.from_dict({"method": "eagle3", "draft_tensor_parallel_size": 1})
    with pytest.raises(ValueError, match="medusa"):
        SpecConfig("medusa")
    with pytest.raises(ValueError, match="conflicts"):
        SpecConfig("eagle3", 3, draft_model="a", model="b")


def test_dtype_aliases():
    from specdeploy.loading import resolve_dtype

    assert resolve_dtype("half") == resolve_dtype("float16") == torch.float16
    assert resolve_dtype("float") == resolve_dtype("float32") == torch.float32
    assert resolve_dtype("bf16") == resolve_dtype("bfloat16") == torch.bfloat16
    assert resolve_dtype("auto") == torch.float32


def test_cli_parses_vllm_flags(tmp_path, capsys):
    from specdeploy.spec_args import spec_from_args

    args = build_parser().parse_args([
        "serve", "org/model", "--speculative-config",
        '{"method": "eagle3", "model": "d", "num_speculative_tokens": 2}', "--max-model-len",
        "100", "--max-num-seqs", "3", "--generation-config", "vllm", "--dtype", "half"])
    assert args.model_tag == "org/model" and args.max_seq_len == 100
    assert args.max_batch_size == 3 and args.generation_config == "vllm"
    spec = spec_from_args(args)
    assert (spec.method, spec.draft_model, spec.num_draft_tokens) == ("eagle3", "d", 2)
    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out.startswith("specdeploy ")
    assert main(["serve", "--speculative-config", "{nope", "--model", "x"]) == 2
    assert "speculative-config" in capsys.readouterr().err


def test_serve_config_yaml_and_positional_model(tiny_dir, tmp_path, monkeypatch):
    from specdeploy.serving import shutdown

    cfg = tmp_path / "serve.yaml"
    cfg.write_text(f"model: {tiny_dir}\nserved-model-name: yml\nmax_model_len: 100\n"
                   "max-num-seqs: 2\nport: 8124\nbackend: eager\nenable-prefix-caching: false\n")
    seen = {}

    def fake_run(app, *, host, port, **kw):
        seen.update(port=port, limits=app.state.limits,
                    batch=app.state.engine_loop.engine.scheduler.max_batch_size)

    monkeypatch.setattr(shutdown, "run", fake_run)
    assert main(["serve", "--config", str(cfg), "--port", "8125"]) == 0  # the flag wins
    assert seen["port"] == 8125 and seen["batch"] == 2
    assert seen["limits"].model_name == "yml" and seen["limits"].max_seq_len == 100
    assert main(["serve", str(tiny_dir), "--backend", "eager", "--max-model-len", "64"]) == 0
    assert seen["limits"].max_seq_len == 64


def _fake_hub(root, repo: str, src) -> None:
    """The layout huggingface_hub writes: models--org--name/{refs/main, snapshots/<commit>}."""
    base = root / "hub" / ("models--" + repo.replace("/", "--"))
    commit = "0123456789abcdef0123456789abcdef01234567"
    (base / "refs").mkdir(parents=True)
    (base / "refs" / "main").write_text(commit)
    shutil.copytree(src, base / "snapshots" / commit)


def test_hub_ids_resolve_from_the_local_cache_only(tiny_dir, tmp_path, monkeypatch, capsys):
    from specdeploy.checkpoint import open_checkpoint
    from specdeploy.checkpoint.hub import resolve_model_path

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _fake_hub(tmp_path / "hf", "someorg/tiny-llama", tiny_dir)
    path = resolve_model_path("someorg/tiny-llama")
    assert path.is_dir() and (path / "config.json").is_file() and "snapshots" in str(path)
    assert open_checkpoint("someorg/tiny-llama").config["architectures"]
    with pytest.raises(CheckpointError) as e:
        open_checkpoint("someorg/not-downloaded")
    msg = str(e.value)
    assert "someorg/not-downloaded" in msg and str(tmp_path / "hf" / "hub") in msg
    # the whole API: load with progress bars, vLLM-shaped outputs
    llm = LLM("someorg/tiny-llama", backend="eager", max_batch_size=2, progress=True)
    assert llm.max_model_len == 512 and llm.model_path == path
    outs = llm.generate(["Hi", "Hello"], SamplingParams(max_tokens=4), use_tqdm=True)
    err = capsys.readouterr().err
    assert "loading tensors" in err and "generating" in err
    assert outs[0].outputs[0].text == outs[0].text
    assert outs[1].outputs[0].token_ids == outs[1].token_ids
    assert outs[0].outputs[0].finish_reason == outs[0].finish_reason


def test_generation_config_modes(tiny_dir, tmp_path):
    from specdeploy.model_defaults import generation_defaults, resolve_max_len

    d = tmp_path / "g"
    d.mkdir()
    (d / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1,
         "do_sample": True, "max_length": 9}))
    assert generation_defaults(tiny_dir, "auto") == {}  # tiny: eos ids only
    assert generation_defaults(tiny_dir, d) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20,
                                                "min_p": 0.05, "repetition_penalty": 1.1}
    assert generation_defaults(d, "vllm") == {}
    with pytest.raises(ValueError, match="no generation_config.json"):
        generation_defaults(tiny_dir, tmp_path)
    (d / "generation_config.json").write_text(json.dumps({"temperature": -1}))
    with pytest.raises(ValueError, match="temperature"):
        generation_defaults(tiny_dir, d)
    assert resolve_max_len({"max_position_embeddings": 512}) == 512
    assert resolve_max_len({"max_position_embeddings": 8192}) == 2048
    assert resolve_max_len({"text_config": {"max_position_embeddings": 300}}, 200) == 200
    with pytest.raises(ValueError, match="max_position_embeddings"):
        resolve_max_len({"max_position_embeddings": 512}, max_seq_len=700)


def test_chat_template_generation_block_and_kwargs():
    from specdeploy.chat_template import render

    t = ("{% for m in messages %}{% generation %}{{ m['content'] }}{% endgeneration %}"
         "{% endfor %}{% if enable_thinking %}T{% endif %}{{ tools | length if tools else 0 }}")
    msgs = [{"role": "assistant", "content": "ab"}]
    assert render(t, msgs, variables={"enable_thinking": True, "tools": [1, 2]}) == "abT2"
    assert render(t, msgs, add_generation_prompt=False, continue_final_message=True) == "ab"
    with pytest.raises(ValueError, match="continue_final_message"):
        render(t, msgs, add_generation_prompt=True, continue_final_message=True)


def test_bench_summary_table():
    from specdeploy.bench import summary_table

    text = summary_table({"model": "m", "num_requests": 4, "concurrency": 2,
                          "prompt_tokens": 40, "output_tokens": 64, "wall_s": 2.0,
                          "output_tokens_per_s": 32.0, "ttft_s": {"p50": 0.1, "p90": 0.2,
                                                                  "p99": 0.3},
                          "itl_s": {"p50": 0.01, "p90": None, "p99": 0.05},
                          "stats": {"draft_steps": 10, "mean_accepted_length": 1.8,
                                    "acceptance_rate": 0.4,
                                    "acceptance_per_position": [0.6, 0.2]}})
    assert "32.0 tokens/s" in text and "100.0 ms / 200.0 ms / 300.0 ms" in text
    assert "1.80" in text and "40.0%" in text and "0.60, 0.20" in text


def test_plot_writes_pngs(tmp_path):
    pytest.importorskip("matplotlib", reason="`specdeploy plot` needs the plot extra")
    runs = [{"concurrency": c, "output_tokens_per_s": 10.0 * c,
             "stats": {"draft_steps": 8, "accepted_per_position": [6, 3, 1]}} for c in (1, 4)]
    src = tmp_path / "bench.json"
    src.write_text(json.dumps(runs))
    assert main(["plot", str(src), "--out", str(tmp_path / "png")]) == 0
    for name in ("throughput_vs_concurrency.png", "acceptance_per_position.png"):
        data = (tmp_path / "png" / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000
    serve = tmp_path / "serve.json"  # bench/serve.py's shape
    serve.write_text(json.dumps({"runs": [{"config": "mtp", "levels": [
        {"concurrency": 1, "output_tokens_per_s": 5.0}, {"concurrency": 8,
                                                        "output_tokens_per_s": 20.0}]}]}))
    from specdeploy.plot import plot_bench

    (png,) = plot_bench(serve, tmp_path / "png2")
    assert png.name == "throughput_vs_concurrency.png" and png.stat().st_size > 1000
