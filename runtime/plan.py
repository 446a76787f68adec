"""`runtime plan`: capacity arithmetic for an artifact, per KV policy, before deploying it.

With --tp N the memory given is each rank's (each GPU's): a rank holds its slice of the
weights and the KV heads of its attention heads, and the pool of every rank has the same
number of blocks, so the rank with the least room left sets the capacity."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.artifact.manifest import BLOCK_MULTIPLE
from runtime.artifact.reader import Artifact
from runtime.distributed.shard import plan_shards
from runtime.kv.format import KV_QUANT, KVSpec

DEFAULT_AVG_LEN = 4000


@dataclass(frozen=True)
class PlanRow:
    kv_quant: str
    bytes_per_token: int
    bytes_per_block: int
    blocks: int
    tokens: int
    sequences: int  # of --avg-len tokens each, whole blocks per sequence


def weight_bytes(art: Artifact) -> int:
    """Resident weights as a GPU holds them: the stored tensors, byte for byte."""
    return sum(f.size for name, f in art.manifest.files.items() if name.endswith(".safetensors"))


@dataclass(frozen=True)
class RankMemory:
    rank: int
    weights: int  # bytes of the artifact's tensors the rank holds
    kv_heads: int


def ranks(art: Artifact, tp: int) -> list[RankMemory]:
    """Each rank's weights and KV heads (one rank: the whole artifact)."""
    a = art.manifest.architecture
    if tp == 1:
        return [RankMemory(0, weight_bytes(art), a.num_kv_heads)]
    shards = plan_shards(a, art.manifest.quantization.group_size, tp)
    return [RankMemory(s.rank, s.stored_bytes(art), s.num_kv_heads) for s in shards]


def default_avg_len(art: Artifact) -> int:
    """4000 tokens, or the model's positions if fewer: an explicit --avg-len past them is
    refused, and a default must not be."""
    return min(DEFAULT_AVG_LEN, art.manifest.architecture.max_position_embeddings)


def plan(art: Artifact, memory: int, avg_len: int, block_size: int, tp: int = 1) -> list[PlanRow]:
    """`memory` is each rank's; the byte columns are the fullest rank's."""
    a = art.manifest.architecture
    if avg_len < 1:
        raise ValueError(f"--avg-len {avg_len}: a sequence holds at least one token")
    if avg_len > a.max_position_embeddings:
        raise ValueError(
            f"--avg-len {avg_len} is over the model's max_position_embeddings "
            f"({a.max_position_embeddings}), the longest session the engine serves; use "
            f"--avg-len {a.max_position_embeddings} or less"
        )
    if block_size < 1 or block_size % BLOCK_MULTIPLE:
        raise ValueError(
            f"--cache-block-seq-len {block_size}: the engine takes a positive multiple of "
            f"{BLOCK_MULTIPLE}"
        )
    weights = max(r.weights for r in ranks(art, tp))
    if memory <= weights:
        raise ValueError(
            f"--memory {memory:,} bytes ({memory / 2**30:.2f} GiB) does not hold the weights "
            f"({weights / 2**30:.2f} GiB), so no KV cache fits: give more, e.g. "
            f"--memory {weights // 2**30 + 1}GiB"
        )
    rows = []
    for kv in KV_QUANT:
        specs = [
            (r, KVSpec(a.num_layers, r.kv_heads, a.head_dim, block_size, kv, torch.float16))
            for r in ranks(art, tp)
        ]
        blocks = min(max(memory - r.weights, 0) // spec.bytes_per_block() for r, spec in specs)
        spec = max((spec for _, spec in specs), key=lambda s: s.bytes_per_block())
        per_seq = -(-avg_len // block_size)
        rows.append(
            PlanRow(
                kv,
                spec.bytes_per_token(),
                spec.bytes_per_block(),
                blocks,
                blocks * block_size,
                blocks // per_seq,
            )
        )
    if not any(r.blocks for r in rows):  # a table of zeros, exit 0: read as a plan that fits
        smallest = min(r.bytes_per_block for r in rows)
        raise ValueError(
            f"--memory {memory:,} bytes holds the weights ({weights:,} bytes) but not one KV "
            f"block of any policy (the smallest takes {smallest:,} bytes): give more"
        )
    return rows


def render(rows: list[PlanRow], art: Artifact, memory: int, avg_len: int, tp: int = 1) -> str:
    a = art.manifest.architecture
    lines = [
        f"{art.manifest.source.id}: {a.num_layers} layers, {a.num_kv_heads} KV heads x {a.head_dim}"
    ]
    for r in ranks(art, tp):
        who, heads = (f"rank {r.rank}: ", f" for {r.kv_heads} KV heads") if tp > 1 else ("", "")
        lines.append(
            f"{who}memory {memory / 2**30:.2f} GiB - weights {r.weights / 2**30:.2f} GiB = KV "
            f"pool {max(memory - r.weights, 0) / 2**30:.2f} GiB{heads}; sequences of {avg_len} "
            "tokens"
        )
    lines += [
        "",
        f"{'kv':<6} {'bytes/token':>12} {'bytes/block':>12} {'blocks':>10} {'tokens':>12} "
        f"{'sequences':>10}",
    ]
    for r in rows:
        lines.append(
            f"{r.kv_quant:<6} {r.bytes_per_token:>12,} {r.bytes_per_block:>12,} "
            f"{r.blocks:>10,} {r.tokens:>12,} {r.sequences:>10,}"
        )
    batch = art.manifest.launch.max_batch_size
    lines += [
        "",
        f"For a GPU (fp16 KV). The engine runs at most {batch} sequences at once "
        "(max_batch_size). On a CPU the `none` pool is fp32 (twice its bytes here) and the "
        "weights take more than their stored bytes: its start-up log (-v) gives both.",
    ]
    return "\n".join(lines)
