# Shared by prof.sh and sass_stalls.sh: primus from the carry into $BIN, the library path, $NCU.
set -u
BIN=/tmp/b; mkdir -p $BIN; gunzip -c .carry-cuda/primus.gz > $BIN/primus; chmod +x $BIN/primus
cudnn_dir=$(python3 -c "import nvidia.cudnn, os; print(os.path.join(list(nvidia.cudnn.__path__)[0], 'lib'))" 2>/dev/null)
lt=$(ls /usr/local/cuda*/lib*/libcublasLt.so.13 2>/dev/null | head -1)
export LD_LIBRARY_PATH=$BIN:$cudnn_dir:$(dirname "$lt"):.carry-cuda:${LD_LIBRARY_PATH:-}
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu | head -1)
