// Per-token row offsets and pool locations of whole blocks moved to whole pages.
#include "kvferry/kernels/status_macros.h"
#include "record.cuh"

namespace kvferry::cuda {
namespace {

constexpr int kExpandThreads = 256;

__global__ void __launch_bounds__(kExpandThreads)
    ExpandBlockIndicesKernel(const int64_t* __restrict__ blocks, const int64_t* __restrict__ pages,
                             int64_t num_tokens, int page_size, int64_t row0, int64_t block_stride,
                             int64_t token_stride, int64_t* __restrict__ row_offsets,
                             int64_t* __restrict__ locs) {
  detail::WaitForPrerequisiteGrid();  // launched with programmatic serialization allowed
  const int64_t token = static_cast<int64_t>(blockIdx.x) * kExpandThreads + threadIdx.x;
  if (token >= num_tokens) return;
  const int64_t listed = token / page_size;
  const int64_t t = token - listed * page_size;
  row_offsets[token] = row0 + __ldg(blocks + listed) * block_stride + t * token_stride;
  locs[token] = __ldg(pages + listed) * page_size + t;
}

}  // namespace

absl::Status ExpandBlockIndices(const ExpandBlockIndicesParams& p, cudaStream_t stream) {
  if (p.num_listed < 0 || p.page_size <= 0) {
    return absl::InvalidArgumentError("index expansion needs a page size and a page count");
  }
  if (p.num_listed == 0) return absl::OkStatus();
  if (p.blocks == nullptr || p.pages == nullptr || p.row_offsets == nullptr || p.locs == nullptr) {
    return absl::InvalidArgumentError("index expansion needs all four arrays");
  }
  const int64_t tokens = p.num_listed * p.page_size;
  return detail::LaunchKernel(ExpandBlockIndicesKernel, (tokens + kExpandThreads - 1) / kExpandThreads,
                              kExpandThreads, stream, "ExpandBlockIndicesKernel", p.blocks, p.pages,
                              tokens, p.page_size, p.row0, p.block_stride, p.token_stride,
                              p.row_offsets, p.locs);
}

}  // namespace kvferry::cuda
