// conv2d.wgsl's three implicit GEMMs on cooperative matrices (tensor cores), for adapters
// with EXPERIMENTAL_COOPERATIVE_MATRIX, SHADER_F16 and subgroups of 32: operands rounded to
// f16 as they are staged, f32 sums (as matmul_coop.wgsl's f16 mode). Same Params, bindings,
// store (conv2d_gemm.wgsl, the prelude of both) and modes as conv2d.wgsl (whose header
// spells out A, B and C of each mode):
//   MODE 0, forward:  C (Cout_g x N*OH*OW) = w (Cout_g x Cin_g*KH*KW) . x gathered
//   MODE 1, dx:       C (Cin_g x N*H*W)    = w^T (Cin_g x Cout_g*KH*KW) . dy gathered
//   MODE 2, dw:       partial C (Cout_g x Cin_g*KH*KW) = dy (Cout_g x chunk of N*OH*OW) . x
//
// Tiling: a workgroup of 128 threads (4 subgroups of 32) computes a 64 x 128 tile of C
// (rows m0.., columns p0..), stepping through its k range 32 at a time. Subgroup w owns
// rows 32 (w / 2) .. + 32 and columns 64 (w % 2) .. + 64: 2 x 4 accumulators of 16 x 16.
// Each step stages A (64 x 32) row-major and B (32 x 128) as f16 in workgroup memory, rows
// padded by 8 halves; the next step's values wait in registers meanwhile.
//   A: thread t holds k = t % 32 of rows t / 32 + 4 r (r < 16); k decoded once a step.
//   B, modes 0 and 1: thread t holds column t (its pixel decoded once a tile) at the
//      step's 32 k, whose (channel, ky, kx) offsets 32 threads decode into `ktab` a step
//      ahead (two halves, one a step: the first step's values are fetched before the
//      loop with no barrier after them, so the table of the second must not overwrite
//      the first's); stored [k][p].
//   B, mode 2: thread t holds k = t % 32 (an output pixel, decoded once a step) of columns
//      t / 32 + 4 r (r < 32), whose (channel, ky, kx) offsets are decoded once a tile into
//      `cols`; stored [p][k] (consecutive threads, consecutive k: pixels next to each other
//      in x), loaded column-major.
// The accumulators leave through a 16 x 16 scratch of their subgroup (NCHW scatter, bias,
// bounds), 16 lanes to a row of 16 consecutive columns.
// Sums run in a fixed order: the same inputs give the same bits on one device.
// Grid: linear over tiles_p * tiles_m * (G * splits) workgroups (2-D past 65535).

enable f16;
enable wgpu_cooperative_matrix;

const TM: u32 = 64u;    // tile rows
const TP: u32 = 128u;   // tile columns
const BK: u32 = 32u;    // k a step
const SA: u32 = 40u;    // staged A row stride, halves: [m][k]
const SB: u32 = 136u;   // staged B row stride (modes 0, 1): [k][p]
const SBT: u32 = 40u;   // staged B^T row stride (mode 2): [p][k]

var<workgroup> sa: array<f16, 2560>;      // TM rows of SA
var<workgroup> sb: array<f16, 5120>;      // BK rows of SB (4352), or TP rows of SBT
var<workgroup> scratch: array<f32, 1024>; // 16 x 16 a subgroup
var<workgroup> cols: array<vec3<i32>, 128>; // mode 2: (x offset of the channel or -1, ky dh - ph, kx dw - pw)
var<workgroup> ktab: array<vec4<i32>, 64>;  // modes 0, 1: two steps' k entries (k_entry)


// Column k of A for group g: (offset of row m = 0, stride between rows), or offset -1
// where k is outside [.., kend). Modes 0 and 1 read w, mode 2 reads dy.
fn a_col(g: u32, k: u32, kend: u32) -> vec2<i32> {
    // No early return: coopLoad needs uniform control flow, and naga counts a return on a
    // thread's own condition, even in a callee, against it.
    var c = vec2<i32>(0, 0);
    if (MODE == 0u) {
        c = vec2<i32>(i32(g * cout_g() * dim_k() + k), i32(dim_k()));
    } else if (MODE == 1u) {
        let co = k / khw();
        c = vec2<i32>(i32((g * cout_g() + co) * cin_g() * khw() + k % khw()), i32(khw()));
    } else {
        let b = k / ohw();
        c = vec2<i32>(i32((b * p.cout + g * cout_g()) * ohw() + k % ohw()), i32(ohw()));
    }
    return select(c, vec2<i32>(-1, 0), k >= kend);
}

fn a_at(i: u32) -> f32 {
    if (MODE == 2u) { return dy[i]; }
    return wt[i];
}

// An accumulator (rows r0.., columns c0..) through subgroup w's scratch.
fn put(acc: coop_mat16x16<f32, C>, w: u32, lane: u32, g: u32, split: u32, r0: u32, c0: u32) {
    coopStoreT(acc, &scratch[w * 256u], 16u);
    workgroupBarrier();
    for (var e = 0u; e < 8u; e++) {
        let i = e * 32u + lane;
        store(g, split, r0 + i / 16u, c0 + i % 16u, scratch[w * 256u + i]);
    }
    workgroupBarrier();
}

// The (channel, ky, kx) of k for modes 0 and 1 (x: the channel's offset in x, or dy's
// channel offset in mode 1, -1 past kend; y, z: the tap's offsets along y and x).
fn k_entry(g: u32, k: u32, kend: u32) -> vec4<i32> {
    let ch = k / khw();
    let r = k % khw();
    let ky = i32((r / p.kw) * p.dh);
    let kx = i32((r % p.kw) * p.dw);
    var e = vec4<i32>(i32(ch * hw()), ky - i32(p.ph), kx - i32(p.pw), 0);
    if (MODE == 1u) {
        e = vec4<i32>(i32(ch * ohw()), i32(p.ph) - ky, i32(p.pw) - kx, 0);
    }
    return select(e, vec4<i32>(-1, 0, 0, 0), k >= kend);
}

// Modes 0 and 1: B's element for this thread's pixel `px` (x: image and group offset, y, z:
// the pixel's row and column, scaled by the stride in mode 0; w: 1 inside P) at the step
// table's entry t; zero outside.
fn gather_b(px: vec4<i32>, t: vec4<i32>) -> f32 {
    var v = 0.0;
    if (px.w == 0 || t.x < 0) { return v; }
    if (MODE == 0u) {
        let iy = px.y + t.y;
        let ix = px.z + t.z;
        if (iy >= 0 && ix >= 0 && iy < i32(p.h) && ix < i32(p.w)) {
            v = x[u32(px.x + t.x + iy * i32(p.w) + ix)];
        }
    } else {
        let ny = px.y + t.y;
        let nx = px.z + t.z;
        if (ny >= 0 && nx >= 0) {
            var oy = u32(ny);
            var ox = u32(nx);
            var hit = true;
            if (p.sh != 1u) { oy = oy / p.sh; hit = oy * p.sh == u32(ny); }
            if (p.sw != 1u) { ox = ox / p.sw; hit = hit && ox * p.sw == u32(nx); }
            if (hit && oy < p.oh && ox < p.ow) {
                v = dy[u32(px.x + t.x) + oy * p.ow + ox];
            }
        }
    }
    return v;
}

// Mode 2: B's element at the pixel (k) `kp` (x: x's image offset or -1, y, z: the output
// pixel's row and column times the stride) and the tile's column entry c (`cols`).
fn gather_bt(kp: vec3<i32>, c: vec3<i32>) -> f32 {
    var v = 0.0;
    let iy = kp.y + c.y;
    let ix = kp.z + c.z;
    if (kp.x >= 0 && c.x >= 0 && iy >= 0 && ix >= 0 && iy < i32(p.h) && ix < i32(p.w)) {
        v = x[u32(kp.x + c.x + iy * i32(p.w) + ix)];
    }
    return v;
}

fn a_elem(ac: vec2<i32>, m: u32, mrows: u32) -> f32 {
    var v = 0.0;
    if (ac.x >= 0 && m < mrows) {
        v = a_at(u32(ac.x + i32(m) * ac.y));
    }
    return v;
}

// A's 16 values of this thread at step k0: k = k0 + tid % 32, rows tid / 32 + 4 r, as
// r = 4 i + j in vec4 i's component j; zero outside.
fn fetch_a(g: u32, k0: u32, kend: u32, m0: u32, tid: u32, mrows: u32) -> array<vec4<f32>, 4> {
    var va: array<vec4<f32>, 4>;
    let ac = a_col(g, k0 + tid % 32u, kend);
    for (var i = 0u; i < 4u; i++) {
        let m = m0 + tid / 32u + 16u * i;
        va[i] = vec4<f32>(a_elem(ac, m, mrows), a_elem(ac, m + 4u, mrows),
                          a_elem(ac, m + 8u, mrows), a_elem(ac, m + 12u, mrows));
    }
    return va;
}

// B's 32 values of this thread at step k0: modes 0 and 1, its pixel px at the step's k
// (entries in ktab's half `half`), r = 4 i + j; mode 2, pixel k0 + tid % 32 at the tile's
// columns tid / 32 + 4 r. Zero outside.
fn fetch_b(g: u32, k0: u32, kend: u32, tid: u32, px: vec4<i32>, half: u32) -> array<vec4<f32>, 8> {
    var vb: array<vec4<f32>, 8>;
    if (MODE == 2u) {
        let k = k0 + tid % 32u;
        var kp = vec3<i32>(-1, 0, 0);
        if (k < kend) {
            let s = k % ohw();
            kp = vec3<i32>(i32(k / ohw() * p.cin * hw()), i32((s / p.ow) * p.sh),
                           i32((s % p.ow) * p.sw));
        }
        for (var i = 0u; i < 8u; i++) {
            let c = tid / 32u + 16u * i;
            vb[i] = vec4<f32>(gather_bt(kp, cols[c]), gather_bt(kp, cols[c + 4u]),
                              gather_bt(kp, cols[c + 8u]), gather_bt(kp, cols[c + 12u]));
        }
    } else {
        for (var i = 0u; i < 8u; i++) {
            let r = half * BK + 4u * i;
            vb[i] = vec4<f32>(gather_b(px, ktab[r]), gather_b(px, ktab[r + 1u]),
                              gather_b(px, ktab[r + 2u]), gather_b(px, ktab[r + 3u]));
        }
    }
    return vb;
}

@compute @workgroup_size(128)
fn conv_gemm_coop(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                  @builtin(local_invocation_index) tid: u32) {
    // Lets, not a var: naga takes a return on a var's value as non-uniform (coop ops).
    let t = wid.x + wid.y * nwg.x;
    let tp = t % p.tiles_p;
    let tm = (t / p.tiles_p) % p.tiles_m;
    let z = t / p.tiles_p / p.tiles_m;
    if (z >= p.groups * p.splits) { return; }   // uniform per workgroup, before any barrier
    let g = z / p.splits;
    let split = z % p.splits;
    let m0 = tm * TM;
    let p0 = tp * TP;
    let kstart = split * p.chunk;
    let kend = min(kstart + p.chunk, dim_k());
    let w = tid / 32u;
    let lane = tid % 32u;
    let wr = (w / 2u) * 32u;   // the subgroup's rows and columns within the tile
    let wc = (w % 2u) * 64u;

    let ak = tid % 32u;   // A: this thread's k within a step, rows am + 4 r
    let am = tid / 32u;

    // Modes 0 and 1: this thread's column of B (a pixel), decoded once.
    let col = p0 + tid;
    var px = vec4<i32>(0, 0, 0, i32(col < dim_p()));
    if (MODE == 0u) {
        let s = col % ohw();
        px.x = i32((col / ohw() * p.cin + g * cin_g()) * hw());
        px.y = i32((s / p.ow) * p.sh);
        px.z = i32((s % p.ow) * p.sw);
    } else if (MODE == 1u) {
        let s = col % hw();
        px.x = i32((col / hw() * p.cout + g * cout_g()) * ohw());
        px.y = i32(s / p.w);
        px.z = i32(s % p.w);
    } else {
        // Mode 2: the tile's 128 columns (channel, ky, kx), decoded into `cols`.
        var e = vec3<i32>(-1, 0, 0);
        if (col < dim_p()) {
            let ci = col / khw();
            let r = col % khw();
            e = vec3<i32>(i32((g * cin_g() + ci) * hw()),
                          i32((r / p.kw) * p.dh) - i32(p.ph),
                          i32((r % p.kw) * p.dw) - i32(p.pw));
        }
        cols[tid] = e;
    }
    if (MODE != 2u && tid < BK) {
        ktab[tid] = k_entry(g, kstart + tid, kend);
    }
    workgroupBarrier();

    // A's 16 values (rows am + 4 (4 i + j)), B's 32 (k or columns 4 i + j), of the next step.
    var va: array<vec4<f32>, 4>;
    var vb: array<vec4<f32>, 8>;
    let mrows = dim_m();

    var c00: coop_mat16x16<f32, C>;
    var c01: coop_mat16x16<f32, C>;
    var c02: coop_mat16x16<f32, C>;
    var c03: coop_mat16x16<f32, C>;
    var c10: coop_mat16x16<f32, C>;
    var c11: coop_mat16x16<f32, C>;
    var c12: coop_mat16x16<f32, C>;
    var c13: coop_mat16x16<f32, C>;
    c00 = coop_mat16x16<f32, C>();
    c01 = coop_mat16x16<f32, C>();
    c02 = coop_mat16x16<f32, C>();
    c03 = coop_mat16x16<f32, C>();
    c10 = coop_mat16x16<f32, C>();
    c11 = coop_mat16x16<f32, C>();
    c12 = coop_mat16x16<f32, C>();
    c13 = coop_mat16x16<f32, C>();

    // Each step: stage the values fetched as f16 (the previous step's multiplies are done:
    // barrier at the end), write the next step's k table, fetch the next step's values while
    // this one's multiply. Loops of 4 or 8 vec4s with no state carried between iterations,
    // so that the compiler can unroll them and keep the values in registers.
    var k0 = kstart;
    var step = 0u;
    va = fetch_a(g, k0, kend, m0, tid, mrows);
    vb = fetch_b(g, k0, kend, tid, px, 0u);
    loop {
        if (k0 >= kend) { break; }
        for (var i = 0u; i < 4u; i++) {
            let m = am + 16u * i;
            sa[m * SA + ak] = f16(va[i].x);
            sa[(m + 4u) * SA + ak] = f16(va[i].y);
            sa[(m + 8u) * SA + ak] = f16(va[i].z);
            sa[(m + 12u) * SA + ak] = f16(va[i].w);
        }
        if (MODE == 2u) {
            for (var i = 0u; i < 8u; i++) {
                let c = am + 16u * i;
                sb[c * SBT + ak] = f16(vb[i].x);
                sb[(c + 4u) * SBT + ak] = f16(vb[i].y);
                sb[(c + 8u) * SBT + ak] = f16(vb[i].z);
                sb[(c + 12u) * SBT + ak] = f16(vb[i].w);
            }
        } else {
            for (var i = 0u; i < 8u; i++) {
                sb[(4u * i) * SB + tid] = f16(vb[i].x);
                sb[(4u * i + 1u) * SB + tid] = f16(vb[i].y);
                sb[(4u * i + 2u) * SB + tid] = f16(vb[i].z);
                sb[(4u * i + 3u) * SB + tid] = f16(vb[i].w);
            }
            if (tid < BK) {
                ktab[((step + 1u) % 2u) * BK + tid] = k_entry(g, k0 + BK + tid, kend);
            }
        }
        workgroupBarrier();
        let k1 = k0 + BK;
        if (k1 < kend) {
            va = fetch_a(g, k1, kend, m0, tid, mrows);
            vb = fetch_b(g, k1, kend, tid, px, (step + 1u) % 2u);
        }
        for (var kb = 0u; kb < BK; kb += 16u) {
            let a0 = coopLoadT<coop_mat16x16<f16, A>>(&sa[wr * SA + kb], SA);
            let a1 = coopLoadT<coop_mat16x16<f16, A>>(&sa[(wr + 16u) * SA + kb], SA);
            var b0: coop_mat16x16<f16, B>;
            var b1: coop_mat16x16<f16, B>;
            var b2: coop_mat16x16<f16, B>;
            var b3: coop_mat16x16<f16, B>;
            if (MODE == 2u) {
                b0 = coopLoad<coop_mat16x16<f16, B>>(&sb[wc * SBT + kb], SBT);
                b1 = coopLoad<coop_mat16x16<f16, B>>(&sb[(wc + 16u) * SBT + kb], SBT);
                b2 = coopLoad<coop_mat16x16<f16, B>>(&sb[(wc + 32u) * SBT + kb], SBT);
                b3 = coopLoad<coop_mat16x16<f16, B>>(&sb[(wc + 48u) * SBT + kb], SBT);
            } else {
                b0 = coopLoadT<coop_mat16x16<f16, B>>(&sb[kb * SB + wc], SB);
                b1 = coopLoadT<coop_mat16x16<f16, B>>(&sb[kb * SB + wc + 16u], SB);
                b2 = coopLoadT<coop_mat16x16<f16, B>>(&sb[kb * SB + wc + 32u], SB);
                b3 = coopLoadT<coop_mat16x16<f16, B>>(&sb[kb * SB + wc + 48u], SB);
            }
            c00 = coopMultiplyAdd(a0, b0, c00);
            c01 = coopMultiplyAdd(a0, b1, c01);
            c02 = coopMultiplyAdd(a0, b2, c02);
            c03 = coopMultiplyAdd(a0, b3, c03);
            c10 = coopMultiplyAdd(a1, b0, c10);
            c11 = coopMultiplyAdd(a1, b1, c11);
            c12 = coopMultiplyAdd(a1, b2, c12);
            c13 = coopMultiplyAdd(a1, b3, c13);
        }
        workgroupBarrier();
        k0 = k1;
        step += 1u;
    }
    let r0 = m0 + wr;
    let c0 = p0 + wc;
    put(c00, w, lane, g, split, r0, c0);
    put(c01, w, lane, g, split, r0, c0 + 16u);
    put(c02, w, lane, g, split, r0, c0 + 32u);
    put(c03, w, lane, g, split, r0, c0 + 48u);
    put(c10, w, lane, g, split, r0 + 16u, c0);
    put(c11, w, lane, g, split, r0 + 16u, c0 + 16u);
    put(c12, w, lane, g, split, r0 + 16u, c0 + 32u);
    put(c13, w, lane, g, split, r0 + 16u, c0 + 48u);
}
