/* Where a decode step's native call spends its time, phase by phase (bench/micro/
 * chain_timeline.py): built with -DMOX_TIMELINE (native_build.build's `defines`), each phase's
 * TSC cycles on the calling thread add up in mox_timeline until mox_timeline_take reads and
 * clears them; built without it, the marks compile to nothing. The phases are the calling
 * thread's wall time, parallel regions included. */
#ifndef MOX_TIMELINE_H
#define MOX_TIMELINE_H

#include <stdint.h>

enum {
    PHASE_QKV,          /* input norm, q/k/v GEMV (and its bias) */
    PHASE_QK_NORM,
    PHASE_ROPE,         /* rotary and the KV write */
    PHASE_ATTEND,       /* attention over the cached keys */
    PHASE_OUT,          /* o GEMV, residual, post-attention norm */
    PHASE_ROUTER,       /* router GEMV */
    PHASE_ROUTE,        /* softmax, top-k, the residency check, rows sorted by slot */
    PHASE_EXPERTS,      /* mox_moe_experts */
    PHASE_COMBINE,      /* rows summed per token, residual */
    PHASE_TAIL,         /* final norm and lm_head */
    PHASE_CALLS,        /* (a count: mox_decode_layers_bf16 calls) */
    NUM_PHASES
};

#ifdef MOX_TIMELINE
#include <x86intrin.h>
extern uint64_t mox_timeline[NUM_PHASES];
/* a phase's start (once a function), then each mark closes a phase and opens the next */
#define TIMELINE_START uint64_t timeline_t0 = __rdtsc()
#define TIMELINE_MARK(phase)                                                                 \
    do {                                                                                     \
        uint64_t timeline_t = __rdtsc();                                                     \
        mox_timeline[phase] += timeline_t - timeline_t0;                                     \
        timeline_t0 = timeline_t;                                                            \
    } while (0)
#define TIMELINE_COUNT(phase) (mox_timeline[phase]++)
#else
#define TIMELINE_START
#define TIMELINE_MARK(phase)
#define TIMELINE_COUNT(phase)
#endif

#endif
