#!/usr/bin/env bash
# Tokenizers of Hugging Face folders on the GPU machine (issue #40, tokenizer part), which has the
# `tokenizers` and `transformers` Python packages. Run from the repository root with $BIN (the
# built primus, on PATH) and $OUT set; $DATA (tinyshakespeare) is used when set. About 45 s.
# tests/data/crosscheck_hf.py compares the ids of `$BIN/primus data prepare` (every document, the
# end-of-document id included) and `primus data encode` with tokenizers' on fuzzed documents that
# mix composed and decomposed Unicode, compatibility characters and special tokens:
#   qwen2-nfc    a Qwen2/Qwen3-style tokenizer.json trained here (NFC normalizer, Qwen2's Split
#                regex + ByteLevel, <|endoftext|> <|im_start|> <|im_end|> special, <think> plain
#                added tokens), eod as transformers' AutoTokenizer reads it from the folder
#   nfd-replace  the same under Sequence[NFD, Replace, Replace]
#   gpt2, hf-gpt2, hf-llama3, hf-qwen2   the byte-level files without a normalizer (regression)
#   sp-llama2, sp-metaspace, sp-metaspace-split   SentencePiece-style BPE (Llama-2 / Mistral:
#                byte fallback, Prepend+Replace normalizer or Metaspace) trained here, eod </s>
# Writes $OUT/tokenizer.jsonl (one row per check) and prints a PASS/FAIL table last.
PART=tokenizer
# shellcheck source=bench/hf/common.sh
source bench/hf/common.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
corpus=()
[ -n "${DATA:-}" ] && [ -f "${DATA:-}" ] && corpus=(--corpus "$DATA")

timeout 240 python3 tests/data/crosscheck_hf.py --primus "$BIN/primus" --vocab-dir third_party/gpt2 \
  "${corpus[@]}" --work "$W" --docs 2000 > "$W/checks.jsonl" 2> "$W/checks.err"
rc=$?
cp "$W/checks.jsonl" "$W/checks.err" "$OUT/" 2>/dev/null
[ "$rc" -ne 0 ] && { echo "crosscheck_hf.py stderr (tail):"; tail -5 "$W/checks.err"; }

python3 - "$W/checks.jsonl" "$OUT/tokenizer.jsonl" "$rc" "$COMMIT" "$DEVICE" "$DATE" <<'PY'
import json, sys
src, dst, rc, commit, device, date = sys.argv[1:]
rows, meta = [], {}
for line in open(src, encoding="utf-8"):
    try:
        r = json.loads(line)
    except ValueError:
        continue
    if "check" not in r:
        meta = r
        continue
    status = "SKIP" if "skipped" in r else ("PASS" if r["mismatches"] == 0 else "FAIL")
    rows.append((r["check"], status, r.get("documents"), r.get("mismatches"), r.get("skipped", "")))
with open(dst, "w") as f:
    for check, status, docs, bad, why in rows:
        f.write(json.dumps({"bench": "hf_tokenizer", "case": check, "status": status, "metric": "mismatched_documents",
                            "ours": bad, "documents": docs, "detail": why, "versions": meta,
                            "device": device, "date": date, "commit": commit}) + "\n")
print()
print(f"hf tokenizer (commit {commit}, {device}, crosscheck rc={rc}, {meta})")
for check, status, docs, bad, why in rows:
    print(f"{status:5} {check:90.90} docs {docs} mismatched {bad} {why}")
if not rows or int(rc) != 0 and all(s != "FAIL" for _, s, *_ in rows):
    print(f"FAIL  crosscheck_hf.py exited {rc} (see checks.err)")
PY
[ "$rc" -eq 0 ]
