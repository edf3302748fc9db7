// Save and Load between a session's registered tensors (session.h) and the KV cache's
// blocks by key (block_index.h): a worker stores the blocks it computed under their keys,
// and loads a lease's hits into its blocks, with the daemon's kernels in place (no byte
// crosses gRPC or host memory).
//
// A save reserves a page per new key in the member pool (evicting as a put does), runs the
// session's page-form Save into those pages for every layer of the pool, and only then
// commits the blocks to the index, all at once; anything failing on the way frees the
// reserved pages (zeroed) and no lookup ever saw them. A load pins the lease's blocks for
// its duration (an asynchronous one until its device work ends) and runs the session's
// page-form Load from their pages. No gRPC.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/block_index.h"
#include "core/session.h"

namespace kvferry::server {

struct CacheSaveRequest {
  const TenantAccount* caller = nullptr;
  uint64_t session_id = 0;
  std::string name_space;
  uint64_t digest = 0;
  std::string pool;                    // the member pool
  std::vector<std::string> keys;       // pairwise with blocks
  std::vector<uint64_t> blocks;        // the tensors' block ids
  std::vector<uint64_t> layer_tensors;  // the tensor of each layer of the pool, in order
};

struct CacheSaveResult {
  int64_t stored = 0;        // new blocks
  int64_t already_held = 0;  // keys skipped: held, or being written by another put
  int64_t tokens = 0;        // tokens moved over all layers
};

// Synchronous: every layer is in place and the blocks visible when it returns OK.
absl::StatusOr<CacheSaveResult> SaveToCache(SessionManager& sessions, BlockIndex& index,
                                            const CacheSaveRequest& request);

struct CacheLoadRequest {
  // The session's page-form Load (tensor, pool, layer, tensor_blocks, async); its pages
  // are the lease's blocks [first_block, first_block + tensor_blocks.size()).
  TransferRequest transfer;
  std::string name_space;
  uint64_t digest = 0;
  uint64_t lease_id = 0;
  uint64_t first_block = 0;
};

// As SessionManager::Load: tokens moved, 0 for an asynchronous request.
absl::StatusOr<int64_t> LoadFromCache(SessionManager& sessions, BlockIndex& index,
                                      CacheLoadRequest request);

}  // namespace kvferry::server
