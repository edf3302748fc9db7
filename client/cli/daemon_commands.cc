// `kvferry pool|pages|put|get-pages|get-workspace|push|pull|stats|bench|health|cache`.
#include "daemon_commands.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <fstream>
#include <iomanip>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <set>
#include <sstream>
#include <vector>

#include <grpcpp/security/credentials.h>
#include <unistd.h>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "file_io.h"
#include "format_commands.h"
#include "kvferry/client/client.h"

namespace kvferry::cli {
namespace {

using client::Client;
using client::PageHandle;
using client::TokenLocation;
using nlohmann::json;

constexpr const char* kUsage = R"(Daemon commands (global options: --target HOST:PORT, default 127.0.0.1:50051;
--json for machine-readable output; --timeout SECONDS; --token-file FILE (its first line is
sent as the bearer token); --tls-ca PEM (TLS, trusting this CA) with --tls-cert PEM and
--tls-key PEM for a client certificate (mutual TLS); --help after any command):
  kvferry pool create NAME --layout v4|v41|v41_fp4 --page-size N --pages N [--layers N] [--device D]
  kvferry pool list | pool describe NAME | pool delete NAME
  kvferry pages alloc POOL COUNT --out PAGES.json [--lease SECONDS]
  kvferry pages free POOL --pages PAGES.json | pages renew POOL --pages PAGES.json
  kvferry put POOL --pages PAGES.json --layer L --rows ROWS.bf16 --locs LOCS.i64
  kvferry get-pages POOL --pages PAGES.json [--layers 0,1] [--transcode-to LAYOUT] --out FILE
  kvferry get-workspace POOL --pages PAGES.json --layer L --locs LOCS.i64 --out FILE
  kvferry push POOL --pages PAGES.json [--layers 0,1] --to HOST:PORT --to-pool POOL2
               --to-pages PAGES2.json [--transcode-to LAYOUT]
  kvferry pull POOL --pages PAGES.json [--layers 0,1] --from HOST:PORT --from-pool POOL2
               --from-pages PAGES2.json [--transcode-to LAYOUT]
  kvferry stats
  kvferry bench [--layout v41] [--page-size 64] [--tokens N] [--device D]
  kvferry health
  kvferry cache create NS --pools P1[,P2..] --block-tokens N [--model M] [--layer-group G]
                          [--salt S] [--max-blocks N]
  kvferry cache describe NS | cache delete NS
  kvferry cache put NS POOL --keys KEYS.txt --rows ROWS.bf16 [--digest D]
  kvferry cache lookup NS --keys KEYS.txt [--pools P1,P2] [--lease-ms N] [--digest D]
  kvferry cache load NS POOL --lease ID --out FILE [--layer L | --records] [--first N]
                     [--count N] [--digest D]
  kvferry cache release NS --lease ID
KEYS.txt has one key per line (its bytes, without the newline). ROWS.bf16 holds, for each
key in order and each layer of POOL, page_size bf16 rows of 512. --digest (decimal) is
checked against the namespace's; without it the namespace's own is used. load writes bf16
rows of one layer (--layer, default 0) or, with --records, the raw page records.

PAGES.json is [{"page_id": .., "generation": ..}, ...]; a location in LOCS.i64 is
i * page_size + slot, i indexing PAGES.json. Exit 0 on success, 2 on a usage error, 1 on
an error (message on stderr).
)";

// The usage of one command (`command --help`): the global options, the command's own lines
// of kUsage (each "  kvferry COMMAND ..." line and the deeper-indented lines under it), the
// paragraphs of notes after the commands that begin with a file the command names, and the
// last one (page files and exit codes). A word that names no command gets the whole usage.
std::string CommandUsage(const std::string& command) {
  const std::vector<absl::string_view> lines = absl::StrSplit(kUsage, '\n');
  const std::string prefix = "  kvferry " + command + " ";
  std::string head, own;
  std::vector<std::string> notes(1);  // paragraphs, split at blank lines
  bool in_commands = false, mine = false;
  for (absl::string_view line : lines) {
    if (absl::StartsWith(line, "  kvferry ")) {
      in_commands = true;
      mine = absl::StartsWith(line, prefix) || line == "  kvferry " + command;
    } else if (!absl::StartsWith(line, "   ")) {
      mine = false;
      if (!in_commands) {
        absl::StrAppend(&head, line, "\n");
      } else if (line.empty()) {
        if (!notes.back().empty()) notes.emplace_back();
      } else {
        absl::StrAppend(&notes.back(), line, "\n");
      }
      continue;
    }
    if (mine) absl::StrAppend(&own, line, "\n");
  }
  if (own.empty()) return kUsage;
  if (notes.back().empty()) notes.pop_back();
  std::string usage = head + own;
  for (size_t i = 0; i < notes.size(); ++i) {
    const absl::string_view first_word = absl::string_view(notes[i]).substr(0, notes[i].find(' '));
    if (i + 1 == notes.size() || absl::StrContains(own, first_word)) usage += notes[i];
  }
  return usage;
}

// An error with its exit code.
struct Failure {
  int code;
  std::string message;
};

// The words of one command line: positionals, --name value options, and flags.
class Words {
 public:
  // Options that take no value.
  static inline const std::set<std::string> kFlags = {"json", "help", "records"};

  static std::optional<Failure> Parse(const std::vector<std::string>& words, Words* out) {
    for (size_t i = 0; i < words.size(); ++i) {
      const std::string& w = words[i];
      if (w.rfind("--", 0) != 0 || w.size() < 3) {
        out->positional_.push_back(w);
        continue;
      }
      std::string name = w.substr(2), value;
      const size_t eq = name.find('=');
      if (eq != std::string::npos) {
        value = name.substr(eq + 1);
        name = name.substr(0, eq);
      } else if (kFlags.contains(name)) {
        value = "true";
      } else if (i + 1 < words.size()) {
        value = words[++i];
      } else {
        return Failure{kExitUsage, absl::StrCat("option --", name, " needs a value")};
      }
      if (!out->options_.emplace(name, value).second) {
        return Failure{kExitUsage, absl::StrCat("option --", name, " given twice")};
      }
    }
    return std::nullopt;
  }

  const std::vector<std::string>& positional() const { return positional_; }
  bool Has(const std::string& name) const { return options_.contains(name); }
  std::optional<std::string> Get(const std::string& name) const {
    auto it = options_.find(name);
    if (it == options_.end()) return std::nullopt;
    used_.insert(name);
    return it->second;
  }
  // The first option the command did not read, if any.
  std::optional<std::string> Unused() const {
    for (const auto& [name, value] : options_) {
      static const std::set<std::string> kGlobal = {"target", "json", "timeout", "token-file",
                                                    "tls-ca", "tls-cert", "tls-key"};
      if (!used_.contains(name) && !kGlobal.contains(name)) return name;
    }
    return std::nullopt;
  }

 private:
  std::vector<std::string> positional_;
  std::map<std::string, std::string> options_;
  mutable std::set<std::string> used_;
};

struct Context {
  const Words& words;
  Client& client;
  std::ostream& out;
  std::ostream& err;
  bool json;
  bool terminal;
};

Failure Usage(const std::string& message) { return Failure{kExitUsage, message}; }

Failure FromStatus(const absl::Status& s) {
  std::string reason = client::ErrorReason(s);
  return Failure{kExitInvalidInput,
                 absl::StrCat(absl::StatusCodeToString(s.code()),
                              reason.empty() ? "" : absl::StrCat(" (", reason, ")"), ": ",
                              s.message())};
}

std::optional<Failure> Required(const Words& w, const std::string& name, std::string* value) {
  std::optional<std::string> v = w.Get(name);
  if (!v.has_value()) return Usage(absl::StrCat("missing option --", name));
  *value = *v;
  return std::nullopt;
}

template <typename T>
std::optional<Failure> ParseNumber(const std::string& what, const std::string& text, T* value) {
  if (!absl::SimpleAtoi(text, value)) {
    return Usage(absl::StrCat(what, " takes a non-negative integer, got '", text, "'"));
  }
  return std::nullopt;
}

std::optional<Failure> LayoutOption(const std::string& text, client::Layout* layout) {
  if (!client::ParseLayout(text, layout)) {
    return Usage(absl::StrCat("layout must be v4, v41 or v41_fp4, got '", text, "'"));
  }
  return std::nullopt;
}

#define KVF_CLI_TRY(expr)                             \
  do {                                                \
    if (std::optional<Failure> _f = (expr)) return _f; \
  } while (false)

std::optional<Failure> ReadPagesFile(const std::string& path, std::vector<PageHandle>* pages) {
  std::ifstream in(path);
  if (!in) return Failure{kExitInvalidInput, absl::StrCat("cannot read ", path)};
  try {
    const json doc = json::parse(in);
    if (!doc.is_array()) throw std::runtime_error("not a JSON array");
    for (const json& h : doc) {
      pages->push_back(PageHandle{h.at("page_id").get<uint64_t>(), h.at("generation").get<uint64_t>()});
    }
  } catch (const std::exception& e) {
    return Failure{kExitInvalidInput,
                   absl::StrCat(path, ": expected [{\"page_id\": N, \"generation\": N}, ...]: ", e.what())};
  }
  return std::nullopt;
}

json PagesJson(const std::vector<PageHandle>& pages) {
  json doc = json::array();
  for (const PageHandle& h : pages) doc.push_back({{"page_id", h.page_id}, {"generation", h.generation}});
  return doc;
}

std::optional<Failure> WriteText(const std::string& path, const std::string& text) {
  const absl::Status s = WriteFileBytes(
      path, std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(text.data()), text.size()));
  if (!s.ok()) return Failure{kExitInvalidInput, std::string(s.message())};
  return std::nullopt;
}

json PoolJson(const client::PoolInfo& p) {
  return {{"name", p.spec.name},           {"layout", client::LayoutName(p.spec.layout)},
          {"page_size", p.spec.page_size}, {"num_pages", p.spec.num_pages},
          {"num_layers", p.spec.num_layers}, {"device", p.spec.device},
          {"pool_id", p.pool_id},          {"page_bytes", p.page_bytes},
          {"pool_bytes", p.pool_bytes},    {"pages_used", p.pages_used},
          {"pages_free", p.pages_free},    {"tokens_held", p.tokens_held}};
}

// "1.5 GiB", "512 B".
std::string HumanBytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (bytes >= 1024 && u < 4) {
    bytes /= 1024;
    ++u;
  }
  std::ostringstream s;
  s << std::fixed << std::setprecision(u == 0 ? 0 : 1) << bytes << " " << units[u];
  return s.str();
}

void PrintPool(const Context& c, const client::PoolInfo& p) {
  if (c.json) {
    c.out << PoolJson(p).dump(2) << "\n";
    return;
  }
  c.out << p.spec.name << ": " << client::LayoutName(p.spec.layout) << ", page size "
        << p.spec.page_size << ", " << p.spec.num_pages << " pages x " << p.spec.num_layers
        << " layers on " << p.spec.device << " (" << HumanBytes(p.pool_bytes) << "), "
        << p.pages_used << " pages used, " << p.pages_free << " free, " << p.tokens_held
        << " tokens\n";
}

// Resolves LOCS.i64 against PAGES.json.
std::optional<Failure> Locations(const Context& c, const std::string& pool,
                                 std::vector<TokenLocation>* where) {
  std::string pages_path, locs_path;
  KVF_CLI_TRY(Required(c.words, "pages", &pages_path));
  KVF_CLI_TRY(Required(c.words, "locs", &locs_path));
  std::vector<PageHandle> pages;
  KVF_CLI_TRY(ReadPagesFile(pages_path, &pages));
  absl::StatusOr<std::vector<int64_t>> locs = ReadFileArray<int64_t>(locs_path);
  if (!locs.ok()) return Failure{kExitInvalidInput, std::string(locs.status().message())};
  absl::StatusOr<client::PoolInfo> info = c.client.DescribePool(pool);
  if (!info.ok()) return FromStatus(info.status());
  const int64_t page_size = info->spec.page_size;
  for (size_t i = 0; i < locs->size(); ++i) {
    const int64_t loc = (*locs)[i];
    if (loc < 0 || loc / page_size >= static_cast<int64_t>(pages.size())) {
      return Failure{kExitInvalidInput,
                     absl::StrCat(locs_path, ": location ", i, " (", loc, ") is outside the ",
                                  pages.size(), " pages of ", pages_path)};
    }
    where->push_back({pages[loc / page_size], static_cast<uint32_t>(loc % page_size)});
  }
  return std::nullopt;
}

std::optional<Failure> Layer(const Words& w, uint32_t* layer) {
  std::string text;
  KVF_CLI_TRY(Required(w, "layer", &text));
  return ParseNumber("--layer", text, layer);
}

std::optional<Failure> WriteBytes(const std::string& path, std::span<const uint8_t> bytes) {
  const absl::Status s = WriteFileBytes(path, bytes);
  if (!s.ok()) return Failure{kExitInvalidInput, std::string(s.message())};
  return std::nullopt;
}

// ---- the commands ------------------------------------------------------------------------------

std::optional<Failure> Pool(const Context& c) {
  const auto& p = c.words.positional();
  if (p.size() < 2) return Usage("pool needs a subcommand: create, list, describe or delete");
  const std::string& sub = p[1];
  if (sub == "list") {
    if (p.size() != 2) return Usage("pool list takes no name");
    absl::StatusOr<std::vector<client::PoolInfo>> pools = c.client.ListPools();
    if (!pools.ok()) return FromStatus(pools.status());
    if (c.json) {
      json doc = json::array();
      for (const auto& pool : *pools) doc.push_back(PoolJson(pool));
      c.out << doc.dump(2) << "\n";
    } else {
      for (const auto& pool : *pools) PrintPool(c, pool);
    }
    return std::nullopt;
  }
  if (p.size() != 3) return Usage(absl::StrCat("pool ", sub, " needs exactly one NAME"));
  const std::string& name = p[2];
  if (sub == "create") {
    client::PoolSpec spec;
    spec.name = name;
    std::string text;
    KVF_CLI_TRY(Required(c.words, "layout", &text));
    KVF_CLI_TRY(LayoutOption(text, &spec.layout));
    KVF_CLI_TRY(Required(c.words, "page-size", &text));
    KVF_CLI_TRY(ParseNumber("--page-size", text, &spec.page_size));
    KVF_CLI_TRY(Required(c.words, "pages", &text));
    KVF_CLI_TRY(ParseNumber("--pages", text, &spec.num_pages));
    if (auto layers = c.words.Get("layers")) KVF_CLI_TRY(ParseNumber("--layers", *layers, &spec.num_layers));
    if (auto device = c.words.Get("device")) spec.device = *device;
    if (auto unused = c.words.Unused()) return Usage(absl::StrCat("unknown option --", *unused));
    absl::StatusOr<client::PoolInfo> info = c.client.CreatePool(spec);
    if (!info.ok()) return FromStatus(info.status());
    PrintPool(c, *info);
    return std::nullopt;
  }
  if (auto unused = c.words.Unused()) return Usage(absl::StrCat("unknown option --", *unused));
  if (sub == "describe") {
    absl::StatusOr<client::PoolInfo> info = c.client.DescribePool(name);
    if (!info.ok()) return FromStatus(info.status());
    PrintPool(c, *info);
    return std::nullopt;
  }
  if (sub == "delete") {
    if (absl::Status s = c.client.DeletePool(name); !s.ok()) return FromStatus(s);
    if (c.json) c.out << json{{"deleted", name}}.dump() << "\n";
    return std::nullopt;
  }
  return Usage(absl::StrCat("unknown pool subcommand '", sub, "'"));
}

std::optional<Failure> Pages(const Context& c) {
  const auto& p = c.words.positional();
  if (p.size() >= 2 && p[1] == "alloc") {
    if (p.size() != 4) return Usage("pages alloc needs POOL COUNT");
    uint32_t count;
    KVF_CLI_TRY(ParseNumber("COUNT", p[3], &count));
    std::string out_path;
    KVF_CLI_TRY(Required(c.words, "out", &out_path));
    uint32_t lease_seconds = 0;
    if (auto text = c.words.Get("lease")) KVF_CLI_TRY(ParseNumber("--lease", *text, &lease_seconds));
    if (auto unused = c.words.Unused()) return Usage(absl::StrCat("unknown option --", *unused));
    absl::StatusOr<std::vector<PageHandle>> pages =
        lease_seconds > 0 ? c.client.AllocatePages(p[2], count, absl::Seconds(lease_seconds))
                          : c.client.AllocatePages(p[2], count);
    if (!pages.ok()) return FromStatus(pages.status());
    if (auto f = WriteText(out_path, PagesJson(*pages).dump() + "\n")) {
      c.client.FreePages(p[2], *pages).IgnoreError();  // nobody would know the handles
      return f;
    }
    if (c.json) c.out << json{{"pool", p[2]}, {"allocated", pages->size()}, {"out", out_path}}.dump() << "\n";
    return std::nullopt;
  }
  if (p.size() >= 2 && (p[1] == "free" || p[1] == "renew")) {
    const bool free = p[1] == "free";
    if (p.size() != 3) return Usage(absl::StrCat("pages ", p[1], " needs POOL"));
    std::string path;
    KVF_CLI_TRY(Required(c.words, "pages", &path));
    if (auto unused = c.words.Unused()) return Usage(absl::StrCat("unknown option --", *unused));
    std::vector<PageHandle> pages;
    KVF_CLI_TRY(ReadPagesFile(path, &pages));
    const absl::Status s = free ? c.client.FreePages(p[2], pages) : c.client.RenewPages(p[2], pages);
    if (!s.ok()) return FromStatus(s);
    if (c.json) c.out << json{{"pool", p[2]}, {free ? "freed" : "renewed", pages.size()}}.dump() << "\n";
    return std::nullopt;
  }
  return Usage("pages needs alloc, free or renew");
}

std::optional<Failure> Put(const Context& c) {
  const auto& p = c.words.positional();
  if (p.size() != 2) return Usage("put needs POOL");
  uint32_t layer;
  KVF_CLI_TRY(Layer(c.words, &layer));
  std::string rows_path;
  KVF_CLI_TRY(Required(c.words, "rows", &rows_path));
  std::vector<TokenLocation> where;
  KVF_CLI_TRY(Locations(c, p[1], &where));
  if (auto unused = c.words.Unused()) return Usage(absl::StrCat("unknown option --", *unused));
  absl::StatusOr<std::vector<uint16_t>> rows = ReadFileArray<uint16_t>(rows_path);
  if (!rows.ok()) return Failure{kExitInvalidInput, std::string(rows.status().message())};
  absl::StatusOr<client::WriteResult> written = c.client.WriteTokens(p[1], layer, where, *rows);
  if (!written.ok()) return FromStatus(written.status());
  if (c.json) {
    c.out << json{{"pool", p[1]}, {"layer", layer}, {"tokens_written", written->tokens_written}}.dump() << "\n";
  } else {
    c.out << written->tokens_written << " tokens written to " << p[1] << " layer " << layer << "\n";
  }
  return std::nullopt;
}

// --layers 0,1 and --transcode-to LAYOUT, both optional.
std::optional<Failure> LayersAndTranscode(const Context& c, std::vector<uint32_t>* layers,
                                          std::optional<client::Layout>* transcode) {
  if (auto text = c.words.Get("layers")) {
    for (absl::string_view part : absl::StrSplit(*text, ',')) {
      uint32_t l;
      KVF_CLI_TRY(ParseNumber("--layers", std::string(part), &l));
      layers->push_back(l);
    }
  }
  if (auto text = c.words.Get("transcode-to")) {
    client::Layout l;
    KVF_CLI_TRY(LayoutOption(*text, &l));
    *transcode = l;
  }
  return std::nullopt;
}

std::optional<Failure> GetPages(const Context& c) {
  const auto& p = c.words.positional();
  if (p.size() != 2) return Usage("get-pages needs POOL");
  std::string pages_path, out_path;
  KVF_CLI_TRY(Required(c.words, "pages", &pages_path));
  KVF_CLI_TRY(Required(c.words, "out", &out_path));
  std::vector<uint32_t> layers;
  std::optional<client::Layout> transcode;
  KVF_CLI_TRY(LayersAndTranscode(c, &layers, &transcode));
  if (auto unused = c.words.Unused()) return Usage(absl::StrCat("unknown option --", *unused));
  std::vector<PageHandle> pages;
  KVF_CLI_TRY(ReadPagesFile(pages_path, &pages));
  absl::StatusOr<std::vector<uint8_t>> bytes = c.client.ReadPages(p[1], pages, layers, transcode);
  if (!bytes.ok()) return FromStatus(bytes.status());
  KVF_CLI_TRY(WriteBytes(out_path, *bytes));
  if (c.json) c.out << json{{"pool", p[1]}, {"bytes", bytes->size()}, {"out", out_path}}.dump() << "\n";
  return std::nullopt;
}

// push (this daemon's pages → a peer's) and pull (a peer's pages → this daemon's).
std::optional<Failure> Transfer(const Context& c, bool push) {
  const auto& p = c.words.positional();
  const char* name = push ? "push" : "pull";
  if (p.size() != 2) return Usage(absl::StrCat(name, " needs POOL"));
  const std::string peer = push ? "to" : "from";
  std::string pages_path;
  client::Client::PeerPages other;
  std::string other_pages_path;
  KVF_CLI_TRY(Required(c.words, "pages", &pages_path));
  KVF_CLI_TRY(Required(c.words, peer, &other.address));
  KVF_CLI_TRY(Required(c.words, peer + "-pool", &other.pool));
  KVF_CLI_TRY(Required(c.words, peer + "-pages", &other_pages_path));
  std::vector<uint32_t> layers;
  std::optional<client::Layout> transcode;
  KVF_CLI_TRY(LayersAndTranscode(c, &layers, &transcode));
  if (auto unused = c.words.Unused()) return Usage(absl::StrCat("unknown option --", *unused));
  std::vector<PageHandle> pages;
  KVF_CLI_TRY(ReadPagesFile(pages_path, &pages));
  KVF_CLI_TRY(ReadPagesFile(other_pages_path, &other.pages));
  absl::StatusOr<client::Client::TransferResult> r =
      push ? c.client.Push(p[1], pages, other, layers, transcode)
           : c.client.Pull(other, p[1], pages, layers, transcode);
  if (!r.ok()) return FromStatus(r.status());
  if (c.json) {
    c.out << json{{"pool", p[1]}, {peer, other.address}, {peer + "_pool", other.pool},
                  {"pages", r->pages}, {"bytes", r->bytes}, {"seconds", r->seconds},
                  {"transport", r->transport}}.dump()
          << "\n";
  } else {
    c.out << (push ? "pushed " : "pulled ") << r->pages << " pages (" << r->bytes << " bytes) in "
          << r->seconds << " s over UCX (" << r->transport << ")\n";
  }
  return std::nullopt;
}

std::optional<Failure> GetWorkspace(const Context& c) {
  const auto& p = c.words.positional();
  if (p.size() != 2) return Usage("get-workspace needs POOL");
  uint32_t layer;
  KVF_CLI_TRY(Layer(c.words, &layer));
  std::string out_path;
  KVF_CLI_TRY(Required(c.words, "out", &out_path));
  std::vector<TokenLocation> where;
  KVF_CLI_TRY(Locations(c, p[1], &where));
  if (auto unused = c.words.Unused()) return Usage(absl::StrCat("unknown option --", *unused));
  absl::StatusOr<std::vector<uint16_t>> rows = c.client.ReadWorkspace(p[1], layer, where);
  if (!rows.ok()) return FromStatus(rows.status());
  KVF_CLI_TRY(WriteBytes(out_path, {reinterpret_cast<const uint8_t*>(rows->data()), rows->size() * 2}));
  if (c.json) c.out << json{{"pool", p[1]}, {"rows", where.size()}, {"out", out_path}}.dump() << "\n";
  return std::nullopt;
}

std::optional<Failure> StatsCommand(const Context& c) {
  if (c.words.positional().size() != 1) return Usage("stats takes no arguments");
  if (auto unused = c.words.Unused()) return Usage(absl::StrCat("unknown option --", *unused));
  absl::StatusOr<client::Stats> stats = c.client.GetStats();
  if (!stats.ok()) return FromStatus(stats.status());
  if (c.json) {
    json pools = json::array();
    for (const auto& s : stats->pools) {
      pools.push_back({{"name", s.name}, {"layout", client::LayoutName(s.layout)},
                       {"page_size", s.page_size}, {"pages_used", s.pages_used},
                       {"pages_free", s.pages_free}, {"tokens_held", s.tokens_held},
                       {"records_held", s.records_held}, {"pool_bytes", s.pool_bytes},
                       {"nominal_bytes_per_token", s.nominal_bytes_per_token},
                       {"effective_bytes_per_token", s.effective_bytes_per_token},
                       {"bytes_saved_vs_bf16", s.bytes_saved_vs_bf16},
                       {"bytes_saved_vs_v4", s.bytes_saved_vs_v4}});
    }
    c.out << json{{"pools", pools}, {"tokens_held", stats->tokens_held},
                  {"records_held", stats->records_held}, {"pool_bytes", stats->pool_bytes},
                  {"bytes_saved_vs_bf16", stats->bytes_saved_vs_bf16},
                  {"bytes_saved_vs_v4", stats->bytes_saved_vs_v4}}
                 .dump(2)
          << "\n";
    return std::nullopt;
  }
  std::ostream& o = c.out;
  o << std::left << std::setw(20) << "POOL" << std::setw(9) << "LAYOUT" << std::right
    << std::setw(12) << "PAGES USED" << std::setw(12) << "PAGES FREE" << std::setw(12) << "TOKENS"
    << std::setw(15) << "B/TOKEN NOM" << std::setw(15) << "B/TOKEN EFF" << std::setw(14)
    << "SAVED v bf16" << std::setw(14) << "SAVED v V4" << "\n";
  for (const auto& s : stats->pools) {
    o << std::left << std::setw(20) << s.name << std::setw(9) << client::LayoutName(s.layout)
      << std::right << std::setw(12) << s.pages_used << std::setw(12) << s.pages_free
      << std::setw(12) << s.tokens_held << std::setw(15) << std::fixed << std::setprecision(1)
      << s.nominal_bytes_per_token << std::setw(15) << s.effective_bytes_per_token << std::setw(14)
      << HumanBytes(s.bytes_saved_vs_bf16) << std::setw(14) << HumanBytes(s.bytes_saved_vs_v4)
      << "\n";
  }
  o << "total: " << stats->tokens_held << " tokens, " << stats->records_held << " records in "
    << HumanBytes(stats->pool_bytes) << " of pools; saved " << HumanBytes(stats->bytes_saved_vs_bf16)
    << " against bf16, " << HumanBytes(stats->bytes_saved_vs_v4) << " against V4\n";
  return std::nullopt;
}

std::optional<Failure> Health(const Context& c) {
  if (c.words.positional().size() != 1) return Usage("health takes no arguments");
  if (auto unused = c.words.Unused()) return Usage(absl::StrCat("unknown option --", *unused));
  if (absl::Status s = c.client.Health(); !s.ok()) return FromStatus(s);
  c.out << (c.json ? "{\"status\": \"SERVING\"}\n" : "SERVING\n");
  return std::nullopt;
}

// Throughput of a fresh pool: WriteTokens, ReadWorkspace and ReadPages of --tokens tokens.
std::optional<Failure> Bench(const Context& c) {
  if (c.words.positional().size() != 1) return Usage("bench takes no positional arguments");
  client::Layout layout = client::Layout::kV41;
  uint32_t page_size = 64;
  uint64_t tokens = 1 << 18;
  if (auto t = c.words.Get("layout")) KVF_CLI_TRY(LayoutOption(*t, &layout));
  if (auto t = c.words.Get("page-size")) KVF_CLI_TRY(ParseNumber("--page-size", *t, &page_size));
  if (auto t = c.words.Get("tokens")) KVF_CLI_TRY(ParseNumber("--tokens", *t, &tokens));
  const std::string device = c.words.Get("device").value_or("");
  if (auto unused = c.words.Unused()) return Usage(absl::StrCat("unknown option --", *unused));
  if (tokens == 0 || page_size == 0) return Usage("--tokens and --page-size must be positive");
  constexpr uint64_t kPerCall = 16384;
  const uint64_t pages_needed = (tokens + page_size - 1) / page_size;
  const std::string pool = absl::StrCat("kvferry-bench-", getpid());
  absl::StatusOr<client::PoolInfo> info =
      c.client.CreatePool({pool, layout, page_size, pages_needed, 1, device});
  if (!info.ok()) return FromStatus(info.status());
  struct Cleanup {
    Client& client;
    std::string pool;
    ~Cleanup() { client.DeletePool(pool).IgnoreError(); }
  } cleanup{c.client, pool};
  std::vector<PageHandle> pages;
  while (pages.size() < pages_needed) {
    absl::StatusOr<std::vector<PageHandle>> more = c.client.AllocatePages(
        pool, static_cast<uint32_t>(std::min<uint64_t>(65536, pages_needed - pages.size())));
    if (!more.ok()) return FromStatus(more.status());
    pages.insert(pages.end(), more->begin(), more->end());
  }
  // Random finite rows (bf16 of N(0,1)-ish values), written call by call.
  std::mt19937 random(1);
  std::normal_distribution<float> normal;
  std::vector<uint16_t> rows(kPerCall * 512);
  for (auto& v : rows) {
    float f = normal(random);
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    v = static_cast<uint16_t>(bits >> 16);
  }
  auto progress = [&](const char* what, uint64_t done) {
    if (!c.terminal) return;
    const int width = 40;
    const int filled = static_cast<int>(width * done / tokens);
    c.err << "\r" << std::left << std::setw(14) << what << " [" << std::string(filled, '#')
          << std::string(width - filled, ' ') << "] " << std::setw(3) << (100 * done / tokens) << "%"
          << std::flush;
    if (done == tokens) c.err << "\n";
  };
  auto locations = [&](uint64_t first, uint64_t n) {
    std::vector<TokenLocation> where(n);
    for (uint64_t i = 0; i < n; ++i) {
      where[i] = {pages[(first + i) / page_size], static_cast<uint32_t>((first + i) % page_size)};
    }
    return where;
  };
  using Clock = std::chrono::steady_clock;
  json results = json::object();
  auto run = [&](const char* name, uint64_t bytes_per_token,
                 const std::function<absl::Status(uint64_t, uint64_t)>& call) -> std::optional<Failure> {
    const auto start = Clock::now();
    for (uint64_t first = 0; first < tokens; first += kPerCall) {
      const uint64_t n = std::min(kPerCall, tokens - first);
      if (absl::Status s = call(first, n); !s.ok()) return FromStatus(s);
      progress(name, first + n);
    }
    const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
    const double gbps = tokens * bytes_per_token / seconds / 1e9;
    results[name] = {{"seconds", seconds}, {"tokens_per_second", tokens / seconds}, {"gb_per_second", gbps}};
    if (!c.json) {
      c.out << std::left << std::setw(14) << name << std::right << std::setw(12) << std::fixed
            << std::setprecision(0) << tokens / seconds << " tokens/s " << std::setw(8)
            << std::setprecision(2) << gbps << " GB/s\n";
    }
    return std::nullopt;
  };
  KVF_CLI_TRY(run("WriteTokens", 1024, [&](uint64_t first, uint64_t n) {
    return c.client.WriteTokens(pool, 0, locations(first, n), {rows.data(), n * 512}).status();
  }));
  std::vector<uint16_t> back(kPerCall * 512);
  KVF_CLI_TRY(run("ReadWorkspace", 1024, [&](uint64_t first, uint64_t n) {
    return c.client.ReadWorkspaceInto(pool, 0, locations(first, n), {back.data(), n * 512});
  }));
  const uint64_t page_bytes = info->page_bytes;
  std::vector<uint8_t> page_buffer;
  KVF_CLI_TRY(run("ReadPages", page_bytes / page_size, [&](uint64_t first, uint64_t n) {
    const uint64_t p0 = first / page_size, p1 = (first + n + page_size - 1) / page_size;
    page_buffer.resize((p1 - p0) * page_bytes);
    return c.client.ReadPagesInto(pool, std::span<const PageHandle>(pages).subspan(p0, p1 - p0), {},
                                  std::nullopt, page_buffer).status();
  }));
  if (c.json) {
    results["tokens"] = tokens;
    results["layout"] = client::LayoutName(layout);
    results["page_size"] = page_size;
    c.out << results.dump(2) << "\n";
  }
  return std::nullopt;
}

// ---- the KV cache ---------------------------------------------------------------------------

json NamespaceJson(const client::NamespaceInfo& ns) {
  json members = json::array();
  for (const auto& m : ns.members) {
    members.push_back({{"pool", m.pool}, {"layout", client::LayoutName(m.layout)},
                       {"page_size", m.page_size}, {"num_layers", m.num_layers},
                       {"tier", m.tier}, {"blocks", m.blocks}});
  }
  return {{"name", ns.name}, {"digest", ns.digest}, {"block_tokens", ns.block_tokens},
          {"max_blocks", ns.max_blocks}, {"members", members}};
}

std::optional<Failure> ReadKeys(const Words& w, std::vector<std::string>* keys) {
  std::string path;
  KVF_CLI_TRY(Required(w, "keys", &path));
  std::ifstream in(path);
  if (!in) return Failure{kExitInvalidInput, absl::StrCat("cannot read ", path)};
  for (std::string line; std::getline(in, line);) keys->push_back(line);
  return std::nullopt;
}

// The namespace as calls name it: --digest, or the namespace's own.
std::optional<Failure> Namespace(const Context& c, const std::string& name,
                                 client::NamespaceRef* ref) {
  ref->name = name;
  if (auto digest = c.words.Get("digest")) return ParseNumber("--digest", *digest, &ref->digest);
  absl::StatusOr<client::NamespaceInfo> info = c.client.DescribeNamespace(name);
  if (!info.ok()) return FromStatus(info.status());
  ref->digest = info->digest;
  return std::nullopt;
}

std::optional<Failure> CacheCommand(const Context& c) {
  const auto& p = c.words.positional();
  if (p.size() < 3) return Usage("cache needs a subcommand and a namespace");
  const std::string& sub = p[1];
  const std::string& name = p[2];
  auto print = [&](const client::NamespaceInfo& ns) {
    if (c.json) {
      c.out << NamespaceJson(ns).dump(2) << "\n";
      return;
    }
    c.out << ns.name << ": digest " << ns.digest << ", " << ns.block_tokens
          << " tokens per block";
    for (const auto& m : ns.members) {
      c.out << "; " << m.pool << " (" << client::LayoutName(m.layout) << ", " << m.blocks
            << " blocks on " << m.tier << ")";
    }
    c.out << "\n";
  };
  if (sub == "create") {
    client::NamespaceSpec spec;
    spec.name = name;
    std::string text;
    KVF_CLI_TRY(Required(c.words, "pools", &text));
    spec.pools = absl::StrSplit(text, ',');
    KVF_CLI_TRY(Required(c.words, "block-tokens", &text));
    KVF_CLI_TRY(ParseNumber("--block-tokens", text, &spec.block_tokens));
    if (auto v = c.words.Get("model")) spec.model_fingerprint = *v;
    if (auto v = c.words.Get("layer-group")) spec.layer_group = *v;
    if (auto v = c.words.Get("salt")) spec.tenant_salt = *v;
    if (auto v = c.words.Get("max-blocks")) KVF_CLI_TRY(ParseNumber("--max-blocks", *v, &spec.max_blocks));
    if (auto unused = c.words.Unused()) return Usage(absl::StrCat("unknown option --", *unused));
    absl::StatusOr<client::NamespaceInfo> ns = c.client.CreateNamespace(spec);
    if (!ns.ok()) return FromStatus(ns.status());
    print(*ns);
    return std::nullopt;
  }
  if (sub == "describe" || sub == "delete") {
    if (auto unused = c.words.Unused()) return Usage(absl::StrCat("unknown option --", *unused));
    if (sub == "delete") {
      if (absl::Status s = c.client.DeleteNamespace(name); !s.ok()) return FromStatus(s);
      if (c.json) c.out << json{{"deleted", name}}.dump() << "\n";
      return std::nullopt;
    }
    absl::StatusOr<client::NamespaceInfo> ns = c.client.DescribeNamespace(name);
    if (!ns.ok()) return FromStatus(ns.status());
    print(*ns);
    return std::nullopt;
  }
  client::NamespaceRef ref;
  if (sub == "put") {
    if (p.size() != 4) return Usage("cache put needs NS POOL");
    std::vector<std::string> keys;
    KVF_CLI_TRY(ReadKeys(c.words, &keys));
    std::string rows_path;
    KVF_CLI_TRY(Required(c.words, "rows", &rows_path));
    KVF_CLI_TRY(Namespace(c, name, &ref));
    if (auto unused = c.words.Unused()) return Usage(absl::StrCat("unknown option --", *unused));
    absl::StatusOr<std::vector<uint16_t>> rows = ReadFileArray<uint16_t>(rows_path);
    if (!rows.ok()) return Failure{kExitInvalidInput, std::string(rows.status().message())};
    absl::StatusOr<client::PoolInfo> pool = c.client.DescribePool(p[3]);
    if (!pool.ok()) return FromStatus(pool.status());
    const size_t per = static_cast<size_t>(pool->spec.page_size) * 512;
    const size_t layers = pool->spec.num_layers;
    if (rows->size() != keys.size() * layers * per) {
      return Failure{kExitInvalidInput,
                     absl::StrCat(rows_path, " holds ", rows->size() / 512, " rows; ", keys.size(),
                                  " keys x ", layers, " layers x ", pool->spec.page_size,
                                  " slots need ", keys.size() * layers * per / 512)};
    }
    std::vector<client::BlockRows> blocks;
    for (size_t k = 0; k < keys.size(); ++k) {
      for (size_t l = 0; l < layers; ++l) {
        blocks.push_back({keys[k], static_cast<uint32_t>(l), 0,
                          std::span<const uint16_t>(*rows).subspan((k * layers + l) * per, per)});
      }
    }
    absl::StatusOr<client::PutResult> put = c.client.PutRows(ref, p[3], blocks);
    if (!put.ok()) return FromStatus(put.status());
    if (c.json) {
      c.out << json{{"blocks_stored", put->blocks_stored},
                    {"blocks_already_held", put->blocks_already_held}}.dump() << "\n";
    } else {
      c.out << put->blocks_stored << " blocks stored, " << put->blocks_already_held
            << " already held\n";
    }
    return std::nullopt;
  }
  if (sub == "lookup") {
    std::vector<std::string> keys;
    KVF_CLI_TRY(ReadKeys(c.words, &keys));
    client::LookupOptions options;
    if (auto v = c.words.Get("pools")) options.pools = absl::StrSplit(*v, ',');
    if (auto v = c.words.Get("lease-ms")) {
      uint32_t ms;
      KVF_CLI_TRY(ParseNumber("--lease-ms", *v, &ms));
      options.lease_ttl = absl::Milliseconds(ms);
    }
    KVF_CLI_TRY(Namespace(c, name, &ref));
    if (auto unused = c.words.Unused()) return Usage(absl::StrCat("unknown option --", *unused));
    absl::StatusOr<client::LookupResult> hit = c.client.Lookup(ref, keys, options);
    if (!hit.ok()) return FromStatus(hit.status());
    if (c.json) {
      c.out << json{{"hit_blocks", hit->hit_blocks}, {"pending_blocks", hit->pending_blocks},
                    {"hit_tokens", hit->hit_tokens}, {"lease_id", hit->lease_id}}.dump() << "\n";
    } else {
      c.out << hit->hit_blocks << " of " << keys.size() << " blocks held (" << hit->hit_tokens
            << " tokens), " << hit->pending_blocks << " more being written";
      if (hit->lease_id != 0) c.out << "; lease " << hit->lease_id;
      c.out << "\n";
    }
    return std::nullopt;
  }
  if (sub == "load" || sub == "release") {
    std::string text;
    uint64_t lease;
    KVF_CLI_TRY(Required(c.words, "lease", &text));
    KVF_CLI_TRY(ParseNumber("--lease", text, &lease));
    if (sub == "release") {
      KVF_CLI_TRY(Namespace(c, name, &ref));
      if (auto unused = c.words.Unused()) return Usage(absl::StrCat("unknown option --", *unused));
      if (absl::Status s = c.client.ReleaseLease(ref, lease); !s.ok()) return FromStatus(s);
      return std::nullopt;
    }
    if (p.size() != 4) return Usage("cache load needs NS POOL");
    std::string out_path;
    KVF_CLI_TRY(Required(c.words, "out", &out_path));
    client::BlockRange range;
    if (auto v = c.words.Get("first")) KVF_CLI_TRY(ParseNumber("--first", *v, &range.first));
    if (auto v = c.words.Get("count")) KVF_CLI_TRY(ParseNumber("--count", *v, &range.count));
    uint32_t layer = 0;
    if (auto v = c.words.Get("layer")) KVF_CLI_TRY(ParseNumber("--layer", *v, &layer));
    const bool records = c.words.Get("records").has_value();
    KVF_CLI_TRY(Namespace(c, name, &ref));
    if (auto unused = c.words.Unused()) return Usage(absl::StrCat("unknown option --", *unused));
    uint64_t bytes = 0;
    if (records) {
      absl::StatusOr<std::vector<uint8_t>> pages =
          c.client.LoadPages(ref, lease, p[3], {}, std::nullopt, range);
      if (!pages.ok()) return FromStatus(pages.status());
      KVF_CLI_TRY(WriteBytes(out_path, *pages));
      bytes = pages->size();
    } else {
      absl::StatusOr<std::vector<uint16_t>> rows = c.client.LoadRows(ref, lease, p[3], layer, range);
      if (!rows.ok()) return FromStatus(rows.status());
      KVF_CLI_TRY(WriteBytes(out_path, {reinterpret_cast<const uint8_t*>(rows->data()),
                                        rows->size() * 2}));
      bytes = rows->size() * 2;
    }
    if (c.json) c.out << json{{"bytes", bytes}, {"out", out_path}}.dump() << "\n";
    return std::nullopt;
  }
  return Usage(absl::StrCat("unknown cache subcommand '", sub, "'"));
}

}  // namespace

bool IsDaemonCommand(const std::string& command) {
  static const std::set<std::string> kCommands = {"pool", "pages", "put", "get-pages",
                                                  "get-workspace", "push", "pull", "stats", "bench", "health",
                                                  "cache"};
  return kCommands.contains(command);
}

const char* DaemonUsage() { return kUsage; }

int RunDaemonCommand(const std::vector<std::string>& args, std::ostream& out, std::ostream& err,
                     bool err_is_terminal) {
  Words words;
  if (std::optional<Failure> f = Words::Parse(args, &words)) {
    err << "kvferry: " << f->message << "\n" << kUsage;
    return f->code;
  }
  if (words.Has("help")) {
    out << (words.positional().empty() ? std::string(kUsage) : CommandUsage(words.positional()[0]));
    return kExitOk;
  }
  client::ClientOptions options;
  if (auto target = words.Get("target")) options.target = *target;
  if (auto timeout = words.Get("timeout")) {
    double seconds;
    if (!absl::SimpleAtod(*timeout, &seconds) || seconds <= 0) {
      err << "kvferry: --timeout takes a positive number of seconds\n";
      return kExitUsage;
    }
    options.timeout = absl::Seconds(seconds);
  }
  // The whole contents of a small text file (certificates, the token).
  auto slurp = [&](const std::string& flag, std::string* text) -> bool {
    std::optional<std::string> path = words.Get(flag);
    if (!path.has_value()) return true;
    std::ifstream in(*path);
    if (!in) {
      err << "kvferry: cannot read --" << flag << " " << *path << "\n";
      return false;
    }
    text->assign(std::istreambuf_iterator<char>(in), {});
    return true;
  };
  std::string token, ca, cert, key;
  if (!slurp("token-file", &token) || !slurp("tls-ca", &ca) || !slurp("tls-cert", &cert) ||
      !slurp("tls-key", &key)) {
    return kExitInvalidInput;
  }
  options.bearer_token = token.substr(0, token.find_first_of("\r\n"));
  if (!ca.empty()) {
    grpc::SslCredentialsOptions tls;
    tls.pem_root_certs = ca;
    tls.pem_cert_chain = cert;
    tls.pem_private_key = key;
    options.credentials = grpc::SslCredentials(tls);
  } else if (!cert.empty() || !key.empty()) {
    err << "kvferry: --tls-cert and --tls-key need --tls-ca\n";
    return kExitUsage;
  }
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(options);
  if (!client.ok()) {
    err << "kvferry: " << client.status().message() << "\n";
    return kExitInvalidInput;
  }
  const Context c{words, **client, out, err, words.Has("json"), err_is_terminal};
  const std::string& command = words.positional().front();
  std::optional<Failure> failure;
  if (command == "pool") failure = Pool(c);
  else if (command == "pages") failure = Pages(c);
  else if (command == "put") failure = Put(c);
  else if (command == "get-pages") failure = GetPages(c);
  else if (command == "push") failure = Transfer(c, true);
  else if (command == "pull") failure = Transfer(c, false);
  else if (command == "get-workspace") failure = GetWorkspace(c);
  else if (command == "stats") failure = StatsCommand(c);
  else if (command == "bench") failure = Bench(c);
  else if (command == "health") failure = Health(c);
  else if (command == "cache") failure = CacheCommand(c);
  if (failure.has_value()) {
    err << "kvferry " << command << ": " << failure->message << "\n";
    if (failure->code == kExitUsage) err << kUsage;
    return failure->code;
  }
  return kExitOk;
}

}  // namespace kvferry::cli
