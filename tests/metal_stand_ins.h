// C++ stand-ins for the Metal Shading Language names kernels/metal/ uses, so that g++ can
// parse and instantiate those sources (tests/test_metal_source.py): a check of syntax,
// names and types where no Apple hardware is at hand, not of what the kernels compute.
#include <cstdint>
#include <cstddef>
#define device
#define thread
#define threadgroup
#define constant const
struct half { unsigned short b; half() {} half(float) {} operator float() const { return 0.f; } };
struct bfloat16_t { unsigned short b; bfloat16_t() {} explicit bfloat16_t(float) {} explicit operator float() const { return 0.f; } };
typedef unsigned int uint; typedef unsigned short ushort;
struct uint2 { uint x, y; }; struct uint3 { uint x, y, z; }; struct uint4 { uint x, y, z, w; };
struct float4 { float x, y, z, w; float4() {} float4(float a, float b, float c, float d) : x(a), y(b), z(c), w(d) {} };
template <typename T, typename U> T as_type(U u) { return T(); }
namespace metal { inline float fma(float a, float b, float c) { return a * b + c; } inline float fmax(float a, float b) { return a; }
  inline float fmin(float a, float b) { return a; } inline float exp2(float a) { return a; } inline float rint(float a) { return a; }
  namespace precise { inline float divide(float a, float b) { return a / b; } } }
enum class mem_flags { mem_threadgroup };
inline void simdgroup_barrier(mem_flags) {} inline void threadgroup_barrier(mem_flags) {}
template <typename T> T simd_max(T x) { return x; } template <typename T> T simd_sum(T x) { return x; }
template <typename T> T simd_shuffle(T x, ushort) { return x; } template <typename T> T simd_shuffle_xor(T x, ushort) { return x; }
#define INFINITY __builtin_inff()
template <typename T> T min(T a, T b) { return a < b ? a : b; } template <typename T> T max(T a, T b) { return a > b ? a : b; }
