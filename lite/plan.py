"""What a `lite auto_awq` run will need, worked out from the model's config alone.

The model is built on the meta device (shapes, no memory), so a 70B config is planned in a
second on any machine. `--dry-run` prints these numbers; the driver sizes its activation chunks
with the same ones, so the plan and the run agree on what a layer holds:

- on the device, per decoder layer: its weights in fp32 (calibration's compute dtype), one
  Gram matrix per scale group, one chunk of calibration activations going through the forward,
  and the larger of the widest group's scale-search temporaries and the widest linear's GPTQ
  rounding workspace;
- on the host: the calibration activations, a layer's inputs and its outputs;
- the artifact: int4 codes and fp16 group parameters for every decoder linear, 16-bit copies of
  everything else.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lite.families import LAYER_GROUPS
from lite.quantizer import num_groups
from runtime.artifact import layout

CHUNK_TOKENS = 4096  # tokens per forward chunk by default: large matmuls, bounded memory
FP32, FP64, STORED = 4, 8, 2  # bytes: statistics, scores, unquantized tensors in the artifact
QPARAM_BYTES = 2 * 2  # (s, -z*s) in fp16 per group and output column
SEARCH_BYTES_PER_WEIGHT = 32  # the scale search's temporaries per weight of its group, below
# a rounded weight until packing: its uint8 code, and its group's fp32 scale and int32 zero
# shared by at least 32 weights (the smallest group)
CODE_BYTES = 1 + (FP32 + 4) / 32


def skeleton(config) -> torch.nn.Module:
    """The whole model on the meta device: every shape, no memory."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


@dataclass(frozen=True)
class LayerMemory:
    """Bytes one decoder layer holds on the calibration device at its peak."""

    weights: int
    grams: int
    chunk: int
    workspace: int

    @property
    def total(self) -> int:
        return self.weights + self.grams + self.chunk + self.workspace


def _linears(layer: torch.nn.Module) -> dict[str, torch.nn.Linear]:
    return {n: m for n, m in layer.named_modules() if isinstance(m, torch.nn.Linear)}


def gram_bytes(layer: torch.nn.Module, family: str) -> int:
    """Each scale group's input statistics: the Gram matrix in fp32, sum |x| in fp64."""
    dims = [layer.get_submodule(g.linears[0]).in_features for g in LAYER_GROUPS[family]]
    return sum(k * k * FP32 + k * FP64 for k in dims)


def search_bytes(layer: torch.nn.Module, family: str) -> int:
    """The widest group's scale search: its stacked weights, the scaled and fake-quantized
    candidates in fp32 (about 4 copies at once), the error and its product with H in fp64
    (3 more, at 8 bytes), together SEARCH_BYTES_PER_WEIGHT per weight, plus H in fp64."""
    worst = 0
    for group in LAYER_GROUPS[family]:
        lins = [layer.get_submodule(n) for n in group.linears]
        k = lins[0].in_features
        n = sum(lin.out_features for lin in lins)
        worst = max(worst, n * k * SEARCH_BYTES_PER_WEIGHT + k * k * FP64)
    return worst


def rtn_bytes(layer: torch.nn.Module) -> int:
    """Round-to-nearest of the largest linear, plus the codes of every linear, held until the
    layer is packed (CODE_BYTES a weight). Rounding holds the scale and zero expanded to every
    column and two temporaries of its chain, all padded to whole groups (counted at the group
    size that pads most: a bound for any), and two fp32 copies of the unpadded weights; the
    padded group range comes before them. Measured: 20-21 bytes a weight at K = 576 (SmolLM2,
    padded to 640 at g128) for g32/64/128, against 25.8 counted."""
    linears = _linears(layer).values()
    widest = max(
        lin.out_features * (_padded(lin.in_features) * 4 + lin.in_features * 2) * FP32
        for lin in linears
    )
    return int(widest + sum(lin.weight.numel() for lin in linears) * CODE_BYTES)


def _padded(k: int) -> int:
    return max(num_groups(k, g) * g for g in layout.GROUP_SIZES)


def token_bytes(layer: torch.nn.Module, hidden: int, num_heads: int, seqlen: int) -> int:
    """fp32 bytes one calibration token may hold at once inside the layer's forward: the
    chunk's input and output, the residual and a norm's output (4 x hidden), every linear's
    output, the |x| copy a statistics hook makes, and a row of attention scores per head in
    case attention takes the unfused path. An upper bound: torch frees most before the next."""
    linears = _linears(layer).values()
    widest_input = max(lin.in_features for lin in linears)
    outputs = sum(lin.out_features for lin in linears)
    return (4 * hidden + outputs + widest_input + num_heads * seqlen) * FP32


def default_rows(seqlen: int) -> int:
    """Calibration samples per chunk unless told or short of memory: CHUNK_TOKENS worth."""
    return max(1, CHUNK_TOKENS // seqlen)


def chunk_rows(
    requested: int | None, seqlen: int, n_samples: int, row_bytes: int, spare: int | None
) -> int:
    """Samples per activation chunk: `--calib-batch-size` when given; else the default, fewer
    where the device's spare memory (None on the CPU) cannot hold it."""
    if requested is not None:
        return min(requested, n_samples)
    rows = default_rows(seqlen)
    if spare is not None:
        rows = min(rows, max(1, spare // row_bytes))
    return max(1, min(rows, n_samples))


def row_bytes(layer: torch.nn.Module, config, seqlen: int) -> int:
    """Device bytes one calibration sample adds to an activation chunk."""
    return seqlen * token_bytes(layer, config.hidden_size, config.num_attention_heads, seqlen)


def gptq_bytes(layer: torch.nn.Module) -> int:
    """The widest linear's GPTQ rounding (lite/gptq.py, the default rounding with calibration):
    its permuted Gram matrix in fp32 and two K x K fp64 matrices while the inverse Cholesky
    factor is made, then that factor, the weights and their update in fp64 while columns are
    rounded; its weights in fp64 throughout. At an 8B model's down projection (K = 14336)
    the factorization is the larger phase, 4.6 GB. Plus the codes of every linear, held
    until the layer is packed (CODE_BYTES a weight): the last linears are rounded while the
    others' codes wait (measured: without them a quarter-width Llama-3-8B layer on one
    128-token chunk held 1 MiB more than planned)."""
    linears = _linears(layer).values()
    worst = 0
    for lin in linears:
        n, k = lin.out_features, lin.in_features
        factor = k * k * (2 * FP64 + FP32)
        rounding = k * k * FP64 + n * k * FP64
        worst = max(worst, max(factor, rounding) + n * k * FP64)
    return worst + int(sum(lin.weight.numel() for lin in linears) * CODE_BYTES)


def layer_memory(layer: torch.nn.Module, config, seqlen: int, rows: int) -> LayerMemory:
    """`rows` 0: round-to-nearest, no statistics and no activations."""
    weights = sum(p.numel() for p in layer.parameters()) * FP32
    if rows == 0:
        return LayerMemory(weights, 0, 0, rtn_bytes(layer))
    family = config.model_type
    return LayerMemory(
        weights=weights,
        grams=gram_bytes(layer, family),
        chunk=rows * row_bytes(layer, config, seqlen),
        workspace=max(search_bytes(layer, family), gptq_bytes(layer)),
    )


def device_rows(
    requested: int | None,
    layer: torch.nn.Module,
    config,
    seqlen: int,
    n_samples: int,
    free: int | None,
) -> int:
    """Samples per activation chunk on a device with `free` bytes (None: the CPU, where the
    default chunking stays as it always was): what the layer's weights, statistics and
    search leave of it, in whole samples."""
    fixed = layer_memory(layer, config, seqlen, 1)
    spare = None if free is None else free - (fixed.total - fixed.chunk)
    return chunk_rows(requested, seqlen, n_samples, row_bytes(layer, config, seqlen), spare)


def linear_bytes(n: int, k: int, group_size: int) -> int:
    """A quantized linear in the artifact: int4 codes and group parameters, padded."""
    np_, kp = layout.padded_shape(n, k, group_size)
    return kp * np_ // 2 + kp // group_size * np_ * QPARAM_BYTES


def layer_artifact_bytes(layer: torch.nn.Module, group_size: int) -> int:
    linears = _linears(layer)
    total = 0
    for name, p in layer.named_parameters():
        owner, kind = name.rsplit(".", 1)
        if owner in linears and kind == "weight":
            total += linear_bytes(*p.shape, group_size)
        else:  # norms and biases stay 16-bit
            total += p.numel() * STORED
    return total


@dataclass(frozen=True)
class Plan:
    family: str
    layers: int
    layer_params: int
    params: int
    device: str
    n_samples: int
    seqlen: int
    rows: int
    memory: LayerMemory
    host_activations: int
    artifact_bytes: int
    layer_seconds: float | None = None  # measured on one layer
    timed: str = "layer 0"  # which: the model's own, or one of random weights (no weights here)
    layer_peak: int | None = None  # bytes its tensors held at most, measured on the same run
    peak_where: str | None = None  # the calls at that peak (measured on the CPU only)
    not_timed: str | None = None  # why the layer was not run (it would not fit)

    @property
    def planned_peak(self) -> int:
        """What the measured peak is held to: the layer's device memory and, where the device
        is the host, the layer's outputs too (the host half of the calibration activations)."""
        host_outputs = self.host_activations // 2 if self.device == "cpu" else 0
        return self.memory.total + host_outputs


def activation_bytes(config, n_samples: int, seqlen: int) -> int:
    """The calibration activations a run keeps on the host: one layer's inputs and outputs."""
    return 2 * n_samples * seqlen * config.hidden_size * FP32


def run_need(memory: LayerMemory, host_activations: int, device: str) -> int:
    """What one layer's run holds where it runs: the layer's memory and, on the CPU, the
    calibration activations too (a layer's inputs and outputs). On a GPU they stay on the host
    and cross in chunks already sized to what is free."""
    return memory.total + (host_activations if device == "cpu" else 0)


def shortfall(need: int, available: int, device: str) -> str | None:
    """Why one layer's run, holding `need` bytes where it runs, would not fit the `available`
    ones (None: it fits)."""
    if need <= available:
        return None
    what = "a layer and the calibration activations need" if device == "cpu" else "a layer needs"
    return f"{what} about {_size(need)} and {device} has {_size(available)} available"


def too_large(plan: Plan, available: int) -> str | None:
    """Why the dry run would not time a layer in the ``available`` bytes where it runs (None:
    it fits)."""
    need = run_need(plan.memory, plan.host_activations, plan.device)
    short = shortfall(need, available, plan.device)
    one_row = plan.memory.chunk // plan.rows if plan.rows else 0
    if short and plan.rows > 1 and need - plan.memory.chunk + one_row <= available:
        rows = max(1, plan.rows * (available - need + plan.memory.chunk) // plan.memory.chunk)
        return f"{short}: use smaller activation chunks, e.g. --calib-batch-size {rows}"
    fix = "dry-run where the run will go (--device cuda on a GPU with the room)"
    return short and f"{short}: {fix}"


def make_plan(
    config,
    group_size: int,
    n_samples: int,
    seqlen: int,
    device: str,
    requested_rows: int | None,
    free: int | None,
) -> Plan:
    """Everything but the time, from the config, with the chunking a run would choose on a
    device with `free` bytes (None: the CPU)."""
    model = skeleton(config)
    layer = model.model.layers[0]
    n_layers = config.num_hidden_layers
    rows = device_rows(requested_rows, layer, config, seqlen, n_samples, free) if n_samples else 0
    globals_ = [p for n, p in model.named_parameters() if not n.startswith("model.layers.")]
    return Plan(
        family=config.model_type,
        layers=n_layers,
        layer_params=sum(p.numel() for p in layer.parameters()),
        params=sum(p.numel() for p in model.parameters()),
        device=device,
        n_samples=n_samples,
        seqlen=seqlen,
        rows=rows,
        memory=layer_memory(layer, config, seqlen, rows),
        host_activations=activation_bytes(config, n_samples, seqlen),
        artifact_bytes=n_layers * layer_artifact_bytes(layer, group_size)
        + sum(p.numel() for p in globals_) * STORED,
    )


def _size(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def render(plan: Plan) -> str:
    m = plan.memory
    calib = (
        f"{plan.n_samples} x {plan.seqlen} calibration tokens, chunks of {plan.rows} sample(s)"
        if plan.n_samples
        else "round-to-nearest (no calibration)"
    )
    lines = [
        f"plan: {plan.family}, {plan.layers} decoder layers of {plan.layer_params / 1e6:.1f} M "
        f"parameters ({plan.params / 1e9:.2f} B in all), on {plan.device}; {calib}",
        f"per decoder layer on {plan.device}:",
        f"  weights (fp32)              {_size(m.weights):>11}",
        f"  Gram matrices (fp32)        {_size(m.grams):>11}",
        f"  activation chunk            {_size(m.chunk):>11}",
        f"  search/quantize workspace   {_size(m.workspace):>11}",
        f"  total                       {_size(m.total):>11}",
        f"host: calibration activations {_size(plan.host_activations)} (a layer's inputs and "
        f"outputs, fp32) plus one layer as read from the shards",
        f"artifact: about {_size(plan.artifact_bytes)} (fp16 model: {_size(plan.params * STORED)})",
    ]
    return "\n".join(lines + render_measured(plan))


def render_measured(plan: Plan) -> list[str]:
    """The lines of what one layer's run measured (none before it ran)."""
    lines = [f"time: not measured: {plan.not_timed}"] if plan.not_timed else []
    if plan.layer_seconds is not None:
        total = plan.layer_seconds * plan.layers
        lines.append(
            f"time: about {total / 60:.1f} min for {plan.layers} layers ({plan.timed} took "
            f"{plan.layer_seconds:.1f} s on {plan.device}, warm-up included), plus reading "
            f"and writing the shards"
        )
    if plan.layer_peak is not None:
        at = f", in {plan.peak_where}" if plan.peak_where else ""
        outputs = " with the layer's outputs" if plan.device == "cpu" else ""
        lines.append(
            f"memory: {plan.timed} held at most {_size(plan.layer_peak)} in tensors on "
            f"{plan.device}{at} (planned: {_size(plan.planned_peak)}{outputs})"
        )
    return lines
