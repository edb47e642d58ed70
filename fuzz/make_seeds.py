#!/usr/bin/env python3
"""Writes the hand-made seed inputs of fuzz/corpus/<target>/ (seed-*). Run once; the corpora
are kept in the repo, and files that fuzzing adds (crash regressions: crash-*) sit beside them.
Usage: fuzz/make_seeds.py"""
import json
import os
import struct

ROOT = os.path.dirname(os.path.abspath(__file__))
SEP = "\n~~~~\n"


def put(target, name, data):
    d = os.path.join(ROOT, "corpus", target)
    os.makedirs(d, exist_ok=True)
    if isinstance(data, str):
        data = data.encode()
    with open(os.path.join(d, "seed-" + name), "wb") as f:
        f.write(data)


# --- config_yaml: a.yaml [~~~~ b.yaml [~~~~ c.yaml [~~~~ d.yaml]]]
experiment = """work_group: ${FUZZ_TEAM:local}
user_name: local
exp_name: ${FUZZ_EXP:seed}
workspace: ${FUZZ_HOME}/out
modules:
  pre_trainer:
    framework: reference
    config: b.yaml
    model: c.yaml
    overrides:
      train_iters: 20
      micro_batch_size: 2
      global_batch_size: 4
      lr: 2.0e-3
      data_path: [../data/x.txt]
      extra: {a: 1, b: [x, "y"]}
"""
module = "extends: d.yaml\nmin_lr: 1.0e-4\nlr_decay_style: linear\nsave_interval: 10\n"
model = "num_layers: 2\nhidden_size: 32\nmodel_type: gpt2\ntags: [a, b]\n"
base = ("train_iters: 1000\nmicro_batch_size: 8\nglobal_batch_size: 8\nlr: 3.0e-4\nadam_beta2: 0.95\n"
        "clip_grad: 1.0\nseed: 1234\nsplit: 0.9\ntokenizer_type: gpt2\n")
put("config_yaml", "experiment", SEP.join([experiment, module, model, base]))
put("config_yaml", "types", """int: 42
neg: -7
hex: 0x1F
float: 1.5e-3
dot: .5
inf: -.inf
nan: .nan
yes: true
no: FALSE
nothing: ~
empty:
quoted: "123"
single: 'true'
list: [1, 2.0, three, "four", null]
nested: {a: {b: {c: [1, {d: e}]}}}
block:
  - x
  - y: 1
multi: |
  line one
  line two
""")
put("config_yaml", "interpolation", """home: ${FUZZ_HOME}
n: ${FUZZ_N}
empty: ${FUZZ_EMPTY}
default: ${FUZZ_MISSING:fallback}
mixed: pre-${FUZZ_N}-${FUZZ_OTHER:x}-post
quoted: "${FUZZ_N}"
""")
put("config_yaml", "extends_list", SEP.join([
    "extends: [b.yaml, c.yaml]\nx: 3\nnested: {k: top}\n",
    "x: 1\ny: 1\nnested: {k: b, j: b}\n",
    "extends: d.yaml\nx: 2\nz: 2\n",
    "w: 0\nnested: {deep: {er: 1}}\n"]))
put("config_yaml", "extends_cycle", SEP.join(["extends: b.yaml\na: 1\n", "extends: a.yaml\nb: 1\n"]))
put("config_yaml", "extends_missing", "extends: nowhere.yaml\n")
put("config_yaml", "anchors", "base: &b {x: 1, y: 2}\nuse: *b\nmerge:\n  <<: *b\n  z: 3\n")
put("config_yaml", "bad_interp", "a: ${FUZZ_NOPE}\nb: ${1bad}\nc: ${unterminated\n")

# --- cli_overrides: one argument per line
for i, args in enumerate([
        ["train_iters=5", "lr=1e-3"],
        ["--micro_batch_size", "4", "--global-batch-size=8"],
        ["modules.pre_trainer.lr=0.1", "modules.other.train_iters=3"],
        ["extra={a: 1, b: [1, 2]}", "extra.c.d=1"],
        ["exp_name=x", "workspace=/tmp/w", "user_name='me'", "work_group=\"g\""],
        ["lr_decay_style=linear", "adam_beta1=1.5", "seed=-1"],
        ["data_path=[a, b]", "mock_data=true", "split=0.5"],
        ["num_layers=0x10", "hidden_size=.inf", "model_type=llama"],
        ["train_iters=1", "train_iters=2"],
        ["--lr"],
        ["=1", "a..b=2", ".x=1"],
        ["global_batch_size=6", "micro_batch_size=4"],
        ["min_lr=1", "lr=0.5"],
]):
    put("cli_overrides", f"args{i:02d}", "\n".join(args))

# --- safetensors
DT = {"F64": ("d", 8), "F32": ("f", 4), "F16": ("e", 2), "BF16": ("H", 2), "I64": ("q", 8),
      "I32": ("i", 4), "I16": ("h", 2), "I8": ("b", 1), "U8": ("B", 1), "BOOL": ("B", 1)}


def safetensors(tensors, metadata=None):
    header, blobs, off = {}, [], 0
    for name, dtype, shape, values in tensors:
        fmt, size = DT[dtype]
        n = 1
        for s in shape:
            n *= s
        vals = (values * (n // max(len(values), 1) + 1))[:n] if values else [0] * n
        blob = struct.pack("<" + fmt * n, *vals)
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + len(blob)]}
        blobs.append(blob)
        off += len(blob)
    if metadata:
        header["__metadata__"] = metadata
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + b"".join(blobs)


put("safetensors", "mixed", safetensors([
    ("w", "F32", [2, 3], [0.5, -1.0, 2.0]), ("b", "F16", [3], [1.0, 2.0]), ("h", "BF16", [2, 2], [0x3f80, 0xbf80]),
    ("i", "I32", [4], [1, -2, 3]), ("u", "U8", [5], [1, 2, 255]), ("d", "F64", [1], [3.25]),
    ("l", "I64", [2], [-1, 1 << 40]), ("flag", "BOOL", [2], [0, 1])], {"format": "pt", "step": "10"}))
put("safetensors", "scalar_empty", safetensors([("s", "F32", [], [1.0]), ("e", "F32", [0, 4], []),
                                                 ("z", "I8", [3], [-1, 0, 1])]))
put("safetensors", "single", safetensors([("model.embed_tokens.weight", "F32", [4, 2], [0.1, 0.2])]))
put("safetensors", "empty", safetensors([]))
# 2-D F32 of a transformer-like name, and an I16 one
put("safetensors", "two", safetensors([("a.weight", "F32", [3, 1], [1.0]), ("b", "I16", [2], [7, -7])],
                                      {"note": "x"}))

# --- indexed_dataset: ctl byte, u32 idx size, .idx, .bin
def indexed(dtype_code, docs):
    fmt, size = {1: ("B", 1), 2: ("b", 1), 3: ("h", 2), 4: ("i", 4), 5: ("q", 8), 8: ("H", 2)}[dtype_code]
    binary = b"".join(struct.pack("<" + fmt * len(d), *d) for d in docs)
    idx = b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, dtype_code, len(docs), len(docs) + 1)
    idx += b"".join(struct.pack("<i", len(d)) for d in docs)
    ptr = 0
    for d in docs:
        idx += struct.pack("<q", ptr)
        ptr += len(d) * size
    idx += b"".join(struct.pack("<q", i) for i in range(len(docs) + 1))
    return idx, binary


for i, (ctl, code, docs) in enumerate([
        (2 | 4 << 2, 8, [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10, 11, 12, 13, 14]]),
        (3 | 1 << 2, 4, [[50256, 15496, 995], [0] * 9, [1]]),
        (0 | 15 << 2, 1, [[65, 66, 67], [], [255, 0]]),
        (2 | 2 << 2, 3, [[-1, 5], [7]]),
        (1 | 0 << 2, 5, [[0, 0, 1 << 40]]),
        (2, 2, [[1, -3, 4]])]):
    idx, binary = indexed(code, docs)
    put("indexed_dataset", f"ds{i}", bytes([ctl]) + struct.pack("<I", len(idx)) + idx + binary)

# --- tokenizers: GPT-2's byte-level alphabet
def bytes_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


B2U = bytes_to_unicode()


def form(s):
    return "".join(B2U[b] for b in s.encode())


def small_tokenizer(pre, merges_as_lists=False, added=(), extra=None):
    vocab = {B2U[b]: b for b in range(256)}
    merges = []
    for a, b in [("h", "e"), ("l", "l"), ("he", "ll"), ("hell", "o"), (" ", "w"), (" w", "o"), ("1", "2"),
                 ("12", "3"), ("'", "l"), ("'l", "l")]:
        fa, fb = form(a), form(b)
        vocab.setdefault(fa + fb, len(vocab))
        merges.append([fa, fb] if merges_as_lists else f"{fa} {fb}")
    model = {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
             "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False, "vocab": vocab, "merges": merges}
    if extra:
        model.update(extra)
    return json.dumps({"version": "1.0", "added_tokens": [
        {"id": i, "content": c, "single_word": False, "lstrip": ls, "rstrip": rs, "normalized": False,
         "special": True} for i, c, ls, rs in added], "normalizer": None, "pre_tokenizer": pre,
        "decoder": {"type": "ByteLevel"}, "model": model}, ensure_ascii=False)


LLAMA3 = ("(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|"
          "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")
byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
split = {"type": "Sequence", "pretokenizers": [
    {"type": "Split", "pattern": {"Regex": LLAMA3}, "behavior": "Isolated", "invert": False},
    {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}
text = "hello world 12345 'll <|endoftext|>\n\n  x\u00e9\u4e2d\U0001F600 \xff"
put("tokenizer_json", "gpt2_style", small_tokenizer(byte_level, added=[(300, "<|endoftext|>", False, False)]) + SEP + SEP + text)
put("tokenizer_json", "llama3_style", small_tokenizer(split, merges_as_lists=True,
                                                       added=[(400, "<|begin_of_text|>", False, False),
                                                              (401, "<|end_of_text|>", True, True)],
                                                       extra={"ignore_merges": True})
    + SEP + json.dumps({"eos_token": "<|end_of_text|>"}) + SEP + "<|begin_of_text|>hello  <|end_of_text|> 123")
put("tokenizer_json", "prefix_space", small_tokenizer(dict(byte_level, add_prefix_space=True))
    + SEP + json.dumps({"eos_token": {"content": "hello"}}) + SEP + "hello hello")
put("tokenizer_json", "unk", small_tokenizer(byte_level, extra={"unk_token": form("he")}))
put("tokenizer_json", "unsupported", json.dumps({"model": {"type": "WordPiece", "vocab": {}}}))

for sel, t in enumerate(["Hello, world! It's 2024 and we'll see.\n\n  Indented   text\t<|endoftext|>",
                         "caf\u00e9 \u4e2d\u6587 \U0001F600 \u0627\u0644\u0639\u0631\u0628\u064a\u0629 123456789",
                         "I'M HERE, THEY'RE 'll 'Ve \r\n\r\n x  y   ",
                         "\x00\x01 tabs\t\tand\u00a0nbsp \u2003 1,234.56"]):
    put("tokenizer_encode", f"text{sel}", bytes([sel]) + t.encode())
put("tokenizer_encode", "malformed_utf8", bytes([0]) + b"ok \xff\xfe \xc3 \xe2\x82 \xed\xa0\x80 \xf4\x90\x80\x80 end")
put("tokenizer_encode", "malformed_utf8_llama", bytes([2]) + b"\xc3\xa9\xc3 \xe4\xb8 99999 \xf0\x9f\x98")

# --- checkpoint: a real checkpoint of the tiny GPT-2 that fuzz/checkpoint_fuzz.cpp expects,
# written by the CLI (skipped when build/bin/primus is missing).
def checkpoint_seeds():
    import subprocess
    import tempfile
    primus = os.path.join(ROOT, "..", "build", "bin", "primus")
    if not os.path.exists(primus):
        print("make_seeds: build/bin/primus missing, checkpoint seeds not written")
        return
    with tempfile.TemporaryDirectory() as ws:
        subprocess.run([primus, "train", "pretrain", "--config",
                        os.path.join(ROOT, "..", "examples", "reference", "shakespeare.yaml"),
                        "num_layers=1", "hidden_size=4", "num_attention_heads=1", "ffn_hidden_size=8",
                        "seq_length=4", "micro_batch_size=2", "global_batch_size=2", "train_iters=2",
                        "eval_interval=0", "sample_tokens=0", "mock_data=true", "workspace=" + ws],
                       check=True, capture_output=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
        d = os.path.join(ws, "local", "local", "shakespeare", "checkpoints", "iter_0000002")
        model = open(os.path.join(d, "model.safetensors"), "rb").read()
        opt = open(os.path.join(d, "optimizer.safetensors"), "rb").read()
        state = json.load(open(os.path.join(d, "trainer_state.json")))
        manifest = open(os.path.join(d, "manifest.json"), "rb").read()
    small = {"step": state["step"], "model_spec": state["model_spec"], "backend": "reference"}
    sep = SEP.encode()
    put("checkpoint", "tiny_gpt2", model + sep + opt + sep + json.dumps(small, indent=1).encode())
    put("checkpoint", "no_model_spec", model + sep + opt + sep + json.dumps({"step": 2}).encode())
    put("checkpoint", "stale_manifest", model + sep + opt + sep + json.dumps(small).encode() + sep + manifest)


checkpoint_seeds()
