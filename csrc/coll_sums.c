/*
 * coll_sums.c: the checksums of a collective (sdc_guard/core/collective.py's segment_sums
 * and bit_checksums) in one read of the data and one call, for the collective checks
 * (sdc_guard/runtime/collectives/collective_checks.py).
 *
 * Why native: the receiver's checksums run on the backend's thread (gloo's) while the
 * training thread holds the GIL in its dispatch mode; every torch operation there gives
 * the GIL back and waits to take it again (up to a switch interval), which delays the
 * collective's completion. One C call that keeps the GIL for the tens of microseconds it
 * reads does not. The sums and magnitudes are also read in one pass instead of three.
 *
 * Reductions (coll_sums): per segment of CS_SEG elements of each row, the sums of the
 * even- and odd-indexed elements and (with_abs) the sum of magnitudes, fp64, written as
 * core/collective.py lays them out: [rows, segments, 2] then [rows, segments]. A full
 * segment is read in blocks of CS_BLOCK (core's PARTIAL) elements into CS_LANES fp32
 * lanes (element i goes to lane i mod 16: even lanes hold even elements), so each lane
 * adds CS_BLOCK / CS_LANES = 4 elements in fp32 (3 roundings, fewer than core's
 * PARTIAL / 2 - 1); the lanes' partials are added in fp64 (CS_SEG / CS_BLOCK per lane, then
 * the lanes). core.collective.reduction_bound holds for this order: its fp32 term
 * (gamma_31 of 2^-24) exceeds these 3 fp32 roundings plus the few extra fp64 ones by far.
 * A short last segment (or a row shorter than one) is summed directly in fp64, as in core.
 *
 * All-gathers (coll_bits): the raw bits of each row read as 32-bit words (wide) or
 * sign-extended 16-bit words, summed per segment of CS_SEG words modulo 2^32, then the
 * plain sum of the segments' sums and the sum weighted by position 1, 2, ..., both modulo
 * 2^32: integer arithmetic, exactly core.bit_checksums' numbers, written as fp64 (every
 * value below 2^32 is exact).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vabft_cpu.h"

#define CS_SEG 2048
#define CS_BLOCK 64
#define CS_LANES 16

static inline float cs_load(const void *x, int dt, int64_t i) {
    if (dt == DT_F32) return ((const float *)x)[i];
    uint32_t b = (uint32_t)((const uint16_t *)x)[i] << 16; /* bf16: the top half of an fp32 */
    float f;
    memcpy(&f, &b, sizeof f);
    return f;
}

/* one full segment at x (CS_SEG elements): even, odd, magnitudes */
#define CS_FULL(NAME, LOAD)                                                                     \
    static void NAME(const void *x, int64_t base, double *even, double *odd, double *mag) {    \
        double de[CS_LANES] = {0}, da[CS_LANES] = {0};                                          \
        for (int b = 0; b < CS_SEG; b += CS_BLOCK) {                                            \
            float ps[CS_LANES] = {0}, pa[CS_LANES] = {0};                                       \
            for (int j = 0; j < CS_BLOCK; j += CS_LANES)                                        \
                for (int l = 0; l < CS_LANES; l++) {                                            \
                    float v = LOAD(x, base + b + j + l);                                        \
                    ps[l] += v;                                                                 \
                    pa[l] += fabsf(v);                                                          \
                }                                                                               \
            for (int l = 0; l < CS_LANES; l++) {                                                \
                de[l] += (double)ps[l];                                                         \
                da[l] += (double)pa[l];                                                         \
            }                                                                                   \
        }                                                                                       \
        double e = 0.0, o = 0.0, a = 0.0;                                                       \
        for (int l = 0; l < CS_LANES; l += 2) {                                                 \
            e += de[l];                                                                         \
            o += de[l + 1];                                                                     \
        }                                                                                       \
        for (int l = 0; l < CS_LANES; l++) a += da[l];                                          \
        *even = e;                                                                              \
        *odd = o;                                                                               \
        *mag = a;                                                                               \
    }

#define LOAD_F32(x, i) (((const float *)(x))[i])
#define LOAD_BF16(x, i) cs_load((x), DT_BF16, (i))
CS_FULL(cs_full_f32, LOAD_F32)
CS_FULL(cs_full_bf16, LOAD_BF16)

void vabft_coll_sums(const void *x, int dt, int64_t n, int64_t rows, int with_abs, double *out) {
    int64_t full = n / CS_SEG, nseg = (n + CS_SEG - 1) / CS_SEG;
    double *sums = out, *mags = out + 2 * rows * nseg;
    for (int64_t r = 0; r < rows; r++) {
        int64_t row = r * n;
        for (int64_t s = 0; s < full; s++) {
            double e, o, a;
            if (dt == DT_F32)
                cs_full_f32(x, row + s * CS_SEG, &e, &o, &a);
            else
                cs_full_bf16(x, row + s * CS_SEG, &e, &o, &a);
            sums[2 * (r * nseg + s)] = e;
            sums[2 * (r * nseg + s) + 1] = o;
            if (with_abs) mags[r * nseg + s] = a;
        }
        if (full < nseg) { /* the short last segment, in fp64 */
            double e = 0.0, o = 0.0, a = 0.0;
            for (int64_t i = full * CS_SEG; i < n; i++) {
                double v = (double)cs_load(x, dt, row + i);
                if ((i - full * CS_SEG) % 2 == 0)
                    e += v;
                else
                    o += v;
                a += fabs(v);
            }
            sums[2 * (r * nseg + full)] = e;
            sums[2 * (r * nseg + full) + 1] = o;
            if (with_abs) mags[r * nseg + full] = a;
        }
    }
}

void vabft_coll_bits(const void *x, int wide, int64_t words, int64_t rows, double *out) {
    for (int64_t r = 0; r < rows; r++) {
        uint32_t plain = 0, weighted = 0, k = 0;
        for (int64_t s = 0; s < words; s += CS_SEG) {
            int64_t end = s + CS_SEG < words ? s + CS_SEG : words;
            uint32_t sum = 0;
            if (wide) {
                const unsigned char *p = (const unsigned char *)x + 4 * (r * words);
                for (int64_t i = s; i < end; i++) {
                    uint32_t w;
                    memcpy(&w, p + 4 * i, 4);
                    sum += w;
                }
            } else {
                const unsigned char *p = (const unsigned char *)x + 2 * (r * words);
                for (int64_t i = s; i < end; i++) {
                    int16_t w;
                    memcpy(&w, p + 2 * i, 2);
                    sum += (uint32_t)(int32_t)w;
                }
            }
            k++;
            plain += sum;
            weighted += sum * k;
        }
        out[2 * r] = (double)plain;
        out[2 * r + 1] = (double)weighted;
    }
}
