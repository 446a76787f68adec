"""`lite auto_awq`: calibrate layer by layer, resumably, and publish an artifact atomically.

Only one decoder layer's weights (read lazily from the source shards) and the calibration
activations are resident at a time. After each layer, its packed tensors and the next layer's
inputs are saved under WORK_DIR.partial/; a rerun of the same command picks up there and
writes the same bytes. The artifact appears at WORK_DIR by a single rename at the end.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import resource
import shutil
import sys
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import torch
from safetensors.torch import load_file

from lite.awq import InputStats, search_clip, search_scale
from lite.data import CalibrationSet, build_calibration
from lite.families import LAYER_GROUPS, NO_CLIP, ScaleGroup
from lite.hf import architecture_from_config, generation_defaults, load_config
from lite.model_card import write_model_card
from lite.quantizer import QuantSpec, quantize
from lite.sources import Checkpoint, ModelSource, resolve
from runtime import __version__
from runtime.artifact import layout
from runtime.artifact.manifest import (
    LaunchConfig,
    Layout,
    Manifest,
    Producer,
    Quantization,
    SourceModel,
)
from runtime.artifact.writer import (
    file_entries,
    publish,
    save_tensors_atomic,
    tensor_entries,
    write_json_atomic,
    write_manifest,
    write_shards,
)

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
CHUNK_TOKENS = 4096  # tokens per forward chunk: bounds activation memory, keeps matmuls large


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
    dtype: str = "float16"
    launch: LaunchConfig = field(default_factory=LaunchConfig)

    @property
    def method(self) -> str:
        return "awq" if self.calib_samples > 0 else "rtn"


@dataclass
class RunState:
    """What survives a kill: the run's identity, its start time and the last finished layer."""

    dir: Path
    fingerprint: str
    created: str
    done: int = -1
    fallbacks: list[str] = field(default_factory=list)

    @classmethod
    def open(cls, partial: Path, fingerprint: str) -> RunState:
        state_file = partial / "state.json"
        if state_file.is_file():
            saved = json.loads(state_file.read_text())
            if saved["fingerprint"] != fingerprint:
                raise ValueError(
                    f"{partial} holds an unfinished run with other settings or another model; "
                    f"rerun the original command to resume it, or delete it (rm -r {partial}) "
                    f"to start over"
                )
            return cls(
                partial, **{k: saved[k] for k in ("fingerprint", "created", "done", "fallbacks")}
            )
        partial.mkdir(parents=True, exist_ok=True)
        (partial / "layers").mkdir(exist_ok=True)
        state = cls(partial, fingerprint, _now())
        state.save()
        return state

    def layer_file(self, i: int) -> Path:
        return self.dir / "layers" / f"{i:05d}.safetensors"

    def inputs_file(self, i: int) -> Path:
        """Inputs of layer i, named by layer so a kill at any point pairs them right."""
        return self.dir / f"inputs-{i:05d}.safetensors"

    def save(self) -> None:
        data = {k: v for k, v in dataclasses.asdict(self).items() if k != "dir"}
        write_json_atomic(data, self.dir / "state.json")

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
        if not path.is_file():
            raise ValueError(
                f"{self.dir} is damaged ({path.name} is missing); delete it (rm -r {self.dir}) "
                f"to start over"
            )
        return load_file(str(path))["x"]


def _now() -> str:
    """UTC now, or SOURCE_DATE_EPOCH when set: the reproducible-builds convention, so two
    separate runs can be compared byte for byte."""
    epoch = os.environ.get("SOURCE_DATE_EPOCH")
    when = datetime.fromtimestamp(int(epoch), timezone.utc) if epoch else datetime.now(timezone.utc)
    return when.strftime("%Y-%m-%dT%H:%M:%SZ")


def fingerprint(source: ModelSource, cfg: AwqConfig, calib: CalibrationSet | None) -> str:
    ident = {
        "source": source.files,
        "config": json.dumps(dataclasses.asdict(cfg), sort_keys=True, default=str),
        "calib": calib.sha256 if calib else None,
        "liteserve": __version__,
        "torch": torch.__version__,
    }
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()


def check_writable(work_dir: Path, overwrite: bool) -> None:
    """Fail before hours of calibration, not after."""
    if work_dir.exists() and not overwrite:
        raise FileExistsError(f"{work_dir} already exists; pass --overwrite to replace it")
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
    out = layer(h, attention_mask=None, position_embeddings=pos)
    return out[0] if isinstance(out, tuple) else out


@torch.inference_mode()
def run_layer(layer: torch.nn.Module, x: torch.Tensor, pos: tuple) -> torch.Tensor:
    chunk = max(1, CHUNK_TOKENS // x.shape[1])
    return torch.cat([_layer_call(layer, x[i : i + chunk], pos) for i in range(0, len(x), chunk)])


def capture(
    layer: torch.nn.Module, groups: tuple[ScaleGroup, ...], x: torch.Tensor, pos: tuple
) -> tuple[dict[ScaleGroup, InputStats], torch.Tensor]:
    """One forward with hooks: the input statistics each group's linears share, and the
    layer's full-precision outputs, which become the next layer's inputs (as in AutoAWQ;
    measured on SmolLM2 as good as feeding quantized outputs, and one forward cheaper)."""
    stats: dict[ScaleGroup, InputStats] = {}
    handles = []
    for group in groups:
        first = layer.get_submodule(group.linears[0])
        stats[group] = InputStats(first.in_features)
        handles.append(
            first.register_forward_pre_hook(lambda _m, args, s=stats[group]: s.add(args[0]))
        )
    try:
        outputs = run_layer(layer, x, pos)
    finally:
        for h in handles:
            h.remove()
    return stats, outputs


@dataclass
class LayerCalibration:
    clip: dict[str, torch.Tensor]  # linear name -> per (row, group) range shrink
    fallbacks: list[str]
    outputs: torch.Tensor


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


def calibrate_layer(
    layer: torch.nn.Module,
    groups: tuple[ScaleGroup, ...],
    x: torch.Tensor,
    pos: tuple,
    cfg: AwqConfig,
    name: str,
) -> LayerCalibration:
    """Scale search (folded into the layer in place), then clip search."""
    stats, outputs = capture(layer, groups, x, pos)
    fallbacks = []
    for group in groups:
        if not _can_scale(layer, group):
            continue
        w = torch.cat([layer.get_submodule(n).weight.data for n in group.linears])
        result = search_scale(w, stats[group], cfg.spec, cfg.n_grid, cfg.duo_scaling)
        if result.ratio is None and not torch.isfinite(torch.tensor(result.loss)):
            note = (
                f"{name} {group.prev}->{','.join(group.linears)}: non-finite search loss, "
                f"identity scale"
            )
            warnings.warn(note, AwqFallbackWarning, stacklevel=2)
            fallbacks.append(note)
            continue
        _apply_scale(layer, group, result.scales)
        stats[group].rescale(result.scales)
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
    return LayerCalibration(clip, fallbacks, outputs)


def pack_layer(
    layer: torch.nn.Module, cfg: AwqConfig, prefix: str, clip: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Every linear quantized and packed in the artifact layout; the rest in `cfg.dtype`."""
    dtype = DTYPES[cfg.dtype]
    gs = cfg.spec.group_size
    tensors: dict[str, torch.Tensor] = {}
    linears = {n: m for n, m in layer.named_modules() if isinstance(m, torch.nn.Linear)}
    for name, lin in linears.items():
        w = lin.weight.data
        k = w.shape[1]
        qw = quantize(w, cfg.spec, clip.get(name, 1.0))
        tensors[f"{prefix}{name}.qweight"] = layout.pack_qweight(qw.q, gs)
        tensors[f"{prefix}{name}.qparams"] = layout.pack_qparams(qw.scale, qw.zero, gs, k)
        if lin.bias is not None:
            tensors[f"{prefix}{name}.bias"] = lin.bias.data.to(dtype)
    for pname, p in layer.named_parameters():
        if pname.rsplit(".", 1)[0] not in linears:
            tensors[prefix + pname] = p.data.to(dtype)
    return tensors


def build_layers(config) -> tuple[torch.nn.ModuleList, torch.nn.Module]:
    """Decoder layer skeletons on the meta device (no memory) and the rotary embedding."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    rotary = type(skeleton.model.rotary_emb)(config=config)
    return skeleton.model.layers, rotary


def load_layer(layer: torch.nn.Module, ckpt: Checkpoint, prefix: str) -> None:
    layer.to_empty(device="cpu")
    state = ckpt.with_prefix(prefix)
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


def auto_awq(
    model: str,
    work_dir: str | Path,
    cfg: AwqConfig,
    command: str = "",
    overwrite: bool = False,
    progress: bool = True,
) -> Path:
    from transformers import AutoTokenizer

    started = time.perf_counter()
    work_dir = Path(work_dir)
    check_writable(work_dir, overwrite)
    source = resolve(model)
    config = load_config(source.path)
    tokenizer = AutoTokenizer.from_pretrained(source.path)
    calib = None
    if cfg.calib_samples > 0:
        calib = build_calibration(
            cfg.calib_dataset, tokenizer, cfg.calib_samples, cfg.calib_seqlen, cfg.seed
        )
    state = RunState.open(
        work_dir.with_name(work_dir.name + ".partial"), fingerprint(source, cfg, calib)
    )
    ckpt = Checkpoint(source.path)
    bar_label = f"{cfg.method} {Path(model).name}"
    quantize_layers(state, ckpt, config, calib, cfg, bar_label if progress else None)
    staging = state.dir / "artifact"
    _assemble(staging, state, source, ckpt, config, tokenizer, cfg, calib, command)
    publish(staging, work_dir, overwrite)
    shutil.rmtree(state.dir)
    print(
        f"wrote {work_dir} in {time.perf_counter() - started:.0f} s; "
        f"peak RSS {peak_rss_gib():.2f} GiB",
        file=sys.stderr,
    )
    return work_dir


def quantize_layers(
    state: RunState,
    ckpt: Checkpoint,
    config,
    calib: CalibrationSet | None,
    cfg: AwqConfig,
    bar_label: str | None,
) -> None:
    """Each layer not yet finished: load it, calibrate it (unless RTN), pack it, save it."""
    from tqdm import tqdm

    groups = LAYER_GROUPS[config.model_type]
    layers, rotary = build_layers(config)
    check_coverage(layers[0], groups, config.model_type)
    x = pos = None
    if calib is not None:
        if state.done >= 0:
            x = state.load_inputs()
        else:
            x = torch.nn.functional.embedding(calib.tokens, ckpt.get("model.embed_tokens.weight"))
        pos = rotary(x[:1], torch.arange(calib.seqlen)[None])
    n_layers = config.num_hidden_layers
    with tqdm(
        total=n_layers,
        initial=state.done + 1,
        desc=bar_label,
        unit="layer",
        disable=bar_label is None,
    ) as bar:
        for i in range(state.done + 1, n_layers):
            prefix = f"model.layers.{i}."
            layer = layers[i]
            load_layer(layer, ckpt, prefix)
            clip, fallbacks = {}, []
            if x is not None:
                result = calibrate_layer(layer, groups, x, pos, cfg, f"model.layers.{i}")
                clip, fallbacks, x = result.clip, result.fallbacks, result.outputs
            state.finish_layer(i, pack_layer(layer, cfg, prefix, clip), x, fallbacks)
            layers[i] = torch.nn.Identity()  # drop the layer's weights
            bar.update(1)


def _globals(ckpt: Checkpoint, tied: bool, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not tied:
        names.append("lm_head.weight")
    return {n: ckpt.get(n).to(dtype) for n in names}


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
        producer=Producer(version=__version__, command=command, created=state.created),
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
    write_model_card(staging, manifest)
