// Training checkpoints: one directory per saved iteration, written so that a crash at any
// moment leaves the previous checkpoint intact and the tracker naming a complete one.
//
//   <save_dir>/
//     latest_checkpointed_iteration.txt   Megatron's tracker: the iteration number, as text
//     iter_0000100/
//       model.safetensors                 model tensors (names and dtypes chosen by the caller)
//       optimizer.safetensors             optimizer tensors (moments etc., caller's names)
//       trainer_state.json                caller's JSON (step, RNG, data position, config, ...)
//       manifest.json                     size and CRC-32C of each file above; written last
//
// Save: write into <save_dir>/.iter_0000100.tmp-<pid>/, fsync every file and the directory,
// rename it to iter_0000100 (an existing iter_0000100 is swapped out atomically), then
// rewrite the tracker atomically, then prune old checkpoints. Load: verify every file's size
// and checksum against the manifest before handing anything out. See docs/checkpoints.md.
#pragma once
#include <cstdint>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "io/digest_writer.h"
#include "io/tensor_blob.h"

namespace primus::io {

inline constexpr const char* kTrackerFile = "latest_checkpointed_iteration.txt";
inline constexpr const char* kModelFile = "model.safetensors";
inline constexpr const char* kOptimizerFile = "optimizer.safetensors";
inline constexpr const char* kStateFile = "trainer_state.json";
inline constexpr const char* kManifestFile = "manifest.json";

// What a checkpoint holds. On save the blobs may borrow the trainer's buffers (no staging
// copy); on load they are zero-copy views of the mapped files, alive as long as any blob is.
struct CheckpointData {
  std::map<std::string, TensorBlob> model;
  std::map<std::string, TensorBlob> optimizer;
  nlohmann::json state = nlohmann::json::object();
  // On load: manifest.json as written (files, and the keys SaveOptions::manifest_extra added).
  nlohmann::json manifest;
};

// A file another process (a data-parallel rank) already wrote, fsync()ed, into the save folder,
// to become part of the checkpoint: save_checkpoint renames it into the checkpoint before the
// manifest is written, so it is covered by the same atomic install and checksum.
struct AdoptedFile {
  std::string name;             // its name inside the checkpoint (no '/', not one of the files above)
  std::filesystem::path path;   // where it is now; must be on the save folder's file system
  FileDigest digest;            // size and CRC-32C, from its writer
};

struct SaveOptions {
  // Keep this many newest complete checkpoints (by iteration); 0 keeps all. The one just saved
  // and the one the tracker names are never removed.
  int keep_last = 0;
  // Written into both safetensors files' __metadata__ (e.g. {"format": "pt"}).
  std::map<std::string, std::string> metadata;
  // Files written by other ranks (e.g. ZeRO-1 optimizer shards), listed in the manifest.
  std::vector<AdoptedFile> adopt;
  // Extra top-level keys of manifest.json (e.g. "sharding": world size and shard ranges).
  nlohmann::json manifest_extra = nlohmann::json::object();
};

struct CheckpointRef {
  int64_t iteration = 0;
  std::filesystem::path dir;
};

// <save_dir>/iter_0000100 (seven digits, more when needed).
std::filesystem::path checkpoint_dir(const std::filesystem::path& save_dir, int64_t iteration);

// Saves `data` as iteration `iteration`; returns the checkpoint's directory. Throws IoError
// when a write fails, leaving the previous checkpoints and the tracker untouched.
std::filesystem::path save_checkpoint(const std::filesystem::path& save_dir, int64_t iteration,
                                      const CheckpointData& data, const SaveOptions& opts = {});

// The checkpoint to resume from: the one the tracker names when its manifest is present and its
// files have the listed sizes; otherwise (with a warning) the newest iter_ directory whose files
// all verify, checksums included. nullopt when there is none.
std::optional<CheckpointRef> find_latest(const std::filesystem::path& save_dir);

// Verifies every file of the checkpoint in `dir` against its manifest (sizes, and checksums
// unless `sizes_only`); throws FormatError naming `dir` and the file that disagrees (missing,
// truncated, altered), or the manifest itself when it is missing or malformed.
void verify_checkpoint(const std::filesystem::path& dir, bool sizes_only = false);

// Verifies (sizes and checksums) and loads the checkpoint in `dir`. With `verify_other_files`
// false, files beyond the three standard ones (other ranks' shards) are left to
// load_checkpoint_file, so each rank reads only what it needs.
CheckpointData load_checkpoint(const std::filesystem::path& dir, bool verify_other_files = true);

// Verifies one more file the manifest lists (size and checksum) and returns its tensors. Throws
// FormatError naming `dir` and the file when the manifest does not list it, or it is missing,
// truncated or altered; `what` (e.g. "optimizer shard of rank 3") is added to the message.
std::map<std::string, TensorBlob> load_checkpoint_file(const std::filesystem::path& dir, const std::string& name,
                                                       const std::string& what = "");

// The iterations of the iter_ directories in `save_dir` that have a manifest, ascending.
std::vector<int64_t> list_checkpoints(const std::filesystem::path& save_dir);

// Removes directories left by crashed saves or prunes (.iter_*.tmp-<pid>, .iter_*.del-<pid>)
// whose process is gone, logging each; returns how many were removed.
int remove_stale_temporaries(const std::filesystem::path& save_dir);

// Test hook: when the environment variable PRIMUS_TEST_CRASH_DURING_SAVE equals one of
// after_model, after_optimizer, after_state, before_rename, before_tracker, save_checkpoint
// calls _exit(77) at that point, as a crash would.
inline constexpr const char* kCrashHookEnv = "PRIMUS_TEST_CRASH_DURING_SAVE";

}  // namespace primus::io
