"""Which modules of a decoder layer share an AWQ scale, declared per family by module name.

A group's `prev` absorbs 1/s (an RMSNorm's weight or a linear's output rows) and its
`linears` absorb s on their input columns. The search and the driver know nothing about
families beyond this table, so adding one is a few lines here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ScaleGroup:
    prev: str
    linears: tuple[str, ...]

    @property
    def label(self) -> str:
        """How warnings and reports name the group: `input_layernorm->self_attn.q_proj,...`."""
        return f"{self.prev}->{','.join(self.linears)}"


_LLAMA_LIKE = (
    ScaleGroup("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    # Applies only when v's outputs line up with o's inputs: not under grouped-query attention.
    ScaleGroup("self_attn.v_proj", ("self_attn.o_proj",)),
    ScaleGroup("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
    ScaleGroup("mlp.up_proj", ("mlp.down_proj",)),
)

LAYER_GROUPS: dict[str, tuple[ScaleGroup, ...]] = {
    "llama": _LLAMA_LIKE,
    "mistral": _LLAMA_LIKE,
    "qwen2": _LLAMA_LIKE,
    "qwen3": _LLAMA_LIKE,
}

# Linears that feed attention scores: clipping them hurts more than it helps (AWQ's finding).
NO_CLIP = ("q_proj", "k_proj")
