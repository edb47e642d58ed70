// Residual connection: out = a + b over a flat array of n elements.
#pragma once
#include <cstdint>

namespace primus::turbo::cpu {

// out[n] = a[n] + b[n]. Overwrites out; out may alias a or b.
template <typename Real>
void residual_forward(Real* out, const Real* a, const Real* b, int64_t n);

// The gradient of a sum passes through unchanged to both operands: da += dout, db += dout.
// Either of da, db may be nullptr (e.g. when the caller lets the residual stream's gradient
// buffer stand for da and only adds into the branch). Needs nothing from the forward.
// da and db must not alias dout.
template <typename Real>
void residual_backward(Real* da, Real* db, const Real* dout, int64_t n);

}  // namespace primus::turbo::cpu
