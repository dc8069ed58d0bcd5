/* One MoE layer's experts (moe_experts.c) against a plain stream of the same machine, pass by
 * pass in one process: moe_stream.py builds this with the csrc of two revisions and alternates
 * them. This VM's memory streams at ~31 GB/s for minutes, then at 45-56 for a while, so a
 * kernel's rate means little alone; its ratio to a stream timed the moment before does.
 *
 * A pass: the decode GEMV (bf16_gemv.c) of one x row over 256 MiB of bf16 weights, each thread
 * a contiguous half, then CALLS MoE calls at each token count (64 slots of the bench olmoe's
 * experts, H 1024, I 512, each token routed to 4 experts at random). Prints per pass:
 * "stream GB/s" then "tokens GB/s" for each count. Usage: moe_stream PASSES TOKENS... */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "exported.h"
#include "moe_pools.h"

enum { SLOTS = 64, H = 1024, I = 512, TOP_K = 4, CALLS = 24, MAX_TOKENS = 64 };
#define STREAM_BYTES ((int64_t)256 << 20)

typedef struct {
    int64_t slots[SLOTS], starts[SLOTS], counts[SLOTS], num_active;
} call_t;

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static void fill(uint16_t *w, int64_t n) {     /* bf16 values in [1, 2): no denormals */
    for (int64_t i = 0; i < n; i++)
        w[i] = 0x3f80 | (rand() & 0x7f);
}

/* `tokens` tokens, each to TOP_K distinct experts at random; rows sorted by slot */
static void route(call_t *c, int tokens) {
    int64_t count[SLOTS] = {0};
    for (int t = 0; t < tokens; t++) {
        int used[SLOTS] = {0};
        for (int j = 0; j < TOP_K; j++) {
            int e;
            do e = rand() % SLOTS; while (used[e]);
            used[e] = 1;
            count[e]++;
        }
    }
    c->num_active = 0;
    for (int64_t e = 0, start = 0; e < SLOTS; start += count[e], e++)
        if (count[e]) {
            c->slots[c->num_active] = e;
            c->starts[c->num_active] = start;
            c->counts[c->num_active++] = count[e];
        }
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: %s PASSES TOKENS...\n", argv[0]);
        return 2;
    }
    int passes = atoi(argv[1]), num_counts = argc - 2;
    int64_t s13 = 2 * I * H, s2 = (int64_t)H * I, rows_max = MAX_TOKENS * TOP_K;
    uint16_t *w13 = malloc(sizeof(uint16_t) * SLOTS * s13);
    uint16_t *w2 = malloc(sizeof(uint16_t) * SLOTS * s2);
    uint16_t *stream = malloc(STREAM_BYTES), *rows = malloc(sizeof(uint16_t) * rows_max * H);
    uint16_t *act = malloc(sizeof(uint16_t) * rows_max * I);
    float *gate_up = malloc(sizeof(float) * rows_max * 2 * I);
    float *down = malloc(sizeof(float) * rows_max * H), weights[MAX_TOKENS * TOP_K];
    call_t *calls = malloc(sizeof(call_t) * CALLS * num_counts);
    if (!w13 || !w2 || !stream || !rows || !act || !gate_up || !down || !calls)
        return 1;
    fill(w13, SLOTS * s13);
    fill(w2, SLOTS * s2);
    fill(stream, STREAM_BYTES / 2);
    fill(rows, rows_max * H);
    for (int i = 0; i < MAX_TOKENS * TOP_K; i++)
        weights[i] = 1.0f;
    for (int k = 0; k < num_counts; k++) {
        int tokens = atoi(argv[2 + k]);
        if (tokens < 1 || tokens > MAX_TOKENS)
            return 2;
        for (int c = 0; c < CALLS; c++)
            route(&calls[k * CALLS + c], tokens);
    }
    int64_t stream_rows = STREAM_BYTES / (2 * H);
    float *y = malloc(sizeof(float) * stream_rows);
    if (!y)
        return 1;
    for (int p = 0; p < passes; p++) {
        double start = now();
        if (mox_gemv_bf16(rows, H, stream, H, y, stream_rows, 1, stream_rows, H, OUT_F32, 1))
            return 1;
        printf("stream %.2f", STREAM_BYTES / (now() - start) / 1e9);
        for (int k = 0; k < num_counts; k++) {
            double bytes = 0;
            start = now();
            for (int c = 0; c < CALLS; c++) {
                call_t *call = &calls[k * CALLS + c];
                if (mox_moe_experts_bf16(rows, w13, s13, w2, s2, NULL, call->slots,
                                         call->starts, call->counts, call->num_active, weights,
                                         H, I, gate_up, act, down, 1) != 0)
                    return 1;
                bytes += (double)call->num_active * (s13 + s2) * sizeof(uint16_t);
            }
            printf(" %s %.2f", argv[2 + k], bytes / (now() - start) / 1e9);
        }
        printf("\n");
        fflush(stdout);
    }
    return 0;
}
