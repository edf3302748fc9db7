// Soak: well-behaved clients (tenant "good") run allocate → WriteTokens → ReadPages →
// ReadWorkspace → free cycles against a real kvferryd for a phase alone, then for a phase
// beside hostile clients (tenant "evil", its own quotas): streams opened and left idle,
// reads never read, pools created until refused, writes staged and never finished. Every
// second the daemon's RSS, threads and the good tenant's pages are sampled. Prints the good
// clients' cycle latency (p50/p99) per phase and the samples' ranges.
//
// Usage: soak_bench [--seconds S] [--clients N] [--check]
//   --seconds  length of each phase (default 60); --check: exit 1 when a good client's call
//   failed, or after the hostile phase the daemon did not come back to its quiet state
//   (threads, pages and RSS bounds below) — ctest runs it briefly that way.
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/random_rows.h"
#include "integration/daemon_harness.h"
#include "kvferry/client/client.h"
#include "kvferry/v1/kvferry.grpc.pb.h"
#include "security/token_file.h"

namespace {

using Clock = std::chrono::steady_clock;
namespace v1 = kvferry::v1;
namespace client = kvferry::client;

struct ProcSample {
  long rss_kib = 0;
  int threads = 0;
};

ProcSample Sample(pid_t pid) {
  return {kvferry::testing::ProcStatus(pid, "VmRSS"),
          static_cast<int>(kvferry::testing::ProcStatus(pid, "Threads"))};
}

double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(p * v.size()))];
}

// One well-behaved client: its own pool, cycles until `stop`.
void Good(const std::string& target, int id, std::atomic<bool>& stop, std::mutex& mu,
          std::vector<double>& latencies, std::atomic<int>& failures, std::string& last_error) {
  client::ClientOptions o;
  o.target = target;
  o.bearer_token = "tok-good";
  auto c = *client::Client::Connect(o);
  const std::string pool = "g" + std::to_string(id);
  if (!c->CreatePool({pool, client::Layout::kV41, 64, 64, 1, "cpu"}).ok()) {
    ++failures;
    return;
  }
  const auto rows = kvferry::testing::RandomRows(256, id);
  std::vector<uint16_t> back(256 * 512);
  while (!stop) {
    const auto start = Clock::now();
    absl::Status s;
    auto pages = c->AllocatePages(pool, 4);
    if (!pages.ok()) {
      s = pages.status();
    } else {
      std::vector<client::TokenLocation> where;
      for (const auto& p : *pages) {
        for (uint32_t t = 0; t < 64; ++t) where.push_back({p, t});
      }
      if (s.ok()) s = c->WriteTokens(pool, 0, where, rows).status();
      if (s.ok()) s = c->ReadPages(pool, *pages).status();
      if (s.ok()) s = c->ReadWorkspaceInto(pool, 0, where, back);
      const absl::Status freed = c->FreePages(pool, *pages);
      if (s.ok()) s = freed;
    }
    const double us = std::chrono::duration<double, std::micro>(Clock::now() - start).count();
    std::lock_guard<std::mutex> lock(mu);
    if (s.ok()) {
      latencies.push_back(us);
    } else {
      ++failures;
      last_error = s.ToString();
    }
  }
}

// Hostile clients of tenant "evil" until `stop`: four kinds at once.
void Evil(const std::string& target, int kind, const std::vector<client::PageHandle>& pages,
          std::atomic<bool>& stop) {
  auto channel = grpc::CreateChannel(target, grpc::InsecureChannelCredentials());
  auto stub = v1::KvFerry::NewStub(channel);
  auto context = [] {
    auto ctx = std::make_unique<grpc::ClientContext>();
    ctx->AddMetadata("authorization", "Bearer tok-evil");
    return ctx;
  };
  while (!stop) {
    switch (kind) {
      case 0: {  // writes that name a pool and never send a row: held until refused or timed out
        auto ctx = context();
        v1::WriteResponse resp;
        auto w = stub->WriteTokens(ctx.get(), &resp);
        v1::WriteTokensRequest m;
        m.set_pool("e0");
        w->Write(m);
        for (int i = 0; i < 60 && !stop; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(100));
        ctx->TryCancel();
        w->Finish();
        break;
      }
      case 1: {  // a read of every page in small chunks, never read
        auto ctx = context();
        v1::ReadPagesRequest req;
        req.set_pool("e0");
        req.set_chunk_bytes(4096);
        for (const auto& p : pages) {
          auto* h = req.add_pages();
          h->set_page_id(p.page_id);
          h->set_generation(p.generation);
        }
        auto r = stub->ReadPages(ctx.get(), req);
        for (int i = 0; i < 30 && !stop; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(100));
        ctx->TryCancel();
        r->Finish();
        break;
      }
      case 2: {  // pools until refused, then all deleted
        int made = 0;
        for (; made < 100000 && !stop; ++made) {
          auto ctx = context();
          v1::CreatePoolRequest req;
          req.set_name("spam" + std::to_string(made));
          req.set_layout(v1::LAYOUT_V4);
          req.set_page_size(64);
          req.set_num_pages(16);
          req.set_device("cpu");
          v1::Pool pool;
          if (!stub->CreatePool(ctx.get(), req, &pool).ok()) break;
        }
        for (int i = 0; i < made; ++i) {
          auto ctx = context();
          v1::DeletePoolRequest req;
          req.set_name("spam" + std::to_string(i));
          v1::DeletePoolResponse resp;
          stub->DeletePool(ctx.get(), req, &resp);
        }
        break;
      }
      default: {  // a write staging 1 MiB messages until refused, never finished
        auto ctx = context();
        v1::WriteResponse resp;
        auto w = stub->WriteTokens(ctx.get(), &resp);
        // Each message 512 distinct tokens of the tenant's pages, 1 MiB of rows.
        for (int i = 0; i * 512 < static_cast<int>(pages.size()) * 64 && !stop; ++i) {
          v1::WriteTokensRequest msg;
          if (i == 0) msg.set_pool("e0");
          for (int t = i * 512; t < (i + 1) * 512; ++t) {
            auto* l = msg.add_locations();
            l->mutable_page()->set_page_id(pages[t / 64].page_id);
            l->mutable_page()->set_generation(pages[t / 64].generation);
            l->set_slot(t % 64);
          }
          msg.mutable_rows()->assign(512 * 1024, '\0');  // zeros: finite rows
          if (!w->Write(msg)) break;
        }
        ctx->TryCancel();
        w->Finish();
        break;
      }
    }
  }
}

struct Phase {
  std::vector<double> latencies;
  int failures = 0;
  std::string last_error;
  long rss_min = 1L << 40, rss_max = 0;
  int threads_min = 1 << 30, threads_max = 0;
};

}  // namespace

int main(int argc, char** argv) {
  double seconds = 60;
  int clients = 4;
  bool check = false;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--seconds") && i + 1 < argc) seconds = std::atof(argv[++i]);
    else if (!std::strcmp(argv[i], "--clients") && i + 1 < argc) clients = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--check")) check = true;
    else {
      std::fprintf(stderr, "usage: soak_bench [--seconds S] [--clients N] [--check]\n");
      return 2;
    }
  }
  char dir[] = "/tmp/kvferry-soak-XXXXXX";
  if (mkdtemp(dir) == nullptr) return 1;
  const std::string tokens = std::string(dir) + "/tokens";
  {
    std::ofstream f(tokens);
    f << "good " << kvferry::server::Sha256Hex("tok-good") << "\n"
      << "evil " << kvferry::server::Sha256Hex("tok-evil")
      << " pools=64 streams=8 staged_write_bytes=8M pages=4096\n";
  }
  kvferry::testing::Daemon d({"--auth_tokens=" + tokens, "--stream_idle_timeout_seconds=3",
                              "--default_device=cpu"});
  const std::string target = "127.0.0.1:" + std::to_string(d.grpc_port());
  std::vector<client::PageHandle> evil_pages;  // the hostile tenant's pool, all allocated
  {
    client::ClientOptions o;
    o.target = target;
    o.bearer_token = "tok-evil";
    auto c = *client::Client::Connect(o);
    if (!c->CreatePool({"e0", client::Layout::kV41, 64, 64, 1, "cpu"}).ok()) return 1;
    auto pages = c->AllocatePages("e0", 64);
    if (!pages.ok()) return 1;
    evil_pages = *pages;
  }
  client::ClientOptions good_options;
  good_options.target = target;
  good_options.bearer_token = "tok-good";
  auto good_client = *client::Client::Connect(good_options);

  Phase phases[2];
  for (int p = 0; p < 2; ++p) {
    Phase& phase = phases[p];
    std::atomic<bool> stop{false};
    std::atomic<int> failures{0};
    std::mutex mu;
    std::vector<std::thread> threads;
    for (int i = 0; i < clients; ++i) {
      threads.emplace_back(Good, target, p * 100 + i, std::ref(stop), std::ref(mu),
                           std::ref(phase.latencies), std::ref(failures), std::ref(phase.last_error));
    }
    if (p == 1) {
      for (int kind = 0; kind < 4; ++kind) {
        for (int copy = 0; copy < 4; ++copy) threads.emplace_back(Evil, target, kind, std::cref(evil_pages), std::ref(stop));
      }
    }
    const auto end = Clock::now() + std::chrono::duration<double>(seconds);
    while (Clock::now() < end) {
      std::this_thread::sleep_for(std::chrono::seconds(1));
      const ProcSample s = Sample(d.pid());
      phase.rss_min = std::min(phase.rss_min, s.rss_kib);
      phase.rss_max = std::max(phase.rss_max, s.rss_kib);
      phase.threads_min = std::min(phase.threads_min, s.threads);
      phase.threads_max = std::max(phase.threads_max, s.threads);
    }
    stop = true;
    for (auto& t : threads) t.join();
    phase.failures = failures;
  }
  // Quiet again: the hostile streams timed out or were cancelled, their memory returned.
  std::this_thread::sleep_for(std::chrono::seconds(12));
  const ProcSample after = Sample(d.pid());
  auto stats = good_client->GetStats();
  uint64_t good_pages = 0;
  if (stats.ok()) {
    for (const auto& pool : stats->pools) good_pages += pool.pages_used;
  }

  std::printf("%d good clients (tenant good), %.0f s per phase; hostile phase: 16 clients of "
              "tenant evil (idle writes, unread reads, pool floods, staging floods)\n\n",
              clients, seconds);
  std::printf("| phase | cycles | p50 | p99 | failed calls | daemon RSS | daemon threads |\n"
              "|---|---|---|---|---|---|---|\n");
  const char* names[2] = {"good clients alone", "with hostile clients"};
  for (int p = 0; p < 2; ++p) {
    const Phase& ph = phases[p];
    std::printf("| %s | %zu | %.0f µs | %.0f µs | %d | %.1f–%.1f MiB | %d–%d |\n", names[p],
                ph.latencies.size(), Percentile(ph.latencies, 0.5), Percentile(ph.latencies, 0.99),
                ph.failures, ph.rss_min / 1024.0, ph.rss_max / 1024.0, ph.threads_min, ph.threads_max);
  }
  std::printf("\n12 s after: RSS %.1f MiB, %d threads, %llu pages held by tenant good\n",
              after.rss_kib / 1024.0, after.threads, static_cast<unsigned long long>(good_pages));
  bool ok = true;
  for (int p = 0; p < 2; ++p) {
    if (phases[p].failures > 0) {
      std::printf("FAIL: %d calls of good clients failed in phase %d, last: %s\n", phases[p].failures,
                  p, phases[p].last_error.c_str());
      ok = false;
    }
    if (phases[p].latencies.empty()) {
      std::printf("FAIL: no cycle of a good client completed in phase %d\n", p);
      ok = false;
    }
  }
  if (!stats.ok() || good_pages != 0) {
    std::printf("FAIL: the good clients' pages were not all freed\n");
    ok = false;
  }
  if (after.threads > phases[0].threads_max + 8) {
    std::printf("FAIL: %d threads after the hostile phase, %d at most before\n", after.threads,
                phases[0].threads_max);
    ok = false;
  }
  if (after.rss_kib > 2 * phases[0].rss_max + 64 * 1024) {
    std::printf("FAIL: RSS %ld KiB after the hostile phase, %ld at most before\n", after.rss_kib,
                phases[0].rss_max);
    ok = false;
  }
  std::system(("rm -rf '" + std::string(dir) + "'").c_str());
  return check && !ok ? 1 : 0;
}
