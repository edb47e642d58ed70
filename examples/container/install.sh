#!/usr/bin/env bash
# The steps the container recipes beside it (Dockerfile, primus.def) share, so the two build the
# same image.
#   install.sh build     in CUDA's devel image, from the source tree in the current folder:
#                        build primus and lay it out in /opt/primus (expects setup.sh's packages)
#   install.sh runtime   in CUDA's runtime image, after /opt/primus was copied in: install the
#                        Debian packages it needs and put primus on the PATH
# CUDA_ARCHITECTURES (default 90a-real, the project's default: H100, H200) picks the GPUs the
# binary carries code for.
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
prefix=/opt/primus

case "${1:-}" in
  build)
    cmake -S . -B /tmp/primus-build -DCMAKE_BUILD_TYPE=Release -DPRIMUS_CUDA=ON \
      -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCHITECTURES:-90a-real}" -DPRIMUS_BUILD_TESTS=OFF \
      -DCMAKE_UNITY_BUILD=ON -DCMAKE_UNITY_BUILD_BATCH_SIZE=8
    cmake --build /tmp/primus-build -j"$(nproc)" --target primus
    # The binary looks for configs/ in the folders above its own and for the GPT-2 vocabulary in
    # ../third_party/gpt2, so this layout needs no variables.
    mkdir -p "$prefix/bin" "$prefix/third_party"
    cp /tmp/primus-build/bin/primus "$prefix/bin/"
    # The Gloo plugin of the CPU collectives, opened from beside the binary (docs/launch.md,
    # "Collectives on Gloo"); its libgloo0 is found by the ldd loop below.
    cp /tmp/primus-build/bin/libprimus_gloo.so "$prefix/bin/"
    cp -r configs examples "$prefix/"
    cp -r third_party/gpt2 "$prefix/third_party/"
    cp "$0" "$prefix/install.sh"
    "$prefix/bin/primus" --help >/dev/null
    # The Debian packages that own the shared libraries primus still links (most are static; what
    # is left, e.g. libgomp, must be in the runtime image). ldd prints /lib paths that dpkg may
    # know under /usr/lib (merged /usr), hence the three tries; a library no package owns is an error.
    for lib in $(ldd "$prefix/bin/primus" "$prefix/bin/libprimus_gloo.so" | awk '$3 ~ /^\// {print $3}' | sort -u); do
      dpkg -S "$lib" 2>/dev/null || dpkg -S "$(readlink -f "$lib")" 2>/dev/null || dpkg -S "/usr$lib" 2>/dev/null ||
        { echo "install.sh: no Debian package owns $lib" >&2; exit 1; }
    done >/tmp/owners.txt
    cut -d: -f1 /tmp/owners.txt | sort -u | { grep -v -x libc6 || true; } >"$prefix/runtime-packages.txt"
    echo "install.sh: runtime packages: $(tr '\n' ' ' <"$prefix/runtime-packages.txt")"
    rm -rf /tmp/primus-build
    ;;
  runtime)
    apt-get update
    xargs -r apt-get install -y --no-install-recommends <"$prefix/runtime-packages.txt"
    # InfiniBand / RoCE userspace: NCCL opens libibverbs at run time, and without it falls back
    # to TCP sockets between nodes. The host's RDMA devices still have to be passed in.
    apt-get install -y --no-install-recommends libibverbs1 ibverbs-providers
    # NCCL is opened at run time (parallel/nccl_library.h). CUDA's runtime images ship libnccl2;
    # should one not, CUDA's apt repository (configured in those images) has it.
    if ! ldconfig -p | grep -q 'libnccl\.so\.2 '; then
      apt-get install -y --no-install-recommends libnccl2
    fi
    # Cairo is opened at run time too (report/cairo_api.h): report.png at the end of a run and
    # `primus report`. ldd cannot name it; without it both only say it is missing.
    apt-get install -y --no-install-recommends libcairo2
    rm -rf /var/lib/apt/lists/*
    ln -sf "$prefix/bin/primus" /usr/local/bin/primus
    primus --help >/dev/null
    ;;
  *)
    echo "usage: install.sh build|runtime" >&2
    exit 2
    ;;
esac
