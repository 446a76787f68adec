"""The helpers of evals/bench/cpu_isa.py, the GPU check's CPU stage (issue 19): which CPUs it
keeps, which ISA paths it times, and reading engine.py's table back."""

from __future__ import annotations

import random

from evals.bench.cpu_isa import parse_cpu_list, paths, reserve, summarize
from evals.bench.engine import decode_row


def test_cpu_lists_in_the_kernels_format() -> None:
    assert parse_cpu_list("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert parse_cpu_list("5") == [5]


def test_reserve_keeps_whole_cores_and_runs_on_one_cpu_of_each() -> None:
    smt = [[i, i + 8] for i in range(8)]  # 8 cores, siblings 8 apart, as Linux numbers them
    run, kept = reserve(2, smt)
    assert run == [6, 7] and sorted(kept) == [6, 7, 14, 15]
    assert reserve(2, [[0], [1], [2]]) is None  # the rest of the check needs cores too
    assert reserve(2, [[0], [1], [2], [3]]) == ([2, 3], [2, 3])


def test_paths_add_avx2_only_on_an_avx512_host() -> None:
    assert paths({"avx2", "avx512f"}, "x86_64") == ["native", "avx2"]
    assert paths({"avx2", "fma"}, "x86_64") == ["native"]
    assert paths({"asimd", "asimddp"}, "aarch64") == ["native"]


def test_summary_reads_engine_tables_back() -> None:
    rng = random.Random(7)
    rows = {b: [rng.uniform(50, 900), rng.uniform(5, 300), rng.uniform(2, 30)] for b in (1, 8)}
    table = [decode_row(b, pre, dec, hf, None) for b, (pre, dec, hf) in rows.items()]
    table.append(decode_row(16, 1.0, 2.0, 3.0, 4.0))  # a bf16 column as well
    out = "\n".join(
        [
            "CPU: x; SIMD flags: avx2",
            "C kernels' path: avx512-vnni; dispatch: int4 linears ...",
            "| batch | runtime prefill tok/s | runtime decode tok/s | hf fp32 tok/s | ...",
            "|---|---|---|---|---|---|---|",
            *table,
            "| 1 | 623 | 345 | 1.80x |",  # the prefill table: not a decode row
        ]
    )
    pre, dec, hf = rows[1]
    cells = [c.strip() for c in summarize("native", out).strip("|").split("|")]
    assert cells[:2] == ["native", "avx512-vnni"]
    assert cells[2] == f"{dec:.1f}" and cells[3] == "2.0 (batch 16)"
    assert cells[4:] == [f"{pre:.0f}", f"{hf:.1f}", f"{dec / hf:.2f}x"]
    assert "no table" in summarize("avx2", "engine.py crashed")
