"""The hand-written protobuf encodings parse back, with the generated classes, to what
the client meant; chunk parsing and verification reject what they must."""

import grpc
import numpy as np
import pytest

import kvferry
from kvferry import _wire
from kvferry._client import _Assembler

pb = kvferry.v1.kvferry_pb2

EDGES = [0, 1, 127, 128, 300, 16383, 16384, 2**32 - 1, 2**32, 2**56, 2**63, 2**64 - 1]


@pytest.mark.parametrize("value", EDGES)
def test_varint_matches_protobuf(value):
    assert pb.PageHandle.FromString(_wire.varint_field(2, value)).generation == value
    if value:  # protobuf leaves zeros out; _wire writes them
        assert _wire.varint_field(2, value) == pb.PageHandle(generation=value).SerializeToString()
    matrix, lengths = _wire._varints(np.array([value], dtype=np.uint64))
    assert matrix[0, :lengths[0]].tobytes() == _wire.varint(value)


def test_token_locations_parse_back():
    rng = np.random.default_rng(1)
    page_ids = np.array(EDGES + rng.integers(0, 2**63, 50).tolist(), dtype=np.uint64)
    generations = page_ids[::-1].copy()
    slots = np.resize(np.array([0, 1, 127, 128, 4095, 2**32 - 1], dtype=np.uint32), page_ids.size)
    encoded = _wire.token_locations(3, page_ids, generations, slots)
    message = pb.WriteTokensRequest.FromString(encoded)
    assert [(l.page.page_id, l.page.generation, l.slot) for l in message.locations] == list(
        zip(page_ids.tolist(), generations.tolist(), slots.tolist()))
    assert _wire.token_locations(3, page_ids[:0], generations[:0], slots[:0]) == b""


def test_write_tokens_message_parses_with_layer_zero_present():
    header = _wire.bytes_field(1, b"pool") + _wire.varint_field(2, 0)
    rows = np.arange(1024, dtype=np.uint16)
    encoded = b"".join([header, _wire.token_locations(3, np.array([5], np.uint64),
                                                       np.array([2], np.uint64),
                                                       np.array([9], np.uint32)),
                        _wire.bytes_header(4, rows.nbytes), memoryview(rows)])
    message = pb.WriteTokensRequest.FromString(encoded)
    assert (message.pool, message.layer, message.rows) == ("pool", 0, rows.tobytes())
    assert b"\x10\x00" in header  # explicit, so a proto3 `optional` layer reads as set


def test_fields_read_protobuf_chunks_in_place():
    chunk = pb.PageChunk(offset=2**40, data=b"abc" * 1000, xxh64=2**64 - 1, page_bytes=9792)
    raw = chunk.SerializeToString()
    values = dict(_wire.fields(memoryview(raw)))
    assert values[1] == 2**40 and values[3] == 2**64 - 1 and values[4] == 9792
    assert bytes(values[2]) == b"abc" * 1000 and values[2].obj is raw
    for bad in [raw[:-1], b"\x12\x05ab", b"\x08\xff", b"\x0b"]:
        with pytest.raises(ValueError):
            list(_wire.fields(memoryview(bad)))


def test_assembler_refuses_bad_checksums_and_gaps():
    xxhash = pytest.importorskip("xxhash")
    data = memoryview(b"x" * 100)
    assembler = _Assembler(verify=True, capacity=10)
    assembler.append(0, data, xxhash.xxh64_intdigest(b"x" * 100))  # grows past 10
    with pytest.raises(kvferry.Error) as info:
        assembler.append(100, data, 12345)
    assert info.value.code == grpc.StatusCode.DATA_LOSS and "XXH64" in info.value.message
    with pytest.raises(kvferry.Error) as info:
        assembler.append(150, data, xxhash.xxh64_intdigest(b"x" * 100))
    assert info.value.code == grpc.StatusCode.DATA_LOSS and "offset 150" in info.value.message
    assert assembler.result().tobytes() == b"x" * 100
    unverified = _Assembler(verify=False)
    unverified.append(0, data, 12345)
    assert unverified.size == 100


def test_without_xxhash_reads_go_unverified_and_say_so(monkeypatch):
    monkeypatch.setattr(kvferry._client, "_xxhash", None)
    with pytest.warns(RuntimeWarning, match="not verified"):
        client = kvferry.Client("127.0.0.1:1")
    assert client.verify_checksums is False
    with pytest.raises(kvferry.Error) as info:
        kvferry.Client("127.0.0.1:1", verify_checksums=True)
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION


def test_error_pickles():
    import pickle

    error = kvferry.Error(grpc.StatusCode.NOT_FOUND, "no pool named 'x'", "POOL_NOT_FOUND")
    back = pickle.loads(pickle.dumps(error))
    assert (back.code, back.message, back.reason, str(back)) == (
        error.code, error.message, error.reason, str(error))
