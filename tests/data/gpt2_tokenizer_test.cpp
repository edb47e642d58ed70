// The GPT-2 tokenizer against ids from an independent implementation (the MIT gpt-3-encoder
// JavaScript port of OpenAI's encoder, run once to produce the expected values below), and
// round trips on the shared corpus and on random bytes.
#include <gtest/gtest.h>

#include <random>
#include <thread>

#include "core/util/error.h"
#include "data/tokenizer/tokenizer.h"
#include "data_test_util.h"

namespace primus::data {
namespace {

using Ids = std::vector<int32_t>;

const Tokenizer& gpt2() {
  static auto tok = make_tokenizer("gpt2");
  return *tok;
}

TEST(Gpt2Tokenizer, VocabularyAndEndOfText) {
  EXPECT_EQ(gpt2().vocab_size(), 50257);
  EXPECT_EQ(gpt2().eod_id(), 50256);
  EXPECT_EQ(gpt2().name(), "gpt2");
  EXPECT_EQ(gpt2().decode(Ids{50256}), "<|endoftext|>");
}

TEST(Gpt2Tokenizer, KnownIds) {
  struct Case {
    std::string text;
    Ids ids;
  };
  const std::vector<Case> cases = {
      {"Hello world", {15496, 995}},
      {" Hello", {18435}},
      {"I'm can't we'll they've she'd it's you're",
       {40, 1101, 460, 470, 356, 1183, 484, 1053, 673, 1549, 340, 338, 345, 821}},
      {"  leading\n\n\ntrailing   ", {220, 3756, 628, 198, 9535, 4386, 220, 220, 220}},
      {"naïve café Ωmega 中文 😀", {2616, 38776, 40304, 7377, 102, 13731, 220, 40792, 23877, 229, 30325, 222}},
      {"1234567 3.14", {10163, 2231, 3134, 513, 13, 1415}},
      {"a\t\tb", {64, 197, 197, 65}},
      {"HELLO'S 'quoted'", {13909, 3069, 46, 6, 50, 705, 421, 5191, 6}},
      {"   ", {220, 220, 220}},
      {"", {}},
  };
  for (const auto& c : cases) {
    EXPECT_EQ(gpt2().encode(c.text), c.ids) << "text: " << c.text;
    EXPECT_EQ(gpt2().decode(c.ids), c.text);
  }
}

TEST(Gpt2Tokenizer, EndOfTextInTextIsTheSpecialToken) {
  // Like Hugging Face's GPT-2 tokenizer: the literal string is the special id, and the text on
  // either side is pre-tokenized on its own (no " <" merge across the boundary).
  EXPECT_EQ(gpt2().encode("<|endoftext|>"), (Ids{50256}));
  EXPECT_EQ(gpt2().encode("Hello world<|endoftext|> Hello"), (Ids{15496, 995, 50256, 18435}));
  EXPECT_EQ(gpt2().encode("<|endoftext|><|endoftext|>"), (Ids{50256, 50256}));
  // Not quite the special token: plain text.
  Ids partial = gpt2().encode("<|endoftext|");
  EXPECT_EQ(std::count(partial.begin(), partial.end(), 50256), 0);
  EXPECT_EQ(gpt2().decode(partial), "<|endoftext|");
}

TEST(Gpt2Tokenizer, WhitespaceRunsKeepTheirLastSpaceForTheNextWord) {
  // "\s+(?!\S)": a run of spaces before a word leaves one space to join the word (" b" = 275);
  // GPT-2 has no multi-space tokens, so the rest are single spaces (220).
  EXPECT_EQ(gpt2().encode("a    b"), (Ids{64, 220, 220, 220, 275}));
  EXPECT_EQ(gpt2().encode("a \n b"), (Ids{64, 220, 198, 275}));
}

TEST(Gpt2Tokenizer, RoundTripsTheShakespeareCorpus) {
  std::string path = testing::shakespeare_path();
  if (path.empty()) GTEST_SKIP() << "tinyshakespeare.txt not found next to the repository";
  std::string text = testing::read_bytes(path);
  Ids ids = gpt2().encode(text);
  // The independent implementation gives 338025 tokens for this file.
  EXPECT_EQ(ids.size(), 338025u);
  EXPECT_EQ(gpt2().decode(ids), text);
  for (int32_t id : ids) ASSERT_TRUE(id >= 0 && id < 50256) << id;
}

TEST(Gpt2Tokenizer, RoundTripsRandomBytesIncludingMalformedUtf8) {
  uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const std::vector<std::string> atoms = {"a", "Z", " ", "  ", "\n", "\r\n", "\t", "'s", "'", "7", ".", "é",
                                          "中", "😀", "\xC3", "\xFF", "\xE4\xB8", "\x80", "\u00a0", "\u3000"};
  for (int round = 0; round < 300; ++round) {
    std::string s;
    int n = static_cast<int>(rng() % 40);
    for (int i = 0; i < n; ++i) {
      if (rng() % 4 == 0) s += static_cast<char>(rng() % 256);
      else s += atoms[rng() % atoms.size()];
    }
    Ids ids = gpt2().encode(s);
    ASSERT_EQ(gpt2().decode(ids), s);
    // Deterministic: the cache must not change the answer.
    ASSERT_EQ(gpt2().encode(s), ids);
  }
}

TEST(Gpt2Tokenizer, LongPieceIsFastAndExact) {
  // One 200 kB "word": BPE on a single piece must not be quadratic.
  std::string s(200000, 'a');
  Ids ids = gpt2().encode(s);
  EXPECT_LT(ids.size(), s.size() / 2);
  EXPECT_EQ(gpt2().decode(ids), s);
}

TEST(Gpt2Tokenizer, ParallelEncodingAgreesWithSerial) {
  std::vector<std::string> texts;
  std::mt19937 rng(static_cast<uint32_t>(testing::fresh_seed()));
  for (int i = 0; i < 64; ++i) {
    std::string s;
    for (int w = 0; w < 50; ++w) s += " word" + std::to_string(rng() % 1000) + (w % 7 ? "," : ".\n");
    texts.push_back(s);
  }
  std::vector<Ids> serial;
  auto fresh = make_tokenizer("gpt2");  // its own, empty cache
  for (auto& t : texts) serial.push_back(fresh->encode(t));
  std::vector<Ids> parallel(texts.size());
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (size_t i = static_cast<size_t>(t); i < texts.size(); i += 4) parallel[i] = gpt2().encode(texts[i]);
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(parallel, serial);
}

TEST(Gpt2Tokenizer, DecodeRejectsIdsOutsideTheVocabulary) {
  EXPECT_THROW(gpt2().decode(Ids{50257}), RuntimeError);
  EXPECT_THROW(gpt2().decode(Ids{-1}), RuntimeError);
}

TEST(Gpt2Tokenizer, VocabDirFromEnvironment) {
  testing::TempDir dir;
  setenv("PRIMUS_GPT2_VOCAB_DIR", dir.path().c_str(), 1);
  EXPECT_THROW(make_tokenizer("gpt2"), IoError);  // the override is honoured, not skipped
  unsetenv("PRIMUS_GPT2_VOCAB_DIR");
  EXPECT_NO_THROW(gpt2_vocab_dir());
}

TEST(ByteTokenizer, IdsAreBytesAndEodIsNul) {
  auto tok = make_tokenizer("bytes");
  EXPECT_EQ(tok->vocab_size(), 256);
  EXPECT_EQ(tok->eod_id(), 0);
  std::string s = "h\xC3\xA9\xFF";
  EXPECT_EQ(tok->encode(s), (Ids{104, 0xC3, 0xA9, 0xFF}));
  EXPECT_EQ(tok->decode(tok->encode(s)), s);
  EXPECT_THROW(tok->decode(Ids{256}), RuntimeError);
}

TEST(MakeTokenizer, UnknownSpecIsAConfigError) {
  try {
    make_tokenizer("no-such-tokenizer");
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("no-such-tokenizer"), std::string::npos);
  }
}

}  // namespace
}  // namespace primus::data
