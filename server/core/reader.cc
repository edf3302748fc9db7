// Readers: batches of pages or workspace rows, one in flight while the previous is consumed.
#include "core/reader.h"

#include <algorithm>
#include <chrono>
#include <cstring>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "common/errors.h"
#include "kvferry/kernels/status_macros.h"

namespace kvferry::server {
namespace {

int64_t AlignUp(int64_t x, int64_t a) { return (x + a - 1) / a * a; }

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace

int64_t OutputPageBytes(const Pool& pool, std::optional<Layout> layout) {
  return PageBytes(layout.value_or(pool.config().layout), pool.config().page_size);
}

// ---- the batch pipeline ----------------------------------------------------------------------

Reader::~Reader() { Stop(); }

void Reader::Stop() {
  for (Slot& slot : slots_) {
    if (slot.busy) Finish(slot).IgnoreError();
  }
  failed_ = true;
}

std::shared_ptr<void> Reader::TakeMemory() {
  Stop();
  auto memory = std::make_shared<std::vector<Buffer>>();
  for (Slot& slot : slots_) {
    if (slot.host.get() != nullptr) memory->push_back(std::move(slot.host));
    if (slot.device.get() != nullptr) memory->push_back(std::move(slot.device));
    slot.out = nullptr;
  }
  return memory;
}

absl::Status Reader::Start(int64_t index) {
  Slot& slot = slots_[index % depth()];
  slot.started = Now();
  slot.op = op_name();
  KVF_RETURN_IF_ERROR(Launch(index, slot));
  slot.busy = true;
  return absl::OkStatus();
}

absl::Status Reader::Submit(Slot& slot, std::span<const Op> ops, PageTable::Pin pin,
                            int64_t bytes) {
  absl::StatusOr<Completion> done = pool_->backend().Submit(ops);
  if (!done.ok()) {
    pool_->Unpin(pin);
    return done.status();
  }
  slot.done = std::move(*done);
  slot.pin = std::move(pin);
  slot.bytes = bytes;
  return absl::OkStatus();
}

absl::Status Reader::Finish(Slot& slot) {
  const absl::Status s = slot.done.Wait();
  pool_->ObserveOp(slot.op, Now() - slot.started);
  if (slot.pin.has_value()) pool_->Unpin(*slot.pin);
  slot.pin.reset();
  slot.busy = false;
  return s;
}

void Reader::DropPrefetched() {
  if (next_ == 0 && slots_[0].busy) Finish(slots_[0]).IgnoreError();
}

void Reader::set_device_output(bool on) {
  const bool device = on && can_output_on_device_;
  if (next_ != 0 || device == device_output_) return;
  DropPrefetched();
  device_output_ = device;
}

MemoryBlock Reader::last_block() const {
  if (next_ == 0) return {};
  // Batch next_ - 1 stays in its slot until batch next_ - 1 + depth() is launched there.
  const Slot& slot = slots_[(next_ - 1) % depth()];
  return slot.out != nullptr ? slot.device.block() : slot.host.block();
}

void Reader::set_depth(int depth) {
  if (next_ != 0 || depth < 2 || depth == this->depth()) return;
  DropPrefetched();
  slots_.resize(static_cast<size_t>(depth));
}

absl::Status Reader::Prefetch() {
  if (failed_ || next_ > 0 || slots_[0].busy || num_batches_ == 0) return absl::OkStatus();
  absl::Status s = Start(0);
  if (!s.ok()) failed_ = true;
  return s;
}

absl::StatusOr<std::span<const uint8_t>> Reader::Next() {
  if (failed_) {
    return Error(absl::StatusCode::kFailedPrecondition, ErrorReason::kInternalError,
                 "the read already failed");
  }
  if (next_ >= num_batches_) return std::span<const uint8_t>();
  auto fail = [this](absl::Status s) {
    failed_ = true;
    return s;
  };
  if (next_ == 0 && !slots_[0].busy) {
    if (absl::Status s = Start(0); !s.ok()) return fail(s);
  }
  Slot& slot = slots_[next_ % depth()];
  if (absl::Status s = Finish(slot); !s.ok()) return fail(s);
  if (next_ + 1 < num_batches_) {
    if (absl::Status s = Start(next_ + 1); !s.ok()) return fail(s);
  }
  ++next_;
  return std::span<const uint8_t>(slot.out != nullptr ? slot.out : slot.host.get(),
                                  static_cast<size_t>(slot.bytes));
}

// ---- pages -----------------------------------------------------------------------------------

namespace {

class PageReader final : public Reader {
 public:
  PageReader(std::shared_ptr<Pool> pool, std::vector<PageHandle> pages, std::vector<int> layers,
             std::optional<Layout> transcode_to, int64_t units_per_batch)
      : Reader(pool, Batches(pages.size() * layers.size(), units_per_batch),
               static_cast<int64_t>(pages.size() * layers.size()) * OutputPageBytes(*pool, transcode_to)),
        pages_(std::move(pages)),
        layers_(std::move(layers)),
        transcode_to_(transcode_to),
        per_batch_(units_per_batch),
        in_page_(pool->geometry().page_bytes()),
        out_page_(OutputPageBytes(*pool, transcode_to)) {
    can_output_on_device_ = !pool_->backend().host_memory();
  }

 protected:
  const char* op_name() const override { return transcode_to_ ? "transcode" : "gather_pages"; }

  absl::Status Launch(int64_t index, Slot& slot) override {
    Pool& pool = *pool_;
    Backend& backend = pool.backend();
    const int page_size = pool.config().page_size;
    const int64_t k = per_batch_;
    // Host slot: [out k*out_page | ids k | slots k*page_size]; device: [gathered | converted
    // | ids | slots].
    const int64_t host_ids = AlignUp(k * out_page_, 64);
    const int64_t host_slots = host_ids + k * 8;
    const int64_t dev_converted = AlignUp(k * in_page_, 256);
    const int64_t dev_ids = AlignUp(dev_converted + (transcode_to_ ? k * out_page_ : 0), 256);
    const int64_t dev_slots = dev_ids + k * 8;
    // Host memory pools (cpu) are gathered straight into the output slot: no scratch, no
    // copy back.
    const bool direct = backend.host_memory() && !transcode_to_;
    if (slot.host.get() == nullptr && direct) {
      KVF_ASSIGN_OR_RETURN(slot.host, backend.Allocate(host_slots, MemoryKind::kHostStaging, false));
    } else if (slot.host.get() == nullptr) {
      KVF_ASSIGN_OR_RETURN(slot.host, backend.Allocate(host_slots + k * page_size * 8,
                                                       MemoryKind::kHostStaging, false));
      KVF_ASSIGN_OR_RETURN(slot.device, backend.Allocate(dev_slots + k * page_size * 8,
                                                         MemoryKind::kDevice, false));
    }
    const int64_t units = static_cast<int64_t>(pages_.size() * layers_.size());
    const int64_t first = index * k;
    const int64_t n = std::min(k, units - first);
    const int64_t num_layers = static_cast<int64_t>(layers_.size());
    std::vector<PageHandle> handles;
    int64_t* ids = reinterpret_cast<int64_t*>(slot.host.get() + host_ids);
    for (int64_t u = first; u < first + n; ++u) {
      const PageHandle& h = pages_[u / num_layers];
      handles.push_back(h);
      ids[u - first] = layers_[u % num_layers] * pool.config().num_pages +
                       static_cast<int64_t>(h.page_id);
    }
    KVF_ASSIGN_OR_RETURN(PageTable::Pin pin, pool.table().PinPages(handles, false));
    if (direct) {
      PageCopyParams gather;
      gather.geometry = pool.flat_pages();
      gather.pool = pool.base();
      gather.pages = ids;
      gather.num_listed = n;
      gather.buffer = slot.host.get();
      const Op op = GatherPagesOp{gather};
      return Submit(slot, std::span<const Op>(&op, 1), std::move(pin), n * out_page_);
    }
    uint8_t* dev = slot.device.get();
    PageCopyParams gather;
    gather.geometry = pool.flat_pages();
    gather.pool = pool.base();
    gather.pages = reinterpret_cast<const int64_t*>(dev + dev_ids);
    gather.num_listed = n;
    gather.buffer = dev;
    std::vector<Op> ops = {CopyOp{dev + dev_ids, ids, static_cast<size_t>(n * 8)},
                           GatherPagesOp{gather}};
    const uint8_t* result = dev;
    if (transcode_to_) {
      int64_t* slots = reinterpret_cast<int64_t*>(slot.host.get() + host_slots);
      int64_t written = 0;
      for (int64_t u = first; u < first + n; ++u) {
        const int64_t page = static_cast<int64_t>(pages_[u / num_layers].page_id);
        for (int64_t s : pool.table().WrittenSlots(layers_[u % num_layers], {&page, 1})) {
          slots[written++] = (u - first) * page_size + s;
        }
      }
      ops.push_back(FillZeroOp{dev + dev_converted, static_cast<size_t>(n * out_page_)});
      if (written > 0) {
        ops.push_back(CopyOp{dev + dev_slots, slots, static_cast<size_t>(written * 8)});
        TranscodeParams t;
        t.from = PoolGeometry{pool.config().layout, page_size, n};
        t.src = dev;
        t.to = PoolGeometry{*transcode_to_, page_size, n};
        t.dst = dev + dev_converted;
        t.locs = reinterpret_cast<const int64_t*>(dev + dev_slots);
        t.num_tokens = written;
        ops.push_back(t);
      }
      result = dev + dev_converted;
    }
    if (device_output_) {
      slot.out = result;  // the batch stays where the device put it
    } else {
      slot.out = nullptr;
      ops.push_back(CopyOp{slot.host.get(), result, static_cast<size_t>(n * out_page_)});
    }
    return Submit(slot, ops, std::move(pin), n * out_page_);
  }

 private:
  static int64_t Batches(size_t units, int64_t per_batch) {
    return (static_cast<int64_t>(units) + per_batch - 1) / per_batch;
  }

  const std::vector<PageHandle> pages_;
  const std::vector<int> layers_;
  const std::optional<Layout> transcode_to_;
  const int64_t per_batch_;
  const int64_t in_page_, out_page_;
};

// ---- workspace -----------------------------------------------------------------------------

class WorkspaceReader final : public Reader {
 public:
  WorkspaceReader(std::shared_ptr<Pool> pool, int layer, std::vector<TokenLocation> locations,
                  std::vector<int64_t> tokens, int64_t rows_per_batch)
      : Reader(pool, (static_cast<int64_t>(tokens.size()) + rows_per_batch - 1) / rows_per_batch,
               static_cast<int64_t>(tokens.size()) * kBf16RowBytes),
        layer_(layer),
        locations_(std::move(locations)),
        tokens_(std::move(tokens)),
        per_batch_(rows_per_batch) {}

 protected:
  const char* op_name() const override { return "dequantize_gather"; }

  absl::Status Launch(int64_t index, Slot& slot) override {
    Pool& pool = *pool_;
    Backend& backend = pool.backend();
    const int64_t k = per_batch_;
    const int64_t locs_at = k * kBf16RowBytes;
    if (slot.host.get() == nullptr) {
      KVF_ASSIGN_OR_RETURN(slot.host, backend.Allocate(locs_at + k * 8, MemoryKind::kHostStaging, false));
      KVF_ASSIGN_OR_RETURN(slot.device, backend.Allocate(locs_at + k * 8, MemoryKind::kDevice, false));
    }
    const int64_t first = index * k;
    const int64_t n = std::min<int64_t>(k, static_cast<int64_t>(tokens_.size()) - first);
    std::vector<PageHandle> handles(n);
    for (int64_t i = 0; i < n; ++i) handles[i] = locations_[first + i].page;
    KVF_ASSIGN_OR_RETURN(PageTable::Pin pin, pool.table().PinPages(handles, false));
    const size_t locs_bytes = static_cast<size_t>(n) * 8;
    std::memcpy(slot.host.get() + locs_at, tokens_.data() + first, locs_bytes);
    const PoolGeometry g = pool.geometry();
    DequantizeGatherParams gather;
    gather.geometry = g;
    gather.pool = pool.base() + static_cast<int64_t>(layer_) * g.pool_bytes();
    gather.locs = reinterpret_cast<const int64_t*>(slot.device.get() + locs_at);
    gather.num_tokens = n;
    gather.out = slot.device.get<uint16_t>();
    const Op ops[] = {CopyOp{slot.device.get() + locs_at, slot.host.get() + locs_at, locs_bytes},
                      gather,
                      CopyOp{slot.host.get(), slot.device.get(), static_cast<size_t>(n * kBf16RowBytes)}};
    return Submit(slot, ops, std::move(pin), n * kBf16RowBytes);
  }

 private:
  const int layer_;
  const std::vector<TokenLocation> locations_;
  const std::vector<int64_t> tokens_;
  const int64_t per_batch_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Reader>> ReadPages(std::shared_ptr<Pool> pool,
                                                  std::span<const PageHandle> pages,
                                                  std::span<const int64_t> layers_in,
                                                  std::optional<Layout> transcode_to,
                                                  int64_t batch_bytes) {
  std::vector<int> layers;
  absl::flat_hash_set<int64_t> seen;
  for (int64_t l : layers_in) {
    KVF_RETURN_IF_ERROR(pool->CheckLayer(l));
    if (!seen.insert(l).second) {
      return Error(absl::StatusCode::kInvalidArgument, ErrorReason::kDuplicateLayer,
                   absl::StrCat("layer ", l, " is listed twice"));
    }
    layers.push_back(static_cast<int>(l));
  }
  if (layers.empty()) {
    for (int l = 0; l < pool->config().num_layers; ++l) layers.push_back(l);
  }
  if (transcode_to.has_value() && !IsValidLayout(static_cast<int>(*transcode_to))) {
    return Error(absl::StatusCode::kInvalidArgument, ErrorReason::kInvalidLayout,
                 "unknown output layout");
  }
  for (const PageHandle& h : pages) KVF_RETURN_IF_ERROR(pool->table().CheckHandle(h));
  pool->RenewLeases(pages);
  const int64_t out_page = OutputPageBytes(*pool, transcode_to);
  const int64_t units = static_cast<int64_t>(pages.size() * layers.size());
  const int64_t per_batch = std::clamp<int64_t>(batch_bytes / out_page, 1, std::max<int64_t>(units, 1));
  return std::unique_ptr<Reader>(new PageReader(std::move(pool), {pages.begin(), pages.end()},
                                                std::move(layers), transcode_to, per_batch));
}

absl::StatusOr<std::unique_ptr<Reader>> ReadWorkspace(std::shared_ptr<Pool> pool, int64_t layer,
                                                      std::span<const TokenLocation> locations,
                                                      int64_t batch_bytes) {
  KVF_RETURN_IF_ERROR(pool->CheckLayer(layer));
  KVF_ASSIGN_OR_RETURN(std::vector<int64_t> tokens, pool->table().Resolve(locations));
  std::vector<PageHandle> named;
  named.reserve(locations.size());
  for (const TokenLocation& l : locations) named.push_back(l.page);
  pool->RenewLeases(named);
  const int64_t per_batch = std::clamp<int64_t>(batch_bytes / kBf16RowBytes, 1,
                                                std::max<int64_t>(static_cast<int64_t>(tokens.size()), 1));
  return std::unique_ptr<Reader>(new WorkspaceReader(std::move(pool), static_cast<int>(layer),
                                                     {locations.begin(), locations.end()},
                                                     std::move(tokens), per_batch));
}

}  // namespace kvferry::server
