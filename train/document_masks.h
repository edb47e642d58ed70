// Document masking inside packed sequences (Megatron's reset_attention_mask and
// reset_position_ids, get_ltor_masks_and_position_ids): a training sample of T tokens holds
// several documents joined by the end-of-document token. With reset_attention_mask a token
// attends only to tokens of its own document; with reset_position_ids positions restart at 0
// at each document start. The end-of-document token belongs to the document it ends: the token
// after it starts the next one.
//
// Both backends build the same tables from the input tokens of each micro-batch: per-token
// positions for RoPE / learned positions, and the varlen attention's cu_seqlens (documents
// inside batch rows, as turbo/ops/attention.h takes them).
#pragma once
#include <cstdint>
#include <vector>

namespace primus::train {

struct DocumentMasking {
  bool reset_attention_mask = false;
  bool reset_position_ids = false;
  int32_t eod_id = -1;  // the tokenizer's end-of-document id
  bool enabled() const { return reset_attention_mask || reset_position_ids; }
};

struct DocumentTables {
  // [B*T] position of each token (0.. within its document with reset_position_ids, else t).
  std::vector<int32_t> positions;
  // [num_docs + 1] cumulative offsets over the flattened B*T axis (reset_attention_mask; empty
  // otherwise). Every batch row starts a document; an end-of-document token as a row's last
  // token adds no empty document.
  std::vector<int32_t> cu_seqlens;
};

// tokens [B,T] (the model's inputs). Throws primus::RuntimeError when eod_id < 0 while masking
// is enabled, or when B*T does not fit the i32 tables.
void build_document_tables(const int32_t* tokens, int64_t B, int64_t T, const DocumentMasking& m,
                           DocumentTables* out);

// The same documents in fixed-size tables, as the CUDA kernel writes them
// (turbo/kernels/cuda/document_masks.h), so that a captured step replays for any tokens:
//   positions [B*T]       restarting at 0 after each eod_id (always reset);
//   cu_seqlens [B*T + 1]  cu[b*T + t] = b*T + (start of t's document in row b), cu[B*T] = B*T: a
//                         non-decreasing table whose repeated entries are empty documents (the
//                         attention skips them), num_docs = B*T.
void build_fixed_document_tables(const int32_t* tokens, int64_t B, int64_t T, int32_t eod_id, int32_t* positions,
                                 int32_t* cu_seqlens);

// Megatron-LM's eod_mask_loss: no loss where the input token is the end-of-document id, i.e. no
// prediction of a document's first token from the end of the one before it. targets[i] becomes
// ignore_index wherever inputs[i] == eod_id (inputs and targets aligned, n each); returns the
// targets that keep a loss, the mean loss's denominator. Throws primus::RuntimeError when
// eod_id < 0 (a tokenizer without an end-of-document token).
int64_t mask_eod_targets(const int32_t* inputs, int32_t* targets, int64_t n, int32_t eod_id, int32_t ignore_index);

}  // namespace primus::train
