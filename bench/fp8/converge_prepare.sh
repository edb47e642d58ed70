#!/usr/bin/env bash
# Fills .carry-fp8 for bench/fp8/converge_on_gpu.sh: bench/fp8/prepare_carry.sh (its arguments and
# environment pass through: build dir, BINS), then tinyshakespeare.txt (../shared/data, which does
# not travel) and Cairo for `primus report` there (the GPU machine has none): libcairo.so.2 and the
# libraries it needs, less glibc's, with DejaVu Sans for its text, as extra/cairo.tar.xz (not a
# top-level .xz: carry_unpack would unpack it as a binary). Usage, from the repository root:
#   bench/fp8/converge_prepare.sh [build-dir]
# (BINS=primus carries only what converge_on_gpu.sh runs, but leaves run_on_gpu.sh without its tests.)
set -eu
CARRY=.carry-fp8
bash bench/fp8/prepare_carry.sh "$@"
install -m 0644 ../shared/data/tinyshakespeare.txt "$CARRY/tinyshakespeare.txt"

# Cairo: best effort; without it the call still trains and the chart is drawn here afterwards.
cairo_lib=$(ldconfig -p | awk '/libcairo\.so\.2 .*x86-64/{print $NF; exit}')
if [ -n "$cairo_lib" ]; then
  stage=$(mktemp -d)
  mkdir -p "$stage/cairo/fonts" "$CARRY/extra"
  cp -L "$cairo_lib" "$stage/cairo/"
  for l in $(ldd "$cairo_lib" | awk '/=> \//{print $3}'); do
    case $(basename "$l") in
      libc.so*|libm.so*|libpthread.so*|libdl.so*|librt.so*|ld-linux*) ;;
      *) cp -L "$l" "$stage/cairo/" ;;
    esac
  done
  for f in DejaVuSans.ttf DejaVuSans-Bold.ttf; do
    p=$(fc-list 2>/dev/null | awk -F: -v f="/$f" 'index($1, f) {print $1; exit}')
    [ -z "$p" ] && p=/usr/share/fonts/truetype/dejavu/$f
    [ -e "$p" ] && cp -L "$p" "$stage/cairo/fonts/"
  done
  tar -C "$stage" -cJf "$CARRY/extra/cairo.tar.xz" cairo
  rm -rf "$stage"
else
  echo "converge_prepare: no libcairo.so.2 here; the chart will be drawn here from the returned metrics" >&2
fi
du -sh "$CARRY"
