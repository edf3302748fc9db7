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
  // A Session's calls (Save, Load, ...) go round robin over this many connections, so that
  // large requests issued from several threads at once are not read one after another
  // from a single connection.
  int session_connections = 4;
};

// Per-call overrides.
struct CallOptions {
  std::optional<absl::Duration> timeout;
};

// ---- the KV cache (kvferry.v1.KvCache, cache.proto) ----------------------------------------

struct NamespaceSpec {
  std::string name;
  std::string model_fingerprint;    // the model, weights and config the blocks come from
  std::string layer_group;          // which layers the member pools hold
  std::string tenant_salt;          // any bytes mixed into the digest
  uint32_t block_tokens = 64;       // prompt tokens one key names
  std::vector<std::string> pools;   // the member pools, in order
  uint64_t max_blocks = 0;          // per member pool; 0: as many as the pools hold
};

struct NamespaceMember {
  std::string pool;
  uint64_t pool_id = 0;
  Layout layout = Layout::kV4;
  uint32_t page_size = 0;   // slots of one block in this pool
  uint32_t num_layers = 0;
  std::string tier;         // the pool's device
  uint64_t blocks = 0;      // blocks stored now
};

// A namespace as calls name it: its name and digest (sent with every call; a digest that is
// not the namespace's fails with FAILED_PRECONDITION, reason NAMESPACE_MISMATCH).
struct NamespaceRef {
  std::string name;
  uint64_t digest = 0;
};

struct NamespaceInfo {
  std::string name;
  uint64_t digest = 0;
  uint32_t block_tokens = 0;
  uint64_t max_blocks = 0;
  std::vector<NamespaceMember> members;
  NamespaceRef ref() const { return {name, digest}; }
};

// Rows of one block in one layer: bf16 [n, 512] for slots [first_slot, first_slot + n).
struct BlockRows {
  std::string key;
  uint32_t layer = 0;
  uint32_t first_slot = 0;
  std::span<const uint16_t> rows;
};

// The records of one block in one layer: the whole page in the pool's layout.
struct BlockRecords {
  std::string key;
  uint32_t layer = 0;
  std::span<const uint8_t> data;
};

struct PutResult {
  uint64_t blocks_stored = 0;        // new blocks
  uint64_t blocks_already_held = 0;  // keys skipped: held, or written by another put
  uint64_t bytes_sent = 0;
};

struct LookupOptions {
  std::vector<std::string> pools;                    // the group; empty: every member
  absl::Duration lease_ttl = absl::ZeroDuration();  // > 0: pin the hits under a lease
};

struct LookupResult {
  uint64_t hit_blocks = 0;      // keys[0, hit_blocks) are held by every pool of the group
  uint64_t pending_blocks = 0;  // the keys after them held or still being written
  uint64_t hit_tokens = 0;
  uint64_t lease_id = 0;        // 0: no lease
  absl::Time lease_expiry;
};

// Which blocks of a lease a load returns: [first, first + count), count 0: to the end.
struct BlockRange {
  uint64_t first = 0;
  uint64_t count = 0;
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
  // Pages under a lease of `lease` (whole seconds, at least 1): every write or read naming a
  // page and every RenewPages renews it; a page whose lease runs out is freed by the daemon
  // (zeroed, its handle refused from then on), so a client that dies leaks nothing.
  absl::StatusOr<std::vector<PageHandle>> AllocatePages(const std::string& pool, uint32_t count,
                                                        absl::Duration lease, CallOptions call = {});
  // Renews the leases of leased pages (all handles checked first; none renewed on an error).
  absl::Status RenewPages(const std::string& pool, std::span<const PageHandle> pages,
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

  // ---- between daemons (UCX) ----
  // Pages of `pool` here → pages `to.pages` of pool `to.pool` on the daemon at
  // `to.address` (allocated there by the caller), each listed layer into the same layer
  // (all layers when empty), optionally transcoded on the way (to the destination pool's
  // layout). All or nothing at the destination; OK means committed and readable there.
  struct PeerPages {
    std::string address;  // host:port of the peer daemon's gRPC listener
    std::string pool;
    std::vector<PageHandle> pages;
  };
  struct TransferResult {
    uint64_t pages = 0;    // (page, layer) pairs committed
    uint64_t bytes = 0;    // bytes moved over UCX
    double seconds = 0;    // as the daemon measured it
    std::string transport; // UCX transports of the receiving daemon
  };
  absl::StatusOr<TransferResult> Push(const std::string& pool, std::span<const PageHandle> pages,
                                      const PeerPages& to, std::span<const uint32_t> layers = {},
                                      std::optional<Layout> transcode_to = std::nullopt,
                                      CallOptions call = {});
  // Pages `from.pages` of pool `from.pool` on the daemon at `from.address` → pages of
  // `pool` here; the same rules.
  absl::StatusOr<TransferResult> Pull(const PeerPages& from, const std::string& pool,
                                      std::span<const PageHandle> pages,
                                      std::span<const uint32_t> layers = {},
                                      std::optional<Layout> transcode_to = std::nullopt,
                                      CallOptions call = {});

  // ---- the KV cache ----
  // Creates a namespace over pools of the caller (the same binding again: the existing one).
  absl::StatusOr<NamespaceInfo> CreateNamespace(const NamespaceSpec& spec, CallOptions call = {});
  absl::StatusOr<NamespaceInfo> DescribeNamespace(const std::string& name, CallOptions call = {});
  absl::Status DeleteNamespace(const std::string& name, CallOptions call = {});
  // Stores blocks by key into member `pool`, all or nothing (every new block needs every
  // slot of every layer); keys already held are skipped.
  absl::StatusOr<PutResult> PutRows(const NamespaceRef& ns, const std::string& pool,
                                    std::span<const BlockRows> blocks, CallOptions call = {});
  absl::StatusOr<PutResult> PutPages(const NamespaceRef& ns, const std::string& pool,
                                     Layout layout, std::span<const BlockRecords> blocks,
                                     CallOptions call = {});
  // The longest prefix of `keys` held by every pool of the group; never waits for writers.
  absl::StatusOr<LookupResult> Lookup(const NamespaceRef& ns, std::span<const std::string> keys,
                                      const LookupOptions& options = {}, CallOptions call = {});
  absl::Status ReleaseLease(const NamespaceRef& ns, uint64_t lease_id, CallOptions call = {});
  // Dequantized rows of leased blocks in one member pool and layer: [blocks * page_size, 512].
  // FAILED_PRECONDITION (LEASE_EXPIRED) when the lease is not held: no bytes then.
  absl::StatusOr<std::vector<uint16_t>> LoadRows(const NamespaceRef& ns, uint64_t lease_id,
                                                 const std::string& pool, uint32_t layer,
                                                 BlockRange blocks = {}, CallOptions call = {});
  // Page records of leased blocks (each block, each listed layer; all when empty),
  // optionally transcoded.
  absl::StatusOr<std::vector<uint8_t>> LoadPages(const NamespaceRef& ns, uint64_t lease_id,
                                                 const std::string& pool,
                                                 std::span<const uint32_t> layers = {},
                                                 std::optional<Layout> transcode_to = std::nullopt,
                                                 BlockRange blocks = {}, CallOptions call = {});
  // The standard gRPC health check of the whole server: OK when SERVING.
  absl::Status Health(CallOptions call = {});

 private:
  struct Impl;
  explicit Client(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvferry::client
