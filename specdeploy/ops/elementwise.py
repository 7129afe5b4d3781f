"""exp / silu / softplus / sigmoid for the recurrent layers' math on the CPU, each element the
same bits wherever it sits in its tensor (ops/row_kernels.c `elementwise`).

torch's vectorized kernels run the last elements of a tensor (its size modulo the vector
width) through a scalar path whose exp and log round otherwise, so a decode row's decay,
step size or gate changed in the last bit with the number of sequences batched beside it and
its place among them; the fast GGUF kernels' 8-bit activation rounding then turns that into
~1e-3 in logprob, and greedy speculation is not strictly lossless. Off the CPU, for other
dtypes, under autograd or without a C compiler: torch's own functions.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from specdeploy.ops import row_kernels


def exp(x: torch.Tensor) -> torch.Tensor:
    out = row_kernels.elementwise("exp", x)
    return torch.exp(x) if out is None else out


def silu(x: torch.Tensor) -> torch.Tensor:
    out = row_kernels.elementwise("silu", x)
    return F.silu(x) if out is None else out


def softplus(x: torch.Tensor) -> torch.Tensor:
    """torch's softplus with beta 1, threshold 20."""
    out = row_kernels.elementwise("softplus", x)
    return F.softplus(x) if out is None else out


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    out = row_kernels.elementwise("sigmoid", x)
    return torch.sigmoid(x) if out is None else out
