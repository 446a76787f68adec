"""The paged KV pool: every layer's blocks, claimed up front with ``torch.zeros`` so the pool's
memory is taken when the engine starts. Its format is ``runtime.kv.format``; kernels read and
write one layer through :meth:`KVCache.layer`, the one place a layer's tensors are named."""

from __future__ import annotations

import torch

from runtime.kv.format import KVSpec
from runtime.kv.layer import LayerKV


class KVCache:
    """The block pool of every layer, as one :class:`LayerKV` per layer."""

    def __init__(self, spec: KVSpec, num_blocks: int, device: torch.device | str = "cpu") -> None:
        spec.validate()
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.spec = spec
        self.num_blocks = num_blocks
        self.device = torch.device(device)
        self.layers = [self._allocate() for _ in range(spec.num_layers)]

    def _allocate(self) -> LayerKV:
        s = self.spec
        if s.kv_quant == "none":
            d, code_dtype = s.head_dim, s.dtype
        else:
            d = s.head_dim if s.kv_quant == "int8" else s.head_dim // 2
            code_dtype = torch.uint8
        code_shape = (self.num_blocks, s.block_size, s.num_kv_heads, d)
        param_shape = (self.num_blocks, s.block_size, s.num_kv_heads)

        def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=self.device)

        params = (
            [zeros(param_shape, torch.float16) for _ in range(4)]
            if s.kv_quant != "none"
            else [None] * 4
        )
        return LayerKV(s, zeros(code_shape, code_dtype), zeros(code_shape, code_dtype), *params)

    @property
    def quantized(self) -> bool:
        return self.spec.kv_quant != "none"

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.spec.block_size

    def layer(self, layer: int) -> LayerKV:
        """The layer's six tensors, the view every kernel takes."""
        if not 0 <= layer < self.spec.num_layers:
            raise ValueError(f"layer {layer} out of range for {self.spec.num_layers} layers")
        return self.layers[layer]

    def nbytes(self) -> int:
        """Bytes actually allocated (equals ``num_blocks * spec.bytes_per_block()``)."""
        return sum(
            t.numel() * t.element_size()
            for kv in self.layers
            for t in (kv.k, kv.v, kv.k_scale, kv.k_zero, kv.v_scale, kv.v_zero)
            if t is not None
        )

    @staticmethod
    def num_blocks_for(spec: KVSpec, memory_bytes: int) -> int:
        """How many whole blocks fit in ``memory_bytes`` (0 when not even one does)."""
        return max(0, int(memory_bytes) // spec.bytes_per_block())
