"""Paged attention in Triton: flash-decoding for single-token decode, a variable-length
flash-attention kernel for prefill and mixed batches, over fp16/bf16/fp32 or int8/int4 KV.

Design, and why:

* **Grouped-query packing.** A program owns one KV head and every query head that reads it,
  so each K/V tile is loaded (and dequantized) once per group instead of once per query head.
  The group's rows become the M side of ``tl.dot``: decode pads the group to at least 16
  rows (``tl.dot`` needs M >= 16; the padding rows are masked, cheap next to the memory
  traffic), prefill packs ``BLOCK_Q`` query tokens x the group (rounded up to a power of two)
  into ``BLOCK_M`` rows.
* **Paging per token.** Each KV tile of ``BLOCK_N`` tokens looks up every token's block in
  the block table (``pos // block_size``), so the tile size is independent of the pool's
  block size (16..128 and beyond, any value) and non-contiguous tables cost nothing extra.
* **Dequantize in the tile loop.** int8/int4 codes are turned into ``q * scale + zero`` in
  fp32 right after the load, then cast to the KV dtype as ``KVCache.read`` does, so the
  kernel sees the reference's K/V (a GPU may fuse the multiply-add: one fp32 rounding less);
  int4 tiles load the packed bytes contiguously and join the low and high nibbles back into
  elements ``2i`` and ``2i + 1``, except tiles under 1024 elements (``_JOIN_MIN_ELEMENTS``),
  which read byte ``d // 2`` for each element ``d`` and shift out its nibble. On an H200 under
  triton 3.6 (2026-12-04) the join gave wrong K/V in 16 x 32 and 32 x 16 (tokens x dims)
  decode tiles, where the interpreter agreed with the reference, and right ones in 64 x 16,
  64 x 32 and 64 x 128 tiles. The per-element load is right at every size, but took 2.4-7x as
  long over int4 KV at 32k tokens and spills registers at head dim 256.
* **Flash-decoding.** Decode has one query per sequence, so the context is split into
  partitions run by separate programs (``[B, Hkv, partitions]``); each writes its running
  max, sum and unnormalized output and counts itself in on its (sequence, KV head)'s counter
  (runtime/kernels/counters.py), and the last to finish merges the partitions by log-sum-exp,
  in partition order, and sets the counter back to 0: no second kernel, which a decode step
  would launch in every layer. With one partition the program normalizes and writes the
  output itself. The number of partitions comes from the block-table width, not from
  ``context_lens``, so no device sync happens: programs past a sequence's end return at once
  (the merge reads only the sequence's own partitions, and counts only those), and one
  before its sliding window stores max -inf, sum 0, output 0, which the merge weights 0.
* **Variable-length prefill without a sync.** The grid has ``T // BLOCK_Q + S`` tiles per KV
  head; sequence i's tiles start at ``cu_query_lens[i] // BLOCK_Q + i`` (an upper bound on
  the tiles before it), so each program finds its sequence by counting starts, and spare
  programs return at once.
* **Numerics.** Scores and softmax in fp32 (``exp2`` with ``log2(e)`` folded into the
  scale), masked scores are -inf, and a fully masked row never produces NaN (its max is
  replaced by 0 before exponentiation). Probabilities are cast to the KV dtype for the
  ``P @ V`` dot, as flash attention does; fp32 KV uses IEEE dots (not TF32).
* **Tiles per GPU generation.** The prefill tile depends on the architecture Triton compiles
  for: on sm_90 ``wgmma`` reads its operands from shared memory and 128-row tiles fit in
  registers; on sm_8x (``mma.sync``: A100, A10, L4, RTX 30/40) the same tiles spill up to 1 KiB
  a thread with int8 KV, so they are 64 rows on 8 warps, and past 128-wide heads 16-token KV
  tiles, or 32 rows for quantized KV (every launch compiled offline for both with triton 3.6
  and 3.9, no spills: ``tests/triton_compile.py``).

head_dim may be any size: tiles are padded to a power of two (at least 16) with masks.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl
from triton.runtime.driver import driver
from triton.runtime.interpreter import InterpretedFunction

from runtime.device import check_devices
from runtime.kernels.counters import arrival_counters
from runtime.kernels.triton.launch import pdl_launch, wait_for_producers
from runtime.kv.layer import LayerKV

_LOG2E = math.log2(math.e)
DEFAULT_PARTITION = 512  # tokens per decode partition (rounded up to whole blocks)
_JOIN_MIN_ELEMENTS = tl.constexpr(1024)  # the smallest int4 tile joined, tokens x dims (docstring)
_MERGE_BLOCK_P = 32
_SEQ_BLOCK = 32  # cu_query_lens entries a prefill program scans at a time for its sequence


@triton.jit
def _load_kv_tile(
    cache_ptr,
    scale_ptr,
    zero_ptr,
    block,
    offset,
    kv_head,
    mask_n,
    stride_cb,
    stride_co,
    stride_ch,
    stride_pb,
    stride_po,
    stride_ph,
    HEAD_DIM: tl.constexpr,
    QUANT: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """K or V of ``BLOCK_N`` tokens (``block``/``offset`` int64 [BLOCK_N]) as
    ``[BLOCK_N, BLOCK_D]`` in ``OUT_DTYPE``; masked entries are 0."""
    row = (block * stride_cb + offset * stride_co + kv_head * stride_ch)[:, None]
    if QUANT == 2 and BLOCK_N * BLOCK_D >= _JOIN_MIN_ELEMENTS:  # nibbles joined: (2i, 2i + 1)
        offs_b = tl.arange(0, BLOCK_D // 2)
        mask = mask_n[:, None] & (offs_b < HEAD_DIM // 2)[None, :]
        byte = tl.load(cache_ptr + row + offs_b[None, :], mask=mask, other=0).to(tl.int32)
        codes = tl.join(byte & 0xF, byte >> 4).reshape(BLOCK_N, BLOCK_D).to(tl.float32)
    elif QUANT == 2:  # element d: the low (even d) or high (odd d) nibble of byte d // 2
        offs_d = tl.arange(0, BLOCK_D)
        mask = mask_n[:, None] & (offs_d < HEAD_DIM)[None, :]
        byte = tl.load(cache_ptr + row + (offs_d // 2)[None, :], mask=mask, other=0)
        codes = ((byte.to(tl.int32) >> ((offs_d % 2) * 4)[None, :]) & 0xF).to(tl.float32)
    else:
        offs_d = tl.arange(0, BLOCK_D)
        mask = mask_n[:, None] & (offs_d < HEAD_DIM)[None, :]
        codes = tl.load(cache_ptr + row + offs_d[None, :], mask=mask, other=0)
        if QUANT == 0:
            return codes
        codes = codes.to(tl.float32)
    param = block * stride_pb + offset * stride_po + kv_head * stride_ph
    scale = tl.load(scale_ptr + param, mask=mask_n, other=0.0).to(tl.float32)
    zero = tl.load(zero_ptr + param, mask=mask_n, other=0.0).to(tl.float32)
    return (codes * scale[:, None] + zero[:, None]).to(OUT_DTYPE)


@triton.jit
def _dot(a, b, acc, PRECISION: tl.constexpr, WIDEN: tl.constexpr):
    """``a @ b (+ acc)`` in fp32. ``WIDEN`` (interpreted bf16) multiplies fp32 copies, exact
    for bf16 products: the interpreter's dot would read bf16 storage as raw integers."""
    if WIDEN:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc=acc, input_precision="ieee")
    return tl.dot(a, b, acc=acc, input_precision=PRECISION)


@triton.jit
def _attend_tile(
    q,
    q_pos,
    start,
    end,
    table,
    max_blocks,
    kv_head,
    m_i,
    l_i,
    acc,
    k_cache,
    v_cache,
    k_scale,
    k_zero,
    v_scale,
    v_zero,
    stride_cb,
    stride_co,
    stride_ch,
    stride_pb,
    stride_po,
    stride_ph,
    qk_scale,
    window,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    QUANT: tl.constexpr,
    SLIDING: tl.constexpr,
    PRECISION: tl.constexpr,
    WIDEN: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """One online-softmax step of the rows of ``q`` (absolute positions ``q_pos``) over the
    KV positions ``[start, start + BLOCK_N)`` that are below ``end``; returns (m, l, acc)."""
    pos = start + tl.arange(0, BLOCK_N)
    in_range = (pos < end) & (pos // BLOCK_SIZE < max_blocks)
    block = tl.load(table + pos // BLOCK_SIZE, mask=in_range, other=0).to(tl.int64)
    offset = (pos % BLOCK_SIZE).to(tl.int64)
    k = _load_kv_tile(
        k_cache, k_scale, k_zero, block, offset, kv_head, in_range,
        stride_cb, stride_co, stride_ch, stride_pb, stride_po, stride_ph,
        HEAD_DIM, QUANT, q.dtype, BLOCK_D, BLOCK_N,
    )  # fmt: skip
    scores = _dot(q, tl.trans(k), None, PRECISION, WIDEN) * qk_scale
    valid = in_range[None, :] & (pos[None, :] <= q_pos[:, None])
    if SLIDING:
        valid &= pos[None, :] > q_pos[:, None] - window
    scores = tl.where(valid, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing valid yet
    p = tl.exp2(scores - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    v = _load_kv_tile(
        v_cache, v_scale, v_zero, block, offset, kv_head, in_range,
        stride_cb, stride_co, stride_ch, stride_pb, stride_po, stride_ph,
        HEAD_DIM, QUANT, q.dtype, BLOCK_D, BLOCK_N,
    )  # fmt: skip
    acc = _dot(p.to(q.dtype), v, acc * alpha[:, None], PRECISION, WIDEN)
    return m_new, l_i * alpha + tl.sum(p, axis=1), acc


@triton.jit
def _attend(
    q,
    q_pos,
    lo,
    end,
    table,
    max_blocks,
    kv_head,
    k_cache,
    v_cache,
    k_scale,
    k_zero,
    v_scale,
    v_zero,
    stride_cb,
    stride_co,
    stride_ch,
    stride_pb,
    stride_po,
    stride_ph,
    qk_scale,
    window,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    QUANT: tl.constexpr,
    SLIDING: tl.constexpr,
    PRECISION: tl.constexpr,
    INTERPRETED: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Online softmax of ``q``'s rows over KV positions ``[lo, end)`` in ``BLOCK_N`` tiles;
    returns the unnormalized (max, sum, output) in fp32, max in the log2 domain.

    Compiled, the tiles run in a ``for`` loop (software-pipelined); interpreted, in a ``while``
    loop, because the interpreter's ``range`` cannot take tensor bounds under numpy >= 2.4."""
    rows: tl.constexpr = q.shape[0]
    m_i = tl.full([rows], float("-inf"), tl.float32)
    l_i = tl.zeros([rows], tl.float32)
    acc = tl.zeros([rows, BLOCK_D], tl.float32)
    widen: tl.constexpr = INTERPRETED and q.dtype == tl.bfloat16
    if INTERPRETED:
        start = lo
        while start < end:
            m_i, l_i, acc = _attend_tile(
                q, q_pos, start, end, table, max_blocks, kv_head, m_i, l_i, acc,
                k_cache, v_cache, k_scale, k_zero, v_scale, v_zero,
                stride_cb, stride_co, stride_ch, stride_pb, stride_po, stride_ph,
                qk_scale, window, BLOCK_SIZE, HEAD_DIM, QUANT, SLIDING, PRECISION, widen,
                BLOCK_D, BLOCK_N,
            )  # fmt: skip
            start += BLOCK_N
    else:
        for start in range(lo, end, BLOCK_N):
            m_i, l_i, acc = _attend_tile(
                q, q_pos, start, end, table, max_blocks, kv_head, m_i, l_i, acc,
                k_cache, v_cache, k_scale, k_zero, v_scale, v_zero,
                stride_cb, stride_co, stride_ch, stride_pb, stride_po, stride_ph,
                qk_scale, window, BLOCK_SIZE, HEAD_DIM, QUANT, SLIDING, PRECISION, widen,
                BLOCK_D, BLOCK_N,
            )  # fmt: skip
    return m_i, l_i, acc


# do_not_specialize: integers that change from step to step. Triton would otherwise compile a
# variant the first time one of them is 1 or a multiple of 16: about a second on a GPU, inside
# a request (tests/test_triton_request_path.py).
@triton.jit(do_not_specialize=["max_blocks", "stride_bt", "num_partitions"])
def _decode_partition_kernel(
    q_ptr,
    k_cache,
    v_cache,
    k_scale,
    k_zero,
    v_scale,
    v_zero,
    block_tables,
    context_lens,
    out_ptr,
    part_m,
    part_l,
    part_acc,
    counters,
    qk_scale,
    window,
    max_blocks,
    stride_qb,
    stride_qh,
    stride_bt,
    stride_ob,
    stride_oh,
    stride_cb,
    stride_co,
    stride_ch,
    stride_pb,
    stride_po,
    stride_ph,
    num_heads,
    num_partitions,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    PARTITION: tl.constexpr,
    QUANT: tl.constexpr,
    SLIDING: tl.constexpr,
    SINGLE: tl.constexpr,
    PRECISION: tl.constexpr,
    INTERPRETED: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_P: tl.constexpr,
    PDL: tl.constexpr,
):
    """One (sequence, KV head, partition): the group's query heads are the dot's rows; the
    last partition of the (sequence, KV head) to finish merges them all (module docstring)."""
    wait_for_producers(PDL)
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    ctx = tl.load(context_lens + b).to(tl.int32)
    part_start = part * PARTITION
    if part_start >= ctx:  # past this sequence's end: the merge reads only cdiv(ctx, PARTITION)
        return
    end = tl.minimum(part_start + PARTITION, ctx)
    lo = part_start
    if SLIDING:  # skip to the first tile (on this partition's grid) inside the window
        lo += (tl.maximum(ctx - window, part_start) - part_start) // BLOCK_N * BLOCK_N

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + offs_g
    mask = (offs_g < GROUP)[:, None] & (offs_d < HEAD_DIM)[None, :]
    b64 = b.to(tl.int64)
    q = tl.load(
        q_ptr + b64 * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=mask,
        other=0.0,
    )
    q_pos = tl.full([BLOCK_G], 0, tl.int32) + ctx - 1
    m_i, l_i, acc = _attend(
        q, q_pos, lo, end, block_tables + b64 * stride_bt, max_blocks, kv_head,
        k_cache, v_cache, k_scale, k_zero, v_scale, v_zero,
        stride_cb, stride_co, stride_ch, stride_pb, stride_po, stride_ph,
        qk_scale, window, BLOCK_SIZE, HEAD_DIM, QUANT, SLIDING, PRECISION, INTERPRETED,
        BLOCK_D, BLOCK_N,
    )  # fmt: skip
    if SINGLE:
        tl.store(
            out_ptr + b64 * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
            (acc / l_i[:, None]).to(out_ptr.dtype.element_ty),
            mask=mask,
        )
    else:  # partials [B, H, P] and [B, H, P, BLOCK_D]; one before the window stores -inf, 0, 0
        row = (b64 * num_heads + heads) * num_partitions + part
        mask_g = offs_g < GROUP
        tl.store(part_m + row, m_i, mask=mask_g)
        tl.store(part_l + row, l_i, mask=mask_g)
        # all BLOCK_D columns (the padding ones are 0), so the merge reads no garbage
        tl.store(part_acc + row[:, None] * BLOCK_D + offs_d[None, :], acc, mask=mask_g[:, None])
        tl.debug_barrier()  # every thread's partials are stored before the count releases them
        counter = counters + b * tl.num_programs(1) + kv_head
        arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        used = tl.minimum(tl.cdiv(ctx, PARTITION), num_partitions)
        if arrived == used - 1:
            for g in range(GROUP):
                head = kv_head * GROUP + g
                _merge_head(
                    part_m, part_l, part_acc, (b64 * num_heads + head) * num_partitions, used,
                    out_ptr + b64 * stride_ob + head * stride_oh, HEAD_DIM, INTERPRETED,
                    BLOCK_D, BLOCK_P,
                )  # fmt: skip
            tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")


@triton.jit
def _merge_step(
    part_m,
    part_l,
    part_acc,
    base,
    p0,
    used,
    m_run,
    l_run,
    o_run,
    BLOCK_D: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    """Fold partitions ``[p0, p0 + BLOCK_P)`` (of ``used``) into the running (max, sum, out)."""
    offs_p = p0 + tl.arange(0, BLOCK_P)
    mask_p = offs_p < used
    # .cg: from L2, where the other partitions' programs left them, never a stale L1 line
    m = tl.load(part_m + base + offs_p, mask=mask_p, other=float("-inf"), cache_modifier=".cg")
    l_p = tl.load(part_l + base + offs_p, mask=mask_p, other=0.0, cache_modifier=".cg")
    acc = tl.load(
        part_acc + (base + offs_p)[:, None] * BLOCK_D + tl.arange(0, BLOCK_D)[None, :],
        mask=mask_p[:, None],
        other=0.0,
        cache_modifier=".cg",
    )
    m_new = tl.maximum(m_run, tl.max(m, axis=0))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_run - m_safe)
    w = tl.exp2(m - m_safe)
    return (
        m_new,
        l_run * alpha + tl.sum(l_p * w, axis=0),
        o_run * alpha + tl.sum(acc * w[:, None], axis=0),
    )


@triton.jit
def _merge_head(
    part_m,
    part_l,
    part_acc,
    base,
    used,
    out_ptr,
    HEAD_DIM: tl.constexpr,
    INTERPRETED: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    """Log-sum-exp merge of one (sequence, query head)'s ``used`` partitions (from ``base``),
    ``BLOCK_P`` at a time, into its output row."""
    m_run = tl.full([], float("-inf"), tl.float32)
    l_run = tl.zeros([], tl.float32)
    o_run = tl.zeros([BLOCK_D], tl.float32)
    if INTERPRETED:
        p0 = 0
        while p0 < used:
            m_run, l_run, o_run = _merge_step(
                part_m, part_l, part_acc, base, p0, used, m_run, l_run, o_run, BLOCK_D, BLOCK_P
            )
            p0 += BLOCK_P
    else:
        for p0 in range(0, used, BLOCK_P):
            m_run, l_run, o_run = _merge_step(
                part_m, part_l, part_acc, base, p0, used, m_run, l_run, o_run, BLOCK_D, BLOCK_P
            )
    offs_d = tl.arange(0, BLOCK_D)
    tl.store(out_ptr + offs_d, (o_run / l_run).to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


@triton.jit
def _seqs_before(cu_query_lens, num_seqs, tile, s0, BLOCK_Q: tl.constexpr, BLOCK_S: tl.constexpr):
    """How many of sequences ``[s0, s0 + BLOCK_S)`` start at or before query tile ``tile``."""
    offs_s = s0 + tl.arange(0, BLOCK_S)
    valid = offs_s < num_seqs
    cu = tl.load(cu_query_lens + offs_s, mask=valid, other=0).to(tl.int32)
    return tl.sum(((cu // BLOCK_Q + offs_s <= tile) & valid).to(tl.int32), axis=0)


@triton.jit
def _owning_seq(
    cu_query_lens,
    num_seqs,
    tile,
    INTERPRETED: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """The sequence query tile ``tile`` belongs to: the last one whose first tile (its first
    query's tile, plus one spare tile per sequence before it) is <= tile. Scanned ``BLOCK_S``
    sequences at a time, so one compiled kernel serves any number of sequences."""
    count = tl.zeros([], tl.int32)
    if INTERPRETED:
        s0 = 0
        while s0 < num_seqs:
            count += _seqs_before(cu_query_lens, num_seqs, tile, s0, BLOCK_Q, BLOCK_S)
            s0 += BLOCK_S
    else:
        for s0 in range(0, num_seqs, BLOCK_S):
            count += _seqs_before(cu_query_lens, num_seqs, tile, s0, BLOCK_Q, BLOCK_S)
    return count - 1


# do_not_specialize: see _decode_partition_kernel
@triton.jit(do_not_specialize=["max_blocks", "num_seqs", "stride_bt"])
def _prefill_kernel(
    q_ptr,
    k_cache,
    v_cache,
    k_scale,
    k_zero,
    v_scale,
    v_zero,
    block_tables,
    cu_query_lens,
    context_lens,
    out_ptr,
    qk_scale,
    window,
    max_blocks,
    num_seqs,
    stride_qt,
    stride_qh,
    stride_bt,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_co,
    stride_ch,
    stride_pb,
    stride_po,
    stride_ph,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    QUANT: tl.constexpr,
    SLIDING: tl.constexpr,
    PRECISION: tl.constexpr,
    INTERPRETED: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """One (query tile, KV head): rows are ``BLOCK_Q`` tokens x ``BLOCK_G`` heads of a group."""
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _owning_seq(cu_query_lens, num_seqs, tile, INTERPRETED, BLOCK_Q, BLOCK_S)
    q_start = tl.load(cu_query_lens + seq).to(tl.int32)
    q_len = tl.load(cu_query_lens + seq + 1).to(tl.int32) - q_start
    q0 = (tile - (q_start // BLOCK_Q + seq)) * BLOCK_Q
    if q0 >= q_len:  # a spare tile
        return
    first_pos = tl.load(context_lens + seq).to(tl.int32) - q_len  # of the first query

    offs_m = tl.arange(0, BLOCK_Q * BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    q_idx = q0 + offs_m // BLOCK_G
    g = offs_m % BLOCK_G
    heads = kv_head * GROUP + g
    row_ok = (q_idx < q_len) & (g < GROUP)
    mask = row_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    q_rows = (q_start + q_idx).to(tl.int64)
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=mask,
        other=0.0,
    )
    end = first_pos + tl.minimum(q0 + BLOCK_Q, q_len)  # one past the tile's last query
    lo = 0
    if SLIDING:
        lo = tl.maximum(first_pos + q0 - window + 1, 0) // BLOCK_N * BLOCK_N
    m_i, l_i, acc = _attend(
        q, first_pos + q_idx, lo, end, block_tables + seq.to(tl.int64) * stride_bt, max_blocks,
        kv_head, k_cache, v_cache, k_scale, k_zero, v_scale, v_zero,
        stride_cb, stride_co, stride_ch, stride_pb, stride_po, stride_ph,
        qk_scale, window, BLOCK_SIZE, HEAD_DIM, QUANT, SLIDING, PRECISION, INTERPRETED,
        BLOCK_D, BLOCK_N,
    )  # fmt: skip
    l_i = tl.where(row_ok, l_i, 1.0)
    tl.store(
        out_ptr + q_rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
        (acc / l_i[:, None]).to(out_ptr.dtype.element_ty),
        mask=mask,
    )


# Interpreted kernels (TRITON_INTERPRET=1, read when a kernel is decorated) loop with ``while``
# and multiply bf16 tiles as fp32: the interpreter's dot reads bf16 storage as raw uint16.
_INTERPRETED = isinstance(_prefill_kernel, InterpretedFunction)


def _check_common(
    q: torch.Tensor,
    kv: LayerKV,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    num_seqs: int,
    sliding_window: int | None,
) -> None:
    s = kv.spec
    if q.dim() != 3 or q.shape[2] != s.head_dim or q.shape[1] % s.num_kv_heads:
        raise ValueError(
            f"q {list(q.shape)} must be [tokens, heads, head_dim={s.head_dim}] with heads a "
            f"multiple of {s.num_kv_heads} KV heads"
        )
    if q.dtype != s.dtype:
        raise ValueError(f"q is {q.dtype} but the KV cache holds {s.dtype}: they must match")
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs or block_tables.shape[1] < 1:
        raise ValueError(
            f"block_tables {list(block_tables.shape)} must be [{num_seqs}, max_blocks >= 1]"
        )
    if context_lens.dim() != 1 or context_lens.shape[0] != num_seqs:
        raise ValueError(f"context_lens {list(context_lens.shape)} must be [{num_seqs}]")
    for name, t in (("block_tables", block_tables), ("context_lens", context_lens)):
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")
    check_devices(kv.device, q=q, block_tables=block_tables, context_lens=context_lens)
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    if context_lens.device.type == "cpu":  # free here; on a GPU it would cost a sync per layer
        capacity = block_tables.shape[1] * s.block_size
        if bool(((context_lens < 1) | (context_lens > capacity)).any()):
            raise ValueError(
                f"context_lens {context_lens.tolist()} must be in [1, {capacity}] "
                f"(block table width {block_tables.shape[1]} x block size {s.block_size})"
            )
        if bool(((block_tables < 0) | (block_tables >= kv.num_blocks)).any()):
            raise ValueError(f"block_tables hold ids outside [0, {kv.num_blocks})")


def _pool(kv: LayerKV) -> tuple[tuple[torch.Tensor, ...], list[int]]:
    """The layer's six tensors and the code and parameter strides (an unquantized pool passes
    its K in place of the never-read scales and zeros)."""
    pool = kv.tensors()
    return pool, [*pool[0].stride()[:3], *pool[2].stride()[:3]]


def _kernel_options(kv: LayerKV, num_heads: int) -> dict:
    s = kv.spec
    return {
        "GROUP": num_heads // s.num_kv_heads,
        "HEAD_DIM": s.head_dim,
        "BLOCK_SIZE": s.block_size,
        "QUANT": s.quant_id,
        "PRECISION": "ieee" if s.dtype == torch.float32 else "tf32",
        "INTERPRETED": _INTERPRETED,
        "BLOCK_D": max(16, triton.next_power_of_2(s.head_dim)),
    }


@functools.cache
def _compile_arch(device_index: int) -> int:  # noqa: ARG001 - the cache key
    return driver.active.get_current_target().arch


def target_arch() -> int:
    """The compute capability Triton compiles for now (its current device's, e.g. 90);
    interpreted, 90, whose tiles the interpreter runs (it has no registers to spill)."""
    if _INTERPRETED:
        return 90
    return _compile_arch(torch.cuda.current_device() if torch.cuda.is_available() else -1)


def prefill_tiles(opts: dict, dtype: torch.dtype, arch: int) -> tuple[int, int, int]:
    """(query rows, KV tokens, warps) of a prefill tile for ``arch``: the largest that ptxas
    holds without spilling (see the module docstring)."""
    wide = opts["BLOCK_D"] > 128
    if arch < 90:
        if not wide:
            return 64, 32, 8
        return (32, 32, 8) if opts["QUANT"] else (64, 16, 8)  # dequantizing takes registers
    if _large_tiles(opts, dtype):
        return 128, 64, 8
    return 64, 32, 8 if wide else 4


def _large_tiles(opts: dict, dtype: torch.dtype) -> bool:
    """Whether 16-bit tiles of up to 128 columns fit: fp32 or head_dim > 128 halve the tiles
    (register and shared-memory budget on sm_90, checked with ptxas: no spills)."""
    return dtype != torch.float32 and opts["BLOCK_D"] <= 128


def _contiguous_last(x: torch.Tensor) -> torch.Tensor:
    """Kernels step the last dim with stride 1 and take every other stride as an argument."""
    return x if x.stride(-1) == 1 else x.contiguous()


def decode_partition_size(block_size: int) -> int:
    """Tokens per decode partition: :data:`DEFAULT_PARTITION` rounded up to whole blocks. Not
    shrunk to a shorter block table: the partition is a constexpr, and eager steps' tables
    widen as contexts grow, so each width would compile its own kernel while serving."""
    return -(-DEFAULT_PARTITION // block_size) * block_size


def paged_decode_attention(
    q: torch.Tensor,
    kv: LayerKV,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    partition_size: int | None = None,
) -> torch.Tensor:
    """Attention of one new token per sequence, ``q [B, H, D]`` (its K/V already in the
    cache), over each sequence's paged context.

    ``block_tables [B, max_blocks]`` (padded with valid ids, e.g. 0) and ``context_lens [B]``
    are int32 or int64. ``partition_size`` (tokens, a multiple of the block size) defaults to
    :func:`decode_partition_size` of the block size. Context lengths and block ids are
    checked only when they are on the CPU (on a GPU the check would sync); the kernel never
    reads past the block table either way. Returns ``[B, H, D]`` in ``q.dtype``."""
    batch = q.shape[0] if q.dim() == 3 else -1
    _check_common(q, kv, block_tables, context_lens, batch, sliding_window)
    bs = kv.spec.block_size
    capacity = block_tables.shape[1] * bs
    if partition_size is None:
        partition_size = decode_partition_size(bs)
    elif partition_size < 1 or partition_size % bs:
        raise ValueError(
            f"partition_size {partition_size} must be a positive multiple of block size {bs}"
        )
    q, block_tables = _contiguous_last(q), _contiguous_last(block_tables)
    context_lens = context_lens.contiguous()
    out = torch.empty_like(q)
    if batch == 0:
        return out
    num_heads = q.shape[1]
    num_partitions = -(-capacity // partition_size)
    opts = _kernel_options(kv, num_heads)
    single = num_partitions == 1
    if single:
        partials = [out] * 3  # never written: the kernel normalizes into out itself
    else:
        shape = (batch, num_heads, num_partitions)
        partials = [
            torch.empty(shape, dtype=torch.float32, device=q.device),
            torch.empty(shape, dtype=torch.float32, device=q.device),
            torch.empty((*shape, opts["BLOCK_D"]), dtype=torch.float32, device=q.device),
        ]
    tile = 64 if _large_tiles(opts, q.dtype) else 32
    pool, pool_strides = _pool(kv)
    num_kv_heads = kv.spec.num_kv_heads
    counters = out if single else arrival_counters(q.device, batch * num_kv_heads)
    _decode_partition_kernel[(batch, num_kv_heads, num_partitions)](
        q, *pool, block_tables, context_lens, out, *partials, counters,
        scale * _LOG2E, sliding_window or 0, block_tables.shape[1],
        q.stride(0), q.stride(1), block_tables.stride(0), out.stride(0), out.stride(1),
        *pool_strides, num_heads, num_partitions,
        PARTITION=partition_size,
        SLIDING=sliding_window is not None,
        SINGLE=single,
        BLOCK_G=max(16, triton.next_power_of_2(opts["GROUP"])),
        BLOCK_N=max(16, min(tile, triton.next_power_of_2(partition_size))),
        BLOCK_P=_MERGE_BLOCK_P,
        num_warps=4,
        **opts,
        **pdl_launch(q.device),
    )  # fmt: skip
    return out


def _check_cu_query_lens(cu_query_lens: torch.Tensor, kv: LayerKV) -> None:
    if cu_query_lens.dim() != 1 or cu_query_lens.shape[0] < 1:
        raise ValueError(f"cu_query_lens must be [S + 1], got {list(cu_query_lens.shape)}")
    if cu_query_lens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"cu_query_lens must be int32 or int64, got {cu_query_lens.dtype}")
    check_devices(kv.device, cu_query_lens=cu_query_lens)


def _check_query_lens(
    cu_query_lens: torch.Tensor, num_tokens: int, context_lens: torch.Tensor
) -> None:
    """Values of CPU metadata (on a GPU this would sync, as for context_lens)."""
    if cu_query_lens.device.type != "cpu":
        return
    query_lens = cu_query_lens.diff()
    if cu_query_lens[0] != 0 or cu_query_lens[-1] != num_tokens or bool((query_lens < 0).any()):
        raise ValueError(
            f"cu_query_lens must rise from 0 to the {num_tokens} query tokens, got "
            f"{cu_query_lens.tolist()}"
        )
    if context_lens.device.type == "cpu" and bool((query_lens > context_lens).any()):
        raise ValueError(
            f"query lens {query_lens.tolist()} exceed context_lens {context_lens.tolist()}"
        )


def paged_prefill_attention(
    q: torch.Tensor,
    kv: LayerKV,
    block_tables: torch.Tensor,
    cu_query_lens: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal attention of ``S`` sequences' new tokens, concatenated in ``q [T, H, D]``.

    ``cu_query_lens [S + 1]`` (prefix sums of the query lengths), ``block_tables
    [S, max_blocks]`` and ``context_lens [S]`` are int32 or int64. Sequence i's queries are
    its last ``query_len_i`` of ``context_lens[i]`` tokens, whose K/V (cached prefix and new
    tokens) are all in the pool already. Covers full prefill, chunked prefill over a cached
    prefix and decode rows (query_len 1). Metadata values are checked only on the CPU, as in
    :func:`paged_decode_attention`. Returns ``[T, H, D]`` in ``q.dtype``."""
    _check_cu_query_lens(cu_query_lens, kv)
    num_seqs = cu_query_lens.shape[0] - 1
    _check_common(q, kv, block_tables, context_lens, num_seqs, sliding_window)
    _check_query_lens(cu_query_lens, q.shape[0], context_lens)
    q, block_tables = _contiguous_last(q), _contiguous_last(block_tables)
    cu_query_lens, context_lens = cu_query_lens.contiguous(), context_lens.contiguous()
    out = torch.empty_like(q)
    if q.shape[0] == 0:
        return out
    num_heads = q.shape[1]
    opts = _kernel_options(kv, num_heads)
    rows, block_n, warps = prefill_tiles(opts, q.dtype, target_arch())
    block_g = triton.next_power_of_2(opts["GROUP"])
    block_q = max(1, rows // block_g)
    pool, pool_strides = _pool(kv)
    _prefill_kernel[(q.shape[0] // block_q + num_seqs, kv.spec.num_kv_heads)](
        q, *pool, block_tables, cu_query_lens, context_lens, out,
        scale * _LOG2E, sliding_window or 0, block_tables.shape[1], num_seqs,
        q.stride(0), q.stride(1), block_tables.stride(0), out.stride(0), out.stride(1),
        *pool_strides,
        SLIDING=sliding_window is not None,
        BLOCK_S=_SEQ_BLOCK,
        BLOCK_G=block_g,
        BLOCK_Q=block_q,
        BLOCK_N=block_n,
        num_warps=warps,
        **opts,
    )  # fmt: skip
    return out
