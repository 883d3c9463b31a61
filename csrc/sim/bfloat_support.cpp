// Conversions to bfloat that clang emits as library calls on x86-64. libgcc has them only from
// GCC 13 and Debian 12's toolchain links libgcc, so the module carries its own. Hidden, so they
// bind inside _native only.
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {
template <class To, class From>
To bits(From x) {
  To out;
  std::memcpy(&out, &x, sizeof out);
  return out;
}
}  // namespace

// float -> bfloat, round to nearest even; NaNs stay (quiet) NaNs.
extern "C" __attribute__((visibility("hidden"))) __bf16 __truncsfbf2(float f) {
  uint32_t u = bits<uint32_t>(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bits<__bf16>(uint16_t((u >> 16) | 0x40u));
  u += 0x7fffu + ((u >> 16) & 1u);
  return bits<__bf16>(uint16_t(u >> 16));
}

// double -> bfloat in one rounding: go through float rounded to odd (truncate, then set the
// lowest bit if anything was lost), which makes the second rounding exact.
extern "C" __attribute__((visibility("hidden"))) __bf16 __truncdfbf2(double d) {
  float f = static_cast<float>(d);
  if (std::isfinite(f) && static_cast<double>(f) != d) {
    if (std::fabs(static_cast<double>(f)) > std::fabs(d)) f = std::nextafter(f, 0.0f);
    f = bits<float>(bits<uint32_t>(f) | 1u);
  }
  return __truncsfbf2(f);
}
