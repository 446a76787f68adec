"""The csrc paged decode attention (csrc/paged_attention.cu) on a GPU, against the Triton kernel
on the same pools in the same run: issue 12's decode-attention targets.

Llama-3-8B heads (32 query, 8 KV, dim 128), block size 64, one token per sequence over 1k..32k
cached tokens, fp16 / int8 / int4 KV. Both kernels are timed back to back in CUDA graphs (how the
engine runs decode), each launch on its own block tables into a pool several times the L2
(`gpu_timing.py`), so neither the host's launch time nor L2 reuse is in the figures. Prints per
shape the time, the KV bytes read per second and the speed-up over Triton, then the targets:

* int8 KV at batch 8, 32k tokens: at least 1.6x faster than fp16 KV (it reads half the bytes);
* fp16 KV at batch 1, 32k tokens: at least 2.5 TB/s of KV read.

Every shape's output is also compared with Triton's (max abs difference: both read the same
pool, so it is their rounding difference, ~1e-3 for fp16).

--sweep times, at the longest context of each batch and KV kind, partition sizes from 256
tokens to a few thousand, and those whose blocks fill whole waves, against the one
lsq_paged_decode_partition_size plans (a model of waves of 3 blocks an SM): the data its rule
is to be fit to (issue 12; at batch 1 the fixed cost of each block, its Q fragments, the
warps' merge and the partials, weighs against the waves of blocks), and
at the planned size how far ahead each warp prefetches its K and V into L2 (0, 1, 2 or 4 tiles;
`lsq_paged_decode_l2_prefetch`, default 2): bytes in flight without registers, for the
quantized pools whose register buffers hold little; and the partitions merged by a second
kernel against the one-launch merge the backend runs (the last block of each head group merges,
counting in on zeroed counters).

The library is the cuda backend's (`runtime build-kernels`; built on first use, or carried
prebuilt in LITESERVE_CACHE to a machine without nvcc). --quick runs tiny shapes through the
CPU emulation of the kernel (lsq_emulate_paged_decode_attention, no GPU, no timing): a check
of this script.

Usage: python evals/bench/cuda_attention.py [--batch 1,8] [--contexts 1024,4096,16384,32768]
       [--sweep]
"""

from __future__ import annotations

import argparse
import ctypes
import math
import time

import torch
from gpu_timing import TIMING, copies_for, graph_ms, launch_floor_ms

from runtime.kernels.cuda import library
from runtime.kv.cache import KVCache
from runtime.kv.format import STORAGE_KINDS, KVSpec

HEADS, KV_HEADS, DIM, BLOCK = 32, 8, 128, 64


def load_library() -> ctypes.CDLL:
    """The library the cuda backend loads (built on first use, or carried prebuilt in
    LITESERVE_CACHE); --quick runs its emulated twins on the CPU."""
    start = time.monotonic()
    lib = library.library()
    print(f"csrc library ready in {time.monotonic() - start:.0f} s")
    return lib


def setup(quick: bool) -> tuple[torch.device, ctypes.CDLL, int]:
    """The device, the library and the SM count launches are planned for: the current GPU, or
    with --quick the CPU, running the emulated twins and planning as an H200 (132 SMs)."""
    if not quick and not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (or --quick: the CPU emulation, as a smoke test)")
    device = torch.device("cpu") if quick else torch.device("cuda", torch.cuda.current_device())
    lib = load_library()
    sms = 132 if quick else torch.cuda.get_device_properties(device).multi_processor_count
    return device, lib, sms


def kv_bytes(kv_quant: str, batch: int, ctx: int) -> int:
    """The KV bytes one decode launch reads (codes or values and their parameters)."""
    return batch * ctx * KVSpec(1, KV_HEADS, DIM, BLOCK, kv_quant, torch.float16).bytes_per_token()


def make_pool(kv_quant: str, batch: int, ctx: int, device: torch.device, copies: int = 1):
    """A random pool of ``copies`` times the blocks of ``batch`` sequences of ``ctx`` tokens,
    and ``copies`` block tables [copies, batch, width] over disjoint blocks of it (a launch per
    table reads other bytes than the one before)."""
    spec = KVSpec(1, KV_HEADS, DIM, BLOCK, kv_quant, torch.float16)
    blocks = copies * batch * -(-ctx // BLOCK)
    kv = KVCache(spec, blocks, device).layer(0)
    for t in (kv.k, kv.v):
        t.copy_(torch.randint_like(t, 0, 255) if t.dtype == torch.uint8 else torch.randn_like(t))
    if kv.quantized:
        for t in (kv.k_scale, kv.v_scale):
            t.fill_(0.01)
        for t in (kv.k_zero, kv.v_zero):
            t.fill_(-1.0)
    tables = torch.randperm(blocks, device=device, dtype=torch.int32).view(copies, batch, -1)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    return spec, kv, tables, lens


def counters_for(batch: int, device: torch.device) -> torch.Tensor:
    """Zeros for the one-launch merge: one per sequence and KV head (4 query heads a group)."""
    return torch.zeros(batch * KV_HEADS, dtype=torch.int32, device=device)


def csrc_call(lib, q, out, kv, tables, lens, partition, workspace, emulate: bool, counters=None):
    """The launch as a closure; `counters` (counters_for) merges in one launch, None in two."""
    s = kv.spec
    ptr = [None if t is None else t.data_ptr() for t in kv.tensors()[:2]]
    ptr += [None if t is None else t.data_ptr() for t in (kv.k_scale, kv.k_zero)]
    ptr += [None if t is None else t.data_ptr() for t in (kv.v_scale, kv.v_zero)]
    args = [
        q.data_ptr(), q.stride(0), q.stride(1), out.data_ptr(), out.stride(0), out.stride(1),
        *ptr, s.storage_kind, STORAGE_KINDS[q.dtype],
        tables.data_ptr(), tables.stride(0), tables.shape[1], lens.data_ptr(),
        q.shape[0], q.shape[1], s.num_kv_heads, s.head_dim, s.block_size, 0, DIM**-0.5,
        partition, workspace.data_ptr(),
        None if counters is None else counters.data_ptr(),
        0 if counters is None else counters.numel(),
    ]  # fmt: skip

    def run() -> None:
        if emulate:
            rc = lib.lsq_emulate_paged_decode_attention(*args)
        else:
            rc = lib.lsq_paged_decode_attention(*args, torch.cuda.current_stream().cuda_stream)
        if rc:
            raise RuntimeError(f"lsq_paged_decode_attention returned {rc}")

    return run


SWEEP_PARTITIONS = (256, 512, 768, 1024, 1536, 2048, 4096, 8192)
L2_AHEAD = (0, 1, 2, 4)  # tiles a warp prefetches ahead into L2, timed at the planned size


def wave_sizes(batch: int, capacity: int, sms: int) -> set[int]:
    """Partition sizes whose blocks fill whole waves of 2, 3 or 4 blocks an SM (the kernel's
    launch bound asks for 3): a second, partial wave runs as long as a full one, so these are
    the sizes the sweep must see to tell whether the planner should count waves."""
    groups = batch * KV_HEADS * math.ceil(HEADS // KV_HEADS / 8)  # blocks a partition
    sizes = set()
    for per_sm in (2, 3, 4):
        parts = max(1, per_sm * sms // groups)
        sizes.add(math.ceil(math.ceil(capacity / parts) / BLOCK) * BLOCK)
    return sizes


def rotation(lib, q, out, kv, tables, lens, partition, workspace, counters=None) -> list:
    """One launch per copy of the block tables (make_pool), for gpu_timing.graph_ms."""
    return [
        csrc_call(lib, q, out, kv, t, lens, partition, workspace, False, counters) for t in tables
    ]


def sweep(lib, kv_quant: str, batch: int, ctx: int, device: torch.device, sms: int) -> None:
    """One row: the planned partition size against every size of SWEEP_PARTITIONS and of
    wave_sizes that fits."""
    copies = copies_for(kv_bytes(kv_quant, batch, ctx), device)
    spec, kv, tables, lens = make_pool(kv_quant, batch, ctx, device, copies)
    q = torch.randn(batch, HEADS, DIM, device=device, dtype=torch.float16)
    out = torch.empty_like(q)
    width = tables.shape[-1]
    planned = lib.lsq_paged_decode_partition_size(batch, HEADS, KV_HEADS, width, BLOCK, sms)
    counters = counters_for(batch, device)
    timed = {}
    sizes = {planned, *SWEEP_PARTITIONS, *wave_sizes(batch, width * BLOCK, sms)}
    for part in sorted(p for p in sizes if p <= width * BLOCK):
        floats = lib.lsq_paged_decode_workspace_floats(batch, HEADS, DIM, width, BLOCK, part)
        workspace = torch.empty(max(floats, 1), dtype=torch.float32, device=device)
        timed[part] = graph_ms(rotation(lib, q, out, kv, tables, lens, part, workspace, counters))
    best = min(timed, key=timed.get)
    cells = ", ".join(f"{p}: {ms:.4f}" for p, ms in timed.items())
    floats = lib.lsq_paged_decode_workspace_floats(batch, HEADS, DIM, width, BLOCK, planned)
    workspace = torch.empty(max(floats, 1), dtype=torch.float32, device=device)
    ahead = []
    for tiles in L2_AHEAD:  # set before the capture: the launch's parameters are baked in
        before = lib.lsq_paged_decode_l2_prefetch(tiles)
        try:
            calls = rotation(lib, q, out, kv, tables, lens, planned, workspace, counters)
            ahead.append(f"{graph_ms(calls):.4f}")
        finally:
            lib.lsq_paged_decode_l2_prefetch(before)
    two = graph_ms(rotation(lib, q, out, kv, tables, lens, planned, workspace))
    print(
        f"| {kv_quant} | {batch} | {ctx} | {planned} | {timed[planned]:.4f} | {best} | "
        f"{timed[best]:.4f} | {timed[planned] / timed[best]:.2f}x | {' / '.join(ahead)} | "
        f"{two:.4f} ({two / timed[planned]:.2f}x) | {cells} |"
    )


def measure(lib, kv_quant: str, batch: int, ctx: int, device: torch.device, sms: int, quick: bool):
    """(partition size, csrc ms, triton ms, max |csrc - triton|, KV bytes read) of one shape;
    in --quick mode only the emulated call runs (times and difference are None)."""
    nbytes = kv_bytes(kv_quant, batch, ctx)
    spec, kv, tables, lens = make_pool(kv_quant, batch, ctx, device, copies_for(nbytes, device))
    q = torch.randn(batch, HEADS, DIM, device=device, dtype=torch.float16)
    out = torch.empty_like(q)
    width = tables.shape[-1]
    part = lib.lsq_paged_decode_partition_size(batch, HEADS, KV_HEADS, width, BLOCK, sms)
    floats = lib.lsq_paged_decode_workspace_floats(batch, HEADS, DIM, width, BLOCK, part)
    workspace = torch.empty(max(floats, 1), dtype=torch.float32, device=device)
    counters = counters_for(batch, device)
    if quick:
        csrc_call(lib, q, out, kv, tables[0], lens, part, workspace, True, counters)()
        return part, None, None, None, nbytes
    from runtime.kernels.triton.attention import paged_decode_attention

    ms = graph_ms(rotation(lib, q, out, kv, tables, lens, part, workspace, counters))
    t_ms = graph_ms([lambda t=t: paged_decode_attention(q, kv, t, lens, DIM**-0.5) for t in tables])
    csrc_call(lib, q, out, kv, tables[0], lens, part, workspace, False, counters)()
    theirs = paged_decode_attention(q, kv, tables[0], lens, DIM**-0.5)
    torch.cuda.synchronize()
    diff = (out.float() - theirs.float()).abs().max().item()
    return part, ms, t_ms, diff, nbytes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", default="1,8")
    p.add_argument("--contexts", default="1024,4096,16384,32768")
    p.add_argument("--sweep", action="store_true", help="partition sizes at the longest context")
    p.add_argument("--quick", action="store_true", help="CPU emulation, tiny shapes, no timing")
    a = p.parse_args()
    device, lib, sms = setup(a.quick)
    batches = (1, 2) if a.quick else tuple(int(b) for b in a.batch.split(","))
    contexts = (200,) if a.quick else tuple(int(c) for c in a.contexts.split(","))
    name = "CPU (emulated)" if a.quick else torch.cuda.get_device_name(device)
    print(f"# csrc paged decode attention on {name}, torch {torch.__version__}")
    print(f"{HEADS} heads / {KV_HEADS} KV heads, dim {DIM}, block {BLOCK}; {TIMING}\n")
    if not a.quick:
        floor = launch_floor_ms(device)
        print(f"One launch a graph replay takes at least {floor:.4f} ms on this host.\n")
    print(
        "| kv | batch | context | partition | csrc ms | csrc TB/s | triton ms | speed-up | diff |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    times: dict[tuple[str, int, int], float] = {}
    for batch in batches:
        for kv_quant in ("none", "int8", "int4"):
            for ctx in contexts:
                part, ms, t_ms, diff, kv_bytes = measure(
                    lib, kv_quant, batch, ctx, device, sms, a.quick
                )
                if ms is None:
                    print(f"| {kv_quant} | {batch} | {ctx} | {part} | - | - | - | - | - |")
                    continue
                times[(kv_quant, batch, ctx)] = ms
                print(
                    f"| {kv_quant} | {batch} | {ctx} | {part} | {ms:.4f} | "
                    f"{kv_bytes / ms / 1e9:.2f} | {t_ms:.4f} | {t_ms / ms:.2f}x | {diff:.1e} |"
                )
    if a.quick:
        return
    longest = max(contexts)
    print(f"\n## Targets (context {longest})")
    if ("int8", 8, longest) in times:
        ratio = times[("none", 8, longest)] / times[("int8", 8, longest)]
        print(f"- int8 vs fp16 KV at batch 8: {ratio:.2f}x faster (target >= 1.6x)")
    if ("none", 1, longest) in times:
        spec = KVSpec(1, KV_HEADS, DIM, BLOCK, "none", torch.float16)
        rate = longest * spec.bytes_per_token() / times[("none", 1, longest)] / 1e9
        print(f"- fp16 KV at batch 1: {rate:.2f} TB/s of KV read (target >= 2.5 TB/s)")
    if a.sweep:
        print(f"\n## Partition sizes at context {longest} (csrc ms)\n")
        print(
            "| kv | batch | context | planned | ms | fastest | ms | planned / fastest | "
            f"planned, L2 prefetch {' / '.join(map(str, L2_AHEAD))} tiles ahead | "
            "planned, merged by a second kernel (vs one launch) | all |"
        )
        print("|---|---:|---:|---:|---:|---:|---:|---:|---|---|---|")
        for batch in batches:
            for kv_quant in ("none", "int8", "int4"):
                sweep(lib, kv_quant, batch, longest, device, sms)


if __name__ == "__main__":
    main()
