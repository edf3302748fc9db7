// BlockIndex: namespaces, pending and stored blocks, lookups, leases, LRU eviction, events.
#include "core/block_index.h"

#include <xxhash.h>

#include <algorithm>
#include <random>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/container/node_hash_map.h"
#include "absl/strings/str_cat.h"
#include "common/errors.h"
#include "common/log.h"
#include "kvferry/kernels/status_macros.h"

namespace kvferry::server {

// One key's page in one member pool.
struct CacheBlock {
  enum class State : uint8_t { kAbsent, kPending, kStored };
  State state = State::kAbsent;
  uint64_t writer = 0;  // pending: the put writing it
  PageHandle page;      // stored: the page (a pending block's page belongs to its put)
  int32_t pins = 0;     // leases and loads holding it
  uint64_t last_used = 0;
  bool in_lru = false;
  std::list<std::pair<const std::string*, CacheBlock*>>::iterator lru;
};

struct CacheMember {
  std::weak_ptr<Pool> pool;
  MemberInfo info;
  bool alive = true;  // false once the pool was deleted
  int64_t stored = 0, pending = 0;
  // Stored, unpinned blocks (key, block), least recently used first.
  std::list<std::pair<const std::string*, CacheBlock*>> lru;
};

struct CacheNamespace {
  std::string tenant;
  NamespaceInfo info;
  std::vector<CacheMember> members;
  // key → one block per member (node map: blocks keep their address while they exist)
  absl::node_hash_map<std::string, std::vector<CacheBlock>> entries;
  bool deleted = false;
};

namespace {

using State = CacheBlock::State;

void HashField(XXH3_state_t* state, const void* data, uint64_t size) {
  XXH3_64bits_update(state, &size, sizeof(size));  // little-endian hosts only (x86-64, arm64)
  XXH3_64bits_update(state, data, size);
}
void HashString(XXH3_state_t* state, const std::string& s) { HashField(state, s.data(), s.size()); }
void HashNumber(XXH3_state_t* state, uint64_t v) { XXH3_64bits_update(state, &v, sizeof(v)); }

absl::Status NamespaceNotFound(const std::string& name) {
  return Error(absl::StatusCode::kNotFound, ErrorReason::kNamespaceNotFound,
               absl::StrCat("no namespace named ", log::Quoted(name)));
}

absl::Status Deleted(const CacheNamespace& ns) {
  return Error(absl::StatusCode::kAborted, ErrorReason::kNamespaceDeleted,
               absl::StrCat("namespace ", log::Quoted(ns.info.name), " was deleted"));
}

absl::Status PoolGone(const CacheMember& m) {
  return Error(absl::StatusCode::kAborted, ErrorReason::kPoolDeleted,
               absl::StrCat("pool ", log::Quoted(m.info.pool), " of the namespace was deleted"));
}

absl::Status LeaseNotHeld(uint64_t id) {
  return Error(absl::StatusCode::kFailedPrecondition, ErrorReason::kLeaseExpired,
               absl::StrCat("lease ", id,
                            " is not held (expired, released, or never granted); look up again"));
}

bool ValidName(const std::string& name) {
  if (name.empty() || name.size() > 128) return false;
  return std::all_of(name.begin(), name.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '.' || c == '-';
  });
}

int MemberIndex(const CacheNamespace& ns, const std::string& pool) {
  for (size_t i = 0; i < ns.members.size(); ++i) {
    if (ns.members[i].info.pool == pool) return static_cast<int>(i);
  }
  return -1;
}

absl::Status NotAMember(const CacheNamespace& ns, const std::string& pool) {
  return Error(absl::StatusCode::kInvalidArgument, ErrorReason::kNotAMember,
               absl::StrCat("pool ", log::Quoted(pool), " is not a member of namespace ",
                            log::Quoted(ns.info.name)));
}

}  // namespace

uint64_t NamespaceDigest(const NamespaceSpec& spec) {
  XXH3_state_t* state = XXH3_createState();
  XXH3_64bits_reset(state);
  HashString(state, "kvferry.namespace.v1");
  HashString(state, spec.name);
  HashString(state, spec.model_fingerprint);
  HashString(state, spec.layer_group);
  HashString(state, spec.tenant_salt);
  HashNumber(state, static_cast<uint64_t>(spec.block_tokens));
  HashNumber(state, spec.members.size());
  for (const auto& pool : spec.members) {
    HashString(state, pool->config().name);
    HashString(state, LayoutName(pool->config().layout));
    HashNumber(state, static_cast<uint64_t>(pool->config().page_size));
    HashNumber(state, static_cast<uint64_t>(pool->config().num_layers));
  }
  const uint64_t digest = XXH3_64bits_digest(state);
  XXH3_freeState(state);
  return digest;
}

LoadPin::~LoadPin() {
  if (index_ != nullptr) index_->Unpin(*this);
}

BlockIndex::BlockIndex(BlockIndexOptions options)
    : options_(std::move(options)),
      events_(std::random_device()() | (uint64_t{std::random_device()()} << 32),
              options_.event_capacity) {}

BlockIndex::~BlockIndex() { events_.Close(); }

absl::Status BlockIndex::ValidateKey(absl::string_view key, size_t index) const {
  if (key.empty() || key.size() > options_.max_key_bytes) {
    return Error(absl::StatusCode::kInvalidArgument, ErrorReason::kInvalidRequest,
                 absl::StrCat("key ", index, " has ", key.size(), " bytes; keys have 1 to ",
                              options_.max_key_bytes));
  }
  return absl::OkStatus();
}

absl::StatusOr<NamespaceInfo> BlockIndex::CreateNamespace(const TenantAccount& owner,
                                                          NamespaceSpec spec) {
  if (!ValidName(spec.name)) {
    return Error(absl::StatusCode::kInvalidArgument, ErrorReason::kInvalidName,
                 "namespace name must have 1 to 128 characters of letters, digits, '_', '.', '-'");
  }
  if (spec.model_fingerprint.size() > 1024 || spec.layer_group.size() > 256 ||
      spec.tenant_salt.size() > 256) {
    return Error(absl::StatusCode::kInvalidArgument, ErrorReason::kInvalidRequest,
                 "model_fingerprint has at most 1024 bytes, layer_group and tenant_salt 256");
  }
  if (spec.block_tokens <= 0 || spec.block_tokens > (int64_t{1} << 20)) {
    return Error(absl::StatusCode::kInvalidArgument, ErrorReason::kInvalidGeometry,
                 absl::StrCat("block_tokens ", spec.block_tokens, " is not in [1, 2^20]"));
  }
  if (spec.max_blocks < 0) {
    return Error(absl::StatusCode::kInvalidArgument, ErrorReason::kInvalidRequest,
                 "max_blocks must be >= 0");
  }
  if (spec.members.empty() || spec.members.size() > 8) {
    return Error(absl::StatusCode::kInvalidArgument, ErrorReason::kInvalidRequest,
                 absl::StrCat("a namespace has 1 to 8 member pools, not ", spec.members.size()));
  }
  absl::flat_hash_set<uint64_t> ids;
  for (const auto& pool : spec.members) {
    if (!ids.insert(pool->id()).second) {
      return Error(absl::StatusCode::kInvalidArgument, ErrorReason::kInvalidRequest,
                   absl::StrCat("pool ", log::Quoted(pool->config().name), " is listed twice"));
    }
  }
  auto ns = std::make_shared<CacheNamespace>();
  ns->tenant = owner.name();
  ns->info.name = spec.name;
  ns->info.digest = NamespaceDigest(spec);
  ns->info.block_tokens = spec.block_tokens;
  ns->info.max_blocks = spec.max_blocks;
  for (const auto& pool : spec.members) {
    CacheMember m;
    m.pool = pool;
    m.info.pool = pool->config().name;
    m.info.pool_id = pool->id();
    m.info.layout = pool->config().layout;
    m.info.page_size = pool->config().page_size;
    m.info.num_layers = pool->config().num_layers;
    m.info.tier = pool->device();
    ns->members.push_back(std::move(m));
    ns->info.members.push_back(ns->members.back().info);
  }
  kvferry::MutexLock lock(&mu_);
  auto [it, inserted] = namespaces_.try_emplace({owner.name(), spec.name}, ns);
  if (!inserted) {
    const CacheNamespace& old = *it->second;
    bool same = old.info.digest == ns->info.digest && old.info.max_blocks == spec.max_blocks;
    for (size_t i = 0; same && i < old.members.size(); ++i) {
      same = old.members[i].alive && old.members[i].info.pool_id == ns->members[i].info.pool_id;
    }
    if (!same) {
      return Error(absl::StatusCode::kAlreadyExists, ErrorReason::kNamespaceExists,
                   absl::StrCat("namespace ", log::Quoted(spec.name),
                                " exists with another binding or other pools"));
    }
    NamespaceInfo info = old.info;
    for (size_t i = 0; i < old.members.size(); ++i) info.members[i].blocks = old.members[i].stored;
    return info;
  }
  for (size_t i = 0; i < ns->members.size(); ++i) {
    by_pool_[ns->members[i].info.pool_id].emplace_back(ns.get(), static_cast<int>(i));
  }
  return ns->info;
}

absl::StatusOr<std::shared_ptr<CacheNamespace>> BlockIndex::FindLocked(const TenantAccount& owner,
                                                                       const std::string& name,
                                                                       uint64_t digest,
                                                                       bool check_digest) const {
  auto it = namespaces_.find(std::make_pair(owner.name(), name));
  if (it == namespaces_.end()) return NamespaceNotFound(name);
  if (check_digest && it->second->info.digest != digest) {
    // The namespace's digest is not echoed: the caller computes its own.
    return Error(absl::StatusCode::kFailedPrecondition, ErrorReason::kNamespaceMismatch,
                 absl::StrCat("digest ", digest, " does not match namespace ", log::Quoted(name),
                              ": another model, layout, page size, layer group or salt"));
  }
  return it->second;
}

absl::StatusOr<NamespaceInfo> BlockIndex::DescribeNamespace(const TenantAccount& owner,
                                                            const std::string& name) const {
  kvferry::ReaderMutexLock lock(&mu_);
  KVF_ASSIGN_OR_RETURN(std::shared_ptr<CacheNamespace> ns, FindLocked(owner, name, 0, false));
  NamespaceInfo info = ns->info;
  for (size_t i = 0; i < ns->members.size(); ++i) info.members[i].blocks = ns->members[i].stored;
  return info;
}

absl::Status BlockIndex::DeleteNamespace(const TenantAccount& owner, const std::string& name) {
  std::vector<Victim> victims;
  {
    kvferry::MutexLock lock(&mu_);
    KVF_ASSIGN_OR_RETURN(std::shared_ptr<CacheNamespace> ns, FindLocked(owner, name, 0, false));
    namespaces_.erase(std::make_pair(owner.name(), name));
    for (auto lease = leases_.begin(); lease != leases_.end();) {
      auto next = std::next(lease);
      if (lease->second.ns == ns) {
        expiries_.erase({lease->second.expiry, lease->first});
        leases_.erase(lease);
      }
      lease = next;
    }
    for (size_t m = 0; m < ns->members.size(); ++m) {
      auto& users = by_pool_[ns->members[m].info.pool_id];
      std::erase(users, std::make_pair(ns.get(), static_cast<int>(m)));
      if (users.empty()) by_pool_.erase(ns->members[m].info.pool_id);
    }
    std::vector<std::string> keys;
    for (const auto& [key, blocks] : ns->entries) keys.push_back(key);
    for (const std::string& key : keys) {
      auto it = ns->entries.find(key);
      for (size_t m = 0; m < ns->members.size() && it != ns->entries.end(); ++m) {
        if (it->second[m].state == State::kStored) {
          victims.push_back({ns->members[m].pool, it->second[m].page});
        }
        RemoveLocked(*ns, static_cast<int>(m), key, BlockEvent::Cause::kNamespaceDeleted);
        it = ns->entries.find(key);
      }
    }
    ns->deleted = true;
  }
  FreeVictims(victims);
  return absl::OkStatus();
}

void BlockIndex::RemoveLocked(CacheNamespace& ns, int member, const std::string& key,
                              BlockEvent::Cause cause) {
  auto it = ns.entries.find(key);
  if (it == ns.entries.end()) return;
  CacheBlock& b = it->second[member];
  CacheMember& m = ns.members[member];
  if (b.state == State::kStored) {
    --m.stored;
    if (b.in_lru) m.lru.erase(b.lru);
    events_.Append(ns.tenant, BlockEvent{0, BlockEvent::Kind::kRemoved, cause, ns.info.name, key,
                                         m.info.pool, m.info.tier});
  } else if (b.state == State::kPending) {
    --m.pending;
  }
  b = CacheBlock{};
  if (std::all_of(it->second.begin(), it->second.end(),
                  [](const CacheBlock& x) { return x.state == State::kAbsent; })) {
    ns.entries.erase(it);
  }
}

void BlockIndex::FreeVictims(std::vector<Victim>& victims) {
  for (const Victim& v : victims) {
    // A deleted pool frees its memory whole; otherwise the page is zeroed and its
    // generation bumped, so a handle taken before the eviction is refused.
    if (std::shared_ptr<Pool> pool = v.pool.lock()) {
      const PageHandle page[] = {v.page};
      pool->FreePages(page).IgnoreError();
    }
  }
  victims.clear();
}

bool BlockIndex::EvictLocked(CacheNamespace* ns, int member, uint64_t pool_id,
                             std::vector<Victim>* victims) {
  CacheNamespace* best_ns = nullptr;
  int best_member = -1;
  uint64_t best_tick = 0;
  auto consider = [&](CacheNamespace* n, int m) {
    const auto& lru = n->members[m].lru;
    if (lru.empty()) return;
    const uint64_t tick = lru.front().second->last_used;
    if (best_ns == nullptr || tick < best_tick) {
      best_ns = n;
      best_member = m;
      best_tick = tick;
    }
  };
  if (member >= 0) {
    consider(ns, member);
  } else if (auto it = by_pool_.find(pool_id); it != by_pool_.end()) {
    for (const auto& [n, m] : it->second) consider(n, m);
  }
  if (best_ns == nullptr) return false;
  CacheMember& m = best_ns->members[best_member];
  const std::string key = *m.lru.front().first;
  victims->push_back({m.pool, m.lru.front().second->page});
  RemoveLocked(*best_ns, best_member, key, BlockEvent::Cause::kEvicted);
  ++evictions_;
  return true;
}

void BlockIndex::ExpireLeasesLocked() {
  const absl::Time now = options_.clock ? options_.clock() : absl::Now();
  while (!expiries_.empty() && expiries_.begin()->first <= now) {
    EndLeaseLocked(expiries_.begin()->second);
    ++lease_expirations_;
  }
}

void BlockIndex::EndLeaseLocked(uint64_t id) {
  auto it = leases_.find(id);
  if (it == leases_.end()) return;
  Lease& lease = it->second;
  for (size_t i = 0; i < lease.members.size(); ++i) {
    for (size_t k = 0; k < lease.keys.size(); ++k) {
      UnpinLocked(*lease.ns, lease.members[i], lease.keys[k], lease.pages[i][k]);
    }
  }
  expiries_.erase({lease.expiry, id});
  leases_.erase(it);
}

void BlockIndex::UnpinLocked(CacheNamespace& ns, int member, const std::string& key,
                             const PageHandle& page) {
  auto it = ns.entries.find(key);
  if (it == ns.entries.end()) return;
  CacheBlock& b = it->second[member];
  // Removed (pool deleted) and perhaps stored again since: not this pin's block.
  if (b.state != State::kStored || b.page.page_id != page.page_id ||
      b.page.generation != page.generation || b.pins == 0) {
    return;
  }
  if (--b.pins == 0) {
    // Back in the LRU as just used.
    b.last_used = ++tick_;
    b.lru = ns.members[member].lru.insert(ns.members[member].lru.end(), {&it->first, &b});
    b.in_lru = true;
  }
}

absl::StatusOr<LookupResult> BlockIndex::Lookup(const TenantAccount& owner,
                                                const LookupRequest& request) {
  if (static_cast<int64_t>(request.keys.size()) > options_.max_keys_per_call) {
    return Error(absl::StatusCode::kInvalidArgument, ErrorReason::kInvalidRequest,
                 absl::StrCat(request.keys.size(), " keys in one lookup; at most ",
                              options_.max_keys_per_call));
  }
  for (size_t i = 0; i < request.keys.size(); ++i) {
    KVF_RETURN_IF_ERROR(ValidateKey(request.keys[i], i));
  }
  if (request.lease_ttl < absl::ZeroDuration() || request.lease_ttl > options_.max_lease_ttl) {
    return Error(absl::StatusCode::kInvalidArgument, ErrorReason::kInvalidRequest,
                 absl::StrCat("lease TTL ", absl::FormatDuration(request.lease_ttl),
                              " is not in [0, ", absl::FormatDuration(options_.max_lease_ttl), "]"));
  }
  kvferry::MutexLock lock(&mu_);
  ExpireLeasesLocked();
  KVF_ASSIGN_OR_RETURN(std::shared_ptr<CacheNamespace> ns,
                       FindLocked(owner, request.name_space, request.digest, true));
  std::vector<int> group;
  for (const std::string& pool : request.pools) {
    const int m = MemberIndex(*ns, pool);
    if (m < 0) return NotAMember(*ns, pool);
    if (std::find(group.begin(), group.end(), m) != group.end()) {
      return Error(absl::StatusCode::kInvalidArgument, ErrorReason::kInvalidRequest,
                   absl::StrCat("pool ", log::Quoted(pool), " is named twice"));
    }
    group.push_back(m);
  }
  if (group.empty()) {
    for (size_t m = 0; m < ns->members.size(); ++m) group.push_back(static_cast<int>(m));
  }
  LookupResult result;
  result.block_tokens = ns->info.block_tokens;
  std::vector<std::vector<CacheBlock>*> hits;
  hits.reserve(request.keys.size());
  size_t k = 0;
  for (; k < request.keys.size(); ++k) {
    auto it = ns->entries.find(request.keys[k]);
    if (it == ns->entries.end()) break;
    bool stored = true, held = true;
    for (int m : group) {
      const State s = it->second[m].state;
      stored = stored && s == State::kStored;
      held = held && s != State::kAbsent;
    }
    if (!held) break;
    if (!stored || result.pending_blocks > 0) {
      ++result.pending_blocks;
    } else {
      ++result.hit_blocks;
      hits.push_back(&it->second);
    }
  }
  // Every hit is used now: the most recently used end of its LRU.
  for (std::vector<CacheBlock>* blocks : hits) {
    for (int m : group) {
      CacheBlock& b = (*blocks)[m];
      b.last_used = ++tick_;
      if (b.in_lru) {
        auto& lru = ns->members[m].lru;
        lru.splice(lru.end(), lru, b.lru);
      }
    }
  }
  if (request.lease_ttl > absl::ZeroDuration() && result.hit_blocks > 0) {
    uint64_t id = 0;
    while (id == 0 || leases_.contains(id)) id = absl::Uniform<uint64_t>(bitgen_);
    Lease lease;
    lease.tenant = owner.name();
    lease.ns = ns;
    lease.members = group;
    for (int64_t i = 0; i < result.hit_blocks; ++i) lease.keys.emplace_back(request.keys[i]);
    lease.pages.resize(group.size());
    for (size_t g = 0; g < group.size(); ++g) {
      auto& lru = ns->members[group[g]].lru;
      for (std::vector<CacheBlock>* blocks : hits) {
        CacheBlock& b = (*blocks)[group[g]];
        if (b.in_lru) {
          lru.erase(b.lru);
          b.in_lru = false;
        }
        ++b.pins;
        lease.pages[g].push_back(b.page);
      }
    }
    lease.expiry = (options_.clock ? options_.clock() : absl::Now()) + request.lease_ttl;
    result.lease_id = id;
    result.lease_expiry = lease.expiry;
    expiries_.insert({lease.expiry, id});
    leases_.emplace(id, std::move(lease));
  }
  ++lookups_;
  requested_tokens_ += static_cast<int64_t>(request.keys.size()) * ns->info.block_tokens;
  hit_tokens_ += result.hit_blocks * ns->info.block_tokens;
  return result;
}

absl::Status BlockIndex::ReleaseLease(const TenantAccount& owner, const std::string& name_space,
                                      uint64_t lease_id) {
  kvferry::MutexLock lock(&mu_);
  ExpireLeasesLocked();
  KVF_ASSIGN_OR_RETURN(std::shared_ptr<CacheNamespace> ns, FindLocked(owner, name_space, 0, false));
  auto it = leases_.find(lease_id);
  if (it == leases_.end() || it->second.tenant != owner.name() || it->second.ns != ns) {
    return LeaseNotHeld(lease_id);
  }
  EndLeaseLocked(lease_id);
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<LoadPin>> BlockIndex::PinForLoad(
    const TenantAccount& owner, const std::string& name_space, uint64_t digest, uint64_t lease_id,
    const std::string& pool, int64_t first, int64_t count) {
  kvferry::MutexLock lock(&mu_);
  ExpireLeasesLocked();
  KVF_ASSIGN_OR_RETURN(std::shared_ptr<CacheNamespace> ns,
                       FindLocked(owner, name_space, digest, true));
  auto it = leases_.find(lease_id);
  if (it == leases_.end() || it->second.tenant != owner.name() || it->second.ns != ns) {
    return LeaseNotHeld(lease_id);
  }
  const Lease& lease = it->second;
  const int member = MemberIndex(*ns, pool);
  if (member < 0) return NotAMember(*ns, pool);
  const auto g = std::find(lease.members.begin(), lease.members.end(), member);
  if (g == lease.members.end()) {
    return Error(absl::StatusCode::kInvalidArgument, ErrorReason::kNotAMember,
                 absl::StrCat("pool ", log::Quoted(pool), " was not in the lookup of lease ",
                              lease_id));
  }
  const int64_t held = static_cast<int64_t>(lease.keys.size());
  if (count == 0) count = held - first;
  if (first < 0 || count <= 0 || first + count > held) {
    return Error(absl::StatusCode::kInvalidArgument, ErrorReason::kBlockOutOfRange,
                 absl::StrCat("blocks [", first, ", ", first + count, ") are outside the lease's ",
                              held, " blocks"));
  }
  CacheMember& m = ns->members[member];
  std::shared_ptr<Pool> p = m.pool.lock();
  if (!m.alive || p == nullptr) return PoolGone(m);
  auto pin = std::unique_ptr<LoadPin>(new LoadPin());
  pin->ns_ = ns;
  pin->member_ = member;
  pin->pool_ = std::move(p);
  const auto& pages = lease.pages[g - lease.members.begin()];
  for (int64_t k = first; k < first + count; ++k) {
    auto e = ns->entries.find(lease.keys[k]);
    if (e == ns->entries.end() || e->second[member].state != State::kStored ||
        e->second[member].page.generation != pages[k].generation) {
      return PoolGone(m);  // only a deleted pool drops a pinned block
    }
    pin->keys_.push_back(lease.keys[k]);
    pin->pages_.push_back(pages[k]);
  }
  for (const std::string& key : pin->keys_) {
    CacheBlock& b = ns->entries.find(key)->second[member];
    if (b.in_lru) {
      m.lru.erase(b.lru);
      b.in_lru = false;
    }
    ++b.pins;
  }
  pin->index_ = this;
  return pin;
}

void BlockIndex::Unpin(LoadPin& pin) {
  kvferry::MutexLock lock(&mu_);
  for (size_t k = 0; k < pin.keys_.size(); ++k) {
    UnpinLocked(*pin.ns_, pin.member_, pin.keys_[k], pin.pages_[k]);
  }
}

BlockIndex::Snapshot BlockIndex::TakeSnapshot(const TenantAccount& owner) {
  Snapshot snapshot;
  snapshot.publisher_id = events_.publisher_id();
  kvferry::MutexLock lock(&mu_);
  ExpireLeasesLocked();
  // Under the index lock no event is appended: the sequence is the state's.
  snapshot.sequence = events_.sequence(owner.name());
  for (const auto& [name, ns] : namespaces_) {
    if (name.first != owner.name()) continue;
    for (const auto& [key, blocks] : ns->entries) {
      for (size_t m = 0; m < blocks.size(); ++m) {
        if (blocks[m].state != State::kStored) continue;
        snapshot.blocks.push_back(BlockEvent{0, BlockEvent::Kind::kStored, BlockEvent::Cause::kNone,
                                             ns->info.name, key, ns->members[m].info.pool,
                                             ns->members[m].info.tier});
      }
    }
  }
  return snapshot;
}

void BlockIndex::PoolDeleted(const Pool& pool) {
  kvferry::MutexLock lock(&mu_);
  auto it = by_pool_.find(pool.id());
  if (it == by_pool_.end()) return;
  for (const auto& [ns, member] : it->second) {
    ns->members[member].alive = false;
    std::vector<std::string> keys;
    for (const auto& [key, blocks] : ns->entries) {
      if (blocks[member].state != State::kAbsent) keys.push_back(key);
    }
    for (const std::string& key : keys) {
      RemoveLocked(*ns, member, key, BlockEvent::Cause::kPoolDeleted);
    }
  }
  by_pool_.erase(it);
}

CacheCounts BlockIndex::Counts() {
  CacheCounts c;
  kvferry::MutexLock lock(&mu_);
  ExpireLeasesLocked();
  c.lookups = lookups_;
  c.requested_tokens = requested_tokens_;
  c.hit_tokens = hit_tokens_;
  c.evictions = evictions_;
  c.lease_expirations = lease_expirations_;
  c.leases = static_cast<int64_t>(leases_.size());
  for (const auto& [name, ns] : namespaces_) {
    for (const CacheMember& m : ns->members) {
      c.blocks.push_back({name.first, name.second, m.info.pool, m.stored});
    }
  }
  std::sort(c.blocks.begin(), c.blocks.end(), [](const auto& a, const auto& b) {
    return std::tie(a.tenant, a.name_space, a.pool) < std::tie(b.tenant, b.name_space, b.pool);
  });
  return c;
}

// ---- puts ------------------------------------------------------------------------------------

absl::StatusOr<BlockIndex::PutTarget> BlockIndex::BeginPut(const TenantAccount& owner,
                                                           const std::string& name_space,
                                                           uint64_t digest,
                                                           const std::string& pool) {
  kvferry::MutexLock lock(&mu_);
  PutTarget target;
  KVF_ASSIGN_OR_RETURN(target.ns, FindLocked(owner, name_space, digest, true));
  target.member = MemberIndex(*target.ns, pool);
  if (target.member < 0) return NotAMember(*target.ns, pool);
  CacheMember& m = target.ns->members[target.member];
  target.pool = m.pool.lock();
  if (!m.alive || target.pool == nullptr) return PoolGone(m);
  target.writer = next_writer_++;
  return target;
}

absl::StatusOr<std::optional<PageHandle>> BlockIndex::Reserve(const PutTarget& t,
                                                              const std::string& key) {
  CacheNamespace& ns = *t.ns;
  CacheMember& m = ns.members[t.member];
  std::vector<Victim> victims;
  // Our pending block, or null when the namespace or the pool went away or it was dropped.
  auto ours = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) -> CacheBlock* {
    if (ns.deleted || !m.alive) return nullptr;
    auto it = ns.entries.find(key);
    if (it == ns.entries.end()) return nullptr;
    CacheBlock& b = it->second[t.member];
    return b.state == State::kPending && b.writer == t.writer ? &b : nullptr;
  };
  auto gone = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return ns.deleted ? Deleted(ns) : PoolGone(m);
  };
  {
    kvferry::MutexLock lock(&mu_);
    ExpireLeasesLocked();
    if (ns.deleted || !m.alive) return gone();
    auto [it, inserted] = ns.entries.try_emplace(key);
    if (inserted) it->second.resize(ns.members.size());
    CacheBlock& b = it->second[t.member];
    if (b.state != State::kAbsent) return std::nullopt;  // held, or another put writes it
    if (ns.info.max_blocks > 0 && m.stored + m.pending >= ns.info.max_blocks &&
        !EvictLocked(&ns, t.member, 0, &victims)) {
      if (inserted) ns.entries.erase(key);  // made here, every block absent
      return Error(absl::StatusCode::kResourceExhausted, ErrorReason::kCacheFull,
                   absl::StrCat("namespace ", log::Quoted(ns.info.name), " holds its ",
                                ns.info.max_blocks, " blocks in pool ", log::Quoted(m.info.pool),
                                " and every one is leased or being written"));
    }
    auto e = ns.entries.try_emplace(key).first;  // the eviction may have moved nothing, but be sure
    if (e->second.empty()) e->second.resize(ns.members.size());
    CacheBlock& mine = e->second[t.member];
    mine.state = State::kPending;
    mine.writer = t.writer;
    ++m.pending;
  }
  FreeVictims(victims);
  for (int attempt = 0;; ++attempt) {
    absl::StatusOr<std::vector<PageHandle>> page = t.pool->AllocatePages(1);
    absl::Status failed;
    {
      kvferry::MutexLock lock(&mu_);
      if (page.ok()) {
        if (ours() != nullptr) return page->front();
        failed = gone();
      } else {
        if (ours() == nullptr) return gone();
        const bool full = ReasonOf(page.status()) == ErrorReason::kPoolFull;
        if (!full || attempt >= 64 || !EvictLocked(nullptr, -1, m.info.pool_id, &victims)) {
          RemoveLocked(ns, t.member, key, BlockEvent::Cause::kNone);
          if (!full) return page.status();
          return Error(absl::StatusCode::kResourceExhausted, ErrorReason::kCacheFull,
                       absl::StrCat("pool ", log::Quoted(m.info.pool),
                                    " is full and every block in it is leased or being written"));
        }
      }
    }
    if (page.ok()) {
      t.pool->FreePages(*page).IgnoreError();
      return failed;
    }
    // Another put may take the freed page first: then evict again.
    FreeVictims(victims);
  }
}

absl::Status BlockIndex::Commit(const PutTarget& t, std::span<const std::string> keys,
                              std::span<const PageHandle> pages) {
  CacheNamespace& ns = *t.ns;
  CacheMember& m = ns.members[t.member];
  kvferry::MutexLock lock(&mu_);
  if (ns.deleted) return Deleted(ns);
  if (!m.alive) return PoolGone(m);
  std::vector<CacheBlock*> blocks;
  for (const std::string& key : keys) {
    auto it = ns.entries.find(key);
    if (it == ns.entries.end() || it->second[t.member].state != State::kPending ||
        it->second[t.member].writer != t.writer) {
      return Error(absl::StatusCode::kInternal, ErrorReason::kInternalError,
                   "a reserved block is missing at commit");
    }
    blocks.push_back(&it->second[t.member]);
  }
  for (size_t i = 0; i < keys.size(); ++i) {
    CacheBlock& b = *blocks[i];
    auto it = ns.entries.find(keys[i]);
    b.state = State::kStored;
    b.writer = 0;
    b.page = pages[i];
    b.last_used = ++tick_;
    b.lru = m.lru.insert(m.lru.end(), {&it->first, &b});
    b.in_lru = true;
    --m.pending;
    ++m.stored;
    events_.Append(ns.tenant, BlockEvent{0, BlockEvent::Kind::kStored, BlockEvent::Cause::kNone,
                                         ns.info.name, keys[i], m.info.pool, m.info.tier});
  }
  return absl::OkStatus();
}

void BlockIndex::Abort(const PutTarget& t, std::span<const std::string> keys,
                       std::span<const PageHandle> pages) {
  {
    CacheNamespace& ns = *t.ns;
    kvferry::MutexLock lock(&mu_);
    for (const std::string& key : keys) {
      auto it = ns.entries.find(key);
      if (it == ns.entries.end()) continue;
      const CacheBlock& b = it->second[t.member];
      if (b.state == State::kPending && b.writer == t.writer) {
        RemoveLocked(ns, t.member, key, BlockEvent::Cause::kNone);
      }
    }
  }
  if (!pages.empty()) t.pool->FreePages(pages).IgnoreError();
}

}  // namespace kvferry::server
