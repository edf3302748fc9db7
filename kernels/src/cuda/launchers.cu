// Host entry points of the CUDA ops: validate params, pick the layout's instantiation.
#include "record.cuh"
#include "kvferry/kernels/cuda_compressor.h"
#include "kvferry/kernels/validate.h"
#include "kvferry/kernels/status_macros.h"

namespace kvferry::cuda {
namespace {

absl::Status CheckTokens(int64_t num_tokens) {
  if (num_tokens < 0) {
    return absl::InvalidArgumentError(absl::StrCat("negative token count ", num_tokens));
  }
  // Grid x is limited to 2^31 - 1 blocks of 8 tokens.
  if (num_tokens > (int64_t{0x7FFFFFFF} * detail::kWarpsPerBlock)) {
    return absl::InvalidArgumentError(absl::StrCat(num_tokens, " tokens in one launch is too many"));
  }
  return absl::OkStatus();
}

absl::Status CheckAligned(const void* pointer, const char* what) {
  if (pointer == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(what, " pointer is null"));
  }
  if (reinterpret_cast<uintptr_t>(pointer) % 16 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(what, " pointer is not 16-byte aligned"));
  }
  return absl::OkStatus();
}


}  // namespace

absl::Status CudaStatus(cudaError_t error, const char* what) {
  if (error == cudaSuccess) return absl::OkStatus();
  const std::string message = absl::StrCat(what, ": ", cudaGetErrorString(error));
  switch (error) {
    case cudaErrorMemoryAllocation:
      return absl::ResourceExhaustedError(message);
    case cudaErrorInvalidValue:
    case cudaErrorInvalidDevicePointer:
      return absl::InvalidArgumentError(message);
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
      return absl::UnavailableError(message);
    default:
      return absl::InternalError(message);
  }
}

absl::Status QuantizeStore(const QuantizeStoreParams& p, cudaStream_t stream) {
  KVF_RETURN_IF_ERROR(ValidateGeometry(p.geometry));
  KVF_RETURN_IF_ERROR(CheckTokens(p.num_tokens));
  if (p.num_tokens == 0) return absl::OkStatus();
  KVF_RETURN_IF_ERROR(CheckAligned(p.rows, "rows"));
  KVF_RETURN_IF_ERROR(CheckAligned(p.pool, "pool"));
  if (p.locs == nullptr) return absl::InvalidArgumentError("locations pointer is null");
  const detail::QuantizeShape shape = detail::ChooseQuantizeShape(p.num_tokens);
  return detail::DispatchLayout(p.geometry.layout, [&](auto layout) {
    return detail::LaunchQuantizeStore<decltype(layout)::value>(p, shape, stream);
  });
}

absl::Status DequantizeGather(const DequantizeGatherParams& p, cudaStream_t stream) {
  KVF_RETURN_IF_ERROR(ValidateGeometry(p.geometry));
  KVF_RETURN_IF_ERROR(CheckTokens(p.num_tokens));
  if (p.out_row_stride < kHeadDim) {
    return absl::InvalidArgumentError(
        absl::StrCat("workspace row stride ", p.out_row_stride, " is below ", kHeadDim));
  }
  if (p.num_tokens == 0) return absl::OkStatus();
  KVF_RETURN_IF_ERROR(CheckAligned(p.pool, "pool"));
  if (p.locs == nullptr || p.out == nullptr) {
    return absl::InvalidArgumentError("locations or workspace pointer is null");
  }
  if (reinterpret_cast<uintptr_t>(p.out) % 2 != 0) {
    return absl::InvalidArgumentError("workspace pointer is not 2-byte aligned");
  }
  return detail::DispatchLayout(p.geometry.layout, [&](auto layout) {
    return detail::LaunchDequantizeGather<decltype(layout)::value>(p, stream);
  });
}

absl::Status Transcode(const TranscodeParams& p, cudaStream_t stream) {
  KVF_RETURN_IF_ERROR(ValidateGeometry(p.from));
  KVF_RETURN_IF_ERROR(ValidateGeometry(p.to));
  KVF_RETURN_IF_ERROR(CheckTokens(p.num_tokens));
  if (p.from.page_size != p.to.page_size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "transcode on the GPU keeps the page size: ", p.from.page_size, " vs ", p.to.page_size));
  }
  if (p.num_tokens == 0) return absl::OkStatus();
  KVF_RETURN_IF_ERROR(CheckAligned(p.src, "source pool"));
  KVF_RETURN_IF_ERROR(CheckAligned(p.dst, "destination pool"));
  if (p.locs == nullptr) return absl::InvalidArgumentError("locations pointer is null");
  const uint8_t* src_end = p.src + p.from.pool_bytes();
  const uint8_t* dst_end = p.dst + p.to.pool_bytes();
  if (p.src < dst_end && p.dst < src_end) {
    return absl::InvalidArgumentError("transcode source and destination pools overlap");
  }
  return detail::DispatchLayout(p.from.layout, [&](auto layout) {
    return detail::LaunchTranscode<decltype(layout)::value>(p, stream);
  });
}

}  // namespace kvferry::cuda

namespace kvferry::cuda {
namespace detail {
template <Layout L>
absl::Status LaunchCompress(const CompressorParams& p, const CompressorWindows& w,
                            cudaStream_t stream);
}  // namespace detail

absl::Status Compress(const CompressorParams& p, cudaStream_t stream) {
  KVF_RETURN_IF_ERROR(ValidateCompressorParams(p));
  const CompressorWindows w = CompressorEntries(p.ratio, p.first_position, p.num_rows);
  if (w.count == 0) return absl::OkStatus();
  if (w.count > int64_t{0x7FFFFFFF} / 4) {  // ratio 128 runs 4 CTAs per entry
    return absl::InvalidArgumentError(absl::StrCat(w.count, " entries in one launch is too many"));
  }
  for (const void* pointer : {static_cast<const void*>(p.kv), static_cast<const void*>(p.score),
                              static_cast<const void*>(p.norm_weight)}) {
    if (pointer != nullptr && reinterpret_cast<uintptr_t>(pointer) % 16 != 0) {
      return absl::InvalidArgumentError("compressor inputs must be 16-byte aligned");
    }
  }
  if (reinterpret_cast<uintptr_t>(p.rope_cos) % 8 != 0 ||
      reinterpret_cast<uintptr_t>(p.rope_sin) % 8 != 0 ||
      (p.pre_quant_rows != nullptr && reinterpret_cast<uintptr_t>(p.pre_quant_rows) % 8 != 0)) {
    return absl::InvalidArgumentError("RoPE tables and row output must be 8-byte aligned");
  }
  return detail::DispatchLayout(p.geometry.layout, [&](auto layout) {
    return detail::LaunchCompress<decltype(layout)::value>(p, w, stream);
  });
}

}  // namespace kvferry::cuda
