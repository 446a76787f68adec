"""`lite auto_awq`: calibrate layer by layer, resumably, and publish an artifact atomically.

Only one decoder layer's weights (read lazily from the source shards) and the calibration
activations are resident at a time: the layer on the calibration device (`--device`), the
activations on the host, crossing to the device one chunk at a time (`--calib-batch-size`).
After each layer, its packed tensors and the next layer's inputs are saved under
WORK_DIR.partial/; a rerun of the same command picks up there and writes the same bytes, and
so does a rerun with another device or chunk size (neither is part of the run's identity). The
artifact appears at WORK_DIR by a single rename at the end.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import resource
import shutil
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from filelock import FileLock, Timeout
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from lite.awq import (
    BlockProbe,
    InputStats,
    block_of,
    choose_clip_block,
    search_clip,
    search_scale,
    search_scale_block,
    soften_clip,
)
from lite.compute import (
    CHUNK_FLAG,
    PeakBytes,
    available_bytes,
    cuda_version,
    device_label,
    expandable_segments,
    free_bytes,
    full_fp32,
    out_of_memory,
    peak_gib,
    peak_tensors_gib,
    pick_device,
    reset_peak,
    tensor_peak,
)
from lite.data import CalibrationSet, build_calibration
from lite.families import LAYER_GROUPS, NO_CLIP, ScaleGroup
from lite.gptq import DAMP as GPTQ_DAMP
from lite.gptq import gptq_quantize
from lite.hf import architecture_from_config, load_config, load_tokenizer, sliding_window
from lite.model_card import write_model_card
from lite.plan import (
    LayerMemory,
    Plan,
    activation_bytes,
    default_rows,
    device_rows,
    layer_memory,
    make_plan,
    run_need,
    shortfall,
    skeleton,
    too_large,
)
from lite.quantizer import QuantizedWeight, QuantSpec, num_groups, quantize
from lite.sources import Checkpoint, ModelSource, SourceError, resolve, resolve_plan
from runtime import __version__
from runtime.artifact import layout
from runtime.artifact.convert import DTYPES, STORED_16BIT
from runtime.artifact.hf_config import generation_defaults
from runtime.artifact.manifest import (
    LaunchConfig,
    Layout,
    Manifest,
    Producer,
    Quantization,
    SourceModel,
)
from runtime.artifact.reader import read_manifest
from runtime.artifact.writer import (
    check_replaceable,
    file_entries,
    publish,
    save_tensors_atomic,
    tensor_entries,
    utc_now,
    write_json_atomic,
    write_manifest,
    write_shards,
)

WINDOW_ATTR = "calibration_window"  # set on the decoder layers by build_layers


class AwqFallbackWarning(UserWarning):
    """A layer's scale search was not finite and fell back to the identity scale."""


@dataclass(frozen=True)
class AwqConfig:
    spec: QuantSpec = QuantSpec(group_size=128)
    calib_dataset: str = "pydoc"
    calib_samples: int = 128
    calib_seqlen: int = 512
    seed: int = 42
    n_grid: int = 20
    duo_scaling: bool = True
    clip_max_shrink: float = 0.5
    # Groups feeding these modules score scale candidates by the module's output error on
    # `block_samples` calibration sequences, and the blocks in `block_clip` pick how much of
    # each linear's clip to keep; the others (and single-linear groups, whose output is their
    # block) use the Gram form over every token. Off by default: on SmolLM2 it lowers the
    # attention output error per layer but not the whole model's perplexity, in domain or out
    # of it, at 1.8x the calibration time (issue 18 in evals/bench/RESULTS.md).
    block_objective: tuple[str, ...] = ()
    block_clip: tuple[str, ...] = ()
    block_samples: int = 8
    # How the scaled, clipped weights become codes: "gptq" (lite/gptq.py: each column's error
    # compensated on the later ones through the inputs' Gram matrix, which the scale search
    # collects anyway; the default when calibrating: issue 18 in evals/bench/RESULTS.md) or
    # "nearest" (AWQ's round-to-nearest, and what RTN does). None picks by calib_samples.
    rounding: str | None = None
    gptq_damp: float = GPTQ_DAMP  # an evaluation knob (evals/bench/awq_objectives.py)
    gptq_act_order: bool = True  # an evaluation knob: lite.gptq.gptq_quantize's group_act_order
    dtype: str = "float16"
    launch: LaunchConfig = field(default_factory=LaunchConfig)

    def __post_init__(self) -> None:
        if self.rounding is None:  # frozen: the resolved value is what the manifest records
            object.__setattr__(self, "rounding", "gptq" if self.calib_samples > 0 else "nearest")
        if self.rounding not in ROUNDINGS:
            raise ValueError(f"rounding {self.rounding!r}: choose one of {', '.join(ROUNDINGS)}")
        if self.rounding == "gptq" and self.calib_samples == 0:
            raise ValueError(
                "--rounding gptq needs the calibration's statistics: give --calib-samples > 0, "
                "or use --rounding nearest for round-to-nearest without calibration"
            )

    @property
    def method(self) -> str:
        return "awq" if self.calib_samples > 0 else "rtn"

    @property
    def search(self) -> str:
        """The manifest's name for the scale and clip objectives this config runs."""
        if self.method == "rtn":
            return "none"
        chosen = (self.block_objective, self.block_clip)
        custom = f"block(scale={','.join(chosen[0])}; clip={','.join(chosen[1])})"
        return next((name for name, blocks in SEARCHES.items() if blocks == chosen), custom)


ROUNDINGS = ("nearest", "gptq")  # `lite auto_awq --rounding`

# `lite auto_awq --search`: (block_objective, block_clip) by name. "block" is the best block
# variant measured for issue 18 (evals/bench/awq_objectives.py).
SEARCHES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "gram": ((), ()),
    "block": (("self_attn",), ("self_attn", "mlp")),
}


@dataclass
class RunState:
    """What survives a kill: the run's identity, its start time and the last finished layer."""

    dir: Path
    identity: dict  # what decides the run's bytes (identity()): a resume must match it
    created: str
    done: int = -1
    fallbacks: list[str] = field(default_factory=list)
    devices: list[str] = field(default_factory=list)  # every device that calibrated a layer
    command: str = ""  # the command that started the run

    @classmethod
    def open(cls, partial: Path, identity: dict, command: str = "") -> RunState:
        state_file = partial / "state.json"
        if state_file.is_file():
            return cls._resume(partial, identity)
        if partial.is_symlink() or (
            partial.exists() and (not partial.is_dir() or any(partial.iterdir()))
        ):
            raise FileExistsError(  # the finished run deletes it: it must be this tool's
                f"{partial} exists but holds no run of lite auto_awq (no state.json); move it "
                "away, or choose another --work-dir"
            )
        partial.mkdir(parents=True, exist_ok=True)
        (partial / "layers").mkdir(exist_ok=True)
        state = cls(partial, identity, utc_now(), command=command)
        state.save()
        return state

    @classmethod
    def _resume(cls, partial: Path, identity: dict) -> RunState:
        """The saved run, if it is this run and whole; otherwise an error that says why and
        what to do (a state file or layer cut short by a crash gave a traceback, or failed
        only after every remaining layer was calibrated again)."""
        damaged = f"{partial} is damaged (%s); delete it (rm -r {partial}) to start over"
        try:
            saved = json.loads((partial / "state.json").read_text())
            kept = {k: saved[k] for k in ("created", "done", "fallbacks")}
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(damaged % f"state.json is unreadable: {e}") from e
        if saved.get("identity") != identity:
            started = saved.get("command")
            raise ValueError(
                f"{partial} holds an unfinished run of another model or with other settings "
                f"({_changes(saved.get('identity'), identity)}); rerun "
                + (f"its command ({started})" if started else "the original command")
                + f" to resume it, or delete it (rm -r {partial}) to start over"
            )
        state = cls(
            partial,
            identity,
            **kept,
            devices=saved.get("devices", []),
            command=saved.get("command", ""),
        )
        for path in [state.layer_file(i) for i in range(state.done + 1)]:
            why = unreadable(path)
            if why:
                raise ValueError(damaged % f"layers/{path.name} {why}")
        return state

    def layer_file(self, i: int) -> Path:
        return self.dir / "layers" / f"{i:05d}.safetensors"

    def inputs_file(self, i: int) -> Path:
        """Inputs of layer i, named by layer so a kill at any point pairs them right."""
        return self.dir / f"inputs-{i:05d}.safetensors"

    def save(self) -> None:
        data = {k: v for k, v in dataclasses.asdict(self).items() if k != "dir"}
        write_json_atomic(data, self.dir / "state.json")

    def add_device(self, label: str) -> None:
        if label not in self.devices:
            self.devices.append(label)
            self.save()

    def finish_layer(
        self,
        i: int,
        tensors: dict[str, torch.Tensor],
        acts: torch.Tensor | None,
        fallbacks: list[str],
    ) -> None:
        """Layer file and next inputs, then the counter: a kill before the counter redoes i."""
        save_tensors_atomic(tensors, self.layer_file(i))
        if acts is not None:
            save_tensors_atomic({"x": acts}, self.inputs_file(i + 1))
        self.done = i
        self.fallbacks.extend(fallbacks)
        self.save()
        self.inputs_file(i).unlink(missing_ok=True)

    def load_inputs(self) -> torch.Tensor:
        path = self.inputs_file(self.done + 1)
        why = "is missing" if not path.is_file() else unreadable(path)
        if why:
            raise ValueError(
                f"{self.dir} is damaged ({path.name} {why}); delete it (rm -r {self.dir}) "
                f"to start over"
            )
        return load_file(str(path))["x"]


def unreadable(path: Path) -> str | None:
    """Why a saved safetensors file cannot be read back (cut short by a crash), or None; reads
    the header, whose offsets safetensors checks against the file's size."""
    try:
        with safe_open(str(path), "pt"):
            return None
    except (OSError, SafetensorError) as e:
        return f"is unreadable ({e})"


def identity(source: ModelSource, cfg: AwqConfig, calib: CalibrationSet | None) -> dict:
    """What decides a run's bytes: a partial run resumes only under the same. As JSON keeps it
    (lists, not tuples), so the one saved in state.json compares equal."""
    ident = {
        "source": source.files,
        "config": dataclasses.asdict(cfg),
        "calib": calib.sha256 if calib else None,
        "liteserve": __version__,
        "torch": torch.__version__,
    }
    return json.loads(json.dumps(ident, sort_keys=True, default=str))


def _flat(config: dict, prefix: str = "") -> dict:
    """Nested settings (the quantization spec, the launch config) as dotted names."""
    out: dict = {}
    for k, v in config.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _changes(saved: object, now: dict) -> str:
    """What differs between a saved run's identity and this one's, for the refusal."""
    if not isinstance(saved, dict):  # state.json of an older liteserve
        return "settings not recorded by the liteserve that started it"
    names = {
        "source": "the model's files",
        "calib": "the calibration set",
        "liteserve": "liteserve's version",
        "torch": "torch's version",
    }
    changed = [
        f"{names[k]}: {saved.get(k)} then, {now[k]} now"
        if k in ("liteserve", "torch")
        else names[k]
        for k in names
        if saved.get(k) != now[k]
    ]
    before, after = _flat(saved.get("config") or {}), _flat(now["config"])
    changed += [
        f"{k}: {before.get(k)} then, {after.get(k)} now"
        for k in sorted(set(before) | set(after))
        if before.get(k) != after.get(k)
    ]
    return "; ".join(changed[:4]) or "settings not recorded"


def check_writable(work_dir: Path, overwrite: bool) -> None:
    """Fail before hours of calibration, not after."""
    check_replaceable(work_dir, overwrite)
    try:
        work_dir.parent.mkdir(parents=True, exist_ok=True)
        probe = work_dir.parent / f".{work_dir.name}.probe"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise PermissionError(
            f"cannot write the artifact to {work_dir} ({e.strerror or e}); choose a writable "
            f"--work-dir"
        ) from e


def _layer_call(layer: torch.nn.Module, h: torch.Tensor, pos: tuple) -> torch.Tensor:
    out = layer(h, attention_mask=_window_mask(layer, h), position_embeddings=pos)
    return out[0] if isinstance(out, tuple) else out


def _window_mask(layer: torch.nn.Module, h: torch.Tensor) -> torch.Tensor | None:
    """Causal attention within the model's sliding window, as transformers' model builds it
    for its layers: a layer called alone gets the plain causal default (None), which attends
    past the window once the calibration blocks are longer than it."""
    window, n = getattr(layer, WINDOW_ATTR, None), h.shape[1]
    if window is None or n <= window:
        return None
    i = torch.arange(n, device=h.device)
    allowed = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < window)
    mask = torch.zeros(n, n, dtype=h.dtype, device=h.device)
    return mask.masked_fill(~allowed, torch.finfo(h.dtype).min)[None, None]


def layer_device(layer: torch.nn.Module) -> torch.device:
    return next(layer.parameters()).device


@torch.inference_mode()
def run_layer(
    layer: torch.nn.Module, x: torch.Tensor, pos: tuple, rows: int | None = None
) -> torch.Tensor:
    """The layer's outputs for all samples of x, `rows` samples at a time (default:
    `default_rows`). Each chunk crosses to the layer's device and its outputs come back to
    x's, so the device holds one chunk; `pos` must be on the layer's device."""
    device = layer_device(layer)
    rows = rows or default_rows(x.shape[1])
    out = torch.empty_like(x)
    for i in range(0, len(x), rows):
        out[i : i + rows] = _layer_call(layer, x[i : i + rows].to(device), pos)
    return out


def capture(
    layer: torch.nn.Module,
    groups: tuple[ScaleGroup, ...],
    x: torch.Tensor,
    pos: tuple,
    rows: int | None = None,
) -> tuple[dict[ScaleGroup, InputStats], torch.Tensor]:
    """One forward with hooks: the input statistics each group's linears share, and the
    layer's full-precision outputs, which become the next layer's inputs (as in AutoAWQ;
    measured on SmolLM2 as good as feeding quantized outputs, and one forward cheaper). The
    statistics add up chunk by chunk on the layer's device."""
    stats: dict[ScaleGroup, InputStats] = {}
    handles = []
    for group in groups:
        first = layer.get_submodule(group.linears[0])
        stats[group] = InputStats(first.in_features, layer_device(layer))
        handles.append(
            first.register_forward_pre_hook(lambda _m, args, s=stats[group]: s.add(args[0]))
        )
    try:
        outputs = run_layer(layer, x, pos, rows)
    finally:
        for h in handles:
            h.remove()
    return stats, outputs


@dataclass
class LayerCalibration:
    clip: dict[str, torch.Tensor]  # linear name -> per (row, group) range shrink
    fallbacks: list[str]
    outputs: torch.Tensor
    ratios: dict[str, float | None] = field(default_factory=dict)  # group -> alpha (None: 1)
    grams: dict[str, torch.Tensor] = field(default_factory=dict)  # linear -> its inputs' Gram


def _can_scale(layer: torch.nn.Module, group: ScaleGroup) -> bool:
    prev = layer.get_submodule(group.prev)
    if isinstance(prev, torch.nn.Linear):
        return all(prev.out_features == layer.get_submodule(n).in_features for n in group.linears)
    return True


def _apply_scale(layer: torch.nn.Module, group: ScaleGroup, s: torch.Tensor) -> None:
    prev = layer.get_submodule(group.prev)
    if isinstance(prev, torch.nn.Linear):
        prev.weight.data.div_(s[:, None])
        if prev.bias is not None:
            prev.bias.data.div_(s)
    else:
        prev.weight.data.div_(s)
    for name in group.linears:
        layer.get_submodule(name).weight.data.mul_(s[None, :])


def check_coverage(layer: torch.nn.Module, groups: tuple[ScaleGroup, ...], family: str) -> None:
    declared = {n for g in groups for n in g.linears}
    found = {n for n, m in layer.named_modules() if isinstance(m, torch.nn.Linear)}
    if declared != found:
        raise ValueError(
            f"{family}: the decoder layer's linears {sorted(found)} differ from the declared "
            f"AWQ groups {sorted(declared)}; update lite/families.py"
        )


def probe_samples(n: int, k: int) -> torch.Tensor:
    """k of n calibration sequences, evenly spaced (deterministic, spread over the text)."""
    if k >= n:
        return torch.arange(n)
    return torch.linspace(0, n - 1, k).round().long().unique()


def record_probes(
    layer: torch.nn.Module,
    blocks: set[str],
    x: torch.Tensor,
    pos: tuple,
    samples: int,
    rows: int | None = None,
) -> dict[str, BlockProbe]:
    """One forward of `samples` sequences, recording each block module's calls (inputs and
    outputs) for the block-output searches; one chunk of `rows` sequences per call."""
    probes = {b: BlockProbe(layer.get_submodule(b)) for b in sorted(blocks)}
    handles = [
        p.module.register_forward_hook(
            lambda _m, args, kwargs, out, p=p: p.record(args, kwargs, out), with_kwargs=True
        )
        for p in probes.values()
    ]
    try:
        run_layer(layer, x[probe_samples(len(x), samples)], pos, rows)
    finally:
        for h in handles:
            h.remove()
    return probes


def _block_blocks(groups: tuple[ScaleGroup, ...], wanted: tuple[str, ...]) -> set[str]:
    return {b for g in groups if (b := block_of(g.linears)) is not None and b in wanted}


def _search_group(
    layer: torch.nn.Module,
    group: ScaleGroup,
    stats: InputStats,
    probes: dict[str, BlockProbe],
    cfg: AwqConfig,
):
    """The block-output search where the group's block is probed, the Gram form elsewhere."""
    linears = [layer.get_submodule(n) for n in group.linears]
    probe = probes.get(block_of(group.linears) or "")
    if probe is not None:
        return search_scale_block(linears, stats, cfg.spec, probe, cfg.n_grid, cfg.duo_scaling)
    w = torch.cat([lin.weight.data for lin in linears])
    return search_scale(w, stats, cfg.spec, cfg.n_grid, cfg.duo_scaling)


def _clip_layer(
    layer: torch.nn.Module,
    groups: tuple[ScaleGroup, ...],
    stats: dict[ScaleGroup, InputStats],
    x: torch.Tensor,
    pos: tuple,
    cfg: AwqConfig,
    rows: int | None,
) -> dict[str, torch.Tensor]:
    """Gram-form clip per (row, group) for every clipped linear; then, for the blocks in
    `cfg.block_clip`, the strength of each linear's clip picked on the block output (probes
    recorded again, as the folded scales changed the blocks' inputs)."""
    clip = {
        name: search_clip(
            layer.get_submodule(name).weight.data,
            stats[group],
            cfg.spec,
            cfg.n_grid,
            cfg.clip_max_shrink,
        )
        for group in groups
        for name in group.linears
        if name.rsplit(".", 1)[-1] not in NO_CLIP
    }
    blocks = _block_blocks(groups, cfg.block_clip)
    if not blocks or cfg.block_samples < 1:
        return clip
    probes = record_probes(layer, blocks, x, pos, cfg.block_samples, rows)
    for group in groups:
        probe = probes.get(block_of(group.linears) or "")
        if probe is None:
            continue
        linears = [layer.get_submodule(n) for n in group.linears]
        strengths = choose_clip_block(
            linears, [clip.get(n) for n in group.linears], cfg.spec, probe
        )
        for n, st in zip(group.linears, strengths, strict=True):
            if n in clip:
                clip[n] = soften_clip(clip[n], st)
    return clip


def calibrate_layer(
    layer: torch.nn.Module,
    groups: tuple[ScaleGroup, ...],
    x: torch.Tensor,
    pos: tuple,
    cfg: AwqConfig,
    name: str,
    rows: int | None = None,
) -> LayerCalibration:
    """Scale search (folded into the layer in place), then clip search, on the layer's device.
    Block probes are recorded on the unscaled layer: folding a group's scale leaves every
    block's function unchanged, and the only block inputs it changes (the norm outputs) feed
    groups whose searches come first."""
    stats, outputs = capture(layer, groups, x, pos, rows)
    blocks = _block_blocks(groups, cfg.block_objective) if cfg.block_samples > 0 else set()
    probes = record_probes(layer, blocks, x, pos, cfg.block_samples, rows) if blocks else {}
    fallbacks = []
    ratios: dict[str, float | None] = {}
    for group in groups:
        if not _can_scale(layer, group):
            continue
        result = _search_group(layer, group, stats[group], probes, cfg)
        ratios[group.label] = result.ratio
        if result.ratio is None and not math.isfinite(result.loss):
            note = f"{name} {group.label}: non-finite search loss, identity scale"
            warnings.warn(note, AwqFallbackWarning, stacklevel=2)
            fallbacks.append(note)
            continue
        _apply_scale(layer, group, result.scales)
        stats[group].rescale(result.scales)
    del probes
    clip = _clip_layer(layer, groups, stats, x, pos, cfg, rows)
    grams = {n: stats[g].gram for g in groups for n in g.linears} if cfg.rounding == "gptq" else {}
    return LayerCalibration(clip, fallbacks, outputs, ratios, grams)


def pack_layer(
    layer: torch.nn.Module,
    cfg: AwqConfig,
    prefix: str,
    clip: dict[str, torch.Tensor],
    grams: dict[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """Every linear quantized (GPTQ rounding where `grams` has its inputs' Gram matrix) and
    packed in the artifact layout; the rest in `cfg.dtype`. Computed where the layer is;
    returned on the host, to be written."""
    dtype = DTYPES[cfg.dtype]
    gs = cfg.spec.group_size
    tensors: dict[str, torch.Tensor] = {}
    linears = {n: m for n, m in layer.named_modules() if isinstance(m, torch.nn.Linear)}
    rounded = _gptq_rounded(linears, grams or {}, clip, cfg)
    for name, lin in linears.items():
        w = lin.weight.data
        k = w.shape[1]
        qw = rounded[name] if name in rounded else quantize(w, cfg.spec, clip.get(name, 1.0))
        tensors[f"{prefix}{name}.qweight"] = layout.pack_qweight(qw.q, gs)
        tensors[f"{prefix}{name}.qparams"] = layout.pack_qparams(qw.scale, qw.zero, gs, k)
        if lin.bias is not None:
            tensors[f"{prefix}{name}.bias"] = lin.bias.data.to(dtype)
    for pname, p in layer.named_parameters():
        if pname.rsplit(".", 1)[0] not in linears:
            tensors[prefix + pname] = p.data.to(dtype)
    return {name: t.cpu() for name, t in stored_finite(tensors).items()}


def stored_finite(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`tensors`, once none holds an inf that its 16-bit storage made: values past float16's
    65504 (in an fp32 or bf16 source, or in a group's scale) were written as inf, and the
    artifact verified."""
    for name, t in tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            fix = (
                "its weights' range per group is beyond the fp16 group scales"
                if name.endswith(".qparams")
                else "store it with --dtype bfloat16"
            )
            raise ValueError(f"{name} does not fit its 16-bit storage (inf or NaN): {fix}")
    return tensors


def _gptq_rounded(
    linears: dict[str, torch.nn.Linear],
    grams: dict[str, torch.Tensor],
    clip: dict[str, torch.Tensor],
    cfg: AwqConfig,
) -> dict[str, QuantizedWeight]:
    """GPTQ's codes for the linears `grams` names. Linears fed the same inputs (q, k, v; gate,
    up) share one Gram matrix and are rounded as one stack of rows: GPTQ treats rows
    independently, so the codes are the same, and its column loop, most of its time, runs
    once for the stack instead of once per linear."""
    stacks: dict[int, list[str]] = {}
    for name in linears:
        if name in grams:
            stacks.setdefault(id(grams[name]), []).append(name)
    out = {}
    for names in stacks.values():
        ws = [linears[n].weight.data for n in names]
        groups = num_groups(ws[0].shape[1], cfg.spec.group_size)
        ratios = [
            torch.as_tensor(clip.get(n, 1.0), dtype=w.dtype, device=w.device).expand(
                w.shape[0], groups
            )
            for n, w in zip(names, ws, strict=True)
        ]
        qw = gptq_quantize(
            torch.cat(ws),
            grams[names[0]],
            cfg.spec,
            torch.cat(ratios),
            cfg.gptq_damp,
            cfg.gptq_act_order,
        )
        rows = [w.shape[0] for w in ws]
        for n, q, sc, z in zip(
            names, qw.q.split(rows), qw.scale.split(rows), qw.zero.split(rows), strict=True
        ):
            out[n] = QuantizedWeight(q=q, scale=sc, zero=z)
    return out


def build_layers(config) -> tuple[torch.nn.ModuleList, torch.nn.Module]:
    """Decoder layer skeletons on the meta device (no memory) and the rotary embedding."""
    model = skeleton(config)
    rotary = type(model.model.rotary_emb)(config=config)
    window = sliding_window(config)
    for layer in model.model.layers:
        setattr(layer, WINDOW_ATTR, window)
    return model.model.layers, rotary


def check_weights(ckpt: Checkpoint, config) -> None:
    """Every tensor the run reads, by name and shape, from the shards' headers: one missing
    from a shard or unlike config.json was found at its layer (after the layers before it, or
    after all of them for the final norm), and fixing the source then changes its hash, so the
    finished layers could not be resumed."""
    want = {
        f"model.layers.{i}.{name}": tuple(t.shape)
        for i, layer in enumerate(build_layers(config)[0])
        for name, t in layer.state_dict().items()
    }
    rows = (config.vocab_size, config.hidden_size)
    want |= {"model.embed_tokens.weight": rows, "model.norm.weight": (config.hidden_size,)}
    if not config.tie_word_embeddings:
        want["lm_head.weight"] = rows
    missing = [name for name in want if name not in ckpt]
    if missing:
        raise SourceError(
            f"{ckpt.path}: {len(missing)} weight(s) that config.json calls for are not in the "
            f"checkpoint ({', '.join(missing[:3])}); the shards are incomplete or belong to "
            "another model"
        )
    wrong = [(n, got, shape) for n, shape in want.items() if (got := ckpt.shape(n)) != shape]
    if wrong:
        name, got, shape = wrong[0]
        raise SourceError(
            f"{ckpt.path}: {name} is {list(got)} in the checkpoint, config.json says "
            f"{list(shape)} ({len(wrong)} weight(s) differ); use the model's own config.json"
        )


def load_layer(
    layer: torch.nn.Module, ckpt: Checkpoint, prefix: str, device: torch.device | str = "cpu"
) -> None:
    """The layer's weights from the shards onto `device`, in fp32."""
    layer.to_empty(device=device)
    state = ckpt.with_prefix(prefix, device)
    missing, unexpected = layer.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(
            f"{ckpt.path}: weights for {prefix} do not match the architecture "
            f"(missing {missing[:4]}, unexpected {unexpected[:4]})"
        )


def peak_rss_gib() -> float:
    """This process's own high-water RSS. Linux's ru_maxrss would also count the parent's
    memory at fork, so read VmHWM where there is a /proc."""
    status = Path("/proc/self/status")
    if status.is_file():
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024**2
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2


@dataclass(frozen=True)
class Compute:
    """Where a run computes and in what pieces: `--device` (auto, cpu, cuda, cuda:N) and
    `--calib-batch-size` (samples per activation chunk; None: automatic). Not part of the
    run's identity: a run that ran out of memory resumes with a smaller chunk or elsewhere."""

    device: str = "auto"
    calib_batch_size: int | None = None


def storage_dtype(requested: str, ckpt: Checkpoint) -> str:
    """`--dtype auto`: the source's own 16-bit dtype, so embeddings, norms and an untied
    lm_head are stored bit for bit; float16 for a 32-bit source."""
    if requested != "auto":
        return requested
    return STORED_16BIT.get(ckpt.stored_dtype("model.embed_tokens.weight"), "float16")


def _calibration(cfg: AwqConfig, tokenizer) -> CalibrationSet | None:
    if cfg.calib_samples == 0:
        return None
    return build_calibration(
        cfg.calib_dataset, tokenizer, cfg.calib_samples, cfg.calib_seqlen, cfg.seed
    )


def auto_awq(
    model: str,
    work_dir: str | Path,
    cfg: AwqConfig,
    command: str = "",
    overwrite: bool = False,
    progress: bool = True,
    compute: Compute = Compute(),
) -> Path:
    started = time.perf_counter()
    expandable_segments()  # before anything touches CUDA
    device = pick_device(compute.device)
    work_dir = Path(work_dir)
    check_writable(work_dir, overwrite)
    source = resolve(model)
    config = load_config(source.path)
    ckpt = Checkpoint(source.path)
    check_weights(ckpt, config)
    cfg = dataclasses.replace(cfg, dtype=storage_dtype(cfg.dtype, ckpt))
    tokenizer = load_tokenizer(source.path)
    calib = _calibration(cfg, tokenizer)
    with _only_run_on(work_dir):
        # again under the lock: a run that held it may have published since the check above,
        # and this one would calibrate everything to be refused at the end
        check_replaceable(work_dir, overwrite)
        state = RunState.open(
            work_dir.with_name(work_dir.name + ".partial"), identity(source, cfg, calib), command
        )
        resumed_at = state.done + 1  # 0: a fresh run
        bar_label = f"{cfg.method} {Path(model).name} on {device_label(device)}"
        reset_peak(device)
        quantize_layers(
            state, ckpt, config, calib, cfg, device, compute.calib_batch_size, bar_label, progress
        )
        staging = state.dir / "artifact"
        _assemble(staging, state, source, ckpt, config, tokenizer, cfg, calib, command)
        write_model_card(staging, read_manifest(staging), work_dir.name)  # as it is served
        publish(staging, work_dir, overwrite)
        shutil.rmtree(state.dir)
    line = _summary(work_dir, time.perf_counter() - started, device)
    if resumed_at:
        line += f" (this session, which resumed at layer {resumed_at})"
    print(line, file=sys.stderr)
    return work_dir


@contextlib.contextmanager
def _only_run_on(work_dir: Path) -> Iterator[None]:
    """Hold the work directory's lock for the run: a second run on it would calibrate the same
    layers again and then fail on the files the first one moved or deleted."""
    lock = FileLock(work_dir.with_name(f".{work_dir.name}.lock"))
    try:
        lock.acquire(timeout=0)
    except Timeout as e:
        raise FileExistsError(
            f"another lite auto_awq is writing {work_dir} (it holds {lock.lock_file}); wait "
            "for it to finish, or choose another --work-dir"
        ) from e
    try:
        yield
    finally:
        lock.release()


def _summary(work_dir: Path, seconds: float, device: torch.device) -> str:
    """The last line: wall time, peak host RSS and, on a GPU, peak GPU memory."""
    line = f"wrote {work_dir} in {seconds:.0f} s on {device_label(device)}; "
    line += f"peak RSS {peak_rss_gib():.2f} GiB"
    gpu = peak_gib(device)
    if gpu is None:
        return line
    return f"{line}; peak GPU memory {gpu:.2f} GiB ({peak_tensors_gib(device):.2f} GiB in tensors)"


def embed(ckpt: Checkpoint, calib: CalibrationSet) -> torch.Tensor:
    """The first layer's inputs, on the host: the calibration tokens' embeddings in fp32."""
    return torch.nn.functional.embedding(calib.tokens, ckpt.get("model.embed_tokens.weight"))


def positions(rotary: torch.nn.Module, x: torch.Tensor, device: torch.device) -> tuple:
    """Rotary cos/sin of one calibration block, on the device (they broadcast over chunks)."""
    cos, sin = rotary(x[:1], torch.arange(x.shape[1])[None])
    return cos.to(device), sin.to(device)


def quantize_layer(
    layer: torch.nn.Module,
    i: int,
    ckpt: Checkpoint,
    x: torch.Tensor | None,
    pos: tuple | None,
    cfg: AwqConfig,
    config,
    device: torch.device,
    rows: int,
    room: tuple[int, int | None] = (0, None),
) -> tuple[dict[str, torch.Tensor], torch.Tensor | None, list[str]]:
    """Layer i loaded onto the device, calibrated on x (unless RTN) and packed: its host
    tensors, its outputs (the next layer's inputs) and its fallbacks. Out of device memory
    becomes an error that says what fixes it (`room`: see compute.out_of_memory)."""
    with memory_errors(device, i, rows if x is not None else 0, room):
        load_layer(layer, ckpt, f"model.layers.{i}.", device)
        return calibrate_and_pack(layer, i, x, pos, cfg, config, rows)


@contextlib.contextmanager
def memory_errors(
    device: torch.device, i: int, rows: int, room: tuple[int, int | None] = (0, None)
) -> Iterator[None]:
    """torch's out-of-memory error as compute.out_of_memory's, which names the fix."""
    try:
        yield
    except torch.OutOfMemoryError as e:
        raise out_of_memory(device, i, rows, room) from e


def calibrate_and_pack(
    layer: torch.nn.Module,
    i: int,
    x: torch.Tensor | None,
    pos: tuple | None,
    cfg: AwqConfig,
    config,
    rows: int,
) -> tuple[dict[str, torch.Tensor], torch.Tensor | None, list[str]]:
    """quantize_layer's work once the layer's weights are on its device."""
    prefix = f"model.layers.{i}."
    if x is None:
        return pack_layer(layer, cfg, prefix, {}), None, []
    groups = LAYER_GROUPS[config.model_type]
    result = calibrate_layer(layer, groups, x, pos, cfg, f"model.layers.{i}", rows)
    tensors = pack_layer(layer, cfg, prefix, result.clip, result.grams)
    return tensors, result.outputs, result.fallbacks


def warn_if_short(
    memory: LayerMemory, config, calib: CalibrationSet | None, device: torch.device
) -> None:
    """Say before the first layer when one layer's run would not fit where it runs: on the
    CPU the OOM killer would end it with nothing shown; on a GPU the chunking fits what is
    free unless the layer alone cannot, or `--calib-batch-size` asked for more. A warning, not
    a refusal: the estimate is an upper bound (the dry run's measured peaks stay under it)."""
    # the layer's inputs are already on the host (embedded or resumed): its outputs are to come
    acts = activation_bytes(config, calib.n_samples, calib.seqlen) // 2 if calib else 0
    need = run_need(memory, acts, device.type)
    short = shortfall(need, available_bytes(device), str(device))
    if not short:
        return
    if device.type == "cpu":
        fix = (
            f"run it with a smaller {CHUNK_FLAG} or fewer --calib-samples, or on a GPU with "
            "the room (--device cuda)"
        )
    else:
        fix = f"run it with a smaller {CHUNK_FLAG}, with --device cpu, or on a freer GPU"
    print(
        f"warning: {short}; the run may fail for memory (it resumes after its last finished "
        f"layer): {fix}",
        file=sys.stderr,
    )


def quantize_layers(
    state: RunState,
    ckpt: Checkpoint,
    config,
    calib: CalibrationSet | None,
    cfg: AwqConfig,
    device: torch.device,
    calib_batch_size: int | None,
    bar_label: str,
    progress: bool = True,
) -> None:
    """Each layer not yet finished: load it, calibrate it (unless RTN), pack it, save it."""
    from tqdm import tqdm

    layers, rotary = build_layers(config)
    check_coverage(layers[0], LAYER_GROUPS[config.model_type], config.model_type)
    n_layers = config.num_hidden_layers
    x = pos = None
    rows = 0
    free = free_bytes(device)
    if calib is not None and state.done + 1 < n_layers:
        x = state.load_inputs() if state.done >= 0 else embed(ckpt, calib)
        pos = positions(rotary, x, device)
        rows = device_rows(calib_batch_size, layers[0], config, calib.seqlen, calib.n_samples, free)
    seqlen = calib.seqlen if rows else 0
    fixed = layer_memory(layers[0], config, seqlen, min(rows, 1))
    room = (fixed.total - fixed.chunk, free)
    if state.done + 1 < n_layers:
        warn_if_short(layer_memory(layers[0], config, seqlen, rows), config, calib, device)
    state.add_device(device_label(device))
    with (
        tqdm(
            total=n_layers,
            initial=state.done + 1,
            desc=bar_label,
            unit="layer",
            disable=not progress,
        ) as bar,
        full_fp32(),
    ):
        for i in range(state.done + 1, n_layers):
            tensors, x, fallbacks = quantize_layer(
                layers[i], i, ckpt, x, pos, cfg, config, device, rows, room
            )
            last = i + 1 == n_layers  # its outputs feed nothing: not saved
            state.finish_layer(i, tensors, None if last else x, fallbacks)
            layers[i] = torch.nn.Identity()  # drop the layer's weights
            bar.update(1)


def dry_run_plan(
    model: str, cfg: AwqConfig, compute: Compute = Compute()
) -> tuple[Plan, Callable[[], Plan] | None]:
    """The plan of a run, from the config alone, and how to time one layer calibrated once
    (nothing written): layer 0 with the weights here, else a layer of random weights of the
    config's shape (a 70B plan on a machine without its 140 GB). Apart, so that the plan is
    shown before that run, which on a CPU takes minutes to hours for a large model's layer (an
    8B layer 24 min on 2 cores); None, with the plan saying why, where the layer would not fit
    (the host's OOM killer, or a CUDA error, would end it with nothing to show)."""
    device = pick_device(compute.device)
    path, source = resolve_plan(model)
    config = load_config(path)
    if source is not None and cfg.calib_samples:  # the blocks the text gives, as a run uses
        calib = _calibration(cfg, load_tokenizer(source.path))
        cfg = dataclasses.replace(cfg, calib_samples=calib.n_samples)
    plan = make_plan(
        config,
        cfg.spec.group_size,
        cfg.calib_samples,
        cfg.calib_seqlen,
        device_label(device),
        compute.calib_batch_size,
        free_bytes(device),
    )
    short = too_large(plan, available_bytes(device))
    if short:
        return dataclasses.replace(plan, not_timed=short), None

    def timed() -> Plan:
        if source is None:
            seconds, peak = time_random_layer(config, cfg, device, plan)
            which = "a layer of random weights"
        else:
            (seconds, peak), which = time_layer(source, config, cfg, device, plan), plan.timed
        return dataclasses.replace(
            plan,
            layer_seconds=seconds,
            timed=which,
            layer_peak=peak.bytes,
            peak_where=peak.where,
        )

    return plan, timed


def time_layer(
    source: ModelSource, config, cfg: AwqConfig, device: torch.device, plan: Plan
) -> tuple[float, PeakBytes]:
    """Seconds to load, calibrate and pack layer 0 on the device, as a run would, and the
    peak of its tensors there."""

    ckpt = Checkpoint(source.path)
    check_weights(ckpt, config)
    cfg = dataclasses.replace(cfg, dtype=storage_dtype(cfg.dtype, ckpt))
    calib = _calibration(cfg, load_tokenizer(source.path))
    layers, rotary = build_layers(config)
    x = pos = None
    if calib is not None:
        x = embed(ckpt, calib)
        pos = positions(rotary, x, device)
    return _time_layer_0(layers[0], ckpt, x, pos, cfg, config, device, plan.rows)


def _time_layer_0(
    layer, weights, x, pos, cfg: AwqConfig, config, device, rows: int
) -> tuple[float, PeakBytes]:
    """The layer's time and its tensors' peak, measured on the one run: the plan's memory
    figures are an estimate, this is what the code held (and where it peaked, on the CPU).
    The peak counts from the loaded weights on: on the CPU the shards' file mappings would
    count as allocations of their whole size while reading (they are not memory), and loading
    holds at most two copies of the weights, below the calibration's peak."""
    started = time.perf_counter()
    with full_fp32(), memory_errors(device, 0, rows if x is not None else 0):
        load_layer(layer, weights, "model.layers.0.", device)
        with tensor_peak(device, where=True) as peak:
            calibrate_and_pack(layer, 0, x, pos, cfg, config, rows)
            seconds = time.perf_counter() - started  # pack_layer's copies to the host synchronize
    peak.bytes += sum(p.nbytes for p in layer.parameters())
    return seconds, peak


class RandomWeights:
    """Stands in for the checkpoint of a model whose weights are not here: layer 0's tensors,
    random, in the config's shapes. A layer's calibration time depends on its shapes, not its
    values, so timing it on these is timing the run's layers."""

    path = "random weights"

    def __init__(self, layer: torch.nn.Module, prefix: str) -> None:
        self.shapes = {prefix + n: t.shape for n, t in layer.state_dict().items()}

    def with_prefix(self, prefix: str, device: torch.device | str) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(0)
        out = {}
        for name, shape in self.shapes.items():
            t = 0.02 * torch.randn(shape, generator=g)
            out[name.removeprefix(prefix)] = (t + 1 if len(shape) == 1 else t).to(device)
        return out  # norms about 1, linears of a trained model's scale


def time_random_layer(
    config, cfg: AwqConfig, device: torch.device, plan: Plan
) -> tuple[float, PeakBytes]:
    """Seconds to load, calibrate and pack a layer of random weights on the device, on
    random activations of the calibration's size, as a run would spend them per layer, and
    the peak of its tensors there."""
    layers, rotary = build_layers(config)
    weights = RandomWeights(layers[0], "model.layers.0.")
    dtype = "bfloat16" if getattr(config, "dtype", None) == torch.bfloat16 else "float16"
    cfg = dataclasses.replace(cfg, dtype=dtype if cfg.dtype == "auto" else cfg.dtype)
    x = pos = None
    if cfg.calib_samples:
        g = torch.Generator().manual_seed(0)
        shape = (cfg.calib_samples, cfg.calib_seqlen, config.hidden_size)
        x = torch.randn(shape, generator=g)
        pos = positions(rotary, x, device)
    return _time_layer_0(layers[0], weights, x, pos, cfg, config, device, plan.rows)


def _globals(ckpt: Checkpoint, tied: bool, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not tied:
        names.append("lm_head.weight")
    return stored_finite({n: ckpt.get(n).to(dtype) for n in names})


def _assemble(
    staging: Path,
    state: RunState,
    source: ModelSource,
    ckpt: Checkpoint,
    config,
    tokenizer,
    cfg: AwqConfig,
    calib: CalibrationSet | None,
    command: str,
) -> None:
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    n_layers = config.num_hidden_layers
    arch = architecture_from_config(config, tokenizer.eos_token_id)
    dtype = DTYPES[cfg.dtype]

    def groups() -> Iterator[dict[str, torch.Tensor]]:
        yield _globals(ckpt, arch.tie_word_embeddings, dtype)
        for i in range(n_layers):
            yield load_file(str(state.layer_file(i)))

    where = write_shards(staging, groups())
    linear_shapes, padded = {}, {}
    for i in range(n_layers):
        for lin in (n for g in LAYER_GROUPS[arch.family] for n in g.linears):
            prefix = f"model.layers.{i}.{lin}"
            w_shape = ckpt.shape(prefix + ".weight")
            linear_shapes[prefix] = w_shape
            padded[prefix] = layout.padded_shape(*w_shape, cfg.spec.group_size)
    tokenizer.save_pretrained(staging)
    manifest = Manifest(
        producer=Producer(
            version=__version__,
            command=command,
            created=state.created,
            devices=state.devices,
            torch=torch.__version__,
            cuda=cuda_version(state.devices),
        ),
        source=SourceModel(id=source.id, revision=source.revision, files=source.files),
        architecture=arch,
        quantization=Quantization(
            method=cfg.method,
            bits=cfg.spec.bits,
            group_size=cfg.spec.group_size,
            symmetric=cfg.spec.symmetric,
            zero_point=not cfg.spec.symmetric,
            calib_dataset=calib.name if calib else None,
            calib_samples=calib.n_samples if calib else 0,
            calib_seqlen=calib.seqlen if calib else 0,
            calib_tokens_sha256=calib.sha256 if calib else None,
            seed=cfg.seed,
            n_grid=cfg.n_grid,
            duo_scaling=cfg.duo_scaling,
            clip_max_shrink=cfg.clip_max_shrink,
            search=cfg.search,
            rounding=cfg.rounding,
            fallbacks=state.fallbacks,
        ),
        layout=Layout(
            name=layout.LAYOUT_NAME,
            version=layout.LAYOUT_VERSION,
            tile=layout.TILE,
            n_align=layout.N_ALIGN,
        ),
        dtype=cfg.dtype,
        tensors=tensor_entries(staging, where, linear_shapes, padded),
        files=file_entries(staging),
        launch=cfg.launch,
        generation=generation_defaults(source.path, arch),
    )
    write_manifest(staging, manifest)
