"""kvferry.Client: every kvferryd operation, taking and returning numpy arrays."""

from __future__ import annotations

import collections
import enum
import time
import warnings

import grpc
import numpy as np

from kvferry import _wire
from kvferry._arrays import ROW_BYTES, byte_view, rows_bf16, writable_bytes
from kvferry._errors import Error, from_rpc_error, invalid_argument, translated
from kvferry._pages import Pages
from kvferry.v1 import cache_pb2 as cache_pb
from kvferry.v1 import cache_pb2_grpc as cache_grpc
from kvferry.v1 import kvferry_pb2 as pb
from kvferry.v1 import kvferry_pb2_grpc as pb_grpc
from kvferry.v1 import transfer_pb2 as transfer_pb
from kvferry.v1 import transfer_pb2_grpc as transfer_grpc

try:  # Debian: python3-xxhash
    import xxhash as _xxhash
except ImportError:  # pragma: no cover - depends on the machine
    _xxhash = None

# Python names of the proto's Layout values: Layout.V4, Layout.V41, Layout.V41_FP4.
Layout = enum.IntEnum("Layout", {name.removeprefix("LAYOUT_"): value
                                 for name, value in pb.Layout.items()}, module="kvferry")
Layout.__doc__ = "The record formats (kvferry.v1.Layout without its LAYOUT_ prefix)."

_SERVICE = pb.DESCRIPTOR.services_by_name["KvFerry"]


def _method(name: str) -> str:
    return f"/{_SERVICE.full_name}/{_SERVICE.methods_by_name[name].name}"


def _number(message, field: str) -> int:
    return message.DESCRIPTOR.fields_by_name[field].number


# Bytes of one encoded TokenLocation at most (tags, lengths and three varints), so a
# WriteTokens message of chunk_bytes // (1024 + this) rows stays within chunk_bytes.
_LOCATION_BYTES_MAX = 32


class _Deadline:
    """One deadline over several calls: each gets the seconds the previous ones left."""

    def __init__(self, timeout: float | None):
        self._end = None if timeout is None else time.monotonic() + timeout

    def left(self) -> float | None:
        return None if self._end is None else max(self._end - time.monotonic(), 0.0)


def _uint(value, what: str) -> int:
    """`value` as a non-negative int, else Error(INVALID_ARGUMENT)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise invalid_argument(f"{what} must be a non-negative integer, got {value!r}")
    return int(value)


def _keys(keys) -> list:
    """Block keys as bytes (str keys UTF-8 encoded)."""
    return [bytes(k, "utf-8") if isinstance(k, str) else bytes(k) for k in keys]


def _handles(pages: Pages) -> list:
    return [pb.PageHandle(page_id=int(i), generation=int(g))
            for i, g in zip(pages.ids.tolist(), pages.generations.tolist())]


def _packed(pages: Pages):
    """The pages as a PageList: parsed and checked far faster than handles in a transfer of
    thousands of pages."""
    return pb.PageList(page_ids=pages.ids.tolist(), generations=pages.generations.tolist())


class _BearerToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                   grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds `authorization: Bearer <token>` to every call's metadata."""

    def __init__(self, token: str):
        self._header = ("authorization", f"Bearer {token}")

    def _details(self, details):
        metadata = list(details.metadata or []) + [self._header]
        return details._replace(metadata=metadata) if hasattr(details, "_replace") else \
            _CallDetails(details.method, details.timeout, metadata, details.credentials,
                         getattr(details, "wait_for_ready", None),
                         getattr(details, "compression", None))

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)


class _CallDetails(collections.namedtuple(
        "_CallDetails", ("method", "timeout", "metadata", "credentials", "wait_for_ready",
                         "compression")), grpc.ClientCallDetails):
    pass


class _Assembler:
    """Reassembles a chunked response into one buffer, in order, verifying each chunk.

    Writes into `out` when given (never past its size); otherwise into a numpy buffer of
    `capacity` bytes, grown geometrically if the response is longer (so the total copy
    work stays linear). Every problem is an Error(DATA_LOSS) (INVALID_ARGUMENT for a
    caller's `out` that is too small).
    """

    def __init__(self, verify: bool, capacity: int = 0, out=None):
        self._verify = verify
        self._fixed = out is not None
        self._buffer = (np.empty(capacity, dtype=np.uint8) if out is None
                        else writable_bytes(out))
        self.size = 0

    def reserve(self, total: int) -> None:
        if total > self._buffer.size:
            if self._fixed:
                raise invalid_argument(f"out holds {self._buffer.size} bytes; the response "
                                       f"needs {total}")
            grown = np.empty(max(total, 2 * self._buffer.size), dtype=np.uint8)
            grown[:self.size] = self._buffer[:self.size]
            self._buffer = grown

    def append(self, offset: int, data: memoryview, checksum: int | None) -> None:
        if offset != self.size:
            raise Error(grpc.StatusCode.DATA_LOSS,
                        f"response chunk at offset {offset}, expected {self.size}")
        if self._verify and _xxhash.xxh64_intdigest(data) != checksum:
            raise Error(grpc.StatusCode.DATA_LOSS,
                        f"XXH64 mismatch in the response chunk at offset {offset}")
        end = self.size + len(data)
        self.reserve(end)
        self._buffer[self.size:end] = np.frombuffer(data, dtype=np.uint8)
        self.size = end

    def result(self) -> np.ndarray:
        return self._buffer[:self.size]


class Client:
    """A connection to one kvferryd.

    Every method takes `timeout=` (seconds; the whole call, streams included, must finish
    within it; None: the Client's default) and raises kvferry.Error on failure, with the
    daemon's status code, message and reason. Rows are bf16 bits: uint16 numpy arrays
    [n, 512] or torch CPU bfloat16 tensors. Token locations are int64 `page_id * page_size
    + slot` over a Pages table (from allocate_pages). A Client is thread-safe (gRPC
    channels are); close it, or use it as a context manager, to release the channel.

    Args:
      target: the daemon's gRPC address, "host:port".
      timeout: default deadline of every call, in seconds (None: no deadline).
      chunk_bytes: the most bytes of one write message (rows or page bytes), and the
        chunk size reads ask the daemon for (it clamps that to its own limits). At least
        1056 (one row); keep it below the daemon's --max_message_bytes (4 MiB default).
      verify_checksums: check every read chunk's XXH64 (seed 0). None: when the xxhash
        module is installed (else a RuntimeWarning says chunks go unverified); True:
        always (Error FAILED_PRECONDITION here if xxhash is missing); False: never.
      max_message_bytes: the largest message this channel sends or receives.
      channel: use this channel instead of making one for `target` (the Client then does
        not close it).
      token: sent as `authorization: Bearer <token>` with every call (a daemon started
        with --auth_tokens needs one).
      root_certificates: PEM bytes of the CA that signed the daemon's certificate: the
        channel uses TLS. With `private_key` and `certificate_chain` (PEM bytes) too, it
        presents a client certificate (mutual TLS).
    """

    def __init__(self, target: str = "127.0.0.1:50051", *, timeout: float | None = 30.0,
                 chunk_bytes: int = 1 << 20, verify_checksums: bool | None = None,
                 max_message_bytes: int = 64 << 20, channel: grpc.Channel | None = None,
                 token: str | None = None, root_certificates: bytes | None = None,
                 private_key: bytes | None = None, certificate_chain: bytes | None = None):
        if verify_checksums and _xxhash is None:
            raise Error(grpc.StatusCode.FAILED_PRECONDITION,
                        "verify_checksums=True needs the xxhash module (python3-xxhash)")
        if verify_checksums is None and _xxhash is None:
            warnings.warn("kvferry: the xxhash module is missing, so read chunks' XXH64 are "
                          "not verified (install python3-xxhash)", RuntimeWarning, stacklevel=2)
        if chunk_bytes < ROW_BYTES + _LOCATION_BYTES_MAX:
            raise invalid_argument(f"chunk_bytes must be at least {ROW_BYTES + _LOCATION_BYTES_MAX}")
        self.timeout = timeout
        self.chunk_bytes = int(chunk_bytes)
        self.verify_checksums = _xxhash is not None if verify_checksums is None else verify_checksums
        self._owns_channel = channel is None
        options = [("grpc.max_send_message_length", max_message_bytes),
                   ("grpc.max_receive_message_length", max_message_bytes)]
        if channel is None and root_certificates is not None:
            credentials = grpc.ssl_channel_credentials(root_certificates, private_key,
                                                       certificate_chain)
            channel = grpc.secure_channel(target, credentials, options=options)
        elif channel is None:
            channel = grpc.insecure_channel(target, options=options)
        self._raw_channel = channel
        if token is not None:
            channel = grpc.intercept_channel(channel, _BearerToken(token))
        self._channel = channel
        # The generated stubs, for anything the methods below do not wrap.
        self.stub = pb_grpc.KvFerryStub(self._channel)
        self.cache_stub = cache_grpc.KvCacheStub(self._channel)
        self.transfer_stub = transfer_grpc.TransferStub(self._channel)
        # The bulk RPCs move raw bytes, (de)serialized by _wire.
        self._write_tokens = self._channel.stream_unary(
            _method("WriteTokens"), response_deserializer=pb.WriteResponse.FromString)
        self._write_pages = self._channel.stream_unary(
            _method("WritePages"), response_deserializer=pb.WriteResponse.FromString)
        self._read_pages = self._channel.unary_stream(
            _method("ReadPages"), request_serializer=pb.ReadPagesRequest.SerializeToString)
        self._read_workspace = self._channel.unary_stream(_method("ReadWorkspace"))

    def close(self) -> None:
        """Closes the channel (unless it was given); calls in flight are cancelled."""
        if self._owns_channel:
            self._raw_channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _deadline(self, timeout):
        return self.timeout if timeout is None else timeout

    # ---- control ------------------------------------------------------------------------

    def create_pool(self, name: str, layout: Layout | int, page_size: int, num_pages: int,
                    num_layers: int = 1, device: str = "", *, timeout=None) -> pb.Pool:
        """Creates a zero-filled pool and returns its description (kvferry.v1.Pool).
        device: "cpu" or "cuda:N"; "" is the daemon's default device."""
        request = pb.CreatePoolRequest(
            name=name, layout=_uint(layout, "layout"), page_size=_uint(page_size, "page_size"),
            num_pages=_uint(num_pages, "num_pages"), num_layers=_uint(num_layers, "num_layers"),
            device=device)
        with translated():
            return self.stub.CreatePool(request, timeout=self._deadline(timeout))

    def describe_pool(self, name: str, *, timeout=None) -> pb.Pool:
        with translated():
            return self.stub.DescribePool(pb.DescribePoolRequest(name=name),
                                          timeout=self._deadline(timeout))

    def list_pools(self, *, timeout=None) -> list:
        """Every pool, as kvferry.v1.Pool messages (page after page)."""
        pools, token = [], ""
        with translated():
            while True:
                reply = self.stub.ListPools(pb.ListPoolsRequest(page_token=token),
                                            timeout=self._deadline(timeout))
                pools.extend(reply.pools)
                token = reply.next_page_token
                if not token:
                    return pools

    def delete_pool(self, name: str, *, timeout=None) -> None:
        """Frees the pool's memory; its page handles become NOT_FOUND."""
        with translated():
            self.stub.DeletePool(pb.DeletePoolRequest(name=name), timeout=self._deadline(timeout))

    def allocate_pages(self, pool: str, count: int, *, lease_seconds: int = 0,
                       timeout=None) -> Pages:
        """Allocates `count` pages (all or none) and returns their handles.

        lease_seconds > 0 leases them: each write or read naming a page, and each
        renew_pages, renews the lease for as long again; pages whose lease runs out are
        freed by the daemon (zeroed, their handles stale), so a client that dies leaks
        nothing. Two calls: DescribePool (for the page size the handles carry), then
        AllocatePages, under one deadline."""
        deadline = _Deadline(self._deadline(timeout))
        with translated():
            page_size = self.stub.DescribePool(pb.DescribePoolRequest(name=pool),
                                               timeout=deadline.left()).page_size
            response = self.stub.AllocatePages(
                pb.AllocatePagesRequest(pool=pool, count=_uint(count, "count"),
                                        lease_seconds=_uint(lease_seconds, "lease_seconds")),
                timeout=deadline.left())
        return Pages(page_size, [h.page_id for h in response.pages],
                     [h.generation for h in response.pages])

    def renew_pages(self, pool: str, pages: Pages, *, timeout=None) -> None:
        """Renews the leases of leased pages; every handle is checked first (a stale one
        is kvferry.Error FAILED_PRECONDITION and none is renewed)."""
        with translated():
            self.stub.RenewPages(pb.RenewPagesRequest(pool=pool, pages=_handles(pages)),
                                 timeout=self._deadline(timeout))

    def push(self, pool: str, pages: Pages, to_address: str, to_pool: str, to_pages: Pages, *,
             layers=None, transcode_to: Layout | int = 0,
             timeout=None) -> transfer_pb.TransferPagesResponse:
        """Pages of `pool` on this daemon -> `to_pages` of `to_pool` on the daemon at
        `to_address` (host:port), over UCX between the two daemons; each listed layer (all
        when None) into the same layer, optionally transcoded. All or nothing at the
        destination; returns once the pages are committed and readable there."""
        request = transfer_pb.PushRequest(
            pool=pool, page_list=_packed(pages),
            layers=[_uint(l, "layer") for l in layers or []],
            transcode_to=int(transcode_to), to_address=to_address, to_pool=to_pool,
            to_page_list=_packed(to_pages))
        with translated():
            return self.transfer_stub.Push(request, timeout=self._deadline(timeout))

    def pull(self, from_address: str, from_pool: str, from_pages: Pages, pool: str,
             pages: Pages, *, layers=None, transcode_to: Layout | int = 0,
             timeout=None) -> transfer_pb.TransferPagesResponse:
        """Pages `from_pages` of `from_pool` on the daemon at `from_address` -> `pages` of
        `pool` on this daemon; the same rules as push."""
        request = transfer_pb.PullRequest(
            from_address=from_address, from_pool=from_pool, from_page_list=_packed(from_pages),
            layers=[_uint(l, "layer") for l in layers or []],
            transcode_to=int(transcode_to), pool=pool, page_list=_packed(pages))
        with translated():
            return self.transfer_stub.Pull(request, timeout=self._deadline(timeout))

    def free_pages(self, pool: str, pages: Pages, *, timeout=None) -> None:
        """Frees pages (all or none); their handles go stale."""
        with translated():
            self.stub.FreePages(pb.FreePagesRequest(pool=pool, pages=_handles(pages)),
                                timeout=self._deadline(timeout))

    def get_stats(self, *, timeout=None) -> pb.Stats:
        """Per-pool and total occupancy and byte savings (kvferry.v1.Stats), every page of
        pools merged into one message."""
        with translated():
            stats = self.stub.GetStats(pb.GetStatsRequest(), timeout=self._deadline(timeout))
            while stats.next_page_token:
                page = self.stub.GetStats(pb.GetStatsRequest(page_token=stats.next_page_token),
                                          timeout=self._deadline(timeout))
                stats.pools.extend(page.pools)
                stats.next_page_token = page.next_page_token
            return stats

    # ---- writes -------------------------------------------------------------------------

    def write_tokens(self, pool: str, layer: int, rows, locations, pages: Pages, *,
                     timeout=None) -> pb.WriteResponse:
        """Writes bf16 rows [n, 512] at int64 token locations [n] of one layer.

        The rows are sent in messages of about chunk_bytes, copied once (into each
        message). The daemon stores them only when every message was valid, so a failed
        write (an Error) changes nothing; the one exception is a DEADLINE_EXCEEDED or
        UNAVAILABLE that strikes after the daemon stored the rows but before its answer
        arrived, so after those, write again (rewriting the same rows is harmless).
        Returns the daemon's WriteResponse.
        """
        layer = _uint(layer, "layer")
        rows = rows_bf16(rows)
        page_ids, generations, slots = pages.locate(locations)
        if len(page_ids) != rows.shape[0]:
            raise invalid_argument(f"{rows.shape[0]} rows but {len(page_ids)} locations")
        request = pb.WriteTokensRequest
        header = (_wire.bytes_field(_number(request, "pool"), pool.encode()) +
                  _wire.varint_field(_number(request, "layer"), layer))
        locations_field = _number(request, "locations")
        rows_field = _number(request, "rows")
        # The last message says so: the daemon stores only a write whose end it saw.
        finish = _wire.varint_field(_number(request, "finish_write"), 1)
        per_message = self.chunk_bytes // (ROW_BYTES + _LOCATION_BYTES_MAX)
        flat = rows.reshape(-1).view(np.uint8)

        def messages():
            first = 0
            while True:
                end = min(first + per_message, len(page_ids))
                yield b"".join([
                    header if first == 0 else b"",
                    finish if end >= len(page_ids) else b"",
                    _wire.token_locations(locations_field, page_ids[first:end],
                                          generations[first:end], slots[first:end]),
                    _wire.bytes_header(rows_field, (end - first) * ROW_BYTES),
                    memoryview(flat[first * ROW_BYTES:end * ROW_BYTES])])
                first = end
                if first >= len(page_ids):
                    return

        with translated():
            return self._write_tokens(messages(), timeout=self._deadline(timeout))

    def write_pages(self, pool: str, layout: Layout | int, pages: Pages, data, *,
                    layers=None, timeout=None) -> pb.WriteResponse:
        """Writes already-quantized page bytes in the pool's layout.

        `data` (bytes-like, numpy or torch CPU) is, for each page in order, for each of
        `layers` in order, one page of page_bytes: exactly what read_pages returns.
        layers=None means every layer, and costs one DescribePool call first. `layout`
        must be the pool's (else FAILED_PRECONDITION). All or nothing, as write_tokens.
        """
        flat = byte_view(data, "data")
        deadline = _Deadline(self._deadline(timeout))
        if layers is None:
            with translated():
                num_layers = self.stub.DescribePool(pb.DescribePoolRequest(name=pool),
                                                    timeout=deadline.left()).num_layers
            layers = range(num_layers)
        layers = [_uint(layer, "layer") for layer in layers]
        units = len(pages) * len(layers)
        if units == 0 or flat.size % units:
            raise invalid_argument(f"data holds {flat.size} bytes, not a whole page for each "
                                   f"of {len(pages)} pages x {len(layers)} layers")
        page_bytes = flat.size // units
        request = pb.WritePagesRequest
        header = (_wire.bytes_field(_number(request, "pool"), pool.encode()) +
                  _wire.varint_field(_number(request, "layout"), int(layout)))
        page_field, layer_field = _number(request, "page"), _number(request, "layer")
        offset_field, data_field = _number(request, "offset"), _number(request, "data")
        step = self.chunk_bytes

        def messages():
            start = 0
            for page_id, generation in zip(pages.ids.tolist(), pages.generations.tolist()):
                handle = (_wire.varint_field(1, page_id) + _wire.varint_field(2, generation))
                for layer in layers:
                    for offset in range(0, page_bytes, step):
                        size = min(step, page_bytes - offset)
                        yield b"".join([
                            header if start == 0 else b"",
                            _wire.bytes_field(page_field, handle),
                            _wire.varint_field(layer_field, layer),
                            _wire.varint_field(offset_field, offset),
                            _wire.bytes_header(data_field, size),
                            memoryview(flat[start:start + size])])
                        start += size
            yield _wire.varint_field(_number(request, "finish_write"), 1)  # the write's end

        with translated():
            return self._write_pages(messages(), timeout=deadline.left())

    # ---- reads --------------------------------------------------------------------------

    def _drain(self, call, assembler: _Assembler, fields: dict, on_first=None):
        """Reads a chunk stream into `assembler`; `fields` names the chunk's field numbers
        for 'offset' (or 'first_row' times 1024), 'data' and 'xxh64'."""
        first = True
        try:
            with translated():
                for raw in call:
                    values = {}
                    try:
                        for number, value in _wire.fields(memoryview(raw)):
                            values[number] = value
                    except ValueError as error:
                        raise Error(grpc.StatusCode.DATA_LOSS, f"malformed chunk: {error}") from None
                    if first and on_first is not None:
                        on_first(values)
                    first = False
                    offset = values.get(fields["offset"], 0) * fields.get("scale", 1)
                    data = values.get(fields["data"], memoryview(b""))
                    assembler.append(offset, data, values.get(fields["xxh64"], 0))
        except BaseException:
            call.cancel()
            raise

    def read_pages(self, pool: str, pages: Pages, *, layers=None,
                   transcode_to: Layout | int = 0, out=None, timeout=None) -> np.ndarray:
        """Raw page bytes: for each page in order, for each layer in order (None: all
        layers), one page in the output layout (the pool's, or `transcode_to`'s: every
        written slot re-quantized to it). Returns a uint8 array; with `out` (a writable
        buffer, numpy array or torch CPU tensor) the bytes land there and the returned
        array is a view of them. Each chunk's XXH64 is verified (see verify_checksums).
        """
        layers = None if layers is None else [_uint(layer, "layer") for layer in layers]
        request = pb.ReadPagesRequest(pool=pool, pages=_handles(pages), layers=layers or [],
                                      transcode_to=int(transcode_to),
                                      chunk_bytes=self.chunk_bytes)
        assembler = _Assembler(self.verify_checksums, out=out)
        fields = {name: _number(pb.PageChunk, name) for name in ("offset", "data", "xxh64")}
        page_bytes_field = _number(pb.PageChunk, "page_bytes")

        def size_from_first(values):
            # The whole size when the layers are known; else at least one layer's.
            if out is None:
                assembler.reserve(len(pages) * len(layers or [0]) *
                                  values.get(page_bytes_field, 0))

        self._drain(self._read_pages(request, timeout=self._deadline(timeout)),
                    assembler, fields, size_from_first)
        return assembler.result()

    def read_workspace(self, pool: str, layer: int, locations, pages: Pages, *, out=None,
                       timeout=None) -> np.ndarray:
        """Dequantized bf16 rows [n, 512] (uint16 bits) for int64 token locations [n] of
        one layer, in request order (repeats allowed). With `out` (uint16 numpy [n, 512]
        or a torch CPU bfloat16 tensor) the rows land there; the returned array is a
        view of them. The request must fit the daemon's --max_message_bytes (4 MiB by
        default: about 250k locations)."""
        layer = _uint(layer, "layer")
        page_ids, generations, slots = pages.locate(locations)
        n = len(page_ids)
        request = pb.ReadWorkspaceRequest
        message = b"".join([
            _wire.bytes_field(_number(request, "pool"), pool.encode()),
            _wire.varint_field(_number(request, "layer"), layer),
            _wire.token_locations(_number(request, "locations"), page_ids, generations, slots),
            _wire.varint_field(_number(request, "chunk_bytes"), self.chunk_bytes)])
        assembler = _Assembler(self.verify_checksums, capacity=n * ROW_BYTES, out=out)
        assembler.reserve(n * ROW_BYTES)
        fields = {"offset": _number(pb.WorkspaceChunk, "first_row"), "scale": ROW_BYTES,
                  "data": _number(pb.WorkspaceChunk, "rows"),
                  "xxh64": _number(pb.WorkspaceChunk, "xxh64")}
        self._drain(self._read_workspace(message, timeout=self._deadline(timeout)),
                    assembler, fields)
        if assembler.size != n * ROW_BYTES:
            raise Error(grpc.StatusCode.DATA_LOSS,
                        f"the daemon sent {assembler.size // ROW_BYTES} rows for {n} locations")
        return assembler.result().view(np.uint16).reshape(n, 512)

    # ---- the KV cache (kvferry.v1.KvCache) ------------------------------------------------
    #
    # A namespace argument is the kvferry.v1.Namespace that create_namespace returned (or
    # anything with .name and .digest): its digest goes with every call, and a digest that
    # is not the namespace's fails with FAILED_PRECONDITION, reason NAMESPACE_MISMATCH.

    def create_namespace(self, name: str, pools, *, block_tokens: int, model_fingerprint="",
                         layer_group="", tenant_salt=b"", max_blocks: int = 0,
                         timeout=None) -> cache_pb.Namespace:
        """Creates a namespace of keyed blocks over `pools` (its members, in order); the same
        binding again answers the existing namespace."""
        request = cache_pb.CreateNamespaceRequest(
            name=name, pools=list(pools), block_tokens=_uint(block_tokens, "block_tokens"),
            model_fingerprint=model_fingerprint, layer_group=layer_group,
            tenant_salt=bytes(tenant_salt), max_blocks=_uint(max_blocks, "max_blocks"))
        with translated():
            return self.cache_stub.CreateNamespace(request, timeout=self._deadline(timeout))

    def describe_namespace(self, name: str, *, timeout=None) -> cache_pb.Namespace:
        with translated():
            return self.cache_stub.DescribeNamespace(cache_pb.DescribeNamespaceRequest(name=name),
                                                     timeout=self._deadline(timeout))

    def delete_namespace(self, name: str, *, timeout=None) -> None:
        with translated():
            self.cache_stub.DeleteNamespace(cache_pb.DeleteNamespaceRequest(name=name),
                                            timeout=self._deadline(timeout))

    def put_rows(self, namespace, pool: str, keys, rows, *, layers: int = 1,
                 timeout=None) -> cache_pb.PutResponse:
        """Stores blocks by key from bf16 rows: `rows` [len(keys) * layers * page_size, 512]
        holds, for each key in order and each layer, the block's page_size rows. All or
        nothing; keys already held are skipped (PutResponse.blocks_already_held)."""
        rows = rows_bf16(rows)
        keys = _keys(keys)
        units = len(keys) * _uint(layers, "layers")
        if units == 0 or rows.shape[0] % units:
            raise invalid_argument(f"{rows.shape[0]} rows are not whole blocks of {len(keys)} "
                                   f"keys x {layers} layers")
        per = rows.shape[0] // units

        def messages():
            for i, key in enumerate(keys):
                for layer in range(layers):
                    first = (i * layers + layer) * per
                    message = cache_pb.PutRowsRequest(
                        key=key, layer=layer, rows=rows[first:first + per].tobytes())
                    if i == 0 and layer == 0:
                        message.namespace = namespace.name
                        message.digest = namespace.digest
                        message.pool = pool
                    # The last message says so: the daemon stores only a put whose end it saw.
                    message.finish_write = i == len(keys) - 1 and layer == layers - 1
                    yield message

        with translated():
            return self.cache_stub.PutRows(messages(), timeout=self._deadline(timeout))

    def put_pages(self, namespace, pool: str, layout: Layout | int, keys, records, *,
                  layers: int = 1, timeout=None) -> cache_pb.PutResponse:
        """Stores blocks by key from page records as load_pages returns them: `records`
        (bytes-like or uint8 array) holds, for each key in order and each layer, the block's
        page record in `layout` (the pool's). All or nothing; keys already held are skipped
        (PutResponse.blocks_already_held)."""
        data = byte_view(records, "records")
        keys = _keys(keys)
        units = len(keys) * _uint(layers, "layers")
        if units == 0 or data.size == 0 or data.size % units:
            raise invalid_argument(f"{data.size} bytes are not whole page records of "
                                   f"{len(keys)} keys x {layers} layers")
        per = data.size // units
        chunk = self.chunk_bytes

        def messages():
            for i, key in enumerate(keys):
                for layer in range(layers):
                    first = (i * layers + layer) * per
                    for at in range(0, per, chunk):
                        message = cache_pb.PutPagesRequest(
                            key=key, layer=layer, offset=at,
                            data=data[first + at:first + min(at + chunk, per)].tobytes())
                        if i == 0 and layer == 0 and at == 0:
                            message.namespace = namespace.name
                            message.digest = namespace.digest
                            message.pool = pool
                            message.layout = int(layout)
                        yield message
            # The end of the put: the daemon stores only a put whose end it saw.
            yield cache_pb.PutPagesRequest(finish_write=True)

        with translated():
            return self.cache_stub.PutPages(messages(), timeout=self._deadline(timeout))

    def lookup(self, namespace, keys, *, pools=(), lease_ttl: float = 0,
               timeout=None) -> cache_pb.LookupResponse:
        """The longest prefix of `keys` held by every pool of the group (`pools`; empty:
        every member), and how many keys after it are still being written. With lease_ttl
        (seconds) > 0 the hits are pinned under LookupResponse.lease_id for that long."""
        request = cache_pb.LookupRequest(
            namespace=namespace.name, digest=namespace.digest,
            keys=_keys(keys),
            pools=list(pools), lease_ttl_ms=int(round(lease_ttl * 1000)))
        with translated():
            return self.cache_stub.Lookup(request, timeout=self._deadline(timeout))

    def release_lease(self, namespace, lease_id: int, *, timeout=None) -> None:
        with translated():
            self.cache_stub.ReleaseLease(
                cache_pb.ReleaseLeaseRequest(namespace=namespace.name, lease_id=lease_id),
                timeout=self._deadline(timeout))

    def load_rows(self, namespace, lease_id: int, pool: str, layer: int = 0, *,
                  first_block: int = 0, num_blocks: int = 0, timeout=None) -> np.ndarray:
        """Dequantized bf16 rows [blocks * page_size, 512] (uint16) of leased blocks
        [first_block, first_block + num_blocks) (0: to the end) in one member pool and
        layer. A lease that expired or was released: Error FAILED_PRECONDITION,
        LEASE_EXPIRED."""
        request = cache_pb.LoadRowsRequest(
            namespace=namespace.name, digest=namespace.digest, lease_id=lease_id, pool=pool,
            layer=_uint(layer, "layer"), first_block=_uint(first_block, "first_block"),
            num_blocks=_uint(num_blocks, "num_blocks"), chunk_bytes=self.chunk_bytes)
        assembler = _Assembler(self.verify_checksums)
        fields = {"offset": _number(pb.WorkspaceChunk, "first_row"), "scale": ROW_BYTES,
                  "data": _number(pb.WorkspaceChunk, "rows"),
                  "xxh64": _number(pb.WorkspaceChunk, "xxh64")}
        call = self._channel.unary_stream(
            "/kvferry.v1.KvCache/LoadRows",
            request_serializer=cache_pb.LoadRowsRequest.SerializeToString)
        self._drain(call(request, timeout=self._deadline(timeout)), assembler, fields)
        return assembler.result().view(np.uint16).reshape(-1, 512)

    def load_pages(self, namespace, lease_id: int, pool: str, *, layers=None,
                   transcode_to: Layout | int = 0, first_block: int = 0, num_blocks: int = 0,
                   timeout=None) -> np.ndarray:
        """Page records (uint8) of leased blocks: for each block, each layer (None: all)."""
        request = cache_pb.LoadPagesRequest(
            namespace=namespace.name, digest=namespace.digest, lease_id=lease_id, pool=pool,
            layers=[_uint(layer, "layer") for layer in (layers or [])],
            transcode_to=int(transcode_to), first_block=_uint(first_block, "first_block"),
            num_blocks=_uint(num_blocks, "num_blocks"), chunk_bytes=self.chunk_bytes)
        assembler = _Assembler(self.verify_checksums)
        fields = {name: _number(pb.PageChunk, name) for name in ("offset", "data", "xxh64")}
        call = self._channel.unary_stream(
            "/kvferry.v1.KvCache/LoadPages",
            request_serializer=cache_pb.LoadPagesRequest.SerializeToString)
        self._drain(call(request, timeout=self._deadline(timeout)), assembler, fields)
        return assembler.result()

    def snapshot(self, *, timeout=None) -> tuple:
        """(publisher_id, sequence, blocks): every stored block of the caller's namespaces
        (kvferry.v1.BlockEvent), and the sequence after which events continue from it."""
        publisher, sequence, blocks = 0, 0, []
        with translated():
            for chunk in self.cache_stub.Snapshot(cache_pb.SnapshotRequest(),
                                                  timeout=self._deadline(timeout)):
                publisher, sequence = chunk.publisher_id, chunk.sequence
                blocks.extend(chunk.blocks)
        return publisher, sequence, blocks

    def subscribe_events(self, after_sequence: int = 0, publisher_id: int = 0, *,
                         timeout: float | None = None) -> "EventStream":
        """An iterator of kvferry.v1.EventBatch: the events after `after_sequence`, and
        heartbeats at least every second. Unlike the other calls, a subscription has no
        deadline unless `timeout` is given (the Client's default does not apply): it lasts
        until cancel() or close(). Errors surface from iteration as kvferry.Error:
        EVENTS_LOST (ABORTED: the subscriber fell behind) or PUBLISHER_CHANGED
        (FAILED_PRECONDITION: the daemon restarted): take a snapshot and subscribe again."""
        request = cache_pb.SubscribeEventsRequest(after_sequence=_uint(after_sequence, "after_sequence"),
                                                  publisher_id=_uint(publisher_id, "publisher_id"))
        return EventStream(self.cache_stub.SubscribeEvents(request, timeout=timeout))


class EventStream:
    """A cache event subscription (Client.subscribe_events): iterate it for EventBatch
    messages; cancel() or close() ends it (iteration then stops); a context manager."""

    def __init__(self, call):
        self._call = call
        self._cancelled = False

    def __iter__(self) -> "EventStream":
        return self

    def __next__(self) -> cache_pb.EventBatch:
        try:
            return next(self._call)
        except grpc.RpcError as error:
            if self._cancelled and error.code() == grpc.StatusCode.CANCELLED:
                raise StopIteration from None
            raise from_rpc_error(error) from error

    def cancel(self) -> None:
        self._cancelled = True
        self._call.cancel()

    close = cancel

    def __enter__(self) -> "EventStream":
        return self

    def __exit__(self, *exc) -> None:
        self.cancel()

