// kvferryd with a config file: pools created at start-up, flag > file > default, the
// effective configuration in the log, --check-config, and start-up refused for bad files.
#include <sys/wait.h>

#include <cstdlib>
#include <fstream>

#include "daemon_harness.h"

namespace kvferry {
namespace {

struct Exit {
  int code;
  std::string out, err;
};

class ConfigDaemonTest : public ::testing::Test {
 protected:
  ConfigDaemonTest() {
    char dir[] = "/tmp/kvferry-config-XXXXXX";
    if (mkdtemp(dir) == nullptr) throw std::runtime_error("mkdtemp");
    dir_ = dir;
  }
  ~ConfigDaemonTest() override { std::system(("rm -rf '" + dir_ + "'").c_str()); }

  std::string Write(const std::string& name, const std::string& text) {
    const std::string path = dir_ + "/" + name;
    std::ofstream(path) << text;
    return path;
  }
  static std::string Slurp(const std::string& path) {
    std::ifstream in(path);
    return std::string(std::istreambuf_iterator<char>(in), {});
  }
  // Runs kvferryd with `args` to completion (for runs that must not start serving: the
  // 20 s timeout ends one that does).
  Exit Kvferryd(const std::string& args) {
    const std::string out = dir_ + "/out", err = dir_ + "/err";
    const int status = std::system(("timeout 20 " + testing::DaemonPath() + " " + args + " > " +
                                    out + " 2> " + err)
                                       .c_str());
    return Exit{WIFEXITED(status) ? WEXITSTATUS(status) : -1, Slurp(out), Slurp(err)};
  }
  // A config with two pools, a write limit of 8 tokens, one cpu thread.
  std::string GoodConfig() {
    return Write("kvferryd.toml", "# kvferryd test config\nmax_write_tokens = 8\ncpu_threads = 1\n\n"
                                  "[[pool]]\nname = \"lat\"\nlayout = \"v41\"\npage_size = 16\n"
                                  "num_pages = 4\nnum_layers = 2\ndevice = \"" +
                                      testing::TestDevice() +
                                      "\"\n\n"
                                      "[[pool]]\nname = \"small\"\nlayout = \"v41_fp4\"\n"
                                      "num_pages = 2\ndevice = \"" +
                                      testing::TestDevice() + "\"\n");
  }
  // Writes `n` zero rows into the first page of pool "lat", layer 0.
  static grpc::Status WriteRows(testing::Daemon& d, int n) {
    const std::vector<v1::PageHandle> pages = testing::Allocate(d, "lat", 1);
    std::vector<v1::TokenLocation> locs;
    for (int i = 0; i < n; ++i) locs.push_back(testing::Location(pages.at(0), i));
    std::vector<uint16_t> rows(static_cast<size_t>(n) * kHeadDim, 0);
    return testing::WriteTokens(d, "lat", 0, locs, rows);
  }

  std::string dir_;
};

TEST_F(ConfigDaemonTest, CreatesThePoolsOfTheFile) {
  testing::Daemon d({"--config=" + GoodConfig()});
  grpc::ClientContext ctx;
  v1::ListPoolsResponse list;
  ASSERT_TRUE(d.stub().ListPools(&ctx, v1::ListPoolsRequest(), &list).ok());
  ASSERT_EQ(list.pools_size(), 2);
  std::map<std::string, v1::Pool> pools;
  for (const v1::Pool& p : list.pools()) pools[p.name()] = p;
  EXPECT_EQ(pools["lat"].layout(), v1::LAYOUT_V41);
  EXPECT_EQ(pools["lat"].page_size(), 16u);
  EXPECT_EQ(pools["lat"].num_pages(), 4u);
  EXPECT_EQ(pools["lat"].num_layers(), 2u);
  EXPECT_EQ(pools["lat"].device(), testing::TestDevice());
  EXPECT_EQ(pools["small"].layout(), v1::LAYOUT_V41_FP4);
  EXPECT_EQ(pools["small"].page_size(), 64u);  // the default
  EXPECT_EQ(pools["small"].num_layers(), 1u);
}

TEST_F(ConfigDaemonTest, FileValueAppliesWhereNoFlagIsGiven) {
  testing::Daemon d({"--config=" + GoodConfig()});
  EXPECT_TRUE(WriteRows(d, 8).ok());
  const grpc::Status s = WriteRows(d, 9);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
  EXPECT_NE(s.error_message().find("more than 8 tokens"), std::string::npos) << s.error_message();
}

TEST_F(ConfigDaemonTest, FlagWinsOverTheFileAndTheLogSaysWhereEachValueCameFrom) {
  testing::Daemon d({"--config", GoodConfig(), "--max-write-tokens=16", "--log_level=info"},
                    /*capture_log=*/true);
  EXPECT_TRUE(WriteRows(d, 16).ok());
  EXPECT_EQ(WriteRows(d, 17).error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  const std::string log = d.Log();
  EXPECT_NE(log.find("configuration max_write_tokens=16 source=flag"), std::string::npos) << log;
  EXPECT_NE(log.find("configuration cpu_threads=1 source=file"), std::string::npos) << log;
  EXPECT_NE(log.find("configuration chunk_bytes=1048576 source=default"), std::string::npos) << log;
  EXPECT_NE(log.find("configuration pool=lat layout=v41 page_size=16 num_pages=4 num_layers=2"),
            std::string::npos)
      << log;
  EXPECT_EQ(log.find("configuration config="), std::string::npos) << "--config is not a key";
}

TEST_F(ConfigDaemonTest, CheckConfigPrintsTheEffectiveConfigurationWithoutStarting) {
  const std::string ports = dir_ + "/ports";
  const Exit r = Kvferryd("--check-config " + GoodConfig() + " --cpu_threads=2 --port_file=" + ports);
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("max_write_tokens = 8  # file"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("cpu_threads = 2  # flag"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("listen = 127.0.0.1:50051  # default"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("pool lat: layout=v41 page_size=16 num_pages=4 num_layers=2"), std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("kvferryd.toml: valid"), std::string::npos) << r.out;
  EXPECT_FALSE(std::ifstream(ports).good()) << "--check-config started the daemon";
}

TEST_F(ConfigDaemonTest, CheckConfigRefusesABadValueNamingKeyAndLine) {
  const std::string path = Write("bad.toml", "listen = \"127.0.0.1:0\"\n\ncpu_threads = 9999999999\n");
  const Exit r = Kvferryd("--check-config=" + path);
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("bad.toml:3: key 'cpu_threads': bad value '9999999999'"), std::string::npos)
      << r.err;
}

TEST_F(ConfigDaemonTest, CheckConfigAppliesTheDaemonsOwnRules) {
  const std::string path = Write("rules.toml", "chunk_bytes = 4194304\n");
  const Exit r = Kvferryd("--check-config=" + path);
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("--max_message_bytes must exceed --chunk_bytes"), std::string::npos) << r.err;
}

TEST_F(ConfigDaemonTest, HeapKeptForReuseIsBounded) {
  for (const char* value : {"-1", "67108865"}) {
    const Exit r = Kvferryd(std::string("--check-config=") + GoodConfig() + " --malloc_top_pad_bytes=" + value);
    EXPECT_EQ(r.code, 2) << value;
    EXPECT_NE(r.err.find("--malloc_top_pad_bytes must be within 0 and 64 MiB"), std::string::npos) << r.err;
  }
  const Exit r = Kvferryd(std::string("--check-config=") + GoodConfig() + " --malloc_top_pad_bytes=0");
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("malloc_top_pad_bytes = 0  # flag"), std::string::npos) << r.out;
}

TEST_F(ConfigDaemonTest, StartUpFailsOnAnUnknownKey) {
  const std::string path = Write("typo.toml", "cpu_threads = 1\nlisten_adress = \"127.0.0.1:0\"\n");
  const Exit r = Kvferryd("--listen=127.0.0.1:0 --metrics_listen=127.0.0.1:0 --config=" + path);
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("typo.toml:2: key 'listen_adress': unknown key"), std::string::npos) << r.err;
}

TEST_F(ConfigDaemonTest, StartUpFailsOnAMissingFile) {
  const Exit r = Kvferryd("--listen=127.0.0.1:0 --metrics_listen=127.0.0.1:0 --config=" + dir_ +
                         "/absent.toml");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("cannot read config file '" + dir_ + "/absent.toml'"), std::string::npos)
      << r.err;
}

TEST_F(ConfigDaemonTest, StartUpFailsOnAPoolOfAnotherTenantWithoutTokens) {
  const std::string path = Write("tenant.toml", "[[pool]]\nname = \"p\"\nlayout = \"v4\"\n"
                                                "num_pages = 1\ntenant = \"alice\"\n");
  const Exit r = Kvferryd("--listen=127.0.0.1:0 --metrics_listen=127.0.0.1:0 --config=" + path);
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.err.find("tenant.toml:1: pool 'p' belongs to tenant 'alice'"), std::string::npos) << r.err;
}

TEST_F(ConfigDaemonTest, StartUpFailsOnAPoolTheDeviceCannotHold) {
  const std::string path = Write("huge.toml", "\n[[pool]]\nname = \"huge\"\nlayout = \"v4\"\n"
                                              "num_pages = 1099511627776\nnum_layers = 4096\n");
  const Exit r = Kvferryd("--listen=127.0.0.1:0 --metrics_listen=127.0.0.1:0 --config=" + path);
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.err.find("huge.toml:2: pool 'huge'"), std::string::npos) << r.err;
}

TEST_F(ConfigDaemonTest, ConfigAndCheckConfigMustNameOneFile) {
  const Exit r = Kvferryd("--config=" + GoodConfig() + " --check-config=" + dir_ + "/other.toml");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("name different files"), std::string::npos) << r.err;
}

}  // namespace
}  // namespace kvferry
