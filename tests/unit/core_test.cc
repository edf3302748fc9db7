// The core in process, on the cpu backend: page table, staged writes, readers, the pool
// manager, and every failure of a fault-injecting backend leaving the pool as it was.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <numeric>
#include <random>
#include <set>
#include <thread>

#include "backend/cpu_backend.h"
#include "common/fault_backend.h"
#include "common/golden.h"
#include "common/random_rows.h"
#include "core/pool_manager.h"
#include "core/reader.h"
#include "core/staged_write.h"
#include "gtest/gtest.h"
#include "kvferry/kernels/ops.h"
#include "kvferry/kernels/status_macros.h"

namespace kvferry::server {
namespace {

using Where = std::vector<TokenLocation>;

std::span<const uint8_t> AsBytes(const std::vector<uint16_t>& rows) {
  return {reinterpret_cast<const uint8_t*>(rows.data()), rows.size() * 2};
}

// Every byte a reader produces, concatenated.
absl::StatusOr<std::vector<uint8_t>> Drain(absl::StatusOr<std::unique_ptr<Reader>> reader) {
  if (!reader.ok()) return reader.status();
  std::vector<uint8_t> all;
  while (true) {
    absl::StatusOr<std::span<const uint8_t>> batch = (*reader)->Next();
    if (!batch.ok()) return batch.status();
    if (batch->empty()) return all;
    all.insert(all.end(), batch->begin(), batch->end());
  }
}

// The whole pool's bytes (cpu backend: host memory) and its counts.
struct Snapshot {
  std::vector<uint8_t> bytes;
  int64_t pages_used, tokens_held, records_held;
  bool operator==(const Snapshot&) const = default;
};
Snapshot Take(Pool& pool) {
  const PoolStats s = pool.Stats();
  return Snapshot{std::vector<uint8_t>(pool.base(), pool.base() + s.pool_bytes), s.pages_used,
                  s.tokens_held, s.records_held};
}

std::shared_ptr<Pool> MakePool(Layout layout, int page_size, int64_t pages, int layers = 1,
                               std::shared_ptr<Backend> backend = MakeCpuBackend(),
                               uint64_t incarnation = 7) {
  auto pool = Pool::Create(PoolConfig{"t", layout, page_size, pages, layers}, std::move(backend),
                           incarnation, nullptr);
  EXPECT_TRUE(pool.ok()) << pool.status();
  return *pool;
}

// ---- page table ---------------------------------------------------------------------------------

TEST(PageTableTest, GenerationsCarryTheIncarnationAndStaleMessagesHideTheCurrentOne) {
  PageTable table("p", 4, 16, 2, 5);
  auto h = table.Allocate(2);
  ASSERT_TRUE(h.ok());
  EXPECT_EQ((*h)[0].page_id, 0u);
  EXPECT_EQ((*h)[0].generation >> kGenerationCountBits, 5u);
  ASSERT_TRUE(table.Free({&(*h)[0], 1}).ok());
  table.Reclaimed(std::vector<int64_t>{0});
  auto again = table.Allocate(1);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ((*again)[0].page_id, 0u);
  EXPECT_EQ((*again)[0].generation, (*h)[0].generation + 1);
  const absl::Status stale = table.CheckHandle((*h)[0]);
  EXPECT_EQ(stale.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(ReasonOf(stale), ErrorReason::kStalePageHandle);
  EXPECT_EQ(std::string(stale.message()).find(std::to_string((*again)[0].generation)),
            std::string::npos)
      << "a stale handle's error names the new owner's generation: " << stale.message();
  // Same page id and count, another incarnation: refused.
  PageHandle foreign{0, (uint64_t{6} << kGenerationCountBits) | 2};
  EXPECT_EQ(ReasonOf(table.CheckHandle(foreign)), ErrorReason::kStalePageHandle);
}

TEST(PageTableTest, FreeOfAPinnedPageDefersItsReclaimAndIgnoresTheWritersMarks) {
  PageTable table("p", 2, 4, 1, 1);
  auto h = *table.Allocate(2);
  auto pin = table.PinPages({&h[0], 1}, /*exclusive=*/true);
  ASSERT_TRUE(pin.ok());
  auto to_zero = table.Free(h);
  ASSERT_TRUE(to_zero.ok());
  EXPECT_EQ(*to_zero, std::vector<int64_t>{1});  // page 0 is still being written
  const int64_t tokens[] = {0, 1};
  EXPECT_EQ(table.Unpin(*pin, 0, tokens), std::vector<int64_t>{0});
  EXPECT_EQ(table.counts().tokens_held, 0);  // the freed page's write is not counted
  EXPECT_EQ(table.counts().pages_free, 0);   // nothing reclaimed until zeroed
  table.Reclaimed(std::vector<int64_t>{0, 1});
  EXPECT_EQ(table.counts().pages_free, 2);
}

TEST(PageTableTest, WritersOfOnePageTakeTurnsAndAFreeWakesAWaiterWithAnError) {
  PageTable table("p", 1, 4, 1, 1);
  auto h = *table.Allocate(1);
  auto first = table.PinPages(h, true);
  ASSERT_TRUE(first.ok());
  absl::Status second_status;
  std::thread second([&] { second_status = table.PinPages(h, true).status(); });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  // Readers never wait for writers.
  auto reader = table.PinPages(h, false);
  ASSERT_TRUE(reader.ok());
  table.Unpin(*reader);
  ASSERT_TRUE(table.Free(h).ok());
  table.Unpin(*first);
  second.join();
  EXPECT_EQ(ReasonOf(second_status), ErrorReason::kStalePageHandle);
}

// Pages freed together come back from the next allocation in the order they were freed: a
// request's run of pages stays a run for the next request (a transfer lands in place in
// device memory only where each message's pages are one run), not reversed.
TEST(PageTableTest, PagesFreedTogetherAreAllocatedAgainInTheOrderFreed) {
  auto pool = MakePool(Layout::kV41, 16, 64, 1);
  const std::vector<PageHandle> first = *pool->AllocatePages(40);
  auto ids = [](const std::vector<PageHandle>& pages) {
    std::vector<uint64_t> v;
    for (const PageHandle& p : pages) v.push_back(p.page_id);
    return v;
  };
  std::vector<uint64_t> run(40);
  std::iota(run.begin(), run.end(), 0);
  ASSERT_EQ(ids(first), run);
  ASSERT_TRUE(pool->FreePages(first).ok());
  const std::vector<PageHandle> again = *pool->AllocatePages(40);
  EXPECT_EQ(ids(again), run);
  std::vector<PageHandle> shuffled = again;
  std::shuffle(shuffled.begin(), shuffled.end(), std::mt19937(3));
  ASSERT_TRUE(pool->FreePages(shuffled).ok());
  EXPECT_EQ(ids(*pool->AllocatePages(40)), ids(shuffled));
}

// A writer does not wait for ever behind another: past its bound it is refused PAGES_BUSY
// holding nothing (the first writer keeps its pages, and a third gets them once it is done).
TEST(PageTableTest, AWriterHeldUpPastItsBoundIsRefusedPagesBusyAndHoldsNothing) {
  PageTable table("p", 2, 4, 1, 1);
  auto h = *table.Allocate(2);
  auto first = table.PinPages({&h[0], 1}, true);
  ASSERT_TRUE(first.ok());
  const auto start = std::chrono::steady_clock::now();
  const absl::StatusOr<PageTable::Pin> late = table.PinPages(h, true, absl::Milliseconds(100));
  EXPECT_GE(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(100));
  EXPECT_EQ(ReasonOf(late.status()), ErrorReason::kPagesBusy);
  EXPECT_EQ(late.status().code(), absl::StatusCode::kAborted);
  // h[1] was not taken by the refused writer: another writer gets it at once.
  auto other = table.PinPages({&h[1], 1}, true, absl::ZeroDuration());
  ASSERT_TRUE(other.ok()) << other.status();
  table.Unpin(*other);
  table.Unpin(*first);
  auto third = table.PinPages(h, true, absl::ZeroDuration());
  ASSERT_TRUE(third.ok()) << third.status();
  table.Unpin(*third);
}

// A worker saves layer after layer into the same pages, each save still on the device when
// the next arrives: writers of different layers do not wait for each other, while a writer
// of the same layer, and a writer of every layer (a transfer received), still take turns
// with them. A freed page is zeroed only once every layer's writer has let go.
TEST(PageTableTest, WritersOfDifferentLayersOfOnePageDoNotWaitForEachOther) {
  PageTable table("p", 4, 4, /*num_layers=*/3, 1);
  auto h = *table.Allocate(2);
  auto layer0 = table.PinLayer(h, 0, absl::ZeroDuration());
  ASSERT_TRUE(layer0.ok()) << layer0.status();
  auto layer2 = table.PinLayer(h, 2, absl::ZeroDuration());
  ASSERT_TRUE(layer2.ok()) << layer2.status();
  // Same layer: busy, and the refused writer holds nothing.
  EXPECT_EQ(ReasonOf(table.PinLayer({&h[1], 1}, 0, absl::ZeroDuration()).status()),
            ErrorReason::kPagesBusy);
  // Every layer: busy while any layer's writer holds a page.
  EXPECT_EQ(ReasonOf(table.PinPages({&h[1], 1}, true, absl::ZeroDuration()).status()),
            ErrorReason::kPagesBusy);
  // Out of range: refused, not pinned.
  EXPECT_EQ(ReasonOf(table.PinLayer(h, 3).status()), ErrorReason::kLayerOutOfRange);
  EXPECT_EQ(ReasonOf(table.PinLayer(h, -1).status()), ErrorReason::kLayerOutOfRange);
  // Readers never wait.
  auto reader = table.PinPages(h, false, absl::ZeroDuration());
  ASSERT_TRUE(reader.ok());
  table.Unpin(*reader);

  // Freed while both layers' writers hold the pages: nothing to zero yet.
  auto to_zero = table.Free(h);
  ASSERT_TRUE(to_zero.ok());
  EXPECT_TRUE(to_zero->empty());
  EXPECT_TRUE(table.Unpin(*layer0).empty());  // layer 2 still holds them
  std::vector<int64_t> last = table.Unpin(*layer2);
  std::sort(last.begin(), last.end());
  EXPECT_EQ(last, (std::vector<int64_t>{0, 1}));
  table.Reclaimed(last);

  // A writer of every layer holds off a writer of one layer until it lets go.
  auto g = *table.Allocate(1);
  auto all = table.PinPages(g, true);
  ASSERT_TRUE(all.ok());
  EXPECT_EQ(ReasonOf(table.PinLayer(g, 1, absl::ZeroDuration()).status()), ErrorReason::kPagesBusy);
  absl::StatusOr<PageTable::Pin> waited;
  std::thread one([&] { waited = table.PinLayer(g, 1); });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  table.Unpin(*all);
  one.join();
  ASSERT_TRUE(waited.ok()) << waited.status();
  EXPECT_EQ(waited->layer, 1);
  // Its release clears only its own layer: the same layer is free again at once.
  table.Unpin(*waited);
  auto again = table.PinLayer(g, 1, absl::ZeroDuration());
  ASSERT_TRUE(again.ok()) << again.status();
  table.Unpin(*again);
  auto whole = table.PinPages(g, true, absl::ZeroDuration());
  ASSERT_TRUE(whole.ok()) << whole.status();
  table.Unpin(*whole);

  // A layer's pin says which of its pages that layer holds records in (the oracle: what was
  // written, and PagesWithRecords).
  auto two = *table.Allocate(2);
  auto write = table.PinLayer(two, 1);
  ASSERT_TRUE(write.ok());
  EXPECT_EQ(write->held, (std::vector<uint8_t>{0, 0}));
  const int64_t token = static_cast<int64_t>(two[1].page_id) * 4 + 3;  // page two[1], slot 3
  table.Unpin(*write, 1, {&token, 1});
  for (int layer : {1, 2}) {
    auto again = table.PinLayer(two, layer);
    ASSERT_TRUE(again.ok());
    const std::vector<uint8_t> expected = {0, static_cast<uint8_t>(layer == 1)};
    EXPECT_EQ(again->held, expected) << "layer " << layer;
    EXPECT_EQ(table.PagesWithRecords(layer, again->pages), expected) << "layer " << layer;
    table.Unpin(*again);
  }

  // A page freed while a layer's save holds it: the save's release marks only the page still
  // allocated, and hands the freed one back for zeroing.
  auto save = table.PinLayer(two, 2);
  ASSERT_TRUE(save.ok());
  const int64_t records_before = table.counts().records_held;
  auto freed = table.Free({&two[0], 1});
  ASSERT_TRUE(freed.ok());
  EXPECT_TRUE(freed->empty());  // still held by the save
  const std::vector<int64_t> both = {static_cast<int64_t>(two[0].page_id),
                                     static_cast<int64_t>(two[1].page_id)};
  EXPECT_EQ(table.UnpinLayerPages(*save, both), std::vector<int64_t>{both[0]});
  EXPECT_EQ(table.counts().records_held, records_before + 4);  // page two[1]'s 4 slots only
  table.Reclaimed(std::vector<int64_t>{both[0]});
}

TEST(PageTableTest, DeletedPoolRefusesPins) {
  PageTable table("p", 1, 4, 1, 1);
  auto h = *table.Allocate(1);
  table.MarkDeleted();
  const absl::Status s = table.PinPages(h, true).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kAborted);
  EXPECT_EQ(ReasonOf(s), ErrorReason::kPoolDeleted);
}

// ---- writes and reads against the goldens -----------------------------------------------------

// Whole pages marked a word of occupancy bits at a time (a page-form save) must leave the
// table exactly as marking each of their tokens one by one does — the oracle is a second
// table marked per token — for page sizes that fill, share and straddle 64-bit words, in
// every layer, over pages already partly written. PagesWithRecords agrees with WrittenSlots.
TEST(PageTableTest, WholePagesMarkedByWordsEqualTheSameTokensMarkedOneByOne) {
  for (const int page_size : {1, 16, 48, 64, 128}) {
    SCOPED_TRACE(page_size);
    const int64_t num_pages = 300;  // enough for the bitmap path of long pin lists
    const int layers = 3;
    PageTable words("w", num_pages, page_size, layers, 1), tokens("t", num_pages, page_size, layers, 1);
    const std::vector<PageHandle> hw = *words.Allocate(num_pages), ht = *tokens.Allocate(num_pages);
    // A few tokens written first, the same in both.
    for (PageTable* t : {&words, &tokens}) {
      const auto& h = t == &words ? hw : ht;
      PageTable::Pin pin = *t->PinPages({&h[7], 1}, true);
      const std::vector<int64_t> some = {7 * page_size, 7 * page_size + page_size - 1};
      t->Unpin(pin, 1, some);
    }
    // Then every third page, in layer (page % layers), whole.
    std::vector<PageHandle> listed_w, listed_t;
    std::vector<int64_t> ids;
    std::vector<int> in_layer;
    for (int64_t p = 1; p < num_pages; p += 3) {
      listed_w.push_back(hw[p]);
      listed_t.push_back(ht[p]);
      ids.push_back(p);
      in_layer.push_back(static_cast<int>(p % layers));
    }
    ASSERT_GE(listed_w.size(), 64u);
    PageTable::Pin pw = *words.PinPages(listed_w, true);
    words.UnpinWrittenPages(pw, in_layer, ids);
    PageTable::Pin pt = *tokens.PinPages(listed_t, true);
    std::vector<int64_t> written;
    for (size_t i = 0; i < ids.size(); ++i) {
      // One Unpin per layer in the oracle: pin again for each.
      if (i > 0) pt = *tokens.PinPages(listed_t, true);
      written.clear();
      for (int s = 0; s < page_size; ++s) written.push_back(ids[i] * page_size + s);
      tokens.Unpin(pt, in_layer[i], written);
    }
    const auto cw = words.counts(), ct = tokens.counts();
    EXPECT_EQ(cw.tokens_held, ct.tokens_held);
    EXPECT_EQ(cw.records_held, ct.records_held);
    // Page 7 is listed in layer 1, where its first and last slots were already written:
    // every listed page's slots once, in one layer each.
    EXPECT_EQ(ct.records_held, static_cast<int64_t>(ids.size()) * page_size);
    EXPECT_EQ(ct.tokens_held, static_cast<int64_t>(ids.size()) * page_size);
    std::vector<int64_t> all(num_pages);
    for (int64_t p = 0; p < num_pages; ++p) all[p] = p;
    for (int l = 0; l < layers; ++l) {
      EXPECT_EQ(words.WrittenSlots(l, all), tokens.WrittenSlots(l, all)) << "layer " << l;
      const std::vector<uint8_t> any = words.PagesWithRecords(l, all);
      for (int64_t p = 0; p < num_pages; ++p) {
        EXPECT_EQ(any[p] != 0, !tokens.WrittenSlots(l, {&all[p], 1}).empty()) << "layer " << l << " page " << p;
      }
    }
  }
}

// The counts against a plain set of (layer, token) records, through random token writes,
// whole-page writes and frees, with tokens written in several layers.
TEST(PageTableTest, HeldTokensAndRecordsFollowASetOfRecordsThroughWritesAndFrees) {
  for (const int page_size : {1, 16, 48, 64, 128}) {
    SCOPED_TRACE(page_size);
    const int64_t num_pages = 40;
    const int layers = 3;
    PageTable table("m", num_pages, page_size, layers, 1);
    std::vector<PageHandle> handles = *table.Allocate(num_pages);
    std::set<std::pair<int, int64_t>> records;  // (layer, token)
    std::mt19937 random(page_size);
    for (int step = 0; step < 400; ++step) {
      const int64_t p = random() % num_pages;
      const int layer = static_cast<int>(random() % layers);
      PageTable::Pin pin = *table.PinPages({&handles[p], 1}, true);
      switch (random() % 3) {
        case 0: {  // a few tokens of the page
          std::vector<int64_t> tokens;
          for (int k = 0; k < 3; ++k) tokens.push_back(p * page_size + random() % page_size);
          table.Unpin(pin, layer, tokens);
          for (int64_t t : tokens) records.insert({layer, t});
          break;
        }
        case 1: {  // the whole page, by a writer of every layer or of this one
          const std::vector<int> in_layer = {layer};
          const std::vector<int64_t> ids = {p};
          if (step % 2 == 0) {
            table.UnpinWrittenPages(pin, in_layer, ids);
          } else {
            table.Unpin(pin);
            const PageTable::Pin one = *table.PinLayer({&handles[p], 1}, layer);
            table.UnpinLayerPages(one, ids);
          }
          for (int s = 0; s < page_size; ++s) records.insert({layer, p * page_size + s});
          break;
        }
        default: {  // freed, and allocated again
          table.Unpin(pin);
          const std::vector<int64_t> zero = *table.Free({&handles[p], 1});
          table.Reclaimed(zero);
          handles[p] = table.Allocate(1)->at(0);
          std::erase_if(records, [&](const auto& r) { return r.second / page_size == p; });
          ASSERT_EQ(static_cast<int64_t>(handles[p].page_id), p);  // the only free page
          break;
        }
      }
      std::set<int64_t> tokens;
      for (const auto& r : records) tokens.insert(r.second);
      const PageTable::Counts c = table.counts();
      ASSERT_EQ(c.records_held, static_cast<int64_t>(records.size())) << "step " << step;
      ASSERT_EQ(c.tokens_held, static_cast<int64_t>(tokens.size())) << "step " << step;
    }
    std::vector<int64_t> all(num_pages);
    for (int64_t p = 0; p < num_pages; ++p) all[p] = p;
    for (int l = 0; l < layers; ++l) {
      std::vector<int64_t> expected;  // i * page_size + slot over all pages in order
      for (const auto& r : records) {
        if (r.first == l) expected.push_back(r.second);
      }
      EXPECT_EQ(table.WrittenSlots(l, all), expected) << "layer " << l;
    }
  }
}

// A long free list (the bitmap path) with one page twice: refused, and nothing freed.
TEST(PageTableTest, ALongFreeListWithARepeatFreesNothing) {
  PageTable table("f", 600, 16, 1, 1);
  std::vector<PageHandle> handles = *table.Allocate(600);
  std::vector<PageHandle> listed = handles;
  listed.push_back(handles[437]);
  const absl::StatusOr<std::vector<int64_t>> freed = table.Free(listed);
  ASSERT_FALSE(freed.ok());
  EXPECT_EQ(ReasonOf(freed.status()), ErrorReason::kDuplicatePage);
  EXPECT_NE(freed.status().message().find("page 437 is listed twice"), std::string::npos)
      << freed.status();
  EXPECT_EQ(table.counts().pages_used, 600);
  EXPECT_TRUE(table.CheckHandles(handles).ok());
  EXPECT_TRUE(table.Free(handles).ok());
}

TEST(PageTableTest, CheckHandlesNamesTheFirstBadHandleAndLongPinListsPinRepeatsOnce) {
  PageTable table("p", 600, 4, 1, 3);
  std::vector<PageHandle> h = *table.Allocate(600);
  EXPECT_TRUE(table.CheckHandles(h).ok());
  std::vector<PageHandle> bad = h;
  bad[400].generation += 1;
  bad[500].page_id = 9999;
  const absl::Status s = table.CheckHandles(bad);
  EXPECT_EQ(ReasonOf(s), ErrorReason::kStalePageHandle) << s;
  EXPECT_NE(std::string(s.message()).find("page 400"), std::string::npos) << s;
  // 600 handles, each page twice: pinned once each, in first-seen order.
  std::vector<PageHandle> twice = h;
  twice.insert(twice.end(), h.rbegin(), h.rend());
  PageTable::Pin pin = *table.PinPages(twice, false);
  ASSERT_EQ(pin.pages.size(), 600u);
  for (int64_t p = 0; p < 600; ++p) EXPECT_EQ(pin.pages[p], static_cast<int64_t>(h[p].page_id));
  table.Unpin(pin);
  // Every reader pin released: a free zeroes at once.
  EXPECT_EQ(table.Free(h)->size(), 600u);
}

TEST(PageTableTest, LongPinListsAreRefusedAtTheirFirstBadHandleAndPinNothing) {
  PageTable table("p", 600, 64, 2, 3);
  const std::vector<PageHandle> h = *table.Allocate(600);
  auto writers_can_pin_all = [&] {
    absl::StatusOr<PageTable::Pin> all = table.PinPages(h, /*exclusive=*/true, absl::ZeroDuration());
    if (!all.ok()) return false;
    table.Unpin(*all);
    return true;
  };
  for (const bool layer_pin : {false, true}) {
    SCOPED_TRACE(layer_pin ? "PinLayer" : "PinPages");
    auto pin = [&](const std::vector<PageHandle>& list) {
      return layer_pin ? table.PinLayer(list, 1) : table.PinPages(list, /*exclusive=*/true);
    };
    // Two bad handles: the one listed first is named, whichever page it is.
    std::vector<PageHandle> bad = h;
    bad[450].generation += 1;
    bad[120].generation += 7;
    absl::StatusOr<PageTable::Pin> refused = pin(bad);
    ASSERT_FALSE(refused.ok());
    EXPECT_EQ(ReasonOf(refused.status()), ErrorReason::kStalePageHandle) << refused.status();
    EXPECT_NE(std::string(refused.status().message()).find("page 120 "), std::string::npos)
        << refused.status();
    // A page listed twice, the repeat with a stale generation: refused, though the page's
    // first listing is current.
    std::vector<PageHandle> repeat = h;
    repeat.push_back(h[300]);
    repeat.back().generation -= 1;
    refused = pin(repeat);
    ASSERT_FALSE(refused.ok());
    EXPECT_EQ(ReasonOf(refused.status()), ErrorReason::kStalePageHandle) << refused.status();
    EXPECT_NE(std::string(refused.status().message()).find("page 300 "), std::string::npos)
        << refused.status();
    // A page outside the pool among them.
    std::vector<PageHandle> outside = h;
    outside[599].page_id = 600;
    refused = pin(outside);
    ASSERT_FALSE(refused.ok());
    EXPECT_EQ(ReasonOf(refused.status()), ErrorReason::kPageOutOfRange) << refused.status();
    // None of the refused pins holds a page.
    EXPECT_TRUE(writers_can_pin_all());
  }
  // A freed page among 600 refuses the list; the others stay pinnable.
  ASSERT_TRUE(table.Free({&h[42], 1}).ok());
  absl::StatusOr<PageTable::Pin> refused = table.PinLayer(h, 0);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(std::string(refused.status().message()).find("page 42 "), std::string::npos)
      << refused.status();
}

TEST(CoreGoldenTest, RowsWritePagesReadWorkspaceAndTranscodeMatchTheGoldens) {
  for (const testing::GoldenCase& c : testing::GoldenCases()) {
    const auto rows = testing::ReadArray<uint16_t>(c.file("input.bf16"));
    const auto locs = testing::ReadArray<int64_t>(c.file("locs.i64"));
    for (Layout layout : testing::AllLayouts()) {
      SCOPED_TRACE(c.name + "." + LayoutName(layout));
      auto pool = MakePool(layout, c.page_size, c.num_pages);
      const auto handles = *pool->AllocatePages(c.num_pages);  // page i at index i
      std::vector<TokenLocation> where;
      for (int64_t loc : locs) {
        where.push_back({handles[loc / c.page_size], static_cast<uint32_t>(loc % c.page_size)});
      }
      auto write = StagedWrite::ForRows(pool, 0, WriteLimits{});
      ASSERT_TRUE(write.ok());
      // In three messages, to cross message boundaries.
      const size_t third = where.size() / 3 + 1;
      for (size_t at = 0; at < where.size(); at += third) {
        const size_t n = std::min(third, where.size() - at);
        ASSERT_TRUE((*write)->AddRows({where.data() + at, n},
                                      {reinterpret_cast<const uint8_t*>(rows.data() + at * 512), n * 1024})
                        .ok());
      }
      ASSERT_EQ(*(*write)->Commit(), static_cast<int64_t>(locs.size()));
      const std::string l = LayoutName(layout);
      // Batches of 1000 bytes: every page is its own batch, with two in flight.
      EXPECT_EQ(*Drain(ReadPages(pool, handles, {}, std::nullopt, 1000)),
                testing::ReadBytes(c.file("pool." + l + ".bin")));
      {
        // A first batch launched early and then dropped by a change of depth (a sender
        // whose guess of the peer's memory was wrong): launched again, the same bytes.
        std::unique_ptr<Reader> reader = *ReadPages(pool, handles, {}, std::nullopt, 1000);
        ASSERT_TRUE(reader->Prefetch().ok());
        reader->set_depth(4);
        EXPECT_EQ(reader->depth(), 4);
        EXPECT_EQ(*Drain(std::move(reader)), testing::ReadBytes(c.file("pool." + l + ".bin")));
      }
      EXPECT_EQ(*Drain(ReadPages(pool, handles, {}, Layout::kV4, 3 << 20)),
                testing::ReadBytes(c.file("transcode." + l + "_to_v4.bin")));
      auto workspace = *Drain(ReadWorkspace(pool, 0, where, 5 * 1024));
      EXPECT_EQ(workspace, testing::ReadBytes(c.file("dequant." + l + ".bf16")));
      EXPECT_EQ(pool->Stats().tokens_held, static_cast<int64_t>(locs.size()));

      // The same bytes through a page write into a second pool.
      auto copy = MakePool(layout, c.page_size, c.num_pages, 1, MakeCpuBackend(), 8);
      const auto copy_handles = *copy->AllocatePages(c.num_pages);
      const auto golden = testing::ReadBytes(c.file("pool." + l + ".bin"));
      auto pages = StagedWrite::ForPages(copy, layout, WriteLimits{});
      ASSERT_TRUE(pages.ok());
      const int64_t pb = PageBytes(layout, c.page_size);
      for (int64_t p = 0; p < c.num_pages; ++p) {  // each page in two halves
        const uint8_t* page = golden.data() + p * pb;
        ASSERT_TRUE((*pages)->AddPageBytes(copy_handles[p], 0, 0, {page, static_cast<size_t>(pb / 2)}).ok());
        ASSERT_TRUE((*pages)->AddPageBytes(copy_handles[p], 0, pb / 2,
                                           {page + pb / 2, static_cast<size_t>(pb - pb / 2)}).ok());
      }
      ASSERT_EQ(*(*pages)->Commit(), c.num_pages);
      EXPECT_EQ(*Drain(ReadPages(copy, copy_handles, {}, std::nullopt, 1 << 20)), golden);
    }
  }
}

TEST(CoreReadTest, LayersInRequestOrderAndRepeatsRefused) {
  auto pool = MakePool(Layout::kV41, 16, 4, 3);
  const auto h = *pool->AllocatePages(2);
  for (int layer = 0; layer < 3; ++layer) {
    auto w = *StagedWrite::ForRows(pool, layer, WriteLimits{});
    Where where = {{h[0], static_cast<uint32_t>(layer)}, {h[1], 5}};
    ASSERT_TRUE(w->AddRows(where, AsBytes(testing::RandomRows(2, layer))).ok());
    ASSERT_TRUE(w->Commit().ok());
  }
  const int64_t pb = PageBytes(Layout::kV41, 16);
  const int64_t layers[] = {2, 0};
  const auto out = *Drain(ReadPages(pool, h, layers, std::nullopt, 1));
  ASSERT_EQ(static_cast<int64_t>(out.size()), 4 * pb);
  // Expected: page-major, layers 2 then 0, straight from the pool's memory.
  std::vector<uint8_t> expected;
  for (const PageHandle& page : h) {
    for (int64_t layer : layers) {
      const uint8_t* at = pool->base() + (layer * 4 + static_cast<int64_t>(page.page_id)) * pb;
      expected.insert(expected.end(), at, at + pb);
    }
  }
  EXPECT_EQ(out, expected);
  const int64_t repeated[] = {1, 1};
  EXPECT_EQ(ReasonOf(ReadPages(pool, h, repeated, std::nullopt, 1 << 20).status()),
            ErrorReason::kDuplicateLayer);
}

// ---- invalid writes -------------------------------------------------------------------------------

TEST(CoreWriteTest, EveryInvalidPieceIsRefusedWithItsReasonAndChangesNothing) {
  auto pool = MakePool(Layout::kV4, 16, 4, 2);
  const auto h = *pool->AllocatePages(3);
  const Snapshot before = Take(*pool);
  auto rows = testing::RandomRows(2, 1);
  struct Case {
    const char* name;
    std::vector<TokenLocation> where;
    std::vector<uint8_t> bytes;
    ErrorReason reason;
  };
  std::vector<uint8_t> good(AsBytes(rows).begin(), AsBytes(rows).end());
  std::vector<uint8_t> nan = good;
  nan[1024 + 2 * 100 + 1] = 0x7F;  // row 1, dim 100: 0x7Fxx with a high exponent
  nan[1024 + 2 * 100] = 0xC0;
  const std::vector<Case> cases = {
      {"short rows", {{h[0], 0}, {h[0], 1}}, std::vector<uint8_t>(good.begin(), good.end() - 2),
       ErrorReason::kBadRowLength},
      {"slot", {{h[0], 16}, {h[0], 1}}, good, ErrorReason::kSlotOutOfRange},
      {"page", {{PageHandle{9, h[0].generation}, 0}, {h[0], 1}}, good, ErrorReason::kPageOutOfRange},
      {"repeat", {{h[1], 3}, {h[1], 3}}, good, ErrorReason::kDuplicateLocation},
      {"nan", {{h[1], 3}, {h[1], 4}}, nan, ErrorReason::kNonFiniteValue},
      {"stale", {{PageHandle{h[2].page_id, h[2].generation + 1}, 0}, {h[0], 0}}, good,
       ErrorReason::kStalePageHandle},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    auto w = *StagedWrite::ForRows(pool, 1, WriteLimits{});
    ASSERT_TRUE(w->AddRows(Where{{h[2], 0}}, {good.data(), 1024}).ok());  // a valid first piece
    // A cpu pool stages each row as its record.
    EXPECT_EQ(w->staged_bytes(), GetLayoutInfo(Layout::kV4).bytes_per_token());
    EXPECT_EQ(ReasonOf(w->AddRows(c.where, c.bytes)), c.reason);
    EXPECT_EQ(w->staged_bytes(), GetLayoutInfo(Layout::kV4).bytes_per_token())
        << "a refused piece keeps no staging";
    EXPECT_EQ(w->staged_rows(), 1);
  }
  EXPECT_EQ(ReasonOf(StagedWrite::ForRows(pool, 2, WriteLimits{}).status()),
            ErrorReason::kLayerOutOfRange);
  {  // limits: one set for rows and bytes
    auto w = *StagedWrite::ForRows(pool, 0, WriteLimits{1, 1 << 20});
    EXPECT_EQ(ReasonOf(w->AddRows(Where{{h[0], 0}, {h[0], 1}}, good)), ErrorReason::kWriteTooLarge);
    auto p = *StagedWrite::ForPages(pool, Layout::kV4, WriteLimits{1 << 20, 100});
    std::vector<uint8_t> page(PageBytes(Layout::kV4, 16), 1);
    EXPECT_EQ(ReasonOf(p->AddPageBytes(h[0], 0, 0, page)), ErrorReason::kWriteTooLarge);
  }
  {  // an empty later message
    auto w = *StagedWrite::ForRows(pool, 0, WriteLimits{});
    ASSERT_TRUE(w->AddRows(Where{}, {}).ok());  // a first message may only name the target
    ASSERT_TRUE(w->AddRows(Where{{h[0], 0}}, {good.data(), 1024}).ok());
    EXPECT_EQ(ReasonOf(w->AddRows(Where{}, {})), ErrorReason::kInvalidRequest);
  }
  {  // page bytes: wrong layout, out of order, past the end, incomplete
    EXPECT_EQ(ReasonOf(StagedWrite::ForPages(pool, Layout::kV41, WriteLimits{}).status()),
              ErrorReason::kLayoutMismatch);
    const int64_t pb = PageBytes(Layout::kV4, 16);
    std::vector<uint8_t> page(pb, 3);
    auto p = *StagedWrite::ForPages(pool, Layout::kV4, WriteLimits{});
    EXPECT_EQ(ReasonOf(p->AddPageBytes(h[0], 0, 8, {page.data(), 8})), ErrorReason::kPageBytesOutOfOrder);
    auto q = *StagedWrite::ForPages(pool, Layout::kV4, WriteLimits{});
    std::vector<uint8_t> too_long(pb + 1, 3);
    EXPECT_EQ(ReasonOf(q->AddPageBytes(h[0], 0, 0, too_long)), ErrorReason::kPageBytesOutOfOrder);
    auto r = *StagedWrite::ForPages(pool, Layout::kV4, WriteLimits{});
    ASSERT_TRUE(r->AddPageBytes(h[0], 1, 0, {page.data(), 100}).ok());
    EXPECT_EQ(ReasonOf(r->Commit().status()), ErrorReason::kPageIncomplete);
  }
  EXPECT_TRUE(Take(*pool) == before);
}

TEST(CoreWriteTest, CommitAfterAFreeOfOneOfItsPagesStoresNothing) {
  auto pool = MakePool(Layout::kV41Fp4, 8, 2);
  const auto h = *pool->AllocatePages(2);
  auto w = *StagedWrite::ForRows(pool, 0, WriteLimits{});
  ASSERT_TRUE(w->AddRows(Where{{h[0], 0}, {h[1], 0}}, AsBytes(testing::RandomRows(2, 2))).ok());
  ASSERT_TRUE(pool->FreePages({&h[1], 1}).ok());
  const Snapshot before = Take(*pool);
  EXPECT_EQ(ReasonOf(w->Commit().status()), ErrorReason::kStalePageHandle);
  EXPECT_TRUE(Take(*pool) == before);
}

// A pages write received in place (a transfer into a cpu pool): its pieces are the pool's own
// (page, layer) pairs, so a commit only marks them written; a write dropped uncommitted
// leaves the pool byte for byte as it was and the pages free for the next writer; pages that
// hold a record already are staged instead. The pool is read back through a page reader.
TEST(CoreWriteTest, PagesReceivedInPlaceCommitOrAreZeroedAgainAndPagesWithRecordsAreStaged) {
  auto pool = MakePool(Layout::kV41, 16, 6, 3);
  const auto h = *pool->AllocatePages(4);
  const int64_t page_bytes = pool->geometry().page_bytes();
  const std::vector<int64_t> layers = {2, 0};
  const std::vector<PageHandle> dst = {h[2], h[0], h[3]};
  auto stream = [&](uint32_t seed) {
    std::vector<uint8_t> bytes(dst.size() * layers.size() * page_bytes);
    std::mt19937 rng(seed);
    for (uint8_t& b : bytes) b = static_cast<uint8_t>(rng() | 1);  // no zero byte
    return bytes;
  };
  // The stream lands through StagingPieces in messages of 1.5 pages (a piece may end
  // mid-page), as the receiver posts them.
  auto land = [&](StagedWrite& w, const std::vector<uint8_t>& bytes) {
    const int64_t total = static_cast<int64_t>(bytes.size()), message = page_bytes * 3 / 2;
    for (int64_t at = 0; at < total; at += message) {
      int64_t from = at;
      for (std::span<uint8_t> piece : w.StagingPieces(at, std::min(message, total - at))) {
        std::memcpy(piece.data(), bytes.data() + from, piece.size());
        from += static_cast<int64_t>(piece.size());
      }
      EXPECT_EQ(from, std::min(at + message, total));
    }
  };
  auto read = [&] { return *Drain(ReadPages(pool, dst, layers, std::nullopt, 1 << 20)); };
  const Snapshot empty = Take(*pool);
  {
    auto w = *StagedWrite::ForPages(pool, Layout::kV41, WriteLimits{});
    ASSERT_TRUE(w->ReservePages(dst, layers, /*in_place=*/true).ok());
    EXPECT_TRUE(w->in_place());
    EXPECT_EQ(w->staged_bytes(), 0);
    land(*w, stream(1));
    EXPECT_EQ(read(), stream(1));  // in the pool already (a reader may see them)
  }
  EXPECT_TRUE(Take(*pool) == empty) << "a write in place dropped uncommitted must leave zeros";

  auto w = *StagedWrite::ForPages(pool, Layout::kV41, WriteLimits{});
  ASSERT_TRUE(w->ReservePages(dst, layers, /*in_place=*/true).ok());  // not held by the first
  ASSERT_TRUE(w->in_place());
  land(*w, stream(2));
  w->MarkReceived();
  ASSERT_EQ(*w->Commit(), 6);
  EXPECT_FALSE(w->in_place());
  w.reset();  // committed: nothing zeroed at its end
  EXPECT_EQ(read(), stream(2));
  EXPECT_EQ(pool->Stats().records_held, 6 * 16);
  // Everything else still zero: layer 1 of those pages, and page h[1] in every layer.
  std::vector<uint8_t> others = *Drain(ReadPages(pool, std::vector<PageHandle>{h[1]},
                                                 std::vector<int64_t>{0, 1, 2}, std::nullopt, 1 << 20));
  const std::vector<uint8_t> layer1 = *Drain(ReadPages(pool, dst, std::vector<int64_t>{1},
                                                       std::nullopt, 1 << 20));
  others.insert(others.end(), layer1.begin(), layer1.end());
  EXPECT_TRUE(std::all_of(others.begin(), others.end(), [](uint8_t b) { return b == 0; }));

  // The pages hold records now: the next write is staged, and dropping it changes nothing.
  const Snapshot written = Take(*pool);
  {
    auto staged = *StagedWrite::ForPages(pool, Layout::kV41, WriteLimits{});
    ASSERT_TRUE(staged->ReservePages(dst, layers, /*in_place=*/true).ok());
    EXPECT_FALSE(staged->in_place());
    EXPECT_EQ(staged->staged_bytes(), 6 * page_bytes);
    land(*staged, stream(3));
  }
  EXPECT_TRUE(Take(*pool) == written);
  auto staged = *StagedWrite::ForPages(pool, Layout::kV41, WriteLimits{});
  ASSERT_TRUE(staged->ReservePages(dst, layers, /*in_place=*/true).ok());
  land(*staged, stream(3));
  staged->MarkReceived();
  ASSERT_EQ(*staged->Commit(), 6);
  EXPECT_EQ(read(), stream(3));
}

// Pages reserved for a transfer are checked as a whole: a repeated page (short lists and
// the bitmap of long ones), a repeated or missing layer and a stale handle are refused; a
// long staged write in chunks of whole pages lands byte for byte.
TEST(CoreWriteTest, ReservedPagesAreCheckedAsAWholeAndLandInOrder) {
  auto pool = MakePool(Layout::kV41, 16, 600, 2);
  const auto h = *pool->AllocatePages(600);
  const int64_t page_bytes = pool->geometry().page_bytes();
  auto reason = [&](std::vector<PageHandle> pages, std::vector<int64_t> layers) {
    auto w = *StagedWrite::ForPages(pool, Layout::kV41, WriteLimits{});
    return ReasonOf(w->ReservePages(pages, layers, /*in_place=*/false));
  };
  EXPECT_EQ(reason({h[0], h[1], h[0]}, {0}), ErrorReason::kDuplicatePage);
  std::vector<PageHandle> many(h.begin(), h.begin() + 300);
  many.push_back(h[299]);
  EXPECT_EQ(reason(many, {1}), ErrorReason::kDuplicatePage);
  EXPECT_EQ(reason({h[0], h[1]}, {1, 0, 1}), ErrorReason::kDuplicatePage);
  EXPECT_EQ(reason({h[0], h[1]}, {2}), ErrorReason::kLayerOutOfRange);
  ASSERT_TRUE(pool->FreePages({&h[599], 1}).ok());
  EXPECT_EQ(reason({h[0], h[599]}, {0}), ErrorReason::kStalePageHandle);

  // 500 pages x 2 layers staged in chunks of 7 pages, received in messages of one chunk.
  const std::vector<PageHandle> dst(h.rbegin() + 1, h.rbegin() + 501);
  const std::vector<int64_t> layers = {1, 0};
  auto w = *StagedWrite::ForPages(pool, Layout::kV41, WriteLimits{}, 7 * page_bytes);
  ASSERT_TRUE(w->ReservePages(dst, layers, /*in_place=*/false).ok());
  const int64_t total = static_cast<int64_t>(dst.size() * layers.size()) * page_bytes;
  ASSERT_EQ(w->staged_bytes(), total);
  std::vector<uint8_t> bytes(static_cast<size_t>(total));
  std::mt19937 rng(5);
  for (uint8_t& b : bytes) b = static_cast<uint8_t>(rng());
  for (int64_t at = 0; at < total; at += 7 * page_bytes) {
    const std::vector<std::span<uint8_t>> pieces = w->StagingPieces(at, std::min(7 * page_bytes, total - at));
    ASSERT_EQ(pieces.size(), 1u);
    std::memcpy(pieces[0].data(), bytes.data() + at, pieces[0].size());
  }
  w->MarkReceived();
  ASSERT_EQ(*w->Commit(), 1000);
  EXPECT_EQ(*Drain(ReadPages(pool, dst, layers, std::nullopt, 1 << 20)), bytes);
}

// In place, a page freed before the commit fails the write: nothing is marked written and
// what landed is zeroed again when the write ends, the freed page's too.
TEST(CoreWriteTest, AWriteInPlaceWhosePageWasFreedCommitsNothing) {
  auto pool = MakePool(Layout::kV4, 16, 4, 2);
  const auto h = *pool->AllocatePages(2);
  const int64_t page_bytes = pool->geometry().page_bytes();
  const std::vector<int64_t> layers = {1};
  const Snapshot empty = Take(*pool);
  auto w = *StagedWrite::ForPages(pool, Layout::kV4, WriteLimits{});
  ASSERT_TRUE(w->ReservePages(h, layers, /*in_place=*/true).ok());
  ASSERT_TRUE(w->in_place());
  for (std::span<uint8_t> piece : w->StagingPieces(0, 2 * page_bytes)) {
    std::memset(piece.data(), 0x5A, piece.size());
  }
  w->MarkReceived();
  ASSERT_TRUE(pool->FreePages({&h[1], 1}).ok());
  EXPECT_EQ(ReasonOf(w->Commit().status()), ErrorReason::kStalePageHandle);
  w.reset();
  const Snapshot after = Take(*pool);
  EXPECT_EQ(after.bytes, empty.bytes);
  EXPECT_EQ(after.records_held, 0);
  EXPECT_EQ(after.pages_used, 1);
}

// A transfer into pages another write holds does not wait for it at the reserve (a transfer
// received in place holds its pages for as long as UCX may write them): its bytes are
// staged, and its commit waits for that write, then lands them.
TEST(CoreWriteTest, ATransferIntoPagesAnotherWriteHoldsIsStagedAndCommitsAfterIt) {
  auto pool = MakePool(Layout::kV41, 16, 4, 2);
  const auto h = *pool->AllocatePages(2);
  const int64_t page_bytes = pool->geometry().page_bytes();
  const std::vector<int64_t> layers = {1};
  PageTable::Pin holder = *pool->table().PinPages(h, /*exclusive=*/true);
  auto w = *StagedWrite::ForPages(pool, Layout::kV41, WriteLimits{});
  const absl::Time start = absl::Now();
  ASSERT_TRUE(w->ReservePages(h, layers, /*in_place=*/true).ok());
  // Not a speed check: a reserve that waited for the holder would take the writers' bound.
  EXPECT_LT(absl::Now() - start, PageTable::kWriterWait / 2) << "the reserve waited for the holder";
  EXPECT_FALSE(w->in_place());
  EXPECT_EQ(w->staged_bytes(), 2 * page_bytes);
  std::vector<uint8_t> bytes(static_cast<size_t>(2 * page_bytes));
  std::mt19937 rng(5);
  for (uint8_t& b : bytes) b = static_cast<uint8_t>(rng() | 1);
  size_t from = 0;
  for (std::span<uint8_t> piece : w->StagingPieces(0, 2 * page_bytes)) {
    std::memcpy(piece.data(), bytes.data() + from, piece.size());
    from += piece.size();
  }
  w->MarkReceived();
  std::atomic<bool> released{false};
  std::thread other([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    released = true;
    pool->Unpin(holder);
  });
  const absl::StatusOr<int64_t> committed = w->Commit();
  EXPECT_TRUE(released) << "the commit did not wait for the write that held the pages";
  other.join();
  ASSERT_TRUE(committed.ok()) << committed.status();
  EXPECT_EQ(*committed, 2);
  EXPECT_EQ(*Drain(ReadPages(pool, h, layers, std::nullopt, 1 << 20)), bytes);
}

// ---- device failures ---------------------------------------------------------------------------

// Runs `op` with the Nth backend event failing, for N = 1, 2, ... until it succeeds without a
// fault; after each failure `check` must hold. Returns the number of failures seen.
int EveryFailure(testing::FaultBackend& fault, const std::function<absl::Status()>& op,
                 const std::function<void(const absl::Status&)>& check) {
  int failures = 0;
  for (int64_t n = 1; n < 1000; ++n) {
    fault.FailAt(n);
    const absl::Status s = op();
    const bool fired = fault.fired() && fault.events() >= n;
    fault.FailAt(0);
    if (s.ok() && n > fault.events()) return failures;  // ran to the end without the fault
    if (!fired && s.ok()) continue;
    EXPECT_FALSE(s.ok()) << "event " << n << " failed but the op reported success";
    ++failures;
    check(s);
  }
  ADD_FAILURE() << "never finished";
  return failures;
}

// A pool in device memory (here a host backend that says it is not one) whose pages arrive
// into host staging message by message: each message goes on to the device as it arrives, in
// whatever order, and the commit scatters from there. Same bytes as the staged commit; a
// commit before every message was copied, or with a copy that failed, changes nothing.
TEST(CoreFaultTest, AWriteMirroredToTheDeviceMessageByMessageLandsTheSameBytes) {
  auto fault = std::make_shared<testing::FaultBackend>(MakeCpuBackend());
  auto pool = MakePool(Layout::kV41, 16, 300, 2, fault);
  const auto h = *pool->AllocatePages(300);
  const int64_t page_bytes = pool->geometry().page_bytes();
  const std::vector<PageHandle> dst(h.rbegin(), h.rbegin() + 250);
  const std::vector<int64_t> layers = {1, 0};
  const int64_t message = 7 * page_bytes;
  const int64_t total = static_cast<int64_t>(dst.size() * layers.size()) * page_bytes;
  const int64_t messages = (total + message - 1) / message;
  std::vector<uint8_t> bytes(static_cast<size_t>(total));
  std::mt19937 rng(11);
  for (uint8_t& b : bytes) b = static_cast<uint8_t>(rng());
  std::vector<int64_t> order(static_cast<size_t>(messages));
  for (int64_t i = 0; i < messages; ++i) order[static_cast<size_t>(i)] = i;
  std::shuffle(order.begin(), order.end(), rng);
  // Stages and mirrors the messages in `order` except the last `missing`; then commits.
  auto write = [&](int64_t missing) -> absl::Status {
    auto w = StagedWrite::ForPages(pool, Layout::kV41, WriteLimits{}, message);
    if (!w.ok()) return w.status();
    KVF_RETURN_IF_ERROR((*w)->ReservePages(dst, layers, /*in_place=*/true));
    EXPECT_FALSE((*w)->in_place());  // not a host memory pool
    KVF_ASSIGN_OR_RETURN(const bool mirrored, (*w)->PrepareDeviceMirror());
    EXPECT_TRUE(mirrored);
    for (size_t k = 0; k + missing < order.size(); ++k) {
      const int64_t at = order[k] * message;
      const int64_t n = std::min(message, total - at);
      const std::vector<std::span<uint8_t>> pieces = (*w)->StagingPieces(at, n);
      EXPECT_EQ(pieces.size(), 1u);
      std::memcpy(pieces[0].data(), bytes.data() + at, pieces[0].size());
      KVF_RETURN_IF_ERROR((*w)->MirrorToDevice(at, n));
    }
    (*w)->MarkReceived();
    return (*w)->Commit().status();
  };
  const Snapshot before = Take(*pool);
  EXPECT_EQ(ReasonOf(write(1)), ErrorReason::kInternalError);
  EXPECT_TRUE(Take(*pool) == before) << "a commit with a message not copied changed the pool";
  EXPECT_GE(EveryFailure(*fault, [&] { return write(0); },
                         [&](const absl::Status&) {
                           EXPECT_TRUE(Take(*pool) == before) << "a failed mirrored write changed the pool";
                         }),
            static_cast<int>(messages));  // the mirror, each message's copy, the ids, the scatter
  EXPECT_EQ(*Drain(ReadPages(pool, dst, layers, std::nullopt, 1 << 20)), bytes);

  // A host memory pool has nothing to mirror to.
  auto cpu = MakePool(Layout::kV41, 16, 4, 1);
  const auto c = *cpu->AllocatePages(2);
  auto w = *StagedWrite::ForPages(cpu, Layout::kV41, WriteLimits{});
  ASSERT_TRUE(w->ReservePages(c, std::vector<int64_t>{0}, /*in_place=*/false).ok());
  EXPECT_FALSE(*w->PrepareDeviceMirror());
}

// A transfer received in place into a pool in device memory (here a host backend that says
// it is not one) that does not commit is undone even when the device has no memory left by
// then (a common reason for a transfer to fail): the rollback's zeroing needs no allocation.
TEST(CoreFaultTest, AWriteInPlaceOnTheDeviceIsUndoneWithNoMemoryLeft) {
  auto fault = std::make_shared<testing::FaultBackend>(MakeCpuBackend());
  auto pool = MakePool(Layout::kV4, 16, 8, 1, fault);
  const auto h = *pool->AllocatePages(8);
  const int64_t page_bytes = pool->geometry().page_bytes();
  const Snapshot empty = Take(*pool);
  auto w = *StagedWrite::ForPages(pool, Layout::kV4, WriteLimits{}, StagingArena::kChunkBytes,
                                  /*device_staging=*/true);
  ASSERT_TRUE(w->ReservePages(h, std::vector<int64_t>{0}, /*in_place=*/true, 4 * page_bytes).ok());
  ASSERT_TRUE(w->in_place());
  for (std::span<uint8_t> piece : w->StagingPieces(0, 8 * page_bytes)) {
    std::memset(piece.data(), 0x5A, piece.size());
  }
  ASSERT_FALSE(Take(*pool) == empty);
  fault->FailAllocations(true);
  w.reset();
  fault->FailAllocations(false);
  EXPECT_TRUE(Take(*pool) == empty) << "the bytes landed in place were not zeroed again";
  // And the pages take the next write in place.
  auto next = *StagedWrite::ForPages(pool, Layout::kV4, WriteLimits{}, StagingArena::kChunkBytes,
                                     /*device_staging=*/true);
  ASSERT_TRUE(next->ReservePages(h, std::vector<int64_t>{0}, /*in_place=*/true, 4 * page_bytes).ok());
  EXPECT_TRUE(next->in_place());
}

TEST(CoreFaultTest, EveryAllocationCopyAndOpFailureOfAWriteLeavesThePoolAsItWas) {
  auto fault = std::make_shared<testing::FaultBackend>(MakeCpuBackend());
  auto pool = MakePool(Layout::kV41, 16, 8, 2, fault);
  const auto h = *pool->AllocatePages(4);
  {  // known content
    auto w = *StagedWrite::ForRows(pool, 1, WriteLimits{});
    ASSERT_TRUE(w->AddRows(Where{{h[0], 1}, {h[3], 2}}, AsBytes(testing::RandomRows(2, 9))).ok());
    ASSERT_TRUE(w->Commit().ok());
  }
  const Snapshot before = Take(*pool);
  // Rows in five messages of 1000 rows: several arena chunks and copies.
  const auto rows = testing::RandomRows(64, 10);
  auto rows_write = [&]() -> absl::Status {
    auto w = StagedWrite::ForRows(pool, 1, WriteLimits{});
    if (!w.ok()) return w.status();
    for (int m = 0; m < 4; ++m) {
      std::vector<TokenLocation> where;
      for (int i = 0; i < 16; ++i) where.push_back({h[m], static_cast<uint32_t>(i)});
      absl::Status s = (*w)->AddRows(where, {reinterpret_cast<const uint8_t*>(rows.data() + m * 16 * 512), 16 * 1024});
      if (!s.ok()) return s;
    }
    return (*w)->Commit().status();
  };
  const int failures = EveryFailure(*fault, rows_write, [&](const absl::Status&) {
    EXPECT_TRUE(Take(*pool) == before) << "a failed rows write changed the pool";
  });
  EXPECT_GE(failures, 3);  // arena chunk, device staging, copies, the quantize op
  const int64_t pb = PageBytes(Layout::kV41, 16);
  std::vector<uint8_t> page(pb, 0x5A);
  auto pages_write = [&]() -> absl::Status {
    auto w = StagedWrite::ForPages(pool, Layout::kV41, WriteLimits{});
    if (!w.ok()) return w.status();
    for (int m = 0; m < 3; ++m) {
      absl::Status s = (*w)->AddPageBytes(h[m], m % 2, 0, page);
      if (!s.ok()) return s;
    }
    return (*w)->Commit().status();
  };
  // The rows write finally succeeded: take the new state as the baseline.
  const Snapshot after_rows = Take(*pool);
  EXPECT_FALSE(after_rows == before);
  EXPECT_GE(EveryFailure(*fault, pages_write, [&](const absl::Status&) {
              EXPECT_TRUE(Take(*pool) == after_rows) << "a failed page write changed the pool";
            }),
            3);
  // Reads: every failure is an error, and the pins are released (the page can be freed
  // and is reclaimed).
  const Snapshot stable = Take(*pool);
  auto read = [&]() -> absl::Status {
    return Drain(ReadPages(pool, h, {}, Layout::kV4, 2 * pb)).status();
  };
  EXPECT_GE(EveryFailure(*fault, read, [&](const absl::Status&) { EXPECT_TRUE(Take(*pool) == stable); }), 4);
  // Frees: a failed zeroing keeps the pages back; the next allocation zeroes them.
  fault->FailAt(2);  // the zero op (after the ids allocation)
  EXPECT_EQ(ReasonOf(pool->FreePages(h)), ErrorReason::kDeviceError);
  fault->FailAt(0);
  EXPECT_EQ(pool->Stats().pages_free, 4);  // 4 never allocated; the freed 4 are held back
  const auto again = *pool->AllocatePages(8);
  std::vector<uint8_t> all(pool->base(), pool->base() + pool->Stats().pool_bytes);
  EXPECT_EQ(all, std::vector<uint8_t>(all.size(), 0));
  EXPECT_EQ(pool->Stats().tokens_held, 0);
  EXPECT_EQ(pool->Stats().pages_used, 8);
}

// ---- manager -------------------------------------------------------------------------------------

const std::shared_ptr<TenantAccount> kTenant = std::make_shared<TenantAccount>("");

TEST(CpuBackendTest, FreedStagingIsReusedStaysCountedAndGoesFirstWhenTheCapWouldRefuse) {
  // A 32 MiB cap; pools (zero-filled device memory) may take all but an eighth, 28 MiB.
  const uint64_t cap = uint64_t{32} << 20;
  auto backend = MakeCpuBackend(1, cap);
  void* first = nullptr;
  {
    auto staging = backend->Allocate(4 << 20, MemoryKind::kHostStaging, false);
    ASSERT_TRUE(staging.ok());
    first = staging->get();
  }
  // Kept as a spare: still counted, and the next staging of that size gets it back.
  EXPECT_EQ(*backend->FreeBytes(), cap - cap / 8 - (4 << 20));
  {
    auto again = backend->Allocate(4 << 20, MemoryKind::kHostStaging, true);
    ASSERT_TRUE(again.ok());
    EXPECT_EQ(again->get(), first);
    EXPECT_TRUE(std::all_of(again->get(), again->get() + (4 << 20), [](uint8_t b) { return b == 0; }));
  }
  // A pool that fits only without the spare: the spare is dropped, the pool allocated.
  auto pool = backend->Allocate(26 << 20, MemoryKind::kDevice, true);
  ASSERT_TRUE(pool.ok()) << pool.status();
  EXPECT_EQ(*backend->FreeBytes(), cap - cap / 8 - (26 << 20));
  // Beyond the cap still refused.
  EXPECT_EQ(backend->Allocate(8 << 20, MemoryKind::kHostStaging, false).status().code(),
            absl::StatusCode::kResourceExhausted);
}

// A pages write larger than one staging chunk (4 MiB), of pages that do not divide it: the
// staging is made of whole pages, so the commit scatters from it where it lies. Copied
// whole into one more buffer first (as when a page crossed two chunks), the write would not
// fit the cap: pool 9.6 MB + staging 8.4 MB + that copy 7.5 MB = 25.4 MB against 23.1 MB.
TEST(CpuBackendTest, APagesWriteBeyondOneStagingChunkCommitsWithoutASecondCopy) {
  auto backend = MakeCpuBackend(1, uint64_t{22} << 20);
  auto pool = MakePool(Layout::kV4, 64, 256, 1, backend);
  const int64_t page_bytes = pool->geometry().page_bytes();  // 37376: no divisor of 4 MiB
  ASSERT_NE((int64_t{4} << 20) % page_bytes, 0);
  const auto handles = *pool->AllocatePages(200);
  auto write = *StagedWrite::ForPages(pool, Layout::kV4, WriteLimits{});
  std::vector<uint8_t> page(page_bytes);
  for (size_t i = 0; i < handles.size(); ++i) {
    std::fill(page.begin(), page.end(), static_cast<uint8_t>(i * 7 + 1));
    ASSERT_TRUE(write->AddPageBytes(handles[i], 0, 0, page).ok());
  }
  const absl::StatusOr<int64_t> committed = write->Commit();
  ASSERT_TRUE(committed.ok()) << committed.status();
  for (size_t i = 0; i < handles.size(); ++i) {
    const uint8_t* at = pool->base() + handles[i].page_id * page_bytes;
    ASSERT_TRUE(std::all_of(at, at + page_bytes,
                            [&](uint8_t b) { return b == static_cast<uint8_t>(i * 7 + 1); }))
        << "page " << i;
  }
}

TEST(PoolManagerTest, NamesIncarnationsTotalsAndDeletion) {
  PoolManager manager(PoolManagerOptions{"cpu", nullptr, {}, nullptr});
  PoolConfig config{"a", Layout::kV4, 16, 4, 1};
  auto a = manager.Create(kTenant, config, "");
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(ReasonOf(manager.Create(kTenant, config, "").status()), ErrorReason::kPoolExists);
  config.name = "bad name";
  EXPECT_EQ(ReasonOf(manager.Create(kTenant, config, "").status()), ErrorReason::kInvalidName);
  config.name = "b";
  EXPECT_EQ(ReasonOf(manager.Create(kTenant, config, "gpu").status()), ErrorReason::kUnknownDevice);
  EXPECT_EQ(ReasonOf(manager.Get(*kTenant, "b").status()), ErrorReason::kPoolNotFound);  // failed create left nothing
  config.num_layers = 0;
  EXPECT_EQ(ReasonOf(manager.Create(kTenant, config, "").status()), ErrorReason::kInvalidGeometry);
  config.num_layers = 2;
  auto b = manager.Create(kTenant, config, "cpu");
  ASSERT_TRUE(b.ok());
  EXPECT_NE((*a)->id(), (*b)->id());
  auto w = *StagedWrite::ForRows(*b, 1, WriteLimits{});
  const auto h = *(*b)->AllocatePages(1);
  ASSERT_TRUE(w->AddRows(Where{{h[0], 0}, {h[0], 1}}, AsBytes(testing::RandomRows(2, 3))).ok());
  ASSERT_TRUE(w->Commit().ok());
  const DaemonStats stats = manager.Stats();
  ASSERT_EQ(stats.pools.size(), 2u);
  EXPECT_EQ(stats.pools[0].name, "a");
  EXPECT_EQ(stats.tokens_held, 2);
  EXPECT_EQ(stats.records_held, 2);
  EXPECT_EQ(stats.pool_bytes, stats.pools[0].pool_bytes + stats.pools[1].pool_bytes);
  // V4 at 16 tokens a page: 17 x 576 bytes, 612 bytes a token.
  EXPECT_DOUBLE_EQ(stats.bytes_saved_vs_bf16, 2 * (1024.0 - 612.0));
  // A write begun on a deleted pool fails at commit.
  auto late = *StagedWrite::ForRows(*b, 0, WriteLimits{});
  ASSERT_TRUE(late->AddRows(Where{{h[0], 2}}, AsBytes(testing::RandomRows(1, 4))).ok());
  ASSERT_TRUE(manager.Delete(*kTenant, "b").ok());
  EXPECT_EQ(ReasonOf(late->Commit().status()), ErrorReason::kPoolDeleted);
  EXPECT_EQ(ReasonOf(manager.Delete(*kTenant, "b")), ErrorReason::kPoolNotFound);
}

TEST(PoolManagerTest, ConcurrentWritersOfDisjointPagesAllLandExactly) {
  PoolManager manager(PoolManagerOptions{"cpu", nullptr, {}, nullptr});
  auto pool = *manager.Create(kTenant, PoolConfig{"c", Layout::kV4, 64, 32, 1}, "");
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      const auto h = *pool->AllocatePages(4);
      const auto rows = testing::RandomRows(256, 50 + t);
      for (int round = 0; round < 5; ++round) {
        auto w = *StagedWrite::ForRows(pool, 0, WriteLimits{});
        std::vector<TokenLocation> where;
        for (int i = 0; i < 256; ++i) where.push_back({h[i / 64], static_cast<uint32_t>(i % 64)});
        if (!w->AddRows(where, AsBytes(rows)).ok() || !w->Commit().ok()) ++failures;
        auto back = Drain(ReadWorkspace(pool, 0, where, 64 * 1024));
        // Reference: the same rows through the CPU reference in a 4-page pool.
        const PoolGeometry g{Layout::kV4, 64, 4};
        std::vector<uint8_t> ref(g.pool_bytes(), 0);
        std::vector<int64_t> locs(256);
        for (int i = 0; i < 256; ++i) locs[i] = i;
        std::vector<uint16_t> expected(256 * 512);
        if (!reference::QuantizeStore(g, rows, locs, ref).ok() ||
            !reference::DequantizeGather(g, ref, locs, expected).ok() || !back.ok() ||
            *back != std::vector<uint8_t>(AsBytes(expected).begin(), AsBytes(expected).end())) {
          ++failures;
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(pool->Stats().tokens_held, 8 * 256);
}

// ---- leases --------------------------------------------------------------------------------------

// A renewal that answers OK keeps its page for a lease length, even while an expiry pass
// that listed the page as run out is freeing the others: the pass frees exactly the pages
// nobody renewed. (Before, the pass freed every page it had listed, renewed since or not,
// and a renewal could answer OK for a page freed between its check and its renewal.)
TEST(PoolLeaseTest, ARenewalDuringAnExpiryPassKeepsItsPage) {
  constexpr int kPages = 4096;
  auto pool = MakePool(Layout::kV41, 16, kPages);
  absl::StatusOr<std::vector<PageHandle>> pages = pool->AllocatePages(kPages, absl::Milliseconds(100));
  ASSERT_TRUE(pages.ok()) << pages.status();
  absl::SleepFor(absl::Milliseconds(150));  // every lease has run out
  const absl::Time now = absl::Now();
  int64_t freed = -1;
  std::thread pass([&] { freed = pool->ExpireLeases(now); });
  // Every other page renewed, one call each, while the pass frees page after page.
  std::vector<char> renewed(kPages, 0);
  for (int i = 0; i < kPages; i += 2) {
    renewed[i] = pool->Renew(std::span<const PageHandle>(&(*pages)[i], 1)).ok();
  }
  pass.join();
  int64_t kept = 0;
  for (int i = 0; i < kPages; ++i) {
    const bool live = pool->table().CheckHandle((*pages)[i]).ok();
    if (renewed[i]) {
      EXPECT_TRUE(live) << "page " << i << " was renewed (OK), then freed";
      ++kept;
    } else {
      EXPECT_FALSE(live) << "page " << i << " was not renewed, yet kept";
    }
  }
  EXPECT_EQ(freed, kPages - kept);
  EXPECT_EQ(pool->Stats().pages_used, kept);
  // The renewed leases run out in their turn.
  EXPECT_EQ(pool->ExpireLeases(now), 0);
  EXPECT_EQ(pool->ExpireLeases(absl::Now() + absl::Seconds(1)), kept);
  EXPECT_EQ(pool->Stats().pages_used, 0);
}

// ---- tenants -------------------------------------------------------------------------------------

TEST(TenantTest, PoolsAreNamespacedByTenantAndInvisibleToOthers) {
  PoolManager manager(PoolManagerOptions{"cpu", nullptr, {}, nullptr});
  auto alice = std::make_shared<TenantAccount>("alice");
  auto bob = std::make_shared<TenantAccount>("bob");
  const PoolConfig config{"p", Layout::kV4, 16, 4, 1};
  auto a = manager.Create(alice, config, "");
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(ReasonOf(manager.Get(*bob, "p").status()), ErrorReason::kPoolNotFound);
  EXPECT_EQ(ReasonOf(manager.Delete(*bob, "p")), ErrorReason::kPoolNotFound);
  EXPECT_TRUE(manager.Stats(*bob).pools.empty());
  auto b = manager.Create(bob, config, "");  // the same name, another tenant
  ASSERT_TRUE(b.ok());
  EXPECT_NE((*a)->id(), (*b)->id());
  EXPECT_EQ(*manager.Get(*alice, "p"), *a);
  EXPECT_EQ(*manager.Get(*bob, "p"), *b);
  ASSERT_EQ(manager.Stats(*alice).pools.size(), 1u);
  EXPECT_EQ(manager.Stats(*alice).pools[0].tenant, "alice");
  EXPECT_EQ(manager.Stats().pools.size(), 2u);
  ASSERT_TRUE(manager.Delete(*bob, "p").ok());
  EXPECT_TRUE(manager.Get(*alice, "p").ok());
}

TEST(TenantTest, QuotasRefuseWithoutAllocatingAndRecoverOnFree) {
  PoolManager manager(PoolManagerOptions{"cpu", nullptr, {}, nullptr});
  const int64_t pool_bytes = PoolGeometry{Layout::kV4, 16, 4}.pool_bytes();
  TenantQuota quota;
  quota[Resource::kPools] = 1;
  quota[Resource::kPages] = 3;
  quota[Resource::kDeviceBytes] = pool_bytes;
  // A cpu pool stages each row written as its record: room for two.
  const int64_t record = GetLayoutInfo(Layout::kV4).bytes_per_token();
  quota[Resource::kStagedWriteBytes] = 2 * record;
  auto alice = std::make_shared<TenantAccount>("alice", quota);

  PoolConfig big{"big", Layout::kV4, 16, 5, 1};
  EXPECT_EQ(ReasonOf(manager.Create(alice, big, "").status()), ErrorReason::kQuotaExceeded);
  EXPECT_EQ(alice->used(Resource::kPools), 0);
  EXPECT_EQ(alice->used(Resource::kDeviceBytes), 0);
  auto pool = *manager.Create(alice, PoolConfig{"p", Layout::kV4, 16, 4, 1}, "");
  EXPECT_EQ(ReasonOf(manager.Create(alice, PoolConfig{"q", Layout::kV4, 16, 1, 1}, "").status()),
            ErrorReason::kQuotaExceeded);
  EXPECT_EQ(alice->used(Resource::kDeviceBytes), pool_bytes);

  auto pages = *pool->AllocatePages(3);
  EXPECT_EQ(ReasonOf(pool->AllocatePages(1).status()), ErrorReason::kQuotaExceeded);
  EXPECT_EQ(pool->Stats().pages_used, 3);
  ASSERT_TRUE(pool->FreePages({pages.data(), 1}).ok());
  EXPECT_EQ(alice->used(Resource::kPages), 2);
  ASSERT_TRUE(pool->AllocatePages(1).ok());

  {
    auto over = *StagedWrite::ForRows(pool, 0, WriteLimits{});
    EXPECT_EQ(ReasonOf(over->AddRows(Where{{pages[1], 0}, {pages[1], 1}, {pages[1], 2}},
                                     AsBytes(testing::RandomRows(3, 1)))),
              ErrorReason::kQuotaExceeded);
    over.reset();  // a failed write is dropped
    // Rows that are not finite and over the quota: the NaN is the reason given (rows are
    // checked before they are staged), and nothing stays charged.
    const std::vector<uint16_t> nan_rows = testing::RandomRows(3, 1);
    std::vector<uint8_t> nan(AsBytes(nan_rows).begin(), AsBytes(nan_rows).end());
    nan[2 * 1024 + 2 * 7 + 1] = 0xFF;  // row 2, dim 7: -Inf
    nan[2 * 1024 + 2 * 7] = 0x80;
    auto both = *StagedWrite::ForRows(pool, 0, WriteLimits{});
    EXPECT_EQ(ReasonOf(both->AddRows(Where{{pages[1], 0}, {pages[1], 1}, {pages[1], 2}}, nan)),
              ErrorReason::kNonFiniteValue);
    EXPECT_EQ(alice->used(Resource::kStagedWriteBytes), 0);
    // Within the quota, the NaN found while staging gives the message's charge back.
    auto within = *StagedWrite::ForRows(pool, 0, WriteLimits{});
    ASSERT_TRUE(within->AddRows(Where{{pages[1], 0}}, {nan.data(), kBf16RowBytes}).ok());
    EXPECT_EQ(ReasonOf(within->AddRows(Where{{pages[1], 2}}, {nan.data() + 2 * kBf16RowBytes,
                                                               kBf16RowBytes})),
              ErrorReason::kNonFiniteValue);
    EXPECT_EQ(alice->used(Resource::kStagedWriteBytes), record);
    within.reset();
    auto write = *StagedWrite::ForRows(pool, 0, WriteLimits{});
    ASSERT_TRUE(write->AddRows(Where{{pages[1], 0}, {pages[1], 1}},
                               AsBytes(testing::RandomRows(2, 1))).ok());
    EXPECT_EQ(alice->used(Resource::kStagedWriteBytes), 2 * record);
  }
  EXPECT_EQ(alice->used(Resource::kStagedWriteBytes), 0) << "a dropped write gives its staging back";

  // Deleting the pool gives back everything once its last user lets go.
  ASSERT_TRUE(manager.Delete(*alice, "p").ok());
  EXPECT_EQ(alice->used(Resource::kPools), 1) << "still held here";
  pool.reset();
  EXPECT_EQ(alice->used(Resource::kPools), 0);
  EXPECT_EQ(alice->used(Resource::kPages), 0);
  EXPECT_EQ(alice->used(Resource::kDeviceBytes), 0);
  EXPECT_TRUE(manager.Create(alice, PoolConfig{"q", Layout::kV4, 16, 4, 1}, "").ok());
}

TEST(TenantTest, ScopedChargeRefundsOnceAndNewLimitsApplyToLaterCharges) {
  TenantQuota quota;
  quota[Resource::kStreams] = 1;
  auto t = std::make_shared<TenantAccount>("t", quota);
  {
    auto held = ScopedCharge::Take(t, Resource::kStreams, 1);
    ASSERT_TRUE(held.ok());
    EXPECT_EQ(ReasonOf(ScopedCharge::Take(t, Resource::kStreams, 1).status()),
              ErrorReason::kQuotaExceeded);
    ScopedCharge moved = std::move(*held);
    EXPECT_EQ(t->used(Resource::kStreams), 1);
  }
  EXPECT_EQ(t->used(Resource::kStreams), 0);
  quota[Resource::kStreams] = 2;
  t->SetQuota(quota);
  auto one = ScopedCharge::Take(t, Resource::kStreams, 1);
  auto two = ScopedCharge::Take(t, Resource::kStreams, 1);
  EXPECT_TRUE(one.ok() && two.ok());
  // Unlimited resources never overflow.
  EXPECT_TRUE(t->Charge(Resource::kPages, TenantQuota::kUnlimited).ok());
  EXPECT_EQ(ReasonOf(t->Charge(Resource::kPages, 1)), ErrorReason::kQuotaExceeded);
}

TEST(TenantTest, TheDaemonBudgetBindsAllTenantsAndARefusalTakesNothingFromEither) {
  std::vector<std::pair<Resource, bool>> refusals;
  TenantLimits limits;
  limits.daemon[Resource::kStagedWriteBytes] = 100;
  limits.per_tenant[Resource::kStagedWriteBytes] = 60;
  limits.on_refusal = [&](Resource r, bool daemon_wide) { refusals.push_back({r, daemon_wide}); };
  TenantRegistry registry(limits);
  auto a = registry.Get("a");
  auto b = registry.Get("b");
  ASSERT_TRUE(a->Charge(Resource::kStagedWriteBytes, 60).ok());
  // a's own share is used up.
  EXPECT_EQ(ReasonOf(a->Charge(Resource::kStagedWriteBytes, 1)), ErrorReason::kQuotaExceeded);
  // b fits its share but not what is left of the daemon's: nothing is taken from b.
  EXPECT_EQ(ReasonOf(b->Charge(Resource::kStagedWriteBytes, 50)), ErrorReason::kDaemonBudgetExhausted);
  EXPECT_EQ(b->used(Resource::kStagedWriteBytes), 0);
  EXPECT_EQ(registry.daemon()->used(Resource::kStagedWriteBytes), 60);
  EXPECT_TRUE(b->Charge(Resource::kStagedWriteBytes, 40).ok());
  a->Refund(Resource::kStagedWriteBytes, 60);
  EXPECT_EQ(registry.daemon()->used(Resource::kStagedWriteBytes), 40);
  EXPECT_TRUE(b->Charge(Resource::kStagedWriteBytes, 20).ok());
  ASSERT_EQ(refusals.size(), 2u);
  EXPECT_FALSE(refusals[0].second);
  EXPECT_TRUE(refusals[1].second);
  // A token file's quota replaces the default where it gives one; elsewhere the default stays.
  TenantQuota given;
  given[Resource::kStreams] = 3;
  a->SetQuota(given);
  EXPECT_EQ(a->limit(Resource::kStreams), 3);
  EXPECT_EQ(a->limit(Resource::kStagedWriteBytes), 60);
}

}  // namespace
}  // namespace kvferry::server
