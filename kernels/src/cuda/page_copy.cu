// Page gather/scatter between a layer-stacked pool and a transfer buffer, and page zeroing.
#include "kvferry/kernels/status_macros.h"
#include "kvferry/kernels/validate.h"
#include "record.cuh"

namespace kvferry::cuda::detail {
namespace {

constexpr int kCopyThreads = 256;

// What a page launch does with each listed (page, layer).
enum class PageOp { kGather, kScatter, kZero };

// One block per (listed page, layer): moves (or zeroes) page_bytes / sizeof(Word) words.
template <PageOp kOp, typename Word>
__global__ void __launch_bounds__(kCopyThreads)
    PageCopyKernel(uint8_t* __restrict__ pool, const int64_t* __restrict__ pages,
                   int num_layers, int64_t num_pages, int64_t page_bytes,
                   uint8_t* __restrict__ buffer,                 // unused by kZero
                   const int64_t* __restrict__ buffer_pages) {  // [listed] or null
  WaitForPrerequisiteGrid();
  AllowDependentGridLaunch();
  const int64_t unit = blockIdx.x;  // listed * num_layers + layer
  const int64_t listed = unit / num_layers;
  const int64_t layer = unit - listed * num_layers;
  const int64_t page = __ldg(pages + listed);
  if (page < 0 || page >= num_pages) return;
  Word* pool_page = reinterpret_cast<Word*>(pool + (layer * num_pages + page) * page_bytes);
  const int64_t words = page_bytes / static_cast<int64_t>(sizeof(Word));
  if constexpr (kOp == PageOp::kZero) {
    for (int64_t i = threadIdx.x; i < words; i += kCopyThreads) pool_page[i] = Word{};
  } else {
    const int64_t buffer_unit =
        buffer_pages != nullptr ? __ldg(buffer_pages + listed) * num_layers + layer : unit;
    Word* buffer_page = reinterpret_cast<Word*>(buffer + buffer_unit * page_bytes);
    for (int64_t i = threadIdx.x; i < words; i += kCopyThreads) {
      if constexpr (kOp == PageOp::kGather) {
        buffer_page[i] = pool_page[i];
      } else {
        pool_page[i] = buffer_page[i];
      }
    }
  }
}

template <PageOp kOp>
absl::Status LaunchPageCopy(const PageCopyParams& p, cudaStream_t stream) {
  constexpr bool kZero = kOp == PageOp::kZero;
  const PageCopyGeometry& g = p.geometry;
  KVF_RETURN_IF_ERROR(ValidatePageCopyGeometry(g));
  if (p.num_listed < 0) {
    return absl::InvalidArgumentError(absl::StrCat("negative page count ", p.num_listed));
  }
  if (p.num_listed == 0) return absl::OkStatus();
  if (p.pool == nullptr || p.pages == nullptr || (!kZero && p.buffer == nullptr)) {
    return absl::InvalidArgumentError(kZero ? "page zeroing needs pool and pages pointers"
                                            : "page copy needs pool, pages and buffer pointers");
  }
  const int64_t units = p.num_listed * g.num_layers;
  if (units > int64_t{0x7FFFFFFF}) {
    return absl::InvalidArgumentError(
        absl::StrCat(units, " page-layers in one ", kZero ? "launch" : "copy", " is too many"));
  }
  const bool aligned = g.page_bytes % 16 == 0 && reinterpret_cast<uintptr_t>(p.pool) % 16 == 0 &&
                       (kZero || reinterpret_cast<uintptr_t>(p.buffer) % 16 == 0);
  const char* name = kOp == PageOp::kGather    ? "PageCopyKernel<gather>"
                     : kOp == PageOp::kScatter ? "PageCopyKernel<scatter>"
                                               : "PageCopyKernel<zero>";
  return LaunchKernel(aligned ? PageCopyKernel<kOp, uint4> : PageCopyKernel<kOp, uint8_t>,
                      units, kCopyThreads, stream, name, p.pool, p.pages, g.num_layers,
                      g.num_pages, g.page_bytes, p.buffer, p.buffer_pages);
}

}  // namespace
}  // namespace kvferry::cuda::detail

namespace kvferry::cuda {

absl::Status GatherPages(const PageCopyParams& params, cudaStream_t stream) {
  return detail::LaunchPageCopy<detail::PageOp::kGather>(params, stream);
}

absl::Status ScatterPages(const PageCopyParams& params, cudaStream_t stream) {
  return detail::LaunchPageCopy<detail::PageOp::kScatter>(params, stream);
}

absl::Status ZeroPages(const PageCopyParams& params, cudaStream_t stream) {
  return detail::LaunchPageCopy<detail::PageOp::kZero>(params, stream);
}

}  // namespace kvferry::cuda
