// The dynamic shared memory and the grid of attend_split_mma, for the
// checks that run it (after split_mma_extract.h and kv_caches.h).
#pragma once
#include <type_traits>
#include <vector>

// The block's dynamic shared memory: the warps' rings (f16: 2 *
// TM_STAGE_HALVES bytes a stage; q8_0: TM_Q8_STAGE_BYTES), at least the
// end's merge (tm_warps * 16 rows of HD + 2 floats), 16-byte aligned,
// every halfword `poison`.
template <class S, int HD> struct Smem {
    static constexpr bool q8 = std::is_same_v<S, Q8>;
    static constexpr size_t ring = (size_t)tm_warps(HD) * tm_stages(HD) *
                                   (q8 ? TM_Q8_STAGE_BYTES(HD) : 2 * TM_STAGE_HALVES(HD));
    static constexpr size_t merge = (size_t)tm_warps(HD) * 16 * (HD + 2) * 4;
    static constexpr size_t bytes = ring > merge ? ring : merge;
    std::vector<uint4> v;
    explicit Smem(u16 poison) : v((bytes + 15) / 16) {
        u16* h = (u16*)v.data();
        for (size_t i = 0; i < v.size() * 8; i++) h[i] = poison;
    }
    u16* data() { return (u16*)v.data(); }
};

// Runs f as every block of an attend_split_mma grid (nx, ny, nz), blocks of
// tm_warps(HD) warps, each with no copy in flight at its start; returns how
// many blocks ended with copies still in flight (a lost stage).
template <int HD, class F> int run_mma_grid(unsigned nx, unsigned ny, unsigned nz, F f) {
    gridDim = dim3_{nx, ny, nz};
    int undrained = 0;
    for (unsigned z = 0; z < nz; z++)
        for (unsigned y = 0; y < ny; y++)
            for (unsigned x = 0; x < nx; x++) {
                cp_async_emu::start_block(tm_warps(HD) * 32);
                run_block(tm_warps(HD) * 32, dim3_{x, y, z}, f);
                undrained += !cp_async_emu::block_drained();
            }
    return undrained;
}
