// Host check of the attention block kernel (dense.cu's attn_block, cut out
// by extract.py -> attn_block_extract.h; no GPU): Q/K/V, the decode
// attention and O of one layer in one persistent grid whose blocks wait on
// one another's counters. The GPU runs the grid's blocks at once, and they
// must: a block spins until others have written. So each emulated block
// here is its own process (fork) of 256 std::threads, so that __shared__
// (a static, block_emu.h) is per block, and "global memory" is one shared
// mapping made before the fork (counters and data through std::atomic_ref
// and fences, as on the GPU). A block whose wait times out traps (the
// kernel's __trap after ATTB_WAIT_CYCLES, here nanoseconds: 20 s), and one
// still running after 30 s is killed; either is reported (a deadlock).
//
// Against the launches it replaces, run block by block in this process with
// the same extracted code: mv3_grid over Q, K, V (norm folded or not, with
// biases), attend_then_merge(attend_rope_part) per (head, split), mv3_grid
// over O with the residual add, then (most cases) the rms_norm kernel over
// the residual stream, which the block's last block out runs as its tail.
// Every output must be the same bits: Q/K/V, the folded norm's output, the
// attention output, the split partials, the KV cache rows, O, the residual
// stream and the tail norm's output. Over two shapes (4 query heads
// of 64 over 2 KV heads, d 256; 7 of 128 over 1, d 896), splits of Q/K/V
// and O 1 / 2 / 4 / 8, f32 and f16 caches, neox and not, positions 0, 20
// and 70 of 96 (6 attention splits), grids of 1 and 3 blocks and of more
// than have work, O tiles copied in ahead (as many a block as it has)
// or read from global memory; and each case twice in a row (the second
// launch at the next position on a new input): the counters must be back at
// zero after every launch.
// Build and run: hostcheck/run.sh.
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>
#include "block_emu.h"
#include "ptx_emu.h"

#define __align__(n) __attribute__((aligned(n)))
#define MIRAGE_INF INFINITY
#define SB_MAGIC 0x4B000000u
#define MIRAGE_ATT_MIN_KEYS 16
#define MIRAGE_ATT_LOADS_BATCH 1
#define PDL_ENTRY() do {} while (0)
using std::max;

// Global memory: one mapping shared by the block processes; a bump
// allocator, reset per case.
static unsigned char* g_arena;
static size_t g_arena_size = size_t(256) << 20, g_used;
template <class T> T* galloc(size_t n) {
    g_used = (g_used + 255) & ~size_t(255);
    T* p = (T*)(g_arena + g_used);
    g_used += n * sizeof(T);
    if (g_used > g_arena_size) { printf("arena too small\n"); exit(1); }
    memset((void*)p, 0, n * sizeof(T));
    return p;
}

static std::atomic<int> g_bad{0};
static const unsigned char *g_wo_lo, *g_wo_hi;  // what the O copies may read
static bool tx_src_ok(const unsigned char* s, sb_u32 bytes) { return s >= g_wo_lo && s + bytes <= g_wo_hi; }
#include "tx_emu.h"

#include "att_emu.h"
template <class T> T __ldcg(const T* p) { return *(const volatile T*)p; }
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline unsigned atomicAdd(unsigned* p, unsigned v) { return std::atomic_ref<unsigned>(*p).fetch_add(v); }
inline void __nanosleep(int) { std::this_thread::yield(); }
inline long long clock64() {  // nanoseconds here; the kernel's bound is in cycles (~1.5-2 per ns)
    return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
        .count();
}
inline void __trap() { abort(); }
inline unsigned attb_load_acquire(const unsigned* p) {
    return std::atomic_ref<unsigned>(*const_cast<unsigned*>(p)).load(std::memory_order_acquire);
}
inline u32 __shfl_sync(unsigned, u32, int) { abort(); }  // q4ks_dot16's: split Q4_K, not run here
alignas(128) static float fused_norm_xs[1 << 16];       // the dynamic shared memory (256 KiB)
#include "attn_block_extract.h"

// Split Q8_0 bytes of a random [rows, cols] matrix: quants, then f16 scales.
static u8* split_q8(std::mt19937& r, int rows, int cols) {
    u8* w = galloc<u8>((size_t)rows * cols + (size_t)rows * cols / 16);
    std::uniform_int_distribution<int> q(-127, 127);
    std::uniform_real_distribution<float> s(0.002f, 0.02f);
    for (long i = 0; i < (long)rows * cols; i++) w[i] = (u8)(int8_t)q(r);
    u16* sc = (u16*)(w + (long)rows * cols);
    for (long i = 0; i < (long)rows * cols / 32; i++) sc[i] = f2h(s(r));
    return w;
}
static float* randv(std::mt19937& r, size_t n, float a) {
    float* v = galloc<float>(n);
    std::normal_distribution<float> d(0.f, a);
    for (size_t i = 0; i < n; i++) v[i] = d(r);
    return v;
}

struct Shape { int d, n_head, n_kv, hd; };

// Everything one layer's launches write, and the inputs they share.
template <typename KV>
struct State {
    float *y0, *y1, *y2, *att, *yo, *res, *part, *nout, *tout;
    KV *kc, *vc;
    unsigned* count;
};

template <typename KV>
static State<KV> new_state(const Shape& s, int n_ctx, int n_split, std::mt19937& r) {
    State<KV> st;
    const int kvw = s.n_kv * s.hd;
    st.y0 = galloc<float>(s.d); st.y1 = galloc<float>(kvw); st.y2 = galloc<float>(kvw);
    st.att = galloc<float>(s.n_head * s.hd); st.yo = galloc<float>(s.d); st.nout = galloc<float>(s.d);
    st.tout = galloc<float>(s.d);
    st.res = randv(r, s.d, 1.f);
    st.part = galloc<float>((size_t)s.n_head * n_split * (s.hd + 2));
    st.count = galloc<unsigned>(s.n_head);
    st.kc = galloc<KV>((size_t)kvw * n_ctx); st.vc = galloc<KV>((size_t)kvw * n_ctx);
    std::normal_distribution<float> d(0.f, 1.f);
    for (size_t i = 0; i < (size_t)kvw * n_ctx; i++) { kv_store(st.kc, i, d(r)); kv_store(st.vc, i, d(r)); }
    return st;
}
template <typename KV>
static void copy_state(const Shape& s, int n_ctx, int n_split, const State<KV>& a, State<KV>& b) {
    const int kvw = s.n_kv * s.hd;
    memcpy(b.res, a.res, s.d * 4);
    memcpy(b.kc, a.kc, (size_t)kvw * n_ctx * sizeof(KV));
    memcpy(b.vc, a.vc, (size_t)kvw * n_ctx * sizeof(KV));
    (void)n_split;
}

struct Weights { u8 *wq, *wk, *wv, *wo; float *bq, *bk, *bv, *nw, *tw; };

static int bits_differ(const void* a, const void* b, size_t bytes) {
    int n = 0;
    for (size_t i = 0; i < bytes; i++) n += ((const u8*)a)[i] != ((const u8*)b)[i];
    return n;
}

// The three launches, block by block in this process.
template <typename KV>
static void reference(const Shape& s, const Weights& w, const State<KV>& st, const float* x, bool fold, int sq, int so,
                      const int* slots, int n_ctx, int n_split, int chunk, float scale, int neox, float base,
                      bool tail) {
    const int kvw = s.n_kv * s.hd;
    auto mv3 = [&](int S, const u8* W0, const u8* W1, const u8* W2, int r0, int r1, int r2, int cols, const float* xx,
                   float* y0, float* y1, float* y2, const float* b0, const float* b1, const float* b2, float* res,
                   const float* nx, const float* nw, float* nout) {
        const int per = (FAST_WARPS / S) * MVV2_NR;
        const int tiles = (r0 + per - 1) / per + (r1 + per - 1) / per + (r2 + per - 1) / per;
        gridDim = dim3_{(unsigned)tiles, 1, 1};
        for (int t = 0; t < tiles; t++)
            run_block(256, dim3_{(unsigned)t, 0, 0}, [&] {
                long row_bytes = 0;
                float ts0 = 0, ts1 = 0, ts2 = 0, neps = 1e-5f;
                auto call = [&](auto SS) {
                    mv3_grid<MVV2_NR, MVV2_U_Q8, decltype(SS)::value>(W0, W1, W2, r0, r1, r2, row_bytes, cols, xx, y0,
                                                                      y1, y2, ts0, ts1, ts2, b0, b1, b2, res, nx, nw,
                                                                      neps, nout);
                };
                if (S == 1) call(std::integral_constant<int, 1>{});
                else if (S == 2) call(std::integral_constant<int, 2>{});
                else if (S == 4) call(std::integral_constant<int, 4>{});
                else call(std::integral_constant<int, 8>{});
            });
    };
    mv3(sq, w.wq, w.wk, w.wv, s.d, kvw, kvw, s.d, fold ? st.nout : x, st.y0, st.y1, st.y2, w.bq, w.bk, w.bv, nullptr,
        fold ? x : nullptr, fold ? w.nw : nullptr, fold ? st.nout : nullptr);
    gridDim = dim3_{1, (unsigned)s.n_head, (unsigned)n_split};
    for (int h = 0; h < s.n_head; h++)
        for (int sp = 0; sp < n_split; sp++)
            run_block(256, dim3_{0, (unsigned)h, (unsigned)sp}, [&] {
                attend_then_merge(
                    [&] {
                        attend_rope_part<KV>(st.y0, st.y1, st.y2, st.kc, st.vc, slots, s.n_head, s.n_kv, s.hd, n_ctx,
                                             chunk, scale, neox, base, st.part);
                    },
                    slots, s.n_head, s.hd, chunk, st.part, st.count, st.att);
            });
    mv3(so, w.wo, w.wo, w.wo, s.d, 0, 0, s.n_head * s.hd, st.att, st.yo, st.yo, st.yo, nullptr, nullptr, nullptr,
        st.res, nullptr, nullptr, nullptr);
    if (tail) {  // the rms_norm kernel of the FFN after it: one block, one row
        gridDim = dim3_{1, 1, 1};
        run_block(256, dim3_{0, 0, 0}, [&] {
            static float s32[32];
            rms_norm_row(st.res, w.tw, 1e-5f, s.d, s32, [&](int i, float v) { st.tout[i] = v; });
        });
    }
}

// The attention block kernel: `grid` blocks at once, one process each.
// Returns false when a block failed or hung.
template <typename KV>
static bool attention_block(const Shape& s, const Weights& w, const State<KV>& st, const float* x, bool fold, int sq,
                            int so, const int* slots, int n_ctx, int n_split, int chunk, float scale, int neox,
                            float base, unsigned* sync, int grid, int o_pre, bool tail) {
    const int kvw = s.n_kv * s.hd, vec = ((s.d > s.n_head * s.hd ? s.d : s.n_head * s.hd) + 31) / 32 * 32;
    gridDim = dim3_{(unsigned)grid, 1, 1};
    std::vector<pid_t> kids;
    fflush(stdout);
    for (int b = 0; b < grid; b++) {
        pid_t pid = fork();
        if (pid == 0) {
            alarm(30);
            run_block(ATTB_THREADS, dim3_{(unsigned)b, 0, 0}, [&] {
                attn_block<KV>(w.wq, w.wk, w.wv, s.d, kvw, kvw, s.d, fold ? st.nout : x, st.y0, st.y1, st.y2, w.bq,
                               w.bk, w.bv, fold ? x : nullptr, fold ? w.nw : nullptr, 1e-5f,
                               fold ? st.nout : nullptr, sq, st.kc, st.vc, slots, s.n_head, s.n_kv, s.hd, n_ctx, chunk,
                               scale, st.part, st.count, st.att, neox, base, n_split, w.wo, s.d, s.n_head * s.hd,
                               st.yo, nullptr, st.res, so, tail ? w.tw : nullptr, 1e-5f,
                               tail ? st.tout : nullptr, sync, o_pre, vec);
            });
            fflush(stdout);
            _exit(g_bad.load() ? 3 : 0);
        }
        kids.push_back(pid);
    }
    bool ok = true;
    for (int b = 0; b < grid; b++) {
        int status = 0;
        waitpid(kids[b], &status, 0);
        if (WIFSIGNALED(status)) {
            printf("  block %d of %d: %s\n", b, grid,
                   WTERMSIG(status) == SIGALRM   ? "still running after 30 s (deadlock)"
                   : WTERMSIG(status) == SIGABRT ? "a wait timed out and trapped (deadlock)"
                                                 : "killed by a signal");
            ok = false;
        } else if (WEXITSTATUS(status) != 0) {
            printf("  block %d of %d failed (exit %d)\n", b, grid, WEXITSTATUS(status));
            ok = false;
        }
    }
    return ok;
}

static int cases = 0, fails = 0;

template <typename KV>
static void check(const Shape& s, int sq, int so, bool fold, int neox, int pos, int grid, bool pre, unsigned seed,
                  bool tail = true) {
    g_used = 0;
    std::mt19937 r(seed);
    const int n_ctx = 96, n_split = 6, chunk = 16, kvw = s.n_kv * s.hd;
    const float scale = 1.f / sqrtf((float)s.hd), base = 10000.f;
    Weights w{split_q8(r, s.d, s.d), split_q8(r, kvw, s.d), split_q8(r, kvw, s.d), split_q8(r, s.d, s.n_head * s.hd),
              randv(r, s.d, 0.1f), randv(r, kvw, 0.1f), randv(r, kvw, 0.1f), randv(r, s.d, 1.f), randv(r, s.d, 1.f)};
    g_wo_lo = w.wo;
    g_wo_hi = w.wo + (size_t)s.d * s.n_head * s.hd * 17 / 16;
    State<KV> a = new_state<KV>(s, n_ctx, n_split, r), b = new_state<KV>(s, n_ctx, n_split, r);
    copy_state(s, n_ctx, n_split, a, b);
    unsigned* sync = galloc<unsigned>(ATTB_SYNC(s.n_head, s.n_kv));
    int* slots = galloc<int>(2);
    // O tiles copied in ahead: every tile of the block (the plan's choice
    // when they fit), or none.
    const int TO = (FAST_WARPS / so) * MVV2_NR, n_to = (s.d + TO - 1) / TO;
    const int o_pre = pre ? (n_to + grid - 1) / grid : 0;
    char what[200];
    snprintf(what, sizeof what,
             "%s d %d heads %d/%d of %d, split %d/%d, norm %s, neox %d, pos %d, grid %d, o_pre %d, tail norm %d",
             sizeof(KV) == 2 ? "f16" : "f32", s.d, s.n_head, s.n_kv, s.hd, sq, so, fold ? "folded" : "apart", neox,
             pos, grid, o_pre, tail);
    bool ok = true;
    for (int step = 0; step < 2 && ok; step++) {
        const float* x = randv(r, s.d, 1.f);
        slots[0] = 0;
        slots[1] = pos + step;
        reference<KV>(s, w, a, x, fold, sq, so, slots, n_ctx, n_split, chunk, scale, neox, base, tail);
        ok = attention_block<KV>(s, w, b, x, fold, sq, so, slots, n_ctx, n_split, chunk, scale, neox, base, sync, grid,
                                 o_pre, tail);
        if (!ok) break;
        struct { const char* name; const void *p, *q; size_t n; } outs[] = {
            {"q", a.y0, b.y0, (size_t)s.d * 4}, {"k", a.y1, b.y1, (size_t)kvw * 4}, {"v", a.y2, b.y2, (size_t)kvw * 4},
            {"norm out", a.nout, b.nout, (size_t)s.d * 4}, {"attention", a.att, b.att, (size_t)s.n_head * s.hd * 4},
            {"partials", a.part, b.part, (size_t)s.n_head * n_split * (s.hd + 2) * 4},
            {"K cache", a.kc, b.kc, (size_t)kvw * n_ctx * sizeof(KV)},
            {"V cache", a.vc, b.vc, (size_t)kvw * n_ctx * sizeof(KV)}, {"O", a.yo, b.yo, (size_t)s.d * 4},
            {"residual", a.res, b.res, (size_t)s.d * 4}, {"arrival counts", a.count, b.count, (size_t)s.n_head * 4},
            {"tail norm", a.tout, b.tout, (size_t)s.d * 4}};
        for (auto& o : outs) {
            const int n = bits_differ(o.p, o.q, o.n);
            if (n) {
                printf("  launch %d: %s: %d bytes differ\n", step + 1, o.name, n);
                ok = false;
            }
        }
        for (int i = 0; i < ATTB_SYNC(s.n_head, s.n_kv); i++)
            if (sync[i] != 0) {
                printf("  launch %d: counter %d is %u after the launch\n", step + 1, i, sync[i]);
                ok = false;
            }
        // The output must be finite and not all zero (a launch that wrote nothing
        // would equal a reference that wrote nothing).
        double mag = 0, tmag = 0;
        for (int i = 0; i < s.d; i++) mag += fabs(b.yo[i]), tmag += fabs(b.tout[i]);
        if (!(mag > 0) || !std::isfinite(mag) || (tail && !(tmag > 0 && std::isfinite(tmag)))) {
            printf("  launch %d: O is %g, the tail norm %g in magnitude\n", step + 1, mag, tmag);
            ok = false;
        }
    }
    cases++;
    if (!ok) fails++;
    printf("attn_block %s: %s\n", what, ok ? "ok" : "FAILED");
}

int main() {
    g_arena = (unsigned char*)mmap(nullptr, g_arena_size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (g_arena == MAP_FAILED) { perror("mmap"); return 1; }
    const Shape small{256, 4, 2, 64}, wide{896, 7, 1, 128};
    unsigned seed = 1;
    // Splits, norm, neox, positions, f32 and f16, at the most useful grid.
    const int splits[][2] = {{1, 1}, {2, 4}, {4, 4}, {8, 2}}, positions[] = {0, 20, 70, 20};
    for (int i = 0; i < 4; i++) check<float>(small, splits[i][0], splits[i][1], i % 2 == 0, i >= 2, positions[i], 24, true, seed++);
    check<u16>(small, 4, 4, true, 0, 20, 24, true, seed++);
    check<u16>(small, 2, 8, false, 1, 70, 32, false, seed++, false);
    // Few blocks: every block takes several tiles and attention items and
    // waits on the others', with and without the O copies ahead.
    for (int grid : {1, 3})
        for (bool pre : {true, false}) check<u16>(small, 4, 2, true, 0, 70, grid, pre, seed++);
    // The wide shape: head_dim 128, 7 query heads over one KV head, d not a
    // multiple of 512.
    check<float>(wide, 4, 4, true, 1, 70, 7, true, seed++);
    check<u16>(wide, 2, 1, true, 0, 20, 64, true, seed++);
    check<u16>(wide, 8, 8, false, 0, 0, 3, false, seed++, false);
    printf("attn_block: %d of %d cases ok (%d bad copies or barrier counts)\n", cases - fails, cases, g_bad.load());
    return fails || g_bad ? 1 : 0;
}
