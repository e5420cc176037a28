// Dequantization of GGUF tensor types to f32, one thread per element (each re-reads its
// block's scales; the reads hit cache). Block layouts as ggml's (see reference/quant.rs):
//   Q4_0 (32: d, 16 B nibbles)   Q4_1 (32: d, m, 16 B)   Q5_0 (32: d, qh u32, 16 B)
//   Q5_1 (32: d, m, qh, 16 B)    Q8_0 (32: d, 32 i8)
//   Q4_K (256: d, dmin, 12 B 6-bit scales/mins, 128 B nibbles)
//   Q5_K (256: d, dmin, 12 B scales, 32 B fifth bits, 128 B nibbles)
//   Q6_K (256: 128 B low nibbles, 64 B 2-bit highs, 16 i8 scales, d)
//   F16, BF16, F32: one value each.
// The raw bytes arrive as u32 words (little-endian); blocks need not be word-aligned.
//
// Kernels (element i of a matrix W (N, K) stored row-major in blocks is value(n * K + k);
// GGUF rows are whole blocks):
//   dequantize   dst[i] = value(i), i < n                       cover n, 256 a workgroup
//   get_rows     dst[r, c] = value(ids[r] * k + c), r < m       cover m * k, 256 a workgroup
//   qmatvec      y[r, j] = sum_c x[r, c] * value(j * k + c)     (n / 8) * (m / 8) groups:
//                8 rows of W x 8 rows of x a workgroup, 32 threads a row of W striding over
//                k, then a fixed tree (a row's sum does not depend on m)
//   qmatmul      the same product for many rows of x: 64 x 64 output tiles, k in slabs of
//                16 staged (W dequantized on the way) in workgroup memory, 4 x 4 a thread
// Both read 4 consecutive elements at a time (value4) when k is a multiple of 4.
// Sums run in a fixed order: the same inputs give the same bits.

struct Params {
    n: u32,    // elements (dequantize); rows of W = outputs per row of x (products)
    m: u32,    // rows of x / ids
    k: u32,    // row length
    _pad: u32,
}

override TYPE: u32 = 2u;   // ggml type id

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> src: array<u32>;
@group(0) @binding(2) var<storage, read_write> dst: array<f32>;
@group(0) @binding(3) var<storage, read> x: array<f32>;
@group(0) @binding(4) var<storage, read> ids: array<u32>;

fn byte(i: u32) -> u32 {
    return (src[i >> 2u] >> ((i & 3u) * 8u)) & 0xFFu;
}

fn half(i: u32) -> f32 {
    return unpack2x16float(byte(i) | (byte(i + 1u) << 8u)).x;
}

fn signed8(i: u32) -> f32 {
    return f32(bitcast<i32>(byte(i) << 24u) >> 24u);
}

fn word(i: u32) -> u32 {
    return byte(i) | (byte(i + 1u) << 8u) | (byte(i + 2u) << 16u) | (byte(i + 3u) << 24u);
}

// Nibble of element j (0..32) of a 32-element block whose 16 bytes start at q.
fn nibble32(q: u32, j: u32) -> u32 {
    let b = byte(q + j % 16u);
    return select(b & 0xFu, b >> 4u, j >= 16u);
}

// Fifth bit (as 0 or 16) of element j of a Q5_0 / Q5_1 block.
fn fifth(qh: u32, j: u32) -> u32 {
    return select(((qh >> j) << 4u) & 0x10u, (qh >> (j % 16u + 12u)) & 0x10u, j >= 16u);
}

// (scale, min) of K-quant sub-block s (0..8) from the 12 packed bytes at q.
fn scale_min(q: u32, s: u32) -> vec2<f32> {
    if (s < 4u) {
        return vec2<f32>(f32(byte(q + s) & 63u), f32(byte(q + s + 4u) & 63u));
    }
    let sc = (byte(q + s + 4u) & 0xFu) | ((byte(q + s - 4u) >> 6u) << 4u);
    let m = (byte(q + s + 4u) >> 4u) | ((byte(q + s) >> 6u) << 4u);
    return vec2<f32>(f32(sc), f32(m));
}

fn value(i: u32) -> f32 {
    switch (TYPE) {
        case 0u: { return bitcast<f32>(src[i]); }
        case 1u: { return half(2u * i); }
        case 30u: { return bitcast<f32>((byte(2u * i) | (byte(2u * i + 1u) << 8u)) << 16u); }
        case 2u: {
            let b = (i / 32u) * 18u;
            return (f32(nibble32(b + 2u, i % 32u)) - 8.0) * half(b);
        }
        case 3u: {
            let b = (i / 32u) * 20u;
            return f32(nibble32(b + 4u, i % 32u)) * half(b) + half(b + 2u);
        }
        case 6u: {
            let b = (i / 32u) * 22u;
            let j = i % 32u;
            return (f32(nibble32(b + 6u, j) | fifth(word(b + 2u), j)) - 16.0) * half(b);
        }
        case 7u: {
            let b = (i / 32u) * 24u;
            let j = i % 32u;
            return f32(nibble32(b + 8u, j) | fifth(word(b + 4u), j)) * half(b) + half(b + 2u);
        }
        case 8u: {
            let b = (i / 32u) * 34u;
            return signed8(b + 2u + i % 32u) * half(b);
        }
        case 12u, 13u: {
            let k5 = TYPE == 13u;
            let b = (i / 256u) * select(144u, 176u, k5);
            let j = i % 256u;
            let c = j / 64u;             // pair of 32-element sub-blocks
            let hi = (j % 64u) >= 32u;   // second of the pair: high nibbles
            let l = j % 32u;
            let sm = scale_min(b + 4u, 2u * c + select(0u, 1u, hi));
            let qb = byte(b + select(16u, 48u, k5) + 32u * c + l);
            var q = select(qb & 0xFu, qb >> 4u, hi);
            if (k5 && ((byte(b + 16u + l) >> (2u * c + select(0u, 1u, hi))) & 1u) != 0u) {
                q += 16u;
            }
            return half(b) * sm.x * f32(q) - half(b + 2u) * sm.y;
        }
        case 14u: {
            let b = (i / 256u) * 210u;
            let j = i % 256u;
            let n = j / 128u;
            let run = (j % 128u) / 32u;
            let l = j % 32u;
            let ql = byte(b + 64u * n + l + 32u * (run & 1u));
            let qh = byte(b + 128u + 32u * n + l);
            let lo = select(ql & 0xFu, ql >> 4u, run >= 2u);
            let q = i32(lo | (((qh >> (2u * run)) & 3u) << 4u)) - 32;
            return half(b + 208u) * signed8(b + 192u + 8u * n + l / 16u + 2u * run) * f32(q);
        }
        default: { return 0.0; }
    }
}

// Word at any byte offset (two loads when unaligned).
fn word_at(i: u32) -> u32 {
    let w = i >> 2u;
    let sh = (i & 3u) * 8u;
    if (sh == 0u) {
        return src[w];
    }
    return (src[w] >> sh) | (src[w + 1u] << (32u - sh));
}

fn nibbles4(w: u32, high: bool) -> vec4<f32> {
    let v = select(w, w >> 4u, high);
    return vec4<f32>(f32(v & 0xFu), f32((v >> 8u) & 0xFu), f32((v >> 16u) & 0xFu), f32((v >> 24u) & 0xFu));
}

// Elements i..i+4 (i a multiple of 4, all in one block): one word of quants and one of
// scales where the layout allows, else four calls of value().
fn value4(i: u32) -> vec4<f32> {
    switch (TYPE) {
        case 0u: { return vec4<f32>(bitcast<f32>(src[i]), bitcast<f32>(src[i + 1u]), bitcast<f32>(src[i + 2u]), bitcast<f32>(src[i + 3u])); }
        case 1u: {
            let w = i >> 1u;
            return vec4<f32>(unpack2x16float(src[w]), unpack2x16float(src[w + 1u]));
        }
        case 2u: {
            let b = (i / 32u) * 18u;
            let j = i % 32u;
            return (nibbles4(word_at(b + 2u + j % 16u), j >= 16u) - 8.0) * half(b);
        }
        case 3u: {
            let b = (i / 32u) * 20u;   // word-aligned blocks
            let j = i % 32u;
            let dm = unpack2x16float(src[b >> 2u]);
            return nibbles4(src[(b + 4u + j % 16u) >> 2u], j >= 16u) * dm.x + dm.y;
        }
        case 8u: {
            let b = (i / 32u) * 34u;
            let w = bitcast<i32>(word_at(b + 2u + i % 32u));
            let q = vec4<f32>(f32((w << 24u) >> 24u), f32((w << 16u) >> 24u), f32((w << 8u) >> 24u), f32(w >> 24u));
            return q * half(b);
        }
        default: { return vec4<f32>(value(i), value(i + 1u), value(i + 2u), value(i + 3u)); }
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

@compute @workgroup_size(256)
fn get_rows(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
            @builtin(local_invocation_index) lid: u32) {
    let i = (wid.x + wid.y * nwg.x) * 256u + lid;
    if (i >= p.m * p.k) {
        return;
    }
    let r = i / p.k;
    let id = ids[r];
    // ids are checked on the host; an id past the table reads as zeros.
    dst[i] = select(0.0, value(id * p.k + i % p.k), id < p.n);
}

const MV_ROWS: u32 = 8u;   // rows of W a workgroup (32 threads each)
const MV_X: u32 = 8u;      // rows of x a workgroup: each W value read once serves them all
var<workgroup> mv_part: array<array<f32, 256>, 8>;

fn x4(r: u32, c: u32) -> vec4<f32> {
    let b = r * p.k + c;
    return vec4<f32>(x[b], x[b + 1u], x[b + 2u], x[b + 3u]);
}

@compute @workgroup_size(256)
fn qmatvec(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
           @builtin(local_invocation_index) lid: u32) {
    let g = wid.x + wid.y * nwg.x;
    let per_row = (p.n + MV_ROWS - 1u) / MV_ROWS;
    let r0 = (g / per_row) * MV_X;               // first row of x
    let j = (g % per_row) * MV_ROWS + lid / 32u;  // row of W
    let lane = lid % 32u;
    let nr = min(MV_X, p.m - min(r0, p.m));
    var acc: array<f32, 8>;
    if (nr > 0u && j < p.n) {
        let wbase = j * p.k;
        if (p.k % 4u == 0u) {
            for (var c = lane * 4u; c < p.k; c += 128u) {
                let w = value4(wbase + c);
                for (var r = 0u; r < nr; r++) {
                    acc[r] += dot(x4(r0 + r, c), w);
                }
            }
        } else {
            for (var c = lane; c < p.k; c += 32u) {
                let w = value(wbase + c);
                for (var r = 0u; r < nr; r++) {
                    acc[r] += x[(r0 + r) * p.k + c] * w;
                }
            }
        }
    }
    for (var r = 0u; r < MV_X; r++) {
        mv_part[r][lid] = acc[r];
    }
    workgroupBarrier();
    for (var s = 16u; s > 0u; s >>= 1u) {
        if (lane < s) {
            for (var r = 0u; r < MV_X; r++) {
                mv_part[r][lid] += mv_part[r][lid + s];
            }
        }
        workgroupBarrier();
    }
    if (lane == 0u && j < p.n) {
        for (var r = 0u; r < nr; r++) {
            dst[(r0 + r) * p.n + j] = mv_part[r][lid];
        }
    }
}

const MM_T: u32 = 64u;
const MM_BK: u32 = 16u;
var<workgroup> mm_x: array<array<f32, 64>, 16>;   // [k][row of x]
var<workgroup> mm_w: array<array<f32, 64>, 16>;   // [k][row of W]

// Grid: (ceil(n / 64), ceil(m / 64)).
@compute @workgroup_size(256)
fn qmatmul(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let col0 = wid.x * MM_T;   // first row of W (output column)
    let row0 = wid.y * MM_T;   // first row of x
    let tx = lid % 16u;
    let ty = lid / 16u;
    var acc: array<array<f32, 4>, 4>;
    for (var c0 = 0u; c0 < p.k; c0 += MM_BK) {
        // 1024 values of each tile, 4 consecutive k of one row a thread.
        let rr = lid / 4u;
        let kq = (lid % 4u) * 4u;
        let c = c0 + kq;
        var xv = vec4<f32>(0.0);
        var wv = vec4<f32>(0.0);
        if (p.k % 4u == 0u) {
            if (c < p.k && row0 + rr < p.m) {
                let xb = (row0 + rr) * p.k + c;
                xv = vec4<f32>(x[xb], x[xb + 1u], x[xb + 2u], x[xb + 3u]);
            }
            if (c < p.k && col0 + rr < p.n) {
                wv = value4((col0 + rr) * p.k + c);
            }
        } else {
            for (var e = 0u; e < 4u; e++) {
                if (c + e < p.k && row0 + rr < p.m) {
                    xv[e] = x[(row0 + rr) * p.k + c + e];
                }
                if (c + e < p.k && col0 + rr < p.n) {
                    wv[e] = value((col0 + rr) * p.k + c + e);
                }
            }
        }
        for (var e = 0u; e < 4u; e++) {
            mm_x[kq + e][rr] = xv[e];
            mm_w[kq + e][rr] = wv[e];
        }
        workgroupBarrier();
        for (var kk = 0u; kk < MM_BK; kk++) {
            var a: array<f32, 4>;
            var b: array<f32, 4>;
            for (var i = 0u; i < 4u; i++) {
                a[i] = mm_x[kk][ty * 4u + i];
                b[i] = mm_w[kk][tx * 4u + i];
            }
            for (var i = 0u; i < 4u; i++) {
                for (var jj = 0u; jj < 4u; jj++) {
                    acc[i][jj] += a[i] * b[jj];
                }
            }
        }
        workgroupBarrier();
    }
    for (var i = 0u; i < 4u; i++) {
        let r = row0 + ty * 4u + i;
        for (var jj = 0u; jj < 4u; jj++) {
            let j = col0 + tx * 4u + jj;
            if (r < p.m && j < p.n) {
                dst[r * p.n + j] = acc[i][jj];
            }
        }
    }
}
