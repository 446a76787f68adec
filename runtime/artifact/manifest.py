"""The artifact's manifest.json schema: everything a server needs, and how the artifact was made.

`extra="forbid"` everywhere: a field this version does not know means the file was written by
something else, and guessing would be worse than refusing.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field

FORMAT = "liteserve-artifact"
# 2: producer.devices/torch/cuda (optional: schema-1 manifests still validate).
# 3: source.format/quantization_config and the converted methods (`lite convert`).
# 4: quantization.search. 5: quantization.rounding.
SCHEMA_VERSION = 5
MANIFEST_FILE = "manifest.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
MODEL_CARD_FILE = "README.md"
FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
Backend = Literal["auto", "cpu", "triton", "cuda"]
BACKENDS: tuple[str, ...] = get_args(Backend)
# the backends whose GEMM launches `lite tune` measures and the manifest's `kernels` pins
TUNED_BACKENDS = ("auto", "cuda", "triton")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Producer(_Strict):
    name: str = "liteserve"
    version: str
    command: str
    created: str  # ISO 8601, UTC; the start of the run, so a resumed run writes the same bytes
    # the devices that calibrated: "cpu", "cuda:0 (NVIDIA H200)"
    devices: list[str] = Field(default_factory=list)
    torch: str | None = None  # torch version of the run
    cuda: str | None = None  # torch's CUDA version, when a GPU calibrated


class SourceModel(_Strict):
    id: str
    revision: str | None = None
    files: dict[str, str] = Field(default_factory=dict)  # file name -> sha256
    # a converted checkpoint's format (autoawq-gemm, gptq, compressed-tensors) and its
    # quantization_config verbatim, so what was converted can be traced and exported back
    format: str | None = None
    quantization_config: dict | None = None


class Architecture(_Strict):
    family: Literal["llama", "mistral", "qwen2", "qwen3"]
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_act: str = "silu"
    # finite and positive: a NaN or negative eps, or a rotary base <= 0, loaded and generated
    # garbage
    rms_norm_eps: float = Field(gt=0, allow_inf_nan=False)
    rope_theta: float = Field(gt=0, allow_inf_nan=False)
    rope_scaling: dict[str, float | int | str] | None = None  # e.g. Llama-3 "llama3" scaling
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # q/k/v have biases (Qwen2); Llama's and Qwen3's: o too
    mlp_bias: bool = False  # Llama's mlp_bias: gate/up/down have biases
    qk_norm: bool = False  # Qwen3: RMSNorm on q and k per head
    sliding_window: int | None = None  # Mistral
    bos_token_id: int | None = None
    eos_token_ids: list[int] = Field(default_factory=list)
    pad_token_id: int | None = None

    def shape_summary(self) -> str:
        """The numbers every tensor's shape follows, for errors that say why one is wrong."""
        return (
            f"hidden {self.hidden_size}, {self.num_heads}:{self.num_kv_heads} heads of "
            f"{self.head_dim}, intermediate {self.intermediate_size}, vocab {self.vocab_size}"
        )

    def logical_shape(self, name: str) -> list[int] | None:
        """The shape this architecture gives a tensor ([out, in] for a linear, by its name
        without .qweight/.qparams), or None for a name it does not know. The kernels index
        by these numbers, so tensors that disagree with them read out of bounds."""
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        h, i = self.hidden_size, self.intermediate_size
        return {
            "model.embed_tokens.weight": [self.vocab_size, h],
            "lm_head.weight": [self.vocab_size, h],
            "model.norm.weight": [h],
            "input_layernorm.weight": [h],
            "post_attention_layernorm.weight": [h],
            "self_attn.q_norm.weight": [self.head_dim],
            "self_attn.k_norm.weight": [self.head_dim],
            "self_attn.q_proj": [q, h],
            "self_attn.k_proj": [kv, h],
            "self_attn.v_proj": [kv, h],
            "self_attn.o_proj": [h, q],
            "self_attn.q_proj.bias": [q],
            "self_attn.k_proj.bias": [kv],
            "self_attn.v_proj.bias": [kv],
            "mlp.gate_proj": [i, h],
            "mlp.up_proj": [i, h],
            "mlp.down_proj": [h, i],
        }.get(re.sub(r"^model\.layers\.\d+\.", "", name))


class Quantization(_Strict):
    method: Literal["awq", "rtn", "autoawq", "gptq", "compressed-tensors"]  # last 3: converted
    # the layout and every kernel are int4: another width loaded, was reported as such, and
    # served garbage
    bits: Literal[4]
    group_size: int
    symmetric: bool
    zero_point: bool
    calib_dataset: str | None
    calib_samples: int
    calib_seqlen: int
    calib_tokens_sha256: str | None
    seed: int
    n_grid: int
    duo_scaling: bool
    clip_max_shrink: float
    # AWQ's objectives: "gram" (each linear's output error), "block" (q/k/v scales and clip
    # strengths scored on the block output), "none" (RTN, converted); artifacts made before
    # it was recorded ran the Gram search
    search: str = "gram"
    # how the scaled weights became codes: "nearest" (round-to-nearest), "gptq" (GPTQ's
    # error-compensating rounding), "none" (converted: the codes came as they were);
    # artifacts made before it was recorded rounded to nearest
    rounding: str = "nearest"
    fallbacks: list[str] = Field(default_factory=list)  # layers whose search fell back, and why


class Layout(_Strict):
    name: str
    version: int
    tile: int
    n_align: int


class TensorEntry(_Strict):
    file: str
    dtype: str
    shape: list[int]  # as stored
    kind: Literal["qweight", "qparams", "dense"]
    logical_shape: list[int] | None = None  # quantized linears: [out, in] before padding
    padded_shape: list[int] | None = None  # [Np, Kp] as laid out


class FileEntry(_Strict):
    sha256: str
    size: int


# Bounds of the serving settings, shared with EngineConfig.validate (the flags that override them)
MIN_SESSION_LEN = 2
BLOCK_MULTIPLE = 16  # KV block lengths: the kernels' token tiles
DEFAULT_BLOCK_SEQ_LEN = 64
MIN_PREFILL_TOKENS = 16


class LaunchConfig(_Strict):
    """Recommended serving settings; `kernels` holds tuned tile configs per GPU architecture.
    Checked where a recipe is read, before hours of calibration, and where an artifact is."""

    session_len: int = Field(4096, ge=MIN_SESSION_LEN)
    kv_quant: Literal["none", "int8", "int4"] = "int8"
    cache_block_seq_len: int = Field(
        DEFAULT_BLOCK_SEQ_LEN, ge=BLOCK_MULTIPLE, multiple_of=BLOCK_MULTIPLE
    )
    max_batch_size: int = Field(64, ge=1)
    max_prefill_tokens: int = Field(4096, ge=MIN_PREFILL_TOKENS)
    backend: Backend = "auto"
    kernels: dict[str, dict[str, dict[str, int]]] = Field(default_factory=dict)


class GenerationDefaults(_Strict):
    # the sampler's own bounds: out of them, every request that left a field to the default
    # failed with a 400 blaming the client for a field it never sent
    temperature: float = Field(0.7, ge=0, allow_inf_nan=False)
    top_p: float = Field(0.9, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    repetition_penalty: float = Field(1.0, gt=0, allow_inf_nan=False)
    stop_token_ids: list[Annotated[int, Field(ge=0)]] = Field(default_factory=list)


class Manifest(_Strict):
    format: Literal["liteserve-artifact"] = FORMAT
    schema_version: int = SCHEMA_VERSION
    producer: Producer
    source: SourceModel
    architecture: Architecture
    quantization: Quantization
    layout: Layout
    dtype: Literal["float16", "bfloat16"] = "float16"  # of the unquantized tensors
    tensors: dict[str, TensorEntry]
    files: dict[str, FileEntry]  # every file but manifest.json and README.md (the card grows)
    launch: LaunchConfig = Field(default_factory=LaunchConfig)
    generation: GenerationDefaults = Field(default_factory=GenerationDefaults)
