// BlockPut: reserve blocks by key, stage their rows or records, commit all or nothing.
#include "core/block_put.h"

#include "absl/strings/str_cat.h"
#include "common/errors.h"
#include "common/log.h"
#include "kvferry/kernels/status_macros.h"

namespace kvferry::server {

absl::StatusOr<std::unique_ptr<BlockPut>> BlockPut::Begin(BlockIndex* index,
                                                          const TenantAccount& owner,
                                                          const std::string& name_space,
                                                          uint64_t digest, const std::string& pool,
                                                          bool records, Layout layout,
                                                          WriteLimits limits) {
  KVF_ASSIGN_OR_RETURN(BlockIndex::PutTarget target,
                       index->BeginPut(owner, name_space, digest, pool));
  auto put = std::unique_ptr<BlockPut>(new BlockPut(index, std::move(target), records, limits));
  const int layers = put->target_.pool->config().num_layers;
  if (records) {
    KVF_ASSIGN_OR_RETURN(std::unique_ptr<StagedWrite> write,
                         StagedWrite::ForPages(put->target_.pool, layout, limits));
    put->writes_.push_back(std::move(write));
  } else {
    put->writes_.resize(layers);  // made on first use
  }
  return put;
}

BlockPut::~BlockPut() {
  if (!done_) Drop();
}

void BlockPut::Drop() {
  done_ = true;
  index_->Abort(target_, reserved_, pages_);
  reserved_.clear();
  pages_.clear();
}

absl::StatusOr<BlockPut::Block*> BlockPut::BlockOf(const std::string& key) {
  KVF_RETURN_IF_ERROR(index_->ValidateKey(key, blocks_.size()));
  auto [it, inserted] = blocks_.try_emplace(key);
  if (!inserted) return &it->second;
  absl::StatusOr<std::optional<PageHandle>> page = index_->Reserve(target_, key);
  if (!page.ok()) {
    blocks_.erase(it);
    return page.status();
  }
  Block& b = it->second;
  if (!page->has_value()) {
    b.skip = true;
    ++skipped_;
    return &b;
  }
  b.page = **page;
  b.filled.assign(target_.pool->config().num_layers, 0);
  reserved_.push_back(key);
  pages_.push_back(b.page);
  return &b;
}

absl::Status BlockPut::AddRows(const std::string& key, int64_t layer, int64_t first_slot,
                               std::span<const uint8_t> rows) {
  if (records_ || done_) {
    return Error(absl::StatusCode::kInvalidArgument, ErrorReason::kInvalidRequest,
                 "rows sent to a put of records");
  }
  KVF_RETURN_IF_ERROR(CheckLayer(layer));
  const int64_t page_size = target_.pool->config().page_size;
  if (rows.size() % kBf16RowBytes != 0 || rows.empty()) {
    return Error(absl::StatusCode::kInvalidArgument, ErrorReason::kBadRowLength,
                 absl::StrCat("a piece of ", rows.size(), " bytes of rows: expected a positive "
                              "multiple of ", kBf16RowBytes));
  }
  const int64_t n = static_cast<int64_t>(rows.size()) / kBf16RowBytes;
  if (first_slot < 0 || first_slot + n > page_size) {
    return Error(absl::StatusCode::kInvalidArgument, ErrorReason::kSlotOutOfRange,
                 absl::StrCat("slots [", first_slot, ", ", first_slot + n,
                              ") are outside a block of ", page_size));
  }
  KVF_ASSIGN_OR_RETURN(Block* b, BlockOf(key));
  if (b->skip) return absl::OkStatus();
  std::unique_ptr<StagedWrite>& write = writes_[layer];
  if (write == nullptr) {
    KVF_ASSIGN_OR_RETURN(write, StagedWrite::ForRows(target_.pool, layer, limits_));
  }
  int64_t staged = 0;  // bytes of rows
  for (const auto& w : writes_) staged += w != nullptr ? w->staged_rows() * kBf16RowBytes : 0;
  if (staged + static_cast<int64_t>(rows.size()) > limits_.max_bytes) {
    return Error(absl::StatusCode::kResourceExhausted, ErrorReason::kWriteTooLarge,
                 absl::StrCat("put of more than ", limits_.max_bytes,
                              " bytes; split it into several puts"));
  }
  std::vector<TokenLocation> where(n);
  for (int64_t i = 0; i < n; ++i) where[i] = TokenLocation{b->page, static_cast<uint32_t>(first_slot + i)};
  KVF_RETURN_IF_ERROR(write->AddRows(where, rows));
  b->filled[layer] += n;
  return absl::OkStatus();
}

absl::Status BlockPut::AddPageBytes(const std::string& key, int64_t layer, uint64_t offset,
                                    std::span<const uint8_t> data) {
  if (!records_ || done_) {
    return Error(absl::StatusCode::kInvalidArgument, ErrorReason::kInvalidRequest,
                 "records sent to a put of rows");
  }
  KVF_RETURN_IF_ERROR(CheckLayer(layer));
  if (data.empty()) {
    return Error(absl::StatusCode::kInvalidArgument, ErrorReason::kInvalidRequest,
                 "a piece of a block carries no bytes");
  }
  KVF_ASSIGN_OR_RETURN(Block* b, BlockOf(key));
  if (b->skip) return absl::OkStatus();
  KVF_RETURN_IF_ERROR(writes_[0]->AddPageBytes(b->page, layer, offset, data));
  b->filled[layer] += static_cast<int64_t>(data.size());
  return absl::OkStatus();
}

absl::StatusOr<BlockPut::Result> BlockPut::Commit() {
  if (done_) {
    return Error(absl::StatusCode::kInternal, ErrorReason::kInternalError, "put committed twice");
  }
  const absl::Status stored = [&]() -> absl::Status {
    if (blocks_.empty()) {
      return Error(absl::StatusCode::kInvalidArgument, ErrorReason::kEmptyWrite,
                   "empty put: no blocks");
    }
    const int64_t full = records_ ? target_.pool->geometry().page_bytes()
                                  : target_.pool->config().page_size;
    for (const std::string& key : reserved_) {
      const Block& b = blocks_.at(key);
      for (size_t layer = 0; layer < b.filled.size(); ++layer) {
        if (b.filled[layer] != full) {
          return Error(absl::StatusCode::kInvalidArgument, ErrorReason::kBlockIncomplete,
                       absl::StrCat("block ", log::Quoted(key), " layer ", layer, " received ",
                                    b.filled[layer], " of ", full,
                                    records_ ? " bytes" : " rows", "; nothing was stored"));
        }
      }
    }
    for (const auto& write : writes_) {
      if (write != nullptr) KVF_RETURN_IF_ERROR(write->Commit().status());
    }
    return index_->Commit(target_, reserved_, pages_);
  }();
  if (!stored.ok()) {
    Drop();
    return stored;
  }
  done_ = true;
  return Result{static_cast<int64_t>(reserved_.size()), skipped_};
}

}  // namespace kvferry::server
