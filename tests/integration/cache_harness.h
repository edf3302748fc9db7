// Calls of the KvCache service against a real kvferryd (daemon_harness.h), for the tests and
// the benchmark: one helper per rpc, failing the test on transport surprises only.
#pragma once

#include <xxhash.h>

#include <cstring>
#include <string>
#include <vector>

#include "daemon_harness.h"
#include "kvferry/v1/cache.grpc.pb.h"

namespace kvferry::testing {

// A call's outcome: status and error reason.
struct CallResult {
  grpc::Status status;
  std::string reason;
  bool ok() const { return status.ok(); }
};

class Cache {
 public:
  explicit Cache(Daemon& d) : stub_(v1::KvCache::NewStub(d.channel())) {}
  explicit Cache(std::shared_ptr<grpc::Channel> channel) : stub_(v1::KvCache::NewStub(channel)) {}
  v1::KvCache::Stub& stub() { return *stub_; }

  CallResult CreateNamespace(const v1::CreateNamespaceRequest& req, v1::Namespace* out) {
    grpc::ClientContext ctx;
    const grpc::Status s = stub_->CreateNamespace(&ctx, req, out);
    return {s, ReasonOf(ctx)};
  }
  // A namespace over `pools`; fails the test on error.
  v1::Namespace Namespace(const std::string& name, const std::vector<std::string>& pools,
                          uint32_t block_tokens = 64, const std::string& model = "model-a",
                          uint64_t max_blocks = 0) {
    v1::CreateNamespaceRequest req;
    req.set_name(name);
    req.set_model_fingerprint(model);
    req.set_layer_group("all");
    req.set_tenant_salt("salt");
    req.set_block_tokens(block_tokens);
    req.set_max_blocks(max_blocks);
    for (const auto& p : pools) req.add_pools(p);
    v1::Namespace ns;
    const CallResult r = CreateNamespace(req, &ns);
    EXPECT_TRUE(r.ok()) << r.status.error_message();
    return ns;
  }
  CallResult DeleteNamespace(const std::string& name) {
    grpc::ClientContext ctx;
    v1::DeleteNamespaceRequest req;
    req.set_name(name);
    v1::DeleteNamespaceResponse resp;
    const grpc::Status s = stub_->DeleteNamespace(&ctx, req, &resp);
    return {s, ReasonOf(ctx)};
  }

  // One block's rows for one layer: `rows` is [n, 512] bf16 for slots [first_slot, +n).
  struct RowsPiece {
    std::string key;
    uint32_t layer = 0;
    uint32_t first_slot = 0;
    std::vector<uint16_t> rows;
  };
  // `finish_at`: the message that sets finish_write (-1: the last; pieces.size(): none).
  CallResult PutRows(const v1::Namespace& ns, const std::string& pool,
                     const std::vector<RowsPiece>& pieces, v1::PutResponse* out = nullptr,
                     uint64_t digest_override = 0, int finish_at = -1) {
    grpc::ClientContext ctx;
    v1::PutResponse resp;
    auto writer = stub_->PutRows(&ctx, &resp);
    for (size_t i = 0; i < pieces.size(); ++i) {
      v1::PutRowsRequest msg;
      if (i == 0) {
        msg.set_namespace_(ns.name());
        msg.set_digest(digest_override != 0 ? digest_override : ns.digest());
        msg.set_pool(pool);
      }
      msg.set_key(pieces[i].key);
      msg.set_layer(pieces[i].layer);
      msg.set_first_slot(pieces[i].first_slot);
      msg.set_rows(reinterpret_cast<const char*>(pieces[i].rows.data()),
                   pieces[i].rows.size() * sizeof(uint16_t));
      msg.set_finish_write(static_cast<int>(i) == (finish_at < 0 ? pieces.size() - 1 : finish_at));
      if (!writer->Write(msg)) break;
    }
    writer->WritesDone();
    const grpc::Status s = writer->Finish();
    if (out != nullptr) *out = resp;
    return {s, ReasonOf(ctx)};
  }
  // Whole blocks of one layer: keys[i] gets rows [i * page_size, (i + 1) * page_size).
  CallResult PutBlocks(const v1::Namespace& ns, const std::string& pool,
                       const std::vector<std::string>& keys, const std::vector<uint16_t>& rows,
                       int page_size, v1::PutResponse* out = nullptr) {
    std::vector<RowsPiece> pieces;
    const size_t per = static_cast<size_t>(page_size) * kHeadDim;
    for (size_t i = 0; i < keys.size(); ++i) {
      pieces.push_back({keys[i], 0, 0,
                        std::vector<uint16_t>(rows.begin() + i * per, rows.begin() + (i + 1) * per)});
    }
    return PutRows(ns, pool, pieces, out);
  }

  struct PagePiece {
    std::string key;
    uint32_t layer = 0;
    uint64_t offset = 0;
    std::string data;
  };
  CallResult PutPages(const v1::Namespace& ns, const std::string& pool, v1::Layout layout,
                      const std::vector<PagePiece>& pieces, v1::PutResponse* out = nullptr,
                      int finish_at = -1) {
    grpc::ClientContext ctx;
    v1::PutResponse resp;
    auto writer = stub_->PutPages(&ctx, &resp);
    for (size_t i = 0; i < pieces.size(); ++i) {
      v1::PutPagesRequest msg;
      if (i == 0) {
        msg.set_namespace_(ns.name());
        msg.set_digest(ns.digest());
        msg.set_pool(pool);
        msg.set_layout(layout);
      }
      msg.set_key(pieces[i].key);
      msg.set_layer(pieces[i].layer);
      msg.set_offset(pieces[i].offset);
      msg.set_data(pieces[i].data);
      msg.set_finish_write(static_cast<int>(i) == (finish_at < 0 ? pieces.size() - 1 : finish_at));
      if (!writer->Write(msg)) break;
    }
    writer->WritesDone();
    const grpc::Status s = writer->Finish();
    if (out != nullptr) *out = resp;
    return {s, ReasonOf(ctx)};
  }

  CallResult Lookup(const v1::Namespace& ns, const std::vector<std::string>& keys,
                    v1::LookupResponse* out, uint32_t lease_ttl_ms = 0,
                    const std::vector<std::string>& pools = {}, uint64_t digest_override = 0) {
    grpc::ClientContext ctx;
    v1::LookupRequest req;
    req.set_namespace_(ns.name());
    req.set_digest(digest_override != 0 ? digest_override : ns.digest());
    for (const auto& k : keys) req.add_keys(k);
    for (const auto& p : pools) req.add_pools(p);
    req.set_lease_ttl_ms(lease_ttl_ms);
    const grpc::Status s = stub_->Lookup(&ctx, req, out);
    return {s, ReasonOf(ctx)};
  }
  // The hit count, failing the test on error.
  int64_t Hits(const v1::Namespace& ns, const std::vector<std::string>& keys,
               const std::vector<std::string>& pools = {}) {
    v1::LookupResponse resp;
    const CallResult r = Lookup(ns, keys, &resp, 0, pools);
    EXPECT_TRUE(r.ok()) << r.status.error_message();
    return static_cast<int64_t>(resp.hit_blocks());
  }
  CallResult ReleaseLease(const v1::Namespace& ns, uint64_t lease) {
    grpc::ClientContext ctx;
    v1::ReleaseLeaseRequest req;
    req.set_namespace_(ns.name());
    req.set_lease_id(lease);
    v1::ReleaseLeaseResponse resp;
    const grpc::Status s = stub_->ReleaseLease(&ctx, req, &resp);
    return {s, ReasonOf(ctx)};
  }

  // LoadRows into `rows` (bf16 [n, 512]); checks offsets and XXH64; `chunks` counts messages.
  CallResult LoadRows(const v1::Namespace& ns, uint64_t lease, const std::string& pool,
                      uint32_t layer, std::vector<uint16_t>* rows, uint64_t first = 0,
                      uint64_t count = 0, int* chunks = nullptr, uint64_t digest_override = 0) {
    grpc::ClientContext ctx;
    v1::LoadRowsRequest req;
    req.set_namespace_(ns.name());
    req.set_digest(digest_override != 0 ? digest_override : ns.digest());
    req.set_lease_id(lease);
    req.set_pool(pool);
    req.set_layer(layer);
    req.set_first_block(first);
    req.set_num_blocks(count);
    auto reader = stub_->LoadRows(&ctx, req);
    v1::WorkspaceChunk chunk;
    std::string bytes;
    int n = 0;
    while (reader->Read(&chunk)) {
      EXPECT_EQ(chunk.first_row() * kBf16RowBytes, bytes.size());
      EXPECT_EQ(chunk.xxh64(), XXH64(chunk.rows().data(), chunk.rows().size(), 0));
      bytes.append(chunk.rows());
      ++n;
    }
    const grpc::Status s = reader->Finish();
    if (chunks != nullptr) *chunks = n;
    rows->resize(bytes.size() / 2);
    if (!bytes.empty()) std::memcpy(rows->data(), bytes.data(), bytes.size());
    return {s, ReasonOf(ctx)};
  }
  CallResult LoadPages(const v1::Namespace& ns, uint64_t lease, const std::string& pool,
                       std::string* bytes, v1::Layout transcode_to = v1::LAYOUT_UNSPECIFIED,
                       uint64_t first = 0, uint64_t count = 0) {
    grpc::ClientContext ctx;
    v1::LoadPagesRequest req;
    req.set_namespace_(ns.name());
    req.set_digest(ns.digest());
    req.set_lease_id(lease);
    req.set_pool(pool);
    req.set_transcode_to(transcode_to);
    req.set_first_block(first);
    req.set_num_blocks(count);
    auto reader = stub_->LoadPages(&ctx, req);
    DrainPageChunks(*reader, bytes);
    const grpc::Status s = reader->Finish();
    return {s, ReasonOf(ctx)};
  }

  // The whole snapshot: blocks as "namespace/pool/key" strings, its publisher and sequence.
  struct SnapshotResult {
    uint64_t publisher_id = 0, sequence = 0;
    std::vector<v1::BlockEvent> blocks;
  };
  SnapshotResult Snapshot() {
    grpc::ClientContext ctx;
    auto reader = stub_->Snapshot(&ctx, v1::SnapshotRequest());
    v1::SnapshotChunk chunk;
    SnapshotResult out;
    while (reader->Read(&chunk)) {
      out.publisher_id = chunk.publisher_id();
      out.sequence = chunk.sequence();
      for (const auto& b : chunk.blocks()) out.blocks.push_back(b);
    }
    const grpc::Status s = reader->Finish();
    EXPECT_TRUE(s.ok()) << s.error_message();
    return out;
  }

 private:
  std::unique_ptr<v1::KvCache::Stub> stub_;
};

// "namespace/pool/key" of a block or event, for set comparisons.
inline std::string BlockId(const v1::BlockEvent& e) {
  return e.namespace_() + "/" + e.pool() + "/" + e.key();
}

}  // namespace kvferry::testing
