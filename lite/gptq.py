"""GPTQ rounding (Frantar et al. 2022) of AWQ-scaled weights: the same groups, codes and
(scale, zero) format as round-to-nearest, chosen column by column so that each column's
rounding error is compensated on the columns not yet quantized, weighted by the inputs'
Gram matrix H = X^T X that the scale search already collected.

Why: after AWQ's scales and clip, round-to-nearest still rounds every weight on its own. The
error that matters is the output's, tr(E H E^T), and correlated input channels let a later
column absorb an earlier one's error. This is the rounding llm-compressor and AutoGPTQ use
for GPTQ; here it runs after the AWQ search, on the scaled weights, with each group's
(scale, zero) taken from the partly updated weights when the group starts (GPTQ's own rule)
and the clip search's ratio applied to that range.

Within each group the columns go in decreasing order of input energy (diag H): GPTQ's
act-order, limited to contiguous groups because the artifact's layout has no per-column group
index (a global order with groups fixed in advance, "static groups", measured worse). The
loudest channels are rounded first and the error left where compensation runs out lands on
the quiet ones; on SmolLM2 it was better in domain and out of it (evals/bench/RESULTS.md,
issue 18).
"""

from __future__ import annotations

import torch

from lite.quantizer import QuantizedWeight, QuantSpec, compute_params

# Of the mean diagonal of H added to its diagonal. GPTQ's own default is 0.01, enough to keep
# H invertible; on SmolLM2 calibrated on pydoc it fitted the calibration text and lost on
# other text (0.60x the Gram search's loss in domain, 1.31x on general English). More damping
# trades some of the in-domain gain for robustness; 3 was the best balance measured on 16
# windows a text, and on quantize.py's full protocol it leaves 0.68x round-to-nearest's loss
# in domain, 0.97x on general English, 0.92x on ARC questions (evals/bench/RESULTS.md, issue 18).
DAMP = 3.0
BLOCK = 128  # columns updated together before the lazy update of the rest


def _inverse_cholesky(gram: torch.Tensor, dead: torch.Tensor, damp: float) -> torch.Tensor:
    """Upper Cholesky factor of (H + damp * mean(diag H) * I)^-1 in fp64: GPTQ's sequential
    update reads its rows. Input channels that never fire (zero diagonal) get a unit diagonal.

    At most two K x K fp64 matrices are alive at once (one is 1.6 GB at an 8B model's K of
    14336, where a layer's whole calibration holds about 7 GB): each intermediate is dropped
    as soon as the next exists, and the triangular inverse is solved in place into the
    identity, laid out column-major as LAPACK writes it (the same bits as a solve into a new
    matrix)."""
    h = gram.to(torch.float64, copy=True)
    h[dead, dead] = 1.0
    h.diagonal().add_(damp * float(h.diagonal().mean()))
    # H = R R^T with R upper (the Cholesky factor of H with its channels reversed), so
    # H^-1 = R^-T R^-1 and R^-1 is the factor: one factorization and one triangular inverse
    # instead of inverting H and factoring the inverse (half the time where K is 1536).
    h = h.flip(0, 1)
    r = torch.linalg.cholesky(h)
    del h
    r = r.flip(0, 1)
    inv = torch.eye(r.shape[0], dtype=r.dtype, device=r.device).mT
    torch.linalg.solve_triangular(r, inv, upper=True, out=inv)
    del r
    return inv.contiguous()


def gptq_quantize(
    w: torch.Tensor,
    gram: torch.Tensor,
    spec: QuantSpec,
    clip_ratio: torch.Tensor | float = 1.0,
    damp: float = DAMP,
    group_act_order: bool = True,
) -> QuantizedWeight:
    """w [N, K] -> codes and per-(row, group) params, as lite.quantizer.quantize gives them.
    `gram`: [K, K] of the inputs w meets; `clip_ratio`: per (row, group) or one float.
    `group_act_order`: within each group, columns of larger input energy (diag H) first."""
    n, k = w.shape
    gs = spec.group_size
    groups = -(-k // gs)
    perm = _group_act_order(gram, gs) if group_act_order else None
    if perm is not None:
        w, gram = w[:, perm], gram[perm[:, None], perm]
    w = w.to(torch.float64, copy=True)
    dead = gram.diagonal() == 0
    w[:, dead] = 0
    hinv = _inverse_cholesky(gram, dead, damp)
    del gram  # the permuted copy: the loop reads hinv alone
    q = torch.empty(n, k, dtype=torch.uint8, device=w.device)
    scale = torch.empty(n, groups, dtype=torch.float32, device=w.device)
    zero = torch.empty(n, groups, dtype=torch.int32, device=w.device)
    for b0 in range(0, k, BLOCK):
        b1 = min(b0 + BLOCK, k)
        # column-major: a column and the later columns of the block are contiguous rows
        block, h = w[:, b0:b1].T.contiguous(), hinv[b0:b1, b0:b1]
        codes, errors = torch.empty_like(block), torch.empty_like(block)
        inv_diag = 1 / h.diagonal()
        for i in range(b1 - b0):
            col = b0 + i
            if col % gs == 0:  # the group's range from the weights as updated so far
                g = col // gs
                ratio = clip_ratio if isinstance(clip_ratio, float) else clip_ratio[:, g : g + 1]
                sg, zg = compute_params(block[i : i + gs].T.float(), spec, ratio)  # BLOCK % gs == 0
                scale[:, g], zero[:, g] = sg[:, 0], zg[:, 0]
                s, z = sg[:, 0].double(), zg[:, 0].double()
            x = block[i]
            code = torch.round(x / s).add_(z).clamp_(0, spec.qmax)
            codes[i] = code
            err = errors[i]
            torch.mul(x - (code - z) * s, inv_diag[i], out=err)
            # the later columns of the block absorb this one's error, in place
            block[i + 1 :].addr_(h[i, i + 1 :], err, alpha=-1)
        q[:, b0:b1] = codes.T.to(torch.uint8)
        w[:, b1:] -= errors.T @ hinv[b0:b1, b1:]
    if perm is not None:
        q = q[:, torch.argsort(perm)]
    return QuantizedWeight(q=q, scale=scale, zero=zero)


def _group_act_order(gram: torch.Tensor, gs: int) -> torch.Tensor:
    """A column order that keeps every group's columns together (so the layout's contiguous
    groups and GPTQ's rule for a group's range still hold) and takes each group's columns by
    decreasing diag H: GPTQ's act-order, limited to what contiguous groups allow."""
    by_energy = torch.sort(-gram.diagonal().float(), stable=True).indices
    group_of = torch.div(by_energy, gs, rounding_mode="floor")
    return by_energy[torch.sort(group_of, stable=True).indices]
