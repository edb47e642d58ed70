#!/usr/bin/env bash
# GPT-2 124M on real text (tinyshakespeare, GPT-2 BPE; B16 x T1024, graph on), two primus binaries
# back to back: throughput over 30 steps and the profiled embedding backward. Real text repeats a
# few tokens a lot (mock data's uniform tokens do not), which is what the embedding backward's run
# sums see. Carry: .carry-cuda (primus.gz = new) and .carry-probe (primus_old.gz = baseline).
#   run(command="bash bench/train/emb_realdata_ab.sh", carry=[".carry-cuda", ".carry-probe"])
# (bench/train/bin_ab.sh on real data, profiled on real data.)
DATA=real PROFILE_DATA=real PROFILE_GREP="embedding|per step|total" exec bash bench/train/bin_ab.sh
