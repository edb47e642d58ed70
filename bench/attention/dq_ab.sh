#!/usr/bin/env bash
# The Hopper attention backward's dQ path: env_ab.sh with A = TMA reduce-adds (the
# default), B = PRIMUS_TURBO_ATTN_BWD_DQ=atomic. Same carry and variables as env_ab.sh.
#   run(command="OUT=$OUT bash bench/attention/dq_ab.sh", carry=[".carry-cuda"])
VAR=PRIMUS_TURBO_ATTN_BWD_DQ A=tma B=atomic exec bash "$(dirname "$0")/env_ab.sh"
