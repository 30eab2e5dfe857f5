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
 * Built at run time by firsttoken/ops/native.py with the machine's C compiler.
 */
#define _GNU_SOURCE /* syscall() for the AMX permission */
#include "common.h"

#if VECTOR_BF16
#define QUERY_BLOCK 32
#define KEY_BLOCK 64
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
    int use_amx;
} PrefillProblem;

/* Lanes [0, valid) of a 16-lane vector starting at lane `first`. */
static inline __mmask16 valid_lanes(int64_t valid, int64_t first) {
    int64_t count = valid - first;
    return count <= 0 ? 0 : (count >= 16 ? 0xffff : (__mmask16)((1u << count) - 1));
}

/* K^T as B tiles: for 16 keys (from `first_key`) and 32 dims, 16 rows of (dim pair) x (16
 * keys x 2), keys past num_keys zero: each row one gather of the keys' dim pair. */
static void pack_keys(const PrefillProblem *p, int64_t kv_head, int64_t first_key) {
    int64_t chunks = p->head_dim / 32;
    uint16_t *packed = p->packed_keys + kv_head * p->padded_keys * p->head_dim + (first_key / 16) * chunks * 16 * 32;
    const uint16_t *rows = p->key + first_key * p->key_row_stride + kv_head * p->head_dim;
    __mmask16 valid = valid_lanes(p->num_keys, first_key);
    __m512i row_offsets = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                             _mm512_set1_epi32((int)p->key_row_stride));
    for (int64_t pair = 0; pair < p->head_dim / 2; pair++) {
        __m512i pairs = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), valid, row_offsets, rows + 2 * pair, 2);
        _mm512_storeu_si512(packed + pair * 32, pairs);
    }
}

/* V as B tiles: for 32 keys (from `first_key`) and 16 dims, 16 rows of (key pair) x (16 dims
 * x 2), keys past num_keys zero: each row two keys' 16 dims, interleaved. */
static void pack_values(const PrefillProblem *p, int64_t kv_head, int64_t first_key) {
    int64_t dim_tiles = p->head_dim / 16;
    uint16_t *packed = p->packed_values + kv_head * p->padded_keys * p->head_dim
                       + (first_key / TILE_KEYS) * dim_tiles * 16 * 32;
    static const uint16_t interleave[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                            8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
    __m512i order = _mm512_loadu_si512(interleave);
    for (int64_t key_pair = 0; key_pair < TILE_KEYS / 2; key_pair++) {
        int64_t even = first_key + 2 * key_pair;
        const uint16_t *even_row = p->value + even * p->value_row_stride + kv_head * p->head_dim;
        const uint16_t *odd_row = even_row + p->value_row_stride;
        __mmask16 even_valid = even < p->num_keys ? 0xffff : 0, odd_valid = even + 1 < p->num_keys ? 0xffff : 0;
        for (int64_t t = 0; t < dim_tiles; t++) {
            __m512i low = _mm512_castsi256_si512(_mm256_maskz_loadu_epi16(even_valid, even_row + t * 16));
            __m512i high = _mm512_castsi256_si512(_mm256_maskz_loadu_epi16(odd_valid, odd_row + t * 16));
            _mm512_storeu_si512(packed + (t * 16 + key_pair) * 32, _mm512_permutex2var_epi16(low, order, high));
        }
    }
}

/* Work items of KEY_BLOCK keys of one KV head, spread over the threads. */
static void pack_share(const PrefillProblem *p, int thread_index, int num_threads) {
    int64_t blocks = p->padded_keys / KEY_BLOCK;
    for (int64_t item = thread_index; item < p->num_kv_heads * blocks; item += num_threads) {
        int64_t kv_head = item / blocks, first_key = (item % blocks) * KEY_BLOCK;
        for (int64_t key = first_key; key < first_key + KEY_BLOCK; key += 16) {
            pack_keys(p, kv_head, key);
        }
        for (int64_t key = first_key; key < first_key + KEY_BLOCK; key += TILE_KEYS) {
            pack_values(p, kv_head, key);
        }
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

typedef struct {
    uint8_t palette_id;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

static void configure_tiles(void) {
    TileConfig config;
    memset(&config, 0, sizeof config);
    config.palette_id = 1;
    for (int tile = 0; tile < 8; tile++) {
        config.rows[tile] = 16;
        config.colsb[tile] = 64;
    }
    _tile_loadconfig(&config);
}

/* scores [32 x 32] (row stride `score_stride`) = Q block [32 x head_dim] . K^T for keys
 * 32 * key_tile ..+32, on tiles 0-3 (C), 4-5 (A: queries), 6-7 (B: keys). */
static void score_tile(const uint16_t *queries, int64_t head_dim, const uint16_t *packed_keys, int64_t key_tile,
                       float *scores, int64_t score_stride) {
    int64_t chunks = head_dim / 32;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t c = 0; c < chunks; c++) {
        _tile_loadd(4, queries + c * 32, head_dim * 2);
        _tile_loadd(5, queries + 16 * head_dim + c * 32, head_dim * 2);
        _tile_loadd(6, packed_keys + ((2 * key_tile) * chunks + c) * 16 * 32, 64);
        _tile_loadd(7, packed_keys + ((2 * key_tile + 1) * chunks + c) * 16 * 32, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, scores, score_stride * 4);
    _tile_stored(1, scores + 16, score_stride * 4);
    _tile_stored(2, scores + 16 * score_stride, score_stride * 4);
    _tile_stored(3, scores + 16 * score_stride + 16, score_stride * 4);
}

/* products [32 x 32] = P [32 x KEY_BLOCK keys] . V [those keys x dims 32 * pass ..+32]. */
static void weigh_tiles(const uint16_t *probabilities, const uint16_t *packed_values, int64_t dim_tiles,
                        int64_t first_key_tile, int64_t pass, float *products) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t k = 0; k < KEY_BLOCK / TILE_KEYS; k++) {
        const uint16_t *values = packed_values + ((first_key_tile + k) * dim_tiles + 2 * pass) * 16 * 32;
        _tile_loadd(4, probabilities + k * TILE_KEYS, KEY_BLOCK * 2);
        _tile_loadd(5, probabilities + 16 * KEY_BLOCK + k * TILE_KEYS, KEY_BLOCK * 2);
        _tile_loadd(6, values, 64);
        _tile_loadd(7, values + 16 * 32, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, products, 128);
    _tile_stored(1, products + 16, 128);
    _tile_stored(2, products + 16 * 32, 128);
    _tile_stored(3, products + 16 * 32 + 16, 128);
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

/* Online softmax over one block of raw scores [QUERY_BLOCK x KEY_BLOCK] (not yet scaled):
 * keys past each row's causal limit count as absent; updates the running max (of scaled
 * scores), adds the block's exponentials to each row's running sum vector (reduced once, at
 * the end), writes bf16 probabilities and the factor that rescales each row's earlier output. */
static void softmax_block(float *scores, int64_t first_query, int64_t first_key, int64_t causal_offset,
                          int64_t num_keys, float scale, float *row_max, float *row_sums, float *rescale,
                          uint16_t *probabilities) {
    const float log2e = 1.44269504f;
    __m512 masked = _mm512_set1_ps(MASKED_SCORE), scale_log2e = _mm512_set1_ps(scale * log2e);
    float block_max[QUERY_BLOCK] __attribute__((aligned(64)));
    /* Rows whose causal limit falls inside this block see masked scores; the rest see all. */
    int64_t first_partial_row = first_key + KEY_BLOCK - 1 - causal_offset - first_query;
    for (int64_t r = 0; r < QUERY_BLOCK; r++) {
        float *row = scores + r * KEY_BLOCK;
        if (r < first_partial_row || first_key + KEY_BLOCK > num_keys) {
            int64_t last_key = first_query + r + causal_offset;
            last_key = last_key < num_keys - 1 ? last_key : num_keys - 1;
            int64_t valid = last_key - first_key + 1;
            for (int64_t v = 0; v < KEY_BLOCK / 16; v++) {
                __m512 raw = _mm512_loadu_ps(row + 16 * v);
                _mm512_storeu_ps(row + 16 * v, _mm512_mask_mov_ps(masked, valid_lanes(valid, 16 * v), raw));
            }
        }
        __m512 maximum = _mm512_max_ps(_mm512_loadu_ps(row), _mm512_loadu_ps(row + 16));
        for (int64_t v = 2; v < KEY_BLOCK / 16; v++) {
            maximum = _mm512_max_ps(maximum, _mm512_loadu_ps(row + 16 * v));
        }
        block_max[r] = _mm512_reduce_max_ps(maximum) * scale; /* scale > 0: the max commutes */
    }
    for (int64_t r = 0; r < QUERY_BLOCK; r += 16) {
        __m512 old_max = _mm512_loadu_ps(row_max + r);
        __m512 updated = _mm512_max_ps(old_max, _mm512_loadu_ps(block_max + r));
        _mm512_storeu_ps(rescale + r, exp2_16(_mm512_mul_ps(_mm512_sub_ps(old_max, updated), _mm512_set1_ps(log2e))));
        _mm512_storeu_ps(row_max + r, updated);
    }
    for (int64_t r = 0; r < QUERY_BLOCK; r++) {
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

/* scores [QUERY_BLOCK x KEY_BLOCK] = Q block . K^T for keys 32 * first_key_tile ..+KEY_BLOCK,
 * on VDPBF16PS: each query dim pair, broadcast, meets 16 keys' pairs; 4 queries x 64 keys of
 * sums stay in registers. */
static void score_block_vector(const uint16_t *queries, int64_t head_dim, const uint16_t *packed_keys,
                               int64_t first_key_tile, float *scores) {
    int64_t chunks = head_dim / 32, first_vector = 2 * first_key_tile;
    for (int64_t q = 0; q < QUERY_BLOCK; q += 4) {
        __m512 sums[4][KEY_BLOCK / 16];
        for (int i = 0; i < 4; i++) {
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
                for (int i = 0; i < 4; i++) {
                    int32_t query_pair;
                    memcpy(&query_pair, query_dims + i * head_dim + 2 * pair, sizeof query_pair);
                    __m512bh broadcast = (__m512bh)_mm512_set1_epi32(query_pair);
                    for (int v = 0; v < KEY_BLOCK / 16; v++) {
                        sums[i][v] = _mm512_dpbf16_ps(sums[i][v], broadcast, keys[v]);
                    }
                }
            }
        }
        for (int i = 0; i < 4; i++) {
            for (int v = 0; v < KEY_BLOCK / 16; v++) {
                _mm512_storeu_ps(scores + (q + i) * KEY_BLOCK + 16 * v, sums[i][v]);
            }
        }
    }
}

/* products [32 x 32] = P [32 x KEY_BLOCK keys] . V [those keys x dims 32 * pass ..+32], on
 * VDPBF16PS: each probability key pair, broadcast, meets 16 dims of both keys' values; 8
 * queries x 32 dims of sums stay in registers. */
static void weigh_block_vector(const uint16_t *probabilities, const uint16_t *packed_values, int64_t dim_tiles,
                               int64_t first_key_tile, int64_t pass, float *products) {
    for (int64_t q = 0; q < QUERY_BLOCK; q += 8) {
        __m512 sums[8][2];
        for (int i = 0; i < 8; i++) {
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
                for (int i = 0; i < 8; i++) {
                    int32_t probability_pair;
                    memcpy(&probability_pair, tile_rows + i * KEY_BLOCK + 2 * key_pair, sizeof probability_pair);
                    __m512bh broadcast = (__m512bh)_mm512_set1_epi32(probability_pair);
                    sums[i][0] = _mm512_dpbf16_ps(sums[i][0], broadcast, low);
                    sums[i][1] = _mm512_dpbf16_ps(sums[i][1], broadcast, high);
                }
            }
        }
        for (int i = 0; i < 8; i++) {
            _mm512_storeu_ps(products + (q + i) * 32, sums[i][0]);
            _mm512_storeu_ps(products + (q + i) * 32 + 16, sums[i][1]);
        }
    }
}

/* The two products of a block, on tiles where `use_amx`. */
static void score_block(int use_amx, const uint16_t *queries, int64_t head_dim, const uint16_t *packed_keys,
                        int64_t first_key_tile, float *scores) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if (use_amx) {
        for (int64_t k = 0; k < KEY_BLOCK / TILE_KEYS; k++) {
            score_tile(queries, head_dim, packed_keys, first_key_tile + k, scores + k * TILE_KEYS, KEY_BLOCK);
        }
        return;
    }
#endif
    (void)use_amx;
    score_block_vector(queries, head_dim, packed_keys, first_key_tile, scores);
}

static void weigh_block(int use_amx, const uint16_t *probabilities, const uint16_t *packed_values, int64_t dim_tiles,
                        int64_t first_key_tile, int64_t pass, float *products) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if (use_amx) {
        weigh_tiles(probabilities, packed_values, dim_tiles, first_key_tile, pass, products);
        return;
    }
#endif
    (void)use_amx;
    weigh_block_vector(probabilities, packed_values, dim_tiles, first_key_tile, pass, products);
}

static void attend_query_block(const PrefillProblem *p, int64_t head, int64_t query_block) {
    int64_t head_dim = p->head_dim, group = p->num_heads / p->num_kv_heads, kv_head = head / group;
    int64_t causal_offset = p->num_keys - p->num_queries, first_query = query_block * QUERY_BLOCK;
    uint16_t queries[QUERY_BLOCK * PREFILL_MAX_HEAD_DIM] __attribute__((aligned(64)));
    uint16_t probabilities[QUERY_BLOCK * KEY_BLOCK] __attribute__((aligned(64)));
    float scores[QUERY_BLOCK * KEY_BLOCK] __attribute__((aligned(64)));
    float products[QUERY_BLOCK * 32] __attribute__((aligned(64)));
    float output[QUERY_BLOCK * PREFILL_MAX_HEAD_DIM] __attribute__((aligned(64)));
    float row_max[QUERY_BLOCK] __attribute__((aligned(64)));
    float row_sums[QUERY_BLOCK * 16] __attribute__((aligned(64)));
    float rescale[QUERY_BLOCK] __attribute__((aligned(64)));
    int64_t rows = p->num_queries - first_query < QUERY_BLOCK ? p->num_queries - first_query : QUERY_BLOCK;
    for (int64_t r = 0; r < QUERY_BLOCK; r++) {
        uint16_t *destination = queries + r * head_dim;
        if (r < rows) {
            memcpy(destination, p->query + (first_query + r) * p->query_row_stride + head * head_dim,
                   (size_t)head_dim * 2);
        } else {
            memset(destination, 0, (size_t)head_dim * 2);
        }
        row_max[r] = MASKED_SCORE;
    }
    memset(row_sums, 0, sizeof row_sums);
    memset(output, 0, sizeof output);
    const uint16_t *packed_keys = p->packed_keys + kv_head * p->padded_keys * head_dim;
    const uint16_t *packed_values = p->packed_values + kv_head * p->padded_keys * head_dim;
    int64_t last_key = first_query + rows - 1 + causal_offset;
    int64_t num_key_blocks = (last_key < p->num_keys ? last_key : p->num_keys - 1) / KEY_BLOCK + 1;
    for (int64_t key_block = 0; key_block < num_key_blocks; key_block++) {
        int64_t first_key_tile = key_block * (KEY_BLOCK / TILE_KEYS);
        score_block(p->use_amx, queries, head_dim, packed_keys, first_key_tile, scores);
        softmax_block(scores, first_query, key_block * KEY_BLOCK, causal_offset, p->num_keys, p->scale, row_max,
                      row_sums, rescale, probabilities);
        for (int64_t pass = 0; pass < head_dim / 32; pass++) {
            weigh_block(p->use_amx, probabilities, packed_values, head_dim / 16, first_key_tile, pass, products);
            for (int64_t r = 0; r < QUERY_BLOCK; r++) {
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
        uint16_t *destination = p->out + ((first_query + r) * p->num_heads + head) * head_dim;
        for (int64_t d = 0; d < head_dim; d++) {
            destination[d] = float_to_bf16(output[r * head_dim + d] * inverse_sum);
        }
    }
}

static void attend_share(const PrefillProblem *p, int thread_index, int num_threads) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if (p->use_amx) {
        configure_tiles();
    }
#endif
    int64_t query_blocks = (p->num_queries + QUERY_BLOCK - 1) / QUERY_BLOCK;
    for (int64_t item = thread_index; item < query_blocks * p->num_heads; item += num_threads) {
        attend_query_block(p, item % p->num_heads, item / p->num_heads);
    }
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if (p->use_amx) {
        _tile_release();
    }
#endif
}

/* query [num_queries, num_heads, head_dim], key and value [num_keys, num_kv_heads, head_dim]
 * (heads contiguous, rows strided), out contiguous [num_queries, num_heads, head_dim], all
 * bf16; head_dim a multiple of 32 up to PREFILL_MAX_HEAD_DIM; num_threads >= 1; use_amx only
 * where ft_amx_available said 1. Returns 0 when out of memory. */
int ft_prefill_attention(const void *query, int64_t query_row_stride, const void *key, int64_t key_row_stride,
                         const void *value, int64_t value_row_stride, int64_t num_queries, int64_t num_keys,
                         int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, float scale, void *out,
                         int num_threads, int use_amx) {
    int64_t padded_keys = (num_keys + KEY_BLOCK - 1) / KEY_BLOCK * KEY_BLOCK;
    size_t packed_elements = (size_t)(num_kv_heads * padded_keys * head_dim);
    uint16_t *packed = aligned_alloc(64, (2 * packed_elements * sizeof(uint16_t) + 63) / 64 * 64);
    if (packed == NULL) {
        return 0;
    }
    PrefillProblem problem = {query, query_row_stride, key, key_row_stride, value, value_row_stride,
                              num_queries, num_keys, num_heads, num_kv_heads, head_dim, scale, out,
                              packed, packed + packed_elements, padded_keys, use_amx};
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
    return 1;
}
#endif
