"""Pools and pages through the Client, and the generated stubs it exposes."""

import time

import grpc
import numpy as np
import pytest

import kvferry
from conftest import device, random_rows


def test_pool_lifecycle(client):
    pool = client.create_pool("a", kvferry.Layout.V41, 64, 8, num_layers=2, device=device())
    assert (pool.name, pool.layout, pool.page_size, pool.num_pages, pool.num_layers) == (
        "a", kvferry.Layout.V41, 64, 8, 2)
    assert pool.pool_bytes == 2 * 8 * pool.page_bytes
    client.create_pool("b", kvferry.Layout.V4, 16, 2, device=device())
    assert sorted(p.name for p in client.list_pools()) == ["a", "b"]

    pages = client.allocate_pages("a", 3)
    assert len(pages) == 3 and pages.page_size == 64
    assert client.describe_pool("a").pages_used == 3
    client.write_tokens("a", 1, random_rows(2, 1), pages.ids[:1].astype(np.int64) * 64 + [0, 5],
                        pages)
    stats = client.get_stats()
    assert stats.tokens_held == 2 and stats.records_held == 2
    client.free_pages("a", pages[1:])
    assert client.describe_pool("a").pages_free == 7

    client.delete_pool("a")
    assert [p.name for p in client.list_pools()] == ["b"]
    assert client.get_stats().tokens_held == 0


def test_generated_stubs_are_the_package_s(client):
    pb = kvferry.v1.kvferry_pb2
    pool = client.stub.CreatePool(pb.CreatePoolRequest(
        name="s", layout=pb.LAYOUT_V41_FP4, page_size=16, num_pages=1, num_layers=1,
        device=device()))
    assert pool.page_bytes == client.describe_pool("s").page_bytes
    assert int(kvferry.Layout.V41_FP4) == pb.LAYOUT_V41_FP4
    assert kvferry.v1.kvferry_pb2_grpc.KvFerryStub is type(client.stub)


def test_pages_index_and_locate():
    pages = kvferry.Pages(16, [7, 3, 9], [1, 2, 3])
    assert pages[1].ids.tolist() == [3] and pages[[2, 0]].generations.tolist() == [3, 1]
    page_ids, generations, slots = pages.locate(np.array([9 * 16 + 15, 3 * 16, 7 * 16 + 2]))
    assert page_ids.tolist() == [9, 3, 7]
    assert generations.tolist() == [3, 2, 1]
    assert slots.tolist() == [15, 0, 2]


def test_leased_pages_live_while_renewed_and_are_freed_after(client):
    client.create_pool("leased", kvferry.Layout.V41, 16, 8, device=device())
    pages = client.allocate_pages("leased", 3, lease_seconds=1)
    plain = client.allocate_pages("leased", 1)
    for _ in range(3):  # 1.5 s in all: past the lease, but renewed every 0.5 s
        time.sleep(0.5)
        client.renew_pages("leased", pages)
    assert client.describe_pool("leased").pages_used == 4
    deadline = time.monotonic() + 10
    while client.describe_pool("leased").pages_used != 1 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert client.describe_pool("leased").pages_used == 1  # the plain page stays
    with pytest.raises(kvferry.Error) as expired:
        client.renew_pages("leased", pages)
    assert expired.value.code == grpc.StatusCode.FAILED_PRECONDITION, expired.value
    client.free_pages("leased", plain)
    with pytest.raises(kvferry.Error) as negative:
        client.allocate_pages("leased", 1, lease_seconds=-1)
    assert negative.value.code == grpc.StatusCode.INVALID_ARGUMENT, negative.value
