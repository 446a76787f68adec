"""The `lite` command: auto_awq, inspect, ppl, eval, lm-eval, tune, convert, export. Flag
names follow LMDeploy's where they mean the same thing, so commands from shell history keep
working."""

from __future__ import annotations

import importlib.metadata
import json
import math
import os
import re
import shlex
import signal
import sys
import warnings
from pathlib import Path

import click
from click.core import ParameterSource

from runtime.artifact.manifest import TUNED_BACKENDS
from runtime.cache import DISK_ERRORS, CacheUnwritable, disk_error, disk_fix
from runtime.termination import Group, terminated, unwind_on_sigterm


def _user_errors() -> tuple[type[Exception], ...]:
    """The errors shown as one line. Read only when one is raised: the reader imports torch,
    and at the top of this module it made every command, `--help` included, take 2 s before
    click could answer a Ctrl-C."""
    from runtime.artifact.reader import ArtifactError

    return (
        ValueError,
        ArtifactError,
        CacheUnwritable,
        FileExistsError,
        PermissionError,
        FileNotFoundError,
    )


def _fail(e: Exception) -> None:
    if terminated():  # the SystemExit of SIGTERM came back as this error from inside a library
        raise SystemExit(128 + signal.SIGTERM) from e
    raise click.ClickException(str(e)) from e


def _writable_dir(path: Path, option: str) -> None:
    """Created if missing, and writable: an option's directory checked before hours of work."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise click.BadParameter(f"{path}: {e.strerror or e}", param_hint=option) from e
    if not os.access(path, os.W_OK):
        raise click.BadParameter(f"{path}: not writable", param_hint=option)


def _interrupted(work_dir: Path, sig: int | None) -> None:
    """Ctrl-C or SIGTERM during a run: say what is kept, and exit as the signal does (130,
    143), so scripts tell it from an error (it ended with status 1; SIGTERM said nothing)."""
    partial = work_dir.with_name(work_dir.name + ".partial")
    kept = (
        f"the finished layers are kept in {partial}: rerun the same command to go on after "
        "the last of them"
        if (partial / "state.json").is_file()
        else "it had not started calibrating, so nothing is kept"
    )
    click.echo(f"Error: interrupted; {kept}", err=True)
    raise SystemExit(128 + (sig or signal.SIGTERM))


# shown before a dry run's one-layer run: minutes to hours on a CPU for a large layer
TIMING = (
    "timing one decoder layer (loaded, calibrated and packed once; Ctrl-C stops here, the plan "
    "above stands)..."
)


def _unwritable(e: Exception, target: Path, flag: str) -> click.ClickException | None:
    """A full, read-only or failing disk while writing `target`, as one line naming it, not
    the hidden staging directory a traceback named; None for any other error."""
    if (code := disk_error(e)) is None:
        return None
    why, fix = DISK_ERRORS[code], disk_fix(code, flag)
    return click.ClickException(
        f"cannot write {target}: {why}; nothing was left half-written: {fix} and rerun"
    )


_SHOW_WARNING = warnings.showwarning
PACKAGE_DIR = Path(__file__).resolve().parent


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """This package's warnings as one line, as its errors are: Python's form points at a line
    of this code, which tells a user nothing. Other libraries' keep Python's form."""
    if Path(filename).resolve().is_relative_to(PACKAGE_DIR):
        print(f"warning: {message}", file=file or sys.stderr)
    else:
        _SHOW_WARNING(message, category, filename, lineno, file, line)


def _extra_modules(extra: str) -> set[str]:
    """The import names of an extra's packages, from the installed metadata (pyproject.toml
    is the one list): `lm-eval[api]` is imported as `lm_eval`."""
    try:
        reqs = importlib.metadata.requires("liteserve") or []
    except importlib.metadata.PackageNotFoundError:  # run from a checkout never installed
        return set()
    names = [re.match(r"[A-Za-z0-9_.-]+", r) for r in reqs if f'extra == "{extra}"' in r]
    return {m.group(0).replace("-", "_").lower() for m in names if m}


class _Group(Group):
    """A serving host installs liteserve without the lite extra and still gets the `lite`
    command: its commands then name the extra instead of a traceback."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except ModuleNotFoundError as e:
            top = (e.name or "").split(".")[0]
            if top.lower() not in _extra_modules("lite"):
                raise
            raise click.ClickException(
                f"{top} is not installed: lite's commands need the lite extra, "
                "pip install 'liteserve[lite]'"
            ) from e


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="liteserve")
def main() -> None:
    """liteserve's offline side: quantize models into artifacts and measure them."""
    warnings.showwarning = _show_warning
    unwind_on_sigterm()


@main.command("auto_awq")
@click.argument("model")
@click.option(
    "--work-dir",
    type=click.Path(path_type=Path),
    help="Where the artifact appears (atomically, when finished); required unless --dry-run.",
)
@click.option(
    "--recipe",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="YAML recipe from recipes/; explicit flags override it.",
)
@click.option(
    "--calib-dataset",
    default="pydoc",
    show_default=True,
    help="pydoc (built-in, offline), a .txt/.jsonl/.parquet file, or pileval, "
    "wikitext2, c4, ptb (needs a network).",
)
@click.option(
    "--calib-samples",
    default=128,
    show_default=True,
    type=click.IntRange(min=0),
    help="Blocks of --calib-seqlen tokens; 0 gives round-to-nearest (no AWQ).",
)
@click.option("--calib-seqlen", default=512, show_default=True, type=click.IntRange(min=2))
@click.option("--w-bits", default=4, show_default=True, type=int)
@click.option(
    "--w-group-size",
    default=128,
    show_default=True,
    type=int,
    help="32, 64 or 128 input channels per scale.",
)
@click.option("--w-sym", is_flag=True, help="Symmetric int4 (no zero points).")
@click.option("--seed", default=42, show_default=True, help="Picks the calibration blocks.")
@click.option(
    "--search",
    type=click.Choice(["gram", "block"]),
    default="gram",
    show_default=True,
    help="AWQ's objective: gram scores each linear's own output error; block scores q/k/v "
    "scales and clip strengths on the attention and MLP outputs (about 1.8x the time).",
)
@click.option(
    "--rounding",
    type=click.Choice(["gptq", "nearest"]),
    help="How the scaled weights become codes: gptq (the default when calibrating: each "
    "column's error compensated on the later columns; on SmolLM2 0.64x the perplexity loss of "
    "nearest on text like the calibration set, 0.88-0.94x on other text) or nearest "
    "(AWQ's round-to-nearest; the default and only choice with --calib-samples 0).",
)
@click.option(
    "--dtype",
    type=click.Choice(["auto", "float16", "bfloat16"]),
    default="auto",
    show_default=True,
    help="Storage dtype of the unquantized tensors; auto: the source's own 16-bit dtype "
    "(float16 for a 32-bit source).",
)
@click.option(
    "--device",
    default="auto",
    show_default=True,
    help="Where calibration computes: auto (the current GPU if there is one, else cpu), cpu, "
    "cuda or cuda:N.",
)
@click.option(
    "--calib-batch-size",
    type=click.IntRange(min=1),
    help="Calibration samples per activation chunk on the device; default: 4096 tokens' worth, "
    "fewer if free GPU memory is short. Lower it after an out-of-memory error and rerun.",
)
@click.option(
    "--dry-run",
    is_flag=True,
    help="Plan only: per-layer memory, artifact size, and (weights present) the time of one "
    "layer; nothing is written.",
)
@click.option("--overwrite", is_flag=True, help="Replace an existing artifact at --work-dir.")
@click.option(
    "--tune", "tune_after", is_flag=True, help="Then pin GEMM configs for this GPU (lite tune)."
)
@click.option("--quiet", is_flag=True, help="No progress bar.")
@click.pass_context
def auto_awq_cmd(
    ctx: click.Context,
    model: str,
    work_dir: Path | None,
    recipe: Path | None,
    overwrite: bool,
    tune_after: bool,
    quiet: bool,
    device: str,
    calib_batch_size: int | None,
    dry_run: bool,
    **flags,
) -> None:
    """Quantize MODEL (HF directory, hub id, .gguf file, or smollm2-135m-instruct) with AWQ.

    Interrupted runs resume: rerun the same command and calibration continues after the last
    finished layer (state in WORK_DIR.partial/), also with another --device or
    --calib-batch-size (after running out of GPU memory, for instance).
    """
    if quiet:  # every bar, transformers' GGUF conversion too: it calls tqdm directly, and
        # tqdm reads TQDM_DISABLE when first imported, which is below
        os.environ["TQDM_DISABLE"] = "1"
    from lite.auto_awq import SEARCHES, AwqConfig, Compute, auto_awq, dry_run_plan
    from lite.plan import render, render_measured
    from lite.quantizer import QuantSpec
    from lite.recipe import Recipe, load_recipe
    from lite.tune import check_device, tune

    if work_dir is None and not dry_run:
        raise click.UsageError("Missing option '--work-dir'.")
    try:
        if tune_after and not dry_run:
            check_device()  # before hours of calibration, not after
        rec = load_recipe(recipe) if recipe else Recipe()
        if rec.model and Path(rec.model).name.lower() != Path(model.rstrip("/")).name.lower():
            click.echo(
                f"warning: {recipe} was written for {rec.model}; quantizing {model} with its "
                "settings",
                err=True,
            )
        for name, value in rec.flags().items():
            if ctx.get_parameter_source(name) != ParameterSource.COMMANDLINE:
                flags[name] = value
            elif flags[name] != value:  # explicit flags win; say so, the recipe said otherwise
                flag = "--" + name.replace("_", "-")
                click.echo(f"note: {flag} {flags[name]} overrides {recipe}'s {value}", err=True)
        cfg = AwqConfig(
            spec=QuantSpec(flags["w_bits"], flags["w_group_size"], flags["w_sym"]),
            calib_dataset=flags["calib_dataset"],
            calib_samples=flags["calib_samples"],
            calib_seqlen=flags["calib_seqlen"],
            seed=flags["seed"],
            dtype=flags["dtype"],
            launch=rec.launch,
            block_objective=SEARCHES[flags["search"]][0],
            block_clip=SEARCHES[flags["search"]][1],
            rounding=flags["rounding"],
        )
        compute = Compute(device, calib_batch_size)
        if dry_run:
            plan, timed = dry_run_plan(model, cfg, compute)
            click.echo(render(plan))
            if timed is not None:
                click.echo(TIMING, err=True)
                click.echo("\n".join(render_measured(timed())))
            return
        command = shlex.join(["lite", *sys.argv[1:]])
        try:
            auto_awq(model, work_dir, cfg, command, overwrite, not quiet, compute)
        except (KeyboardInterrupt, SystemExit) as e:
            if isinstance(e, SystemExit) and not terminated():
                raise
            _interrupted(work_dir, signal.SIGINT if isinstance(e, KeyboardInterrupt) else None)
        if tune_after:
            tune(work_dir, progress=click.echo)
    except _user_errors() as e:
        _fail(e)
    except Exception as e:
        if (code := disk_error(e)) is None:
            raise
        raise click.ClickException(
            f"{DISK_ERRORS[code]} while writing {work_dir} ({e}); the previous artifact, if "
            "any, is unchanged and finished layers are kept in the .partial directory: "
            f"{disk_fix(code, '--work-dir')} and rerun"
        ) from e


@main.command("convert")
@click.argument("src")
@click.option(
    "--work-dir",
    required=True,
    type=click.Path(path_type=Path),
    help="Where the artifact appears (atomically, when finished).",
)
@click.option("--overwrite", is_flag=True, help="Replace an existing artifact at --work-dir.")
def convert_cmd(src: str, work_dir: Path, overwrite: bool) -> None:
    """Turn an AutoAWQ (GEMM), GPTQ or compressed-tensors (pack-quantized) int4 checkpoint
    SRC (a directory or a hub id) into an artifact, without recalibrating."""
    from lite.sources import ALIASES, resolve
    from runtime.artifact.convert import convert

    folder = Path(src)  # a directory whose one model is a GGUF resolves as that GGUF
    lone_gguf = (
        folder.is_dir() and not (folder / "config.json").exists() and any(folder.glob("*.gguf"))
    )
    if src.lower() in ALIASES or src.lower().endswith(".gguf") or lone_gguf:  # dequantized
        # first, then refused as a dense checkpoint named by its cache path
        raise click.ClickException(
            f"{src} is a GGUF model, not one of the int4 checkpoints lite convert reads "
            f"(AutoAWQ GEMM, GPTQ, compressed-tensors): quantize it with lite auto_awq {src} "
            "--work-dir DIR"
        )
    if not Path(src).is_dir() and (src.startswith((".", "/", "~")) or src.count("/") != 1):
        raise click.ClickException(
            f"{src} is neither a directory nor a hub id (org/name): give a quantized "
            "checkpoint's directory or hub id"
        )
    try:
        source = resolve(src, hash_files=False)  # convert hashes them while it works
        command = shlex.join(["lite", *sys.argv[1:]])
        convert(source.path, work_dir, src, command, overwrite, revision=source.revision)
    except _user_errors() as e:
        _fail(e)
    except Exception as e:
        failure = _unwritable(e, work_dir, "--work-dir")
        if failure is None:
            raise
        raise failure from e
    click.echo(f"wrote {work_dir}")


@main.command("export")
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option(
    "--format", "fmt", type=click.Choice(["compressed-tensors", "autoawq"]), required=True
)
@click.option("--output", required=True, type=click.Path(path_type=Path))
@click.option("--overwrite", is_flag=True, help="Replace an existing directory at --output.")
def export_cmd(artifact: Path, fmt: str, output: Path, overwrite: bool) -> None:
    """Write ARTIFACT as a Hugging Face directory that vLLM and transformers load."""
    from lite.export import export

    try:
        export(artifact, fmt, output, overwrite)
    except _user_errors() as e:
        _fail(e)
    except Exception as e:
        failure = _unwritable(e, output, "--output")
        if failure is None:
            raise
        raise failure from e
    click.echo(f"wrote {output} ({fmt})")


@main.command("tune")
@click.argument("artifact", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--buckets", help="Row buckets to tune, comma-separated (default: all, 1..512).")
@click.option("--max-configs", type=click.IntRange(min=1), help="Time at most N configs each.")
@click.option(
    "--dtype",
    type=click.Choice(["bfloat16", "float16"]),
    default="bfloat16",
    show_default=True,
    help="Activation dtype the server will run.",
)
@click.option(
    "--backend",
    type=click.Choice(TUNED_BACKENDS),
    default="auto",
    show_default=True,
    help="GPU backend to tune (auto: cuda when its library loads, else triton).",
)
def tune_cmd(
    artifact: Path, buckets: str | None, max_configs: int | None, dtype: str, backend: str
) -> None:
    """Pin the W4A16 GEMM's launches for this GPU into ARTIFACT's manifest.

    Times the backend's candidates (triton: its config space; cuda: tile configs, split-K and
    the dequantized path, as its planner ranks them) for each GEMM shape of the model at M in
    1, 2, 4, ..., 512+ and writes the winners under the GPU's architecture (sm_90, or
    cuda/sm_90); the server then starts without autotuning. Only manifest.json changes.
    """
    import torch

    from lite.tune import tune

    try:
        chosen = tuple(_bucket(b) for b in _csv(buckets)) or None
        winners = tune(
            artifact, chosen, max_configs, getattr(torch, dtype), progress=click.echo,
            backend=backend,
        )  # fmt: skip
    except _user_errors() as e:
        _fail(e)
    click.echo(f"pinned {len(winners)} GEMM configs in {artifact / 'manifest.json'}")


@main.command("inspect")
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--verify", is_flag=True, help="Check every file's sha256 against the manifest.")
@click.option("--json", "as_json", is_flag=True, help="Print the facts as JSON.")
def inspect_cmd(artifact: Path, verify: bool, as_json: bool) -> None:
    """Describe an artifact; non-zero exit if it is not a valid one."""
    from lite.describe import describe, render

    try:
        facts = describe(artifact, checksums=verify)
    except _user_errors() as e:
        _fail(e)
    click.echo(json.dumps(facts, indent=2) if as_json else render(facts))


def _csv(value: str | None) -> tuple[str, ...]:
    return tuple(v.strip() for v in (value or "").split(",") if v.strip())


def _limit(value: str | None, ppl: bool) -> float | None:
    """lm-eval's --limit: a count of documents per task, or a fraction below 1; with --ppl a
    count of windows."""
    if value is None:
        return None
    try:
        limit = float(value)
    except ValueError:
        limit = math.nan
    if not math.isfinite(limit) or limit <= 0 or (ppl and limit != int(limit)):
        want = "a whole number of windows" if ppl else "a number of documents or a fraction < 1"
        raise click.BadParameter(f"{value!r}: give {want}, above 0", param_hint="--limit")
    return int(limit) if limit >= 1 else limit


def _eval_options(f):
    options = [
        click.option("--model", "model", help="Source model (as for auto_awq): the baseline."),
        click.option(
            "--artifact",
            "artifacts",
            multiple=True,
            type=click.Path(exists=True, file_okay=False, path_type=Path),
            help="Artifact to compare, served by the runtime engine; repeatable.",
        ),
        click.option(
            "--kv-quant",
            default="none",
            show_default=True,
            help="KV policies to run each artifact under, comma-separated: none,int8,int4.",
        ),
        click.option(
            "--dtype",
            type=click.Choice(["auto", "float32", "bfloat16", "float16"]),
            default="auto",
            show_default=True,
            help="Activations of every model; auto = float32 on a CPU, bfloat16 on a GPU.",
        ),
        click.option("--batch-size", default=16, show_default=True, type=click.IntRange(min=1)),
        click.option(
            "--output",
            type=click.Path(file_okay=False, path_type=Path),
            help="Where results.json, report.md and deltas.png go; default reports/<time>.",
        ),
        click.option(
            "--update-card",
            is_flag=True,
            help="Write the comparison into each artifact's README.md (Evaluation section).",
        ),
        click.option("--quiet", is_flag=True, help="No progress bars of liteserve's own."),
    ]
    for option in reversed(options):
        f = option(f)
    return f


@main.command("eval")
@_eval_options
@click.option("--tasks", help="lm-eval tasks, comma-separated (piqa_local,arc_easy_local).")
@click.option(
    "--include-path",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="Folder of extra lm-eval task YAMLs (evals/tasks for the local-file tasks).",
)
@click.option(
    "--data-dir",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="Data folder of the local tasks (else $LITESERVE_EVAL_DATA).",
)
@click.option("--limit", help="Documents per task (or a fraction < 1); windows with --ppl.")
@click.option("--num-fewshot", type=click.IntRange(min=0), help="Few-shot examples per task.")
@click.option(
    "--max-length",
    type=click.IntRange(min=16),
    help="Context of every model (lm-eval's max_length): long inputs are cut on the left. "
    "Default 2048, or less where an artifact's positions hold less.",
)
@click.option("--seed", default=1234, show_default=True, type=int)
@click.option("--ppl", is_flag=True, help="Perplexity, KL and top-1 agreement instead of tasks.")
@click.option(
    "--text-file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="--ppl text (UTF-8); default: the held-out part of the pydoc set.",
)
@click.option("--seqlen", default=512, show_default=True, type=click.IntRange(min=2))
def eval_cmd(**kw) -> None:
    """Task quality of a source model and its artifacts, each under each KV policy.

    Tasks run through lm-eval: the source with lm-eval's hf model, every artifact with the
    liteserve model (the runtime engine, in-process). --ppl instead scores a text: perplexity
    over non-overlapping --seqlen windows, KL(source || variant) in nats per token and top-1
    agreement with the source. One table is printed; results.json, report.md and deltas.png
    are written to --output.
    """
    _run_eval(**kw)


@main.command("ppl")
@_eval_options
@click.option(
    "--text-file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="UTF-8 text to score; default: the held-out part of the pydoc set.",
)
@click.option("--seqlen", default=512, show_default=True, type=click.IntRange(min=2))
@click.option("--limit", help="Score at most this many windows.")
def ppl_cmd(**kw) -> None:
    """Alias of `lite eval --ppl`: perplexity, KL and top-1 agreement on the same windows.

    Protocol: the text is tokenized once without special tokens and cut into non-overlapping
    windows of --seqlen tokens (default 512); each window is scored on its own and
    ppl = exp(mean next-token NLL).
    """
    _run_eval(ppl=True, **kw)


# what each mode reads: an option of the other mode would be ignored in silence
TASK_OPTIONS = ("tasks", "include_path", "data_dir", "num_fewshot", "max_length", "seed")
PPL_OPTIONS = ("text_file", "seqlen")
ARTIFACT_OPTIONS = ("kv_quant", "update_card")


def _refuse_inapplicable(ppl: bool, artifacts: bool) -> None:
    """Options given that this run would not read: refused, never dropped."""
    ctx = click.get_current_context()
    given = {
        name
        for name in ctx.params
        if ctx.get_parameter_source(name) != click.core.ParameterSource.DEFAULT
    }
    unread = {
        "--ppl scores a text, not tasks": TASK_OPTIONS if ppl else (),
        "tasks do not read the --ppl text options": () if ppl else PPL_OPTIONS,
        "no --artifact is given": () if artifacts else ARTIFACT_OPTIONS,
    }
    for why, names in unread.items():
        dropped = [f"--{n.replace('_', '-')}" for n in names if n in given]
        if dropped:
            raise click.UsageError(f"{why}: drop {', '.join(dropped)}")


def _run_eval(
    model: str | None,
    artifacts: tuple[Path, ...],
    kv_quant: str,
    dtype: str,
    batch_size: int,
    output: Path | None,
    update_card: bool,
    ppl: bool = False,
    text_file: Path | None = None,
    seqlen: int = 512,
    limit: str | None = None,
    tasks: str | None = None,
    include_path: Path | None = None,
    data_dir: Path | None = None,
    num_fewshot: int | None = None,
    max_length: int | None = None,
    seed: int = 1234,
    quiet: bool = False,
) -> None:
    from rich.console import Console

    from lite.evaluate import EvalPlan, ppl_report, task_report
    from lite.report import render_terminal, write_report
    from lite.report import update_card as write_card

    if not model and not artifacts:
        raise click.UsageError("give --model, --artifact, or both")
    kvs = _csv(kv_quant)
    bad = [k for k in kvs if k not in ("none", "int8", "int4")]
    if bad or not kvs:
        raise click.BadParameter(f"{kv_quant!r}: use none, int8, int4", param_hint="--kv-quant")
    _refuse_inapplicable(ppl, bool(artifacts))
    command = shlex.join(["lite", *sys.argv[1:]])
    if output is not None:  # found now, not after the whole evaluation
        _writable_dir(output, "--output")
    try:
        plan = EvalPlan(
            model=model,
            artifacts=artifacts,
            kv_quants=kvs,
            tasks=_csv(tasks),
            include_path=include_path,
            data_dir=data_dir,
            limit=_limit(limit, ppl),
            num_fewshot=num_fewshot,
            batch_size=batch_size,
            max_length=max_length,
            dtype=dtype,
            seed=seed,
        )
        if ppl:
            windows = None if plan.limit is None else int(plan.limit)
            report = ppl_report(plan, command, text_file, seqlen, windows, progress=not quiet)
        else:
            report = task_report(plan, command, progress=not quiet)
    except _user_errors() as e:
        _fail(e)
    out = output or Path("reports") / report["created"].replace(":", "")
    Console().print(render_terminal(report))  # first: a failed write loses no result
    try:
        files = write_report(report, out)
    except OSError as e:
        _fail(OSError(f"writing the report to {out}: {e}; the results are above"))
    click.echo(f"wrote {', '.join(str(p) for p in files.values())}")
    if update_card:
        for art in artifacts:
            write_card(art, report)
            click.echo(f"updated {art / 'README.md'}")


@main.command(
    "lm-eval",
    context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
    add_help_option=False,
)
@click.pass_context
def lm_eval_cmd(ctx: click.Context) -> None:
    """lm-eval's own command line with the `liteserve` model registered.

    lm-eval 0.4 has no plugin mechanism, so the stock `lm_eval` command cannot see a model
    defined outside lm-eval; this runs it with `liteserve` registered, e.g.
    `lite lm-eval run --model liteserve --model_args artifact=out/awq,kv_quant=int8 --tasks
    piqa_local --include_path evals/tasks --metadata '{"data_dir": "../shared/data"}'`.
    """
    import lm_eval.__main__

    import lite.lm_eval_model  # noqa: F401  (registers the model)

    sys.argv = ["lm_eval", *ctx.args]
    lm_eval.__main__.cli_evaluate()


def _bucket(text: str) -> int:
    if not text.strip().isdigit():
        raise ValueError(f"--buckets {text!r}: row buckets are positive integers, e.g. 1,16,256")
    return int(text)
