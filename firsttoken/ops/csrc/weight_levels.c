/* A float32 weight's GGUF-style block levels, found from its values (ops/weight_levels.py says
 * why): per row and group of LEVELS_GROUP values, an fp16 scale (and offset) and levels such
 * that level * scale (+ offset), computed as the levels matmul does (one FMA, exact since the
 * product is), gives every value's bits back.
 *
 * 4-bit levels: Q4_1's least value is the offset (its level is 0) and the scale an fp16 step
 * or two from (max - min) / 15; Q4_0's offset is its value of largest magnitude, -8 times the
 * scale. 8-bit (Q8_0): no offset, the scale near max |w| / 127.
 *
 * Q4_K's groups (its 256-value blocks' sub-blocks of 32) are 4-bit levels too, w = q * d * sc -
 * dmin * m: scale and offset are fp16 values times 6-bit integers, 17 significant bits, and exact
 * in float32. Its quantizer maps a group's least value to level 0 (or, where every value is
 * positive, keeps m = 0) and its most to level 15 or a level or two below; so the scale is
 * (max - min) / span for a span of 15 down to 13, to 17 bits.
 */
#pragma GCC optimize("fp-contract=fast") /* the levels matmul's FMA: see isa.h */
#include "common.h"

#include <math.h>

/* fp16 bits of x rounded to nearest even (overflow: infinity; NaN: a NaN). */
static uint16_t half_bits(float x) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    uint32_t sign = (bits >> 16) & 0x8000u, magnitude = bits & 0x7fffffffu;
    if (magnitude >= 0x7f800000u) {
        return (uint16_t)(sign | 0x7c00u | (magnitude > 0x7f800000u ? 0x200u : 0u));
    }
    if (magnitude >= 0x477ff000u) { /* rounds past 65504 */
        return (uint16_t)(sign | 0x7c00u);
    }
    if (magnitude < 0x38800000u) { /* below fp16's least normal: a subnormal, by float arithmetic */
        float scaled = fabsf(x) * 16777216.0f; /* in units of 2^-24, fp16's least subnormal */
        return (uint16_t)(sign | (uint32_t)nearbyintf(scaled));
    }
    uint32_t rounded = magnitude + 0xfffu + ((magnitude >> 13) & 1u);
    return (uint16_t)(sign | ((rounded - 0x38000000u) >> 13));
}

static float half_value(uint16_t half) {
    uint32_t sign = (uint32_t)(half & 0x8000u) << 16, exponent = (half >> 10) & 0x1fu, mantissa = half & 0x3ffu;
    if (exponent == 0) {
        float value = (float)mantissa / 16777216.0f;
        return sign ? -value : value;
    }
    uint32_t bits = sign | (exponent == 31 ? 0x7f800000u | (mantissa << 13)
                                           : ((exponent + 112u) << 23) | (mantissa << 13));
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

static int is_half(float x) {
    return half_value(half_bits(x)) == x;
}

/* Levels of one group for `scale`, into `levels`; whether they rebuild every value. Every value
 * is tried, with no early exit, so that the loop vectorizes: most groups pass on the first scale. */
static int try_scale(const float *values, float scale, float offset, int level_bits, uint8_t *levels) {
    float lowest = level_bits == 4 ? 0.0f : -128.0f, highest = level_bits == 4 ? 15.0f : 127.0f;
    int rebuilt = 1;
    for (int i = 0; i < LEVELS_GROUP; i++) {
        float level = scale == 0.0f ? 0.0f : nearbyintf((values[i] - offset) / scale);
        level = !(level >= lowest) ? lowest : level > highest ? highest : level; /* NaN: lowest, never cast */
        rebuilt &= level * scale + offset == values[i];
        levels[i] = level_bits == 4 ? (uint8_t)level : (uint8_t)(int8_t)level;
    }
    return rebuilt;
}

/* `x` rounded to nearest even at 17 significant bits (Q4_K's scales and offsets). */
static float k_quant_rounded(float x) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    bits = (bits + 0x3fu + ((bits >> 7) & 1u)) & ~0x7fu;
    float rounded;
    memcpy(&rounded, &bits, sizeof rounded);
    return rounded;
}

/* Whether a Q4_K scale (17 bits) a step from `estimate` gives levels that rebuild the group. */
static int try_k_quant(const float *values, float estimate, float offset, uint8_t *levels, float *scale) {
    static const int steps[] = {0, 1, -1};
    uint32_t center;
    float rounded = k_quant_rounded(estimate);
    memcpy(&center, &rounded, sizeof center);
    if (rounded == 0.0f) { /* a constant group: d * sc of 0 */
        *scale = 0.0f;
        return try_scale(values, 0.0f, offset, 4, levels);
    }
    if (!(rounded > 0.0f) || !isfinite(rounded)) {
        return 0;
    }
    for (size_t s = 0; s < sizeof steps / sizeof steps[0]; s++) {
        uint32_t bits = center + (uint32_t)(steps[s] * 0x80);
        memcpy(scale, &bits, sizeof *scale);
        if (try_scale(values, *scale, offset, 4, levels)) {
            return 1;
        }
    }
    return 0;
}

/* Whether some fp16 scale an fp16 step or two from `estimate` gives levels that rebuild the group. */
static int try_near(const float *values, float estimate, float offset, int level_bits, uint8_t *levels,
                    float *scale) {
    static const int steps[] = {0, 1, -1, 2, -2};
    if (!is_half(offset)) {
        return 0;
    }
    uint16_t center = half_bits(estimate);
    for (size_t s = 0; s < sizeof steps / sizeof steps[0]; s++) {
        int bits = (int)center + steps[s];
        /* Steps stay within one sign's finite values. */
        if ((bits & 0x7fff) >= 0x7c00 || ((bits ^ center) & 0x8000) || bits < 0 || bits > 0xffff) {
            continue;
        }
        *scale = half_value((uint16_t)bits);
        if (try_scale(values, *scale, offset, level_bits, levels)) {
            return 1;
        }
    }
    return 0;
}

static int find_group(const float *values, int level_bits, uint8_t *levels, float *scale, float *offset) {
    float least = values[0], most = values[0];
    for (int i = 1; i < LEVELS_GROUP; i++) {
        least = values[i] < least ? values[i] : least;
        most = values[i] > most ? values[i] : most;
    }
    if (!isfinite(most - least)) {
        return 0;
    }
    if (level_bits == 8) {
        float largest = fabsf(least) > fabsf(most) ? fabsf(least) : fabsf(most);
        *offset = 0.0f;
        return try_near(values, largest / 127.0f, 0.0f, 8, levels, scale);
    }
    /* Q4_1: the least value is level 0, the most level 15. Q4_0 (w = (level - 8) d): the value
     * of largest magnitude is level 0, at -8 d. */
    const float offsets[3] = {least, least, most};
    const float estimates[3] = {(most - least) / 15.0f, -least / 8.0f, -most / 8.0f};
    for (int c = 0; c < 3; c++) {
        *offset = offsets[c];
        if (try_near(values, estimates[c], offsets[c], 4, levels, scale)) {
            return 1;
        }
    }
    /* Q4_K: level 0 at the least value (or at zero, m = 0, where all are positive). */
    const float k_offsets[2] = {least, 0.0f};
    for (int c = 0; c < (least > 0.0f ? 2 : 1); c++) {
        for (int span = 15; span >= 13; span--) {
            *offset = k_offsets[c];
            if (try_k_quant(values, (most - k_offsets[c]) / (float)span, k_offsets[c], levels, scale)) {
                return 1;
            }
        }
    }
    return 0;
}

/* weight [rows, cols] (cols a multiple of LEVELS_GROUP) into levels [rows, cols] (uint8 for 4
 * bits, int8 for 8), scales and offsets [rows, cols / LEVELS_GROUP] (offsets zero for 8 bits).
 * FT_OK when every group has its levels, FT_BAD_SHAPE where one has none or cols is no
 * multiple of the group. */
FtStatus ft_find_weight_levels(const float *weight, int64_t rows, int64_t cols, int level_bits, uint8_t *levels,
                               float *scales, float *offsets, int num_threads) {
    if (cols % LEVELS_GROUP != 0 || (level_bits != 4 && level_bits != 8)) {
        return FT_BAD_SHAPE;
    }
    int64_t groups = rows * (cols / LEVELS_GROUP);
    int missing = 0;
#pragma omp parallel for num_threads(num_threads) schedule(static) reduction(| : missing)
    for (int64_t group = 0; group < groups; group++) {
        if (!missing && !find_group(weight + group * LEVELS_GROUP, level_bits, levels + group * LEVELS_GROUP,
                                    scales + group, offsets + group)) {
            missing = 1;
        }
    }
    return missing ? FT_BAD_SHAPE : FT_OK;
}
