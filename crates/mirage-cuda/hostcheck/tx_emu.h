// Stand-ins for the copy engine (sm_90 TMA) the kernels drive through
// nvfp4.cu's sb_tx_* and sb_bulk_g2s, for the host checks that run such
// kernels as emulated blocks (check_ffn_p2t.cpp, check_attn_block.cpp). The
// check defines, before including this, `g_bad` (an std::atomic<int> of
// failures) and `tx_src_ok(src, bytes)`: whether a copy may read there.
// A bad copy (misaligned, not a 16-byte multiple, outside what the kernel
// may read) or a barrier that gets more bytes than it expects counts as a
// failure; a barrier that never completes aborts after 5 s.
#pragma once
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>

// Transaction barrier stand-ins. The 8 bytes hold the bytes still expected
// (low 32 bits, signed) and the completed phases (high 32 bits). Only
// thread 0 arrives and copies (as in the kernel); the waits spin.
static std::atomic_ref<long long> bar_ref(unsigned long long* bar) { return std::atomic_ref<long long>(*(long long*)bar); }
static void bar_add(unsigned long long* bar, long long bytes) {
    // pending += bytes; when it reaches 0 the phase completes.
    auto a = bar_ref(bar);
    long long v = a.load(), nv;
    do {
        int pending = (int)(v & 0xffffffff);
        long long phase = v >> 32;
        pending += (int)bytes;
        if (pending < 0) {
            printf("  a barrier got more bytes than it was told to expect\n");
            g_bad++;
            pending = 0;
        }
        if (pending == 0) phase++;
        nv = (phase << 32) | (unsigned)pending;
    } while (!a.compare_exchange_weak(v, nv));
}
void sb_tx_init(unsigned long long* bar) { bar_ref(bar).store(0); }
void sb_tx_init_fence() {}
void sb_tx_expect(unsigned long long* bar, sb_u32 bytes) {
    if (bytes == 0) bar_add(bar, 0);  // the arrival alone completes the phase
    else bar_ref(bar).fetch_add(bytes);
}
void sb_bulk_g2s(void* dst, const void* src, sb_u32 bytes, unsigned long long* bar) {
    const unsigned char* s = (const unsigned char*)src;
    if (bytes == 0 || bytes % 16 || (uintptr_t)dst % 16 || (uintptr_t)src % 16 || !tx_src_ok(s, bytes)) {
        printf("  bad bulk copy: %u bytes from %p to %p\n", bytes, src, dst);
        g_bad++;
        return;
    }
    memcpy(dst, src, bytes);
    bar_add(bar, -(long long)bytes);
}
void sb_tx_wait(unsigned long long* bar, sb_u32 parity) {
    const auto t0 = std::chrono::steady_clock::now();
    while ((((unsigned long long)bar_ref(bar).load() >> 32) & 1u) == parity) {
        if (std::chrono::steady_clock::now() - t0 > std::chrono::seconds(5)) {
            printf("  a transaction barrier never completed (fewer bytes copied than expected)\n");
            g_bad++;
            abort();
        }
        std::this_thread::yield();
    }
}

