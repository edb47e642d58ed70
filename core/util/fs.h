// File helpers shared by every layer: whole-file reads with clear errors, and atomic writes
// (write to a temporary file in the same folder, fsync, rename) so a crash never leaves a
// half-written file under the final name.
#pragma once
#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>
#include <string_view>

namespace primus::fs {

// Reads the whole file; throws IoError naming the path when it cannot.
std::string read_file(const std::filesystem::path& path);

// Writes `data` to `path` atomically. Throws IoError naming the path on failure; on failure
// the previous file at `path` (if any) is untouched.
void atomic_write_file(const std::filesystem::path& path, std::string_view data);

// Streams into a temporary file via `writer(FILE*)`, fsyncs, then renames onto `path`.
void atomic_write_with(const std::filesystem::path& path,
                       const std::function<void(std::FILE*)>& writer);

// Renames `from` onto `to` atomically and fsyncs the parent folder (for directory swaps).
void atomic_rename(const std::filesystem::path& from, const std::filesystem::path& to);

}  // namespace primus::fs
