// Axis ticks at "nice" numbers (1, 2 or 5 times a power of ten; decades on a log axis) and
// their labels, short enough for a chart (1.5M tokens, 3e-4 learning rates).
#pragma once
#include <string>
#include <vector>

namespace primus::report {

struct Axis {
  double lo = 0, hi = 1;       // the drawn range, widened to tick boundaries where that is cheap
  bool log = false;            // log10 scale (lo > 0)
  std::vector<double> ticks;   // inside [lo, hi]
  double step = 0;             // linear: the tick spacing (labels' precision follows it)
};

// A linear axis over [lo, hi] with about `target` ticks. Equal or non-finite bounds are widened
// to a range around the value.
Axis linear_axis(double lo, double hi, int target = 5);
// A log axis over [lo, hi] (both > 0): ticks at powers of ten, with 2 and 5 between when fewer
// than three decades are shown, and nice linear ticks when the range is within one decade.
Axis log_axis(double lo, double hi, int target = 5);

// The label of tick `v` on `axis`: SI suffixes (k, M, G, T) from 10^4 up, scientific for small
// magnitudes, otherwise as many decimals as the tick spacing needs.
std::string tick_label(double v, const Axis& axis);

}  // namespace primus::report
