#!/usr/bin/env python3
"""Cross-checks `primus data prepare` against the libraries it claims to match.

Needs Python with `tokenizers` (Hugging Face) and `numpy`; `tiktoken` and `transformers` are used
when present (the GPU machine's image has tokenizers and transformers; the build machine has
none, so this is not part of ctest). For each tokenizer below
it writes the same documents to a JSON-lines file, runs `primus data prepare` on it, reads the
.bin/.idx back the way Megatron-LM's IndexedDataset does (numpy views at the header's
offsets), and compares every document's ids with the library's, end-of-document included.

  gpt2           vs tiktoken (encode_ordinary) and HF tokenizers (ByteLevel BPE), plus the
                 whole corpus as one document
  hf-gpt2        a tokenizer.json saved by HF tokenizers itself (ByteLevel pre-tokenizer)
  hf-llama3      tokenizer.json with HF's Split(Llama-3 regex) + ByteLevel, GPT-2 vocabulary
  hf-qwen2       the same with the Qwen2 regex
  qwen2-nfc      a Qwen2-style tokenizer.json built here as Qwen's is made: byte-level BPE
                 trained by tokenizers on --corpus (or generated text), NFC normalizer, Qwen2's
                 Split regex + ByteLevel, <|endoftext|> <|im_start|> <|im_end|> as special added
                 tokens after the vocabulary and <think> </think> as non-special ones (Qwen3),
                 with tokenizer_config.json naming <|endoftext|>; documents mix composed and
                 decomposed spellings. The end-of-document id is the one transformers'
                 AutoTokenizer reads from the folder (when transformers is installed).
  nfd-replace    the same vocabulary under Sequence[NFD, Replace(U+0301 -> ""),
                 Replace("ﬁ" -> "fi")] (accent stripping), special tokens only
  sp-llama2      a SentencePiece-style BPE tokenizer.json as Llama-2 / Mistral-7B-v0.1 ship:
                 models.BPE(byte_fallback=True, fuse_unk=True, unk_token="<unk>") trained by
                 tokenizers on the same text without its characters from U+0800 up (so é, ß,
                 Ω, ж merge as characters while CJK, Hangul and emoji fall back to bytes), <unk> <s> </s> at ids 0-2 and <0x00>..<0xFF> at
                 3-258 as in Llama-2's vocabulary, normalizer Sequence[Prepend("▁"),
                 Replace(" " -> "▁")], no pre-tokenizer, decoder Sequence[Replace("▁" -> " "),
                 ByteFallback, Fuse, Strip(" ", 1, 0)], tokenizer_config.json naming </s>
  sp-metaspace   the same vocabulary with no normalizer and Metaspace(prepend_scheme="first",
                 split=False), as newer Llama-2 / Mistral files have
  sp-metaspace-split   Metaspace(prepend_scheme="always", split=True)

Usage: crosscheck_hf.py --primus BIN --vocab-dir third_party/gpt2 [--corpus FILE] [--work DIR]
                        [--only NAME ...] [--docs N]
Prints one JSON line per check and exits 1 when any document differs.
"""
import argparse
import json
import os
import random
import subprocess
import sys
import tempfile

import numpy as np
import tokenizers
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

try:
    import tiktoken
except ImportError:  # the gpt2-vs-tiktoken checks are skipped
    tiktoken = None

LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
          r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2 = LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")
EOT = "<|endoftext|>"
QWEN_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN_PLAIN_ADDED = ["<think>", "</think>"]
ENCODE_TEXTS = ["caf\u00e9 vs cafe\u0301", "\u212bngstr\u00f6m \u00c5 A\u030a", "<|im_start|>user\nH\u00e9llo<|im_end|>",
                "<think>x\u0301</think> 12345 it's I'LL", "\ud55c\uad6d\uc5b4 \u1112\u1161\u11ab", "\ufb01ne \u2460\uff21\u00b2",
                "<|endoftext|>\u0301 after a special token", "  leading\n\n\ttabs  ", "\u4e2d\u6587 \U0001f600 \u00bd"]
# Spellings NFC (or NFKC) maps onto each other, and compatibility characters.
UNICODE_ATOMS = ["e\u0301", "\u00e9", "A\u030a", "\u212b", "\u00c5", "o\u0323\u0302", "o\u0302\u0323",
                 "\u1ed9", "\u1112\u1161\u11ab", "\ud55c", "n\u0303", "\u0301", "\u0323\u0302",
                 "\ufb01", "\u2460", "\uff21", "\u00b2", "\u037e", "\u2126", "\u0958", "\u30ac",
                 "\u30ab\u3099", " cafe\u0301", "\u00c7a", "C\u0327a"]


def fuzz_documents(rng, n, with_special, extra=()):
    atoms = ["a", "Z", "the", " ", "  ", "\n", "\r\n", "\r", "\t", "'s", "'S", "'ll", "'LL", "'", "7",
             "1234567", ".", ",", "!?", "(", "é", "ß", "Ω", "ж", "中文", "한", "ع", "٣", "½", "²", "Ⅷ",
             "😀", "𝔘", "\u00a0", "\u3000", "\u2003", "\u2028", "\u0085", "\u200b", "\u0301",
             "\x1c", "\x1f", "\x0b", "\x0c", "\ufeff", "\u180e", "\u1680", "—", "…", "€"]
    if with_special:
        atoms.append(EOT)
    atoms += list(extra)
    docs = []
    while len(docs) < n:
        d = "".join(rng.choice(atoms) for _ in range(rng.randint(1, 40)))
        if d:
            docs.append(d)
    return docs


def read_megatron(prefix):
    """Documents of a .bin/.idx pair, read as Megatron-LM's _IndexReader reads them."""
    idx = open(prefix + ".idx", "rb").read()
    assert idx[:9] == b"MMIDIDX\x00\x00", "magic"
    assert int.from_bytes(idx[9:17], "little") == 1, "version"
    dtype = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 8: np.uint16}[idx[17]]
    seq_count = int.from_bytes(idx[18:26], "little")
    doc_count = int.from_bytes(idx[26:34], "little")
    sizes = np.frombuffer(idx, np.int32, seq_count, 34)
    pointers = np.frombuffer(idx, np.int64, seq_count, 34 + sizes.nbytes)
    doc_idx = np.frombuffer(idx, np.int64, doc_count, 34 + sizes.nbytes + pointers.nbytes)
    assert len(idx) == 34 + sizes.nbytes + pointers.nbytes + doc_idx.nbytes, "idx size"
    assert doc_idx[0] == 0 and doc_idx[-1] == seq_count, "document indices"
    data = np.memmap(prefix + ".bin", dtype, mode="r")
    item = np.dtype(dtype).itemsize
    docs = []
    for d in range(doc_count - 1):
        ids = []
        for s in range(doc_idx[d], doc_idx[d + 1]):
            start = pointers[s] // item
            ids.extend(int(x) for x in data[start:start + sizes[s]])
        docs.append(ids)
    return docs


def prepare(args, tokenizer, docs, name):
    path = os.path.join(args.work, name + ".jsonl")
    with open(path, "w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps({"text": d}) + "\n")
    prefix = os.path.join(args.work, name)
    subprocess.run([args.primus, "data", "prepare", "--input", path, "--tokenizer", tokenizer,
                    "--output-prefix", prefix, "--quiet"], check=True, stdout=subprocess.DEVNULL)
    return read_megatron(prefix)


def compare(name, ours, expected_docs, eod):
    bad = []
    if len(ours) != len(expected_docs):
        bad.append(f"{len(ours)} documents, expected {len(expected_docs)}")
    for i, (o, e) in enumerate(zip(ours, expected_docs)):
        if o != list(e) + [eod]:
            bad.append(i)
    print(json.dumps({"check": name, "documents": len(expected_docs), "mismatches": len(bad),
                      "first": bad[:5]}))
    return not bad


def hf_gpt2(vocab_dir, pre):
    tok = Tokenizer(models.BPE.from_file(f"{vocab_dir}/encoder.json", f"{vocab_dir}/vocab.bpe"))
    tok.pre_tokenizer = pre
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOT])
    return tok


def gpt2_ranks(vocab_dir):
    """tiktoken's mergeable ranks for GPT-2: token bytes -> id (GPT-2's ids are its BPE ranks)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    to_byte, extra = {chr(b): b for b in printable}, 0
    for b in range(256):
        if b not in printable:
            to_byte[chr(256 + extra)] = b
            extra += 1
    encoder = json.load(open(f"{vocab_dir}/encoder.json", encoding="utf-8"))
    return {bytes(to_byte[ch] for ch in tok): i for tok, i in encoder.items() if tok != EOT}


def qwen2_style(train_docs, vocab_size=3000):
    """A Qwen2-style tokenizer.json, trained here (Qwen's own files cannot be downloaded)."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(train_docs, trainer)
    # After the vocabulary, as in Qwen's files: specials matched in the raw text, and Qwen3's
    # <think> tags as non-special, non-normalized added tokens.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN_SPECIAL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in QWEN_PLAIN_ADDED])
    return tok


SP = "\u2581"
SP_SPECIAL = ["<unk>", "<s>", "</s>"]
SP_ENCODE_TEXTS = ["Hello world", " Hello", "  two  spaces  ", "<s>Hello</s> world", "hello</s><s> x",
                   "caf\u00e9 na\u00efve \u4e2d\u6587 \U0001f600\U0001f600", "\U0001f600", "tabs\tand\nnewlines\n",
                   "\ud55c\uad6d\uc5b4 \u00bd \u2460", "x \u2581 y", "\u2581lead"]


def sentencepiece_style(train_docs, vocab_size=2000):
    """A Llama-2 / Mistral-style tokenizer.json, trained here (theirs cannot be downloaded).

    Trained with Metaspace(split=True) so that pieces, as SentencePiece's, never span a "▁"
    inside them; then laid out as Llama-2's vocabulary is (<unk> <s> </s>, the 256 byte tokens,
    the pieces) and returned as (vocabulary json, merges) for the variants to wrap."""
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    try:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SP, prepend_scheme="always", split=True)
    except TypeError:  # tokenizers < 0.19: always prepends, always splits
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SP)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False,
                                  special_tokens=SP_SPECIAL)
    # Characters from U+0800 up (CJK, Hangul, emoji) are left out of the alphabet: they must
    # come out as byte tokens, while the 2-byte ones (é, Ω, ж) are single characters.
    tok.train_from_iterator(["".join(c for c in d if ord(c) < 0x800) for d in train_docs], trainer)
    model = json.loads(tok.to_str())["model"]
    pieces = sorted(((i, t) for t, i in model["vocab"].items() if t not in SP_SPECIAL))
    vocab = {t: i for i, t in enumerate(SP_SPECIAL)}
    for b in range(256):
        vocab["<0x%02X>" % b] = len(vocab)
    for _, t in pieces:
        if t not in vocab:  # a piece spelled like a byte token keeps the byte token's id
            vocab[t] = len(vocab)
    return vocab, model["merges"]


def sentencepiece_variant(vocab, merges, variant):
    """The tokenizer.json of one variant, as tokenizers writes it, loaded back by tokenizers."""
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True} for i, t in enumerate(SP_SPECIAL)]
    j = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
         "normalizer": None, "pre_tokenizer": None, "post_processor": None,
         "decoder": {"type": "Sequence", "decoders": [
             {"type": "Replace", "pattern": {"String": SP}, "content": " "},
             {"type": "ByteFallback"}, {"type": "Fuse"},
             {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
         "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>", "continuing_subword_prefix": None,
                   "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True,
                   "ignore_merges": False, "vocab": vocab, "merges": merges}}
    if variant == "sp-llama2":
        j["normalizer"] = {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": SP},
            {"type": "Replace", "pattern": {"String": " "}, "content": SP}]}
    elif variant == "sp-metaspace":
        j["pre_tokenizer"] = {"type": "Metaspace", "replacement": SP, "prepend_scheme": "first", "split": False}
    else:
        j["pre_tokenizer"] = {"type": "Metaspace", "replacement": SP, "prepend_scheme": "always", "split": True}
    text = json.dumps(j, ensure_ascii=False)
    return text, Tokenizer.from_str(text)


def check_sentencepiece(args, rng, n_docs, corpus, train_docs, want):
    ok = True
    vocab, merges = sentencepiece_style(train_docs)
    for name in ("sp-llama2", "sp-metaspace", "sp-metaspace-split"):
        if not want(name):
            continue
        try:
            text, tok = sentencepiece_variant(vocab, merges, name)
        except Exception as e:  # noqa: BLE001 -- an older tokenizers without Prepend / Metaspace(split)
            print(json.dumps({"check": f"{name} tokenizer.json vs HF tokenizers", "skipped": repr(e)[:300]}))
            continue
        folder = os.path.join(args.work, name)
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "tokenizer.json"), "w", encoding="utf-8") as f:
            f.write(text)
        with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
            json.dump({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
                       "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1 << 20}, f)
        eod, source = eod_as_transformers_reads_it(folder, tok, "</s>")
        fallback = sum(1 for i in tok.encode(SP_ENCODE_TEXTS[5], add_special_tokens=False).ids if 3 <= i < 259)
        ok &= compare_encode(args, folder, tok, SP_ENCODE_TEXTS, f"{name} ({fallback} byte-fallback ids)")
        docs = fuzz_documents(rng, n_docs, with_special=False, extra=UNICODE_ATOMS + SP_SPECIAL + [SP, " " + SP])
        if corpus:
            docs += [corpus[i:i + 2000] for i in range(0, 40000, 2000)]
        ours = prepare(args, folder, docs, name)
        ok &= compare(f"{name} tokenizer.json vs HF tokenizers (eod {eod} from {source}, "
                      f"vocab {tok.get_vocab_size()})", ours,
                      [e.ids for e in tok.encode_batch(docs, add_special_tokens=False)], eod)
    return ok


def eod_as_transformers_reads_it(folder, tok, eos=EOT):
    try:
        from transformers import AutoTokenizer
    except ImportError:
        return tok.token_to_id(eos), "tokenizers"
    try:
        return AutoTokenizer.from_pretrained(folder).eos_token_id, "transformers"
    except Exception as e:  # noqa: BLE001 -- reported, and the check still runs on tokenizers' id
        print(json.dumps({"check": "transformers AutoTokenizer reads the folder", "skipped": repr(e)[:300]}))
        return tok.token_to_id(eos), "tokenizers"


def compare_encode(args, folder, tok, texts, name):
    """`primus data encode` (one text at a time, no end-of-document) against tokenizers."""
    bad = []
    for t in texts:
        r = subprocess.run([args.primus, "data", "encode", "--tokenizer", folder, "--text", t],
                           check=True, capture_output=True, text=True)
        if json.loads(r.stdout) != tok.encode(t, add_special_tokens=False).ids:
            bad.append(t)
    print(json.dumps({"check": f"{name} primus data encode vs HF tokenizers", "documents": len(texts),
                      "mismatches": len(bad), "first": bad[:5]}))
    return not bad


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--primus", required=True)
    ap.add_argument("--vocab-dir", required=True)
    ap.add_argument("--corpus")
    ap.add_argument("--work")
    ap.add_argument("--seed", type=int, default=random.randrange(1 << 30))
    ap.add_argument("--only", nargs="*", help="run only these checks (gpt2, hf-gpt2, hf-llama3, hf-qwen2, "
                    "qwen2-nfc, nfd-replace, sp-llama2, sp-metaspace, sp-metaspace-split)")
    ap.add_argument("--docs", type=int, default=3000, help="documents per check")
    args = ap.parse_args()
    args.work = args.work or tempfile.mkdtemp()
    os.makedirs(args.work, exist_ok=True)
    os.environ["PRIMUS_GPT2_VOCAB_DIR"] = args.vocab_dir
    print(json.dumps({"seed": args.seed, "tokenizers": tokenizers.__version__,
                      "tiktoken": getattr(tiktoken, "__version__", None)}))
    rng = random.Random(args.seed)
    ok = True
    want = lambda name: not args.only or name in args.only
    n_docs = args.docs

    if want("gpt2"):
        ok &= check_gpt2(args, rng, n_docs)
    checks = [
        ("hf-gpt2", pre_tokenizers.ByteLevel(add_prefix_space=False)),
        ("hf-llama3", pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(LLAMA3), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])),
        ("hf-qwen2", pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN2), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])),
    ]
    for name, pre in checks:
        if not want(name):
            continue
        tok = hf_gpt2(args.vocab_dir, pre)
        path = os.path.join(args.work, name + ".tokenizer.json")
        tok.save(path)
        docs = fuzz_documents(rng, n_docs, with_special=True)
        ours = prepare(args, path, docs, name)
        ok &= compare(f"{name} tokenizer.json vs HF tokenizers", ours,
                      [e.ids for e in tok.encode_batch(docs, add_special_tokens=False)], 50256)

    corpus = open(args.corpus, encoding="utf-8").read()[:300000] if args.corpus else ""
    train_docs = corpus.split("\n\n") + fuzz_documents(rng, 2000, False, UNICODE_ATOMS)
    if want("qwen2-nfc") or want("nfd-replace"):
        tok = qwen2_style(train_docs)
        extra = UNICODE_ATOMS + QWEN_SPECIAL + QWEN_PLAIN_ADDED
        variants = [("qwen2-nfc", None),
                    ("nfd-replace", normalizers.Sequence([normalizers.NFD(), normalizers.Replace("\u0301", ""),
                                                          normalizers.Replace("\ufb01", "fi")]))]
        for name, norm in variants:
            if not want(name):
                continue
            if norm is not None:
                tok.normalizer = norm
            folder = os.path.join(args.work, name)
            os.makedirs(folder, exist_ok=True)
            tok.save(os.path.join(folder, "tokenizer.json"))
            with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
                json.dump({"eos_token": EOT, "tokenizer_class": "PreTrainedTokenizerFast",
                           "model_max_length": 1 << 20}, f)
            eod, source = eod_as_transformers_reads_it(folder, tok)
            docs = fuzz_documents(rng, n_docs, with_special=True, extra=extra)
            if corpus:
                docs += [corpus[i:i + 2000] for i in range(0, 40000, 2000)]
            ok &= compare_encode(args, folder, tok, ENCODE_TEXTS, name)
            ours = prepare(args, folder, docs, name)
            ok &= compare(f"{name} tokenizer.json vs HF tokenizers (eod {eod} from {source}, "
                          f"vocab {tok.get_vocab_size()})", ours,
                          [e.ids for e in tok.encode_batch(docs, add_special_tokens=False)], eod)
    if any(want(n) for n in ("sp-llama2", "sp-metaspace", "sp-metaspace-split")):
        ok &= check_sentencepiece(args, rng, n_docs, corpus, train_docs, want)
    return 0 if ok else 1


def check_gpt2(args, rng, n_docs):
    ok = True
    if tiktoken is None:
        print(json.dumps({"check": "gpt2 vs tiktoken", "skipped": "tiktoken is not installed"}))
    ranks = gpt2_ranks(args.vocab_dir)
    if tiktoken is not None:
        tik = tiktoken.Encoding("gpt2-local", pat_str=r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""",
                                mergeable_ranks=ranks, special_tokens={EOT: 50256})
        plain = fuzz_documents(rng, n_docs, with_special=False)
        ours = prepare(args, "gpt2", plain, "gpt2")
        ok &= compare("gpt2 vs tiktoken", ours, [tik.encode_ordinary(d) for d in plain], 50256)
    hf = hf_gpt2(args.vocab_dir, pre_tokenizers.ByteLevel(add_prefix_space=False))
    special = fuzz_documents(rng, n_docs, with_special=True)
    ours = prepare(args, "gpt2", special, "gpt2_special")
    ok &= compare("gpt2 vs HF tokenizers (with <|endoftext|> in text)", ours,
                  [e.ids for e in hf.encode_batch(special, add_special_tokens=False)], 50256)
    if args.corpus:
        text = open(args.corpus, encoding="utf-8").read()
        ours = prepare(args, "gpt2", [text], "corpus")
        ok &= compare("gpt2 vs HF tokenizers, corpus as one document", ours,
                      [hf.encode(text, add_special_tokens=False).ids], 50256)
    return ok


if __name__ == "__main__":
    sys.exit(main())
