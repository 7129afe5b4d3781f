"""The grouped MoE path on a CUDA device (ops/moe_grouped.py): each way, and the registered op's
dispatch, against the CPU ref, with CUDA's sync debug mode set to fail on any host sync."""
from __future__ import annotations

import pytest
import torch

from specdeploy.ops import moe_experts_ref
from tests.ops.test_moe_grouped import _case

pytestmark = pytest.mark.cuda


@pytest.fixture(autouse=True)
def _restore_sync_mode():
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("impl", ["op", "auto", "gather", "padded", "grouped_mm"])
@pytest.mark.parametrize("shape", [(1, 2, 8, 64, 32), (37, 4, 16, 64, 32), (5, 3, 7, 40, 24)])
def test_grouped_moe_on_cuda(impl, dtype, shape):
    from specdeploy.ops.moe_grouped import aligned, moe_experts_grouped

    t, k, e, hdim, inter = shape
    case = _case(t, k, e, hdim, inter, "swiglu", dtype=dtype)
    expected = moe_experts_ref(*case).float()
    dev = [c.cuda() if isinstance(c, torch.Tensor) else c for c in case]
    if impl == "grouped_mm" and (dtype != torch.bfloat16 or not aligned(dev[3], dev[4])):
        pytest.skip("grouped_mm: bf16 and 16-byte rows only")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    if impl == "op":
        out = torch.ops.specdeploy.moe_experts(*dev)
    else:
        out = moe_experts_grouped(*dev, impl=impl)
    torch.cuda.set_sync_debug_mode("default")
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    scale = expected.abs().max().item()
    assert (out.float().cpu() - expected).abs().max().item() <= tol * scale


@pytest.mark.parametrize("kind", ["fp8", "nvfp4"])
@pytest.mark.parametrize("shape", [(1, 2, 8, 8), (37, 2, 6, 5)])  # gather / chunked
def test_quantized_experts_on_cuda(kind, shape):
    """FP8 / NVFP4 experts (ops/quant_moe.py) dispatched on a CUDA device: the sync-free ways,
    against the CPU oracle, failing on any host sync."""
    from tests.ops.test_quant_ops import _quant_case, _quant_op, _quant_ref

    case = _quant_case(kind, "swiglu", *shape)
    expected = _quant_ref(kind, case).float()
    dev = [c.cuda() if isinstance(c, torch.Tensor) else c for c in case]
    _quant_op(kind)(*dev)  # first call: per-device tables are copied once, outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    out = _quant_op(kind)(*dev)
    torch.cuda.set_sync_debug_mode("default")
    scale = expected.abs().max().item()
    assert (out.float().cpu() - expected).abs().max().item() <= 1e-5 * scale
