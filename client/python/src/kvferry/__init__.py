"""Python client of kvferryd, the DeepSeek-V4 KV-cache sidecar.

    import kvferry
    with kvferry.Client("127.0.0.1:50051") as client:
        client.create_pool("kv", kvferry.Layout.V41, page_size=64, num_pages=1024)
        pages = client.allocate_pages("kv", 4)
        ...

kvferry.Client wraps every rpc of proto/kvferry/v1/kvferry.proto; kvferry.v1 holds the
generated stubs (kvferry_pb2, kvferry_pb2_grpc) for anything else. Every failure is a
kvferry.Error.
"""

from kvferry._arrays import torch_bf16
from kvferry._client import Client, EventStream, Layout
from kvferry._errors import REASON_KEY, Error
from kvferry._pages import Pages

__all__ = ["Client", "Error", "EventStream", "Layout", "Pages", "REASON_KEY", "torch_bf16"]
