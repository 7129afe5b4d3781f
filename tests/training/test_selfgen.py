"""gen-drafter-data: the target's own greedy replies to training-split prompts only, exact token
ids, resumable; training on the file puts the loss on the replies only."""
from __future__ import annotations

import json

import pytest
import torch

import specdeploy
from specdeploy import LLM
from specdeploy.cli import main
from specdeploy.models import llama
from specdeploy.training import data as data_mod

WORDS = "the cat sat on a mat and then it ran to see the dog".split()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("selfgen")
    target = llama.make_tiny(root / "target", seed=0)
    src = root / "prompts.jsonl"
    with src.open("w") as f:
        for i in range(30):
            words = " ".join(WORDS[(i + j) % len(WORDS)] for j in range(4))
            f.write(json.dumps({"id": f"c{i}", "conversations": [
                {"from": "human", "value": words}, {"from": "gpt", "value": "ok " + words}]})
                + "\n")
    out = root / "self.jsonl"
    argv = ["gen-drafter-data", "--model", str(target), "--data", str(src), "--out", str(out),
            "--num-prompts", "6", "--max-tokens", "5", "--batch-size", "4", "--chunk", "4"]
    assert main(argv) == 0
    return root, target, src, out, argv


def test_records_are_the_targets_greedy_replies_to_training_prompts(setup):
    root, target, src, out, _ = setup
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(recs) == 6 and len({r["id"] for r in recs}) == 6
    train, held = data_mod.split(data_mod.load_conversations(str(src)))
    assert {r["id"] for r in recs} <= {c.id for c in train}
    assert not {r["id"] for r in recs} & {c.id for c in held}
    meta = json.loads((root / "self.jsonl.meta.json").read_text())
    assert meta["source_heldout"]["heldout_ids"] == [c.id for c in held]
    # oracle: full-recompute greedy decoding with the plain model (no cache, no engine)
    model = specdeploy.load_model(str(target))
    for r in recs:
        ids, n = list(r["token_ids"][:r["prompt_len"]]), len(r["token_ids"]) - r["prompt_len"]
        with torch.inference_mode():
            for _ in range(n):
                ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
        assert ids == r["token_ids"]


def test_rerun_appends_only_missing_prompts(setup):
    _, _, _, out, argv = setup
    before = out.read_text()
    assert main(argv) == 0
    assert out.read_text() == before  # nothing new
    assert main([*argv, "--num-prompts", "8"]) == 0  # argparse: the last one wins
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(recs) == 8 and out.read_text().startswith(before)


def test_training_batches_mask_the_prompt(setup):
    _, target, _, out, _ = setup
    convs = data_mod.load_conversations(str(out))
    train, held, meta = data_mod.split_for_training(str(out), convs)
    assert len(train) == len(convs) and not held and "source_heldout" in meta
    tok = LLM(str(target), max_batch_size=1, max_seq_len=64).tokenizer
    b = data_mod.TokenBatches(tok, train, batch_size=2, seq_len=64, min_tokens=1, seed=0)
    ids, mask = b.batch(0)
    for row in range(2):
        conv = next(c for c in train if c.token_ids == ids[row, :len(c.token_ids)].tolist())
        m = mask[row].nonzero().flatten().tolist()
        assert m == list(range(conv.prompt_len - 1, len(conv.token_ids)))


def test_bad_record_is_named(tmp_path):
    f = tmp_path / "bad.jsonl"
    f.write_text(json.dumps({"id": "x", "token_ids": [1, 2], "prompt_len": 5}) + "\n")
    with pytest.raises(ValueError, match="record 0: prompt_len 5"):
        data_mod.load_conversations(str(f))


@pytest.mark.parametrize("shard", ["2/2", "x", "1"])
def test_bad_shard_is_named_before_loading(tmp_path, capsys, shard):
    # the model path does not exist: the shard error must come first
    assert main(["gen-drafter-data", "--model", str(tmp_path / "missing"), "--out",
                 str(tmp_path / "o.jsonl"), "--num-prompts", "1", "--shard", shard]) == 2
    assert "--shard" in capsys.readouterr().err


@pytest.mark.parametrize("method", ["eagle3", "mtp"])
def test_train_drafter_command_on_generated_data(setup, method, tmp_path):
    """`specdeploy train-drafter` end to end: the generated file plus the source file as a second
    source, a few steps, a head that `SpecConfig` deploys losslessly next to the target."""
    from specdeploy import SamplingParams, SpecConfig

    root, target, src, out, _ = setup
    long = tmp_path / "long.jsonl"  # replies long enough for training samples (>= 32 tokens)
    long.write_text("".join(json.dumps({"id": f"l{i}", "conversations": [
        {"from": "human", "value": " ".join(WORDS[i % 5:i % 5 + 4])},
        {"from": "gpt", "value": " ".join(WORDS * 2)}]}) + "\n" for i in range(20)))
    head = tmp_path / method
    argv = ["train-drafter", "--model", str(target), "--method", method, "--out", str(head),
            "--data", f"{out},{long}:12", "--max-steps", "3", "--batch-size", "2",
            "--seq-len", "48", "--draft-vocab-size", "64", "--fit-batches", "1",
            "--no-progress", "--save-dtype", "fp32"]
    assert main(argv) == 0
    meta = json.loads((head / "training.json").read_text())
    assert meta["steps"] == 3 and meta["heldout"]["sources"] == [str(out), f"{long}:12"]
    prompt = [5, 6, 7, 8, 9]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    want = LLM(str(target), max_batch_size=1, max_seq_len=64).generate([prompt], params)
    spec = LLM(str(target), max_batch_size=1, max_seq_len=64,
               spec=SpecConfig(method, 2, draft_model=str(head)))
    assert spec.generate([prompt], params)[0].token_ids == want[0].token_ids
    assert spec.stats()["draft_steps"] > 0


def test_train_drafter_on_data_too_short_names_it(setup, tmp_path, capsys):
    target = setup[1]
    short = tmp_path / "short.jsonl"
    short.write_text("".join(json.dumps({"id": f"s{i}", "conversations": [
        {"from": "human", "value": "hi"}, {"from": "gpt", "value": "ok"}]}) + "\n"
        for i in range(12)))
    argv = ["train-drafter", "--model", str(target), "--method", "mtp", "--out",
            str(tmp_path / "h"), "--data", str(short), "--max-steps", "1", "--no-progress"]
    assert main(argv) == 2
    assert "data: none of the" in capsys.readouterr().err


def test_transformers_engine_writes_the_same_greedy_replies(setup, tmp_path):
    """`--engine transformers` (transformers' batched generate on our weights, left-padded
    prompts of several lengths in one batch) writes the records our engine wrote."""
    pytest.importorskip("transformers")
    root, target, src, out, argv = setup
    hf_out = tmp_path / "hf.jsonl"
    hf_argv = [a if a != str(out) else str(hf_out) for a in argv]
    assert main([*hf_argv, "--engine", "transformers", "--device", "cpu"]) == 0
    mine = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    theirs = [json.loads(line) for line in hf_out.read_text().splitlines()]
    assert len(theirs) == 6 and len({len(r["token_ids"][:r["prompt_len"]]) for r in theirs}) > 1
    for r in theirs:
        m = mine[r["id"]]
        assert (r["token_ids"], r["prompt_len"], r["finish_reason"]) == \
            (m["token_ids"], m["prompt_len"], m["finish_reason"])
        assert r["messages"] == m["messages"]
    meta = json.loads((tmp_path / "hf.jsonl.meta.json").read_text())
    assert meta["engine"] == "transformers"


def test_a_training_split_file_keeps_its_sources_heldout(setup, tmp_path):
    """A prompts file exported from a source's training split (its sidecar names the source's
    held-out split) is used whole, and the generated file's sidecar passes that split on."""
    root, target, src, _, _ = setup
    train, held = data_mod.split(data_mod.load_conversations(str(src)))
    part = tmp_path / "train_prompts.jsonl"
    part.write_text((root / "prompts.jsonl").read_text())
    source_held = data_mod.split_metadata(str(src), held)
    (tmp_path / "train_prompts.jsonl.meta.json").write_text(
        json.dumps({"source_heldout": source_held}))
    out = tmp_path / "gen.jsonl"
    assert main(["gen-drafter-data", "--model", str(target), "--data", str(part), "--out",
                 str(out), "--num-prompts", "30", "--max-tokens", "2", "--batch-size", "8",
                 "--chunk", "8", "--max-minutes", "0"]) == 0
    assert not out.exists() or out.read_text() == ""  # --max-minutes 0: no chunk started
    meta = json.loads((tmp_path / "gen.jsonl.meta.json").read_text())
    assert meta["source_heldout"] == source_held
    assert main(["gen-drafter-data", "--model", str(target), "--data", str(part), "--out",
                 str(out), "--num-prompts", "30", "--max-tokens", "2", "--batch-size", "8",
                 "--chunk", "8"]) == 0
    assert len(out.read_text().splitlines()) == 30  # none held out again
