// Host check of the persistent decode kernel's task loop (no GPU):
// decode_persistent and task_wait_dependencies cut out of cuda/persistent.cu
// and cuda/task_prelude.cu (extract.py -> persistent_extract.h) and run on a
// whole grid of emulated blocks at once, every CUDA thread a fiber on one
// OS thread, the next fiber to run drawn at random (seeded) at every
// barrier, spin and task step. The hardware pieces are emulated:
// bar.sync 0 (hw_sync) and the named task barrier (bar.sync 1, threads) per
// block, the counters' acquire loads and release adds as C++ atomics, the
// global timer as the steady clock, blockIdx/gridDim/blockDim as the task's.
// The tasks are toy bodies that call pdl_wait() first, as every kernel body
// does, then check that every stage they wait on has stamped all its tasks
// with this step's generation, and stamp their own slot once (from their
// last thread, so the loop's barrier before the release is what orders it).
//
// Checked: over several steps without resetting the counters, on grids of
// 1 to 7 blocks, every task runs exactly once per step, after all it
// depends on, and the counters end at steps * tasks; a task body that does
// not wait is reported (TASK_NO_WAIT, with its stage); a dependency that is
// never met ends the launch with TASK_TIMEOUT naming the stage and the one
// it waited on, every block returning instead of hanging.
// Build and run: hostcheck/run.sh.
#include <ucontext.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

struct uint2 { unsigned x, y; };
struct uint3 { unsigned x, y, z; };
struct uint4 { unsigned x, y, z, w; };
inline uint3 make_uint3(unsigned x, unsigned y, unsigned z) { return {x, y, z}; }
#define __device__
#define __forceinline__ inline
#define __noinline__
#define TASK_ARGS 24
#define TASK_THREADS 64

struct TaskContext;
namespace grid {
struct Fiber {
    ucontext_t ctx;
    char* stack;
    unsigned block;
    uint3 tid;
    bool done;
};
struct Barrier {
    int count = 0;
    unsigned gen = 0;
};
inline ucontext_t sched;
inline std::vector<Fiber> fibers;
inline int cur;
inline unsigned n_blocks;
inline std::vector<Barrier> bar0, bar1;
inline std::mt19937_64 rng;
inline void (*kernel)();
inline Fiber& self() { return fibers[cur]; }
inline void yield() { swapcontext(&fibers[cur].ctx, &sched); }
// A barrier of `need` threads of the calling thread's block.
inline void wait(Barrier& b, int need) {
    const unsigned g = b.gen;
    if (++b.count == need) {
        b.count = 0;
        b.gen++;
        return;
    }
    while (b.gen == g) yield();
}
inline void entry() {
    kernel();
    fibers[cur].done = true;
}
}  // namespace grid

#define threadIdx (grid::self().tid)
inline unsigned hw_block_x() { return grid::self().block; }
inline unsigned hw_grid_x() { return grid::n_blocks; }
inline void hw_sync() { grid::wait(grid::bar0[grid::self().block], TASK_THREADS); }
inline unsigned long long task_clock_ns() {
    return (unsigned long long)std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
}
inline unsigned task_counter_acquire(const unsigned* c) {
    grid::yield();  // a spinning thread lets the others run
    return __atomic_load_n(c, __ATOMIC_ACQUIRE);
}
inline unsigned task_status_relaxed(const unsigned* c) { return __atomic_load_n(c, __ATOMIC_RELAXED); }
inline void task_counter_release_add(unsigned* c, unsigned v) { __atomic_fetch_add(c, v, __ATOMIC_RELEASE); }
inline unsigned atomicCAS(unsigned* p, unsigned cmp, unsigned val) {
    __atomic_compare_exchange_n(p, &cmp, val, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
    return cmp;
}
inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }

// The per-block shared context: task_ctx of the running thread's block.
struct TaskContext;
extern std::vector<TaskContext> contexts;
#define task_ctx (contexts[grid::self().block])
inline void task_sync();
void task_wait_dependencies();
struct TaskStage;
void task_run(const TaskStage* st);

#include "persistent_extract.h"

std::vector<TaskContext> contexts;
inline void task_sync() { grid::wait(grid::bar1[grid::self().block], (int)task_ctx.dim.x); }
inline void pdl_wait() { task_wait_dependencies(); }
// The task's index within its stage, from its block in the stage's grid.
inline unsigned blockIdx_x_of(const TaskContext& c) {
    return c.block.x + c.grid.x * (c.block.y + c.grid.y * c.block.z);
}

// Toy bodies. a[0]: this stage's stamps (one per task, the generation that
// last ran it); a[1]: number of stages checked; a[2 + 2k], a[3 + 2k]: their
// stamps and task counts. variant 1: the body skips pdl_wait().
static int violations = 0;
void task_run(const TaskStage* st) {
    if (st->variant != 1) pdl_wait();
    const unsigned gen = task_ctx.generation;
    const unsigned i = blockIdx_x_of(task_ctx);
    if (threadIdx.x == 0 && !task_ctx.abort) {
        for (unsigned k = 0; k < st->a[1]; k++) {
            const unsigned* dep = (const unsigned*)st->a[2 + 2 * k];
            for (unsigned j = 0; j < st->a[3 + 2 * k]; j++)
                if (dep[j] != gen) violations++;
        }
    }
    for (int r = (int)(grid::rng() % 3); r > 0; r--) grid::yield();
    task_sync();
    // The task's last thread stamps it (not thread 0, which releases the
    // counter: the loop's barrier must order this write before that).
    for (int r = (int)(grid::rng() % 3); r > 0; r--) grid::yield();
    if (threadIdx.x == task_ctx.dim.x - 1) {
        unsigned* own = (unsigned*)st->a[0];
        if (own[i] == gen) violations++;  // ran twice in one step
        own[i] = gen;
    }
}

struct Stage {
    unsigned tasks, threads, gx, gy;
    std::vector<unsigned> waits;  // stages
    unsigned variant = 0;
};

struct Result {
    unsigned status[4];
    std::vector<std::vector<unsigned>> stamps;
    std::vector<unsigned> counters;
};

// Runs `steps` launches of the schedule of `stages` on `blocks` blocks.
// inflate: a stage whose first wait expects one task more than it has.
static Result run(const std::vector<Stage>& stages, unsigned blocks, unsigned steps, unsigned long long seed,
                  int inflate = -1, unsigned long long timeout_ns = 2000000000ull) {
    Result res{};
    res.stamps.resize(stages.size());
    for (size_t s = 0; s < stages.size(); s++) res.stamps[s].assign(stages[s].tasks, 0);
    res.counters.assign(stages.size(), 0);
    std::vector<uint4> tasks;
    std::vector<uint2> waits;
    std::vector<TaskStage> table(stages.size());
    for (size_t s = 0; s < stages.size(); s++) {
        const Stage& g = stages[s];
        const unsigned w0 = (unsigned)waits.size();
        for (unsigned w : g.waits) waits.push_back({w, stages[w].tasks + ((int)s == inflate && w == g.waits[0])});
        for (unsigned i = 0; i < g.tasks; i++) tasks.push_back({(unsigned)s, i, w0, (unsigned)waits.size()});
        TaskStage& t = table[s];
        t.kind = 1;
        t.variant = g.variant;
        t.threads = g.threads;
        t.gx = g.gx;
        t.gy = g.gy;
        t.gz = g.tasks / (g.gx * g.gy);
        t.a[0] = (unsigned long long)res.stamps[s].data();
        t.a[1] = g.waits.size();
        for (size_t k = 0; k < g.waits.size(); k++) {
            t.a[2 + 2 * k] = (unsigned long long)res.stamps[g.waits[k]].data();
            t.a[3 + 2 * k] = stages[g.waits[k]].tasks;
        }
    }
    if (waits.empty()) waits.push_back({0, 0});
    grid::rng.seed(seed);
    for (unsigned gen = 1; gen <= steps; gen++) {
        grid::n_blocks = blocks;
        grid::bar0.assign(blocks, {});
        grid::bar1.assign(blocks, {});
        contexts.assign(blocks, TaskContext{});
        grid::fibers.assign(blocks * TASK_THREADS, {});
        static const uint4* tp;
        static const uint2* wp;
        static const TaskStage* sp;
        static unsigned n, g;
        static unsigned long long tmo;
        static unsigned* cp;
        static unsigned* stp;
        tp = tasks.data(), wp = waits.data(), sp = table.data(), n = (unsigned)tasks.size(), g = gen;
        tmo = timeout_ns, cp = res.counters.data(), stp = res.status;
        grid::kernel = [] { decode_persistent(tp, n, wp, sp, cp, g, tmo, stp); };
        for (unsigned f = 0; f < grid::fibers.size(); f++) {
            grid::Fiber& x = grid::fibers[f];
            x.block = f / TASK_THREADS;
            x.tid = {f % TASK_THREADS, 0, 0};
            x.stack = (char*)malloc(64 << 10);
            getcontext(&x.ctx);
            x.ctx.uc_stack.ss_sp = x.stack;
            x.ctx.uc_stack.ss_size = 64 << 10;
            x.ctx.uc_link = &grid::sched;
            makecontext(&x.ctx, grid::entry, 0);
        }
        for (;;) {
            std::vector<int> live;
            for (int f = 0; f < (int)grid::fibers.size(); f++)
                if (!grid::fibers[f].done) live.push_back(f);
            if (live.empty()) break;
            grid::cur = live[grid::rng() % live.size()];
            swapcontext(&grid::sched, &grid::fibers[grid::cur].ctx);
        }
        for (auto& x : grid::fibers) free(x.stack);
        if (res.status[0] != TASK_OK) break;
    }
    return res;
}

static int failures = 0;
#define CHECK(c, ...)                                 \
    do {                                              \
        if (!(c)) {                                   \
            fprintf(stderr, "FAIL %s: ", #c);         \
            fprintf(stderr, __VA_ARGS__);             \
            fprintf(stderr, "\n");                    \
            failures++;                               \
        }                                             \
    } while (0)

int main() {
    // A layer-like chain: an embedding, Q/K/V row groups, attention (3 x 3
    // tasks of 32 threads), its combine, O, and a stage that waits on two.
    const std::vector<Stage> stages = {
        {1, 64, 1, 1, {}},      {6, 64, 6, 1, {0}},     {9, 32, 3, 3, {1}},
        {3, 32, 3, 1, {2}},     {5, 64, 5, 1, {3, 1}},  {1, 64, 1, 1, {4}},
    };
    unsigned total = 0;
    for (auto& s : stages) total += s.tasks;
    for (unsigned blocks : {1u, 2u, 3u, 7u}) {
        for (unsigned long long seed : {1ull, 2ull, 3ull}) {
            violations = 0;
            Result r = run(stages, blocks, 3, seed);
            CHECK(r.status[0] == TASK_OK, "blocks %u seed %llu: status %u", blocks, seed, r.status[0]);
            CHECK(violations == 0, "blocks %u seed %llu: %d tasks ran early or twice", blocks, seed, violations);
            for (size_t s = 0; s < stages.size(); s++) {
                CHECK(r.counters[s] == 3 * stages[s].tasks, "counter %zu: %u", s, r.counters[s]);
                for (unsigned v : r.stamps[s]) CHECK(v == 3, "stage %zu stamp %u", s, v);
            }
        }
    }
    // A body that does not wait is reported with its stage.
    std::vector<Stage> no_wait = stages;
    no_wait[3].variant = 1;
    violations = 0;
    Result r = run(no_wait, 3, 1, 5);
    CHECK(r.status[0] == TASK_NO_WAIT && r.status[2] == 3, "no-wait status %u stage %u", r.status[0], r.status[2]);
    // A dependency never met: the launch ends, naming the stages.
    violations = 0;
    const auto t0 = std::chrono::steady_clock::now();
    r = run(stages, 3, 1, 6, 4, 500000000ull);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    CHECK(r.status[0] == TASK_TIMEOUT && r.status[2] == 4 && r.status[3] == 3,
          "timeout status %u stage %u waited on %u", r.status[0], r.status[2], r.status[3]);
    CHECK(s < 5.0, "the stalled launch took %.1f s to end", s);
    if (failures) {
        fprintf(stderr, "check_persistent: %d failures\n", failures);
        return 1;
    }
    printf("check_persistent: %u tasks x 3 steps on 1-7 blocks in order; no-wait and timeout reported\n", total);
    return 0;
}
