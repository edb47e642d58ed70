#include "train/document_masks.h"

#include <limits>

#include "core/util/error.h"

namespace primus::train {

void build_document_tables(const int32_t* tokens, int64_t B, int64_t T, const DocumentMasking& m,
                           DocumentTables* out) {
  PRIMUS_CHECK(B > 0 && T > 0, "document masks: batch {}x{} must be positive", B, T);
  PRIMUS_CHECK(B * T <= std::numeric_limits<int32_t>::max(), "document masks: B*T={} exceeds int32", B * T);
  PRIMUS_CHECK(!m.enabled() || m.eod_id >= 0,
               "document masks: reset_attention_mask / reset_position_ids need the tokenizer's end-of-document id");
  out->positions.resize(static_cast<size_t>(B * T));
  out->cu_seqlens.clear();
  if (m.reset_attention_mask) out->cu_seqlens.push_back(0);
  for (int64_t b = 0; b < B; ++b) {
    const int32_t* row = tokens + b * T;
    int64_t start = 0;  // of the current document within the row
    for (int64_t t = 0; t < T; ++t) {
      out->positions[static_cast<size_t>(b * T + t)] = static_cast<int32_t>(m.reset_position_ids ? t - start : t);
      if (row[t] == m.eod_id && m.enabled() && t + 1 < T) {
        start = t + 1;  // the end-of-document token closes its document; the next token opens one
        if (m.reset_attention_mask) out->cu_seqlens.push_back(static_cast<int32_t>(b * T + start));
      }
    }
    if (m.reset_attention_mask) out->cu_seqlens.push_back(static_cast<int32_t>((b + 1) * T));
  }
}

int64_t mask_eod_targets(const int32_t* inputs, int32_t* targets, int64_t n, int32_t eod_id, int32_t ignore_index) {
  PRIMUS_CHECK(eod_id >= 0, "eod_mask_loss: the tokenizer has no end-of-document token to mask the loss at");
  int64_t kept = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (inputs[i] == eod_id) targets[i] = ignore_index;
    kept += targets[i] != ignore_index;
  }
  return kept;
}

void build_fixed_document_tables(const int32_t* tokens, int64_t B, int64_t T, int32_t eod_id, int32_t* positions,
                                 int32_t* cu_seqlens) {
  PRIMUS_CHECK(B > 0 && T > 0, "document masks: batch {}x{} must be positive", B, T);
  PRIMUS_CHECK(B * T <= std::numeric_limits<int32_t>::max() - 1, "document masks: B*T={} exceeds int32", B * T);
  for (int64_t b = 0; b < B; ++b) {
    int64_t start = 0;
    for (int64_t t = 0; t < T; ++t) {
      if (t > 0 && tokens[b * T + t - 1] == eod_id) start = t;
      positions[b * T + t] = static_cast<int32_t>(t - start);
      cu_seqlens[b * T + t] = static_cast<int32_t>(b * T + start);
    }
  }
  cu_seqlens[B * T] = static_cast<int32_t>(B * T);
}

}  // namespace primus::train
