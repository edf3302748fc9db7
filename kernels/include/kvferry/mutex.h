// kvferry's mutex: absl::Mutex, except under ThreadSanitizer, where a std::shared_mutex with
// the same interface (the subset kvferry uses) stands in.
//
// Why: the distributions' Abseil is not built with TSan, so absl::Mutex's lock and unlock
// are invisible to it and every access a mutex guards would be reported as a race. The
// stand-in locks through pthreads, which TSan intercepts. Both carry the same
// thread-safety annotations, so clang's -Wthread-safety checks either.
#pragma once

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

#if defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define KVFERRY_STD_MUTEX 1
#endif
#endif
#if defined(__SANITIZE_THREAD__)
#define KVFERRY_STD_MUTEX 1
#endif

#ifdef KVFERRY_STD_MUTEX
#include <chrono>
#include <concepts>
#include <condition_variable>
#include <functional>
#include <shared_mutex>

#include "absl/time/time.h"
#endif

namespace kvferry {

#ifndef KVFERRY_STD_MUTEX

using Mutex = absl::Mutex;
using MutexLock = absl::MutexLock;
using ReaderMutexLock = absl::ReaderMutexLock;
using Condition = absl::Condition;

#else

// absl::Condition's constructors that kvferry uses: a callable or a bool by pointer, a
// function with its argument, an object and its member function.
class Condition {
 public:
  explicit Condition(const bool* flag) : eval_([flag]() ABSL_NO_THREAD_SAFETY_ANALYSIS { return *flag; }) {}
  template <typename F>
    requires std::invocable<const F&>
  explicit Condition(const F* callable) : eval_([callable]() ABSL_NO_THREAD_SAFETY_ANALYSIS { return (*callable)(); }) {}
  template <typename T>
  Condition(bool (*fn)(T*), T* arg) : eval_([fn, arg]() ABSL_NO_THREAD_SAFETY_ANALYSIS { return fn(arg); }) {}
  template <typename T>
  Condition(T* object, bool (T::*method)()) : eval_([object, method]() ABSL_NO_THREAD_SAFETY_ANALYSIS { return (object->*method)(); }) {}
  template <typename T>
  Condition(const T* object, bool (T::*method)() const)
      : eval_([object, method]() ABSL_NO_THREAD_SAFETY_ANALYSIS { return (object->*method)(); }) {}

  bool Eval() const { return eval_(); }

 private:
  std::function<bool()> eval_;
};

class ABSL_LOCKABLE Mutex {
 public:
  void Lock() ABSL_EXCLUSIVE_LOCK_FUNCTION() { mu_.lock(); }
  // Waiters re-check their conditions whenever the state they read may have changed: at
  // every exclusive unlock, as absl::Mutex does.
  void Unlock() ABSL_UNLOCK_FUNCTION() {
    mu_.unlock();
    changed_.notify_all();
  }
  void ReaderLock() ABSL_SHARED_LOCK_FUNCTION() { mu_.lock_shared(); }
  void ReaderUnlock() ABSL_UNLOCK_FUNCTION() { mu_.unlock_shared(); }
  void AssertHeld() const ABSL_ASSERT_EXCLUSIVE_LOCK() {}
  void AssertReaderHeld() const ABSL_ASSERT_SHARED_LOCK() {}

  // Held exclusively: returns once `condition` holds, the lock held again. Waiting
  // releases the lock, which is an unlock like any other: what this thread changed while
  // holding it (a job queued, then awaited) must wake the others' conditions first, as
  // absl::Mutex re-evaluates them there — else both sides sleep.
  void Await(const Condition& condition) ABSL_EXCLUSIVE_LOCKS_REQUIRED(this) {
    if (condition.Eval()) return;
    changed_.notify_all();
    do {
      changed_.wait(mu_);
    } while (!condition.Eval());
  }
  // As Await, giving up after `timeout`; returns whether `condition` holds.
  bool AwaitWithTimeout(const Condition& condition, absl::Duration timeout)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(this) {
    if (condition.Eval()) return true;
    changed_.notify_all();
    const auto deadline = std::chrono::steady_clock::now() + absl::ToChronoNanoseconds(timeout);
    do {
      if (changed_.wait_until(mu_, deadline) == std::cv_status::timeout) return condition.Eval();
    } while (!condition.Eval());
    return true;
  }

 private:
  std::shared_mutex mu_;
  std::condition_variable_any changed_;
};

class ABSL_SCOPED_LOCKABLE MutexLock {
 public:
  explicit MutexLock(Mutex* mu) ABSL_EXCLUSIVE_LOCK_FUNCTION(mu) : mu_(mu) { mu_->Lock(); }
  ~MutexLock() ABSL_UNLOCK_FUNCTION() { mu_->Unlock(); }
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

 private:
  Mutex* const mu_;
};

class ABSL_SCOPED_LOCKABLE ReaderMutexLock {
 public:
  explicit ReaderMutexLock(Mutex* mu) ABSL_SHARED_LOCK_FUNCTION(mu) : mu_(mu) { mu_->ReaderLock(); }
  ~ReaderMutexLock() ABSL_UNLOCK_FUNCTION() { mu_->ReaderUnlock(); }
  ReaderMutexLock(const ReaderMutexLock&) = delete;
  ReaderMutexLock& operator=(const ReaderMutexLock&) = delete;

 private:
  Mutex* const mu_;
};

#endif

}  // namespace kvferry
