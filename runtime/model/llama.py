"""The Llama family on runtime layers: Llama, Mistral, Qwen2 (q/k/v biases), Qwen3 (q/k norms).

Built from the manifest's architecture and the artifact's tensors only; no transformers
modeling code. A forward takes the step's new tokens of every sequence concatenated ([T]),
reads the step metadata from the StepContext, writes K/V into the paged pool and attends over
it, and returns logits only for the rows the step asked for.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from runtime.artifact.manifest import Architecture
from runtime.artifact.reader import Artifact
from runtime.kernels import ops
from runtime.model.context import get_context
from runtime.model.rotary import Rotary, apply_rotary

_ACTS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


class Linear:
    """A quantized linear (several artifact linears fused along N where they share an input)."""

    def __init__(self, artifact: Artifact, names: list[str], dtype: torch.dtype) -> None:
        parts, biases, self.splits = [], [], []
        for name in names:
            n, k = artifact.manifest.tensors[f"{name}.qweight"].logical_shape
            self.splits.append(n)
            qw, qp = artifact.tensor(f"{name}.qweight"), artifact.tensor(f"{name}.qparams")
            parts.append((qw, qp, n))
            if artifact.has(f"{name}.bias"):
                biases.append(artifact.tensor(f"{name}.bias").to(dtype))
        gs = artifact.manifest.quantization.group_size
        self.weight = ops.prepare_int4(parts, k, gs, dtype)
        self.bias = torch.cat(biases) if biases else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = ops.int4_linear(x, self.weight)
        return y if self.bias is None else y + self.bias


class Layer:
    def __init__(self, art: Artifact, i: int, arch: Architecture, dtype: torch.dtype) -> None:
        p = f"model.layers.{i}."
        self.index = i
        self.heads, self.kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
        self.eps = arch.rms_norm_eps
        self.qkv = Linear(art, [p + f"self_attn.{x}_proj" for x in "qkv"], dtype)
        self.o = Linear(art, [p + "self_attn.o_proj"], dtype)
        self.gate_up = Linear(art, [p + "mlp.gate_proj", p + "mlp.up_proj"], dtype)
        self.down = Linear(art, [p + "mlp.down_proj"], dtype)
        self.input_norm = art.tensor(p + "input_layernorm.weight").to(dtype)
        self.post_norm = art.tensor(p + "post_attention_layernorm.weight").to(dtype)
        self.q_norm = self.k_norm = None
        if arch.qk_norm:
            self.q_norm = art.tensor(p + "self_attn.q_norm.weight").to(dtype)
            self.k_norm = art.tensor(p + "self_attn.k_norm.weight").to(dtype)
        self.act = _ACTS[arch.hidden_act]
        self.scale = self.head_dim**-0.5
        self.sliding_window = arch.sliding_window

    def attention(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        ctx = get_context()
        t = x.shape[0]
        q, k, v = self.qkv(x).split(self.qkv.splits, dim=-1)
        q = q.view(t, self.heads, self.head_dim)
        k = k.view(t, self.kv_heads, self.head_dim)
        v = v.view(t, self.kv_heads, self.head_dim)
        if self.q_norm is not None:
            q = ops.rms_norm(q, self.q_norm, self.eps)
            k = ops.rms_norm(k, self.k_norm, self.eps)
        q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        ctx.cache.write(self.index, k, v, ctx.slot_mapping)
        o = ops.paged_attention(q, ctx, self.index, self.scale, self.sliding_window)
        return self.o(o.reshape(t, -1))

    def __call__(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x = x + self.attention(ops.rms_norm(x, self.input_norm, self.eps), rope)
        gate, up = self.gate_up(ops.rms_norm(x, self.post_norm, self.eps)).chunk(2, dim=-1)
        return x + self.down(self.act(gate) * up)


class LlamaModel:
    def __init__(self, artifact: Artifact, dtype: torch.dtype, max_positions: int) -> None:
        arch = artifact.manifest.architecture
        self.arch, self.dtype = arch, dtype
        self.embed = artifact.tensor("model.embed_tokens.weight").to(dtype)
        self.lm_head = (
            self.embed if arch.tie_word_embeddings else artifact.tensor("lm_head.weight").to(dtype)
        )
        self.norm = artifact.tensor("model.norm.weight").to(dtype)
        self.layers = [Layer(artifact, i, arch, dtype) for i in range(arch.num_layers)]
        self.rotary = Rotary(
            arch.head_dim, arch.rope_theta, arch.rope_scaling, max_positions, dtype
        )

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] token ids -> float32 logits for the context's logits_indices rows."""
        ctx = get_context()
        x = self.embed[input_ids]
        rope = self.rotary.tables(ctx.positions)
        for layer in self.layers:
            x = layer(x, rope)
        x = x[ctx.logits_indices]
        return (ops.rms_norm(x, self.norm, self.arch.rms_norm_eps) @ self.lm_head.T).float()
