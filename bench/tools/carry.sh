# Shared by the device-call scripts (source it; bash). Two halves:
#
# Here, before the call:
#   carry_pack CARRY BUILD BIN...   builds the targets (under the build lock), writes each binary
#                                   xz-compressed into CARRY, with libgomp.so.1 (the GPU machine has
#                                   none) and commit.txt (HEAD, "-dirty" with local changes), and
#                                   keeps CARRY out of git (.git/info/exclude)
# On the GPU machine, inside the call:
#   carry_unpack CARRY BIN          the carried binaries (.xz or .gz) and libraries into BIN, the
#                                   toolkit's environment (scripts/gpu_env.sh), PRIMUS_* paths into
#                                   this checkout, PRIMUS_BIN when primus was carried
#   carry_deadline SECONDS; cap S   cap prints S, or what is left before the deadline less 15 s
#                                   (at least 5): every stage's `timeout`, so a call always ends
#                                   with its summary written
carry_pack() {
  local carry=$1 build=$2
  shift 2
  # shellcheck disable=SC2068  # the targets are words
  flock /tmp/primus-build.lock cmake --build "$build" -j2 --target $@
  mkdir -p "$carry"
  rm -f "$carry"/*.xz
  local b
  for b in "$@"; do xz -T2 -6 -c "$build/bin/$b" > "$carry/$b.xz"; done
  cp -L "$(gcc -print-file-name=libgomp.so.1)" "$carry/libgomp.so.1"
  local dirty
  dirty=$(git diff --quiet HEAD || echo "-dirty")
  echo "$(git rev-parse --short HEAD)$dirty" > "$carry/commit.txt"
  grep -qx "/$carry/" .git/info/exclude || echo "/$carry/" >> .git/info/exclude
}

carry_unpack() {
  local carry=$1 bin=$2 f name
  mkdir -p "$bin"
  for f in "$carry"/*.xz "$carry"/*.gz; do
    [ -e "$f" ] || continue
    name=$(basename "${f%.*}")
    case $f in
      *.xz) xz -dc "$f" > "$bin/$name" ;;
      *.gz) gunzip -c "$f" > "$bin/$name" ;;
    esac
    chmod +x "$bin/$name"
  done
  cp "$carry"/lib*.so* "$bin/" 2>/dev/null
  source scripts/gpu_env.sh
  export LD_LIBRARY_PATH=$bin:${LD_LIBRARY_PATH:-}
  export PRIMUS_GPT2_VOCAB_DIR=$PWD/third_party/gpt2 PRIMUS_SOURCE_DIR=$PWD PRIMUS_CONFIG_DIR=$PWD/configs
  if [ -x "$bin/primus" ]; then export PRIMUS_BIN=$bin/primus; fi
}

carry_deadline() { CARRY_DEADLINE=$(( $(date +%s) + $1 )); }
cap() {
  local want=$1 l
  l=$(( CARRY_DEADLINE - $(date +%s) - 15 ))
  [ "$l" -lt "$want" ] && want=$l
  [ "$want" -lt 5 ] && want=5
  echo "$want"
}
