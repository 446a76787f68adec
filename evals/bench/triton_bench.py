"""Triton kernels on a GPU: the W4A16 GEMM and paged decode attention, against the baselines
measured in the same run (the device's copy bandwidth, torch's fp16 matmul on the same shapes).

GEMM: Llama-3-8B's linear shapes (N x K = 4096x4096, 14336x4096 gate/up, 4096x14336 down) at
M = 1 .. 4096, as the backend runs them (the heuristic config: at one row the one-row kernel;
at 1-4 rows the one-row and tile kernels' defaults both timed; from 256 rows the weights
dequantized and torch's matmul) or, with --tune, the best of `lite tune`'s candidates; prints
time, achieved GB/s (weights + activations + output read/written once) and TFLOP/s, and ratios
to the copy bandwidth and to torch.matmul in fp16 on dense weights of the same shape.
The dequantization alone, per tile (DEQUANT_TILES), against the copy bandwidth.
Decode attention: one token per sequence over 1k..32k cached tokens, fp16/int8/int4 KV,
Llama-3-8B heads (32 query, 8 KV, dim 128); prints time and the KV bytes read per second.

Usage (a CUDA GPU): python evals/bench/triton_bench.py [--tune] [--batch 1,8] [--quick]
--quick shrinks every shape, e.g. to check the script under TRITON_INTERPRET=1 on a CPU.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from functools import partial

import torch

from runtime.artifact.layout import pack_qparams, pack_qweight
from runtime.kernels.triton.attention import paged_decode_attention
from runtime.kernels.triton.gemm import (
    GEMV_TUNED_BUCKETS,
    DequantConfig,
    DequantTile,
    GemvConfig,
    LinearConfig,
    choose_config,
    gemv_config,
    heuristic_config,
    m_bucket,
    tune_space,
    w4a16_dequantize,
    w4a16_linear,
)
from runtime.kv.cache import KVCache
from runtime.kv.format import KVSpec

SHAPES = {"qkvo 4096x4096": (4096, 4096), "gate/up 14336x4096": (14336, 4096)}
SHAPES["down 4096x14336"] = (4096, 14336)
MS = (1, 4, 16, 64, 256, 1024, 4096)
CONTEXTS = (1024, 4096, 16384, 32768)
GROUP = 128
# the dequantization feeding prefill GEMMs (the default first): 130-150 GB/s on the H200 at
# 2026-12-04 with 2-byte stores, against about 1 TB/s for csrc's; which tile is best is open
DEQUANT_TILES = (DequantTile(), DequantTile(32, 128, 4), DequantTile(64, 64, 4))
DEQUANT_TILES += (DequantTile(64, 128, 4), DequantTile(64, 128, 8), DequantTile(128, 128, 8))
DEQUANT_TILES += (DequantTile(128, 256, 8), DequantTile(32, 256, 4))


def bench(fn: Callable[[], object], device: torch.device) -> float:
    """Milliseconds per call."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=25, rep=100))
    fn()
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """GB/s of a device-to-device copy (read + write counted)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src), device)
    return 2 * nbytes / ms / 1e6


def random_weight(n: int, k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    groups = -(-k // GROUP)
    q = torch.randint(0, 16, (n, k), dtype=torch.int32)
    scale = torch.rand(n, groups) * 0.02 + 0.002
    zero = torch.randint(0, 16, (n, groups), dtype=torch.int32)
    return pack_qweight(q, GROUP).to(device), pack_qparams(scale, zero, GROUP, k).to(device)


def gemm_rows(device: torch.device, tune: bool, shapes: dict, ms: tuple[int, ...], copy_bw: float):
    print(f"\n## W4A16 GEMM (group {GROUP}, fp16 activations; copy bandwidth {copy_bw:.0f} GB/s)")
    print("| shape | M | config | ms | GB/s | x copy bw | TFLOP/s | torch fp16 ms | vs torch |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|")
    for label, (n, k) in shapes.items():
        qweight, qparams = random_weight(n, k, device)
        dense = torch.randn(n, k, device=device, dtype=torch.float16)
        for m in ms:
            x = torch.randn(m, k, device=device, dtype=torch.float16)
            if tune:
                groups = [tune_space(m, n, k, GROUP, None)]
            else:
                default = choose_config(m, n, k, GROUP)
                groups = [[default]]
                if m_bucket(m) in GEMV_TUNED_BUCKETS:  # the one-row and tile kernels' defaults
                    gemv = isinstance(default, GemvConfig)
                    groups.append(
                        [heuristic_config(m, n, k, GROUP) if gemv else gemv_config(n, k, GROUP)]
                    )
            for candidates in groups:
                gemm_row(label, x, qweight, qparams, dense, candidates, device, copy_bw)


def config_label(cfg: LinearConfig) -> str:
    """How a table row names a launch."""
    if isinstance(cfg, DequantConfig):
        return "dequant"
    if isinstance(cfg, GemvConfig):
        return f"gemv {cfg.block_n}x{cfg.block_k}/s{cfg.split_k}/w{cfg.num_warps}"
    return f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k}/s{cfg.split_k}/w{cfg.num_warps}"


def gemm_row(label, x, qweight, qparams, dense, candidates, device, copy_bw: float) -> None:
    """One table row: the fastest of `candidates` on x, against torch's dense matmul."""
    m, k = x.shape
    n = dense.shape[0]
    timed, failed = [], []
    for cfg in candidates:
        run = partial(w4a16_linear, x, qweight, qparams, n, k, GROUP, cfg)
        try:
            timed.append((bench(run, device), cfg))
        except Exception as e:  # a config the compiler or the launch rejects here
            failed.append(f"{config_label(cfg)}: {type(e).__name__}: {str(e)[:100]}")
    if not timed:  # a finding for this row; the other rows and the attention still run
        print(f"| {label} | {m} | failed: {failed[0]} | - | - | - | - | - | - |")
        return
    t, cfg = min(timed, key=lambda p: p[0])
    t_ref = bench(partial(torch.matmul, x, dense.T), device)
    nbytes = qweight.numel() * 4 + qparams.numel() * 2 + (m * k + m * n) * 2
    gbs = nbytes / t / 1e6
    tflops = 2 * m * n * k / t / 1e9
    print(
        f"| {label} | {m} | {config_label(cfg)} | {t:.4f} | {gbs:.0f} | {gbs / copy_bw:.2f} | "
        f"{tflops:.1f} | {t_ref:.4f} | {t_ref / t:.2f}x |"
    )


def dequant_rows(device: torch.device, shapes: dict, copy_bw: float) -> None:
    """The dequantization alone, per tile: GB/s of int4 words and (s, b) read plus fp16 weights
    written, against the copy bandwidth."""
    print(f"\n## W4A16 dequantization to fp16 (group {GROUP}), per tile")
    print("| shape | tile (k x n / warps) | ms | GB/s | x copy bw |")
    print("|---|---|---:|---:|---:|")
    for label, (n, k) in shapes.items():
        qweight, qparams = random_weight(n, k, device)
        nbytes = qweight.numel() * 4 + qparams.numel() * 2 + n * k * 2
        for tile in DEQUANT_TILES:
            name = f"{tile.block_k} x {tile.block_n} / {tile.num_warps}"
            run = partial(w4a16_dequantize, qweight, qparams, n, k, GROUP, torch.float16, tile)
            try:
                t = bench(run, device)
            except Exception as e:  # a tile the compiler rejects here: a finding, not the end
                print(f"| {label} | {name} | failed: {type(e).__name__}: {str(e)[:80]} | - | - |")
                continue
            gbs = nbytes / t / 1e6
            print(f"| {label} | {name} | {t:.4f} | {gbs:.0f} | {gbs / copy_bw:.2f} |")


def attention_rows(device: torch.device, contexts: tuple[int, ...], batch: int, heads: tuple):
    h, hkv, d = heads
    print(f"\n## Paged decode attention (batch {batch}, {h} heads / {hkv} KV heads, dim {d})")
    print("| kv | context | ms | KV GB/s |")
    print("|---|---:|---:|---:|")
    block = 64
    for kv_quant in ("none", "int8", "int4"):
        for ctx in contexts:
            spec = KVSpec(1, hkv, d, block, kv_quant, torch.float16)
            blocks = batch * -(-ctx // block)
            cache = KVCache(spec, blocks, device)
            kv = cache.layer(0)
            for t in (kv.k, kv.v):
                t.copy_(
                    torch.randint_like(t, 0, 100) if t.dtype == torch.uint8 else torch.randn_like(t)
                )
            for t in (kv.k_scale, kv.v_scale) if kv.quantized else ():
                t.fill_(0.01)
            tables = torch.randperm(blocks, device=device, dtype=torch.int32).view(batch, -1)
            lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
            q = torch.randn(batch, h, d, device=device, dtype=torch.float16)
            run = partial(paged_decode_attention, q, kv, tables, lens, d**-0.5)
            t = bench(run, device)
            kv_bytes = batch * ctx * spec.bytes_per_token()
            print(f"| {kv_quant} | {ctx} | {t:.4f} | {kv_bytes / t / 1e6:.0f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tune", action="store_true", help="best of the config space per shape")
    p.add_argument("--batch", default="1,8", help="decode-attention batch sizes")
    p.add_argument("--quick", action="store_true", help="tiny shapes (interpreter smoke run)")
    a = p.parse_args()
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if not torch.cuda.is_available() and not interpreted:
        raise SystemExit("needs a CUDA GPU (or TRITON_INTERPRET=1 with --quick, as a smoke test)")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU (interpreted)"
    print(f"# kernels on {name}, torch {torch.__version__}")
    shapes = {"quick 96x160": (96, 160)} if a.quick else SHAPES
    ms = (1, 4, 17, 300) if a.quick else MS
    contexts = (70,) if a.quick else CONTEXTS
    heads = (6, 2, 16) if a.quick else (32, 8, 128)
    copy_bw = copy_bandwidth(device, 2**20 if a.quick else 2**30)
    gemm_rows(device, a.tune, shapes, ms, copy_bw)
    dequant_rows(device, shapes, copy_bw)
    for batch in (int(b) for b in a.batch.split(",")):
        attention_rows(device, contexts, batch, heads)


if __name__ == "__main__":
    main()
