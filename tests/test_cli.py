"""The `specdeploy` command: make-tiny, generate --json, bad input."""
from __future__ import annotations

import json

import pytest
import torch

from specdeploy import LLM, SamplingParams
from specdeploy.cli import main


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "llama"
    assert main(["make-tiny", "--arch", "llama", "--seed", "3", "--out", str(out)]) == 0
    return out


def test_make_tiny_writes_checkpoint(tiny_dir):
    assert (tiny_dir / "config.json").is_file()
    assert (tiny_dir / "tokenizer.json").is_file()


def test_generate_json(tiny_dir, capsys):
    rc = main(["generate", "--model", str(tiny_dir), "--prompt", "hello world", "--json",
               "--max-tokens", "6", "--backend", "eager"])
    assert rc == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert {"text", "token_ids", "finish_reason", "tokens_per_s"} <= record.keys()
    llm = LLM(tiny_dir, backend="eager", max_batch_size=1)
    (want,) = llm.generate("hello world", SamplingParams(max_tokens=6))
    assert record["token_ids"] == want.token_ids and record["text"] == want.text
    assert record["finish_reason"] == want.finish_reason


def test_generate_bad_input(tiny_dir, capsys):
    rc = main(["generate", "--model", str(tiny_dir), "--prompt", "x", "--top-p", "0"])
    assert rc == 2 and "top_p" in capsys.readouterr().err


def test_deploy_list_transforms(tiny_dir, capsys):
    assert main(["deploy", "--model", str(tiny_dir), "--list-transforms"]) == 0
    out = capsys.readouterr().out
    assert "transforms" in out and "cache" in out


def test_bench_jsonl(tiny_dir, tmp_path, capsys):
    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": p}) for p in ("hi", "hello there", "abc")))
    rc = main(["bench", "--model", str(tiny_dir), "--dataset", str(data), "--num-prompts", "3",
               "--concurrency", "2", "--max-tokens", "5", "--backend", "eager",
               "--max-seq-len", "64", "--json"])
    assert rc == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r["num_requests"] == 3 and r["output_tokens"] == 15
    assert r["output_tokens_per_s"] > 0 and r["ttft_s"]["p50"] > 0 and r["peak_rss_mib"] > 0


def test_sharegpt_first_human_turns():
    from specdeploy.bench import load_prompts

    prompts = load_prompts("sharegpt", 3)
    assert len(prompts) == 3 and all(p.strip() for p in prompts)


def test_generate_with_eagle3_and_lookup_flags(tiny_dir, tmp_path, capsys):
    """--spec eagle3 --prompt-lookup-max / --draft-dtype / --draft-quantize reach SpecConfig;
    greedy text as without speculation."""
    draft = tmp_path / "eagle"
    assert main(["make-tiny", "--arch", "eagle3", "--target", str(tiny_dir), "--out",
                 str(draft)]) == 0
    prompt = "abc abc abc abc"
    args = ["generate", "--model", str(tiny_dir), "--prompt", prompt, "--json", "--max-tokens",
            "12", "--max-seq-len", "128"]
    assert main(args) == 0
    plain = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert main(args + ["--spec", "eagle3", "--draft-model", str(draft),
                        "--prompt-lookup-max", "3", "--prompt-lookup-min", "1",
                        "--prompt-lookup-num-tokens", "5"]) == 0
    spec = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert spec["token_ids"] == plain["token_ids"]
    assert spec.get("lookup_steps", 0) > 0, spec
    assert spec["num_draft_tokens"] == 3 and len(spec["acceptance_per_position"]) == 5, spec
    assert main(args + ["--spec", "ngram", "--prompt-lookup-min", "1"]) == 0  # no drafter
    ngram = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert ngram["token_ids"] == plain["token_ids"] and ngram["lookup_steps"] > 0, ngram
    # --spec suffix over a store of the plain reply (no prompt lookup match is needed)
    from specdeploy.checkpoint import open_checkpoint
    from specdeploy.engine.suffix_store import SuffixStore

    vocab = open_checkpoint(str(tiny_dir)).config["vocab_size"]
    SuffixStore.save(tmp_path / "store", [plain["token_ids"]], vocab)
    assert main(args + ["--spec", "suffix", "--suffix-store", str(tmp_path / "store"),
                        "--suffix-max-cached-requests", "0", "--suffix-min-token-prob", "0.05",
                        "--spec-controller", "off"]) == 0
    sfx = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert sfx["token_ids"] == plain["token_ids"] and sfx["store_steps"] > 0, sfx
    assert main(args + ["--spec", "eagle3", "--draft-model", str(draft),
                        "--draft-dtype", "bfloat16", "--draft-quantize", "int8"]) == 0
    low = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert low["token_ids"] == plain["token_ids"] and low["draft_steps"] > 0, low
    assert main(args + ["--spec", "eagle3", "--draft-model", str(draft),
                        "--prompt-lookup-max", "2", "--prompt-lookup-min", "3"]) == 2
    assert "prompt_lookup_min" in capsys.readouterr().err
    assert main(args + ["--spec", "eagle3", "--draft-model", str(draft),
                        "--prompt-lookup-max", "2", "--prompt-lookup-num-tokens", "0"]) == 2
    assert "prompt_lookup_num_tokens" in capsys.readouterr().err


def test_cuda_graphs_flags():
    """--cuda-graphs requires them, --no-cuda-graphs / vLLM's --enforce-eager turn them off, and
    without either LLM gets None (on where they can serve, on a CUDA device)."""
    import argparse

    from specdeploy.cli_args import add_cuda_graphs_arg

    p = argparse.ArgumentParser()
    add_cuda_graphs_arg(p)
    assert p.parse_args([]).cuda_graphs is None
    assert p.parse_args(["--cuda-graphs"]).cuda_graphs is True
    assert p.parse_args(["--no-cuda-graphs"]).cuda_graphs is False
    assert p.parse_args(["--enforce-eager"]).cuda_graphs is False
    assert p.parse_args([]).num_scheduler_steps == 1
    assert p.parse_args(["--num-scheduler-steps", "8"]).num_scheduler_steps == 8
    with pytest.raises(SystemExit):
        p.parse_args(["--num-scheduler-steps", "0"])


def test_cuda_graphs_required_off_cuda_is_refused():
    from specdeploy import LLM

    with pytest.raises(ValueError, match="cuda_graphs: needs a CUDA device"):
        LLM(None, cuda_graphs=True)
