// PageTable: free list, generations, pins, occupancy bits and deferred reclaim.
#include "core/page_table.h"

#include <algorithm>
#include <bit>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/errors.h"
#include "kvferry/kernels/status_macros.h"

namespace kvferry::server {

PageTable::PageTable(std::string pool_name, int64_t num_pages, int page_size, int num_layers,
                     uint64_t incarnation)
    : pool_name_(std::move(pool_name)),
      num_pages_(num_pages),
      page_size_(page_size),
      num_layers_(num_layers),
      num_tokens_(num_pages * page_size),
      incarnation_(incarnation) {
  kvferry::MutexLock lock(&mu_);
  pages_.assign(num_pages_, Page{(incarnation_ << kGenerationCountBits) | 1});
  free_list_.resize(num_pages_);
  // Pop order: page 0 first.
  for (int64_t i = 0; i < num_pages_; ++i) free_list_[i] = num_pages_ - 1 - i;
  written_.assign((num_tokens_ * num_layers_ + 63) / 64, 0);
  layer_writer_.assign((num_pages_ * num_layers_ + 63) / 64, 0);
  readers_.assign(num_pages_, 0);
  held_.assign((num_tokens_ + 63) / 64, 0);
}

absl::StatusOr<std::vector<PageHandle>> PageTable::Allocate(int64_t count) {
  if (count <= 0) {
    return Error(absl::StatusCode::kInvalidArgument, ErrorReason::kInvalidRequest,
                 absl::StrCat("page count ", count, " must be > 0"));
  }
  kvferry::MutexLock lock(&mu_);
  if (deleted_) {
    return Error(absl::StatusCode::kAborted, ErrorReason::kPoolDeleted,
                 absl::StrCat("pool '", pool_name_, "' was deleted"));
  }
  if (count > static_cast<int64_t>(free_list_.size())) {
    return Error(absl::StatusCode::kResourceExhausted, ErrorReason::kPoolFull,
                 absl::StrCat("pool '", pool_name_, "' is full: ", count, " pages asked for, ",
                              free_list_.size(), " free of ", num_pages_,
                              reclaiming_ > 0 ? absl::StrCat(" (", reclaiming_, " being zeroed)") : ""));
  }
  std::vector<PageHandle> handles(count);
  for (PageHandle& h : handles) {
    const int64_t page = free_list_.back();
    free_list_.pop_back();
    pages_[page].state = State::kAllocated;
    h = PageHandle{static_cast<uint64_t>(page), pages_[page].generation};
  }
  return handles;
}

absl::Status PageTable::CheckHandleLocked(const PageHandle& handle) const {
  if (handle.page_id >= static_cast<uint64_t>(num_pages_)) {
    return Error(absl::StatusCode::kInvalidArgument, ErrorReason::kPageOutOfRange,
                 absl::StrCat("page ", handle.page_id, " is outside pool '", pool_name_, "' of ",
                              num_pages_, " pages"));
  }
  if (!Current(static_cast<int64_t>(handle.page_id), handle.generation)) {
    // The current generation is never echoed: it is the handle of whoever holds the page.
    const bool other_pool = (handle.generation >> kGenerationCountBits) != incarnation_;
    return Error(absl::StatusCode::kFailedPrecondition, ErrorReason::kStalePageHandle,
                 absl::StrCat("stale page handle: page ", handle.page_id, " generation ",
                              handle.generation,
                              other_pool ? " belongs to an earlier pool of this name"
                                         : " was freed since"));
  }
  return absl::OkStatus();
}

absl::Status PageTable::CheckHandle(const PageHandle& handle) const {
  kvferry::ReaderMutexLock lock(&mu_);
  return CheckHandleLocked(handle);
}

absl::Status PageTable::CheckHandles(std::span<const PageHandle> handles) const {
  kvferry::ReaderMutexLock lock(&mu_);
  for (const PageHandle& h : handles) KVF_RETURN_IF_ERROR(CheckHandleLocked(h));
  return absl::OkStatus();
}

absl::StatusOr<std::vector<int64_t>> PageTable::Resolve(
    std::span<const TokenLocation> locations) const {
  std::vector<int64_t> tokens(locations.size());
  kvferry::ReaderMutexLock lock(&mu_);
  for (size_t i = 0; i < locations.size(); ++i) {
    const TokenLocation& l = locations[i];
    KVF_RETURN_IF_ERROR(CheckHandleLocked(l.page));
    if (l.slot >= static_cast<uint32_t>(page_size_)) {
      return Error(absl::StatusCode::kInvalidArgument, ErrorReason::kSlotOutOfRange,
                   absl::StrCat("location ", i, ": slot ", l.slot, " is outside [0, ", page_size_,
                                ")"));
    }
    tokens[i] = static_cast<int64_t>(l.page.page_id) * page_size_ + l.slot;
  }
  return tokens;
}

absl::StatusOr<std::vector<int64_t>> PageTable::Free(std::span<const PageHandle> handles) {
  kvferry::MutexLock lock(&mu_);
  SeenPages seen(handles.size(), num_pages_);
  for (const PageHandle& h : handles) {
    KVF_RETURN_IF_ERROR(CheckHandleLocked(h));
    if (!seen.Insert(h.page_id)) {
      return Error(absl::StatusCode::kInvalidArgument, ErrorReason::kDuplicatePage,
                   absl::StrCat("page ", h.page_id, " is listed twice"));
    }
  }
  std::vector<int64_t> to_zero;
  ++frees_;
  for (const PageHandle& h : handles) {
    const int64_t p = static_cast<int64_t>(h.page_id);
    Page& page = pages_[p];
    ForgetRecords(p);
    ++page.generation;
    page.state = State::kReclaiming;
    ++reclaiming_;
    if (Unused(p)) to_zero.push_back(p);
  }
  return to_zero;
}

void PageTable::Reclaimed(std::span<const int64_t> pages) {
  kvferry::MutexLock lock(&mu_);
  // Pushed last first, so that the next allocation takes them in the order they were freed:
  // a request's pages freed in order come back as the same runs of the pool (a transfer
  // received in place in device memory needs each message's pages to be one run), not
  // reversed.
  for (auto it = pages.rbegin(); it != pages.rend(); ++it) {
    const int64_t p = *it;
    pages_[p].state = State::kFree;
    --reclaiming_;
    free_list_.push_back(p);
  }
}

void PageTable::ZeroingFailed(std::span<const int64_t> pages) {
  kvferry::MutexLock lock(&mu_);
  unzeroed_.insert(unzeroed_.end(), pages.begin(), pages.end());
}

std::vector<int64_t> PageTable::TakeUnzeroed() {
  kvferry::MutexLock lock(&mu_);
  return std::exchange(unzeroed_, {});
}

absl::StatusOr<PageTable::Pin> PageTable::PinPages(std::span<const PageHandle> handles,
                                                   bool exclusive, absl::Duration max_wait) {
  return PinList(handles, exclusive, -1, max_wait);
}

absl::StatusOr<PageTable::Pin> PageTable::PinLayer(std::span<const PageHandle> handles, int layer,
                                                   absl::Duration max_wait) {
  if (layer < 0 || layer >= num_layers_) {
    return Error(absl::StatusCode::kInvalidArgument, ErrorReason::kLayerOutOfRange,
                 absl::StrCat("layer ", layer, " is outside [0, ", num_layers_, ") of pool '",
                              pool_name_, "'"));
  }
  return PinList(handles, /*exclusive=*/true, layer, max_wait);
}

bool PageTable::WriterHolds(int64_t p, int layer) const {
  const Page& page = pages_[p];
  if (page.writer) return true;
  if (layer < 0) return AnyLayerWriter(p);
  return LayerWriter(layer, p);
}

bool PageTable::AnyLayerWriter(int64_t p) const {
  if (layer_writer_bits_ == 0) return false;
  for (int layer = 0; layer < num_layers_; ++layer) {
    if (LayerWriter(layer, p)) return true;
  }
  return false;
}

absl::StatusOr<PageTable::Pin> PageTable::PinList(std::span<const PageHandle> handles,
                                                  bool exclusive, int layer,
                                                  absl::Duration max_wait) {
  Pin pin;
  pin.exclusive = exclusive;
  pin.layer = exclusive ? layer : -1;
  // The list without repeats, made before the lock is taken (a transfer names thousands of
  // pages and every other request of the pool waits on this lock). A page outside the pool
  // is refused under the lock below, in list order with the other checks.
  const bool in_range = std::all_of(handles.begin(), handles.end(), [&](const PageHandle& h) {
    return h.page_id < static_cast<uint64_t>(num_pages_);
  });
  bool repeats = false;
  if (in_range) {
    pin.pages.reserve(handles.size());
    pin.generations.reserve(handles.size());
    SeenPages seen(handles.size(), num_pages_);
    for (const PageHandle& h : handles) {
      if (!seen.Insert(h.page_id)) {
        repeats = true;
        continue;
      }
      pin.pages.push_back(static_cast<int64_t>(h.page_id));
      pin.generations.push_back(h.generation);
    }
  }
  kvferry::MutexLock lock(&mu_);
  auto check = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) -> absl::Status {
    if (deleted_) {
      return Error(absl::StatusCode::kAborted, ErrorReason::kPoolDeleted,
                   absl::StrCat("pool '", pool_name_, "' was deleted"));
    }
    // Without repeats the list's pages, each once, decide; a failure is then reported from
    // the handles in list order. (A repeat may carry another generation: every handle then.)
    if (in_range && !repeats) {
      bool valid = true;
      for (size_t i = 0; i < pin.pages.size() && valid; ++i) {
        valid = Current(pin.pages[i], pin.generations[i]);
      }
      if (valid) return absl::OkStatus();
    }
    for (const PageHandle& h : handles) KVF_RETURN_IF_ERROR(CheckHandleLocked(h));
    return absl::OkStatus();
  };
  if (exclusive && layer >= 0 && in_range && !repeats && !deleted_) {
    // A layer's save, the common case: each listed page checked, found free of writers and
    // taken in one pass. A page that fails stops it; what was taken is let go, and the
    // general path below refuses or waits.
    const size_t n = pin.pages.size();
    pin.held.resize(n);
    size_t taken = 0;
    for (; taken < n; ++taken) {
      const int64_t p = pin.pages[taken];
      if (!Current(p, pin.generations[taken]) || pages_[p].writer || LayerWriter(layer, p)) break;
      SetLayerWriter(layer, p, true);
      pin.held[taken] = HoldsRecords(layer, p);
    }
    if (taken == n) {
      layer_writer_bits_ += static_cast<int64_t>(n);
      pin.frees = frees_;
      return pin;
    }
    for (size_t i = 0; i < taken; ++i) SetLayerWriter(layer, pin.pages[i], false);
  }
  KVF_RETURN_IF_ERROR(check());
  if (exclusive) {
    // Wait until no other write holds any of these pages (of this layer), then take them
    // all at once (no partial holds, so two writers cannot deadlock). A free in the
    // meantime fails the pin.
    auto none_written = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      for (int64_t p : pin.pages) {
        if (WriterHolds(p, layer)) return false;
      }
      return true;
    };
    const absl::Time give_up = absl::Now() + max_wait;
    while (!none_written()) {
      const bool free = mu_.AwaitWithTimeout(kvferry::Condition(&none_written),
                                             std::max(give_up - absl::Now(), absl::ZeroDuration()));
      KVF_RETURN_IF_ERROR(check());
      if (!free) {
        return Error(absl::StatusCode::kAborted, ErrorReason::kPagesBusy,
                     absl::StrCat("pages of pool '", pool_name_, "' were held by another write for ",
                                  absl::FormatDuration(max_wait),
                                  " (a transfer receiving into them); nothing was written"));
      }
    }
    if (layer < 0) {
      for (int64_t p : pin.pages) pages_[p].writer = true;
    } else {
      pin.held.resize(pin.pages.size());
      for (size_t i = 0; i < pin.pages.size(); ++i) {
        SetLayerWriter(layer, pin.pages[i], true);
        pin.held[i] = HoldsRecords(layer, pin.pages[i]);
      }
      layer_writer_bits_ += static_cast<int64_t>(pin.pages.size());
    }
  } else {
    for (int64_t p : pin.pages) ++readers_[p];
  }
  pin.frees = frees_;
  return pin;
}

bool PageTable::Release(int64_t p, const Pin& pin) {
  if (!pin.exclusive) {
    --readers_[p];
  } else if (pin.layer < 0) {
    pages_[p].writer = false;
  } else {
    SetLayerWriter(pin.layer, p, false);
    --layer_writer_bits_;
  }
  // No free since the pin: every pinned page is still allocated.
  return pin.frees != frees_ && pages_[p].state == State::kReclaiming && Unused(p);
}

std::vector<int64_t> PageTable::Unpin(const Pin& pin, int written_layer,
                                      std::span<const int64_t> written_tokens) {
  absl::flat_hash_map<int64_t, uint64_t> pinned;  // page → the generation pinned
  if (written_layer >= 0) {
    for (size_t i = 0; i < pin.pages.size(); ++i) pinned[pin.pages[i]] = pin.generations[i];
  }
  kvferry::MutexLock lock(&mu_);
  for (int64_t token : written_tokens) {
    const int64_t p = token / page_size_;
    // Freed (and maybe reallocated) since the pin: the records are not the holder's.
    if (Current(p, pinned.at(p))) {
      MarkWritten(written_layer, token);
    }
  }
  std::vector<int64_t> to_zero;
  for (int64_t p : pin.pages) {
    if (Release(p, pin)) to_zero.push_back(p);
  }
  return to_zero;
}

std::vector<int64_t> PageTable::UnpinWrittenPages(const Pin& pin, std::span<const int> layers,
                                                  std::span<const int64_t> written_pages) {
  // The generation each written page was pinned at: usually the pin lists exactly these
  // pages in this order (a page-form save), else looked up.
  const bool aligned = std::equal(written_pages.begin(), written_pages.end(),
                                  pin.pages.begin(), pin.pages.end());
  absl::flat_hash_map<int64_t, uint64_t> pinned;  // page → the generation pinned
  if (!aligned) {
    for (size_t i = 0; i < pin.pages.size(); ++i) pinned[pin.pages[i]] = pin.generations[i];
  }
  kvferry::MutexLock lock(&mu_);
  std::vector<int64_t> to_zero;
  const bool unchanged = pin.frees == frees_;
  for (size_t i = 0; i < written_pages.size(); ++i) {
    const int64_t p = written_pages[i];
    if (unchanged && aligned) {
      MarkPageWritten(layers[i], p);  // still allocated, at the pinned generation
    } else if (Current(p, aligned ? pin.generations[i] : pinned.at(p))) {
      MarkPageWritten(layers[i], p);
    }
    // The pin's own pages, in one pass with their marks.
    if (aligned && Release(p, pin)) to_zero.push_back(p);
  }
  if (!aligned) {
    for (int64_t p : pin.pages) {
      if (Release(p, pin)) to_zero.push_back(p);
    }
  }
  return to_zero;
}

std::vector<int64_t> PageTable::UnpinLayerPages(const Pin& pin,
                                                std::span<const int64_t> written_pages) {
  if (!pin.exclusive || pin.layer < 0) return Unpin(pin);  // not a layer's pin: no marks
  if (std::equal(written_pages.begin(), written_pages.end(), pin.pages.begin(), pin.pages.end())) {
    kvferry::MutexLock lock(&mu_);
    if (pin.frees == frees_) {
      // No page freed since the pin: every page is still allocated at its pinned generation
      // and none waits for reclaim. Mark and let go in one pass.
      for (const int64_t p : written_pages) {
        MarkPageWritten(pin.layer, p);
        SetLayerWriter(pin.layer, p, false);
      }
      layer_writer_bits_ -= static_cast<int64_t>(written_pages.size());
      return {};
    }
  }
  const std::vector<int> layers(written_pages.size(), pin.layer);
  return UnpinWrittenPages(pin, layers, written_pages);
}

std::vector<int64_t> PageTable::WrittenSlots(int layer, std::span<const int64_t> pages) const {
  std::vector<int64_t> slots;
  kvferry::ReaderMutexLock lock(&mu_);
  for (size_t i = 0; i < pages.size(); ++i) {
    for (int s = 0; s < page_size_; ++s) {
      const int64_t bit = Bit(layer, pages[i] * page_size_ + s);
      if ((written_[bit / 64] >> (bit % 64)) & 1) {
        slots.push_back(static_cast<int64_t>(i) * page_size_ + s);
      }
    }
  }
  return slots;
}

namespace {

// Calls visit(word index, mask of the range's bits in it) for each 64-bit word that the bit
// range [begin, end) touches, in order, until visit returns false.
template <typename Visit>
void ForEachWord(int64_t begin, int64_t end, Visit visit) {
  for (int64_t b = begin; b < end;) {
    const int64_t word_end = std::min(end, (b / 64 + 1) * 64);
    const int width = static_cast<int>(word_end - b);
    const uint64_t mask = (width == 64 ? ~uint64_t{0} : ((uint64_t{1} << width) - 1)) << (b % 64);
    if (!visit(b / 64, mask)) return;
    b = word_end;
  }
}

}  // namespace

bool PageTable::HoldsRecords(int layer, int64_t page) const {
  const int64_t begin = Bit(layer, page * page_size_);
  if (page_size_ % 64 == 0) {  // whole words, no masks
    const uint64_t* words = &written_[begin / 64];
    uint64_t any = 0;
    for (int w = 0; w < page_size_ / 64; ++w) any |= words[w];
    return any != 0;
  }
  bool any = false;
  ForEachWord(begin, begin + page_size_, [&](int64_t w, uint64_t mask)
                                             ABSL_NO_THREAD_SAFETY_ANALYSIS {
    any = (written_[w] & mask) != 0;
    return !any;
  });
  return any;
}

std::vector<uint8_t> PageTable::PagesWithRecords(int layer, std::span<const int64_t> pages) const {
  std::vector<uint8_t> any(pages.size(), 0);
  kvferry::ReaderMutexLock lock(&mu_);
  for (size_t i = 0; i < pages.size(); ++i) any[i] = HoldsRecords(layer, pages[i]);
  return any;
}

void PageTable::MarkPageWritten(int layer, int64_t page) {
  const int64_t token0 = page * page_size_;
  if (page_size_ % 64 == 0) {
    // Whole words (every page, in both maps, starts on a word): no masks.
    uint64_t* written = &written_[Bit(layer, token0) / 64];
    uint64_t* held = &held_[token0 / 64];
    for (int w = 0; w < page_size_ / 64; ++w) {
      // Written only when they change: another layer's save of the page set the held bits
      // already, and a line left clean stays shared among the cores reading it.
      // A fresh page's words are 0: no popcount (a library call where the build targets
      // x86-64 without POPCNT).
      if (~written[w] != 0) {
        records_held_ += written[w] == 0 ? 64 : std::popcount(~written[w]);
        written[w] = ~uint64_t{0};
      }
      if (~held[w] != 0) {
        tokens_held_ += held[w] == 0 ? 64 : std::popcount(~held[w]);
        held[w] = ~uint64_t{0};
      }
    }
    return;
  }
  const int64_t begin = Bit(layer, token0);
  ForEachWord(begin, begin + page_size_, [&](int64_t w, uint64_t mask)
                                             ABSL_NO_THREAD_SAFETY_ANALYSIS {
    uint64_t& word = written_[w];
    records_held_ += std::popcount(mask & ~word);
    word |= mask;
    return true;
  });
  MarkHeld(token0, token0 + page_size_);
}

void PageTable::MarkWritten(int layer, int64_t token) {
  const int64_t bit = Bit(layer, token);
  uint64_t& word = written_[bit / 64];
  const uint64_t mask = uint64_t{1} << (bit % 64);
  if (word & mask) return;
  word |= mask;
  ++records_held_;
  MarkHeld(token, token + 1);
}

void PageTable::MarkHeld(int64_t begin, int64_t end) {
  ForEachWord(begin, end, [&](int64_t w, uint64_t mask) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    tokens_held_ += std::popcount(mask & ~held_[w]);
    held_[w] |= mask;
    return true;
  });
}

void PageTable::ForgetRecords(int64_t page) {
  // Bits only, a word at a time: a token holds a record of some layer exactly when its held
  // bit is set, so a page with none held has no layer bit to clear.
  const int64_t token0 = page * page_size_;
  int64_t held = 0;
  ForEachWord(token0, token0 + page_size_, [&](int64_t w, uint64_t mask)
                                               ABSL_NO_THREAD_SAFETY_ANALYSIS {
    held += std::popcount(held_[w] & mask);
    held_[w] &= ~mask;
    return true;
  });
  if (held == 0) return;
  tokens_held_ -= held;
  for (int layer = 0; layer < num_layers_; ++layer) {
    const int64_t begin = Bit(layer, token0);
    ForEachWord(begin, begin + page_size_, [&](int64_t w, uint64_t mask)
                                               ABSL_NO_THREAD_SAFETY_ANALYSIS {
      records_held_ -= std::popcount(written_[w] & mask);
      written_[w] &= ~mask;
      return true;
    });
  }
}

void PageTable::MarkDeleted() {
  kvferry::MutexLock lock(&mu_);
  deleted_ = true;
}

PageTable::Counts PageTable::counts() const {
  kvferry::ReaderMutexLock lock(&mu_);
  Counts c;
  c.pages_free = static_cast<int64_t>(free_list_.size());
  c.pages_used = num_pages_ - c.pages_free;
  c.tokens_held = tokens_held_;
  c.records_held = records_held_;
  return c;
}

}  // namespace kvferry::server
