// The KV cache (kvferry.v1.KvCache) end to end: the real kvferryd, through generated stubs.
#include <httplib.h>
#include <openssl/sha.h>
#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <fstream>
#include <map>
#include <set>
#include <thread>

#include "cache_harness.h"
#include "common/golden.h"
#include "common/random_rows.h"

namespace kvferry {
namespace {

using testing::Cache;
using testing::Daemon;

std::string Key(const std::string& chain, int i) { return chain + "#" + std::to_string(i); }
std::vector<std::string> Keys(const std::string& chain, int n) {
  std::vector<std::string> keys;
  for (int i = 0; i < n; ++i) keys.push_back(Key(chain, i));
  return keys;
}

std::string Fetch(int port, const std::string& path) {
  httplib::Client client("127.0.0.1", port);
  auto res = client.Get(path);
  return res && res->status == 200 ? res->body : "";
}

// The digest recipe of cache.proto, computed here from the request alone.
uint64_t ExpectedDigest(const v1::CreateNamespaceRequest& req,
                        const std::vector<std::tuple<std::string, int, int>>& members) {
  std::string bytes;
  auto field = [&](const std::string& s) {
    const uint64_t n = s.size();
    bytes.append(reinterpret_cast<const char*>(&n), 8);
    bytes.append(s);
  };
  auto number = [&](uint64_t v) { bytes.append(reinterpret_cast<const char*>(&v), 8); };
  field("kvferry.namespace.v1");
  field(req.name());
  field(req.model_fingerprint());
  field(req.layer_group());
  field(req.tenant_salt());
  number(req.block_tokens());
  number(members.size());
  for (size_t i = 0; i < members.size(); ++i) {
    field(req.pools(i));
    field(std::get<0>(members[i]));
    number(std::get<1>(members[i]));
    number(std::get<2>(members[i]));
  }
  return XXH3_64bits(bytes.data(), bytes.size());
}

// ---- golden vectors ---------------------------------------------------------------------

// Rows put by key come back dequantized exactly as the independent golden vectors say, in
// every layout; records put by key come back byte for byte, and dequantized as the goldens.
TEST(CacheGoldenTest, PutLookupLoadIsByteExactWithTheGoldens) {
  Daemon d;
  Cache cache(d);
  for (const testing::GoldenCase& c : testing::GoldenCases()) {
    const auto input = testing::ReadArray<uint16_t>(c.file("input.bf16"));
    const auto locs = testing::ReadArray<int64_t>(c.file("locs.i64"));
    const int blocks = static_cast<int>(c.tokens / c.page_size);  // whole blocks of input rows
    ASSERT_GT(blocks, 0);
    for (Layout layout : testing::AllLayouts()) {
      const std::string l = LayoutName(layout);
      const std::string pool = c.name + "." + l;
      SCOPED_TRACE(pool);
      testing::CreatePool(d, pool, layout, c.page_size, blocks + c.num_pages);
      const v1::Namespace ns = cache.Namespace(pool, {pool}, c.page_size);
      const std::vector<std::string> keys = Keys("rows", blocks);
      v1::PutResponse put;
      ASSERT_TRUE(cache.PutBlocks(ns, pool, keys, input, c.page_size, &put).ok());
      EXPECT_EQ(put.blocks_stored(), static_cast<uint64_t>(blocks));

      v1::LookupResponse hit;
      ASSERT_TRUE(cache.Lookup(ns, keys, &hit, 60000).ok());
      EXPECT_EQ(hit.hit_blocks(), static_cast<uint64_t>(blocks));
      EXPECT_EQ(hit.hit_tokens(), static_cast<uint64_t>(blocks * c.page_size));
      EXPECT_EQ(hit.pending_blocks(), 0u);
      ASSERT_NE(hit.lease_id(), 0u);
      std::vector<uint16_t> rows;
      ASSERT_TRUE(cache.LoadRows(ns, hit.lease_id(), pool, 0, &rows).ok());
      const auto dequant = testing::ReadArray<uint16_t>(c.file("dequant." + l + ".bf16"));
      ASSERT_EQ(rows.size(), static_cast<size_t>(blocks) * c.page_size * kHeadDim);
      EXPECT_TRUE(std::equal(rows.begin(), rows.end(), dequant.begin()));
      // A part of the lease: blocks [1, blocks).
      if (blocks > 1) {
        ASSERT_TRUE(cache.LoadRows(ns, hit.lease_id(), pool, 0, &rows, 1).ok());
        EXPECT_TRUE(std::equal(rows.begin(), rows.end(),
                               dequant.begin() + static_cast<size_t>(c.page_size) * kHeadDim));
      }

      // Records: every page of the golden pool as one block, byte for byte.
      const auto golden_pool = testing::ReadBytes(c.file("pool." + l + ".bin"));
      const int64_t page_bytes = c.layout(layout).page_bytes;
      std::vector<Cache::PagePiece> pieces;
      const std::vector<std::string> page_keys = Keys("page", static_cast<int>(c.num_pages));
      for (int64_t p = 0; p < c.num_pages; ++p) {
        // Two pieces per page: the second continues at its offset.
        const int64_t half = page_bytes / 2;
        pieces.push_back({page_keys[p], 0, 0,
                          std::string(golden_pool.begin() + p * page_bytes,
                                      golden_pool.begin() + p * page_bytes + half)});
        pieces.push_back({page_keys[p], 0, static_cast<uint64_t>(half),
                          std::string(golden_pool.begin() + p * page_bytes + half,
                                      golden_pool.begin() + (p + 1) * page_bytes)});
      }
      ASSERT_TRUE(cache.PutPages(ns, pool, testing::ProtoLayout(layout), pieces, &put).ok());
      EXPECT_EQ(put.blocks_stored(), static_cast<uint64_t>(c.num_pages));
      ASSERT_TRUE(cache.Lookup(ns, page_keys, &hit, 60000).ok());
      ASSERT_EQ(hit.hit_blocks(), static_cast<uint64_t>(c.num_pages));
      std::string bytes;
      ASSERT_TRUE(cache.LoadPages(ns, hit.lease_id(), pool, &bytes).ok());
      EXPECT_TRUE(bytes == std::string(golden_pool.begin(), golden_pool.end()));
      // Transcoded to V4: a records put marks every slot written (as WritePages does), so
      // the oracle is the page API's transcode of the same records.
      ASSERT_TRUE(cache.LoadPages(ns, hit.lease_id(), pool, &bytes, v1::LAYOUT_V4).ok());
      const std::string oracle_pool = pool + ".oracle";
      testing::CreatePool(d, oracle_pool, layout, c.page_size, c.num_pages);
      std::vector<v1::PageHandle> oracle_pages = testing::Allocate(d, oracle_pool, c.num_pages);
      std::sort(oracle_pages.begin(), oracle_pages.end(),
                [](const auto& a, const auto& b) { return a.page_id() < b.page_id(); });
      {
        grpc::ClientContext ctx;
        v1::WriteResponse written;
        auto writer = d.stub().WritePages(&ctx, &written);
        for (int64_t p = 0; p < c.num_pages; ++p) {
          v1::WritePagesRequest msg;
          msg.set_pool(oracle_pool);
          msg.set_layout(testing::ProtoLayout(layout));
          *msg.mutable_page() = oracle_pages[p];
          msg.set_data(std::string(golden_pool.begin() + p * page_bytes,
                                   golden_pool.begin() + (p + 1) * page_bytes));
          msg.set_finish_write(p + 1 == c.num_pages);
          ASSERT_TRUE(writer->Write(msg));
        }
        writer->WritesDone();
        ASSERT_TRUE(writer->Finish().ok());
      }
      std::string expected_v4;
      ASSERT_TRUE(testing::ReadPages(d, oracle_pool, oracle_pages, &expected_v4, v1::LAYOUT_V4).ok());
      EXPECT_TRUE(bytes == expected_v4);
      // Dequantized rows of the record blocks: each written location's golden row.
      ASSERT_TRUE(cache.LoadRows(ns, hit.lease_id(), pool, 0, &rows).ok());
      for (size_t i = 0; i < locs.size(); ++i) {
        EXPECT_TRUE(std::equal(dequant.begin() + i * kHeadDim, dequant.begin() + (i + 1) * kHeadDim,
                               rows.begin() + locs[i] * kHeadDim))
            << "location " << locs[i];
      }
      // A second put of the same keys is idempotent: nothing stored, nothing changed.
      ASSERT_TRUE(cache.PutPages(ns, pool, testing::ProtoLayout(layout), pieces, &put).ok());
      EXPECT_EQ(put.blocks_stored(), 0u);
      EXPECT_EQ(put.blocks_already_held(), static_cast<uint64_t>(c.num_pages));
      ASSERT_TRUE(cache.LoadPages(ns, hit.lease_id(), pool, &bytes).ok());
      EXPECT_TRUE(bytes == std::string(golden_pool.begin(), golden_pool.end()));
    }
  }
}

// ---- prefixes ---------------------------------------------------------------------------

TEST(CachePrefixTest, AChainWithAMissingMiddleBlockHitsOnlyUpToTheGap) {
  Daemon d;
  Cache cache(d);
  testing::CreatePool(d, "p", Layout::kV41, 16, 16);
  const v1::Namespace ns = cache.Namespace("n", {"p"}, 16);
  const auto keys = Keys("c", 6);
  const auto rows = testing::RandomRows(6 * 16, 3);
  auto put = [&](std::vector<int> which) {
    std::vector<std::string> k;
    std::vector<uint16_t> r;
    for (int i : which) {
      k.push_back(keys[i]);
      r.insert(r.end(), rows.begin() + i * 16 * kHeadDim, rows.begin() + (i + 1) * 16 * kHeadDim);
    }
    ASSERT_TRUE(cache.PutBlocks(ns, "p", k, r, 16).ok());
  };
  put({0, 1, 3, 4, 5});
  EXPECT_EQ(cache.Hits(ns, keys), 2);
  EXPECT_EQ(cache.Hits(ns, {keys[3], keys[4]}), 2);  // a key list is a prefix from its start
  EXPECT_EQ(cache.Hits(ns, {}), 0);
  put({2});
  EXPECT_EQ(cache.Hits(ns, keys), 6);
  // The same key list in another order is another chain: it stops where the order breaks.
  EXPECT_EQ(cache.Hits(ns, {keys[0], "other", keys[1]}), 1);
}

TEST(CachePrefixTest, APrefixCountsOnlyWhereEveryPoolOfTheGroupHoldsIt) {
  Daemon d;
  Cache cache(d);
  // DeepSeek-V4 style: compressed entries (4:1, 16 per 64-token block) and the window.
  testing::CreatePool(d, "compressed", Layout::kV41Fp4, 16, 8);
  testing::CreatePool(d, "window", Layout::kV41, 64, 8);
  const v1::Namespace ns = cache.Namespace("n", {"compressed", "window"}, 64);
  const auto keys = Keys("g", 4);
  const auto small = testing::RandomRows(3 * 16, 4);
  const auto big = testing::RandomRows(2 * 64, 5);
  ASSERT_TRUE(cache.PutBlocks(ns, "compressed", {keys[0], keys[1], keys[2]}, small, 16).ok());
  ASSERT_TRUE(cache.PutBlocks(ns, "window", {keys[0], keys[1]}, big, 64).ok());
  EXPECT_EQ(cache.Hits(ns, keys), 2);
  EXPECT_EQ(cache.Hits(ns, keys, {"compressed", "window"}), 2);
  EXPECT_EQ(cache.Hits(ns, keys, {"compressed"}), 3);
  EXPECT_EQ(cache.Hits(ns, keys, {"window"}), 2);
  // A window block alone (key 3) does not complete key 2.
  ASSERT_TRUE(cache.PutBlocks(ns, "window", {keys[3]}, big, 64).ok());
  EXPECT_EQ(cache.Hits(ns, keys), 2);

  // A lease over the group loads each member's part of the two complete blocks.
  v1::LookupResponse hit;
  ASSERT_TRUE(cache.Lookup(ns, keys, &hit, 60000).ok());
  ASSERT_EQ(hit.hit_blocks(), 2u);
  EXPECT_EQ(hit.hit_tokens(), 128u);
  std::vector<uint16_t> rows, expected;
  ASSERT_TRUE(cache.LoadRows(ns, hit.lease_id(), "compressed", 0, &rows).ok());
  EXPECT_EQ(rows.size(), 2u * 16 * kHeadDim);
  ASSERT_TRUE(cache.LoadRows(ns, hit.lease_id(), "window", 0, &rows).ok());
  EXPECT_EQ(rows.size(), 2u * 64 * kHeadDim);
  // The same rows through the page API's path (quantize-store + dequantize) as an oracle.
  testing::CreatePool(d, "oracle", Layout::kV41, 64, 2);
  const auto pages = testing::Allocate(d, "oracle", 2);
  std::vector<v1::TokenLocation> where;
  for (int i = 0; i < 128; ++i) where.push_back(testing::Location(pages[i / 64], i % 64));
  ASSERT_TRUE(testing::WriteTokens(d, "oracle", 0, where, big).ok());
  ASSERT_TRUE(testing::ReadWorkspace(d, "oracle", 0, where, &expected).ok());
  EXPECT_TRUE(rows == expected);
  // A lease of the window alone cannot load the compressed member.
  ASSERT_TRUE(cache.Lookup(ns, keys, &hit, 60000, {"window"}).ok());
  EXPECT_EQ(hit.hit_blocks(), 2u);  // key 2 is missing from the window
  const testing::CallResult r = cache.LoadRows(ns, hit.lease_id(), "compressed", 0, &rows);
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(r.reason, "NOT_A_MEMBER");
}

// A lookup answers while a put is still streaming: the put's blocks are pending, not hits,
// and become hits all at once when it commits.
TEST(CachePrefixTest, LookupsSeePendingBlocksWithoutWaitingForTheWriter) {
  Daemon d;
  Cache cache(d);
  testing::CreatePool(d, "p", Layout::kV4, 16, 8);
  const v1::Namespace ns = cache.Namespace("n", {"p"}, 16);
  const auto keys = Keys("w", 3);
  const auto rows = testing::RandomRows(3 * 16, 6);
  ASSERT_TRUE(cache.PutBlocks(ns, "p", {keys[0]}, rows, 16).ok());

  grpc::ClientContext ctx;
  v1::PutResponse resp;
  auto writer = cache.stub().PutRows(&ctx, &resp);
  for (int i = 1; i < 3; ++i) {
    v1::PutRowsRequest msg;
    if (i == 1) {
      msg.set_namespace_("n");
      msg.set_digest(ns.digest());
      msg.set_pool("p");
    }
    msg.set_key(keys[i]);
    msg.set_rows(reinterpret_cast<const char*>(rows.data() + i * 16 * kHeadDim), 16 * kBf16RowBytes);
    msg.set_finish_write(i == 2);
    ASSERT_TRUE(writer->Write(msg));
  }
  // The daemon reserves a block when its first piece arrives: wait until both are pending.
  v1::LookupResponse hit;
  for (int i = 0; i < 200; ++i) {
    ASSERT_TRUE(cache.Lookup(ns, keys, &hit).ok());
    if (hit.pending_blocks() == 2) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(hit.hit_blocks(), 1u);
  EXPECT_EQ(hit.pending_blocks(), 2u);
  writer->WritesDone();
  ASSERT_TRUE(writer->Finish().ok());
  ASSERT_TRUE(cache.Lookup(ns, keys, &hit).ok());
  EXPECT_EQ(hit.hit_blocks(), 3u);
  EXPECT_EQ(hit.pending_blocks(), 0u);
}

// ---- namespaces and digests ----------------------------------------------------------------

TEST(CacheNamespaceTest, ANamespaceOrDigestMismatchNeverHits) {
  Daemon d;
  Cache cache(d);
  testing::CreatePool(d, "p", Layout::kV41, 16, 16);
  testing::CreatePool(d, "q", Layout::kV4, 16, 16);
  v1::CreateNamespaceRequest req;
  req.set_name("a");
  req.set_model_fingerprint("deepseek-v4@rev1");
  req.set_layer_group("0-60");
  req.set_tenant_salt(std::string("\x00\x01salt", 6));
  req.set_block_tokens(16);
  req.add_pools("p");
  v1::Namespace a;
  ASSERT_TRUE(cache.CreateNamespace(req, &a).ok());
  // The digest follows the documented recipe.
  EXPECT_EQ(a.digest(), ExpectedDigest(req, {{"v41", 16, 1}}));
  // The same binding again answers the same namespace; another binding under the name fails.
  v1::Namespace again;
  ASSERT_TRUE(cache.CreateNamespace(req, &again).ok());
  EXPECT_EQ(again.digest(), a.digest());
  v1::CreateNamespaceRequest other = req;
  other.set_model_fingerprint("deepseek-v4@rev2");
  testing::CallResult r = cache.CreateNamespace(other, &again);
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::ALREADY_EXISTS);
  EXPECT_EQ(r.reason, "NAMESPACE_EXISTS");
  // Each field of the binding changes the digest.
  other.set_name("b");
  v1::Namespace b;
  ASSERT_TRUE(cache.CreateNamespace(other, &b).ok());
  EXPECT_NE(b.digest(), a.digest());
  v1::CreateNamespaceRequest salted = req;
  salted.set_name("c");
  salted.set_tenant_salt("other salt");
  v1::Namespace c;
  ASSERT_TRUE(cache.CreateNamespace(salted, &c).ok());
  v1::CreateNamespaceRequest v4 = req;
  v4.set_name("d");
  v4.set_pools(0, "q");
  v1::Namespace dv4;
  ASSERT_TRUE(cache.CreateNamespace(v4, &dv4).ok());
  EXPECT_EQ(dv4.digest(), ExpectedDigest(v4, {{"v4", 16, 1}}));

  const auto keys = Keys("k", 2);
  ASSERT_TRUE(cache.PutBlocks(a, "p", keys, testing::RandomRows(32, 7), 16).ok());
  EXPECT_EQ(cache.Hits(a, keys), 2);
  // The same keys in another namespace over the same pool, or another layout: no hit.
  EXPECT_EQ(cache.Hits(b, keys), 0);
  EXPECT_EQ(cache.Hits(c, keys), 0);
  EXPECT_EQ(cache.Hits(dv4, keys), 0);
  // Namespace a with another namespace's digest (a caller with another model, layout or
  // salt) fails closed, in every call.
  v1::LookupResponse hit;
  for (uint64_t wrong : {b.digest(), c.digest(), dv4.digest(), a.digest() ^ 1}) {
    r = cache.Lookup(a, keys, &hit, 0, {}, wrong);
    EXPECT_EQ(r.status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
    EXPECT_EQ(r.reason, "NAMESPACE_MISMATCH");
  }
  ASSERT_TRUE(cache.Lookup(a, keys, &hit, 60000).ok());
  std::vector<uint16_t> rows;
  r = cache.LoadRows(a, hit.lease_id(), "p", 0, &rows, 0, 0, nullptr, b.digest());
  EXPECT_EQ(r.reason, "NAMESPACE_MISMATCH");
  EXPECT_TRUE(rows.empty());
  r = cache.PutRows(a, "p", {{"x", 0, 0, testing::RandomRows(16, 8)}}, nullptr, c.digest());
  EXPECT_EQ(r.reason, "NAMESPACE_MISMATCH");
  EXPECT_EQ(cache.Hits(a, {"x"}), 0);
  // A lease of one namespace is not one of another.
  r = cache.LoadRows(b, hit.lease_id(), "p", 0, &rows);
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(r.reason, "LEASE_EXPIRED");
  // Unknown namespace; a pool that is not a member.
  v1::Namespace missing = a;
  missing.set_name("nope");
  r = cache.Lookup(missing, keys, &hit);
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(r.reason, "NAMESPACE_NOT_FOUND");
  r = cache.PutRows(a, "q", {{"x", 0, 0, testing::RandomRows(16, 8)}});
  EXPECT_EQ(r.reason, "NOT_A_MEMBER");
}

std::string Sha256Hex(const std::string& s) {
  unsigned char digest[SHA256_DIGEST_LENGTH];
  SHA256(reinterpret_cast<const unsigned char*>(s.data()), s.size(), digest);
  std::string hex;
  for (unsigned char c : digest) {
    hex += "0123456789abcdef"[c >> 4];
    hex += "0123456789abcdef"[c & 15];
  }
  return hex;
}

TEST(CacheNamespaceTest, AnotherTenantNeverSeesANamespaceItsBlocksOrItsEvents) {
  char dir[] = "/tmp/kvferry-cache-XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  const std::string file = std::string(dir) + "/tokens";
  std::ofstream(file) << "alice " << Sha256Hex("token-a") << "\nbob " << Sha256Hex("token-b") << "\n";
  Daemon d({"--auth_tokens=" + file});
  auto as_alice = testing::MakeChannel(d.grpc_port(), grpc::InsecureChannelCredentials(), "token-a");
  auto as_bob = testing::MakeChannel(d.grpc_port(), grpc::InsecureChannelCredentials(), "token-b");
  d.Connect(grpc::InsecureChannelCredentials(), "token-a");
  testing::CreatePool(d, "p", Layout::kV41, 16, 8);
  Cache alice(as_alice), bob(as_bob);
  const v1::Namespace ns = alice.Namespace("n", {"p"}, 16);
  ASSERT_TRUE(alice.PutBlocks(ns, "p", {"k"}, testing::RandomRows(16, 9), 16).ok());
  v1::LookupResponse hit;
  testing::CallResult r = bob.Lookup(ns, {"k"}, &hit);
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(r.reason, "NAMESPACE_NOT_FOUND");
  // Bob's own namespace of the same name over his own pool of the same name: separate.
  d.Connect(grpc::InsecureChannelCredentials(), "token-b");
  testing::CreatePool(d, "p", Layout::kV41, 16, 8);
  const v1::Namespace bobs = bob.Namespace("n", {"p"}, 16);
  EXPECT_EQ(bob.Hits(bobs, {"k"}), 0);
  EXPECT_EQ(alice.Hits(ns, {"k"}), 1);
  EXPECT_TRUE(bob.Snapshot().blocks.empty());
  EXPECT_EQ(bob.Snapshot().sequence, 0u);
  EXPECT_EQ(alice.Snapshot().blocks.size(), 1u);
  std::system(("rm -rf '" + std::string(dir) + "'").c_str());
}

// ---- leases and eviction --------------------------------------------------------------------

// The LRU order, with pinned blocks skipped, read from the BlockRemoved events.
TEST(CacheEvictionTest, LeastRecentlyUsedUnpinnedBlocksGoFirstAndPinnedNever) {
  Daemon d;
  Cache cache(d);
  testing::CreatePool(d, "p", Layout::kV41, 16, 4);
  const v1::Namespace ns = cache.Namespace("n", {"p"}, 16);
  const auto rows = testing::RandomRows(16, 10);
  auto put = [&](const std::string& key) {
    return cache.PutBlocks(ns, "p", {key}, rows, 16);
  };
  for (const char* k : {"k0", "k1", "k2", "k3"}) ASSERT_TRUE(put(k).ok());
  v1::LookupResponse pinned;
  ASSERT_TRUE(cache.Lookup(ns, {"k0"}, &pinned, 60000).ok());  // k0 pinned
  EXPECT_EQ(cache.Hits(ns, {"k1"}), 1);                        // k1 used: now the newest
  const uint64_t before = cache.Snapshot().sequence;
  for (const char* k : {"k4", "k5", "k6", "k7"}) ASSERT_TRUE(put(k).ok()) << k;
  // Evicted: k2, k3, k1 (in LRU order), then k4; k0 stayed.
  grpc::ClientContext ctx;
  v1::SubscribeEventsRequest req;
  req.set_after_sequence(before);
  auto stream = cache.stub().SubscribeEvents(&ctx, req);
  std::vector<std::string> removed;
  v1::EventBatch batch;
  while (removed.size() < 4 && stream->Read(&batch)) {
    for (const auto& e : batch.events()) {
      if (e.kind() == v1::BlockEvent::BLOCK_REMOVED) {
        EXPECT_EQ(e.cause(), v1::BlockEvent::EVICTED);
        removed.push_back(e.key());
      }
    }
  }
  ctx.TryCancel();
  EXPECT_EQ(removed, (std::vector<std::string>{"k2", "k3", "k1", "k4"}));
  EXPECT_EQ(cache.Hits(ns, {"k0"}), 1);
  for (const char* k : {"k1", "k2", "k3", "k4"}) EXPECT_EQ(cache.Hits(ns, {k}), 0) << k;
  // The pinned block still loads its bytes.
  std::vector<uint16_t> loaded, expected;
  ASSERT_TRUE(cache.LoadRows(ns, pinned.lease_id(), "p", 0, &loaded).ok());
  v1::LookupResponse k5;
  ASSERT_TRUE(cache.Lookup(ns, {"k5"}, &k5, 60000).ok());
  ASSERT_TRUE(cache.LoadRows(ns, k5.lease_id(), "p", 0, &expected).ok());
  EXPECT_TRUE(loaded == expected);  // same rows were put under every key
  // Everything pinned: a new block has no room, and nothing is half-stored.
  v1::LookupResponse all;
  ASSERT_TRUE(cache.Lookup(ns, {"k6"}, &all, 60000).ok());
  ASSERT_TRUE(cache.Lookup(ns, {"k7"}, &all, 60000).ok());
  testing::CallResult r = put("k8");
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(r.reason, "CACHE_FULL");
  EXPECT_EQ(cache.Hits(ns, {"k8"}), 0);
  // Releasing a lease makes its block evictable again.
  ASSERT_TRUE(cache.ReleaseLease(ns, pinned.lease_id()).ok());
  EXPECT_EQ(cache.ReleaseLease(ns, pinned.lease_id()).reason, "LEASE_EXPIRED");
  ASSERT_TRUE(put("k8").ok());
  EXPECT_EQ(cache.Hits(ns, {"k0"}), 0);
  r = cache.LoadRows(ns, pinned.lease_id(), "p", 0, &loaded);
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(r.reason, "LEASE_EXPIRED");
  EXPECT_TRUE(loaded.empty());
}

TEST(CacheEvictionTest, ANamespaceCapacityEvictsItsOwnBlocksOnly) {
  Daemon d;
  Cache cache(d);
  testing::CreatePool(d, "p", Layout::kV4, 16, 8);
  const v1::Namespace small = cache.Namespace("small", {"p"}, 16, "m", /*max_blocks=*/2);
  const v1::Namespace big = cache.Namespace("big", {"p"}, 16, "m");
  const auto rows = testing::RandomRows(16, 11);
  ASSERT_TRUE(cache.PutBlocks(big, "p", {"b0"}, rows, 16).ok());  // the oldest in the pool
  for (const char* k : {"s0", "s1", "s2"}) ASSERT_TRUE(cache.PutBlocks(small, "p", {k}, rows, 16).ok());
  EXPECT_EQ(cache.Hits(small, {"s0"}), 0);
  EXPECT_EQ(cache.Hits(small, {"s1"}), 1);
  EXPECT_EQ(cache.Hits(small, {"s2"}), 1);
  EXPECT_EQ(cache.Hits(big, {"b0"}), 1);
  v1::Pool pool;
  grpc::ClientContext ctx;
  v1::DescribePoolRequest req;
  req.set_name("p");
  ASSERT_TRUE(d.stub().DescribePool(&ctx, req, &pool).ok());
  EXPECT_EQ(pool.pages_used(), 3u);  // the evicted block's page went back to the pool
}

// Leases expire while writers keep the pool full: until then the leased blocks load, never
// get evicted; after it the load fails without a byte and the blocks are evicted again.
TEST(CacheLeaseTest, LeasesExpireUnderLoadAndThenTheirBlocksAreEvictable) {
  Daemon d;
  Cache cache(d);
  testing::CreatePool(d, "p", Layout::kV41, 16, 32);
  const v1::Namespace ns = cache.Namespace("n", {"p"}, 16);
  const auto rows = testing::RandomRows(4 * 16, 12);
  const auto keys = Keys("leased", 4);
  ASSERT_TRUE(cache.PutBlocks(ns, "p", keys, rows, 16).ok());
  v1::LookupResponse lease;
  ASSERT_TRUE(cache.Lookup(ns, keys, &lease, 1500).ok());
  ASSERT_EQ(lease.hit_blocks(), 4u);
  std::vector<uint16_t> first;
  ASSERT_TRUE(cache.LoadRows(ns, lease.lease_id(), "p", 0, &first).ok());

  std::atomic<bool> stop{false};
  std::atomic<int64_t> puts{0}, failures{0};
  std::vector<std::thread> writers;
  for (int w = 0; w < 2; ++w) {
    writers.emplace_back([&, w] {
      Cache mine(d);
      const auto fill = testing::RandomRows(16, 100 + w);
      for (int i = 0; !stop; ++i) {
        const testing::CallResult r = mine.PutBlocks(ns, "p", {Key("fill" + std::to_string(w), i)}, fill, 16);
        (r.ok() ? puts : failures)++;
      }
    });
  }
  // While the lease holds, 28 unpinned pages churn and the leased blocks load unchanged.
  std::vector<uint16_t> again;
  int loads = 0;
  const auto expiry = std::chrono::steady_clock::now() + std::chrono::milliseconds(1500);
  while (std::chrono::steady_clock::now() + std::chrono::milliseconds(300) < expiry) {
    ASSERT_TRUE(cache.LoadRows(ns, lease.lease_id(), "p", 0, &again).ok());
    EXPECT_TRUE(again == first);
    EXPECT_EQ(cache.Hits(ns, keys), 4);
    ++loads;
  }
  std::this_thread::sleep_until(expiry + std::chrono::milliseconds(200));
  int chunks = -1;
  const testing::CallResult r = cache.LoadRows(ns, lease.lease_id(), "p", 0, &again, 0, 0, &chunks);
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(r.reason, "LEASE_EXPIRED");
  EXPECT_EQ(chunks, 0);
  // The writers now evict the formerly leased blocks too.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (cache.Hits(ns, {keys[0]}) == 1 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  stop = true;
  for (auto& t : writers) t.join();
  EXPECT_EQ(cache.Hits(ns, {keys[0]}), 0);
  EXPECT_GT(loads, 1);
  EXPECT_GT(puts.load(), 28);
  EXPECT_EQ(failures.load(), 0);
  const std::string metrics = Fetch(d.metrics_port(), "/metrics");
  EXPECT_NE(metrics.find("kvferry_cache_lease_expirations_total 1\n"), std::string::npos);
  EXPECT_EQ(metrics.find("kvferry_cache_evictions_total 0\n"), std::string::npos);
  EXPECT_NE(metrics.find("kvferry_cache_blocks{namespace=\"n\",pool=\"p\"} 32\n"), std::string::npos)
      << metrics.substr(metrics.find("kvferry_cache"), 1200);
}

// ---- bad input: a status with a reason, nothing half-written ------------------------------

TEST(CacheErrorTest, ARejectedPutStoresNothingAndGivesItsPagesBack) {
  Daemon d;
  Cache cache(d);
  testing::CreatePool(d, "p", Layout::kV41, 16, 8, 2);
  const v1::Namespace ns = cache.Namespace("n", {"p"}, 16);
  const auto rows = testing::RandomRows(16, 13);
  auto pages_used = [&] {
    v1::Pool pool;
    grpc::ClientContext ctx;
    v1::DescribePoolRequest req;
    req.set_name("p");
    EXPECT_TRUE(d.stub().DescribePool(&ctx, req, &pool).ok());
    return pool.pages_used();
  };
  // Block a complete in both layers, block b only in layer 0.
  std::vector<Cache::RowsPiece> pieces = {{"a", 0, 0, rows}, {"a", 1, 0, rows}, {"b", 0, 0, rows}};
  testing::CallResult r = cache.PutRows(ns, "p", pieces);
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(r.reason, "BLOCK_INCOMPLETE");
  EXPECT_EQ(cache.Hits(ns, {"a"}), 0);
  EXPECT_EQ(pages_used(), 0u);
  // Half of a block's slots.
  r = cache.PutRows(ns, "p", {{"a", 0, 0, std::vector<uint16_t>(rows.begin(), rows.begin() + 8 * kHeadDim)},
                              {"a", 1, 0, rows}});
  EXPECT_EQ(r.reason, "BLOCK_INCOMPLETE");
  // A NaN row.
  auto nan = rows;
  nan[5 * kHeadDim + 3] = 0x7FC0;
  r = cache.PutRows(ns, "p", {{"a", 0, 0, rows}, {"a", 1, 0, nan}});
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(r.reason, "NON_FINITE_VALUE");
  // Slots past the block; a layer past the pool; an empty key; the same slot twice.
  r = cache.PutRows(ns, "p", {{"a", 0, 8, rows}});
  EXPECT_EQ(r.reason, "SLOT_OUT_OF_RANGE");
  r = cache.PutRows(ns, "p", {{"a", 2, 0, rows}});
  EXPECT_EQ(r.reason, "LAYER_OUT_OF_RANGE");
  r = cache.PutRows(ns, "p", {{"", 0, 0, rows}});
  EXPECT_EQ(r.reason, "INVALID_REQUEST");
  r = cache.PutRows(ns, "p", {{"a", 0, 0, rows}, {"a", 0, 0, rows}, {"a", 1, 0, rows}});
  EXPECT_EQ(r.reason, "DUPLICATE_LOCATION");
  // Records in another layout than the pool's.
  r = cache.PutPages(ns, "p", v1::LAYOUT_V4, {{"a", 0, 0, std::string(100, 'x')}});
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(r.reason, "LAYOUT_MISMATCH");
  // Whole blocks in streams that end without finish_write, as a stream the client cancelled
  // may look to the daemon, or that go on after it.
  const std::vector<Cache::RowsPiece> whole = {{"a", 0, 0, rows}, {"a", 1, 0, rows}};
  r = cache.PutRows(ns, "p", whole, nullptr, 0, /*finish_at=*/2);
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(r.reason, "WRITE_NOT_FINISHED");
  r = cache.PutRows(ns, "p", whole, nullptr, 0, /*finish_at=*/0);
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(r.reason, "INVALID_REQUEST");
  const std::string page(PageBytes(Layout::kV41, 16), '\0');
  r = cache.PutPages(ns, "p", v1::LAYOUT_V41, {{"a", 0, 0, page}, {"a", 1, 0, page}}, nullptr,
                     /*finish_at=*/2);
  EXPECT_EQ(r.reason, "WRITE_NOT_FINISHED");
  EXPECT_EQ(cache.Hits(ns, {"a"}), 0);
  EXPECT_EQ(pages_used(), 0u);
  EXPECT_TRUE(cache.Snapshot().blocks.empty());
  // Then the whole block stores.
  ASSERT_TRUE(cache.PutRows(ns, "p", {{"a", 0, 0, rows}, {"a", 1, 0, rows}}).ok());
  EXPECT_EQ(cache.Hits(ns, {"a"}), 1);
  EXPECT_EQ(pages_used(), 1u);
  // Loads: a lease that was never granted; blocks outside the lease.
  std::vector<uint16_t> out;
  r = cache.LoadRows(ns, 12345, "p", 0, &out);
  EXPECT_EQ(r.reason, "LEASE_EXPIRED");
  v1::LookupResponse hit;
  ASSERT_TRUE(cache.Lookup(ns, {"a"}, &hit, 1000).ok());
  r = cache.LoadRows(ns, hit.lease_id(), "p", 0, &out, 1, 1);
  EXPECT_EQ(r.reason, "BLOCK_OUT_OF_RANGE");
  r = cache.Lookup(ns, {"a"}, &hit, 3600 * 1000);
  EXPECT_EQ(r.reason, "INVALID_REQUEST");  // past the longest lease
}

TEST(CacheErrorTest, DeletingAPoolOrANamespaceDropsItsBlocksWithEvents) {
  Daemon d;
  Cache cache(d);
  testing::CreatePool(d, "p", Layout::kV41, 16, 8);
  testing::CreatePool(d, "q", Layout::kV41, 16, 8);
  const v1::Namespace ns = cache.Namespace("n", {"p", "q"}, 16);
  const v1::Namespace other = cache.Namespace("o", {"q"}, 16);
  const auto rows = testing::RandomRows(16, 14);
  ASSERT_TRUE(cache.PutBlocks(ns, "p", {"k"}, rows, 16).ok());
  ASSERT_TRUE(cache.PutBlocks(ns, "q", {"k"}, rows, 16).ok());
  ASSERT_TRUE(cache.PutBlocks(other, "q", {"k"}, rows, 16).ok());
  v1::LookupResponse hit;
  ASSERT_TRUE(cache.Lookup(ns, {"k"}, &hit, 60000).ok());
  const uint64_t before = cache.Snapshot().sequence;
  ASSERT_TRUE(testing::DeletePool(d, "p").ok());
  EXPECT_EQ(cache.Hits(ns, {"k"}), 0);
  EXPECT_EQ(cache.Hits(ns, {"k"}, {"q"}), 1);
  std::vector<uint16_t> out;
  testing::CallResult r = cache.LoadRows(ns, hit.lease_id(), "p", 0, &out);
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::ABORTED);
  EXPECT_EQ(r.reason, "POOL_DELETED");
  r = cache.PutBlocks(ns, "p", {"k2"}, rows, 16);
  EXPECT_EQ(r.reason, "POOL_DELETED");
  ASSERT_TRUE(cache.DeleteNamespace("n").ok());
  EXPECT_EQ(cache.DeleteNamespace("n").reason, "NAMESPACE_NOT_FOUND");
  EXPECT_EQ(cache.Hits(other, {"k"}), 1);  // another namespace over q keeps its block
  const auto snapshot = cache.Snapshot();
  ASSERT_EQ(snapshot.blocks.size(), 1u);
  EXPECT_EQ(testing::BlockId(snapshot.blocks[0]), "o/q/k");
  EXPECT_EQ(snapshot.sequence, before + 2);
  grpc::ClientContext ctx;
  v1::SubscribeEventsRequest req;
  req.set_after_sequence(before);
  auto stream = cache.stub().SubscribeEvents(&ctx, req);
  std::vector<std::string> seen;
  v1::EventBatch batch;
  while (seen.size() < 2 && stream->Read(&batch)) {
    for (const auto& e : batch.events()) {
      seen.push_back(testing::BlockId(e) + ":" + std::to_string(e.cause()));
    }
  }
  ctx.TryCancel();
  EXPECT_EQ(seen, (std::vector<std::string>{
                      "n/p/k:" + std::to_string(v1::BlockEvent::POOL_DELETED),
                      "n/q/k:" + std::to_string(v1::BlockEvent::NAMESPACE_DELETED)}));
}

// ---- events and snapshots ------------------------------------------------------------------

// Applies events to a set of block ids, checking that they are consecutive.
struct Replica {
  std::set<std::string> blocks;
  uint64_t sequence = 0;
  uint64_t publisher = 0;
  bool Apply(const v1::EventBatch& batch) {
    EXPECT_EQ(batch.publisher_id(), publisher);
    for (const auto& e : batch.events()) {
      if (e.sequence() != sequence + 1) {
        ADD_FAILURE() << "event " << e.sequence() << " after " << sequence;
        return false;
      }
      sequence = e.sequence();
      if (e.kind() == v1::BlockEvent::BLOCK_STORED) {
        EXPECT_TRUE(blocks.insert(testing::BlockId(e)).second) << testing::BlockId(e);
      } else {
        EXPECT_EQ(blocks.erase(testing::BlockId(e)), 1u) << testing::BlockId(e);
      }
    }
    return true;
  }
  static std::set<std::string> Of(const Cache::SnapshotResult& s) {
    std::set<std::string> out;
    for (const auto& b : s.blocks) out.insert(testing::BlockId(b));
    return out;
  }
};

// Puts, evictions and a deletion on two pools while a subscriber follows; `round` varies keys.
void Churn(Daemon& d, Cache& cache, int round) {
  const auto rows = testing::RandomRows(16, 20 + round);
  const std::string a = "a" + std::to_string(round), b = "b" + std::to_string(round);
  testing::CreatePool(d, a, Layout::kV41, 16, 6);
  testing::CreatePool(d, b, Layout::kV4, 16, 6);
  const v1::Namespace ns = cache.Namespace("ns" + std::to_string(round), {a, b}, 16);
  for (int i = 0; i < 10; ++i) {  // 10 blocks into 6 pages: evictions
    ASSERT_TRUE(cache.PutBlocks(ns, a, {Key("x", i)}, rows, 16).ok());
    if (i % 2 == 0) {
      ASSERT_TRUE(cache.PutBlocks(ns, b, {Key("x", i)}, rows, 16).ok());
    }
  }
  ASSERT_TRUE(testing::DeletePool(d, b).ok());
}

TEST(CacheEventsTest, TheEventStreamReplayedOntoASnapshotEqualsTheIndex) {
  Daemon d;
  Cache cache(d);
  const auto empty = cache.Snapshot();
  EXPECT_TRUE(empty.blocks.empty());
  EXPECT_EQ(empty.sequence, 0u);
  ASSERT_NE(empty.publisher_id, 0u);

  // A subscriber from the start, and one that joins from a snapshot taken midway.
  Replica from_start;
  from_start.publisher = empty.publisher_id;
  grpc::ClientContext ctx;
  v1::SubscribeEventsRequest req;
  req.set_publisher_id(empty.publisher_id);
  auto stream = cache.stub().SubscribeEvents(&ctx, req);
  std::atomic<uint64_t> applied{0};
  std::vector<double> gaps;
  std::thread follower([&] {
    v1::EventBatch batch;
    auto last = std::chrono::steady_clock::now();
    while (stream->Read(&batch)) {
      const auto now = std::chrono::steady_clock::now();
      gaps.push_back(std::chrono::duration<double>(now - last).count());
      last = now;
      from_start.Apply(batch);
      applied = from_start.sequence;
    }
  });
  Churn(d, cache, 0);
  const auto midway = cache.Snapshot();
  Churn(d, cache, 1);
  const auto final_snapshot = cache.Snapshot();
  EXPECT_GT(final_snapshot.sequence, midway.sequence);
  EXPECT_FALSE(final_snapshot.blocks.empty());

  // From the midway snapshot: replaying the events after its sequence gives the final index.
  Replica joined;
  joined.publisher = midway.publisher_id;
  joined.blocks = Replica::Of(midway);
  joined.sequence = midway.sequence;
  {
    grpc::ClientContext ctx2;
    v1::SubscribeEventsRequest after;
    after.set_after_sequence(midway.sequence);
    auto s2 = cache.stub().SubscribeEvents(&ctx2, after);
    v1::EventBatch batch;
    while (joined.sequence < final_snapshot.sequence && s2->Read(&batch)) joined.Apply(batch);
    ctx2.TryCancel();
  }
  EXPECT_EQ(joined.sequence, final_snapshot.sequence);
  EXPECT_EQ(joined.blocks, Replica::Of(final_snapshot));

  // The subscriber from the start holds the same, and heard a heartbeat at least every second
  // while nothing happened.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (applied < final_snapshot.sequence && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(2500));
  ctx.TryCancel();
  follower.join();
  EXPECT_EQ(from_start.blocks, Replica::Of(final_snapshot));
  ASSERT_GE(gaps.size(), 3u);
  EXPECT_LE(*std::max_element(gaps.begin() + 1, gaps.end()), 1.0);
}

TEST(CacheEventsTest, AfterAGapOrARestartTheSubscriberResynchronizesFromASnapshot) {
  auto daemon = std::make_unique<Daemon>(std::vector<std::string>{"--cache_events=8"});
  Cache cache(*daemon);
  const uint64_t publisher = cache.Snapshot().publisher_id;
  Churn(*daemon, cache, 0);  // far more than 8 events
  const auto snapshot = cache.Snapshot();
  ASSERT_GT(snapshot.sequence, 8u);
  // Events after 0 are gone: the stream says so.
  {
    grpc::ClientContext ctx;
    v1::SubscribeEventsRequest req;
    auto stream = cache.stub().SubscribeEvents(&ctx, req);
    v1::EventBatch batch;
    while (stream->Read(&batch)) {
    }
    const grpc::Status s = stream->Finish();
    EXPECT_EQ(s.error_code(), grpc::StatusCode::ABORTED);
    EXPECT_EQ(testing::ReasonOf(ctx), "EVENTS_LOST");
  }
  // Resynchronized: the snapshot, then the events after it.
  Replica replica;
  replica.publisher = publisher;
  replica.blocks = Replica::Of(snapshot);
  replica.sequence = snapshot.sequence;
  Churn(*daemon, cache, 1);  // fewer than 8 events after it would not be a test: count them
  const auto later = cache.Snapshot();
  {
    grpc::ClientContext ctx;
    v1::SubscribeEventsRequest req;
    req.set_after_sequence(later.sequence - 4);
    req.set_publisher_id(publisher);
    auto stream = cache.stub().SubscribeEvents(&ctx, req);
    v1::EventBatch batch;
    ASSERT_TRUE(stream->Read(&batch));
    ctx.TryCancel();
  }
  {
    // The subscriber fell more than 8 behind: lost again; a fresh snapshot resynchronizes.
    grpc::ClientContext ctx;
    v1::SubscribeEventsRequest req;
    req.set_after_sequence(replica.sequence);
    auto stream = cache.stub().SubscribeEvents(&ctx, req);
    v1::EventBatch batch;
    while (stream->Read(&batch)) replica.Apply(batch);
    EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::ABORTED);
    replica.blocks = Replica::Of(later);
    replica.sequence = later.sequence;
  }
  EXPECT_EQ(replica.blocks, Replica::Of(cache.Snapshot()));

  // A restart: a new publisher id, an empty index, and the old id refused.
  daemon.reset();
  daemon = std::make_unique<Daemon>();
  Cache restarted(*daemon);
  const auto fresh = restarted.Snapshot();
  EXPECT_NE(fresh.publisher_id, publisher);
  EXPECT_TRUE(fresh.blocks.empty());
  EXPECT_EQ(fresh.sequence, 0u);
  {
    grpc::ClientContext ctx;
    v1::SubscribeEventsRequest req;
    req.set_after_sequence(replica.sequence);
    req.set_publisher_id(publisher);
    auto stream = restarted.stub().SubscribeEvents(&ctx, req);
    v1::EventBatch batch;
    EXPECT_FALSE(stream->Read(&batch));
    EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::FAILED_PRECONDITION);
    EXPECT_EQ(testing::ReasonOf(ctx), "PUBLISHER_CHANGED");
  }
  Replica again;
  again.publisher = fresh.publisher_id;
  grpc::ClientContext ctx;
  v1::SubscribeEventsRequest req;
  req.set_publisher_id(fresh.publisher_id);
  auto stream = restarted.stub().SubscribeEvents(&ctx, req);
  Churn(*daemon, restarted, 2);
  const auto after_restart = restarted.Snapshot();
  v1::EventBatch batch;
  while (again.sequence < after_restart.sequence && stream->Read(&batch)) again.Apply(batch);
  ctx.TryCancel();
  EXPECT_EQ(again.blocks, Replica::Of(after_restart));
}

// ---- concurrency ---------------------------------------------------------------------------

// Writers commit chains block by block while readers look them up: every answer is a prefix
// that only grows (a block never appears before the one it follows was committed, nothing
// is lost), and lookups never fail or wait for the writers.
TEST(CacheConcurrencyTest, ConcurrentLookupsWhileWritersCommitSeeOnlyGrowingPrefixes) {
  Daemon d;
  Cache cache(d);
  constexpr int kChains = 4, kLength = 64;
  testing::CreatePool(d, "p", Layout::kV41Fp4, 16, kChains * kLength);
  const v1::Namespace ns = cache.Namespace("n", {"p"}, 16);
  // Per chain: blocks committed (the put returned), and blocks begun (the put started).
  std::vector<std::atomic<int>> committed(kChains), begun(kChains);
  std::atomic<bool> done{false};
  std::vector<std::thread> threads;
  for (int c = 0; c < kChains; ++c) {
    threads.emplace_back([&, c] {
      Cache mine(d);
      const auto rows = testing::RandomRows(16, 200 + c);
      for (int i = 0; i < kLength; ++i) {
        begun[c] = i + 1;
        ASSERT_TRUE(mine.PutBlocks(ns, "p", {Key("chain" + std::to_string(c), i)}, rows, 16).ok());
        committed[c] = i + 1;
      }
    });
  }
  std::atomic<int64_t> lookups{0};
  std::vector<std::thread> readers;
  for (int r = 0; r < 2; ++r) {
    readers.emplace_back([&] {
      Cache mine(d);
      std::vector<int64_t> last(kChains, 0);
      while (!done) {
        for (int c = 0; c < kChains; ++c) {
          const int before = committed[c];
          v1::LookupResponse hit;
          ASSERT_TRUE(mine.Lookup(ns, Keys("chain" + std::to_string(c), kLength), &hit).ok());
          const int after = begun[c];
          EXPECT_GE(static_cast<int>(hit.hit_blocks()), before);
          EXPECT_LE(static_cast<int>(hit.hit_blocks()), after);
          EXPECT_LE(hit.hit_blocks() + hit.pending_blocks(), static_cast<uint64_t>(after));
          EXPECT_GE(static_cast<int64_t>(hit.hit_blocks()), last[c]);
          last[c] = static_cast<int64_t>(hit.hit_blocks());
          ++lookups;
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  done = true;
  for (auto& t : readers) t.join();
  EXPECT_GT(lookups.load(), 100);
  for (int c = 0; c < kChains; ++c) {
    EXPECT_EQ(cache.Hits(ns, Keys("chain" + std::to_string(c), kLength)), kLength);
  }
}

}  // namespace
}  // namespace kvferry
