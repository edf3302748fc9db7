// Client::Impl: the channel, stubs, deadlines, retries and chunked reads that every
// source of the client library shares.
#pragma once

#include <grpcpp/grpcpp.h>
#include <xxhash.h>

#include <cstring>
#include <functional>
#include <memory>
#include <span>
#include <thread>

#include "absl/strings/str_cat.h"
#include "internal.h"
#include "kvferry/client/client.h"
#include "kvferry/v1/cache.grpc.pb.h"
#include "kvferry/v1/kvferry.grpc.pb.h"
#include "kvferry/v1/transfer.grpc.pb.h"

namespace kvferry::client {
using namespace internal;  // NOLINT: the shared conversions

struct Client::Impl {
  ClientOptions options;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::KvFerry::Stub> stub;
  std::unique_ptr<v1::KvCache::Stub> cache;
  std::unique_ptr<v1::Transfer::Stub> transfer;

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

  // One unary call of any of the stubs, retried as Retry says.
  template <typename Stub, typename Request, typename Response>
  absl::Status UnaryOn(Stub& on,
                       grpc::Status (Stub::*method)(grpc::ClientContext*, const Request&, Response*),
                       const Request& request, Response* response, const CallOptions& call) const {
    return Retry([&] {
      grpc::ClientContext ctx;
      Prepare(ctx, call);
      response->Clear();
      const grpc::Status s = (on.*method)(&ctx, request, response);
      return FromGrpc(s, ctx);
    });
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

}  // namespace kvferry::client
