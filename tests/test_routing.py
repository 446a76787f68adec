"""The prefix-affinity routing policy (runtime/server/routing.py): pure functions, no Ray."""

from __future__ import annotations

import pytest

from runtime.server.routing import (
    PrefixTable,
    Route,
    choose_replica,
    request_hashes,
    round_robin,
    text_hashes,
    token_hashes,
)

A = "x" * 256  # one full text block each
B = "y" * 256
C = "z" * 256


def test_hashes_are_chained_over_full_blocks() -> None:
    ab, ac = text_hashes(A + B + "tail"), text_hashes(A + C)
    assert len(ab) == 2  # the partial "tail" block is not hashed
    assert ab[0] == ac[0] and ab[1] != ac[1]  # same first block, different second
    assert text_hashes(B + A)[1] != ab[1]  # hash i covers blocks 0..i, not block i alone
    assert text_hashes("short") == []
    assert len(text_hashes("x" * 256 * 500)) == 128  # bounded per prompt
    ids = list(range(200))
    assert token_hashes(ids)[:2] == token_hashes(ids[:128] + [7] * 60)[:2]
    assert len(token_hashes(ids)) == 3


def test_request_hashes_for_chat_and_completions() -> None:
    system = {"role": "system", "content": A + B}
    one = request_hashes(
        "/v1/chat/completions", {"messages": [system, {"role": "user", "content": "1"}]}
    )
    two = request_hashes(
        "/v1/chat/completions", {"messages": [system, {"role": "user", "content": "2"}]}
    )
    assert len(one) == 2 and one == two  # the shared system prompt is the key
    parts = {"role": "system", "content": [{"type": "text", "text": A + B}]}
    assert request_hashes("/v1/chat/completions", {"messages": [parts]}) == request_hashes(
        "/v1/chat/completions", {"messages": [system]}
    )
    tools = [{"type": "function", "function": {"name": "f"}}]
    with_tools = request_hashes("/v1/chat/completions", {"messages": [system], "tools": tools})
    assert with_tools and with_tools[0] != one[0]
    assert request_hashes("/v1/completions", {"prompt": A + B}) == text_hashes(A + B)
    assert request_hashes("/v1/completions", {"prompt": [A + B, C]}) == text_hashes(A + B)
    assert request_hashes("/v1/completions", {"prompt": list(range(64))}) == token_hashes(
        list(range(64))
    )
    assert request_hashes("/v1/completions", {"prompt": [list(range(64))]}) == token_hashes(
        list(range(64))
    )
    for path, body in [
        ("/v1/models", {}),
        ("/v1/chat/completions", "not a dict"),
        ("/v1/chat/completions", {"messages": "no"}),
        ("/v1/completions", {"prompt": 3}),
    ]:
        assert request_hashes(path, body) == []


def test_affinity_to_the_replica_that_served_the_prefix() -> None:
    table = PrefixTable()
    first = text_hashes(A + B)
    table.record(first, "r1")
    loads = {"r0": 0, "r1": 2}  # r1 is busier but within the imbalance bound
    assert choose_replica(text_hashes(A + B + C), table, loads) == Route("r1", "affinity", 2)
    # shares only the first block: still r1, one block matched
    assert choose_replica(text_hashes(A + C), table, loads) == Route("r1", "affinity", 1)


def test_longest_match_wins() -> None:
    table = PrefixTable()
    table.record(text_hashes(A), "r0")
    table.record(text_hashes(A + B)[1:], "r1")  # only block 2's hash points at r1
    assert choose_replica(text_hashes(A + B), table, {"r0": 0, "r1": 0}).replica == "r1"
    assert choose_replica(text_hashes(A + C), table, {"r0": 0, "r1": 0}).replica == "r0"


def test_overloaded_replica_falls_back_to_least_loaded() -> None:
    table = PrefixTable()
    hashes = text_hashes(A + B)
    table.record(hashes, "r0")
    loads = {"r0": 9, "r1": 5, "r2": 4}
    route = choose_replica(hashes, table, loads, max_imbalance=4)
    assert route == Route("r2", "overloaded", 2)
    assert choose_replica(hashes, table, {**loads, "r0": 8}, max_imbalance=4).replica == "r0"


def test_unknown_prefix_goes_to_least_loaded() -> None:
    table = PrefixTable()
    assert choose_replica(text_hashes(A), table, {"r0": 3, "r1": 1, "r2": 2}) == Route(
        "r1", "new", 0
    )
    assert choose_replica([], table, {"r0": 3, "r1": 1}) == Route("r1", "new", 0)
    # equal loads: the replica owning fewer table entries, so new prefixes spread
    table.record(text_hashes(B), "r0")
    assert choose_replica(text_hashes(A), table, {"r0": 0, "r1": 0}).replica == "r1"
    assert choose_replica(text_hashes(A), PrefixTable(), {"r1": 0, "r0": 0}).replica == "r0"


def test_a_gone_replica_is_not_chosen() -> None:
    table = PrefixTable()
    hashes = text_hashes(A + B)
    table.record(hashes, "r0")
    assert choose_replica(hashes, table, {"r1": 3, "r2": 1}) == Route("r2", "new", 0)
    table.forget("r0")
    assert len(table) == 0 and table.owned("r0") == 0
    with pytest.raises(ValueError):
        choose_replica(hashes, table, {})


def test_table_is_bounded_least_recently_used_out() -> None:
    table = PrefixTable(size=4)
    table.record([1, 2, 3], "r0")
    table.record([4, 5], "r1")  # 1 is the oldest: dropped
    assert len(table) == 4 and table.get(1) is None and table.get(2) == "r0"
    assert table.owned("r0") == 2 and table.owned("r1") == 2
    table.record([2], "r1")  # re-recorded: moves to r1 and becomes the newest
    table.record([6, 7], "r1")  # drops 3 and 4, keeps 2
    assert table.get(2) == "r1" and table.get(3) is None and table.get(4) is None
    assert table.owned("r0") == 0 and table.owned("r1") == 4
    table.record(list(range(100, 200)), "r2")
    assert len(table) == 4 and table.owned("r2") == 4
    with pytest.raises(ValueError):
        PrefixTable(size=0)


def test_round_robin_cycles() -> None:
    assert [round_robin(i, ["b", "a"]) for i in range(4)] == ["a", "b", "a", "b"]
    with pytest.raises(ValueError):
        round_robin(0, [])
