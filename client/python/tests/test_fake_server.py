"""What a real kvferryd does not do on demand, from an in-process fake server: reason
trailers on unary and streaming errors, and corrupt, reordered or short read streams,
which the client must refuse as DATA_LOSS (and cancel)."""

import threading
import time
from concurrent import futures

import grpc
import pytest

import kvferry

pb = kvferry.v1.kvferry_pb2
pb_grpc = kvferry.v1.kvferry_pb2_grpc
xxhash = pytest.importorskip("xxhash")


def fail(context, code, message, reason):
    context.set_trailing_metadata(((kvferry.REASON_KEY, reason),))
    context.abort(code, message)


def chunk(offset: int, data: bytes, checksum=None) -> pb.PageChunk:
    return pb.PageChunk(offset=offset, data=data, page_bytes=len(data),
                        xxh64=xxhash.xxh64_intdigest(data) if checksum is None else checksum)


class Fake(pb_grpc.KvFerryServicer):
    """ReadPages behaves as the pool's name says."""

    cancelled = threading.Event()  # set when a bad-checksum read was cancelled by the client

    def DescribePool(self, request, context):
        fail(context, grpc.StatusCode.NOT_FOUND, f"no pool named '{request.name}'",
             "POOL_NOT_FOUND")

    def WriteTokens(self, request_iterator, context):
        for message in request_iterator:
            fail(context, grpc.StatusCode.INVALID_ARGUMENT, "row 0 dim 0 is NaN",
                 "NON_FINITE_VALUE")

    def ReadPages(self, request, context):
        if request.pool == "fails-midway":
            yield chunk(0, b"a" * 10)
            fail(context, grpc.StatusCode.FAILED_PRECONDITION, "stale page handle",
                 "STALE_PAGE_HANDLE")
        elif request.pool == "bad-checksum":
            try:
                yield chunk(0, b"a" * 10, checksum=1)
            except GeneratorExit:  # grpc closes the stream once the client cancelled it
                Fake.cancelled.set()
                raise
            end = time.monotonic() + 5
            while context.is_active() and time.monotonic() < end:  # the client hangs up
                time.sleep(0.01)
            if not context.is_active():
                Fake.cancelled.set()
            yield chunk(10, b"never read")
        elif request.pool == "gap":
            yield chunk(0, b"a" * 10)
            yield chunk(20, b"b" * 10)
        elif request.pool == "ok":
            yield chunk(0, b"a" * 10)
            yield chunk(10, b"b" * 5)

    def ReadWorkspace(self, request, context):  # one row short
        rows = bytes(1024 * (len(request.locations) - 1))
        yield pb.WorkspaceChunk(first_row=0, rows=rows, xxh64=xxhash.xxh64_intdigest(rows))


@pytest.fixture(scope="module")
def fake():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_KvFerryServicer_to_server(Fake(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    with kvferry.Client(f"127.0.0.1:{port}", timeout=10) as client:
        yield client
    server.stop(None)


PAGES = kvferry.Pages(16, [0], [1])


def error_of(call, *args, **kwargs) -> kvferry.Error:
    with pytest.raises(kvferry.Error) as info:
        call(*args, **kwargs)
    return info.value


def test_reason_trailers_reach_the_error(fake):
    error = error_of(fake.describe_pool, "x")
    assert (error.code, error.message, error.reason) == (
        grpc.StatusCode.NOT_FOUND, "no pool named 'x'", "POOL_NOT_FOUND")
    error = error_of(fake.write_tokens, "x", 0, bytes(1024), [0], PAGES)  # rows as bytes
    assert (error.code, error.reason) == (grpc.StatusCode.INVALID_ARGUMENT, "NON_FINITE_VALUE")
    error = error_of(fake.read_pages, "fails-midway", PAGES)
    assert (error.code, error.reason) == (grpc.StatusCode.FAILED_PRECONDITION,
                                          "STALE_PAGE_HANDLE")


def test_corrupt_reordered_and_short_streams_are_data_loss(fake):
    error = error_of(fake.read_pages, "bad-checksum", PAGES)
    assert error.code == grpc.StatusCode.DATA_LOSS and "XXH64" in error.message
    assert error.reason == ""
    assert Fake.cancelled.wait(5)  # the client cancelled the rest of the stream
    error = error_of(fake.read_pages, "gap", PAGES)
    assert error.code == grpc.StatusCode.DATA_LOSS and "offset 20" in error.message
    error = error_of(fake.read_workspace, "x", 0, [0, 1], PAGES)
    assert error.code == grpc.StatusCode.DATA_LOSS and "1 rows for 2" in error.message
    assert fake.read_pages("ok", PAGES).tobytes() == b"a" * 10 + b"b" * 5
