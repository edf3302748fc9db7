// libFuzzer: the pool service (kvferry.v1.KvFerry) in-process, driven by sequences of
// requests the fuzzer makes up — mostly well-formed, aimed at real pages, with bad fields,
// stale handles, NaN rows, changing targets and raw undecodable bytes among them.
//
// The oracle is a mirror of the pool kept here with the reference ops: every accepted write
// is applied to it with reference::QuantizeStore (rows) or a plain copy (pages), every
// accepted free zeroes it. After every request, reading every allocated page back through
// the service must equal the mirror byte for byte — so a rejected request that changed
// anything, a partial write, a page not zeroed on free, or a read that returns other bytes
// is caught. Accepted reads are checked against the mirror too (raw, transcoded with
// reference::Transcode, workspaces with reference::DequantizeGather).
#include <fuzzer/FuzzedDataProvider.h>
#include <grpcpp/grpcpp.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "backend/cpu_backend.h"
#include "common/error_reason.h"
#include "core/pool_manager.h"
#include "kvferry/kernels/format.h"
#include "kvferry/kernels/ops.h"
#include "kvferry/v1/kvferry.grpc.pb.h"
#include "fuzz/fuzz_data.h"
#include "service/pool_service.h"

namespace {

namespace v1 = kvferry::v1;
using kvferry::Layout;

[[noreturn]] void Fail(const std::string& what) {
  std::fprintf(stderr, "service_fuzz: %s\n", what.c_str());
  std::abort();
}

struct Service {
  Service() {
    kvferry::server::PoolManagerOptions options;
    options.default_device = "cpu";
    options.make_backend = [backend = kvferry::server::MakeCpuBackend(2)](const std::string&) {
      return absl::StatusOr<std::shared_ptr<kvferry::server::Backend>>(backend);
    };
    pools = std::make_unique<kvferry::server::PoolManager>(options);
    kvferry::server::ServiceOptions service_options;
    service_options.max_chunk_bytes = 8192;  // reads span several chunks
    service_options.write_limits.max_tokens = 4096;
    service = std::make_unique<kvferry::server::KvFerryService>(pools.get(), nullptr,
                                                                service_options);
    grpc::ServerBuilder builder;
    builder.RegisterService(service.get());
    server = builder.BuildAndStart();
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(64 << 20);
    stub = v1::KvFerry::NewStub(server->InProcessChannel(args));
  }
  std::unique_ptr<kvferry::server::PoolManager> pools;
  std::unique_ptr<kvferry::server::KvFerryService> service;
  std::unique_ptr<grpc::Server> server;
  std::unique_ptr<v1::KvFerry::Stub> stub;
};

Service& TheService() {
  static auto* s = new Service();
  return *s;
}

Layout ToLayout(v1::Layout l) { return static_cast<Layout>(static_cast<int>(l) - 1); }

// One pool as the fuzzer's requests should have left it.
class Mirror {
 public:
  Mirror(Layout layout, int page_size, int64_t num_pages, int num_layers)
      : geometry_{layout, page_size, num_pages},
        num_layers_(num_layers),
        bytes_(num_layers, std::vector<uint8_t>(geometry_.pool_bytes(), 0)),
        written_(num_layers, std::vector<bool>(geometry_.num_tokens(), false)) {}

  const kvferry::PoolGeometry& geometry() const { return geometry_; }
  int num_layers() const { return num_layers_; }
  int64_t page_bytes() const { return geometry_.page_bytes(); }
  std::map<uint64_t, uint64_t>& live() { return live_; }  // page id → generation

  uint8_t* Page(int layer, int64_t page) { return bytes_[layer].data() + page * page_bytes(); }
  std::vector<uint8_t>& Layer(int layer) { return bytes_[layer]; }
  void MarkWritten(int layer, int64_t loc) { written_[layer][loc] = true; }
  bool Written(int layer, int64_t loc) const { return written_[layer][loc]; }
  void Free(int64_t page) {
    for (int l = 0; l < num_layers_; ++l) {
      std::memset(Page(l, page), 0, page_bytes());
      for (int s = 0; s < geometry_.page_size; ++s) written_[l][page * geometry_.page_size + s] = false;
    }
    live_.erase(page);
  }

 private:
  kvferry::PoolGeometry geometry_;
  int num_layers_;
  std::vector<std::vector<uint8_t>> bytes_;  // [layer][pool bytes]
  std::vector<std::vector<bool>> written_;   // [layer][token]
  std::map<uint64_t, uint64_t> live_;
};

class Session {
 public:
  Session(FuzzedDataProvider& in, v1::KvFerry::Stub& stub) : in_(in), stub_(stub) {}

  void Create() {
    static constexpr v1::Layout kLayouts[] = {v1::LAYOUT_V4, v1::LAYOUT_V41, v1::LAYOUT_V41_FP4};
    static constexpr int kPageSizes[] = {1, 2, 16, 64};
    layout_ = kLayouts[in_.ConsumeIntegralInRange<int>(0, 2)];
    const int page_size = kPageSizes[in_.ConsumeIntegralInRange<int>(0, 3)];
    const int64_t num_pages = in_.ConsumeIntegralInRange<int64_t>(1, 6);
    const int num_layers = in_.ConsumeIntegralInRange<int>(1, 3);
    v1::CreatePoolRequest req;
    req.set_name(kPool);
    req.set_layout(layout_);
    req.set_page_size(page_size);
    req.set_num_pages(num_pages);
    req.set_num_layers(num_layers);
    req.set_device("cpu");
    grpc::ClientContext ctx;
    v1::Pool pool;
    const grpc::Status s = stub_.CreatePool(&ctx, req, &pool);
    if (!s.ok()) Fail("CreatePool of a valid pool failed: " + s.error_message());
    mirror_ = std::make_unique<Mirror>(ToLayout(layout_), page_size, num_pages, num_layers);
    if (static_cast<int64_t>(pool.page_bytes()) != mirror_->page_bytes()) Fail("page_bytes");
  }

  void Delete() {
    grpc::ClientContext ctx;
    v1::DeletePoolRequest req;
    req.set_name(kPool);
    v1::DeletePoolResponse resp;
    const grpc::Status s = stub_.DeletePool(&ctx, req, &resp);
    if (!s.ok()) Fail("DeletePool failed: " + s.error_message());
  }

  void Step() {
    static constexpr const char* kSteps[] = {"AllocatePages", "FreePages", "WriteTokens",
                                             "WriteTokens", "WritePages", "ReadPages",
                                             "ReadWorkspace", "a raw request"};
    const int step = in_.ConsumeIntegralInRange<int>(0, 7);
    switch (step) {
      case 0: Allocate(); break;
      case 1: FreeSome(); break;
      case 2: case 3: WriteTokens(); break;
      case 4: WritePages(); break;
      case 5: ReadPages(); break;
      case 6: ReadWorkspace(); break;
      default: Raw(); break;
    }
    CheckAll(kSteps[step]);
  }

 private:
  static constexpr const char* kPool = "f";

  std::string PoolName() {
    return in_.ConsumeIntegralInRange<int>(0, 15) == 0 ? in_.ConsumeRandomLengthString(8) : kPool;
  }

  // Usually a live handle; sometimes stale, freed, out of range or made up.
  v1::PageHandle Handle() {
    v1::PageHandle h;
    auto& live = mirror_->live();
    const int kind = in_.ConsumeIntegralInRange<int>(0, 9);
    if (!live.empty() && kind < 8) {
      auto it = live.begin();
      std::advance(it, in_.ConsumeIntegralInRange<size_t>(0, live.size() - 1));
      h.set_page_id(it->first);
      h.set_generation(it->second - (kind == 7 ? 1 : 0));
    } else {
      h.set_page_id(in_.ConsumeIntegralInRange<uint64_t>(0, mirror_->geometry().num_pages));
      h.set_generation(in_.ConsumeIntegral<uint64_t>());
    }
    return h;
  }

  uint32_t Slot() {
    const int page_size = mirror_->geometry().page_size;
    return in_.ConsumeIntegralInRange<int>(0, 30) == 0 ? in_.ConsumeIntegral<uint32_t>()
                                                        : in_.ConsumeIntegralInRange<uint32_t>(0, page_size - 1);
  }

  bool IsLive(const v1::PageHandle& h) {
    auto it = mirror_->live().find(h.page_id());
    return it != mirror_->live().end() && it->second == h.generation();
  }

  void Allocate() {
    v1::AllocatePagesRequest req;
    req.set_pool(PoolName());
    req.set_count(in_.ConsumeIntegralInRange<int>(0, 30) == 0 ? in_.ConsumeIntegral<uint32_t>()
                                                               : in_.ConsumeIntegralInRange<uint32_t>(0, 3));
    grpc::ClientContext ctx;
    v1::AllocatePagesResponse resp;
    if (!stub_.AllocatePages(&ctx, req, &resp).ok()) return;
    if (req.pool() != kPool) Fail("AllocatePages accepted an unknown pool");
    if (static_cast<uint32_t>(resp.pages_size()) != req.count()) Fail("AllocatePages count");
    for (const auto& h : resp.pages()) {
      if (h.page_id() >= static_cast<uint64_t>(mirror_->geometry().num_pages)) Fail("page id range");
      if (mirror_->live().count(h.page_id())) Fail("a live page was handed out twice");
      mirror_->live()[h.page_id()] = h.generation();
    }
  }

  void FreeSome() {
    v1::FreePagesRequest req;
    req.set_pool(PoolName());
    const int n = in_.ConsumeIntegralInRange<int>(0, 3);
    for (int i = 0; i < n; ++i) *req.add_pages() = Handle();
    grpc::ClientContext ctx;
    v1::FreePagesResponse resp;
    if (!stub_.FreePages(&ctx, req, &resp).ok()) return;
    for (const auto& h : req.pages()) {
      if (!IsLive(h)) Fail("FreePages accepted a handle that is not live");
    }
    for (const auto& h : req.pages()) mirror_->Free(h.page_id());
  }

  std::string Rows(int n) {
    const std::vector<uint16_t> rows =
        kvferry::fuzz::Bf16(in_, static_cast<size_t>(n) * kvferry::kHeadDim, 8);
    std::string out(reinterpret_cast<const char*>(rows.data()), rows.size() * 2);
    if (in_.ConsumeIntegralInRange<int>(0, 15) == 0) out.resize(in_.ConsumeIntegralInRange<size_t>(0, out.size() + 3));
    return out;
  }

  void WriteTokens() {
    const int messages = in_.ConsumeIntegralInRange<int>(1, 3);
    const uint32_t layer = in_.ConsumeIntegralInRange<uint32_t>(0, mirror_->num_layers());
    std::vector<v1::WriteTokensRequest> sent;
    // finish_write on the last message, now and then on another or on none.
    const int finish_at = in_.ConsumeIntegralInRange<int>(0, 15) == 0
                              ? in_.ConsumeIntegralInRange<int>(0, messages)
                              : messages - 1;
    grpc::ClientContext ctx;
    v1::WriteResponse resp;
    auto writer = stub_.WriteTokens(&ctx, &resp);
    for (int m = 0; m < messages; ++m) {
      v1::WriteTokensRequest msg;
      if (m == 0 || in_.ConsumeIntegralInRange<int>(0, 7) == 0) msg.set_pool(PoolName());
      // The first message names the stream's layer (out of range now and then: `layer` may be
      // num_layers); a later one may repeat it or, now and then, name another.
      if (m == 0) {
        if (in_.ConsumeBool() || layer != 0) msg.set_layer(layer);
      } else if (in_.ConsumeIntegralInRange<int>(0, 7) == 0) {
        msg.set_layer(in_.ConsumeIntegralInRange<int>(0, 7) == 0 ? layer + 1 : layer);
      }
      const int n = in_.ConsumeIntegralInRange<int>(0, 4);
      for (int i = 0; i < n; ++i) {
        auto* loc = msg.add_locations();
        *loc->mutable_page() = Handle();
        loc->set_slot(Slot());
      }
      *msg.mutable_rows() = Rows(n);
      msg.set_finish_write(m == finish_at);
      sent.push_back(msg);
      if (!writer->Write(msg)) break;
    }
    writer->WritesDone();
    if (!writer->Finish().ok()) return;
    if (finish_at + 1 != static_cast<int>(sent.size())) {
      Fail("WriteTokens accepted a stream whose last message did not finish it");
    }
    // Accepted: every message's rows, in order, must be what the reference stores.
    const auto& g = mirror_->geometry();
    int64_t stored = 0;
    std::vector<uint8_t> next = mirror_->Layer(layer);
    std::vector<int64_t> all_locs;
    for (const auto& msg : sent) {
      if (!msg.pool().empty() && msg.pool() != kPool) Fail("WriteTokens accepted another pool");
      if (msg.has_layer() && msg.layer() != layer) Fail("WriteTokens accepted a changed layer");
      std::vector<int64_t> locs;
      for (const auto& l : msg.locations()) {
        if (!IsLive(l.page())) Fail("WriteTokens accepted a handle that is not live");
        locs.push_back(static_cast<int64_t>(l.page().page_id()) * g.page_size + l.slot());
      }
      std::vector<uint16_t> rows(msg.rows().size() / 2);
      if (!rows.empty()) std::memcpy(rows.data(), msg.rows().data(), rows.size() * 2);
      if (msg.rows().size() % 2 != 0) Fail("WriteTokens accepted an odd byte count");
      const absl::Status s = kvferry::reference::QuantizeStore(g, rows, locs, next);
      if (!s.ok()) Fail("WriteTokens accepted what the reference refuses: " + s.ToString());
      all_locs.insert(all_locs.end(), locs.begin(), locs.end());
      stored += static_cast<int64_t>(locs.size());
    }
    std::sort(all_locs.begin(), all_locs.end());
    if (std::adjacent_find(all_locs.begin(), all_locs.end()) != all_locs.end()) {
      Fail("WriteTokens accepted one location twice in a stream");
    }
    if (layer >= static_cast<uint32_t>(mirror_->num_layers())) Fail("WriteTokens accepted a bad layer");
    if (static_cast<int64_t>(resp.tokens_written()) != stored) Fail("tokens_written");
    mirror_->Layer(layer) = std::move(next);
    for (int64_t loc : all_locs) mirror_->MarkWritten(layer, loc);
  }

  void WritePages() {
    const int pages = in_.ConsumeIntegralInRange<int>(1, 2);
    const int64_t page_bytes = mirror_->page_bytes();
    struct Piece { v1::PageHandle page; uint32_t layer; std::string data; };
    std::vector<Piece> pieces;
    // finish_write on the last message, now and then on the first or on none.
    const int finish_mode = in_.ConsumeIntegralInRange<int>(0, 15) == 0 ? in_.ConsumeIntegralInRange<int>(1, 2) : 0;
    int finishing = 0, sent = 0;  // messages that set finish_write; messages written
    bool last_finished = false;
    grpc::ClientContext ctx;
    v1::WriteResponse resp;
    auto writer = stub_.WritePages(&ctx, &resp);
    for (int p = 0; p < pages; ++p) {
      Piece piece{Handle(), in_.ConsumeIntegralInRange<uint32_t>(0, mirror_->num_layers()), {}};
      const int parts = in_.ConsumeIntegralInRange<int>(1, 2);
      int64_t offset = 0;
      for (int k = 0; k < parts; ++k) {
        v1::WritePagesRequest msg;
        if (p == 0 && k == 0) {
          msg.set_pool(PoolName());
          msg.set_layout(in_.ConsumeIntegralInRange<int>(0, 15) == 0
                             ? static_cast<v1::Layout>(in_.ConsumeIntegralInRange<int>(0, 5))
                             : layout_);
        }
        *msg.mutable_page() = piece.page;
        msg.set_layer(piece.layer);
        const int64_t want = k + 1 == parts ? page_bytes - offset : page_bytes / 2;
        int64_t len = in_.ConsumeIntegralInRange<int>(0, 15) == 0
                          ? in_.ConsumeIntegralInRange<int64_t>(0, page_bytes)
                          : want;
        msg.set_offset(in_.ConsumeIntegralInRange<int>(0, 15) == 0 ? offset + 1 : offset);
        const std::vector<char> bytes = kvferry::fuzz::Fill<char>(in_, len);
        const std::string data(bytes.begin(), bytes.end());
        msg.set_data(data);
        piece.data += data;
        offset += len;
        const bool last = p + 1 == pages && k + 1 == parts;
        msg.set_finish_write(finish_mode == 0 ? last : finish_mode == 2 && sent == 0);
        finishing += msg.finish_write() ? 1 : 0;
        last_finished = msg.finish_write();
        ++sent;
        if (!writer->Write(msg)) break;
      }
      pieces.push_back(std::move(piece));
    }
    writer->WritesDone();
    if (!writer->Finish().ok()) return;
    if (finishing != 1 || !last_finished) {
      Fail("WritePages accepted a stream whose last message alone did not finish it");
    }
    for (const auto& piece : pieces) {
      if (!IsLive(piece.page)) Fail("WritePages accepted a handle that is not live");
      if (static_cast<int64_t>(piece.data.size()) != page_bytes) Fail("WritePages accepted a partial page");
      if (piece.layer >= static_cast<uint32_t>(mirror_->num_layers())) Fail("WritePages: bad layer");
    }
    if (static_cast<int>(resp.pages_written()) != pages) Fail("pages_written");
    for (const auto& piece : pieces) {
      std::memcpy(mirror_->Page(piece.layer, piece.page.page_id()), piece.data.data(), page_bytes);
      const int ps = mirror_->geometry().page_size;
      for (int s = 0; s < ps; ++s) mirror_->MarkWritten(piece.layer, piece.page.page_id() * ps + s);
    }
  }

  // Reads through the service; returns its status (with the reason in the message).
  grpc::Status Read(const v1::ReadPagesRequest& req, std::string* out) {
    grpc::ClientContext ctx;
    auto reader = stub_.ReadPages(&ctx, req);
    v1::PageChunk chunk;
    out->clear();
    while (reader->Read(&chunk)) {
      if (chunk.offset() != out->size()) Fail("ReadPages chunk offset");
      *out += chunk.data();
    }
    const grpc::Status s = reader->Finish();
    if (s.ok()) return s;
    return grpc::Status(s.error_code(),
                        s.error_message() + " (" + kvferry::testing::ReasonOf(ctx) + ")");
  }

  void ReadPages() {
    v1::ReadPagesRequest req;
    req.set_pool(PoolName());
    const int n = in_.ConsumeIntegralInRange<int>(0, 3);
    for (int i = 0; i < n; ++i) *req.add_pages() = Handle();
    const int layers = in_.ConsumeIntegralInRange<int>(0, 2);
    for (int i = 0; i < layers; ++i) req.add_layers(in_.ConsumeIntegralInRange<uint32_t>(0, mirror_->num_layers()));
    req.set_transcode_to(static_cast<v1::Layout>(in_.ConsumeIntegralInRange<int>(0, in_.ConsumeBool() ? 3 : 5)));
    req.set_chunk_bytes(in_.ConsumeIntegralInRange<uint32_t>(0, 9000));
    std::string got;
    if (!Read(req, &got).ok()) return;
    std::vector<uint32_t> layer_list(req.layers().begin(), req.layers().end());
    if (layer_list.empty()) {
      for (int l = 0; l < mirror_->num_layers(); ++l) layer_list.push_back(l);
    }
    const auto& g = mirror_->geometry();
    const bool transcode = req.transcode_to() != v1::LAYOUT_UNSPECIFIED;
    if (transcode && (req.transcode_to() < 1 || req.transcode_to() > 3)) Fail("ReadPages accepted a bad layout");
    const kvferry::PoolGeometry out_g{transcode ? ToLayout(req.transcode_to()) : g.layout, g.page_size, 1};
    std::string want;
    for (const auto& h : req.pages()) {
      if (!IsLive(h)) Fail("ReadPages accepted a handle that is not live");
      for (uint32_t l : layer_list) {
        if (l >= static_cast<uint32_t>(mirror_->num_layers())) Fail("ReadPages accepted a bad layer");
        const uint8_t* page = mirror_->Page(l, h.page_id());
        std::vector<uint8_t> out(out_g.page_bytes(), 0);
        if (!transcode) {
          std::memcpy(out.data(), page, out.size());
        } else {
          std::vector<int64_t> locs;
          for (int s = 0; s < g.page_size; ++s) {
            if (mirror_->Written(l, h.page_id() * g.page_size + s)) locs.push_back(s);
          }
          const kvferry::PoolGeometry one{g.layout, g.page_size, 1};
          const absl::Status s = kvferry::reference::Transcode(
              one, std::span<const uint8_t>(page, one.page_bytes()), out_g, out, locs);
          if (!s.ok()) Fail("the reference refused a transcode the service did: " + s.ToString());
        }
        want.append(reinterpret_cast<const char*>(out.data()), out.size());
      }
    }
    if (got != want) Fail("ReadPages bytes differ from the mirror");
  }

  void ReadWorkspace() {
    v1::ReadWorkspaceRequest req;
    req.set_pool(PoolName());
    req.set_layer(in_.ConsumeIntegralInRange<uint32_t>(0, mirror_->num_layers()));
    const int n = in_.ConsumeIntegralInRange<int>(0, 5);
    for (int i = 0; i < n; ++i) {
      auto* loc = req.add_locations();
      *loc->mutable_page() = Handle();
      loc->set_slot(Slot());
    }
    req.set_chunk_bytes(in_.ConsumeIntegralInRange<uint32_t>(0, 9000));
    grpc::ClientContext ctx;
    auto reader = stub_.ReadWorkspace(&ctx, req);
    v1::WorkspaceChunk chunk;
    std::string got;
    while (reader->Read(&chunk)) {
      if (chunk.first_row() * 1024 != got.size()) Fail("ReadWorkspace first_row");
      got += chunk.rows();
    }
    if (!reader->Finish().ok()) return;
    const auto& g = mirror_->geometry();
    std::vector<int64_t> locs;
    for (const auto& l : req.locations()) {
      if (!IsLive(l.page())) Fail("ReadWorkspace accepted a handle that is not live");
      locs.push_back(static_cast<int64_t>(l.page().page_id()) * g.page_size + l.slot());
    }
    if (req.layer() >= static_cast<uint32_t>(mirror_->num_layers())) Fail("ReadWorkspace: bad layer");
    std::vector<uint16_t> want(locs.size() * kvferry::kHeadDim);
    const absl::Status s = kvferry::reference::DequantizeGather(g, mirror_->Layer(req.layer()), locs, want);
    if (!s.ok()) Fail("ReadWorkspace accepted what the reference refuses: " + s.ToString());
    if (got.size() != want.size() * 2 ||
        (!want.empty() && std::memcmp(got.data(), want.data(), got.size()) != 0)) {
      Fail("ReadWorkspace rows differ from the reference's");
    }
  }

  // Bytes that may not even decode, sent as a request of some method.
  void Raw() {
    const std::string bytes = in_.ConsumeRandomLengthString(256);
    grpc::ClientContext ctx;
    switch (in_.ConsumeIntegralInRange<int>(0, 3)) {
      case 0: {
        v1::WriteTokensRequest msg;
        if (!msg.ParseFromString(bytes)) return;
        msg.set_pool(kPool);
        msg.clear_locations();  // a write must not land on live pages unseen by the mirror
        v1::WriteResponse resp;
        auto w = stub_.WriteTokens(&ctx, &resp);
        w->Write(msg);
        w->WritesDone();
        w->Finish();
        return;
      }
      case 1: {
        v1::ReadPagesRequest req;
        if (!req.ParseFromString(bytes)) return;
        auto r = stub_.ReadPages(&ctx, req);
        v1::PageChunk c;
        while (r->Read(&c)) {
        }
        r->Finish();
        return;
      }
      case 2: {
        v1::CreatePoolRequest req;
        if (!req.ParseFromString(bytes)) return;
        if (req.num_pages() > 64 || req.page_size() > 64 || req.num_layers() > 4) return;
        req.set_device("cpu");
        v1::Pool pool;
        if (stub_.CreatePool(&ctx, req, &pool).ok()) {
          grpc::ClientContext dctx;
          v1::DeletePoolRequest d;
          d.set_name(req.name());
          v1::DeletePoolResponse dr;
          if (req.name() == kPool) Fail("a second pool of the same name was created");
          if (!stub_.DeletePool(&dctx, d, &dr).ok()) Fail("could not delete a pool just created");
        }
        return;
      }
      default: {
        v1::AllocatePagesRequest req;
        if (!req.ParseFromString(bytes)) return;
        req.set_pool("no-such-pool");
        v1::AllocatePagesResponse resp;
        if (stub_.AllocatePages(&ctx, req, &resp).ok()) Fail("allocated from a pool that does not exist");
        return;
      }
    }
  }

  // Every live page, every layer, as stored, equals the mirror.
  // `after`: the request just made, for the message.
  void CheckAll(const char* after) {
    auto& live = mirror_->live();
    if (live.empty()) return;
    v1::ReadPagesRequest req;
    req.set_pool(kPool);
    std::string want;
    for (const auto& [page, generation] : live) {
      auto* h = req.add_pages();
      h->set_page_id(page);
      h->set_generation(generation);
      for (int l = 0; l < mirror_->num_layers(); ++l) {
        want.append(reinterpret_cast<const char*>(mirror_->Page(l, page)), mirror_->page_bytes());
      }
    }
    std::string got;
    if (const grpc::Status s = Read(req, &got); !s.ok()) {
      Fail(std::string("reading every live page was refused after ") + after + ": " +
           s.error_message());
    }
    if (got != want) Fail(std::string("the pool differs from the mirror after ") + after);
  }

  FuzzedDataProvider& in_;
  v1::KvFerry::Stub& stub_;
  v1::Layout layout_ = v1::LAYOUT_V4;
  std::unique_ptr<Mirror> mirror_;
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  Session session(in, *TheService().stub);
  session.Create();
  const int steps = in.ConsumeIntegralInRange<int>(1, 12);
  for (int i = 0; i < steps && in.remaining_bytes() > 0; ++i) session.Step();
  session.Delete();
  return 0;
}
