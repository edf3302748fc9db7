// `kvferry format quantize|dequantize|transcode|info`.
#include "format_commands.h"

#include <algorithm>
#include <cstring>
#include <iomanip>
#include <optional>
#include <span>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "args.h"
#include "file_io.h"
#include "kvferry/kernels/cpu_ops.h"
#include "kvferry/kernels/format.h"
#include "kvferry/kernels/ops.h"
#include "kvferry/kernels/validate.h"

namespace kvferry::cli {
namespace {

// A failure carries its exit code: usage errors (2) versus invalid input (1).
struct Failure {
  int code;
  std::string message;
};

using Outcome = std::optional<Failure>;

Outcome Usage(const absl::Status& status) {
  return Failure{kExitUsage, std::string(status.message())};
}
Outcome Invalid(const absl::Status& status) {
  return Failure{kExitInvalidInput, std::string(status.message())};
}

// Reads --<name> as a layout name; unknown names are usage errors.
Outcome GetLayout(const Args& args, const char* name, Layout* layout) {
  absl::StatusOr<std::string> text = args.Get(name);
  if (!text.ok()) return Usage(text.status());
  if (!ParseLayoutName(*text, layout)) {
    return Failure{kExitUsage, absl::StrCat("--", name, " must be v4, v41 or v41_fp4, got '",
                                            *text, "'")};
  }
  return std::nullopt;
}

Outcome GetPageSize(const Args& args, int* page_size) {
  absl::StatusOr<int64_t> value = args.GetInt("page-size");
  if (!value.ok()) return Usage(value.status());
  if (!IsValidPageSize(*value)) {
    return Failure{kExitInvalidInput,
                   absl::StrCat("page size ", *value, " is not a power of two in [1, ",
                                kMaxPageSize, "]")};
  }
  *page_size = static_cast<int>(*value);
  return std::nullopt;
}

// The page count of a pool file, which must be a whole number of pages.
Outcome PagesOfPoolFile(const std::vector<uint8_t>& pool, const std::string& path,
                        PoolGeometry* geometry) {
  const int64_t page_bytes = geometry->page_bytes();
  if (pool.empty() || static_cast<int64_t>(pool.size()) % page_bytes != 0) {
    return Failure{kExitInvalidInput,
                   absl::StrCat(path, " holds ", pool.size(), " bytes, not a whole number of ",
                                LayoutName(geometry->layout), " pages of ", page_bytes,
                                " bytes (page size ", geometry->page_size, ")")};
  }
  geometry->num_pages = static_cast<int64_t>(pool.size()) / page_bytes;
  return std::nullopt;
}

template <typename T>
Outcome Load(const Args& args, const char* name, std::vector<T>* values, std::string* path) {
  absl::StatusOr<std::string> p = args.Get(name);
  if (!p.ok()) return Usage(p.status());
  *path = *p;
  absl::StatusOr<std::vector<T>> data = ReadFileArray<T>(*p);
  if (!data.ok()) return Invalid(data.status());
  *values = std::move(*data);
  return std::nullopt;
}

Outcome Save(const Args& args, const char* name, std::span<const uint8_t> bytes) {
  absl::StatusOr<std::string> path = args.Get(name);
  if (!path.ok()) return Usage(path.status());
  if (absl::Status s = WriteFileBytes(*path, bytes); !s.ok()) return Invalid(s);
  return std::nullopt;
}

#define KVF_TRY(expr)                        \
  if (Outcome failure = (expr); failure) { \
    return failure;                          \
  }

Outcome Quantize(const Args& args, std::ostream& out) {
  PoolGeometry geometry;
  KVF_TRY(GetLayout(args, "layout", &geometry.layout));
  KVF_TRY(GetPageSize(args, &geometry.page_size));
  absl::StatusOr<int64_t> num_pages = args.GetInt("num-pages");
  if (!num_pages.ok()) return Usage(num_pages.status());
  geometry.num_pages = *num_pages;
  if (absl::Status s = ValidateGeometry(geometry); !s.ok()) return Invalid(s);
  // Refuse absurd sizes before allocating.
  if (geometry.num_pages > (int64_t{1} << 40) / geometry.page_bytes()) {
    return Failure{kExitInvalidInput, absl::StrCat("a pool of ", geometry.num_pages,
                                                   " pages is larger than 1 TiB")};
  }
  std::vector<uint16_t> rows;
  std::vector<int64_t> locs;
  std::string rows_path, locs_path;
  KVF_TRY(Load(args, "rows", &rows, &rows_path));
  KVF_TRY(Load(args, "locs", &locs, &locs_path));
  std::vector<uint8_t> pool(geometry.pool_bytes(), 0);
  cpu::ThreadPool workers(cpu::DefaultThreadCount());
  if (absl::Status s = cpu::QuantizeStore(geometry, rows, locs, pool, &workers); !s.ok()) {
    return Invalid(s);
  }
  KVF_TRY(Save(args, "pool", pool));
  out << "wrote " << locs.size() << " rows into " << geometry.num_pages << " "
      << LayoutName(geometry.layout) << " pages (" << pool.size() << " bytes)\n";
  return std::nullopt;
}

Outcome Dequantize(const Args& args, std::ostream& out) {
  PoolGeometry geometry;
  KVF_TRY(GetLayout(args, "layout", &geometry.layout));
  KVF_TRY(GetPageSize(args, &geometry.page_size));
  std::vector<uint8_t> pool;
  std::vector<int64_t> locs;
  std::string pool_path, locs_path;
  KVF_TRY(Load(args, "pool", &pool, &pool_path));
  KVF_TRY(PagesOfPoolFile(pool, pool_path, &geometry));
  KVF_TRY(Load(args, "locs", &locs, &locs_path));
  std::vector<uint16_t> rows(locs.size() * kHeadDim);
  cpu::ThreadPool workers(cpu::DefaultThreadCount());
  if (absl::Status s = cpu::DequantizeGather(geometry, pool, locs, rows, kHeadDim, &workers);
      !s.ok()) {
    return Invalid(s);
  }
  KVF_TRY(Save(args, "rows",
               std::span(reinterpret_cast<const uint8_t*>(rows.data()), rows.size() * 2)));
  out << "wrote " << locs.size() << " bf16 rows\n";
  return std::nullopt;
}

Outcome Transcode(const Args& args, std::ostream& out) {
  PoolGeometry from, to;
  KVF_TRY(GetLayout(args, "from", &from.layout));
  KVF_TRY(GetLayout(args, "to", &to.layout));
  KVF_TRY(GetPageSize(args, &from.page_size));
  to.page_size = from.page_size;
  std::vector<uint8_t> src;
  std::vector<int64_t> locs;
  std::string pool_path, locs_path;
  KVF_TRY(Load(args, "pool", &src, &pool_path));
  KVF_TRY(PagesOfPoolFile(src, pool_path, &from));
  KVF_TRY(Load(args, "locs", &locs, &locs_path));
  to.num_pages = from.num_pages;
  std::vector<uint8_t> dst(to.pool_bytes(), 0);
  cpu::ThreadPool workers(cpu::DefaultThreadCount());
  if (absl::Status s = cpu::Transcode(from, src, to, dst, locs, &workers); !s.ok()) {
    return Invalid(s);
  }
  KVF_TRY(Save(args, "out", dst));
  out << "transcoded " << locs.size() << " rows from " << LayoutName(from.layout) << " to "
      << LayoutName(to.layout) << " (" << dst.size() << " bytes)\n";
  return std::nullopt;
}

Outcome Info(const Args& args, std::ostream& out) {
  Layout layout;
  int page_size;
  KVF_TRY(GetLayout(args, "layout", &layout));
  KVF_TRY(GetPageSize(args, &page_size));
  const LayoutInfo info = GetLayoutInfo(layout);
  const Savings savings = ComputeSavings(layout, page_size);
  out << std::fixed;
  out << "layout                " << LayoutName(layout) << "\n"
      << "page size             " << page_size << " tokens\n"
      << "page bytes            " << PageBytes(layout, page_size) << "\n"
      << "record                " << info.data_bytes << " data + " << info.scale_bytes
      << " scale bytes, " << info.tile << " values per scale\n"
      << std::setprecision(0) << "bytes/token nominal   " << savings.nominal_bytes_per_token
      << "\n"
      << std::setprecision(2) << "bytes/token effective "
      << savings.effective_bytes_per_token << "\n"
      << "saved vs bf16         " << 100.0 * savings.nominal_saved_vs_bf16 << " % nominal, "
      << 100.0 * savings.effective_saved_vs_bf16 << " % effective (bf16: 1024 B/token)\n"
      << "saved vs v4           " << 100.0 * savings.nominal_saved_vs_v4 << " % nominal, "
      << 100.0 * savings.effective_saved_vs_v4 << " % effective (v4: "
      << ComputeSavings(Layout::kV4, page_size).effective_bytes_per_token
      << " B/token at this page size)\n";
  return std::nullopt;
}

}  // namespace

const char* FormatUsage() {
  return "usage:\n"
         "  kvferry format quantize --layout {v4|v41|v41_fp4} --page-size P --num-pages N "
         "--rows IN.bf16 --locs LOCS.i64 --pool OUT.bin\n"
         "  kvferry format dequantize --layout L --page-size P --pool POOL.bin "
         "--locs LOCS.i64 --rows OUT.bf16\n"
         "  kvferry format transcode --from L1 --to L2 --page-size P --pool IN.bin "
         "--locs LOCS.i64 --out OUT.bin\n"
         "  kvferry format info --layout L --page-size P\n";
}

int RunFormatCommand(const std::vector<std::string>& words, std::ostream& out,
                     std::ostream& err) {
  if (words.empty()) {
    err << FormatUsage();
    return kExitUsage;
  }
  // `kvferry format --help`, `kvferry format help` or `--help` after a verb: the usage, exit 0.
  if (words[0] == "help" || std::find(words.begin(), words.end(), "--help") != words.end()) {
    out << FormatUsage();
    return kExitOk;
  }
  const std::string& verb = words[0];
  const std::vector<std::string> rest(words.begin() + 1, words.end());
  absl::StatusOr<Args> args;
  Outcome (*run)(const Args&, std::ostream&) = nullptr;
  if (verb == "quantize") {
    args = Args::Parse(rest, {"layout", "page-size", "num-pages", "rows", "locs", "pool"});
    run = Quantize;
  } else if (verb == "dequantize") {
    args = Args::Parse(rest, {"layout", "page-size", "pool", "locs", "rows"});
    run = Dequantize;
  } else if (verb == "transcode") {
    args = Args::Parse(rest, {"from", "to", "page-size", "pool", "locs", "out"});
    run = Transcode;
  } else if (verb == "info") {
    args = Args::Parse(rest, {"layout", "page-size"});
    run = Info;
  } else {
    err << "kvferry format: unknown subcommand '" << verb << "'\n" << FormatUsage();
    return kExitUsage;
  }
  if (!args.ok()) {
    err << "kvferry format " << verb << ": " << args.status().message() << "\n" << FormatUsage();
    return kExitUsage;
  }
  if (Outcome failure = run(*args, out); failure) {
    err << "kvferry format " << verb << ": " << failure->message << "\n";
    if (failure->code == kExitUsage) err << FormatUsage();
    return failure->code;
  }
  return kExitOk;
}

}  // namespace kvferry::cli
