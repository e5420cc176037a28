// Dequantization of GGUF tensor types to f32, one thread per element (each re-reads its
// block's scales; the reads hit cache). Block layouts as ggml's (see reference/quant.rs):
//   Q4_0 (32: d, 16 B nibbles)   Q4_1 (32: d, m, 16 B)   Q5_0 (32: d, qh u32, 16 B)
//   Q5_1 (32: d, m, qh, 16 B)    Q8_0 (32: d, 32 i8)
//   Q4_K (256: d, dmin, 12 B 6-bit scales/mins, 128 B nibbles)
//   Q5_K (256: d, dmin, 12 B scales, 32 B fifth bits, 128 B nibbles)
//   Q6_K (256: 128 B low nibbles, 64 B 2-bit highs, 16 i8 scales, d; padded to 224 B on
//         upload (ops::quant::upload_blocks), so that blocks are 16-byte aligned)
//   F16, BF16, F32: one value each.
// The raw bytes arrive as u32 words (little-endian); blocks need not be word-aligned.
//
// Kernels (element i of a matrix W (N, K) stored row-major in blocks is value(n * K + k);
// GGUF rows are whole blocks):
//   dequantize   dst[i] = value(i), i < n                       cover n, 256 a workgroup
//   dequantize_runs  the same for RAW types, a run of 32 a thread    cover n / 32
//   get_rows     dst[r, c] = value(ids[r] * k + c), r < m       cover m * k, 256 a workgroup
//   qmatvec      y[r, j] = sum_c x[r, c] * value(j * k + c)     (n / 8) * (m / MV_X) groups:
//                8 rows of W x MV_X rows of x a workgroup (8; 1 for one row), 32 threads a
//                row of W striding over k, then a fixed tree (a row's sum does not depend on m)
//   qmatvec_rows qmatvec for batched steps (invariant): 32 rows of W x up to 16 rows of x a
//                workgroup, k's runs over 8 or 9 sets of 32 threads, summed in set order;
//                qmatvec_rows_rope the same with ROPE into paged caches (serving)
//   qmatvec1     the same for one row of x and k a multiple of 32 (decode): 4 rows of W a
//                set of 32 threads sharing their loads of x (or of 64 or 128 splitting k:
//                long rows); 32, 16 or 8 rows a workgroup
//   qmatvec1_x8  qmatvec1 on x rounded to 8 bits (XQ8 below), optionally rounding its own
//                outputs for the next product (X8_OUT)
//   qmatvec_x8rows  qmatvec1_x8 for 2 .. 8 rows of x a workgroup (batched decode): W read
//                once per MV1_X rows of x
//   qmatvec_rope, qmatvec1_rope  qmatvec and qmatvec1 with q/k/v's bias, RoPE and KV-cache
//                store as the epilogue (ROPE below)
//   quantize_x8  rows of x (times a norm weight) rounded to 8 bits in groups of 16 (XQ8)
//   qmatmul      the same product for many rows of x: 64 x 64 output tiles, k in slabs of
//                16 staged (W dequantized on the way) in workgroup memory, 4 x 4 a thread;
//                with SPLITK, slices of k into partial tiles that splitk_sum adds in order
//   qmatmul_t    dst[r, c] = sum_j x[r, j] * value(j * k + c): W untransposed (backward)
// Both read 4 consecutive elements at a time (value4) when k is a multiple of 4; qmatvec
// reads runs of 32 (run32: scales decoded once a run) when k is a multiple of 32.
// Sums run in a fixed order: the same inputs give the same bits.

struct Params {
    n: u32,    // elements (dequantize); outputs per row of x (products: rows of W, or
               // half of them with SWIGLU)
    m: u32,    // rows of x / ids
    k: u32,    // row length
    eps: u32,  // NORM's epsilon, f32 bits
    d: u32,        // MERGE, ROPE: head size
    splits: u32,   // MERGE: key ranges a head
    pos: u32,      // ROPE: position of the first row of x
    heads: u32,    // ROPE: query heads (W stacks heads q heads, then k and v heads)
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(2) var<storage, read_write> dst: array<f32>;
@group(0) @binding(3) var<storage, read> x: array<f32>;
@group(0) @binding(4) var<storage, read> ids: array<u32>;

// Column of the e-th 4 values (e < 8) of the run of 32 that run32 returns for the run
// starting at column c (a multiple of 32): c + 4 e, except in Q4_K / Q5_K blocks.
fn run_col(c: u32, e: u32) -> u32 {
    if (TYPE == 12u || TYPE == 13u) {
        let rb = (c % 256u) / 32u;
        return c - 32u * rb + 64u * (rb / 2u) + 16u * (rb & 1u) + 4u * (e % 4u) + 32u * (e / 4u);
    }
    return c + 4u * e;
}

// The quants of run i / 32 of a Q4_K / Q5_K row as unsigned bytes, 4 a word in run32's
// order (words 0..4 sub-block 2 j, 4..8 sub-block 2 j + 1), and those sub-blocks' (d scale,
// dmin min): a value is q scale - min. Run rb of the block is 16 bytes of sub-block pair
// j = rb / 2: their low nibbles are elements 16 h.. of sub-block 2 j, the high ones the
// same of 2 j + 1 (h = rb % 2; run_col gives the columns). One 16-byte load of quants.
struct KRun {
    q: array<u32, 8>,
    s0: vec2<f32>,
    s1: vec2<f32>,
}

fn k_run(i: u32) -> KRun {
    var r: KRun;
    let k5 = TYPE == 13u;
    let b = (i / 256u) * select(144u, 176u, k5);   // 16-byte-aligned blocks
    let rb = (i % 256u) / 32u;
    let j = rb / 2u;
    let h = rb & 1u;
    let hdr = srcv4[b >> 4u];   // d, dmin, 12 bytes of scales and mins
    let dm = unpack2x16float(hdr.x);
    r.s0 = dm * scale_min16(hdr, 2u * j);
    r.s1 = dm * scale_min16(hdr, 2u * j + 1u);
    let q = srcv4[(b + select(16u, 48u, k5) + 32u * j + 16u * h) >> 4u];
    var qh = vec4<u32>(0u);
    if (k5) {
        // Fifth bits: bit 2 j (low nibbles) and 2 j + 1 of the same 16 bytes' index.
        qh = srcv4[(b + 16u + 16u * h) >> 4u] >> vec4<u32>(2u * j);
    }
    for (var w = 0u; w < 4u; w++) {
        r.q[w] = (q[w] & 0x0F0F0F0Fu) | ((qh[w] & 0x01010101u) << 4u);
        r.q[w + 4u] = ((q[w] >> 4u) & 0x0F0F0F0Fu) | (((qh[w] >> 1u) & 0x01010101u) << 4u);
    }
    return r;
}

// The quants of run i / 32 of a Q6_K row as unsigned bytes (q + 32), 4 a word, and the
// d scale of its two halves of 16: a value is (q - 32) scale.
struct Q6Run {
    q: array<u32, 8>,
    s: vec2<f32>,
}

fn q6k_run(i: u32) -> Q6Run {
    var r: Q6Run;
    let b = (i / 256u) * (Q6K_BYTES / 16u);   // in 16-byte words
    let j = i % 256u;
    let n = j / 128u;
    let run = (j % 128u) / 32u;
    // Scales 8 n + 2 run and the next (bytes 192..208), d (bytes 208, 209).
    let sw = srcv4[b + 12u][2u * n + run / 2u] >> (16u * (run & 1u));
    let d = unpack2x16float(srcv4[b + 13u].x).x;
    r.s = d * vec2<f32>(f32(bitcast<i32>(sw << 24u) >> 24u), f32(bitcast<i32>(sw << 16u) >> 24u));
    // Low nibbles (runs 0, 1) or high (2, 3) of bytes 64 n + 32 (run % 2).., and the 2-bit
    // highs of bytes 128 + 32 n.. at bit 2 run.
    let nib = select(0u, 4u, run >= 2u);
    for (var v = 0u; v < 2u; v++) {
        let ql = srcv4[b + 4u * n + 2u * (run & 1u) + v] >> vec4<u32>(nib);
        let qh = srcv4[b + 8u + 2u * n + v] >> vec4<u32>(2u * run);
        for (var w = 0u; w < 4u; w++) {
            r.q[4u * v + w] = (ql[w] & 0x0F0F0F0Fu) | ((qh[w] & 0x03030303u) << 4u);
        }
    }
    return r;
}

// The 32 elements of run i / 32 (i a multiple of 32: one block, or 32 elements of a K-quant
// block), as 8 vec4s, the e-th at column run_col(i, e) of W's row: the scales are decoded
// once for all 32, and the quants come a word (4 or 8 elements) at a time.
fn run32(i: u32) -> array<vec4<f32>, 8> {
    var o: array<vec4<f32>, 8>;
    switch (TYPE) {
        case 2u: {
            let b = (i / 32u) * 18u;
            let d = half(b);
            for (var w = 0u; w < 4u; w++) {
                let q = word_at(b + 2u + 4u * w);
                o[w] = (nibbles4(q, false) - 8.0) * d;
                o[w + 4u] = (nibbles4(q, true) - 8.0) * d;
            }
        }
        case 3u: {
            let b = (i / 32u) * 5u;   // in words: 20-byte blocks are word-aligned
            let dm = unpack2x16float(src[b]);
            for (var w = 0u; w < 4u; w++) {
                let q = src[b + 1u + w];
                o[w] = nibbles4(q, false) * dm.x + dm.y;
                o[w + 4u] = nibbles4(q, true) * dm.x + dm.y;
            }
        }
        case 8u: {
            let b = (i / 32u) * 34u;
            let d = half(b);
            for (var w = 0u; w < 8u; w++) {
                // Signed bytes as offset binary (b ^ 0x80 = b + 128).
                let q = word_at(b + 2u + 4u * w) ^ 0x80808080u;
                o[w] = (u2f4(bytes4(q)) - 128.0) * d;
            }
        }
        case 12u, 13u: {
            let r = k_run(i);
            for (var w = 0u; w < 4u; w++) {
                o[w] = u2f4(bytes4(r.q[w])) * r.s0.x - r.s0.y;
                o[w + 4u] = u2f4(bytes4(r.q[w + 4u])) * r.s1.x - r.s1.y;
            }
        }
        case 14u: {
            let r = q6k_run(i);
            for (var w = 0u; w < 8u; w++) {
                o[w] = (u2f4(bytes4(r.q[w])) - 32.0) * select(r.s.x, r.s.y, w >= 4u);
            }
        }
        default: {
            for (var w = 0u; w < 8u; w++) {
                o[w] = value4(i + 4u * w);
            }
        }
    }
    return o;
}

// XQ8 (qmatvec1_x8, qmatvec1_rope; the types with a case in run32_q8): x arrives rounded
// to 8-bit integers (groups of 16 consecutive columns, scale max|h| / 127 of h = x, or x
// times the norm weight), and a row's run is a sum of integer dot products (dot4I8Packed)
// of those with W's quants, scaled per group: a quarter of the float work of run32, and 8
// bits of x read a value instead of 64 (x and the norm weight). The product is W's with x
// so rounded, exactly up to f32 rounding of the scaled sums (reference::quant::round_x8 is
// the CPU side). x's buffer (bindings 3 and 7) holds a row as
//   k / 4 words   the quants, 4 a word, lowest column first
//   k / 8 words   each group's scale (f32) and the sum of its quants (i32)
//   k / 16 words  with a norm: each group's sum of x^2 (f32)
// With NORM the RMSNorm factor rsqrt(mean(x^2) + eps) is not in the scales: the products
// add the groups' squares (the threads sharing a row of W cover all of k, so their sum is
// x's) and multiply their sums by it at the end, as the f32 path does. Who rounds x:
// quantize_x8, attend_merge_x8 (kvcache.wgsl), or the product before, whose workgroups
// each make 16 consecutive outputs, one group (qmatvec1_x8 with X8_OUT).
override XQ8: bool = false;

// Words of a row of x rounded (with the norm's squares).
fn x8_row_words(k: u32) -> u32 {
    return k / 4u + k / 8u + k / 16u;
}

// A run of x (the 32 columns run_col(c, 0..8) maps; halves e < 4 and e >= 4 are groups of
// 16 consecutive columns): 4 quants a word, each half's scale, the sum of its quants and
// (NORM) of its x^2.
struct Xq8 {
    q: array<u32, 8>,
    d: vec2<f32>,
    s: vec2<i32>,
    ss: f32,
}

fn xq8_at(c: u32) -> Xq8 {
    return xq8_row(0u, c);
}

// The same of row r of x (rows of x8_row_words(k) words: a multiple of 4 for r > 0).
fn xq8_row(r: u32, c: u32) -> Xq8 {
    var o: Xq8;
    let r0 = r * x8_row_words(p.k);
    let sc = r0 + p.k / 4u;   // scales and sums
    o.ss = 0.0;
    for (var h = 0u; h < 2u; h++) {
        let col = run_col(c, 4u * h);   // a multiple of 16
        let w = bitcast<vec4<u32>>(xv4[r0 / 4u + col / 16u]);
        o.q[4u * h] = w.x;
        o.q[4u * h + 1u] = w.y;
        o.q[4u * h + 2u] = w.z;
        o.q[4u * h + 3u] = w.w;
        o.d[h] = x[sc + col / 8u];
        o.s[h] = bitcast<i32>(x[sc + col / 8u + 1u]);
        if (NORM) {
            o.ss += x[sc + p.k / 8u + col / 16u];
        }
    }
    return o;
}

// A NaN or an infinity in x makes its group's scale NaN, so that the products' outputs are
// not finite either (rounding alone would turn a NaN into 0). Tested on the bits: a
// compiler may assume floats are never NaN.
const NAN_BITS: u32 = 0x7FC00000u;

fn non_finite(v: vec4<f32>) -> bool {
    return any((bitcast<vec4<u32>>(v) & vec4<u32>(0x7F800000u)) == vec4<u32>(0x7F800000u));
}

// Group g of a row rounded into xq_out from o (the row's first word): its 16 values of x
// in v, h = v * nw (nw = 1 without a norm). With `squares` the group's sum of x^2 too.
fn round_group(o: u32, k: u32, g: u32, v: array<vec4<f32>, 4>, nw: array<vec4<f32>, 4>, squares: bool) {
    var a = vec4<f32>(0.0);
    var bad = false;
    var sq = vec4<f32>(0.0);
    var h: array<vec4<f32>, 4>;
    for (var e = 0u; e < 4u; e++) {
        h[e] = v[e] * nw[e];
        a = max(a, abs(h[e]));
        bad = bad || non_finite(h[e]);
        sq += v[e] * v[e];
    }
    let amax = max(max(a.x, a.y), max(a.z, a.w));
    let inv = select(0.0, 127.0 / amax, amax > 0.0);
    var sum = vec4<i32>(0);
    for (var e = 0u; e < 4u; e++) {
        let q = vec4<i32>(round(h[e] * inv));
        xq_out[o + 4u * g + e] = pack4xI8(q);
        sum += q;
    }
    xq_out[o + k / 4u + 2u * g] = select(bitcast<u32>(amax / 127.0), NAN_BITS, bad);
    xq_out[o + k / 4u + 2u * g + 1u] = bitcast<u32>((sum.x + sum.y) + (sum.z + sum.w));
    if (squares) {
        xq_out[o + k / 4u + k / 8u + g] = bitcast<u32>((sq.x + sq.y) + (sq.z + sq.w));
    }
}

// quantize_x8: x (m, k) (k a multiple of 16) rounded to XQ8's layout in xq_out
// (x8_row_words(k) words a row), a thread a group, slices of 256 groups a workgroup (p.n
// slices a row); with NORM, h = x * nw, and the groups' squares.
@group(0) @binding(14) var<storage, read_write> xq_out: array<u32>;

@compute @workgroup_size(256)
fn quantize_x8(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
               @builtin(local_invocation_index) lid: u32) {
    let g0 = wid.x + wid.y * nwg.x;
    let r = g0 / p.n;
    let g = (g0 % p.n) * 256u + lid;
    if (r >= p.m || g >= p.k / 16u) {
        return;
    }
    let x0 = r * p.k / 4u;   // row r in vec4s of x
    var v: array<vec4<f32>, 4>;
    var nw: array<vec4<f32>, 4>;
    for (var e = 0u; e < 4u; e++) {
        v[e] = xv4[x0 + 4u * g + e];
        nw[e] = vec4<f32>(1.0);
        if (NORM) {
            nw[e] = nwv4[4u * g + e];
        }
    }
    round_group(r * x8_row_words(p.k), p.k, g, v, nw, NORM);
}

// dot(W's run i / 32, x's run as xq): run32's values and columns, as integer dot products
// of the quants (unsigned, offset where the type's are signed) with x's, a group of 16 at
// a time, then each group's scales.
fn run32_q8(i: u32, xq: Xq8) -> f32 {
    return dot_run_q8(w_run_q8(i), xq);
}

// W's run i / 32 as the integer dots take it: the halves' quants (4 words each, unsigned
// or offset as the type stores them) and the type's factors (Q4_0, Q8_0: d; Q4_1: d, m;
// K-quants: the halves' (scale, min); Q6_K: the halves' scales). Loaded once, it serves
// several rows of x (qmatvec_x8rows).
struct WRun {
    q: array<u32, 8>,
    f: vec4<f32>,
}

fn w_run_q8(i: u32) -> WRun {
    var r: WRun;
    switch (TYPE) {
        case 2u: {
            let b = (i / 32u) * 18u;
            for (var w = 0u; w < 4u; w++) {
                let q = word_at(b + 2u + 4u * w);
                r.q[w] = q & 0x0F0F0F0Fu;
                r.q[w + 4u] = (q >> 4u) & 0x0F0F0F0Fu;
            }
            r.f.x = half(b);
        }
        case 3u: {
            let b = (i / 32u) * 5u;   // in words
            for (var w = 0u; w < 4u; w++) {
                let q = src[b + 1u + w];
                r.q[w] = q & 0x0F0F0F0Fu;
                r.q[w + 4u] = (q >> 4u) & 0x0F0F0F0Fu;
            }
            r.f = vec4<f32>(unpack2x16float(src[b]), 0.0, 0.0);
        }
        case 8u: {
            let b = (i / 32u) * 34u;
            for (var w = 0u; w < 4u; w++) {
                r.q[w] = word_at(b + 2u + 4u * w);
                r.q[w + 4u] = word_at(b + 18u + 4u * w);
            }
            r.f.x = half(b);
        }
        case 12u, 13u: {
            let k = k_run(i);
            r.q = k.q;
            r.f = vec4<f32>(k.s0, k.s1);
        }
        case 14u: {
            let k = q6k_run(i);
            r.q = k.q;
            r.f = vec4<f32>(k.s, 0.0, 0.0);
        }
        default: {}
    }
    return r;
}

// dot(W's run, x's run as xq): the integer dots of the halves, then the type's factors.
fn dot_run_q8(r: WRun, xq: Xq8) -> f32 {
    var lo = 0;   // integer dots of the halves
    var hi = 0;
    for (var w = 0u; w < 4u; w++) {
        lo += dot4I8Packed(r.q[w], xq.q[w]);
        hi += dot4I8Packed(r.q[w + 4u], xq.q[w + 4u]);
    }
    switch (TYPE) {
        case 2u: {
            // (q - 8) d
            return r.f.x * (xq.d.x * f32(lo - 8 * xq.s.x) + xq.d.y * f32(hi - 8 * xq.s.y));
        }
        case 3u: {
            // q d + m
            return xq.d.x * (r.f.x * f32(lo) + r.f.y * f32(xq.s.x)) + xq.d.y * (r.f.x * f32(hi) + r.f.y * f32(xq.s.y));
        }
        case 8u: {
            return r.f.x * (xq.d.x * f32(lo) + xq.d.y * f32(hi));
        }
        case 12u, 13u: {
            // q scale - min
            return xq.d.x * (r.f.x * f32(lo) - r.f.y * f32(xq.s.x)) + xq.d.y * (r.f.z * f32(hi) - r.f.w * f32(xq.s.y));
        }
        case 14u: {
            // (q - 32) scale
            return r.f.x * xq.d.x * f32(lo - 32 * xq.s.x) + r.f.y * xq.d.y * f32(hi - 32 * xq.s.y);
        }
        default: {
            return 0.0;
        }
    }
}

@compute @workgroup_size(256)
fn dequantize(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
              @builtin(local_invocation_index) lid: u32) {
    let i = (wid.x + wid.y * nwg.x) * 256u + lid;
    if (i < p.n) {
        dst[i] = value(i);
    }
}

// dequantize's result for RAW types by quant_blocks.wgsl's run decoding (fetch_raw,
// raw_value4: what quant_coop.wgsl's product decodes W with), a run of 32 a thread (p.n a
// multiple of 32), so that `doppler verify` checks that decoding on any adapter.
@compute @workgroup_size(256)
fn dequantize_runs(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                   @builtin(local_invocation_index) lid: u32) {
    let i = ((wid.x + wid.y * nwg.x) * 256u + lid) * 32u;
    if (i < p.n) {
        let r = fetch_raw(i);
        for (var e = 0u; e < 8u; e++) {
            let v = raw_value4(r, e, (i % 256u) / 32u);
            for (var j = 0u; j < 4u; j++) {
                dst[i + 4u * e + j] = v[j];
            }
        }
    }
}

@compute @workgroup_size(256)
fn get_rows(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
            @builtin(local_invocation_index) lid: u32) {
    let i = (wid.x + wid.y * nwg.x) * 256u + lid;
    if (i >= p.m * p.k) {
        return;
    }
    let r = i / p.k;
    // A part of a table split by rows (ops::quant::RowSplit) starts at row p.pos and
    // writes the rows it holds; ids are checked on the host, and one past the table reads
    // as zeros (written by the last part, p.heads = 1).
    let id = ids[r];
    if (id < p.pos) {
        return;
    }
    let l = id - p.pos;
    if (l < p.n) {
        dst[i] = value(l * p.k + i % p.k);
    } else if (p.heads == 1u) {
        dst[i] = 0.0;
    }
}

// Fusions of the products (override constants; unused bindings get a placeholder):
//   NORM     x rows are RMS-normalised first: x * rsqrt(mean(x^2) + eps) * nw (binding 5).
//            The row's scale factors out of the sum: the kernels sum x * nw * w and x^2 in
//            the same pass and multiply by rsqrt(mean(x^2) + eps) at the end.
//   RESIDUAL dst = res (binding 6) + product
//   SWIGLU   W holds 2n rows [gate; up]: dst[r, j] = silu(x.gate_j) * x.up_j, j < n
//   GEGLU    with SWIGLU: gelu_tanh(x.gate_j) instead of silu (Gemma's GeGLU;
//            quant_blocks.wgsl's gate_act)
override NORM: bool = false;
override RESIDUAL: bool = false;
override SWIGLU: bool = false;

// ROPE (entry points qmatvec_rope, qmatvec1_rope; what kvcache.wgsl's rope_store does, on
// the product's output): W stacks q, k and v heads ((heads + 2 hkv) d rows; p.heads query
// heads of p.d). Row t of x's outputs get the bias (ROPE_BIAS, binding 9), q and k are
// turned by RoPE at position p.pos + t (table (positions, d / 2) of (cos, sin), binding
// 10), q goes to dst (T, heads, d), k and v into the caches (capacity, hkv, d) at that
// position (bindings 11, 12). A head's pairs are (2e, 2e + 1), or (e, e + d / 2) with
// ROPE_HALF: then virtual columns (2e, 2e + 1) read W's rows e and e + d / 2.
// The caches hold words as kvcache.wgsl's: f32 bits, or with ROPE_KV_F16 two f16 halves
// (adjacent pairs only, ROPE_HALF false: a pair is one word).
override ROPE_HALF: bool = false;
override ROPE_BIAS: bool = false;
override ROPE_KV_F16: bool = false;
@group(0) @binding(9) var<storage, read> rbias: array<f32>;
@group(0) @binding(10) var<storage, read> rtable: array<vec2<f32>>;
@group(0) @binding(11) var<storage, read_write> k_cache: array<u32>;
@group(0) @binding(12) var<storage, read_write> v_cache: array<u32>;

fn rope_kv_heads() -> u32 {
    return (p.n / p.d - p.heads) / 2u;
}

// Columns turned by RoPE (q and k heads); v follows.
fn rope_turned() -> u32 {
    return (p.heads + rope_kv_heads()) * p.d;
}

// The pair of (virtual) columns (v, v + 1), v even, of a row of x from their sums: bias
// added, q and k turned by RoPE at position pos; values of the stacked row's columns
// (w_row(v), w_row(v + 1)).
fn rope_vals(pos: u32, v: u32, sa: f32, sb: f32) -> vec2<f32> {
    var a = sa;
    var b = sb;
    if (ROPE_BIAS) {
        a += rbias[w_row(v)];
        b += rbias[w_row(v + 1u)];
    }
    if (v < rope_turned()) {
        let cs = rtable[pos * (p.d / 2u) + (v % p.d) / 2u];
        return vec2<f32>(a * cs.x - b * cs.y, a * cs.y + b * cs.x);
    }
    return vec2<f32>(a, b);
}

// Stores the pair of (virtual) columns (v, v + 1), v even, of row t: sums a and b; the
// token's position `pos`, its k and v in the caches' row `row`.
fn rope_out(t: u32, pos: u32, row: u32, v: u32, sa: f32, sb: f32) {
    let i = w_row(v);        // column in the stacked q, k, v row
    let j = w_row(v + 1u);
    let r = rope_vals(pos, v, sa, sb);
    let kv = rope_kv_heads() * p.d;
    let qw = p.heads * p.d;
    if (v < qw) {
        dst[t * qw + i] = r.x;
        dst[t * qw + j] = r.y;
        return;
    }
    // Offset of the k cache's row (v's columns), or the v cache's.
    let o = select(row * kv - qw - kv, row * kv - qw, v < qw + kv);
    if (ROPE_KV_F16) {
        put_kv(v < qw + kv, (o + i) / 2u, pack2x16float(r));
    } else {
        put_kv(v < qw + kv, o + i, bitcast<u32>(r.x));
        put_kv(v < qw + kv, o + j, bitcast<u32>(r.y));
    }
}

fn put_kv(is_k: bool, w: u32, val: u32) {
    if (is_k) {
        k_cache[w] = val;
    } else {
        v_cache[w] = val;
    }
}

// ROPE_HALF with ROPE_KV_F16, row t: in q and k heads the pairs (v, v + 1) and (v + 2,
// v + 3), v a multiple of 4, hold head dims (e, e + d / 2) and (e + 1, e + 1 + d / 2), e
// even: whole words of the cache, (e, e + 1) and (e + d / 2, e + d / 2 + 1); v heads'
// columns v..v+4 are dims in order. `s`: the four columns' sums; pos and row as rope_out's.
fn rope_out_half16(t: u32, pos: u32, row: u32, v: u32, s: vec4<f32>) {
    let i = w_row(v);        // dim e's column; e + d / 2 at w_row(v + 1)
    let j = w_row(v + 1u);
    let r0 = rope_vals(pos, v, s.x, s.y);
    let r1 = rope_vals(pos, v + 2u, s.z, s.w);
    let kv = rope_kv_heads() * p.d;
    let qw = p.heads * p.d;
    if (v < qw) {
        dst[t * qw + i] = r0.x;
        dst[t * qw + j] = r0.y;
        dst[t * qw + i + 1u] = r1.x;
        dst[t * qw + j + 1u] = r1.y;
        return;
    }
    if (v >= qw + kv) {
        // v heads are not turned: columns v..v+4 in order, two words.
        let o = row * kv - qw - kv;
        put_kv(false, (o + i) / 2u, pack2x16float(r0));
        put_kv(false, (o + i) / 2u + 1u, pack2x16float(r1));
        return;
    }
    let o = row * kv - qw;
    put_kv(true, (o + i) / 2u, pack2x16float(vec2<f32>(r0.x, r1.x)));
    put_kv(true, (o + j) / 2u, pack2x16float(vec2<f32>(r0.y, r1.y)));
}

@group(0) @binding(5) var<storage, read> nw: array<f32>;
// x and nw again as vec4s (the same buffers), for rows whose length is a multiple of 4.
@group(0) @binding(7) var<storage, read> xv4: array<vec4<f32>>;
@group(0) @binding(8) var<storage, read> nwv4: array<vec4<f32>>;
@group(0) @binding(6) var<storage, read> res: array<f32>;

// Rows of W the product reads, and W's row for (virtual) output column v: with SWIGLU the
// columns interleave gate and up rows (v even: gate v / 2, odd: up v / 2).
fn w_rows() -> u32 {
    return select(p.n, 2u * p.n, SWIGLU);
}
fn w_row(v: u32) -> u32 {
    if (ROPE_HALF && v < rope_turned()) {
        // Head element e of the pair list: (e / 2) or (e / 2 + d / 2).
        let e = v % p.d;
        return v - e + e / 2u + select(0u, p.d / 2u, (e & 1u) == 1u);
    }
    return select(v, select(v / 2u, p.n + v / 2u, (v & 1u) == 1u), SWIGLU);
}

fn nw4(c: u32) -> vec4<f32> {
    return nwv4[c / 4u];
}

// The value stored for row r, output j, from the sum (RESIDUAL adds res).
fn finish(r: u32, j: u32, sum: f32) -> f32 {
    return select(sum, res[r * p.n + j] + sum, RESIDUAL);
}

const MV_ROWS: u32 = 8u;   // rows of W a workgroup (32 threads each)
// Rows of x a workgroup (8 at most): each W value read once serves them all. 1 for one
// row of x (decode): the loops over rows then hold one sum, not eight, in registers.
override MV_X: u32 = 8u;
var<workgroup> mv_part: array<array<vec4<f32>, 64>, 8>;   // [row of x][thread / 4][thread % 4]
var<workgroup> mv_ss: array<array<vec4<f32>, 8>, 8>;      // NORM: x^2 sums of the first 32 threads
var<workgroup> mv_tot: array<array<f32, 8>, 8>;           // [row of x][group]: its column's sum
var<workgroup> mv_sstot: array<f32, 8>;                   // NORM: [row of x] sum of x^2

// MERGE (qmatvec, one row of x): x holds a token's attention split over key ranges,
// (heads, splits, d + 2) = unnormalised output, max score m, sum l (kvcache.wgsl's
// attend_part); the workgroup first merges it into mx_in as attend_merge does (same
// operations in the same order), then reads x from there. k = heads * d <= 1024.
override MERGE: bool = false;
var<workgroup> mx_in: array<f32, 1024>;
// With at most 512 (head, range) pairs and 64 heads, each range's factor exp(m - max m)
// and each head's sum of factor * l are computed once, not once per element.
var<workgroup> mx_fac: array<f32, 512>;   // [head][range]
var<workgroup> mx_sum: array<f32, 64>;    // [head]

fn merge_x(lid: u32) {
    let w = p.d + 2u;
    let ns = p.splits;
    let heads = p.k / p.d;
    if (heads * ns <= 512u && heads <= 64u) {
        // m into mx_fac, l into mx_in (free until the end).
        for (var i = lid; i < heads * ns; i += 256u) {
            mx_fac[i] = x[i * w + p.d];
            mx_in[i] = x[i * w + p.d + 1u];
        }
        workgroupBarrier();
        if (lid < heads) {
            let b = lid * ns;
            var mx = -3.0e38;
            for (var sp = 0u; sp < ns; sp++) {
                mx = max(mx, mx_fac[b + sp]);
            }
            var l = 0.0;
            for (var sp = 0u; sp < ns; sp++) {
                let f = exp(mx_fac[b + sp] - mx);
                mx_fac[b + sp] = f;
                l += f * mx_in[b + sp];
            }
            mx_sum[lid] = l;
        }
        workgroupBarrier();
        // A thread's (up to 4) elements lid + 256 j side by side: their loads of 4 ranges
        // are in flight together. Rows past k read element 0 and are not stored.
        var hd: vec4<u32>;
        var base: vec4<u32>;
        for (var j = 0u; j < 4u; j++) {
            let i = select(0u, lid + 256u * j, lid + 256u * j < p.k);
            hd[j] = i / p.d;
            base[j] = hd[j] * ns * w + i % p.d;
        }
        var acc = vec4<f32>(0.0);
        var sp = 0u;
        for (; sp + 4u <= ns; sp += 4u) {
            var a: array<vec4<f32>, 4>;   // [element][range]
            for (var j = 0u; j < 4u; j++) {
                let b = base[j] + sp * w;
                a[j] = vec4<f32>(x[b], x[b + w], x[b + 2u * w], x[b + 3u * w]);
            }
            for (var j = 0u; j < 4u; j++) {
                let f = hd[j] * ns + sp;
                acc[j] += mx_fac[f] * a[j].x;
                acc[j] += mx_fac[f + 1u] * a[j].y;
                acc[j] += mx_fac[f + 2u] * a[j].z;
                acc[j] += mx_fac[f + 3u] * a[j].w;
            }
        }
        for (; sp < ns; sp++) {
            for (var j = 0u; j < 4u; j++) {
                acc[j] += mx_fac[hd[j] * ns + sp] * x[base[j] + sp * w];
            }
        }
        // (the l values in mx_in were read before the barrier)
        for (var j = 0u; j < 4u; j++) {
            if (lid + 256u * j < p.k) {
                mx_in[lid + 256u * j] = acc[j] / mx_sum[hd[j]];
            }
        }
        return;
    }
    for (var i = lid; i < p.k; i += 256u) {
        let base = (i / p.d) * ns * w;
        let e = i % p.d;
        var mx = -3.0e38;
        var sp = 0u;
        for (; sp + 4u <= ns; sp += 4u) {
            let b = base + sp * w + p.d;
            let m4 = vec4<f32>(x[b], x[b + w], x[b + 2u * w], x[b + 3u * w]);
            mx = max(mx, max(max(m4.x, m4.y), max(m4.z, m4.w)));
        }
        for (; sp < ns; sp++) {
            mx = max(mx, x[base + sp * w + p.d]);
        }
        var l = 0.0;
        var acc = 0.0;
        // 4 ranges' loads before their sums (in range order, as attend_merge adds them).
        for (sp = 0u; sp + 4u <= ns; sp += 4u) {
            let b = base + sp * w;
            let f = exp(vec4<f32>(x[b + p.d], x[b + w + p.d], x[b + 2u * w + p.d], x[b + 3u * w + p.d]) - mx);
            let l4 = vec4<f32>(x[b + p.d + 1u], x[b + w + p.d + 1u], x[b + 2u * w + p.d + 1u], x[b + 3u * w + p.d + 1u]);
            let a4 = vec4<f32>(x[b + e], x[b + w + e], x[b + 2u * w + e], x[b + 3u * w + e]);
            l += f.x * l4.x;
            l += f.y * l4.y;
            l += f.z * l4.z;
            l += f.w * l4.w;
            acc += f.x * a4.x;
            acc += f.y * a4.y;
            acc += f.z * a4.z;
            acc += f.w * a4.w;
        }
        for (; sp < ns; sp++) {
            let b = base + sp * w;
            let f = exp(x[b + p.d] - mx);
            l += f * x[b + p.d + 1u];
            acc += f * x[b + e];
        }
        mx_in[i] = acc / l;
    }
}

// 4 elements of row r from column c (k and c multiples of 4).
fn x4(r: u32, c: u32) -> vec4<f32> {
    if (MERGE) {
        return vec4<f32>(mx_in[c], mx_in[c + 1u], mx_in[c + 2u], mx_in[c + 3u]);
    }
    return xv4[(r * p.k + c) / 4u];
}

// Where thread lid of workgroup g works in qmatvec: (first row of x, output column (virtual
// with SWIGLU or ROPE_HALF), rows of x).
fn mv_at(g: u32, lid: u32) -> vec3<u32> {
    let per_row = (w_rows() + MV_ROWS - 1u) / MV_ROWS;
    let r0 = (g / per_row) * MV_X;
    return vec3<u32>(r0, (g % per_row) * MV_ROWS + lid / 32u, min(MV_X, p.m - min(r0, p.m)));
}

// qmatvec's sums: every thread ends seeing column (group g)'s sum for row r0 + r of x in
// mv_tot[r][g] (without the norm's scale, mv_scale(r)).
fn mv_sums(g: u32, lid: u32) {
    let at = mv_at(g, lid);
    let r0 = at.x;
    let v = at.y;
    let nr = at.z;
    let wr = w_rows();
    let lane = lid % 32u;
    if (MERGE) {
        merge_x(lid);
        workgroupBarrier();
    }
    var acc: array<f32, 8>;
    var ss: array<f32, 8>;   // NORM: sum of x^2 over this thread's columns
    if (nr > 0u && v < wr) {
        let wbase = w_row(v) * p.k;
        if (p.k % 32u == 0u) {
            // A run of 32 a thread (run32), 32 threads covering 1024 columns a pass.
            for (var c = lane * 32u; c < p.k; c += 1024u) {
                var w = run32(wbase + c);
                for (var e = 0u; e < 8u; e++) {
                    if (NORM) {
                        w[e] *= nw4(run_col(c, e));
                    }
                }
                for (var r = 0u; r < MV_X; r++) {
                    if (r < nr) {
                        for (var e = 0u; e < 8u; e++) {
                            let xv = x4(r0 + r, run_col(c, e));
                            acc[r] += dot(xv, w[e]);
                            if (NORM) {
                                ss[r] += dot(xv, xv);
                            }
                        }
                    }
                }
            }
        } else if (p.k % 4u == 0u) {
            for (var c = lane * 4u; c < p.k; c += 128u) {
                let w = value4(wbase + c);
                var wn = w;
                if (NORM) {
                    wn = w * nw4(c);
                }
                // Constant bounds: the loop unrolls and acc stays in registers.
                for (var r = 0u; r < MV_X; r++) {
                    if (r < nr) {
                        let xv = x4(r0 + r, c);
                        acc[r] += dot(xv, wn);
                        if (NORM) {
                            ss[r] += dot(xv, xv);
                        }
                    }
                }
            }
        } else {
            for (var c = lane; c < p.k; c += 32u) {
                var w = value(wbase + c);
                if (NORM) {
                    w *= nw[c];
                }
                for (var r = 0u; r < MV_X; r++) {
                    if (r < nr) {
                        let xv = x[(r0 + r) * p.k + c];
                        acc[r] += xv * w;
                        if (NORM) {
                            ss[r] += xv * xv;
                        }
                    }
                }
            }
        }
    }
    for (var r = 0u; r < MV_X; r++) {
        if (r < nr) {
            mv_part[r][lid / 4u][lid % 4u] = acc[r];
            // Every group of 32 covers all of k: the first group's sums serve them all.
            if (NORM && lid < 32u) {
                mv_ss[r][lid / 4u][lid % 4u] = ss[r];
            }
        }
    }
    workgroupBarrier();
    // Lane 0 of each group adds its 32 partial sums in order (8 vec4s, then across).
    if (lane == 0u) {
        let g4 = lid / 4u;
        for (var r = 0u; r < nr; r++) {
            var t = mv_part[r][g4];
            var u = mv_ss[r][0];
            for (var i = 1u; i < 8u; i++) {
                t += mv_part[r][g4 + i];
                if (NORM && lid == 0u) {
                    u += mv_ss[r][i];
                }
            }
            mv_tot[r][lid / 32u] = (t.x + t.y) + (t.z + t.w);
            if (NORM && lid == 0u) {
                mv_sstot[r] = (u.x + u.y) + (u.z + u.w);
            }
        }
    }
    workgroupBarrier();
}

// NORM's factor for a row of x whose squares sum to ss: rsqrt(mean(x^2) + eps).
fn rstd(ss: f32) -> f32 {
    return inverseSqrt(ss / f32(p.k) + bitcast<f32>(p.eps));
}

// RMSNorm's factor for row r of x (1 without NORM), after mv_sums.
fn mv_scale(r: u32) -> f32 {
    return select(1.0, rstd(mv_sstot[r]), NORM);
}

@compute @workgroup_size(256)
fn qmatvec(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
           @builtin(local_invocation_index) lid: u32) {
    let g = wid.x + wid.y * nwg.x;
    mv_sums(g, lid);
    let at = mv_at(g, lid);
    let v = at.y;
    if (lid % 32u == 0u && v < w_rows()) {
        for (var r = 0u; r < at.z; r++) {
            let scale = mv_scale(r);
            if (SWIGLU) {
                if ((v & 1u) == 0u) {
                    dst[(at.x + r) * p.n + v / 2u] = gate_act(mv_tot[r][lid / 32u] * scale) * (mv_tot[r][lid / 32u + 1u] * scale);
                }
            } else {
                dst[(at.x + r) * p.n + v] = finish(at.x + r, v, mv_tot[r][lid / 32u] * scale);
            }
        }
    }
}

// qmatvec_rows: qmatvec for batched decode steps (the invariant product of a few rows of
// x), k a multiple of 32. A workgroup: 32 MR_W rows of W (virtual columns; thread t of a
// set takes columns v + 32 h, h < MR_W) x MR_X rows of x; its MR_SETS sets of 32 threads
// (set sg) take k's runs of 32 in turn (set sg: runs sg, sg + MR_SETS, ...), each thread's
// MR_W MR_X sums in registers, every thread of a set reading the same x (one load serves
// the set and its MR_W rows of W); then the sets' sums added in set order, times the row's
// norm factor (NORM: the rows' squares summed first, a fixed tree), the GLU or the
// residual applied; sets 0..7 finish rows sg and sg + 8. A column's sums never depend on
// the other rows of x, on MR_X (how many rows a workgroup takes) or on MR_W, so the rows'
// bits do not depend on the batch (MR_SETS, chosen by W's shape and the adapter's limits,
// does change them). Grid: (ceil(W's rows / (32 MR_W)), ceil(m / MR_X)); MR_X <= 16, MR_W
// 1 or 2, MR_SETS 8 or 9 (9: k's 18 runs at SmolLM2's width in two passes, not three) or,
// for longer rows of W, more (SmolLM2's down product: 16 sets, 3 passes of k's 48 runs, not
// 6); MR_STAGE below.
override MR_X: u32 = 8u;
override MR_W: u32 = 1u;
override MR_SETS: u32 = 8u;
// Whether each pass stages the sets' runs of x in workgroup memory (coalesced loads, one
// barrier a pass) instead of each thread loading them: faster with many rows of x a
// workgroup, slower with one or two (the host's choice by MR_X; the same bits).
override MR_STAGE: bool = false;
var<workgroup> mr_ss: array<f32, 16>;       // NORM: [row of x] sum of x^2
// One buffer, two uses: x's staged runs ([set][row of x (MR_X)][vec4 of the run (8)]) while
// the sets sum, then the sets' partials as f32s ([set][row of x (MR_X)][thread of the set]).
override MR_LEN: u32 = MR_SETS * MR_X * 8u;
var<workgroup> mr_xs: array<vec4<f32>, MR_LEN>;
fn mr_get(i: u32) -> f32 {
    return mr_xs[i / 4u][i % 4u];
}
fn mr_set(i: u32, v: f32) {
    mr_xs[i / 4u][i % 4u] = v;
}

// Sums `acc` after a run's 8 dots of x's `xs` (x: with W's run w0, y: with w1 where MR_W
// is 2), each x load serving both.
fn mr_dots(acc: vec2<f32>, xs: array<vec4<f32>, 8>, w0: array<vec4<f32>, 8>, w1: array<vec4<f32>, 8>) -> vec2<f32> {
    var a = acc;
    for (var e = 0u; e < 8u; e++) {
        a.x += dot(xs[e], w0[e]);
        if (MR_W > 1u) {
            a.y += dot(xs[e], w1[e]);
        }
    }
    return a;
}

// Row r's sums after run c's 8 dots from set sg's staged x (MR_STAGE).
fn mr_row_s(acc: vec2<f32>, sg: u32, r: u32, w0: array<vec4<f32>, 8>, w1: array<vec4<f32>, 8>) -> vec2<f32> {
    let xb = (sg * MR_X + r) * 8u;
    var xs: array<vec4<f32>, 8>;
    for (var e = 0u; e < 8u; e++) {
        xs[e] = mr_xs[xb + e];
    }
    return mr_dots(acc, xs, w0, w1);
}

fn mr_at(sg: u32, r: u32, t: u32) -> u32 {
    return (sg * MR_X + r) * 32u + t;
}

// W's run at column c of the row starting at wbase, times the norm weight (NORM).
fn mr_w(wbase: u32, c: u32) -> array<vec4<f32>, 8> {
    var w = run32(wbase + c);
    if (NORM) {
        for (var e = 0u; e < 8u; e++) {
            w[e] *= nw4(run_col(c, e));
        }
    }
    return w;
}

// Row r of x's sums after run c's 8 dots, x loaded from memory.
fn mr_row(acc: vec2<f32>, r: u32, c: u32, w0: array<vec4<f32>, 8>, w1: array<vec4<f32>, 8>) -> vec2<f32> {
    let xb = (r * p.k) / 4u;
    var xs: array<vec4<f32>, 8>;
    for (var e = 0u; e < 8u; e++) {
        xs[e] = xv4[xb + run_col(c, e) / 4u];
    }
    return mr_dots(acc, xs, w0, w1);
}

// Rows r.. r + 4 of set sg's sums for thread t (rows past MR_X have no slots).
fn mr_put(sg: u32, r: u32, t: u32, a: vec4<f32>) {
    mr_set(mr_at(sg, r, t), a.x);
    if (r + 1u < MR_X) { mr_set(mr_at(sg, r + 1u, t), a.y); }
    if (r + 2u < MR_X) { mr_set(mr_at(sg, r + 2u, t), a.z); }
    if (r + 3u < MR_X) { mr_set(mr_at(sg, r + 3u, t), a.w); }
}

// Row r's sum for thread t's column: the MR_SETS sets' in order, times the norm factor.
fn mr_total(r: u32, t: u32, nr: u32) -> f32 {
    var sum = 0.0;
    if (r < nr) {
        sum = mr_get(mr_at(0u, r, t));
        for (var s = 1u; s < MR_SETS; s++) {
            sum += mr_get(mr_at(s, r, t));
        }
        if (NORM) {
            sum *= rstd(mr_ss[r]);
        }
    }
    return sum;
}

// A workgroup's first row of x and its number of rows.
fn mr_span(wid: vec3<u32>) -> vec2<u32> {
    let r0 = wid.y * MR_X;
    return vec2<u32>(r0, min(MR_X, p.m - min(r0, p.m)));
}

// From mr_sums' result: row sg + 8 i's sum of column v + 32 h.
fn mr_pick(tot: vec4<f32>, h: u32, i: u32) -> f32 {
    return select(select(tot.x, tot.y, i == 1u), select(tot.z, tot.w, i == 1u), h == 1u);
}

// qmatvec_rows' sums: thread (sg, t), sg < 8, returns rows sg and sg + 8's sums of
// columns v = wid.x * 32 MR_W + t (xy) and v + 32 (zw, MR_W 2) (times the norm factor; 0
// past the rows), and mr_get(mr_at(h, r, t)) holds row r's of column v + 32 h for every
// thread to read.
fn mr_sums(wid: vec3<u32>, lid: u32) -> vec4<f32> {
    let span = mr_span(wid);
    let r0 = span.x;
    let nr = span.y;
    let t = lid % 32u;
    let sg = lid / 32u;
    let wr = w_rows();
    let v = wid.x * 32u * MR_W + t;
    if (NORM) {
        // Row r's squares: set r % 8 takes rows r, r + 8 (a ninth set none); its thread t
        // columns 4 t + 128 i, then the 32 partials in a fixed tree.
        for (var r = sg; r < MR_X && sg < 8u; r += 8u) {
            var ss = 0.0;
            if (r < nr) {
                for (var c = t * 4u; c < p.k; c += 128u) {
                    let xv = xv4[((r0 + r) * p.k + c) / 4u];
                    ss += dot(xv, xv);
                }
            }
            mr_set(mr_at(0u, r, t), ss);
        }
        workgroupBarrier();
        for (var h = 16u; h > 0u; h >>= 1u) {
            if (t < h) {
                for (var r = sg; r < MR_X && sg < 8u; r += 8u) {
                    mr_set(mr_at(0u, r, t), mr_get(mr_at(0u, r, t)) + mr_get(mr_at(0u, r, t + h)));
                }
            }
            workgroupBarrier();
        }
        if (t == 0u) {
            for (var r = sg; r < MR_X && sg < 8u; r += 8u) {
                mr_ss[r] = mr_get(mr_at(0u, r, 0u));
            }
        }
        workgroupBarrier();
    }
    // One named accumulator a row of x (an array indexed by the row may be kept in memory
    // by the compiler: SmolLM2's 32-row step 2.41 -> 2.32 ms of products on an H100); MR_X
    // (a constant) drops the rows past it.
    var a0 = vec2<f32>(0.0);
    var a1 = vec2<f32>(0.0);
    var a2 = vec2<f32>(0.0);
    var a3 = vec2<f32>(0.0);
    var a4 = vec2<f32>(0.0);
    var a5 = vec2<f32>(0.0);
    var a6 = vec2<f32>(0.0);
    var a7 = vec2<f32>(0.0);
    var a8 = vec2<f32>(0.0);
    var a9 = vec2<f32>(0.0);
    var a10 = vec2<f32>(0.0);
    var a11 = vec2<f32>(0.0);
    var a12 = vec2<f32>(0.0);
    var a13 = vec2<f32>(0.0);
    var a14 = vec2<f32>(0.0);
    var a15 = vec2<f32>(0.0);
    let wb0 = w_row(min(v, wr - 1u)) * p.k;
    let wb1 = w_row(min(v + 32u, wr - 1u)) * p.k;
    // Two loops over the same runs in the same order: the unstaged one stepping c (one loop
    // of passes with a `live` test for both cost 5% at one stream on an H100, session 37).
    if (MR_STAGE) {
        // Each pass, a set's run of x for the workgroup's rows staged in workgroup memory
        // first (coalesced loads; the same values, so the same sums).
        let passes = (p.k / 32u + MR_SETS - 1u) / MR_SETS;
        for (var ps = 0u; ps < passes; ps++) {
            let c = (ps * MR_SETS + sg) * 32u;
            let live = c < p.k;
            // Thread t stages vec4 t % 8 of the run for rows t / 8 + 4 i: loaded into
            // registers first, then W's run loaded, so that both wait on memory together.
            let e = t % 8u;
            var xr: array<vec4<f32>, 4>;
            if (live) {
                for (var i = 0u; i < 4u; i++) {
                    let r = t / 8u + 4u * i;
                    if (r < MR_X && r < nr) {
                        xr[i] = xv4[((r0 + r) * p.k + run_col(c, e)) / 4u];
                    }
                }
            }
            var w0: array<vec4<f32>, 8>;
            var w1: array<vec4<f32>, 8>;
            if (live) {
                w0 = mr_w(wb0, c);
                w1 = w0;
                if (MR_W > 1u) {
                    w1 = mr_w(wb1, c);
                }
            }
            workgroupBarrier();
            if (live) {
                for (var i = 0u; i < 4u; i++) {
                    let r = t / 8u + 4u * i;
                    if (r < MR_X && r < nr) {
                        mr_xs[(sg * MR_X + r) * 8u + e] = xr[i];
                    }
                }
            }
            workgroupBarrier();
            if (live) {
                a0 = mr_row_s(a0, sg, 0u, w0, w1);
                if (MR_X > 1u && nr > 1u) { a1 = mr_row_s(a1, sg, 1u, w0, w1); }
                if (MR_X > 2u && nr > 2u) { a2 = mr_row_s(a2, sg, 2u, w0, w1); }
                if (MR_X > 3u && nr > 3u) { a3 = mr_row_s(a3, sg, 3u, w0, w1); }
                if (MR_X > 4u && nr > 4u) { a4 = mr_row_s(a4, sg, 4u, w0, w1); }
                if (MR_X > 5u && nr > 5u) { a5 = mr_row_s(a5, sg, 5u, w0, w1); }
                if (MR_X > 6u && nr > 6u) { a6 = mr_row_s(a6, sg, 6u, w0, w1); }
                if (MR_X > 7u && nr > 7u) { a7 = mr_row_s(a7, sg, 7u, w0, w1); }
                if (MR_X > 8u && nr > 8u) { a8 = mr_row_s(a8, sg, 8u, w0, w1); }
                if (MR_X > 9u && nr > 9u) { a9 = mr_row_s(a9, sg, 9u, w0, w1); }
                if (MR_X > 10u && nr > 10u) { a10 = mr_row_s(a10, sg, 10u, w0, w1); }
                if (MR_X > 11u && nr > 11u) { a11 = mr_row_s(a11, sg, 11u, w0, w1); }
                if (MR_X > 12u && nr > 12u) { a12 = mr_row_s(a12, sg, 12u, w0, w1); }
                if (MR_X > 13u && nr > 13u) { a13 = mr_row_s(a13, sg, 13u, w0, w1); }
                if (MR_X > 14u && nr > 14u) { a14 = mr_row_s(a14, sg, 14u, w0, w1); }
                if (MR_X > 15u && nr > 15u) { a15 = mr_row_s(a15, sg, 15u, w0, w1); }
            }
        }
        workgroupBarrier();
    } else {
        for (var c = sg * 32u; c < p.k; c += MR_SETS * 32u) {
            let w0 = mr_w(wb0, c);
            var w1 = w0;
            if (MR_W > 1u) {
                w1 = mr_w(wb1, c);
            }
            a0 = mr_row(a0, r0, c, w0, w1);
            if (MR_X > 1u && nr > 1u) { a1 = mr_row(a1, r0 + 1u, c, w0, w1); }
            if (MR_X > 2u && nr > 2u) { a2 = mr_row(a2, r0 + 2u, c, w0, w1); }
            if (MR_X > 3u && nr > 3u) { a3 = mr_row(a3, r0 + 3u, c, w0, w1); }
            if (MR_X > 4u && nr > 4u) { a4 = mr_row(a4, r0 + 4u, c, w0, w1); }
            if (MR_X > 5u && nr > 5u) { a5 = mr_row(a5, r0 + 5u, c, w0, w1); }
            if (MR_X > 6u && nr > 6u) { a6 = mr_row(a6, r0 + 6u, c, w0, w1); }
            if (MR_X > 7u && nr > 7u) { a7 = mr_row(a7, r0 + 7u, c, w0, w1); }
            if (MR_X > 8u && nr > 8u) { a8 = mr_row(a8, r0 + 8u, c, w0, w1); }
            if (MR_X > 9u && nr > 9u) { a9 = mr_row(a9, r0 + 9u, c, w0, w1); }
            if (MR_X > 10u && nr > 10u) { a10 = mr_row(a10, r0 + 10u, c, w0, w1); }
            if (MR_X > 11u && nr > 11u) { a11 = mr_row(a11, r0 + 11u, c, w0, w1); }
            if (MR_X > 12u && nr > 12u) { a12 = mr_row(a12, r0 + 12u, c, w0, w1); }
            if (MR_X > 13u && nr > 13u) { a13 = mr_row(a13, r0 + 13u, c, w0, w1); }
            if (MR_X > 14u && nr > 14u) { a14 = mr_row(a14, r0 + 14u, c, w0, w1); }
            if (MR_X > 15u && nr > 15u) { a15 = mr_row(a15, r0 + 15u, c, w0, w1); }
        }
    }
    // Column v's sums (x), then with MR_W 2 column v + 32's (y), through the same slots.
    mr_put(sg, 0u, t, vec4<f32>(a0.x, a1.x, a2.x, a3.x));
    if (MR_X > 4u) { mr_put(sg, 4u, t, vec4<f32>(a4.x, a5.x, a6.x, a7.x)); }
    if (MR_X > 8u) { mr_put(sg, 8u, t, vec4<f32>(a8.x, a9.x, a10.x, a11.x)); }
    if (MR_X > 12u) { mr_put(sg, 12u, t, vec4<f32>(a12.x, a13.x, a14.x, a15.x)); }
    workgroupBarrier();
    // Thread (sg, t) finishes rows sg, sg + 8 of its columns: the sets in order (a ninth
    // set's threads the same as set 0's, unused).
    let t0 = vec2<f32>(mr_total(sg, t, nr), mr_total(sg + 8u, t, nr));
    var t1 = vec2<f32>(0.0);
    if (MR_W > 1u) {
        workgroupBarrier();
        mr_put(sg, 0u, t, vec4<f32>(a0.y, a1.y, a2.y, a3.y));
        if (MR_X > 4u) { mr_put(sg, 4u, t, vec4<f32>(a4.y, a5.y, a6.y, a7.y)); }
        if (MR_X > 8u) { mr_put(sg, 8u, t, vec4<f32>(a8.y, a9.y, a10.y, a11.y)); }
        if (MR_X > 12u) { mr_put(sg, 12u, t, vec4<f32>(a12.y, a13.y, a14.y, a15.y)); }
        workgroupBarrier();
        t1 = vec2<f32>(mr_total(sg, t, nr), mr_total(sg + 8u, t, nr));
    }
    workgroupBarrier();
    // Rows sg and sg + 8 by sets 0..7 only: one writer a slot.
    if (sg < 8u && sg < MR_X) {
        mr_set(mr_at(0u, sg, t), t0.x);
        if (MR_W > 1u) {
            mr_set(mr_at(1u, sg, t), t1.x);
        }
    }
    if (sg + 8u < MR_X) {
        mr_set(mr_at(0u, sg + 8u, t), t0.y);
        if (MR_W > 1u) {
            mr_set(mr_at(1u, sg + 8u, t), t1.y);
        }
    }
    workgroupBarrier();
    return vec4<f32>(t0, t1);
}

@compute @workgroup_size(MR_SETS * 32u)
fn qmatvec_rows(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let tot = mr_sums(wid, lid);
    if (lid >= 256u) {
        return;
    }
    let span = mr_span(wid);
    let r0 = span.x;
    let nr = span.y;
    let t = lid % 32u;
    for (var h = 0u; h < MR_W; h++) {
        let v = (wid.x * MR_W + h) * 32u + t;
        for (var i = 0u; i < 2u; i++) {
            let r = lid / 32u + 8u * i;
            if (r < nr && v < w_rows()) {
                let sum = mr_pick(tot, h, i);
                if (SWIGLU) {
                    if ((v & 1u) == 0u) {
                        dst[(r0 + r) * p.n + v / 2u] = gate_act(sum) * mr_get(mr_at(h, r, t + 1u));
                    }
                } else {
                    dst[(r0 + r) * p.n + v] = finish(r0 + r, v, sum);
                }
            }
        }
    }
}

// qmatvec_rows with ROPE for paged rows (serving's batched steps): row r of x is a token of
// its own sequence, its position and page list in `ids` as kvcache.wgsl's `paged` holds
// them (per row: position (2 r), start of its page list (2 r + 1); a page ROWS_PAGE cache
// rows, kvcache.wgsl's PAGE). q goes to dst (m, heads, d), k and v into the caches at the
// token's row. Pairs (v, v + 1) are neighbouring threads' columns; with ROPE_HALF and f16
// caches, columns v..v+4 (threads t % 4 = 0) give whole words.
const ROWS_PAGE: u32 = 16u;

@compute @workgroup_size(MR_SETS * 32u)
fn qmatvec_rows_rope(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let tot = mr_sums(wid, lid);
    if (lid >= 256u) {
        return;
    }
    let span = mr_span(wid);
    let r0 = span.x;
    let nr = span.y;
    let t = lid % 32u;
    for (var h = 0u; h < MR_W; h++) {
        let v = (wid.x * MR_W + h) * 32u + t;
        for (var i = 0u; i < 2u; i++) {
            let r = lid / 32u + 8u * i;
            if (r >= nr || v >= w_rows()) {
                continue;
            }
            let row = r0 + r;
            let pos = ids[2u * row];
            let crow = ids[ids[2u * row + 1u] + pos / ROWS_PAGE] * ROWS_PAGE + pos % ROWS_PAGE;
            let sum = mr_pick(tot, h, i);
            if (ROPE_HALF && ROPE_KV_F16) {
                if (t % 4u == 0u) {
                    let s = vec4<f32>(sum, mr_get(mr_at(h, r, t + 1u)), mr_get(mr_at(h, r, t + 2u)),
                                      mr_get(mr_at(h, r, t + 3u)));
                    rope_out_half16(row, pos, crow, v, s);
                }
            } else if ((v & 1u) == 0u) {
                rope_out(row, pos, crow, v, sum, mr_get(mr_at(h, r, t + 1u)));
            }
        }
    }
}

// qmatvec with ROPE: columns (v, v + 1), v even, are a pair, in neighbouring groups.
@compute @workgroup_size(256)
fn qmatvec_rope(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                @builtin(local_invocation_index) lid: u32) {
    let g = wid.x + wid.y * nwg.x;
    mv_sums(g, lid);
    let at = mv_at(g, lid);
    let v = at.y;
    if (ROPE_HALF && ROPE_KV_F16) {
        // Groups 0 and 4 (columns v..v+4, v a multiple of 4: a workgroup's 8 columns start
        // at a multiple of 8) write whole words of f16 caches.
        if (lid % 128u == 0u && v < w_rows()) {
            let gi = lid / 32u;
            for (var r = 0u; r < at.z; r++) {
                let s = vec4<f32>(mv_tot[r][gi], mv_tot[r][gi + 1u], mv_tot[r][gi + 2u], mv_tot[r][gi + 3u]);
                let t = at.x + r;
                rope_out_half16(t, p.pos + t, p.pos + t, v, s * mv_scale(r));
            }
        }
        return;
    }
    if (lid % 32u == 0u && v < w_rows() && (v & 1u) == 0u) {
        for (var r = 0u; r < at.z; r++) {
            let scale = mv_scale(r);
            let t = at.x + r;
            rope_out(t, p.pos + t, p.pos + t, v, mv_tot[r][lid / 32u] * scale, mv_tot[r][lid / 32u + 1u] * scale);
        }
    }
}

// qmatvec for one row of x (decode), k a multiple of 32: a thread's run of x (times the
// norm weight) is loaded once and serves MV1_RW rows of W, so activation reads do not
// outnumber weight reads (with XQ8: a run of x's 8-bit quants). 8 groups of 32 threads;
// MV1_SPLIT consecutive groups share MV1_RW rows of W and split k between them (1: 32
// rows a workgroup, for tall W; 4: 8 rows a workgroup, for long rows of few W rows).
// qmatvec1_x8 with X8_OUT takes MV1_WG threads a workgroup (128 to 512; the others 256),
// or 8 rows a set (MV1_RW, XQ8 only, 256 threads), so that a workgroup makes 16 outputs.
override MV1_RW: u32 = 4u;
override MV1_SPLIT: u32 = 1u;
override MV1_WG: u32 = 256u;
const MV1_MAX_WG: u32 = 512u;
// [thread][rows 0..4 of its set]; rows 4..8 at [thread + 256] with MV1_RW 8.
var<workgroup> mv1_part: array<vec4<f32>, MV1_MAX_WG>;
var<workgroup> mv1_ss: array<f32, MV1_MAX_WG>;

// Where thread lid of workgroup g works in qmatvec1: (first of its MV1_RW (virtual) output
// columns, its index among the threads sharing them).
fn mv1_at(g: u32, lid: u32) -> vec2<u32> {
    let width = 32u * MV1_SPLIT;   // threads sharing rows of W
    return vec2<u32>((g * (MV1_WG / width) + lid / width) * MV1_RW, lid % width);
}

// A thread's sums for its set's rows (hi: rows 4..8 with MV1_RW 8) and of x^2.
struct Mv1Acc {
    rows: vec4<f32>,
    hi: vec4<f32>,
    ss: f32,
}

// The XQ8 path's sums of the thread `local` of `width` sharing rows v0.. of W. Rows past W
// read its last row (their sums are not stored): no branch between the rows.
fn mv1_sums_x8(v0: u32, local: u32, width: u32) -> Mv1Acc {
    var a: Mv1Acc;
    let wr = w_rows();
    if (v0 >= wr) {
        return a;
    }
    let step = 32u * width;
    if (MV1_RW == 8u) {
        // A pass over k at a time: the 8 rows' loads are in flight together.
        for (var c = local * 32u; c < p.k; c += step) {
            let xa = xq8_at(c);
            a.ss += xa.ss;
            for (var q = 0u; q < 4u; q++) {
                a.rows[q] += run32_q8(w_row(min(v0 + q, wr - 1u)) * p.k + c, xa);
            }
            for (var q = 0u; q < 4u; q++) {
                a.hi[q] += run32_q8(w_row(min(v0 + 4u + q, wr - 1u)) * p.k + c, xa);
            }
        }
        return a;
    }
    // Two passes over k at a time, so that both passes' loads of the 4 rows are in flight
    // together (8B o + down 1.05 -> 0.99 ms a token on the H200).
    var c = local * 32u;
    for (; c + step < p.k; c += 2u * step) {
        let xa = xq8_at(c);
        let xb = xq8_at(c + step);
        a.ss += xa.ss;
        a.ss += xb.ss;
        for (var q = 0u; q < 4u; q++) {
            let row = w_row(min(v0 + q, wr - 1u)) * p.k;
            let u = run32_q8(row + c, xa);
            let v = run32_q8(row + c + step, xb);
            a.rows[q] += u;
            a.rows[q] += v;
        }
    }
    if (c < p.k) {
        let xa = xq8_at(c);
        a.ss += xa.ss;
        for (var q = 0u; q < 4u; q++) {
            a.rows[q] += run32_q8(w_row(min(v0 + q, wr - 1u)) * p.k + c, xa);
        }
    }
    return a;
}

// The f32 path's sums (x times the norm weight, and x^2 with NORM).
fn mv1_sums_f32(v0: u32, local: u32, width: u32) -> Mv1Acc {
    var a: Mv1Acc;
    let wr = w_rows();
    if (v0 >= wr) {
        return a;
    }
    for (var c = local * 32u; c < p.k; c += 32u * width) {
        var xs: array<vec4<f32>, 8>;
        for (var e = 0u; e < 8u; e++) {
            let xv = x4(0u, run_col(c, e));
            xs[e] = xv;
            if (NORM) {
                a.ss += dot(xv, xv);
                xs[e] = xv * nw4(run_col(c, e));
            }
        }
        for (var q = 0u; q < 4u; q++) {   // MV1_RW is 4 here
            if (v0 + q < wr) {
                let w = run32(w_row(v0 + q) * p.k + c);
                var sum = 0.0;
                for (var e = 0u; e < 8u; e++) {
                    sum += dot(xs[e], w[e]);
                }
                a.rows[q] += sum;
            }
        }
    }
    return a;
}

// The sets' sums: the first of the threads sharing columns v0.. ends with column v0 + q's
// sum in mv1_get(lid, q) and the sum of x^2 in mv1_ss[lid]. Two barriers whatever the
// width: the first width / 8 threads of a set each add 8 partials (theirs, then every
// width / 8-th after), into their own slot; then the first thread adds those, into its
// slot (which only it reads afterwards).
fn mv1_reduce(lid: u32, local: u32, width: u32, a: Mv1Acc) {
    let hi = MV1_RW == 8u;
    mv1_part[lid] = a.rows;
    if (hi) {
        mv1_part[lid + 256u] = a.hi;
    }
    mv1_ss[lid] = a.ss;
    workgroupBarrier();
    let n1 = width / 8u;
    let first = lid - local;
    if (local < n1) {
        var t = vec4<f32>(0.0);
        var th = vec4<f32>(0.0);
        var u = 0.0;
        for (var i = 0u; i < 8u; i++) {
            let j = lid + i * n1;
            t += mv1_part[j];
            if (hi) {
                th += mv1_part[j + 256u];
            }
            u += mv1_ss[j];
        }
        mv1_part[lid] = t;
        if (hi) {
            mv1_part[lid + 256u] = th;
        }
        mv1_ss[lid] = u;
    }
    workgroupBarrier();
    if (local == 0u) {
        var t = vec4<f32>(0.0);
        var th = vec4<f32>(0.0);
        var u = 0.0;
        for (var i = 0u; i < n1; i++) {
            t += mv1_part[first + i];
            if (hi) {
                th += mv1_part[first + i + 256u];
            }
            u += mv1_ss[first + i];
        }
        mv1_part[lid] = t;
        if (hi) {
            mv1_part[lid + 256u] = th;
        }
        mv1_ss[lid] = u;
    }
}

// Sum q of the first thread of a set, after mv1_reduce.
fn mv1_get(lid: u32, q: u32) -> f32 {
    return mv1_part[lid + 256u * (q / 4u)][q % 4u];
}

// RMSNorm's factor (1 without NORM) for the first thread of a set, after mv1_reduce: the
// threads sharing these rows cover all of k, so their sum of squares is x's.
fn mv1_scale(lid: u32) -> f32 {
    return select(1.0, rstd(mv1_ss[lid]), NORM);
}

// X8_OUT (qmatvec1_x8): the outputs (after the residual or SwiGLU) also go into xq_out
// (binding 14) rounded for the next XQ8 product, times the next norm's weight (binding 5)
// with X8_OUT_NORM, which also stores the groups' squares. The host picks MV1_WG so that
// a workgroup makes 16 consecutive outputs (16 rows of W, 32 with SWIGLU): workgroup g
// rounds group g.
override X8_OUT: bool = false;
override X8_OUT_NORM: bool = false;
var<workgroup> x8_vals: array<f32, 16>;

// Stores the first thread of each set's outputs (the columns at.x.. of row r of x) into
// dst, and with X8_OUT (one row) into x8_vals.
fn mv1_store(g: u32, lid: u32, at: vec2<u32>, r: u32) {
    let wr = w_rows();
    if (at.y != 0u) {
        return;
    }
    let scale = mv1_scale(lid);
    for (var q = 0u; q < MV1_RW; q++) {
        let v = at.x + q;
        if (v < wr) {
            if (SWIGLU) {
                // v0 is a multiple of 4: gate (even v) and up (v + 1) are both here.
                if ((v & 1u) == 0u) {
                    let y = gate_act(mv1_get(lid, q) * scale) * (mv1_get(lid, q + 1u) * scale);
                    dst[r * p.n + v / 2u] = y;
                    if (X8_OUT) {
                        x8_vals[v / 2u - 16u * g] = y;
                    }
                }
            } else {
                let y = finish(r, v, mv1_get(lid, q) * scale);
                dst[r * p.n + v] = y;
                if (X8_OUT) {
                    x8_vals[v - 16u * g] = y;
                }
            }
        }
    }
}

// The sums of qmatvec1 and qmatvec1_rope, either path; returns mv1_at(g, lid).
fn mv1_sums(g: u32, lid: u32) -> vec2<u32> {
    let width = 32u * MV1_SPLIT;
    let at = mv1_at(g, lid);
    var a: Mv1Acc;
    if (XQ8) {
        a = mv1_sums_x8(at.x, at.y, width);
    } else {
        a = mv1_sums_f32(at.x, at.y, width);
    }
    mv1_reduce(lid, at.y, width, a);
    return at;
}

@compute @workgroup_size(256)
fn qmatvec1(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
            @builtin(local_invocation_index) lid: u32) {
    let g = wid.x + wid.y * nwg.x;
    let at = mv1_sums(g, lid);
    mv1_store(g, lid, at, 0u);
}

// qmatvec1 on x rounded (XQ8), with X8_OUT: only the bindings the XQ8 path reads, so that
// xq_out fits WebGPU's default of 8 storage buffers a stage.
@compute @workgroup_size(MV1_WG)
fn qmatvec1_x8(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
               @builtin(local_invocation_index) lid: u32) {
    let g = wid.x + wid.y * nwg.x;
    let width = 32u * MV1_SPLIT;
    let at = mv1_at(g, lid);
    mv1_reduce(lid, at.y, width, mv1_sums_x8(at.x, at.y, width));
    mv1_store(g, lid, at, 0u);
    if (X8_OUT) {
        workgroupBarrier();
        if (lid == 0u && 16u * g < p.n) {
            var v: array<vec4<f32>, 4>;
            var nwv: array<vec4<f32>, 4>;
            for (var e = 0u; e < 4u; e++) {
                let c = 16u * g + 4u * e;
                v[e] = vec4<f32>(x8_vals[4u * e], x8_vals[4u * e + 1u], x8_vals[4u * e + 2u], x8_vals[4u * e + 3u]);
                nwv[e] = vec4<f32>(1.0);
                if (X8_OUT_NORM) {
                    nwv[e] = vec4<f32>(nw[c], nw[c + 1u], nw[c + 2u], nw[c + 3u]);
                }
            }
            round_group(0u, p.n, g, v, nwv, X8_OUT_NORM);
        }
    }
}

// qmatvec1_x8 for up to MV1_X rows of x (2 .. 8: batched decode steps), x rounded
// (XQ8; rows of x8_row_words(k) words, a multiple of 4): each thread's 4 runs of W a pass
// are loaded and unpacked once (w_run_q8) and serve every row of x (dot_run_q8), so a
// weight is read once per MV1_X rows, not once a row. Sets of threads as qmatvec1's
// (MV1_SPLIT groups of 32 sharing 4 rows of W); then each row's sums are reduced and
// stored in turn (mv1_reduce, mv1_store). Grid: linear over (W's workgroups) x
// ceil(m / MV1_X) row groups. Same sums, in the same order, as qmatvec1_x8 gives a row.
override MV1_X: u32 = 1u;

struct MvxAcc {
    rows: array<vec4<f32>, 8>,
    ss: array<f32, 8>,
}

// Row r of x against a pass's 4 runs of W (at column c): the 4 dots, and the row's x^2
// there (NORM).
struct MvxRow {
    d: vec4<f32>,
    ss: f32,
}

fn mvx_row(w0: WRun, w1: WRun, w2: WRun, w3: WRun, r: u32, c: u32) -> MvxRow {
    let xa = xq8_row(r, c);
    let d = vec4<f32>(dot_run_q8(w0, xa), dot_run_q8(w1, xa), dot_run_q8(w2, xa), dot_run_q8(w3, xa));
    return MvxRow(d, xa.ss);
}

// The sums of rows r0 .. r0 + nr of x: one named accumulator a row (not an array indexed
// by the row, which the compiler may keep in memory); MV1_X (a constant) drops the rows
// past it.
fn mvx_sums(v0: u32, local: u32, width: u32, r0: u32, nr: u32) -> MvxAcc {
    var a: MvxAcc;
    let wr = w_rows();
    if (v0 >= wr) {
        return a;
    }
    var a0 = vec4<f32>(0.0);
    var a1 = vec4<f32>(0.0);
    var a2 = vec4<f32>(0.0);
    var a3 = vec4<f32>(0.0);
    var a4 = vec4<f32>(0.0);
    var a5 = vec4<f32>(0.0);
    var a6 = vec4<f32>(0.0);
    var a7 = vec4<f32>(0.0);
    var sa = vec4<f32>(0.0);   // x^2 of rows 0..4, and 4..8
    var sb = vec4<f32>(0.0);
    for (var c = local * 32u; c < p.k; c += 32u * width) {
        let w0 = w_run_q8(w_row(v0) * p.k + c);
        let w1 = w_run_q8(w_row(min(v0 + 1u, wr - 1u)) * p.k + c);
        let w2 = w_run_q8(w_row(min(v0 + 2u, wr - 1u)) * p.k + c);
        let w3 = w_run_q8(w_row(min(v0 + 3u, wr - 1u)) * p.k + c);
        let x0 = mvx_row(w0, w1, w2, w3, r0, c);
        a0 += x0.d;
        sa.x += x0.ss;
        if (MV1_X > 1u && nr > 1u) {
            let x = mvx_row(w0, w1, w2, w3, r0 + 1u, c);
            a1 += x.d;
            sa.y += x.ss;
        }
        if (MV1_X > 2u && nr > 2u) {
            let x = mvx_row(w0, w1, w2, w3, r0 + 2u, c);
            a2 += x.d;
            sa.z += x.ss;
        }
        if (MV1_X > 3u && nr > 3u) {
            let x = mvx_row(w0, w1, w2, w3, r0 + 3u, c);
            a3 += x.d;
            sa.w += x.ss;
        }
        if (MV1_X > 4u && nr > 4u) {
            let x = mvx_row(w0, w1, w2, w3, r0 + 4u, c);
            a4 += x.d;
            sb.x += x.ss;
        }
        if (MV1_X > 5u && nr > 5u) {
            let x = mvx_row(w0, w1, w2, w3, r0 + 5u, c);
            a5 += x.d;
            sb.y += x.ss;
        }
        if (MV1_X > 6u && nr > 6u) {
            let x = mvx_row(w0, w1, w2, w3, r0 + 6u, c);
            a6 += x.d;
            sb.z += x.ss;
        }
        if (MV1_X > 7u && nr > 7u) {
            let x = mvx_row(w0, w1, w2, w3, r0 + 7u, c);
            a7 += x.d;
            sb.w += x.ss;
        }
    }
    a.rows = array<vec4<f32>, 8>(a0, a1, a2, a3, a4, a5, a6, a7);
    a.ss = array<f32, 8>(sa.x, sa.y, sa.z, sa.w, sb.x, sb.y, sb.z, sb.w);
    return a;
}

@compute @workgroup_size(256)
fn qmatvec_x8rows(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                  @builtin(local_invocation_index) lid: u32) {
    let g = wid.x + wid.y * nwg.x;
    let width = 32u * MV1_SPLIT;
    let per = 256u / width * 4u;   // rows of W a workgroup
    let groups = (w_rows() + per - 1u) / per;
    let gw = g % groups;
    let r0 = (g / groups) * MV1_X;
    let nr = min(MV1_X, p.m - min(r0, p.m));
    let at = mv1_at(gw, lid);
    let a = mvx_sums(at.x, at.y, width, r0, nr);
    for (var r = 0u; r < MV1_X; r++) {
        if (r < nr) {
            mv1_reduce(lid, at.y, width, Mv1Acc(a.rows[r], vec4<f32>(0.0), a.ss[r]));
            mv1_store(gw, lid, at, r0 + r);
            workgroupBarrier();   // the sums read before the next row's go in
        }
    }
}

// qmatvec1 with ROPE: a thread's 4 columns are two pairs.
@compute @workgroup_size(256)
fn qmatvec1_rope(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                 @builtin(local_invocation_index) lid: u32) {
    let g = wid.x + wid.y * nwg.x;
    let at = mv1_sums(g, lid);
    if (at.y == 0u) {
        let scale = mv1_scale(lid);
        if (ROPE_HALF && ROPE_KV_F16) {
            // MV1_RW 4 (the default): a thread's 4 columns start at a multiple of 4.
            if (at.x < w_rows()) {
                let s = vec4<f32>(mv1_get(lid, 0u), mv1_get(lid, 1u), mv1_get(lid, 2u), mv1_get(lid, 3u));
                rope_out_half16(0u, p.pos, p.pos, at.x, s * scale);
            }
            return;
        }
        for (var q = 0u; q < MV1_RW; q += 2u) {
            if (at.x + q < w_rows()) {
                rope_out(0u, p.pos, p.pos, at.x + q, mv1_get(lid, q) * scale, mv1_get(lid, q + 1u) * scale);
            }
        }
    }
}

// x_half: rows of x into f16 for quant_coop.wgsl's product, a workgroup a row: y = x
// (NORM: times rsqrt(mean(x^2) + eps) and the norm weight), scaled by 2^-s, s >= 0 the
// least that brings the row's largest |y| under 2^15 (0 for any row f16 holds: y only
// rounded), xh = f16(y 2^-s) (xq_out: two halves a word, the lower first), dst[r] = 2^s
// (an inf or NaN row stays so). SCALE_UP (gradients, whose rows may be small enough for
// f16's subnormals): s may be negative too, down to -100, the row's largest |y| in
// [2^14, 2^15). k a multiple of 4. Grid: m workgroups (2-D past 65535).
override SCALE_UP: bool = false;
var<workgroup> xh_part: array<f32, 256>;

// Row r's values y, 4 at column c (NORM: times the factor f and the weight).
fn x_half_y(r: u32, c: u32, f: f32) -> vec4<f32> {
    let v = xv4[(r * p.k + c) / 4u];
    if (NORM) {
        return v * f * nwv4[c / 4u];
    }
    return v;
}

// The 256 threads' partials summed (or with MAX their largest) in a fixed tree.
fn x_half_reduce(lid: u32, v: f32, take_max: bool) -> f32 {
    xh_part[lid] = v;
    workgroupBarrier();
    for (var s = 128u; s > 0u; s >>= 1u) {
        if (lid < s) {
            let o = xh_part[lid + s];
            xh_part[lid] = select(xh_part[lid] + o, max(xh_part[lid], o), take_max);
        }
        workgroupBarrier();
    }
    let t = xh_part[0];
    workgroupBarrier();
    return t;
}

// The power of two s >= lo (at most 125) that brings a row whose largest |y| is `top`
// under 2^15 (y 2^-s): e + 1 - 15 for top's exponent e.
fn half_shift(top: f32, lo: i32) -> i32 {
    let e = i32((bitcast<u32>(top) >> 23u) & 0xffu) - 127;
    return clamp(e - 14, lo, 125);
}

// Four values of row r from column c (a multiple of 4) as two words of f16 halves.
fn put_halves(r: u32, c: u32, v: vec4<f32>) {
    let o = (r * p.k + c) / 2u;
    xq_out[o] = pack2x16float(v.xy);
    xq_out[o + 1u] = pack2x16float(v.zw);
}

@compute @workgroup_size(256)
fn x_half(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
          @builtin(local_invocation_index) lid: u32) {
    let r = wid.x + wid.y * nwg.x;
    if (r >= p.m) {
        return;
    }
    var f = 1.0;
    if (NORM) {
        var ss = 0.0;
        for (var c = lid * 4u; c < p.k; c += 1024u) {
            let v = xv4[(r * p.k + c) / 4u];
            ss += dot(v, v);
        }
        f = rstd(x_half_reduce(lid, ss, false));
    }
    var big = 0.0;
    for (var c = lid * 4u; c < p.k; c += 1024u) {
        let a = abs(x_half_y(r, c, f));
        big = max(big, max(max(a.x, a.y), max(a.z, a.w)));
    }
    let s = half_shift(x_half_reduce(lid, big, true), select(0, -100, SCALE_UP));
    let down = exp2(f32(-s));
    for (var c = lid * 4u; c < p.k; c += 1024u) {
        put_halves(r, c, x_half_y(r, c, f) * down);
    }
    if (lid == 0u) {
        dst[r] = exp2(f32(s));
    }
}

// x_half_sum: a cooperative product's split-K sum with its residual (splitk_sum with
// RESIDUAL) and that row into f16 for the next product (x_half with NORM) in one pass, a
// workgroup a row: y = res + the SPLITK partials (xv4: (p.splits, m, k) as vec4s) in
// slice order, stored to y_out; then y times rsqrt(mean(y^2) + eps) and the norm weight,
// scaled and rounded as x_half does (the factor to dst, the halves to xq_out). The same
// arithmetic in the same order as splitk_sum then x_half: the same bits. (Its own loops:
// a function reading y_out would bind it for x_half too.) Grid: m workgroups (2-D past
// 65535).
@group(0) @binding(15) var<storage, read_write> y_out: array<vec4<f32>>;

@compute @workgroup_size(256)
fn x_half_sum(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
              @builtin(local_invocation_index) lid: u32) {
    let r = wid.x + wid.y * nwg.x;
    if (r >= p.m) {
        return;
    }
    let mk4 = p.m * p.k / 4u;
    var ss = 0.0;
    for (var c = lid * 4u; c < p.k; c += 1024u) {
        let i = r * p.k + c;
        var acc = vec4<f32>(0.0);
        for (var z = 0u; z < p.splits; z++) {
            acc += xv4[z * mk4 + i / 4u];
        }
        let y = vec4<f32>(res[i], res[i + 1u], res[i + 2u], res[i + 3u]) + acc;
        y_out[i / 4u] = y;   // (read back below by this thread alone)
        ss += dot(y, y);
    }
    let f = rstd(x_half_reduce(lid, ss, false));
    var big = 0.0;
    for (var c = lid * 4u; c < p.k; c += 1024u) {
        let a = abs(y_out[(r * p.k + c) / 4u] * f * nwv4[c / 4u]);
        big = max(big, max(max(a.x, a.y), max(a.z, a.w)));
    }
    let s = half_shift(x_half_reduce(lid, big, true), 0);
    let down = exp2(f32(-s));
    for (var c = lid * 4u; c < p.k; c += 1024u) {
        put_halves(r, c, y_out[(r * p.k + c) / 4u] * f * nwv4[c / 4u] * down);
    }
    if (lid == 0u) {
        dst[r] = exp2(f32(s));
    }
}

// glu_half: glu_rows then x_half without NORM in one pass, a workgroup a row: g =
// act(gate) * up from x (m, 2n), the cooperative product's [gate | up] row (as glu_rows
// reads it, summing p.splits partials where split: gu_at; n is p.k here), stored to y_out; then g scaled and rounded to f16 as x_half
// makes it (the factor to dst, the halves to xq_out) for the product that takes g (the
// down product). The same arithmetic in the same order as glu_rows then x_half: the
// same bits. n a multiple of 4. Grid: m workgroups (2-D past 65535).
@compute @workgroup_size(256)
fn glu_half(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
            @builtin(local_invocation_index) lid: u32) {
    let r = wid.x + wid.y * nwg.x;
    if (r >= p.m) {
        return;
    }
    var big = 0.0;
    for (var c = lid * 4u; c < p.k; c += 1024u) {
        let gi = 2u * r * p.k + c;   // gate's columns; up's are p.k further
        let ui = gi + p.k;
        let n = p.k;
        let g = vec4<f32>(gate_act(gu_at(gi, n)) * gu_at(ui, n),
                          gate_act(gu_at(gi + 1u, n)) * gu_at(ui + 1u, n),
                          gate_act(gu_at(gi + 2u, n)) * gu_at(ui + 2u, n),
                          gate_act(gu_at(gi + 3u, n)) * gu_at(ui + 3u, n));
        y_out[(r * p.k + c) / 4u] = g;   // (read back below by this thread alone)
        let a = abs(g);
        big = max(big, max(max(a.x, a.y), max(a.z, a.w)));
    }
    let s = half_shift(x_half_reduce(lid, big, true), 0);
    let down = exp2(f32(-s));
    for (var c = lid * 4u; c < p.k; c += 1024u) {
        put_halves(r, c, y_out[(r * p.k + c) / 4u] * down);
    }
    if (lid == 0u) {
        dst[r] = exp2(f32(s));
    }
}

const MM_T: u32 = 64u;
const MM_BK: u32 = 16u;
var<workgroup> mm_x: array<array<f32, 64>, 16>;   // [k][row of x]
var<workgroup> mm_w: array<array<f32, 64>, 16>;   // [k][row of W]
var<workgroup> mm_red: array<f32, 256>;
var<workgroup> mm_rstd: array<f32, 64>;

// SPLITK (no NORM or SWIGLU): workgroup z of p.splits sums slice z of k and stores its
// partial tile to dst (p.splits, m, n) for splitk_sum: more workgroups for products with
// few output tiles (SmolLM2's o and down over a prompt).
override SPLITK: bool = false;

// Columns of k that SPLITK's slice z covers: [x, y).
fn k_slice(z: u32) -> vec2<u32> {
    if (!SPLITK) {
        return vec2<u32>(0u, p.k);
    }
    let per = (p.k + p.splits * MM_BK - 1u) / (p.splits * MM_BK) * MM_BK;
    return vec2<u32>(min(p.k, z * per), min(p.k, (z + 1u) * per));
}

// Grid: (ceil(n / 64), ceil(m / 64), splits).
@compute @workgroup_size(256)
fn qmatmul(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let col0 = wid.x * MM_T;   // first row of W (output column)
    let row0 = wid.y * MM_T;   // first row of x
    let ks = k_slice(wid.z);
    let tx = lid % 16u;
    let ty = lid / 16u;
    // Accumulators as named vectors (constant indices keep them in registers).
    var acc0 = vec4<f32>(0.0);
    var acc1 = vec4<f32>(0.0);
    var acc2 = vec4<f32>(0.0);
    var acc3 = vec4<f32>(0.0);
    let wr = w_rows();
    var ss = 0.0;   // NORM: sum of x^2 over this thread's columns of its row
    for (var c0 = ks.x; c0 < ks.y; c0 += MM_BK) {
        // 1024 values of each tile, 4 consecutive k of one row a thread.
        let rr = lid / 4u;
        let kq = (lid % 4u) * 4u;
        let c = c0 + kq;
        var xv = vec4<f32>(0.0);
        var wv = vec4<f32>(0.0);
        if (p.k % 4u == 0u) {
            if (c < ks.y && row0 + rr < p.m) {
                xv = x4(row0 + rr, c);
                if (NORM) {
                    ss += dot(xv, xv);
                    xv *= nw4(c);
                }
            }
            if (c < ks.y && col0 + rr < wr) {
                wv = value4(w_row(col0 + rr) * p.k + c);
            }
        } else {
            for (var e = 0u; e < 4u; e++) {
                if (c + e < ks.y && row0 + rr < p.m) {
                    xv[e] = x[(row0 + rr) * p.k + c + e];
                    if (NORM) {
                        ss += xv[e] * xv[e];
                        xv[e] *= nw[c + e];
                    }
                }
                if (c + e < ks.y && col0 + rr < wr) {
                    wv[e] = value(w_row(col0 + rr) * p.k + c + e);
                }
            }
        }
        for (var e = 0u; e < 4u; e++) {
            mm_x[kq + e][rr] = xv[e];
            mm_w[kq + e][rr] = wv[e];
        }
        workgroupBarrier();
        for (var kk = 0u; kk < MM_BK; kk++) {
            let a = vec4<f32>(mm_x[kk][ty * 4u], mm_x[kk][ty * 4u + 1u], mm_x[kk][ty * 4u + 2u], mm_x[kk][ty * 4u + 3u]);
            let b = vec4<f32>(mm_w[kk][tx * 4u], mm_w[kk][tx * 4u + 1u], mm_w[kk][tx * 4u + 2u], mm_w[kk][tx * 4u + 3u]);
            acc0 += a.x * b;
            acc1 += a.y * b;
            acc2 += a.z * b;
            acc3 += a.w * b;
        }
        workgroupBarrier();
    }
    if (NORM) {
        // Row rr's x^2 sums sit with threads 4 rr .. 4 rr + 3: added in that order.
        mm_red[lid] = ss;
        workgroupBarrier();
        if (lid < 64u) {
            let t = ((mm_red[4u * lid] + mm_red[4u * lid + 1u]) + mm_red[4u * lid + 2u]) + mm_red[4u * lid + 3u];
            mm_rstd[lid] = rstd(t);
        }
        workgroupBarrier();
    }
    let accs = array<vec4<f32>, 4>(acc0, acc1, acc2, acc3);
    for (var i = 0u; i < 4u; i++) {
        let r = row0 + ty * 4u + i;
        var v = accs[i];
        if (NORM) {
            v *= mm_rstd[ty * 4u + i];
        }
        if (SWIGLU) {
            // Columns (2u, 2u + 1) are (gate, up) of output u.
            for (var jj = 0u; jj < 4u; jj += 2u) {
                let u = (col0 + tx * 4u + jj) / 2u;
                if (r < p.m && u < p.n) {
                    dst[r * p.n + u] = gate_act(v[jj]) * v[jj + 1u];
                }
            }
        } else {
            for (var jj = 0u; jj < 4u; jj++) {
                let j = col0 + tx * 4u + jj;
                if (r < p.m && j < p.n) {
                    if (SPLITK) {
                        dst[(wid.z * p.m + r) * p.n + j] = v[jj];
                    } else {
                        dst[r * p.n + j] = finish(r, j, v[jj]);
                    }
                }
            }
        }
    }
}

// dst (m, k) = x (m, n) @ W (n, k): the product with W as stored, not transposed (the
// backward of qmatmul: dX = dY W, for fine-tuning through a frozen quantized weight),
// reading the blocks as qmatmul does. 64 x 64 output tiles (rows of x, columns of W), n
// in slabs of 16: x's 64 x 16 and W's 16 x 64 (dequantized on the way: 4 consecutive
// columns of one row a thread) staged in workgroup memory, 4 x 4 outputs a thread. x's
// rows are p.d long (x may be a wider matrix: a split table's columns from p.pos); with
// RESIDUAL dst = res + the product (a split table's parts summed in order). Sums over n
// in order: the same bits on every run. Grid: (ceil(k / 64), ceil(m / 64)).
@compute @workgroup_size(256)
fn qmatmul_t(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let col0 = wid.x * MM_T;   // first column of W (output column)
    let row0 = wid.y * MM_T;   // first row of x
    let tx = lid % 16u;
    let ty = lid / 16u;
    var acc0 = vec4<f32>(0.0);
    var acc1 = vec4<f32>(0.0);
    var acc2 = vec4<f32>(0.0);
    var acc3 = vec4<f32>(0.0);
    let rr = lid / 4u;           // x: row rr of the tile, n from kq
    let kq = (lid % 4u) * 4u;
    let wn = lid / 16u;          // W: row wn of the slab, columns from wc
    let wc = (lid % 16u) * 4u;
    for (var n0 = 0u; n0 < p.n; n0 += MM_BK) {
        for (var e = 0u; e < 4u; e++) {
            let nn = n0 + kq + e;
            var xv = 0.0;
            if (nn < p.n && row0 + rr < p.m) {
                xv = x[(row0 + rr) * p.d + p.pos + nn];
            }
            mm_x[kq + e][rr] = xv;
        }
        let wr = n0 + wn;
        let c = col0 + wc;
        var wv = vec4<f32>(0.0);
        if (wr < p.n) {
            if (p.k % 4u == 0u) {
                if (c < p.k) {
                    wv = value4(wr * p.k + c);
                }
            } else {
                for (var e = 0u; e < 4u; e++) {
                    if (c + e < p.k) {
                        wv[e] = value(wr * p.k + c + e);
                    }
                }
            }
        }
        for (var e = 0u; e < 4u; e++) {
            mm_w[wn][wc + e] = wv[e];
        }
        workgroupBarrier();
        for (var kk = 0u; kk < MM_BK; kk++) {
            let a = vec4<f32>(mm_x[kk][ty * 4u], mm_x[kk][ty * 4u + 1u], mm_x[kk][ty * 4u + 2u], mm_x[kk][ty * 4u + 3u]);
            let b = vec4<f32>(mm_w[kk][tx * 4u], mm_w[kk][tx * 4u + 1u], mm_w[kk][tx * 4u + 2u], mm_w[kk][tx * 4u + 3u]);
            acc0 += a.x * b;
            acc1 += a.y * b;
            acc2 += a.z * b;
            acc3 += a.w * b;
        }
        workgroupBarrier();
    }
    let accs = array<vec4<f32>, 4>(acc0, acc1, acc2, acc3);
    for (var i = 0u; i < 4u; i++) {
        let r = row0 + ty * 4u + i;
        for (var jj = 0u; jj < 4u; jj++) {
            let j = col0 + tx * 4u + jj;
            if (r < p.m && j < p.k) {
                let at = r * p.k + j;
                dst[at] = select(accs[i][jj], res[at] + accs[i][jj], RESIDUAL);
            }
        }
    }
}

// dst[r, j] = act(x[r, j]) * x[r, n + j] (quant_blocks.wgsl's gate_act: silu, or GEGLU's
// gelu), x (m, 2n) the product with W's 2n rows [gate; up]: the cooperative product's
// SwiGLU / GeGLU, done after it (its tiles go straight to x, or p.splits partial tiles
// summed here: gu_at). i < m n; cover m n, 256 a workgroup.
@compute @workgroup_size(256)
fn glu_rows(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
            @builtin(local_invocation_index) lid: u32) {
    let i = (wid.x + wid.y * nwg.x) * 256u + lid;
    if (i >= p.m * p.n) {
        return;
    }
    let r = i / p.n;
    let j = i % p.n;
    let gi = 2u * r * p.n + j;
    dst[i] = gate_act(gu_at(gi, p.n)) * gu_at(gi + p.n, p.n);
}

// Element i of the cooperative product's [gate | up] rows (m, 2n) in x: summed over its
// p.splits SPLITK partials (splits, m, 2n) in slice order as splitk_sum sums them, where
// there are more than one (glu_rows and glu_half with a split gate/up product).
fn gu_at(i: u32, n: u32) -> f32 {
    if (p.splits <= 1u) {
        return x[i];
    }
    let mn = 2u * p.m * n;
    var acc = 0.0;
    for (var z = 0u; z < p.splits; z++) {
        acc += x[z * mn + i];
    }
    return acc;
}

// dst[i] = (res[i] +) the sum of qmatmul's SPLITK partials x (p.splits, m, n) in slice
// order, i < m n. Cover m n, 256 a workgroup.
@compute @workgroup_size(256)
fn splitk_sum(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
              @builtin(local_invocation_index) lid: u32) {
    let i = (wid.x + wid.y * nwg.x) * 256u + lid;
    let mn = p.m * p.n;
    if (i >= mn) {
        return;
    }
    var acc = 0.0;
    for (var z = 0u; z < p.splits; z++) {
        acc += x[z * mn + i];
    }
    dst[i] = finish(i / p.n, i % p.n, acc);
}
