// The keyed-block index that makes the pools a KV cache: namespaces, blocks by key, prefix
// lookups, leases, LRU eviction, and the events and snapshots routers follow.
//
// A key (bytes chosen by the caller, e.g. a chain hash over a block's token ids) names one
// block of `block_tokens` prompt tokens inside a namespace. A namespace belongs to one tenant
// and binds everything that changes the bytes: the model fingerprint, the layer group, the
// tenant's salt, and its member pools (each with its layout, page size and layers). Its
// digest (NamespaceDigest) is sent with every call, and a call whose digest is not the
// namespace's fails closed (NAMESPACE_MISMATCH), so a block is never found in the wrong
// format. A block of a key is one page in each member pool (all its layers); a lookup counts
// a prefix only where every member it names holds the block (a prefix unit: e.g. the
// compressed entries plus the last window).
//
// Blocks are pending while a put writes them and stored once it commits; lookups see both
// and never wait for a writer (the index lock covers bookkeeping only, never device work).
// A lease pins the hits of a lookup for a TTL; pinned blocks are never evicted. When a pool
// is full, the least recently used unpinned stored block of that pool is evicted: its page
// freed through the pool (zeroed, generation bumped), so no stale handle reads it. Every
// stored and removed block is an event (event_log.h). Thread-safe. No gRPC.
#pragma once

#include <cstdint>
#include <functional>
#include <list>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/btree_set.h"
#include "absl/container/flat_hash_map.h"
#include "absl/random/random.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "core/event_log.h"
#include "core/pool.h"
#include "core/tenant.h"
#include "kvferry/mutex.h"

namespace kvferry::server {

// What a namespace binds. Limits are checked by CreateNamespace.
struct NamespaceSpec {
  std::string name;               // 1-128 characters of [A-Za-z0-9_.-]
  std::string model_fingerprint;  // the caller's name for the model and its config; <= 1024 B
  std::string layer_group;        // which layers the member pools hold; <= 256 bytes
  std::string tenant_salt;        // the caller's salt; <= 256 bytes
  int64_t block_tokens = 0;       // prompt tokens one key names; in [1, 2^20]
  int64_t max_blocks = 0;         // blocks per member pool; 0: as many as the pools hold
  std::vector<std::shared_ptr<Pool>> members;  // 1..8 distinct pools of the owner
};

struct MemberInfo {
  std::string pool;
  uint64_t pool_id = 0;
  Layout layout = Layout::kV4;
  int page_size = 0;
  int num_layers = 0;
  std::string tier;     // the pool's device
  int64_t blocks = 0;   // stored blocks
};

struct NamespaceInfo {
  std::string name;
  uint64_t digest = 0;
  int64_t block_tokens = 0;
  int64_t max_blocks = 0;
  std::vector<MemberInfo> members;
};

// XXH3-64 (seed 0) of the binding, each field as an 8-byte little-endian length (or value)
// followed by its bytes: "kvferry.namespace.v1", name, model_fingerprint, layer_group,
// tenant_salt, block_tokens, the member count, then per member in order its pool name,
// layout name ("v4", "v41", "v41_fp4"), page_size and num_layers.
uint64_t NamespaceDigest(const NamespaceSpec& spec);

struct LookupRequest {
  std::string name_space;
  uint64_t digest = 0;
  std::vector<absl::string_view> keys;  // in prefix order; viewed, not copied, for the call
  std::vector<std::string> pools;  // the group that must hold each block; empty: all members
  absl::Duration lease_ttl = absl::ZeroDuration();  // > 0: pin the hits under a lease
};

struct LookupResult {
  int64_t hit_blocks = 0;      // the longest prefix of keys stored in every pool of the group
  int64_t pending_blocks = 0;  // the keys after it held or still being written in every pool
  int64_t block_tokens = 0;
  uint64_t lease_id = 0;       // 0: no lease (none asked for, or no hit)
  absl::Time lease_expiry;
};

// Cache totals for the metrics endpoint.
struct CacheCounts {
  int64_t lookups = 0;
  int64_t requested_tokens = 0;  // keys looked up x block_tokens
  int64_t hit_tokens = 0;        // hit blocks x block_tokens
  int64_t evictions = 0;
  int64_t lease_expirations = 0;
  int64_t leases = 0;            // held now
  struct Blocks {
    std::string tenant, name_space, pool;
    int64_t blocks = 0;
  };
  std::vector<Blocks> blocks;    // stored blocks per namespace and member pool
};

struct BlockIndexOptions {
  int64_t event_capacity = int64_t{1} << 16;  // events kept per tenant for subscribers
  absl::Duration max_lease_ttl = absl::Minutes(10);
  int64_t max_keys_per_call = int64_t{1} << 16;
  size_t max_key_bytes = 256;
  std::function<absl::Time()> clock;  // default absl::Now
};

struct CacheNamespace;  // block_index.cc
class BlockIndex;

// The pages of some blocks of a lease in one member pool, pinned (not evictable) until this
// is destroyed, whatever happens to the lease meanwhile: a load that started completes.
class LoadPin {
 public:
  ~LoadPin();
  const std::shared_ptr<Pool>& pool() const { return pool_; }
  const std::vector<PageHandle>& pages() const { return pages_; }

 private:
  friend class BlockIndex;
  LoadPin() = default;
  BlockIndex* index_ = nullptr;
  std::shared_ptr<CacheNamespace> ns_;
  int member_ = 0;
  std::shared_ptr<Pool> pool_;
  std::vector<std::string> keys_;
  std::vector<PageHandle> pages_;
};

class BlockIndex {
 public:
  explicit BlockIndex(BlockIndexOptions options = {});
  ~BlockIndex();

  // INVALID_ARGUMENT (name, fields, members), ALREADY_EXISTS (NAMESPACE_EXISTS: the owner has
  // that name with another binding). The same name with the same binding and pools answers
  // the existing namespace.
  absl::StatusOr<NamespaceInfo> CreateNamespace(const TenantAccount& owner, NamespaceSpec spec)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Drops every block (BlockRemoved events) and lease of the namespace; puts running on it
  // fail with ABORTED (NAMESPACE_DELETED).
  absl::Status DeleteNamespace(const TenantAccount& owner, const std::string& name)
      ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<NamespaceInfo> DescribeNamespace(const TenantAccount& owner,
                                                  const std::string& name) const
      ABSL_LOCKS_EXCLUDED(mu_);

  absl::StatusOr<LookupResult> Lookup(const TenantAccount& owner, const LookupRequest& request)
      ABSL_LOCKS_EXCLUDED(mu_);
  // FAILED_PRECONDITION (LEASE_EXPIRED) when the lease is not held.
  absl::Status ReleaseLease(const TenantAccount& owner, const std::string& name_space,
                            uint64_t lease_id) ABSL_LOCKS_EXCLUDED(mu_);
  // Blocks [first, first + count) of a lease's hits (count 0: to the end) in member `pool`,
  // pinned for a load. FAILED_PRECONDITION (LEASE_EXPIRED) unless the lease is held.
  absl::StatusOr<std::unique_ptr<LoadPin>> PinForLoad(const TenantAccount& owner,
                                                      const std::string& name_space,
                                                      uint64_t digest, uint64_t lease_id,
                                                      const std::string& pool, int64_t first,
                                                      int64_t count) ABSL_LOCKS_EXCLUDED(mu_);

  // Every stored block of the owner's namespaces, and the owner's event sequence number
  // after which events continue from exactly this state.
  struct Snapshot {
    uint64_t publisher_id = 0;
    uint64_t sequence = 0;
    std::vector<BlockEvent> blocks;  // kind kStored, sequence 0
  };
  Snapshot TakeSnapshot(const TenantAccount& owner) ABSL_LOCKS_EXCLUDED(mu_);
  EventLog& events() { return events_; }

  // Drops the blocks held in `pool` (being deleted).
  void PoolDeleted(const Pool& pool) ABSL_LOCKS_EXCLUDED(mu_);
  CacheCounts Counts() ABSL_LOCKS_EXCLUDED(mu_);

  // ---- for puts (block_put.h) ----------------------------------------------------------------
  struct PutTarget {
    std::shared_ptr<CacheNamespace> ns;
    int member = 0;
    std::shared_ptr<Pool> pool;
    uint64_t writer = 0;
  };
  // The member `pool` of the namespace, checked against the digest.
  absl::StatusOr<PutTarget> BeginPut(const TenantAccount& owner, const std::string& name_space,
                                     uint64_t digest, const std::string& pool)
      ABSL_LOCKS_EXCLUDED(mu_);
  // A new pending block for `key`, with a page the caller owns until Commit (and frees if it
  // does not commit); nullopt when the member holds the key or another put is writing it.
  // Evicts least recently used unpinned blocks when the pool (or the namespace's
  // max_blocks) is full: RESOURCE_EXHAUSTED (CACHE_FULL) when none can go.
  absl::StatusOr<std::optional<PageHandle>> Reserve(const PutTarget& target, const std::string& key)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Stores the target's pending blocks of `keys` in `pages` (as Reserve gave them), all or none (ABORTED when the namespace or
  // pool went away: the caller still owns the pages, and Aborts).
  absl::Status Commit(const PutTarget& target, std::span<const std::string> keys,
                      std::span<const PageHandle> pages) ABSL_LOCKS_EXCLUDED(mu_);
  // Forgets the target's pending blocks of `keys` and frees their `pages` (zeroed before
  // anyone gets them again; no lookup ever saw them). Also after a refused Commit.
  void Abort(const PutTarget& target, std::span<const std::string> keys,
             std::span<const PageHandle> pages) ABSL_LOCKS_EXCLUDED(mu_);

  absl::Status ValidateKey(absl::string_view key, size_t index) const;

 private:
  friend class LoadPin;
  struct Victim {
    std::weak_ptr<Pool> pool;
    PageHandle page;
  };
  absl::StatusOr<std::shared_ptr<CacheNamespace>> FindLocked(const TenantAccount& owner,
                                                             const std::string& name,
                                                             uint64_t digest, bool check_digest) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  void ExpireLeasesLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void EndLeaseLocked(uint64_t id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void UnpinLocked(CacheNamespace& ns, int member, const std::string& key, const PageHandle& page)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Evicts the least recently used unpinned block of one member (member >= 0) or of a whole
  // pool; false when there is none.
  bool EvictLocked(CacheNamespace* ns, int member, uint64_t pool_id, std::vector<Victim>* victims)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Removes a block; a stored one becomes a BlockRemoved event.
  void RemoveLocked(CacheNamespace& ns, int member, const std::string& key, BlockEvent::Cause cause)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  static void FreeVictims(std::vector<Victim>& victims);
  void Unpin(LoadPin& pin) ABSL_LOCKS_EXCLUDED(mu_);

  const BlockIndexOptions options_;
  EventLog events_;
  mutable kvferry::Mutex mu_;
  absl::BitGen bitgen_ ABSL_GUARDED_BY(mu_);
  uint64_t tick_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t next_writer_ ABSL_GUARDED_BY(mu_) = 1;
  // (tenant, name) → namespace
  absl::flat_hash_map<std::pair<std::string, std::string>, std::shared_ptr<CacheNamespace>>
      namespaces_ ABSL_GUARDED_BY(mu_);
  // pool id → the (namespace, member) pairs it serves
  absl::flat_hash_map<uint64_t, std::vector<std::pair<CacheNamespace*, int>>> by_pool_
      ABSL_GUARDED_BY(mu_);
  struct Lease {
    std::string tenant;
    std::shared_ptr<CacheNamespace> ns;
    std::vector<int> members;
    std::vector<std::string> keys;
    std::vector<std::vector<PageHandle>> pages;  // [member of `members`][key]
    absl::Time expiry;
  };
  absl::flat_hash_map<uint64_t, Lease> leases_ ABSL_GUARDED_BY(mu_);
  absl::btree_set<std::pair<absl::Time, uint64_t>> expiries_ ABSL_GUARDED_BY(mu_);
  int64_t lookups_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t requested_tokens_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t hit_tokens_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t evictions_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t lease_expirations_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace kvferry::server
