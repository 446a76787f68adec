"""`runtime generate`, `chat` and `plan` through click, on a tiny artifact."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

import runtime
from runtime.cli import main, parse_bytes
from runtime.config import EngineConfig
from runtime.engine.engine import Engine
from runtime.engine.sampler import SamplingParams

ENGINE = ["--num-blocks", "32", "--session-len", "256"]


@pytest.fixture
def art(rtn_artifact: Path) -> Path:
    return rtn_artifact


def test_generate_streams_what_the_engine_generates(art: Path) -> None:
    r = CliRunner().invoke(
        main,
        [
            "generate",
            str(art),
            "--prompt",
            "def f(x):",
            "--raw",
            "--temperature",
            "0",
            "--max-new-tokens",
            "12",
            *ENGINE,
        ],
    )
    assert r.exit_code == 0, r.output
    engine = Engine(art, EngineConfig(num_blocks=32, session_len=256))
    ids = engine.tokenizer.encode("def f(x):", add_special_tokens=False).ids
    seq = engine.generate([ids], SamplingParams(temperature=0, max_new_tokens=12))[0]
    assert r.output == seq.text + "\n"


def test_generate_refuses_an_oversized_request(art: Path) -> None:
    r = CliRunner().invoke(
        main, ["generate", str(art), "--prompt", "x", "--max-new-tokens", "1000", *ENGINE]
    )
    assert r.exit_code != 0 and "over session_len 256" in r.output


def test_chat_keeps_history_until_eof(art: Path) -> None:
    r = CliRunner().invoke(
        main,
        ["chat", str(art), "--max-new-tokens", "4", "--temperature", "0", *ENGINE],
        input="hello\n\nhow are you\n",
    )
    assert r.exit_code == 0, r.output
    assert r.output.count("you> ") == 4 and r.output.count("model> ") == 2
    # fed from a pipe, stdout holds the replies alone; the prompts go to stderr
    assert "you> " not in r.stdout and "model> " not in r.stdout, r.stdout
    assert r.stderr.count("you> ") == 4 and r.stderr.count("model> ") == 2
    assert r.stderr.endswith("you> \n")  # the newline ending the last prompt, not in stdout


def test_chat_drops_the_oldest_turns_when_the_session_is_full(art: Path) -> None:
    """A conversation longer than session_len goes on: the oldest exchanges leave the context
    (said on stderr) and the system message stays; every turn was refused before."""
    turn = "tell me more about the weather in the mountains " * 3
    r = CliRunner().invoke(
        main,
        ["chat", str(art), "--max-new-tokens", "40", "--temperature", "0", "--system", "Be brief."]
        + ENGINE,
        input=f"{turn}\n" * 8,
    )
    assert r.exit_code == 0, r.output
    assert "error" not in r.output and r.output.count("model> ") == 8, r.output
    assert "oldest messages left the context" in r.output


def test_ctrl_c_in_chat_stops_the_reply_not_the_session(
    art: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C mid-reply ended the whole session (exit 1, the conversation lost); it now stops
    that reply, which stays in the history as far as it went, and the next turn runs."""
    from runtime.api import Pipeline

    real, calls = Pipeline.stream, []

    def interrupted_once(self, request, gen=None):
        calls.append(len(request))
        for i, chunk in enumerate(real(self, request, gen)):
            if len(calls) == 1 and i == 2:
                raise KeyboardInterrupt
            yield chunk

    monkeypatch.setattr(Pipeline, "stream", interrupted_once)
    r = CliRunner().invoke(
        main,
        ["chat", str(art), "--max-new-tokens", "8", "--temperature", "0", *ENGINE],
        input="hello\nhow are you\n",
    )
    assert r.exit_code == 0, r.output
    assert "(stopped)" in r.output and r.output.count("model> ") == 2
    assert calls == [1, 3]  # the second turn saw the first, its partial reply included


def test_ctrl_c_exits_130_as_a_shell_reports_it(art: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """click's Abort exited 1, a user error's status, where SIGTERM exits 143."""
    from runtime.api import Pipeline

    def interrupted(self, request, gen=None):
        raise KeyboardInterrupt
        yield

    monkeypatch.setattr(Pipeline, "stream", interrupted)
    r = CliRunner().invoke(main, ["generate", str(art), "--prompt", "x", *ENGINE])
    assert r.exit_code == 130 and "Aborted!" in r.output, r.output


def test_chat_refuses_a_line_that_is_not_utf8_and_goes_on(art: Path) -> None:
    r = CliRunner().invoke(
        main,
        ["chat", str(art), "--max-new-tokens", "4", "--temperature", "0", *ENGINE],
        input=b"hello \xff world\nhow are you\n",
    )
    assert r.exit_code == 0, r.output
    assert "this line holds an unpaired UTF-16 surrogate (\\udcff at character 6)" in r.output
    assert r.output.count("model> ") == 1 and r.exception is None


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--temperature", "nan"], "temperature must be >= 0 and finite"),
        (["--max-new-tokens", "0"], "max_new_tokens must be an integer >= 1"),
        (["--max-new-tokens", "256"], "leaves no room for a message in session_len 256"),
        (["--system", "be \udcff brief"], "--system holds an unpaired UTF-16 surrogate"),
    ],
)
def test_chat_refuses_bad_settings_before_the_first_turn(
    art: Path, flags: list[str], message: str
) -> None:
    """It used to print an error on every turn and exit 0."""
    r = CliRunner().invoke(main, ["chat", str(art), *flags, *ENGINE], input="hello\n")
    assert r.exit_code == 1 and message in r.output, r.output
    assert "model> " not in r.output


def test_the_python_api_names_text_that_is_not_utf8(art: Path) -> None:
    pipe = runtime.pipeline(art, EngineConfig(num_blocks=32, session_len=256))
    with pytest.raises(ValueError, match="the prompt holds an unpaired UTF-16 surrogate"):
        pipe(["fine", "hi \udcff"])
    with pytest.raises(ValueError, match=r"messages\[1\]\.content holds"):
        next(
            pipe.stream([{"role": "system", "content": "x"}, {"role": "user", "content": "\ud83d"}])
        )
    assert pipe.engine.sequences == {}  # nothing was admitted


def test_device_eager_and_overlap_flags_reach_every_engine_command(
    art: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    configs: list[EngineConfig] = []

    def pipeline(artifact: Path, config: EngineConfig, template: Path | None) -> None:
        configs.append(config)
        raise ValueError("loaded no engine")

    monkeypatch.setattr(runtime, "pipeline", pipeline)
    commands = [["generate", str(art), "--prompt", "x"], ["chat", str(art)]]
    commands += [["check", str(art)], ["serve", str(art)]]
    for command in commands:
        for flags in (
            [],
            ["--device", "cuda:1", "--enforce-eager", "--no-overlap-schedule"],
            ["--overlap-schedule"],
        ):
            r = CliRunner().invoke(main, [*command, *flags])
            assert r.exit_code == 1 and "loaded no engine" in r.output, r.output
    chosen = [(c.device, c.enforce_eager, c.overlap_schedule) for c in configs]
    want = [("auto", False, None), ("cuda:1", True, False), ("auto", False, True)]
    assert chosen == want * len(commands)


def test_a_bad_device_is_refused_with_the_choices(art: Path) -> None:
    r = CliRunner().invoke(main, ["generate", str(art), "--prompt", "x", "--device", "gpu"])
    assert r.exit_code == 1, r.output
    assert "device='gpu' is invalid: expected auto, cpu, cuda or cuda:N" in r.output


def test_plan_orders_kv_policies(art: Path) -> None:
    r = CliRunner().invoke(main, ["plan", str(art), "--memory", "1GiB", "--avg-len", "100"])
    assert r.exit_code == 0, r.output
    rows = {
        line.split()[0]: line.split()
        for line in r.output.splitlines()
        if line.split() and line.split()[0] in ("none", "int8", "int4")
    }
    tokens = {k: int(v[4].replace(",", "")) for k, v in rows.items()}
    assert tokens["int4"] > tokens["int8"] > tokens["none"] > 0
    # hand check for 'none': 2 layers x 2 kv heads x 16 dims x 2 (K, V) x 2 bytes = 256 B/token
    assert rows["none"][1] == "256"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--memory", "1GiB", "--avg-len", "0"], "--avg-len 0: a sequence holds at least one"),
        (["--memory", "1GiB", "--cache-block-seq-len", "17"], "a positive multiple of 16"),
        (["--memory", "24"], "does not hold the weights"),
        (["--memory", "100KiB"], "102,400 bytes (0.00 GiB) does not hold the weights"),
        (
            ["--memory", "1GiB", "--avg-len", "1025"],
            "--avg-len 1025 is over the model's max_position_embeddings (1024)",
        ),
    ],
)
def test_plan_refuses_what_it_cannot_plan(art: Path, args: list[str], message: str) -> None:
    r = CliRunner().invoke(main, ["plan", str(art), *args])
    assert r.exit_code == 1 and message in r.output and "Traceback" not in r.output, r.output
    assert "give a unit" not in r.output  # said so to --memory 100KiB too


def test_plan_refuses_memory_that_holds_no_block_and_names_bad_options(art: Path) -> None:
    """Memory a byte over the weights gave a table of zeros and exit 0; an unparsable size
    or age named no option."""
    from runtime.artifact.reader import Artifact
    from runtime.plan import weight_bytes

    over = str(weight_bytes(Artifact(art, checksums=False)) + 1)
    r = CliRunner().invoke(main, ["plan", str(art), "--memory", over])
    assert r.exit_code == 1 and "but not one KV block of any policy" in r.output, r.output
    r = CliRunner().invoke(main, ["plan", str(art), "--memory", "-1GiB"])
    assert r.exit_code == 2 and "Invalid value for '--memory'" in r.output, r.output
    r = CliRunner().invoke(main, ["cache", "prune", "--unused-for", "1w", "--dry-run"])
    assert r.exit_code == 2 and "Invalid value for '--unused-for'" in r.output, r.output


def test_plan_takes_what_serve_takes_with_the_engines_block(
    art: Path, tiny_models: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It planned 64-token blocks for an artifact whose engine uses its launch config's, and
    refused a quantized checkpoint that serve converts, advising to quantize it."""
    from tests.test_interop import make_checkpoint

    launched = tmp_path / "art128"
    shutil.copytree(art, launched)
    manifest = json.loads((launched / "manifest.json").read_text())
    manifest["launch"]["cache_block_seq_len"] = 128
    (launched / "manifest.json").write_text(json.dumps(manifest))
    r = CliRunner().invoke(main, ["plan", str(launched), "--memory", "1GiB", "--avg-len", "100"])
    assert r.exit_code == 0, r.output
    none = next(line.split() for line in r.output.splitlines() if line.startswith("none"))
    assert none[1:3] == ["256", f"{256 * 128:,}"], none  # bytes per token, per block

    monkeypatch.setenv("LITESERVE_CACHE", str(tmp_path / "cache"))  # plan converts it there
    src = tmp_path / "gptq"
    make_checkpoint(tiny_models["llama"], src, "gptq", 32, True)
    r = CliRunner().invoke(main, ["plan", str(src), "--memory", "1GiB", "--avg-len", "100"])
    assert r.exit_code == 0 and "quantize it first" not in r.output, r.output


def test_plan_defaults_avg_len_to_the_models_positions(art: Path) -> None:
    """The default 4000 would be refused on a model of 1024 positions: it falls to 1024."""
    r = CliRunner().invoke(main, ["plan", str(art), "--memory", "1GiB"])
    assert r.exit_code == 0 and "sequences of 1024 tokens" in r.output, r.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--cache-block-seq-len", "1048576"],
            "cache_block_seq_len=1048576 is larger than session_len=1024: a block never holds "
            "more than one session; choose at most 1024",
        ),
        (["--num-blocks", "1000000000"], "num_blocks=1000000000 needs "),
    ],
)
def test_generate_refuses_a_pool_the_session_or_memory_cannot_use(
    art: Path, args: list[str], message: str
) -> None:
    """A block longer than the session allocated it whole (13 GB for a 4096-token session);
    a pool larger than memory ended in a traceback from torch's allocator."""
    r = CliRunner().invoke(main, ["generate", str(art), "--prompt", "x", *args])
    assert r.exit_code == 1 and message in r.output and "Traceback" not in r.output, r.output


def test_parse_bytes() -> None:
    assert parse_bytes("24GiB") == 24 * 2**30
    assert parse_bytes("1.5 GB") == 1_500_000_000
    assert parse_bytes(".5KiB") == 512 and parse_bytes("2.GB") == 2 * 10**9
    for text in ("lots", "1.2.3GiB", ".", "", "1e3"):  # "1.2.3GiB" and "." failed in float()
        with pytest.raises(click.BadParameter, match="not a size"):
            parse_bytes(text)


@pytest.mark.parametrize(
    ("template", "says"),
    [
        (b'{{ raise_exception("no system prompt") }}', "cannot render a one-message conversation"),
        (b"", "without the message"),
        (b"{% for m in messages %}{{ m.role }}{% endfor %}", "without the message"),
        (b"\xff\xfe{{ messages }}", "is not UTF-8 text"),
    ],
    ids=["raises", "empty", "drops-content", "not-utf8"],
)
def test_a_broken_chat_template_is_refused_at_load(
    art: Path, tmp_path: Path, template: bytes, says: str
) -> None:
    """`runtime check` ended in a traceback, and `runtime serve` started healthy and failed
    every chat: a template is tried on one message when it loads, and named when it fails."""
    path = tmp_path / "bad.jinja"
    path.write_bytes(template)
    r = CliRunner().invoke(main, ["check", str(art), "--chat-template", str(path)])
    assert r.exit_code == 1 and "Traceback" not in r.output, r.output
    assert f"Error: {path}: the chat template" in r.output and says in r.output, r.output


def test_the_start_up_log_gives_the_weights_in_memory_and_stored(
    art: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """`runtime plan` counts stored bytes and sends CPU users to this line for the rest; the
    line never gave the weights."""
    import logging

    from runtime.plan import weight_bytes

    caplog.set_level(logging.INFO)
    engine = Engine(art, EngineConfig(num_blocks=8))
    stored = weight_bytes(engine.artifact) / 2**30
    held = engine.model.weight_bytes() / 2**30
    assert f"weights {held:.2f} GiB in memory ({stored:.2f} GiB stored)" in caplog.text


def test_api_keys_can_come_from_the_environment(art: Path, monkeypatch) -> None:
    """Only --api-keys took them, which every local user reads in `ps`."""
    monkeypatch.setenv("LITESERVE_API_KEYS", "k1,k2")
    serve = main.commands["serve"]
    with serve.make_context("serve", [str(art)]) as ctx:
        assert ctx.params["api_keys"] == "k1,k2"
    with serve.make_context("serve", [str(art), "--api-keys", "k3"]) as ctx:
        assert ctx.params["api_keys"] == "k3"  # the flag wins, as click's envvar does


def test_a_pipelines_chat_template_file_is_checked_before_loading(
    art: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A missing file read as "no template" (chats failed later, blaming the artifact); a
    str path was an AttributeError after the engine had loaded."""
    import runtime.api
    from runtime.chat_template import ChatTemplateError

    missing = pytest.raises(ChatTemplateError, match="nope.jinja: no such chat template file")
    with missing, monkeypatch.context() as patch:
        patch.setattr(runtime.api, "Engine", None)  # nothing may load before the refusal
        runtime.pipeline(art, chat_template=tmp_path / "nope.jinja")
    mine = tmp_path / "mine.jinja"
    mine.write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    config = EngineConfig(num_blocks=16, kv_quant="none")
    with runtime.pipeline(str(art), config, chat_template=str(mine)) as pipe:
        assert pipe.chat_template.render([{"role": "user", "content": "hi"}]) == "[hi]"
