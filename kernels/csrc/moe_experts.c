/* The gated experts of one MoE layer for decode, over bf16, int8, int4, MXFP4 or FP8 slot
 * pools: each weight row read once, in place, in memory order, so an expert costs its stored
 * bytes. bf16 pools use the GEMVs' inner loops (rows.h). Integer pools (int8, int4, MXFP4)
 * meet activations quantized here to int8 in blocks of 64 (one float scale each, as
 * llama.cpp's Q8 activations): one AVX512-VNNI instruction multiplies 64 weight bytes by 64
 * activation bytes, where widening the weights to bf16 took six instructions per 32 and left
 * decode compute-bound. VPDPBUSD takes unsigned bytes on one side: int8 weights are flipped
 * to w + 128, int4 nibbles are stored as v + 8, MXFP4 codes looked up as 2v + 12
 * (quant_rows.h), and the offset times the activations' block sums is subtracted once per
 * row; CPUs with AVX2 but not VNNI take two instructions for it (quant_rows.h's
 * block_dot_avx2). FP8 weights are widened in registers (to bf16 for AVX512-BF16, through
 * F16C to float32 for AVX2: fp8_rows.h) and meet the bf16 activations. Built with
 * every csrc/*.c into one library (mox/kernels/native.py); the plain-C paths compute the same
 * sums everywhere.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx_tiles.h"
#include "bf16.h"
#include "rows.h"
#include "int4_span_rows.h"
#include "quant_rows.h"
#include "fp8_rows.h"
#include "vexp.h"
#include "exported.h"

/* How the threads share a call's experts. While many experts remain, each thread takes a
 * contiguous run of them (static) and computes each one alone: its gate rows, up rows,
 * activations and down rows, three runs of 1 MiB for a bench expert that the prefetchers follow
 * at the memory's full rate, with no barrier (an expert's down rows read only its own
 * activations). The active slots come in order and are mostly adjacent, so a thread's gate and
 * up rows run on from one expert into the next, as do its down rows; claimed one at a time, the
 * threads took alternate experts and each stream started over at every expert. In the VM's fast
 * spells (~70-75 GB/s) a MoE layer at 32 tokens read 1.04x faster with the runs, the same in
 * slow ones (bench/micro/expert_spells.py, 268 and 535 rounds; an ad-hoc loop before it, twice:
 * 1.04x and 1.04x fast, 1.00x and 1.01x slow). The last TAIL_PER_THREAD experts per thread are
 * shared finely, CHUNK_ROWS weight rows a claim (whole QBLOCKs) in two passes with a barrier
 * between them, so the threads finish together: on a VM the two rarely get equal shares of the
 * memory bus. This VM's memory (AMD EPYC Zen 4, two threads) streams at ~31 GB/s for minutes,
 * then 45-56 for a while: against a GEMV stream timed the moment before
 * (bench/micro/moe_stream.py --base 1af951e, two runs), 128-row claims throughout (one barrier
 * a call) read experts at 0.92-0.98x the stream's rate at 8 and 32 tokens in the slow spells
 * and 0.70-0.74x in the fast ones, whole experts at 0.94-1.01x and 0.80-0.82x. The tail's
 * claims are handed out guided, not one at a time: a thread's first claim is half of what is
 * left over the threads, then the claims shrink, so each thread reads long runs of adjacent
 * chunks and the last small claims still even out the finish. One chunk at a claim had the two
 * threads alternating 128 KiB runs through the same rows: in a fast spell (the GEMV over the
 * same bytes at 64-72 GB/s) four bench experts for one token read at 48 GB/s that way and 60-64
 * guided, static, or as whole experts (alternated builds). A claim holds CHUNK_ROWS bf16 rows'
 * bytes: 2x the rows for the 8-bit formats, 4x for the 4-bit ones (int4's 64-row claims were 32
 * KiB runs of gate rows, read at 0.83-0.91x the rate of 256-row claims over experts preset
 * shapes, one and two experts a call). */
#define CHUNK_ROWS 64
#define TAIL_PER_THREAD 2

int mox_has_avx512vnni(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw");
}

/* mox_has_avx512vnni, asked once (mox_moe_experts sets it before its threads start) rather
 * than for every weight row */
static int has_vnni = -1;

/* the scales of row n: its part's block of rows (per-row scales, as int8, int4 and MXFP4
 * have, skip the divisions: a few per weight row, against ~250 cycles of reading an int8
 * row of 1,024 values) */
static inline const float *row_scales(pool_t p, int64_t s, int64_t n, int64_t K) {
    int64_t per_row = p.group ? K / p.group : 1;
    if (p.block_rows == 1)
        return p.scale + s * p.scale_stride + n * per_row;
    int64_t blocks = (p.part_rows + p.block_rows - 1) / p.block_rows;
    int64_t block = (n / p.part_rows) * blocks + (n % p.part_rows) / p.block_rows;
    return p.scale + s * p.scale_stride + block * per_row;
}

static inline float bias_at(const uint16_t *b, int64_t stride, int64_t s, int64_t i) {
    return b ? bf16_to_f32(b[s * stride + i]) : 0.0f;
}

static inline float activate(const gating_t *g, float gate, float up) {
    if (!g->clamped)
        return gate / (1.0f + expf(-gate)) * up;
    gate = fminf(gate, g->limit);
    up = fminf(fmaxf(up, -g->limit), g->limit);
    return (up + 1.0f) * (gate / (1.0f + expf(-gate * g->alpha)));
}

/* integer weight rows [n0, n1) of slot s (int8, int4, MXFP4: block_rows 1, so row n's
 * scales follow row n - 1's) against
 * `count` quantized x rows from `first`, MAX_ROWS at a time: the VNNI loops where the CPU
 * has VNNI, else AVX2's (`fast`), else plain C */
static void integer_rows(const qrows_t *qx, int64_t first, int64_t count, pool_t p, int64_t s,
                         int64_t n0, int64_t n1, float *out, int64_t ldy, int64_t K,
                         int fast) {
    int64_t row_bytes = p.kind == WEIGHTS_INT8 ? K : K / 2, per_row = p.group ? K / p.group : 1;
    const uint8_t *w = (const uint8_t *)p.w + s * p.stride + n0 * row_bytes;
    const float *wscale = row_scales(p, s, n0, K);
    for (int64_t c = 0; c < count; c += MAX_ROWS) {
        int m = count - c < MAX_ROWS ? (int)(count - c) : MAX_ROWS;
        float *o = out + c * ldy;
        if (fast && has_vnni && qx->pairs == 2 * QBLOCK)
            int4_rows_vnni(qx, first + c, m, w, row_bytes, n1 - n0, wscale, per_row, p.group,
                           o, ldy);
        else if (fast && has_vnni && p.kind == WEIGHTS_INT8 && !p.group)
            int8_rows_vnni(qx, first + c, m, w, n1 - n0, wscale, o, ldy);
        else if (fast && has_vnni)
            rows_vnni(qx, first + c, m, w, row_bytes, n1 - n0, p.kind, wscale, per_row,
                      p.group, o, ldy);
        else if (fast && qx->pairs == 2 * QBLOCK)
            int4_rows_avx2(qx, first + c, m, w, row_bytes, n1 - n0, wscale, per_row, p.group,
                           o, ldy);
        else if (fast)
            rows_avx2(qx, first + c, m, w, row_bytes, n1 - n0, p.kind, wscale, per_row,
                      p.group, o, ldy);
        else
            for (int64_t n = 0; n < n1 - n0; n++)
                row_q_plain(qx, first + c, m, w + n * row_bytes, p.kind, wscale + n * per_row,
                            p.group, o + n, ldy);
    }
}

/* row n of slot s, a bf16 or FP8 pool (integer pools: integer_rows), against `count` bf16
 * x rows from row `first` (AVX2's bf16: pool_rows_block's tiles); `isa`: the path */
static void pool_rows_dot(const uint16_t *x, int64_t first, int64_t count, pool_t p,
                          int64_t s, int64_t n, float *out, int64_t ldy, int64_t K, int isa) {
    if (p.kind == WEIGHTS_BF16) {
        rows_dot(x + first * K, K, count, (const uint16_t *)p.w + s * p.stride + n * K, out,
                 ldy, K, isa);
        return;
    }
    const uint8_t *row = (const uint8_t *)p.w + s * p.stride + n * K;      /* FP8 */
    const float *wscale = row_scales(p, s, n, K);
    for (int64_t c = 0; c < count; c += MAX_ROWS) {     /* bf16 activations */
        int m = count - c < MAX_ROWS ? (int)(count - c) : MAX_ROWS;
        const uint16_t *xc = x + (first + c) * K;
        if (isa == ISA_AVX512BF16)
            row_fp8_avx512(xc, K, m, row, wscale, p.group ? p.group : K, K, out + c * ldy, ldy);
        else if (isa == ISA_AVX2)
            row_fp8_avx2(xc, K, m, row, wscale, p.group ? p.group : K, K, out + c * ldy, ldy);
        else
            row_fp8_plain(xc, K, m, row, wscale, p.group ? p.group : K, K, out + c * ldy, ldy);
    }
}

/* weight rows [n0, n1) of slot s against `count` x rows from `first`, their sums at
 * out[0 .. n1 - n0) of each x row (row stride ldy): bf16 pools on AVX2 by tiles_avx2 (a weight
 * row at a time for one or two x rows, tiles of three from three), on AMX tiles from
 * AMX_MIN_ROWS x rows where `amx` (this thread's packing scratch) is given, integer pools
 * against the quantized `qx` (integer_rows), the rest row by row (pool_rows_dot) */
static void pool_rows_block(const uint16_t *x, const float *xf, const qrows_t *qx,
                            int64_t first, int64_t count, pool_t p, int64_t s, int64_t n0,
                            int64_t n1, float *out, int64_t ldy, int64_t K, int isa,
                            uint16_t *amx) {
    if (p.kind == WEIGHTS_BF16 && amx && count >= AMX_MIN_ROWS) {
        amx_rows(x + first * K, K, count, (const uint16_t *)p.w + s * p.stride + n0 * K, K,
                 n1 - n0, out, ldy, K, NULL, amx);
        return;
    }
    if (p.kind == WEIGHTS_BF16 && isa == ISA_AVX2) {
        tiles_avx2(xf + first * K, K, count, (const uint16_t *)p.w + s * p.stride + n0 * K, K,
                   n1 - n0, out, ldy, K);
        return;
    }
    if (p.kind == WEIGHTS_BF16 && isa == ISA_AVX512BF16 && count >= tile_min_rows()) {
        tiles_avx512(x + first * K, K, count, (const uint16_t *)p.w + s * p.stride + n0 * K, K,
                     n1 - n0, out, ldy, K);
        return;
    }
    if (p.kind != WEIGHTS_BF16 && p.kind != WEIGHTS_FP8) {
        integer_rows(qx, first, count, p, s, n0, n1, out, ldy, K, isa != ISA_PLAIN);
        return;
    }
    for (int64_t n = n0; n < n1; n++)
        pool_rows_dot(x, first, count, p, s, n, out + (n - n0), ldy, K, isa);
}

#define ACT_SPAN 64       /* activations computed a piece at a time, in float on the stack */

/* act(gate, up) for n values (a multiple of `lanes`: the pieces are padded) with vexp.h's
 * exp, as activate() computes it: min and max return the bound where gate or up is NaN */
#define ACTIVATE_VEC(name, attributes, vec, lanes, set1, load, store, minf, maxf, add, mul, div, \
                     exp)                                                                      \
    attributes static void name(const gating_t *g, const float *gate, const float *up,         \
                                float *out, int64_t n) {                                       \
        for (int64_t j = 0; j < n; j += lanes) {                                               \
            vec x = load(gate + j), u = load(up + j);                                          \
            if (!g->clamped) {                                                                 \
                store(out + j, mul(div(x, add(set1(1.0f), exp(mul(x, set1(-1.0f))))), u));     \
                continue;                                                                      \
            }                                                                                  \
            x = minf(x, set1(g->limit));                                                       \
            u = minf(maxf(u, set1(-g->limit)), set1(g->limit));                                \
            vec s = div(x, add(set1(1.0f), exp(mul(x, set1(-g->alpha)))));                     \
            store(out + j, mul(add(u, set1(1.0f)), s));                                        \
        }                                                                                      \
    }

ACTIVATE_VEC(activate_avx512, __attribute__((target("avx512f"))), __m512, 16, _mm512_set1_ps,
             _mm512_loadu_ps, _mm512_storeu_ps, _mm512_min_ps, _mm512_max_ps, _mm512_add_ps,
             _mm512_mul_ps, _mm512_div_ps, exp16_avx512)
ACTIVATE_VEC(activate_avx2, __attribute__((target("avx2,fma"))), __m256, 8, _mm256_set1_ps,
             _mm256_loadu_ps, _mm256_storeu_ps, _mm256_min_ps, _mm256_max_ps, _mm256_add_ps,
             _mm256_mul_ps, _mm256_div_ps, exp8_avx2)

/* act [p, i0:i1] = act(gate_up[p, i] + gate bias, gate_up[p, I + i] + up bias), rounded to
 * bf16 once, as the down projection reads it, for the rows of one active slot. With vectors
 * (`isa`) the exp is vexp.h's, not libm's scalar expf (a call per value): a MoE layer with its
 * experts in cache ran 1.05-1.09x faster, from memory 1.00-1.01x (alternated builds). Every
 * value goes through the same exp wherever it falls in a piece (the pieces are padded), so a
 * claim's bounds do not change a result. */
static void activate_rows(const gating_t *g, int64_t slot, int64_t first, int64_t count,
                          int64_t i0, int64_t i1, int64_t I, const float *gate_up,
                          uint16_t *act, float *act_f, int isa) {
    float gate[ACT_SPAN], up[ACT_SPAN], out[ACT_SPAN];
    for (int64_t p = first; p < first + count; p++)
        for (int64_t i = i0; i < i1; i += ACT_SPAN) {
            int64_t n = i1 - i < ACT_SPAN ? i1 - i : ACT_SPAN;
            for (int64_t j = 0; j < ACT_SPAN; j++) {
                gate[j] = j < n ? gate_up[p * 2 * I + i + j]
                                  + bias_at(g->b13, g->b13_stride, slot, i + j) : 0.0f;
                up[j] = j < n ? gate_up[p * 2 * I + I + i + j]
                                + bias_at(g->b13, g->b13_stride, slot, I + i + j) : 0.0f;
            }
            if (isa == ISA_AVX512BF16)
                activate_avx512(g, gate, up, out, ACT_SPAN);
            else if (isa == ISA_AVX2)
                activate_avx2(g, gate, up, out, ACT_SPAN);
            else
                for (int64_t j = 0; j < n; j++)
                    out[j] = activate(g, gate[j], up[j]);
            for (int64_t j = 0; j < n; j++) {
                act[p * I + i + j] = f32_to_bf16(out[j]);
                if (act_f)                        /* the AVX2 path's float32 copy */
                    act_f[p * I + avx2_lane(i + j, I)] = bf16_to_f32(act[p * I + i + j]);
            }
        }
}

/* What one call's claims share: its rows, pools and scratch (mox_moe_experts' arguments) */
typedef struct {
    const uint16_t *rows;
    const float *rows_f, *row_weights;
    const qrows_t *q13, *q2;
    pool_t p13, p2;
    const gating_t *g;
    const int64_t *slots, *starts, *counts;
    int64_t H, I;
    float *gate_up, *act_f, *down;
    uint16_t *act;
    int quantized, isa;
    uint16_t *amx;          /* bf16 pools on AMX: amx_packed_size(max(H, I)) a thread, or NULL */
    int64_t amx_size;
} experts_t;

static inline uint16_t *amx_scratch(const experts_t *e) {
    return e->amx ? e->amx + omp_get_thread_num() * e->amx_size : NULL;
}

/* gate rows [i0, i1) of active slot a, the same up rows, and their activations (quantized
 * for the integer formats: [i0, i1) is whole blocks of QBLOCK values) */
static void gate_up_rows(const experts_t *e, int64_t a, int64_t i0, int64_t i1) {
    int64_t first = e->starts[a], count = e->counts[a], I = e->I, n13 = 2 * I;
    float *gu = e->gate_up + first * n13;
    pool_rows_block(e->rows, e->rows_f, e->q13, first, count, e->p13, e->slots[a], i0, i1,
                    gu + i0, n13, e->H, e->isa, amx_scratch(e));
    pool_rows_block(e->rows, e->rows_f, e->q13, first, count, e->p13, e->slots[a], I + i0,
                    I + i1, gu + I + i0, n13, e->H, e->isa, amx_scratch(e));
    activate_rows(e->g, e->slots[a], first, count, i0, i1, I, e->gate_up, e->act, e->act_f,
                  e->isa);
    if (e->quantized)
        for (int64_t p = first; p < first + count; p++)
            quantize_blocks(e->act, e->q2, p, i0 / QBLOCK, i1 / QBLOCK);
}

/* down rows [h0, h1) of active slot a (+ bias), each output row scaled by its routing weight */
static void down_rows(const experts_t *e, int64_t a, int64_t h0, int64_t h1) {
    int64_t first = e->starts[a], count = e->counts[a], H = e->H;
    pool_rows_block(e->act, e->act_f, e->q2, first, count, e->p2, e->slots[a], h0, h1,
                    e->down + first * H + h0, H, e->I, e->isa, amx_scratch(e));
    for (int64_t h = h0; h < h1; h++) {
        float *out = e->down + first * H + h;
        float bias = bias_at(e->g->b2, e->g->b2_stride, e->slots[a], h);
        for (int64_t c = 0; c < count; c++)
            out[c * H] = (out[c * H] + bias) * e->row_weights[first + c];
    }
}

/* The gated experts of one MoE layer for a few rows each (decode), in one call (moe_block.c
 * calls it after routing).
 * `rows` [P, H] bf16: the tokens' hidden states gathered and sorted by slot; active slot a
 * owns rows [starts[a], starts[a] + counts[a]). Weights read in place from the slot pools:
 * w13 slot s ([2I, H]: gate rows, then up rows), w2 ([H, I]).
 * Out: `down` [P, H] f32 = row_weight * (act(gate, up) @ w2[s]^T (+ b2)); act: SiLU(gate) * up
 * or the clamped SwiGLU, on gate_up (+ b13) (`gating`, NULL: SiLU). Scratch: `gate_up`
 * [P, 2I] f32, `act` [P, I] bf16. Each weight is read once, in memory order, by the thread
 * that claimed its expert or its chunk of rows (TAIL_PER_THREAD). */
int mox_moe_experts(const uint16_t *rows, pool_t p13, pool_t p2, const gating_t *gating,
                    const int64_t *slots, const int64_t *starts, const int64_t *counts,
                    int64_t num_active, const float *row_weights, int64_t H, int64_t I,
                    float *gate_up, uint16_t *act, float *down, int fast) {
    static const gating_t silu = {0};
    if (p13.kind < WEIGHTS_BF16 || p13.kind > WEIGHTS_FP8 || p13.block_rows < 1
        || p13.group < 0 || p2.kind != p13.kind || p2.group != p13.group
        || p2.block_rows != p13.block_rows
        || (p13.kind == WEIGHTS_INT8 && (p13.group || p13.block_rows != 1))
        || ((p13.kind == WEIGHTS_INT4 || p13.kind == WEIGHTS_MXFP4)
            && (p13.group == 0 || p13.block_rows != 1)))
        return -1;
    const gating_t *g = gating ? gating : &silu;
    /* activations quantized to int8 for the integer formats */
    int quantized = p13.kind != WEIGHTS_BF16 && p13.kind != WEIGHTS_FP8;
    int isa = fast ? mox_vector_isa() : ISA_PLAIN;
    if (has_vnni < 0)
        has_vnni = mox_has_avx512vnni();
    /* how the activations meet packed weights (qrows_t): int4 in groups of a multiple of
     * 128 (so H and I are too) takes int4_rows_vnni, or int4_rows_avx2 without VNNI */
    int pairs = p13.kind != WEIGHTS_INT4 && p13.kind != WEIGHTS_MXFP4 ? 0 : QBLOCK;
    if (p13.kind == WEIGHTS_INT4 && isa != ISA_PLAIN && p13.group % (2 * QBLOCK) == 0)
        pairs = 2 * QBLOCK;
    if (fast && !quantized && (H % 32 != 0 || I % 32 != 0 || isa == ISA_PLAIN
                               || (p13.kind == WEIGHTS_FP8 && isa == ISA_PLAIN)))
        return -1;
    if (p13.kind == WEIGHTS_FP8 && ((p13.group && p13.group % 32) || (p13.group && H % p13.group)
                                    || (p2.group && I % p2.group)))
        return -1;
    if (quantized && (H % QBLOCK || I % QBLOCK || (fast && isa == ISA_PLAIN)
                      || (p13.kind == WEIGHTS_INT4 && ((p13.group % QBLOCK && p13.group != 32)
                                                       || H % p13.group || I % p13.group))
                      || (p13.kind == WEIGHTS_MXFP4 && p13.group != 32)))
        return -1;
    int64_t num_rows = 0, most_rows = 0;
    for (int64_t a = 0; a < num_active; a++) {
        num_rows += counts[a];
        most_rows = counts[a] > most_rows ? counts[a] : most_rows;
    }
    qrows_t q13 = {0}, q2 = {0};
    int bf16_avx2 = p13.kind == WEIGHTS_BF16 && isa == ISA_AVX2;
    float *rows_f = bf16_avx2 ? widen_rows(rows, H, num_rows, H, isa) : NULL;
    float *act_f = bf16_avx2 ? malloc(sizeof(float) * (size_t)(num_rows * I)) : NULL;
    int vec = isa == ISA_PLAIN ? QUANT_PLAIN
              : __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
                  ? QUANT_AVX512 : QUANT_AVX2;
    if ((quantized && !(qrows_alloc(&q13, num_rows, H, pairs, vec)
                        && qrows_alloc(&q2, num_rows, I, pairs, vec)))
        || (bf16_avx2 && (rows_f == NULL || act_f == NULL))) {
        qrows_free(&q13);
        qrows_free(&q2);
        free(rows_f);
        free(act_f);
        return -2;
    }
    int64_t amx_size = amx_packed_size(H > I ? H : I);
    /* (no scratch, and no tile configuration, for a call no expert of which takes AMX) */
    uint16_t *amx = p13.kind == WEIGHTS_BF16 && isa == ISA_AVX512BF16
                    && most_rows >= AMX_MIN_ROWS && amx_usable()
                    ? aligned_alloc(64, omp_get_max_threads() * amx_size * sizeof *amx) : NULL;
    experts_t e = {rows, rows_f, row_weights, &q13, &q2, p13, p2, g, slots, starts, counts, H,
                   I, gate_up, act_f, down, act, quantized, isa, amx, amx_size};
    int64_t tail = TAIL_PER_THREAD * omp_get_max_threads();
    int64_t whole = num_active > tail ? num_active - tail : 0;   /* experts claimed whole */
    int bits = p13.kind == WEIGHTS_BF16 ? 16
               : p13.kind == WEIGHTS_INT4 || p13.kind == WEIGHTS_MXFP4 ? 4 : 8;
    int64_t chunk = CHUNK_ROWS * 16 / bits;         /* a claim: CHUNK_ROWS bf16 rows' bytes */
    int64_t gate_chunks = (I + chunk - 1) / chunk;
    int64_t down_chunks = (H + chunk - 1) / chunk;
    #pragma omp parallel
    {
        if (amx)
            amx_begin();
        if (quantized) {
            #pragma omp for schedule(static)
            for (int64_t p = 0; p < num_rows; p++)
                quantize_blocks(rows, &q13, p, 0, H / QBLOCK);
        }
        #pragma omp for schedule(static) nowait
        for (int64_t a = 0; a < whole; a++) {
            gate_up_rows(&e, a, 0, I);
            down_rows(&e, a, 0, H);
        }
        /* the tail: gate and up rows a chunk at a claim, then (after the barrier: the down
         * rows read every activation of their expert) the down rows */
        #pragma omp for schedule(guided)
        for (int64_t j = 0; j < (num_active - whole) * gate_chunks; j++) {
            int64_t i0 = (j % gate_chunks) * chunk, i1 = i0 + chunk;
            gate_up_rows(&e, whole + j / gate_chunks, i0, i1 < I ? i1 : I);
        }
        #pragma omp for schedule(guided)
        for (int64_t j = 0; j < (num_active - whole) * down_chunks; j++) {
            int64_t h0 = (j % down_chunks) * chunk, h1 = h0 + chunk;
            down_rows(&e, whole + j / down_chunks, h0, h1 < H ? h1 : H);
        }
        if (amx)
            amx_end();
    }
    free(amx);
    qrows_free(&q13);
    qrows_free(&q2);
    free(rows_f);
    free(act_f);
    return 0;
}

/* bf16 slot pools: w13 slot s at w13 + s * s13, w2 at w2 + s * s2 (elements). */
int mox_moe_experts_bf16(const uint16_t *rows, const uint16_t *w13, int64_t s13,
                         const uint16_t *w2, int64_t s2, const gating_t *gating,
                         const int64_t *slots, const int64_t *starts, const int64_t *counts,
                         int64_t num_active, const float *row_weights, int64_t H, int64_t I,
                         float *gate_up, uint16_t *act, float *down, int fast) {
    pool_t p13 = {w13, s13, WEIGHTS_BF16, 0, 0, 0, 1, 1}, p2 = p13;
    p2.w = w2;
    p2.stride = s2;
    return mox_moe_experts(rows, p13, p2, gating, slots, starts, counts, num_active,
                           row_weights, H, I, gate_up, act, down, fast);
}

/* Quantized slot pools (`kind` 1: int8, 2: int4, 3: MXFP4, 4: FP8 E4M3): float32 scales, w13's
 * at sc13 + s * ss13 ([2, ceil(I / block_rows), H / group]: gate's, then up's), w2's at
 * sc2 + s * ss2 ([ceil(H / block_rows), I / group]); `group` 0: one per row. int8: per row;
 * int4: groups of 32 or a multiple of 64; MXFP4: groups of 32; FP8: any blocks (`group` a
 * multiple of 32). H and I: multiples of 64 (FP8: of 32). */
int mox_moe_experts_quantized(const uint16_t *rows, int kind, const void *w13, int64_t s13,
                              const float *sc13, int64_t ss13, const void *w2, int64_t s2,
                              const float *sc2, int64_t ss2, int64_t group,
                              int64_t block_rows, const gating_t *gating, const int64_t *slots,
                              const int64_t *starts, const int64_t *counts,
                              int64_t num_active, const float *row_weights, int64_t H,
                              int64_t I, float *gate_up, uint16_t *act, float *down,
                              int fast) {
    if (kind == WEIGHTS_BF16)
        return -1;
    pool_t p13 = {w13, s13, kind, sc13, ss13, group, block_rows, I};
    pool_t p2 = {w2, s2, kind, sc2, ss2, group, block_rows, H};
    return mox_moe_experts(rows, p13, p2, gating, slots, starts, counts, num_active,
                           row_weights, H, I, gate_up, act, down, fast);
}
