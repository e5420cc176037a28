// GGUF block decoding shared by quant.wgsl and quant_coop.wgsl (prepended to both:
// crate::shaders). Block layouts as ggml's (see reference/quant.rs and quant.wgsl's
// header); W's blocks arrive as u32 words (binding 1), little-endian; blocks need not be
// word-aligned. value(i) is element i of the row-major matrix, value4(i) elements i..i+4
// (i a multiple of 4, all in one block). TYPE: the ggml type id. Also the gated
// activation of both files' SwiGLU/GeGLU products (gate_act).

override TYPE: u32 = 2u;   // ggml type id
const Q6K_BYTES: u32 = 224u;   // a Q6_K block on the GPU (210 bytes and 14 of padding)

@group(0) @binding(1) var<storage, read> src: array<u32>;

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
            let b = (i / 256u) * Q6K_BYTES;
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

// The 4 bytes of a word, lowest first.
fn bytes4(v: u32) -> vec4<u32> {
    return vec4<u32>(v & 0xFFu, (v >> 8u) & 0xFFu, (v >> 16u) & 0xFFu, v >> 24u);
}

// f32(u) for u < 2^23, exactly, without integer-to-float conversions (a quarter of the
// float rate on some GPUs): u's bits under the exponent of 2^23, minus 2^23.
fn u2f4(u: vec4<u32>) -> vec4<f32> {
    return bitcast<vec4<f32>>(u | vec4<u32>(0x4B000000u)) - 8388608.0;
}

fn nibbles4(w: u32, high: bool) -> vec4<f32> {
    return u2f4(bytes4(select(w, w >> 4u, high) & 0x0F0F0F0Fu));
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
        case 30u: {
            // Two bf16 a word, the lower first: the f32 with those 16 high bits.
            let w = i >> 1u;
            let a = src[w];
            let b = src[w + 1u];
            return bitcast<vec4<f32>>(vec4<u32>(a << 16u, a & 0xFFFF0000u, b << 16u, b & 0xFFFF0000u));
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
        case 12u, 13u: {
            let k5 = TYPE == 13u;
            let b = (i / 256u) * select(144u, 176u, k5);   // word-aligned blocks
            let j = i % 256u;
            let c = j / 64u;
            let hi = (j % 64u) >= 32u;
            let l = j % 32u;
            let sub = 2u * c + select(0u, 1u, hi);
            let sm = scale_min(b + 4u, sub);
            let dm = unpack2x16float(src[b >> 2u]);
            var q = nibbles4(src[(b + select(16u, 48u, k5) + 32u * c + l) >> 2u], hi);
            if (k5) {
                let h = src[(b + 16u + l) >> 2u] >> sub;
                q += vec4<f32>(f32(h & 1u), f32((h >> 8u) & 1u), f32((h >> 16u) & 1u), f32((h >> 24u) & 1u)) * 16.0;
            }
            return dm.x * sm.x * q - dm.y * sm.y;
        }
        case 14u: {
            let b = (i / 256u) * Q6K_BYTES;
            let j = i % 256u;
            let n = j / 128u;
            let run = (j % 128u) / 32u;
            let l = j % 32u;
            let ql = word_at(b + 64u * n + l + 32u * (run & 1u));
            let qh = word_at(b + 128u + 32u * n + l) >> (2u * run);
            let lo = nibbles4(ql, run >= 2u);
            let hb = vec4<f32>(f32(qh & 3u), f32((qh >> 8u) & 3u), f32((qh >> 16u) & 3u), f32((qh >> 24u) & 3u));
            let q = lo + hb * 16.0 - 32.0;
            return half(b + 208u) * signed8(b + 192u + 8u * n + l / 16u + 2u * run) * q;
        }
        default: { return vec4<f32>(value(i), value(i + 1u), value(i + 2u), value(i + 3u)); }
    }
}

// scale_min from a K-quant block's first 16 bytes in registers (d and dmin, then the 12
// packed bytes: words y, z, w).
fn scale_min16(h: vec4<u32>, s: u32) -> vec2<f32> {
    let sh = 8u * (s % 4u);
    var sm: vec2<u32>;
    if (s < 4u) {
        sm = vec2<u32>((h.y >> sh) & 63u, (h.z >> sh) & 63u);
    } else {
        let e = h.w >> sh;
        sm = vec2<u32>((e & 0xFu) | ((((h.y >> sh) >> 6u) & 3u) << 4u), ((e >> 4u) & 0xFu) | ((((h.z >> sh) >> 6u) & 3u) << 4u));
    }
    return u2f4(vec4<u32>(sm, 0u, 0u)).xy;
}

// Runs of 32 values (one block, or one sub-block of a K-quant block) decoded from their
// raw words (RAW types: blocks on word or 16-byte boundaries): fetch_raw loads a run's
// words into registers, raw_value4 decodes 4 values of it (the scales once a run where
// the compiler keeps them). quant_coop.wgsl's product fetches the next step's words before
// a step's products and decodes after; dequantize decodes RAW types a run a thread.
override RAW: bool = TYPE == 3u || TYPE == 7u || TYPE == 12u || TYPE == 13u || TYPE == 14u;
const RAW_V4: u32 = 5u;   // registers of raw words a run (vec4s)

// W's blocks again as 16-byte words (K-quant blocks are 16-byte aligned).
@group(0) @binding(13) var<storage, read> srcv4: array<vec4<u32>>;

// The words of the run of elements i.. (i a multiple of 32).
//   Q4_1 (20 bytes), Q5_1 (24): the block's words, in order.
//   Q4_K: the header (d, dmin, scales), the 32 bytes of the sub-block pair.
//   Q5_K: the header, the 32 bytes of fifth bits, the pair's 32 bytes.
//   Q6_K: the 32 bytes of low nibbles, the 32 of 2-bit highs, scales (bytes 192..208), d.
fn fetch_raw(i: u32) -> array<vec4<u32>, RAW_V4> {
    let z = vec4<u32>(0u);
    switch (TYPE) {
        case 3u: {
            let w0 = (i / 32u) * 5u;
            let a = vec4<u32>(src[w0], src[w0 + 1u], src[w0 + 2u], src[w0 + 3u]);
            return array<vec4<u32>, RAW_V4>(a, vec4<u32>(src[w0 + 4u], 0u, 0u, 0u), z, z, z);
        }
        case 7u: {
            let w0 = (i / 32u) * 6u;
            let a = vec4<u32>(src[w0], src[w0 + 1u], src[w0 + 2u], src[w0 + 3u]);
            let b = vec4<u32>(src[w0 + 4u], src[w0 + 5u], 0u, 0u);
            return array<vec4<u32>, RAW_V4>(a, b, z, z, z);
        }
        case 12u: {
            let b = (i / 256u) * 9u;              // in vec4s
            let q = b + 1u + 2u * (((i % 256u) / 32u) / 2u);   // the sub-block pair's bytes
            return array<vec4<u32>, RAW_V4>(srcv4[b], srcv4[q], srcv4[q + 1u], z, z);
        }
        case 13u: {
            let b = (i / 256u) * 11u;
            let q = b + 3u + 2u * (((i % 256u) / 32u) / 2u);
            return array<vec4<u32>, RAW_V4>(srcv4[b], srcv4[q], srcv4[q + 1u], srcv4[b + 1u], srcv4[b + 2u]);
        }
        case 14u: {
            let b = (i / 256u) * (Q6K_BYTES / 16u);
            let run = (i % 256u) / 32u;
            let h = run / 4u;   // half of the block
            let rr = run % 4u;
            let l = b + 4u * h + 2u * (rr & 1u);
            let sc = srcv4[b + 12u];
            let j = 2u * h + rr / 2u;   // the scales' word
            let sw = select(select(select(sc.x, sc.y, j == 1u), sc.z, j == 2u), sc.w, j == 3u);
            let s = vec4<u32>(sw >> (16u * (rr & 1u)), srcv4[b + 13u].x, 0u, 0u);
            return array<vec4<u32>, RAW_V4>(srcv4[l], srcv4[l + 1u], srcv4[b + 8u + 2u * h], srcv4[b + 9u + 2u * h], s);
        }
        default: {
            return array<vec4<u32>, RAW_V4>(z, z, z, z, z);
        }
    }
}

// Word j (0..20) of a run's raw registers.
fn rw(r: array<vec4<u32>, RAW_V4>, j: u32) -> u32 {
    return r[j / 4u][j % 4u];
}

// The 4 nibbles of w's bytes (high ones if `high`), as integers.
fn nib4(w: u32, high: bool) -> vec4<u32> {
    return bytes4(select(w, w >> 4u, high) & 0x0F0F0F0Fu);
}

// Run values e (4 e .. 4 e + 3 of the run's 32) from fetch_raw's words; s: the run's
// place in a K-quant block, (i % 256) / 32. Each quant is put together as an integer
// (low bits | high bits << 4) and converted once, by u2f4 (no integer-to-float
// conversions: the same decode written into the skinny product's Q4_K staging took the
// 8B's gate/up from 0.231 to 0.214 ms on the H200, docs/benchmarks.md session 31): a sum
// of u2f4's (2^23 + q) - 2^23 terms is exact only if the compiler keeps the subtractions
// where they are, and the H200's did not (Q5_1, Q5_K and Q6_K decoded wrong; Q4_1 and
// Q4_K, one term, right).
fn raw_value4(r: array<vec4<u32>, RAW_V4>, e: u32, s: u32) -> vec4<f32> {
    let hi = e >= 4u;        // Q4_1 / Q5_1: high nibbles for elements 16..
    let ek = e % 4u;
    switch (TYPE) {
        case 3u: {
            let dm = unpack2x16float(rw(r, 0u));
            return u2f4(nib4(rw(r, 1u + ek), hi)) * dm.x + dm.y;
        }
        case 7u: {
            let dm = unpack2x16float(rw(r, 0u));
            // Element j's fifth bit is bit j of qh (word 1).
            let h = (rw(r, 1u) >> (4u * e)) & 0xFu;
            let hb = vec4<u32>(h & 1u, (h >> 1u) & 1u, (h >> 2u) & 1u, h >> 3u);
            return u2f4(nib4(rw(r, 2u + ek), hi) | (hb << vec4<u32>(4u))) * dm.x + dm.y;
        }
        case 12u, 13u: {
            let dm = unpack2x16float(r[0].x);
            let sm = scale_min16(r[0], s);
            var q = nib4(rw(r, 4u + e), (s & 1u) == 1u);
            if (TYPE == 13u) {
                q |= bytes4((rw(r, 12u + e) >> s) & 0x01010101u) << vec4<u32>(4u);
            }
            return dm.x * sm.x * u2f4(q) - dm.y * sm.y;
        }
        case 14u: {
            let rr = s % 4u;
            let lo = nib4(rw(r, e), rr >= 2u);
            let hb = bytes4((rw(r, 8u + e) >> (2u * rr)) & 0x03030303u);
            let sw = r[4].x >> select(0u, 8u, hi);
            let d = unpack2x16float(r[4].y).x;
            let q = u2f4(lo | (hb << vec4<u32>(4u))) - 32.0;
            return d * f32(bitcast<i32>(sw << 24u) >> 24u) * q;
        }
        default: {
            return vec4<f32>(0.0);
        }
    }
}

// SWIGLU / GEGLU products (quant.wgsl, quant_coop.wgsl): the gate's activation.
override GEGLU: bool = false;

fn silu(v: f32) -> f32 {
    return v / (1.0 + exp(-v));
}

// The gate's activation: silu, or with GEGLU gelu(approximate='tanh'), 0.5 v (1 + tanh u)
// = v / (1 + exp(-2u)), u = sqrt(2/pi) (v + 0.044715 v^3) (gelu.wgsl's form: no
// cancellation; exp's overflow gives 0 for v << 0).
fn gate_act(v: f32) -> f32 {
    if (GEGLU) {
        let u = 0.7978845608028654 * (v + 0.044715 * v * v * v);
        return v / (1.0 + exp(-2.0 * u));
    }
    return silu(v);
}
