// Fuzzes the safetensors reader on a file already in memory: header length, JSON header,
// dtypes, shapes, offsets, layout (gaps, overlaps, past the end), metadata, and then every
// accessor a loader uses on each tensor it accepted (raw bytes, blobs, typed copies, fp32
// conversion). Input: the file's bytes.
#include "fuzz/fuzz_target.h"
#include "io/safetensors.h"

PRIMUS_FUZZ_TARGET(safetensors) {
  using namespace primus::io;
  // A private copy, exactly sized, so the sanitizer sees any read past the end.
  auto copy = std::make_shared<std::vector<std::byte>>(reinterpret_cast<const std::byte*>(data),
                                                       reinterpret_cast<const std::byte*>(data) + size);
  primus::fuzz::refuse_only_with_primus_errors([&] {
    SafetensorsFile f = SafetensorsFile::parse(std::span<const std::byte>(copy->data(), copy->size()), copy,
                                               "fuzz.safetensors");
    uint64_t total = 0;
    for (const auto& name : f.names()) {
      const TensorInfo& info = f.info(name);
      auto bytes = f.data(name);
      if (bytes.size() != info.nbytes) primus::fuzz::finding("data() size disagrees with the header: " + name);
      total += bytes.size();
      unsigned acc = 0;
      for (auto b : bytes) acc += static_cast<unsigned>(b);  // touch every byte
      (void)acc;
      TensorBlob blob = f.blob(name);
      if (blob.nbytes() != info.nbytes) primus::fuzz::finding("blob size disagrees with the header: " + name);
      primus::fuzz::refuse_only_with_primus_errors([&] { (void)f.read_fp32(name); });
      primus::fuzz::refuse_only_with_primus_errors([&] { (void)f.read_as<int32_t>(name); });
      primus::fuzz::refuse_only_with_primus_errors([&] { (void)f.read_as<uint8_t>(name); });
    }
    (void)total;
    for (const auto& [k, v] : f.metadata()) (void)(k.size() + v.size());
    primus::fuzz::refuse_only_with_primus_errors([&] { (void)f.info("no such tensor"); });
  });
}
