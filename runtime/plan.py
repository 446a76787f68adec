"""`runtime plan`: capacity arithmetic for an artifact, per KV policy, before deploying it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.artifact.reader import Artifact
from runtime.kv.format import KV_QUANT, KVSpec


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


def plan(art: Artifact, memory: int, avg_len: int, block_size: int) -> list[PlanRow]:
    a = art.manifest.architecture
    kv_memory = max(memory - weight_bytes(art), 0)
    rows = []
    for kv in KV_QUANT:
        spec = KVSpec(a.num_layers, a.num_kv_heads, a.head_dim, block_size, kv, torch.float16)
        blocks = kv_memory // spec.bytes_per_block()
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
    return rows


def render(rows: list[PlanRow], art: Artifact, memory: int, avg_len: int) -> str:
    w = weight_bytes(art)
    lines = [
        f"{art.manifest.source.id}: {art.manifest.architecture.num_layers} layers, "
        f"{art.manifest.architecture.num_kv_heads} KV heads x {art.manifest.architecture.head_dim}",
        f"memory {memory / 2**30:.2f} GiB - weights {w / 2**30:.2f} GiB = KV pool "
        f"{max(memory - w, 0) / 2**30:.2f} GiB; sequences of {avg_len} tokens",
        "",
        f"{'kv':<6} {'bytes/token':>12} {'bytes/block':>12} {'blocks':>10} {'tokens':>12} "
        f"{'sequences':>10}",
    ]
    for r in rows:
        lines.append(
            f"{r.kv_quant:<6} {r.bytes_per_token:>12,} {r.bytes_per_block:>12,} "
            f"{r.blocks:>10,} {r.tokens:>12,} {r.sequences:>10,}"
        )
    return "\n".join(lines)
