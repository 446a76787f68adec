"""Torch reference ops: the CPU oracle every Triton/CUDA kernel is tested against.

Accuracy over speed: everything computes in fp32 and casts back to the input dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from runtime.kv.layer import LayerKV

# Activations by their Hugging Face names (config.hidden_act).
ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim] rotated in its two halves (the rotate-half convention), in x's
    dtype op by op: what the fused rotary kernels reproduce bit for bit."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x**2) + eps) * weight`` over the last dim, in fp32, cast to ``x.dtype``."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (xf * weight.float()).to(x.dtype)


def attention_mask(
    context_len: int,
    query_len: int,
    sliding_window: int | None = None,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Boolean ``[query_len, context_len]``, True where query j (absolute position
    ``context_len - query_len + j``) may attend key position p: ``p <= pos`` and, with a
    sliding window, ``p > pos - sliding_window`` (the window counts the token itself)."""
    qpos = torch.arange(context_len - query_len, context_len, device=device)[:, None]
    kpos = torch.arange(context_len, device=device)[None, :]
    mask = kpos <= qpos
    if sliding_window is not None:
        mask &= kpos > qpos - sliding_window
    return mask


def paged_attention(
    q: torch.Tensor,
    kv: LayerKV,
    block_tables: list[torch.Tensor],
    context_lens: list[int],
    query_lens: list[int],
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its paged K/V (one layer's).

    ``q`` is ``[sum(query_lens), num_heads, head_dim]``: the new tokens of all sequences,
    concatenated in order. Sequence i's queries are its last ``query_lens[i]`` of
    ``context_lens[i]`` tokens, whose K/V are all in ``kv`` already. Covers prefill
    (query_len == context_len), chunked prefill over a cached prefix, and decode
    (query_len 1). Grouped-query: query head h reads KV head ``h // (num_heads //
    num_kv_heads)``. Returns ``[sum(query_lens), num_heads, head_dim]`` in ``q.dtype``.
    """
    spec = kv.spec
    if not (len(block_tables) == len(context_lens) == len(query_lens)):
        raise ValueError(
            f"{len(block_tables)} block tables, {len(context_lens)} context lens, "
            f"{len(query_lens)} query lens: expected one of each per sequence"
        )
    if q.dim() != 3 or q.shape[0] != sum(query_lens) or q.shape[2] != spec.head_dim:
        raise ValueError(
            f"q {list(q.shape)} must be [sum(query_lens)={sum(query_lens)}, heads, "
            f"head_dim={spec.head_dim}]"
        )
    num_heads = q.shape[1]
    if num_heads % spec.num_kv_heads:
        raise ValueError(f"{num_heads} query heads not a multiple of {spec.num_kv_heads} KV heads")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    group = num_heads // spec.num_kv_heads

    out = torch.empty_like(q)
    start = 0
    for table, ctx, qlen in zip(block_tables, context_lens, query_lens, strict=True):
        if not 0 <= qlen <= ctx:
            raise ValueError(f"query_len {qlen} must be in [0, context_len {ctx}]")
        if qlen == 0:
            continue
        k, v = kv.gather(table, ctx)  # [ctx, Hkv, D]
        qi = q[start : start + qlen].float().transpose(0, 1)  # [H, qlen, D]
        k = k.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, ctx, D]
        v = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
        mask = attention_mask(ctx, qlen, sliding_window, device=q.device)
        o = F.scaled_dot_product_attention(qi, k, v, attn_mask=mask, scale=scale)
        out[start : start + qlen] = o.transpose(0, 1).to(q.dtype)
        start += qlen
    return out
