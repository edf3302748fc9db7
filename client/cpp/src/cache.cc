// The KV cache calls of the C++ client (kvferry.v1.KvCache).
#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "client_impl.h"

namespace kvferry::client {
namespace {

NamespaceInfo FromProto(const v1::Namespace& ns) {
  NamespaceInfo info;
  info.name = ns.name();
  info.digest = ns.digest();
  info.block_tokens = ns.block_tokens();
  info.max_blocks = ns.max_blocks();
  for (const v1::NamespaceMember& m : ns.members()) {
    info.members.push_back({m.pool(), m.pool_id(), internal::FromProto(m.layout()), m.page_size(),
                            m.num_layers(), m.tier(), m.blocks()});
  }
  return info;
}

// Reads a chunked stream of unknown total size into `out`, checking offsets and hashes.
template <typename Chunk, typename Reader>
absl::Status Collect(grpc::ClientContext& ctx, Reader& reader, std::string* out,
                     const std::function<uint64_t(const Chunk&)>& offset_of,
                     const std::function<const std::string&(const Chunk&)>& data_of) {
  Chunk chunk;
  absl::Status local;
  while (local.ok() && reader.Read(&chunk)) {
    const std::string& data = data_of(chunk);
    if (offset_of(chunk) != out->size()) {
      local = absl::DataLossError(
          absl::StrCat("chunk at offset ", offset_of(chunk), ", expected ", out->size()));
    } else if (XXH64(data.data(), data.size(), 0) != chunk.xxh64()) {
      local = absl::DataLossError(absl::StrCat("chunk at offset ", out->size(), " fails its XXH64"));
    } else {
      out->append(data);
    }
  }
  if (!local.ok()) {
    ctx.TryCancel();
    while (reader.Read(&chunk)) {
    }
    reader.Finish().IgnoreError();
    out->clear();
    return local;
  }
  const absl::Status s = FromGrpc(reader.Finish(), ctx);
  if (!s.ok()) out->clear();
  return s;
}

}  // namespace

absl::StatusOr<NamespaceInfo> Client::CreateNamespace(const NamespaceSpec& spec, CallOptions call) {
  v1::CreateNamespaceRequest req;
  req.set_name(spec.name);
  req.set_model_fingerprint(spec.model_fingerprint);
  req.set_layer_group(spec.layer_group);
  req.set_tenant_salt(spec.tenant_salt);
  req.set_block_tokens(spec.block_tokens);
  for (const std::string& p : spec.pools) req.add_pools(p);
  req.set_max_blocks(spec.max_blocks);
  v1::Namespace ns;
  KVF_CLIENT_RETURN(impl_->UnaryOn(*impl_->cache, &v1::KvCache::Stub::CreateNamespace, req, &ns, call));
  return FromProto(ns);
}

absl::StatusOr<NamespaceInfo> Client::DescribeNamespace(const std::string& name, CallOptions call) {
  v1::DescribeNamespaceRequest req;
  req.set_name(name);
  v1::Namespace ns;
  KVF_CLIENT_RETURN(impl_->UnaryOn(*impl_->cache, &v1::KvCache::Stub::DescribeNamespace, req, &ns, call));
  return FromProto(ns);
}

absl::Status Client::DeleteNamespace(const std::string& name, CallOptions call) {
  v1::DeleteNamespaceRequest req;
  req.set_name(name);
  v1::DeleteNamespaceResponse resp;
  return impl_->UnaryOn(*impl_->cache, &v1::KvCache::Stub::DeleteNamespace, req, &resp, call);
}

absl::StatusOr<PutResult> Client::PutRows(const NamespaceRef& ns, const std::string& pool,
                                          std::span<const BlockRows> blocks, CallOptions call) {
  const size_t per_message = static_cast<size_t>(impl_->options.message_bytes / kRowBytes);
  for (const BlockRows& b : blocks) {
    if (b.rows.empty() || b.rows.size() % kRowValues != 0) {
      return absl::InvalidArgumentError(absl::StrCat("block ", b.key, ": ", b.rows.size(),
                                                     " values are not whole rows of 512"));
    }
  }
  PutResult result;
  KVF_CLIENT_RETURN(impl_->Retry([&]() -> absl::Status {
    grpc::ClientContext ctx;
    impl_->Prepare(ctx, call);
    v1::PutResponse resp;
    auto writer = impl_->cache->PutRows(&ctx, &resp);
    bool first = true, open = true;
    for (const BlockRows& b : blocks) {
      const size_t rows = b.rows.size() / kRowValues;
      for (size_t at = 0; open && at < rows; at += per_message) {
        const size_t n = std::min(per_message, rows - at);
        v1::PutRowsRequest msg;
        if (first) {
          msg.set_namespace_(ns.name);
          msg.set_digest(ns.digest);
          msg.set_pool(pool);
          first = false;
        }
        msg.set_key(b.key);
        msg.set_layer(b.layer);
        msg.set_first_slot(static_cast<uint32_t>(b.first_slot + at));
        msg.set_rows(reinterpret_cast<const char*>(b.rows.data() + at * kRowValues), n * kRowBytes);
        open = writer->Write(msg);
      }
    }
    if (open && !first) {  // the end of the put (an empty one is refused EMPTY_WRITE)
      v1::PutRowsRequest msg;
      msg.set_finish_write(true);
      writer->Write(msg);
    }
    writer->WritesDone();
    KVF_CLIENT_RETURN(FromGrpc(writer->Finish(), ctx));
    result = {resp.blocks_stored(), resp.blocks_already_held(), resp.bytes_received()};
    return absl::OkStatus();
  }));
  return result;
}

absl::StatusOr<PutResult> Client::PutPages(const NamespaceRef& ns, const std::string& pool,
                                           Layout layout, std::span<const BlockRecords> blocks,
                                           CallOptions call) {
  const size_t per_message = static_cast<size_t>(impl_->options.message_bytes);
  PutResult result;
  KVF_CLIENT_RETURN(impl_->Retry([&]() -> absl::Status {
    grpc::ClientContext ctx;
    impl_->Prepare(ctx, call);
    v1::PutResponse resp;
    auto writer = impl_->cache->PutPages(&ctx, &resp);
    bool first = true, open = true;
    for (const BlockRecords& b : blocks) {
      for (size_t at = 0; open && at < b.data.size(); at += per_message) {
        const size_t n = std::min(per_message, b.data.size() - at);
        v1::PutPagesRequest msg;
        if (first) {
          msg.set_namespace_(ns.name);
          msg.set_digest(ns.digest);
          msg.set_pool(pool);
          msg.set_layout(ToProto(layout));
          first = false;
        }
        msg.set_key(b.key);
        msg.set_layer(b.layer);
        msg.set_offset(at);
        msg.set_data(reinterpret_cast<const char*>(b.data.data() + at), n);
        open = writer->Write(msg);
      }
    }
    if (open && !first) {  // the end of the put (an empty one is refused EMPTY_WRITE)
      v1::PutPagesRequest msg;
      msg.set_finish_write(true);
      writer->Write(msg);
    }
    writer->WritesDone();
    KVF_CLIENT_RETURN(FromGrpc(writer->Finish(), ctx));
    result = {resp.blocks_stored(), resp.blocks_already_held(), resp.bytes_received()};
    return absl::OkStatus();
  }));
  return result;
}

absl::StatusOr<LookupResult> Client::Lookup(const NamespaceRef& ns, std::span<const std::string> keys,
                                            const LookupOptions& options, CallOptions call) {
  v1::LookupRequest req;
  req.set_namespace_(ns.name);
  req.set_digest(ns.digest);
  for (const std::string& k : keys) req.add_keys(k);
  for (const std::string& p : options.pools) req.add_pools(p);
  req.set_lease_ttl_ms(static_cast<uint32_t>(absl::ToInt64Milliseconds(options.lease_ttl)));
  v1::LookupResponse resp;
  KVF_CLIENT_RETURN(impl_->UnaryOn(*impl_->cache, &v1::KvCache::Stub::Lookup, req, &resp, call));
  LookupResult r;
  r.hit_blocks = resp.hit_blocks();
  r.pending_blocks = resp.pending_blocks();
  r.hit_tokens = resp.hit_tokens();
  r.lease_id = resp.lease_id();
  r.lease_expiry = absl::FromUnixMillis(resp.lease_expires_unix_ms());
  return r;
}

absl::Status Client::ReleaseLease(const NamespaceRef& ns, uint64_t lease_id, CallOptions call) {
  v1::ReleaseLeaseRequest req;
  req.set_namespace_(ns.name);
  req.set_lease_id(lease_id);
  v1::ReleaseLeaseResponse resp;
  return impl_->UnaryOn(*impl_->cache, &v1::KvCache::Stub::ReleaseLease, req, &resp, call);
}

absl::StatusOr<std::vector<uint16_t>> Client::LoadRows(const NamespaceRef& ns, uint64_t lease_id,
                                                       const std::string& pool, uint32_t layer,
                                                       BlockRange blocks, CallOptions call) {
  v1::LoadRowsRequest req;
  req.set_namespace_(ns.name);
  req.set_digest(ns.digest);
  req.set_lease_id(lease_id);
  req.set_pool(pool);
  req.set_layer(layer);
  req.set_first_block(blocks.first);
  req.set_num_blocks(blocks.count);
  req.set_chunk_bytes(static_cast<uint32_t>(impl_->options.message_bytes));
  std::string bytes;
  KVF_CLIENT_RETURN(impl_->Retry([&]() -> absl::Status {
    grpc::ClientContext ctx;
    impl_->Prepare(ctx, call);
    bytes.clear();
    auto reader = impl_->cache->LoadRows(&ctx, req);
    return Collect<v1::WorkspaceChunk>(
        ctx, *reader, &bytes, [](const v1::WorkspaceChunk& c) { return c.first_row() * kRowBytes; },
        [](const v1::WorkspaceChunk& c) -> const std::string& { return c.rows(); });
  }));
  std::vector<uint16_t> rows(bytes.size() / 2);
  if (!bytes.empty()) std::memcpy(rows.data(), bytes.data(), bytes.size());
  return rows;
}

absl::StatusOr<std::vector<uint8_t>> Client::LoadPages(const NamespaceRef& ns, uint64_t lease_id,
                                                       const std::string& pool,
                                                       std::span<const uint32_t> layers,
                                                       std::optional<Layout> transcode_to,
                                                       BlockRange blocks, CallOptions call) {
  v1::LoadPagesRequest req;
  req.set_namespace_(ns.name);
  req.set_digest(ns.digest);
  req.set_lease_id(lease_id);
  req.set_pool(pool);
  for (uint32_t l : layers) req.add_layers(l);
  if (transcode_to.has_value()) req.set_transcode_to(ToProto(*transcode_to));
  req.set_first_block(blocks.first);
  req.set_num_blocks(blocks.count);
  req.set_chunk_bytes(static_cast<uint32_t>(impl_->options.message_bytes));
  std::string bytes;
  KVF_CLIENT_RETURN(impl_->Retry([&]() -> absl::Status {
    grpc::ClientContext ctx;
    impl_->Prepare(ctx, call);
    bytes.clear();
    auto reader = impl_->cache->LoadPages(&ctx, req);
    return Collect<v1::PageChunk>(
        ctx, *reader, &bytes, [](const v1::PageChunk& c) { return c.offset(); },
        [](const v1::PageChunk& c) -> const std::string& { return c.data(); });
  }));
  return std::vector<uint8_t>(bytes.begin(), bytes.end());
}

}  // namespace kvferry::client
