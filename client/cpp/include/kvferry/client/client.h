// kvferry's C++ client: a typed, thread-safe client of kvferryd's gRPC API.
//
// Every call has a deadline (the client's default timeout, or the one given), chunks its
// stream itself, verifies every read chunk (offset and XXH64: DATA_LOSS on a mismatch) and
// returns an absl::Status carrying the server's code and message; ErrorReason() gives the
// machine-readable reason the daemon attached ("STALE_PAGE_HANDLE", see the daemon's
// errors.proto). A call is retried only when it failed UNAVAILABLE before the channel ever
// connected, that is before any byte of it reached the daemon; nothing else is retried.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace grpc {
class ChannelCredentials;
}

namespace kvferry::client {

// The record formats (spec/kv-formats.md).
enum class Layout { kV4, kV41, kV41Fp4 };
// "v4", "v41", "v41_fp4"; and back (false on an unknown name).
const char* LayoutName(Layout layout);
bool ParseLayout(const std::string& name, Layout* layout);

struct PageHandle {
  uint64_t page_id = 0;
  uint64_t generation = 0;
  bool operator==(const PageHandle&) const = default;
};

struct TokenLocation {
  PageHandle page;
  uint32_t slot = 0;
};

struct PoolSpec {
  std::string name;
  Layout layout = Layout::kV4;
  uint32_t page_size = 64;  // tokens, a power of two in [1, 4096]
  uint64_t num_pages = 0;
  uint32_t num_layers = 1;
  std::string device;       // "cpu", "cuda:N"; empty: the daemon's default
};

struct PoolInfo {
  PoolSpec spec;
  uint64_t pool_id = 0;
  uint64_t page_bytes = 0;  // one page of one layer
  uint64_t pool_bytes = 0;
  uint64_t pages_used = 0;
  uint64_t pages_free = 0;
  uint64_t tokens_held = 0;
};

struct PoolStats {
  std::string name;
  Layout layout = Layout::kV4;
  uint32_t page_size = 0;
  uint64_t pages_used = 0, pages_free = 0, tokens_held = 0, records_held = 0, pool_bytes = 0;
  double nominal_bytes_per_token = 0, effective_bytes_per_token = 0;
  double bytes_saved_vs_bf16 = 0, bytes_saved_vs_v4 = 0;
};

struct Stats {
  std::vector<PoolStats> pools;
  uint64_t tokens_held = 0, records_held = 0, pool_bytes = 0;
  double bytes_saved_vs_bf16 = 0, bytes_saved_vs_v4 = 0;
};

struct WriteResult {
  uint64_t tokens_written = 0;  // WriteTokens
  uint64_t pages_written = 0;   // WritePages: (page, layer) pairs
  uint64_t bytes_sent = 0;
};

// One (page, layer) of already-quantized bytes for WritePages.
struct PageBytes {
  PageHandle page;
  uint32_t layer = 0;
  std::span<const uint8_t> data;  // page_bytes of the pool's layout
};

struct ClientOptions {
  std::string target = "127.0.0.1:50051";  // host:port of kvferryd
  absl::Duration timeout = absl::Seconds(60);  // default deadline of each call
  int64_t message_bytes = 1 << 20;  // payload per write message; read chunk size asked for
  int max_attempts = 4;             // for calls that never reached the daemon
  absl::Duration first_backoff = absl::Milliseconds(100);  // doubles each attempt
  // Channel credentials; null: plaintext (kvferryd accepts that on loopback only).
  std::shared_ptr<grpc::ChannelCredentials> credentials;
  std::string bearer_token;  // sent as `authorization: Bearer <token>` when not empty
};

// Per-call overrides.
struct CallOptions {
  std::optional<absl::Duration> timeout;
};

// The reason the daemon attached to `status` ("" when none).
std::string ErrorReason(const absl::Status& status);

class Client {
 public:
  // Creates the channel (it connects lazily, on the first call).
  static absl::StatusOr<std::unique_ptr<Client>> Connect(ClientOptions options);
  ~Client();

  absl::StatusOr<PoolInfo> CreatePool(const PoolSpec& spec, CallOptions call = {});
  absl::StatusOr<PoolInfo> DescribePool(const std::string& name, CallOptions call = {});
  absl::StatusOr<std::vector<PoolInfo>> ListPools(CallOptions call = {});
  absl::Status DeletePool(const std::string& name, CallOptions call = {});

  absl::StatusOr<std::vector<PageHandle>> AllocatePages(const std::string& pool, uint32_t count,
                                                        CallOptions call = {});
  absl::Status FreePages(const std::string& pool, std::span<const PageHandle> pages,
                         CallOptions call = {});

  // rows: bf16 [n, 512] (n = locations.size()), one layer. All or nothing.
  absl::StatusOr<WriteResult> WriteTokens(const std::string& pool, uint32_t layer,
                                          std::span<const TokenLocation> locations,
                                          std::span<const uint16_t> rows, CallOptions call = {});
  absl::StatusOr<WriteResult> WritePages(const std::string& pool, Layout layout,
                                         std::span<const PageBytes> pages, CallOptions call = {});

  // Pages (for each page, each listed layer; all layers when empty) into `out`, whose size
  // must be pages × layers × the output layout's page bytes. Returns the page bytes.
  absl::StatusOr<uint64_t> ReadPagesInto(const std::string& pool, std::span<const PageHandle> pages,
                                         std::span<const uint32_t> layers,
                                         std::optional<Layout> transcode_to, std::span<uint8_t> out,
                                         CallOptions call = {});
  // The same into a new buffer (sized from the pool's description).
  absl::StatusOr<std::vector<uint8_t>> ReadPages(const std::string& pool,
                                                 std::span<const PageHandle> pages,
                                                 std::span<const uint32_t> layers = {},
                                                 std::optional<Layout> transcode_to = std::nullopt,
                                                 CallOptions call = {});
  // Dequantized rows [n, 512] bf16 into `out` (n × 512 values).
  absl::Status ReadWorkspaceInto(const std::string& pool, uint32_t layer,
                                 std::span<const TokenLocation> locations,
                                 std::span<uint16_t> out, CallOptions call = {});
  absl::StatusOr<std::vector<uint16_t>> ReadWorkspace(const std::string& pool, uint32_t layer,
                                                      std::span<const TokenLocation> locations,
                                                      CallOptions call = {});

  absl::StatusOr<Stats> GetStats(CallOptions call = {});
  // The standard gRPC health check of the whole server: OK when SERVING.
  absl::Status Health(CallOptions call = {});

 private:
  struct Impl;
  explicit Client(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvferry::client
