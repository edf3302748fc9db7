// The `kvferry format` command, run as a process: golden files byte for byte, exit codes.
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <string>

#include "common/golden.h"
#include "gtest/gtest.h"

namespace kvferry {
namespace {

using testing::ReadBytes;

struct RunResult {
  int exit_code;
  std::string out, err;
};

class CliTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char dir[] = "/tmp/kvferry-cli-XXXXXX";
    ASSERT_NE(mkdtemp(dir), nullptr);
    dir_ = dir;
  }
  void TearDown() override { std::system(("rm -rf '" + dir_ + "'").c_str()); }

  RunResult Run(const std::string& args) {
    const std::string out = dir_ + "/stdout", err = dir_ + "/stderr";
    const int status =
        std::system((std::string(KVFERRY_CLI) + " " + args + " >" + out + " 2>" + err).c_str());
    auto text = [](const std::string& path) {
      const auto bytes = ReadBytes(path);
      return std::string(bytes.begin(), bytes.end());
    };
    return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, text(out), text(err)};
  }

  std::string Path(const std::string& name) const { return dir_ + "/" + name; }
  void WriteFile(const std::string& name, const std::string& bytes) {
    std::ofstream(Path(name), std::ios::binary) << bytes;
  }

  std::string dir_;
};

TEST_F(CliTest, ReproducesEveryGoldenFile) {
  for (const testing::GoldenCase& c : testing::GoldenCases()) {
    const std::string p = std::to_string(c.page_size);
    for (Layout layout : testing::AllLayouts()) {
      const std::string l = LayoutName(layout);
      SCOPED_TRACE(c.name + " " + l);
      RunResult r = Run("format quantize --layout " + l + " --page-size " + p + " --num-pages " +
                        std::to_string(c.num_pages) + " --rows " + c.file("input.bf16") +
                        " --locs " + c.file("locs.i64") + " --pool " + Path("pool.bin"));
      ASSERT_EQ(r.exit_code, 0) << r.err;
      EXPECT_EQ(ReadBytes(Path("pool.bin")), ReadBytes(c.file("pool." + l + ".bin")));

      r = Run("format dequantize --layout " + l + " --page-size " + p + " --pool " +
              c.file("pool." + l + ".bin") + " --locs " + c.file("locs.i64") + " --rows " +
              Path("rows.bf16"));
      ASSERT_EQ(r.exit_code, 0) << r.err;
      EXPECT_EQ(ReadBytes(Path("rows.bf16")), ReadBytes(c.file("dequant." + l + ".bf16")));

      r = Run("format transcode --from " + l + " --to v4 --page-size " + p + " --pool " +
              c.file("pool." + l + ".bin") + " --locs " + c.file("locs.i64") + " --out " +
              Path("v4.bin"));
      ASSERT_EQ(r.exit_code, 0) << r.err;
      EXPECT_EQ(ReadBytes(Path("v4.bin")), ReadBytes(c.file("transcode." + l + "_to_v4.bin")));
    }
  }
}

TEST_F(CliTest, InfoReportsSpecFigures) {
  RunResult r = Run("format info --layout v41_fp4 --page-size 64");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("page bytes            18432"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("bytes/token nominal   288"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("71.88 % nominal"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("50.68 % nominal"), std::string::npos) << r.out;
  r = Run("format info --layout v4 --page-size 64");
  EXPECT_NE(r.out.find("bytes/token effective 585.00"), std::string::npos) << r.out;
}

TEST_F(CliTest, UsageErrorsExitTwo) {
  EXPECT_EQ(Run("").exit_code, 2);
  EXPECT_EQ(Run("format").exit_code, 2);
  EXPECT_EQ(Run("format shrink --layout v4").exit_code, 2);
  EXPECT_EQ(Run("format info --layout v4").exit_code, 2);  // missing --page-size
  EXPECT_EQ(Run("format info --layout v4 --page-size 64 --colour red").exit_code, 2);
  EXPECT_EQ(Run("format info --layout fp8 --page-size 64").exit_code, 2);
  RunResult r = Run("format info --layout v4 --page-size sixty");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("takes an integer"), std::string::npos) << r.err;
}

// --help anywhere in a format command prints the format tools' usage on stdout, exit 0,
// and runs nothing (a quantize that would write a pool writes none).
TEST_F(CliTest, HelpOnEveryFormatCommandPrintsTheUsage) {
  for (const std::string args :
       {"format --help", "format help", "format quantize --help",
        "format info --layout v4 --help", "format transcode --from v41 --help"}) {
    SCOPED_TRACE(args);
    const RunResult r = Run(args);
    EXPECT_EQ(r.exit_code, 0) << r.err;
    EXPECT_NE(r.out.find("kvferry format quantize"), std::string::npos) << r.out;
    EXPECT_EQ(r.err, "");
  }
  const RunResult r = Run("format quantize --layout v4 --page-size 16 --num-pages 1 --pool " +
                          Path("pool.bin") + " --help");
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_FALSE(std::ifstream(Path("pool.bin")).good()) << "a --help run wrote a pool";
}

TEST_F(CliTest, InvalidInputExitsOneWithMessageAndWritesNoPool) {
  // One row with a NaN in dim 3.
  std::string row(1024, '\0');
  row[6] = static_cast<char>(0xC0);
  row[7] = static_cast<char>(0x7F);
  WriteFile("nan.bf16", row);
  WriteFile("one.i64", std::string(8, '\0'));
  RunResult r = Run("format quantize --layout v41 --page-size 16 --num-pages 1 --rows " +
                    Path("nan.bf16") + " --locs " + Path("one.i64") + " --pool " +
                    Path("out.bin"));
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("row 0 dim 3 is NaN"), std::string::npos) << r.err;
  EXPECT_NE(access(Path("out.bin").c_str(), F_OK), 0) << "a failed write left a pool file";

  r = Run("format info --layout v4 --page-size 48");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("not a power of two"), std::string::npos) << r.err;

  r = Run("format dequantize --layout v4 --page-size 16 --pool " + Path("nan.bf16") +
          " --locs " + Path("one.i64") + " --rows " + Path("rows.bf16"));
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("not a whole number of v4 pages"), std::string::npos) << r.err;

  r = Run("format dequantize --layout v4 --page-size 16 --pool " + Path("missing.bin") +
          " --locs " + Path("one.i64") + " --rows " + Path("rows.bf16"));
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("cannot open"), std::string::npos) << r.err;
}

}  // namespace
}  // namespace kvferry
