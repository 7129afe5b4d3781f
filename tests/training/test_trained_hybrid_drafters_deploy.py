"""Drafters trained on tiny hybrid targets deploy and speculate losslessly: greedy output with
`SpecConfig(method, draft_model=DIR)` equals greedy output without a drafter (oracle: the plain
path of the same deployment code). The VLM checkpoint deploys with its vision tower, and gets
image prompts too."""
from __future__ import annotations

import json

import pytest
from safetensors import safe_open

from specdeploy import LLM, SamplingParams, SpecConfig
from specdeploy.cli import main
from tests.training.hybrid_setup import Hybrid
from tests.training.test_train_tiny import WORDS
from tests.vision.conftest import rand_image

LIMITS = dict(max_batch_size=4, max_seq_len=256, max_cache_gib=0.05, page_size=8,
              max_num_tokens=16)
PROMPTS = [[5, 6, 7, 8, 9], [20, 30, 40, 50, 60, 70, 80, 90, 11, 12, 13, 14, 15, 16, 17, 18, 19],
           [33]]
GREEDY = SamplingParams(max_tokens=16, ignore_eos=True)
DRAFTERS = {"eagle3": "Eagle3Drafter", "mtp": "MTP", "mtp_ft": "MTP"}


def _chats():
    """Text only, and an image between two texts (chunked prefill splits its tokens)."""
    return [[{"role": "user", "content": "hello world"}],
            [{"role": "user", "content": [{"type": "text", "text": "look"},
                                          {"type": "image", "image": rand_image(37, 53, 0)},
                                          {"type": "text", "text": "ok"}]}]]


@pytest.fixture(scope="module", params=["nemotron_h", "qwen3_5_moe", "qwen3_5_moe_text",
                                        "qwen3_next"])
def hybrid(request, tmp_path_factory):
    h = Hybrid(request.param, tmp_path_factory.mktemp(request.param))
    plain = LLM(str(h.path), **LIMITS)
    h.plain = [o.token_ids for o in plain.generate(PROMPTS, GREEDY)]
    h.vlm = request.param == "qwen3_5_moe"
    if h.vlm:
        h.plain_chat = [o.token_ids for o in plain.chat(_chats(), GREEDY)]
    return h


@pytest.mark.parametrize("run", ["eagle3", "mtp", "mtp_ft"])
def test_trained_drafter_speculates_losslessly(hybrid, run):
    cfg, _ = hybrid.run(run)
    spec = SpecConfig(cfg.method, 3, draft_model=cfg.out, controller="off")  # 3 drafts a step
    llm = LLM(str(hybrid.path), spec=spec, **LIMITS)
    assert type(llm.deployed.drafter).__name__ == DRAFTERS[run]
    assert (type(llm.deployed).__name__ == "VisionLanguageDeployed") == hybrid.vlm
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == hybrid.plain
    if hybrid.vlm:
        assert [o.token_ids for o in llm.chat(_chats(), GREEDY)] == hybrid.plain_chat
    stats = llm.stats()
    assert stats["draft_steps"] > 0 and stats["draft_tokens"] == 3 * stats["draft_steps"]


@pytest.mark.parametrize("args", [["--method", "eagle3", "--fit-batches", "1"],
                                  ["--method", "mtp", "--init-from-checkpoint"]],
                         ids=["eagle3_warm_start", "mtp_init_from_checkpoint"])
def test_train_drafter_command(args, tmp_path):
    """`specdeploy train-drafter` end to end on a NemotronH checkpoint (its own loading and
    tokenizer): a head that speculates losslessly, in the checkpoint's mtp.* layout for MTP."""
    h = Hybrid("nemotron_h", tmp_path)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"id": f"c{i}", "conversations": [
        {"from": "human", "value": " ".join(WORDS[i % 5:i % 5 + 4])},
        {"from": "gpt", "value": " ".join(WORDS * 2)}]}) + "\n" for i in range(20)))
    out = tmp_path / "head"
    assert main(["train-drafter", "--model", str(h.path), *args, "--out", str(out), "--data",
                 str(data), "--max-steps", "3", "--batch-size", "2", "--seq-len", "48",
                 "--draft-vocab-size", "64", "--no-progress", "--save-dtype", "fp32"]) == 0
    if "mtp" in args:
        with safe_open(f"{out}/model.safetensors", "pt") as f, \
                safe_open(f"{h.path}/model.safetensors", "pt") as ref:
            assert set(f.keys()) == {k for k in ref.keys() if k.startswith("mtp.")}
    method = args[1]
    want = [o.token_ids for o in LLM(str(h.path), **LIMITS).generate(PROMPTS, GREEDY)]
    llm = LLM(str(h.path), spec=SpecConfig(method, 2, draft_model=str(out)), **LIMITS)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == want
    assert llm.stats()["draft_steps"] > 0
