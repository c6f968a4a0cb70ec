/* One pass over two nibble-coded projections: report's and verify --deep's statistics of b
 * against reference a, from the stored codes (requant/report/native.py builds and calls it).
 *
 * A side's element k of row r is (table[code] - offset[r, k / group]) * scale[r, k / group] in
 * float32, the very operations of requant's torch decoders, so every element's value and error
 * are bit-equal to theirs. Elements are taken in units that lie in one group of each side and one
 * exactness block; a unit's 16 possible values per side are computed once. The sums are float32
 * per lane within a unit, then float64: a fixed order that the AVX2 path and the portable one
 * share, so both give the same bits.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define REQUANT_X86 1
#endif

typedef struct {
    const uint8_t *codes;   /* [rows, k/2]: element 2i in the low nibble of byte i */
    const float *scale;     /* [rows, k/group] */
    const float *offset;    /* [rows, k/group], or NULL for none */
    const float *table;     /* [16]: a code's value before offset and scale */
    int64_t group;
} requant_side;

typedef struct {
    double sum_a2, sum_e2, sum_ea;
    int64_t exponents[256];   /* biased float32 exponent of each |e| (0: zeros and subnormals) */
    int64_t zero, nonfinite, blocks, exact_blocks;
    uint32_t max_bits;        /* of the largest |e| */
} requant_sums;

/* A slice: 8 bytes, their low nibbles then their high ones, one per lane. */
enum { LANES = 8, SLICE = 2 * LANES, UNIT_BYTES_MAX = 512 };
static const uint32_t ABS_MASK = 0x7fffffffu, INF_BITS = 0x7f800000u;

/* Everything but the float64 lane sums, which each path keeps its own way. */
typedef struct {
    int64_t hist[4][256];   /* four copies: a run of equal exponents does not wait on one counter */
    int64_t zero, nonfinite, blocks, exact_blocks;
    uint32_t max_bits, block_max;
} counts_t;

/* Where the units of a row are: each lies in one group of each side and one block. */
typedef struct {
    int64_t unit, per_group_a, per_group_b, per_block;
} layout_t;

static inline uint32_t bits_of(float x) { uint32_t u; memcpy(&u, &x, sizeof u); return u; }

static inline void unit_values(const requant_side *s, int64_t g, float *v)
{
    const float scale = s->scale[g], offset = s->offset ? s->offset[g] : 0.0f;
    for (int c = 0; c < 16; c++) v[c] = (s->table[c] - offset) * scale;
}

/* Which group of each side and which block the next unit is in, by countdowns (a division per
 * unit costs as much as the unit). */
typedef struct {
    int64_t ga, gb, left_a, left_b, left_block;
} cursor_t;

static inline cursor_t row_start(const requant_side *a, const requant_side *b, int64_t r, int64_t k, const layout_t *lay)
{
    const cursor_t c = {r * (k / a->group), r * (k / b->group), lay->per_group_a, lay->per_group_b, lay->per_block};
    return c;
}

/* After a unit: the next unit's groups, and its block's exactness once the block is complete. */
static inline void unit_done(cursor_t *c, counts_t *t, const layout_t *lay)
{
    if (--c->left_a == 0) { c->ga++; c->left_a = lay->per_group_a; }
    if (--c->left_b == 0) { c->gb++; c->left_b = lay->per_group_b; }
    if (--c->left_block) return;
    c->left_block = lay->per_block;
    t->blocks++;
    t->exact_blocks += t->block_max == 0;
    if (t->block_max > t->max_bits) t->max_bits = t->block_max;
    t->block_max = 0;
}

/* One unit element by element into float lane sums; b's non-finite values count as 0 (error
 * -a), as in the torch passes. */
static void unit_portable(const uint8_t *ca, const uint8_t *cb, int64_t bytes, const float *va, const float *vb,
                          float *a2, float *e2, float *ea, counts_t *t)
{
    for (int l = 0; l < LANES; l++) a2[l] = e2[l] = ea[l] = 0.0f;
    for (int64_t s = 0; s < bytes; s += LANES)
        for (int half = 0; half < 2; half++)
            for (int l = 0; l < LANES; l++) {
                const int shift = 4 * half;
                const float x = va[(ca[s + l] >> shift) & 15];
                float e = vb[(cb[s + l] >> shift) & 15] - x;
                uint32_t u = bits_of(e) & ABS_MASK;
                if (u >= INF_BITS) {
                    t->nonfinite++;
                    e = -x;
                    u = bits_of(e) & ABS_MASK;
                }
                a2[l] += x * x;
                e2[l] += e * e;
                ea[l] += e * x;
                t->hist[l & 3][u >> 23]++;
                t->zero += u == 0;
                if (u > t->block_max) t->block_max = u;
            }
}

static void row_portable(const requant_side *a, const requant_side *b, int64_t r, int64_t k, const layout_t *lay,
                         double *sums, counts_t *t)
{
    const int64_t units = k / lay->unit, bytes = lay->unit / 2;
    const uint8_t *ca = a->codes + r * (k / 2), *cb = b->codes + r * (k / 2);
    float va[16], vb[16], a2[LANES], e2[LANES], ea[LANES];
    cursor_t c = row_start(a, b, r, k, lay);
    for (int64_t u = 0; u < units; u++) {
        unit_values(a, c.ga, va);
        unit_values(b, c.gb, vb);
        unit_portable(ca + u * bytes, cb + u * bytes, bytes, va, vb, a2, e2, ea, t);
        for (int l = 0; l < LANES; l++) {
            sums[l] += a2[l];
            sums[LANES + l] += e2[l];
            sums[2 * LANES + l] += ea[l];
        }
        unit_done(&c, t, lay);
    }
}

#ifdef REQUANT_X86
#define AVX2 __attribute__((target("avx2")))

AVX2 static inline __m256 lookup(__m256i idx, __m256 low, __m256 high)
{
    const __m256 lo = _mm256_permutevar8x32_ps(low, idx), hi = _mm256_permutevar8x32_ps(high, idx);
    return _mm256_blendv_ps(lo, hi, _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)));   /* code bit 3 */
}

AVX2 static inline void sum_lanes(__m256d *acc, __m256 x)
{
    acc[0] = _mm256_add_pd(acc[0], _mm256_cvtps_pd(_mm256_castps256_ps128(x)));
    acc[1] = _mm256_add_pd(acc[1], _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1)));
}

/* row_portable's arithmetic eight lanes at a time; a unit with a non-finite error is redone by
 * unit_portable. */
AVX2 static void row_avx2(const requant_side *a, const requant_side *b, int64_t r, int64_t k, const layout_t *lay,
                          double *sums, counts_t *t)
{
    const int64_t units = k / lay->unit, bytes = lay->unit / 2;
    const uint8_t *ca = a->codes + r * (k / 2), *cb = b->codes + r * (k / 2);
    const __m128i nibble = _mm_set1_epi8(15);
    const __m256i abs_mask = _mm256_set1_epi32((int)ABS_MASK), finite = _mm256_set1_epi32((int)INF_BITS - 1);
    const __m256 ta_lo = _mm256_loadu_ps(a->table), ta_hi = _mm256_loadu_ps(a->table + 8);
    const __m256 tb_lo = _mm256_loadu_ps(b->table), tb_hi = _mm256_loadu_ps(b->table + 8);
    __m256d d_a2[2], d_e2[2], d_ea[2];
    for (int h = 0; h < 2; h++) {
        d_a2[h] = _mm256_loadu_pd(sums + 4 * h);
        d_e2[h] = _mm256_loadu_pd(sums + LANES + 4 * h);
        d_ea[h] = _mm256_loadu_pd(sums + 2 * LANES + 4 * h);
    }
    uint32_t exps[2 * UNIT_BYTES_MAX];
    cursor_t c = row_start(a, b, r, k, lay);
    for (int64_t u = 0; u < units; u++) {
        const int64_t ga = c.ga, gb = c.gb;
        const __m256 sa = _mm256_set1_ps(a->scale[ga]), oa = _mm256_set1_ps(a->offset ? a->offset[ga] : 0.0f);
        const __m256 sb = _mm256_set1_ps(b->scale[gb]), ob = _mm256_set1_ps(b->offset ? b->offset[gb] : 0.0f);
        const __m256 va_lo = _mm256_mul_ps(_mm256_sub_ps(ta_lo, oa), sa), va_hi = _mm256_mul_ps(_mm256_sub_ps(ta_hi, oa), sa);
        const __m256 vb_lo = _mm256_mul_ps(_mm256_sub_ps(tb_lo, ob), sb), vb_hi = _mm256_mul_ps(_mm256_sub_ps(tb_hi, ob), sb);
        const uint8_t *ua = ca + u * bytes, *ub = cb + u * bytes;
        __m256 a2 = _mm256_setzero_ps(), e2 = _mm256_setzero_ps(), ea = _mm256_setzero_ps();
        __m256i largest = _mm256_setzero_si256(), zeros = _mm256_setzero_si256(), bad = _mm256_setzero_si256();
        for (int64_t s = 0; s < bytes; s += LANES) {
            const __m128i xa = _mm_loadl_epi64((const __m128i *)(ua + s)), xb = _mm_loadl_epi64((const __m128i *)(ub + s));
            const __m128i na[2] = {_mm_and_si128(xa, nibble), _mm_and_si128(_mm_srli_epi16(xa, 4), nibble)};
            const __m128i nb[2] = {_mm_and_si128(xb, nibble), _mm_and_si128(_mm_srli_epi16(xb, 4), nibble)};
            for (int half = 0; half < 2; half++) {
                const __m256 x = lookup(_mm256_cvtepu8_epi32(na[half]), va_lo, va_hi);
                const __m256 e = _mm256_sub_ps(lookup(_mm256_cvtepu8_epi32(nb[half]), vb_lo, vb_hi), x);
                a2 = _mm256_add_ps(a2, _mm256_mul_ps(x, x));
                e2 = _mm256_add_ps(e2, _mm256_mul_ps(e, e));
                ea = _mm256_add_ps(ea, _mm256_mul_ps(e, x));
                const __m256i bits = _mm256_and_si256(_mm256_castps_si256(e), abs_mask);
                bad = _mm256_or_si256(bad, _mm256_cmpgt_epi32(bits, finite));
                largest = _mm256_max_epu32(largest, bits);
                zeros = _mm256_sub_epi32(zeros, _mm256_cmpeq_epi32(bits, _mm256_setzero_si256()));
                _mm256_storeu_si256((__m256i *)(exps + 2 * s + half * LANES), _mm256_srli_epi32(bits, 23));
            }
        }
        if (_mm256_testz_si256(bad, bad)) {
            for (int64_t i = 0; i < 2 * bytes; i++) t->hist[i & 3][exps[i]]++;
            uint32_t lanes[LANES];
            _mm256_storeu_si256((__m256i *)lanes, largest);
            for (int l = 0; l < LANES; l++) if (lanes[l] > t->block_max) t->block_max = lanes[l];
            _mm256_storeu_si256((__m256i *)lanes, zeros);
            for (int l = 0; l < LANES; l++) t->zero += lanes[l];
        } else {
            float va[16], vb[16], fa2[LANES], fe2[LANES], fea[LANES];
            _mm256_storeu_ps(va, va_lo); _mm256_storeu_ps(va + 8, va_hi);
            _mm256_storeu_ps(vb, vb_lo); _mm256_storeu_ps(vb + 8, vb_hi);
            unit_portable(ua, ub, bytes, va, vb, fa2, fe2, fea, t);
            a2 = _mm256_loadu_ps(fa2); e2 = _mm256_loadu_ps(fe2); ea = _mm256_loadu_ps(fea);
        }
        sum_lanes(d_a2, a2);
        sum_lanes(d_e2, e2);
        sum_lanes(d_ea, ea);
        unit_done(&c, t, lay);
    }
    for (int h = 0; h < 2; h++) {
        _mm256_storeu_pd(sums + 4 * h, d_a2[h]);
        _mm256_storeu_pd(sums + LANES + 4 * h, d_e2[h]);
        _mm256_storeu_pd(sums + 2 * LANES + 4 * h, d_ea[h]);
    }
}
#endif

/* Whether this CPU takes the AVX2 path (vector_ok: the caller allows it). */
int requant_compare_vectorised(int vector_ok)
{
#ifdef REQUANT_X86
    return vector_ok && __builtin_cpu_supports("avx2");
#else
    (void)vector_ok;
    return 0;
#endif
}

/* 0 on success; -1 when the groups and the block share no unit of whole slices (the caller
 * compares another way). */
int requant_compare(int64_t rows, int64_t k, const requant_side *a, const requant_side *b,
                    int64_t block, int vector_ok, requant_sums *out)
{
    int64_t unit = a->group < b->group ? a->group : b->group;
    unit = block < unit ? block : unit;
    if (unit <= 0 || unit % SLICE || unit > 2 * UNIT_BYTES_MAX || a->group % unit || b->group % unit
        || block % unit || k % block || k % a->group || k % b->group)
        return -1;
    const layout_t lay = {unit, a->group / unit, b->group / unit, block / unit};
    const int vector = requant_compare_vectorised(vector_ok);
    double sums[3 * LANES] = {0};   /* lanes of sum a^2, then e^2, then e a */
    counts_t t;
    memset(&t, 0, sizeof t);
    for (int64_t r = 0; r < rows; r++) {
#ifdef REQUANT_X86
        if (vector) {
            row_avx2(a, b, r, k, &lay, sums, &t);
            continue;
        }
#endif
        row_portable(a, b, r, k, &lay, sums, &t);
    }
    memset(out, 0, sizeof *out);
    for (int l = 0; l < LANES; l++) {
        out->sum_a2 += sums[l];
        out->sum_e2 += sums[LANES + l];
        out->sum_ea += sums[2 * LANES + l];
    }
    for (int c = 0; c < 256; c++) out->exponents[c] = t.hist[0][c] + t.hist[1][c] + t.hist[2][c] + t.hist[3][c];
    out->zero = t.zero;
    out->nonfinite = t.nonfinite;
    out->blocks = t.blocks;
    out->exact_blocks = t.exact_blocks;
    out->max_bits = t.max_bits;
    return 0;
}
