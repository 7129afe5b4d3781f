"""On the fast GGUF kernels, a row of a step is the same bits whatever rows are beside it: five
sequences' decode rows one step at a time equal the same tokens as one verify step of 5 x 4 or
5 x 5 rows. The oracle is the decode path itself (the non-speculative step).

What broke this before (deploy/passes/row_linears.py): above 16 rows the K-quant linears
left the integer-dot kernel for an fp32 GEMM (another model: 1e-2 apart in the logits); a
GGUF's F32 router ran on the BLAS, whose row bits depend on the call's row count; torch's
sigmoid and softplus round a tensor's tail elements otherwise than its body. Each moved the
8-bit activation rounding of the layers after it.
"""
from __future__ import annotations

import pytest
import torch

from specdeploy.cache.metadata import SEG_EXTEND, SEG_NORMAL, Segment, build_metadata
from specdeploy.deploy.build import build
from specdeploy.ops import ggml_int
from specdeploy.ops.ggml_linear import kernel_unavailable

pytestmark = pytest.mark.skipif(
    kernel_unavailable() is not None or ggml_int.kernel_unavailable() is not None,
    reason=f"ggml kernels unavailable: {kernel_unavailable() or ggml_int.kernel_unavailable()}")
gguf = pytest.importorskip("gguf")
pytest.importorskip("transformers")

S, PROMPT = 5, 21  # sequences, prompt tokens each
Q = pytest.importorskip("tests.checkpoint.test_gguf").Q


def _nemotron(tmp, qtype, expert_qtype):
    from specdeploy.models import nemotron_h as nh
    from tests.checkpoint.gguf_nemotron_h_layout import write_gguf
    from tests.checkpoint.test_gguf_nemotron_h import MOE

    # widths of 256 (K-quant blocks); 8 experts: a router row of 8 scores, so 5 rows of them
    # end mid-vector where torch's sigmoid takes its scalar tail
    hf = dict(MOE, hidden_size=256, mamba_num_heads=8, mamba_head_dim=32, head_dim=64,
              moe_intermediate_size=256, moe_shared_expert_intermediate_size=256,
              moe_latent_size=256)
    src = nh.make_tiny(tmp / "st", seed=3, mtp_layers=1, hf_config=hf)
    return write_gguf(src, tmp / "m.gguf", qtype=qtype, expert_qtype=expert_qtype)


def _qwen(tmp, qtype, expert_qtype):
    from specdeploy.models import qwen3_5_moe as q35
    from tests.checkpoint.gguf_qwen3_5_layout import write_gguf

    hf = q35.tiny_hf_config(1)
    if qtype == Q.Q4_K:  # value heads of 64: `ssm_out` on K-quant blocks, columns reordered
        hf["text_config"]["linear_value_head_dim"] = 64
    src = q35.make_tiny(tmp / "st", seed=4, mtp_layers=1, hf_config=hf)
    return write_gguf(src, tmp / "m.gguf", qtype=qtype, expert_qtype=expert_qtype)


CASES = {  # name: (writer, matrices, experts)
    "nemotron_q8_0": (_nemotron, "Q8_0", "Q8_0"),  # F32 router + sigmoid
    "nemotron_kquants": (_nemotron, "Q4_K", "Q6_K"),  # K-quants at 20 / 25 rows
    "qwen3_5_q8_0": (_qwen, "Q8_0", "Q8_0"),  # F32 matrices, softplus / sigmoid gates
    "qwen3_5_kquants": (_qwen, "Q4_K", "Q4_K"),  # + `ssm_out` blocks read in stored order
}


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    writer, q, e = CASES[request.param]
    return request.param, writer(tmp_path_factory.mktemp(request.param), getattr(Q, q),
                                 getattr(Q, e))


_DEPLOYED: dict = {}


def _deployed(path, **opts):
    """One deployment per case and options: export is most of this file's time, and every
    use below prefills its sequences from position 0 (a zero recurrent state) first."""
    key = (str(path), repr(sorted(opts.items())))
    if key not in _DEPLOYED:
        _DEPLOYED[key] = build(str(path), kernels="fast", max_seq_len=64, page_size=4, **opts)
    return _DEPLOYED[key]


def _logits(path, rows: int, verify: bool) -> torch.Tensor:
    """[S, rows, vocab]: each sequence's last `rows` tokens decoded one step at a time (all S
    sequences a step) or verified in one step of S x rows (one deployment for both: the
    verify step's rows would show any state a decode left behind)."""
    dep = _deployed(path, max_batch_size=S, max_cache_gib=0.05,
                    spec={"method": "ngram", "num_speculative_tokens": rows - 1})
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(3, 120, (PROMPT + rows,), generator=g).tolist() for _ in range(S)]
    pages = [list(range(16 * s, 16 * s + 16)) for s in range(S)]
    for s in range(S):
        dep.forward(build_metadata([Segment(ids[s][:PROMPT], 0, pages[s], s, 1, SEG_NORMAL)]))
    if verify:
        segs = [Segment(ids[s][PROMPT:], PROMPT, pages[s], s, rows, SEG_EXTEND) for s in range(S)]
        return dep.forward(build_metadata(segs)).logits.view(S, rows, -1), dep
    steps = []
    for t in range(rows):
        segs = [Segment(ids[s][PROMPT + t:PROMPT + t + 1], PROMPT + t, pages[s], s, 1,
                        SEG_NORMAL) for s in range(S)]
        steps.append(dep.forward(build_metadata(segs)).logits)
    return torch.stack(steps, 1), dep


@pytest.mark.parametrize("rows", [4, 5])
def test_verify_rows_equal_decode_rows_on_fast_kernels(case, rows):
    _, path = case
    decoded, dep = _logits(path, rows, verify=False)
    verified, _ = _logits(path, rows, verify=True)
    assert decoded.std() > 1e-3 and torch.isfinite(decoded).all()
    assert torch.equal(decoded, verified), (decoded - verified).abs().max().item()
    infos = {i.name: i for i in dep.target.infos}
    info = infos["row_invariant_linears"]
    assert info.num_matches > 0, info.detail  # routers / gates moved to the kernels
    # decode steps ran each recurrent mixer as one C call, verify steps the graph's chain
    assert infos["fuse_recurrent_mixers"].num_matches > 0, infos["fuse_recurrent_mixers"]


def test_exact_kernels_keep_the_blas(case):
    _, path = case
    dep = build(str(path), kernels="exact", max_batch_size=2, max_seq_len=64, page_size=4,
                max_cache_gib=0.02)
    info = {i.name: i for i in dep.infos}["row_invariant_linears"]
    assert info.num_matches == 0 and "the fp32 model keeps torch's fp32 linears" in info.detail


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_prefill_cut_by_any_budget_gives_the_same_bits(case, prefix_caching):
    """A prompt longer than the token budget is prefilled in chunks cut where the budget ends:
    on a hybrid those cuts land on page (= scan chunk) boundaries, so budgets that cut it
    differently give the same logprobs bit for bit (before, with prefix caching off, a cut
    inside a scan chunk moved the fast kernels' logits by up to 5e-2)."""
    from specdeploy import LLM, SamplingParams

    _, path = case
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=3)
    got = {}
    for budget in (512, 300, 150):
        llm = LLM(str(path), max_seq_len=512, spec=None, kernels="fast", max_num_tokens=budget,
                  enable_prefix_caching=prefix_caching)
        page = llm.engine.deployed.layout.page_size
        assert budget >= page and llm.engine.scheduler.chunk_align == page
        prompt = torch.randint(3, 120, (2 * page + 77,),
                               generator=torch.Generator().manual_seed(2)).tolist()
        out = llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0]
        got[budget] = (out.token_ids, [{t: getattr(v, "logprob", v) for t, v in lp.items()}
                                       for lp in out.logprobs])
    assert got[300] == got[512] and got[150] == got[512]


@pytest.mark.parametrize("method", ["mtp", "ngram"])
def test_speculation_on_fast_kernels_is_plain_bit_for_bit(case, method):
    """Greedy MTP / n-gram speculation on a hybrid GGUF with the fast kernels: the same tokens
    and the same logprobs, bit for bit, as plain decoding, with more prompts than batch slots
    (admissions at other steps) and a budget that cuts prompts (prefill chunks beside other
    verify steps). Before, a decode row's decay / gate exps (torch's vectorized tails), the
    router's BLAS rows and K-quant GEMMs above 16 rows each moved some logprobs by 1e-7..1e-2."""
    from specdeploy import LLM, SamplingParams

    _, path = case
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 120, (int(n),), generator=g).tolist()
               for n in torch.randint(5, 200, (12,), generator=g)]
    prompts += [[5, 6, 7, 8] * 10, [9, 10, 11] * 20]  # n-gram lookups hit here
    sp = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=2)
    runs = {}
    for spec in (None, {"method": method, "num_speculative_tokens": 3, "controller": "off",
                        "prompt_lookup_min": 1} if method == "ngram" else
                 {"method": method, "num_speculative_tokens": 3, "controller": "off"}):
        if spec is None and str(path) in _PLAIN:  # the same plain run for both methods
            runs[True] = _PLAIN[str(path)]
            continue
        llm = LLM(str(path), max_seq_len=512, spec=spec, kernels="fast", max_batch_size=5,
                  max_num_tokens=256)
        outs = llm.generate(prompts, sp, use_tqdm=False)
        runs[spec is None] = [(o.outputs[0].token_ids, [
            {t: getattr(v, "logprob", v) for t, v in lp.items()} for lp in o.outputs[0].logprobs])
            for o in outs]
        if spec is None:
            _PLAIN[str(path)] = runs[True]
    assert llm.stats()["draft_tokens"] > 0  # verify steps ran
    assert runs[False] == runs[True]


_PLAIN: dict = {}  # case -> the plain run of test_speculation_on_fast_kernels_is_plain_bit_for_bit


def test_a_decode_row_is_the_same_bits_last_of_nine_or_alone(case):
    """Nine sequences decoded together for five steps, against the ninth decoded alone: its
    logits the same bits (its rows are the last of the recurrent ops' batched decode math,
    where torch's vectorized kernels put their scalar tails)."""
    _, path = case
    steps = 5
    got = []
    for rows in (range(9), [8]):
        dep = _deployed(path, max_batch_size=9, max_cache_gib=0.1)
        g = torch.Generator().manual_seed(0)
        ids = [torch.randint(3, 120, (PROMPT + steps,), generator=g).tolist() for _ in range(9)]
        pages = [list(range(16 * s, 16 * s + 16)) for s in range(9)]
        for s in range(9):
            dep.forward(build_metadata([Segment(ids[s][:PROMPT], 0, pages[s], s, 1,
                                                SEG_NORMAL)]))
        out = []
        for t in range(PROMPT, PROMPT + steps):
            segs = [Segment(ids[s][t:t + 1], t, pages[s], s, 1, SEG_NORMAL) for s in rows]
            out.append(dep.forward(build_metadata(segs)).logits[-1])
        got.append(torch.stack(out))
    assert torch.equal(got[0], got[1]), (got[0] - got[1]).abs().max().item()
