// Loading the golden vectors of testdata/kv-formats (an independent implementation).
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <string>
#include <vector>

#include "kvferry/kernels/format.h"

namespace kvferry::testing {

// Directory of the golden cases: set by CMake, or by the environment variable of the same
// name when the tests run from another checkout (a GPU machine, say).
inline std::string GoldenDir() {
  const char* dir = std::getenv("KVFERRY_GOLDEN_DIR");
  return dir != nullptr && *dir != '\0' ? dir : KVFERRY_GOLDEN_DIR;
}

inline std::vector<uint8_t> ReadBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot open golden file " + path);
  return std::vector<uint8_t>((std::istreambuf_iterator<char>(in)),
                              std::istreambuf_iterator<char>());
}

template <typename T>
std::vector<T> ReadArray(const std::string& path) {
  const std::vector<uint8_t> bytes = ReadBytes(path);
  std::vector<T> values(bytes.size() / sizeof(T));
  std::memcpy(values.data(), bytes.data(), values.size() * sizeof(T));
  return values;
}

// Reads the integer after `"key":` in a JSON text, searching from `from`. The golden
// case.json files are flat and machine-written, so a full JSON parser is not needed.
inline int64_t JsonInt(const std::string& json, const std::string& key, size_t from = 0) {
  const size_t at = json.find("\"" + key + "\"", from);
  if (at == std::string::npos) throw std::runtime_error("case.json lacks " + key);
  return std::stoll(json.substr(json.find(':', at) + 1));
}

inline double JsonDouble(const std::string& json, const std::string& key, size_t from) {
  const size_t at = json.find("\"" + key + "\"", from);
  if (at == std::string::npos) throw std::runtime_error("case.json lacks " + key);
  return std::stod(json.substr(json.find(':', at) + 1));
}

struct GoldenLayout {
  int64_t bytes_per_token;
  int64_t page_bytes;
  double relative_l2_error;
};

struct GoldenCase {
  std::string name;
  int page_size = 0;
  int64_t num_pages = 0;
  int64_t tokens = 0;
  GoldenLayout layouts[kNumLayouts];

  std::string dir() const { return GoldenDir() + "/" + name; }
  std::string file(const std::string& base) const { return dir() + "/" + base; }
  PoolGeometry geometry(Layout layout) const { return PoolGeometry{layout, page_size, num_pages}; }
  const GoldenLayout& layout(Layout l) const { return layouts[static_cast<int>(l)]; }
};

inline GoldenCase LoadGoldenCase(const std::string& name) {
  GoldenCase c;
  c.name = name;
  const std::vector<uint8_t> raw = ReadBytes(c.file("case.json"));
  const std::string json(raw.begin(), raw.end());
  c.page_size = static_cast<int>(JsonInt(json, "page_size"));
  c.num_pages = JsonInt(json, "num_pages");
  c.tokens = JsonInt(json, "tokens");
  for (int i = 0; i < kNumLayouts; ++i) {
    const size_t at = json.find("\"" + std::string(LayoutName(static_cast<Layout>(i))) + "\": {");
    if (at == std::string::npos) throw std::runtime_error(name + ": case.json lacks a layout");
    c.layouts[i] = GoldenLayout{JsonInt(json, "bytes_per_token", at),
                                JsonInt(json, "page_bytes", at),
                                JsonDouble(json, "relative_l2_error", at)};
  }
  return c;
}

inline std::vector<GoldenCase> GoldenCases() {
  return {LoadGoldenCase("edge_p16"), LoadGoldenCase("latent_p64"), LoadGoldenCase("wide_p256")};
}

inline std::vector<Layout> AllLayouts() { return {Layout::kV4, Layout::kV41, Layout::kV41Fp4}; }

// One golden case in one layout: the parameter of the golden tests.
struct GoldenParam {
  std::string case_name;
  Layout layout;
};

inline std::vector<GoldenParam> AllGoldenParams() {
  std::vector<GoldenParam> params;
  for (const char* name : {"edge_p16", "latent_p64", "wide_p256"}) {
    for (Layout layout : AllLayouts()) params.push_back({name, layout});
  }
  return params;
}

// A test name for the parameter, e.g. "latent_p64_v41".
inline std::string GoldenParamName(const GoldenParam& param) {
  return param.case_name + "_" + LayoutName(param.layout);
}

// Index of the first differing element, or -1 (0 when the sizes differ).
template <typename T>
int64_t FirstDifference(const std::vector<T>& a, const std::vector<T>& b) {
  if (a.size() != b.size()) return 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i] != b[i]) return static_cast<int64_t>(i);
  }
  return -1;
}

}  // namespace kvferry::testing
