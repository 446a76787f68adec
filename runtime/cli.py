"""The `runtime` command on a serving host (no `lite` needed): serve, check, generate, chat,
plan, verify and build-kernels."""

from __future__ import annotations

import contextlib
import logging
import re
import signal
import sys
import time
from collections import Counter
from pathlib import Path

import click

from runtime.artifact.manifest import BACKENDS, MIN_PREFILL_TOKENS
from runtime.cache import CacheUnwritable
from runtime.server.cluster import replica_options, served_name
from runtime.server.listen import listen_socket
from runtime.termination import Group, unwind_on_sigterm

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_bytes(text: str) -> int:
    # one decimal point at most, and a digit ("1.2.3GiB" and "." failed in float())
    m = re.fullmatch(r"\s*([0-9]+\.?[0-9]*|\.[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise click.BadParameter(f"{text!r} is not a size; write e.g. 24GiB, 512MB or 1000000")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _engine_options(f):
    for opt in reversed(
        [
            click.option(
                "--kv-quant",
                type=click.Choice(["none", "int8", "int4"]),
                help="KV cache policy (default: the artifact's launch config).",
            ),
            click.option("--session-len", type=int, help="Max prompt + output tokens."),
            click.option(
                "--cache-block-seq-len",
                type=int,
                help="KV block size in tokens (default: the artifact's launch config).",
            ),
            click.option(
                "--num-blocks",
                type=int,
                help="KV pool size in blocks (default: sized "
                "from --cache-max-entry-count of free memory).",
            ),
            click.option("--cache-max-entry-count", type=float, default=0.8, show_default=True),
            click.option("--enable-prefix-caching", is_flag=True),
            click.option(
                "--backend",
                type=click.Choice(BACKENDS),
                help="Kernels (default: the artifact's launch config; auto, given here, overrides "
                "a backend it pins: on a CUDA GPU the csrc kernels where their library runs, "
                "else triton; cpu without a GPU).",
            ),
            click.option(
                "--dtype",
                type=click.Choice(["auto", "float32", "bfloat16", "float16"]),
                help="Activations (default auto: the backend's fastest).",
            ),
            click.option(
                "--device",
                default="auto",
                show_default=True,
                metavar="auto|cpu|cuda|cuda:N",
                help="Where the engine runs; auto = the backend's (the current GPU for cuda and "
                "triton).",
            ),
            click.option(
                "--enforce-eager",
                is_flag=True,
                help="No CUDA graphs: every decode step runs eagerly (for debugging and "
                "profiling, or to save the graphs' memory; no effect on a CPU).",
            ),
            click.option(
                "--overlap-schedule/--no-overlap-schedule",
                default=None,
                help="Queue each step before reading the previous one's token ids, so the "
                "host's scheduling and detokenizing overlap the device's work (default: on a "
                "GPU, not under --tp).",
            ),
            click.option(
                "--tp",
                type=click.IntRange(min=1),
                default=1,
                show_default=True,
                help="Tensor-parallel ranks: one process each (one GPU each, or sharing the "
                "CPU), every rank holding its slice of the weights and of the KV heads.",
            ),
            click.option(
                "--tp-timeout",
                type=float,
                default=60.0,
                show_default=True,
                help="Seconds a rank waits in a collective before the engine fails (a rank "
                "that died is seen at once; this catches one that is stuck).",
            ),
            click.option(
                "--chat-template",
                type=click.Path(exists=True, dir_okay=False, path_type=Path),
                help="Override the artifact's chat template.",
            ),
        ]
    ):
        f = opt(f)
    return f


def _served(path: Path) -> Path:
    """An artifact is itself; a quantized Hugging Face checkpoint (AutoAWQ, GPTQ,
    compressed-tensors) is converted once into the cache, and that conversion is served."""
    from runtime.artifact.convert import served_artifact

    try:
        return served_artifact(path)
    except (ValueError, CacheUnwritable) as e:
        raise click.ClickException(str(e)) from e


def _pipeline(artifact: Path, kw: dict):
    from runtime import EngineConfig, pipeline
    from runtime.artifact.reader import ArtifactError
    from runtime.distributed.group import RankFailure

    template = kw.pop("chat_template")
    try:
        config = EngineConfig(**{k: v for k, v in kw.items() if v is not None})
        pipe = pipeline(_served(artifact), config, template)
    except (ArtifactError, ValueError, RankFailure) as e:  # a rank that died while loading
        raise click.ClickException(str(e)) from e
    # the command's end stops tensor-parallel ranks (and leaves the process group), also when
    # the command runs inside another program, as under click's CliRunner
    click.get_current_context().call_on_close(pipe.close)
    return pipe


@click.group(cls=Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="liteserve")
@click.option("-v", "--verbose", is_flag=True, help="Log the engine's start-up facts.")
def main(verbose: bool) -> None:
    """liteserve's serving side."""
    unwind_on_sigterm()  # serve replaces it with its own graceful stop
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(message)s"
    )


@main.command("verify")
@click.argument("artifact", type=click.Path(path_type=Path))
def verify_cmd(artifact: Path) -> None:
    """Check an artifact's manifest, file sizes and every checksum."""
    from runtime.artifact.reader import Artifact, ArtifactError

    try:
        art = Artifact(_served(artifact), checksums=True)
    except ArtifactError as e:
        raise click.ClickException(str(e)) from e
    m = art.manifest
    click.echo(
        f"ok: {artifact} ({m.source.id}, {m.quantization.method} int"
        f"{m.quantization.bits}, {len(m.files)} files verified)"
    )


_AGE_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_age(text: str) -> float:
    """'30d', '12h', '90m', '45s' or '0' to seconds."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([smhd]?)\s*", text)
    if not m or (not m.group(2) and float(m.group(1)) != 0):
        raise click.BadParameter(f"{text!r} is not an age; write e.g. 30d, 12h or 0 (all)")
    return float(m.group(1)) * _AGE_UNITS[m.group(2) or "s"]


@main.group("cache")
def cache_group() -> None:
    """The liteserve cache (LITESERVE_CACHE): conversions and kernels, by last use."""


@cache_group.command("list")
def cache_list_cmd() -> None:
    """Every entry with its size and last use, oldest first."""
    from runtime.cache import cache_root, list_entries

    entries = list_entries()
    for e in entries:
        click.echo(f"{_ago(e.used):>9}  {_mib(e.size):>10}  {e.kind}/{e.path.name}")
    total = sum(e.size for e in entries)
    click.echo(f"{len(entries)} entries, {_mib(total)} in {cache_root()}")


@cache_group.command("prune")
@click.option(
    "--unused-for",
    default="30d",
    show_default=True,
    help="Remove the entries not used for this long (30d, 12h, 0 = all).",
    callback=lambda _ctx, _param, value: parse_age(value),  # an error names the option
)
@click.option("--dry-run", is_flag=True, help="Say what would go, remove nothing.")
def cache_prune_cmd(unused_for: float, dry_run: bool) -> None:
    """Remove entries not used lately (a new liteserve or torch leaves the old ones unused);
    whatever needs one again rebuilds it. An entry being written stays."""
    from runtime.cache import list_entries, prune, unused

    age = unused_for
    entries = list_entries()
    gone, busy = (unused(entries, age), []) if dry_run else prune(entries, age)
    verb = "would remove" if dry_run else "removed"
    for e in gone:
        click.echo(f"{verb} {e.kind}/{e.path.name} ({_mib(e.size)}, used {_ago(e.used)})")
    for e in busy:
        click.echo(f"kept {e.kind}/{e.path.name}: another process is writing it")
    click.echo(f"{verb} {len(gone)} of {len(entries)} entries, {_mib(sum(e.size for e in gone))}")


def _mib(size: int) -> str:
    return f"{size / 2**20:.1f} MiB"


def _ago(when: float) -> str:
    s = max(time.time() - when, 0)
    for unit, span in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= span:
            return f"{s / span:.0f}{unit} ago"
    return f"{s:.0f}s ago"


def _archs(ctx: click.Context, param: click.Parameter, value: str | None) -> tuple[str, ...]:
    from runtime.kernels.cuda import library

    if value is None:
        return library.ARCHS
    archs = tuple(dict.fromkeys(a.strip().removeprefix("sm_") for a in value.split(",")))
    if not archs or not set(archs) <= set(library.ARCHS):
        raise click.BadParameter(
            f"{value!r}: choose from {','.join(library.ARCHS)} (comma-separated)", ctx, param
        )
    return tuple(a for a in library.ARCHS if a in archs)


@main.command("build-kernels")
@click.option(
    "--arch",
    "archs",
    callback=_archs,
    help="Only these GPU architectures, e.g. 90 (default: all). A machine uses the library "
    "built for all of them or for exactly its GPUs' ones; one architecture's is a fraction of "
    "the size, to copy to a GPU machine without nvcc.",
)
def build_kernels_cmd(archs: tuple[str, ...]) -> None:
    """Build the csrc CUDA library now (otherwise the cuda backend builds it on first use)."""
    from runtime.kernels.build_cache import BuildUnavailable
    from runtime.kernels.cuda import library

    start = time.perf_counter()
    try:
        path = library.build(archs)
    except BuildUnavailable as e:
        raise click.ClickException(str(e)) from e
    size = path.stat().st_size / 2**20
    names = ", ".join(f"sm_{a}" for a in archs)
    click.echo(f"{path} ({names}; {size:.1f} MiB; {time.perf_counter() - start:.1f} s)")


@main.command("generate")
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--prompt", required=True)
@click.option("--raw", is_flag=True, help="Send the prompt as plain text, not as a chat turn.")
@click.option("--max-new-tokens", default=256, show_default=True)
@click.option("--temperature", type=float, help="0 = greedy (default: the artifact's).")
@click.option("--top-p", type=float)
@click.option("--top-k", type=int)
@click.option("--seed", type=int)
@_engine_options
def generate_cmd(
    artifact: Path,
    prompt: str,
    raw: bool,
    max_new_tokens: int,
    temperature: float | None,
    top_p: float | None,
    top_k: int | None,
    seed: int | None,
    **kw,
) -> None:
    """Generate one completion, streamed to stdout."""
    from runtime import GenerationConfig
    from runtime.distributed.group import RankFailure

    pipe = _pipeline(artifact, kw)
    gen = GenerationConfig(
        max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed
    )
    request = prompt if raw or pipe.chat_template is None else [{"role": "user", "content": prompt}]
    try:
        for chunk in pipe.stream(request, gen):
            click.echo(chunk.text, nl=False)
    except (ValueError, RankFailure) as e:
        raise click.ClickException(str(e)) from e
    click.echo()


@main.command("chat")
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--max-new-tokens", default=512, show_default=True)
@click.option("--temperature", type=float)
@click.option("--system", help="A system prompt.")
@_engine_options
def chat_cmd(
    artifact: Path, max_new_tokens: int, temperature: float | None, system: str | None, **kw
) -> None:
    """Interactive chat with streaming, through the artifact's chat template. Ctrl-C stops a
    reply, Ctrl-D exits."""
    from runtime import GenerationConfig
    from runtime.api import NOT_UTF8_FIX
    from runtime.distributed.group import RankFailure
    from runtime.text import check_text

    pipe = _pipeline(artifact, kw)
    if pipe.chat_template is None:
        raise click.ClickException(f"{artifact} has no chat template; use --chat-template FILE")
    gen = GenerationConfig(max_new_tokens=max_new_tokens, temperature=temperature)
    session_len = pipe.engine.config.session_len
    try:  # refused now, not on every turn of a session that exits 0
        pipe.sampling_params(gen).validate()
        check_text(system or "", "--system", NOT_UTF8_FIX)
    except ValueError as e:
        raise click.ClickException(str(e)) from e
    if max_new_tokens >= session_len:
        raise click.ClickException(
            f"--max-new-tokens {max_new_tokens} leaves no room for a message in session_len "
            f"{session_len}; lower it (or raise --session-len)"
        )
    history = [{"role": "system", "content": system}] if system else []
    if hasattr(sys.stdin, "reconfigure"):  # a line that is not UTF-8 is refused, not fatal
        sys.stdin.reconfigure(errors="surrogateescape")
    # fed from a pipe, stdout holds the replies alone (the prompts go to stderr), one a line
    prompts_to_stderr = not sys.stdin.isatty()
    while True:
        try:
            click.echo("you> ", nl=False, err=prompts_to_stderr)
            line = input()
        except EOFError:
            click.echo(err=prompts_to_stderr)  # ends the prompt's line, where the prompt went
            return
        if not line.strip():
            continue
        try:
            check_text(line, "this line", NOT_UTF8_FIX)
        except ValueError as e:  # the session goes on without it
            click.echo(f"error: {e}", err=True)
            continue
        history.append({"role": "user", "content": line})
        dropped = _fit_history(pipe, history, max_new_tokens)
        if dropped:
            click.echo(f"(the {dropped} oldest messages left the context: session_len)", err=True)
        reply = []
        click.echo("model> ", nl=False, err=prompts_to_stderr)
        try:
            for chunk in pipe.stream(history, gen):
                reply.append(chunk.text)
                click.echo(chunk.text, nl=False)
        except ValueError as e:  # e.g. the conversation outgrew session_len
            click.echo(f"\nerror: {e}", err=True)
            history.pop()
            continue
        except RankFailure as e:  # a tensor-parallel rank died: no turn can run any more
            raise click.ClickException(str(e)) from e
        except KeyboardInterrupt:  # stops the reply, as in other chat tools, not the session
            if pipe.engine.workers is not None:  # the ranks were left mid-step
                raise
            click.echo("\n(stopped)", err=True)
        click.echo()
        history.append({"role": "assistant", "content": "".join(reply)})
        sys.stdout.flush()


def _fit_history(pipe, history: list[dict], max_new_tokens: int) -> int:
    """Drop the oldest exchanges (a user turn and its reply; the system message stays) until
    the conversation and a full reply fit the session, and say how many messages went: a
    chat that outgrew session_len refused every later turn, with no way on but a restart."""
    limit = pipe.engine.config.session_len
    first = 1 if history[0]["role"] == "system" else 0
    dropped = 0
    while len(history) - first > 1 and len(pipe.encode(history)) + max_new_tokens > limit:
        del history[first : first + 2]
        dropped += 2
    return dropped


@main.command("plan")
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option(
    "--memory",
    required=True,
    help="Memory for the server, e.g. 24GiB.",
    callback=lambda _ctx, _param, value: parse_bytes(value),  # an error names the option
)
@click.option(
    "--avg-len",
    type=int,
    help="Average tokens per sequence (default: 4000, or the model's max_position_embeddings "
    "if fewer).",
)
@click.option(
    "--cache-block-seq-len",
    type=int,
    help="Tokens per KV block (default: the artifact's launch config, as the engine's).",
)
@click.option(
    "--tp",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Tensor-parallel ranks: --memory is then each rank's (each GPU's).",
)
def plan_cmd(
    artifact: Path, memory: int, avg_len: int | None, cache_block_seq_len: int | None, tp: int
) -> None:
    """How many tokens and sequences fit, for each KV policy, side by side."""
    from runtime.artifact.reader import Artifact, ArtifactError
    from runtime.plan import default_avg_len, plan, render

    try:  # whatever serve takes: a quantized checkpoint is planned as its conversion
        art = Artifact(_served(artifact), checksums=False)
        avg_len = default_avg_len(art) if avg_len is None else avg_len
        block = cache_block_seq_len or art.manifest.launch.cache_block_seq_len
        rows = plan(art, memory, avg_len, block, tp)
    except (ArtifactError, ValueError) as e:
        raise click.ClickException(str(e)) from e
    click.echo(render(rows, art, memory, avg_len, tp))


@main.command("serve")
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option(
    "--server-name",
    default="127.0.0.1",
    show_default=True,
    help="Address to bind; 0.0.0.0 exposes the server to the network.",
)
@click.option("--server-port", default=23333, show_default=True)
@click.option(
    "--api-keys",
    envvar="LITESERVE_API_KEYS",  # a command line is readable by every local user (ps)
    help="Comma-separated keys; clients send 'Authorization: Bearer KEY'. Default: no auth. "
    "Also from $LITESERVE_API_KEYS, which other local users cannot read in `ps`.",
)
@click.option(
    "--model-name", help="The id clients pass as `model` (default: the artifact's directory name)."
)
@click.option(
    "--max-batch-size", type=int, help="Sequences per step (default: the artifact's launch config)."
)
@click.option(
    "--max-prefill-token-num",
    type=int,
    help=f"Tokens per step, chunked prefill beyond; at least {MIN_PREFILL_TOKENS} (default: the "
    "artifact's launch config; at most 512 on the CPU backend).",
)
@click.option(
    "--max-concurrent-requests",
    default=256,
    show_default=True,
    help="Beyond this, requests get 429 with Retry-After.",
)
@click.option("--max-body-bytes", default=4 * 2**20, show_default=True)
@click.option(
    "--grace",
    default=30.0,
    show_default=True,
    help="Seconds in-flight requests get to finish after SIGTERM.",
)
@replica_options
@_engine_options
def serve_cmd(
    artifact: Path,
    server_name: str,
    server_port: int,
    api_keys: str | None,
    model_name: str | None,
    max_concurrent_requests: int,
    max_body_bytes: int,
    grace: float,
    **kw,
) -> None:
    """Serve ARTIFACT over an OpenAI-compatible HTTP API."""
    from runtime.server.cluster import (
        pop_replica_options,
        refuse_stray_replica_options,
        serve_replicas,
        wants_replicas,
    )

    keys = tuple(k.strip() for k in (api_keys or "").split(",") if k.strip())
    replica_kw = pop_replica_options(kw)
    refuse_stray_replica_options(click.get_current_context(), replica_kw)
    if wants_replicas(replica_kw):
        serve_replicas(
            _served(artifact),
            kw,
            server_name=server_name,
            server_port=server_port,
            model_name=served_name(artifact, model_name),
            api_keys=keys,
            max_concurrent_requests=max_concurrent_requests,
            max_body_bytes=max_body_bytes,
            grace=grace,
            **replica_kw,
        )
        return
    try:  # before the imports below (torch, the engine: seconds), so a busy port fails at once
        sock = listen_socket(server_name, server_port)
    except OSError as e:
        raise click.ClickException(str(e)) from e
    import uvicorn

    from runtime.kernels.omp_threads import openmp_left_to_the_engine_thread
    from runtime.server.serve import DrainingServer, build_app

    loading = openmp_left_to_the_engine_thread() if kw["tp"] == 1 else contextlib.nullcontext()
    with loading:
        pipe = _pipeline(artifact, kw)
    app = build_app(
        pipe,
        served_name(artifact, model_name),
        keys,
        max_concurrent_requests,
        max_body_bytes,
    )
    engine, pool = pipe.engine, pipe.engine.pool_stats()
    logging.getLogger("liteserve").warning(
        "serving %s as %r on http://%s:%d: backend %s on %s%s (%s), kv %s, %d blocks, "
        "%d tokens fit",
        artifact,
        app.state.liteserve.settings.model_name,
        server_name,
        sock.getsockname()[1],
        engine.backend,
        engine.ops.device,
        f" (rank 0 of {engine.config.tp})" if engine.workers is not None else "",
        engine.ops.detail,  # the ISA path, or what --backend auto passed over and why
        engine.config.kv_quant,
        pool.num_blocks,
        pool.capacity_tokens,
    )
    # uvicorn re-raises the signal it stopped on once it has drained and shut down: a SIGTERM
    # or Ctrl-C that stopped the server gracefully must end the process with status 0, not by
    # the signal (or click's "Aborted!" and status 1 for the KeyboardInterrupt).
    for stop in (signal.SIGTERM, signal.SIGINT):
        signal.signal(stop, lambda *_: sys.exit(0))
    server = DrainingServer(
        uvicorn.Config(
            app,
            host=server_name,
            port=server_port,
            timeout_graceful_shutdown=grace,
            log_level="warning",
        )
    )
    if engine.workers is not None:  # a tensor-parallel rank that dies ends the server
        engine.workers.on_failure.append(lambda _: setattr(server, "should_exit", True))
    try:
        server.run(sockets=[sock])
    finally:
        engine.close()
        sock.close()
    if engine.workers is not None and engine.workers.failure is not None:
        raise click.ClickException(f"stopped: {engine.workers.failure}")


@main.command("check")
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--max-new-tokens", default=64, show_default=True)
@_engine_options
def check_cmd(artifact: Path, max_new_tokens: int, **kw) -> None:
    """Deploy check: load, render a chat, run one greedy request that must end on an end token."""
    from runtime import GenerationConfig
    from runtime.distributed.group import RankFailure

    pipe = _pipeline(artifact, kw)
    engine = pipe.engine
    click.echo(f"artifact  {artifact} ({engine.artifact.manifest.source.id})")
    click.echo(
        f"backend   {engine.backend} ({engine.ops.detail}), "
        f"{str(engine.dtype).removeprefix('torch.')} activations, kv {engine.config.kv_quant}"
    )
    click.echo(f"device    {engine.ops.device}")
    if engine.workers is not None:
        pids = ", ".join(str(p.pid) for p in engine.workers.procs)
        click.echo(f"tp        {engine.config.tp} ranks: rank 0 here, workers pid {pids}")
    if pipe.chat_template is None:
        raise click.ClickException("no chat template in the artifact (give --chat-template)")
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    try:
        ids = pipe.encode(messages)
        click.echo(f"template  {pipe.chat_template.render(messages)!r}")
        click.echo(f"tokens    {ids}")
        r = pipe(messages, GenerationConfig(max_new_tokens=max_new_tokens, temperature=0))[0]
    except (ValueError, RankFailure) as e:  # e.g. max_new_tokens past session_len
        raise click.ClickException(str(e)) from e
    click.echo(f"reply     {r.text!r} ({len(r.token_ids)} tokens, finish {r.finish_reason})")
    if r.finish_reason != "stop" or r.token_ids[-1] not in engine.eos_ids:
        why = "check the chat template and the stop token ids"
        if _loops(r.token_ids):  # the template led to an answer; greedy decoding then cycled
            why = (
                "the reply repeats itself, which a small or heavily quantized model can do "
                "under greedy decoding whatever its template: if it answered the question, "
                f"the template is likely right; else {why}"
            )
        raise click.ClickException(
            f"the reply did not end on an end token {list(engine.eos_ids)} within "
            f"{max_new_tokens} tokens: {why}"
        )
    click.echo("ok")


def _loops(ids: list[int], span: int = 8, times: int = 3) -> bool:
    """Whether some run of `span` tokens comes `times` times: a reply caught in a cycle."""
    runs = Counter(tuple(ids[i : i + span]) for i in range(len(ids) - span + 1))
    return bool(runs) and max(runs.values()) >= times
