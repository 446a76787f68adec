"""Which CPU kernel runs an op at a given row count: measured on this host, not hard-coded.

The crossovers between the C kernels and torch's move by an order of magnitude from machine to
machine (an AVX-512 host with bf16 and an AVX2-only one disagree about every one of them), so
the backend times each candidate path at a few row counts on a mid-size shape the first time
it runs on a host, and keeps the table in the liteserve cache (runtime/cache.py: atomic, one
writer), keyed by the kernel library (its sources, ISA and compiler), torch's version, the
activation dtype and the thread count. Later starts read the table, so a host always makes the
same choices; deleting the file measures again. `runtime -v` prints the table at start-up.

Timing is the best of several interleaved runs after a warm-up: the least disturbed one, with
every candidate timed in each round so a disturbance hits them alike. A path stays
chosen at the next row count unless another beats it by KEEP_FACTOR, so timing noise between
near-equal paths does not make the table flip back and forth. A path that loses by more than
LOSER_FACTOR at some row count is not timed at larger ones (torch's fp32 int4 kernel would
otherwise cost seconds at 256 rows).

Interleaving evens out drift, not contention: another process on the cores the kernels use
slows the multi-threaded paths more than the others (a descheduled OpenMP thread stalls its
team at every barrier). A table measured while the test suite ran beside it on a 2-core
host put the lm_head on the fp32 C path for good, 4.5x slower at one row than int8 on a quiet
host. So the host's CPU time is read from /proc/stat around the measurement, and a table
measured while other work took more than DISTURBED of the CPU time its threads needed (beyond
the CPUs they left free; a hypervisor's steal counts) is used by that process only: the next
start measures again, until a quiet one keeps it.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from runtime.cache import CacheUnwritable, cache_root, cached_entry

log = logging.getLogger(__name__)

ROW_POINTS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
MIN_RUNS, MIN_SECONDS, MAX_RUNS = 5, 0.02, 200  # short calls repeat until 20 ms are spent
LOSER_FACTOR = 4.0
KEEP_FACTOR = 1.1  # the previous row count's path stays unless another beats it by 10%
TABLE_VERSION = 2  # bump when the candidates or the measurement change (2: interleaved)
DISTURBED = 0.1  # share of the measuring threads' CPU time other work may take: kept below
MIN_JUDGED_S = 0.5  # shorter measurements are not judged (/proc/stat counts 10 ms ticks)

# what the table chooses among, per op: for int4 linears ("int8-unpacked": the same kernel
# unpacking each column tile's codes once for all its row tiles; same bits, faster only at
# many rows) and for the logits
PATHS = {"int4": ("int8", "int8-unpacked", "torch-int4", "dense"), "logits": ("int8", "c", "torch")}

# path -> (rows -> a zero-argument call that runs the path once at that row count)
Candidates = dict[str, Callable[[int], Callable[[], object]]]


@dataclass(frozen=True)
class Choice:
    """The fastest path at each measured row count; between them the next larger point's."""

    points: tuple[tuple[int, str], ...]

    def pick(self, rows: int) -> str:
        for limit, path in self.points:
            if rows <= limit:
                return path
        return self.points[-1][1]

    def paths(self) -> set[str]:
        return {path for _, path in self.points}

    def describe(self) -> str:
        """'int8 up to 64 rows, dense above' style."""
        runs: list[list] = []
        for limit, path in self.points:
            if runs and runs[-1][1] == path:
                runs[-1][0] = limit
            else:
                runs.append([limit, path])
        parts = [f"{path} up to {limit} rows" for limit, path in runs[:-1]]
        parts.append(f"{runs[-1][1]} {'above' if parts else 'always'}")
        return ", ".join(parts)


def _best_times(runs: dict[str, Callable[[], object]]) -> dict[str, float]:
    """Each candidate's best time over interleaved rounds, one call of each per round: a
    disturbance (another process taking a core for a second) then slows every candidate alike
    instead of the one whose turn it was. Timed one after the other, a table of this 2-core
    host once kept the lm_head on torch's fp32 path for good, 4-6x slower at one row than the
    int8 path it lost to by chance."""
    for run in runs.values():
        run()  # warm-up
    best = dict.fromkeys(runs, float("inf"))
    spent = dict.fromkeys(runs, 0.0)
    rounds = 0
    while rounds < MIN_RUNS or (min(spent.values()) < MIN_SECONDS and rounds < MAX_RUNS):
        for path, run in runs.items():
            start = time.perf_counter()
            run()
            took = time.perf_counter() - start
            best[path], spent[path] = min(best[path], took), spent[path] + took
        rounds += 1
    return best


Timings = dict[int, dict[str, float]]  # rows -> path -> best seconds (clear losers absent)


def measure(candidates: Candidates, points: tuple[int, ...] = ROW_POINTS) -> Timings:
    """Time every candidate at every row count (dropping clear losers as rows grow)."""
    alive = dict(candidates)
    timings: Timings = {}
    for rows in points:
        times = _best_times({path: make(rows) for path, make in alive.items()})
        timings[rows] = times
        fastest = min(times.values())
        alive = {p: m for p, m in alive.items() if times[p] <= LOSER_FACTOR * fastest}
    return timings


def choose(timings: Timings) -> Choice:
    """The fastest path at each row count, keeping the previous one through near ties; a path
    without a timing at some row count (dropped as a loser) is out there."""
    chosen: list[tuple[int, str]] = []
    for rows, times in timings.items():
        fastest = min(times, key=times.get)
        previous = chosen[-1][1] if chosen else None
        if previous in times and times[previous] <= KEEP_FACTOR * times[fastest]:
            fastest = previous
        chosen.append((rows, fastest))
    return Choice(tuple(chosen))


CpuTime = tuple[float, float, int]  # (seconds used on this process's CPUs, by it, CPU count)


def cpu_time() -> CpuTime | None:
    """CPU seconds used so far on the CPUs this process may run on (busy = every /proc/stat
    field but idle and iowait, a hypervisor's steal included) and by this process; None where
    there is no /proc/stat. Work on other CPUs (outside a container's cpuset) does not count."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return None
    mine = {f"cpu{n}" for n in os.sched_getaffinity(0)}
    busy = 0
    for line in lines:
        name, *fields = line.split()
        if name in mine:  # user nice system idle iowait irq softirq steal
            ticks = [int(v) for v in fields[:8]]
            busy += sum(ticks) - ticks[3] - ticks[4]
    own = os.times()
    return busy / os.sysconf("SC_CLK_TCK"), own.user + own.system, len(mine)


def contention(before: CpuTime, after: CpuTime, wall: float, threads: int) -> float:
    """The share of `threads` CPUs over `wall` seconds that other work took: its CPU time on
    this process's CPUs beyond what the ones the threads leave free could hold."""
    others = max(0.0, (after[0] - before[0]) - (after[1] - before[1]))
    spare = max(0, after[2] - threads) * wall
    return max(0.0, others - spare) / (threads * wall)


def parse_table(table: object) -> dict[str, Choice]:
    """A table as written: every op of PATHS, each a non-empty list of [rows, path] with rows
    rising and paths of that op. Anything else (a hand edit, a table of renamed paths that a
    key without the kernel library's hash, torch-only-..., outlived) is a ValueError, so it is
    measured again instead of failing every start with a KeyError or IndexError."""
    if not isinstance(table, dict) or set(table) != set(PATHS):
        raise ValueError(f"expected the ops {sorted(PATHS)}")
    choices = {}
    for op, points in table.items():
        if not isinstance(points, list) or not points or not all(_pair(p) for p in points):
            raise ValueError(f"{op}: expected a non-empty list of [rows, path]")
        rows = [r for r, _ in points]
        if any(type(r) is not int or r < 1 for r in rows) or rows != sorted(set(rows)):
            raise ValueError(f"{op}: row counts must be rising positive integers, not {rows}")
        unknown = {p for _, p in points} - set(PATHS[op])
        if unknown:
            raise ValueError(f"{op}: unknown paths {sorted(map(str, unknown))}")
        choices[op] = Choice(tuple((r, p) for r, p in points))
    return choices


def _pair(point: object) -> bool:
    return isinstance(point, list) and len(point) == 2


class _Disturbed(Exception):
    """The table was measured beside other work: not written (cached_entry keeps nothing)."""


def cached_choices(
    key: str,
    measure_all: Callable[[], dict[str, Choice]],
    threads: int = 1,
    remeasure: bool = True,
) -> dict[str, Choice]:
    """The host's table for `key` from the cache, measuring and writing it the first time.
    A table measured beside other work (above) or with an unwritable cache is used by this
    process only; an unreadable one (tables are written atomically, so a damaged disk or a
    hand edit) is measured again and replaced. `threads`: how many the measured kernels run."""
    target = cache_root() / "dispatch" / f"{key}-v{TABLE_VERSION}.json"
    measured: dict[str, Choice] = {}

    def write(tmp: Path) -> None:
        before, start = cpu_time(), time.perf_counter()
        measured.update(measure_all())
        wall, after = time.perf_counter() - start, cpu_time()
        if before and after and wall >= MIN_JUDGED_S:
            share = contention(before, after, wall, threads)
            if share > DISTURBED:
                raise _Disturbed(f"{share:.0%}")
        table = {op: [list(p) for p in c.points] for op, c in measured.items()}
        tmp.write_text(json.dumps(table, indent=1))

    try:
        path = cached_entry(target, write)
    except CacheUnwritable as e:
        log.warning("CPU dispatch table not cached (%s)", e)
        return measured or measure_all()
    except _Disturbed as e:
        log.warning(
            "other work took %s of the CPU time while the CPU dispatch table was measured: "
            "this process uses it, and the next start measures again (a table measured on a "
            "busy host can pick paths several times slower)",
            e,
        )
        return measured
    if measured:
        return measured
    try:
        return parse_table(json.loads(path.read_text()))
    except ValueError as e:
        if not remeasure:
            raise RuntimeError(f"the CPU dispatch table {path} is unreadable ({e})") from e
        log.warning("the CPU dispatch table %s is unreadable (%s): measuring again", path, e)
        path.unlink(missing_ok=True)  # readers see it whole or not at all, then rebuild it
        return cached_choices(key, measure_all, threads, remeasure=False)
