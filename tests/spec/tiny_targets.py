"""Tiny targets with drafters, shared by the speculative-decoding tests."""
from __future__ import annotations

import torch

from specdeploy.models.registry import family_module

# arch → speculative method used with it
METHODS = {"llama": "eagle3", "nemotron_h": "mtp", "qwen3_5_moe": "mtp"}
# NOTE: the default page size (16 tokens; the scan chunk on hybrids: 16 for the tiny NemotronH,
# 64 for the tiny Qwen3.5 gated delta) and checkpoint spacing (every page): the deployed path
LIMITS = dict(max_batch_size=8, max_seq_len=256, max_cache_gib=0.05)
# the page size each tiny target deploys with by default
PAGE_SIZE = {"llama": 16, "nemotron_h": 16, "qwen3_5_moe": 64}


class Target:
    def __init__(self, arch: str, root):
        self.arch = arch
        self.method = METHODS[arch]
        self.path = root / arch
        fam = family_module(arch)
        fam.make_tiny(self.path, seed=0, mtp_layers=0 if arch == "llama" else 1)
        self.draft_model = None
        if self.method == "eagle3":
            from specdeploy.models.drafters.eagle3 import make_tiny_eagle3

            self.draft_model = root / f"{arch}_eagle3"
            make_tiny_eagle3(self.path, self.draft_model, seed=1)
        g = torch.Generator().manual_seed(1)
        # mixed prompt lengths 1..100, token ids away from the specials
        self.prompts = [torch.randint(3, 100, (n,), generator=g).tolist()
                        for n in (1, 7, 33, 100, 12)]

        self._llms: dict = {}

    def llm(self, k: int | None = None):
        """One LLM per (target, K) for the whole session: exporting dominates test time."""
        from specdeploy import LLM

        if k not in self._llms:
            spec = None if k is None else self.spec(k)
            self._llms[k] = LLM(str(self.path), spec=spec, **LIMITS)
        llm = self._llms[k]
        if k is not None:
            llm.engine.fix_drafts(None)
            llm.engine.set_lookup(None)
        return llm

    def spec(self, k: int, controller: str = "off"):
        """Fixed K by default (not SpecConfig's "cost"): the tests sharing these LLMs count K
        drafts per step, fix the drafts, or set their own controller (test_spec_controller.py).
        The drafter in the target's precision (not the default "auto", Q8_0 on this fp32 CPU
        path): tests here compare draft logits with the drafter module's; the Q8_0 drafter
        has its own (test_spec_greedy.py)."""
        from specdeploy import SpecConfig

        return SpecConfig(self.method, k, draft_model=None if self.draft_model is None
                          else str(self.draft_model), controller=controller,
                          draft_quantize=None)
