#include "core/util/python_sites.h"

#include <array>
#include <cstdio>
#include <cstdlib>

namespace primus {

std::vector<std::string> python_site_dirs() {
  std::vector<std::string> dirs;
  const char* py = std::getenv("PRIMUS_PYTHON");
  const std::string exe = py && *py ? py : "python3";
  const std::string cmd = "'" + exe +
                          "' -c \"import site; d=list(getattr(site,'getsitepackages',lambda:[])()); "
                          "d.append(site.getusersitepackages()); print(chr(10).join(d))\" 2>/dev/null";
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return dirs;
  std::string out;
  std::array<char, 1024> buf;
  size_t n;
  while ((n = std::fread(buf.data(), 1, buf.size(), p)) > 0) out.append(buf.data(), n);
  pclose(p);
  size_t start = 0;
  while (start < out.size()) {
    size_t end = out.find('\n', start);
    if (end == std::string::npos) end = out.size();
    std::string line = out.substr(start, end - start);
    while (!line.empty() && (line.back() == '\r' || line.back() == ' ')) line.pop_back();
    if (!line.empty()) dirs.push_back(line);
    start = end + 1;
  }
  return dirs;
}

}  // namespace primus
