// Pool: creation and limits, allocation, freeing with device zeroing, pins, stats.
#include "core/pool.h"

#include <cctype>
#include <chrono>

#include "absl/strings/str_cat.h"
#include "common/errors.h"
#include "kvferry/kernels/status_macros.h"
#include "kvferry/kernels/validate.h"

namespace kvferry::server {

absl::Status Pool::ValidateConfig(const PoolConfig& config) {
  if (config.name.empty() || config.name.size() > 128) {
    return Error(absl::StatusCode::kInvalidArgument, ErrorReason::kInvalidName,
                 "pool name must have 1 to 128 characters");
  }
  for (char c : config.name) {
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '.' || c == '-')) {
      // The name is not echoed: it may hold anything, of any length.
      return Error(absl::StatusCode::kInvalidArgument, ErrorReason::kInvalidName,
                   "pool name may only use letters, digits, '_', '.', '-'");
    }
  }
  if (!IsValidLayout(static_cast<int>(config.layout))) {
    return Error(absl::StatusCode::kInvalidArgument, ErrorReason::kInvalidLayout,
                 "unknown layout: expected v4, v41 or v41_fp4");
  }
  if (!IsValidPageSize(config.page_size)) {
    return Error(absl::StatusCode::kInvalidArgument, ErrorReason::kInvalidGeometry,
                 absl::StrCat("page size ", config.page_size, " is not a power of two in [1, ",
                              kMaxPageSize, "]"));
  }
  if (config.num_pages <= 0 || config.num_pages > (int64_t{1} << 40)) {
    return Error(absl::StatusCode::kInvalidArgument, ErrorReason::kInvalidGeometry,
                 absl::StrCat("num_pages ", config.num_pages, " is not in [1, 2^40]"));
  }
  if (config.num_layers <= 0 || config.num_layers > 4096) {
    return Error(absl::StatusCode::kInvalidArgument, ErrorReason::kInvalidGeometry,
                 absl::StrCat("num_layers ", config.num_layers, " is not in [1, 4096]"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<Pool>> Pool::Create(const PoolConfig& config,
                                                   std::shared_ptr<Backend> backend,
                                                   uint64_t incarnation, OpObserver* observer,
                                                   std::shared_ptr<TenantAccount> owner) {
  KVF_RETURN_IF_ERROR(ValidateConfig(config));
  const PoolGeometry g{config.layout, config.page_size, config.num_pages};
  // Refuse sizes whose byte count would overflow before asking the device.
  if (config.num_pages > (int64_t{1} << 50) / g.page_bytes() / config.num_layers) {
    return Error(absl::StatusCode::kResourceExhausted, ErrorReason::kDeviceOutOfMemory,
                 absl::StrCat("a pool of ", config.num_pages, " pages x ", config.num_layers,
                              " layers is too large"));
  }
  // Token bookkeeping (a bit per record and two bytes per slot) lives in host memory.
  const int64_t tokens = config.num_pages * config.page_size;
  if (tokens > (int64_t{1} << 36)) {
    return Error(absl::StatusCode::kResourceExhausted, ErrorReason::kDeviceOutOfMemory,
                 absl::StrCat("a pool of ", tokens, " token slots is too large"));
  }
  const int64_t bytes = g.pool_bytes() * config.num_layers;
  // The quota is charged before the device is asked, so a tenant over it allocates nothing;
  // from here on the charges are the pool's (refunded by ~Pool) or refunded on failure.
  if (owner != nullptr) {
    KVF_RETURN_IF_ERROR(owner->Charge(Resource::kPools, 1));
    if (absl::Status s = owner->Charge(Resource::kDeviceBytes, bytes); !s.ok()) {
      owner->Refund(Resource::kPools, 1);
      return s;
    }
  }
  absl::StatusOr<Buffer> memory =
      backend->Allocate(static_cast<size_t>(bytes), MemoryKind::kDevice, /*zero=*/true);
  if (!memory.ok()) {
    if (owner != nullptr) {
      owner->Refund(Resource::kPools, 1);
      owner->Refund(Resource::kDeviceBytes, bytes);
    }
    return memory.status();
  }
  return std::shared_ptr<Pool>(new Pool(config, std::move(backend), incarnation, observer,
                                        std::move(*memory), std::move(owner)));
}

Pool::Pool(const PoolConfig& config, std::shared_ptr<Backend> backend, uint64_t incarnation,
           OpObserver* observer, Buffer memory, std::shared_ptr<TenantAccount> owner)
    : config_(config),
      backend_(std::move(backend)),
      observer_(observer),
      owner_(std::move(owner)),
      memory_(std::move(memory)),
      table_(config.name, config.num_pages, config.page_size, config.num_layers, incarnation) {}

Pool::~Pool() {
  if (owner_ == nullptr) return;
  owner_->Refund(Resource::kPages, charged_pages_.load());
  owner_->Refund(Resource::kDeviceBytes, Stats().pool_bytes);
  owner_->Refund(Resource::kPools, 1);
}

PoolStats Pool::Stats() const {
  PoolStats s;
  s.name = config_.name;
  s.tenant = owner_ != nullptr ? owner_->name() : std::string();
  s.device = backend_->device();
  s.pool_id = id();
  s.layout = config_.layout;
  s.page_size = config_.page_size;
  s.num_pages = config_.num_pages;
  s.num_layers = config_.num_layers;
  s.page_bytes = geometry().page_bytes();
  s.pool_bytes = s.page_bytes * config_.num_pages * config_.num_layers;
  s.savings = ComputeSavings(config_.layout, config_.page_size);
  const PageTable::Counts c = table_.counts();
  s.pages_used = c.pages_used;
  s.pages_free = c.pages_free;
  s.tokens_held = c.tokens_held;
  s.records_held = c.records_held;
  const double v4_effective =
      ComputeSavings(Layout::kV4, config_.page_size).effective_bytes_per_token;
  s.bytes_saved_vs_bf16 = s.records_held * (kBf16RowBytes - s.savings.effective_bytes_per_token);
  s.bytes_saved_vs_v4 = s.records_held * (v4_effective - s.savings.effective_bytes_per_token);
  return s;
}

absl::Status Pool::CheckLayer(int64_t layer) const {
  if (layer < 0 || layer >= config_.num_layers) {
    return Error(absl::StatusCode::kInvalidArgument, ErrorReason::kLayerOutOfRange,
                 absl::StrCat("layer ", layer, " is outside [0, ", config_.num_layers, ")"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<PageHandle>> Pool::AllocatePages(int64_t count, absl::Duration lease) {
  // Pages whose zeroing failed earlier get another try before they can be handed out.
  if (std::vector<int64_t> retry = table_.TakeUnzeroed(); !retry.empty()) {
    ZeroAndReclaim(std::move(retry)).IgnoreError();
  }
  if (owner_ != nullptr && count > 0) KVF_RETURN_IF_ERROR(owner_->Charge(Resource::kPages, count));
  absl::StatusOr<std::vector<PageHandle>> pages = table_.Allocate(count);
  if (owner_ != nullptr && count > 0) {
    if (pages.ok()) {
      charged_pages_ += count;
    } else {
      owner_->Refund(Resource::kPages, count);
    }
  }
  if (pages.ok() && lease > absl::ZeroDuration()) {
    const absl::Time expiry = absl::Now() + lease;
    kvferry::MutexLock lock(&lease_mu_);
    for (const PageHandle& h : *pages) leases_[h.page_id] = Lease{h.generation, lease, expiry};
  }
  return pages;
}

void Pool::RenewLeases(std::span<const PageHandle> pages) {
  const absl::Time now = absl::Now();
  kvferry::MutexLock lock(&lease_mu_);
  RenewLocked(pages, now);
}

void Pool::RenewLocked(std::span<const PageHandle> pages, absl::Time now) {
  if (leases_.empty()) return;
  for (const PageHandle& h : pages) {
    auto it = leases_.find(h.page_id);
    if (it != leases_.end() && it->second.generation == h.generation) {
      it->second.expiry = now + it->second.length;
    }
  }
}

absl::Status Pool::Renew(std::span<const PageHandle> pages) {
  // The check and the renewal are one step under the lease lock, as ExpireLeases' check of
  // a lease and its free are: a renewal that answers OK keeps its pages for a lease length.
  const absl::Time now = absl::Now();
  kvferry::MutexLock lock(&lease_mu_);
  for (const PageHandle& h : pages) KVF_RETURN_IF_ERROR(table_.CheckHandle(h));
  RenewLocked(pages, now);
  return absl::OkStatus();
}

int64_t Pool::ExpireLeases(absl::Time now) {
  std::vector<PageHandle> expired;
  {
    kvferry::MutexLock lock(&lease_mu_);
    for (const auto& [page, lease] : leases_) {
      if (lease.expiry <= now) expired.push_back(PageHandle{page, lease.generation});
    }
  }
  int64_t freed = 0;
  std::vector<int64_t> to_zero;  // the pass's pages, zeroed with one op
  for (const PageHandle& h : expired) {
    // One at a time: a page its client freed meanwhile (stale) must not keep the others.
    // Freed only while its lease is still the one that ran out, checked under the lease
    // lock with the free: a renewal since the list was made keeps the page.
    kvferry::MutexLock lock(&lease_mu_);
    auto it = leases_.find(h.page_id);
    if (it == leases_.end() || it->second.generation != h.generation || it->second.expiry > now) {
      continue;
    }
    leases_.erase(it);
    absl::StatusOr<std::vector<int64_t>> released = table_.Free(std::span<const PageHandle>(&h, 1));
    if (!released.ok()) continue;  // its client freed it meanwhile
    to_zero.insert(to_zero.end(), released->begin(), released->end());
    ++freed;
  }
  RefundPages(freed);
  ZeroAndReclaim(std::move(to_zero)).IgnoreError();  // a failed zeroing holds the pages back
  return freed;
}

void Pool::RefundPages(int64_t count) {
  if (owner_ == nullptr) return;
  charged_pages_ -= count;
  owner_->Refund(Resource::kPages, count);
}

absl::Status Pool::FreePages(std::span<const PageHandle> pages) {
  KVF_ASSIGN_OR_RETURN(std::vector<int64_t> to_zero, table_.Free(pages));
  {
    kvferry::MutexLock lock(&lease_mu_);
    if (!leases_.empty()) {
      for (const PageHandle& h : pages) {
        // Only this handle's lease: the page may already be allocated again.
        auto it = leases_.find(h.page_id);
        if (it != leases_.end() && it->second.generation == h.generation) leases_.erase(it);
      }
    }
  }
  // Freed from here on, whatever the zeroing does: the page table holds back unzeroed pages.
  RefundPages(static_cast<int64_t>(pages.size()));
  return ZeroAndReclaim(std::move(to_zero));
}

absl::Status Pool::ZeroListedPages(PageCopyGeometry geometry, std::span<const int64_t> ids,
                                   const Buffer* scratch) {
  PageCopyParams zero;
  zero.geometry = geometry;
  zero.pool = base();
  zero.num_listed = static_cast<int64_t>(ids.size());
  if (backend_->host_memory()) {
    zero.pages = ids.data();
    const Op op = ZeroPagesOp{zero};
    return RunTimed("zero_pages", std::span<const Op>(&op, 1));
  }
  const size_t id_bytes = ids.size() * sizeof(int64_t);
  Buffer allocated;
  if (scratch == nullptr || scratch->bytes() < id_bytes) {
    KVF_ASSIGN_OR_RETURN(allocated, backend_->Allocate(id_bytes, MemoryKind::kDevice, false));
    scratch = &allocated;
  }
  zero.pages = scratch->get<int64_t>();
  const Op ops[] = {CopyOp{scratch->get(), ids.data(), id_bytes}, ZeroPagesOp{zero}};
  return RunTimed("zero_pages", ops);
}

absl::Status Pool::ZeroAndReclaim(std::vector<int64_t> pages) {
  if (pages.empty()) return absl::OkStatus();
  const absl::Status zeroed = ZeroListedPages(
      PageCopyGeometry{geometry().page_bytes(), config_.num_pages, config_.num_layers}, pages);
  if (!zeroed.ok()) {
    table_.ZeroingFailed(pages);
    return WithReason(zeroed, ErrorReason::kDeviceError);
  }
  table_.Reclaimed(pages);
  return absl::OkStatus();
}

void Pool::Unpin(const PageTable::Pin& pin, int written_layer,
                 std::span<const int64_t> written_tokens) {
  // A failed zeroing leaves the pages out of the free list; nobody waits on this status.
  ZeroAndReclaim(table_.Unpin(pin, written_layer, written_tokens)).IgnoreError();
}

void Pool::UnpinLayerPages(const PageTable::Pin& pin, std::span<const int64_t> pages) {
  ZeroAndReclaim(table_.UnpinLayerPages(pin, pages)).IgnoreError();
}

void Pool::UnpinWrittenPages(const PageTable::Pin& pin, std::span<const int> layers,
                             std::span<const int64_t> pages) {
  ZeroAndReclaim(table_.UnpinWrittenPages(pin, layers, pages)).IgnoreError();
}

absl::Status Pool::RunTimed(const char* op, std::span<const Op> ops) {
  const auto start = std::chrono::steady_clock::now();
  const absl::Status s = backend_->Run(ops);
  ObserveOp(op, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  return s;
}

void Pool::ObserveOp(const char* op, double seconds) const {
  if (observer_ != nullptr) observer_->RecordOp(op, config_.layout, seconds);
}

}  // namespace kvferry::server
