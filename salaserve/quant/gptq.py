"""GPTQ (Frantar et al., 2022): int4 weights that minimise ||X W^T - X Q^T|| over calibration X.

Columns (input channels) are quantized one at a time; the rounding error of each column is spread
over the not-yet-quantized columns through the inverse Hessian H^-1, H = 2 X^T X. The paper's
tricks are all here: dampening, the upper Cholesky factor of H^-1 (numerically stable updates),
lazy batched updates over column blocks of 128, group scales found when a group's first column is
reached, act-order (descending diag(H)) and static groups. Runs on whatever device W and H are on.
"""

from __future__ import annotations

import math
import torch

from salaserve.quant.formats import GPTQ_V2, QuantizedLinearWeights, pack_int4, pack_zeros
from salaserve.quant.rtn import find_params, quantize_codes


class HessianAccumulator:
    """Running H = 2/n * sum x x^T over calibration rows x of the layer's input (fp32)."""

    def __init__(self, in_features: int, device=None):
        self.in_features = in_features
        self.hessian = torch.zeros(in_features, in_features, dtype=torch.float32, device=device)
        self.nsamples = 0

    def add(self, x: torch.Tensor) -> None:
        """x [..., in_features]: a batch of the layer's inputs (any leading shape)."""
        x = x.reshape(-1, self.in_features).to(device=self.hessian.device, dtype=torch.float32)
        n = x.shape[0]
        if n == 0:
            return
        # keep H a mean so that batches of different sizes weigh by their token counts
        self.hessian *= self.nsamples / (self.nsamples + n)
        self.nsamples += n
        x = x * math.sqrt(2.0 / self.nsamples)
        self.hessian += x.t() @ x


def _upper_cholesky_of_inverse(h: torch.Tensor) -> torch.Tensor:
    """Upper factor U of H^-1 = U^T U: row i of U gives the update of column i's error."""
    L = torch.linalg.cholesky(h)
    hinv = torch.cholesky_inverse(L)
    return torch.linalg.cholesky(hinv, upper=True)


def _damped_factor(h: torch.Tensor, percdamp: float) -> torch.Tensor:
    """Add percdamp * mean(diag H) to the diagonal; if H is still not positive definite (few
    calibration tokens), retry with 10x the dampening a few times before giving up."""
    mean_diag = torch.mean(torch.diag(h))
    eye = torch.eye(h.shape[0], device=h.device)
    for attempt in range(4):
        try:
            return _upper_cholesky_of_inverse(h + (percdamp * 10**attempt) * mean_diag * eye)
        except torch.linalg.LinAlgError:
            continue
    raise RuntimeError("GPTQ: Hessian is not positive definite even with 1000x dampening")


def gptq_quantize(
    w: torch.Tensor,
    hessian: torch.Tensor,
    group_size: int = 128,
    sym: bool = True,
    act_order: bool = False,
    static_groups: bool = False,
    percdamp: float = 0.01,
    block_size: int = 128,
    scale_dtype: torch.dtype = torch.float16,
) -> QuantizedLinearWeights:
    """W [N, K] and H [K, K] (from HessianAccumulator) -> w4a16 weights in GPTQ layout.

    act_order without static_groups gives a non-trivial g_idx (groups follow the quantization
    order); with static_groups the groups are fixed up front on the original order, so g_idx stays
    trivial and only the error-feedback order changes.
    """
    N, K = w.shape
    gs = K if group_size <= 0 else group_size
    W = w.detach().clone().float()
    H = hessian.detach().clone().float().to(W.device)

    dead = torch.diag(H) == 0  # inputs that never fire: any value is exact, pin them to 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0

    static = None
    if static_groups:  # grid per original group, from the untouched weights
        static = [find_params(W[:, g : g + gs], sym, scale_dtype) for g in range(0, K, gs)]

    perm = torch.arange(K, device=W.device)
    if act_order:
        perm = torch.argsort(torch.diag(H), descending=True)
        W, H = W[:, perm], H[perm][:, perm]
    perm_list = perm.tolist()  # host copy: no device sync per column in the loop below

    U = _damped_factor(H, percdamp)

    codes = torch.zeros(N, K, dtype=torch.uint8, device=W.device)  # in processing order
    grids: list[tuple[torch.Tensor, torch.Tensor]] = []  # groups in the order they were reached
    scale = zero = None
    for b0 in range(0, K, block_size):
        b1 = min(b0 + block_size, K)
        Wb = W[:, b0:b1].clone()
        Errb = torch.zeros_like(Wb)
        Ub = U[b0:b1, b0:b1]
        for i in range(b1 - b0):
            col = b0 + i
            if static is not None:
                scale, zero = static[perm_list[col] // gs]
            elif col % gs == 0:
                # this group's columns as they are now: in-block ones carry this block's updates
                cols = Wb[:, i : i + gs]
                if cols.shape[1] < gs:  # the group runs past this block
                    cols = torch.cat([cols, W[:, b1 : b1 + gs - cols.shape[1]]], dim=1)
                scale, zero = find_params(cols, sym, scale_dtype)
                grids.append((scale, zero))
            x = Wb[:, i]
            q = quantize_codes(x[:, None], scale, zero)[:, 0]
            codes[:, col] = q.to(torch.uint8)
            err = (x - (q - zero) * scale) / Ub[i, i]
            Wb[:, i:] -= err[:, None] * Ub[i, i:][None, :]
            Errb[:, i] = err
        W[:, b1:] -= Errb @ U[b0:b1, b1:]  # the lazy batch update for the columns still ahead

    invperm = torch.argsort(perm)
    codes = codes[:, invperm]  # back to the original input-channel order
    if static is not None:
        grids = static
        g_idx = torch.arange(K, device=W.device) // gs
    else:
        g_idx = (invperm // gs) if act_order else torch.arange(K, device=W.device) // gs
    scales = torch.stack([s for s, _ in grids]).to(scale_dtype)  # [G, N]
    zeros = torch.stack([z for _, z in grids]).to(torch.uint8)
    return QuantizedLinearWeights.from_gptq(
        pack_int4(codes.t()), pack_zeros(zeros, GPTQ_V2), scales, g_idx.to(torch.int32), gs, GPTQ_V2
    )


def gptq_quantize_from_inputs(w: torch.Tensor, inputs, **kwargs) -> QuantizedLinearWeights:
    """Convenience: feed an iterable of input batches [tokens, K], then quantize."""
    acc = HessianAccumulator(w.shape[1], device=w.device)
    for x in inputs:
        acc.add(x)
    return gptq_quantize(w, acc.hessian, **kwargs)

