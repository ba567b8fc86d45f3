// Error-message helpers shared by the planner and the runtime (header-only).
#pragma once

#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>

namespace ltxk {
namespace detail {

// Messages are built with std::string and std::to_string only, no iostreams: std::ostringstream number
// formatting segfaulted inside this module on the GPU machine (torch 2.11, GCC 13.3; cause not established).
inline std::string to_str(const char* v) { return v; }
inline std::string to_str(const std::string& v) { return v; }
template <typename T, typename = std::enable_if_t<std::is_arithmetic_v<std::decay_t<T>>>>
std::string to_str(T v) {
  return std::to_string(v);
}
template <typename... Args>
std::string cat(Args&&... args) {
  std::string out;
  ((out += to_str(args)), ...);
  return out;
}

template <typename... Args>
[[noreturn]] void invalid(Args&&... args) {
  throw std::invalid_argument(cat(std::forward<Args>(args)...));
}

}  // namespace detail
}  // namespace ltxk
