#!/usr/bin/env bash
# Session 23: the head_dim-128 backward's dQ split (PRIMUS_TURBO_ATTN_BWD_DQ_SPLIT=cols|keys|keys2, from
# dq_split_keys.diff) in one device call: the fwd3wg folder's ab.sh with this switch and the head_dim-128
# shapes (tests, in-process A/B of the three splits, CUDNN).
#   run(command="OUT=$OUT bash bench/attention/runs/2026-11-28-h200-s23-dqsplit/split_ab.sh", carry=[".carry-attn"])
VAR=PRIMUS_TURBO_ATTN_BWD_DQ_SPLIT VALUES=${VALUES:-cols,keys,keys2} SHAPES=${SHAPES:-8x2048x16x16x128,2x8192x16x16x128,4x4096x32x8x128} \
  exec bash "$(dirname "$0")/../2026-11-28-h200-s23-fwd3wg/ab.sh"
