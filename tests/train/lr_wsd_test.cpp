// WSD (warmup-stable-decay) against values worked by hand from Megatron's formulas:
// lr = 1, min_lr = 0.1, warmup 10, lr_decay_iters 110, lr_wsd_decay_iters 20, so the decay
// starts after step 90 and r = (step - 90) / 20.
#include <gtest/gtest.h>

#include <cmath>

#include "train/lr_schedule.h"

using primus::train::lr_at;
using primus::train::OptimizerArgs;

namespace {
OptimizerArgs wsd(const char* shape) {
  OptimizerArgs o;
  o.lr = 1.0;
  o.min_lr = 0.1;
  o.warmup_iters = 10;
  o.decay_iters = 110;
  o.decay_style = "WSD";
  o.wsd_decay_iters = 20;
  o.wsd_decay_style = shape;
  return o;
}
}  // namespace

TEST(LrScheduleWsd, WarmupAndStablePhaseAreTheSameForEveryShape) {
  for (const char* shape : {"linear", "cosine", "exponential", "minus_sqrt"}) {
    OptimizerArgs o = wsd(shape);
    EXPECT_DOUBLE_EQ(lr_at(o, 0), 0.1) << shape;  // warmup: (0 + 1) / 10
    EXPECT_DOUBLE_EQ(lr_at(o, 4), 0.5) << shape;
    EXPECT_DOUBLE_EQ(lr_at(o, 9), 1.0) << shape;
    for (int s = 10; s <= 90; ++s) EXPECT_DOUBLE_EQ(lr_at(o, s), 1.0) << shape << " step " << s;  // stable
    EXPECT_DOUBLE_EQ(lr_at(o, 110), 0.1) << shape;  // the end of decay and after: min_lr
    EXPECT_DOUBLE_EQ(lr_at(o, 1000), 0.1) << shape;
    for (int s = 91; s <= 110; ++s) EXPECT_LT(lr_at(o, s), lr_at(o, s - 1)) << shape << " step " << s;
  }
}

TEST(LrScheduleWsd, EachDecayShapeAtAQuarterAndHalfOfTheDecay) {
  struct Case {
    const char* shape;
    double at95, at100;  // r = 0.25 and r = 0.5: min_lr + c(r) * 0.9
  };
  const Case cases[] = {
      {"linear", 0.1 + 0.75 * 0.9, 0.1 + 0.5 * 0.9},
      // (1 + cos(pi/4)) / 2 = 0.853553390593...; (1 + cos(pi/2)) / 2 = 0.5
      {"cosine", 0.1 + 0.8535533905932737 * 0.9, 0.1 + 0.5 * 0.9},
      // 2 * 0.5^0.25 - 1 = 0.681792830507...; 2 * 0.5^0.5 - 1 = 0.414213562373...
      {"exponential", 0.1 + 0.6817928305074290 * 0.9, 0.1 + 0.4142135623730951 * 0.9},
      // 1 - sqrt(0.25) = 0.5; 1 - sqrt(0.5) = 0.292893218813...
      {"minus_sqrt", 0.1 + 0.5 * 0.9, 0.1 + 0.2928932188134524 * 0.9},
  };
  for (const Case& c : cases) {
    OptimizerArgs o = wsd(c.shape);
    EXPECT_NEAR(lr_at(o, 95), c.at95, 1e-12) << c.shape;
    EXPECT_NEAR(lr_at(o, 100), c.at100, 1e-12) << c.shape;
  }
}

TEST(LrScheduleWsd, DecayAsLongAsTheScheduleStartsRightAfterWarmup) {
  OptimizerArgs o = wsd("linear");
  o.wsd_decay_iters = 100;  // anneal_start = 10: no stable phase
  EXPECT_DOUBLE_EQ(lr_at(o, 9), 1.0);
  EXPECT_DOUBLE_EQ(lr_at(o, 10), 1.0);
  EXPECT_NEAR(lr_at(o, 60), 0.1 + 0.5 * 0.9, 1e-12);
}
