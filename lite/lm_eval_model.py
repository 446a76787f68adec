"""lm-eval model ``liteserve``: an artifact served by the runtime engine, in-process.

Every request goes through the engine's scheduler (continuous batching, paged and optionally
quantized KV), so a score measures the artifact as ``runtime serve`` would run it, KV policy
included, with float activations on a CPU (LiteserveLM's docstring says why). Loglikelihoods
come from the engine's prompt logprobs; the tokenization (the tokenizer's own special tokens,
such as a Llama's BOS; BOS as the prefix of an empty context) and the reading of gen_kwargs
match lm-eval's ``hf`` model, so the source model scored by ``hf`` and its artifacts scored here
see identical token streams.

lm-eval 0.4 finds models only through its own registry, and its ``lm_eval`` command imports
nothing from outside: importing this module registers ``liteserve``, which ``lite eval`` and
``lite lm-eval`` (the stock command line with this model registered) both do.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from pathlib import Path

from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import has_bos_prefix, normalize_gen_kwargs
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from lite.perplexity import eval_dtype
from runtime.artifact.reader import read_manifest
from runtime.chat_template import ChatTemplate
from runtime.config import EngineConfig
from runtime.engine.engine import Engine
from runtime.engine.sampler import SamplingParams
from runtime.engine.sequence import Sequence

DEFAULT_MAX_LENGTH = 2048
_MIN_BLOCKS = 256  # short multiple-choice requests: room for a full batch of them at once


def default_max_length(positions: int) -> int:
    """2048, or what the model's positions hold (session_len)."""
    return min(DEFAULT_MAX_LENGTH, positions - 2)


def session_len(max_length: int, positions: int) -> int:
    """Tokens a request may hold: a loglikelihood's max_length + 1 prompt tokens (hf's
    max_length predictions) and the one token the engine samples after them; a generation
    fits in max_length, as hf's does. A max_length the model's positions cannot hold is
    refused: hf would run it past them, the engine cuts it, and the two sides saw different
    tokens."""
    if max_length < 1 or max_length + 2 > positions:
        raise ValueError(
            f"max_length {max_length} does not fit the model's {positions} positions (a request "
            f"holds max_length + 2 tokens); use at most {positions - 2}"
        )
    return max_length + 2


@register_model("liteserve")
class LiteserveLM(TemplateLM):
    """``--model_args artifact=DIR[,kv_quant=none|int8|int4,max_length=2048,dtype=auto,
    backend=auto,max_gen_toks=256,num_blocks=N,int8_activations=False]``; kv_quant defaults to
    the artifact's launch config, as ``runtime serve`` runs it. ``dtype=auto`` is fp32 on a CPU
    and bf16 on a GPU, and the CPU's int8 activations are off unless asked for: they are a
    speed path each host picks by measurement, so with them a score would change with the
    machine. ``--batch_size`` is the requests in flight."""

    def __init__(
        self,
        artifact: str,
        kv_quant: str | None = None,
        max_length: int | None = None,  # None: default_max_length
        dtype: str = "auto",
        backend: str | None = None,  # None: the artifact's launch config
        batch_size: int | str = 32,
        max_gen_toks: int = 256,
        num_blocks: int | None = None,
        int8_activations: bool = False,
        progress: bool = True,  # lite eval --quiet: lm-eval passes no disable_tqdm to requests
        **_ignored: object,  # lm-eval passes device/max_batch_size to every model
    ) -> None:
        super().__init__()
        # within the positions the model was trained for, which the engine holds sessions to
        positions = read_manifest(artifact).architecture.max_position_embeddings
        self._max_length = default_max_length(positions) if max_length is None else int(max_length)
        session = session_len(self._max_length, positions)
        self._max_gen_toks = int(max_gen_toks)  # the default of a task that sets none
        self._progress = progress
        self._batch_size = 32 if str(batch_size).startswith("auto") else int(batch_size)
        block = 64
        per_session = -(-session // block)
        config = EngineConfig(
            kv_quant=kv_quant,
            session_len=session,
            cache_block_seq_len=block,
            num_blocks=int(num_blocks) if num_blocks else max(2 * per_session, _MIN_BLOCKS),
            max_batch_size=self._batch_size,
            enable_prefix_caching=True,
            dtype=str(eval_dtype(dtype)).removeprefix("torch."),
            backend=backend,
            int8_activations=int8_activations,
        )
        self.engine = Engine(artifact, config)
        self.artifact = Path(artifact)
        arch = self.engine.arch
        self._eot = self.engine.eos_ids[0]
        self._prefix = arch.bos_token_id if arch.bos_token_id is not None else self._eot
        self._template = ChatTemplate.from_artifact(self.artifact)

    @property
    def eot_token_id(self) -> int:
        return self._eot

    @property
    def prefix_token_id(self) -> int:
        return self._prefix

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def device(self) -> str:
        return self.engine.backend

    @property
    def tokenizer_name(self) -> str:
        return str(self.artifact.resolve())

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **_: object):
        """As lm-eval's `hf` model encodes, so that the source model it scores and the artifacts
        scored here see the same ids: the tokenizer's own special tokens (a Llama's BOS) unless
        told otherwise, none when the text starts with the BOS text already."""
        if add_special_tokens is None:
            bos = self.engine.tokenizer.decode([self._prefix], skip_special_tokens=False)
            add_special_tokens = not has_bos_prefix(string, bos)
        return self.engine.tokenizer.encode(string, add_special_tokens=add_special_tokens).ids

    def tok_decode(self, tokens: Seq[int]) -> str:
        return self.engine.tokenizer.decode(list(tokens))

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return self._template.source if chat_template and self._template else None

    def apply_chat_template(
        self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        if self._template is None:
            raise ValueError(f"{self.artifact} has no chat template; drop --apply_chat_template")
        return self._template.render(chat_history, add_generation_prompt=add_generation_prompt)

    def _run(
        self, prompts: list[list[int]], params: list[SamplingParams], desc: str, quiet: bool
    ) -> list[Sequence]:
        """Keep up to batch_size requests in the engine, refilling as they finish."""
        done: list[Sequence | None] = [None] * len(prompts)
        waiting = list(range(len(prompts)))[::-1]
        flight: dict[int, Sequence] = {}
        with tqdm(total=len(prompts), desc=desc, disable=quiet or not self._progress) as bar:
            try:
                while waiting or flight:
                    while waiting and len(flight) < self._batch_size:
                        i = waiting.pop()
                        flight[i] = self.engine.add_request(prompts[i], params[i])
                    self.engine.step()
                    for i in [i for i, s in flight.items() if s.finished]:
                        done[i] = flight.pop(i)
                        bar.update(1)
            except BaseException:  # none left running in the engine for the next call
                for seq in flight.values():
                    self.engine.abort(seq.seq_id)
                raise
        return done  # type: ignore[return-value]

    def _loglikelihood_tokens(
        self, requests, disable_tqdm: bool = False, **_: object
    ) -> list[tuple[float, bool]]:
        """Context and continuation as one prompt, left-truncated to max_length + 1 tokens
        (max_length predictions, as lm-eval's hf model); the continuation's prompt logprobs
        are summed, and it is greedy when each token was the top-1."""
        for key, _, cont in requests:
            if not cont:  # its slice below was the whole prompt: the context's likelihood
                raise ValueError(
                    f"loglikelihood request {key!r}: the continuation encodes to no tokens, so "
                    "there is nothing to score (lm-eval's hf model refuses it too)"
                )
        prompts = [(ctx + cont)[-(self._max_length + 1) :] for _, ctx, cont in requests]
        params = SamplingParams(temperature=0.0, max_new_tokens=1, prompt_logprobs=1)
        seqs = self._run(prompts, [params] * len(prompts), "liteserve loglikelihood", disable_tqdm)
        out = []
        for (key, _, cont), seq in zip(requests, seqs, strict=True):
            lps = seq.prompt_logprobs[-len(cont) :]
            answer = (
                sum(lp.logprob for lp in lps),
                all(lp.top[0][0] == lp.token_id for lp in lps),
            )
            out.append(answer)
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each document in disjoint windows of max_length predictions, every token scored
        exactly once (the first conditioned on the prefix token)."""
        flat, owner = [], []
        for i, req in enumerate(requests):
            windows = get_rolling_token_windows(
                token_list=self.tok_encode(req.args[0]),
                prefix_token=self.prefix_token_id,
                max_seq_len=self._max_length,
                context_len=1,
            )
            for ctx, cont in map(make_disjoint_window, windows):
                flat.append((None, ctx, cont))
                owner.append(i)
        scores = self._loglikelihood_tokens(flat, disable_tqdm=disable_tqdm)
        totals = [0.0] * len(requests)
        for i, (ll, _) in zip(owner, scores, strict=True):
            totals[i] += ll
        for req, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", (req.args[0],), total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        prompts, params = [], []
        for req in requests:
            context, kwargs = req.args
            p = self._sampling(dict(kwargs))
            ids = self.tok_encode(context)[-(self._max_length - p.max_new_tokens) :]
            prompts.append(ids or [self.prefix_token_id])
            params.append(p)
        seqs = self._run(prompts, params, "liteserve generate_until", disable_tqdm)
        out = []
        for req, seq in zip(requests, seqs, strict=True):
            out.append(seq.text)
            self.cache_hook.add_partial("generate_until", req.args, seq.text)
        return out

    def _sampling(self, kwargs: dict) -> SamplingParams:
        """lm-eval's gen_kwargs, read as its backends read them (normalize_gen_kwargs): greedy
        unless do_sample, whatever the temperature; max_gen_toks or any of its aliases
        (max_new_tokens, max_tokens, max_completion_tokens); `until` strings stop generation."""
        kwargs = dict(normalize_gen_kwargs(kwargs, self._max_gen_toks))
        until = kwargs.pop("until")
        eot = self.tok_decode([self._eot])
        if eot not in until:
            until.append(eot)
        max_new = kwargs.pop("max_gen_toks")
        if not 0 < max_new < self._max_length:  # its context is the rest of max_length
            raise ValueError(
                f"max_gen_toks {max_new} leaves no context within max_length "
                f"{self._max_length}; raise max_length (--model_args) above it"
            )
        sample = kwargs.pop("do_sample")
        temperature = float(kwargs.pop("temperature", 0.0))
        return SamplingParams(
            temperature=temperature or (1.0 if sample else 0.0),
            top_p=float(kwargs.pop("top_p", 1.0)),
            top_k=int(kwargs.pop("top_k", 0)),
            max_new_tokens=max_new,
            stop=tuple(u for u in until if u),
            seed=kwargs.pop("seed", None),
        )
