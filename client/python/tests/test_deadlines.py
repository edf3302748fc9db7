"""Deadlines: every call takes timeout= (default: the Client's); an expired call is
Error(DEADLINE_EXCEEDED), an expired write stores nothing, and the daemon keeps serving."""

import socket
import time

import grpc
import numpy as np
import pytest

import kvferry
from conftest import device, random_rows


@pytest.fixture
def silent_server():
    """An address that accepts TCP connections and never answers, so every call waits
    for its deadline."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    yield f"127.0.0.1:{listener.getsockname()[1]}"
    listener.close()


PAGES = kvferry.Pages(16, [0], [1])
CALLS = {
    "create_pool": lambda c, **t: c.create_pool("x", kvferry.Layout.V4, 16, 1, **t),
    "describe_pool": lambda c, **t: c.describe_pool("x", **t),
    "list_pools": lambda c, **t: c.list_pools(**t),
    "delete_pool": lambda c, **t: c.delete_pool("x", **t),
    "allocate_pages": lambda c, **t: c.allocate_pages("x", 1, **t),
    "free_pages": lambda c, **t: c.free_pages("x", PAGES, **t),
    "write_tokens": lambda c, **t: c.write_tokens("x", 0, random_rows(1, 1), [0], PAGES, **t),
    "write_pages": lambda c, **t: c.write_pages("x", kvferry.Layout.V4, PAGES, bytes(64),
                                                layers=[0], **t),
    "read_pages": lambda c, **t: c.read_pages("x", PAGES, **t),
    "read_workspace": lambda c, **t: c.read_workspace("x", 0, [0], PAGES, **t),
    "get_stats": lambda c, **t: c.get_stats(**t),
}


@pytest.mark.parametrize("method", CALLS)
def test_every_call_ends_at_its_deadline(silent_server, method):
    with kvferry.Client(silent_server, timeout=0.3) as client:
        for timeout, expected in [({}, 0.3), ({"timeout": 0.1}, 0.1)]:  # default, then per call
            start = time.monotonic()
            with pytest.raises(kvferry.Error) as info:
                CALLS[method](client, **timeout)
            elapsed = time.monotonic() - start
            assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
            assert expected * 0.9 <= elapsed < expected + 2, (timeout, elapsed)


@pytest.fixture
def big(client):
    """A pool for 128k tokens and 128 MiB of rows to write into it."""
    client.create_pool("big", kvferry.Layout.V41_FP4, 256, 512, device=device())
    pages = client.allocate_pages("big", 512)
    locs = (pages.ids.astype(np.int64)[:, None] * 256 + np.arange(256)).reshape(-1)
    return pages, locs, np.tile(random_rows(256, 7), (512, 1))


def test_write_past_its_deadline_stores_nothing(client, big):
    pages, locs, rows = big
    start = time.monotonic()
    with pytest.raises(kvferry.Error) as info:
        client.write_tokens("big", 0, rows, locs, pages, timeout=0.05)
    assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - start < 5  # the stream stopped at the deadline
    assert client.get_stats().tokens_held == 0
    # The daemon serves on: the same write with time to finish succeeds.
    assert client.write_tokens("big", 0, rows, locs, pages).tokens_written == len(locs)


def test_read_past_its_deadline_is_deadline_exceeded(client, big):
    pages, locs, rows = big
    client.write_tokens("big", 0, rows, locs, pages)
    with pytest.raises(kvferry.Error) as info:
        client.read_workspace("big", 0, locs, pages, timeout=0.02)
    assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    with pytest.raises(kvferry.Error) as info:
        client.read_pages("big", pages, timeout=0.001)
    assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert np.array_equal(client.read_workspace("big", 0, locs[:256], pages),
                          client.read_workspace("big", 0, locs[-256:], pages))
