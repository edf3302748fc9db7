// CUDA IPC sessions on a GPU: this test process is the worker (its tensors in its own
// device memory), kvferryd another process. Save and Load against the golden vectors and
// the daemon's gRPC reads, asynchronous completion, invalid requests leaving the pool as
// it was, pool exports, and a worker killed with SIGKILL.
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <fcntl.h>
#include <httplib.h>
#include <unistd.h>
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <numeric>
#include <optional>
#include <thread>
#include <random>

#include "common/golden.h"
#include "common/random_rows.h"
#include "daemon_harness.h"
#include "kvferry/v1/session.grpc.pb.h"
#include "kvferry/client/client.h"
#include "kvferry/client/cuda_ipc.h"
#include "kvferry/client/session.h"
#include "kvferry/kernels/ops.h"

namespace kvferry {
namespace {

using client::BlockSlot;
using client::KvTensor;
using client::PageHandle;
using client::Session;
using client::TokenLocation;

bool HaveGpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

client::Layout L(Layout l) {
  return l == Layout::kV4 ? client::Layout::kV4 : l == Layout::kV41 ? client::Layout::kV41 : client::Layout::kV41Fp4;
}

// Device memory of the worker.
struct Device {
  explicit Device(size_t n) : bytes(n) {
    EXPECT_EQ(cudaMalloc(&ptr, n), cudaSuccess);
    cudaMemset(ptr, 0, n);
  }
  ~Device() { cudaFree(ptr); }
  void Upload(const void* host, size_t n, size_t at = 0) {
    ASSERT_EQ(cudaMemcpy(static_cast<uint8_t*>(ptr) + at, host, n, cudaMemcpyHostToDevice), cudaSuccess);
  }
  std::vector<uint8_t> Download() const {
    std::vector<uint8_t> h(bytes);
    EXPECT_EQ(cudaMemcpy(h.data(), ptr, bytes, cudaMemcpyDeviceToHost), cudaSuccess);
    return h;
  }
  void* ptr = nullptr;
  size_t bytes;
};

class IpcTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
    daemon_ = std::make_unique<testing::Daemon>(std::vector<std::string>{"--default_device=cuda:0"});
    options_.target = "127.0.0.1:" + std::to_string(daemon_->grpc_port());
    client_ = *client::Client::Connect(options_);
    auto s = Session::Open(options_, "ipc-test", 0);
    ASSERT_TRUE(s.ok()) << s.status();
    session_ = std::move(*s);
  }

  // A bf16 tensor: `blocks` blocks of `tokens` tokens, rows `stride` bytes apart.
  uint64_t RegisterBf16(Device& d, uint64_t blocks, uint32_t tokens, uint64_t stride, uint64_t block_stride) {
    KvTensor t{.num_blocks = blocks, .block_tokens = tokens, .block_stride = block_stride,
               .token_stride = stride, .kind = KvTensor::Kind::kBf16, .name = "bf16"};
    EXPECT_TRUE(client::DescribeDevicePointer(d.ptr, t).ok());
    auto id = session_->RegisterKv(t);
    EXPECT_TRUE(id.ok()) << id.status();
    return id.value_or(0);
  }
  uint64_t RegisterRecords(Device& d, uint64_t blocks, uint32_t page_size, Layout layout) {
    KvTensor t{.num_blocks = blocks, .block_tokens = page_size,
               .block_stride = static_cast<uint64_t>(PageBytes(layout, page_size)),
               .kind = KvTensor::Kind::kRecords, .layout = L(layout), .name = "records"};
    EXPECT_TRUE(client::DescribeDevicePointer(d.ptr, t).ok());
    auto id = session_->RegisterKv(t);
    EXPECT_TRUE(id.ok()) << id.status();
    return id.value_or(0);
  }
  std::vector<PageHandle> NewPool(const std::string& name, Layout layout, int page_size, int64_t pages) {
    EXPECT_TRUE(client_->CreatePool({name, L(layout), static_cast<uint32_t>(page_size),
                                     static_cast<uint64_t>(pages), 1, "cuda:0"}).ok());
    return *client_->AllocatePages(name, static_cast<uint32_t>(pages));
  }

  // Token form pairs of golden locations: block loc / page_size of the worker's tensor (one
  // block per page) and the same slot of pool page pages[loc / page_size].
  static void PairUp(const std::vector<int64_t>& locs, int page_size,
                     const std::vector<PageHandle>& pages, std::vector<BlockSlot>& from,
                     std::vector<TokenLocation>& to) {
    for (int64_t loc : locs) {
      from.push_back({static_cast<uint64_t>(loc / page_size), static_cast<uint32_t>(loc % page_size)});
      to.push_back({pages[loc / page_size], static_cast<uint32_t>(loc % page_size)});
    }
  }

  client::ClientOptions options_;
  std::unique_ptr<testing::Daemon> daemon_;
  std::unique_ptr<client::Client> client_;
  std::unique_ptr<Session> session_;
};

TEST_F(IpcTest, SaveAndLoadOfBf16RowsMatchTheGoldensByteForByte) {
  for (const testing::GoldenCase& g : testing::GoldenCases()) {
    const auto rows = testing::ReadArray<uint16_t>(g.file("input.bf16"));
    const auto locs = testing::ReadArray<int64_t>(g.file("locs.i64"));
    // An engine-like cache: one block per page, rows 1536 bytes apart, blocks padded.
    const uint64_t stride = 1536, block_stride = g.page_size * stride + 256;
    Device cache(g.num_pages * block_stride);
    for (size_t i = 0; i < locs.size(); ++i) {
      cache.Upload(rows.data() + i * 512, 1024,
                   (locs[i] / g.page_size) * block_stride + (locs[i] % g.page_size) * stride);
    }
    const uint64_t tensor = RegisterBf16(cache, g.num_pages, g.page_size, stride, block_stride);
    for (Layout layout : testing::AllLayouts()) {
      const std::string l = LayoutName(layout), name = g.name + "." + l;
      SCOPED_TRACE(name);
      const auto pages = NewPool(name, layout, g.page_size, g.num_pages);
      std::vector<BlockSlot> from;
      std::vector<TokenLocation> to;
      PairUp(locs, g.page_size, pages, from, to);
      auto saved = session_->Save(tensor, name, 0, from, to);
      ASSERT_TRUE(saved.ok()) << saved.status();
      EXPECT_EQ(*saved, locs.size());
      EXPECT_EQ(*client_->ReadPages(name, pages), testing::ReadBytes(g.file("pool." + l + ".bin")));
      // Load into a dense workspace tensor in reverse order.
      Device ws(locs.size() * 1024);
      const uint64_t ws_tensor = RegisterBf16(ws, 1, static_cast<uint32_t>(locs.size()), 1024, locs.size() * 1024);
      std::vector<BlockSlot> dest;
      for (size_t i = 0; i < locs.size(); ++i) dest.push_back({0, static_cast<uint32_t>(locs.size() - 1 - i)});
      auto loaded = session_->Load(ws_tensor, name, 0, to, dest);
      ASSERT_TRUE(loaded.ok()) << loaded.status();
      const auto got = ws.Download();
      const auto expected = testing::ReadBytes(g.file("dequant." + l + ".bf16"));
      for (size_t i = 0; i < locs.size(); ++i) {
        ASSERT_TRUE(std::equal(expected.begin() + i * 1024, expected.begin() + (i + 1) * 1024,
                               got.begin() + (locs.size() - 1 - i) * 1024))
            << "row " << i;
      }
    }
  }
}

TEST_F(IpcTest, PagesOfRecordsLoadAsStoredOrTranscodedAndSaveAsStored) {
  for (const testing::GoldenCase& g : testing::GoldenCases()) {
    const auto rows = testing::ReadArray<uint16_t>(g.file("input.bf16"));
    const auto locs = testing::ReadArray<int64_t>(g.file("locs.i64"));
    for (Layout layout : testing::AllLayouts()) {
      const std::string l = LayoutName(layout), name = g.name + ".r." + l;
      SCOPED_TRACE(name);
      // The golden pool, written over gRPC: its written slots are exactly the golden's.
      const auto pages = NewPool(name, layout, g.page_size, g.num_pages);
      std::vector<TokenLocation> where;
      for (int64_t loc : locs) where.push_back({pages[loc / g.page_size], static_cast<uint32_t>(loc % g.page_size)});
      ASSERT_TRUE(client_->WriteTokens(name, 0, where, rows).ok());
      const auto golden = testing::ReadBytes(g.file("pool." + l + ".bin"));
      // Out as V4 records (what FlashMLA's SM90 decode reads) into a poisoned tensor: the
      // golden transcode, or for a V4 pool its pages as stored.
      const int64_t v4 = PageBytes(Layout::kV4, g.page_size);
      Device out(g.num_pages * v4);
      cudaMemset(out.ptr, 0x5A, out.bytes);
      const uint64_t out_tensor = RegisterRecords(out, g.num_pages, g.page_size, Layout::kV4);
      std::vector<uint64_t> identity(g.num_pages);
      std::iota(identity.begin(), identity.end(), 0);
      auto loaded = session_->LoadBlocks(out_tensor, name, 0, pages, identity);
      ASSERT_TRUE(loaded.ok()) << loaded.status();
      EXPECT_EQ(out.Download(), layout == Layout::kV4
                                    ? golden
                                    : testing::ReadBytes(g.file("transcode." + l + "_to_v4.bin")));
      // As stored into a tensor of the pool's layout, blocks reversed.
      const int64_t pb = PageBytes(layout, g.page_size);
      Device records(g.num_pages * pb);
      const uint64_t tensor = RegisterRecords(records, g.num_pages, g.page_size, layout);
      std::vector<uint64_t> reversed(g.num_pages);
      for (int64_t p = 0; p < g.num_pages; ++p) reversed[p] = g.num_pages - 1 - p;
      ASSERT_TRUE(session_->LoadBlocks(tensor, name, 0, pages, reversed).ok());
      const auto back = records.Download();
      for (int64_t p = 0; p < g.num_pages; ++p) {
        EXPECT_TRUE(std::equal(golden.begin() + p * pb, golden.begin() + (p + 1) * pb,
                               back.begin() + (g.num_pages - 1 - p) * pb)) << "page " << p;
      }
      // And saved from those blocks into a second pool, page for page.
      const auto copy = NewPool(name + ".copy", layout, g.page_size, g.num_pages);
      auto saved = session_->SaveBlocks(tensor, name + ".copy", 0, reversed, copy);
      ASSERT_TRUE(saved.ok()) << saved.status();
      EXPECT_EQ(*client_->ReadPages(name + ".copy", copy), golden);
    }
  }
}

TEST_F(IpcTest, WholeBlocksOfBf16RowsSaveAndLoadPageForPage) {
  const int ps = 64, blocks = 4;
  const uint64_t stride = 1280, block_stride = ps * stride;
  const auto rows = testing::RandomRows(blocks * ps, 11);
  Device cache(blocks * block_stride);
  for (int i = 0; i < blocks * ps; ++i) cache.Upload(rows.data() + i * 512, 1024, (i / ps) * block_stride + (i % ps) * stride);
  const uint64_t tensor = RegisterBf16(cache, blocks, ps, stride, block_stride);
  for (Layout layout : testing::AllLayouts()) {
    const std::string name = std::string("blocks.") + LayoutName(layout);
    SCOPED_TRACE(name);
    const auto pages = NewPool(name, layout, ps, blocks);
    const std::vector<uint64_t> order = {3, 1, 0, 2};  // block order[i] → page i
    auto saved = session_->SaveBlocks(tensor, name, 0, order, pages);
    ASSERT_TRUE(saved.ok()) << saved.status();
    EXPECT_EQ(*saved, static_cast<uint64_t>(blocks * ps));
    // Reference: row (order[p], t) at location p * ps + t.
    const PoolGeometry g{layout, ps, blocks};
    std::vector<uint8_t> ref(g.pool_bytes(), 0);
    std::vector<uint16_t> placed(rows.size());
    std::vector<int64_t> locs(blocks * ps);
    for (int p = 0; p < blocks; ++p) {
      for (int t = 0; t < ps; ++t) {
        std::copy_n(rows.begin() + (order[p] * ps + t) * 512, 512, placed.begin() + (p * ps + t) * 512);
        locs[p * ps + t] = p * ps + t;
      }
    }
    ASSERT_TRUE(reference::QuantizeStore(g, placed, locs, ref).ok());
    EXPECT_EQ(*client_->ReadPages(name, pages), ref);
    // The client sends the pages packed; the same save with PageHandle messages stores the
    // same bytes.
    {
      const auto handles_pages = NewPool(name + ".handles", layout, ps, blocks);
      auto stub = v1::KvSession::NewStub(
          grpc::CreateChannel(options_.target, grpc::InsecureChannelCredentials()));
      v1::SaveRequest req;
      req.set_session_id(session_->id());
      req.set_tensor_id(tensor);
      req.set_pool(name + ".handles");
      for (int p = 0; p < blocks; ++p) {
        req.add_source_blocks(order[p]);
        v1::PageHandle* h = req.add_destination_pages();
        h->set_page_id(handles_pages[p].page_id);
        h->set_generation(handles_pages[p].generation);
      }
      grpc::ClientContext ctx;
      v1::TransferResponse resp;
      const grpc::Status st = stub->Save(&ctx, req, &resp);
      ASSERT_TRUE(st.ok()) << st.error_message();
      EXPECT_EQ(*client_->ReadPages(name + ".handles", handles_pages), ref);
    }
    // Back into a dense tensor, page i into block i: the reference's dequantized rows.
    Device out(blocks * ps * 1024);
    const uint64_t out_tensor = RegisterBf16(out, blocks, ps, 1024, ps * 1024);
    const std::vector<uint64_t> identity = {0, 1, 2, 3};
    ASSERT_TRUE(session_->LoadBlocks(out_tensor, name, 0, pages, identity).ok());
    std::vector<uint16_t> expected(rows.size());
    ASSERT_TRUE(reference::DequantizeGather(g, ref, locs, expected).ok());
    const auto got = out.Download();
    EXPECT_TRUE(std::equal(got.begin(), got.end(), reinterpret_cast<const uint8_t*>(expected.data())));
  }
}

TEST_F(IpcTest, AsynchronousSaveCompletesThroughItsWord) {
  const int ps = 64, n = 4096;
  const auto rows = testing::RandomRows(n, 7);
  Device cache(n * 1024);
  cache.Upload(rows.data(), n * 1024);
  const uint64_t tensor = RegisterBf16(cache, n / ps, ps, 1024, ps * 1024);
  const auto pages = NewPool("async", Layout::kV41Fp4, ps, n / ps);
  std::vector<BlockSlot> from;
  std::vector<TokenLocation> to;
  for (int i = 0; i < n; ++i) {
    from.push_back({static_cast<uint64_t>(i / ps), static_cast<uint32_t>(i % ps)});
    to.push_back({pages[i / ps], static_cast<uint32_t>(i % ps)});
  }
  auto pending = session_->SaveAsync(tensor, "async", 0, from, to);
  ASSERT_TRUE(pending.ok()) << pending.status();
  ASSERT_TRUE(pending->Wait(absl::Seconds(30)).ok());
  // Expected: the CPU reference of the same rows.
  const PoolGeometry g{Layout::kV41Fp4, ps, n / ps};
  std::vector<uint8_t> ref(g.pool_bytes(), 0);
  std::vector<int64_t> locs(n);
  std::iota(locs.begin(), locs.end(), 0);
  ASSERT_TRUE(reference::QuantizeStore(g, rows, locs, ref).ok());
  EXPECT_EQ(*client_->ReadPages("async", pages), ref);
  // Many in flight at once, each with its own word.
  std::vector<Session::Pending> all;
  for (int k = 0; k < 16; ++k) {
    auto p = session_->LoadAsync(tensor, "async", 0,
                                 std::span<const TokenLocation>(to).subspan(k * 256, 256),
                                 std::span<const BlockSlot>(from).subspan(k * 256, 256));
    ASSERT_TRUE(p.ok());
    all.push_back(*p);
  }
  for (auto& p : all) EXPECT_TRUE(p.Wait().ok());
}

// The engine's pattern: each layer's blocks saved asynchronously into the same pages as the
// forward pass reaches it, several still running when the next is issued, from several
// threads at once, half of them enqueued without waiting for the daemon; then loaded back
// the same way. Each layer holds the reference's records
// of its own rows, and each layer's tensor gets them back dequantized.
TEST_F(IpcTest, LayerAfterLayerAsynchronousSavesIntoTheSamePagesAllLand) {
  const int ps = 64, blocks = 8, layers = 6;
  const Layout layout = Layout::kV41;
  ASSERT_TRUE(client_->CreatePool({"layers", L(layout), ps, blocks, layers, "cuda:0"}).ok());
  const auto pages = *client_->AllocatePages("layers", blocks);
  std::vector<uint64_t> order(blocks);
  std::iota(order.rbegin(), order.rend(), 0);  // block blocks-1-i → page i
  std::vector<std::unique_ptr<Device>> caches;
  std::vector<uint64_t> tensors;
  std::vector<std::vector<uint16_t>> rows;
  for (int l = 0; l < layers; ++l) {
    rows.push_back(testing::RandomRows(blocks * ps, 100 + l));
    caches.push_back(std::make_unique<Device>(blocks * ps * 1024));
    caches.back()->Upload(rows.back().data(), blocks * ps * 1024);
    tensors.push_back(RegisterBf16(*caches.back(), blocks, ps, 1024, ps * 1024));
  }
  // Issues every layer's request from four threads; returns once each word says done.
  auto every_layer = [&](bool save) {
    std::vector<std::optional<Session::Pending>> pending(layers);
    std::vector<absl::Status> issued(layers);
    std::atomic<int> next{0};
    std::vector<std::thread> issuers;
    for (int k = 0; k < 4; ++k) {
      issuers.emplace_back([&] {
        for (int l; (l = next.fetch_add(1)) < layers;) {
          // Odd layers enqueued (the request goes out without waiting for the daemon).
          Session& s = *session_;
          auto p = l % 2 == 1 ? (save ? s.EnqueueSaveBlocks(tensors[l], "layers", l, order, pages)
                                      : s.EnqueueLoadBlocks(tensors[l], "layers", l, pages, order))
                              : (save ? s.SaveBlocksAsync(tensors[l], "layers", l, order, pages)
                                      : s.LoadBlocksAsync(tensors[l], "layers", l, pages, order));
          issued[l] = p.status();
          if (p.ok()) pending[l] = *p;
        }
      });
    }
    for (auto& t : issuers) t.join();
    for (int l = 0; l < layers; ++l) {
      ASSERT_TRUE(issued[l].ok()) << "layer " << l << ": " << issued[l];
      const absl::Status done = pending[l]->Wait(absl::Seconds(30));
      EXPECT_TRUE(done.ok()) << "layer " << l << ": " << done;
    }
  };
  every_layer(/*save=*/true);
  const PoolGeometry g{layout, ps, blocks};
  std::vector<int64_t> locs(blocks * ps);
  std::iota(locs.begin(), locs.end(), 0);
  std::vector<std::vector<uint8_t>> ref(layers);
  for (int l = 0; l < layers; ++l) {
    // Row (order[p], t) of layer l at location p * ps + t.
    std::vector<uint16_t> placed(rows[l].size());
    for (int p = 0; p < blocks; ++p) {
      std::copy_n(rows[l].begin() + order[p] * ps * 512, ps * 512, placed.begin() + p * ps * 512);
    }
    ref[l].assign(g.pool_bytes(), 0);
    ASSERT_TRUE(reference::QuantizeStore(g, placed, locs, ref[l]).ok());
    const uint32_t layer[] = {static_cast<uint32_t>(l)};
    EXPECT_EQ(*client_->ReadPages("layers", pages, layer), ref[l]) << "layer " << l;
  }
  // Back into each layer's tensor, cleared first: block order[p] gets page p.
  for (auto& c : caches) ASSERT_EQ(cudaMemset(c->ptr, 0, c->bytes), cudaSuccess);
  every_layer(/*save=*/false);
  for (int l = 0; l < layers; ++l) {
    std::vector<uint16_t> expected(blocks * ps * 512), placed(blocks * ps * 512);
    ASSERT_TRUE(reference::DequantizeGather(g, ref[l], locs, placed).ok());
    for (int p = 0; p < blocks; ++p) {
      std::copy_n(placed.begin() + p * ps * 512, ps * 512, expected.begin() + order[p] * ps * 512);
    }
    const auto got = caches[l]->Download();
    EXPECT_TRUE(std::equal(got.begin(), got.end(), reinterpret_cast<const uint8_t*>(expected.data())))
        << "layer " << l;
  }
}

// The driver's virtual memory calls, found at run time (the test links no driver library).
template <typename Fn>
Fn Driver(const char* name) {
  void* f = nullptr;
  cudaDriverEntryPointQueryResult found;
  if (cudaGetDriverEntryPointByVersion(name, &f, 12000, cudaEnableDefault, &found) != cudaSuccess ||
      found != cudaDriverEntryPointSuccess) {
    ADD_FAILURE() << "the CUDA driver lacks " << name;
    return nullptr;
  }
  return reinterpret_cast<Fn>(f);
}

// Worker memory from CUDA's virtual memory API, as PyTorch's expandable segments allocate
// it: `count` allocations of the minimum granularity with POSIX descriptor handles, mapped
// back to back into one reserved range. cudaIpcGetMemHandle cannot name it.
struct VmmRange {
  explicit VmmRange(int count) {
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = 0;
    prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    EXPECT_EQ(Driver<decltype(&cuMemGetAllocationGranularity)>("cuMemGetAllocationGranularity")(
                  &granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
              CUDA_SUCCESS);
    bytes = granularity * count;
    EXPECT_EQ(Driver<decltype(&cuMemAddressReserve)>("cuMemAddressReserve")(&base, bytes, 0, 0, 0),
              CUDA_SUCCESS);
    for (int i = 0; i < count; ++i) {
      CUmemGenericAllocationHandle h = 0;
      EXPECT_EQ(Driver<decltype(&cuMemCreate)>("cuMemCreate")(&h, granularity, &prop, 0), CUDA_SUCCESS);
      EXPECT_EQ(Driver<decltype(&cuMemMap)>("cuMemMap")(base + i * granularity, granularity, 0, h, 0),
                CUDA_SUCCESS);
      handles.push_back(h);
    }
    CUmemAccessDesc access = {};
    access.location = prop.location;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    EXPECT_EQ(Driver<decltype(&cuMemSetAccess)>("cuMemSetAccess")(base, bytes, &access, 1), CUDA_SUCCESS);
    cudaMemset(ptr(), 0, bytes);
  }
  ~VmmRange() {
    cudaDeviceSynchronize();
    Driver<decltype(&cuMemUnmap)>("cuMemUnmap")(base, bytes);
    for (CUmemGenericAllocationHandle h : handles) Driver<decltype(&cuMemRelease)>("cuMemRelease")(h);
    Driver<decltype(&cuMemAddressFree)>("cuMemAddressFree")(base, bytes);
  }
  uint8_t* ptr() const { return reinterpret_cast<uint8_t*>(base); }
  std::vector<uint64_t> sizes() const { return std::vector<uint64_t>(handles.size(), granularity); }

  CUmemAllocationProp prop = {};
  size_t granularity = 0, bytes = 0;
  CUdeviceptr base = 0;
  std::vector<CUmemGenericAllocationHandle> handles;
};

TEST_F(IpcTest, AVmmTensorAcrossTwoAllocationsSavesAndLoadsInPlace) {
  const testing::GoldenCase g = testing::LoadGoldenCase("latent_p64");
  const auto rows = testing::ReadArray<uint16_t>(g.file("input.bf16"));
  const auto locs = testing::ReadArray<int64_t>(g.file("locs.i64"));
  VmmRange range(2);
  ASSERT_GT(range.granularity, 0u);
  // Dense blocks of one page each, placed so that the tensor straddles the two allocations.
  const uint64_t block_stride = g.page_size * 1024;
  const uint64_t extent = g.num_pages * block_stride;
  ASSERT_LE(extent, range.bytes);
  const uint64_t start = (range.granularity - extent / 2) / 256 * 256;
  uint8_t* tensor_ptr = range.ptr() + start;
  for (size_t i = 0; i < locs.size(); ++i) {
    ASSERT_EQ(cudaMemcpy(tensor_ptr + locs[i] * 1024, rows.data() + i * 512, 1024, cudaMemcpyHostToDevice),
              cudaSuccess);
  }
  KvTensor t{.num_blocks = static_cast<uint64_t>(g.num_pages), .block_tokens = static_cast<uint32_t>(g.page_size),
             .block_stride = block_stride, .token_stride = 1024, .kind = KvTensor::Kind::kBf16, .name = "vmm"};
  KvTensor ipc = t;
  EXPECT_FALSE(client::DescribeDevicePointer(tensor_ptr, ipc).ok() &&
               session_->RegisterKv(ipc).ok()) << "legacy IPC cannot name VMM memory";
  ASSERT_TRUE(client::DescribeVmmTensor(range.ptr(), range.sizes(), tensor_ptr, t).ok());
  ASSERT_EQ(t.vmm_allocations.size(), 2u);
  EXPECT_EQ(t.offset, start);
  auto id = session_->RegisterKv(t);
  client::CloseVmmDescriptors(t);  // the daemon holds its own mapping now
  ASSERT_TRUE(id.ok()) << id.status();
  for (Layout layout : testing::AllLayouts()) {
    const std::string l = LayoutName(layout), name = "vmm." + l;
    SCOPED_TRACE(name);
    const auto pages = NewPool(name, layout, g.page_size, g.num_pages);
    std::vector<BlockSlot> from;
    std::vector<TokenLocation> to;
    PairUp(locs, g.page_size, pages, from, to);
    auto saved = session_->Save(*id, name, 0, from, to);
    ASSERT_TRUE(saved.ok()) << saved.status();
    EXPECT_EQ(*client_->ReadPages(name, pages), testing::ReadBytes(g.file("pool." + l + ".bin")));
    // Load back into the same VMM tensor, over rows cleared first: the dequantized rows.
    ASSERT_EQ(cudaMemset(tensor_ptr, 0, extent), cudaSuccess);
    auto loaded = session_->Load(*id, name, 0, to, from);
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    std::vector<uint8_t> got(extent);
    ASSERT_EQ(cudaMemcpy(got.data(), tensor_ptr, extent, cudaMemcpyDeviceToHost), cudaSuccess);
    const auto expected = testing::ReadBytes(g.file("dequant." + l + ".bf16"));
    for (size_t i = 0; i < locs.size(); ++i) {
      ASSERT_TRUE(std::equal(expected.begin() + i * 1024, expected.begin() + (i + 1) * 1024,
                             got.begin() + locs[i] * 1024)) << "row " << i;
    }
    // Leave the inputs for the next layout.
    for (size_t i = 0; i < locs.size(); ++i) {
      cudaMemcpy(tensor_ptr + locs[i] * 1024, rows.data() + i * 512, 1024, cudaMemcpyHostToDevice);
    }
  }
  // Refused: a size past the allocation, a descriptor that is no CUDA allocation, a process
  // the daemon cannot reach; nothing stays mapped (the daemon keeps serving).
  KvTensor bad = t;
  ASSERT_TRUE(client::DescribeVmmTensor(range.ptr(), range.sizes(), tensor_ptr, bad).ok());
  bad.vmm_allocations[1].size = 2 * range.granularity;
  EXPECT_EQ(client::ErrorReason(session_->RegisterKv(bad).status()), "INVALID_REQUEST");
  const int not_cuda = open("/dev/null", O_RDONLY);
  const int real = bad.vmm_allocations[1].fd;
  bad.vmm_allocations[1] = {not_cuda, range.granularity};
  EXPECT_EQ(client::ErrorReason(session_->RegisterKv(bad).status()), "INVALID_REQUEST");
  bad.vmm_allocations[1] = {real, range.granularity};
  bad.vmm_pid = 0x7FFFFFF0;  // no such process
  EXPECT_EQ(client::ErrorReason(session_->RegisterKv(bad).status()), "WORKER_NOT_ACCESSIBLE");
  bad.vmm_pid = static_cast<uint32_t>(getpid());
  bad.ipc_handle = ipc.ipc_handle.empty() ? std::string(64, 'x') : ipc.ipc_handle;
  EXPECT_EQ(client::ErrorReason(session_->RegisterKv(bad).status()), "INVALID_REQUEST");
  close(not_cuda);
  client::CloseVmmDescriptors(bad);
  EXPECT_TRUE(client_->DescribePool("vmm.v4").ok());
}

TEST_F(IpcTest, InvalidSavesAndLoadsChangeNothing) {
  const int ps = 16;
  auto rows = testing::RandomRows(64, 3);
  Device cache(64 * 1024);
  cache.Upload(rows.data(), rows.size() * 2);
  const uint64_t tensor = RegisterBf16(cache, 4, ps, 1024, ps * 1024);
  const auto pages = NewPool("bad", Layout::kV4, ps, 4);
  // Pages 0 and 1 hold known rows; 2 and 3 are fresh.
  std::vector<BlockSlot> from;
  std::vector<TokenLocation> to;
  for (int i = 0; i < 32; ++i) {
    from.push_back({static_cast<uint64_t>(i / ps), static_cast<uint32_t>(i % ps)});
    to.push_back({pages[i / ps], static_cast<uint32_t>(i % ps)});
  }
  ASSERT_TRUE(session_->Save(tensor, "bad", 0, from, to).ok());
  const auto before = *client_->ReadPages("bad", pages);
  auto expect = [&](absl::Status s, const char* reason) {
    EXPECT_FALSE(s.ok());
    EXPECT_EQ(client::ErrorReason(s), reason) << s;
    EXPECT_EQ(*client_->ReadPages("bad", pages), before) << reason;
  };
  // Block out of range.
  expect(session_->Save(tensor, "bad", 0, std::vector<BlockSlot>{{9, 0}},
                        std::vector<TokenLocation>{{pages[2], 0}}).status(), "BLOCK_OUT_OF_RANGE");
  // NaN rows: into fresh pages (re-zeroed) and over written ones (restored).
  const uint16_t nan = 0x7FC0;
  cudaMemcpy(static_cast<uint8_t*>(cache.ptr) + 40 * 1024 + 200, &nan, 2, cudaMemcpyHostToDevice);
  std::vector<BlockSlot> nan_from;
  std::vector<TokenLocation> nan_to;
  for (int i = 32; i < 48; ++i) {  // rows 32..47 (40 has the NaN) into pages 2 and 0
    nan_from.push_back({static_cast<uint64_t>(i / ps), static_cast<uint32_t>(i % ps)});
    nan_to.push_back({pages[i % 2 == 0 ? 2 : 0], static_cast<uint32_t>(i % ps)});
  }
  expect(session_->Save(tensor, "bad", 0, nan_from, nan_to).status(), "NON_FINITE_VALUE");
  auto pending = session_->SaveAsync(tensor, "bad", 0, nan_from, nan_to);
  ASSERT_TRUE(pending.ok());
  EXPECT_FALSE(pending->Wait().ok());
  EXPECT_EQ(*client_->ReadPages("bad", pages), before);
  // A stale handle.
  ASSERT_TRUE(client_->FreePages("bad", std::vector<PageHandle>{pages[3]}).ok());
  const auto kept = std::vector<PageHandle>(pages.begin(), pages.begin() + 3);
  const auto kept_before = *client_->ReadPages("bad", kept);
  absl::Status s = session_->Save(tensor, "bad", 0, std::vector<BlockSlot>{{0, 0}},
                                  std::vector<TokenLocation>{{pages[3], 0}}).status();
  EXPECT_EQ(client::ErrorReason(s), "STALE_PAGE_HANDLE");
  // Token form on a records tensor; records of another layout.
  Device rec(4 * PageBytes(Layout::kV41, ps));
  const uint64_t rec_tensor = RegisterRecords(rec, 4, ps, Layout::kV41);
  s = session_->Save(rec_tensor, "bad", 0, std::vector<BlockSlot>{{0, 0}},
                     std::vector<TokenLocation>{{pages[0], 0}}).status();
  EXPECT_EQ(client::ErrorReason(s), "KIND_MISMATCH");
  s = session_->SaveBlocks(rec_tensor, "bad", 0, std::vector<uint64_t>{0}, std::vector<PageHandle>{pages[0]}).status();
  EXPECT_EQ(client::ErrorReason(s), "LAYOUT_MISMATCH");
  // A tensor that would end past its allocation.
  KvTensor big{.num_blocks = 1000, .block_tokens = ps, .block_stride = ps * 1024, .token_stride = 1024};
  ASSERT_TRUE(client::DescribeDevicePointer(cache.ptr, big).ok());
  EXPECT_EQ(client::ErrorReason(session_->RegisterKv(big).status()), "TENSOR_OUT_OF_BOUNDS");
  // Geometries whose byte count wraps around 2^64 are refused too, not let through small.
  KvTensor wraps{.num_blocks = (uint64_t{1} << 32) + 1, .block_tokens = ps,
                 .block_stride = uint64_t{1} << 32, .token_stride = 1024};
  ASSERT_TRUE(client::DescribeDevicePointer(cache.ptr, wraps).ok());
  EXPECT_EQ(client::ErrorReason(session_->RegisterKv(wraps).status()), "TENSOR_OUT_OF_BOUNDS");
  KvTensor before_base{.num_blocks = 1, .block_tokens = ps, .block_stride = ps * 1024,
                       .token_stride = 1024};
  ASSERT_TRUE(client::DescribeDevicePointer(cache.ptr, before_base).ok());
  before_base.offset = ~uint64_t{0} - 4095;  // "- 4096 bytes" once the sum wraps
  EXPECT_EQ(client::ErrorReason(session_->RegisterKv(before_base).status()), "TENSOR_OUT_OF_BOUNDS");
  EXPECT_EQ(*client_->ReadPages("bad", kept), kept_before);
  EXPECT_TRUE(client_->Health().ok());
}

// Issue #11 through the session: blocks saved by key from the worker's per-layer tensors
// are the CPU reference's pages (read back through the cache's own LoadPages); a lease's
// hits load into worker blocks (synchronously and through a completion word) as the
// reference dequantizes them; a save with a NaN row in its last layer stores nothing; an
// ended lease, a wrong digest and a short list of layer tensors are refused.
TEST_F(IpcTest, CacheBlocksSaveByKeyAndLoadByLeaseInPlace) {
  const int ps = 64, blocks = 4, layers = 2;
  const Layout layout = Layout::kV41;
  const std::string pool = "cache.v41";
  ASSERT_TRUE(client_->CreatePool({pool, L(layout), ps, 8, layers, "cuda:0"}).ok());
  auto ns = client_->CreateNamespace({.name = "ns", .model_fingerprint = "m", .layer_group = "0-1",
                                      .block_tokens = ps, .pools = {pool}});
  ASSERT_TRUE(ns.ok()) << ns.status();
  // One dense bf16 tensor per layer, the same block ids in each.
  std::vector<std::vector<uint16_t>> rows;
  std::vector<std::unique_ptr<Device>> tensors;
  std::vector<uint64_t> ids;
  for (int l = 0; l < layers; ++l) {
    rows.push_back(testing::RandomRows(blocks * ps, 40 + l));
    tensors.push_back(std::make_unique<Device>(blocks * ps * 1024));
    tensors.back()->Upload(rows.back().data(), blocks * ps * 1024);
    ids.push_back(RegisterBf16(*tensors.back(), blocks, ps, 1024, ps * 1024));
  }
  // The reference page of source block b in layer l.
  auto page_of = [&](int l, int b) {
    const PoolGeometry g{layout, ps, 1};
    std::vector<uint8_t> page(g.pool_bytes(), 0);
    std::vector<uint16_t> block(rows[l].begin() + b * ps * 512, rows[l].begin() + (b + 1) * ps * 512);
    std::vector<int64_t> locs(ps);
    std::iota(locs.begin(), locs.end(), 0);
    EXPECT_TRUE(reference::QuantizeStore(g, block, locs, page).ok());
    return page;
  };
  const std::vector<std::string> keys = {"k0", "k1", "k2", "k3"};
  auto saved = session_->SaveToCache(ns->ref(), pool, ids, keys, std::vector<uint64_t>{0, 1, 2, 3});
  ASSERT_TRUE(saved.ok()) << saved.status();
  EXPECT_EQ(saved->blocks_stored, 4u);
  EXPECT_EQ(saved->blocks_already_held, 0u);
  EXPECT_EQ(saved->tokens, static_cast<uint64_t>(layers * blocks * ps));
  // Idempotent: k3 is held and skipped, k4 is new (source block 0).
  saved = session_->SaveToCache(ns->ref(), pool, ids, std::vector<std::string>{"k3", "k4"},
                                std::vector<uint64_t>{3, 0});
  ASSERT_TRUE(saved.ok()) << saved.status();
  EXPECT_EQ(saved->blocks_stored, 1u);
  EXPECT_EQ(saved->blocks_already_held, 1u);
  const std::vector<int> source = {0, 1, 2, 3, 0};  // of k0..k4

  const std::vector<std::string> all = {"k0", "k1", "k2", "k3", "k4", "k5"};
  auto hit = client_->Lookup(ns->ref(), all, {.lease_ttl = absl::Seconds(60)});
  ASSERT_TRUE(hit.ok()) << hit.status();
  ASSERT_EQ(hit->hit_blocks, 5u);
  // The stored pages, read through the cache's gRPC load: the reference, block by block.
  std::vector<uint8_t> expected_pages;
  for (int k = 0; k < 5; ++k) {
    for (int l = 0; l < layers; ++l) {
      const auto page = page_of(l, source[k]);
      expected_pages.insert(expected_pages.end(), page.begin(), page.end());
    }
  }
  EXPECT_EQ(*client_->LoadPages(ns->ref(), hit->lease_id, pool), expected_pages);

  // Lease blocks 1..4 (k1..k4) of layer 1 into blocks 3,2,1,0 of a fresh tensor.
  Device out(blocks * ps * 1024);
  const uint64_t out_id = RegisterBf16(out, blocks, ps, 1024, ps * 1024);
  const std::vector<uint64_t> into = {3, 2, 1, 0};
  auto loaded = session_->LoadFromCache(out_id, ns->ref(), hit->lease_id, pool, 1, 1, into);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(*loaded, static_cast<uint64_t>(blocks * ps));
  auto dequantized = [&](int l, int k) {
    const PoolGeometry g{layout, ps, 1};
    std::vector<uint16_t> r(ps * 512);
    std::vector<int64_t> locs(ps);
    std::iota(locs.begin(), locs.end(), 0);
    EXPECT_TRUE(reference::DequantizeGather(g, page_of(l, source[k]), locs, r).ok());
    return r;
  };
  auto expect_blocks = [&](int l, int first) {
    const auto got = out.Download();
    for (int i = 0; i < 4; ++i) {
      const auto want = dequantized(l, first + i);
      EXPECT_TRUE(std::equal(want.begin(), want.end(),
                             reinterpret_cast<const uint16_t*>(got.data()) + into[i] * ps * 512))
          << "layer " << l << " lease block " << first + i;
    }
  };
  expect_blocks(1, 1);
  // Asynchronously, layer 0 of lease blocks 0..3; the lease ends while it runs: the load
  // still completes (its blocks stay pinned until then).
  auto pending = session_->LoadFromCacheAsync(out_id, ns->ref(), hit->lease_id, pool, 0, 0, into);
  ASSERT_TRUE(pending.ok()) << pending.status();
  ASSERT_TRUE(client_->ReleaseLease(ns->ref(), hit->lease_id).ok());
  ASSERT_TRUE(pending->Wait(absl::Seconds(30)).ok());
  expect_blocks(0, 0);
  // An ended lease: refused before any byte, the tensor untouched.
  const auto before = out.Download();
  auto ended = session_->LoadFromCache(out_id, ns->ref(), hit->lease_id, pool, 0, 0, into);
  EXPECT_EQ(client::ErrorReason(ended.status()), "LEASE_EXPIRED") << ended.status();
  EXPECT_EQ(out.Download(), before);

  // A NaN in the last layer's block 2: nothing of the save is stored or visible, and its
  // pages are free again.
  const uint16_t nan = 0x7FC0;
  ASSERT_EQ(cudaMemcpy(static_cast<uint8_t*>(tensors[1]->ptr) + (2 * ps + 5) * 1024 + 64, &nan, 2,
                       cudaMemcpyHostToDevice), cudaSuccess);
  const auto used = client_->DescribePool(pool)->pages_used;
  auto bad = session_->SaveToCache(ns->ref(), pool, ids, std::vector<std::string>{"k5", "k6"},
                                   std::vector<uint64_t>{1, 2});
  EXPECT_EQ(client::ErrorReason(bad.status()), "NON_FINITE_VALUE") << bad.status();
  EXPECT_EQ(client_->Lookup(ns->ref(), std::vector<std::string>{"k5"})->hit_blocks, 0u);
  EXPECT_EQ(client_->DescribePool(pool)->pages_used, used);
  // A wrong digest, a layer missing, a key without a block.
  client::NamespaceRef wrong = ns->ref();
  wrong.digest ^= 1;
  EXPECT_EQ(client::ErrorReason(session_->SaveToCache(wrong, pool, ids, std::vector<std::string>{"k7"},
                                                      std::vector<uint64_t>{1}).status()),
            "NAMESPACE_MISMATCH");
  EXPECT_EQ(client::ErrorReason(session_->SaveToCache(ns->ref(), pool, std::vector<uint64_t>{ids[0]},
                                                      std::vector<std::string>{"k7"},
                                                      std::vector<uint64_t>{1}).status()),
            "INVALID_REQUEST");
  EXPECT_EQ(client::ErrorReason(session_->SaveToCache(ns->ref(), pool, ids,
                                                      std::vector<std::string>{"k7", "k8"},
                                                      std::vector<uint64_t>{1}).status()),
            "INVALID_REQUEST");
  EXPECT_EQ(client_->Lookup(ns->ref(), std::vector<std::string>{"k7"})->hit_blocks, 0u);
  EXPECT_EQ(client_->DescribePool(pool)->pages_used, used);
}

TEST_F(IpcTest, AnExportedPoolReadsInPlaceAndIsRevokedWhenDeleted) {
  const int ps = 64;
  const auto rows = testing::RandomRows(ps, 4);
  Device cache(ps * 1024);
  cache.Upload(rows.data(), ps * 1024);
  const uint64_t tensor = RegisterBf16(cache, 1, ps, 1024, ps * 1024);
  const auto pages = NewPool("exp", Layout::kV41, ps, 4);
  std::vector<BlockSlot> from;
  std::vector<TokenLocation> to;
  for (int i = 0; i < ps; ++i) {
    from.push_back({0, static_cast<uint32_t>(i)});
    to.push_back({pages[2], static_cast<uint32_t>(i)});
  }
  ASSERT_TRUE(session_->Save(tensor, "exp", 0, from, to).ok());
  auto mapping = session_->MapPool("exp");
  ASSERT_TRUE(mapping.ok()) << mapping.status();
  auto ptr = client::OpenPoolMapping(*mapping);
  ASSERT_TRUE(ptr.ok()) << ptr.status();
  std::vector<uint8_t> page(mapping->page_bytes);
  ASSERT_EQ(cudaMemcpy(page.data(), *ptr + pages[2].page_id * mapping->page_bytes, page.size(),
                       cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(page, *client_->ReadPages("exp", std::vector<PageHandle>{pages[2]}));
  ASSERT_TRUE(client_->DeletePool("exp").ok());
  for (int i = 0; i < 100 && session_->Revoked().empty(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_EQ(session_->Revoked(), std::vector<uint64_t>{mapping->export_id});
  EXPECT_TRUE(client::ClosePoolMapping(*mapping, *ptr).ok());
  EXPECT_TRUE(session_->UnmapPool(mapping->export_id).ok());
}

TEST_F(IpcTest, AWorkerKilledMidSessionReleasesEverything) {
  ASSERT_TRUE(client_->CreatePool({"kill", client::Layout::kV4, 64, 32, 1, "cuda:0"}).ok());
  const std::string command = testing::SessionWorkerPath() + " " + options_.target + " 8 kill gpu 64";
  FILE* worker = popen(("exec " + command).c_str(), "r");
  char line[64] = {};
  ASSERT_NE(fgets(line, sizeof(line), worker), nullptr);
  int pid = 0;  // the worker says its own pid
  ASSERT_EQ(std::sscanf(line, "ready %d", &pid), 1) << line;
  EXPECT_EQ(client_->DescribePool("kill")->pages_used, 8u);
  ASSERT_EQ(kill(pid, SIGKILL), 0);
  pclose(worker);
  uint64_t used = 8;
  for (int i = 0; i < 200 && used != 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    used = client_->DescribePool("kill")->pages_used;
  }
  EXPECT_EQ(used, 0u);
  httplib::Client http("127.0.0.1", daemon_->metrics_port());
  auto metrics = http.Get("/metrics");
  ASSERT_TRUE(metrics);
  EXPECT_NE(metrics->body.find("kvferry_sessions 1"), std::string::npos);  // this test's own
  EXPECT_NE(metrics->body.find("kvferry_session_pool_exports 0"), std::string::npos);
  // The daemon still serves, pool and session alike.
  const auto rows = testing::RandomRows(64, 9);
  Device cache(64 * 1024);
  cache.Upload(rows.data(), rows.size() * 2);
  const uint64_t tensor = RegisterBf16(cache, 1, 64, 1024, 64 * 1024);
  auto pages = session_->AllocatePages("kill", 1);
  ASSERT_TRUE(pages.ok());
  std::vector<BlockSlot> from;
  std::vector<TokenLocation> to;
  for (uint32_t i = 0; i < 64; ++i) {
    from.push_back({0, i});
    to.push_back({(*pages)[0], i});
  }
  EXPECT_TRUE(session_->Save(tensor, "kill", 0, from, to).ok());
}

}  // namespace
}  // namespace kvferry
