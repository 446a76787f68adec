"""The paged KV pool, with online per-token, per-KV-head asymmetric int8/int4 quantization.

The pool is a fixed set of blocks, each holding ``block_size`` token slots. A token's slot is
``block_id * block_size + offset``; the block manager hands out block ids and the model runner
turns positions into slots (``slot_mapping``) and per-sequence ``block_tables``.

Storage, per layer ``l`` (Python lists indexed by layer, every tensor claimed up front with
``torch.zeros`` so the pool's memory is taken when the engine starts):

``kv_quant == "none"``
    ``k_cache[l]``, ``v_cache[l]``: ``[num_blocks, block_size, H, D]`` in ``spec.dtype``.
    ``k_scale``/``k_zero``/``v_scale``/``v_zero`` are empty lists.

``kv_quant == "int8"``
    ``k_cache[l]``, ``v_cache[l]``: uint8 codes ``[num_blocks, block_size, H, D]``;
    ``k_scale[l]``, ``k_zero[l]``, ``v_scale[l]``, ``v_zero[l]``: fp16
    ``[num_blocks, block_size, H]``, one (scale, zero) per token per KV head.

``kv_quant == "int4"``
    as int8, but codes are ``[num_blocks, block_size, H, D // 2]`` uint8 with two 4-bit codes
    per byte: element ``2i`` in the low nibble, element ``2i + 1`` in the high nibble.

Quantization (one token's ``D``-vector of one KV head at a time, ``qmax`` = 255 or 15):

* ``zero`` is the **additive offset**, not an integer zero-point: ``zero = fp16(min(x))``
  rounded *down* (towards -inf), and ``scale = fp16((max(x) - zero) / qmax)`` rounded *up*
  (never below the smallest positive fp16, so a constant vector never divides by zero).
* ``q = clamp(round((x - zero) / scale), 0, qmax)`` (round half to even).
* **Dequantization is ``x = q * scale + zero``** (one fused multiply-add; this is the
  ``(s, -z*s)`` form of ``(q - z) * s`` with ``z = -zero / scale``). Compute it in fp32 and
  cast to ``spec.dtype``.

Because ``zero <= min`` and ``zero + qmax * scale >= max`` (up to fp32 rounding), no code is
clamped by more than rounding, and the error per element is at most ``scale / 2``, where
``scale`` exceeds the ideal ``(max - min) / qmax`` only by fp16 rounding (relative 2**-10,
plus the rounding of ``min`` divided by ``qmax``, plus 2**-24 absolute in the subnormal
range). A constant vector never divides by zero and comes back within fp16 rounding; when its
value is representable in fp16 (always, for fp16 KV) ``zero`` is that value, ``q = 0`` and it
comes back exactly. Values beyond the fp16 range (|x| > 65504) saturate; NaN/inf are not
supported.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

KV_QUANT = ("none", "int8", "int4")
KV_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
QMAX = {"int8": 255, "int4": 15}
# bytes of per-token, per-head quantization parameters: fp16 scale + fp16 zero
_PARAM_BYTES = 4
_FP16_MAX = 65504.0
_FP16_TINY = 2.0**-24  # smallest positive (subnormal) fp16


@dataclass(frozen=True)
class KVSpec:
    """Shape and policy of the KV pool. ``dtype`` is the dtype of unquantized K/V."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    kv_quant: str
    dtype: torch.dtype

    def validate(self) -> None:
        if self.kv_quant not in KV_QUANT:
            raise ValueError(
                f"unknown kv_quant {self.kv_quant!r}: expected one of {', '.join(KV_QUANT)}"
            )
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.dtype not in KV_DTYPES:
            raise ValueError(f"KV dtype must be float16, bfloat16 or float32, got {self.dtype}")
        if self.kv_quant == "int4" and self.head_dim % 2:
            raise ValueError(
                f"kv_quant int4 packs two codes per byte: head_dim {self.head_dim} is odd"
            )

    def bytes_per_token(self) -> int:
        """K and V of one token over all layers, including scale/zero storage."""
        self.validate()
        if self.kv_quant == "none":
            per_head = self.head_dim * torch.empty((), dtype=self.dtype).element_size()
        elif self.kv_quant == "int8":
            per_head = self.head_dim + _PARAM_BYTES
        else:
            per_head = self.head_dim // 2 + _PARAM_BYTES
        return 2 * self.num_layers * self.num_kv_heads * per_head

    def bytes_per_block(self) -> int:
        return self.bytes_per_token() * self.block_size


def quantize_kv(x: torch.Tensor, kv_quant: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize ``x [..., D]`` along its last dim; returns uint8 codes (packed for int4) and
    fp16 ``scale``, ``zero`` of shape ``x.shape[:-1]``. See the module docstring."""
    qmax = QMAX[kv_quant]
    x = x.float().clamp(-_FP16_MAX, _FP16_MAX)
    lo, hi = torch.aminmax(x, dim=-1)
    zero = lo.half()
    down = torch.tensor(-_FP16_MAX, dtype=torch.float16, device=x.device)
    zero = torch.where(zero.float() > lo, torch.nextafter(zero, down), zero)
    step = ((hi - zero.float()) / qmax).clamp_min(_FP16_TINY)
    scale = step.half()
    up = torch.tensor(float("inf"), dtype=torch.float16, device=x.device)
    scale = torch.where(scale.float() < step, torch.nextafter(scale, up), scale)
    q = torch.round((x - zero.float()[..., None]) / scale.float()[..., None]).clamp_(0, qmax)
    q = q.to(torch.uint8)
    if kv_quant == "int4":
        q = q[..., 0::2] | (q[..., 1::2] << 4)
    return q, scale, zero


def dequantize_kv(
    codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, kv_quant: str, dtype: torch.dtype
) -> torch.Tensor:
    """Inverse of :func:`quantize_kv`: ``q * scale + zero`` in fp32, cast to ``dtype``."""
    if kv_quant == "int4":
        codes = torch.stack((codes & 0xF, codes >> 4), dim=-1).flatten(-2)
    x = codes.float() * scale.float()[..., None] + zero.float()[..., None]
    return x.to(dtype)


class KVCache:
    """The block pool of every layer. ``write`` quantizes online; ``gather`` is the reference
    read path (fast kernels read ``k_cache``/``v_cache``/scales/zeros directly)."""

    def __init__(self, spec: KVSpec, num_blocks: int, device: torch.device | str = "cpu") -> None:
        spec.validate()
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.spec = spec
        self.num_blocks = num_blocks
        self.device = torch.device(device)
        s = spec
        if s.kv_quant == "none":
            code_shape = (num_blocks, s.block_size, s.num_kv_heads, s.head_dim)
            code_dtype = s.dtype
        else:
            d = s.head_dim if s.kv_quant == "int8" else s.head_dim // 2
            code_shape = (num_blocks, s.block_size, s.num_kv_heads, d)
            code_dtype = torch.uint8
        param_shape = (num_blocks, s.block_size, s.num_kv_heads)

        def codes() -> list[torch.Tensor]:
            return [
                torch.zeros(code_shape, dtype=code_dtype, device=self.device)
                for _ in range(s.num_layers)
            ]

        def params() -> list[torch.Tensor]:
            if s.kv_quant == "none":
                return []
            return [
                torch.zeros(param_shape, dtype=torch.float16, device=self.device)
                for _ in range(s.num_layers)
            ]

        self.k_cache: list[torch.Tensor] = codes()
        self.v_cache: list[torch.Tensor] = codes()
        self.k_scale: list[torch.Tensor] = params()
        self.k_zero: list[torch.Tensor] = params()
        self.v_scale: list[torch.Tensor] = params()
        self.v_zero: list[torch.Tensor] = params()

    @property
    def quantized(self) -> bool:
        return self.spec.kv_quant != "none"

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.spec.block_size

    def nbytes(self) -> int:
        """Bytes actually allocated (equals ``num_blocks * spec.bytes_per_block()``)."""
        tensors = (
            self.k_cache + self.v_cache + self.k_scale + self.k_zero + self.v_scale + self.v_zero
        )
        return sum(t.numel() * t.element_size() for t in tensors)

    @staticmethod
    def num_blocks_for(spec: KVSpec, memory_bytes: int) -> int:
        """How many whole blocks fit in ``memory_bytes`` (0 when not even one does)."""
        return max(0, int(memory_bytes) // spec.bytes_per_block())

    def _flat(self, t: torch.Tensor) -> torch.Tensor:
        return t.view(self.num_slots, *t.shape[2:])

    def write(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
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
            self._flat(self.k_cache[layer])[slots] = k.to(s.dtype)
            self._flat(self.v_cache[layer])[slots] = v.to(s.dtype)
            return
        # K and V quantized in one call: half the small ops on the per-layer decode path
        q, sc, z = quantize_kv(torch.stack((k, v)).to(self.device), s.kv_quant)
        for i, (codes, scale, zero) in enumerate(
            ((self.k_cache, self.k_scale, self.k_zero), (self.v_cache, self.v_scale, self.v_zero))
        ):
            self._flat(codes[layer])[slots] = q[i]
            self._flat(scale[layer])[slots] = sc[i]
            self._flat(zero[layer])[slots] = z[i]

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

    def gather(
        self, layer: int, block_table: torch.Tensor, length: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized K, V ``[length, H, D]`` in ``spec.dtype`` of a sequence's first tokens."""
        return self.read(layer, self.slots_for(block_table, length), self.spec.dtype)

    def read_blocks(
        self, layer: int, blocks: torch.Tensor
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
        for codes, scale, zero in (
            (self.k_cache, self.k_scale, self.k_zero),
            (self.v_cache, self.v_scale, self.v_zero),
        ):
            c = take(codes[layer])
            if not self.quantized:
                out.append((c,))
                continue
            if self.spec.kv_quant == "int4":
                c = torch.stack((c & 0xF, c >> 4), dim=-1).flatten(-2)
            out.append((c, take(scale[layer]), take(zero[layer])))
        return out[0], out[1]

    def read(
        self, layer: int, slots: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V at ``slots`` (any shape) as ``[*slots.shape, H, D]`` in ``dtype``, dequantized
        straight into it (a batched decode reads every sequence's context in one call)."""
        s = self.spec
        if not self.quantized:
            k = self._flat(self.k_cache[layer])[slots]
            v = self._flat(self.v_cache[layer])[slots]
            return k.to(dtype), v.to(dtype)
        return tuple(
            dequantize_kv(
                self._flat(codes[layer])[slots],
                self._flat(scale[layer])[slots],
                self._flat(zero[layer])[slots],
                s.kv_quant,
                dtype,
            )
            for codes, scale, zero in (
                (self.k_cache, self.k_scale, self.k_zero),
                (self.v_cache, self.v_scale, self.v_zero),
            )
        )
