// A put of cache blocks by key into one member pool of a namespace: bf16 rows (quantized
// like WriteTokens) or already-quantized page records (like WritePages).
//
// The first piece of a key reserves the key's block (block_index.h): a page of the pool,
// evicting least recently used blocks if it is full. A key the member already holds, or
// that another put is writing, is skipped: its pieces are counted, not staged (puts are
// idempotent). Pieces are staged (staged_write.h) and validated as they arrive. Commit
// checks that every reserved block received every slot (rows) or byte (records) of every
// layer, stores them, and only then makes them visible to lookups, all at once; a put that
// fails or is dropped frees its pages (zeroed) and no lookup ever saw them. Not
// thread-safe (one stream feeds one put).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/block_index.h"
#include "core/staged_write.h"

namespace kvferry::server {

class BlockPut {
 public:
  // A put of rows (records: false) or of page records in `layout` (must be the pool's).
  static absl::StatusOr<std::unique_ptr<BlockPut>> Begin(BlockIndex* index,
                                                         const TenantAccount& owner,
                                                         const std::string& name_space,
                                                         uint64_t digest, const std::string& pool,
                                                         bool records, Layout layout,
                                                         WriteLimits limits);
  ~BlockPut();

  // Rows [n, 512] bf16 for slots [first_slot, first_slot + n) of the key's block in `layer`.
  absl::Status AddRows(const std::string& key, int64_t layer, int64_t first_slot,
                       std::span<const uint8_t> rows);
  // Bytes of the key's page in `layer` at `offset` (in order, possibly over several pieces).
  absl::Status AddPageBytes(const std::string& key, int64_t layer, uint64_t offset,
                            std::span<const uint8_t> data);

  struct Result {
    int64_t stored = 0;        // blocks this put stored
    int64_t already_held = 0;  // keys skipped: held already or written by another put
  };
  absl::StatusOr<Result> Commit();

  const Pool& pool() const { return *target_.pool; }

 private:
  struct Block {
    bool skip = false;
    PageHandle page;
    std::vector<int64_t> filled;  // per layer: rows (rows put) or bytes (records put)
  };
  BlockPut(BlockIndex* index, BlockIndex::PutTarget target, bool records, WriteLimits limits)
      : index_(index), target_(std::move(target)), records_(records), limits_(limits) {}
  // The key's block, reserved on first sight.
  absl::StatusOr<Block*> BlockOf(const std::string& key);
  absl::Status CheckLayer(int64_t layer) const { return target_.pool->CheckLayer(layer); }
  // Forgets the pending blocks and frees their pages.
  void Drop();

  BlockIndex* const index_;
  const BlockIndex::PutTarget target_;
  const bool records_;
  const WriteLimits limits_;
  std::vector<std::unique_ptr<StagedWrite>> writes_;  // rows: one per layer; records: one
  absl::flat_hash_map<std::string, Block> blocks_;
  std::vector<std::string> reserved_;  // keys with a pending block of this put, in order
  std::vector<PageHandle> pages_;      // their pages
  int64_t skipped_ = 0;
  bool done_ = false;
};

}  // namespace kvferry::server
