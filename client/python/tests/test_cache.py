"""The KV cache through the Python client and a real kvferryd: rows put by key load back as
the goldens' dequantized rows; leases, digests and events behave as cache.proto says."""

import numpy as np
import pytest

import kvferry
from conftest import LAYOUTS, device, expect_reason, golden_cases

CASES = golden_cases()


@pytest.mark.parametrize("layout", LAYOUTS, ids=list(LAYOUTS))
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_put_lookup_load_is_byte_exact_with_the_goldens(client, case, layout):
    blocks = len(case.rows) // case.page_size
    client.create_pool("kv", LAYOUTS[layout], case.page_size, blocks + 1, device=device())
    ns = client.create_namespace("n", ["kv"], block_tokens=case.page_size, model_fingerprint="m")
    keys = [f"block{i}" for i in range(blocks)]
    put = client.put_rows(ns, "kv", keys, case.rows[:blocks * case.page_size])
    assert put.blocks_stored == blocks
    hit = client.lookup(ns, keys + ["absent"], lease_ttl=30)
    assert hit.hit_blocks == blocks and hit.hit_tokens == blocks * case.page_size
    rows = client.load_rows(ns, hit.lease_id, "kv")
    expected = case.array(f"dequant.{layout}.bf16")[:blocks * case.page_size]
    assert np.array_equal(rows, expected)
    assert client.put_rows(ns, "kv", keys, case.rows[:blocks * case.page_size]).blocks_already_held == blocks
    records = client.load_pages(ns, hit.lease_id, "kv")
    assert records.size == blocks * case.layouts[layout]["page_bytes"]
    # The records put by key into another namespace (in chunks smaller than a record, so
    # that a page arrives over several messages) load as the same rows and records.
    client.create_pool("kv2", LAYOUTS[layout], case.page_size, blocks + 1, device=device())
    ns2 = client.create_namespace("n2", ["kv2"], block_tokens=case.page_size, model_fingerprint="m")
    small = kvferry.Client(channel=client._channel, chunk_bytes=2048)
    assert small.put_pages(ns2, "kv2", LAYOUTS[layout], keys, records).blocks_stored == blocks
    hit2 = client.lookup(ns2, keys, lease_ttl=30)
    assert hit2.hit_blocks == blocks
    assert np.array_equal(client.load_rows(ns2, hit2.lease_id, "kv2"), expected)
    assert np.array_equal(client.load_pages(ns2, hit2.lease_id, "kv2"), records)
    # Records that do not split into the keys, a record cut short, or records said to be of
    # another layout: refused, nothing stored.
    page_bytes = records.size // blocks
    with pytest.raises(kvferry.Error) as ragged:
        client.put_pages(ns2, "kv2", LAYOUTS[layout], ["x", "z"], records[:3])
    assert ragged.value.code.name == "INVALID_ARGUMENT"
    with pytest.raises(kvferry.Error):
        client.put_pages(ns2, "kv2", LAYOUTS[layout], ["x"], records[:page_bytes - 1])
    other = next(v for k, v in LAYOUTS.items() if k != layout)
    with pytest.raises(kvferry.Error):
        client.put_pages(ns2, "kv2", other, ["y"], records[:page_bytes])
    assert client.lookup(ns2, ["x"]).hit_blocks == 0 and client.lookup(ns2, ["y"]).hit_blocks == 0


def test_leases_digests_and_events(client):
    client.create_pool("kv", kvferry.Layout.V41, 16, 4, device=device())
    ns = client.create_namespace("n", ["kv"], block_tokens=16)
    rows = np.zeros((16, 512), dtype=np.uint16)
    client.put_rows(ns, "kv", ["a"], rows)
    hit = client.lookup(ns, ["a"], lease_ttl=30)
    client.release_lease(ns, hit.lease_id)
    with pytest.raises(kvferry.Error) as released:
        client.load_rows(ns, hit.lease_id, "kv")
    assert released.value.code.name == "FAILED_PRECONDITION"
    expect_reason(released.value, "LEASE_EXPIRED")
    publisher, sequence, blocks = client.snapshot()
    assert sequence == 1 and [b.key for b in blocks] == [b"a"]
    events = client.subscribe_events(after_sequence=0, publisher_id=publisher)
    batch = next(events)
    assert batch.publisher_id == publisher and batch.events[0].key == b"a"
    events.cancel()
    assert list(events) == []  # a cancelled subscription ends its iteration
    # A subscription's failure is a kvferry.Error with the daemon's reason, as any call's.
    with client.subscribe_events(after_sequence=0, publisher_id=publisher ^ 1) as gone:
        with pytest.raises(kvferry.Error) as changed:
            next(gone)
    assert changed.value.code.name == "FAILED_PRECONDITION"
    expect_reason(changed.value, "PUBLISHER_CHANGED")
    with pytest.raises(kvferry.Error) as negative:
        client.subscribe_events(after_sequence=-1)
    assert negative.value.code.name == "INVALID_ARGUMENT"

    class Wrong:
        name, digest = ns.name, ns.digest ^ 1
    with pytest.raises(kvferry.Error) as mismatch:
        client.lookup(Wrong, ["a"])
    expect_reason(mismatch.value, "NAMESPACE_MISMATCH")
