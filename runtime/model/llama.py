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
from runtime.kernels.ops import Backend
from runtime.model.context import get_context
from runtime.model.rotary import Rotary, apply_rotary

_ACTS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


# The runtime's linears per decoder layer: artifact linears sharing an input run as one GEMM.
FUSED_LINEARS = {
    "qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "o": ("self_attn.o_proj",),
    "gate_up": ("mlp.gate_proj", "mlp.up_proj"),
    "down": ("mlp.down_proj",),
}


class Linear:
    """A quantized linear (several artifact linears fused along N where they share an input)."""

    def __init__(
        self, artifact: Artifact, names: list[str], dtype: torch.dtype, ops: Backend
    ) -> None:
        self.ops = ops
        parts, biases, self.splits = [], [], []
        for name in names:
            n, k = artifact.manifest.tensors[f"{name}.qweight"].logical_shape
            self.splits.append(n)
            qw, qp = artifact.tensor(f"{name}.qweight"), artifact.tensor(f"{name}.qparams")
            parts.append((qw, qp, n))
            if artifact.has(f"{name}.bias"):
                biases.append(artifact.tensor(f"{name}.bias").to(ops.device, dtype))
        gs = artifact.manifest.quantization.group_size
        self.weight = ops.prepare_int4(parts, k, gs, dtype)
        self.bias = torch.cat(biases) if biases else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.ops.int4_linear(x, self.weight)
        return y if self.bias is None else y + self.bias


class Layer:
    def __init__(
        self, art: Artifact, i: int, arch: Architecture, dtype: torch.dtype, ops: Backend
    ) -> None:
        p = f"model.layers.{i}."
        self.ops = ops
        self.index = i
        self.heads, self.kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
        self.eps = arch.rms_norm_eps
        self.qkv, self.o, self.gate_up, self.down = (
            Linear(art, [p + name for name in names], dtype, ops)
            for names in FUSED_LINEARS.values()
        )
        self.input_norm = art.tensor(p + "input_layernorm.weight").to(ops.device, dtype)
        self.post_norm = art.tensor(p + "post_attention_layernorm.weight").to(ops.device, dtype)
        self.q_norm = self.k_norm = None
        if arch.qk_norm:
            self.q_norm = art.tensor(p + "self_attn.q_norm.weight").to(ops.device, dtype)
            self.k_norm = art.tensor(p + "self_attn.k_norm.weight").to(ops.device, dtype)
        self.act = _ACTS[arch.hidden_act]
        self.scale = self.head_dim**-0.5
        self.sliding_window = arch.sliding_window

    def attention(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        ctx = get_context()
        t = x.shape[0]
        h, hkv, d = self.heads, self.kv_heads, self.head_dim
        qkv = self.qkv(x)
        qk = qkv[:, : (h + hkv) * d].view(t, h + hkv, d)  # q and k side by side: one rotary
        v = qkv[:, (h + hkv) * d :].view(t, hkv, d)
        if self.q_norm is not None:
            q = self.ops.rms_norm(qk[:, :h], self.q_norm, self.eps)
            qk = torch.cat((q, self.ops.rms_norm(qk[:, h:], self.k_norm, self.eps)), dim=1)
        qk = apply_rotary(qk, *rope)
        q, k = qk[:, :h], qk[:, h:]
        kv = ctx.cache.layer(self.index)
        self.ops.kv_write(kv, k, v, ctx.step.slot_mapping)
        o = self.ops.attention(q, kv, ctx.step.attn, self.scale, self.sliding_window)
        return self.o(o.reshape(t, -1))

    def __call__(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        norm = self.ops.rms_norm
        x = x + self.attention(norm(x, self.input_norm, self.eps), rope)
        gate, up = self.gate_up(norm(x, self.post_norm, self.eps)).chunk(2, dim=-1)
        return x + self.down(self.act(gate) * up)


class LlamaModel:
    def __init__(
        self, artifact: Artifact, dtype: torch.dtype, max_positions: int, ops: Backend
    ) -> None:
        arch = artifact.manifest.architecture
        self.arch, self.dtype, self.ops = arch, dtype, ops

        def dense(name: str) -> torch.Tensor:
            return artifact.tensor(name).to(ops.device, dtype)

        self.embed = dense("model.embed_tokens.weight")
        self.lm_head = self.embed if arch.tie_word_embeddings else dense("lm_head.weight")
        self.norm = dense("model.norm.weight")
        self.layers = [Layer(artifact, i, arch, dtype, ops) for i in range(arch.num_layers)]
        self.rotary = Rotary(
            arch.head_dim, arch.rope_theta, arch.rope_scaling, max_positions, dtype, ops.device
        )

    @torch.inference_mode()
    def __call__(self) -> torch.Tensor:
        """Float32 logits of the step's logits_indices rows (the context holds the step)."""
        step = get_context().step
        x = self.embed[step.input_ids]
        rope = self.rotary.tables(step.positions)
        for layer in self.layers:
            x = layer(x, rope)
        x = x[step.logits_indices]
        x = self.ops.rms_norm(x, self.norm, self.arch.rms_norm_eps)
        return self.ops.logits(x, self.lm_head)
