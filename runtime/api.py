"""The Python API: `pipeline(artifact, EngineConfig(...))` then call it or stream from it.

pipe = pipeline("out/smollm2-awq", EngineConfig(kv_quant="int8"))
for r in pipe(["Summarise: ...", "Classify: ..."], GenerationConfig(max_new_tokens=64)):
    print(r.text)
for chunk in pipe.stream("Tell me about Paris"):
    print(chunk.text, end="")
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from runtime.chat_template import ChatTemplate
from runtime.config import EngineConfig
from runtime.engine.engine import Engine
from runtime.engine.sampler import SamplingParams, TokenLogprobs
from runtime.engine.sequence import Sequence
from runtime.message_text import MessageText
from runtime.text import check_text, token_ids

Prompt = str | list[int] | list[dict]  # text, token ids, or chat messages
# bytes that were not UTF-8 reach a str as surrogates (sys.argv and stdin decode them so)
NOT_UTF8_FIX = "the input was not UTF-8; convert it first (iconv -t UTF-8)"


@dataclass(frozen=True)
class GenerationConfig:
    """Per-request settings; None means the artifact's generation defaults."""

    max_new_tokens: int = 256
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float = 0.0
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None


@dataclass
class Response:
    text: str
    token_ids: list[int]
    finish_reason: str | None
    prompt_tokens: int
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    cached_tokens: int = 0

    @classmethod
    def of(cls, seq: Sequence, text: str | None = None) -> Response:
        return cls(
            text=seq.text if text is None else text,
            token_ids=seq.output_ids,
            finish_reason=seq.finish_reason,
            prompt_tokens=seq.num_prompt,
            logprobs=seq.logprobs,
            prompt_logprobs=seq.prompt_logprobs,
            cached_tokens=seq.num_cached,
        )


class Pipeline:
    """Callable from several threads: the engine takes one caller at a time (its steps are
    not reentrant), a batch call whole and a stream a step at a time, and every caller's step
    advances every request in the engine, so streams in other threads go on meanwhile."""

    def __init__(self, engine: Engine, chat_template: ChatTemplate | None) -> None:
        self.engine = engine
        self.chat_template = chat_template
        self.message_text = MessageText(engine.tokenizer)
        self._lock = threading.RLock()

    def sampling_params(self, gen: GenerationConfig) -> SamplingParams:
        if not isinstance(gen, GenerationConfig):
            raise TypeError(
                f"gen must be a GenerationConfig, not {type(gen).__name__}: "
                "GenerationConfig(max_new_tokens=..., temperature=...)"
            )
        return self.engine.sampling_params(**dataclasses.asdict(gen))

    def encode(self, prompt: Prompt) -> list[int]:
        """Text is tokenized as is; chat messages go through the artifact's chat template."""
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            if self.chat_template is None:
                raise ValueError("this artifact has no chat template; pass text instead")
            contents = [m.get("content") if isinstance(m, dict) else None for m in prompt]
            for i, content in enumerate(contents):
                if isinstance(content, str):
                    check_text(content, f"messages[{i}].content", NOT_UTF8_FIX)
            rendered = self.chat_template.render(prompt)
            check_text(rendered, "the rendered chat", NOT_UTF8_FIX)
            # a special token typed in a message stays text (runtime/message_text.py)
            return self.message_text.encode(
                rendered,
                [c if isinstance(c, str) else None for c in contents],
                lambda texts: self.chat_template.render(
                    [{**m, "content": texts[i]} if i in texts else m for i, m in enumerate(prompt)]
                ),
            )
        if isinstance(prompt, str):
            check_text(prompt, "the prompt", NOT_UTF8_FIX)
            return token_ids(self.engine.tokenizer, prompt)
        if not isinstance(prompt, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            raise TypeError(
                "a prompt is text, a list of token ids (int) or a list of chat messages (dict), "
                f"not {type(prompt).__name__}"
                + (f" of {type(prompt[0]).__name__}" if isinstance(prompt, list) else "")
                + (
                    "; a batch is a list of prompts, stream() takes one"
                    if isinstance(prompt, list)
                    else ""
                )
            )
        return list(prompt)

    def __call__(
        self, prompts: Prompt | list[Prompt], gen: GenerationConfig | None = None
    ) -> list[Response]:
        if not isinstance(prompts, (str, list)):
            raise TypeError(f"prompts are a prompt or a list of them, not {type(prompts).__name__}")
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], (int, dict))):
            prompts = [prompts]
        params = self.sampling_params(GenerationConfig() if gen is None else gen)
        ids = [self.encode(p) for p in prompts]
        with self._lock:
            seqs = self.engine.generate(ids, params)
        return [Response.of(s) for s in seqs]

    def stream(self, prompt: Prompt, gen: GenerationConfig | None = None) -> Iterator[Response]:
        """Text deltas as they are decoded, the last one carrying the finish reason. Closing the
        iterator early aborts the request. Another call's steps (another stream read in turn,
        a batch call, another thread) advance this request too: it may be finished, whole or
        in part, before this iterator steps it, and its text is still all delivered."""
        params = self.sampling_params(GenerationConfig() if gen is None else gen)
        ids = self.encode(prompt)
        hold = max((len(s) for s in params.stop), default=1) - 1  # a stop string may be forming
        with self._lock:
            seq = self.engine.add_request(ids, params)
        try:
            while True:
                with self._lock:
                    if not seq.finished:
                        self.engine.step()
                    done = seq.finished
                    end = len(seq.text) if done else max(seq.emitted, len(seq.text) - hold)
                    delta = seq.text[seq.emitted : end]
                    seq.emitted = end
                    response = Response.of(seq, delta)
                if delta or done:
                    yield response
                if done:
                    return
        finally:
            with self._lock:
                if not seq.finished:
                    self.engine.abort(seq.seq_id)

    def close(self) -> None:
        """Stop the tensor-parallel ranks (EngineConfig(tp=N)); nothing to do with one."""
        self.engine.close()

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def pipeline(
    artifact: str | Path,
    config: EngineConfig | None = None,
    chat_template: str | Path | None = None,
) -> Pipeline:
    if config is not None and not isinstance(config, EngineConfig):
        raise TypeError(f"config must be an EngineConfig, not {type(config).__name__}")
    # before the engine: a template that fails is found before minutes of loading, and
    # leaves no tensor-parallel rank running
    template = ChatTemplate.from_artifact(Path(artifact), chat_template)
    return Pipeline(Engine(artifact, config), template)
