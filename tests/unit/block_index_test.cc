// The keyed-block index in process: prefixes, pending blocks, leases on a test clock,
// eviction through the pool's free path, the event log, and events replayed against
// snapshots under concurrent puts.
#include <atomic>
#include <cstring>
#include <set>
#include <thread>

#include "backend/cpu_backend.h"
#include "common/errors.h"
#include "common/random_rows.h"
#include "core/block_index.h"
#include "core/block_put.h"
#include "kvferry/kernels/status_macros.h"
#include "gtest/gtest.h"

namespace kvferry::server {
namespace {

std::shared_ptr<Pool> MakePool(const std::string& name, int page_size, int64_t pages,
                               int layers = 1, uint64_t incarnation = 7) {
  auto pool = Pool::Create(PoolConfig{name, Layout::kV41, page_size, pages, layers},
                           MakeCpuBackend(1), incarnation, nullptr);
  EXPECT_TRUE(pool.ok()) << pool.status();
  return *pool;
}

struct Fixture {
  TenantAccount tenant{"t"};
  absl::Time now = absl::FromUnixSeconds(1000);
  BlockIndex index{BlockIndexOptions{.event_capacity = 1 << 20,
                                     .max_lease_ttl = absl::Minutes(10),
                                     .max_keys_per_call = 1 << 16,
                                     .max_key_bytes = 256,
                                     .clock = [this] { return now; }}};

  NamespaceInfo Namespace(const std::string& name, std::vector<std::shared_ptr<Pool>> pools,
                          int64_t max_blocks = 0) {
    NamespaceSpec spec{name, "model", "all", "salt", 16, max_blocks, std::move(pools)};
    auto info = index.CreateNamespace(tenant, spec);
    EXPECT_TRUE(info.ok()) << info.status();
    return *info;
  }
  // Puts complete blocks of rows for `keys` into `pool` (layer 0 .. layers-1).
  absl::StatusOr<BlockPut::Result> Put(const NamespaceInfo& ns, const std::string& pool,
                                       const std::vector<std::string>& keys, int layers = 1) {
    KVF_ASSIGN_OR_RETURN(auto put, BlockPut::Begin(&index, tenant, ns.name, ns.digest, pool, false,
                                                   Layout::kV41, WriteLimits{}));
    const auto rows = testing::RandomRows(16, keys.size());
    for (const std::string& key : keys) {
      for (int l = 0; l < layers; ++l) {
        KVF_RETURN_IF_ERROR(put->AddRows(key, l, 0,
                                         {reinterpret_cast<const uint8_t*>(rows.data()),
                                          rows.size() * 2}));
      }
    }
    return put->Commit();
  }
  LookupResult Lookup(const NamespaceInfo& ns, const std::vector<std::string>& keys,
                      absl::Duration ttl = absl::ZeroDuration(),
                      std::vector<std::string> pools = {}) {
    auto r = index.Lookup(tenant, LookupRequest{ns.name, ns.digest, {keys.begin(), keys.end()},
                                                std::move(pools), ttl});
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? *r : LookupResult{};
  }
  // Every event so far.
  std::vector<BlockEvent> Events(uint64_t after = 0) {
    std::vector<BlockEvent> out;
    uint64_t latest;
    index.events().Read(tenant.name(), after, 1 << 20, absl::ZeroDuration(), &out, &latest);
    return out;
  }
};

TEST(BlockIndexTest, PendingBlocksAreNotHitsAndADroppedPutLeavesNothing) {
  Fixture f;
  auto pool = MakePool("p", 16, 4);
  const NamespaceInfo ns = f.Namespace("n", {pool});
  ASSERT_TRUE(f.Put(ns, "p", {"a"}).ok());
  {
    auto put = BlockPut::Begin(&f.index, f.tenant, ns.name, ns.digest, "p", false, Layout::kV41, {});
    ASSERT_TRUE(put.ok());
    const auto rows = testing::RandomRows(8, 1);
    ASSERT_TRUE((*put)->AddRows("b", 0, 0, {reinterpret_cast<const uint8_t*>(rows.data()), rows.size() * 2}).ok());
    const LookupResult r = f.Lookup(ns, {"a", "b", "c"});
    EXPECT_EQ(r.hit_blocks, 1);
    EXPECT_EQ(r.pending_blocks, 1);
    EXPECT_EQ(pool->Stats().pages_used, 2);
  }  // dropped uncommitted
  const LookupResult r = f.Lookup(ns, {"a", "b"});
  EXPECT_EQ(r.hit_blocks, 1);
  EXPECT_EQ(r.pending_blocks, 0);
  EXPECT_EQ(pool->Stats().pages_used, 1);
  ASSERT_EQ(f.Events().size(), 1u);  // only a's BlockStored
}

TEST(BlockIndexTest, LeasesExpireOnTheClockAndOnlyThenBecomeEvictable) {
  Fixture f;
  auto pool = MakePool("p", 16, 2);
  const NamespaceInfo ns = f.Namespace("n", {pool});
  ASSERT_TRUE(f.Put(ns, "p", {"a", "b"}).ok());
  const LookupResult leased = f.Lookup(ns, {"a", "b"}, absl::Seconds(5));
  ASSERT_NE(leased.lease_id, 0u);
  EXPECT_EQ(leased.lease_expiry, f.now + absl::Seconds(5));
  auto full = f.Put(ns, "p", {"c"});
  EXPECT_EQ(ReasonOf(full.status()), ErrorReason::kCacheFull);
  auto pin = f.index.PinForLoad(f.tenant, ns.name, ns.digest, leased.lease_id, "p", 0, 0);
  ASSERT_TRUE(pin.ok());
  const std::vector<PageHandle> pages = (*pin)->pages();
  pin->reset();
  f.now += absl::Seconds(5);  // expired exactly at its expiry
  pin = f.index.PinForLoad(f.tenant, ns.name, ns.digest, leased.lease_id, "p", 0, 0);
  EXPECT_EQ(pin.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(ReasonOf(pin.status()), ErrorReason::kLeaseExpired);
  ASSERT_TRUE(f.Put(ns, "p", {"c"}).ok());
  EXPECT_EQ(f.index.Counts().lease_expirations, 1);
  EXPECT_EQ(f.index.Counts().evictions, 1);
  // The evicted block's page was freed through the pool: its old handle is refused.
  int stale = 0;
  for (const PageHandle& h : pages) stale += !pool->table().CheckHandle(h).ok();
  EXPECT_EQ(stale, 1);
}

TEST(BlockIndexTest, ALoadThatStartedKeepsItsBlocksPastTheLeaseExpiry) {
  Fixture f;
  auto pool = MakePool("p", 16, 1);
  const NamespaceInfo ns = f.Namespace("n", {pool});
  ASSERT_TRUE(f.Put(ns, "p", {"a"}).ok());
  const LookupResult leased = f.Lookup(ns, {"a"}, absl::Seconds(1));
  auto pin = f.index.PinForLoad(f.tenant, ns.name, ns.digest, leased.lease_id, "p", 0, 0);
  ASSERT_TRUE(pin.ok());
  f.now += absl::Seconds(2);
  EXPECT_EQ(ReasonOf(f.Put(ns, "p", {"b"}).status()), ErrorReason::kCacheFull);
  EXPECT_TRUE(pool->table().CheckHandle((*pin)->pages()[0]).ok());
  pin->reset();  // the load ended
  ASSERT_TRUE(f.Put(ns, "p", {"b"}).ok());
}

// A put refused for want of room in one member leaves the key's blocks in the others.
TEST(BlockIndexTest, ARefusedPutKeepsTheKeysBlocksInOtherMembers) {
  Fixture f;
  auto p = MakePool("p", 16, 4), q = MakePool("q", 16, 4, 1, 8);
  const NamespaceInfo ns = f.Namespace("n", {p, q}, /*max_blocks=*/1);
  ASSERT_TRUE(f.Put(ns, "p", {"a"}).ok());
  ASSERT_TRUE(f.Put(ns, "q", {"a"}).ok());
  EXPECT_NE(f.Lookup(ns, {"a"}, absl::Seconds(60), {"p"}).lease_id, 0u);  // pins p's "a" only
  ASSERT_TRUE(f.Put(ns, "q", {"b"}).ok());  // evicts q's "a"
  EXPECT_EQ(ReasonOf(f.Put(ns, "p", {"b"}).status()), ErrorReason::kCacheFull);
  EXPECT_EQ(f.Lookup(ns, {"b"}, absl::ZeroDuration(), {"q"}).hit_blocks, 1);
  EXPECT_EQ(f.index.TakeSnapshot(f.tenant).blocks.size(), 2u);  // p/a and q/b
  EXPECT_EQ(q->Stats().pages_used, 1);
}

TEST(BlockIndexTest, MultiLayerBlocksNeedEveryLayer) {
  Fixture f;
  auto pool = MakePool("p", 16, 4, 3);
  const NamespaceInfo ns = f.Namespace("n", {pool});
  auto partial = f.Put(ns, "p", {"a"}, 2);
  EXPECT_EQ(ReasonOf(partial.status()), ErrorReason::kBlockIncomplete);
  EXPECT_EQ(pool->Stats().pages_used, 0);
  auto whole = f.Put(ns, "p", {"a"}, 3);
  ASSERT_TRUE(whole.ok());
  EXPECT_EQ(whole->stored, 1);
  EXPECT_EQ(pool->Stats().records_held, 3 * 16);
}

TEST(BlockIndexTest, DigestsDependOnEveryBoundField) {
  auto p = MakePool("p", 16, 1), q = MakePool("q", 16, 1, 1, 8);
  const NamespaceSpec base{"n", "model", "group", "salt", 16, 0, {p}};
  std::set<uint64_t> digests = {NamespaceDigest(base)};
  for (int i = 0; i < 7; ++i) {
    NamespaceSpec s = base;
    switch (i) {
      case 0: s.name = "m"; break;
      case 1: s.model_fingerprint = "model2"; break;
      case 2: s.layer_group = "group2"; break;
      case 3: s.tenant_salt = "salt2"; break;
      case 4: s.block_tokens = 32; break;
      case 5: s.members = {q}; break;
      case 6: s.members = {p, q}; break;
    }
    EXPECT_TRUE(digests.insert(NamespaceDigest(s)).second) << i;
  }
  NamespaceSpec capacity = base;
  capacity.max_blocks = 5;  // a limit, not a format: same digest
  EXPECT_EQ(NamespaceDigest(capacity), NamespaceDigest(base));
}

TEST(EventLogTest, ReadersGetConsecutiveEventsTimeOutOrLearnTheyAreLost) {
  EventLog log(42, 4);
  std::vector<BlockEvent> out;
  uint64_t latest = 0;
  EXPECT_EQ(log.Read("t", 0, 10, absl::Milliseconds(10), &out, &latest), EventLog::ReadResult::kTimeout);
  for (int i = 0; i < 6; ++i) log.Append("t", BlockEvent{0, BlockEvent::Kind::kStored, {}, "n", std::to_string(i), "p", "cpu"});
  log.Append("u", BlockEvent{});
  EXPECT_EQ(log.sequence("t"), 6u);
  EXPECT_EQ(log.sequence("u"), 1u);
  EXPECT_EQ(log.Read("t", 1, 10, absl::ZeroDuration(), &out, &latest), EventLog::ReadResult::kLost);
  EXPECT_EQ(log.Read("t", 2, 10, absl::ZeroDuration(), &out, &latest), EventLog::ReadResult::kEvents);
  ASSERT_EQ(out.size(), 4u);
  EXPECT_EQ(out[0].sequence, 3u);
  EXPECT_EQ(out[0].key, "2");
  EXPECT_EQ(out[3].sequence, 6u);
  EXPECT_EQ(log.Read("t", 7, 10, absl::ZeroDuration(), &out, &latest), EventLog::ReadResult::kLost);
  std::thread closer([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    log.Close();
  });
  out.clear();
  EXPECT_EQ(log.Read("t", 6, 10, absl::Seconds(30), &out, &latest), EventLog::ReadResult::kClosed);
  closer.join();
}

// Random puts into two small pools (evictions), lookups with leases, releases and a namespace
// deletion from several threads; afterwards the event log replayed from nothing is exactly
// the snapshot, and every pool page is either free or a stored block's.
TEST(BlockIndexTest, EventsReplayedEqualTheSnapshotAfterConcurrentChurn) {
  Fixture f;
  auto a = MakePool("a", 16, 12), b = MakePool("b", 16, 7, 1, 8);
  const NamespaceInfo n1 = f.Namespace("n1", {a, b});
  const NamespaceInfo n2 = f.Namespace("n2", {a}, 5);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      testing::FastRandom random(t + 1);
      for (int i = 0; i < 150; ++i) {
        const NamespaceInfo& ns = random.Next() % 3 ? n1 : n2;
        const std::string pool = &ns == &n1 && random.Next() % 2 ? "b" : "a";
        const std::string key = "k" + std::to_string(random.Next() % 40);
        if (random.Next() % 4) {
          auto r = f.Put(ns, pool, {key, key + "x"});
          EXPECT_TRUE(r.ok() || ReasonOf(r.status()) == ErrorReason::kCacheFull) << r.status();
        } else {
          auto r = f.index.Lookup(f.tenant, LookupRequest{ns.name, ns.digest, {key}, {}, absl::Seconds(1)});
          ASSERT_TRUE(r.ok());
          if (r->lease_id != 0 && random.Next() % 2) {
            EXPECT_TRUE(f.index.ReleaseLease(f.tenant, ns.name, r->lease_id).ok());
          }
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  ASSERT_TRUE(f.index.DeleteNamespace(f.tenant, "n2").ok());
  const BlockIndex::Snapshot snapshot = f.index.TakeSnapshot(f.tenant);
  std::set<std::string> replayed;
  uint64_t sequence = 0;
  for (const BlockEvent& e : f.Events()) {
    EXPECT_EQ(e.sequence, ++sequence);
    const std::string id = e.name_space + "/" + e.pool + "/" + e.key;
    if (e.kind == BlockEvent::Kind::kStored) {
      EXPECT_TRUE(replayed.insert(id).second) << id;
    } else {
      EXPECT_EQ(replayed.erase(id), 1u) << id;
    }
  }
  EXPECT_EQ(sequence, snapshot.sequence);
  std::set<std::string> held;
  int64_t in_a = 0, in_b = 0;
  for (const BlockEvent& e : snapshot.blocks) {
    held.insert(e.name_space + "/" + e.pool + "/" + e.key);
    (e.pool == "a" ? in_a : in_b)++;
  }
  EXPECT_EQ(replayed, held);
  EXPECT_GT(f.index.Counts().evictions, 0);
  // No page leaked: a pool's used pages are its stored blocks.
  EXPECT_EQ(a->Stats().pages_used, in_a);
  EXPECT_EQ(b->Stats().pages_used, in_b);
}

}  // namespace
}  // namespace kvferry::server
