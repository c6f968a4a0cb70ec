/* The W4A16 encoder (int4_search.py's _search with the coarse-to-fine search) in one pass over the
 * groups, for CPUs: requant/formats/int4_search_c.py builds and calls it, int4_search.py's section comment
 * says what is computed.
 *
 * torch runs the same steps as a few dozen whole-tensor passes (lane gathers, windows, small matrix
 * products per chunk and per coarse winner, code gathers), most of a core's time going to memory
 * traffic and sorting. Here each group's counts, search and codes stay in registers and L1.
 *
 * The same bytes as torch: a group's key under candidate c is sum_r counts[r] * table[r][c], the
 * counts small integers and every table entry a whole number, every partial sum below 2^53; each
 * key is exact in float64 in any order of the additions (fused or not), and the minimum carries
 * the candidate's index. Scales go to BF16 the way torch does (to float, then round to nearest
 * even). The AVX2 path and the portable one differ in speed only.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define REQUANT_X86 1
#endif

enum { MAX_ROWS = 32, MAX_VECTORS = 64, MAX_PER_GROUP = 4, BLOCK_BYTES = 16 };

typedef struct {
    /* the search (int4_search._Tables.error, laid out by int4_search_c.Prepared) */
    const double *coarse;       /* [rows][n_coarse]: the coarse candidates' columns */
    int64_t n_coarse;           /* a multiple of 16 (the caller repeats a column to pad) */
    const double *table;        /* [rows][stride]: candidate z * n_s + s in column z * n_s + s */
    int64_t stride;             /* >= n_s * n_z + 4: a vector may read past the last candidate */
    int64_t n_s, n_z;           /* scales and zero points: n_s * n_z candidates */
    int64_t radius, z_radius;   /* the fine window: scale +- radius, zero point +- z_radius */
    int64_t tie;                /* a key is error * tie + candidate (tie a power of two) */
    int64_t rows;               /* n_bins + split + 1 (the candidate-index row) */
    int64_t n_bins, split;
    /* the encoding */
    const uint64_t *byte_lanes; /* [2][256]: lane words of a byte's two codes, positive then negative */
    const uint8_t *bytes;       /* [(d_max + 2) * candidates][256]: output byte per source byte */
    const float *s, *z;         /* [candidates]: scale s' and zero point of each */
    const int64_t *lane_squared; /* [8]: 4 * magnitude^2 of each lane */
    int64_t zero_index;         /* the candidate of all-zero groups (s' of index 0, z = 0) */
    int64_t d_max, empty, e8m0_bias, r_offset;
} requant_int4_tables;

typedef struct {
    int n;                  /* nonzero rows */
    int row[MAX_ROWS];
    double count[MAX_ROWS];
} group_counts;

static int64_t floor_half(int64_t v) { return v >= 0 ? v / 2 : -((1 - v) / 2); }

/* A lane word moved so that lane `first` lands in lane 0 (int4_search._window). */
static uint64_t window(uint64_t word, int64_t first)
{
    if (first >= 8 || first <= -8)
        return 0;
    return first >= 0 ? word >> (8 * first) : word << (-8 * first);
}

static uint16_t to_bf16(double value)
{
    const float f = (float)value;
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    return (uint16_t)((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);   /* never NaN here */
}

static int64_t pick_of(double key, int64_t tie) { return (int64_t)key & (tie - 1); }   /* floor modulo */

/* The fine window of a coarse winner: columns z * n_s + s0 .. + width - 1 for z0 <= z < z1. */
typedef struct {
    int64_t z0, z1, s0, width;
} window_t;

static window_t window_of(const requant_int4_tables *t, int64_t pick)
{
    const int64_t s = pick % t->n_s, z = pick / t->n_s;
    window_t w;
    w.z0 = z - t->z_radius < 0 ? 0 : z - t->z_radius;
    w.z1 = z + t->z_radius + 1 > t->n_z ? t->n_z : z + t->z_radius + 1;
    w.s0 = s - t->radius < 0 ? 0 : s - t->radius;
    w.width = (s + t->radius + 1 > t->n_s ? t->n_s : s + t->radius + 1) - w.s0;
    return w;
}

static double search_portable(const group_counts *g, const requant_int4_tables *t)
{
    double best = 0;
    for (int64_t c = 0; c < t->n_coarse; c++) {
        double key = 0;
        for (int i = 0; i < g->n; i++)
            key += g->count[i] * t->coarse[g->row[i] * t->n_coarse + c];
        best = c == 0 || key < best ? key : best;
    }
    const window_t w = window_of(t, pick_of(best, t->tie));
    for (int64_t z = w.z0; z < w.z1; z++)
        for (int64_t s = w.s0; s < w.s0 + w.width; s++) {
            double key = 0;
            for (int i = 0; i < g->n; i++)
                key += g->count[i] * t->table[g->row[i] * t->stride + z * t->n_s + s];
            best = key < best ? key : best;   /* the window holds the coarse winner: never above it */
        }
    return best;
}

#ifdef REQUANT_X86
#define AVX2 __attribute__((target("avx2,fma")))

AVX2 static inline double min_lanes(__m256d v)
{
    const __m128d m = _mm_min_pd(_mm256_castpd256_pd128(v), _mm256_extractf128_pd(v, 1));
    return _mm_cvtsd_f64(_mm_min_sd(m, _mm_unpackhi_pd(m, m)));
}

/* min over `vectors` (a multiple of 4) columns of 4 from table + first[j], lanes at or past
 * valid[j] ignored; row i of the group's nonzero ones at offset[i]. Four columns at a time, two
 * sums each: eight independent chains of fused multiply-adds. */
AVX2 static inline __m256d best_of(const double *table, const int64_t *first, const int64_t *valid, int vectors,
                                   const int64_t *offset, const __m256d *count, int n, __m256d best)
{
    const __m256d lane = _mm256_setr_pd(0, 1, 2, 3), inf = _mm256_set1_pd(__builtin_inf());
    for (int j = 0; j < vectors; j += 4) {
        const double *c0 = table + first[j], *c1 = table + first[j + 1], *c2 = table + first[j + 2],
                     *c3 = table + first[j + 3];
        __m256d a[8];
        for (int k = 0; k < 8; k++)
            a[k] = _mm256_setzero_pd();
        int i = 0;
        for (; i + 1 < n; i += 2) {
            const int64_t o0 = offset[i], o1 = offset[i + 1];
            a[0] = _mm256_fmadd_pd(count[i], _mm256_loadu_pd(c0 + o0), a[0]);
            a[1] = _mm256_fmadd_pd(count[i], _mm256_loadu_pd(c1 + o0), a[1]);
            a[2] = _mm256_fmadd_pd(count[i], _mm256_loadu_pd(c2 + o0), a[2]);
            a[3] = _mm256_fmadd_pd(count[i], _mm256_loadu_pd(c3 + o0), a[3]);
            a[4] = _mm256_fmadd_pd(count[i + 1], _mm256_loadu_pd(c0 + o1), a[4]);
            a[5] = _mm256_fmadd_pd(count[i + 1], _mm256_loadu_pd(c1 + o1), a[5]);
            a[6] = _mm256_fmadd_pd(count[i + 1], _mm256_loadu_pd(c2 + o1), a[6]);
            a[7] = _mm256_fmadd_pd(count[i + 1], _mm256_loadu_pd(c3 + o1), a[7]);
        }
        if (i < n) {
            const int64_t o0 = offset[i];
            a[0] = _mm256_fmadd_pd(count[i], _mm256_loadu_pd(c0 + o0), a[0]);
            a[1] = _mm256_fmadd_pd(count[i], _mm256_loadu_pd(c1 + o0), a[1]);
            a[2] = _mm256_fmadd_pd(count[i], _mm256_loadu_pd(c2 + o0), a[2]);
            a[3] = _mm256_fmadd_pd(count[i], _mm256_loadu_pd(c3 + o0), a[3]);
        }
        for (int k = 0; k < 4; k++) {
            const __m256d past = _mm256_cmp_pd(lane, _mm256_set1_pd((double)valid[j + k]), _CMP_GE_OQ);
            best = _mm256_min_pd(best, _mm256_blendv_pd(_mm256_add_pd(a[k], a[k + 4]), inf, past));
        }
    }
    return best;
}

AVX2 static double search_avx2(const group_counts *g, const requant_int4_tables *t)
{
    __m256d count[MAX_ROWS];
    int64_t coarse_offset[MAX_ROWS], offset[MAX_ROWS];
    int64_t coarse_first[MAX_VECTORS], coarse_valid[MAX_VECTORS], first[MAX_VECTORS], valid[MAX_VECTORS];
    const int coarse_vectors = (int)(t->n_coarse / 4);
    for (int j = 0; j < coarse_vectors; j++) {
        coarse_first[j] = 4 * j;
        coarse_valid[j] = 4;
    }
    for (int i = 0; i < g->n; i++) {
        count[i] = _mm256_set1_pd(g->count[i]);
        coarse_offset[i] = g->row[i] * t->n_coarse;
        offset[i] = g->row[i] * t->stride;
    }
    const __m256d inf = _mm256_set1_pd(__builtin_inf());
    const double coarse = min_lanes(best_of(t->coarse, coarse_first, coarse_valid, coarse_vectors, coarse_offset,
                                            count, g->n, inf));
    const window_t w = window_of(t, pick_of(coarse, t->tie));
    int vectors = 0;
    for (int64_t z = w.z0; z < w.z1; z++)
        for (int64_t s = 0; s < w.width; s += 4) {
            first[vectors] = z * t->n_s + w.s0 + s;
            valid[vectors++] = w.width - s;
        }
    for (; vectors % 4; vectors++) {   /* whole tiles: a repeated column changes no minimum */
        first[vectors] = first[vectors - 1];
        valid[vectors] = valid[vectors - 1];
    }
    return min_lanes(best_of(t->table, first, valid, vectors, offset, count, g->n, inf));
}
#endif

/* Whether this CPU takes the AVX2 path (vector_ok: the caller allows it). */
int requant_int4_vectorised(int vector_ok)
{
#ifdef REQUANT_X86
    return vector_ok && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
    (void)vector_ok;
    return 0;
#endif
}

/* One tensor's encoding: n_blocks MXFP4 blocks (16 bytes and an E8M0 scale each), groups of
 * per_group blocks -> codes (16 bytes a block), BF16 scale bits and zero points per group; the
 * blocks' signal energy (4x, whole numbers) added to signal_bins[e8m0] and the groups' excess
 * error to excess_bins[r + r_offset]. 0 on success; -1 for tables beyond the fixed sizes (the
 * caller encodes another way). */
int requant_int4_encode(int64_t n_blocks, int64_t per_group, const uint8_t *weight, const uint8_t *e8m0,
                        const requant_int4_tables *t, int vector_ok, uint8_t *codes, uint16_t *scale_out,
                        int8_t *zero, double *signal_bins, double *excess_bins)
{
    const int64_t window_vectors = (2 * t->z_radius + 1) * ((2 * t->radius + 1 + 3) / 4);
    if (per_group < 1 || per_group > MAX_PER_GROUP || n_blocks % per_group || t->rows > MAX_ROWS
        || t->rows != t->n_bins + t->split + 1 || t->n_bins > 16 || t->split >= 8 || t->n_coarse % 16
        || t->n_coarse / 4 > MAX_VECTORS || window_vectors + 3 > MAX_VECTORS || t->stride < t->n_s * t->n_z + 4
        || t->tie <= 0 || t->tie & (t->tie - 1))
        return -1;
    double (*search)(const group_counts *, const requant_int4_tables *) = search_portable;
#ifdef REQUANT_X86
    if (requant_int4_vectorised(vector_ok))
        search = search_avx2;
#endif
    const int64_t candidates = t->n_s * t->n_z;
    const uint64_t mask = ((uint64_t)1 << (8 * t->split)) - 1;
    for (int64_t b0 = 0; b0 < n_blocks; b0 += per_group) {
        /* Lane words of each block's positive and negative codes, its top level and exponent. */
        uint64_t plus[MAX_PER_GROUP], minus[MAX_PER_GROUP];
        int64_t exps[MAX_PER_GROUP], top = INT64_MIN;
        for (int64_t b = 0; b < per_group; b++) {
            const uint8_t *block = weight + (b0 + b) * BLOCK_BYTES;
            uint64_t p = 0, m = 0;
            for (int i = 0; i < BLOCK_BYTES; i++) {
                p += t->byte_lanes[block[i]];
                m += t->byte_lanes[256 + block[i]];
            }
            const uint64_t both = p + m;
            exps[b] = (int64_t)e8m0[b0 + b] - t->e8m0_bias;
            const int64_t block_top = both ? 5 - __builtin_ctzll(both) / 8 : t->empty;
            top = block_top + 2 * exps[b] > top ? block_top + 2 * exps[b] : top;
            plus[b] = p;
            minus[b] = m;
            int64_t energy = 0;
            for (int j = 0; j < 8; j++)
                energy += (int64_t)((both >> (8 * j)) & 255) * t->lane_squared[j];
            signal_bins[e8m0[b0 + b]] += (double)energy;
        }
        const int empty = top < t->empty / 2;
        const int64_t r = empty ? 0 : floor_half(top);
        /* Counts over the table's rows (int4_search._search's `counts`), blocks' windows summed. */
        int64_t shift[MAX_PER_GROUP];
        uint64_t words[4] = {0, 0, 0, 0};   /* levels 0-7 of +, -, both; levels 8-15 of both */
        for (int64_t b = 0; b < per_group; b++) {
            const int64_t d = r - exps[b];
            shift[b] = d < -1 ? -1 : d > t->d_max ? t->d_max : d;
            const int64_t first = 4 - 2 * shift[b];
            words[0] += window(plus[b], first);
            words[1] += window(minus[b], first);
            words[2] += window(plus[b] + minus[b], first);
            words[3] += window(plus[b] + minus[b], first + 8);
        }
        const uint64_t merged[3] = {(words[0] & mask) | (words[2] & ~mask), words[3], (words[1] & mask) | (mask + 1)};
        group_counts g;
        g.n = 0;
        for (int64_t i = 0; i < t->rows; i++) {
            const int64_t lane = i < t->n_bins ? i : 16 + i - t->n_bins;
            const unsigned c = (unsigned)((merged[lane / 8] >> (8 * (lane % 8))) & 255);
            g.row[g.n] = (int)i;   /* kept only when nonzero: no branch to mispredict */
            g.count[g.n] = c;
            g.n += c != 0;
        }
        int64_t pick = t->zero_index;
        if (!empty) {
            const double key = search(&g, t);
            const double excess = floor(key * (1.0 / (double)t->tie));
            pick = (int64_t)(key - excess * (double)t->tie);
            excess_bins[r + t->r_offset] += excess;
        }
        const int64_t group = b0 / per_group;
        scale_out[group] = empty ? to_bf16(1.0) : to_bf16((double)t->s[pick] * ldexp(1.0, r < -126 ? -126 : (int)r));
        zero[group] = empty ? 0 : (int8_t)t->z[pick];
        for (int64_t b = 0; b < per_group; b++) {
            const uint8_t *lookup = t->bytes + ((shift[b] + 1) * candidates + pick) * 256;
            const uint8_t *block = weight + (b0 + b) * BLOCK_BYTES;
            uint8_t *out = codes + (b0 + b) * BLOCK_BYTES;
            for (int i = 0; i < BLOCK_BYTES; i++)
                out[i] = lookup[block[i]];
        }
    }
    return 0;
}
