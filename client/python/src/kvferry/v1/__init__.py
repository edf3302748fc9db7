"""Generated protobuf and gRPC stubs of proto/kvferry/v1 (made at build time, not committed)."""
