#include "report/ticks.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

namespace primus::report {
namespace {

// The smallest of 1, 2, 5 x 10^k not below `raw`.
double nice_step(double raw) {
  const double p = std::pow(10.0, std::floor(std::log10(raw)));
  for (double m : {1.0, 2.0, 5.0, 10.0})
    if (m * p >= raw * (1 - 1e-9)) return m * p;
  return 10 * p;
}

// Trailing zeros of a fixed or mantissa text ("2.50" -> "2.5", "3.0" -> "3").
std::string trim_zeros(std::string s) {
  if (s.find('.') == std::string::npos) return s;
  while (!s.empty() && s.back() == '0') s.pop_back();
  if (!s.empty() && s.back() == '.') s.pop_back();
  return s;
}

int decimals_for(double step) { return std::max(0, static_cast<int>(std::ceil(-std::log10(step) - 1e-9))); }

}  // namespace

Axis linear_axis(double lo, double hi, int target) {
  if (!std::isfinite(lo) || !std::isfinite(hi)) lo = hi = 0;
  if (lo > hi) std::swap(lo, hi);
  if (hi - lo <= 1e-12 * std::max(std::abs(lo), std::abs(hi))) {
    const double pad = lo == 0 ? 1.0 : std::abs(lo) * 0.1;
    lo -= pad;
    hi += pad;
  }
  Axis a;
  a.step = nice_step((hi - lo) / std::max(1, target));
  // Widen to whole steps: the line then never touches the frame, and the end labels are round.
  a.lo = std::floor(lo / a.step + 1e-9) * a.step;
  a.hi = std::ceil(hi / a.step - 1e-9) * a.step;
  for (double v = a.lo; v <= a.hi + a.step * 1e-6; v += a.step) a.ticks.push_back(std::abs(v) < a.step * 1e-9 ? 0.0 : v);
  return a;
}

Axis log_axis(double lo, double hi, int target) {
  if (!(lo > 0) || !(hi > 0)) return linear_axis(lo, hi, target);
  if (lo > hi) std::swap(lo, hi);
  const double d0 = std::floor(std::log10(lo) + 1e-9), d1 = std::ceil(std::log10(hi) - 1e-9);
  if (d1 - d0 <= 1) {
    // Within one decade a log axis looks linear; nice linear ticks read better than one label.
    Axis lin = linear_axis(lo, hi, target);
    Axis a;
    a.log = true;
    a.lo = lo;
    a.hi = hi;
    a.step = lin.step;
    for (double v : lin.ticks)
      if (v >= lo * (1 - 1e-9) && v <= hi * (1 + 1e-9) && v > 0) a.ticks.push_back(v);
    return a;
  }
  Axis a;
  a.log = true;
  a.lo = std::pow(10.0, d0);
  a.hi = std::pow(10.0, d1);
  const bool minor = d1 - d0 < 3;
  for (double d = d0; d <= d1; d += 1) {
    const double p = std::pow(10.0, d);
    a.ticks.push_back(p);
    if (minor && d < d1) {
      a.ticks.push_back(2 * p);
      a.ticks.push_back(5 * p);
    }
  }
  return a;
}

std::string tick_label(double v, const Axis& axis) {
  if (v == 0) return "0";
  double mag = 0;
  for (double t : axis.ticks) mag = std::max(mag, std::abs(t));
  if (axis.log && axis.ticks.size() > 1 && axis.step == 0) mag = std::abs(v);  // decades: each label on its own
  static const struct {
    double scale;
    const char* suffix;
  } kSi[] = {{1e12, "T"}, {1e9, "G"}, {1e6, "M"}, {1e3, "k"}};
  if (mag >= 1e4) {
    for (auto& si : kSi) {
      if (mag >= si.scale) {
        const double step = axis.step > 0 ? axis.step / si.scale : std::abs(v) / si.scale;
        return trim_zeros(fmt::format("{:.{}f}", v / si.scale, std::min(3, decimals_for(step)))) + si.suffix;
      }
    }
  }
  if (mag < 1e-2) {
    // 3e-4, 1.5e-5: the mantissa keeps the digits the spacing needs.
    const int e = static_cast<int>(std::floor(std::log10(std::abs(v)) + 1e-9));
    const double m = v / std::pow(10.0, e);
    const int dec = axis.step > 0 ? std::min(3, std::max(0, decimals_for(axis.step / std::pow(10.0, e)))) : 2;
    return trim_zeros(fmt::format("{:.{}f}", m, dec)) + fmt::format("e{}", e);
  }
  const int dec = axis.step > 0 ? std::min(6, decimals_for(axis.step)) : 3;
  return axis.step > 0 ? fmt::format("{:.{}f}", v, dec) : trim_zeros(fmt::format("{:.{}f}", v, dec));
}

}  // namespace primus::report
