// Timing helpers shared by the CUDA benchmarks: CUDA-event medians, per-launch time by CUDA
// graph replay, and the device-to-device copy bandwidth used as a ceiling.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <functional>
#include <vector>

#include "common/cuda_testing.h"

namespace kvferry::bench {

// Median milliseconds of `reps` timed runs of `body` on the default stream (after two
// warm-ups).
inline double MedianMs(int reps, const std::function<void()>& body) {
  cudaEvent_t start, stop;
  testing::CudaCheck(cudaEventCreate(&start), "event");
  testing::CudaCheck(cudaEventCreate(&stop), "event");
  body();
  body();
  std::vector<float> times;
  for (int i = 0; i < reps; ++i) {
    testing::CudaCheck(cudaEventRecord(start), "record");
    body();
    testing::CudaCheck(cudaEventRecord(stop), "record");
    testing::CudaCheck(cudaEventSynchronize(stop), "sync");
    float ms;
    testing::CudaCheck(cudaEventElapsedTime(&ms, start, stop), "elapsed");
    times.push_back(ms);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

// Median microseconds per launch: `launches` calls of `launch` captured in one CUDA graph,
// the graph replayed reps (+3 warm-up) times.
inline double GraphLaunchUs(int reps, int launches,
                            const std::function<void(cudaStream_t)>& launch) {
  cudaStream_t stream;
  testing::CudaCheck(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  testing::CudaCheck(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), "capture");
  for (int i = 0; i < launches; ++i) launch(stream);
  testing::CudaCheck(cudaStreamEndCapture(stream, &graph), "end capture");
  testing::CudaCheck(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  std::vector<float> times;
  for (int i = 0; i < reps + 3; ++i) {
    cudaEventRecord(start, stream);
    testing::CudaCheck(cudaGraphLaunch(exec, stream), "graph launch");
    cudaEventRecord(stop, stream);
    testing::CudaCheck(cudaEventSynchronize(stop), "sync");
    float ms;
    cudaEventElapsedTime(&ms, start, stop);
    if (i >= 3) times.push_back(ms);
  }
  std::sort(times.begin(), times.end());
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return 1000.0 * times[times.size() / 2] / launches;
}

// Device-to-device copy of 1 GiB, in bytes read + written per second: the ceiling.
inline double CopyBandwidth(int reps) {
  const size_t bytes = size_t{1} << 30;
  testing::DeviceBuffer a(bytes), b(bytes);
  const double ms = MedianMs(reps, [&] {
    testing::CudaCheck(
        cudaMemcpyAsync(b.as<void>(), a.as<void>(), bytes, cudaMemcpyDeviceToDevice), "copy");
  });
  return 2.0 * bytes / (ms * 1e-3);
}

}  // namespace kvferry::bench
