#!/usr/bin/env bash
# Throughput of `primus data prepare --tokenizer gpt2` (read, GPT-2 BPE, write .bin/.idx) on a
# ~100 MB text built by repeating tinyshakespeare, with 1 and 2 workers. Appends one line per
# measurement to bench/results/data_prepare.jsonl in the DESIGN.md Measurements format.
#
# Metric: input MB per CPU-second of the whole process (user + sys), i.e. MB/s per core; it
# stays meaningful on a machine shared with other jobs, where wall time does not. Wall time is
# given in the case text.
#
# Anchors: where Python has numpy and Hugging Face `tokenizers` and/or `tiktoken` (the GPU
# machine's image has both; the build machine has neither), the same documents are encoded by
# each with GPT-2 BPE built from the same vocabulary files and as many threads as we have
# workers; their MB per CPU-second is the anchor of one line each (encoding only, the text in
# ~1 MB strings so that their per-call overhead does not count: they read no file and write
# nothing, which favours them). Their ids for the first 100k documents must equal ours, read
# back from the .bin/.idx, or the run fails. Without either library the anchor is null and anchor_name says
# why.
#
# Environment: PRIMUS (binary, default build/bin/primus), CORPUS (default
# ../shared/data/tinyshakespeare.txt), REPEAT (default 90), RESULTS (output file), PYTHON,
# COMMIT (recorded commit; default: git rev-parse of this checkout).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PRIMUS=${PRIMUS:-$ROOT/build/bin/primus}
CORPUS=${CORPUS:-$ROOT/../shared/data/tinyshakespeare.txt}
REPEAT=${REPEAT:-90}
RESULTS=${RESULTS:-$ROOT/bench/results/data_prepare.jsonl}
PYTHON=${PYTHON:-python3}
VOCAB=${PRIMUS_GPT2_VOCAB_DIR:-$ROOT/third_party/gpt2}
export PRIMUS_GPT2_VOCAB_DIR=$VOCAB
# The primus binary links OpenBLAS statically (for the CPU backend), whose initialiser starts
# nproc-1 threads that spin for a while: CPU time that data prepare never asked for.
export OPENBLAS_NUM_THREADS=1

[[ -x $PRIMUS ]] || { echo "data_prepare.sh: no primus binary at $PRIMUS (set PRIMUS)" >&2; exit 2; }
[[ -f $CORPUS ]] || { echo "data_prepare.sh: no corpus at $CORPUS (set CORPUS)" >&2; exit 2; }
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

for _ in $(seq "$REPEAT"); do cat "$CORPUS"; done >"$WORK/input.txt"
BYTES=$(stat -c %s "$WORK/input.txt")
MB=$(awk -v b="$BYTES" 'BEGIN { printf "%.1f", b / 1e6 }')
CPU=$(grep -m1 'model name' /proc/cpuinfo | sed 's/.*: //; s/  */ /g')
DEVICE="cpu: $CPU ($(nproc) cores)"
DATE=$(date -u +%Y-%m-%dT%H:%M:%SZ)
COMMIT=${COMMIT:-$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)}

# run WORKERS -> sets WALL and CPU_S (the child's user + sys time, from getrusage)
run() {
  read -r WALL CPU_S < <("$PYTHON" - "$PRIMUS" "$WORK" "$1" <<'EOF'
import resource, subprocess, sys, time
primus, work, workers = sys.argv[1:4]
t = time.perf_counter()
with open(f"{work}/log_{workers}", "w") as log:
    subprocess.run([primus, "data", "prepare", "--input", f"{work}/input.txt", "--tokenizer", "gpt2",
                    "--output-prefix", f"{work}/out_{workers}", "--workers", workers, "--quiet"],
                   check=True, stdout=log)
wall = time.perf_counter() - t
r = resource.getrusage(resource.RUSAGE_CHILDREN)
print(f"{wall:.2f} {r.ru_utime + r.ru_stime:.2f}")
EOF
)
}

# anchors THREADS -> writes $WORK/anchors_THREADS.json: MB per CPU-second of Hugging Face
# tokenizers and of tiktoken on the same documents, after checking that both give our ids.
anchors() {
  RAYON_NUM_THREADS=$1 "$PYTHON" - "$VOCAB" "$WORK/input.txt" "$WORK/out_$1" "$1" >"$WORK/anchors_$1.json" <<'EOF'
import json, os, sys, time
try:
    import numpy as np
except ImportError:  # no numpy: no library to compare with either, on this machine
    print("{}")
    sys.exit(0)
vocab_dir, input_path, prefix, threads = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
with open(input_path, "rb") as f:
    lines = [l[:-1] if l.endswith(b"\n") else l for l in f]  # as primus: one \n, then one \r
lines = [(l[:-1] if l.endswith(b"\r") else l).decode("utf-8") for l in lines]
lines = [l for l in lines if l]
mb = os.path.getsize(input_path) / 1e6
# Speed: the libraries encode ~1 MB texts (their per-call overhead would swamp one-line
# documents); ids: the first 100k documents one by one must equal ours.
chunks, cur, size = [], [], 0
for l in lines:
    cur.append(l)
    size += len(l) + 1
    if size >= 1 << 20:
        chunks.append("\n".join(cur))
        cur, size = [], 0
if cur:
    chunks.append("\n".join(cur))
check = lines[:100000]
idx = open(prefix + ".idx", "rb").read()  # our documents, read as Megatron-LM reads them
n = int.from_bytes(idx[18:26], "little")
sizes = np.frombuffer(idx, np.int32, n, 34)
ptrs = np.frombuffer(idx, np.int64, n, 34 + 4 * n)
flat = np.memmap(prefix + ".bin", np.uint16, mode="r")
ours = [flat[p // 2: p // 2 + s - 1].tolist() for p, s in zip(ptrs[:len(check)], sizes[:len(check)])]
assert n == len(lines), (n, len(lines))

out = {}
try:
    import tokenizers
    from tokenizers import Tokenizer, models, pre_tokenizers
    tok = Tokenizer(models.BPE.from_file(f"{vocab_dir}/encoder.json", f"{vocab_dir}/vocab.bpe"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    enc = getattr(tok, "encode_batch_fast", tok.encode_batch)  # fast: skips offsets
    t0 = time.process_time()
    enc(chunks, add_special_tokens=False)
    out["hf"] = {"mbps": mb / (time.process_time() - t0),
                 "agree": [e.ids for e in enc(check, add_special_tokens=False)] == ours,
                 "name": f"Hugging Face tokenizers {tokenizers.__version__} ({enc.__name__})"}
except ImportError:
    pass
try:
    import tiktoken
    encoder = json.load(open(f"{vocab_dir}/encoder.json", encoding="utf-8"))
    printable = list(range(33, 127)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    to_byte, k = {chr(b): b for b in printable}, 0
    for b in range(256):
        if b not in printable:
            to_byte[chr(256 + k)] = b
            k += 1
    ranks = {bytes(to_byte[ch] for ch in t): i for t, i in encoder.items() if t != "<|endoftext|>"}
    enc = tiktoken.Encoding("gpt2-files", pat_str=r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""",
                            mergeable_ranks=ranks, special_tokens={})
    t0 = time.process_time()
    enc.encode_ordinary_batch(chunks, num_threads=threads)
    out["tiktoken"] = {"mbps": mb / (time.process_time() - t0),
                       "agree": [enc.encode_ordinary(l) for l in check] == ours,
                       "name": f"tiktoken {tiktoken.__version__}"}
except ImportError:
    pass
print(json.dumps(out))
EOF
  echo "anchors ($1 thread(s)): $(cat "$WORK/anchors_$1.json")" >&2
}

# line WORKERS KEY: appends the measurement line against anchor KEY (hf | tiktoken | none)
line() {
  "$PYTHON" - "$@" "$WORK" "$BYTES" "$CPU_S" "$WALL" "$MB" "$REPEAT" "$DEVICE" "$DATE" "$COMMIT" >>"$RESULTS" <<'EOF'
import json, sys
workers, key, work, nbytes, cpu, wall, mb, repeat, device, date, commit = sys.argv[1:12]
ours = round(int(nbytes) / 1e6 / float(cpu), 2)
anchors = json.load(open(f"{work}/anchors_{workers}.json"))
a = anchors.get(key)
if a and not a["agree"]:
    sys.exit(f"data_prepare.sh: {a['name']} gives other ids than primus")
threads = f"{workers} thread" + ("s" if workers != "1" else "")
print(json.dumps({
    "bench": "data_prepare",
    "case": f"gpt2, {workers} worker(s), {mb} MB (tinyshakespeare x{repeat}, one document per line): "
            f"wall {wall} s, CPU {cpu} s",
    "device": device, "date": date, "commit": commit,
    "metric": "MB/s per core (input MB per CPU-second, user+sys)",
    "ours": ours,
    "anchor": round(a["mbps"], 2) if a else None,
    "anchor_name": (f"{a['name']}, GPT-2 BPE from the same vocabulary files, {threads}, encoding "
                    f"the same text as ~1 MB strings (no file read or written); ids equal to ours "
                    f"on the first 100k documents" if a else
                    "none: neither Hugging Face tokenizers nor tiktoken is installed here (no PyPI "
                    "offline); figure only"),
    "ratio": round(ours / a["mbps"], 3) if a else None,
}))
EOF
  tail -n 1 "$RESULTS"
}

mkdir -p "$(dirname "$RESULTS")"
# One untimed run first: it pulls the input into the page cache and, on VMs whose memory grows
# on first touch (the GPU machines here), pays that growth, so the timed runs compare alike.
run 1
for workers in 1 2; do
  run "$workers"
  anchors "$workers"
  if grep -q '"hf"' "$WORK/anchors_$workers.json"; then line "$workers" hf; fi
  if grep -q '"tiktoken"' "$WORK/anchors_$workers.json"; then line "$workers" tiktoken; fi
  if ! grep -q '"' "$WORK/anchors_$workers.json"; then line "$workers" none; fi
done
