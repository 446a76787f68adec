"""A decoder layer of a step in one C call (cpu_layer.c).

A batch-1 decode step of a small model is a few hundred small ops; called one by one from
Python, each costs microseconds of torch and ctypes dispatch, a fifth of SmolLM2's step on
AVX2 (evals/bench/RESULTS.md, issue 19). The fused layer runs the same kernels in the same
order in C. It runs where the per-op path would run those kernels anyway: fp32 activations,
every linear on the int4 x int8 path for the step's row count, an int8/int4 or fp32 KV pool,
SiLU, no tensor parallelism; decoding tokens and prefill chunks alike (a prefill of 128 tokens
spent about a tenth of its time in the per-op Python between kernels, and a step that mixed
one prefill chunk into the decodes left them all op by op). Anything else returns None and
the model calls the ops one by one. `LITESERVE_CPU_FUSE=0` turns it off (for comparisons).
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from typing import Any

import torch

from runtime.kernels import native
from runtime.kernels.ops import LayerParts, StepTensors
from runtime.kv.format import QMAX
from runtime.kv.layer import LayerKV

# cpu_layer.c's D_* and P_* orders
LAYER_DIMS = (
    "hidden", "heads", "kv_heads", "head_dim", "group", "s_dtype", "window", "kind", "qmax",
    "block", "inter", "unpack",
)  # fmt: skip
LINEARS = ("qkv", "o", "gate_up", "down")
NORMS = ("input_norm", "post_norm", "qkv_bias", "q_norm", "k_norm")
_FIELDS_PER_LINEAR = 5  # codes, scale, offset, n, kp
_Ptrs = ctypes.c_void_p * (len(NORMS) + _FIELDS_PER_LINEAR * len(LINEARS))
_Dims = ctypes.c_int64 * len(LAYER_DIMS)
_Floats = ctypes.c_float * 2
_UNPACK = LAYER_DIMS.index("unpack")


def enabled() -> bool:
    return os.environ.get("LITESERVE_CPU_FUSE", "1") != "0"


@dataclass
class FusedLayer:
    """The pointers and sizes cpu_layer.c reads, built once per layer; `keep` holds the
    tensors they point into."""

    ptrs: ctypes.Array
    dims: ctypes.Array
    floats: ctypes.Array
    keep: tuple
    pool_for: int = 0  # the pool (its K tensor's address) that pool_ok and pool describe
    pool_ok: bool = False  # the pool's format is in dims, or it is one cpu_layer.c cannot write
    pool: ctypes.Array | None = None  # its six pointers
    stack: _Stack | None = None  # on a model's first layer: decode_layers' tables


def prepare_layer(parts: LayerParts, lib: ctypes.CDLL | None) -> FusedLayer | None:
    """The layer's fused form, or None where cpu_layer.c does not run it."""
    weights = [parts.linears[name] for name in LINEARS]
    dtypes = {parts.input_norm.dtype, parts.post_norm.dtype}
    if (
        lib is None
        or not enabled()
        or parts.hidden_act != "silu"
        or parts.out_biases  # cpu_layer.c adds the q/k/v biases alone
        or dtypes != {torch.float32}
        or any(w.nibbles is None or w.scale.dtype != torch.float16 for w in weights)
        or len({w.group_size for w in weights}) != 1
    ):
        return None
    keep = [parts.input_norm.contiguous(), parts.post_norm.contiguous()]
    ptrs: list[int | None] = [keep[0].data_ptr(), keep[1].data_ptr()]
    for t in (parts.qkv_bias, parts.q_norm, parts.k_norm):
        if t is not None and t.dtype != torch.float32:
            return None
        t = None if t is None else t.contiguous()
        keep.append(t)
        ptrs.append(None if t is None else t.data_ptr())
    for w in weights:
        ptrs += [w.nibbles.data_ptr(), w.scale.data_ptr(), w.offset.data_ptr(), w.n, w.kp]
    dims = dict.fromkeys(LAYER_DIMS, 0)
    dims |= {
        "hidden": parts.linears["o"].n,
        "heads": parts.heads,
        "kv_heads": parts.kv_heads,
        "head_dim": parts.head_dim,
        "group": weights[0].group_size,
        "s_dtype": native.DTYPE_CODES[torch.float16],
        "window": parts.sliding_window or 0,
        "inter": parts.intermediate,
    }
    return FusedLayer(
        _Ptrs(*ptrs),
        _Dims(*(dims[name] for name in LAYER_DIMS)),
        _Floats(parts.eps, parts.scale),
        (*keep, *weights),
    )


def _set_pool(layer: FusedLayer, kv: LayerKV) -> bool:
    """The pool's format into the layer's dims (fixed for an engine's life); False where the
    fused layer cannot write it."""
    spec = kv.spec
    if kv.quantized:
        qmax = QMAX[spec.kv_quant]
    elif kv.k.dtype == torch.float32:
        qmax = 0
    else:
        return False
    dim = LAYER_DIMS.index
    if (spec.num_kv_heads, spec.head_dim) != (
        layer.dims[dim("kv_heads")],
        layer.dims[dim("head_dim")],
    ):
        return False
    for name, value in (("kind", spec.storage_kind), ("qmax", qmax), ("block", spec.block_size)):
        layer.dims[dim(name)] = value
    layer.pool = (ctypes.c_void_p * 6)(*(None if p is None else p.data_ptr() for p in _pool(kv)))
    return True


def _pool_ready(layer: FusedLayer, kv: LayerKV) -> bool:
    """The layer's pool pointers and format set for kv's pool (once per pool); False where
    cpu_layer.c cannot write that pool."""
    if layer.pool_for != kv.k.data_ptr():
        layer.pool_ok, layer.pool_for = _set_pool(layer, kv), kv.k.data_ptr()
    return layer.pool_ok


def _pool(kv: LayerKV) -> tuple[torch.Tensor | None, ...]:
    """cpu_decode.c's six pool pointers: the parameters NULL when unquantized (it reads any
    it is given)."""
    return kv.k, kv.v, kv.k_scale, kv.k_zero, kv.v_scale, kv.v_zero


@dataclass
class _Stack:
    """decode_layers' per-layer pointer tables, built once for a model's layers and KV cache."""

    key: tuple[int, ...]  # the cache and its first and last pools: what the tables point at
    ptrs: ctypes.Array
    dims: ctypes.Array
    floats: ctypes.Array
    pools: ctypes.Array


def _addresses(arrays: list[ctypes.Array]) -> ctypes.Array:
    return (ctypes.c_void_p * len(arrays))(*(ctypes.addressof(a) for a in arrays))


def _stack(layers: list[FusedLayer], cache: Any) -> _Stack | None:
    """The layers' tables over this cache's pools (kept on the first layer), or None where a
    pool is one the fused layer cannot write."""
    first, last = cache.layer(0), cache.layer(len(layers) - 1)
    key = (id(cache), first.k.data_ptr(), last.k.data_ptr())
    stack = layers[0].stack
    if stack is not None and stack.key == key:
        return stack
    if not all(_pool_ready(layer, cache.layer(i)) for i, layer in enumerate(layers)):
        return None
    layers[0].stack = _Stack(
        key,
        _addresses([layer.ptrs for layer in layers]),
        _addresses([layer.dims for layer in layers]),
        _addresses([layer.floats for layer in layers]),
        _addresses([layer.pool for layer in layers]),
    )
    return layers[0].stack


def decoder_layers(
    lib: ctypes.CDLL,
    x: torch.Tensor,
    layers: list[FusedLayer],
    rope: tuple[torch.Tensor, torch.Tensor],
    cache: Any,
    step: StepTensors,
    unpack: bool = False,
) -> torch.Tensor | None:
    """Every layer's output in turn, the last returned, in one C call (layer i's pool is
    cache.layer(i)); None where the fused layers do not run this step."""
    if x.dtype != torch.float32 or not x.is_contiguous():
        return None
    stack = _stack(layers, cache)
    if stack is None:
        return None
    if layers[0].dims[_UNPACK] != unpack:
        for layer in layers:
            layer.dims[_UNPACK] = unpack
    out, t = torch.empty_like(x), x.shape[0]
    tables = (stack.ptrs, stack.dims, stack.floats)
    lib.decode_layers(x.data_ptr(), out.data_ptr(), t, len(layers), *tables,
                      *_step_args(t, rope, step, stack.pools))  # fmt: skip
    return out


def _step_args(t: int, rope: tuple[torch.Tensor, torch.Tensor], step: StepTensors, pool) -> tuple:
    """decode_layer(s)' arguments from the rotary tables on: the step's, the same for every
    layer (the pool or the pools' table where the layers take theirs)."""
    d, chunks = step.attn.decode, step.attn.chunks
    cos, sin = (r.reshape(t, -1) for r in rope)
    return (
        cos.data_ptr(),
        sin.data_ptr(),
        step.slot_mapping.data_ptr(),
        pool,
        *((None, None, 0, None, 0) if d is None else
          (d.rows.data_ptr(), d.blocks.data_ptr(), d.blocks.stride(0), d.lens.data_ptr(),
           d.rows.shape[0])),
        None if chunks is None else chunks.data_ptr(),
        0 if chunks is None else chunks.shape[0],
    )  # fmt: skip


def decoder_layer(
    lib: ctypes.CDLL,
    x: torch.Tensor,
    layer: FusedLayer,
    rope: tuple[torch.Tensor, torch.Tensor],
    kv: LayerKV,
    step: StepTensors,
    unpack: bool = False,
) -> torch.Tensor | None:
    """The layer's output [T, hidden], or None where the fused layer does not run; `unpack`:
    the linears on the dispatch's "int8-unpacked" path."""
    t = x.shape[0]
    if x.dtype != torch.float32 or not x.is_contiguous() or not _pool_ready(layer, kv):
        return None
    layer.dims[_UNPACK] = unpack
    out = torch.empty_like(x)
    lib.decode_layer(x.data_ptr(), out.data_ptr(), t, layer.ptrs, layer.dims, layer.floats,
                     *_step_args(t, rope, step, layer.pool))  # fmt: skip
    return out
