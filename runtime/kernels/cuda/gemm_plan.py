"""Launch planning for the CUDA W4A16 GEMM (``csrc/w4a16_gemm.cu``): pure Python, no GPU.

The tile configs live in one place, the C table behind ``lsq_w4a16_num_configs`` /
``lsq_w4a16_config``; :func:`configs` reads it from the loaded library (a library built
with static cudart answers without a GPU). :func:`plan` picks a config and a split-K for one call
``(m, n, k, group_size)`` on a GPU with ``sm_count`` SMs and returns what the launch needs:
``plan.config`` and ``plan.split_k`` (the entry point's arguments), the grid and the workspace.

Split-K cuts the ``ceil(k / block_k)`` k-steps into ``split_k`` contiguous slices of
``steps_per_split`` whole steps (the last may be shorter, never empty); each slice covers at
least one quantization group. The GEMM then writes fp32 partials to a workspace
``[split_k, m, Np]`` (``Np`` = n padded to 64) with plain stores, and they are summed in split
order, so results are reproducible bit for bit: in the same launch by the block that finishes
each output tile's last split (counted in per-tile counters, :data:`SPLIT_COUNTERS` of them), or
by a second kernel when the tiles outnumber the counters. Without split-K the workspace is
unused.

How the plan is chosen. Every candidate (config, split_k) gets a time estimate from a small model
of an H100/H200-class SM, and the fastest wins (within 3 %: fewer splits, then more SMs busy,
then fewer warp instructions in all, then the lower id):

* decode rows (m <= 16) use the decode configs (block_m <= 16, swapped operands among them),
  larger m the configs whose block_m fits m;
* compute: the busiest SM runs ``ceil(blocks / sm_count)`` blocks of ``steps_per_split`` steps;
* memory: the weights and x stream at HBM bandwidth only with enough bytes in flight: each
  resident block keeps ``stages - 1`` k-steps in flight, and latency * bandwidth is the need;
* latency: a block's k-steps form a chain of round trips, ``stages - 1`` at a time;
* issue: the busiest SM issues each block's warp instructions (the weights' int4 conversion per
  warp along m, the mma.sync) at a rate that grows with the warps resident on it, up to one
  per scheduler per cycle (fit to an H200's M = 1 figures, see ``_ISSUE_PER_WARP``);
* a split adds the workspace's round trip and, where its tiles fit the split counters, the last
  block's read of the partials, else the reduction's launch.

So a single weight matrix at decode is split until its blocks cover the SMs with enough warps
and bytes in flight, while a small one (SmolLM2's) is not split when the extra launch costs more
than the latency it hides.

Past the decode rows the plan may instead be a :class:`DequantPlan`: ``lsq_w4a16_dequantize``
writes the weights out in the activation dtype (the bits the GEMM would multiply) and a dense
GEMM (cuBLAS) runs on them. On sm_90 cuBLAS issues wgmma, about 1.5x the tensor-core rate that
mma.sync reaches, so at prefill sizes (hundreds of rows and up) it wins even after the weights'
write and read; vLLM's AWQ path makes the same switch at 256 rows. Elsewhere cuBLAS runs
mma.sync too and the fused kernel keeps every M. The model picks it only when clearly faster.

Pinned entries (``lite tune``) override the model per shape and row bucket: a tile shape plus
split_k, or ``{"dequant": 1}`` (:meth:`GemmPlan.to_dict`, :meth:`DequantPlan.to_dict`), looked up
by the row bucket (a weight's own pins) or by the full key ``w4a16/N{n}xK{k}/m{bucket}``.
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping
from dataclasses import dataclass

from runtime.artifact.layout import GROUP_SIZES, N_ALIGN
from runtime.kernels.counters import COUNTERS

# Row buckets and pinned-config keys, the same as the Triton backend's (runtime.kernels.triton).
M_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)  # 512 means 512+
DECODE_ROWS = 16  # m up to this runs the 16-row (decode) configs
MAX_SPLIT_K = 32
# Output tiles a split-K launch can count in its per-tile counters (runtime/kernels/counters.py
# holds COUNTERS per device) and so sum in the same launch; more take a second kernel,
# the reduction.
SPLIT_COUNTERS = COUNTERS
# a tile's pinned form (TileConfig.shape), split_k aside
TILE_FIELDS = ("block_m", "block_n", "block_k", "warps", "warps_m", "warps_k", "stages", "swap_ab")

# The machine model (per SM of an H100/H200-class GPU; only ratios matter for the choice).
_SM_FLOPS = 4.0e12  # mma.sync fp16/bf16, fp32 accumulate, per SM
_HBM_BYTES_PER_S = 4.0e12  # achievable HBM bandwidth, whole GPU
_LATENCY_S = 0.8e-6  # a global load's round trip under load
_LAUNCH_S = 1.5e-6  # the reduction kernel's launch, in a CUDA graph or a stream
_SMEM_PER_SM = 228 * 1024  # sm_90; sm_80 164 KiB, sm_86/89 100 KiB
_THREADS_PER_SM = 2048  # sm_80/90; 1536 on sm_86/89
_REGS_PER_SM = 65536
_REGS_PER_THREAD = 128  # the configs' launch bounds keep most at or under this
_MAX_BLOCKS_PER_SM = 16
# Instruction issue: 4 schedulers per SM each issue a warp instruction a cycle at best. Per packed
# 32-bit weight word (8 weights) a warp along m issues its shared load, the int4 conversion and
# the scale and offset (about 18 instructions, bf16; evals/bench/gemm_sass.py on sm_90), and per
# qparams word (a column's (s, b) for one group) a shared load and the pairs' conversion (about
# 5). Each mma.sync is one more.
_SCHEDULERS = 4
_CLOCK_HZ = 1.98e9  # H100/H200 boost
_WORD_INSTR = 18.0
_PAIR_INSTR = 5.0
# Swapped operands (TileConfig.swap_ab): per word the shared load, the shifts and masks only
# (about 9); per group run of a warp and 16 columns, 2 qparams words (a load, 2 conversions and
# b - 16 s: about 4 each) and 2 fp32 FMAs per accumulator; per 16-deep slice and 8 rows of x a
# warp issues an ldmatrix and an mma for the sums of x (evals/bench/gemm_sass.py on sm_90:
# 12.9 a word at 8 x 128 x 128 and group 128, against 21.0 for config 1 in bf16).
_SWAP_WORD_INSTR = 9.0
_SWAP_PAIR_INSTR = 4.0
# A scheduler with w resident warps issues about min(1, w * this) of its cycles: the H200 ran the
# 16x128 decode tile with the group size read at run time (25 instructions a word by this model,
# 28.7 in its SASS) at 2 warps per scheduler in 0.9-1.2x the time that 0.4 of the issue rate
# gives, on all four Llama-3-8B linears at M = 1 (2026-12-04, before configs 8 and 9 existed).
_ISSUE_PER_WARP = 0.2
_TIE = 1.03
# cuBLAS's tensor-core rate per SM against mma.sync's (_SM_FLOPS): wgmma on sm_90 (about 700 of
# the H100/H200's 989 dense TFLOPS reached on large GEMMs, mma.sync about two thirds of that)
_DENSE_SPEEDUP = {"sm_90": 1.5}
_DEQUANT_MARGIN = 1.15  # the dequantized path must beat the fused kernel's estimate by this


@dataclass(frozen=True)
class TileConfig:
    """One row of the C table: a block_m x block_n tile per block, block_k-deep k-steps, by
    ``warps`` warps: ``warps_m`` along the rows (each dequantizes the tile's weights for its
    own rows) and ``warps_k`` splitting each k-step's slices (adding up at the end).
    ``swap_ab``: the weights are the mma's A operand and x^T its B (8 rows of x per mma), with
    each group's scale applied in fp32 after the mma (decode tiles only)."""

    id: int
    block_m: int
    block_n: int
    block_k: int
    warps: int
    warps_m: int
    warps_k: int
    stages: int
    swap_ab: int = 0

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def smem_bytes(self) -> int:
        """Dynamic shared memory of one block (csrc Tile::SMEM): per stage the x tile, the
        packed weight tile and block_k / 32 rows of (s, b) words."""
        per_stage = 2 * self.block_m * self.block_k + self.block_k * self.block_n // 2
        return self.stages * (per_stage + (self.block_k // 32) * self.block_n * 4)

    def shape(self) -> dict[str, int]:
        """The pinned form of the tile (without split_k)."""
        return {f: getattr(self, f) for f in TILE_FIELDS}


@dataclass(frozen=True)
class GemmPlan:
    """Everything ``lsq_w4a16_gemm`` needs beyond the tensors: ``config`` (the tile config id)
    and ``split_k``, with the tile, the grid it launches and the workspace it needs."""

    config: int
    tile: TileConfig
    split_k: int
    k_steps: int
    steps_per_split: int
    grid: tuple[int, int, int]  # (n tiles, m tiles, split_k)
    workspace_bytes: int  # 0 without split-K, else split_k * m * Np * 4 (fp32)

    @property
    def blocks(self) -> int:
        return self.grid[0] * self.grid[1] * self.grid[2]

    @property
    def workspace_floats(self) -> int:
        return self.workspace_bytes // 4

    def to_dict(self) -> dict[str, int]:
        """The pinned form: the tile shape and split_k (values of :func:`plan`'s ``pinned``)."""
        return {**self.tile.shape(), "split_k": self.split_k}


@dataclass(frozen=True)
class DequantPlan:
    """The weights dequantized (``lsq_w4a16_dequantize``) into an [n, k] scratch tensor in the
    activation dtype, then a dense GEMM on them."""

    m: int
    n: int
    k: int

    workspace_floats = 0  # the scratch is the activation dtype's, see scratch_bytes

    @property
    def scratch_bytes(self) -> int:
        return 2 * self.n * self.k

    def to_dict(self) -> dict[str, int]:
        """The pinned form."""
        return {"dequant": 1}


Plan = GemmPlan | DequantPlan


def configs(lib: ctypes.CDLL) -> tuple[TileConfig, ...]:
    """The C table of the loaded library (library.load types its entry points), in id order
    (callable without a GPU). lsq_w4a16_config writes the fields in TILE_FIELDS' order."""
    table = []
    for i in range(lib.lsq_w4a16_num_configs()):
        out = [ctypes.c_int32() for _ in TILE_FIELDS]
        if lib.lsq_w4a16_config(i, *(ctypes.byref(v) for v in out)) != 0:
            raise RuntimeError(f"lsq_w4a16_config refused id {i} of its own table")
        table.append(TileConfig(i, **{f: v.value for f, v in zip(TILE_FIELDS, out, strict=True)}))
    return tuple(table)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def m_bucket(m: int) -> int:
    """The smallest row bucket >= m, and 512 for every m > 256 (the Triton backend's)."""
    if m < 1:
        raise ValueError(f"row count must be >= 1, got {m}")
    return next((b for b in M_BUCKETS if m <= b), M_BUCKETS[-1])


def gemm_key(n: int, k: int, bucket: int) -> str:
    """Pinned-config key of one GEMM shape and row bucket (the Triton backend's format)."""
    return f"w4a16/N{n}xK{k}/m{bucket}"


def workspace_bytes(split_k: int, m: int, n: int) -> int:
    """fp32 partials [split_k, m, Np]; none without split-K."""
    return 0 if split_k == 1 else split_k * m * cdiv(n, N_ALIGN) * N_ALIGN * 4


def split_ok(cfg: TileConfig, k: int, group_size: int, split_k: int) -> bool:
    """Whether ``split_k`` cuts k into non-empty slices of whole k-steps, each at least one
    group long (the C entry point itself refuses only empty slices)."""
    steps = cdiv(k, cfg.block_k)
    if not 1 <= split_k <= min(steps, MAX_SPLIT_K):
        return False
    per = cdiv(steps, split_k)
    if (split_k - 1) * per >= steps:
        return False
    return split_k == 1 or per * cfg.block_k >= group_size


def make_plan(cfg: TileConfig, m: int, n: int, k: int, split_k: int) -> GemmPlan:
    steps = cdiv(k, cfg.block_k)
    per = cdiv(steps, split_k)
    grid = (cdiv(n, cfg.block_n), cdiv(m, cfg.block_m), split_k)
    return GemmPlan(cfg.id, cfg, split_k, steps, per, grid, workspace_bytes(split_k, m, n))


def _check(m: int, n: int, k: int, group_size: int, sm_count: int) -> None:
    if group_size not in GROUP_SIZES:
        raise ValueError(f"group_size must be one of {GROUP_SIZES}, got {group_size!r}")
    if m < 1 or n < 1 or k < 1:
        raise ValueError(f"m, n and k must be positive, got m={m}, n={n}, k={k}")
    if sm_count < 1:
        raise ValueError(f"sm_count must be positive, got {sm_count}")


def candidates(table: tuple[TileConfig, ...], m: int) -> list[TileConfig]:
    """The configs worth timing for m rows: the 16-row ones at decode; else those whose
    block_m is at least 32 and at most m rounded up to a power of two (>= 64 when m > 64)."""
    if m <= DECODE_ROWS:
        found = [c for c in table if c.block_m <= DECODE_ROWS]
    else:
        top = 1 << (m - 1).bit_length()
        low = 64 if m > 64 else 32
        found = [c for c in table if low <= c.block_m <= top]
        if not found:  # a table without such tiles: the nearest block_m
            best = min(abs(c.block_m - min(m, top)) for c in table)
            found = [c for c in table if abs(c.block_m - min(m, top)) == best]
    if not found:
        raise ValueError("the GEMM library has no tile configs")
    return found


def blocks_per_sm(cfg: TileConfig, smem_per_sm: int = _SMEM_PER_SM) -> int:
    """Resident blocks per SM, from shared memory (1 KiB reserved per block), threads and a
    register estimate; at least 1."""
    by_smem = smem_per_sm // (cfg.smem_bytes + 1024)
    by_threads = _THREADS_PER_SM // cfg.threads
    by_regs = _REGS_PER_SM // (cfg.threads * _REGS_PER_THREAD)
    return max(1, min(by_smem, by_threads, by_regs, _MAX_BLOCKS_PER_SM))


def estimate_seconds(
    cfg: TileConfig,
    m: int,
    n: int,
    k: int,
    group_size: int,
    split_k: int,
    sm_count: int,
    smem_per_sm: int = _SMEM_PER_SM,
) -> float:
    """The model's time for one launch (see the module docstring); only comparisons matter."""
    p = make_plan(cfg, m, n, k, split_k)
    np_ = cdiv(n, N_ALIGN) * N_ALIGN
    slots = sm_count * blocks_per_sm(cfg, smem_per_sm)
    per_sm = cdiv(p.blocks, sm_count)
    step_flops = 2 * cfg.block_m * cfg.block_n * cfg.block_k
    compute = per_sm * p.steps_per_split * step_flops / _SM_FLOPS
    # rows of x past m are zero-filled by the copy, not fetched
    stage_bytes = cfg.block_k * cfg.block_n // 2 + 2 * min(m, cfg.block_m) * cfg.block_k
    depth = min(p.steps_per_split, cfg.stages - 1)
    in_flight = min(p.blocks, slots) * depth * stage_bytes
    bandwidth = min(_HBM_BYTES_PER_S, in_flight / _LATENCY_S)
    hbm_bytes = np_ * cdiv(k, 16) * 8 + 2 * m * k + 2 * m * n
    memory = hbm_bytes / bandwidth
    chain = cdiv(p.blocks, slots) * cdiv(p.steps_per_split, cfg.stages - 1) * _LATENCY_S
    rate = issue_rate(cfg, per_sm, blocks_per_sm(cfg, smem_per_sm))
    issue = per_sm * p.steps_per_split * step_instructions(cfg, group_size) / rate
    total = max(compute, memory, chain, issue)
    if split_k > 1:  # the last block of a tile reads its partials (one round trip), or a launch
        tail = _LATENCY_S if p.grid[0] * p.grid[1] <= SPLIT_COUNTERS else _LAUNCH_S
        total += tail + (8 * split_k * m * np_ + 2 * m * n) / _HBM_BYTES_PER_S
    return total


def step_instructions(cfg: TileConfig, group_size: int) -> float:
    """Warp instructions one block issues per k-step: each warp along m converts the step's
    block_k * block_n / 8 weight words, and the (s, b) pairs of each group its run of the step
    touches (2 qparams words per 16 columns; a tile not compiled per group size converts them
    at every slice pair where a group of 32 could start); the block issues one mma.sync per
    m16n8k16. Swapped tiles: :func:`_swapped_step_instructions`."""
    if cfg.swap_ab:
        return _swapped_step_instructions(cfg, group_size)
    words = cfg.block_k * cfg.block_n / 8
    run = cfg.block_k // cfg.warps_k  # k depth of one warp's slices in a step
    per_group_size = cfg.block_m <= DECODE_ROWS  # csrc's kPerGroupSize
    groups = max(1, run // (group_size if per_group_size else 32))
    pairs_per_word = 32 * groups / run
    convert = words * cfg.warps_m * (_WORD_INSTR + _PAIR_INSTR * pairs_per_word) / 32
    return convert + (cfg.block_m // 16) * (cfg.block_n // 8) * (cfg.block_k // 16)


def _swapped_step_instructions(cfg: TileConfig, group_size: int) -> float:
    """The same for a swapped tile: the words' conversion, one mma per word and 8 rows of x,
    per run of slices inside one group the fp32 scale and offset of every accumulator, and per
    slice and 8 rows of each warp the ldmatrix of x and the mma summing it."""
    row_tiles = cfg.block_m // 8
    warps_n = cfg.warps // (cfg.warps_m * cfg.warps_k)
    run = min(cfg.block_k // cfg.warps_k, group_size)  # k depth of a warp's run in one group
    convert = cfg.block_k * cfg.block_n / 8 * _SWAP_WORD_INSTR / 32
    mma = row_tiles * (cfg.block_n // 16) * (cfg.block_k // 16)
    scale = (cfg.block_k // run) * (cfg.block_n // 16) * (2 * _SWAP_PAIR_INSTR + 8 * row_tiles)
    sums = 2 * row_tiles * warps_n * (cfg.block_k // 16)
    return convert + mma + scale + sums


def issue_rate(cfg: TileConfig, per_sm: int, slots_per_sm: int) -> float:
    """Warp instructions a second on the busiest SM, holding min(per_sm, its slots) blocks at
    once: fewer warps than hide the latencies leave issue cycles empty."""
    resident = min(per_sm, slots_per_sm)
    warps_per_scheduler = resident * cfg.warps / _SCHEDULERS
    return _SCHEDULERS * _CLOCK_HZ * min(1.0, _ISSUE_PER_WARP * warps_per_scheduler)


def dense_speedup(arch: str) -> float:
    """cuBLAS's tensor-core rate over mma.sync's on ``arch`` (``sm_90``); 1 where it has none
    faster."""
    return _DENSE_SPEEDUP.get(arch, 1.0)


def estimate_dequant_seconds(m: int, n: int, k: int, sm_count: int, speedup: float) -> float:
    """The model's time for the dequantized path: the packed weights read and the dense ones
    written at HBM bandwidth, then a dense GEMM bound by its compute or its bytes."""
    np_, kp = cdiv(n, N_ALIGN) * N_ALIGN, cdiv(k, 16) * 16
    dequant = _LAUNCH_S + (np_ * kp // 2 + 2 * n * k) / _HBM_BYTES_PER_S
    compute = 2 * m * n * k / (sm_count * _SM_FLOPS * speedup)
    memory = (2 * n * k + 2 * m * k + 2 * m * n) / _HBM_BYTES_PER_S
    return dequant + _LAUNCH_S + max(compute, memory)


def plan(
    table: tuple[TileConfig, ...],
    m: int,
    n: int,
    k: int,
    group_size: int,
    sm_count: int,
    pinned: Mapping[int | str, Mapping[str, int]] | None = None,
    arch: str = "sm_90",
    smem_per_sm: int = _SMEM_PER_SM,
) -> Plan:
    """How to compute ``y[m, n] = x[m, k] @ W^T`` with ``table`` (:func:`configs`) on a GPU of
    ``arch`` with ``sm_count`` SMs: the pinned entry for m's row bucket when ``pinned`` has one
    (keyed by the bucket, or by ``w4a16/N{n}xK{k}/m{bucket}``), else the model's choice
    (:func:`ranked`). A pinned entry naming no tile of the table, or a split this k cannot
    take, raises ValueError (the caller warns and plans without it)."""
    _check(m, n, k, group_size, sm_count)
    bucket = m_bucket(m)
    key = gemm_key(n, k, bucket)
    if pinned:
        for found in (bucket, key):
            if found in pinned:
                return _pinned_plan(table, key, pinned[found], m, n, k, group_size)
    return ranked(table, m, n, k, group_size, sm_count, arch, smem_per_sm)[0]


def ranked(
    table: tuple[TileConfig, ...],
    m: int,
    n: int,
    k: int,
    group_size: int,
    sm_count: int,
    arch: str = "sm_90",
    smem_per_sm: int = _SMEM_PER_SM,
) -> list[Plan]:
    """Every candidate plan, the model's choice first and the rest by estimate (what ``lite
    tune`` times). The choice among the fused launches within 3% of the fastest: fewer splits,
    more SMs busy, fewer warp instructions, the lower id. Past the decode rows the dequantized path
    competes too, and is the choice only when clearly faster (by _DEQUANT_MARGIN)."""
    _check(m, n, k, group_size, sm_count)
    timed: list[tuple[float, Plan]] = []
    for cfg in candidates(table, m):
        for split in range(1, MAX_SPLIT_K + 1):
            if split_ok(cfg, k, group_size, split):
                seconds = estimate_seconds(cfg, m, n, k, group_size, split, sm_count, smem_per_sm)
                timed.append((seconds, make_plan(cfg, m, n, k, split)))
    fastest = min(t for t, _ in timed)
    choice = min(
        (p for t, p in timed if t <= fastest * _TIE),
        key=lambda p: _preference(p, sm_count, group_size),
    )
    if m > DECODE_ROWS:
        dequant = estimate_dequant_seconds(m, n, k, sm_count, dense_speedup(arch))
        if dequant * _DEQUANT_MARGIN < fastest:
            choice = DequantPlan(m, n, k)
        timed.append((dequant, DequantPlan(m, n, k)))
    rest = [p for _, p in sorted(timed, key=lambda tp: tp[0]) if p != choice]
    return [choice, *rest]


def _preference(p: GemmPlan, sm_count: int, group_size: int) -> tuple[int, int, float, int]:
    """Among near-equal estimates: fewer splits, more SMs busy, fewer warp instructions in all
    (larger tiles convert each weight word for more rows), the lower id."""
    issued = p.blocks * p.steps_per_split * step_instructions(p.tile, group_size)
    return (p.split_k, -min(p.blocks, sm_count), issued, p.config)


def _pinned_plan(
    table: tuple[TileConfig, ...],
    key: str,
    entry: Mapping[str, int],
    m: int,
    n: int,
    k: int,
    group_size: int,
) -> Plan:
    if not isinstance(entry, Mapping):
        raise ValueError(f"pinned {key}: expected a mapping, got {type(entry).__name__}")
    if dict(entry) == DequantPlan(m, n, k).to_dict():
        return DequantPlan(m, n, k)
    if "swap_ab" not in entry:  # pinned before the swapped tiles existed: an unswapped one
        entry = {**entry, "swap_ab": 0}
    want = {*TILE_FIELDS, "split_k"}
    if set(entry) != want:
        raise ValueError(
            f"pinned {key}: keys must be {sorted(want)} (or only dequant: 1), got "
            f"{sorted(str(x) for x in entry)}"
        )
    shape = {f: entry[f] for f in want - {"split_k"}}
    cfg = next((c for c in table if c.shape() == shape), None)
    if cfg is None:
        raise ValueError(f"pinned {key}: no tile config {shape} in the GEMM library")
    split = entry["split_k"]
    if not isinstance(split, int) or not split_ok(cfg, k, group_size, split):
        raise ValueError(
            f"pinned {key}: split_k={split!r} does not cut K={k} into non-empty slices of "
            f"{cfg.block_k}-deep steps, each at least one group of {group_size}"
        )
    return make_plan(cfg, m, n, k, split)
