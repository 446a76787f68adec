"""The Llama family on runtime layers: Llama, Mistral, Qwen2 (q/k/v biases), Qwen3 (q/k norms).

Built from the manifest's architecture and the artifact's tensors only; no transformers
modeling code. A forward takes the step's new tokens of every sequence concatenated ([T]),
reads the step metadata from the StepContext, writes K/V into the paged pool and attends over
it, and returns logits only for the rows the step asked for.

Under tensor parallelism (a Shard and a TPGroup given) each rank builds only its slice, Megatron
style: q/k/v and gate/up column-parallel (the rank's heads and MLP channels), o and down
row-parallel with one all-reduce each, the embedding and lm_head split by vocabulary (one
all-reduce after the lookup, the logits gathered on rank 0). Without a shard nothing of this
runs: no collective, no extra copy.
"""

from __future__ import annotations

import torch

from runtime.artifact.manifest import Architecture
from runtime.artifact.reader import Artifact, Span
from runtime.distributed.group import TPGroup
from runtime.distributed.shard import Shard
from runtime.kernels.ops import Backend, LayerParts
from runtime.kernels.reference import ACTIVATIONS
from runtime.model.context import get_context
from runtime.model.rotary import SUPPORTED_SCALING, Rotary

# The runtime's linears per decoder layer: artifact linears sharing an input run as one GEMM.
FUSED_LINEARS = {
    "qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "o": ("self_attn.o_proj",),
    "gate_up": ("mlp.gate_proj", "mlp.up_proj"),
    "down": ("mlp.down_proj",),
}


def check_supported(arch: Architecture) -> None:
    """What this model cannot run, refused by name. Conversion and calibration call it before
    they write anything: an artifact that fails only when served cost their whole run."""
    kind = (arch.rope_scaling or {}).get("rope_type", "default")
    if kind not in SUPPORTED_SCALING:
        raise ValueError(
            f"rope scaling {kind!r} is not supported by the runtime "
            f"(supported: {', '.join(SUPPORTED_SCALING)})"
        )
    if arch.hidden_act not in ACTIVATIONS:
        raise ValueError(
            f"hidden_act {arch.hidden_act!r} is not supported by the runtime "
            f"(supported: {', '.join(ACTIVATIONS)})"
        )


class Linear:
    """A quantized linear (several artifact linears fused along N where they share an input).

    Under TP each rank keeps its shard's slice of each: output columns (column-parallel) or
    input channels (row-parallel: a partial sum the caller all-reduces)."""

    def __init__(
        self,
        artifact: Artifact,
        names: list[str],
        dtype: torch.dtype,
        ops: Backend,
        shard: Shard | None = None,
    ) -> None:
        self.ops = ops
        parts, biases, self.splits = [], [], []
        for name in names:
            cols, rows = (None, None) if shard is None else shard.linear(name)
            qw, qp, n, k = artifact.linear(name, cols, rows)
            self.splits.append(n)
            parts.append((qw, qp, n))
            if artifact.has(f"{name}.bias") and (shard is None or shard.keeps_bias(name)):
                biases.append(artifact.tensor(f"{name}.bias", cols).to(ops.device, dtype))
        gs = artifact.manifest.quantization.group_size
        self.weight = ops.prepare_int4(parts, k, gs, dtype)
        self.bias = torch.cat(biases) if biases else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.ops.int4_linear(x, self.weight)
        return y if self.bias is None else y + self.bias


class Layer:
    def __init__(
        self,
        art: Artifact,
        i: int,
        arch: Architecture,
        dtype: torch.dtype,
        ops: Backend,
        shard: Shard | None = None,
        group: TPGroup | None = None,
    ) -> None:
        p = f"model.layers.{i}."
        self.ops = ops
        self.group = group
        self.index = i
        self.heads, self.kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
        self.eps = arch.rms_norm_eps
        if shard is not None:
            self.heads, self.kv_heads = shard.num_heads, shard.num_kv_heads
        self.qkv, self.o, self.gate_up, self.down = (
            Linear(art, [p + name for name in names], dtype, ops, shard)
            for names in FUSED_LINEARS.values()
        )
        self.input_norm = art.tensor(p + "input_layernorm.weight").to(ops.device, dtype)
        self.post_norm = art.tensor(p + "post_attention_layernorm.weight").to(ops.device, dtype)
        self.q_norm = self.k_norm = None
        if arch.qk_norm:
            self.q_norm = art.tensor(p + "self_attn.q_norm.weight").to(ops.device, dtype)
            self.k_norm = art.tensor(p + "self_attn.k_norm.weight").to(ops.device, dtype)
        self.hidden_act = arch.hidden_act
        self.scale = self.head_dim**-0.5
        self.sliding_window = arch.sliding_window
        self.fused = None if group is not None else ops.prepare_layer(self.parts(arch))

    def parts(self, arch: Architecture) -> LayerParts:
        """What a backend that runs the whole layer in one call needs of it."""
        return LayerParts(
            linears={name: getattr(self, name).weight for name in FUSED_LINEARS},
            input_norm=self.input_norm,
            post_norm=self.post_norm,
            qkv_bias=self.qkv.bias,
            out_biases=any(x.bias is not None for x in (self.o, self.gate_up, self.down)),
            q_norm=self.q_norm,
            k_norm=self.k_norm,
            heads=self.heads,
            kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            intermediate=sum(self.gate_up.splits) // 2,
            eps=self.eps,
            hidden_act=arch.hidden_act,
            sliding_window=self.sliding_window,
            scale=self.scale,
        )

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of a row-parallel linear's partial output (itself without TP)."""
        return x if self.group is None else self.group.all_reduce(x)

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
        kv = ctx.cache.layer(self.index)
        q = self.ops.rotary_kv_write(qk, v, rope, kv, ctx.step.slot_mapping)
        o = self.ops.attention(q, kv, ctx.step.attn, self.scale, self.sliding_window)
        return self.reduce(self.o(o.reshape(t, -1)))

    def __call__(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        delta: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(x', delta'): this layer's output is x' + delta'. The input is x + delta (the previous
        layer's last add, not yet done): each residual add is done by the norm after it, in one
        kernel where the backend fuses them."""
        if self.fused is not None:
            ctx = get_context()
            kv = ctx.cache.layer(self.index)
            whole = x if delta is None else x + delta
            out = self.ops.decoder_layer(whole, self.fused, rope, kv, ctx.step)
            if out is not None:
                return out, None
        x, h = self.ops.add_rms_norm(x, delta, self.input_norm, self.eps)
        x, h = self.ops.add_rms_norm(x, self.attention(h, rope), self.post_norm, self.eps)
        return x, self.reduce(self.down(self.ops.act_mul(self.gate_up(h), self.hidden_act)))


class LlamaModel:
    def __init__(
        self,
        artifact: Artifact,
        dtype: torch.dtype,
        max_positions: int,
        ops: Backend,
        shard: Shard | None = None,
        group: TPGroup | None = None,
    ) -> None:
        arch = artifact.manifest.architecture
        check_supported(arch)
        self.arch, self.dtype, self.ops = arch, dtype, ops
        self.shard, self.group = shard, group
        vocab = None if shard is None else shard.vocab

        def dense(name: str, rows: Span | None = None) -> torch.Tensor:
            return artifact.tensor(name, rows).to(ops.device, dtype)

        self.embed = dense("model.embed_tokens.weight", vocab)
        lm_head = self.embed if arch.tie_word_embeddings else dense("lm_head.weight", vocab)
        self.lm_head = ops.prepare_logits(lm_head)
        self.norm = dense("model.norm.weight")
        self.layers = [
            Layer(artifact, i, arch, dtype, ops, shard, group) for i in range(arch.num_layers)
        ]
        fused = [layer.fused for layer in self.layers]
        # every layer's fused form, for the backend to run the stack in one call
        self.fused = fused if all(f is not None for f in fused) else None
        self.rotary = Rotary(
            arch.head_dim, arch.rope_theta, arch.rope_scaling, max_positions, dtype, ops.device
        )

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """The tokens' rows; under TP each rank looks up the ids in its vocabulary slice and
        the all-reduce adds the one rank that has each row to the zeros of the others (exact
        in any dtype)."""
        if self.group is None:
            return self.embed[ids]
        local = ids - self.shard.vocab[0]
        mine = (local >= 0) & (local < self.embed.shape[0])
        x = self.embed[local.clamp(0, self.embed.shape[0] - 1)] * mine[:, None]
        return self.group.all_reduce(x)

    def weight_bytes(self) -> int:
        """Bytes of the weights this process holds (the backend's forms of them, every tensor
        counted once): what a tensor-parallel rank saves is measured here."""
        seen: dict[int, int] = {}
        _tensors([self.embed, self.lm_head, self.norm, self.layers], seen)
        return sum(seen.values())

    @torch.inference_mode()
    def __call__(self) -> torch.Tensor | None:
        """Float32 logits of the step's logits_indices rows (the context holds the step);
        under TP only rank 0 gets them (None elsewhere)."""
        step = get_context().step
        x = self.embedding(step.input_ids)
        rope = self.rotary.tables(step.positions)
        out = None
        if self.fused is not None:
            out = self.ops.decoder_layers(x, self.fused, rope, get_context().cache, step)
        delta = None
        if out is not None:
            x = out
        else:
            for layer in self.layers:
                x, delta = layer(x, rope, delta)
        rows = step.logits_indices
        delta = None if delta is None else delta[rows]
        _, x = self.ops.add_rms_norm(x[rows], delta, self.norm, self.arch.rms_norm_eps)
        logits = self.ops.logits(x, self.lm_head)
        return (
            logits
            if self.group is None
            else self.group.gather_vocab(logits, self.shard.vocab_rows, self.arch.vocab_size)
        )


def _tensors(obj: object, seen: dict[int, int]) -> None:
    """Every weight tensor reachable from obj's attributes, lists and dicts, by storage."""
    if isinstance(obj, torch.Tensor):
        seen[obj.untyped_storage().data_ptr()] = obj.untyped_storage().nbytes()
    elif isinstance(obj, dict):
        for value in obj.values():
            _tensors(value, seen)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            _tensors(value, seen)
    elif hasattr(obj, "__dict__") and not isinstance(obj, (Backend, TPGroup)):
        _tensors(vars(obj), seen)
