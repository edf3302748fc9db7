// The `kvferry` command against a real kvferryd: every daemon subcommand in the exact forms
// scripts rely on, exit codes (0 / 1 / 2), and the --json output parsed.
#include <nlohmann/json.hpp>

#include <cstdlib>
#include <fstream>

#include "common/golden.h"
#include "daemon_harness.h"
#include "test_certs.h"

namespace kvferry {
namespace {

using nlohmann::json;

struct CliRun {
  int code;
  std::string out, err;
};

class CliTest : public ::testing::Test {
 protected:
  // Runs `kvferry --target <daemon> <args>` through the shell.
  CliRun Kvferry(const std::string& args) {
    const std::string out = d_.dir() + "/out.txt", err = d_.dir() + "/err.txt";
    const std::string command = testing::CliPath() + " --target 127.0.0.1:" +
                                std::to_string(d_.grpc_port()) + " " + args + " > " + out +
                                " 2> " + err;
    const int status = std::system(command.c_str());
    return CliRun{WIFEXITED(status) ? WEXITSTATUS(status) : -1, Slurp(out), Slurp(err)};
  }
  static std::string Slurp(const std::string& path) {
    std::ifstream in(path);
    return std::string(std::istreambuf_iterator<char>(in), {});
  }
  std::string Path(const std::string& name) { return d_.dir() + "/" + name; }

  testing::Daemon d_;
};

TEST_F(CliTest, GoldenRoundTripThroughEveryDataCommand) {
  const testing::GoldenCase g = testing::GoldenCases().front();
  CliRun r = Kvferry("pool create gold --layout v41_fp4 --page-size " + std::to_string(g.page_size) +
                  " --pages " + std::to_string(g.num_pages) + " --layers 2 --device " +
                  testing::TestDevice() + " --json");
  ASSERT_EQ(r.code, 0) << r.err;
  const json pool = json::parse(r.out);
  EXPECT_EQ(pool["name"], "gold");
  EXPECT_EQ(pool["layout"], "v41_fp4");
  EXPECT_EQ(pool["num_layers"], 2);
  r = Kvferry("pages alloc gold " + std::to_string(g.num_pages) + " --out " + Path("pages.json"));
  ASSERT_EQ(r.code, 0) << r.err;
  const json pages = json::parse(Slurp(Path("pages.json")));
  ASSERT_EQ(pages.size(), static_cast<size_t>(g.num_pages));
  EXPECT_TRUE(pages[0].contains("page_id") && pages[0].contains("generation"));
  r = Kvferry("put gold --pages " + Path("pages.json") + " --layer 1 --rows " + g.file("input.bf16") +
              " --locs " + g.file("locs.i64") + " --json");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(json::parse(r.out)["tokens_written"], g.tokens);
  r = Kvferry("get-pages gold --pages " + Path("pages.json") + " --layers 1 --out " + Path("p.bin"));
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(testing::ReadBytes(Path("p.bin")), testing::ReadBytes(g.file("pool.v41_fp4.bin")));
  r = Kvferry("get-pages gold --pages " + Path("pages.json") +
              " --layers 1 --transcode-to v4 --out " + Path("t.bin"));
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(testing::ReadBytes(Path("t.bin")), testing::ReadBytes(g.file("transcode.v41_fp4_to_v4.bin")));
  r = Kvferry("get-workspace gold --pages " + Path("pages.json") + " --layer 1 --locs " +
              g.file("locs.i64") + " --out " + Path("w.bin"));
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(testing::ReadBytes(Path("w.bin")), testing::ReadBytes(g.file("dequant.v41_fp4.bf16")));
  r = Kvferry("stats --json");
  ASSERT_EQ(r.code, 0) << r.err;
  const json stats = json::parse(r.out);
  EXPECT_EQ(stats["tokens_held"], g.tokens);
  EXPECT_EQ(stats["pools"][0]["nominal_bytes_per_token"], 288.0);
  r = Kvferry("stats");
  ASSERT_EQ(r.code, 0);
  EXPECT_NE(r.out.find("gold"), std::string::npos);
  EXPECT_NE(r.out.find("288.0"), std::string::npos) << r.out;
  r = Kvferry("pool list --json");
  ASSERT_EQ(r.code, 0);
  EXPECT_EQ(json::parse(r.out).size(), 1u);
  r = Kvferry("pages free gold --pages " + Path("pages.json"));
  ASSERT_EQ(r.code, 0) << r.err;
  r = Kvferry("pool describe gold --json");
  EXPECT_EQ(json::parse(r.out)["pages_used"], 0);
  EXPECT_EQ(Kvferry("pool delete gold").code, 0);
  EXPECT_EQ(Kvferry("pool list --json").out, "[]\n");
}

// The cache through the command: create, put rows by key, look up with a lease, load the
// rows back (the goldens' dequantized rows) and the records, release, delete.
TEST_F(CliTest, CachePutLookupLoadMatchTheGoldens) {
  const testing::GoldenCase g = testing::LoadGoldenCase("latent_p64");
  const int blocks = static_cast<int>(g.tokens / g.page_size);
  ASSERT_EQ(Kvferry("pool create kv --layout v41 --page-size 64 --pages 16 --device " +
                    testing::TestDevice()).code, 0);
  CliRun r = Kvferry("cache create n --pools kv --block-tokens 64 --model m --json");
  ASSERT_EQ(r.code, 0) << r.err;
  const json ns = json::parse(r.out);
  EXPECT_EQ(ns["members"][0]["pool"], "kv");
  std::string keys;
  for (int b = 0; b < blocks; ++b) keys += "block" + std::to_string(b) + "\n";
  std::ofstream(Path("keys.txt")) << keys;
  std::ofstream(Path("more.txt")) << keys << "absent\n";
  const auto input = testing::ReadBytes(g.file("input.bf16"));
  std::ofstream(Path("rows.bf16"), std::ios::binary)
      .write(reinterpret_cast<const char*>(input.data()), blocks * 64 * 1024);
  r = Kvferry("cache put n kv --keys " + Path("keys.txt") + " --rows " + Path("rows.bf16") +
              " --digest " + std::to_string(ns["digest"].get<uint64_t>()) + " --json");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(json::parse(r.out)["blocks_stored"], blocks);
  r = Kvferry("cache lookup n --keys " + Path("more.txt") + " --lease-ms 60000 --json");
  ASSERT_EQ(r.code, 0) << r.err;
  const json hit = json::parse(r.out);
  EXPECT_EQ(hit["hit_blocks"], blocks);
  const std::string lease = std::to_string(hit["lease_id"].get<uint64_t>());
  r = Kvferry("cache load n kv --lease " + lease + " --out " + Path("rows.out"));
  ASSERT_EQ(r.code, 0) << r.err;
  const auto dequant = testing::ReadBytes(g.file("dequant.v41.bf16"));
  EXPECT_TRUE(testing::ReadBytes(Path("rows.out")) ==
              std::vector<uint8_t>(dequant.begin(), dequant.begin() + blocks * 64 * 1024));
  r = Kvferry("cache load n kv --lease " + lease + " --records --first 1 --count 2 --out " +
              Path("pages.out"));
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(testing::ReadBytes(Path("pages.out")).size(), 2u * 33792);
  EXPECT_EQ(Kvferry("cache release n --lease " + lease).code, 0);
  r = Kvferry("cache load n kv --lease " + lease + " --out " + Path("late.out"));
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.err.find("LEASE_EXPIRED"), std::string::npos) << r.err;
  r = Kvferry("cache lookup n --keys " + Path("keys.txt") + " --digest 12345");
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.err.find("NAMESPACE_MISMATCH"), std::string::npos) << r.err;
  EXPECT_EQ(Kvferry("cache put n kv --keys " + Path("keys.txt")).code, 2);  // no --rows
  EXPECT_EQ(Kvferry("cache delete n").code, 0);
  r = Kvferry("cache describe n");
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.err.find("NAMESPACE_NOT_FOUND"), std::string::npos) << r.err;
}

TEST_F(CliTest, ExitCodesSayUsageOrErrorAndMessagesNameTheReason) {
  CliRun r = Kvferry("health");
  EXPECT_EQ(r.code, 0);
  EXPECT_EQ(r.out, "SERVING\n");
  r = Kvferry("pool describe nope");
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.err.find("POOL_NOT_FOUND"), std::string::npos) << r.err;
  EXPECT_EQ(Kvferry("pool create x --layout v5 --page-size 16 --pages 1").code, 2);
  EXPECT_EQ(Kvferry("pool create x --layout v4 --page-size 16").code, 2);  // --pages missing
  EXPECT_EQ(Kvferry("pool create x --layout v4 --page-size 16 --pages 1 --bogus 1").code, 2);
  EXPECT_EQ(Kvferry("pool create x --layout v4 --page-size 48 --pages 1").code, 1);  // daemon refuses
  EXPECT_EQ(Kvferry("pages alloc").code, 2);
  r = Kvferry("pages free x --pages " + Path("missing.json"));
  EXPECT_EQ(r.code, 1);
  r = Kvferry("pool --help");
  EXPECT_EQ(r.code, 0);
  EXPECT_NE(r.out.find("kvferry pool create NAME"), std::string::npos);
  // A command's --help prints its own lines, the global options and the notes on files.
  EXPECT_EQ(r.out.find("kvferry push"), std::string::npos) << r.out;
  r = Kvferry("push p --help");
  EXPECT_EQ(r.code, 0);
  for (const char* part : {"global options: --target", "kvferry push POOL --pages PAGES.json",
                           "--to-pages PAGES2.json [--transcode-to LAYOUT]", "PAGES.json is"}) {
    EXPECT_NE(r.out.find(part), std::string::npos) << part << " missing from\n" << r.out;
  }
  EXPECT_EQ(r.out.find("kvferry pull"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("kvferry pool"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("KEYS.txt"), std::string::npos) << r.out;  // a note on cache files
  r = Kvferry("cache --help");
  EXPECT_NE(r.out.find("[--salt S] [--max-blocks N]"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("KEYS.txt has one key per line"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("kvferry stats"), std::string::npos) << r.out;
  // No daemon there: health fails with exit 1.
  const std::string command = testing::CliPath() + " health --target 127.0.0.1:1 --timeout 2 > /dev/null 2>&1";
  const int status = std::system(command.c_str());
  EXPECT_EQ(WEXITSTATUS(status), 1);
}

TEST_F(CliTest, LeasedPagesAreRenewedAndThenFreedByTheDaemon) {
  ASSERT_EQ(Kvferry("pool create l --layout v41 --page-size 16 --pages 4 --device " +
                    testing::TestDevice()).code, 0);
  // A 4 s lease renewed every second for 5 s: the pages outlive their first lease only
  // because of the renewals. (Sanitizer builds start the command slowly: the timing
  // margin is the lease, not the sleeps.)
  CliRun r = Kvferry("--json pages alloc l 2 --lease 4 --out " + Path("leased.json"));
  ASSERT_EQ(r.code, 0) << r.err;
  const auto allocated = std::chrono::steady_clock::now();
  auto renewed = allocated;
  while (std::chrono::steady_clock::now() - allocated < std::chrono::seconds(5)) {
    std::this_thread::sleep_for(std::chrono::seconds(1));
    renewed = std::chrono::steady_clock::now();
    r = Kvferry("--json pages renew l --pages " + Path("leased.json"));
    ASSERT_EQ(r.code, 0) << r.err;
    EXPECT_NE(r.out.find("\"renewed\":2"), std::string::npos) << r.out;
  }
  const std::string described = Kvferry("--json pool describe l").out;
  // The last renewal began less than a lease ago: the pages must still be held. (On a
  // machine so slow that the describe came a whole lease later, nothing can be said.)
  if (std::chrono::steady_clock::now() - renewed < std::chrono::seconds(4)) {
    EXPECT_NE(described.find("\"pages_used\": 2"), std::string::npos) << described;
  }
  // Not renewed any more: the daemon frees them, and renewing names the stale handle.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (Kvferry("--json pool describe l").out.find("\"pages_used\": 0") == std::string::npos &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  EXPECT_NE(Kvferry("--json pool describe l").out.find("\"pages_used\": 0"), std::string::npos);
  r = Kvferry("pages renew l --pages " + Path("leased.json"));
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.err.find("STALE_PAGE_HANDLE"), std::string::npos) << r.err;
  EXPECT_EQ(Kvferry("pages alloc l 1 --lease -1 --out " + Path("x.json")).code, 2);
}

TEST_F(CliTest, BenchReportsThroughputAsJson) {
  const CliRun r = Kvferry("bench --tokens 2048 --page-size 16 --device " + testing::TestDevice() + " --json");
  ASSERT_EQ(r.code, 0) << r.err;
  const json result = json::parse(r.out);
  for (const char* op : {"WriteTokens", "ReadWorkspace", "ReadPages"}) {
    EXPECT_GT(result[op]["tokens_per_second"].get<double>(), 0) << op;
  }
  EXPECT_EQ(Kvferry("pool list --json").out, "[]\n");  // its pool is gone
}

TEST(CliAuthTest, TheTokenFileAuthenticatesAndItsAbsenceIsAnError) {
  char dir[] = "/tmp/kvferry-cli-auth-XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  const std::string d = dir;
  // sha256("cli-token-1") via the shell's sha256sum.
  ASSERT_EQ(std::system(("printf 'ops %s\\n' $(printf cli-token-1 | sha256sum | cut -d' ' -f1) > " + d +
                         "/tokens && printf 'cli-token-1\\n' > " + d + "/token").c_str()),
            0);
  testing::Daemon daemon({"--auth_tokens=" + d + "/tokens"});
  const std::string base = testing::CliPath() + " --target 127.0.0.1:" +
                           std::to_string(daemon.grpc_port()) + " ";
  auto run = [&](const std::string& args) {
    const int status = std::system((base + args + " > " + d + "/out 2> " + d + "/err").c_str());
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  };
  EXPECT_EQ(run("pool list"), 1);
  std::ifstream err(d + "/err");
  const std::string message(std::istreambuf_iterator<char>(err), {});
  EXPECT_NE(message.find("NOT_AUTHENTICATED"), std::string::npos) << message;
  EXPECT_EQ(run("pool create t --layout v4 --page-size 16 --pages 2 --device cpu --token-file " + d + "/token"), 0);
  EXPECT_EQ(run("pool list --json --token-file " + d + "/token"), 0);
  std::ifstream out(d + "/out");
  EXPECT_EQ(json::parse(out).size(), 1u);
  EXPECT_EQ(run("health"), 0);  // the health check needs no token
  std::system(("rm -rf " + d).c_str());
}

TEST(CliTlsTest, MutualTlsServesTheClientWithItsCertificateOnly) {
  char dir[] = "/tmp/kvferry-cli-tls-XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  const std::string d = dir;
  const testing::KeyAndCert ca = testing::MakeCert({"cli test CA", true});
  const testing::KeyAndCert server = testing::MakeCert({"kvferryd", false, "DNS:localhost,IP:127.0.0.1"}, &ca);
  const testing::KeyAndCert client = testing::MakeCert({"worker", false}, &ca);
  testing::WriteFile(d + "/ca.pem", ca.CertPem());
  testing::WriteFile(d + "/server.pem", server.CertPem());
  testing::WriteFile(d + "/server.key", server.KeyPem());
  testing::WriteFile(d + "/client.pem", client.CertPem());
  testing::WriteFile(d + "/client.key", client.KeyPem());
  testing::Daemon daemon({"--tls_cert=" + d + "/server.pem", "--tls_key=" + d + "/server.key",
                          "--tls_client_ca=" + d + "/ca.pem"});
  const std::string base = testing::CliPath() + " --timeout 5 --target 127.0.0.1:" +
                           std::to_string(daemon.grpc_port()) + " ";
  auto run = [&](const std::string& args) {
    const int status = std::system((base + args + " > /dev/null 2>&1").c_str());
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  };
  const std::string mutual = "--tls-ca " + d + "/ca.pem --tls-cert " + d + "/client.pem --tls-key " +
                             d + "/client.key";
  EXPECT_EQ(run("health " + mutual), 0);
  EXPECT_EQ(run("pool create t --layout v41 --page-size 16 --pages 2 --device cpu " + mutual), 0);
  EXPECT_EQ(run("pool describe t " + mutual), 0);
  EXPECT_EQ(run("pool list --tls-ca " + d + "/ca.pem"), 1);  // no client certificate
  EXPECT_EQ(run("pool list"), 1);                             // plaintext
  EXPECT_EQ(run("pool list --tls-cert " + d + "/client.pem"), 2);  // a certificate needs the CA
  std::system(("rm -rf " + d).c_str());
}

}  // namespace
}  // namespace kvferry
