// The KV caches the host checks of the attention kernels run over, one
// interface for all (ptr: what the kernels' templates take; get: an element
// as the cache holds it; fill, poison, differ):
//   Plain<float>, Plain<u16>: f32 and f16 caches;
//   Q8: a q8_0 cache, KvQ8's two arrays (the codes, one byte an element,
//       and one f16 scale per 32 elements), each ending where an unreadable
//       page begins, so a read past either array faults.
// q8_ref_block is ggml's q8_0 quantizer (quantize_row_q8_0_ref, the CPU
// cache's quantize_q8_0), written out here as the reference of the
// kernels' stores: per block of 32, d = max|x| / 127, q = round(x * (1 /
// d)) half away from zero (0 for d = 0), d stored as f16 rounded to nearest
// even. Include after the extracted kernel header (KvQ8) and att_emu.h (f2h).
#pragma once
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

inline float widen(float f) { return f; }
inline float widen(u16 h) { return h2f(h); }

template <class KV> struct Plain {
    static constexpr const char* name = sizeof(KV) == 4 ? "f32" : "f16";
    std::vector<KV> v;
    explicit Plain(size_t n) : v(n) {}
    KV* ptr() { return v.data(); }
    const KV* cptr() const { return v.data(); }  // for the kernels that only read it
    size_t size() const { return v.size(); }
    // Element e as the cache holds it, and rounded to f16.
    float get(size_t e) const { return widen(v[e]); }
    float get_f16(size_t e) const { return h2f(f2h(get(e))); }
    static KV conv(float f) {
        if constexpr (sizeof(KV) == 4)
            return f;
        else
            return f2h(f);
    }
    void fill(std::mt19937& rng, std::normal_distribution<float>& nd) {
        for (auto& x : v) x = conv(nd(rng));
    }
    // Elements at .. at + n - 1: 300 (a key) or -300.
    void poison(size_t at, int n, bool key) {
        for (int i = 0; i < n; i++) v[at + i] = conv(key ? 300.f : -300.f);
    }
    // Elements that differ from o's.
    int differ(const Plain& o) const {
        int n = 0;
        for (size_t i = 0; i < v.size(); i++) n += memcmp(&v[i], &o.v[i], sizeof(KV)) != 0;
        return n;
    }
};
using F32 = Plain<float>;
using F16 = Plain<u16>;

// n elements of T that end at an unreadable page.
template <class T> class Guarded {
  public:
    explicit Guarded(size_t n) { alloc(n); }
    Guarded(const Guarded& o) {
        alloc(o.n_);
        memcpy(p_, o.p_, n_ * sizeof(T));
    }
    Guarded& operator=(const Guarded& o) {
        if (this != &o) {
            release();
            alloc(o.n_);
            memcpy(p_, o.p_, n_ * sizeof(T));
        }
        return *this;
    }
    ~Guarded() { release(); }
    T* data() { return p_; }
    const T* data() const { return p_; }
    T& operator[](size_t i) { return p_[i]; }
    const T& operator[](size_t i) const { return p_[i]; }
    size_t size() const { return n_; }

  private:
    void alloc(size_t n) {
        const size_t page = (size_t)sysconf(_SC_PAGESIZE), bytes = n * sizeof(T);
        const size_t span = (bytes + page - 1) / page * page;
        len_ = span + page;
        base_ = (char*)mmap(nullptr, len_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (base_ == (char*)MAP_FAILED || mprotect(base_ + span, page, PROT_NONE) != 0) {
            fprintf(stderr, "kv_caches: no guarded buffer\n");
            abort();
        }
        p_ = (T*)(base_ + span - bytes);
        n_ = n;
    }
    void release() {
        if (base_) munmap(base_, len_);
        base_ = nullptr;
    }
    char* base_ = nullptr;
    size_t len_ = 0, n_ = 0;
    T* p_ = nullptr;
};

// One block of 32 values to codes q and scale *d.
inline void q8_ref_block(const float* x, i8* q, u16* d) {
    float amax = 0.f;
    for (int j = 0; j < 32; j++) amax = std::max(amax, std::fabs(x[j]));
    const float s = amax / 127.f, inv = s != 0.f ? 1.f / s : 0.f;
    for (int j = 0; j < 32; j++) q[j] = (i8)std::round(x[j] * inv);
    *d = f2h(s);
}

struct Q8 {
    static constexpr const char* name = "q8_0";
    Guarded<i8> q;
    Guarded<u16> d;
    explicit Q8(size_t n) : q(n), d(n / 32) {}
    KvQ8 ptr() { return KvQ8{q.data(), d.data(), 0}; }
    KvQ8 cptr() const { return KvQ8{(i8*)q.data(), (u16*)d.data(), 0}; }
    size_t size() const { return q.size(); }
    // Element e as the cache holds it (q * d, exact in f32), and rounded to
    // f16.
    float get(size_t e) const { return (float)q[e] * h2f(d[e >> 5]); }
    float get_f16(size_t e) const { return h2f(f2h(get(e))); }
    // Elements at .. at + n - 1 (whole blocks) quantized from x.
    void quantize(size_t at, const float* x, int n) {
        for (int b = 0; b < n; b += 32) q8_ref_block(x + b, &q[at + b], &d[(at + b) >> 5]);
    }
    // Every block from 32 normal values.
    void fill(std::mt19937& rng, std::normal_distribution<float>& nd) {
        float x[32];
        for (size_t at = 0; at < size(); at += 32) {
            for (auto& v : x) v = nd(rng);
            quantize(at, x, 32);
        }
    }
    // Elements at .. at + n - 1 (whole blocks): codes 127 (a key) or -127,
    // scales NaN.
    void poison(size_t at, int n, bool key) {
        for (int i = 0; i < n; i++) q[at + i] = key ? 127 : -127;
        for (int b = 0; b < n; b += 32) d[(at + b) >> 5] = 0x7e00;
    }
    // Codes and scales that differ from o's.
    int differ(const Q8& o) const {
        int n = 0;
        for (size_t i = 0; i < q.size(); i++) n += q[i] != o.q[i];
        for (size_t i = 0; i < d.size(); i++) n += d[i] != o.d[i];
        return n;
    }
};

// A q8_0 cache's edge cases in n_rows head rows of HD values (v): block b
// of head row x (32 values) by (x + b) % 5: left as drawn, zeros (scale
// 0), ties (max 127: scale 1, codes of x.5 that round away from zero),
// small (an f16-subnormal scale), large.
template <int HD> inline void q8_edge_rows(std::vector<float>& v, int n_rows, std::mt19937& rng) {
    std::normal_distribution<float> nd(0.f, 1.f);
    for (int x = 0; x < n_rows; x++)
        for (int b = 0; b < HD / 32; b++) {
            float* e = &v[(size_t)x * HD + 32 * b];
            for (int j = 0; j < 32; j++) switch ((x + b) % 5) {
                    case 1: e[j] = 0.f; break;
                    case 2: e[j] = j == 0 ? (x & 1 ? 127.f : -127.f) : (j & 1 ? 1.f : -1.f) * (j % 20 + 0.5f); break;
                    case 3: e[j] = 2e-4f * nd(rng); break;
                    case 4: e[j] = 1000.f * nd(rng); break;
                }
        }
}
