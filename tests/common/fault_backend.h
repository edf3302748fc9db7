// A backend that fails on request: wraps another backend and fails its Nth allocation,
// copy or kernel op (counted together, in call order) with an error, running nothing of
// that op. For testing that every failure leaves a pool as it was.
#pragma once

#include <atomic>
#include <memory>

#include "backend/backend.h"
#include "common/errors.h"

namespace kvferry::testing {

class FaultBackend final : public server::Backend {
 public:
  explicit FaultBackend(std::shared_ptr<server::Backend> inner) : inner_(std::move(inner)) {}

  // Fail event number `n` (1-based) from now on; 0 never fails. Events counted: Allocate
  // and each op of Submit.
  void FailAt(int64_t n) {
    events_ = 0;
    fail_at_ = n;
  }
  // While on, every Allocate fails (a device with no memory left); ops still run.
  void FailAllocations(bool on) { fail_allocations_ = on; }
  int64_t events() const { return events_; }
  bool fired() const { return fired_; }

  const std::string& device() const override { return inner_->device(); }
  absl::StatusOr<uint64_t> FreeBytes() override { return inner_->FreeBytes(); }

  absl::StatusOr<server::Buffer> Allocate(size_t bytes, server::MemoryKind kind,
                                          bool zero) override {
    if (Fire() || fail_allocations_) {
      return server::Error(absl::StatusCode::kResourceExhausted,
                           server::ErrorReason::kDeviceOutOfMemory, "injected allocation failure");
    }
    return inner_->Allocate(bytes, kind, zero);
  }

  absl::StatusOr<server::Completion> Submit(std::span<const server::Op> ops) override {
    for (const server::Op& op : ops) {
      if (Fire()) {
        return server::Error(absl::StatusCode::kInternal, server::ErrorReason::kDeviceError,
                             std::string("injected failure of ") + server::OpName(op));
      }
      absl::Status s = inner_->Run(op);
      if (!s.ok()) return s;
    }
    return server::Completion();
  }

 protected:
  // Memory is allocated by the inner backend, whose Buffer releases it there.
  void Release(server::MemoryKind, void*, size_t) override {}

 private:
  bool Fire() {
    const int64_t n = ++events_;
    if (fail_at_ > 0 && n == fail_at_) {
      fired_ = true;
      return true;
    }
    return false;
  }

  const std::shared_ptr<server::Backend> inner_;
  std::atomic<int64_t> events_{0};
  std::atomic<int64_t> fail_at_{0};
  std::atomic<bool> fired_{false};
  std::atomic<bool> fail_allocations_{false};
};

}  // namespace kvferry::testing
