// Names the calling thread as `top -H`, `ps -L`, gdb, perf and /proc/<pid>/task/*/comm show
// it, so that an operator can tell kvferry's threads (all "kvf-...") from the libraries'
// (gRPC's, UCX's) and see which one spins or blocks. Linux keeps 15 characters; the threads
// a named thread starts inherit its name.
#pragma once

#include <pthread.h>

#include <string>

namespace kvferry {

inline void NameThisThread(std::string name) {
  if (name.size() > 15) name.resize(15);
  pthread_setname_np(pthread_self(), name.c_str());
}

}  // namespace kvferry
