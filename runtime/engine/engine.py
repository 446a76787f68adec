"""The engine: loads an artifact, sizes the KV pool, and runs the step loop.

A step asks the scheduler what to run, runs the model once over all of it, marks the new KV
computed (so the prefix cache may share it), samples for every sequence that reached its last
token, and detokenizes. Requests join and leave between any two steps.
"""

from __future__ import annotations

import itertools
import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from tokenizers import Tokenizer

from runtime import host_memory
from runtime.artifact.manifest import Architecture
from runtime.artifact.reader import Artifact
from runtime.config import EngineConfig
from runtime.device import make_current, on_device
from runtime.distributed.group import RankFailure, TPGroup
from runtime.distributed.shard import Shard
from runtime.engine.block_manager import BlockManager
from runtime.engine.cuda_graph import DecodeGraphs
from runtime.engine.detokenizer import TokenBytes, detokenizer, piece_bytes
from runtime.engine.grammar import GrammarCompiler, parser_error
from runtime.engine.model_runner import ModelRunner
from runtime.engine.overlap import PLACEHOLDER, PendingStep, TokenFeed, overlappable
from runtime.engine.sampler import (
    BatchLogprobs,
    Sampler,
    SamplingParams,
    TokenLogprobs,
    check_stop,
    prompt_logprobs,
)
from runtime.engine.scheduler import Batch, Scheduler
from runtime.engine.sequence import Sequence, Status
from runtime.kernels.ops import Backend, BackendError, select_backend
from runtime.kv.cache import KVCache
from runtime.kv.format import KVSpec
from runtime.model.llama import LlamaModel
from runtime.plan import weight_bytes

if TYPE_CHECKING:
    from runtime.distributed.worker import Workers

log = logging.getLogger("liteserve")


@dataclass(frozen=True)
class PoolStats:
    """The KV pool as the server and CLI see it: read through Engine.pool_stats(), so block
    state keeps one owner (scheduler + block manager)."""

    num_blocks: int
    block_size: int
    free_blocks: int
    usage: float  # fraction of blocks in use
    prefix_queries: int  # full prompt blocks that could have come from the prefix cache
    prefix_hits: int  # ... and did
    running: int  # sequences in the running batch
    waiting: int  # sequences waiting for admission
    preemptions: int

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Rank:
    """What each rank builds for itself: its kernels, activation dtype, model (or slice of it
    under tensor parallelism) and KV pool (its KV heads)."""

    ops: Backend
    dtype: torch.dtype
    model: LlamaModel
    kv_spec: KVSpec
    cache: KVCache


def load_rank(
    artifact: Artifact,
    config: EngineConfig,
    device: str,
    shard: Shard | None = None,
    group: TPGroup | None = None,
) -> Rank:
    """Backend, model and pool from a config with the artifact's launch defaults filled in:
    the one loading path of the engine's process and of every tensor-parallel worker."""
    manifest = artifact.manifest
    requested = config.backend_from(manifest.launch)
    pinned = config.backend is None and requested != "auto"
    why = (
        f" (the artifact's launch config pins backend {requested}: --backend, or "
        "EngineConfig(backend=...), overrides it)"
        if pinned
        else ""
    )
    try:
        ops = select_backend(requested, manifest.launch.kernels, device, config.int8_activations)
    except BackendError as e:
        raise BackendError(f"{e}{why}") from e
    dtype = ops.default_dtype() if config.dtype == "auto" else _DTYPES[config.dtype]
    if dtype not in ops.dtypes:
        names = ", ".join(str(d).removeprefix("torch.") for d in ops.dtypes)
        raise ValueError(
            f"backend {ops.name} runs {names} activations, not "
            f"{str(dtype).removeprefix('torch.')}; choose one of those as dtype{why}"
        )
    model = LlamaModel(artifact, dtype, config.session_len, ops, shard, group)
    arch = manifest.architecture
    spec = KVSpec(
        num_layers=arch.num_layers,
        num_kv_heads=arch.num_kv_heads if shard is None else shard.num_kv_heads,
        head_dim=arch.head_dim,
        block_size=config.cache_block_seq_len,
        kv_quant=config.kv_quant,
        dtype=dtype,
    )
    spec.validate()
    num_blocks = _blocks_from_memory(spec, config, ops.device)
    if group is not None:  # every rank's pool holds the blocks rank 0's block manager hands out
        num_blocks = group.min(num_blocks)
    return Rank(ops, dtype, model, spec, KVCache(spec, num_blocks, ops.device))


def _blocks_from_memory(spec: KVSpec, config: EngineConfig, device: torch.device) -> int:
    """The pool's blocks: num_blocks as given, once the memory free now is known to hold it
    (else torch's allocator failed with a traceback); unset, cache_max_entry_count of that
    memory, but never more than a full batch of full sessions could use, nor less than one
    session."""
    available = _available_bytes(config, device)
    if config.num_blocks is not None:
        return _fitting(spec, config.num_blocks, available)
    free = available * config.cache_max_entry_count
    per_session = -(-config.session_len // spec.block_size)
    useful = per_session * config.max_batch_size
    return max(min(KVCache.num_blocks_for(spec, int(free)), useful), per_session)


def _available_bytes(config: EngineConfig, device: torch.device) -> int:
    """Memory a new pool can have: the GPU's free memory, or the host's available memory, of
    which tensor-parallel ranks on the CPU (sharing the host) each take their share."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return host_memory.available_bytes() // config.tp


def _fitting(spec: KVSpec, num_blocks: int, available: int) -> int:
    """num_blocks, if its pool fits in `available` bytes."""
    need = num_blocks * spec.bytes_per_block()
    if need <= available:
        return num_blocks
    fits = KVCache.num_blocks_for(spec, available)
    fix = f"choose at most num_blocks={fits}" if fits else "free memory first"
    raise ValueError(
        f"num_blocks={num_blocks} needs {need:,} bytes ({need / 2**30:.2f} GiB) of KV pool but "
        f"{available:,} bytes ({available / 2**30:.2f} GiB) are available; {fix}"
    )


class ContextLengthError(ValueError):
    """A request's prompt and max_new_tokens do not fit the session, or the whole KV pool:
    either way over the server's max_model_len (OpenAI's context_length_exceeded)."""


def _within_positions(
    asked: EngineConfig, config: EngineConfig, arch: Architecture
) -> EngineConfig:
    """The session within the positions the model was trained for: a session_len the user set
    past them is refused (the rotary table would be built for them all, and the model has
    never seen them: 100M positions ran the host out of memory); the launch config's default
    is capped to them."""
    limit = arch.max_position_embeddings
    if config.session_len <= limit:
        return config
    if asked.session_len is not None:
        raise ValueError(
            f"session_len={asked.session_len} is over the model's max_position_embeddings "
            f"({limit}): positions past it were never trained; use --session-len {limit} or less"
        )
    return replace(config, session_len=limit)


class Engine:
    def __init__(self, artifact: str | Path, config: EngineConfig | None = None) -> None:
        config = config or EngineConfig()
        config.validate()
        self.artifact = Artifact(artifact, checksums=config.verify_checksums)
        manifest = self.artifact.manifest
        self.arch = manifest.architecture
        self.config = _within_positions(
            config, config.with_launch_defaults(manifest.launch), self.arch
        )
        self.config.validate()
        self.workers: Workers | None = None
        shard = group = None
        device = self.config.device
        if self.config.tp > 1:
            from runtime.distributed.worker import Workers

            self.workers = Workers.start(self.artifact, self.config)
            shard, group, device = self.workers.shard, self.workers.group, self.workers.device
        try:
            self._load(device, shard, group, config.max_prefill_token_num)
        except Exception as e:
            if self.workers is None:
                raise
            raise self.workers.abort(e) from e
        self.sampler = Sampler()
        self._grammar: GrammarCompiler | None = None
        self._mask_worker = ThreadPoolExecutor(1, thread_name_prefix="liteserve-masks")
        self._ids = itertools.count()
        self.sequences: dict[int, Sequence] = {}
        self._pending: PendingStep | None = None
        self.overlap = self._overlaps()
        pool = self.cache.num_blocks * self.kv_spec.block_size
        log.info(
            "backend %s (%s), %s activations, weights %.2f GiB in memory (%.2f GiB stored), "
            "kv %s: %d bytes/token, %d blocks of %d, %d tokens fit",
            self.backend,
            self.ops.detail,
            str(self.dtype).removeprefix("torch."),
            self.model.weight_bytes() / 2**30,
            weight_bytes(self.artifact) / 2**30,
            self.config.kv_quant,
            self.kv_spec.bytes_per_token(),
            self.cache.num_blocks,
            self.kv_spec.block_size,
            pool,
        )
        if pool < self.session_len:
            log.warning(
                "the KV pool holds %d tokens, fewer than session_len %d: one request's prompt "
                "and output are limited to %d (num_blocks or cache_max_entry_count sizes it)",
                pool,
                self.session_len,
                pool,
            )

    def _load(
        self, device: str, shard: Shard | None, group: TPGroup | None, budget: int | None
    ) -> None:
        """This rank's model and pool, the block manager, scheduler and runner, warmed up.
        budget: the step token budget the user asked for, if any (else the launch config's,
        capped at the backend's own step_tokens)."""
        manifest = self.artifact.manifest
        rank = load_rank(self.artifact, self.config, device, shard, group)
        self.ops, self.dtype, self.model = rank.ops, rank.dtype, rank.model
        cap = rank.ops.step_tokens
        if budget is None and cap is not None and self.config.max_prefill_token_num > cap:
            self.config = replace(self.config, max_prefill_token_num=cap)
        self.kv_spec, self.cache = rank.kv_spec, rank.cache
        self.backend = self.ops.name
        self.tokenizer = Tokenizer.from_file(str(self.artifact.path / "tokenizer.json"))
        self._token_bytes = TokenBytes.of(self.tokenizer)  # detokenizing by bytes, if it can
        self.eos_ids = tuple(manifest.generation.stop_token_ids or self.arch.eos_token_ids)
        self.blocks = BlockManager(
            self.cache.num_blocks, self.kv_spec.block_size, self.config.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            self.blocks, self.config.max_batch_size, self.config.max_prefill_token_num
        )
        self.runner = ModelRunner(
            self.model, self.cache, self.blocks, self.ops, self._graphs(), self.workers
        )
        self.warm_up()

    def warm_up(self) -> None:
        """Compile the backend's kernels for every step this engine can take, before the first
        request: a step holds at most max_batch_size decode rows or the prefill token budget,
        and contexts up to the session length."""
        c = self.config
        self.runner.warm_up(max(c.max_batch_size, c.max_prefill_token_num), self.session_len)

    def _graphs(self) -> DecodeGraphs | None:
        """Decode steps from static buffers, captured as CUDA graphs on a GPU, unless the
        backend cannot or the user asked for eager steps (--enforce-eager). Not under tensor
        parallelism yet: the graphs would have to capture the collectives too."""
        if not self.ops.graphs or self.config.enforce_eager or self.workers is not None:
            return None
        graphs = DecodeGraphs(
            self.model,
            self.cache,
            self.ops,
            self.config.max_batch_size,
            -(-self.session_len // self.kv_spec.block_size),
            capture=self.ops.device.type == "cuda",
        )
        graphs.capture()
        return graphs

    def _overlaps(self) -> bool:
        """Overlapped scheduling (runtime.engine.overlap) where the device runs asynchronously
        to the host, a GPU, unless the config says otherwise. Not under tensor parallelism:
        the other ranks take each step's ids from the host."""
        if self.config.overlap_schedule is None:
            return self.ops.device.type == "cuda" and self.workers is None
        return self.config.overlap_schedule

    def close(self) -> None:
        """Stop the tensor-parallel workers (nothing to do without them); the engine cannot
        step after this."""
        if self.workers is not None:
            self.workers.stop()

    def token_bytes(self, token_id: int) -> bytes:
        """The token's own bytes (part of a character, for some): see piece_bytes."""
        return piece_bytes(self.tokenizer, self._token_bytes, token_id)

    def pool_stats(self) -> PoolStats:
        b, sched = self.blocks, self.scheduler
        return PoolStats(
            num_blocks=b.num_blocks,
            block_size=self.kv_spec.block_size,
            free_blocks=b.num_free_blocks,
            usage=b.usage,
            prefix_queries=b.prefix_queries,
            prefix_hits=b.prefix_hits,
            running=len(sched.running),
            waiting=len(sched.waiting),
            preemptions=sched.num_preemptions,
        )

    def running_ids(self) -> list[int]:
        """The sequences in the running batch: the ones a step that raised was running, which
        the server fails while the rest keep their place."""
        return [s.seq_id for s in self.scheduler.running]

    @property
    def session_len(self) -> int:
        return self.config.session_len

    @property
    def grammar(self) -> GrammarCompiler:
        """The schema compiler, built on first use (its token table takes a fraction of a
        second for a 50k vocabulary: no reason to make every start pay it)."""
        if self._grammar is None:
            self._grammar = GrammarCompiler(
                self.artifact.path / "tokenizer.json", self.arch.vocab_size, self.eos_ids
            )
        return self._grammar

    def sampling_params(self, **fields) -> SamplingParams:
        """A request's settings over the artifact's generation defaults (None = the default);
        the one place both the Python API and the server resolve them."""
        d = self.artifact.manifest.generation
        defaults = {
            "temperature": d.temperature,
            "top_p": d.top_p,
            "top_k": d.top_k,
            "repetition_penalty": d.repetition_penalty,
        }
        return SamplingParams(**{**defaults, **{k: v for k, v in fields.items() if v is not None}})

    def add_request(
        self, prompt_ids: list[int], params: SamplingParams, scored_only: bool = False
    ) -> Sequence:
        """Queue a request; every problem with it is a ValueError raised before anything is
        allocated. `scored_only`: the caller wants the prompt's logprobs and drops the one
        token sampled after it (echo with max_tokens 0), which is never run, so the prompt
        alone must fit: a prompt of exactly the session was refused as one token over."""
        params.validate()
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        for what, ids in (("token ids", prompt_ids), ("stop_token_ids", params.stop_token_ids)):
            bad = [t for t in ids if not 0 <= t < self.arch.vocab_size]
            if bad:  # a stop id past the vocabulary would never stop anything
                raise ValueError(
                    f"{what} {bad[:5]} are outside the vocabulary (0..{self.arch.vocab_size - 1})"
                )
        new = 0 if scored_only else params.max_new_tokens
        total = len(prompt_ids) + new
        if total > self.session_len:
            raise ContextLengthError(
                f"the prompt ({len(prompt_ids)} tokens) plus max_new_tokens "
                f"({new}) is {total} tokens, over session_len "
                f"{self.session_len}; shorten the prompt or lower max_new_tokens"
            )
        needed = -(-total // self.kv_spec.block_size)
        if needed > self.blocks.num_blocks:
            raise ContextLengthError(
                f"the request needs {needed} KV blocks ({total} tokens) but the pool has "
                f"{self.blocks.num_blocks} ({self.blocks.num_blocks * self.kv_spec.block_size} "
                "tokens); shorten the prompt or lower max_new_tokens, or serve with a larger "
                "num_blocks or cache_max_entry_count"
            )
        matcher = None if params.json_schema is None else self.grammar.matcher(params.json_schema)
        seq_id = next(self._ids)
        seq = Sequence(
            seq_id=seq_id,
            prompt_ids=list(prompt_ids),
            params=params,
            detokenizer=detokenizer(
                self.tokenizer, self._token_bytes, prompt_ids, params.skip_special_tokens
            ),
            generator=None if params.seed is None else self._generator(params.seed),
            matcher=matcher,
        )
        self.sequences[seq_id] = seq
        self.scheduler.add(seq)
        return seq

    def _generator(self, seed: int) -> torch.Generator:
        """A seeded request's own RNG, on the device the sampler runs on: its draws depend on
        nothing else in the batch."""
        return torch.Generator(device=self.ops.device).manual_seed(seed)

    def abort(self, seq_id: int) -> None:
        """Stop a request now; its blocks are free when this returns."""
        seq = self.sequences.pop(seq_id, None)
        if seq is not None and not seq.finished:
            self.scheduler.remove(seq)
            seq.finish_reason = "abort"

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self._pending is not None

    def step(self) -> list[Sequence]:
        """Run one step; returns the sequences that produced a token (or finished).

        Overlapped (``runtime.engine.overlap``), a call queues the next step and then returns
        what the step queued by the previous call produced."""
        make_current(self.ops.device)  # the server steps on its own thread, not the builder's
        prev, self._pending = self._pending, None
        done: list[Sequence] = []
        if prev is not None and not overlappable(prev):
            done, prev = self._complete(prev), None
        feed = None
        if prev is not None:
            self._advance(prev, placeholders=True)
            feed = prev.feed()
        try:
            batch = self.scheduler.schedule()
            launched = self._launch(batch, feed) if batch.seqs else None
        finally:  # also when the launch failed: the previous step's ids are good
            if prev is not None:
                done += self._finish(prev)
        if launched is not None:
            if self.overlap:
                self._pending = launched
            else:
                done += self._complete(launched)
        return done

    def _launch(self, batch: Batch, feed: TokenFeed | None) -> PendingStep:
        """The step's forward and sampling, queued on the device."""
        rows = [
            (i, seq)
            for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_tokens, strict=True))
            if seq.num_computed + n == len(seq.token_ids)
        ]
        sampled = [seq for _, seq in rows]
        masks = self._masks(sampled)  # computed while the model runs
        try:
            last_logits, chunk_logits = self.runner.run(batch, feed)
        except RankFailure as e:  # only under TP: name the rank that died, if one did
            raise self.workers.failed(e) from e
        except BaseException:  # Ctrl-C: the other ranks wait in this step's collectives
            if self.workers is not None:
                self.workers.left_mid_step()
            raise
        if rows:
            mask = masks.result() if masks is not None else None
            tokens, logprobs = self._sample(last_logits, [i for i, _ in rows], sampled, mask)
        else:  # every sequence is inside its prompt
            tokens, logprobs = last_logits.new_empty(0, dtype=torch.long), BatchLogprobs(0, [], [])
        return PendingStep(batch, chunk_logits, sampled, tokens, logprobs)

    def _advance(self, step: PendingStep, placeholders: bool = False) -> None:
        """The host's record of a step's KV, before its sampled ids are read: computed
        tokens (shared by the prefix cache once whole blocks are) and prompt logprobs. With
        ``placeholders``, a placeholder for each sampled id, so that the scheduler sees each
        sequence at its new length; a sequence that this id ends by length is left out of
        the next step instead."""
        for seq, n, chunk in zip(
            step.batch.seqs, step.batch.num_tokens, step.chunk_logits, strict=True
        ):
            if seq.finished:  # finished or aborted while the step ran: its row is dropped
                continue
            if chunk is not None:
                self._prompt_logprobs(seq, chunk, n)
            seq.num_computed += n
            self.blocks.mark_computed(seq.seq_id, seq.token_ids, seq.num_computed)
        if not placeholders:
            return
        for seq in step.sampled:
            if seq.finished:
                continue
            if len(seq.token_ids) + 1 - seq.num_prompt >= seq.params.max_new_tokens:
                seq.status = Status.LAST_TOKEN
            else:
                seq.token_ids.append(PLACEHOLDER)

    def _finish(self, step: PendingStep) -> list[Sequence]:
        """Read a step's sampled ids (waiting for that step only) and append them."""
        done = []
        for seq, token, lp in zip(step.sampled, *step.read(), strict=True):
            if not seq.finished:
                self._append(seq, token, lp)
                done.append(seq)
        return done

    def _complete(self, step: PendingStep) -> list[Sequence]:
        self._advance(step)
        return self._finish(step)

    def _masks(self, seqs: list[Sequence]) -> Future[torch.Tensor] | None:
        """The grammar masks of the rows this step samples, started on a worker thread before
        the model runs: llguidance computes them without the GIL, so on a machine with cores
        to spare they cost the step nothing. None when no row is constrained."""
        matchers = [s.matcher for s in seqs]
        if all(m is None for m in matchers):
            return None
        return self._mask_worker.submit(self.grammar.fill_masks, matchers)

    def _prompt_logprobs(self, seq: Sequence, chunk: torch.Tensor, n: int) -> None:
        # A sequence preempted during its prompt recomputes rows it has already recorded.
        done = seq.prompt_rows()
        first = max(seq.num_computed, done)
        m = min(seq.num_computed + n, seq.num_prompt - 1) - first  # rows predicting prompt
        if m <= 0:
            return
        rows = chunk[first - seq.num_computed : first - seq.num_computed + m]
        if seq.prompt_logits is not None:
            seq.prompt_logits.append(rows.float())
            return
        logits = torch.cat([rows, rows.new_zeros(1, rows.shape[1])])
        ids = torch.tensor(seq.token_ids[first : first + m + 1])
        seq.prompt_logprobs.extend(prompt_logprobs(logits, ids, seq.params.prompt_logprobs))

    def _sample(
        self,
        logits: torch.Tensor,
        index: list[int],
        seqs: list[Sequence],
        masks: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, BatchLogprobs]:
        """Ids and logprobs (on the device) of the rows ``index`` of a step's last logits."""
        # every row samples in a decode step: a view, not a gather (whose index list must be
        # copied to the device first, through pinned memory: on_device)
        rows = (
            logits[: len(index)]
            if index[-1] == len(index) - 1
            else logits[on_device(index, logits.device)]
        )
        seen = [
            torch.tensor(s.token_ids) if s.params.repetition_penalty != 1.0 else None for s in seqs
        ]
        outputs = [
            torch.tensor(s.output_ids)
            if s.params.presence_penalty or s.params.frequency_penalty
            else None
            for s in seqs
        ]
        return self.sampler.sample(
            rows, [s.params for s in seqs], [s.generator for s in seqs], seen, outputs, masks
        )

    def _append(self, seq: Sequence, token: int, lp: TokenLogprobs | None) -> None:
        if seq.token_ids[-1] == PLACEHOLDER:  # overlapped: the next step already reads it
            seq.token_ids[-1] = token
        else:
            seq.token_ids.append(token)
        if lp is not None:
            seq.logprobs.append(lp)
        start = len(seq.text)
        seq.text += seq.detokenizer.step(token)
        n_out = len(seq.token_ids) - seq.num_prompt
        reason, cut = check_stop(seq.text, start, token, seq.params, self.eos_ids, n_out)
        if seq.matcher is not None:
            if not seq.matcher.consume_token(token) or seq.matcher.is_error():
                # the parser gave up (a limit hit past the forced prefix): its is_stopped()
                # is true then too, but the text is not the schema's, so no "stop"
                seq.error = (
                    f"structured output failed after {n_out} tokens: the grammar engine "
                    f"stopped ({parser_error(seq.matcher)}); simplify the JSON schema"
                )
                reason, cut = "error", None
            elif reason is None and seq.matcher.is_stopped():  # the grammar is complete
                reason = "stop"
        if reason is None:
            return
        seq.text = seq.text[:cut] if cut is not None else seq.text + seq.detokenizer.flush()
        seq.finish_reason = reason
        self.scheduler.remove(seq)
        self.sequences.pop(seq.seq_id, None)

    def score(self, prompts: list[list[int]]) -> list[torch.Tensor]:
        """Float32 logits [T - 1, V] predicting tokens 1..T-1 of each prompt, batched by the
        scheduler: the full next-token distributions that perplexity and KL divergence need
        (prompt logprobs keep only the top k)."""
        if any(len(p) < 2 for p in prompts):
            raise ValueError("scoring needs prompts of at least 2 tokens")
        params = SamplingParams(temperature=0.0, max_new_tokens=1, prompt_logprobs=0)
        seqs = []
        for p in prompts:
            seq = self.add_request(p, params, scored_only=True)  # a whole session scores
            seq.prompt_logits = []
            seqs.append(seq)
        while any(not s.finished for s in seqs):
            self.step()
        return [torch.cat(s.prompt_logits).cpu() for s in seqs]

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Sequence]:
        """Run prompts to completion together (continuous batching). All or nothing: if one
        prompt is refused or a step raises (or the caller interrupts), none of them is left
        in the engine to take steps and KV blocks for a result nobody reads."""
        seqs: list[Sequence] = []
        try:
            for p in prompts:
                seqs.append(self.add_request(p, params))
            while any(not s.finished for s in seqs):
                self.step()
        except BaseException:
            for s in seqs:
                self.abort(s.seq_id)
            raise
        return seqs
