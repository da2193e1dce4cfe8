// Just enough CUDA to compile gpuload's kernels as C++ and run them on the CPU, checked.
//
// Valid for kernels without shared memory, __syncthreads, atomics or warp intrinsics: each
// thread is then an independent call, so running every (block, thread) in a loop computes what
// the GPU computes. The kernel source declares its pointers with PTR(T) / PTR_AT(T, address);
// here they are checked pointers: every read and write must fall inside one registered buffer
// (a launch argument or a source image), be aligned, have that buffer's element size, and
// writes must go to a writable buffer, where each element's writes are counted.
//
// Include this header first, then the kernel source, then GPULOAD_SHIM_EXPORT(kernel_name).
// The exported C functions are driven from tests/transforms/test_kernels_cpu.py via ctypes.

#pragma once

#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <type_traits>
#include <utility>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __restrict__

struct dim3 {
    unsigned int x = 1, y = 1, z = 1;
};
static dim3 gridDim, blockDim, blockIdx, threadIdx;

static inline int min(int a, int b) { return a < b ? a : b; }
static inline int max(int a, int b) { return a > b ? a : b; }

static inline unsigned int __float_as_uint(float f) {
    unsigned int u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static inline float __uint_as_float(unsigned int u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

// cvt.rn.f16.f32: float32 to float16 bits, rounded to nearest even (the PTX the kernel uses on
// the GPU). Needs the default rounding mode and no flush-to-zero, as a Python process has.
static inline unsigned short host_float_to_half(float value) {
    unsigned int f = __float_as_uint(value);
    const unsigned int sign = (f >> 16) & 0x8000u;
    f &= 0x7fffffffu;
    unsigned int h;
    if (f >= 0x47800000u) {  // >= 2**16: infinity (overflow), or NaN
        if (f > 0x7f800000u) return 0x7fffu;  // NaN: the canonical one
        h = 0x7c00u;
    } else if (f < 0x38800000u) {  // below the smallest normal half: let the FPU round
        h = __float_as_uint(__uint_as_float(f) + 0.5f) - 0x3f000000u;
    } else {  // rebias the exponent, round the 13 dropped bits to nearest even
        h = (f + 0xc8000fffu + ((f >> 13) & 1u)) >> 13;
    }
    return (unsigned short)(h | sign);
}

namespace shim {

struct Region {
    uintptr_t begin, end;  // bytes [begin, end)
    size_t element;        // element size in bytes
    uint32_t* writes;      // per-element write counts (writable buffers), else nullptr
};

constexpr int kMaxRegions = 1 << 12;
static Region regions[kMaxRegions];
static int region_count = 0;
static long long error_count = 0;
static char first_error[1024];

static void fail(const char* format, ...) {
    if (error_count++ > 0) return;
    int used = snprintf(first_error, sizeof first_error, "block %u thread %u: ", blockIdx.x,
                        threadIdx.x);
    va_list args;
    va_start(args, format);
    vsnprintf(first_error + used, sizeof first_error - used, format, args);
    va_end(args);
}

static int find(uintptr_t address) {
    for (int i = 0; i < region_count; ++i)
        if (regions[i].begin <= address && address < regions[i].end) return i;
    return -1;
}

// True when an access of `size` bytes at `address` is legal in region `r`; else reports why.
static bool check(int r, uintptr_t address, size_t size, bool write) {
    if (r < 0) {
        fail("%s through a pointer into no buffer (address %#lx)", write ? "write" : "read",
             (unsigned long)address);
        return false;
    }
    const Region& g = regions[r];
    if (address < g.begin || address + size > g.end) {
        fail("%s out of bounds of buffer %d: byte offset %lld, buffer has %lld bytes",
             write ? "write" : "read", r, (long long)(address - g.begin),
             (long long)(g.end - g.begin));
        return false;
    }
    if (size != g.element || (address - g.begin) % size != 0) {
        fail("%s of %zu bytes at byte offset %lld of buffer %d of %zu-byte elements",
             write ? "write" : "read", size, (long long)(address - g.begin), r, g.element);
        return false;
    }
    if (write && g.writes == nullptr) {
        fail("write to read-only buffer %d", r);
        return false;
    }
    return true;
}

template <class T>
struct Ref {  // what p[i] gives: reads check bounds; writes also count
    using Value = typename std::remove_const<T>::type;
    uintptr_t address;
    int region;

    operator Value() const {
        Value v{};
        if (check(region, address, sizeof(T), false)) memcpy(&v, (const void*)address, sizeof v);
        return v;
    }

    template <class V>
    Ref& operator=(V value) {
        static_assert(!std::is_const<T>::value, "write through a pointer to const");
        const Value v = (Value)value;
        if (check(region, address, sizeof(T), true)) {
            memcpy((void*)address, &v, sizeof v);
            const Region& g = regions[region];
            ++g.writes[(address - g.begin) / g.element];
        }
        return *this;
    }
};

template <class T>
struct Ptr {
    uintptr_t address = 0;
    int region = -1;  // the buffer the pointer was made from; arithmetic must stay in it

    static Ptr at(uintptr_t address) {
        Ptr p;
        p.address = address;
        p.region = find(address);
        if (p.region < 0)
            fail("pointer %#lx made from an address in no buffer", (unsigned long)address);
        return p;
    }

    Ptr operator+(long long k) const {
        Ptr p = *this;
        p.address = address + (uintptr_t)(k * (long long)sizeof(T));
        return p;
    }

    Ref<T> operator[](long long k) const { return Ref<T>{address + (uintptr_t)(k * (long long)sizeof(T)), region}; }
};

// How a kernel parameter is read from a launch's argument array (as cuLaunchKernel's
// kernelParams: one pointer to each argument's value), and its code in the signature string.
template <class P>
struct Arg;

template <class T>
struct Arg<Ptr<T>> {
    static Ptr<T> get(void* value) {
        uint64_t address;
        memcpy(&address, value, sizeof address);
        return Ptr<T>::at((uintptr_t)address);
    }
    static int describe(char* out) {
        return sprintf(out, "%s%zu", std::is_const<T>::value ? "r" : "w", sizeof(T));
    }
};

template <class T, char Kind>
struct ScalarArg {
    static T get(void* value) {
        T v;
        memcpy(&v, value, sizeof v);
        return v;
    }
    static int describe(char* out) { return sprintf(out, "%c%zu", Kind, sizeof(T)); }
};

template <>
struct Arg<int> : ScalarArg<int, 'i'> {};
template <>
struct Arg<long long> : ScalarArg<long long, 'i'> {};
template <>
struct Arg<float> : ScalarArg<float, 'f'> {};

template <class... P, size_t... I>
static void call(void (*kernel)(P...), void** args, std::index_sequence<I...>) {
    kernel(Arg<P>::get(args[I])...);
}

// Runs the kernel once for every (block, thread) of the grid; returns the errors so far.
template <class... P>
static long long launch(void (*kernel)(P...), const unsigned* grid, const unsigned* block,
                        void** args) {
    gridDim = {grid[0], grid[1], grid[2]};
    blockDim = {block[0], block[1], block[2]};
    for (blockIdx.z = 0; blockIdx.z < gridDim.z; ++blockIdx.z)
        for (blockIdx.y = 0; blockIdx.y < gridDim.y; ++blockIdx.y)
            for (blockIdx.x = 0; blockIdx.x < gridDim.x; ++blockIdx.x)
                for (threadIdx.z = 0; threadIdx.z < blockDim.z; ++threadIdx.z)
                    for (threadIdx.y = 0; threadIdx.y < blockDim.y; ++threadIdx.y)
                        for (threadIdx.x = 0; threadIdx.x < blockDim.x; ++threadIdx.x)
                            call(kernel, args, std::index_sequence_for<P...>{});
    return error_count;
}

// "r8,i4,w2,...": per parameter, r/w (pointer to const / writable) or i/f (int, float) and size.
template <class... P>
static const char* signature(void (*)(P...)) {
    static char text[256];
    char* at = text;
    ((at += Arg<P>::describe(at), *at++ = ','), ...);
    at[-1] = '\0';
    return text;
}

}  // namespace shim

#define PTR(T) shim::Ptr<T>
#define PTR_AT(T, address) shim::Ptr<T>::at((uintptr_t)(long long)(address))

extern "C" void shim_reset() {
    shim::region_count = 0;
    shim::error_count = 0;
    shim::first_error[0] = '\0';
}

// Registers bytes [begin, end) of `element`-byte elements; writable when `writes` is given.
extern "C" int shim_add_region(uint64_t begin, uint64_t end, uint64_t element, uint32_t* writes) {
    if (shim::region_count == shim::kMaxRegions) return -1;
    shim::regions[shim::region_count] = {(uintptr_t)begin, (uintptr_t)end, (size_t)element, writes};
    return shim::region_count++;
}

extern "C" long long shim_errors(char* message, int size) {
    snprintf(message, size, "%s", shim::first_error);
    return shim::error_count;
}

extern "C" unsigned short shim_float_to_half(float f) { return host_float_to_half(f); }

#define GPULOAD_SHIM_EXPORT(kernel)                                                          \
    extern "C" long long shim_launch(const unsigned* grid, const unsigned* block, void** args) { \
        return shim::launch(kernel, grid, block, args);                                      \
    }                                                                                        \
    extern "C" const char* shim_signature() { return shim::signature(kernel); }
