// The one translation unit that compiles fmt's and spdlog's out-of-line code (Debian's packages ship
// only their headers and shared libraries). Every other source includes the libraries' headers in
// their compiled-library mode (no FMT_HEADER_ONLY, SPDLOG_COMPILED_LIB; cmake/Dependencies.cmake), so
// the implementation is compiled here once instead of in each of the ~80 unity files (0-13 s each at
// -O3), and the binaries still link it statically (they run where no -dev library is installed).
#if defined(FMT_HEADER_ONLY) || !defined(SPDLOG_COMPILED_LIB)
#error "fmt_spdlog.cpp is the compiled half of fmt / spdlog: build it without FMT_HEADER_ONLY, with SPDLOG_COMPILED_LIB"
#endif

#include <fmt/format-inl.h>

#include <mutex>

#include <spdlog/common-inl.h>
#include <spdlog/details/backtracer-inl.h>
#include <spdlog/details/log_msg-inl.h>
#include <spdlog/details/log_msg_buffer-inl.h>
#include <spdlog/details/os-inl.h>
#include <spdlog/details/periodic_worker-inl.h>
#include <spdlog/details/registry-inl.h>
#include <spdlog/logger-inl.h>
#include <spdlog/pattern_formatter-inl.h>
#include <spdlog/sinks/ansicolor_sink-inl.h>
#include <spdlog/sinks/base_sink-inl.h>
#include <spdlog/sinks/sink-inl.h>
#include <spdlog/sinks/stdout_color_sinks-inl.h>
#include <spdlog/spdlog-inl.h>

// Explicit instantiations: the templates that the libraries' headers declare but define only in their
// -inl.h files, and that our sources use (each line answers an undefined symbol of the link).
FMT_BEGIN_NAMESPACE
namespace detail {
template FMT_API auto thousands_sep_impl<char>(locale_ref) -> thousands_sep_result<char>;  // locale-aware {:L}
template FMT_API auto decimal_point_impl<char>(locale_ref) -> char;                        // floats
}  // namespace detail
FMT_END_NAMESPACE

template class spdlog::sinks::base_sink<std::mutex>;  // spdlog::sinks::ringbuffer_sink_mt (tests)
