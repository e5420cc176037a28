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
//   qmatvec      y[r, j] = sum_c x[r, c] * value(j * k + c)     (n / 8) * m workgroups:
//                8 outputs a workgroup, 32 threads each striding over k, then a fixed tree
//   qmatmul      the same product for many rows of x: 64 x 64 output tiles, k in slabs of
//                16 staged (W dequantized on the way) in workgroup memory, 4 x 4 a thread
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

const MV_ROWS: u32 = 8u;
var<workgroup> mv_part: array<f32, 256>;

@compute @workgroup_size(256)
fn qmatvec(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
           @builtin(local_invocation_index) lid: u32) {
    let g = wid.x + wid.y * nwg.x;
    let per_row = (p.n + MV_ROWS - 1u) / MV_ROWS;
    let r = g / per_row;                       // row of x
    let j = (g % per_row) * MV_ROWS + lid / 32u; // row of W
    let lane = lid % 32u;
    var acc = 0.0;
    if (r < p.m && j < p.n) {
        let wbase = j * p.k;
        let xbase = r * p.k;
        for (var c = lane; c < p.k; c += 32u) {
            acc += x[xbase + c] * value(wbase + c);
        }
    }
    mv_part[lid] = acc;
    workgroupBarrier();
    for (var s = 16u; s > 0u; s >>= 1u) {
        if (lane < s) {
            mv_part[lid] += mv_part[lid + s];
        }
        workgroupBarrier();
    }
    if (lane == 0u && r < p.m && j < p.n) {
        dst[r * p.n + j] = mv_part[lid];
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
        // 1024 values of each tile, 4 a thread: element e = lid + 256 * q, (row e / 16, k e % 16).
        for (var q = 0u; q < 4u; q++) {
            let e = lid + 256u * q;
            let rr = e / MM_BK;
            let kk = e % MM_BK;
            let c = c0 + kk;
            var xv = 0.0;
            var wv = 0.0;
            if (c < p.k) {
                if (row0 + rr < p.m) {
                    xv = x[(row0 + rr) * p.k + c];
                }
                if (col0 + rr < p.n) {
                    wv = value((col0 + rr) * p.k + c);
                }
            }
            mm_x[kk][rr] = xv;
            mm_w[kk][rr] = wv;
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
