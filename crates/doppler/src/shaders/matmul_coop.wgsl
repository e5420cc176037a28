// matmul.wgsl's product on cooperative matrices (tensor cores), for adapters with
// EXPERIMENTAL_COOPERATIVE_MATRIX, SHADER_F16 and subgroups of 32: the operands are
// rounded to f16 as they are staged, products accumulate in f32.
//   C[b] = alpha * op(A[b]) @ op(B[b]) + bias + beta * C[b]     (same Params and bindings)
// The host runs it only in VEC mode (the contiguous dimension of each operand and the
// batch strides multiples of 4).
//
// Tiling: a workgroup of 128 threads (4 subgroups of 32) computes a 128 x 128 tile of C,
// stepping through K 32 at a time. Each step stages op(A) (128 x 32) and op(B) (32 x 128)
// as f16 in workgroup memory in the order their global rows come (op(A) row-major, or
// column-major when TRANS_A; op(B) row-major, or column-major when TRANS_B: a warp's
// stores stay contiguous), rows padded by 8 halves against bank conflicts; fragments load
// with coopLoadT (row-major) or coopLoad (column-major) to match. The next step's values
// wait in registers meanwhile. Subgroup w owns rows 64 (w / 2) .. + 64 and columns
// 64 (w % 2) .. + 64 of the tile: 4 x 4 accumulators of 16 x 16, each step 2 x (4 A
// fragments, 4 B fragments, 16 multiply-adds). (Measured on the H200 at 4096^3: 165
// TFLOP/s; 8 subgroups of 32 x 64 each: 126.) Where every tile lies inside C and alpha
// is 1, the accumulators may start from the bias row or from C itself (beta 1: C += the
// product; override INIT) and go straight to C at the end, as does a whole tile with
// alpha 1, beta 0 and no bias; otherwise each goes through a 16 x 16 scratch of its
// subgroup (alpha, bias, beta, bounds).
// Sums run in a fixed order: the same inputs give the same bits on one device.
// Grid: (ceil(N / 128), ceil(M / 128), batch).
//
// SPLIT (f16x3: f32 products on the same tensor cores): each operand is scaled by a power
// of two, 2^s, that brings its largest magnitude to [2^14, 2^15) (s from matmul.wgsl's
// `absmax` partials, binding 6: 256 for A, then 256 for B; s kept in [-125, 125]), and
// each scaled value v splits into hi (v rounded to f16's 11 significant bits) and
// lo = f16(v - hi), two f16 arrays per operand in workgroup memory. The product is
// hi_a hi_b + hi_a lo_b + lo_a hi_b (lo_a lo_b, below 2^-22 of the first, is left out),
// summed in the same f32 accumulators, scaled back by 2^-(s_a + s_b) on the way out (in
// place where a whole tile goes straight to C, else in `put`; the host sets INIT 0: C or
// the bias row scaled up by 2^(s_a + s_b) could overflow). A value keeps 22 of
// f32's 24 significant bits where it lies within 2^18 of its tensor's largest; smaller
// ones keep an absolute precision of 2^-39 of that largest (lo's subnormals). On the H200
// against f64 (verify's cases): within 4.1e-7 of sum |a b|, where the f32 kernel is within
// 2.4e-7 and f16 operands within 2.2e-4.

enable f16;
enable wgpu_cooperative_matrix;

struct Params {
    m: u32,
    n: u32,
    k: u32,
    stride_a: u32,
    stride_b: u32,
    stride_c: u32,
    alpha: f32,
    beta: f32,
    bias: u32,
    k_last: u32,   // split-K (A^T B): the last batch slice's k where shorter; 0: p.k for all
    pad1: u32,
    pad2: u32,
}

override TRANS_A: bool = false;
override TRANS_B: bool = false;
override INIT: u32 = 0u;
override SPLIT: bool = false;

const T: u32 = 128u;    // tile of C
const BK: u32 = 32u;    // k a step
// Staged operands are arrays of vec4<f16> (one 8-byte store for 4 values); fragments load
// from them with strides and offsets in vec4s (cooperative loads take vector elements as
// their consecutive components).
const SK: u32 = 10u;    // stride of a staged row along k (BK + 8 halves, in vec4s): A, or B^T
const SM: u32 = 34u;    // stride of a staged row along m or n (T + 8 halves): A^T, or B

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(2) var<storage, read> a4: array<vec4<f32>>;
@group(0) @binding(4) var<storage, read> b4: array<vec4<f32>>;
@group(0) @binding(5) var<storage, read_write> c: array<f32>;
@group(0) @binding(6) var<storage, read> maxes: array<u32>;   // SPLIT: absmax partials (512)
@group(0) @binding(7) var<storage, read> bias: array<f32>;

// SPLIT: the lo halves follow the hi ones (from LO), laid out alike. Otherwise the arrays
// are what they were before f16x3: a product on other workgroup variables beside them
// (lo arrays of their own, even of 256 bytes, or an 8-byte array of atomics) ran at 110
// TFLOP/s instead of 192 on the H200 (4096^3), and the atomics gave wrong sums.
override S_LEN: u32 = select(1280u, 2560u, SPLIT);
const LO: u32 = 1280u;
var<workgroup> sa: array<vec4<f16>, S_LEN>;   // [m][k] (T rows of SK), or [k][m] (TRANS_A)
var<workgroup> sb: array<vec4<f16>, S_LEN>;   // [k][n] (BK rows of SM), or [n][k] (TRANS_B)
var<workgroup> scratch: array<f32, 1024>;   // 16 x 16 a subgroup

var<private> scale_a: f32 = 1.0;   // SPLIT: 2^s_a, 2^s_b
var<private> scale_b: f32 = 1.0;
// SPLIT: 2^-(s_a + s_b) as two factors (each a normal f32), which the sums are multiplied
// by on the way out (one: 2^-250 or 2^250 is not an f32).
var<private> unscale1: f32 = 1.0;
var<private> unscale2: f32 = 1.0;

// x rounded to f16's 11 significant bits, as f32 (exact in f16 where x is within f16's
// normal range), on the bits: with lo = f16(x - f32(f16(x))) the H200 gave f16x3 products
// f16's error (5e-4), as if lo were zero.
fn split_hi(x: vec4<f32>) -> vec4<f32> {
    return bitcast<vec4<f32>>((bitcast<vec4<u32>>(x) + vec4<u32>(0x1000u)) & vec4<u32>(0xffffe000u));
}

// The exponent s that brings a largest magnitude (its f32 bits) to [2^14, 2^15), kept in
// [-125, 125]: 125 for zero (or subnormal), -114 for infinite or NaN (which stay so).
fn scale_exp(bits: u32) -> i32 {
    return clamp(141 - i32((bits >> 23u) & 0xffu), -125, 125);
}

// Load slot q (0..1024) of the op(A) step at k0: 4 values (zero outside).
// kz: this slice's k (p.k, or split-K's shorter last chunk; only A^T B products have one).
fn fetch_a(q: u32, m0: u32, k0: u32, off: u32, kz: u32) -> vec4<f32> {
    if (TRANS_A) {   // A stored (K, M): 4 consecutive m of one k
        let kk = k0 + q / 32u;
        let m = m0 + (q % 32u) * 4u;
        if (kk < kz && m < p.m) {
            return a4[(off + kk * p.m + m) / 4u];
        }
    } else {         // A stored (M, K): 4 consecutive k of one m
        let m = m0 + q / 8u;
        let kk = k0 + (q % 8u) * 4u;
        if (m < p.m && kk < kz) {
            return a4[(off + m * p.k + kk) / 4u];
        }
    }
    return vec4<f32>(0.0);
}

fn stash_a(q: u32, v: vec4<f32>) {
    var at = (q / 8u) * SK + q % 8u;
    if (TRANS_A) {
        at = (q / 32u) * SM + q % 32u;
    }
    if (SPLIT) {
        let x = v * scale_a;
        let hi = split_hi(x);
        sa[at] = vec4<f16>(hi);
        sa[LO + at] = vec4<f16>(x - hi);
    } else {
        sa[at] = vec4<f16>(v);
    }
}

fn fetch_b(q: u32, n0: u32, k0: u32, off: u32, kz: u32) -> vec4<f32> {
    if (TRANS_B) {   // B stored (N, K): 4 consecutive k of one n
        let n = n0 + q / 8u;
        let kk = k0 + (q % 8u) * 4u;
        if (n < p.n && kk < kz) {
            return b4[(off + n * p.k + kk) / 4u];
        }
    } else {         // B stored (K, N): 4 consecutive n of one k
        let kk = k0 + q / 32u;
        let n = n0 + (q % 32u) * 4u;
        if (kk < kz && n < p.n) {
            return b4[(off + kk * p.n + n) / 4u];
        }
    }
    return vec4<f32>(0.0);
}

fn stash_b(q: u32, v: vec4<f32>) {
    var at = (q / 32u) * SM + q % 32u;
    if (TRANS_B) {
        at = (q / 8u) * SK + q % 8u;
    }
    if (SPLIT) {
        let x = v * scale_b;
        let hi = split_hi(x);
        sb[at] = vec4<f16>(hi);
        sb[LO + at] = vec4<f16>(x - hi);
    } else {
        sb[at] = vec4<f16>(v);
    }
}

// Accumulator (rows r0.., columns c0.. of C) through the subgroup's scratch: lane l
// writes elements 8 l .. 8 l + 7 of the 16 x 16 block.
fn put(acc: coop_mat16x16<f32, C>, w: u32, lane: u32, r0: u32, c0: u32, c_off: u32) {
    coopStoreT(acc, &scratch[w * 256u], 16u);
    workgroupBarrier();
    for (var e = 0u; e < 8u; e++) {
        let i = lane * 8u + e;
        let r = r0 + i / 16u;
        let col = c0 + i % 16u;
        if (r < p.m && col < p.n) {
            let at = c_off + r * p.n + col;
            var v = p.alpha * (scratch[w * 256u + i] * unscale1 * unscale2);
            if (p.bias != 0u) {
                v += bias[col];
            }
            if (p.beta != 0.0) {
                v += p.beta * c[at];
            }
            c[at] = v;
        }
    }
    workgroupBarrier();
}

@compute @workgroup_size(128)
fn matmul_coop(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
               @builtin(local_invocation_index) tid: u32) {
    let kz = select(p.k, p.k_last, p.k_last != 0u && wid.z + 1u == nwg.z);
    let m0 = wid.y * T;
    let n0 = wid.x * T;
    let a_off = wid.z * p.stride_a;
    let b_off = wid.z * p.stride_b;
    let c_off = wid.z * p.stride_c;
    let w = tid / 32u;
    let lane = tid % 32u;
    let wr = (w / 2u) * 64u;   // the subgroup's rows and columns within the tile
    let wc = (w % 2u) * 64u;
    if (SPLIT) {
        // The largest magnitudes from the 256 + 256 partials (f32 bits, compared as u32),
        // through the scratch: 128 + 128, then 16 + 16, then each thread reads those.
        scratch[tid] = bitcast<f32>(max(maxes[tid], maxes[tid + 128u]));
        scratch[128u + tid] = bitcast<f32>(max(maxes[256u + tid], maxes[384u + tid]));
        workgroupBarrier();
        if (tid < 32u) {
            var m = 0u;
            for (var i = 0u; i < 8u; i++) {
                m = max(m, bitcast<u32>(scratch[tid * 8u + i]));
            }
            scratch[256u + tid] = bitcast<f32>(m);
        }
        workgroupBarrier();
        var ma = 0u;
        var mb = 0u;
        for (var i = 0u; i < 16u; i++) {
            ma = max(ma, bitcast<u32>(scratch[256u + i]));
            mb = max(mb, bitcast<u32>(scratch[272u + i]));
        }
        let sa_e = scale_exp(ma);
        let sb_e = scale_exp(mb);
        scale_a = exp2(f32(sa_e));
        scale_b = exp2(f32(sb_e));
        let e = -(sa_e + sb_e);
        unscale1 = exp2(f32(e / 2));
        unscale2 = exp2(f32(e - e / 2));
        workgroupBarrier();   // all read before `put` may write the scratch (K = 0: no step)
    }

    var c00: coop_mat16x16<f32, C>;
    var c01: coop_mat16x16<f32, C>;
    var c02: coop_mat16x16<f32, C>;
    var c03: coop_mat16x16<f32, C>;
    var c10: coop_mat16x16<f32, C>;
    var c11: coop_mat16x16<f32, C>;
    var c12: coop_mat16x16<f32, C>;
    var c13: coop_mat16x16<f32, C>;
    var c20: coop_mat16x16<f32, C>;
    var c21: coop_mat16x16<f32, C>;
    var c22: coop_mat16x16<f32, C>;
    var c23: coop_mat16x16<f32, C>;
    var c30: coop_mat16x16<f32, C>;
    var c31: coop_mat16x16<f32, C>;
    var c32: coop_mat16x16<f32, C>;
    var c33: coop_mat16x16<f32, C>;
    // INIT (the host sets it only where every tile is whole and alpha is 1): the sums start
    // from C (1: beta 1) or from the bias row (2: a load with row stride 0), else from zero.
    // The addresses are worked out here and again at the store, so that none is held in a
    // register through the k loop (a form that kept them from here measured 1-5% slower
    // products without INIT on the H200 than the session's earlier calls). Strides and
    // addresses are named values: naga 30's SPIR-V writer panics on expressions written
    // inside coopLoadT's and coopStoreT's arguments.
    if (INIT == 1u) {
        let n = p.n;
        let at = c_off + (m0 + wr) * n + n0 + wc;   // C's element at the subgroup's corner
        let r16 = 16u * n;
        let a00 = at + 0u * r16 + 0u;
        let a01 = at + 0u * r16 + 16u;
        let a02 = at + 0u * r16 + 32u;
        let a03 = at + 0u * r16 + 48u;
        let a10 = at + 1u * r16 + 0u;
        let a11 = at + 1u * r16 + 16u;
        let a12 = at + 1u * r16 + 32u;
        let a13 = at + 1u * r16 + 48u;
        let a20 = at + 2u * r16 + 0u;
        let a21 = at + 2u * r16 + 16u;
        let a22 = at + 2u * r16 + 32u;
        let a23 = at + 2u * r16 + 48u;
        let a30 = at + 3u * r16 + 0u;
        let a31 = at + 3u * r16 + 16u;
        let a32 = at + 3u * r16 + 32u;
        let a33 = at + 3u * r16 + 48u;
        c00 = coopLoadT<coop_mat16x16<f32, C>>(&c[a00], n);
        c01 = coopLoadT<coop_mat16x16<f32, C>>(&c[a01], n);
        c02 = coopLoadT<coop_mat16x16<f32, C>>(&c[a02], n);
        c03 = coopLoadT<coop_mat16x16<f32, C>>(&c[a03], n);
        c10 = coopLoadT<coop_mat16x16<f32, C>>(&c[a10], n);
        c11 = coopLoadT<coop_mat16x16<f32, C>>(&c[a11], n);
        c12 = coopLoadT<coop_mat16x16<f32, C>>(&c[a12], n);
        c13 = coopLoadT<coop_mat16x16<f32, C>>(&c[a13], n);
        c20 = coopLoadT<coop_mat16x16<f32, C>>(&c[a20], n);
        c21 = coopLoadT<coop_mat16x16<f32, C>>(&c[a21], n);
        c22 = coopLoadT<coop_mat16x16<f32, C>>(&c[a22], n);
        c23 = coopLoadT<coop_mat16x16<f32, C>>(&c[a23], n);
        c30 = coopLoadT<coop_mat16x16<f32, C>>(&c[a30], n);
        c31 = coopLoadT<coop_mat16x16<f32, C>>(&c[a31], n);
        c32 = coopLoadT<coop_mat16x16<f32, C>>(&c[a32], n);
        c33 = coopLoadT<coop_mat16x16<f32, C>>(&c[a33], n);
    } else if (INIT == 2u) {
        let zero = 0u;
        let b0 = n0 + wc;
        let b1 = b0 + 16u;
        let b2 = b0 + 32u;
        let b3 = b0 + 48u;
        c00 = coopLoadT<coop_mat16x16<f32, C>>(&bias[b0], zero);
        c01 = coopLoadT<coop_mat16x16<f32, C>>(&bias[b1], zero);
        c02 = coopLoadT<coop_mat16x16<f32, C>>(&bias[b2], zero);
        c03 = coopLoadT<coop_mat16x16<f32, C>>(&bias[b3], zero);
        c10 = coopLoadT<coop_mat16x16<f32, C>>(&bias[b0], zero);
        c11 = coopLoadT<coop_mat16x16<f32, C>>(&bias[b1], zero);
        c12 = coopLoadT<coop_mat16x16<f32, C>>(&bias[b2], zero);
        c13 = coopLoadT<coop_mat16x16<f32, C>>(&bias[b3], zero);
        c20 = coopLoadT<coop_mat16x16<f32, C>>(&bias[b0], zero);
        c21 = coopLoadT<coop_mat16x16<f32, C>>(&bias[b1], zero);
        c22 = coopLoadT<coop_mat16x16<f32, C>>(&bias[b2], zero);
        c23 = coopLoadT<coop_mat16x16<f32, C>>(&bias[b3], zero);
        c30 = coopLoadT<coop_mat16x16<f32, C>>(&bias[b0], zero);
        c31 = coopLoadT<coop_mat16x16<f32, C>>(&bias[b1], zero);
        c32 = coopLoadT<coop_mat16x16<f32, C>>(&bias[b2], zero);
        c33 = coopLoadT<coop_mat16x16<f32, C>>(&bias[b3], zero);
    } else {
        c00 = coop_mat16x16<f32, C>();
        c01 = coop_mat16x16<f32, C>();
        c02 = coop_mat16x16<f32, C>();
        c03 = coop_mat16x16<f32, C>();
        c10 = coop_mat16x16<f32, C>();
        c11 = coop_mat16x16<f32, C>();
        c12 = coop_mat16x16<f32, C>();
        c13 = coop_mat16x16<f32, C>();
        c20 = coop_mat16x16<f32, C>();
        c21 = coop_mat16x16<f32, C>();
        c22 = coop_mat16x16<f32, C>();
        c23 = coop_mat16x16<f32, C>();
        c30 = coop_mat16x16<f32, C>();
        c31 = coop_mat16x16<f32, C>();
        c32 = coop_mat16x16<f32, C>();
        c33 = coop_mat16x16<f32, C>();
    }

    var pa: array<vec4<f32>, 8>;
    var pb: array<vec4<f32>, 8>;
    for (var i = 0u; i < 8u; i++) {
        pa[i] = fetch_a(tid + 128u * i, m0, 0u, a_off, kz);
        pb[i] = fetch_b(tid + 128u * i, n0, 0u, b_off, kz);
    }
    for (var k0 = 0u; k0 < kz; k0 += BK) {
        for (var i = 0u; i < 8u; i++) {
            stash_a(tid + 128u * i, pa[i]);
            stash_b(tid + 128u * i, pb[i]);
        }
        workgroupBarrier();
        let k1 = k0 + BK;
        if (k1 < kz) {
            for (var i = 0u; i < 8u; i++) {
                pa[i] = fetch_a(tid + 128u * i, m0, k1, a_off, kz);
                pb[i] = fetch_b(tid + 128u * i, n0, k1, b_off, kz);
            }
        }
        for (var kb = 0u; kb < BK / 4u; kb += 4u) {   // 16 k a pass, in vec4s
            var a0: coop_mat16x16<f16, A>;
            var a1: coop_mat16x16<f16, A>;
            var a2: coop_mat16x16<f16, A>;
            var a3: coop_mat16x16<f16, A>;
            if (TRANS_A) {
                a0 = coopLoad<coop_mat16x16<f16, A>>(&sa[kb * 4u * SM + wr / 4u], SM);
                a1 = coopLoad<coop_mat16x16<f16, A>>(&sa[kb * 4u * SM + (wr + 16u) / 4u], SM);
                a2 = coopLoad<coop_mat16x16<f16, A>>(&sa[kb * 4u * SM + (wr + 32u) / 4u], SM);
                a3 = coopLoad<coop_mat16x16<f16, A>>(&sa[kb * 4u * SM + (wr + 48u) / 4u], SM);
            } else {
                a0 = coopLoadT<coop_mat16x16<f16, A>>(&sa[wr * SK + kb], SK);
                a1 = coopLoadT<coop_mat16x16<f16, A>>(&sa[(wr + 16u) * SK + kb], SK);
                a2 = coopLoadT<coop_mat16x16<f16, A>>(&sa[(wr + 32u) * SK + kb], SK);
                a3 = coopLoadT<coop_mat16x16<f16, A>>(&sa[(wr + 48u) * SK + kb], SK);
            }
            var b0: coop_mat16x16<f16, B>;
            var b1: coop_mat16x16<f16, B>;
            var b2: coop_mat16x16<f16, B>;
            var b3: coop_mat16x16<f16, B>;
            if (TRANS_B) {
                b0 = coopLoad<coop_mat16x16<f16, B>>(&sb[wc * SK + kb], SK);
                b1 = coopLoad<coop_mat16x16<f16, B>>(&sb[(wc + 16u) * SK + kb], SK);
                b2 = coopLoad<coop_mat16x16<f16, B>>(&sb[(wc + 32u) * SK + kb], SK);
                b3 = coopLoad<coop_mat16x16<f16, B>>(&sb[(wc + 48u) * SK + kb], SK);
            } else {
                b0 = coopLoadT<coop_mat16x16<f16, B>>(&sb[kb * 4u * SM + wc / 4u], SM);
                b1 = coopLoadT<coop_mat16x16<f16, B>>(&sb[kb * 4u * SM + (wc + 16u) / 4u], SM);
                b2 = coopLoadT<coop_mat16x16<f16, B>>(&sb[kb * 4u * SM + (wc + 32u) / 4u], SM);
                b3 = coopLoadT<coop_mat16x16<f16, B>>(&sb[kb * 4u * SM + (wc + 48u) / 4u], SM);
            }
            c00 = coopMultiplyAdd(a0, b0, c00);
            c01 = coopMultiplyAdd(a0, b1, c01);
            c02 = coopMultiplyAdd(a0, b2, c02);
            c03 = coopMultiplyAdd(a0, b3, c03);
            c10 = coopMultiplyAdd(a1, b0, c10);
            c11 = coopMultiplyAdd(a1, b1, c11);
            c12 = coopMultiplyAdd(a1, b2, c12);
            c13 = coopMultiplyAdd(a1, b3, c13);
            c20 = coopMultiplyAdd(a2, b0, c20);
            c21 = coopMultiplyAdd(a2, b1, c21);
            c22 = coopMultiplyAdd(a2, b2, c22);
            c23 = coopMultiplyAdd(a2, b3, c23);
            c30 = coopMultiplyAdd(a3, b0, c30);
            c31 = coopMultiplyAdd(a3, b1, c31);
            c32 = coopMultiplyAdd(a3, b2, c32);
            c33 = coopMultiplyAdd(a3, b3, c33);
            if (SPLIT) {   // + hi_a lo_b, then + lo_a hi_b
                var l0: coop_mat16x16<f16, B>;
                var l1: coop_mat16x16<f16, B>;
                var l2: coop_mat16x16<f16, B>;
                var l3: coop_mat16x16<f16, B>;
                if (TRANS_B) {
                    l0 = coopLoad<coop_mat16x16<f16, B>>(&sb[LO + wc * SK + kb], SK);
                    l1 = coopLoad<coop_mat16x16<f16, B>>(&sb[LO + (wc + 16u) * SK + kb], SK);
                    l2 = coopLoad<coop_mat16x16<f16, B>>(&sb[LO + (wc + 32u) * SK + kb], SK);
                    l3 = coopLoad<coop_mat16x16<f16, B>>(&sb[LO + (wc + 48u) * SK + kb], SK);
                } else {
                    l0 = coopLoadT<coop_mat16x16<f16, B>>(&sb[LO + kb * 4u * SM + wc / 4u], SM);
                    l1 = coopLoadT<coop_mat16x16<f16, B>>(&sb[LO + kb * 4u * SM + (wc + 16u) / 4u], SM);
                    l2 = coopLoadT<coop_mat16x16<f16, B>>(&sb[LO + kb * 4u * SM + (wc + 32u) / 4u], SM);
                    l3 = coopLoadT<coop_mat16x16<f16, B>>(&sb[LO + kb * 4u * SM + (wc + 48u) / 4u], SM);
                }
                c00 = coopMultiplyAdd(a0, l0, c00);
                c01 = coopMultiplyAdd(a0, l1, c01);
                c02 = coopMultiplyAdd(a0, l2, c02);
                c03 = coopMultiplyAdd(a0, l3, c03);
                c10 = coopMultiplyAdd(a1, l0, c10);
                c11 = coopMultiplyAdd(a1, l1, c11);
                c12 = coopMultiplyAdd(a1, l2, c12);
                c13 = coopMultiplyAdd(a1, l3, c13);
                c20 = coopMultiplyAdd(a2, l0, c20);
                c21 = coopMultiplyAdd(a2, l1, c21);
                c22 = coopMultiplyAdd(a2, l2, c22);
                c23 = coopMultiplyAdd(a2, l3, c23);
                c30 = coopMultiplyAdd(a3, l0, c30);
                c31 = coopMultiplyAdd(a3, l1, c31);
                c32 = coopMultiplyAdd(a3, l2, c32);
                c33 = coopMultiplyAdd(a3, l3, c33);
                var h0: coop_mat16x16<f16, A>;
                var h1: coop_mat16x16<f16, A>;
                var h2: coop_mat16x16<f16, A>;
                var h3: coop_mat16x16<f16, A>;
                if (TRANS_A) {
                    h0 = coopLoad<coop_mat16x16<f16, A>>(&sa[LO + kb * 4u * SM + wr / 4u], SM);
                    h1 = coopLoad<coop_mat16x16<f16, A>>(&sa[LO + kb * 4u * SM + (wr + 16u) / 4u], SM);
                    h2 = coopLoad<coop_mat16x16<f16, A>>(&sa[LO + kb * 4u * SM + (wr + 32u) / 4u], SM);
                    h3 = coopLoad<coop_mat16x16<f16, A>>(&sa[LO + kb * 4u * SM + (wr + 48u) / 4u], SM);
                } else {
                    h0 = coopLoadT<coop_mat16x16<f16, A>>(&sa[LO + wr * SK + kb], SK);
                    h1 = coopLoadT<coop_mat16x16<f16, A>>(&sa[LO + (wr + 16u) * SK + kb], SK);
                    h2 = coopLoadT<coop_mat16x16<f16, A>>(&sa[LO + (wr + 32u) * SK + kb], SK);
                    h3 = coopLoadT<coop_mat16x16<f16, A>>(&sa[LO + (wr + 48u) * SK + kb], SK);
                }
                c00 = coopMultiplyAdd(h0, b0, c00);
                c01 = coopMultiplyAdd(h0, b1, c01);
                c02 = coopMultiplyAdd(h0, b2, c02);
                c03 = coopMultiplyAdd(h0, b3, c03);
                c10 = coopMultiplyAdd(h1, b0, c10);
                c11 = coopMultiplyAdd(h1, b1, c11);
                c12 = coopMultiplyAdd(h1, b2, c12);
                c13 = coopMultiplyAdd(h1, b3, c13);
                c20 = coopMultiplyAdd(h2, b0, c20);
                c21 = coopMultiplyAdd(h2, b1, c21);
                c22 = coopMultiplyAdd(h2, b2, c22);
                c23 = coopMultiplyAdd(h2, b3, c23);
                c30 = coopMultiplyAdd(h3, b0, c30);
                c31 = coopMultiplyAdd(h3, b1, c31);
                c32 = coopMultiplyAdd(h3, b2, c32);
                c33 = coopMultiplyAdd(h3, b3, c33);
            }
        }
        workgroupBarrier();
    }
    let r0 = m0 + wr;
    let c0 = n0 + wc;
    // Straight to C: every tile under INIT 1 and 2; otherwise a whole tile with alpha 1,
    // beta 0 and no bias (most products). Rows of C a multiple of 4 floats keep the stores
    // 16-byte aligned.
    let whole = m0 + T <= p.m && n0 + T <= p.n && p.n % 4u == 0u;
    if (INIT != 0u || (whole && p.alpha == 1.0 && p.beta == 0.0 && p.bias == 0u)) {
        if (SPLIT) {   // the sums scaled back in place (INIT is 0 here)
            c00 = (c00 * unscale1) * unscale2;
            c01 = (c01 * unscale1) * unscale2;
            c02 = (c02 * unscale1) * unscale2;
            c03 = (c03 * unscale1) * unscale2;
            c10 = (c10 * unscale1) * unscale2;
            c11 = (c11 * unscale1) * unscale2;
            c12 = (c12 * unscale1) * unscale2;
            c13 = (c13 * unscale1) * unscale2;
            c20 = (c20 * unscale1) * unscale2;
            c21 = (c21 * unscale1) * unscale2;
            c22 = (c22 * unscale1) * unscale2;
            c23 = (c23 * unscale1) * unscale2;
            c30 = (c30 * unscale1) * unscale2;
            c31 = (c31 * unscale1) * unscale2;
            c32 = (c32 * unscale1) * unscale2;
            c33 = (c33 * unscale1) * unscale2;
        }
        let n = p.n;
        let at = c_off + r0 * n + c0;   // C's element (r0, c0), then rows 16 apart
        let r16 = 16u * n;
        let a00 = at + 0u * r16 + 0u;
        let a01 = at + 0u * r16 + 16u;
        let a02 = at + 0u * r16 + 32u;
        let a03 = at + 0u * r16 + 48u;
        let a10 = at + 1u * r16 + 0u;
        let a11 = at + 1u * r16 + 16u;
        let a12 = at + 1u * r16 + 32u;
        let a13 = at + 1u * r16 + 48u;
        let a20 = at + 2u * r16 + 0u;
        let a21 = at + 2u * r16 + 16u;
        let a22 = at + 2u * r16 + 32u;
        let a23 = at + 2u * r16 + 48u;
        let a30 = at + 3u * r16 + 0u;
        let a31 = at + 3u * r16 + 16u;
        let a32 = at + 3u * r16 + 32u;
        let a33 = at + 3u * r16 + 48u;
        coopStoreT(c00, &c[a00], n);
        coopStoreT(c01, &c[a01], n);
        coopStoreT(c02, &c[a02], n);
        coopStoreT(c03, &c[a03], n);
        coopStoreT(c10, &c[a10], n);
        coopStoreT(c11, &c[a11], n);
        coopStoreT(c12, &c[a12], n);
        coopStoreT(c13, &c[a13], n);
        coopStoreT(c20, &c[a20], n);
        coopStoreT(c21, &c[a21], n);
        coopStoreT(c22, &c[a22], n);
        coopStoreT(c23, &c[a23], n);
        coopStoreT(c30, &c[a30], n);
        coopStoreT(c31, &c[a31], n);
        coopStoreT(c32, &c[a32], n);
        coopStoreT(c33, &c[a33], n);
        return;
    }
    put(c00, w, lane, r0, c0, c_off);
    put(c01, w, lane, r0, c0 + 16u, c_off);
    put(c02, w, lane, r0, c0 + 32u, c_off);
    put(c03, w, lane, r0, c0 + 48u, c_off);
    put(c10, w, lane, r0 + 16u, c0, c_off);
    put(c11, w, lane, r0 + 16u, c0 + 16u, c_off);
    put(c12, w, lane, r0 + 16u, c0 + 32u, c_off);
    put(c13, w, lane, r0 + 16u, c0 + 48u, c_off);
    put(c20, w, lane, r0 + 32u, c0, c_off);
    put(c21, w, lane, r0 + 32u, c0 + 16u, c_off);
    put(c22, w, lane, r0 + 32u, c0 + 32u, c_off);
    put(c23, w, lane, r0 + 32u, c0 + 48u, c_off);
    put(c30, w, lane, r0 + 48u, c0, c_off);
    put(c31, w, lane, r0 + 48u, c0 + 16u, c_off);
    put(c32, w, lane, r0 + 48u, c0 + 32u, c_off);
    put(c33, w, lane, r0 + 48u, c0 + 48u, c_off);
}
