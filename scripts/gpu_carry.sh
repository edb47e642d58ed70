# shellcheck shell=bash
# Sourced by the device scripts (bench/*/run_on_gpu.sh) on the GPU machine, with CARRY (the carried
# folder) and BIN (where the binaries go) set: unpacks the carried binaries (*.xz, *.gz), puts the
# carried shared libraries beside them, sources gpu_env.sh, and exports what primus and its tests
# look for (the library path, the GPT-2 vocabulary, the source and config folders, PRIMUS_BIN)
# and DEVICE (the GPU's name).
mkdir -p "$BIN"
for f in "$CARRY"/*.xz "$CARRY"/*.gz; do
  [ -e "$f" ] || continue
  n=$(basename "${f%.*}")
  case "$f" in *.xz) xz -dc "$f" > "$BIN/$n" ;; *) gunzip -c "$f" > "$BIN/$n" ;; esac && chmod +x "$BIN/$n"
done
cp "$CARRY"/lib*.so* "$BIN/" 2>/dev/null
# shellcheck source=scripts/gpu_env.sh
source scripts/gpu_env.sh 2>/dev/null
export LD_LIBRARY_PATH=$BIN:${LD_LIBRARY_PATH:-}
export PRIMUS_GPT2_VOCAB_DIR=$PWD/third_party/gpt2 PRIMUS_SOURCE_DIR=$PWD PRIMUS_CONFIG_DIR=$PWD/configs
export PRIMUS_BIN=$BIN/primus
DEVICE=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
export DEVICE
