// Host stand-ins for the asynchronous global -> shared copies mmq.cu and
// attention_mma.cu issue (cp.async.{cg,ca}.shared.global of 16, 8 or 4
// bytes, commit_group, wait_group), on the fibers of block_emu.h. Two
// timings, so that a check sees both kinds of race:
//   Eager    : the copy lands when it is issued. A copy into a buffer that
//              another warp may still be reading (no barrier between its
//              reads and the issue) overwrites data the reader then takes.
//   Deferred : a thread's copies land only when its own wait_group retires
//              their group (the latest moment the PTX ISA allows). A read
//              of a stage before its wait (and the barrier after it) sees
//              what the buffer held before.
// The source bytes are taken at issue in both (global memory is not written
// during a product).
#pragma once
#include <cstring>
#include <vector>

#include "block_emu.h"

namespace cp_async_emu {
enum Mode { Eager, Deferred };
inline Mode mode = Eager;
struct Copy {
    unsigned char* dst;
    unsigned char bytes[16];
    int n;
};
// Per thread: its committed groups (oldest first) and the open one.
inline std::vector<std::vector<std::vector<Copy>>> groups;
inline std::vector<std::vector<Copy>> open;
inline long copies_issued = 0, copies_landed = 0;

// Before a block runs: no thread has anything in flight.
inline void start_block(int threads) {
    groups.assign(threads, {});
    open.assign(threads, {});
}
// After a block ran: every copy it issued has landed (a group still in
// flight at exit would be a lost stage); returns false otherwise.
inline bool block_drained() {
    for (auto& g : groups)
        for (auto& c : g)
            if (!c.empty()) return false;
    for (auto& o : open)
        if (!o.empty()) return false;
    return true;
}
inline void land(std::vector<Copy>& g) {
    for (auto& c : g) {
        memcpy(c.dst, c.bytes, c.n);
        copies_landed++;
    }
    g.clear();
}
inline void issue(void* dst, const void* src, int n) {
    Copy c{(unsigned char*)dst, {}, n};
    memcpy(c.bytes, src, n);
    copies_issued++;
    if (mode == Eager) {
        memcpy(c.dst, c.bytes, n);
        copies_landed++;
    } else {
        open[threadIdx.x].push_back(c);
    }
}
}  // namespace cp_async_emu

inline size_t __cvta_generic_to_shared(const void* p) { return (size_t)p; }
inline void cp_async16(void* dst, const void* src) {
    if (((size_t)dst | (size_t)src) & 15) {
        fprintf(stderr, "cp.async 16: misaligned address\n");
        abort();
    }
    cp_async_emu::issue(dst, src, 16);
}
inline void cp_async8(void* dst, const void* src) {
    if (((size_t)dst | (size_t)src) & 7) {
        fprintf(stderr, "cp.async 8: misaligned address\n");
        abort();
    }
    cp_async_emu::issue(dst, src, 8);
}
inline void cp_async4(void* dst, const void* src) {
    if (((size_t)dst | (size_t)src) & 3) {
        fprintf(stderr, "cp.async 4: misaligned address\n");
        abort();
    }
    cp_async_emu::issue(dst, src, 4);
}
inline void cp_async_commit() {
    using namespace cp_async_emu;
    groups[threadIdx.x].push_back(std::move(open[threadIdx.x]));
    open[threadIdx.x].clear();
}
// Every group of this thread but the N most recent ones lands. (Copies not
// yet committed are not waited for, as on the GPU.)
template <int N> inline void cp_async_wait() {
    auto& g = cp_async_emu::groups[threadIdx.x];
    while ((int)g.size() > N) {
        cp_async_emu::land(g.front());
        g.erase(g.begin());
    }
}
