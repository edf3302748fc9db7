// The kvferry C++ client over the generated gRPC stubs.
#include "kvferry/client/client.h"

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <xxhash.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <thread>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "kvferry/v1/kvferry.grpc.pb.h"

#include "internal.h"

namespace kvferry::client {
using namespace internal;  // NOLINT: the shared conversions

const char* LayoutName(Layout layout) {
  switch (layout) {
    case Layout::kV4: return "v4";
    case Layout::kV41: return "v41";
    case Layout::kV41Fp4: return "v41_fp4";
  }
  return "unknown";
}

bool ParseLayout(const std::string& name, Layout* layout) {
  for (Layout l : {Layout::kV4, Layout::kV41, Layout::kV41Fp4}) {
    if (name == LayoutName(l)) {
      *layout = l;
      return true;
    }
  }
  return false;
}

std::string ErrorReason(const absl::Status& status) {
  absl::optional<absl::Cord> reason = status.GetPayload(kReasonPayload);
  return reason.has_value() ? std::string(*reason) : std::string();
}

struct Client::Impl {
  ClientOptions options;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::KvFerry::Stub> stub;

  void Prepare(grpc::ClientContext& ctx, const CallOptions& call) const {
    internal::Prepare(ctx, options, call.timeout.value_or(options.timeout));
  }

  // Runs `attempt` (which makes one call with a fresh context) again while it fails
  // UNAVAILABLE without the channel ever having been connected: nothing was sent then.
  absl::Status Retry(const std::function<absl::Status()>& attempt) const {
    absl::Duration backoff = options.first_backoff;
    for (int i = 1;; ++i) {
      const grpc_connectivity_state before = channel->GetState(/*try_to_connect=*/true);
      absl::Status s = attempt();
      const bool never_connected = before != GRPC_CHANNEL_READY &&
                                   channel->GetState(false) != GRPC_CHANNEL_READY;
      if (s.code() != absl::StatusCode::kUnavailable || !never_connected ||
          i >= options.max_attempts) {
        return s;
      }
      std::this_thread::sleep_for(absl::ToChronoNanoseconds(backoff));
      backoff *= 2;
    }
  }

  template <typename Request, typename Response>
  absl::Status Unary(grpc::Status (v1::KvFerry::Stub::*method)(grpc::ClientContext*, const Request&,
                                                              Response*),
                     const Request& request, Response* response, const CallOptions& call) const {
    return Retry([&] {
      grpc::ClientContext ctx;
      Prepare(ctx, call);
      response->Clear();
      const grpc::Status s = (stub.get()->*method)(&ctx, request, response);
      return FromGrpc(s, ctx);
    });
  }

  // Streams a ReadPages; `place(page_bytes)` returns where the whole output goes once the
  // first chunk says how large a page is.
  absl::Status ReadPages(const v1::ReadPagesRequest& req,
                         const std::function<absl::StatusOr<std::span<uint8_t>>(uint64_t)>& place,
                         uint64_t* page_bytes, const CallOptions& call) const {
    return Retry([&]() -> absl::Status {
      grpc::ClientContext ctx;
      Prepare(ctx, call);
      auto reader = stub->ReadPages(&ctx, req);
      return Drain<v1::PageChunk>(
          ctx, *reader,
          [&](const v1::PageChunk& first) -> absl::StatusOr<std::span<uint8_t>> {
            *page_bytes = first.page_bytes();
            return place(first.page_bytes());
          },
          [&]() { return place(0); },
          [](const v1::PageChunk& c) { return c.offset(); },
          [](const v1::PageChunk& c) -> const std::string& { return c.data(); });
    });
  }

  // Reads a chunked stream into one buffer: `place(first)` says where, from the first chunk
  // (`place_empty()` when there is none). Checks every chunk's offset, hash and fit, and
  // the total; on a bad chunk cancels the call.
  template <typename Chunk, typename Reader>
  static absl::Status Drain(
      grpc::ClientContext& ctx, Reader& reader,
      const std::function<absl::StatusOr<std::span<uint8_t>>(const Chunk&)>& place,
      const std::function<absl::StatusOr<std::span<uint8_t>>()>& place_empty,
      const std::function<uint64_t(const Chunk&)>& offset_of,
      const std::function<const std::string&(const Chunk&)>& data_of) {
    Chunk chunk;
    std::span<uint8_t> out;
    uint64_t received = 0;
    bool placed = false;
    absl::Status local;
    while (local.ok() && reader.Read(&chunk)) {
      if (!placed) {
        absl::StatusOr<std::span<uint8_t>> where = place(chunk);
        if (!where.ok()) {
          local = where.status();
          break;
        }
        out = *where;
        placed = true;
      }
      const std::string& data = data_of(chunk);
      local = CheckChunk(offset_of(chunk), data, chunk.xxh64(), received, out.size());
      if (local.ok()) {
        std::memcpy(out.data() + received, data.data(), data.size());
        received += data.size();
      }
    }
    if (!local.ok()) {
      ctx.TryCancel();
      while (reader.Read(&chunk)) {
      }
      reader.Finish().IgnoreError();
      return local;
    }
    KVF_CLIENT_RETURN(FromGrpc(reader.Finish(), ctx));
    if (!placed) {
      absl::StatusOr<std::span<uint8_t>> where = place_empty();
      if (!where.ok()) return where.status();
      out = *where;
    }
    if (received != out.size()) {
      return absl::DataLossError(absl::StrCat("read ended after ", received, " of ", out.size(),
                                              " bytes"));
    }
    return absl::OkStatus();
  }

  static absl::Status CheckChunk(uint64_t offset, const std::string& data, uint64_t hash,
                                 uint64_t received, uint64_t capacity) {
    if (offset != received) {
      return absl::DataLossError(absl::StrCat("chunk at offset ", offset, ", expected ", received));
    }
    if (XXH64(data.data(), data.size(), 0) != hash) {
      return absl::DataLossError(absl::StrCat("chunk at offset ", offset, " fails its XXH64"));
    }
    if (received + data.size() > capacity) {
      return absl::InvalidArgumentError(absl::StrCat("the output buffer holds ", capacity,
                                                     " bytes; the read returns more"));
    }
    return absl::OkStatus();
  }
};

Client::Client(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Client::~Client() = default;

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(ClientOptions options) {
  if (options.message_bytes < kRowBytes) {
    return absl::InvalidArgumentError(absl::StrCat("message_bytes must be at least ", kRowBytes));
  }
  auto impl = std::make_unique<Impl>();
  impl->channel = MakeChannel(options);
  impl->stub = v1::KvFerry::NewStub(impl->channel);
  impl->options = std::move(options);
  return std::unique_ptr<Client>(new Client(std::move(impl)));
}

absl::StatusOr<PoolInfo> Client::CreatePool(const PoolSpec& spec, CallOptions call) {
  v1::CreatePoolRequest req;
  req.set_name(spec.name);
  req.set_layout(ToProto(spec.layout));
  req.set_page_size(spec.page_size);
  req.set_num_pages(spec.num_pages);
  req.set_num_layers(spec.num_layers);
  req.set_device(spec.device);
  v1::Pool pool;
  KVF_CLIENT_RETURN(impl_->Unary(&v1::KvFerry::Stub::CreatePool, req, &pool, call));
  return FromProto(pool);
}

absl::StatusOr<PoolInfo> Client::DescribePool(const std::string& name, CallOptions call) {
  v1::DescribePoolRequest req;
  req.set_name(name);
  v1::Pool pool;
  KVF_CLIENT_RETURN(impl_->Unary(&v1::KvFerry::Stub::DescribePool, req, &pool, call));
  return FromProto(pool);
}

absl::StatusOr<std::vector<PoolInfo>> Client::ListPools(CallOptions call) {
  v1::ListPoolsResponse resp;
  KVF_CLIENT_RETURN(impl_->Unary(&v1::KvFerry::Stub::ListPools, v1::ListPoolsRequest(), &resp, call));
  std::vector<PoolInfo> pools;
  for (const v1::Pool& p : resp.pools()) pools.push_back(FromProto(p));
  return pools;
}

absl::Status Client::DeletePool(const std::string& name, CallOptions call) {
  v1::DeletePoolRequest req;
  req.set_name(name);
  v1::DeletePoolResponse resp;
  return impl_->Unary(&v1::KvFerry::Stub::DeletePool, req, &resp, call);
}

absl::StatusOr<std::vector<PageHandle>> Client::AllocatePages(const std::string& pool,
                                                              uint32_t count, CallOptions call) {
  v1::AllocatePagesRequest req;
  req.set_pool(pool);
  req.set_count(count);
  v1::AllocatePagesResponse resp;
  KVF_CLIENT_RETURN(impl_->Unary(&v1::KvFerry::Stub::AllocatePages, req, &resp, call));
  std::vector<PageHandle> pages;
  for (const v1::PageHandle& h : resp.pages()) pages.push_back({h.page_id(), h.generation()});
  return pages;
}

absl::Status Client::FreePages(const std::string& pool, std::span<const PageHandle> pages,
                               CallOptions call) {
  v1::FreePagesRequest req;
  req.set_pool(pool);
  for (const PageHandle& h : pages) ToProto(h, req.add_pages());
  v1::FreePagesResponse resp;
  return impl_->Unary(&v1::KvFerry::Stub::FreePages, req, &resp, call);
}

absl::StatusOr<WriteResult> Client::WriteTokens(const std::string& pool, uint32_t layer,
                                                std::span<const TokenLocation> locations,
                                                std::span<const uint16_t> rows, CallOptions call) {
  if (rows.size() != locations.size() * kRowValues) {
    return absl::InvalidArgumentError(absl::StrCat(locations.size(), " locations need ",
                                                   locations.size() * kRowValues,
                                                   " bf16 values, got ", rows.size()));
  }
  const size_t per_message = static_cast<size_t>(impl_->options.message_bytes / kRowBytes);
  WriteResult result;
  KVF_CLIENT_RETURN(impl_->Retry([&]() -> absl::Status {
    grpc::ClientContext ctx;
    impl_->Prepare(ctx, call);
    v1::WriteResponse resp;
    auto writer = impl_->stub->WriteTokens(&ctx, &resp);
    size_t first = 0;
    do {
      const size_t n = std::min(per_message, locations.size() - first);
      v1::WriteTokensRequest msg;
      if (first == 0) {
        msg.set_pool(pool);
        msg.set_layer(layer);
      }
      for (size_t i = first; i < first + n; ++i) {
        v1::TokenLocation* l = msg.add_locations();
        ToProto(locations[i].page, l->mutable_page());
        l->set_slot(locations[i].slot);
      }
      msg.set_rows(reinterpret_cast<const char*>(rows.data() + first * kRowValues), n * kRowBytes);
      if (!writer->Write(msg)) break;  // the server ended the call: Finish says why
      first += n;
    } while (first < locations.size());
    writer->WritesDone();
    KVF_CLIENT_RETURN(FromGrpc(writer->Finish(), ctx));
    result.tokens_written = resp.tokens_written();
    result.bytes_sent = resp.bytes_received();
    return absl::OkStatus();
  }));
  return result;
}

absl::StatusOr<WriteResult> Client::WritePages(const std::string& pool, Layout layout,
                                               std::span<const PageBytes> pages, CallOptions call) {
  const size_t per_message = static_cast<size_t>(impl_->options.message_bytes);
  WriteResult result;
  KVF_CLIENT_RETURN(impl_->Retry([&]() -> absl::Status {
    grpc::ClientContext ctx;
    impl_->Prepare(ctx, call);
    v1::WriteResponse resp;
    auto writer = impl_->stub->WritePages(&ctx, &resp);
    bool first = true, open = true;
    for (const PageBytes& page : pages) {
      for (size_t at = 0; open && (at < page.data.size() || (at == 0 && page.data.empty()));) {
        const size_t n = std::min(per_message, page.data.size() - at);
        v1::WritePagesRequest msg;
        if (first) {
          msg.set_pool(pool);
          msg.set_layout(ToProto(layout));
          first = false;
        }
        ToProto(page.page, msg.mutable_page());
        msg.set_layer(page.layer);
        msg.set_offset(at);
        msg.set_data(reinterpret_cast<const char*>(page.data.data() + at), n);
        open = writer->Write(msg);
        at += n;
        if (n == 0) break;
      }
    }
    if (first && open) {  // no pages: one message that names the pool
      v1::WritePagesRequest msg;
      msg.set_pool(pool);
      msg.set_layout(ToProto(layout));
      writer->Write(msg);
    }
    writer->WritesDone();
    KVF_CLIENT_RETURN(FromGrpc(writer->Finish(), ctx));
    result.pages_written = resp.pages_written();
    result.bytes_sent = resp.bytes_received();
    return absl::OkStatus();
  }));
  return result;
}

namespace {

v1::ReadPagesRequest PagesRequest(const std::string& pool, std::span<const PageHandle> pages,
                                  std::span<const uint32_t> layers,
                                  std::optional<Layout> transcode_to, int64_t chunk_bytes) {
  v1::ReadPagesRequest req;
  req.set_pool(pool);
  for (const PageHandle& h : pages) ToProto(h, req.add_pages());
  for (uint32_t l : layers) req.add_layers(l);
  if (transcode_to.has_value()) req.set_transcode_to(ToProto(*transcode_to));
  req.set_chunk_bytes(static_cast<uint32_t>(chunk_bytes));
  return req;
}

}  // namespace

absl::StatusOr<uint64_t> Client::ReadPagesInto(const std::string& pool,
                                               std::span<const PageHandle> pages,
                                               std::span<const uint32_t> layers,
                                               std::optional<Layout> transcode_to,
                                               std::span<uint8_t> out, CallOptions call) {
  uint64_t page_bytes = 0;
  KVF_CLIENT_RETURN(impl_->ReadPages(
      PagesRequest(pool, pages, layers, transcode_to, impl_->options.message_bytes),
      [&](uint64_t) -> absl::StatusOr<std::span<uint8_t>> { return out; }, &page_bytes, call));
  return page_bytes;
}

absl::StatusOr<std::vector<uint8_t>> Client::ReadPages(const std::string& pool,
                                                       std::span<const PageHandle> pages,
                                                       std::span<const uint32_t> layers,
                                                       std::optional<Layout> transcode_to,
                                                       CallOptions call) {
  uint64_t units = pages.size() * layers.size();
  if (layers.empty()) {
    absl::StatusOr<PoolInfo> info = DescribePool(pool, call);
    if (!info.ok()) return info.status();
    units = pages.size() * info->spec.num_layers;
  }
  std::vector<uint8_t> out;
  uint64_t page_bytes = 0;
  KVF_CLIENT_RETURN(impl_->ReadPages(
      PagesRequest(pool, pages, layers, transcode_to, impl_->options.message_bytes),
      [&](uint64_t bytes) -> absl::StatusOr<std::span<uint8_t>> {
        out.assign(units * bytes, 0);
        return std::span<uint8_t>(out);
      },
      &page_bytes, call));
  return out;
}

absl::Status Client::ReadWorkspaceInto(const std::string& pool, uint32_t layer,
                                       std::span<const TokenLocation> locations,
                                       std::span<uint16_t> out, CallOptions call) {
  if (out.size() != locations.size() * kRowValues) {
    return absl::InvalidArgumentError(absl::StrCat(locations.size(), " locations need ",
                                                   locations.size() * kRowValues,
                                                   " bf16 values of output, got ", out.size()));
  }
  v1::ReadWorkspaceRequest req;
  req.set_pool(pool);
  req.set_layer(layer);
  for (const TokenLocation& l : locations) {
    v1::TokenLocation* p = req.add_locations();
    ToProto(l.page, p->mutable_page());
    p->set_slot(l.slot);
  }
  req.set_chunk_bytes(static_cast<uint32_t>(impl_->options.message_bytes));
  const std::span<uint8_t> bytes(reinterpret_cast<uint8_t*>(out.data()), out.size() * 2);
  return impl_->Retry([&]() -> absl::Status {
    grpc::ClientContext ctx;
    impl_->Prepare(ctx, call);
    auto reader = impl_->stub->ReadWorkspace(&ctx, req);
    auto whole = [&]() -> absl::StatusOr<std::span<uint8_t>> { return bytes; };
    return Impl::Drain<v1::WorkspaceChunk>(
        ctx, *reader, [&](const v1::WorkspaceChunk&) { return whole(); }, whole,
        [](const v1::WorkspaceChunk& c) { return c.first_row() * kRowBytes; },
        [](const v1::WorkspaceChunk& c) -> const std::string& { return c.rows(); });
  });
}

absl::StatusOr<std::vector<uint16_t>> Client::ReadWorkspace(const std::string& pool, uint32_t layer,
                                                            std::span<const TokenLocation> locations,
                                                            CallOptions call) {
  std::vector<uint16_t> out(locations.size() * kRowValues);
  KVF_CLIENT_RETURN(ReadWorkspaceInto(pool, layer, locations, out, call));
  return out;
}

absl::StatusOr<Stats> Client::GetStats(CallOptions call) {
  v1::Stats resp;
  KVF_CLIENT_RETURN(impl_->Unary(&v1::KvFerry::Stub::GetStats, v1::GetStatsRequest(), &resp, call));
  Stats stats;
  for (const v1::PoolStats& p : resp.pools()) {
    PoolStats s;
    s.name = p.name();
    s.layout = FromProto(p.layout());
    s.page_size = p.page_size();
    s.pages_used = p.pages_used();
    s.pages_free = p.pages_free();
    s.tokens_held = p.tokens_held();
    s.records_held = p.records_held();
    s.pool_bytes = p.pool_bytes();
    s.nominal_bytes_per_token = p.nominal_bytes_per_token();
    s.effective_bytes_per_token = p.effective_bytes_per_token();
    s.bytes_saved_vs_bf16 = p.bytes_saved_vs_bf16();
    s.bytes_saved_vs_v4 = p.bytes_saved_vs_v4();
    stats.pools.push_back(std::move(s));
  }
  stats.tokens_held = resp.tokens_held();
  stats.records_held = resp.records_held();
  stats.pool_bytes = resp.pool_bytes();
  stats.bytes_saved_vs_bf16 = resp.bytes_saved_vs_bf16();
  stats.bytes_saved_vs_v4 = resp.bytes_saved_vs_v4();
  return stats;
}

absl::Status Client::Health(CallOptions call) {
  return impl_->Retry([&]() -> absl::Status {
    grpc::GenericStub stub(impl_->channel);
    grpc::CompletionQueue cq;
    grpc::ClientContext ctx;
    impl_->Prepare(ctx, call);
    grpc::Slice empty("");  // HealthCheckRequest{service: ""}: the whole server
    grpc::ByteBuffer req(&empty, 1), resp;
    auto rpc = stub.PrepareUnaryCall(&ctx, "/grpc.health.v1.Health/Check", req, &cq);
    rpc->StartCall();
    grpc::Status status;
    rpc->Finish(&resp, &status, reinterpret_cast<void*>(1));
    void* tag;
    bool ok;
    cq.Next(&tag, &ok);
    cq.Shutdown();
    while (cq.Next(&tag, &ok)) {
    }
    KVF_CLIENT_RETURN(FromGrpc(status, ctx));
    std::vector<grpc::Slice> slices;
    resp.Dump(&slices);
    std::string bytes;
    for (const auto& s : slices) bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
    // HealthCheckResponse: field 1 (status), varint; 1 is SERVING.
    if (bytes != std::string("\x08\x01", 2)) {
      return absl::UnavailableError("kvferryd is not serving");
    }
    return absl::OkStatus();
  });
}

}  // namespace kvferry::client
