// MIRAGE CUDA kernels: the prelude of the persistent decode module
// (crates/mirage-cuda/src/persistent.rs). This file comes first, then the
// dense module's files unchanged (pdl.cu ... matvec_split.cu), then
// persistent.cu, whose one kernel runs a whole decode step: each block works
// through its share of the step's task list, a task being one block of one
// of the step's kernels, run by that kernel's own body (`*_body`).
//
// What makes a kernel body a task, without touching its code:
//   - blockIdx, gridDim and blockDim name the task's (the block of the
//     original launch it stands for), kept in shared memory by the loop;
//   - __syncthreads() is a named barrier over the task's threads only (a
//     task of 128 threads runs on threads 0..127 of the 256; the others
//     wait at the loop's own barrier, bar 0);
//   - pdl_wait() (pdl.cu, every body calls it before it reads what another
//     kernel wrote) waits on the counters of the tasks this one depends on,
//     so a body's weight prefetch, issued before it, overlaps that wait;
//   - __restrict__ is dropped: within one launch, data another block wrote
//     must not come through the non-coherent load path the compiler may
//     pick for const __restrict__ pointers. Weights still load through
//     __ldg (constant for the whole launch).
#define MIRAGE_TASK_LOOP 1

// Threads of a persistent block: the widest task (mat-vecs, norms: 256).
#define TASK_THREADS 256

// The hardware's names, taken before they are redirected below.
__device__ __forceinline__ unsigned hw_block_x() { return blockIdx.x; }
__device__ __forceinline__ unsigned hw_grid_x() { return gridDim.x; }
__device__ __forceinline__ void hw_sync() { __syncthreads(); }

// Why a persistent launch stopped early (status[0]; status[1] the task,
// status[2] its stage, status[3] the stage waited on).
#define TASK_OK 0u
#define TASK_TIMEOUT 1u     // a dependency was not met within the timeout
#define TASK_NO_WAIT 2u     // a task body returned without waiting (a kernel without PDL_ENTRY)

// The task the block is running (thread 0 writes it between two hw_sync).
struct TaskContext {
    uint3 block, grid, dim;
    const unsigned* counters;
    const uint2* waits;  // (stage, its tasks) per wait
    unsigned wait_begin, wait_end, generation, task, stage;
    unsigned long long deadline_ns;
    unsigned* status;
    int waited, abort;
};
__shared__ TaskContext task_ctx;

__device__ __forceinline__ unsigned long long task_clock_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
// Acquire: the loads after it see every write released before the count.
__device__ __forceinline__ unsigned task_counter_acquire(const unsigned* c) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(c) : "memory");
    return v;
}
__device__ __forceinline__ unsigned task_status_relaxed(const unsigned* c) {
    unsigned v;
    asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(c) : "memory");
    return v;
}
// Release: every write of the block (ordered before it by the barrier and
// the fence) is visible to whoever acquires the new count.
__device__ __forceinline__ void task_counter_release_add(unsigned* c, unsigned v) {
    asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(c), "r"(v) : "memory");
}
// Counters only grow (no reset between steps): stage s's counter has
// reached generation * tasks(s) when the wrapped difference is >= 0 (one
// step in flight at a time, so it is never 2^31 behind).
__device__ __forceinline__ bool task_counter_reached(unsigned v, unsigned target) { return (int)(v - target) >= 0; }

// The barrier of the task's threads (bar 1; the loop's is bar 0).
__device__ __forceinline__ void task_sync() {
    asm volatile("bar.sync 1, %0;" ::"r"(task_ctx.dim.x) : "memory");
}

// pdl_wait() of a task: thread 0 spins on each dependency's counter
// (acquire), giving up when another block reported a failure or the
// launch's deadline passed (the step then ends with status[0] set and the
// host reports it); then the task's threads meet, so all of them read after
// the acquire.
__device__ __noinline__ void task_wait_dependencies() {
    if (threadIdx.x == 0) {
        task_ctx.waited = 1;
        for (unsigned i = task_ctx.wait_begin; i < task_ctx.wait_end && !task_ctx.abort; i++) {
            const uint2 w = task_ctx.waits[i];
            const unsigned target = task_ctx.generation * w.y;
            const unsigned* c = task_ctx.counters + w.x;
            while (!task_counter_reached(task_counter_acquire(c), target)) {
                if (task_status_relaxed(task_ctx.status) != TASK_OK) {
                    task_ctx.abort = 1;
                    break;
                }
                if (task_clock_ns() > task_ctx.deadline_ns) {
                    if (atomicCAS(task_ctx.status, TASK_OK, TASK_TIMEOUT) == TASK_OK) {
                        task_ctx.status[1] = task_ctx.task;
                        task_ctx.status[2] = task_ctx.stage;
                        task_ctx.status[3] = w.x;
                    }
                    task_ctx.abort = 1;
                    break;
                }
            }
        }
    }
    task_sync();
}

#define blockIdx task_ctx.block
#define gridDim task_ctx.grid
#define blockDim task_ctx.dim
#define __syncthreads() task_sync()
#define __restrict__
