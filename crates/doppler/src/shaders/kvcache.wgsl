// Attention for inference over a key/value cache, and writing into that cache.
//
//   kv_store   cache[(pos + t) * row + i] = src[t * row + i]       cover t * row, 256 a group
//              cache (tmax, Hkv, D), src (T, Hkv, D), row = Hkv * D
//   attend     o[t, h] = sum_j softmax_j(scale * q[t, h] . k[j, h / G]) v[j, h / G]
//              over the cached keys j <= pos + t (causal; the T new keys are already
//              stored at pos..pos+T). q, o (T, Hq, D); k, v caches (tmax, Hkv, D), G = Hq / Hkv.
//              One workgroup per (t, h), 256 threads. Keys go in chunks of 256, one score
//              per thread, with a running max and sum (online softmax); for the output the
//              threads form 1024 / D groups of D / 4 threads holding 4 dims each, group g
//              taking keys g, g + groups, ... of each chunk, and the groups are summed in a
//              fixed order at the end. D a multiple of 4. (Used for prompts whose heads
//              are too large for attention.wgsl's tiled kernel.)
//   attend_part, attend_merge   the same for up to 4 queries (decode), however many keys,
//              split over key ranges so that more than Hq workgroups work (flash-decoding):
//              attend_part, one workgroup of 256 per (t, h, range of 64 keys), writes the
//              range's max score m, sum l of exp(s - m) and unnormalised output to `part`
//              (binding 12, (T, Hq, splits, D + 2)); it reads the caches as vec4s
//              (bindings 14, 15) instead of 2, 3; attend_merge, one workgroup per (t, h),
//              combines the ranges in order: o = sum_r e^(m_r - M) acc_r / sum_r e^(m_r - M) l_r.
//   rope_store the projections of T new tokens, qkv (T, (Hq + 2 Hkv) D) = [q | k | v] per
//              token, plus a bias (HAS_BIAS, binding 7) -> q turned by RoPE (T, Hq, D) at
//              binding 9, k turned and v as is into the caches (binding 10, 11) at
//              pos..pos+T. RoPE as rope.wgsl: (x_i, x_j) -> (x_i c - x_j s, x_i s + x_j c)
//              for pair k, j = i + 1 (INTERLEAVED) or i + D/2, (c, s) from the table
//              (positions, D/2) at binding 8. One thread per pair; cover T (Hq + 2Hkv) D/2.
//              SPLIT_SRC: qkv comes as p.splits partial sums over slices of k,
//              (splits, T, ..), added in slice order as it is read.
// Windows and rings: with p.window > 0 the query at position i sees only keys j with
// i - j < window (sliding-window attention); every kernel keeps token j in the cache's row
// j % p.ring (p.ring = its rows), so a cache of window - 1 + T rows or more holds all a
// step of T tokens needs (a ring of the last keys); without a ring, j < rows and the row
// is j.
// Pages (PAGED, `attend_part` and `rope_store`: continuous batching): each row t of q / qkv
// is a token of its own sequence, whose keys live in pages of PAGE rows of one pool; the
// u32 buffer `paged` (binding 18) holds per row its position (2 t) and where its page list
// starts (2 t + 1): key j of row t is in pool row pages[j / PAGE] * PAGE + j % PAGE. No
// windows then. attend_part splits each row's keys 0..=pos into ranges of 64 from key 0,
// p.splits ranges for every row (enough for the longest); a row's ranges past its keys
// are empty (m = -3e38, l = 0, acc = 0) and add exact zeros in the merge, so a row's sums
// do not depend on the other rows. attend_part's dispatch covers p.t rows from row p.pos
// (a group of rows; its `part` the group's own), and may take HEADS query heads of a kv
// head a workgroup and (LOOP) walk a row's ranges and merge them itself: the same bits.
// Caches hold words (array<u32>): f32 bits, or with KV_F16 two f16 halves a word
// (pack2x16float / unpack2x16float: core WGSL, no shader-f16 needed), or with KV_Q8
// llama.cpp's q8_0 numbers: each head's D values of a token as D / 4 words of 8-bit
// integers, then D / 32 f32 scales (value = q * scale, scale = max |x| / 127 over 32
// values): D * 9 / 32 words a head and token. Every sum is f32. Writers write whole
// words: kv_store a pair of elements (f16) or a block of 32 (q8_0) a thread, rope_store
// two RoPE pairs (f16) or a block of 32 of a k or v head (q8_0) a thread. kv_widen copies
// cached rows out as f32 (for the tiled prompt kernels of attention.wgsl, which read f32).
// Every sum runs in a fixed order: the same inputs give the same bits.

struct Params {
    t: u32,       // new tokens (queries)
    pos: u32,     // cached tokens before them
    hq: u32,
    hkv: u32,
    d: u32,
    tmax: u32,
    scale: f32,
    row: u32,     // hkv * d (kv_store)
    window: u32,  // 0: every earlier key
    ring: u32,    // the cache's rows
    splits: u32,  // rope_store with SPLIT_SRC: slices of k src holds
    _pad1: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> q: array<f32>;
@group(0) @binding(2) var<storage, read> kc: array<u32>;
@group(0) @binding(3) var<storage, read> vc: array<u32>;
@group(0) @binding(4) var<storage, read_write> o: array<f32>;
@group(0) @binding(5) var<storage, read> src: array<f32>;
@group(0) @binding(6) var<storage, read_write> cache: array<u32>;

override KV_F16: bool = false;
override KV_Q8: bool = false;
override PAGED: bool = false;
const PAGE: u32 = 16u;
@group(0) @binding(18) var<storage, read> paged: array<u32>;

// The position of row t's token.
fn tok_pos(t: u32) -> u32 {
    if (PAGED) {
        return paged[2u * t];
    }
    return p.pos + t;
}

// The cache (pool) row of row t's sequence's token j.
fn key_row(t: u32, j: u32) -> u32 {
    if (PAGED) {
        return paged[paged[2u * t + 1u] + j / PAGE] * PAGE + j % PAGE;
    }
    return cache_row(j);
}

// q8_0: the words of head-and-token segment `seg` start at seg * D * 9 / 32; within it,
// dim's quant word and its block's scale word.
fn q8_word(seg: u32, dim: u32) -> u32 {
    return seg * (p.d * 9u / 32u) + dim / 4u;
}
fn q8_scale_word(seg: u32, dim: u32) -> u32 {
    return seg * (p.d * 9u / 32u) + p.d / 4u + dim / 32u;
}

// Flat element i (a multiple of 4) of a q8_0 cache, as f32.
fn q8_4(c: u32, i: u32) -> vec4<f32> {
    let seg = i / p.d;
    let dim = i % p.d;
    if (c == 0u) {
        return vec4<f32>(unpack4xI8(kc[q8_word(seg, dim)])) * bitcast<f32>(kc[q8_scale_word(seg, dim)]);
    }
    return vec4<f32>(unpack4xI8(vc[q8_word(seg, dim)])) * bitcast<f32>(vc[q8_scale_word(seg, dim)]);
}

// 32 values as q8_0: 8 words of quants round(x * 127 / max |x|), then the scale
// max |x| / 127.
fn q8_pack(x: array<f32, 32>) -> array<u32, 9> {
    var amax = 0.0;
    for (var i = 0u; i < 32u; i++) {
        amax = max(amax, abs(x[i]));
    }
    let inv = select(0.0, 127.0 / amax, amax > 0.0);
    var out: array<u32, 9>;
    for (var w = 0u; w < 8u; w++) {
        let v = vec4<f32>(x[4u * w], x[4u * w + 1u], x[4u * w + 2u], x[4u * w + 3u]);
        out[w] = pack4xI8(vec4<i32>(round(v * inv)));
    }
    out[8] = bitcast<u32>(amax / 127.0);
    return out;
}

// Cover t * row threads (f32), t * row / 2 (f16: a pair of elements each) or t * row / 32
// (q8_0: a block each).
@compute @workgroup_size(256)
fn kv_store(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
            @builtin(local_invocation_index) lid: u32) {
    let n = (wid.x + wid.y * nwg.x) * 256u + lid;
    if (KV_Q8) {
        let e = 32u * n;
        if (e < p.t * p.row) {
            var x: array<f32, 32>;
            for (var i = 0u; i < 32u; i++) {
                x[i] = src[e + i];
            }
            let at = cache_row(p.pos + e / p.row) * p.row + e % p.row;
            let seg = at / p.d;
            let dim0 = at % p.d;
            let w = q8_pack(x);
            for (var i = 0u; i < 8u; i++) {
                cache[q8_word(seg, dim0) + i] = w[i];
            }
            cache[q8_scale_word(seg, dim0)] = w[8];
        }
        return;
    }
    let e = select(n, 2u * n, KV_F16);     // first element
    if (e < p.t * p.row) {
        let at = cache_row(p.pos + e / p.row) * p.row + e % p.row;
        if (KV_F16) {
            cache[at / 2u] = pack2x16float(vec2<f32>(src[e], src[e + 1u]));
        } else {
            cache[at] = bitcast<u32>(src[e]);
        }
    }
}

// Rows 0..p.t of the cache at binding 6 as f32 into o (binding 4): cover p.t * row.
@compute @workgroup_size(256)
fn kv_widen(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
            @builtin(local_invocation_index) lid: u32) {
    let i = (wid.x + wid.y * nwg.x) * 256u + lid;
    if (i < p.t * p.row) {
        if (KV_Q8) {
            let seg = i / p.d;
            let dim = i % p.d;
            let w = cache[q8_word(seg, dim)];
            o[i] = f32(unpack4xI8(w)[dim % 4u]) * bitcast<f32>(cache[q8_scale_word(seg, dim)]);
        } else if (KV_F16) {
            o[i] = unpack2x16float(cache[i / 2u])[i % 2u];
        } else {
            o[i] = bitcast<f32>(cache[i]);
        }
    }
}

// The cache row of token j.
fn cache_row(j: u32) -> u32 {
    return j % p.ring;
}

// The first key query t (at position pos + t) sees.
fn first_key(t: u32) -> u32 {
    let i = p.pos + t;
    return select(0u, i + 1u - p.window, p.window > 0u && i + 1u > p.window);
}

const WG: u32 = 256u;
var<workgroup> qs: array<vec4<f32>, 64>;
var<workgroup> sc: array<f32, 256>;
var<workgroup> red: array<f32, 256>;
var<workgroup> red4: array<vec4<f32>, 256>;

// Fixed-order tree over red[0..256] with op max (is_max) or +; result in red[0].
fn reduce(lid: u32, is_max: bool) {
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        workgroupBarrier();
        if (lid < s) {
            let a = red[lid];
            let b = red[lid + s];
            red[lid] = select(a + b, max(a, b), is_max);
        }
    }
    workgroupBarrier();
}

// Elements i..i+4 of a cache (i a multiple of 4).
fn k4(i: u32) -> vec4<f32> {
    if (KV_Q8) {
        return q8_4(0u, i);
    }
    if (KV_F16) {
        return vec4<f32>(unpack2x16float(kc[i / 2u]), unpack2x16float(kc[i / 2u + 1u]));
    }
    return bitcast<vec4<f32>>(vec4<u32>(kc[i], kc[i + 1u], kc[i + 2u], kc[i + 3u]));
}
fn v4(i: u32) -> vec4<f32> {
    if (KV_Q8) {
        return q8_4(1u, i);
    }
    if (KV_F16) {
        return vec4<f32>(unpack2x16float(vc[i / 2u]), unpack2x16float(vc[i / 2u + 1u]));
    }
    return bitcast<vec4<f32>>(vec4<u32>(vc[i], vc[i + 1u], vc[i + 2u], vc[i + 3u]));
}

// q[t, h] into qs, by threads lid < D/4 (the caller synchronises).
fn load_q(t: u32, h: u32, lid: u32) {
    if (lid < p.d / 4u) {
        let qb = (t * p.hq + h) * p.d + 4u * lid;
        qs[lid] = vec4<f32>(q[qb], q[qb + 1u], q[qb + 2u], q[qb + 3u]);
    }
}

// scale * (qs . the cached key whose first float is kb).
// Loops over cache rows load 4 rows before using any (unrolled by hand): a load's latency
// is then paid once per 4 rows, not once per row.
fn score(kb: u32) -> f32 {
    let d4 = p.d / 4u;
    var dot4 = vec4<f32>(0.0);
    var e = 0u;
    for (; e + 4u <= d4; e += 4u) {
        let a = k4(kb + 4u * e);
        let b = k4(kb + 4u * e + 4u);
        let c = k4(kb + 4u * e + 8u);
        let d = k4(kb + 4u * e + 12u);
        dot4 += qs[e] * a + qs[e + 1u] * b + qs[e + 2u] * c + qs[e + 3u] * d;
    }
    for (; e < d4; e++) {
        dot4 += qs[e] * k4(kb + 4u * e);
    }
    return (dot4.x + dot4.y + dot4.z + dot4.w) * p.scale;
}

// sum over jj = first, first + step, ... < n of sc[jj] * (4 dims at vb of the cached value
// row c0 + jj): a group's share of a chunk of keys.
fn weighted_values(c0: u32, first: u32, step: u32, n: u32, stride: u32, vb: u32) -> vec4<f32> {
    var acc = vec4<f32>(0.0);
    var jj = first;
    for (; jj + 3u * step < n; jj += 4u * step) {
        let a = v4(cache_row(c0 + jj) * stride + vb);
        let b = v4(cache_row(c0 + jj + step) * stride + vb);
        let c = v4(cache_row(c0 + jj + 2u * step) * stride + vb);
        let d = v4(cache_row(c0 + jj + 3u * step) * stride + vb);
        acc += sc[jj] * a + sc[jj + step] * b + sc[jj + 2u * step] * c + sc[jj + 3u * step] * d;
    }
    for (; jj < n; jj += step) {
        acc += sc[jj] * v4(cache_row(c0 + jj) * stride + vb);
    }
    return acc;
}

// Thread lid < D/4: its 4 dims summed over the `groups` groups' partials in red4, in order.
fn group_sum(lid: u32, groups: u32) -> vec4<f32> {
    var sum = vec4<f32>(0.0);
    for (var gg = 0u; gg < groups; gg++) {
        sum += red4[gg * (p.d / 4u) + lid];
    }
    return sum;
}

// D a multiple of 4 up to 256. For the output the threads form groups of D/4, each thread
// holding 4 dims; group g takes keys g, g + groups, ... of a chunk.
@compute @workgroup_size(256)
fn attend(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
          @builtin(local_invocation_index) lid: u32) {
    let g = wid.x + wid.y * nwg.x;
    if (g >= p.t * p.hq) {
        return;
    }
    let t = g / p.hq;
    let h = g % p.hq;
    let kvh = h / (p.hq / p.hkv);
    let d4 = p.d / 4u;
    let groups = WG / d4;
    let grp = lid / d4;
    let dim4 = lid % d4;
    let stride = p.hkv * p.d;             // floats between consecutive cached tokens
    let base = kvh * p.d;
    let nkeys = p.pos + t + 1u;           // causal: keys first_key(t)..=pos+t
    let first = first_key(t);
    load_q(t, h, lid);
    var m = -3.0e38;                       // running max of the scores
    var l = 0.0;                           // running sum of exp(score - m)
    var acc = vec4<f32>(0.0);              // this thread's 4 output dims, its group's keys
    for (var c0 = first; c0 < nkeys; c0 += WG) {
        workgroupBarrier();
        let j = c0 + lid;
        var s = -3.0e38;
        if (j < nkeys) {
            s = score(cache_row(j) * stride + base);
        }
        red[lid] = s;
        reduce(lid, true);
        let m_new = max(m, red[0]);
        let pj = select(0.0, exp(s - m_new), j < nkeys);
        workgroupBarrier();
        sc[lid] = pj;
        red[lid] = pj;
        reduce(lid, false);
        let alpha = exp(m - m_new);
        l = l * alpha + red[0];
        m = m_new;
        acc *= alpha;
        if (grp < groups) {
            acc += weighted_values(c0, grp, groups, min(WG, nkeys - c0), stride, base + 4u * dim4);
        }
    }
    workgroupBarrier();
    red4[lid] = select(vec4<f32>(0.0), acc, grp < groups);
    workgroupBarrier();
    if (lid < d4) {
        let sum = group_sum(lid, groups);
        let ob = (t * p.hq + h) * p.d + 4u * lid;
        let r = sum / l;
        o[ob] = r.x;
        o[ob + 1u] = r.y;
        o[ob + 2u] = r.z;
        o[ob + 3u] = r.w;
    }
}

const SPLIT: u32 = 64u;
@group(0) @binding(12) var<storage, read_write> part: array<f32>;
var<workgroup> red64: array<vec4<f32>, 16>;   // a range's 64 scores

// Ranges of 64 keys from first_key(0) (the first key any query sees) to pos + t; with
// PAGED, p.splits: enough ranges for the longest row (set by the host).
fn splits() -> u32 {
    if (PAGED) {
        return p.splits;
    }
    return (p.pos + p.t - first_key(0u) + SPLIT - 1u) / SPLIT;
}

// 256 threads a range: for the scores, 4 threads a key, each a quarter of the dims (vec4s
// e = quarter, quarter + 4, ...), the quarters added in a fixed order; for the output,
// 256 / (D / 4) groups of D / 4 threads as in `attend`. A thread's share of the keys and
// of the values (up to 8 vec4s each: all of them for D <= 128) is loaded before anything
// waits: the kernel pays one round trip to memory, not one for the keys and then one for
// the values. The cache arrives as vec4s (bindings 14, 15: kc and vc again; with KV_F16
// 16, 17: four halves in two words).
var<workgroup> part_dot: array<f32, 256>;
@group(0) @binding(14) var<storage, read> kc4: array<vec4<u32>>;
@group(0) @binding(15) var<storage, read> vc4: array<vec4<u32>>;
@group(0) @binding(16) var<storage, read> kh4: array<vec2<u32>>;
@group(0) @binding(17) var<storage, read> vh4: array<vec2<u32>>;

// vec4 n of a cache (q8_0: through bindings 2, 3).
fn key4(n: u32) -> vec4<f32> {
    if (KV_Q8) {
        return q8_4(0u, 4u * n);
    }
    if (KV_F16) {
        let w = kh4[n];
        return vec4<f32>(unpack2x16float(w.x), unpack2x16float(w.y));
    }
    return bitcast<vec4<f32>>(kc4[n]);
}
fn val4(n: u32) -> vec4<f32> {
    if (KV_Q8) {
        return q8_4(1u, 4u * n);
    }
    if (KV_F16) {
        let w = vh4[n];
        return vec4<f32>(unpack2x16float(w.x), unpack2x16float(w.y));
    }
    return bitcast<vec4<f32>>(vc4[n]);
}
// vec4s of keys and of values a thread loads up front: D / 16 up to 8 (set by the host;
// arrays past it are never touched, so they take no registers).
override PRE: u32 = 8u;
// One workgroup a row (and head or heads) for all its ranges, merged at its end: o with
// one dispatch, the same bits as a workgroup a range then attend_merge.
override LOOP: bool = false;
// Query heads a workgroup: 1, or up to 8 of the G = Hq / Hkv that share a kv head (HEADS
// divides G): the keys and values read once for them, each head's sums in the same order
// as alone; their queries in qh.
override HEADS: u32 = 1u;
var<workgroup> qh: array<vec4<f32>, 512>;

@compute @workgroup_size(256)
fn attend_part(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
               @builtin(local_invocation_index) lid: u32) {
    let ns = splits();
    let g = wid.x + wid.y * nwg.x;
    let per = HEADS;
    let units = p.hq / per;
    // Workgroups a (row, heads): one a range, or with LOOP one for all ranges.
    let nwork = select(ns, 1u, LOOP);
    if (g >= p.t * units * nwork) {
        return;
    }
    let tu = g / nwork;
    let t = tu / units;
    let h0 = (tu % units) * per;
    let sp0 = select(g % nwork, 0u, LOOP);
    let sp1 = select(sp0 + 1u, ns, LOOP);
    // With LOOP the outputs o (T, Hq, D) come first in binding 12, the ranges' parts after.
    let pb = select(0u, p.t * p.hq * p.d, LOOP);
    let kvh = h0 / (p.hq / p.hkv);
    let d4 = p.d / 4u;
    let groups = 256u / d4;
    let grp = lid / d4;
    let dim4 = lid % d4;
    let stride4 = p.hkv * d4;             // vec4s between consecutive cached tokens
    let base4 = kvh * d4;
    // With PAGED, the dispatch's rows are rows p.pos.. of q and of the page lists (a group
    // of them); `part` is the group's own.
    let tg = t + select(0u, p.pos, PAGED);
    let nkeys = tok_pos(tg) + 1u;
    // The heads' queries (consecutive in q), read once.
    for (var i = lid; i < per * d4; i += 256u) {
        let qb = (tg * p.hq + h0) * p.d + 4u * i;
        qh[i] = vec4<f32>(q[qb], q[qb + 1u], q[qb + 2u], q[qb + 3u]);
    }
    // (Each range's and head's workgroup memory is written after the last barrier behind
    // its reads in the one before.)
    for (var sp = sp0; sp < sp1; sp++) {
        let k0 = first_key(0u) + sp * SPLIT;
        let nk = select(0u, min(SPLIT, nkeys - k0), k0 < nkeys);   // keys in this range
        // Keys at the range's start before this query's window (later queries of a step).
        let skip = min(nk, select(0u, first_key(t) - k0, first_key(t) > k0));
        // Quarter qtr of key k0 + lid / 4: vec4s qtr + 4 i of its row.
        let qtr = lid % 4u;
        // (Keys past the row's own are never read: clamped to its last so that a paged row's
        // page list is not read past its end.)
        let kb4 = key_row(tg, min(k0 + lid / 4u, nkeys - 1u)) * stride4 + base4;
        let kn = select(0u, (d4 + 3u - qtr) / 4u, lid / 4u < nk);
        var kq: array<vec4<f32>, 8>;
        for (var i = 0u; i < PRE; i++) {
            if (i < kn) {
                kq[i] = key4(kb4 + qtr + 4u * i);
            }
        }
        // Group grp's keys grp + groups i, dims 4 dim4...
        let on = grp < groups;
        var vv: array<vec4<f32>, 8>;
        for (var i = 0u; i < PRE; i++) {
            let jj = grp + groups * i;
            if (on && jj < nk) {
                vv[i] = val4(key_row(tg, k0 + jj) * stride4 + base4 + dim4);
            }
        }
        workgroupBarrier();
        for (var hi = 0u; hi < per; hi++) {
            let h = h0 + hi;
            let th = t * p.hq + h;
            let out = pb + (th * ns + sp) * (p.d + 2u);
            let qo = hi * d4;
            var dq = vec4<f32>(0.0);
            for (var i = 0u; i < PRE; i++) {
                if (i < kn) {
                    dq += qh[qo + qtr + 4u * i] * kq[i];
                }
            }
            for (var i = PRE; i < kn; i++) {
                dq += qh[qo + qtr + 4u * i] * key4(kb4 + qtr + 4u * i);
            }
            part_dot[lid] = (dq.x + dq.y) + (dq.z + dq.w);
            workgroupBarrier();
            // Threads lid < 64: key k0 + lid's score; every thread reads the 64 for the max.
            var s = -3.0e38;
            let seen = lid < nk && lid >= skip;
            if (seen) {
                let b = 4u * lid;
                s = ((part_dot[b] + part_dot[b + 1u]) + (part_dot[b + 2u] + part_dot[b + 3u])) * p.scale;
            }
            if (lid < SPLIT) {
                red64[lid / 4u][lid % 4u] = s;
            }
            workgroupBarrier();
            var m4 = red64[0];
            for (var i = 1u; i < 16u; i++) {
                m4 = max(m4, red64[i]);
            }
            let m = max(max(m4.x, m4.y), max(m4.z, m4.w));
            if (lid < SPLIT) {
                sc[lid] = select(0.0, exp(s - m), seen);
            }
            workgroupBarrier();
            var acc = vec4<f32>(0.0);
            if (on) {
                for (var i = 0u; i < PRE; i++) {
                    let jj = grp + groups * i;
                    if (jj < nk) {
                        acc += sc[jj] * vv[i];
                    }
                }
                for (var jj = grp + groups * PRE; jj < nk; jj += groups) {
                    acc += sc[jj] * val4(key_row(tg, k0 + jj) * stride4 + base4 + dim4);
                }
            }
            red4[lid] = acc;
            workgroupBarrier();
            if (lid < d4) {
                let sum = group_sum(lid, groups);
                part[out + 4u * lid] = sum.x;
                part[out + 4u * lid + 1u] = sum.y;
                part[out + 4u * lid + 2u] = sum.z;
                part[out + 4u * lid + 3u] = sum.w;
            }
            if (lid == 255u) {
                // The sum of the 64 weights, in order (on a thread not summing groups above).
                // An empty range (past this query's keys, or before its window) has l = 0 and
                // adds nothing.
                var l = 0.0;
                for (var i = 0u; i < 64u; i++) {
                    l += sc[i];
                }
                part[out + p.d] = select(-3.0e38, m, nk > skip);
                part[out + p.d + 1u] = select(0.0, l, nk > skip);
            }
        }
    }
    if (LOOP) {
        // The ranges merged as attend_merge merges them (the same bits): thread lid < D/4
        // reads the dims it wrote, and thread 255's m and l after the barrier.
        storageBarrier();
        if (lid < d4) {
            for (var hi = 0u; hi < per; hi++) {
                let th = t * p.hq + h0 + hi;
                let r = merged(pb, th, lid);
                let ob = th * p.d + 4u * lid;
                part[ob] = r.x;
                part[ob + 1u] = r.y;
                part[ob + 2u] = r.z;
                part[ob + 3u] = r.w;
            }
        }
    }
}

@compute @workgroup_size(64)
fn attend_merge(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                @builtin(local_invocation_index) lid: u32) {
    let th = wid.x + wid.y * nwg.x;
    if (th >= p.t * p.hq || lid >= p.d / 4u) {
        return;
    }
    let r = merged(0u, th, lid);
    let ob = th * p.d + 4u * lid;
    o[ob] = r.x;
    o[ob + 1u] = r.y;
    o[ob + 2u] = r.z;
    o[ob + 3u] = r.w;
}

// attend_merge for one query whose output goes to an XQ8 product (quant.wgsl): written
// rounded as quant.wgsl's quantize_x8 rounds a row (groups of 16 columns, 4 threads a
// group here; D a multiple of 16), to binding 13: (Hq D) / 4 words of quants, then a
// scale and a quant sum a group (no sums of squares: the o product takes no norm). The
// same bits as attend_merge then quantize_x8.
@group(0) @binding(13) var<storage, read_write> xq_o: array<u32>;
var<workgroup> mg_max: array<f32, 64>;
var<workgroup> mg_sum: array<i32, 64>;

@compute @workgroup_size(64)
fn attend_merge_x8(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                   @builtin(local_invocation_index) lid: u32) {
    let th = wid.x + wid.y * nwg.x;
    if (th >= p.hq) {
        return;
    }
    let on = lid < p.d / 4u;
    var r = vec4<f32>(0.0);
    if (on) {
        r = merged(0u, th, lid);
    }
    let a = abs(r);
    // A NaN or infinity marks the lane (as quant.wgsl's quantize_x8: the group's scale
    // becomes NaN); tested on the bits.
    let bad = any((bitcast<vec4<u32>>(r) & vec4<u32>(0x7F800000u)) == vec4<u32>(0x7F800000u));
    mg_max[lid] = select(max(max(a.x, a.y), max(a.z, a.w)), -1.0, bad);
    workgroupBarrier();
    let g0 = lid & ~3u;
    let m4 = vec4<f32>(mg_max[g0], mg_max[g0 + 1u], mg_max[g0 + 2u], mg_max[g0 + 3u]);
    let group_bad = any(m4 < vec4<f32>(0.0));
    let amax = max(max(m4.x, m4.y), max(m4.z, m4.w));
    let inv = select(0.0, 127.0 / amax, amax > 0.0);
    let q = vec4<i32>(round(r * inv));
    mg_sum[lid] = (q.x + q.y) + (q.z + q.w);
    workgroupBarrier();
    if (on) {
        let c = th * p.d + 4u * lid;   // column in the row of Hq D
        xq_o[c / 4u] = pack4xI8(q);
        if ((lid & 3u) == 0u) {
            let sc = p.hq * p.d / 4u + 2u * (c / 16u);
            xq_o[sc] = select(bitcast<u32>(amax / 127.0 * 1.0), 0x7FC00000u, group_bad);
            xq_o[sc + 1u] = bitcast<u32>((mg_sum[lid] + mg_sum[lid + 1u]) + (mg_sum[lid + 2u] + mg_sum[lid + 3u]));
        }
    }
}

// Query-head th's output dims 4 lid.. merged over its key ranges, whose parts start at
// part[pb].
fn merged(pb: u32, th: u32, lid: u32) -> vec4<f32> {
    let ns = splits();
    let w = p.d + 2u;
    var mx = -3.0e38;
    var sp = 0u;
    for (; sp + 4u <= ns; sp += 4u) {
        let b = pb + (th * ns + sp) * w + p.d;
        let m4 = vec4<f32>(part[b], part[b + w], part[b + 2u * w], part[b + 3u * w]);
        mx = max(mx, max(max(m4.x, m4.y), max(m4.z, m4.w)));
    }
    for (; sp < ns; sp++) {
        mx = max(mx, part[pb + (th * ns + sp) * w + p.d]);
    }
    var l = 0.0;
    var acc = vec4<f32>(0.0);
    // 4 ranges' loads before their sums (in range order).
    for (sp = 0u; sp + 4u <= ns; sp += 4u) {
        let b = pb + (th * ns + sp) * w;
        let f = exp(vec4<f32>(part[b + p.d], part[b + w + p.d], part[b + 2u * w + p.d], part[b + 3u * w + p.d]) - mx);
        let l4 = vec4<f32>(part[b + p.d + 1u], part[b + w + p.d + 1u], part[b + 2u * w + p.d + 1u], part[b + 3u * w + p.d + 1u]);
        var a: array<vec4<f32>, 4>;
        for (var r = 0u; r < 4u; r++) {
            let c = b + r * w + 4u * lid;
            a[r] = vec4<f32>(part[c], part[c + 1u], part[c + 2u], part[c + 3u]);
        }
        l += f.x * l4.x;
        l += f.y * l4.y;
        l += f.z * l4.z;
        l += f.w * l4.w;
        acc += f.x * a[0];
        acc += f.y * a[1];
        acc += f.z * a[2];
        acc += f.w * a[3];
    }
    for (; sp < ns; sp++) {
        let b = pb + (th * ns + sp) * w;
        let f = exp(part[b + p.d] - mx);
        l += f * part[b + p.d + 1u];
        acc += f * vec4<f32>(part[b + 4u * lid], part[b + 4u * lid + 1u], part[b + 4u * lid + 2u], part[b + 4u * lid + 3u]);
    }
    return acc / l;
}

override HAS_BIAS: bool = false;
override INTERLEAVED: bool = false;
@group(0) @binding(7) var<storage, read> bias: array<f32>;
@group(0) @binding(8) var<storage, read> table: array<vec2<f32>>;
@group(0) @binding(9) var<storage, read_write> q_out: array<f32>;
@group(0) @binding(10) var<storage, read_write> k_cache: array<u32>;
@group(0) @binding(11) var<storage, read_write> v_cache: array<u32>;

// RoPE pair k of head `slot` (q heads, then k heads, then v heads) of new token t: its
// dims' places (i, j) in the head and their values after the bias and (q, k) RoPE.
struct Pair {
    i: u32,
    j: u32,
    a: f32,
    b: f32,
}

// SPLIT_SRC: src holds the cooperative product's partials over p.splits slices of k,
// (p.splits, T, width), summed here in slice order as quant.wgsl's splitk_sum sums them
// (the same bits as that sum, then rope_store).
override SPLIT_SRC: bool = false;

// The projections' value i of the (T, width) rows, n = T width.
fn src_at(i: u32, n: u32) -> f32 {
    if (!SPLIT_SRC) {
        return src[i];
    }
    var acc = 0.0;
    for (var z = 0u; z < p.splits; z++) {
        acc += src[z * n + i];
    }
    return acc;
}

fn rope_pair(t: u32, slot: u32, k: u32) -> Pair {
    let half = p.d / 2u;
    let width = (p.hq + 2u * p.hkv) * p.d;
    let off = slot * p.d;                // within the token's row
    let i = select(k, 2u * k, INTERLEAVED);
    let j = select(k + half, 2u * k + 1u, INTERLEAVED);
    var a = src_at(t * width + off + i, p.t * width);
    var b = src_at(t * width + off + j, p.t * width);
    if (HAS_BIAS) {
        a += bias[off + i];
        b += bias[off + j];
    }
    if (slot < p.hq + p.hkv) {
        let cs = table[tok_pos(t) * half + k];
        return Pair(i, j, a * cs.x - b * cs.y, a * cs.y + b * cs.x);
    }
    return Pair(i, j, a, b);
}

fn put(is_k: bool, w: u32, v: u32) {
    if (is_k) {
        k_cache[w] = v;
    } else {
        v_cache[w] = v;
    }
}

// One RoPE pair a thread (cover T (Hq + 2Hkv) D/2), or with KV_F16 two (k, k + 1; cover
// T (Hq + 2Hkv) D/4): the cache words of f16 pairs (D a multiple of 4).
@compute @workgroup_size(256)
fn rope_store(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
              @builtin(local_invocation_index) lid: u32) {
    let idx = (wid.x + wid.y * nwg.x) * 256u + lid;
    if (KV_Q8) {
        rope_store_q8(idx);
        return;
    }
    let per = select(1u, 2u, KV_F16);    // pairs a thread
    let np = p.d / 2u / per;
    let heads = p.hq + 2u * p.hkv;
    if (idx >= p.t * heads * np) {
        return;
    }
    let k = (idx % np) * per;
    let slot = (idx / np) % heads;
    let t = idx / (np * heads);
    let x = rope_pair(t, slot, k);
    if (slot < p.hq) {
        let o = (t * p.hq + slot) * p.d;
        q_out[o + x.i] = x.a;
        q_out[o + x.j] = x.b;
        if (KV_F16) {
            let y = rope_pair(t, slot, k + 1u);
            q_out[o + y.i] = y.a;
            q_out[o + y.j] = y.b;
        }
        return;
    }
    let is_k = slot < p.hq + p.hkv;
    let h = select(slot - p.hq - p.hkv, slot - p.hq, is_k);
    let o = (key_row(t, tok_pos(t)) * p.hkv + h) * p.d;
    if (KV_F16) {
        let y = rope_pair(t, slot, k + 1u);
        if (INTERLEAVED) {
            put(is_k, (o + x.i) / 2u, pack2x16float(vec2<f32>(x.a, x.b)));
            put(is_k, (o + y.i) / 2u, pack2x16float(vec2<f32>(y.a, y.b)));
        } else {
            put(is_k, (o + x.i) / 2u, pack2x16float(vec2<f32>(x.a, y.a)));
            put(is_k, (o + x.j) / 2u, pack2x16float(vec2<f32>(x.b, y.b)));
        }
    } else {
        put(is_k, o + x.i, bitcast<u32>(x.a));
        put(is_k, o + x.j, bitcast<u32>(x.b));
    }
}

// rope_store into q8_0 caches: threads 0..T Hq D/2 write q's pairs; the next T 2Hkv D/32
// each a block of 32 dims of a k or v head (every dim's pair turned, its own value kept).
fn rope_store_q8(idx: u32) {
    let half = p.d / 2u;
    let nq = p.t * p.hq * half;
    if (idx < nq) {
        let k = idx % half;
        let slot = (idx / half) % p.hq;
        let t = idx / (half * p.hq);
        let x = rope_pair(t, slot, k);
        let o = (t * p.hq + slot) * p.d;
        q_out[o + x.i] = x.a;
        q_out[o + x.j] = x.b;
        return;
    }
    let nb = p.d / 32u;
    let b = idx - nq;
    if (b >= p.t * 2u * p.hkv * nb) {
        return;
    }
    let blk = b % nb;
    let kvs = (b / nb) % (2u * p.hkv);   // k heads, then v heads
    let t = b / (nb * 2u * p.hkv);
    let slot = p.hq + kvs;
    var x: array<f32, 32>;
    for (var i = 0u; i < 32u; i++) {
        let dim = 32u * blk + i;
        // dim's pair and which of its two it is.
        var k = select(dim, dim - half, dim >= half);
        if (INTERLEAVED) {
            k = dim / 2u;
        }
        let pr = rope_pair(t, slot, k);
        x[i] = select(pr.b, pr.a, pr.i == dim);
    }
    let seg = key_row(t, tok_pos(t)) * p.hkv + kvs % p.hkv;
    let w = q8_pack(x);
    for (var i = 0u; i < 8u; i++) {
        put(kvs < p.hkv, q8_word(seg, 32u * blk) + i, w[i]);
    }
    put(kvs < p.hkv, q8_scale_word(seg, 32u * blk), w[8]);
}
