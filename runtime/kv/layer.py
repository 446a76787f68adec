"""One layer's view of the pool, and the reference read and write paths over it.

Kernels take a ``LayerKV`` (raw tensors and the spec) and nothing else from the pool; the
methods here are the torch formulation every kernel is tested against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.kv.format import KVSpec, dequantize_kv, quantize_kv


@dataclass(frozen=True)
class LayerKV:
    """One layer's slice of the pool: the six tensors a kernel reads or writes.

    ``k``/``v`` are ``[num_blocks, block_size, H, D]`` (quantized: uint8 codes, int4 packed to
    ``D // 2``); the four parameters are fp16 ``[num_blocks, block_size, H]``, or None when the
    pool is unquantized."""

    spec: KVSpec
    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    k_zero: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None
    v_zero: torch.Tensor | None = None

    @property
    def quantized(self) -> bool:
        return self.k_scale is not None

    @property
    def num_blocks(self) -> int:
        return self.k.shape[0]

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.spec.block_size

    @property
    def device(self) -> torch.device:
        return self.k.device

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """(k, v, k_scale, k_zero, v_scale, v_zero); an unquantized layer passes its K in place
        of the never-read parameters, for kernels that take six pointers."""
        params = (self.k_scale, self.k_zero, self.v_scale, self.v_zero)
        return (self.k, self.v, *(p if p is not None else self.k for p in params))

    def _sides(self) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """K's and V's stored tensors: (codes,) unquantized, else (codes, scale, zero)."""
        if not self.quantized:
            return (self.k,), (self.v,)
        return (self.k, self.k_scale, self.k_zero), (self.v, self.v_scale, self.v_zero)

    def _flat(self, t: torch.Tensor) -> torch.Tensor:
        return t.view(self.num_slots, *t.shape[2:])

    def write(self, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store ``k``, ``v`` ``[T, H, D]`` at ``slot_mapping [T]``; slots < 0 are padding."""
        s = self.spec
        expected = (slot_mapping.shape[0], s.num_kv_heads, s.head_dim)
        if slot_mapping.dim() != 1 or tuple(k.shape) != expected or tuple(v.shape) != expected:
            raise ValueError(
                f"write expects k, v {list(expected)} and slot_mapping [T]; got k "
                f"{list(k.shape)}, v {list(v.shape)}, slot_mapping {list(slot_mapping.shape)}"
            )
        slots = slot_mapping.to(device=self.device, dtype=torch.long)
        if bool((slots < 0).any()):
            keep = slots >= 0
            slots, k, v = slots[keep], k[keep], v[keep]
        if not self.quantized:
            self._flat(self.k)[slots] = k.to(s.dtype)
            self._flat(self.v)[slots] = v.to(s.dtype)
            return
        # K and V quantized in one call: half the small ops on the per-layer decode path
        q, sc, z = quantize_kv(torch.stack((k, v)).to(self.device), s.kv_quant)
        for i, side in enumerate(self._sides()):
            for stored, value in zip(side, (q[i], sc[i], z[i]), strict=True):
                self._flat(stored)[slots] = value

    def slots_for(self, block_table: torch.Tensor, length: int) -> torch.Tensor:
        """Slots of positions ``0..length-1`` of a sequence with ``block_table``."""
        bs = self.spec.block_size
        needed = -(-length // bs)
        if block_table.numel() < needed:
            raise ValueError(
                f"block table has {block_table.numel()} blocks; {length} tokens need {needed}"
            )
        pos = torch.arange(length, device=self.device)
        table = block_table.to(device=self.device, dtype=torch.long).reshape(-1)
        return table[pos // bs] * bs + pos % bs

    def gather(self, block_table: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized K, V ``[length, H, D]`` in ``spec.dtype`` of a sequence's first tokens."""
        return self.read(self.slots_for(block_table, length), self.spec.dtype)

    def read_blocks(
        self, blocks: torch.Tensor
    ) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """K and V of whole blocks ``[B, NB]`` as stored, flattened to ``[B, NB * bs, ...]``:
        ``(codes,)`` unquantized, else ``(codes, scale, zero)`` with int4 codes unpacked to
        one uint8 per element. Copying whole blocks (contiguous runs) costs a fraction of a
        per-slot gather; attention then works on the codes without dequantizing them."""
        b, nb = blocks.shape
        ids = blocks.reshape(-1)

        def take(t: torch.Tensor) -> torch.Tensor:  # index_select: 20x aten::index here
            return t.index_select(0, ids).view(b, nb * t.shape[1], *t.shape[2:])

        out = []
        for side in self._sides():
            taken = [take(t) for t in side]
            if self.spec.kv_quant == "int4":
                c = taken[0]
                taken[0] = torch.stack((c & 0xF, c >> 4), dim=-1).flatten(-2)
            out.append(tuple(taken))
        return out[0], out[1]

    def read(self, slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V at ``slots`` (any shape) as ``[*slots.shape, H, D]`` in ``dtype``, dequantized
        straight into it (a batched decode reads every sequence's context in one call)."""
        if not self.quantized:
            return self._flat(self.k)[slots].to(dtype), self._flat(self.v)[slots].to(dtype)
        k, v = (
            dequantize_kv(*(self._flat(t)[slots] for t in side), self.spec.kv_quant, dtype)
            for side in self._sides()
        )
        return k, v
