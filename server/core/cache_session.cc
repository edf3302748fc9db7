// SaveToCache / LoadFromCache: the cache's put and pin rules around session transfers.
#include "core/cache_session.h"

#include <memory>
#include <optional>

#include "absl/strings/str_cat.h"
#include "common/errors.h"
#include "kvferry/kernels/status_macros.h"

namespace kvferry::server {
namespace {

// At most this many blocks per call: a Lookup's key limit.
constexpr size_t kMaxBlocksPerCall = size_t{1} << 16;

absl::Status InvalidRequest(std::string message) {
  return Error(absl::StatusCode::kInvalidArgument, ErrorReason::kInvalidRequest, std::move(message));
}

}  // namespace

absl::StatusOr<CacheSaveResult> SaveToCache(SessionManager& sessions, BlockIndex& index,
                                            const CacheSaveRequest& r) {
  if (r.keys.empty() || r.keys.size() != r.blocks.size()) {
    return InvalidRequest(absl::StrCat(r.keys.size(), " keys and ", r.blocks.size(),
                                       " source blocks: give one key per block, at least one"));
  }
  if (r.keys.size() > kMaxBlocksPerCall) {
    return InvalidRequest(absl::StrCat(r.keys.size(), " keys in one save; at most ",
                                       kMaxBlocksPerCall));
  }
  for (size_t i = 0; i < r.keys.size(); ++i) KVF_RETURN_IF_ERROR(index.ValidateKey(r.keys[i], i));
  KVF_ASSIGN_OR_RETURN(const BlockIndex::PutTarget target,
                       index.BeginPut(*r.caller, r.name_space, r.digest, r.pool));
  const int64_t layers = target.pool->config().num_layers;
  if (static_cast<int64_t>(r.layer_tensors.size()) != layers) {
    return InvalidRequest(absl::StrCat("pool '", r.pool, "' has ", layers, " layers and the save ",
                                       "names ", r.layer_tensors.size(), " layer tensors: a cache ",
                                       "block holds every layer, give one tensor per layer"));
  }

  // New keys get a page each; held keys (and repeats within this save) are skipped.
  std::vector<std::string> reserved;
  std::vector<PageHandle> pages;
  std::vector<uint64_t> blocks;
  CacheSaveResult result;
  for (size_t i = 0; i < r.keys.size(); ++i) {
    absl::StatusOr<std::optional<PageHandle>> page = index.Reserve(target, r.keys[i]);
    if (!page.ok()) {
      index.Abort(target, reserved, pages);
      return page.status();
    }
    if (!page->has_value()) {
      ++result.already_held;
      continue;
    }
    reserved.push_back(r.keys[i]);
    pages.push_back(**page);
    blocks.push_back(r.blocks[i]);
  }
  if (reserved.empty()) return result;

  for (int64_t layer = 0; layer < layers; ++layer) {
    TransferRequest t;
    t.caller = r.caller;
    t.session_id = r.session_id;
    t.tensor_id = r.layer_tensors[layer];
    t.pool = r.pool;
    t.pool_id = target.pool->id();
    t.layer = layer;
    t.tensor_blocks = blocks;
    t.pages = pages;
    absl::StatusOr<int64_t> moved = sessions.Save(t);
    if (!moved.ok()) {
      index.Abort(target, reserved, pages);
      return moved.status();
    }
    result.tokens += *moved;
  }
  if (absl::Status s = index.Commit(target, reserved, pages); !s.ok()) {
    index.Abort(target, reserved, pages);  // namespace or pool gone: the pages are still ours
    return s;
  }
  result.stored = static_cast<int64_t>(reserved.size());
  return result;
}

absl::StatusOr<int64_t> LoadFromCache(SessionManager& sessions, BlockIndex& index,
                                      CacheLoadRequest r) {
  TransferRequest& t = r.transfer;
  if (t.tensor_blocks.empty() || t.tensor_blocks.size() > kMaxBlocksPerCall) {
    return InvalidRequest(absl::StrCat("a load by key names 1 to ", kMaxBlocksPerCall,
                                       " destination blocks, not ", t.tensor_blocks.size()));
  }
  if (r.first_block > (uint64_t{1} << 40)) {
    return Error(absl::StatusCode::kInvalidArgument, ErrorReason::kBlockOutOfRange,
                 "first_block is beyond any lease");
  }
  KVF_ASSIGN_OR_RETURN(std::unique_ptr<LoadPin> pin,
                       index.PinForLoad(*t.caller, r.name_space, r.digest, r.lease_id, t.pool,
                                        static_cast<int64_t>(r.first_block),
                                        static_cast<int64_t>(t.tensor_blocks.size())));
  t.pages = pin->pages();
  t.pool_id = pin->pool()->id();
  t.hold = std::shared_ptr<const LoadPin>(std::move(pin));
  return sessions.Load(t);
}

}  // namespace kvferry::server
