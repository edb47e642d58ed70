// Token ids as vocabulary files write them (JSON numbers), checked before they size anything:
// the tokenizer keeps a table indexed by id, so an id of 2^31 from a corrupt file would ask
// for tens of GiB, and a float or negative id would index outside it.
#pragma once
#include <fmt/format.h>

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>

#include "core/util/error.h"

namespace primus::data {

// No real vocabulary comes near this (the largest in use have about 2^18 tokens).
inline constexpr int64_t kMaxTokenId = (int64_t{1} << 24) - 1;

// `v` as a token id in [0, kMaxTokenId]; otherwise FormatError naming `where()` (file and
// field; called only then, as vocabularies have 10^5 entries).
template <class Where>
int32_t read_token_id(const nlohmann::json& v, Where&& where) {
  if (!v.is_number_integer()) {
    throw FormatError(fmt::format("{}: id {} is not an integer", where(), v.dump()));
  }
  if (v.is_number_unsigned() ? v.get<uint64_t>() > static_cast<uint64_t>(kMaxTokenId)
                             : (v.get<int64_t>() < 0 || v.get<int64_t>() > kMaxTokenId)) {
    throw FormatError(fmt::format("{}: id {} is outside [0, {}]", where(), v.dump(), kMaxTokenId));
  }
  return static_cast<int32_t>(v.get<int64_t>());
}

}  // namespace primus::data
