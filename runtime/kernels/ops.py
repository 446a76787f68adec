"""One dispatch point per op: the engine picks a backend once and the model calls its ops.

``cpu`` is the C kernels (``cpu_decode.c``, ``cpu_qlinear.c``, ``cpu_layer.c``), each op on the
path ``cpu_dispatch`` measured fastest on the host, with torch's ops where they are faster or
no compiler is there; ``triton`` is the GPU kernels in ``runtime/kernels/triton/`` (on a CPU only
under ``TRITON_INTERPRET=1``, which the tests use); ``cuda`` is the csrc library
(``runtime/kernels/cuda/``). A backend asked for by name that cannot run is refused with the
reason; ``auto`` takes the first that runs and says what it passed over.
"""

from __future__ import annotations

import logging
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from runtime.artifact.manifest import BACKENDS
from runtime.device import make_current, resolve_device
from runtime.kernels.reference import ACTIVATIONS, apply_rotary
from runtime.kv.layer import LayerKV

log = logging.getLogger(__name__)


class BackendError(ValueError):
    """The requested backend cannot run here."""


@dataclass(frozen=True)
class StepInputs:
    """One step as the model runner hands it to a backend, on the host: the new tokens of every
    sequence concatenated, and each sequence's block table and lengths."""

    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    block_tables: list[list[int]]
    context_lens: list[int]  # per sequence: tokens in its KV after this step
    query_lens: list[int]  # per sequence: new tokens in this step
    logits_indices: list[int]  # rows of the step whose logits are wanted
    block_size: int

    @property
    def all_decode(self) -> bool:
        return all(n == 1 for n in self.query_lens)


@dataclass
class StepTensors:
    """A step's inputs on the backend's device, as the model's forward reads them: the token
    rows, their positions and KV slots, the rows to compute logits for, and the attention
    metadata in the backend's own form (``attn``, built by its ``prepare_step``)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    logits_indices: torch.Tensor
    attn: Any


@dataclass(frozen=True)
class LayerParts:
    """A decoder layer's weights in the backend's forms, and its shape: what prepare_layer
    gets from the model (kernels never import the model)."""

    linears: dict[str, Any]  # "qkv", "o", "gate_up", "down": prepare_int4's forms
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv_bias: torch.Tensor | None
    # o, gate_up or down carry a bias (Llama's attention_bias and mlp_bias, Qwen3's
    # attention_bias): a fused layer must add them or not run the layer
    out_biases: bool
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    hidden_act: str
    sliding_window: int | None
    scale: float


class Backend(ABC):
    """The ops a model runs and the step metadata they read. Each backend builds its own
    metadata from :class:`StepInputs` in ``prepare_step``; the model runner never asks which
    backend it has."""

    name: str
    device: torch.device
    dtypes: tuple[torch.dtype, ...]  # activation dtypes it supports
    detail: str  # what it runs on, for logs, /health and `runtime check`
    graphs: bool = False  # decode steps can run from static buffers (CUDA graphs on a GPU)
    fuses_layers: bool = False  # fp32 steps run a whole decoder layer per call
    # the environment variable that, set to 0, runs torch's pointwise ops instead of the
    # backend's fused kernels (add_rms_norm, act_mul, rotary_kv_write), to time the difference
    fused_env: str | None = None
    # row counts (ascending) that compile kernels of their own: run once at start-up
    # (ModelRunner.warm_up), so that no request waits on a compile
    warmup_tokens: tuple[int, ...] = ()
    # the most tokens a step should take where the user sets no budget (the artifact's launch
    # config is the GPU's); None: the launch config's
    step_tokens: int | None = None

    @abstractmethod
    def default_dtype(self) -> torch.dtype:
        """The activation dtype `--dtype auto` picks: the one this backend runs fastest without
        losing range."""

    @abstractmethod
    def prepare_int4(
        self,
        parts: list[tuple[torch.Tensor, torch.Tensor, int]],
        k: int,
        group_size: int,
        dtype: torch.dtype,
    ) -> Any:
        """The backend's form of linears sharing an input; parts are (qweight, qparams, n)."""

    @abstractmethod
    def int4_linear(self, x: torch.Tensor, w: Any) -> torch.Tensor: ...

    @abstractmethod
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...

    def add_rms_norm(
        self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, rms_norm(x + delta)): a sublayer's output added to the residual stream
        and the sum normalized for the next sublayer; without delta (x, rms_norm(x)). Torch's
        add and the backend's norm here; one kernel where a backend fuses them."""
        if delta is not None:
            x = x + delta
        return x, self.rms_norm(x, weight, eps)

    def act_mul(self, gate_up: torch.Tensor, hidden_act: str) -> torch.Tensor:
        """act(gate) * up from the fused gate/up GEMM's output [T, 2I], gate first."""
        gate, up = gate_up.chunk(2, dim=-1)
        return ACTIVATIONS[hidden_act](gate) * up

    def rotary_kv_write(
        self,
        qk: torch.Tensor,
        v: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv: LayerKV,
        slot_mapping: torch.Tensor,
    ) -> torch.Tensor:
        """The queries [T, H, D] rotated, after K rotated and V [T, Hkv, D] were written into the
        layer's pool; qk [T, H + Hkv, D] holds the queries' heads, then K's. rope: cos and sin
        [T, 1, D/2] of the tokens' positions."""
        qk = apply_rotary(qk, *rope)
        heads = qk.shape[1] - v.shape[1]
        self.kv_write(kv, qk[:, heads:], v, slot_mapping)
        return qk[:, :heads]

    def prepare_logits(self, weight: torch.Tensor) -> Any:
        """The backend's form of the lm_head [V, K] (the dense weight itself by default)."""
        return weight

    @abstractmethod
    def logits(self, x: torch.Tensor, weight: Any) -> torch.Tensor:
        """float32 [M, V] = x [M, K] @ weight [V, K].T, weight in prepare_logits' form"""

    @abstractmethod
    def kv_write(
        self, kv: LayerKV, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None: ...

    @abstractmethod
    def attention(
        self, q: torch.Tensor, kv: LayerKV, attn: Any, scale: float, sliding_window: int | None
    ) -> torch.Tensor:
        """[T, H, D] attention of the step's queries over their paged context."""

    @abstractmethod
    def prepare_step(self, step: StepInputs) -> StepTensors: ...

    def prepare_layer(self, parts: LayerParts) -> Any:
        """The backend's form of a whole decoder layer, for backends that run one in a single
        call (`decoder_layer`); None: the model calls the ops one by one."""
        return None

    def decoder_layer(
        self,
        x: torch.Tensor,
        layer: Any,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv: LayerKV,
        step: StepTensors,
    ) -> torch.Tensor | None:
        """The layer's output for this step, or None when this step is not one the fused
        layer runs (the model then calls the ops one by one)."""
        return None

    def decoder_layers(
        self,
        x: torch.Tensor,
        layers: list[Any],
        rope: tuple[torch.Tensor, torch.Tensor],
        cache: Any,
        step: StepTensors,
    ) -> torch.Tensor | None:
        """The last of `layers`' outputs for this step in one call (layer i's KV is
        cache.layer(i)), or None when the backend does not run the stack whole (the model
        then calls `decoder_layer` for each)."""
        return None

    def decode_attn(self, block_tables: torch.Tensor, context_lens: torch.Tensor) -> Any:
        """Attention metadata of an all-decode step over static buffers (what a CUDA graph
        replays); only backends with ``graphs`` have it."""
        raise NotImplementedError(f"backend {self.name} does not run decode steps from graphs")


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _has_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def select_backend(
    requested: str,
    pinned: dict[str, dict[str, dict[str, int]]],
    device: str = "auto",
    int8_activations: bool = True,
) -> Backend:
    """`pinned` is the artifact's launch.kernels (tuned configs per GPU architecture); `device`
    is auto (the current GPU for the GPU backends), cpu, cuda or cuda:N; `int8_activations`
    lets the CPU backend quantize activations where it measured that faster.

    ``auto`` takes cuda (the csrc library) when a GPU is there and the library builds and
    loads, then triton, then the CPU; the backend's detail line says what it passed over and
    why, so logs, /health and `runtime check` show it."""
    if requested not in BACKENDS:
        raise BackendError(f"unknown backend {requested!r}: expected one of {', '.join(BACKENDS)}")
    if requested != "auto":
        return _make(requested, pinned, device, int8_activations)
    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        backend = _make("cpu", pinned, "auto", int8_activations)
        backend.detail += " (auto: no CUDA GPU)" if device == "auto" else ""
        return backend
    if not torch.cuda.is_available() and not interpreting():  # one reason, not one per backend
        raise BackendError(
            f"device {device!r} needs a CUDA GPU and none is visible here; use --device cpu "
            "(or auto)"
        )
    passed = []
    for name in ("cuda", "triton"):
        try:
            backend = _make(name, pinned, device, int8_activations)
        except BackendError as e:
            passed.append(f"{name}: {e}")
            continue
        if passed:
            backend.detail += f" (auto passed over {'; '.join(passed)})"
        return backend
    raise BackendError(f"no GPU backend can run here ({'; '.join(passed)}); use --backend cpu")


def _make(
    name: str, pinned: dict[str, dict[str, dict[str, int]]], device: str, int8_activations: bool
) -> Backend:
    if name == "cpu":
        if device not in ("auto", "cpu"):
            raise BackendError(f"backend 'cpu' runs on the CPU, not {device!r}")
        from runtime.kernels.cpu import CpuBackend

        return CpuBackend(int8_activations)
    if not _has_triton():  # the cuda backend's prefill attention is Triton's too
        raise BackendError(f"backend {name!r} needs the triton package: pip install triton")
    if name == "cuda":
        return _cuda(pinned, device)
    if not torch.cuda.is_available() and not interpreting():
        raise BackendError(
            "backend 'triton' needs a CUDA GPU (TRITON_INTERPRET=1 interprets its kernels on "
            "the CPU, for tests only); use --backend cpu here"
        )
    from runtime.kernels.triton.backend import TritonBackend

    return TritonBackend(_gpu_device(device, "triton"), pinned)


def _cuda(pinned: dict[str, dict[str, dict[str, int]]], device: str) -> Backend:
    if not torch.cuda.is_available() and not interpreting():
        raise BackendError(
            "backend 'cuda' needs a CUDA GPU (TRITON_INTERPRET=1 runs its kernels on the CPU "
            "through the csrc emulator, for tests only); use --backend cpu here"
        )
    from runtime.kernels.build_cache import BuildUnavailable
    from runtime.kernels.cuda import library
    from runtime.kernels.cuda.backend import CudaBackend

    try:
        lib = library.library()
    except BuildUnavailable as e:
        raise BackendError(f"the csrc CUDA library is unavailable: {e}") from e
    gpu = _gpu_device(device, "cuda")
    if gpu.type == "cuda":  # not the emulator
        why = library.unrunnable(
            library.probe(lib), torch.cuda.get_device_capability(gpu), Path(lib._name)
        )
        if why:
            raise BackendError(f"the csrc CUDA library cannot run here: {why}")
    return CudaBackend(gpu, pinned, lib)


def _gpu_device(requested: str, backend: str) -> torch.device:
    """cuda:N for the GPU backends (the current GPU for auto); the CPU only when interpreting."""
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cpu" and not interpreting():
        raise BackendError(f"backend {backend!r} runs on a GPU: choose --device cuda[:N]")
    try:
        device = resolve_device(requested)
    except ValueError as e:
        raise BackendError(str(e)) from e
    make_current(device)
    return device
