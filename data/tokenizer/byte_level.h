// GPT-2's byte-level alphabet: each of the 256 byte values is written as one printable code
// point (printable Latin-1 bytes as themselves, the others as U+0100 onward), so that BPE
// vocabularies can be stored as JSON text. "Ġthe" in a vocab file is the bytes " the".
#pragma once
#include <cstdint>
#include <string>
#include <string_view>

namespace primus::data::byte_level {

// Code point that stands for byte b.
uint32_t byte_to_codepoint(uint8_t b);

// Byte that code point cp stands for, or -1 when cp is not in the alphabet.
int codepoint_to_byte(uint32_t cp);

// Decodes a token in byte-level form ("Ġthe") into raw bytes (" the"); false when a
// character is not in the alphabet.
bool decode_token(std::string_view token, std::string* out);

// The inverse: raw bytes to byte-level form (UTF-8).
std::string encode_token(std::string_view bytes);

}  // namespace primus::data::byte_level
