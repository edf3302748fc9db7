// Pool: page allocation with generations, staged writes, chunked reads, accounting.
#include "core/pool.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <deque>
#include <thread>

#include "absl/strings/str_cat.h"
#include "kvferry/kernels/validate.h"
#include "kvferry/kernels/status_macros.h"

namespace kvferry::server {


absl::StatusOr<std::shared_ptr<Pool>> Pool::Create(const PoolConfig& config,
                                                   std::shared_ptr<Backend> backend,
                                                   OpObserver* observer) {
  const PoolGeometry g{config.layout, config.page_size, config.num_pages};
  KVF_RETURN_IF_ERROR(ValidateGeometry(g));
  if (config.num_layers <= 0 || config.num_layers > 4096) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_layers ", config.num_layers, " is not in [1, 4096]"));
  }
  // Refuse sizes whose byte count would overflow before asking the device.
  if (config.num_pages > (int64_t{1} << 50) / g.page_bytes() / config.num_layers) {
    return absl::ResourceExhaustedError(absl::StrCat("a pool of ", config.num_pages, " pages x ",
                                                     config.num_layers, " layers is too large"));
  }
  KVF_ASSIGN_OR_RETURN(DeviceMemory memory,
                       backend->Allocate(static_cast<size_t>(g.pool_bytes() * config.num_layers)));
  std::shared_ptr<Pool> pool(new Pool(config, std::move(backend), observer, std::move(memory)));
  pool->self_ = pool;
  return pool;
}

Pool::Pool(const PoolConfig& config, std::shared_ptr<Backend> backend, OpObserver* observer,
           DeviceMemory memory)
    : config_(config), backend_(std::move(backend)), observer_(observer), memory_(std::move(memory)) {
  absl::MutexLock lock(&mu_);
  generation_.assign(config_.num_pages, 1);  // handle generation 0 is never valid
  allocated_.assign(config_.num_pages, false);
  free_list_.resize(config_.num_pages);
  // Pop order: page 0 first.
  for (int64_t i = 0; i < config_.num_pages; ++i) free_list_[i] = config_.num_pages - 1 - i;
  const int64_t tokens = config_.num_pages * config_.page_size;
  written_.assign((tokens * config_.num_layers + 63) / 64, 0);
  slot_layers_.assign(tokens, 0);
}

PoolStats Pool::Stats() const {
  PoolStats s;
  s.name = config_.name;
  s.device = backend_->device();
  s.layout = config_.layout;
  s.page_size = config_.page_size;
  s.num_pages = config_.num_pages;
  s.num_layers = config_.num_layers;
  s.page_bytes = geometry().page_bytes();
  s.pool_bytes = s.page_bytes * config_.num_pages * config_.num_layers;
  s.savings = ComputeSavings(config_.layout, config_.page_size);
  {
    absl::ReaderMutexLock lock(&mu_);
    s.pages_used = config_.num_pages - static_cast<int64_t>(free_list_.size());
    s.tokens_held = tokens_held_;
    s.records_held = records_held_;
  }
  const double v4_effective = ComputeSavings(Layout::kV4, config_.page_size).effective_bytes_per_token;
  s.bytes_saved_vs_bf16 = s.records_held * (kBf16RowBytes - s.savings.effective_bytes_per_token);
  s.bytes_saved_vs_v4 = s.records_held * (v4_effective - s.savings.effective_bytes_per_token);
  return s;
}

absl::StatusOr<std::vector<PageHandle>> Pool::AllocatePages(int64_t count) {
  if (count <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("page count ", count, " must be > 0"));
  }
  absl::MutexLock lock(&mu_);
  if (count > static_cast<int64_t>(free_list_.size())) {
    return absl::ResourceExhaustedError(absl::StrCat("pool '", config_.name, "' is full: ", count,
                                                     " pages asked for, ", free_list_.size(),
                                                     " free of ", config_.num_pages));
  }
  std::vector<PageHandle> handles(count);
  for (auto& h : handles) {
    const int64_t page = free_list_.back();
    free_list_.pop_back();
    allocated_[page] = true;
    h = PageHandle{static_cast<uint64_t>(page), generation_[page]};
  }
  return handles;
}

absl::Status Pool::CheckHandle(const PageHandle& handle) const {
  if (handle.page_id >= static_cast<uint64_t>(config_.num_pages)) {
    return absl::InvalidArgumentError(absl::StrCat("page ", handle.page_id, " is outside pool '",
                                                   config_.name, "' of ", config_.num_pages,
                                                   " pages"));
  }
  if (!allocated_[handle.page_id] || generation_[handle.page_id] != handle.generation) {
    return absl::FailedPreconditionError(absl::StrCat(
        "stale page handle: page ", handle.page_id, " generation ", handle.generation,
        " (the page is ", allocated_[handle.page_id] ? "allocated at generation " : "free, generation ",
        generation_[handle.page_id], ")"));
  }
  return absl::OkStatus();
}

absl::Status Pool::CheckLayer(int layer) const {
  if (layer < 0 || layer >= config_.num_layers) {
    return absl::InvalidArgumentError(absl::StrCat("layer ", layer, " is outside [0, ",
                                                   config_.num_layers, ")"));
  }
  return absl::OkStatus();
}

absl::Status Pool::FreePages(std::span<const PageHandle> pages) {
  absl::MutexLock lock(&mu_);
  absl::flat_hash_set<uint64_t> seen;
  for (const PageHandle& h : pages) {
    KVF_RETURN_IF_ERROR(CheckHandle(h));
    if (!seen.insert(h.page_id).second) {
      return absl::InvalidArgumentError(absl::StrCat("page ", h.page_id, " is listed twice"));
    }
  }
  for (const PageHandle& h : pages) {
    const int64_t page = static_cast<int64_t>(h.page_id);
    for (int64_t t = page * config_.page_size; t < (page + 1) * config_.page_size; ++t) {
      if (slot_layers_[t] > 0) --tokens_held_;
      records_held_ -= slot_layers_[t];
      slot_layers_[t] = 0;
      for (int layer = 0; layer < config_.num_layers; ++layer) {
        const int64_t bit = WrittenBit(layer, t);
        written_[bit / 64] &= ~(uint64_t{1} << (bit % 64));
      }
    }
    ++generation_[page];
    allocated_[page] = false;
    free_list_.push_back(page);
  }
  return absl::OkStatus();
}

void Pool::MarkWritten(int layer, int64_t token) {
  const int64_t bit = WrittenBit(layer, token);
  uint64_t& word = written_[bit / 64];
  const uint64_t mask = uint64_t{1} << (bit % 64);
  if (word & mask) return;
  word |= mask;
  if (slot_layers_[token]++ == 0) ++tokens_held_;
  ++records_held_;
}

bool Pool::IsWritten(int layer, int64_t token) const {
  const int64_t bit = WrittenBit(layer, token);
  return (written_[bit / 64] >> (bit % 64)) & 1;
}

absl::StatusOr<std::vector<int64_t>> Pool::Resolve(std::span<const TokenLocation> locations) const {
  std::vector<int64_t> tokens(locations.size());
  for (size_t i = 0; i < locations.size(); ++i) {
    const TokenLocation& l = locations[i];
    KVF_RETURN_IF_ERROR(CheckHandle(l.page));
    if (l.slot >= static_cast<uint32_t>(config_.page_size)) {
      return absl::InvalidArgumentError(absl::StrCat("location ", i, ": slot ", l.slot,
                                                     " is outside [0, ", config_.page_size, ")"));
    }
    tokens[i] = static_cast<int64_t>(l.page.page_id) * config_.page_size + l.slot;
  }
  return tokens;
}

absl::Status Pool::Timed(const char* op, Layout layout,
                         const std::function<absl::Status()>& run) const {
  const auto start = std::chrono::steady_clock::now();
  absl::Status s = run();
  if (observer_ != nullptr) {
    observer_->RecordOp(op, layout,
                        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  return s;
}

// ---- token writes ------------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<Pool::TokenWrite>> Pool::BeginTokenWrite(int layer,
                                                                         int64_t max_tokens) {
  KVF_RETURN_IF_ERROR(CheckLayer(layer));
  return std::unique_ptr<TokenWrite>(new TokenWrite(self_.lock(), layer, max_tokens));
}

absl::Status Pool::TokenWrite::Add(std::span<const TokenLocation> locations,
                                   std::span<const uint8_t> rows) {
  const int64_t n = static_cast<int64_t>(locations.size());
  if (static_cast<int64_t>(rows.size()) != n * kBf16RowBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "message with ", n, " locations carries ", rows.size(), " bytes of rows, expected ",
        n * kBf16RowBytes, " (", kBf16RowBytes, " bytes = 512 bf16 per row)"));
  }
  if (tokens_ + n > max_tokens_) {
    return absl::ResourceExhaustedError(absl::StrCat("write of more than ", max_tokens_,
                                                     " tokens; split it into several writes"));
  }
  std::vector<int64_t> tokens;
  {
    absl::ReaderMutexLock lock(&pool_->mu_);
    KVF_ASSIGN_OR_RETURN(tokens, pool_->Resolve(locations));
  }
  for (int64_t i = 0; i < n; ++i) {
    if (!seen_.insert(tokens[i]).second) {
      return absl::InvalidArgumentError(absl::StrCat(
          "location ", tokens_ + i, " (page ", locations[i].page.page_id, " slot ",
          locations[i].slot, ") is written twice in one write"));
    }
    generations_[locations[i].page.page_id] = locations[i].page.generation;
  }
  KVF_RETURN_IF_ERROR(ValidateFiniteBytes(rows, tokens_));
  Chunk chunk;
  chunk.n = n;
  if (n > 0) {
    KVF_ASSIGN_OR_RETURN(chunk.rows, pool_->backend_->Allocate(rows.size(), /*zero=*/false));
    KVF_ASSIGN_OR_RETURN(chunk.locs, pool_->backend_->Allocate(n * sizeof(int64_t), /*zero=*/false));
    KVF_RETURN_IF_ERROR(pool_->backend_->CopyToDevice(chunk.rows.get(), rows.data(), rows.size()));
    KVF_RETURN_IF_ERROR(pool_->backend_->CopyToDevice(chunk.locs.get(), tokens.data(), n * sizeof(int64_t)));
  }
  chunk.host_locs = std::move(tokens);
  chunks_.push_back(std::move(chunk));
  tokens_ += n;
  return absl::OkStatus();
}

absl::StatusOr<int64_t> Pool::TokenWrite::Commit() {
  Pool& pool = *pool_;
  absl::MutexLock lock(&pool.mu_);
  for (const auto& [page, generation] : generations_) {
    KVF_RETURN_IF_ERROR(pool.CheckHandle(PageHandle{page, generation}));
  }
  const PoolGeometry g = pool.geometry();
  for (const Chunk& c : chunks_) {
    if (c.n == 0) continue;
    KVF_RETURN_IF_ERROR(pool.Timed("quantize_store", g.layout, [&] {
      return pool.backend_->QuantizeStore(g, pool.layer_base(layer_), c.rows.get<uint16_t>(),
                                          c.locs.get<int64_t>(), c.n);
    }));
    for (int64_t token : c.host_locs) pool.MarkWritten(layer_, token);
  }
  return tokens_;
}

// ---- page writes -------------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<Pool::PageWrite>> Pool::BeginPageWrite(int64_t max_bytes) {
  return std::unique_ptr<PageWrite>(new PageWrite(self_.lock(), max_bytes));
}

absl::Status Pool::PageWrite::Add(const PageHandle& page, int layer, uint64_t offset,
                                  std::span<const uint8_t> data) {
  Pool& pool = *pool_;
  KVF_RETURN_IF_ERROR(pool.CheckLayer(layer));
  {
    absl::ReaderMutexLock lock(&pool.mu_);
    KVF_RETURN_IF_ERROR(pool.CheckHandle(page));
  }
  const uint64_t page_bytes = static_cast<uint64_t>(pool.geometry().page_bytes());
  auto [it, inserted] = index_.try_emplace(std::make_pair(page.page_id, layer), pages_.size());
  if (inserted) {
    if (staged_bytes_ + static_cast<int64_t>(page_bytes) > max_bytes_) {
      index_.erase(it);
      return absl::ResourceExhaustedError(absl::StrCat("write of more than ", max_bytes_,
                                                       " bytes; split it into several writes"));
    }
    KVF_ASSIGN_OR_RETURN(DeviceMemory staging, pool.backend_->Allocate(page_bytes, /*zero=*/false));
    pages_.push_back(Staged{page, layer, std::move(staging), 0});
    staged_bytes_ += static_cast<int64_t>(page_bytes);
  }
  Staged& staged = pages_[it->second];
  if (staged.handle.generation != page.generation) {
    return absl::InvalidArgumentError(absl::StrCat("page ", page.page_id,
                                                   " is written with two generations"));
  }
  if (offset != staged.received) {
    return absl::InvalidArgumentError(absl::StrCat(
        "page ", page.page_id, " layer ", layer, ": data at offset ", offset, ", expected ",
        staged.received, staged.received == page_bytes ? " (the page is already complete)" : ""));
  }
  if (data.size() > page_bytes - staged.received) {
    return absl::InvalidArgumentError(absl::StrCat("page ", page.page_id, " layer ", layer, ": ",
                                                   staged.received + data.size(),
                                                   " bytes exceed the page size of ", page_bytes));
  }
  KVF_RETURN_IF_ERROR(pool.backend_->CopyToDevice(staged.bytes.get() + staged.received,
                                                  data.data(), data.size()));
  staged.received += data.size();
  return absl::OkStatus();
}

absl::StatusOr<int64_t> Pool::PageWrite::Commit() {
  Pool& pool = *pool_;
  const uint64_t page_bytes = static_cast<uint64_t>(pool.geometry().page_bytes());
  for (const Staged& s : pages_) {
    if (s.received != page_bytes) {
      return absl::InvalidArgumentError(absl::StrCat("page ", s.handle.page_id, " layer ", s.layer,
                                                     " is incomplete: ", s.received, " of ",
                                                     page_bytes, " bytes"));
    }
  }
  absl::MutexLock lock(&pool.mu_);
  for (const Staged& s : pages_) KVF_RETURN_IF_ERROR(pool.CheckHandle(s.handle));
  for (const Staged& s : pages_) {
    KVF_RETURN_IF_ERROR(pool.backend_->CopyOnDevice(
        pool.layer_base(s.layer) + s.handle.page_id * page_bytes, s.bytes.get(), page_bytes));
    // Raw pages define every slot of the page.
    for (int64_t t = 0; t < pool.config_.page_size; ++t) {
      pool.MarkWritten(s.layer, static_cast<int64_t>(s.handle.page_id) * pool.config_.page_size + t);
    }
  }
  return static_cast<int64_t>(pages_.size());
}

// ---- reads -------------------------------------------------------------------------------

namespace {

// Runs produce(i, buffer) for i in [0, batches) on a helper thread, up to two batches ahead
// of send(buffer) on the calling thread, so the device work and the copy of the next batch
// overlap the sending of this one. The first error of either side ends both and is returned.
absl::Status SendPipelined(int64_t batches,
                           const std::function<absl::Status(int64_t, std::string&)>& produce,
                           const std::function<absl::Status(std::string&)>& send) {
  if (batches <= 1) {
    std::string buffer;
    for (int64_t i = 0; i < batches; ++i) {
      KVF_RETURN_IF_ERROR(produce(i, buffer));
      KVF_RETURN_IF_ERROR(send(buffer));
    }
    return absl::OkStatus();
  }
  struct State {
    absl::Mutex mu;
    std::deque<std::string> ready ABSL_GUARDED_BY(mu);  // produced, not yet sent
    absl::Status produced ABSL_GUARDED_BY(mu);
    bool producer_done ABSL_GUARDED_BY(mu) = false;
    bool stop ABSL_GUARDED_BY(mu) = false;  // the sender failed
  } st;
  std::thread producer([&] {
    for (int64_t i = 0; i < batches; ++i) {
      {
        absl::MutexLock lock(&st.mu);
        st.mu.Await(absl::Condition(
            +[](State* x) ABSL_NO_THREAD_SAFETY_ANALYSIS { return x->ready.size() < 2 || x->stop; },
            &st));
        if (st.stop) break;
      }
      std::string buffer;
      absl::Status s = produce(i, buffer);
      absl::MutexLock lock(&st.mu);
      if (!s.ok()) {
        st.produced = s;
        break;
      }
      st.ready.push_back(std::move(buffer));
    }
    absl::MutexLock lock(&st.mu);
    st.producer_done = true;
  });
  absl::Status sent;
  while (true) {
    std::string buffer;
    {
      absl::MutexLock lock(&st.mu);
      st.mu.Await(absl::Condition(
          +[](State* x) ABSL_NO_THREAD_SAFETY_ANALYSIS { return !x->ready.empty() || x->producer_done; },
          &st));
      if (st.ready.empty()) break;  // the producer finished (or failed) and all is sent
      buffer = std::move(st.ready.front());
      st.ready.pop_front();
    }
    sent = send(buffer);
    if (!sent.ok()) {
      absl::MutexLock lock(&st.mu);
      st.stop = true;
      break;
    }
  }
  producer.join();
  if (!sent.ok()) return sent;
  absl::MutexLock lock(&st.mu);
  return st.produced;
}

}  // namespace

absl::Status Pool::ReadPages(std::span<const PageHandle> pages, std::span<const int> layers_in,
                             std::optional<Layout> transcode_to, int64_t chunk_bytes,
                             const Sink& sink) {
  const Layout out_layout = transcode_to.value_or(config_.layout);
  const bool transcode = transcode_to.has_value();
  std::vector<int> layers(layers_in.begin(), layers_in.end());
  if (layers.empty()) {
    for (int l = 0; l < config_.num_layers; ++l) layers.push_back(l);
  }
  for (int l : layers) KVF_RETURN_IF_ERROR(CheckLayer(l));
  if (!IsValidLayout(static_cast<int>(out_layout))) {
    return absl::InvalidArgumentError("unknown output layout");
  }
  {
    absl::ReaderMutexLock lock(&mu_);
    for (const PageHandle& h : pages) KVF_RETURN_IF_ERROR(CheckHandle(h));
  }
  const PoolGeometry g = geometry();
  const int64_t in_page = g.page_bytes();
  const int64_t out_page = PageBytes(out_layout, config_.page_size);
  const int64_t per_page = out_page * static_cast<int64_t>(layers.size());
  const int64_t batch = std::clamp<int64_t>(chunk_bytes / std::max<int64_t>(per_page, 1), 1,
                                            std::max<int64_t>(1, static_cast<int64_t>(pages.size())));
  // Device scratch for one batch: the gathered pages, the transcoded pages, locations.
  KVF_ASSIGN_OR_RETURN(DeviceMemory gathered, backend_->Allocate(batch * in_page, /*zero=*/false));
  DeviceMemory converted, locs;
  if (transcode) {
    KVF_ASSIGN_OR_RETURN(converted, backend_->Allocate(batch * out_page));
    KVF_ASSIGN_OR_RETURN(locs, backend_->Allocate(batch * config_.page_size * sizeof(int64_t)));
  }
  KVF_ASSIGN_OR_RETURN(DeviceMemory page_ids, backend_->Allocate(batch * sizeof(int64_t)));

  // [layer][page][out_page] staging, needed only to reorder several layers.
  std::vector<uint8_t> host(layers.size() > 1 ? batch * per_page : 0);
  const int64_t num_pages = static_cast<int64_t>(pages.size());
  auto produce = [&](int64_t index, std::string& out) -> absl::Status {
    const int64_t first = index * batch;
    const int64_t n = std::min<int64_t>(batch, num_pages - first);
    out.resize(n * per_page);
    std::vector<int64_t> batch_ids(n);
    absl::ReaderMutexLock lock(&mu_);
    for (int64_t i = 0; i < n; ++i) {
      KVF_RETURN_IF_ERROR(CheckHandle(pages[first + i]));
      batch_ids[i] = static_cast<int64_t>(pages[first + i].page_id);
    }
    KVF_RETURN_IF_ERROR(backend_->CopyToDevice(page_ids.get(), batch_ids.data(), n * sizeof(int64_t)));
    for (size_t li = 0; li < layers.size(); ++li) {
      const int layer = layers[li];
      KVF_RETURN_IF_ERROR(Timed("gather_pages", config_.layout, [&] {
        return backend_->GatherPages(PageCopyGeometry{in_page, config_.num_pages, 1},
                                     layer_base(layer), page_ids.get<int64_t>(), n,
                                     gathered.get());
      }));
      const uint8_t* result = gathered.get();
      if (transcode) {
        std::vector<int64_t> written;
        for (int64_t i = 0; i < n; ++i) {
          for (int64_t s = 0; s < config_.page_size; ++s) {
            if (IsWritten(layer, batch_ids[i] * config_.page_size + s)) {
              written.push_back(i * config_.page_size + s);
            }
          }
        }
        KVF_RETURN_IF_ERROR(backend_->Zero(converted.get(), n * out_page));
        if (!written.empty()) {
          KVF_RETURN_IF_ERROR(backend_->CopyToDevice(locs.get(), written.data(),
                                                     written.size() * sizeof(int64_t)));
          KVF_RETURN_IF_ERROR(Timed("transcode", config_.layout, [&] {
            return backend_->Transcode(PoolGeometry{config_.layout, config_.page_size, n},
                                       gathered.get(),
                                       PoolGeometry{out_layout, config_.page_size, n},
                                       converted.get(), locs.get<int64_t>(),
                                       static_cast<int64_t>(written.size()));
          }));
        }
        result = converted.get();
      }
      // One layer is already in the caller's order: copy it straight into the output.
      uint8_t* to = layers.size() == 1 ? reinterpret_cast<uint8_t*>(out.data())
                                       : host.data() + li * n * out_page;
      KVF_RETURN_IF_ERROR(backend_->CopyToHost(to, result, n * out_page));
    }
    // Page-major order for the caller: for each page, each layer.
    if (layers.size() > 1) {
      for (int64_t i = 0; i < n; ++i) {
        for (size_t li = 0; li < layers.size(); ++li) {
          std::memcpy(out.data() + (i * layers.size() + li) * out_page,
                      host.data() + (li * n + i) * out_page, out_page);
        }
      }
    }
    return absl::OkStatus();
  };
  auto send = [&](std::string& out) -> absl::Status {
    if (static_cast<int64_t>(out.size()) <= chunk_bytes) return sink(out);  // one piece, no copy
    for (int64_t at = 0; at < static_cast<int64_t>(out.size()); at += chunk_bytes) {
      std::string piece = out.substr(at, chunk_bytes);
      KVF_RETURN_IF_ERROR(sink(piece));
    }
    return absl::OkStatus();
  };
  return SendPipelined((num_pages + batch - 1) / batch, produce, send);
}

absl::Status Pool::ReadWorkspace(int layer, std::span<const TokenLocation> locations,
                                 int64_t chunk_rows, const Sink& sink) {
  KVF_RETURN_IF_ERROR(CheckLayer(layer));
  {
    absl::ReaderMutexLock lock(&mu_);
    KVF_RETURN_IF_ERROR(Resolve(locations).status());
  }
  const int64_t total = static_cast<int64_t>(locations.size());
  const int64_t batch = std::clamp<int64_t>(chunk_rows, 1, std::max<int64_t>(total, 1));
  KVF_ASSIGN_OR_RETURN(DeviceMemory d_locs,
                       backend_->Allocate(batch * sizeof(int64_t), /*zero=*/false));
  KVF_ASSIGN_OR_RETURN(DeviceMemory d_out,
                       backend_->Allocate(batch * kBf16RowBytes, /*zero=*/false));
  const PoolGeometry g = geometry();
  auto produce = [&](int64_t index, std::string& rows) -> absl::Status {
    const int64_t first = index * batch;
    const int64_t n = std::min(batch, total - first);
    rows.resize(n * kBf16RowBytes);
    absl::ReaderMutexLock lock(&mu_);
    KVF_ASSIGN_OR_RETURN(const std::vector<int64_t> tokens, Resolve(locations.subspan(first, n)));
    KVF_RETURN_IF_ERROR(backend_->CopyToDevice(d_locs.get(), tokens.data(), n * sizeof(int64_t)));
    KVF_RETURN_IF_ERROR(Timed("dequantize_gather", g.layout, [&] {
      return backend_->DequantizeGather(g, layer_base(layer), d_locs.get<int64_t>(), n,
                                        d_out.get<uint16_t>());
    }));
    return backend_->CopyToHost(rows.data(), d_out.get(), rows.size());
  };
  return SendPipelined((total + batch - 1) / batch, produce, sink);
}

}  // namespace kvferry::server
