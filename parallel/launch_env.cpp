#include "parallel/launch_env.h"

#include <fmt/format.h>

#include <cerrno>
#include <cstdlib>
#include <limits>

#include "core/util/error.h"

namespace primus::parallel {
namespace {

// Strict decimal: the whole value, digits only (an optional '-' where min < 0), within range.
long long parse_int(const std::string& name, const std::string& value, long long min, long long max) {
  bool ok = !value.empty();
  size_t start = (min < 0 && !value.empty() && value[0] == '-') ? 1 : 0;
  if (start == value.size()) ok = false;
  for (size_t i = start; ok && i < value.size(); ++i) ok = value[i] >= '0' && value[i] <= '9';
  long long v = 0;
  if (ok) {
    errno = 0;
    v = std::strtoll(value.c_str(), nullptr, 10);
    ok = errno == 0;
  }
  if (!ok) throw ConfigError(fmt::format("{}='{}' is not an integer", name, value));
  if (v < min || v > max) {
    throw ConfigError(fmt::format("{}={} is out of range [{}, {}]", name, v, min, max));
  }
  return v;
}

int get_int(const EnvLookup& env, const std::string& name, int min, int max = std::numeric_limits<int>::max()) {
  auto v = env(name);
  return static_cast<int>(parse_int(name, *v, min, max));
}

// One entry of a host list: literal text and bracket groups, in order.
struct Range {
  std::string lo_text;  // as written, so "08" keeps its width
  long long lo, hi;
};
struct Segment {
  std::string literal;       // text before the group (or the whole tail when ranges is empty)
  std::vector<Range> ranges;  // empty: no bracket group follows the literal
};

std::vector<std::string> split_top_level(const std::string& list, const std::string& what) {
  std::vector<std::string> out;
  std::string cur;
  int depth = 0;
  for (char c : list) {
    if (c == '[') ++depth;
    if (c == ']') --depth;
    if (depth < 0 || depth > 1) throw ConfigError(fmt::format("{}='{}': unbalanced '[' / ']'", what, list));
    if (c == ',' && depth == 0) {
      out.push_back(cur);
      cur.clear();
    } else {
      cur += c;
    }
  }
  if (depth != 0) throw ConfigError(fmt::format("{}='{}': unbalanced '[' / ']'", what, list));
  out.push_back(cur);
  for (auto& e : out) {
    if (e.empty()) throw ConfigError(fmt::format("{}='{}': empty host name", what, list));
  }
  return out;
}

std::vector<Segment> parse_entry(const std::string& entry, const std::string& what) {
  std::vector<Segment> segs;
  size_t i = 0;
  while (i < entry.size()) {
    size_t open = entry.find('[', i);
    Segment s;
    s.literal = entry.substr(i, open == std::string::npos ? std::string::npos : open - i);
    if (open == std::string::npos) {
      segs.push_back(std::move(s));
      break;
    }
    size_t close = entry.find(']', open);  // balanced: checked by split_top_level
    std::string body = entry.substr(open + 1, close - open - 1);
    size_t p = 0;
    while (true) {
      size_t comma = body.find(',', p);
      std::string item = body.substr(p, comma == std::string::npos ? std::string::npos : comma - p);
      size_t dash = item.find('-');
      std::string lo = item.substr(0, dash);
      std::string hi = dash == std::string::npos ? lo : item.substr(dash + 1);
      std::string label = fmt::format("{} (range '{}' in '{}')", what, item, entry);
      Range r{lo, parse_int(label, lo, 0, 999999999), parse_int(label, hi, 0, 999999999)};
      if (r.hi < r.lo) throw ConfigError(fmt::format("{}: upper bound below lower bound", label));
      s.ranges.push_back(r);
      if (comma == std::string::npos) break;
      p = comma + 1;
    }
    segs.push_back(std::move(s));
    i = close + 1;
  }
  return segs;
}

std::string format_index(const Range& r, long long v) {
  return fmt::format("{:0{}}", v, r.lo_text.size());
}

void read_master(const EnvLookup& env, DistEnv& d) {
  if (auto a = env("MASTER_ADDR")) {
    if (a->empty()) throw ConfigError("MASTER_ADDR is set but empty");
    d.master_addr = *a;
  }
  if (env("MASTER_PORT")) d.master_port = get_int(env, "MASTER_PORT", 1, 65535);
}

void read_torchrun(const EnvLookup& env, DistEnv& d) {
  d.source = "torchrun";
  d.world_size = get_int(env, "WORLD_SIZE", 1);
  d.rank = get_int(env, "RANK", 0);
  // Unset local variables mean one node: a hand-written `RANK=1 WORLD_SIZE=2 primus ...`.
  d.local_world_size = env("LOCAL_WORLD_SIZE") ? get_int(env, "LOCAL_WORLD_SIZE", 1) : d.world_size;
  d.local_rank = env("LOCAL_RANK") ? get_int(env, "LOCAL_RANK", 0) : d.rank % d.local_world_size;
  if (env("GROUP_RANK")) {
    d.node_rank = get_int(env, "GROUP_RANK", 0);
  } else if (env("NODE_RANK")) {
    d.node_rank = get_int(env, "NODE_RANK", 0);
  } else {
    d.node_rank = d.rank / d.local_world_size;
  }
  if (d.local_world_size < d.world_size && !env("MASTER_ADDR")) {
    throw ConfigError(fmt::format(
        "MASTER_ADDR is not set, but the job spans nodes (WORLD_SIZE={}, LOCAL_WORLD_SIZE={}): "
        "set it to the host of rank 0",
        d.world_size, d.local_world_size));
  }
  read_master(env, d);
}

// Returns the variable the node's task count came from, for error messages.
std::string read_slurm(const EnvLookup& env, DistEnv& d) {
  d.source = "slurm";
  d.world_size = get_int(env, "SLURM_NTASKS", 1);
  d.rank = get_int(env, "SLURM_PROCID", 0);
  d.node_rank = env("SLURM_NODEID") ? get_int(env, "SLURM_NODEID", 0) : 0;
  d.local_rank = env("SLURM_LOCALID") ? get_int(env, "SLURM_LOCALID", 0) : 0;
  const char* per_node_vars[] = {"SLURM_NTASKS_PER_NODE", "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"};
  std::string per_node_var;
  for (const char* var : per_node_vars) {
    auto v = env(var);
    if (!v) continue;
    auto counts = parse_tasks_per_node(*v, var);
    if (counts.size() == 1) {
      d.local_world_size = counts[0];  // SLURM_NTASKS_PER_NODE: the same on every node
    } else if (static_cast<size_t>(d.node_rank) < counts.size()) {
      d.local_world_size = counts[d.node_rank];
    } else {
      throw ConfigError(fmt::format("SLURM_NODEID={} but {}='{}' lists {} nodes", d.node_rank, var, *v,
                                    counts.size()));
    }
    per_node_var = var;
    break;
  }
  if (per_node_var.empty()) {  // no per-node count: one node
    d.local_world_size = d.world_size;
    per_node_var = "SLURM_NTASKS";
  }
  for (const char* var : {"SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"}) {
    if (auto v = env(var)) {
      d.master_addr = first_host(*v, var);
      break;
    }
  }
  if (env("SLURM_JOB_ID")) {
    d.master_port = 20000 + static_cast<int>(parse_int("SLURM_JOB_ID", *env("SLURM_JOB_ID"), 0,
                                                       std::numeric_limits<long long>::max()) %
                                             10000);
  }
  read_master(env, d);  // explicit MASTER_ADDR / MASTER_PORT win over what Slurm implies
  return per_node_var;
}

void check_consistent(const DistEnv& d, const std::string& rank_var, const std::string& world_var,
                      const std::string& local_var, const std::string& local_size_var) {
  if (d.rank >= d.world_size) {
    throw ConfigError(fmt::format("{}={} must be below {}={}", rank_var, d.rank, world_var, d.world_size));
  }
  if (d.local_world_size > d.world_size) {
    throw ConfigError(fmt::format("{}={} exceeds {}={}", local_size_var, d.local_world_size, world_var,
                                  d.world_size));
  }
  if (d.local_rank >= d.local_world_size) {
    throw ConfigError(fmt::format("{}={} must be below {}={}", local_var, d.local_rank, local_size_var,
                                  d.local_world_size));
  }
  if (d.node_rank >= d.world_size) {
    throw ConfigError(fmt::format("node rank {} must be below {}={}", d.node_rank, world_var, d.world_size));
  }
}

}  // namespace

std::vector<int> parse_tasks_per_node(const std::string& value, const std::string& what) {
  std::vector<int> counts;
  size_t p = 0;
  while (true) {
    size_t comma = value.find(',', p);
    std::string item = value.substr(p, comma == std::string::npos ? std::string::npos : comma - p);
    std::string label = fmt::format("{} (item '{}' of '{}')", what, item, value);
    size_t paren = item.find('(');
    int n, repeat = 1;
    if (paren == std::string::npos) {
      n = static_cast<int>(parse_int(label, item, 1, 1 << 20));
    } else {
      if (item.size() < paren + 4 || item.compare(paren, 2, "(x") != 0 || item.back() != ')') {
        throw ConfigError(fmt::format("{}: expected N or N(xK)", label));
      }
      n = static_cast<int>(parse_int(label, item.substr(0, paren), 1, 1 << 20));
      repeat = static_cast<int>(parse_int(label, item.substr(paren + 2, item.size() - paren - 3), 1, 1 << 20));
    }
    counts.insert(counts.end(), repeat, n);
    if (comma == std::string::npos) break;
    p = comma + 1;
  }
  return counts;
}

std::vector<std::string> expand_hostlist(const std::string& list, const std::string& what, size_t max_hosts) {
  std::vector<std::string> hosts;
  for (const auto& entry : split_top_level(list, what)) {
    std::vector<std::string> partial{""};
    for (const auto& seg : parse_entry(entry, what)) {
      std::vector<std::string> next;
      for (const auto& head : partial) {
        if (seg.ranges.empty()) {
          next.push_back(head + seg.literal);
          continue;
        }
        for (const auto& r : seg.ranges) {
          for (long long v = r.lo; v <= r.hi; ++v) {
            if (hosts.size() + next.size() >= max_hosts) {
              throw ConfigError(fmt::format("{}='{}' expands to more than {} hosts", what, list, max_hosts));
            }
            next.push_back(head + seg.literal + format_index(r, v));
          }
        }
      }
      partial = std::move(next);
    }
    hosts.insert(hosts.end(), partial.begin(), partial.end());
  }
  return hosts;
}

std::string first_host(const std::string& list, const std::string& what) {
  if (list.empty()) throw ConfigError(fmt::format("{} is set but empty", what));
  std::string host;
  for (const auto& seg : parse_entry(split_top_level(list, what).front(), what)) {
    host += seg.literal;
    if (!seg.ranges.empty()) host += seg.ranges.front().lo_text;
  }
  return host;
}

DistEnv read_dist_env(const EnvLookup& env) {
  DistEnv d;
  bool has_rank = env("RANK").has_value(), has_world = env("WORLD_SIZE").has_value();
  if (has_rank != has_world) {
    throw ConfigError(fmt::format("{} is set but {} is not: torchrun-style launches set both",
                                  has_rank ? "RANK" : "WORLD_SIZE", has_rank ? "WORLD_SIZE" : "RANK"));
  }
  if (has_rank) {
    read_torchrun(env, d);
    check_consistent(d, "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE");
  } else if (env("SLURM_PROCID") && env("SLURM_NTASKS")) {
    std::string per_node_var = read_slurm(env, d);
    check_consistent(d, "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", per_node_var);
  } else {
    read_master(env, d);
  }
  // torchrun's agent (torch >= 2.4) hosts its own store on MASTER_PORT and says so; ours, which
  // speaks another protocol, then takes the next port unless told otherwise.
  if (env("PRIMUS_STORE_PORT")) {
    d.master_port = get_int(env, "PRIMUS_STORE_PORT", 1, 65535);
  } else if (d.source == "torchrun" && env("TORCHELASTIC_USE_AGENT_STORE") == std::optional<std::string>("True")) {
    if (d.master_port == 65535) throw ConfigError("MASTER_PORT=65535 leaves no port for the Primus store: set PRIMUS_STORE_PORT");
    d.master_port += 1;
  }
  if (auto t = env("PRIMUS_DIST_TIMEOUT")) {
    char* end = nullptr;
    d.timeout_s = std::strtod(t->c_str(), &end);
    if (t->empty() || *end != '\0' || !(d.timeout_s > 0) || d.timeout_s > 1e7) {
      throw ConfigError(fmt::format("PRIMUS_DIST_TIMEOUT='{}' is not a positive number of seconds", *t));
    }
  }
  return d;
}

DistEnv read_dist_env() {
  return read_dist_env([](const std::string& name) -> std::optional<std::string> {
    const char* v = std::getenv(name.c_str());
    if (!v) return std::nullopt;
    return std::string(v);
  });
}

std::string describe(const DistEnv& d) {
  return fmt::format("rank {}/{} (local {}/{}, node {}) via {}, store {}:{}", d.rank, d.world_size, d.local_rank,
                     d.local_world_size, d.node_rank, d.source, d.master_addr, d.master_port);
}

}  // namespace primus::parallel
