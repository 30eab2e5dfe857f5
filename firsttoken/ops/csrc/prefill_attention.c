/* Causal prefill attention (bfloat16), flash-style, on AMX tiles or AVX512-BF16.
 *
 * Queries i attend keys j <= i + (num_keys - num_queries): a fresh prompt (num_keys ==
 * num_queries) or new tokens after their context, all of whose K/V lie in `key`/`value`.
 * Per (query head, block of 32 queries), key blocks of 64 stream through: S = Q K^T (float32
 * sums), an online softmax in float32 (running max and sum per row, no score matrix kept),
 * P rounded to bf16 as torch's flash kernel does, O += P V. K and V are first repacked per
 * KV head into a pair-interleaved layout: a row of it is both a B-tile row for AMX and a
 * vector VDPBF16PS pairs with a broadcast (query dim pair, or probability key pair). On CPUs
 * with AMX the two products run on tiles; elsewhere on VDPBF16PS with the products in
 * registers. Work items are spread over `num_threads` OpenMP threads.
 *
 * With a sliding window of W keys (window > 0) a query at position p sees keys p - W + 1 .. p:
 * a block of queries starts at the key block holding its first query's window, keys before
 * that window are never read (their blocks may have gone back to the pool: they pack as
 * zeros), and each row masks the keys before its own window. A key block wholly before a row's
 * window is an exact no-op for it: its masked scores are finite, and the row's first block with
 * a key it sees rescales what they added by exactly 0, so where a row's blocks start does not
 * change its bits.
 *
 * With a soft-cap C > 0 (Gemma 2), a scaled score s is taken as C tanh(s / C).
 *
 * Every query row's arithmetic is its own: the same instructions, in the same order, over the
 * same 64-key tiles, whether it shares its block of 32 with other queries or not. So a decode
 * row run here (ft_decode_attention_as_prefill: one query over its paged context) gets the bits
 * a prefill of the same tokens gives that position: a request recomputed after preemption, or a
 * later prompt hitting blocks a decode step wrote, reads the same K/V either way.
 * (paged_decode_attention.c holds the other paged decode attention, one exact softmax
 * without tiles: a little faster, without that guarantee.)
 *
 * Built at run time by firsttoken/ops/native_build.py with the machine's C compiler.
 */
#define _GNU_SOURCE /* syscall() for the AMX permission */
#include "common.h"

#if VECTOR_BF16
#define QUERY_BLOCK 32
#define KEY_BLOCK PREFILL_KEY_BLOCK
#define TILE_KEYS 32 /* keys per packed block of V (16 rows of key pairs) */
#define MASKED_SCORE (-1.0e30f)

typedef struct {
    const uint16_t *query;
    int64_t query_row_stride;
    const uint16_t *key;
    int64_t key_row_stride;
    const uint16_t *value;
    int64_t value_row_stride;
    int64_t num_queries, num_keys, num_heads, num_kv_heads, head_dim;
    float scale;
    uint16_t *out;
    uint16_t *packed_keys;   /* per KV head: padded_keys * head_dim */
    uint16_t *packed_values; /* per KV head: padded_keys * head_dim */
    int64_t padded_keys;
    int64_t window; /* > 0: each query sees its last `window` keys only */
    float softcap;  /* > 0: scaled scores soft-capped */
    int use_amx;
} PrefillProblem;

/* The K (or V) rows of one KV head: consecutive rows, or a sequence's slots in a paged cache. */
typedef struct {
    const uint16_t *base;  /* row 0 (consecutive) or the cache's slot 0, at this KV head */
    int64_t row_stride;    /* elements from one row (slot) to the next */
    const int64_t *blocks; /* NULL: rows are consecutive; else the sequence's block ids */
    int64_t block_size;    /* a multiple of 16 where blocks is set: 16 keys never straddle two */
    int64_t first;         /* rows before it are never read: they pack as zeros */
    int64_t count;         /* rows that exist; later ones pack as zeros */
} HeadRows;

static inline const uint16_t *head_row(const HeadRows *rows, int64_t index) {
    int64_t slot = rows->blocks == NULL ? index
                                        : rows->blocks[index / rows->block_size] * rows->block_size
                                              + index % rows->block_size;
    return rows->base + slot * rows->row_stride;
}

/* One block of up to QUERY_BLOCK queries over one KV head's keys: consecutive positions of one
 * head (a prefill), or one position's query heads that share the KV head (a decode row's
 * group). A row's result does not depend on the others in its block. */
typedef struct {
    const uint16_t *queries; /* the first query's head */
    int64_t query_stride;
    int64_t rows;            /* 1..QUERY_BLOCK */
    int64_t first_position;  /* query r sees keys 0..first_position + r * position_step (its window of them) */
    int64_t position_step;   /* 1: consecutive positions; 0: every row at first_position */
    int64_t num_keys;
    int64_t window;          /* > 0: query r sees keys from its position - window + 1 */
    float softcap;           /* > 0: scaled scores s taken as softcap * tanh(s / softcap) */
    const uint16_t *packed_keys, *packed_values; /* its KV head's, packed */
    int64_t head_dim;
    float scale;
    int use_amx;
    uint16_t *out;           /* the first query's head */
    int64_t out_stride;
} QueryBlock;

/* Lanes [0, valid) of a 16-lane vector starting at lane `first`. */
static inline __mmask16 valid_lanes(int64_t valid, int64_t first) {
    int64_t count = valid - first;
    return count <= 0 ? 0 : (count >= 16 ? 0xffff : (__mmask16)((1u << count) - 1));
}

/* Transposes 16 rows of 16 dwords in place (row i becomes column i). */
static inline void transpose_16x16(__m512i rows[16]) {
    __m512i pairs[16];
    for (int i = 0; i < 16; i += 2) {
        pairs[i] = _mm512_unpacklo_epi32(rows[i], rows[i + 1]);
        pairs[i + 1] = _mm512_unpackhi_epi32(rows[i], rows[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        rows[i] = _mm512_unpacklo_epi64(pairs[i], pairs[i + 2]);
        rows[i + 1] = _mm512_unpackhi_epi64(pairs[i], pairs[i + 2]);
        rows[i + 2] = _mm512_unpacklo_epi64(pairs[i + 1], pairs[i + 3]);
        rows[i + 3] = _mm512_unpackhi_epi64(pairs[i + 1], pairs[i + 3]);
    }
    for (int i = 0; i < 4; i++) {
        pairs[i] = _mm512_shuffle_i32x4(rows[i], rows[i + 4], 0x88);
        pairs[i + 4] = _mm512_shuffle_i32x4(rows[i], rows[i + 4], 0xdd);
        pairs[i + 8] = _mm512_shuffle_i32x4(rows[i + 8], rows[i + 12], 0x88);
        pairs[i + 12] = _mm512_shuffle_i32x4(rows[i + 8], rows[i + 12], 0xdd);
    }
    for (int i = 0; i < 8; i++) {
        rows[i] = _mm512_shuffle_i32x4(pairs[i], pairs[i + 8], 0x88);
        rows[i + 8] = _mm512_shuffle_i32x4(pairs[i], pairs[i + 8], 0xdd);
    }
}

/* K^T as B tiles: for 16 keys (from `first_key`, a multiple of 16) and 32 dims, 16 rows of
 * (dim pair) x (16 keys x 2), keys past the last zero: each chunk of 32 dims of the 16 keys,
 * as 16 x 16 dwords (dim pairs), transposed. `packed` is the KV head's packed keys. */
static void pack_keys(const HeadRows *keys, int64_t head_dim, int64_t first_key, uint16_t *packed) {
    int64_t chunks = head_dim / 32;
    packed += (first_key / 16) * chunks * 16 * 32;
    int64_t valid = keys->count - first_key, skipped = keys->first - first_key;
    if (valid <= 0 || skipped >= 16) { /* no row to read, nor a block id to look up */
        memset(packed, 0, (size_t)(head_dim / 2) * 32 * sizeof(uint16_t));
        return;
    }
    const uint16_t *first_row = head_row(keys, first_key);
    for (int64_t chunk = 0; chunk < chunks; chunk++) {
        __m512i rows[16];
        for (int64_t k = 0; k < 16; k++) {
            rows[k] = k < valid && k >= skipped ? _mm512_loadu_si512(first_row + k * keys->row_stride + chunk * 32)
                                                : _mm512_setzero_si512();
        }
        transpose_16x16(rows);
        for (int64_t pair = 0; pair < 16; pair++) {
            _mm512_storeu_si512(packed + (chunk * 16 + pair) * 32, rows[pair]);
        }
    }
}

/* V as B tiles: for 32 keys (from `first_key`) and 16 dims, 16 rows of (key pair) x (16 dims
 * x 2), keys past the last zero: each row two keys' 16 dims, interleaved. `packed` is the KV
 * head's packed values. */
static void pack_values(const HeadRows *values, int64_t head_dim, int64_t first_key, uint16_t *packed) {
    int64_t dim_tiles = head_dim / 16;
    packed += (first_key / TILE_KEYS) * dim_tiles * 16 * 32;
    static const uint16_t interleave[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                            8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
    static const uint16_t zeros[PREFILL_MAX_HEAD_DIM];
    __m512i order = _mm512_loadu_si512(interleave);
    /* Each 16 keys lie in one block (block_size a multiple of 16): their rows from the 16's first
     * (looked up once, as pack_keys does), where a lookup per key took a division each. */
    const uint16_t *group_rows[TILE_KEYS / 16];
    for (int64_t g = 0; g < TILE_KEYS / 16; g++) {
        int64_t start = first_key + 16 * g;
        group_rows[g] = start < values->count && start + 16 > values->first ? head_row(values, start) : NULL;
    }
    for (int64_t key_pair = 0; key_pair < TILE_KEYS / 2; key_pair++) {
        int64_t even = first_key + 2 * key_pair, group = 2 * key_pair / 16, in_group = 2 * key_pair % 16;
        const uint16_t *even_row = even < values->count && even >= values->first
                                       ? group_rows[group] + in_group * values->row_stride
                                       : zeros;
        const uint16_t *odd_row = even + 1 < values->count && even + 1 >= values->first
                                      ? group_rows[group] + (in_group + 1) * values->row_stride
                                      : zeros;
        for (int64_t t = 0; t < dim_tiles; t++) {
            __m512i low = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(even_row + t * 16)));
            __m512i high = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(odd_row + t * 16)));
            _mm512_storeu_si512(packed + (t * 16 + key_pair) * 32, _mm512_permutex2var_epi16(low, order, high));
        }
    }
}

/* The K and V rows of the KEY_BLOCK keys from `first_key` of one KV head fetched toward L2 (keys
 * and values share first and count). Inlined: GCC drops a call to a function whose only effect
 * is prefetching, as it would a pure one's. */
static inline __attribute__((always_inline)) void prefetch_key_block(const HeadRows *keys, const HeadRows *values,
                                                                     int64_t head_dim, int64_t first_key) {
    for (int64_t start = first_key; start < first_key + KEY_BLOCK; start += 16) {
        if (start >= keys->count || start + 16 <= keys->first) {
            continue;
        }
        /* 16 keys lie in one block: their rows from the first's, one lookup per 16 */
        const char *key_rows = (const char *)head_row(keys, start), *value_rows = (const char *)head_row(values, start);
        int64_t begin = keys->first > start ? keys->first - start : 0;
        int64_t end = keys->count - start < 16 ? keys->count - start : 16;
        for (int64_t k = begin; k < end; k++) {
            for (int64_t offset = 0; offset < head_dim * (int64_t)sizeof(uint16_t); offset += 64) {
                _mm_prefetch(key_rows + k * keys->row_stride * (int64_t)sizeof(uint16_t) + offset, _MM_HINT_T1);
                _mm_prefetch(value_rows + k * values->row_stride * (int64_t)sizeof(uint16_t) + offset, _MM_HINT_T1);
            }
        }
    }
}

/* The KEY_BLOCK keys from `first_key` of one KV head, both packings, with the next block's rows
 * fetched meanwhile: a paged context's rows lie scattered over the cache, where the hardware's
 * prefetchers do not follow them (SmolLM2's decode rows: 0.8x the time). */
static void pack_key_block(const HeadRows *keys, const HeadRows *values, int64_t head_dim, int64_t first_key,
                           uint16_t *packed_keys, uint16_t *packed_values) {
    prefetch_key_block(keys, values, head_dim, first_key + KEY_BLOCK);
    for (int64_t key = first_key; key < first_key + KEY_BLOCK; key += 16) {
        pack_keys(keys, head_dim, key, packed_keys);
    }
    for (int64_t key = first_key; key < first_key + KEY_BLOCK; key += TILE_KEYS) {
        pack_values(values, head_dim, key, packed_values);
    }
}

/* The first key a query at `position` sees: its window's first, or 0 without a window. */
static inline int64_t window_first_key(int64_t position, int64_t window) {
    return window > 0 && position - window + 1 > 0 ? position - window + 1 : 0;
}

/* Work items of KEY_BLOCK keys of one KV head, spread over the threads: those from the block
 * holding the first query's window on. */
static void pack_share(const PrefillProblem *p, int thread_index, int num_threads) {
    int64_t first_key = window_first_key(p->num_keys - p->num_queries, p->window);
    int64_t first_block = first_key / KEY_BLOCK, blocks = p->padded_keys / KEY_BLOCK - first_block;
    for (int64_t item = thread_index; item < p->num_kv_heads * blocks; item += num_threads) {
        int64_t kv_head = item / blocks, block_key = (item % blocks + first_block) * KEY_BLOCK;
        HeadRows keys = {p->key + kv_head * p->head_dim, p->key_row_stride, NULL, 0, first_key, p->num_keys};
        HeadRows values = {p->value + kv_head * p->head_dim, p->value_row_stride, NULL, 0, first_key, p->num_keys};
        int64_t offset = kv_head * p->padded_keys * p->head_dim;
        pack_key_block(&keys, &values, p->head_dim, block_key, p->packed_keys + offset, p->packed_values + offset);
    }
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* 1 when the OS lets this process use the tile registers (built only for CPUs with AMX). */
int ft_amx_available(void) {
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}


/* scores [32 x 32] (row stride `score_stride`) = Q block [32 x head_dim] . K^T for keys
 * 32 * key_tile ..+32, on tiles 0-3 (C), 4-5 (A: queries), 6-7 (B: keys); the first 16 rows only
 * (tiles 0, 1 and 4) unless `second_half`: a block of up to 16 queries (a decode row's query heads
 * of one KV head) skips half the products, and each row's arithmetic is its own either way. */
static void score_tile(const uint16_t *queries, int64_t head_dim, const uint16_t *packed_keys, int64_t key_tile,
                       float *scores, int64_t score_stride, int second_half) {
    int64_t chunks = head_dim / 32;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t c = 0; c < chunks; c++) {
        _tile_loadd(4, queries + c * 32, head_dim * 2);
        _tile_loadd(6, packed_keys + ((2 * key_tile) * chunks + c) * 16 * 32, 64);
        _tile_loadd(7, packed_keys + ((2 * key_tile + 1) * chunks + c) * 16 * 32, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (second_half) {
            _tile_loadd(5, queries + 16 * head_dim + c * 32, head_dim * 2);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
    _tile_stored(0, scores, score_stride * 4);
    _tile_stored(1, scores + 16, score_stride * 4);
    if (second_half) {
        _tile_stored(2, scores + 16 * score_stride, score_stride * 4);
        _tile_stored(3, scores + 16 * score_stride + 16, score_stride * 4);
    }
}

/* products [32 x 32] = P [32 x KEY_BLOCK keys] . V [those keys x dims 32 * pass ..+32]; the first
 * 16 rows only unless `second_half`, as score_tile. */
static void weigh_tiles(const uint16_t *probabilities, const uint16_t *packed_values, int64_t dim_tiles,
                        int64_t first_key_tile, int64_t pass, float *products, int second_half) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t k = 0; k < KEY_BLOCK / TILE_KEYS; k++) {
        const uint16_t *values = packed_values + ((first_key_tile + k) * dim_tiles + 2 * pass) * 16 * 32;
        _tile_loadd(4, probabilities + k * TILE_KEYS, KEY_BLOCK * 2);
        _tile_loadd(6, values, 64);
        _tile_loadd(7, values + 16 * 32, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (second_half) {
            _tile_loadd(5, probabilities + 16 * KEY_BLOCK + k * TILE_KEYS, KEY_BLOCK * 2);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
    _tile_stored(0, products, 128);
    _tile_stored(1, products + 16, 128);
    if (second_half) {
        _tile_stored(2, products + 16 * 32, 128);
        _tile_stored(3, products + 16 * 32 + 16, 128);
    }
}

#endif


/* 2^x for 16 floats: 2^n * 2^f, |f| <= 1/2, 2^f by its degree-4 Taylor polynomial
 * (relative error ~4e-5, a hundredth of the bf16 rounding the probabilities then take);
 * 2^n built in the exponent bits (VSCALEFPS is slow on some CPUs). x <= -127, a masked score
 * (-1e30) among them, gives exactly 0; x stays below 128 here (scores minus their max). */
static inline __m512 exp2_16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-127.0f));
    __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT);
    __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(9.61812911e-3f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.55041087e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.40226507e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.93147181e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    __m512i biased = _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127));
    return _mm512_mul_ps(p, _mm512_castsi512_ps(_mm512_slli_epi32(biased, 23)));
}

/* Raw scores s of one row taken as C tanh(s scale / C) / scale (so scaled, C tanh(s scale / C)),
 * tanh as 1 - 2 / (2^(2 x log2 e) + 1), its exponent clamped where tanh is +-1 in float32. */
static void softcap_row(float *row, float scale, float softcap) {
    __m512 inner = _mm512_set1_ps(2.0f * 1.44269504f * scale / softcap), outer = _mm512_set1_ps(softcap / scale);
    __m512 one = _mm512_set1_ps(1.0f), two = _mm512_set1_ps(2.0f), limit = _mm512_set1_ps(126.0f);
    for (int64_t v = 0; v < KEY_BLOCK / 16; v++) {
        __m512 exponent = _mm512_min_ps(_mm512_mul_ps(_mm512_loadu_ps(row + 16 * v), inner), limit);
        __m512 tanh = _mm512_sub_ps(one, _mm512_div_ps(two, _mm512_add_ps(exp2_16(exponent), one)));
        _mm512_storeu_ps(row + 16 * v, _mm512_mul_ps(tanh, outer));
    }
}

/* Online softmax over one block of raw scores [QUERY_BLOCK x KEY_BLOCK] (not yet scaled) of
 * the first `rows` queries: keys past each row's causal limit count as absent; updates the
 * running max (of scaled scores), adds the block's exponentials to each row's running sum
 * vector (reduced once, at the end), writes bf16 probabilities and the factor that rescales
 * each row's earlier output. */
static void softmax_block(float *scores, int64_t rows, int64_t first_position, int64_t position_step,
                          int64_t first_key, int64_t num_keys, int64_t window, float softcap, float scale,
                          float *row_max, float *row_sums, float *rescale, uint16_t *probabilities) {
    const float log2e = 1.44269504f;
    __m512 masked = _mm512_set1_ps(MASKED_SCORE), scale_log2e = _mm512_set1_ps(scale * log2e);
    float block_max[QUERY_BLOCK] __attribute__((aligned(64)));
    for (int64_t r = 0; r < rows; r++) {
        float *row = scores + r * KEY_BLOCK;
        if (softcap > 0.0f) { /* before the mask: masked scores stay below every capped one */
            softcap_row(row, scale, softcap);
        }
        int64_t position = first_position + r * position_step;
        int64_t skipped = window_first_key(position, window) - first_key; /* before its window */
        /* Rows whose causal limit falls inside this block see masked scores; the rest see all. */
        if (position < first_key + KEY_BLOCK - 1 || first_key + KEY_BLOCK > num_keys || skipped > 0) {
            int64_t last_key = position;
            last_key = last_key < num_keys - 1 ? last_key : num_keys - 1;
            int64_t valid = last_key - first_key + 1;
            for (int64_t v = 0; v < KEY_BLOCK / 16; v++) {
                __m512 raw = _mm512_loadu_ps(row + 16 * v);
                __mmask16 seen = valid_lanes(valid, 16 * v) & (__mmask16)~valid_lanes(skipped, 16 * v);
                _mm512_storeu_ps(row + 16 * v, _mm512_mask_mov_ps(masked, seen, raw));
            }
        }
        __m512 maximum = _mm512_max_ps(_mm512_loadu_ps(row), _mm512_loadu_ps(row + 16));
        for (int64_t v = 2; v < KEY_BLOCK / 16; v++) {
            maximum = _mm512_max_ps(maximum, _mm512_loadu_ps(row + 16 * v));
        }
        block_max[r] = _mm512_reduce_max_ps(maximum) * scale; /* scale > 0: the max commutes */
    }
    for (int64_t r = rows; r < QUERY_BLOCK; r++) {
        block_max[r] = MASKED_SCORE;
    }
    for (int64_t r = 0; r < rows; r += 16) {
        __m512 old_max = _mm512_loadu_ps(row_max + r);
        __m512 updated = _mm512_max_ps(old_max, _mm512_loadu_ps(block_max + r));
        _mm512_storeu_ps(rescale + r, exp2_16(_mm512_mul_ps(_mm512_sub_ps(old_max, updated), _mm512_set1_ps(log2e))));
        _mm512_storeu_ps(row_max + r, updated);
    }
    for (int64_t r = 0; r < rows; r++) {
        const float *row = scores + r * KEY_BLOCK;
        /* e^(s * scale - max) = 2^(s * scale * log2e - max * log2e): one FMA before exp2. */
        __m512 shift = _mm512_set1_ps(-row_max[r] * log2e);
        __m512 sum = _mm512_mul_ps(_mm512_loadu_ps(row_sums + 16 * r), _mm512_set1_ps(rescale[r]));
        for (int64_t v = 0; v < KEY_BLOCK / 16; v += 2) {
            __m512 low = exp2_16(_mm512_fmadd_ps(_mm512_loadu_ps(row + 16 * v), scale_log2e, shift));
            __m512 high = exp2_16(_mm512_fmadd_ps(_mm512_loadu_ps(row + 16 * v + 16), scale_log2e, shift));
            sum = _mm512_add_ps(sum, _mm512_add_ps(low, high));
            _mm512_storeu_si512(probabilities + r * KEY_BLOCK + 16 * v, (__m512i)_mm512_cvtne2ps_pbh(high, low));
        }
        _mm512_storeu_ps(row_sums + 16 * r, sum);
    }
}

/* Scores of `group` queries from row `q` (group a compile-time constant at each call site, so
 * the sums stay in registers): each query dim pair, broadcast, meets 16 keys' pairs. A row's
 * sums take the same instructions in the same order whatever the group. */
static inline __attribute__((always_inline)) void score_rows(const uint16_t *queries, int64_t head_dim,
                                                             const uint16_t *packed_keys, int64_t first_key_tile,
                                                             float *scores, int64_t q, const int group) {
    int64_t chunks = head_dim / 32, first_vector = 2 * first_key_tile;
    __m512 sums[4][KEY_BLOCK / 16];
    for (int i = 0; i < group; i++) {
        for (int v = 0; v < KEY_BLOCK / 16; v++) {
            sums[i][v] = _mm512_setzero_ps();
        }
    }
    for (int64_t chunk = 0; chunk < chunks; chunk++) {
        /* rows of 16 keys x one dim pair, 16 pairs per chunk of 32 dims (see pack_keys) */
        const uint16_t *key_rows[KEY_BLOCK / 16];
        for (int v = 0; v < KEY_BLOCK / 16; v++) {
            key_rows[v] = packed_keys + ((first_vector + v) * chunks + chunk) * 16 * 32;
        }
        const uint16_t *query_dims = queries + q * head_dim + chunk * 32;
        for (int64_t pair = 0; pair < 16; pair++) {
            __m512bh keys[KEY_BLOCK / 16];
            for (int v = 0; v < KEY_BLOCK / 16; v++) {
                keys[v] = (__m512bh)_mm512_loadu_si512(key_rows[v] + pair * 32);
            }
            for (int i = 0; i < group; i++) {
                int32_t query_pair;
                memcpy(&query_pair, query_dims + i * head_dim + 2 * pair, sizeof query_pair);
                __m512bh broadcast = (__m512bh)_mm512_set1_epi32(query_pair);
                for (int v = 0; v < KEY_BLOCK / 16; v++) {
                    sums[i][v] = _mm512_dpbf16_ps(sums[i][v], broadcast, keys[v]);
                }
            }
        }
    }
    for (int i = 0; i < group; i++) {
        for (int v = 0; v < KEY_BLOCK / 16; v++) {
            _mm512_storeu_ps(scores + (q + i) * KEY_BLOCK + 16 * v, sums[i][v]);
        }
    }
}

/* scores [rows x KEY_BLOCK] = Q block . K^T for keys 32 * first_key_tile ..+KEY_BLOCK, on
 * VDPBF16PS: 4 queries x 64 keys of sums at a time, a lone query for the last few. */
static void score_block_vector(const uint16_t *queries, int64_t rows, int64_t head_dim, const uint16_t *packed_keys,
                               int64_t first_key_tile, float *scores) {
    int64_t q = 0;
    for (; q + 4 <= rows; q += 4) {
        score_rows(queries, head_dim, packed_keys, first_key_tile, scores, q, 4);
    }
    for (; q < rows; q++) {
        score_rows(queries, head_dim, packed_keys, first_key_tile, scores, q, 1);
    }
}

/* Products of `group` queries from row `q` (a compile-time constant at each call site): each
 * probability key pair, broadcast, meets 16 dims of both keys' values. A row's sums take the
 * same instructions in the same order whatever the group. */
static inline __attribute__((always_inline)) void weigh_rows(const uint16_t *probabilities,
                                                             const uint16_t *packed_values, int64_t dim_tiles,
                                                             int64_t first_key_tile, int64_t pass, float *products,
                                                             int64_t q, const int group) {
    __m512 sums[8][2];
    for (int i = 0; i < group; i++) {
        sums[i][0] = sums[i][1] = _mm512_setzero_ps();
    }
    const uint16_t *rows = probabilities + q * KEY_BLOCK;
    for (int64_t tile = 0; tile < KEY_BLOCK / TILE_KEYS; tile++) {
        const uint16_t *low_values = packed_values + ((first_key_tile + tile) * dim_tiles + 2 * pass) * 16 * 32;
        const uint16_t *high_values = low_values + 16 * 32;
        const uint16_t *tile_rows = rows + tile * TILE_KEYS;
        for (int64_t key_pair = 0; key_pair < 16; key_pair++) {
            __m512bh low = (__m512bh)_mm512_loadu_si512(low_values + key_pair * 32);
            __m512bh high = (__m512bh)_mm512_loadu_si512(high_values + key_pair * 32);
            for (int i = 0; i < group; i++) {
                int32_t probability_pair;
                memcpy(&probability_pair, tile_rows + i * KEY_BLOCK + 2 * key_pair, sizeof probability_pair);
                __m512bh broadcast = (__m512bh)_mm512_set1_epi32(probability_pair);
                sums[i][0] = _mm512_dpbf16_ps(sums[i][0], broadcast, low);
                sums[i][1] = _mm512_dpbf16_ps(sums[i][1], broadcast, high);
            }
        }
    }
    for (int i = 0; i < group; i++) {
        _mm512_storeu_ps(products + (q + i) * 32, sums[i][0]);
        _mm512_storeu_ps(products + (q + i) * 32 + 16, sums[i][1]);
    }
}

/* products [rows x 32] = P [rows x KEY_BLOCK keys] . V [those keys x dims 32 * pass ..+32], on
 * VDPBF16PS: 8 queries x 32 dims of sums at a time, a lone query for the last few. */
static void weigh_block_vector(const uint16_t *probabilities, int64_t rows, const uint16_t *packed_values,
                               int64_t dim_tiles, int64_t first_key_tile, int64_t pass, float *products) {
    int64_t q = 0;
    for (; q + 8 <= rows; q += 8) {
        weigh_rows(probabilities, packed_values, dim_tiles, first_key_tile, pass, products, q, 8);
    }
    for (; q < rows; q++) {
        weigh_rows(probabilities, packed_values, dim_tiles, first_key_tile, pass, products, q, 1);
    }
}

/* The two products of a block, on tiles (all QUERY_BLOCK rows) where `use_amx`. */
static void score_block(const QueryBlock *b, const uint16_t *queries, int64_t first_key_tile, float *scores) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if (b->use_amx) {
        for (int64_t k = 0; k < KEY_BLOCK / TILE_KEYS; k++) {
            score_tile(queries, b->head_dim, b->packed_keys, first_key_tile + k, scores + k * TILE_KEYS, KEY_BLOCK,
                       b->rows > 16);
        }
        return;
    }
#endif
    score_block_vector(queries, b->rows, b->head_dim, b->packed_keys, first_key_tile, scores);
}

static void weigh_block(const QueryBlock *b, const uint16_t *probabilities, int64_t first_key_tile, int64_t pass,
                        float *products) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if (b->use_amx) {
        weigh_tiles(probabilities, b->packed_values, b->head_dim / 16, first_key_tile, pass, products, b->rows > 16);
        return;
    }
#endif
    weigh_block_vector(probabilities, b->rows, b->packed_values, b->head_dim / 16, first_key_tile, pass, products);
}

static void attend_query_block(const QueryBlock *b) {
    int64_t head_dim = b->head_dim, rows = b->rows;
    uint16_t queries[QUERY_BLOCK * PREFILL_MAX_HEAD_DIM] __attribute__((aligned(64)));
    uint16_t probabilities[QUERY_BLOCK * KEY_BLOCK] __attribute__((aligned(64)));
    float scores[QUERY_BLOCK * KEY_BLOCK] __attribute__((aligned(64)));
    float products[QUERY_BLOCK * 32] __attribute__((aligned(64)));
    float output[QUERY_BLOCK * PREFILL_MAX_HEAD_DIM] __attribute__((aligned(64)));
    float row_max[QUERY_BLOCK] __attribute__((aligned(64)));
    float row_sums[QUERY_BLOCK * 16] __attribute__((aligned(64)));
    float rescale[QUERY_BLOCK] __attribute__((aligned(64)));
    /* Tiles read 16 or all QUERY_BLOCK rows of queries; the vector path only the block's own. */
    int64_t query_rows = b->use_amx ? (rows > 16 ? QUERY_BLOCK : 16) : rows;
    for (int64_t r = 0; r < query_rows; r++) {
        uint16_t *destination = queries + r * head_dim;
        if (r < rows) {
            memcpy(destination, b->queries + r * b->query_stride, (size_t)head_dim * 2);
        } else {
            memset(destination, 0, (size_t)head_dim * 2);
        }
    }
    for (int64_t r = 0; r < QUERY_BLOCK; r++) {
        row_max[r] = MASKED_SCORE;
    }
    memset(row_sums, 0, (size_t)rows * 16 * sizeof(float));
    memset(output, 0, (size_t)(rows * head_dim) * sizeof(float));
    int64_t last_key = b->first_position + (rows - 1) * b->position_step;
    int64_t num_key_blocks = (last_key < b->num_keys ? last_key : b->num_keys - 1) / KEY_BLOCK + 1;
    int64_t first_key_block = window_first_key(b->first_position, b->window) / KEY_BLOCK;
    for (int64_t key_block = first_key_block; key_block < num_key_blocks; key_block++) {
        int64_t first_key_tile = key_block * (KEY_BLOCK / TILE_KEYS);
        score_block(b, queries, first_key_tile, scores);
        softmax_block(scores, rows, b->first_position, b->position_step, key_block * KEY_BLOCK, b->num_keys,
                      b->window, b->softcap, b->scale, row_max, row_sums, rescale, probabilities);
        for (int64_t pass = 0; pass < head_dim / 32; pass++) {
            weigh_block(b, probabilities, first_key_tile, pass, products);
            for (int64_t r = 0; r < rows; r++) {
                float *out_row = output + r * head_dim + pass * 32;
                __m512 factor = _mm512_set1_ps(rescale[r]);
                for (int64_t d = 0; d < 32; d += 16) {
                    __m512 product = _mm512_loadu_ps(products + r * 32 + d);
                    _mm512_storeu_ps(out_row + d, _mm512_fmadd_ps(_mm512_loadu_ps(out_row + d), factor, product));
                }
            }
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        float inverse_sum = 1.0f / _mm512_reduce_add_ps(_mm512_loadu_ps(row_sums + 16 * r));
        uint16_t *destination = b->out + r * b->out_stride;
        for (int64_t d = 0; d < head_dim; d++) {
            destination[d] = float_to_bf16(output[r * head_dim + d] * inverse_sum);
        }
    }
}

static void begin_tiles(int use_amx) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if (use_amx) {
        configure_full_tiles();
    }
#endif
    (void)use_amx;
}

static void end_tiles(int use_amx) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if (use_amx) {
        _tile_release();
    }
#endif
    (void)use_amx;
}

static void attend_share(const PrefillProblem *p, int thread_index, int num_threads) {
    begin_tiles(p->use_amx);
    int64_t query_blocks = (p->num_queries + QUERY_BLOCK - 1) / QUERY_BLOCK;
    int64_t head_dim = p->head_dim, group = p->num_heads / p->num_kv_heads;
    for (int64_t item = thread_index; item < query_blocks * p->num_heads; item += num_threads) {
        int64_t head = item % p->num_heads, first_query = (item / p->num_heads) * QUERY_BLOCK;
        int64_t kv_offset = (head / group) * p->padded_keys * head_dim;
        int64_t rows = p->num_queries - first_query < QUERY_BLOCK ? p->num_queries - first_query : QUERY_BLOCK;
        QueryBlock block = {p->query + first_query * p->query_row_stride + head * head_dim, p->query_row_stride, rows,
                            first_query + p->num_keys - p->num_queries, 1, p->num_keys, p->window, p->softcap,
                            p->packed_keys + kv_offset,
                            p->packed_values + kv_offset, head_dim, p->scale, p->use_amx,
                            p->out + (first_query * p->num_heads + head) * head_dim, p->num_heads * head_dim};
        attend_query_block(&block);
    }
    end_tiles(p->use_amx);
}

/* query [num_queries, num_heads, head_dim], key and value [num_keys, num_kv_heads, head_dim]
 * (heads contiguous, rows strided), out contiguous [num_queries, num_heads, head_dim], all
 * bf16; head_dim a multiple of 32 up to PREFILL_MAX_HEAD_DIM; window >= 0 (0: none; else keys
 * before the first query's window are never read); softcap >= 0 (0: none); num_threads >= 1;
 * use_amx only where ft_amx_available said 1. Returns FT_OUT_OF_MEMORY when out of memory. */
FtStatus ft_prefill_attention(const void *query, int64_t query_row_stride, const void *key, int64_t key_row_stride,
                              const void *value, int64_t value_row_stride, int64_t num_queries, int64_t num_keys,
                              int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, float scale,
                              int64_t window, float softcap, void *out, int num_threads, int use_amx) {
    int64_t padded_keys = (num_keys + KEY_BLOCK - 1) / KEY_BLOCK * KEY_BLOCK;
    size_t packed_elements = (size_t)(num_kv_heads * padded_keys * head_dim);
    uint16_t *packed = aligned_alloc(64, (2 * packed_elements * sizeof(uint16_t) + 63) / 64 * 64);
    if (packed == NULL) {
        return FT_OUT_OF_MEMORY;
    }
    PrefillProblem problem = {query, query_row_stride, key, key_row_stride, value, value_row_stride,
                              num_queries, num_keys, num_heads, num_kv_heads, head_dim, scale, out,
                              packed, packed + packed_elements, padded_keys, window, softcap, use_amx};
    /* OpenMP resolves to the runtime torch already loaded: its threads, not a second pool
     * competing with them for the cores. */
#pragma omp parallel num_threads(num_threads)
    {
        int thread_index = omp_get_thread_num(), team = omp_get_num_threads();
        pack_share(&problem, thread_index, team);
#pragma omp barrier
        attend_share(&problem, thread_index, team);
    }
    free(packed);
    return FT_OK;
}

/* Decode rows attending through block tables: what ft_decode_attention_as_prefill's two ways
 * of splitting the work share. */
typedef struct {
    const uint16_t *query;
    int64_t query_stride;
    const uint16_t *kv_cache;
    int64_t num_slots;
    const int64_t *block_table;
    int64_t max_blocks;
    const int64_t *seq_lens;
    int64_t block_size, rows, num_heads, num_kv_heads, head_dim;
    float scale;
    int64_t window;
    float softcap;
    uint16_t *out;
    int use_amx;
} PagedDecodes;

static int64_t padded_length(const PagedDecodes *d, int64_t row) {
    return (d->seq_lens[row] + KEY_BLOCK - 1) / KEY_BLOCK * KEY_BLOCK;
}

/* Packs KEY_BLOCK keys from `first_key` of row `row`'s context at `kv_head` into that head's
 * packed keys and values; nothing for a block wholly before the row's window, which it never reads. */
static void pack_paged_block(const PagedDecodes *d, int64_t row, int64_t kv_head, int64_t first_key,
                             uint16_t *packed_keys, uint16_t *packed_values) {
    int64_t kv_width = d->num_kv_heads * d->head_dim, seq_len = d->seq_lens[row];
    int64_t first_seen = window_first_key(seq_len - 1, d->window);
    if (first_key + KEY_BLOCK <= first_seen) {
        return;
    }
    const int64_t *blocks = d->block_table + row * d->max_blocks;
    HeadRows keys = {d->kv_cache + kv_head * d->head_dim, kv_width, blocks, d->block_size, first_seen, seq_len};
    HeadRows values = {d->kv_cache + d->num_slots * kv_width + kv_head * d->head_dim, kv_width, blocks,
                       d->block_size, first_seen, seq_len};
    pack_key_block(&keys, &values, d->head_dim, first_key, packed_keys, packed_values);
}

/* Row `row`'s query heads that read `kv_head` over its packed context, in blocks of up to
 * QUERY_BLOCK heads: each the last position of a prefill. */
static void attend_paged_group(const PagedDecodes *d, int64_t row, int64_t kv_head, const uint16_t *packed_keys,
                               const uint16_t *packed_values) {
    int64_t seq_len = d->seq_lens[row], group = d->num_heads / d->num_kv_heads;
    for (int64_t first = 0; first < group; first += QUERY_BLOCK) {
        int64_t head = kv_head * group + first;
        QueryBlock block = {d->query + row * d->query_stride + head * d->head_dim, d->head_dim,
                            group - first < QUERY_BLOCK ? group - first : QUERY_BLOCK, seq_len - 1, 0, seq_len,
                            d->window, d->softcap, packed_keys, packed_values, d->head_dim, d->scale, d->use_amx,
                            d->out + (row * d->num_heads + head) * d->head_dim, d->head_dim};
        attend_query_block(&block);
    }
}

/* Every context packed first (work split by KV head and key block), then every (row, head)
 * attends: balanced over the threads even for one row, while the packed contexts fit the
 * cores' caches. Returns FT_OUT_OF_MEMORY when out of memory. */
static FtStatus decode_in_two_phases(const PagedDecodes *d, int num_threads) {
    int64_t rows = d->rows, head_dim = d->head_dim;
    /* Row r's packed K (then V) of KV head h start at packed + offsets[r] + h * padded * head_dim. */
    int64_t *offsets = malloc((size_t)(2 * rows + 1) * sizeof(int64_t));
    if (offsets == NULL) {
        return FT_OUT_OF_MEMORY;
    }
    int64_t *first_items = offsets + rows + 1; /* row r's first packing item */
    offsets[0] = 0;
    int64_t num_items = 0;
    for (int64_t r = 0; r < rows; r++) {
        first_items[r] = num_items;
        num_items += d->num_kv_heads * padded_length(d, r) / KEY_BLOCK;
        offsets[r + 1] = offsets[r] + 2 * d->num_kv_heads * padded_length(d, r) * head_dim;
    }
    uint16_t *packed = aligned_alloc(64, ((size_t)offsets[rows] * sizeof(uint16_t) + 63) / 64 * 64);
    if (packed == NULL) {
        free(offsets);
        return FT_OUT_OF_MEMORY;
    }
#pragma omp parallel num_threads(num_threads) if (num_items * KEY_BLOCK * head_dim * d->num_heads >= 4 * PARALLEL_MIN_ELEMENTS)
    {
#pragma omp for schedule(static)
        for (int64_t item = 0; item < num_items; item++) {
            int64_t r = 0;
            while (r + 1 < rows && first_items[r + 1] <= item) {
                r++;
            }
            int64_t key_blocks = padded_length(d, r) / KEY_BLOCK, padded = padded_length(d, r);
            int64_t kv_head = (item - first_items[r]) / key_blocks;
            uint16_t *packed_keys = packed + offsets[r] + kv_head * padded * head_dim;
            pack_paged_block(d, r, kv_head, (item - first_items[r]) % key_blocks * KEY_BLOCK, packed_keys,
                             packed_keys + d->num_kv_heads * padded * head_dim);
        }
        begin_tiles(d->use_amx);
        /* dynamic: sequences of different lengths make items of different cost */
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < rows * d->num_kv_heads; item++) {
            int64_t r = item / d->num_kv_heads, kv_head = item % d->num_kv_heads, padded = padded_length(d, r);
            const uint16_t *packed_keys = packed + offsets[r] + kv_head * padded * head_dim;
            attend_paged_group(d, r, kv_head, packed_keys, packed_keys + d->num_kv_heads * padded * head_dim);
        }
        end_tiles(d->use_amx);
    }
    free(packed);
    free(offsets);
    return FT_OK;
}

/* Per (row, KV head): its context packed into this thread's scratch, then the query heads that
 * read it attend while it is still in this core's cache. Returns FT_OUT_OF_MEMORY when out of memory. */
static FtStatus decode_per_kv_head(const PagedDecodes *d, int num_threads, int64_t max_padded) {
    int64_t head_dim = d->head_dim;
    /* A thread takes a row's KV heads one after another where there are rows enough to share:
     * they lie side by side in each slot, so the lines the hardware fetches around one KV head's
     * keys and values serve the next. */
    int64_t chunk = d->rows >= 2 * num_threads ? d->num_kv_heads : 1;
    int all_allocated = 1;
#pragma omp parallel num_threads(num_threads) reduction(&& : all_allocated)
    {
        uint16_t *packed_keys = aligned_alloc(64, (size_t)(2 * max_padded * head_dim) * sizeof(uint16_t));
        all_allocated = packed_keys != NULL;
        if (all_allocated) {
            uint16_t *packed_values = packed_keys + max_padded * head_dim;
            begin_tiles(d->use_amx);
#pragma omp for schedule(dynamic, chunk) nowait
            for (int64_t item = 0; item < d->rows * d->num_kv_heads; item++) {
                int64_t r = item / d->num_kv_heads, kv_head = item % d->num_kv_heads;
                for (int64_t first_key = 0; first_key < padded_length(d, r); first_key += KEY_BLOCK) {
                    pack_paged_block(d, r, kv_head, first_key, packed_keys, packed_values);
                }
                attend_paged_group(d, r, kv_head, packed_keys, packed_values);
            }
            end_tiles(d->use_amx);
        }
        free(packed_keys);
    }
    return all_allocated ? FT_OK : FT_OUT_OF_MEMORY;
}

/* Packed contexts beyond this many bytes per thread no longer fit the cores' caches between
 * the packing and the attending: then each (row, KV head) is packed and attended in one go. */
#define TWO_PHASE_MAX_BYTES_PER_THREAD (1 << 20)

/* out [rows, num_heads, head_dim] = each row's single query (rows of query, query_stride
 * apart, heads contiguous) attending over its sequence's first seq_lens[r] keys, read through
 * block_table [rows, max_blocks] from one layer's bf16 cache [2, num_slots, kv_heads *
 * head_dim] (block_size a multiple of 16), with the prefill kernel's arithmetic: the bits a
 * prefill of the same tokens gives the query's position (window > 0: over its last `window`
 * keys, the blocks before them never read; softcap > 0: scaled scores soft-capped). Returns FT_OK, FT_OUT_OF_MEMORY,
 * or FT_OUT_OF_BOUNDS (touching nothing) when a block id or length lies outside the cache. */
FtStatus ft_decode_attention_as_prefill(const uint16_t *query, int64_t query_stride, const uint16_t *kv_cache,
                                        int64_t num_slots, const int64_t *block_table, int64_t max_blocks,
                                        const int64_t *seq_lens, int64_t block_size, int64_t rows, int64_t num_heads,
                                        int64_t num_kv_heads, int64_t head_dim, float scale, uint16_t *out,
                                        int num_threads, int64_t window, float softcap, int use_amx) {
    if (block_size % DECODE_AS_PREFILL_BLOCK_MULTIPLE != 0
        || !tables_in_bounds(num_slots, block_table, max_blocks, block_size, seq_lens, rows)) {
        return FT_OUT_OF_BOUNDS;
    }
    PagedDecodes decodes = {query, query_stride, kv_cache, num_slots, block_table, max_blocks, seq_lens, block_size,
                            rows, num_heads, num_kv_heads, head_dim, scale, window, softcap, out, use_amx};
    int64_t packed_bytes = 0, max_padded = 0;
    for (int64_t r = 0; r < rows; r++) {
        int64_t padded = padded_length(&decodes, r);
        packed_bytes += 2 * num_kv_heads * padded * head_dim * (int64_t)sizeof(uint16_t);
        max_padded = padded > max_padded ? padded : max_padded;
    }
    if (packed_bytes > (int64_t)num_threads * TWO_PHASE_MAX_BYTES_PER_THREAD) {
        return decode_per_kv_head(&decodes, num_threads, max_padded);
    }
    return decode_in_two_phases(&decodes, num_threads);
}
#endif
