// Dequantization of GGUF tensor types to f32, one thread per element (each re-reads its
// block's scales; the reads hit cache). Block layouts as ggml's (see reference/quant.rs):
//   Q4_0 (32: d, 16 B nibbles)   Q4_1 (32: d, m, 16 B)   Q5_0 (32: d, qh u32, 16 B)
//   Q5_1 (32: d, m, qh, 16 B)    Q8_0 (32: d, 32 i8)
//   Q4_K (256: d, dmin, 12 B 6-bit scales/mins, 128 B nibbles)
//   Q5_K (256: d, dmin, 12 B scales, 32 B fifth bits, 128 B nibbles)
//   Q6_K (256: 128 B low nibbles, 64 B 2-bit highs, 16 i8 scales, d)
//   F16, BF16, F32: one value each.
// The raw bytes arrive as u32 words (little-endian); blocks need not be word-aligned.
// Grid: cover n threads, 256 per workgroup (2-D past 65535).

struct Params {
    n: u32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

override TYPE: u32 = 2u;   // ggml type id

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> src: array<u32>;
@group(0) @binding(2) var<storage, read_write> dst: array<f32>;

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
