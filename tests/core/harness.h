// A tiny test harness for the torch-free core's test programs (tests/core/test_*.cpp).
//
// Each program lists its test functions and returns run_tests(tests): every failed CHECK prints
// `file:line: expression`; the last line is `N passed, M failed`, counting test functions, and the
// exit status is non-zero when any test function failed (tests/test_core_cpp.py reads both).
#pragma once

#include <cstdio>
#include <string>

namespace mtprobe_test {

inline int g_failures = 0;  // failed CHECKs in the running test function

struct Test {
  const char* name;
  void (*fn)();
};

template <size_t N>
int run_tests(const Test (&tests)[N]) {
  int passed = 0, failed = 0;
  for (const Test& t : tests) {
    g_failures = 0;
    t.fn();
    if (g_failures == 0) {
      ++passed;
    } else {
      ++failed;
      std::printf("FAILED %s (%d checks)\n", t.name, g_failures);
    }
  }
  std::printf("%d passed, %d failed\n", passed, failed);
  return failed == 0 ? 0 : 1;
}

}  // namespace mtprobe_test

#define CHECK(expr)                                          \
  do {                                                       \
    if (!(expr)) {                                           \
      ++mtprobe_test::g_failures;                            \
      std::printf("%s:%d: %s\n", __FILE__, __LINE__, #expr); \
    }                                                        \
  } while (0)

// Checks that `str` contains `sub`; on failure also prints the actual string.
#define CHECK_CONTAINS(str, sub)                                                          \
  do {                                                                                    \
    const std::string check_str_ = (str);                                                 \
    if (check_str_.find(sub) == std::string::npos) {                                      \
      ++mtprobe_test::g_failures;                                                         \
      std::printf("%s:%d: %s contains %s (got \"%s\")\n", __FILE__, __LINE__, #str, #sub, \
                  check_str_.c_str());                                                    \
    }                                                                                     \
  } while (0)
