// RoPE frequency scaling as Llama-3.1 / 3.2 train with it (Hugging Face's rope_scaling
// {"rope_type": "llama3", ...}; Megatron-LM's --use-rope-scaling / --rope-scaling-factor). The
// model spec holds it, the RoPE kernels read it: turbo::cpu::rope_inv_freq is the one function
// that turns (base, head dim, scaling) into the rotation frequencies.
//
// With wavelen_i = 2 pi / inv_freq_i of the plain rotation, low = original_max_position /
// low_freq_factor, high = original_max_position / high_freq_factor:
//   wavelen_i < high            : inv_freq_i unchanged (high frequencies, short wavelengths)
//   wavelen_i > low             : inv_freq_i / factor  (low frequencies, long wavelengths)
//   otherwise                   : (1 - s) inv_freq_i / factor + s inv_freq_i,
//                                 s = (original_max_position / wavelen_i - low_freq_factor) /
//                                     (high_freq_factor - low_freq_factor)
// (transformers' _compute_llama3_parameters, Meta's apply_scaling).
#pragma once

namespace primus {

struct RopeScaling {
  bool enabled = false;                   // use_rope_scaling
  double factor = 8.0;                    // rope_scaling_factor
  double low_freq_factor = 1.0;           // rope_scaling_low_freq_factor
  double high_freq_factor = 4.0;          // rope_scaling_high_freq_factor
  double original_max_position = 8192.0;  // rope_scaling_original_max_position_embeddings

  bool operator==(const RopeScaling&) const = default;
};

}  // namespace primus
