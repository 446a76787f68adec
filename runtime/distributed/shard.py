"""Which slice of the model a tensor-parallel rank owns.

Attention is split by heads and the MLP by intermediate channels, each rank a contiguous range,
so that every linear is cut where the artifact's layout can be cut without unpacking
(docs/artifact-layout.md, section 8): the column-parallel linears (q/k/v, gate/up) at multiples
of 64 output columns, the row-parallel ones (o, down) at multiples of the group size along K.
The split is as even as those units allow; a remainder unit goes to the first ranks, a partial
one to the last. A rank's query heads always share their KV heads the same way the whole model
does: either whole GQA groups (each KV head once, on one rank), or, with fewer KV heads than
ranks, a part of one group whose KV head is then replicated on every rank of that group.
The embedding and lm_head are split by vocabulary rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from runtime.artifact.layout import N_ALIGN
from runtime.artifact.manifest import Architecture
from runtime.artifact.reader import Artifact, Span, linear_slices


@dataclass(frozen=True)
class Shard:
    rank: int
    size: int
    heads: Span  # query heads
    kv_heads: Span
    intermediate: Span  # MLP channels
    vocab: Span  # embedding / lm_head rows
    vocab_rows: int  # rows every rank's logits are padded to for the gather: ceil(V / size)
    head_dim: int

    @property
    def num_heads(self) -> int:
        return self.heads[1] - self.heads[0]

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]

    @property
    def q_cols(self) -> Span:
        """q_proj's output columns, and o_proj's input rows."""
        return self.heads[0] * self.head_dim, self.heads[1] * self.head_dim

    @property
    def kv_cols(self) -> Span:
        return self.kv_heads[0] * self.head_dim, self.kv_heads[1] * self.head_dim

    def linear(self, name: str) -> tuple[Span | None, Span | None]:
        """(output columns, input rows) this rank keeps of a decoder layer's linear, by its
        artifact name: q/k/v and gate/up column-parallel, o and down row-parallel."""
        return {
            "q_proj": (self.q_cols, None),
            "k_proj": (self.kv_cols, None),
            "v_proj": (self.kv_cols, None),
            "o_proj": (None, self.q_cols),
            "gate_proj": (self.intermediate, None),
            "up_proj": (self.intermediate, None),
            "down_proj": (None, self.intermediate),
        }[name.rsplit(".", 1)[-1]]

    def keeps_bias(self, name: str) -> bool:
        """A row-parallel linear's bias is added once, by rank 0, after nothing else: the
        all-reduce sums the ranks' partial outputs."""
        return self.linear(name)[1] is None or self.rank == 0

    def stored_bytes(self, art: Artifact) -> int:
        """Bytes of the artifact's tensors this rank reads (what `runtime plan --tp` counts
        per rank; a GPU holds them as stored)."""
        total = 0
        gs = art.manifest.quantization.group_size
        for name, entry in art.manifest.tensors.items():
            base, _, suffix = name.rpartition(".")
            if entry.kind in ("qweight", "qparams"):
                (n, k), (cols, rows) = entry.logical_shape, self.linear(base)
                qweight, qparams = linear_slices(n, k, gs, cols, rows)
                total += art.nbytes(name, *(qweight if entry.kind == "qweight" else qparams))
            elif suffix == "bias" and ".layers." in name:
                total += art.nbytes(name, self.linear(base)[0]) if self.keeps_bias(base) else 0
            elif base in ("model.embed_tokens", "lm_head"):
                total += art.nbytes(name, self.vocab)
            else:
                total += art.nbytes(name)
        return total


def split(total: int, unit: int, size: int) -> list[Span]:
    """[0, total) cut into `size` contiguous spans at multiples of `unit` (the last may end on a
    partial unit), as even as whole units allow. Refuses when there are fewer units than
    spans: a rank with nothing to do would still pay every collective."""
    units = -(-total // unit)
    if units < size:
        raise ValueError(f"{total} cannot be split {size} ways in units of {unit}")
    bounds = [0]
    for r in range(size):
        bounds.append(bounds[-1] + units // size + (r < units % size))
    return [(b * unit, min(e * unit, total)) for b, e in zip(bounds, bounds[1:], strict=False)]


def _steps(width: int, align: int) -> int:
    """The fewest items of `width` columns whose total is a multiple of `align`."""
    return align // math.gcd(width, align)


def _head_spans(arch: Architecture, group_size: int, size: int) -> list[tuple[Span, Span]]:
    """(query heads, KV heads) per rank. A cut between query heads must fall on 64 columns of
    q_proj and on a group of o_proj's K; a cut between KV heads on 64 columns of k/v_proj."""
    h, hkv, d = arch.num_heads, arch.num_kv_heads, arch.head_dim
    g = h // hkv
    q_align = math.lcm(N_ALIGN, group_size)
    if hkv >= size:
        unit = math.lcm(_steps(g * d, q_align), _steps(d, N_ALIGN))  # whole GQA groups
        groups = split(hkv, unit, size)
        return [((a * g, b * g), (a, b)) for a, b in groups]
    if size % hkv:
        raise ValueError(f"{hkv} KV heads cannot be shared evenly by {size} ranks")
    per_kv = size // hkv  # ranks sharing one replicated KV head
    spans = []
    for r in range(size):
        kv, part = divmod(r, per_kv)
        a, b = split(g, _steps(d, q_align), per_kv)[part]
        spans.append(((kv * g + a, kv * g + b), (kv, kv + 1)))
    return spans


def plan_shards(arch: Architecture, group_size: int, size: int) -> list[Shard]:
    """Every rank's shard, or a ValueError that says which dimension cannot be split."""
    try:
        heads = _head_spans(arch, group_size, size)
        mlp = split(arch.intermediate_size, math.lcm(N_ALIGN, group_size), size)
    except ValueError as e:
        raise ValueError(
            f"tensor parallelism over {size} ranks cannot split this model ({arch.num_heads} "
            f"heads, {arch.num_kv_heads} KV heads of {arch.head_dim}, intermediate "
            f"{arch.intermediate_size}, group size {group_size}) on the layout's 64-column "
            f"and group boundaries: {e}; use fewer ranks"
        ) from e
    for (q0, _), (kv0, _) in heads:
        if (q0 * arch.head_dim) % math.lcm(N_ALIGN, group_size) or (kv0 * arch.head_dim) % N_ALIGN:
            raise ValueError(
                f"tensor parallelism over {size} ranks would cut heads of {arch.head_dim} "
                f"off the layout's 64-column and group-size-{group_size} boundaries; use fewer "
                f"ranks"
            )
    rows = -(-arch.vocab_size // size)
    return [
        Shard(
            rank=r,
            size=size,
            heads=heads[r][0],
            kv_heads=heads[r][1],
            intermediate=mlp[r],
            vocab=(min(r * rows, arch.vocab_size), min((r + 1) * rows, arch.vocab_size)),
            vocab_rows=rows,
            head_dim=arch.head_dim,
        )
        for r in range(size)
    ]
