"""Errors: the daemon's status code, message and reason arrive as one kvferry.Error, and
a failed write changes nothing. Arguments the client can check fail before any call."""

import grpc
import numpy as np
import pytest

import kvferry
from conftest import device, expect_reason, random_rows


@pytest.fixture
def pool(client):
    """Pool "p" (V41, 16-token pages, 8 pages, 2 layers) with 20 known rows in layer 1
    of its first two pages; returns (pages, unchanged): 4 handles, and a check that pages
    0-2 and the token count are as they were (the tests free page 3)."""
    client.create_pool("p", kvferry.Layout.V41, 16, 8, num_layers=2, device=device())
    pages = client.allocate_pages("p", 4)
    pages = pages[np.argsort(pages.ids)]
    locs = pages.ids[np.arange(20) // 16].astype(np.int64) * 16 + np.arange(20) % 16
    client.write_tokens("p", 1, random_rows(20, 1), locs, pages)
    before = client.read_pages("p", pages[:3]).tobytes()

    def unchanged() -> bool:
        return (client.read_pages("p", pages[:3]).tobytes() == before
                and client.get_stats().tokens_held == 20)

    return pages, unchanged


def raises(code: grpc.StatusCode, call, *args, **kwargs) -> kvferry.Error:
    with pytest.raises(kvferry.Error) as info:
        call(*args, **kwargs)
    error = info.value
    assert error.code == code, error
    assert isinstance(error.message, str) and error.message
    assert isinstance(error.reason, str)
    return error


def loc(pages: kvferry.Pages, index: int, slot: int) -> int:
    return int(pages.ids[index]) * pages.page_size + slot


def test_unknown_pool_is_not_found(client):
    error = raises(grpc.StatusCode.NOT_FOUND, client.describe_pool, "nope")
    assert "nope" in error.message
    raises(grpc.StatusCode.NOT_FOUND, client.delete_pool, "nope")
    raises(grpc.StatusCode.NOT_FOUND, client.allocate_pages, "nope", 1)
    stray = kvferry.Pages(16, [0], [1])
    raises(grpc.StatusCode.NOT_FOUND, client.write_tokens, "nope", 0, random_rows(1, 2), [0], stray)
    raises(grpc.StatusCode.NOT_FOUND, client.read_pages, "nope", stray)
    raises(grpc.StatusCode.NOT_FOUND, client.read_workspace, "nope", 0, [0], stray)
    expect_reason(error, "POOL_NOT_FOUND")


def test_nan_row_is_invalid_argument_and_writes_nothing(client, pool):
    pages, unchanged = pool
    rows = random_rows(2, 2)
    rows[1, 7] = 0x7FC0
    error = raises(grpc.StatusCode.INVALID_ARGUMENT, client.write_tokens, "p", 1, rows,
                   [loc(pages, 2, 0), loc(pages, 2, 1)], pages)
    assert "row 1 dim 7 is NaN" in error.message
    assert unchanged()
    expect_reason(error, "NON_FINITE_VALUE")


def test_inf_in_a_later_message_leaves_earlier_messages_unwritten(daemon, pool):
    pages, unchanged = pool
    rows = random_rows(4, 3)
    rows[3, 0] = 0xFF80  # -Inf, in the second message of two rows each
    small = kvferry.Client(daemon.address, chunk_bytes=2 * 1056)
    error = raises(grpc.StatusCode.INVALID_ARGUMENT, small.write_tokens, "p", 1, rows,
                   [loc(pages, 0, i) for i in range(4)], pages)
    assert unchanged()
    expect_reason(error, "NON_FINITE_VALUE")


def test_stale_handle_is_failed_precondition(client, pool):
    pages, unchanged = pool
    client.free_pages("p", pages[3])
    error = raises(grpc.StatusCode.FAILED_PRECONDITION, client.write_tokens, "p", 1,
                   random_rows(1, 4), [loc(pages, 3, 0)], pages)
    assert "stale page handle" in error.message
    raises(grpc.StatusCode.FAILED_PRECONDITION, client.read_pages, "p", pages[3])
    raises(grpc.StatusCode.FAILED_PRECONDITION, client.free_pages, "p", pages[3])
    again = client.allocate_pages("p", 1)
    assert again.ids[0] == pages.ids[3] and again.generations[0] != pages.generations[3]
    assert unchanged()
    expect_reason(error, "STALE_PAGE_HANDLE")


def test_pool_full_is_resource_exhausted(client, pool):
    _, unchanged = pool
    error = raises(grpc.StatusCode.RESOURCE_EXHAUSTED, client.allocate_pages, "p", 5)
    assert "is full" in error.message
    assert client.describe_pool("p").pages_used == 4
    assert unchanged()
    expect_reason(error, "POOL_FULL")


def test_other_daemon_refusals_keep_their_codes(client, pool):
    pages, unchanged = pool
    raises(grpc.StatusCode.ALREADY_EXISTS, client.create_pool, "p", kvferry.Layout.V4, 16, 1,
           device=device())
    raises(grpc.StatusCode.INVALID_ARGUMENT, client.create_pool, "bad", kvferry.Layout.V4, 48,
           1, device=device())
    wide = kvferry.Pages(32, pages.ids, pages.generations)  # claims 32-token pages
    raises(grpc.StatusCode.INVALID_ARGUMENT, client.write_tokens, "p", 1, random_rows(1, 5),
           [loc(wide, 2, 20)], wide)  # slot 20 of a 16-token page
    raises(grpc.StatusCode.INVALID_ARGUMENT, client.write_tokens, "p", 1, random_rows(2, 5),
           [loc(pages, 2, 3), loc(pages, 2, 3)], pages)  # written twice
    raises(grpc.StatusCode.INVALID_ARGUMENT, client.write_tokens, "p", 9, random_rows(1, 5),
           [loc(pages, 2, 0)], pages)  # no layer 9
    raises(grpc.StatusCode.FAILED_PRECONDITION, client.write_pages, "p", kvferry.Layout.V4,
           pages[0], bytes(9792), layers=[1])
    raises(grpc.StatusCode.RESOURCE_EXHAUSTED, client.create_pool, "huge", kvferry.Layout.V4,
           4096, 1 << 28, device=device())
    assert unchanged()


def test_client_refuses_bad_arguments_before_calling(client, pool):
    pages, unchanged = pool
    bad = [
        (random_rows(1, 6).astype(np.float32), [loc(pages, 2, 0)], pages),  # not bf16 bits
        (random_rows(1, 6)[:, :256], [loc(pages, 2, 0)], pages),            # not [n, 512]
        (random_rows(2, 6), [loc(pages, 2, 0)], pages),                     # 2 rows, 1 location
        (random_rows(1, 6), [-1], pages),                                   # negative location
        (random_rows(1, 6), [loc(pages, 2, 0)], pages[0]),                  # page not in handles
        (random_rows(1, 6), [[loc(pages, 2, 0)]], pages),                   # locations not 1-D
    ]
    for rows, locations, handles in bad:
        error = raises(grpc.StatusCode.INVALID_ARGUMENT, client.write_tokens, "p", 1, rows,
                       locations, handles)
        assert error.reason == ""
    raises(grpc.StatusCode.INVALID_ARGUMENT, client.write_tokens, "p", -1, random_rows(1, 6),
           [loc(pages, 2, 0)], pages)
    raises(grpc.StatusCode.INVALID_ARGUMENT, client.write_pages, "p", kvferry.Layout.V41,
           pages[:2], bytes(1001), layers=[0])
    raises(grpc.StatusCode.INVALID_ARGUMENT, client.read_workspace, "p", 1, [loc(pages, 2, 0)],
           pages, out=np.zeros((1, 512), dtype=np.uint16)[:, ::2])
    raises(grpc.StatusCode.INVALID_ARGUMENT, kvferry.Pages, 16, [1, 1], [1, 2])
    raises(grpc.StatusCode.INVALID_ARGUMENT, client.allocate_pages, "p", -1)
    raises(grpc.StatusCode.INVALID_ARGUMENT, client.create_pool, "q", kvferry.Layout.V4, -16, 1)
    assert unchanged()


def test_error_carries_the_reason_trailer_when_present():
    class Failed(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.NOT_FOUND

        def details(self):
            return "no pool named 'x'"

        def trailing_metadata(self):
            return (("other", "1"), (kvferry.REASON_KEY, "POOL_NOT_FOUND"))

    with pytest.raises(kvferry.Error) as info:
        with kvferry._errors.translated():
            raise Failed()
    assert (info.value.code, info.value.message, info.value.reason) == (
        grpc.StatusCode.NOT_FOUND, "no pool named 'x'", "POOL_NOT_FOUND")
    assert isinstance(info.value.__cause__, Failed)


def test_unreachable_daemon_is_unavailable():
    with kvferry.Client("127.0.0.1:1", timeout=5) as client:
        raises(grpc.StatusCode.UNAVAILABLE, client.list_pools)
