#!/bin/bash
# ptxas -v of turbo/kernels/cuda/attention_bwd_sm90.cu alone (needs a configured build-cuda): C7512 / spills / registers per warp-specialised backward kernel (session 22)
# From the repository root (paths below are relative to it). scripts/check_ptxas.sh is the CTest form of the C7512 check.
root=$PWD
cd build-cuda/turbo/kernels/cuda || exit 1
/usr/local/cuda/bin/nvcc -DFMT_HEADER_ONLY=1 -DFMT_SHARED -DPRIMUS_VERSION=\"0.1.0\" -DSPDLOG_FMT_EXTERNAL --options-file CMakeFiles/primus_turbo_cuda.dir/includes_CUDA.rsp -O3 -DNDEBUG --generate-code=arch=compute_90a,code=[sm_90a] -Xcompiler=-fPIC --expt-relaxed-constexpr -lineinfo -Xptxas=-warn-spills -Xptxas=-v -std=c++17 -c "$root/turbo/kernels/cuda/attention_bwd_sm90.cu" -o /tmp/bwd_sm90.o > /tmp/ccbwd.log 2>&1
echo rc=$?
python3 - <<'PY'
import re
lines=open('/tmp/ccbwd.log').read().splitlines()
cur=None
for l in lines:
    m=re.search(r"Compiling entry function '(\S+)'",l)
    if m: cur=m.group(1)
    m2=re.search(r"function '(\S+)'",l)
    name=(m2.group(1) if m2 else cur) or ''
    if 'ws_kernel' not in name: continue
    cfg=re.search(r"(13__nv_bfloat16|6__half).*?BwdWsConfigILi(\d+)ELi(\d)ELi(\d)ELi(\d+)E(Li\dE)?",name)
    tag=f"{'bf16' if cfg.group(1).startswith('13') else 'f16'} D{cfg.group(2)} S{cfg.group(3)} Q{cfg.group(4)} BM{cfg.group(5)}{(' order'+cfg.group(6)[-2]) if cfg.group(6) else ''}" if cfg else name[:40]
    if 'C7512' in l or 'spill' in l.lower() or 'Used' in l:
        print(tag,'|',l.split(':',1)[-1].strip()[:110])
PY
