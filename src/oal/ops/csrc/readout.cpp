// Fused OAL readout for the CPU: num^T = S^T phi(Q)^T with the query features phi built in registers (Eq. 6).
//
// The torch path writes phi(Q), 1 + d + d(d+1)/2 values per query head and token (2145 at d = 64), to memory and
// reads it back in a GEMM; at the memory's write rate that was a quarter of the operator's time (issue 36). Here a
// tile of tokens x outputs keeps its accumulators in vector registers and, for every feature f, forms phi_f for its
// tokens from two rows of the queries (phi_f = w_f q_r q_t, Eq. 6, packed r <= t) and adds S[f, o] phi_f with one
// FMA per accumulator. Nothing but the queries, the weights, the state and the result touches memory.
//
// With `Intra` it also adds the chunk's own keys (Eq. 7 inside the chunk): per query head the kernel block
// kappa(i, l) = eps + sum_m z_m^2, z = L^T [1, s_1, ..., s_G], s_g = scale sum_{r in g} q_r k_r, zero for l > i,
// is built once into a C x C buffer (the group sums cost d multiply-adds per pair, not (G+1) d as the torch GEMMs
// do), and the tiles then take the keys l like C more features with weights u_l. The numerator is then complete.
//
// Layouts (row-major), per item k = (chunk, batch, KV head) flattened:
//   q   [B, Hq, N, d]          the queries token-major, any strides but the last (the operator's), fp32 or bf16
//                              (uint16 bits); each item gathers its own feature-major [d, rep, C] (gather_queries)
//   w   [Hkv, rep, F]          per query head the weights [a, scale b_r, scale^2 m_rt C_rt] (query_coefficients)
//   s   [items, F, dv1]        the state before each chunk (fp32)
//   out [items, dv1, rep * C]  the numerator^T (fp32), overwritten
//   kb  [items, C, d+1]        the chunk's keys, token-major (the last column is not read)      } Intra, optional
//   ub  [items, C, dv1]        their values with the denominator's column                      }
//   order [Hkv * rep, d], bounds [Hkv * rep, G+1] (int32): each head's dims sorted by group and where each group
//   starts in that order (bounds[G] = d); lower [Hkv * rep, G+1, G+1]: L with rows 1..G times scale
// F = 1 + d + d(d+1)/2. C must be a multiple of the vector width VW (the caller checks `oal_readout_vw`).
//
// bf16 queries on a CPU with AVX512_BF16 (`item_dp`): the constant and linear features stay fp32; the quadratic
// ones, formed in fp32 and rounded once to bf16, meet the state rounded to bf16 in bf16 dot products (vdpbf16ps: two
// products per fp32 lane, fp32 accumulation), twice the fp32 FMA rate; on a CPU with AMX-BF16 the same products run
// on the tiles (`item_amx`). Elsewhere bf16 queries are widened exactly to fp32 and run the fp32 kernel.
//
// The decoding steps (`oal_decode_f32`, `oal_window_decode_f32`, at the end) run the token loops of OAL and of the
// sliding windows on a state: one pass over the state per token, the update (Eq. 5) and every query head's readout
// (Eq. 6) together.
//
// Plain C++ with GCC/Clang vector extensions (and AVX-512 intrinsics for the bf16 dot products), no torch headers:
// compiled on the user's machine with -march=native by oal.ops.cpu_kernel (about a second), so the vector width
// and register count are the CPU's own.

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#if defined(__AVX512F__)
#define VW 16  // floats per vector register
#define NV 2   // vectors of tokens per tile: 2 x 13 accumulators + 2 query rows + 2 features = 30 of 32 registers
#define TO 13  // outputs per tile (65 = 5 x 13 at dv = 64)
#elif defined(__AVX__)
#define VW 8
#define NV 1  // 16 registers: 13 accumulators + a query row + a feature + a broadcast
#define TO 13
#else
#define VW 4
#define NV 1
#define TO 12
#endif

// aligned(4): a pointer to it needs no vector alignment (unaligned loads); may_alias: it reads float buffers
typedef float vf __attribute__((vector_size(VW * 4), aligned(4), may_alias));

static inline vf load(const float* p) { return *(const vf*)p; }

static inline void store(float* p, vf v) { *(vf*)p = v; }

#define GMAX 16  // groups + 1 the intra-chunk term takes (the caller checks)

// The intra-chunk inputs of one call (kb == nullptr: none).
struct Intra {
    const float *kb, *ub;
    const int32_t *order, *bounds;
    const float* lower;
    int groups;
    float eps;
};

#if VW == 16
#define NREG 32  // vector registers (AVX-512)
#else
#define NREG 16
#endif

// kappa for KL keys at a time against one vector of queries (G1 = groups + 1 at compile time, so that the z sums
// of the KL keys stay in registers): xg [d, c] the head's query rows and kg [c, d] the keys, both in group order.
template <int G1>
static void kappa_keys(const float* xg, const float* kg, int d, int c, const int32_t* bounds, const float* lower,
                       float eps, float* kappa) {
    constexpr int fit = (NREG - 4) / (G1 + 1), KL = fit >= 4 ? 4 : fit >= 2 ? 2 : 1;  // c is a multiple of KL
    vf lane;
    for (int t = 0; t < VW; ++t) lane[t] = (float)t;
    for (int l0 = 0; l0 < c; l0 += KL) {
        for (int i0 = 0; i0 < c; i0 += VW) {
            if (i0 + VW <= l0) {  // every query of this vector comes before these keys
                for (int q = 0; q < KL; ++q) store(kappa + (ptrdiff_t)(l0 + q) * c + i0, (vf){});
                continue;
            }
            vf z[KL][G1];
            for (int q = 0; q < KL; ++q)
                for (int m = 0; m < G1; ++m) z[q][m] = (vf){} + lower[m];  // row 0: the constants L_0m
            for (int g = 0; g + 1 < G1; ++g) {
                vf sg[KL] = {};  // s_g / scale (scale is in L's rows 1..G)
                for (int p = bounds[g]; p < bounds[g + 1]; ++p) {
                    const vf xv = load(xg + (ptrdiff_t)p * c + i0);  // one load for KL keys
                    for (int q = 0; q < KL; ++q) sg[q] += xv * kg[(ptrdiff_t)(l0 + q) * d + p];
                }
                const float* lg = lower + (ptrdiff_t)(g + 1) * G1;
                for (int q = 0; q < KL; ++q)
                    for (int m = 0; m < G1; ++m) z[q][m] += lg[m] * sg[q];
            }
            for (int q = 0; q < KL; ++q) {
                vf kap = (vf){} + eps;
                for (int m = 0; m < G1; ++m) kap += z[q][m] * z[q][m];
                const int l = l0 + q;  // query i0 + t sees key l when i0 + t >= l
                store(kappa + (ptrdiff_t)l * c + i0, lane + (float)i0 >= (float)l ? kap : (vf){});
            }
        }
    }
}

typedef void (*kappa_fn)(const float*, const float*, int, int, const int32_t*, const float*, float, float*);

template <int G1 = GMAX>
static kappa_fn kappa_of(int g1) {  // the instance for g1 = groups + 1 in 2..GMAX
    if constexpr (G1 < 2)
        return nullptr;
    else
        return g1 == G1 ? kappa_keys<G1> : kappa_of<G1 - 1>(g1);
}

// kappa[l, i] for one query head and one item: eps + sum_m z_m(i, l)^2 for keys l <= i, else 0 (Eq. 7).
// x: the head's query rows (row r at x + r * xs), keys: the chunk's keys token-major (row l at keys + l * (d + 1));
// kappa: c * c floats, then 2 * d * c of scratch, where the query rows and the keys are copied in group order
// (`order`) first, so that each group's sums read contiguous rows.
static void kappa_block(const float* x, ptrdiff_t xs, const float* keys, int d, int c, const int32_t* order,
                        const int32_t* bounds, const float* lower, int groups, float eps, float* kappa) {
    float* xg = kappa + (ptrdiff_t)c * c;
    float* kg = xg + (ptrdiff_t)d * c;
    for (int p = 0; p < d; ++p) {
        const float* row = x + order[p] * xs;
        for (int i = 0; i < c; i += VW) store(xg + (ptrdiff_t)p * c + i, load(row + i));
    }
    for (int l = 0; l < c; ++l)
        for (int p = 0; p < d; ++p) kg[(ptrdiff_t)l * d + p] = keys[(ptrdiff_t)l * (d + 1) + order[p]];
    kappa_of(groups + 1)(xg, kg, d, c, bounds, lower, eps, kappa);
}

// One tile: T outputs (rows o0..o0+T of out) x V * VW tokens (columns i0..) of one query head.
//   x: the head's queries at column i0, row r at x + r * xs; w: the head's F weights; s: state column o0, row f at
//   s + f * ss; out: row o0, column i0, row o at out + o * os.
//   kap: the head's kappa block at column i0 (row l at kap + l * c), u: the values at column o0 (row l at
//   u + l * ss), keys = the keys that can reach these queries (0: no intra-chunk term).
template <int T, int V>
static inline void tile(const float* x, ptrdiff_t xs, const float* w, const float* s, ptrdiff_t ss, float* out,
                        ptrdiff_t os, int d, const float* kap, const float* u, int keys, int c) {
    vf acc[T][V];
    for (int o = 0; o < T; ++o)  // f = 0: the constant feature phi_0 = a
        for (int v = 0; v < V; ++v) acc[o][v] = (vf){} + s[o] * w[0];
    const float* wf = w + 1;
    const float* sf = s + ss;
    for (int r = 0; r < d; ++r, ++wf, sf += ss) {  // f = 1..d: linear features w_r q_r
        vf phi[V];
        for (int v = 0; v < V; ++v) phi[v] = load(x + r * xs + v * VW) * *wf;
        for (int o = 0; o < T; ++o)
            for (int v = 0; v < V; ++v) acc[o][v] += sf[o] * phi[v];
    }
    for (int r = 0; r < d; ++r) {  // pair features w_rt q_r q_t, t >= r, in packed order
        vf xr[V];
        for (int v = 0; v < V; ++v) xr[v] = load(x + r * xs + v * VW);
        for (int t = r; t < d; ++t, ++wf, sf += ss) {
            vf phi[V];
            for (int v = 0; v < V; ++v) phi[v] = load(x + t * xs + v * VW) * *wf * xr[v];
            for (int o = 0; o < T; ++o)
                for (int v = 0; v < V; ++v) acc[o][v] += sf[o] * phi[v];
        }
    }
    for (int l = 0; l < keys; ++l, u += ss) {  // the chunk's own keys: kappa(i, l) u_l (Eq. 7)
        vf kv[V];
        for (int v = 0; v < V; ++v) kv[v] = load(kap + (ptrdiff_t)l * c + v * VW);
        for (int o = 0; o < T; ++o)
            for (int v = 0; v < V; ++v) acc[o][v] += u[o] * kv[v];
    }
    for (int o = 0; o < T; ++o)
        for (int v = 0; v < V; ++v) store(out + o * os + v * VW, acc[o][v]);
}

typedef void (*tile_fn)(const float*, ptrdiff_t, const float*, const float*, ptrdiff_t, float*, ptrdiff_t, int,
                        const float*, const float*, int, int);

template <int V, int T = TO>
static tile_fn tile_of(int t) {  // the instance for t <= TO outputs (a remainder tile has fewer)
    if constexpr (T == 0)
        return nullptr;
    else
        return t == T ? tile<T, V> : tile_of<V, T - 1>(t);
}

// The intra-chunk inputs of item k (kv: its KV head in the call) and its kappa buffer; pointers into `in`.
struct ItemIntra {
    const float *keys, *u;
    const int32_t *order, *bounds;
    const float* lower;
    float* kappa;  // c * c floats and kappa_block's scratch, the caller's
};

static ItemIntra item_intra(const Intra* in, int64_t k, int kv, int d, int rep, int c, int dv1, float* kappa) {
    if (in == nullptr || in->kb == nullptr) return ItemIntra{nullptr, nullptr, nullptr, nullptr, nullptr, nullptr};
    const int g1 = in->groups + 1;
    const ptrdiff_t h = (ptrdiff_t)kv * rep;  // the KV head's first query head
    return ItemIntra{in->kb + k * c * (d + 1), in->ub + k * c * dv1, in->order + h * d, in->bounds + h * g1,
                     in->lower + h * g1 * g1, kappa};
}

// One item: every query head j of the KV head, every tile of tokens and outputs.
static void item(const float* x, const float* w, const float* s, float* out, int d, int rep, int c, int dv1,
                 int feats, const ItemIntra& it, const Intra* in) {
    const ptrdiff_t xs = (ptrdiff_t)rep * c, os = (ptrdiff_t)rep * c;
    for (int j = 0; j < rep; ++j) {
        const float* wj = w + (ptrdiff_t)j * feats;
        if (it.keys) {
            const int g1 = in->groups + 1;
            kappa_block(x + (ptrdiff_t)j * c, xs, it.keys, d, c, it.order + (ptrdiff_t)j * d,
                        it.bounds + (ptrdiff_t)j * g1, it.lower + (ptrdiff_t)j * g1 * g1, in->groups, in->eps,
                        it.kappa);
        }
        for (int i0 = 0; i0 < c;) {
            const int wide = (NV > 1 && c - i0 >= NV * VW);
            const int width = wide ? NV * VW : VW;
            const int keys = it.keys ? (i0 + width < c ? i0 + width : c) : 0;  // keys after the last query: 0
            for (int o0 = 0; o0 < dv1; o0 += TO) {
                const int t = dv1 - o0 < TO ? dv1 - o0 : TO;
                const float* xi = x + (ptrdiff_t)j * c + i0;
                float* oi = out + (ptrdiff_t)o0 * os + (ptrdiff_t)j * c + i0;
                const float* kap = it.kappa ? it.kappa + i0 : nullptr;
                const float* u = it.u ? it.u + o0 : nullptr;
                (wide ? tile_of<NV>(t) : tile_of<1>(t))(xi, xs, wj, s + o0, dv1, oi, os, d, kap, u, keys, c);
            }
            i0 += width;
        }
    }
}

// The normalised output, written by the kernel itself (`Final`, optional): out[b, h, t, o] = num[o] / num[dv]
// (Eq. 6-7: numerator over denominator) for the item's rep query heads h = kv * rep + j and chunk tokens t, fp32,
// or bf16 rounded to nearest even as torch rounds a division into a bf16 tensor. The numerator then never leaves
// the cache (the torch path divides a scratch numerator into a strided view: a fifth of a bf16 call at 16k).
//   out + b * sb + h * sh + t * st: row (b, h, t) of dv contiguous values; t counts from the call's first chunk.
struct Final {
    void* out;
    int64_t sb, sh, st;
    int half, bsz;  // bsz: the batch (item_at)
};

// Where item k = (chunk, batch row, KV head) lies in the operator's [B, H, N, ...] tensors: its KV head, batch row and
// first token.
struct ItemAt {
    int64_t kv, b, t0;
};

static inline ItemAt item_at(int64_t k, int hkv, int bsz, int c) {
    return ItemAt{k % hkv, k / hkv % bsz, k / (hkv * (int64_t)bsz) * c};
}

static inline uint16_t bf16_bits(float f) {
    uint32_t u;
    __builtin_memcpy(&u, &f, 4);
    if (f != f) return 0x7FC0;  // torch's NaN
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)  // 16 x 16 transposes in registers
#define HAVE_T16 1
#include <immintrin.h>

// r[0..15] (16 x 16 uint32) transposed in registers: unpacks within 128-bit lanes, then lane shuffles.
static inline void transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int g = 0; g < 16; g += 4) {  // r[g + c], lane L: rows g..g+3 at column 4L + c
        r[g] = _mm512_unpacklo_epi64(t[g], t[g + 2]);
        r[g + 1] = _mm512_unpackhi_epi64(t[g], t[g + 2]);
        r[g + 2] = _mm512_unpacklo_epi64(t[g + 1], t[g + 3]);
        r[g + 3] = _mm512_unpackhi_epi64(t[g + 1], t[g + 3]);
    }
    for (int c = 0; c < 4; ++c) {
        const __m512i u0 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x88), u1 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xdd);
        const __m512i u2 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x88);
        const __m512i u3 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xdd);
        t[c] = _mm512_shuffle_i32x4(u0, u2, 0x88);
        t[8 + c] = _mm512_shuffle_i32x4(u0, u2, 0xdd);
        t[4 + c] = _mm512_shuffle_i32x4(u1, u3, 0x88);
        t[12 + c] = _mm512_shuffle_i32x4(u1, u3, 0xdd);
    }
    for (int i = 0; i < 16; ++i) r[i] = t[i];
}

// 16 fp32 lanes rounded to bf16 bits as bf16_bits does, in the low 16 bits of each lane's result (packed after).
static inline __m256i bf16_round16(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
    return _mm512_cvtepi32_epi16(r);
}
#else
#define HAVE_T16 0
#endif

static inline float widen(float f) { return f; }

static inline float widen(uint16_t h) {  // bf16 bits, exactly
    const uint32_t u = (uint32_t)h << 16;
    float f;
    __builtin_memcpy(&f, &u, 4);
    return f;
}

#if HAVE_T16
static inline __m512i load16(const float* p, __mmask16 m) { return _mm512_castps_si512(_mm512_maskz_loadu_ps(m, p)); }

static inline __m512i load16(const uint16_t* p, __mmask16 m) {  // bf16 widened: the bits shifted into the high half
    return _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16);
}
#endif

// Item k's queries feature-major, as the tiles read them: x [d, rep, c] fp32, head j's dim r at x + r * rep * c +
// j * c, from the operator's token-major queries q [B, Hq, N, d] (row (b, h, t) at q + b * qb + h * qh + t * qt;
// bf16 bits when T is uint16_t): 16 tokens x 16 dims transposed in registers, so that no feature-major copy of all
// queries is written first.
template <typename T>
static void gather_queries(const T* q, int64_t qb, int64_t qh, int64_t qt, int64_t k, int hkv, int bsz, int d,
                           int rep, int c, float* x) {
    const ItemAt at = item_at(k, hkv, bsz, c);
    const ptrdiff_t xs = (ptrdiff_t)rep * c;
    for (int j = 0; j < rep; ++j) {
        const T* src = q + at.b * qb + (at.kv * rep + j) * qh + at.t0 * qt;
        float* dst = x + (ptrdiff_t)j * c;
        int i0 = 0;
#if HAVE_T16
        for (; i0 + 16 <= c; i0 += 16)
            for (int r0 = 0; r0 < d; r0 += 16) {
                const int m = d - r0 < 16 ? d - r0 : 16;
                const __mmask16 mask = (__mmask16)((1u << m) - 1);
                __m512i v[16];
                for (int i = 0; i < 16; ++i) v[i] = load16(src + (i0 + i) * qt + r0, mask);
                transpose16(v);  // v[r]: dim r0 + r of the 16 tokens
                for (int r = 0; r < m; ++r) _mm512_storeu_si512(dst + (r0 + r) * xs + i0, v[r]);
            }
#endif
        for (; i0 < c; ++i0)
            for (int r = 0; r < d; ++r) dst[r * xs + i0] = widen(src[i0 * qt + r]);
    }
}

// Item k's numerator num [dv1, rep * c] (the layout of `out` above) divided and written to fin (see Final).
static void finish(const float* num, int64_t k, int hkv, int rep, int c, int dv1, const Final& fin) {
    const int dv = dv1 - 1;
    const ItemAt at = item_at(k, hkv, fin.bsz, c);
    const ptrdiff_t ns = (ptrdiff_t)rep * c;
    const float* den = num + (ptrdiff_t)dv * ns;
    for (int j = 0; j < rep; ++j) {
        const int64_t row0 = at.b * fin.sb + (at.kv * rep + j) * fin.sh + at.t0 * fin.st;  // token 0 of head j
        int i0 = 0;
#if HAVE_T16
        for (; i0 + 16 <= c; i0 += 16) {
            const __m512 dn = _mm512_loadu_ps(den + (ptrdiff_t)j * c + i0);
            for (int o0 = 0; o0 < dv; o0 += 16) {
                const int m = dv - o0 < 16 ? dv - o0 : 16;
                __m512i r[16];
                for (int o = 0; o < 16; ++o)
                    r[o] = o < m ? _mm512_castps_si512(_mm512_div_ps(
                                       _mm512_loadu_ps(num + (o0 + o) * ns + (ptrdiff_t)j * c + i0), dn))
                                 : _mm512_setzero_si512();
                transpose16(r);  // r[i]: token i0 + i's outputs o0..o0 + 15
                const __mmask16 mask = (__mmask16)((1u << m) - 1);
                for (int i = 0; i < 16; ++i) {
                    const int64_t at = row0 + (i0 + i) * fin.st + o0;
                    if (fin.half)
                        _mm256_mask_storeu_epi16((uint16_t*)fin.out + at, mask,
                                                 bf16_round16(_mm512_castsi512_ps(r[i])));
                    else
                        _mm512_mask_storeu_ps((float*)fin.out + at, mask, _mm512_castsi512_ps(r[i]));
                }
            }
        }
#endif
        for (; i0 < c; ++i0)
            for (int o = 0; o < dv; ++o) {
                const float q = num[o * ns + (ptrdiff_t)j * c + i0] / den[(ptrdiff_t)j * c + i0];
                const int64_t at = row0 + i0 * fin.st + o;
                if (fin.half)
                    ((uint16_t*)fin.out)[at] = bf16_bits(q);
                else
                    ((float*)fin.out)[at] = q;
            }
    }
}

#if defined(__AVX512BF16__) && VW == 16
#include <immintrin.h>
#define HAVE_DP 1

// Pairs of consecutive quadratic features (r; t, t+1) with t = r, r+2, ... < d, the last one of a row padded with
// a zero when d - r is odd: the unit of one bf16 dot product.
static int pair_count(int d) {
    int n = 0;
    for (int r = 0; r < d; ++r) n += (d - r + 1) / 2;
    return n;
}

// Two fp32 vectors a, b -> one vector of bf16 pairs (a_i, b_i) in 32-bit lane i (round to nearest even).
static inline __m512i pack_pairs(__m512 a, __m512 b) {
    static const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23,
                                                  7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    return _mm512_permutexvar_epi16(order, (__m512i)_mm512_cvtne2ps_pbh(b, a));  // a in 0..15, b in 16..31
}

// One tile of the bf16 path: T outputs x V * 16 tokens. s: the fp32 state at column o0 (rows 0..d: constant and
// linear); sp: the state's bf16 pairs at column o0, pair p at sp + p * dv1; pp: the head's weighted bf16 pair
// features at token i0, pair p at pp + p * c.
template <int T, int V>
static void tile_dp(const float* x, ptrdiff_t xs, const float* w, const float* s, int dv1, const uint32_t* sp,
                    const uint32_t* pp, int c, int pairs, float* out, ptrdiff_t os, int d, const float* kap,
                    const float* u, int keys) {
    __m512 acc[T][V];
    for (int o = 0; o < T; ++o)
        for (int v = 0; v < V; ++v) acc[o][v] = _mm512_set1_ps(s[o] * w[0]);
    for (int r = 0; r < d; ++r) {  // linear features in fp32
        __m512 phi[V];
        for (int v = 0; v < V; ++v) phi[v] = _mm512_mul_ps(_mm512_loadu_ps(x + r * xs + v * 16), _mm512_set1_ps(w[1 + r]));
        const float* sr = s + (ptrdiff_t)(1 + r) * dv1;
        for (int o = 0; o < T; ++o)
            for (int v = 0; v < V; ++v) acc[o][v] = _mm512_fmadd_ps(_mm512_set1_ps(sr[o]), phi[v], acc[o][v]);
    }
    for (int p = 0; p < pairs; ++p, sp += dv1, pp += c) {  // quadratic features, two per dot product
        __m512i a[V];
        for (int v = 0; v < V; ++v) a[v] = _mm512_loadu_si512(pp + v * 16);
        for (int o = 0; o < T; ++o) {
            const __m512bh b = (__m512bh)_mm512_set1_epi32((int)sp[o]);
            for (int v = 0; v < V; ++v) acc[o][v] = _mm512_dpbf16_ps(acc[o][v], (__m512bh)a[v], b);
        }
    }
    for (int l = 0; l < keys; ++l, u += dv1) {  // the chunk's own keys in fp32 (Eq. 7)
        __m512 kv[V];
        for (int v = 0; v < V; ++v) kv[v] = _mm512_loadu_ps(kap + (ptrdiff_t)l * c + v * 16);
        for (int o = 0; o < T; ++o)
            for (int v = 0; v < V; ++v) acc[o][v] = _mm512_fmadd_ps(_mm512_set1_ps(u[o]), kv[v], acc[o][v]);
    }
    for (int o = 0; o < T; ++o)
        for (int v = 0; v < V; ++v) _mm512_storeu_ps(out + o * os + v * 16, acc[o][v]);
}

typedef void (*tile_dp_fn)(const float*, ptrdiff_t, const float*, const float*, int, const uint32_t*,
                           const uint32_t*, int, int, float*, ptrdiff_t, int, const float*, const float*, int);

template <int V, int T = TO>
static tile_dp_fn tile_dp_of(int t) {
    if constexpr (T == 0)
        return nullptr;
    else
        return t == T ? tile_dp<T, V> : tile_dp_of<V, T - 1>(t);
}

// Query head j of an item on the bf16 path: its kappa block, then every tile of tokens and outputs (tile_dp) into
// out (the head's column 0). sp, pp: the state's and the head's bf16 pairs; pairs = 0: none (constant, linear
// features and the chunk's keys only).
static void head_dp(const float* xj, ptrdiff_t xs, const float* wj, const float* s, int dv1, const uint32_t* sp,
                    const uint32_t* pp, int c, int pairs, float* out, ptrdiff_t os, int d, const ItemIntra& it,
                    const Intra* in, int j) {
    if (it.keys) {
        const int g1 = in->groups + 1;
        kappa_block(xj, xs, it.keys, d, c, it.order + (ptrdiff_t)j * d, it.bounds + (ptrdiff_t)j * g1,
                    it.lower + (ptrdiff_t)j * g1 * g1, in->groups, in->eps, it.kappa);
    }
    for (int i0 = 0; i0 < c;) {
        const int wide = c - i0 >= 32;
        const int width = wide ? 32 : 16;
        const int keys = it.keys ? (i0 + width < c ? i0 + width : c) : 0;
        for (int o0 = 0; o0 < dv1; o0 += TO) {
            const int t = dv1 - o0 < TO ? dv1 - o0 : TO;
            (wide ? tile_dp_of<2>(t) : tile_dp_of<1>(t))(xj + i0, xs, wj, s + o0, dv1, sp ? sp + o0 : nullptr,
                                                        pp ? pp + i0 : nullptr, c, pairs, out + (ptrdiff_t)o0 * os + i0,
                                                        os, d, it.kappa ? it.kappa + i0 : nullptr,
                                                        it.u ? it.u + o0 : nullptr, keys);
        }
        i0 += width;
    }
}

// One item of the bf16 path (x already widened to fp32). sp [pairs, dv1] and pp [pairs, c]: the caller's scratch.
static void item_dp(const float* x, const float* w, const float* s, float* out, int d, int rep, int c, int dv1,
                    int feats, uint32_t* sp, uint32_t* pp, const ItemIntra& it, const Intra* in) {
    const ptrdiff_t xs = (ptrdiff_t)rep * c, os = (ptrdiff_t)rep * c;
    const int pairs = pair_count(d);
    int p = 0;  // the state's quadratic rows as bf16 pairs, in pair order
    for (int r = 0, f = 1 + d; r < d; f += d - r, ++r)
        for (int t = r; t < d; t += 2, ++p) {
            const float* s0 = s + (ptrdiff_t)(f + t - r) * dv1;
            for (int o = 0; o < dv1; o += 16) {
                const __mmask16 m = dv1 - o >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (dv1 - o)) - 1);
                const __m512 lo = _mm512_maskz_loadu_ps(m, s0 + o);
                const __m512 hi = t + 1 < d ? _mm512_maskz_loadu_ps(m, s0 + dv1 + o) : _mm512_setzero_ps();
                _mm512_mask_storeu_epi32(sp + (ptrdiff_t)p * dv1 + o, m, pack_pairs(lo, hi));
            }
        }
    for (int j = 0; j < rep; ++j) {
        const float* wj = w + (ptrdiff_t)j * feats;
        const float* xj = x + (ptrdiff_t)j * c;
        p = 0;  // the head's weighted quadratic features w_rt q_r q_t of its c tokens, as bf16 pairs
        for (int r = 0, f = 1 + d; r < d; f += d - r, ++r)
            for (int t = r; t < d; t += 2, ++p) {
                const __m512 w0 = _mm512_set1_ps(wj[f + t - r]), w1 = _mm512_set1_ps(t + 1 < d ? wj[f + t - r + 1] : 0.f);
                const float* x1 = xj + (ptrdiff_t)(t + 1 < d ? t + 1 : t) * xs;
                for (int i = 0; i < c; i += 16) {
                    const __m512 xr = _mm512_loadu_ps(xj + r * xs + i);
                    const __m512 lo = _mm512_mul_ps(_mm512_mul_ps(xr, _mm512_loadu_ps(xj + t * xs + i)), w0);
                    const __m512 hi = _mm512_mul_ps(_mm512_mul_ps(xr, _mm512_loadu_ps(x1 + i)), w1);
                    _mm512_storeu_si512(pp + (ptrdiff_t)p * c + i, pack_pairs(lo, hi));
                }
            }
        head_dp(xj, xs, wj, s, dv1, sp, pp, c, pairs, out + (ptrdiff_t)j * c, os, d, it, in, j);
    }
}
#else
#define HAVE_DP 0
#endif

#if HAVE_DP && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#define HAVE_AMX 1

// The AMX readout (Sapphire Rapids and later): the quadratic features' product on the tile unit. vdpbf16ps above
// runs at the fp32 FMA rate (about 100 GFLOP/s a core on a Xeon); the tiles multiply 16 x 16 x 32 bf16 per
// instruction. num^T[o, i] += sum_p Sp[o, p] . Pp[p, i] over the bf16 pairs p (TDPBF16PS: C[m][n] += A[m][2k]
// B[k][2n] + A[m][2k+1] B[k][2n+1]): A = the state's pairs transposed (built once per item, shared by its query
// heads), 16 outputs x 16 pairs a tile; B = a head's weighted feature pairs, 16 pairs x 16 tokens, formed in L1
// just before use; C = 16 outputs x 16 tokens of the numerator, loaded from `out` after the fp32 part (constant
// and linear features and the chunk's own keys: tile_dp with no pairs) and stored back. Same rounding as item_dp
// (state and features to bf16 once, products exact, fp32 sums), summed in another order.

// Linux gives a process the tile registers only on request (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA).
static bool amx_permitted() {
    static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    return ok;
}

struct TileConfig {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

// Tiles 0..3: C of four whole output blocks, 4: C of the last block when dv1 % 16 rows remain (part); 5: their A
// tiles, 6: the A tile of the part; 7: the B tile.
static void amx_configure(int part) {
    TileConfig cfg = {};
    cfg.palette = 1;
    for (int t = 0; t < 8; ++t) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = (t == 4 || t == 6) && part ? part : 16;
    }
    _tile_loadconfig(&cfg);
}

// The state's quadratic rows as bf16 pairs, transposed: spt[o * pk + p] = (S[f_lo(p), o], S[f_hi(p), o]), for
// o < dvp and p < pk (both padded to 16 with zeros). lo[p], hi[p]: the pair's state rows (hi -1: none).
static void state_pairs_t(const float* s, int dv1, const int32_t* lo, const int32_t* hi, int pairs, int pk,
                          uint32_t* spt) {
    for (int p0 = 0; p0 < pk; p0 += 16)  // pairs outer: the 32 state rows of 16 pairs stay in L1 across the outputs
        for (int o = 0; o < dv1; o += 16) {
            const __mmask16 m = dv1 - o >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (dv1 - o)) - 1);
            __m512i r[16];
            for (int i = 0; i < 16; ++i) {
                const int p = p0 + i;
                const __m512 zero = _mm512_setzero_ps();
                const __m512 a = p < pairs ? _mm512_maskz_loadu_ps(m, s + (ptrdiff_t)lo[p] * dv1 + o) : zero;
                const __m512 b = p < pairs && hi[p] >= 0 ? _mm512_maskz_loadu_ps(m, s + (ptrdiff_t)hi[p] * dv1 + o) : zero;
                r[i] = pack_pairs(a, b);
            }
            transpose16(r);
            for (int i = 0; i < 16; ++i) _mm512_storeu_si512(spt + (ptrdiff_t)(o + i) * pk + p0, r[i]);
        }
}

// Scratch of the AMX path for one d and dv1: per pair p < pk (padded to 16) its query rows r and t (the pair is
// (r; t, t + 1)) and the current head's weights of its two features (0 for a missing second one, and past the last
// pair, whose rows are 0: zero features); the state's pairs transposed (spt); and the 16 tokens of the current B
// tiles in the layout b_rows reads (xd, xp).
namespace {  // internal linkage: another build of this file in the process keeps its own `kept` (GNU_UNIQUE)

struct AmxScratch {
    int d, dv1, pairs, pk;
    std::vector<int32_t> lo, hi;  // each pair's state rows (hi -1: none)
    std::vector<int32_t> rr, rt;
    std::vector<float> wp;  // [heads, pk, 2]: every query head's weights in pair order (`weights`)
    std::vector<uint32_t> spt;
    std::vector<float> xd, xp;  // [d, 32]: per row r, x_r of each token twice; (x_r, x_r+1) of each token (0 past d)

    AmxScratch(int d_, int dv1_) : d(d_), dv1(dv1_), pairs(pair_count(d_)), pk((pair_count(d_) + 15) / 16 * 16) {
        for (int r = 0, f = 1 + d; r < d; f += d - r, ++r)
            for (int t = r; t < d; t += 2) {
                rr.push_back(r);
                rt.push_back(t);
                lo.push_back(f + t - r);
                hi.push_back(t + 1 < d ? f + t - r + 1 : -1);
            }
        rr.resize(pk, 0);
        rt.resize(pk, 0);
        spt.assign((size_t)(dv1 + 15) / 16 * 16 * pk, 0u);
        xd.assign((size_t)d * 32, 0.0f);
        xp.assign((size_t)d * 32, 0.0f);
    }

    static AmxScratch& of(int d, int dv1) {  // the thread's, kept between calls (its state buffer is 300 KB at d = 64)
        static thread_local std::unique_ptr<AmxScratch> kept;
        if (!kept || kept->d != d || kept->dv1 != dv1) kept = std::make_unique<AmxScratch>(d, dv1);
        return *kept;
    }

    void weights(const float* w, int heads, int feats) {  // w [heads, F], once per call: the same for every chunk
        wp.assign((size_t)heads * pk * 2, 0.0f);
        for (int h = 0; h < heads; ++h)
            for (int p = 0; p < pairs; ++p) {
                const float* wh = w + (ptrdiff_t)h * feats;
                wp[((size_t)h * pk + p) * 2] = wh[lo[p]];
                wp[((size_t)h * pk + p) * 2 + 1] = hi[p] >= 0 ? wh[hi[p]] : 0.0f;
            }
    }

    // xd and xp for 16 tokens: x at the first, row r at x + r * xs. Lanes 2n, 2n + 1 of each half hold token n
    // (then 8 + n), so that one product per half gives a pair's two features already interleaved, as B takes them.
    void tokens(const float* x, ptrdiff_t xs) {
        const __m512i dup_lo = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
        const __m512i dup_hi = _mm512_set_epi32(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8, 8);
        const __m512i mix_lo = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
        const __m512i mix_hi = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
        __m512 v = _mm512_loadu_ps(x);
        for (int r = 0; r < d; ++r) {
            const __m512 next = r + 1 < d ? _mm512_loadu_ps(x + (r + 1) * xs) : _mm512_setzero_ps();
            float* dr = xd.data() + (ptrdiff_t)r * 32;
            float* pr = xp.data() + (ptrdiff_t)r * 32;
            _mm512_storeu_ps(dr, _mm512_permutexvar_ps(dup_lo, v));
            _mm512_storeu_ps(dr + 16, _mm512_permutexvar_ps(dup_hi, v));
            _mm512_storeu_ps(pr, _mm512_permutex2var_ps(v, mix_lo, next));
            _mm512_storeu_ps(pr + 16, _mm512_permutex2var_ps(v, mix_hi, next));
            v = next;
        }
    }
};

// Rows from..to of B tile k of one head and the 16 tokens of sc.tokens: row i holds pair p = 16k + i's weighted
// features (w_rt q_r q_t, w_r,t+1 q_r q_t+1) of the tokens as bf16 pairs: (x_r x_r) * (x_t x_t+1) * (w w'), per half.
// wp: the head's weights in sc.wp.
static inline void b_rows(const AmxScratch& sc, const float* wp, int k, uint32_t* bt, int from, int to) {
    for (int i = from; i < to; ++i) {
        const int p = k * 16 + i;
        double wpair;  // the two weights, broadcast as one 64-bit lane
        __builtin_memcpy(&wpair, wp + 2 * p, sizeof wpair);
        const __m512 ww = _mm512_castpd_ps(_mm512_set1_pd(wpair));
        const float* dr = sc.xd.data() + (ptrdiff_t)sc.rr[p] * 32;
        const float* pt = sc.xp.data() + (ptrdiff_t)sc.rt[p] * 32;
        const __m512 lo = _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(dr), _mm512_loadu_ps(pt)), ww);
        const __m512 hi = _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(dr + 16), _mm512_loadu_ps(pt + 16)), ww);
        _mm512_storeu_si512(bt + i * 16, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));  // tokens 0..7 low, 8..15 high
    }
}

}  // namespace

// The quadratic part of one head's numerator on the tiles: out rows 0..dv1 x tokens 0..c (row o at out + o * os)
// += spt . phi. The B tiles are formed 16 pairs x 16 tokens at a time in L1, the next one between the current
// one's products (the vector units and the tile unit work side by side); x: the head's queries at token 0, row r at
// x + r * xs, wp its weights in sc.wp; c a multiple of 16. Passes of four whole output blocks, the part (dv1 % 16 rows)
// in the last.
static void head_amx(AmxScratch& sc, const float* x, ptrdiff_t xs, const float* wp, int c, int dv1, float* out,
                     ptrdiff_t os) {
    alignas(64) uint32_t bt[2][16 * 16];
    const int steps = sc.pk / 16, pk = sc.pk, whole = dv1 / 16, part = dv1 % 16;
    const int passes = whole == 0 ? 1 : (whole + 3) / 4;
    const uint32_t* ap = sc.spt.data() + (ptrdiff_t)whole * 16 * pk;  // the part's A rows
    for (int pass = 0; pass < passes; ++pass) {
        const int o0 = pass * 64, nb = whole - pass * 4 < 4 ? whole - pass * 4 : 4;
        const bool tail = part && pass == passes - 1;
        const uint32_t* a = sc.spt.data() + (ptrdiff_t)o0 * pk;
        for (int i0 = 0; i0 < c; i0 += 16) {
            float* c0 = out + (ptrdiff_t)o0 * os + i0;
            float* cp = out + (ptrdiff_t)whole * 16 * os + i0;
#define C_TILES(op)                                                         \
    if (nb > 0) op(0, c0, os * 4);                                          \
    if (nb > 1) op(1, c0 + 16 * os, os * 4);                                \
    if (nb > 2) op(2, c0 + 32 * os, os * 4);                                \
    if (nb > 3) op(3, c0 + 48 * os, os * 4);                                \
    if (tail) op(4, cp, os * 4);
#define STEP(b) \
    if (nb > b) { _tile_loadd(5, a + (ptrdiff_t)(b) * 16 * pk + k * 16, pk * 4); _tile_dpbf16ps(b, 5, 7); }
            C_TILES(_tile_loadd)
            sc.tokens(x + i0, xs);
            b_rows(sc, wp, 0, bt[0], 0, 16);
            for (int k = 0; k < steps; ++k) {
                _tile_loadd(7, bt[k & 1], 64);
                uint32_t* next = bt[(k + 1) & 1];
                const int more = k + 1 < steps ? 4 : 0;  // rows of the next B tile formed after each product
                STEP(0) b_rows(sc, wp, k + 1, next, 0, more);
                STEP(1) b_rows(sc, wp, k + 1, next, more, 2 * more);
                STEP(2) b_rows(sc, wp, k + 1, next, 2 * more, 3 * more);
                STEP(3) b_rows(sc, wp, k + 1, next, 3 * more, 4 * more);
                if (tail) {
                    _tile_loadd(6, ap + k * 16, pk * 4);
                    _tile_dpbf16ps(4, 6, 7);
                }
            }
            C_TILES(_tile_stored)
#undef C_TILES
#undef STEP
        }
    }
}

// One item on the tiles (x already widened to fp32; kv its KV head, whose weights w are): per head the fp32 part
// into `out`, then the pairs on AMX.
static void item_amx(const float* x, const float* w, const float* s, float* out, int d, int rep, int c, int dv1,
                     int feats, AmxScratch& sc, int kv, const ItemIntra& it, const Intra* in) {
    const ptrdiff_t xs = (ptrdiff_t)rep * c, os = (ptrdiff_t)rep * c;
    state_pairs_t(s, dv1, sc.lo.data(), sc.hi.data(), sc.pairs, sc.pk, sc.spt.data());
    for (int j = 0; j < rep; ++j) {
        const float* wj = w + (ptrdiff_t)j * feats;
        const float* xj = x + (ptrdiff_t)j * c;
        // constant, linear and the chunk's keys in fp32: the dot products' tiles without pairs
        head_dp(xj, xs, wj, s, dv1, nullptr, nullptr, c, 0, out + (ptrdiff_t)j * c, os, d, it, in, j);
        const float* wp = sc.wp.data() + ((ptrdiff_t)kv * rep + j) * sc.pk * 2;
        head_amx(sc, xj, xs, wp, c, dv1, out + (ptrdiff_t)j * c, os);
    }
}

// The chain of chunk states on the tiles (Eq. 5): S_{c+1} = S_c + psi(K_c)^T U_c with bf16 key features and values.
// C = 16 state rows x 16 columns, loaded from S_c and stored into S_{c+1}: the tile unit adds the exact products to
// the fp32 state itself, so each chunk state is read once and written once (the torch path copies each chunk's
// strided features, rounds its increment to bf16, widens it and adds it: four passes); A = 16 feature rows x 32
// tokens, read in place from psi; B = 16 token pairs x 16 columns of U_c (values_b).
// Tiles 0..3: C of four whole column blocks, 4: C of the last dv1 % 16 columns (part); 5: A; 6, 7: B of a whole
// block and of the part. rows: the state rows of this pass (16, or the last F % 16).
static void chain_configure(int rows, int part) {
    TileConfig cfg = {};
    cfg.palette = 1;
    for (int t = 0; t < 8; ++t) {
        cfg.rows[t] = t >= 6 ? 16 : rows;
        cfg.colsb[t] = (t == 4 || t == 7) && part ? part * 4 : 64;
    }
    _tile_loadconfig(&cfg);
}

// One chunk's values U [c, dv1] (bf16 bits, row l at u + l * dv1) as B tiles: tile (step ks, block b) at
// bt + (ks * nb + b) * 256 holds (U[32 ks + 2 kp, 16 b + n], U[32 ks + 2 kp + 1, 16 b + n]) at kp * 16 + n, zeros
// past dv1 (nb = ceil(dv1 / 16)).
static void values_b(const uint16_t* u, int c, int dv1, uint32_t* bt) {
    const int nb = (dv1 + 15) / 16;
    for (int ks = 0; ks < c / 32; ++ks)
        for (int kp = 0; kp < 16; ++kp) {
            const uint16_t* r0 = u + (ptrdiff_t)(32 * ks + 2 * kp) * dv1;
            for (int b = 0; b < nb; ++b) {
                const int m = dv1 - 16 * b < 16 ? dv1 - 16 * b : 16;
                const __mmask16 mask = (__mmask16)((1u << m) - 1);
                const __m512i lo = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, r0 + 16 * b));
                const __m512i hi = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, r0 + dv1 + 16 * b));
                _mm512_storeu_si512(bt + ((ptrdiff_t)(ks * nb + b) * 16 + kp) * 16,
                                    _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
            }
        }
}

// State rows f0.. (the configured rows) of one chunk: s1 = s0 + psi^T U. pc: the chunk's first token of row f0's
// features (row stride t), bt: values_b's tiles.
static void chain_rows(const float* s0, float* s1, const uint16_t* pc, ptrdiff_t t, const uint32_t* bt, int steps,
                       int dv1) {
    const int nb = (dv1 + 15) / 16, whole = dv1 / 16, part = dv1 % 16;
    const int passes = whole == 0 ? 1 : (whole + 3) / 4;
    const ptrdiff_t ss = (ptrdiff_t)dv1 * 4;
    for (int pass = 0; pass < passes; ++pass) {
        const int b0 = pass * 4, n = whole - b0 < 4 ? whole - b0 : 4;
        const bool tail = part && pass == passes - 1;
#define C_TILES(op, base)                                           \
    if (n > 0) op(0, base + (b0 + 0) * 16, ss);                      \
    if (n > 1) op(1, base + (b0 + 1) * 16, ss);                      \
    if (n > 2) op(2, base + (b0 + 2) * 16, ss);                      \
    if (n > 3) op(3, base + (b0 + 3) * 16, ss);                      \
    if (tail) op(4, base + whole * 16, ss);
#define STEP(i) \
    if (n > i) { _tile_loadd(6, bk + (ptrdiff_t)(b0 + i) * 256, 64); _tile_dpbf16ps(i, 5, 6); }
        C_TILES(_tile_loadd, s0)
        for (int ks = 0; ks < steps; ++ks) {
            const uint32_t* bk = bt + (ptrdiff_t)ks * nb * 256;
            _tile_loadd(5, pc + 32 * ks, t * 2);
            STEP(0) STEP(1) STEP(2) STEP(3)
            if (tail) {
                _tile_loadd(7, bk + (ptrdiff_t)whole * 256, 64);
                _tile_dpbf16ps(4, 5, 7);
            }
        }
        C_TILES(_tile_stored, s1)
#undef C_TILES
#undef STEP
    }
}
#else
#define HAVE_AMX 0
#endif

// The chains' loop (`oal_states_*`): chunk(s0, s1, pc, u) for every chunk ci of items [begin, end), with s0, s1 the
// item's states S_ci and S_ci+1 in prev [nc + 1, items, F, dv1], pc its features at the chunk's first token (row
// stride nc * c) and u the chunk's values (row stride dv1; item k's at ug + (k / hkv) * ub + (k % hkv) * uh).
template <typename T, typename Chunk>
static void each_chunk(const T* psi, const T* ug, int64_t ub, int64_t uh, float* prev, int64_t begin, int64_t end,
                       int hkv, int64_t items, int nc, int c, int feats, int dv1, Chunk chunk) {
    const ptrdiff_t t = (ptrdiff_t)nc * c, sn = (ptrdiff_t)feats * dv1;
    for (int64_t k = begin; k < end; ++k)
        for (int ci = 0; ci < nc; ++ci)
            chunk(prev + ((ptrdiff_t)ci * items + k) * sn, prev + ((ptrdiff_t)(ci + 1) * items + k) * sn,
                  psi + k * feats * t + (ptrdiff_t)ci * c, ug + k / hkv * ub + k % hkv * uh + (ptrdiff_t)ci * c * dv1);
}

// The chain of chunk states in fp32 (Eq. 5), the tiles' schedule in vector registers: R state rows x NB vectors of
// columns accumulate from S_c's rows, take the chunk's c tokens (U's row loaded once for the R rows, psi broadcast)
// and go to S_{c+1}: each chunk state read once and written once, where torch's baddbmm first copied S_c into
// S_{c+1} and then added the product (a second pass over the state).
#define CR ((NREG - 6) / 4)  // state rows a block (6 with AVX-512, 2 with AVX2)

// Rows f0..f0+R (R <= CR), columns o0..o0+NB*VW: s, t: S_c and S_{c+1} at (f0, o0); p: psi at (f0, the chunk's first
// token), row stride pt; u: U_c at (token 0, o0), row stride dv1.
template <int R, int NB>
static void chain_block(const float* s, float* t, const float* p, ptrdiff_t pt, const float* u, int c, int dv1) {
    vf acc[R][NB];
    for (int i = 0; i < R; ++i)
        for (int b = 0; b < NB; ++b) acc[i][b] = load(s + (ptrdiff_t)i * dv1 + b * VW);
    for (int l = 0; l < c; ++l) {
        vf ul[NB];
        for (int b = 0; b < NB; ++b) ul[b] = load(u + (ptrdiff_t)l * dv1 + b * VW);
        for (int i = 0; i < R; ++i) {
            const float pl = p[i * pt + l];
            for (int b = 0; b < NB; ++b) acc[i][b] += pl * ul[b];
        }
    }
    for (int i = 0; i < R; ++i)
        for (int b = 0; b < NB; ++b) store(t + (ptrdiff_t)i * dv1 + b * VW, acc[i][b]);
}

typedef void (*chain_fn)(const float*, float*, const float*, ptrdiff_t, const float*, int, int);

template <int NB, int R = CR>
static chain_fn chain_of(int r) {  // the instance for r <= CR rows
    if constexpr (R == 0)
        return nullptr;
    else
        return r == R ? chain_block<R, NB> : chain_of<NB, R - 1>(r);
}

// One chunk: s1 = s0 + psi^T U for all F rows; whole vectors of columns in blocks of up to 4, the last dv1 % VW
// columns as dot products over the tokens (psi's rows are contiguous in them; ucol: those columns of U, column-major).
static void chain_chunk_f32(const float* s0, float* s1, const float* pc, ptrdiff_t pt, const float* u, int c, int dv1,
                            int feats, const float* ucol) {
    const int vecs = dv1 / VW, rest = dv1 % VW;
    for (int f0 = 0; f0 < feats; f0 += CR) {
        const int r = feats - f0 < CR ? feats - f0 : CR;
        const float* s = s0 + (ptrdiff_t)f0 * dv1;
        float* t = s1 + (ptrdiff_t)f0 * dv1;
        const float* p = pc + f0 * pt;
        for (int v0 = 0; v0 < vecs; v0 += 4) {
            const int nb = vecs - v0 < 4 ? vecs - v0 : 4;
            const chain_fn fn = nb == 4 ? chain_of<4>(r) : nb == 3 ? chain_of<3>(r) : nb == 2 ? chain_of<2>(r)
                                                                                      : chain_of<1>(r);
            fn(s + v0 * VW, t + v0 * VW, p, pt, u + v0 * VW, c, dv1);
        }
        for (int i = 0; i < r; ++i)
            for (int j = 0; j < rest; ++j) {
                const int o = vecs * VW + j;
                vf acc = {};
                for (int l = 0; l < c; l += VW) acc += load(p + i * pt + l) * load(ucol + (ptrdiff_t)j * c + l);
                float sum = s[(ptrdiff_t)i * dv1 + o];
                for (int k = 0; k < VW; ++k) sum += acc[k];
                t[(ptrdiff_t)i * dv1 + o] = sum;
            }
    }
}

// One token of the decoding step on one KV head's state rows [F, dv1] (`oal_decode_f32`), in one pass: row f gets
// S[f, :] += psi_f(xk) u (Eq. 5), then each of the rep query heads h adds w[h, f] psi_f(xq_h) S[f, :] to its
// numerator out[h] (Eq. 6). The x are [1, x_1 .. x_d], so that psi_f(x) = x[rowr[f] + 1] x[rowt[f] + 1]. The
// row's NV full vectors stay in registers between its update and its readouts (the dv1 % VW columns after them
// are scalars); the numerators live in a small buffer in L1. The state is read and written once: passes of
// their own for the update and each head's readout read it 1 + rep times, from memory when the model's weights
// have pushed it out of the caches.
typedef void (*DecodeStep)(float*, const float*, const float*, const float*, const float*, ptrdiff_t, float*,
                           const int32_t*, const int32_t*, int, int, int, int);

template <int NV_>
static void decode_step(float* s, const float* xk, const float* u, const float* xq, const float* w, ptrdiff_t ws,
                        float* out, const int32_t* rowr, const int32_t* rowt, int feats, int d1, int dv1, int rep) {
    constexpr int N = NV_ > 0 ? NV_ : 1;
    const int tail = dv1 - NV_ * VW;
    vf uv[N];
    for (int i = 0; i < NV_; ++i) uv[i] = load(u + i * VW);
    std::vector<float> acc((size_t)rep * N * VW, 0.0f), at((size_t)rep * VW, 0.0f);
    for (int f = 0; f < feats; ++f) {
        const int a = rowr[f] + 1, b = rowt[f] + 1;
        const float psi = xk[a] * xk[b];
        float* row = s + (ptrdiff_t)f * dv1;
        vf rv[N];
        for (int i = 0; i < NV_; ++i) {
            rv[i] = load(row + i * VW) + psi * uv[i];
            store(row + i * VW, rv[i]);
        }
        for (int o = 0; o < tail; ++o) row[NV_ * VW + o] += psi * u[NV_ * VW + o];
        for (int h = 0; h < rep; ++h) {
            const float* x = xq + (ptrdiff_t)h * d1;
            const float phi = w[h * ws + f] * x[a] * x[b];
            float* ah = acc.data() + (size_t)h * N * VW;
            for (int i = 0; i < NV_; ++i) store(ah + i * VW, load(ah + i * VW) + phi * rv[i]);
            for (int o = 0; o < tail; ++o) at[(size_t)h * VW + o] += phi * row[NV_ * VW + o];
        }
    }
    for (int h = 0; h < rep; ++h) {
        const float* ah = acc.data() + (size_t)h * N * VW;
        for (int i = 0; i < NV_; ++i) store(out + (ptrdiff_t)h * dv1 + i * VW, load(ah + i * VW));
        for (int o = 0; o < tail; ++o) out[(ptrdiff_t)h * dv1 + NV_ * VW + o] = at[(size_t)h * VW + o];
    }
}

// More columns than the registers hold (dv1 > 8 VW + VW - 1: dv above 142 with AVX-512, 70 with AVX2): the
// update, then each head's readout, row by row in plain loops.
static void decode_step_wide(float* s, const float* xk, const float* u, const float* xq, const float* w,
                             ptrdiff_t ws, float* out, const int32_t* rowr, const int32_t* rowt, int feats, int d1,
                             int dv1, int rep) {
    for (ptrdiff_t i = 0; i < (ptrdiff_t)rep * dv1; ++i) out[i] = 0.0f;
    for (int f = 0; f < feats; ++f) {
        const int a = rowr[f] + 1, b = rowt[f] + 1;
        const float psi = xk[a] * xk[b];
        float* row = s + (ptrdiff_t)f * dv1;
        for (int o = 0; o < dv1; ++o) row[o] += psi * u[o];
        for (int h = 0; h < rep; ++h) {
            const float phi = w[h * ws + f] * xq[(ptrdiff_t)h * d1 + a] * xq[(ptrdiff_t)h * d1 + b];
            float* oh = out + (ptrdiff_t)h * dv1;
            for (int o = 0; o < dv1; ++o) oh[o] += phi * row[o];
        }
    }
}

static DecodeStep decode_step_of(int nv) {
    switch (nv) {
        case 0: return decode_step<0>;
        case 1: return decode_step<1>;
        case 2: return decode_step<2>;
        case 3: return decode_step<3>;
        case 4: return decode_step<4>;
        case 5: return decode_step<5>;
        case 6: return decode_step<6>;
        case 7: return decode_step<7>;
        case 8: return decode_step<8>;
        default: return decode_step_wide;
    }
}

extern "C" {

int oal_readout_vw(void) { return VW; }

// 1 where bf16 queries run bf16 dot products (AVX512_BF16), 0 where they are widened to fp32.
int oal_readout_bf16_dots(void) { return HAVE_DP; }

// 1 where bf16 queries can run the quadratic features on AMX tiles (built with AMX-BF16, and the OS grants this
// process the tile registers), else 0.
int oal_readout_amx(void) {
#if HAVE_AMX
    return amx_permitted() ? 1 : 0;
#else
    return 0;
#endif
}

// Items [begin, end) of the layouts above, with fp32 queries read from q [B, Hq, N, d] (row (b, h, t) at q + b * qb +
// h * qh + t * qt; gather_queries). kv = item % hkv picks the weights. kb == nullptr: no intra-chunk term (the other
// intra arguments are then not read). fin != nullptr: the normalised output goes there (`Final`: strides sb, sh, st
// in elements, half 1 for bf16) and `out` is not written (nullptr).
void oal_readout_f32(const float* q, int64_t qb, int64_t qh, int64_t qt, int bsz, const float* w, const float* s,
                     float* out, int64_t begin, int64_t end, int hkv, int d, int rep, int c, int dv1, const float* kb,
                     const float* ub, const int32_t* order, const int32_t* bounds, const float* lower, int groups,
                     float eps, void* fin, int64_t sb, int64_t sh, int64_t st, int half) {
    const int feats = 1 + d + d * (d + 1) / 2;
    const ptrdiff_t xn = (ptrdiff_t)d * rep * c, sn = (ptrdiff_t)feats * dv1, on = (ptrdiff_t)dv1 * rep * c;
    const Intra in{kb, ub, order, bounds, lower, groups, eps};
    const Final final{fin, sb, sh, st, half, bsz};
    std::vector<float> x(xn), kappa(kb ? (size_t)c * (c + 2 * d) : 0), num(fin ? (size_t)on : 0);
    for (int64_t k = begin; k < end; ++k) {
        const int kv = (int)(k % hkv);
        gather_queries(q, qb, qh, qt, k, hkv, bsz, d, rep, c, x.data());
        const ItemIntra it = item_intra(&in, k, kv, d, rep, c, dv1, kappa.data());
        float* dst = fin ? num.data() : out + k * on;
        item(x.data(), w + kv * (ptrdiff_t)rep * feats, s + k * sn, dst, d, rep, c, dv1, feats, it, &in);
        if (fin) finish(dst, k, hkv, rep, c, dv1, final);
    }
}

// The same with bf16 queries (their uint16 bits), widened exactly to fp32 as they are gathered. `mode` 0: the fp32
// kernel; 1: bf16 dot products (needs oal_readout_bf16_dots()); 2: the quadratic features on AMX tiles (needs
// oal_readout_amx()).
void oal_readout_bf16(const uint16_t* q, int64_t qb, int64_t qh, int64_t qt, int bsz, const float* w, const float* s,
                      float* out, int64_t begin, int64_t end, int hkv, int d, int rep, int c, int dv1, int mode,
                      const float* kb, const float* ub, const int32_t* order, const int32_t* bounds, const float* lower,
                      int groups, float eps, void* fin, int64_t sb, int64_t sh, int64_t st, int half) {
    const int feats = 1 + d + d * (d + 1) / 2;
    const ptrdiff_t xn = (ptrdiff_t)d * rep * c, sn = (ptrdiff_t)feats * dv1, on = (ptrdiff_t)dv1 * rep * c;
    const Intra in{kb, ub, order, bounds, lower, groups, eps};
    const Final final{fin, sb, sh, st, half, bsz};
    std::vector<float> wide(xn), kappa(kb ? (size_t)c * (c + 2 * d) : 0), num(fin ? (size_t)on : 0);
#if HAVE_AMX
    const bool tiles = mode == 2 && amx_permitted();
    AmxScratch* sc = tiles ? &AmxScratch::of(d, dv1) : nullptr;
    if (tiles) {
        sc->weights(w, hkv * rep, feats);
        amx_configure(dv1 % 16);  // the tile configuration is the thread's own
    }
#else
    [[maybe_unused]] const bool tiles = false;
#endif
#if HAVE_DP
    const bool dots = mode != 0 && !tiles;
    const int pairs = pair_count(d);
    std::vector<uint32_t> sp(dots ? (size_t)pairs * dv1 : 0), pp(dots ? (size_t)pairs * c : 0);
#endif
    for (int64_t k = begin; k < end; ++k) {
        gather_queries(q, qb, qh, qt, k, hkv, bsz, d, rep, c, wide.data());  // widened exactly to fp32
        const int kv = (int)(k % hkv);
        const float* wk = w + kv * (ptrdiff_t)rep * feats;
        const ItemIntra it = item_intra(&in, k, kv, d, rep, c, dv1, kappa.data());
        float* dst = fin ? num.data() : out + k * on;
#if HAVE_AMX
        if (tiles)
            item_amx(wide.data(), wk, s + k * sn, dst, d, rep, c, dv1, feats, *sc, kv, it, &in);
        else
#endif
#if HAVE_DP
        if (dots)
            item_dp(wide.data(), wk, s + k * sn, dst, d, rep, c, dv1, feats, sp.data(), pp.data(), it, &in);
        else
#endif
            item(wide.data(), wk, s + k * sn, dst, d, rep, c, dv1, feats, it, &in);
        if (fin) finish(dst, k, hkv, rep, c, dv1, final);
    }
#if HAVE_AMX
    if (tiles) _tile_release();
#endif
}

// The chain of chunk states for items [begin, end) of (batch row, KV head) with bf16 keys, on AMX tiles (needs
// oal_readout_amx()): prev[c + 1] = prev[c] + psi(K_c)^T U_c for c < nc (Eq. 5).
//   psi [items, F, nc * C] the keys' features (bf16 bits), feature-major; ug: item k's values [nc * C, dv1] (bf16
//   bits, contiguous rows) at ug + (k / hkv) * ub + (k % hkv) * uh; prev [nc + 1, items, F, dv1] fp32, prev[0]
//   the state before the first chunk. C a multiple of 32. Returns 0, or -1 where the tiles are not available.
int oal_states_bf16(const uint16_t* psi, const uint16_t* ug, int64_t ub, int64_t uh, float* prev, int64_t begin,
                    int64_t end, int hkv, int64_t items, int nc, int c, int feats, int dv1) {
#if HAVE_AMX
    if (!amx_permitted() || c % 32) return -1;
    const ptrdiff_t t = (ptrdiff_t)nc * c;
    const int steps = c / 32, whole = feats / 16 * 16, rest = feats % 16;
    std::vector<uint32_t> bt((size_t)steps * ((dv1 + 15) / 16) * 256);
    each_chunk(psi, ug, ub, uh, prev, begin, end, hkv, items, nc, c, feats, dv1,
               [&](const float* s0, float* s1, const uint16_t* pc, const uint16_t* u) {
                   values_b(u, c, dv1, bt.data());
                   chain_configure(16, dv1 % 16);  // whole blocks of 16 state rows, then the rest
                   for (int f0 = 0; f0 < whole; f0 += 16)
                       chain_rows(s0 + f0 * dv1, s1 + f0 * dv1, pc + f0 * t, t, bt.data(), steps, dv1);
                   if (rest) {
                       chain_configure(rest, dv1 % 16);
                       chain_rows(s0 + whole * dv1, s1 + whole * dv1, pc + whole * t, t, bt.data(), steps, dv1);
                   }
               });
    _tile_release();
    return 0;
#else
    (void)psi, (void)ug, (void)ub, (void)uh, (void)prev, (void)begin, (void)end, (void)hkv, (void)items, (void)nc;
    (void)c, (void)feats, (void)dv1;
    return -1;
#endif
}

// The same chain with fp32 features and values (any CPU; C a multiple of VW). Returns 0.
int oal_states_f32(const float* psi, const float* ug, int64_t ub, int64_t uh, float* prev, int64_t begin,
                   int64_t end, int hkv, int64_t items, int nc, int c, int feats, int dv1) {
    const int rest = dv1 % VW;
    std::vector<float> ucol((size_t)(rest ? rest : 1) * c);
    each_chunk(psi, ug, ub, uh, prev, begin, end, hkv, items, nc, c, feats, dv1,
               [&](const float* s0, float* s1, const float* pc, const float* u) {
                   for (int j = 0; j < rest; ++j)
                       for (int l = 0; l < c; ++l) ucol[(size_t)j * c + l] = u[(ptrdiff_t)l * dv1 + dv1 - rest + j];
                   chain_chunk_f32(s0, s1, pc, (ptrdiff_t)nc * c, u, c, dv1, feats, ucol.data());
               });
    return 0;
}

// One decoding call of the token loop (Algorithm 1: Eq. 5, then Eq. 6) on the state, for items [begin, end), item
// = (batch row, KV head): for each of T tokens S[f, :] += psi_f(k_t) u_t, then num[h, t, :] = sum_f w[h, f]
// psi_f(q_ht) S[f, :] for the rep query heads h of the KV head.
//   k [items, T, d] and u [items, T, dv1] the keys and the rows they add ([v, 1], or a sliding window's evicted
//   [v, w]); q [items, rep, T, d]; w [Hkv, rep, F] (item k's KV head is k % hkv); s: item k's [F, dv1] rows at
//   s + k * s_stride, updated in place; num [items, rep, T, dv1], overwritten. rowr, rowt [F]: row f of the state
//   is x_r x_t, -1 standing for a factor 1 (oal.ops.kernel.row_maps). All fp32 and contiguous.
void oal_decode_f32(const float* k, const float* u, const float* q, const float* w, const int32_t* rowr,
                    const int32_t* rowt, float* s, int64_t s_stride, float* num, int64_t begin, int64_t end, int hkv,
                    int d, int rep, int tokens, int dv1) {
    const int feats = 1 + d + d * (d + 1) / 2, d1 = d + 1;
    const DecodeStep step = decode_step_of(dv1 / VW);
    std::vector<float> xk(d1), xq((size_t)rep * d1), out((size_t)rep * dv1);
    for (int64_t item = begin; item < end; ++item) {
        const float* wk = w + (item % hkv) * (ptrdiff_t)rep * feats;
        for (int t = 0; t < tokens; ++t) {  // token t's pass reads the state its predecessors left
            const int64_t kt = item * tokens + t;
            xk[0] = 1.0f;
            for (int r = 0; r < d; ++r) xk[1 + r] = k[kt * d + r];
            for (int h = 0; h < rep; ++h) {
                xq[(size_t)h * d1] = 1.0f;
                for (int r = 0; r < d; ++r) xq[(size_t)h * d1 + 1 + r] = q[((item * rep + h) * tokens + t) * d + r];
            }
            step(s + item * s_stride, xk.data(), u + kt * dv1, xq.data(), wk, feats, out.data(), rowr, rowt, feats,
                 d1, dv1, rep);
            for (int h = 0; h < rep; ++h)
                for (int o = 0; o < dv1; ++o) num[((item * rep + h) * tokens + t) * dv1 + o] = out[(size_t)h * dv1 + o];
        }
    }
}

// One decoding call of swa / oal-swa (oal.ops.window, the token loop of window/recurrent.py) for items [begin,
// end), item = (batch row, KV head), on its state (window/state.py): slots [S + W, c], c = d + dv + 1, rows
// [k, v, 1] (all zero when empty: the sinks first, then the window's rows oldest first, right-aligned), at
// st + item * st_stride, and for oal-swa (w != nullptr) the prefix [F, dv + 1] right after them. Per token: the
// token fills the next sink row while fewer than S are filled, else it enters the window rows and the oldest
// leaves them into the prefix (Eq. 5); each query head then reads the filled rows with softmax weights (scores
// scale q . k) and, for oal-swa, the prefix with the kernel (Eq. 6: queries kq, the rescaled q, and weights w
// [Hkv, rep, F]), both under one normaliser (window/normaliser.py, log_lam the kernel's log rescaling).
//   q, kq [items, rep, T, d], k [items, T, d], v [items, T, dv]; out [items, rep, T, dv]. All fp32, contiguous.
void oal_window_decode_f32(const float* q, const float* kq, const float* k, const float* v, float* st,
                           int64_t st_stride, const float* w, const int32_t* rowr, const int32_t* rowt, float* out,
                           int64_t begin, int64_t end, int hkv, int d, int dv, int rep, int tokens, int sinks,
                           int window, float scale, float log_lam) {
    const int c = d + dv + 1, dv1 = dv + 1, rows = sinks + window, feats = 1 + d + d * (d + 1) / 2, d1 = d + 1;
    const DecodeStep step = decode_step_of(dv1 / VW);
    std::vector<float> row(c), left(c), xk(d1), xq((size_t)rep * d1), older((size_t)rep * dv1), score(rows),
        acc(dv1);
    for (int64_t item = begin; item < end; ++item) {
        float* slots = st + item * st_stride;
        float* prefix = slots + (ptrdiff_t)rows * c;
        const float* wk = w ? w + (item % hkv) * (ptrdiff_t)rep * feats : nullptr;
        for (int t = 0; t < tokens; ++t) {
            const int64_t kt = item * tokens + t;
            for (int r = 0; r < d; ++r) row[r] = k[kt * d + r];
            for (int o = 0; o < dv; ++o) row[d + o] = v[kt * dv + o];
            row[c - 1] = 1.0f;
            int filled = 0;  // sinks fill in order: the next free sink row
            while (filled < sinks && slots[(ptrdiff_t)filled * c + c - 1] > 0.0f) ++filled;
            for (int o = 0; o < c; ++o) left[o] = 0.0f;
            if (filled < sinks) {
                for (int o = 0; o < c; ++o) slots[(ptrdiff_t)filled * c + o] = row[o];
            } else {
                float* buf = slots + (ptrdiff_t)sinks * c;
                for (int o = 0; o < c; ++o) left[o] = buf[o];
                for (ptrdiff_t o = 0; o < (ptrdiff_t)(window - 1) * c; ++o) buf[o] = buf[o + c];
                for (int o = 0; o < c; ++o) buf[(ptrdiff_t)(window - 1) * c + o] = row[o];
            }
            if (w) {  // the evicted row [k, v, w] into the prefix, then every head's readout, in one pass
                xk[0] = 1.0f;
                for (int r = 0; r < d; ++r) xk[1 + r] = left[r];
                for (int h = 0; h < rep; ++h) {
                    const float* kqh = kq + ((item * rep + h) * tokens + t) * d;
                    xq[(size_t)h * d1] = 1.0f;
                    for (int r = 0; r < d; ++r) xq[(size_t)h * d1 + 1 + r] = kqh[r];
                }
                step(prefix, xk.data(), left.data() + d, xq.data(), wk, feats, older.data(), rowr, rowt, feats, d1,
                     dv1, rep);
            }
            for (int h = 0; h < rep; ++h) {
                const float* qh = q + ((item * rep + h) * tokens + t) * d;
                float m = -INFINITY;
                for (int j = 0; j < rows; ++j) {
                    const float* sj = slots + (ptrdiff_t)j * c;
                    float dot = 0.0f;
                    for (int r = 0; r < d; ++r) dot += qh[r] * sj[r];
                    score[j] = sj[c - 1] > 0.0f ? dot * scale : -INFINITY;
                    m = score[j] > m ? score[j] : m;  // finite: the token's own row is filled
                }
                for (int o = 0; o < dv1; ++o) acc[o] = 0.0f;
                for (int j = 0; j < rows; ++j) {
                    if (score[j] == -INFINITY) continue;
                    const float e = expf(score[j] - m);
                    const float* uj = slots + (ptrdiff_t)j * c + d;
                    for (int o = 0; o < dv1; ++o) acc[o] += e * uj[o];
                }
                float ww = 1.0f, wo = 0.0f;  // the window's and the older keys' weights (normaliser.py)
                const float* oh = older.data() + (ptrdiff_t)h * dv1;
                if (w && oh[dv] > 0.0f) {
                    const float log_older = logf(oh[dv]) + log_lam, top = m > log_older ? m : log_older;
                    ww = expf(m - top);
                    wo = expf(log_older - top) / oh[dv];
                }
                float* oht = out + ((item * rep + h) * tokens + t) * dv;
                const float den = acc[dv] * ww + (w ? oh[dv] * wo : 0.0f);
                for (int o = 0; o < dv; ++o) oht[o] = (acc[o] * ww + (w ? oh[o] * wo : 0.0f)) / den;
            }
        }
    }
}
}
