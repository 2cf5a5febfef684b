// MIRAGE CUDA kernels: the persistent decode kernel (after task_prelude.cu
// and the dense module's files; crates/mirage-cuda/src/persistent.rs builds
// its tables and launches it, crates/mirage-cuda/src/schedule.rs proves its
// schedule free of deadlocks and races).
//
// One launch runs a recorded decode step. The step's launches are its
// stages; every block of a launch is a task, numbered stage by stage. Block
// b of the grid (all of it resident: a cooperative launch) runs tasks b,
// b + G, b + 2G, ... in order; a task waits (in its body's pdl_wait) until
// the counter of every stage it depends on holds generation * tasks of that
// stage, runs the kernel body of its stage as the block it stands for, and
// adds 1 to its own stage's counter (release). Counters are never reset:
// the host passes generation 1, 2, ... to consecutive steps.

// Task kinds: the kernel whose body a stage runs. The numbers are
// persistent.rs's (`TASK_KINDS`, checked by a test against these lines).
#define TK_MV3_Q8S 1
#define TK_MV3_Q8S_GRID 2
#define TK_MV3_Q4KS 3
#define TK_MV3_Q5S 4
#define TK_MV3_Q6KS 5
#define TK_FFN_Q8S 6
#define TK_FFN_Q4KS 7
#define TK_FFN_Q5S 8
#define TK_FFN_Q6KS 9
#define TK_EMBED_Q8S 10
#define TK_EMBED_Q4KS 11
#define TK_EMBED_Q5S 12
#define TK_EMBED_Q6KS 13
#define TK_EMBED_GGML 14
#define TK_RMS_NORM 15
#define TK_ARGMAX 16
#define TK_ATTEND_SPLIT_F16 17
#define TK_ATTEND_SPLIT_ROPE_F16 18
#define TK_ATTEND_COMBINE 19
#define TK_ROPE_STORE_F16 20
#define TK_GATHER_ROWS 21
#define TK_ADD_INPLACE 22
#define TK_ADD_BIAS 23

// Head size of the attention tasks: the module is compiled per model (one
// attention body per kind, so the kernel's static shared memory is one
// instance's, not every head size's).
#ifndef TASK_HEAD_DIM
#define TASK_HEAD_DIM 128
#endif
#define TASK_CAT3(a, b, c) a##b##c
#define TASK_XCAT3(a, b, c) TASK_CAT3(a, b, c)

// Kernel arguments of a stage, each in its own 8-byte slot (as persistent.rs
// writes them from the launch's argument list).
#define TASK_ARGS 24
struct TaskStage {
    unsigned kind, variant, threads, gx, gy, gz;
    unsigned long long a[TASK_ARGS];
};

#define SP(T, i) ((T)a[i])
#define SI(i) ((int)(unsigned)a[i])
#define SL(i) ((long)a[i])
#define SF(i) __uint_as_float((unsigned)a[i])

#define MV3_SLOTS                                                                                                    \
    SP(const u8*, 0), SP(const u8*, 1), SP(const u8*, 2), SI(3), SI(4), SI(5), SL(6), SI(7), SP(const float*, 8),   \
        SP(float*, 9), SP(float*, 10), SP(float*, 11), SF(12), SF(13), SF(14), SP(const float*, 15),                \
        SP(const float*, 16), SP(const float*, 17), SP(float*, 18), SP(const float*, 19), SP(const float*, 20),     \
        SF(21), SP(float*, 22)
#define FFN_SLOTS                                                                                                    \
    SP(const u8*, 0), SP(const u8*, 1), SI(2), SL(3), SI(4), SP(const float*, 5), SP(float*, 6), SF(7), SF(8),      \
        SP(const float*, 9), SP(const float*, 10), SF(11), SP(float*, 12)
#define EMBED_SLOTS SP(const u8*, 0), SI(1), SI(2), SP(const u32*, 3), SP(float*, 4)
#define EMBED_GGML_SLOTS SP(const u8*, 0), SL(1), SI(2), SI(3), SP(const u32*, 4), SP(float*, 5)

// One function per task kind, not inlined into the loop: each is compiled
// (and register-allocated) on its own, as its kernel is, rather than as one
// function holding every body.
#define TASK_FN(NAME) __device__ __noinline__ void NAME(const unsigned long long* a, unsigned variant)

TASK_FN(task_mv3_q8s) { mv3_body_q8_0s(variant, MV3_SLOTS); }
TASK_FN(task_mv3_q8s_grid) { mv3_body_q8_0s_grid(variant, MV3_SLOTS); }
TASK_FN(task_mv3_q4ks) { mv3_body_q4_ks(variant, MV3_SLOTS); }
TASK_FN(task_mv3_q5s) { mv3_body_q5_0s(variant, MV3_SLOTS); }
TASK_FN(task_mv3_q6ks) { mv3_body_q6_ks(variant, MV3_SLOTS); }
TASK_FN(task_ffn_q8s) { ffn_body_q8_0s(FFN_SLOTS); }
TASK_FN(task_ffn_q4ks) { ffn_body_q4_ks(FFN_SLOTS); }
TASK_FN(task_ffn_q5s) { ffn_body_q5_0s(FFN_SLOTS); }
TASK_FN(task_ffn_q6ks) { ffn_body_q6_ks(FFN_SLOTS); }
TASK_FN(task_embed_q8s) { embed_body_q8_0s(EMBED_SLOTS); }
TASK_FN(task_embed_q4ks) { embed_body_q4_ks(EMBED_SLOTS); }
TASK_FN(task_embed_q5s) { embed_body_q5_0s(EMBED_SLOTS); }
TASK_FN(task_embed_q6ks) { embed_body_q6_ks(EMBED_SLOTS); }
// The ggml-layout embedding tables a task reads (type ids of GGML_TYPES).
#define TASK_EMBED_GGML(T, S, ID, B, E)                                                                             \
    case ID: embed_body_##S(EMBED_GGML_SLOTS); break;
TASK_FN(task_embed_ggml) {
    switch (variant) { GGML_TYPES(TASK_EMBED_GGML) }
}
TASK_FN(task_rms_norm) { rms_norm_body(SP(const float*, 0), SP(const float*, 1), SF(2), SI(3), SP(float*, 4)); }
TASK_FN(task_argmax) { argmax_rows_body(SP(const float*, 0), SI(1), SP(u32*, 2)); }
TASK_FN(task_attend_split) {
    TASK_XCAT3(attend_split_body_f16_d, TASK_HEAD_DIM, )(SP(const float*, 0), SP(const u16*, 1), SP(const u16*, 2),
                                                        SP(const int*, 3), SI(4), SI(5), SI(6), SI(7), SF(8),
                                                        SP(float*, 9));
}
TASK_FN(task_attend_split_rope) {
    TASK_XCAT3(attend_split_rope_body_f16_d, TASK_HEAD_DIM, )(SP(const float*, 0), SP(u16*, 1), SP(u16*, 2),
                                                             SP(const int*, 3), SI(4), SI(5), SI(6), SI(7), SF(8),
                                                             SP(float*, 9), SP(const float*, 10),
                                                             SP(const float*, 11), SI(12), SF(13));
}
TASK_FN(task_gather_rows) { gather_rows_body(SP(const float*, 0), SP(const u32*, 1), SI(2), SP(float*, 3)); }
TASK_FN(task_add_inplace) { add_inplace_body(SP(float*, 0), SP(const float*, 1), SL(2)); }
TASK_FN(task_add_bias) { add_bias_body(SP(float*, 0), SP(const float*, 1), SI(2), SL(3)); }
// attend_combine's and rope_store_f16's wrappers: PDL_ENTRY, then the body.
TASK_FN(task_attend_combine) {
    PDL_ENTRY();
    attend_combine_body(SP(const float*, 0), SP(const int*, 1), SI(2), SI(3), SI(4), SI(5), SI(6), SI(7), SI(8),
                        SP(float*, 9));
}
TASK_FN(task_rope_store) {
    PDL_ENTRY();
    rope_store<u16>(SP(float*, 0), SP(float*, 1), SP(const float*, 2), SP(const int*, 3), SI(4), SI(5), SI(6), SI(7),
                    SF(8), SP(const float*, 9), SP(const float*, 10), SF(11), SP(u16*, 12), SP(u16*, 13), SI(14));
}

// Runs one task: the body of its stage's kernel, as the block task_ctx
// names. A kind the module lacks runs nothing (the host builds stages only
// of the kinds in its table; the missing wait is then reported as
// TASK_NO_WAIT).
__device__ __forceinline__ void task_run(const TaskStage* st) {
    const unsigned long long* a = st->a;
    const unsigned v = st->variant;
    switch (st->kind) {
        case TK_MV3_Q8S: task_mv3_q8s(a, v); break;
        case TK_MV3_Q8S_GRID: task_mv3_q8s_grid(a, v); break;
        case TK_MV3_Q4KS: task_mv3_q4ks(a, v); break;
        case TK_MV3_Q5S: task_mv3_q5s(a, v); break;
        case TK_MV3_Q6KS: task_mv3_q6ks(a, v); break;
        case TK_FFN_Q8S: task_ffn_q8s(a, v); break;
        case TK_FFN_Q4KS: task_ffn_q4ks(a, v); break;
        case TK_FFN_Q5S: task_ffn_q5s(a, v); break;
        case TK_FFN_Q6KS: task_ffn_q6ks(a, v); break;
        case TK_EMBED_Q8S: task_embed_q8s(a, v); break;
        case TK_EMBED_Q4KS: task_embed_q4ks(a, v); break;
        case TK_EMBED_Q5S: task_embed_q5s(a, v); break;
        case TK_EMBED_Q6KS: task_embed_q6ks(a, v); break;
        case TK_EMBED_GGML: task_embed_ggml(a, v); break;
        case TK_RMS_NORM: task_rms_norm(a, v); break;
        case TK_ARGMAX: task_argmax(a, v); break;
        case TK_ATTEND_SPLIT_F16: task_attend_split(a, v); break;
        case TK_ATTEND_SPLIT_ROPE_F16: task_attend_split_rope(a, v); break;
        case TK_ATTEND_COMBINE: task_attend_combine(a, v); break;
        case TK_ROPE_STORE_F16: task_rope_store(a, v); break;
        case TK_GATHER_ROWS: task_gather_rows(a, v); break;
        case TK_ADD_INPLACE: task_add_inplace(a, v); break;
        case TK_ADD_BIAS: task_add_bias(a, v); break;
        default: break;
    }
}

// Two blocks an SM (128 registers a thread), as the mat-vec kernels run
// (100 registers, two of their blocks an SM): one block of 8 warps leaves
// too few loads in flight to stream weights at the copy rate.
// tasks[t] = (stage, index of the task within its stage, first wait, end of
// waits); waits[i] = (stage, its task count); counters[s]: tasks of stage s
// done since the counters were allocated; status: TASK_* and where.
extern "C" __global__ void __launch_bounds__(TASK_THREADS, 2)
    decode_persistent(const uint4* tasks, unsigned n_tasks, const uint2* waits, const TaskStage* stages,
                      unsigned* counters, unsigned generation, unsigned long long timeout_ns, unsigned* status) {
    if (threadIdx.x == 0) task_ctx.abort = 0;
    const unsigned long long deadline = task_clock_ns() + timeout_ns;
    for (unsigned t = hw_block_x(); t < n_tasks; t += hw_grid_x()) {
        const uint4 tk = tasks[t];
        const TaskStage* st = stages + tk.x;
        hw_sync();  // every thread is done with the previous task's context
        if (threadIdx.x == 0) {
            const unsigned i = tk.y, gx = st->gx, gy = st->gy;
            task_ctx.block = make_uint3(i % gx, (i / gx) % gy, i / (gx * gy));
            task_ctx.grid = make_uint3(gx, gy, st->gz);
            task_ctx.dim = make_uint3(st->threads, 1, 1);
            task_ctx.counters = counters;
            task_ctx.waits = waits;
            task_ctx.wait_begin = tk.z;
            task_ctx.wait_end = tk.w;
            task_ctx.generation = generation;
            task_ctx.task = t;
            task_ctx.stage = tk.x;
            task_ctx.deadline_ns = deadline;
            task_ctx.status = status;
            task_ctx.waited = 0;
        }
        hw_sync();
        if (threadIdx.x < task_ctx.dim.x) task_run(st);
        hw_sync();  // the task's writes are done (and ordered before the release)
        const int abort = task_ctx.abort;
        if (threadIdx.x == 0 && !abort) {
            if (!task_ctx.waited && atomicCAS(status, TASK_OK, TASK_NO_WAIT) == TASK_OK) {
                status[1] = t;
                status[2] = tk.x;
            }
            __threadfence();
            task_counter_release_add(counters + tk.x, 1u);
        }
        if (abort) return;
    }
}
