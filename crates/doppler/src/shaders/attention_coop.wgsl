// attention.wgsl's kernels on cooperative matrices (tensor cores), for adapters with
// EXPERIMENTAL_COOPERATIVE_MATRIX, SHADER_F16 and subgroups of 32: q, k, v, dO and the
// probabilities / dS enter the products as f16; every sum, the softmax statistics and
// the outputs are f32. Same formulas, bindings and layouts as attention.wgsl (derivatives
// in its header); head dim <= 64 (staged zero-padded to 64); the forward to 128 too
// (attn_fwd_coop_wide, at the end of the forward's section).
//   q, o   (B, Tq, Hq, D)     k, v, dk, dv  (B, Tk, Hkv, D)     lse, delta  (B, Hq, Tq)
//
// A workgroup of 128 threads (4 subgroups of 32) owns 64 rows (queries in the forward and
// dq, keys in dkv) and steps through the other side 64 rows at a time, staged as f16 in
// workgroup memory (rows padded to 72 halves against bank conflicts). Subgroup g owns
// rows 16 g .. 16 g + 16 of the block and holds them as 16 x 16 f16 fragments in
// registers for the whole loop. Each step it makes a 16 x 64 block of scores (4
// fragments, 16 multiply-adds over the head dim) and stores it to its f32 scratch
// (16 x 64), where lane l takes row l % 16, columns 32 (l / 16) .. + 32: the mask, exp,
// the forward's running row max (the two lanes of a row trade their halves through
// workgroup memory). Probabilities or dS go back to workgroup memory as f16 and enter
// the second product.
//   attn_fwd_coop:     S = Q K^T;  m' = max(m, rowmax S);  P = exp(S - m');
//                      O = O exp(m - m') + P V   (O in the lanes' registers, f32)
//   attn_bwd_dq_coop:  S = Q K^T, dP = dO V^T;  dS = exp(S - lse) (dP - delta);
//                      dQ += dS K   (fragments)
//   attn_bwd_dkv_coop: S^T = K Q^T, dP^T = V dO^T;  dV += P^T dO, dK += dS^T Q
//                      (fragments), over the group's query heads in order
// Scale folded into q (forward, dq) or k (dkv) as they are staged, and applied to dq and
// dk at the end. Sums run in a fixed order: the same inputs give the same bits.
// Dropout on the probabilities as attention.wgsl's (z_ij from the same hash of (seed, row,
// key)): P z into P V and dV, z dP into dS.
// Grid: linear over (B * heads) * ceil(rows / 64) workgroups (2-D past 65535).
// group_id, Block, block_of and row_at repeat attention.wgsl's (WGSL has no includes).

enable f16;
enable wgpu_cooperative_matrix;

struct Params {
    b: u32,
    tq: u32,
    tk: u32,
    hq: u32,
    hkv: u32,
    causal: u32,
    scale: f32,
    _pad: u32,
    seed_lo: u32,
    seed_hi: u32,
    threshold: u32,   // keep p_ij when its 24-bit draw >= threshold (0: no dropout)
    drop_scale: f32,  // 1 / (1 - dropout probability)
}

override D4: u32 = 16u;   // head dim / 4 (<= 16; attn_fwd_coop_wide: <= 32)

const NEG: f32 = -1e30;
const BLK: u32 = 64u;     // rows of a workgroup, and of a step

// Workgroup arrays hold vec4s (one 8- or 16-byte access for 4 values); positions below
// count scalars, divided by 4 at each access, and cooperative loads and stores take
// strides in vec4s (SH4, SS4: a vector element's components are consecutive).
const SH: u32 = 72u;      // stride of a staged f16 row
const SS: u32 = 68u;      // stride of a scratch f32 row
const SCR: u32 = 1088u;   // scratch floats of a subgroup (16 rows of SS)
const SH4: u32 = 18u;
const SS4: u32 = 17u;

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> q: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> k: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read> v: array<vec4<f32>>;
@group(0) @binding(4) var<storage, read_write> o: array<vec4<f32>>;
@group(0) @binding(5) var<storage, read_write> lse: array<f32>;
@group(0) @binding(7) var<storage, read> d_o: array<vec4<f32>>;
@group(0) @binding(8) var<storage, read> lse_in: array<f32>;
@group(0) @binding(10) var<storage, read> delta_in: array<f32>;
@group(0) @binding(11) var<storage, read_write> dq: array<vec4<f32>>;
@group(0) @binding(12) var<storage, read_write> dk: array<vec4<f32>>;
@group(0) @binding(13) var<storage, read_write> dv: array<vec4<f32>>;

var<workgroup> s0: array<vec4<f16>, 1152>;   // 64 staged rows of SH
var<workgroup> s1: array<vec4<f16>, 1152>;   // 64 staged rows of SH
var<workgroup> s2: array<vec4<f16>, 1152>;   // subgroup g: rows 16 g .. + 16 (P, or dS)
var<workgroup> scr: array<vec4<f32>, 1088>;  // subgroup g: SCR floats from g * SCR
var<workgroup> xch: array<f32, 128>;    // lanes' row statistics, or staged lse and delta

fn group_id(wid: vec3<u32>, nwg: vec3<u32>) -> u32 {
    return wid.x + wid.y * nwg.x;
}

// What one workgroup covers: 64 rows from r0 of head h (of nh heads, rows of length nt)
// in batch bi; kv is the key/value head of a query head (h itself when nh is Hkv).
struct Block {
    bi: u32,
    h: u32,
    kv: u32,
    r0: u32,
    ok: bool,
}

fn block_of(wid: vec3<u32>, nwg: vec3<u32>, nt: u32, nh: u32) -> Block {
    let blocks = (nt + BLK - 1u) / BLK;
    let g = group_id(wid, nwg);
    let bh = g / blocks;
    let h = bh % nh;
    return Block(bh / nh, h, h / (nh / p.hkv), (g % blocks) * BLK, bh < p.b * nh);
}

// First vec4 of row t of head h in a (B, T, H, D) tensor.
fn row_at(bi: u32, t: u32, nt: u32, h: u32, nh: u32) -> u32 {
    return ((bi * nt + t) * nh + h) * D4;
}

// Whether query i exists and may see key j (which exists).
fn seen(i: u32, j: u32) -> bool {
    return i < p.tq && j < p.tk && (p.causal == 0u || j <= i + p.tk - p.tq);
}

// Dropout's hash, row hash and z_ij, as attention.wgsl's.
fn pcg(v: u32) -> u32 {
    let state = v * 747796405u + 2891336453u;
    let word = ((state >> ((state >> 28u) + 4u)) ^ state) * 277803737u;
    return (word >> 22u) ^ word;
}

fn drop_row(bi: u32, h: u32, i: u32) -> u32 {
    return pcg(((bi * p.hq + h) * p.tq + i) ^ pcg(p.seed_lo));
}

fn drop_z(row: u32, j: u32) -> f32 {
    if (p.threshold == 0u) {
        return 1.0;
    }
    return select(0.0, p.drop_scale, (pcg(row ^ pcg(j ^ p.seed_hi)) >> 8u) >= p.threshold);
}

// z of query row `row` against keys j .. j + 3, and of queries i .. i + 3 (of head h)
// against key j.
fn z_keys(row: u32, j: u32) -> vec4<f32> {
    if (p.threshold == 0u) {
        return vec4<f32>(1.0);
    }
    return vec4<f32>(drop_z(row, j), drop_z(row, j + 1u), drop_z(row, j + 2u), drop_z(row, j + 3u));
}

fn z_queries(bi: u32, h: u32, i: u32, j: u32) -> vec4<f32> {
    if (p.threshold == 0u) {
        return vec4<f32>(1.0);
    }
    return vec4<f32>(drop_z(drop_row(bi, h, i), j), drop_z(drop_row(bi, h, i + 1u), j),
                     drop_z(drop_row(bi, h, i + 2u), j), drop_z(drop_row(bi, h, i + 3u), j));
}

// Query i against keys j .. j + 3, and queries i .. i + 3 against key j.
fn seen_keys(i: u32, j: u32) -> vec4<bool> {
    return vec4<bool>(seen(i, j), seen(i, j + 1u), seen(i, j + 2u), seen(i, j + 3u));
}

fn seen_queries(i: u32, j: u32) -> vec4<bool> {
    return vec4<bool>(seen(i, j), seen(i + 1u, j), seen(i + 2u, j), seen(i + 3u, j));
}

// Keys a block of queries starting at i0 can see: [0, end).
fn key_end(i0: u32) -> u32 {
    if (p.causal == 0u) {
        return p.tk;
    }
    return min(p.tk, i0 + BLK + p.tk - p.tq);
}

// Slot e (0..8) of thread tid in a stage of 64 rows (from r0) of head hh of q (which 0),
// k (1), v (2) or dO (3): vec4 t % 16 of row t / 16, t = tid + 128 e; zeros past nt,
// past the head dim and past the batch. The loops fetch the next step's slots into registers before they
// compute on this one, so that the loads' latency hides behind the products.
fn fetch(which: u32, bi: u32, r0: u32, nt: u32, hh: u32, nh: u32, tid: u32, e: u32) -> vec4<f32> {
    let t = tid + 128u * e;
    let r = r0 + t / 16u;
    let ch = t % 16u;
    var x = vec4<f32>(0.0);
    if (bi < p.b && r < nt && ch < D4) {   // (bi past the batch: a grid's spare workgroup)
        let at = row_at(bi, r, nt, hh, nh) + ch;
        switch (which) {
            case 0u: { x = q[at]; }
            case 1u: { x = k[at]; }
            case 2u: { x = v[at]; }
            default: { x = d_o[at]; }
        }
    }
    return x;
}

// A fetched slot (times mul) as f16 into s0 (dst 0) or s1 (dst 1).
fn put(dst: u32, tid: u32, e: u32, x: vec4<f32>, mul: f32) {
    let t = tid + 128u * e;
    let at = ((t / 16u) * SH) / 4u + t % 16u;
    if (dst == 0u) {
        s0[at] = vec4<f16>(x * mul);
    } else {
        s1[at] = vec4<f16>(x * mul);
    }
}

// Stages 64 rows at once (the workgroup's own rows, before the loop).
fn stage(which: u32, dst: u32, bi: u32, r0: u32, nt: u32, hh: u32, nh: u32, mul: f32, tid: u32) {
    for (var e = 0u; e < 8u; e++) {
        put(dst, tid, e, fetch(which, bi, r0, nt, hh, nh, tid, e), mul);
    }
}

// (lse, delta) of query i0 + tid of head h (tid < 64; zeros past Tq, and for tid >= 64).
fn stats(bi: u32, h: u32, i0: u32, tid: u32) -> vec2<f32> {
    if (tid < BLK && i0 + tid < p.tq) {
        let at = (bi * p.hq + h) * p.tq + i0 + tid;
        return vec2<f32>(lse_in[at], delta_in[at]);
    }
    return vec2<f32>(0.0);
}

// Fragment c (columns 16 c .. + 16) of the 16 x 64 rows from row r of s0 / s1. (Two
// functions each here: cooperative operations need uniform control flow, and naga takes
// a branch on an argument for non-uniform.)
fn frag_a0(r: u32, c: u32) -> coop_mat16x16<f16, A> {
    return coopLoadT<coop_mat16x16<f16, A>>(&s0[(r * SH + c * 16u) / 4u], SH4);
}

fn frag_a1(r: u32, c: u32) -> coop_mat16x16<f16, A> {
    return coopLoadT<coop_mat16x16<f16, A>>(&s1[(r * SH + c * 16u) / 4u], SH4);
}

// (16 x 64 rows a0..a3) times the 64 rows staged in s0 / s1, transposed: the 16 x 64
// result into subgroup g's scratch.
fn scores0(a0: coop_mat16x16<f16, A>, a1: coop_mat16x16<f16, A>, a2: coop_mat16x16<f16, A>,
           a3: coop_mat16x16<f16, A>, g: u32) {
    for (var c = 0u; c < 4u; c++) {
        let at = c * 16u * SH;
        var acc = coop_mat16x16<f32, C>();
        acc = coopMultiplyAdd(a0, coopLoad<coop_mat16x16<f16, B>>(&s0[at / 4u], SH4), acc);
        acc = coopMultiplyAdd(a1, coopLoad<coop_mat16x16<f16, B>>(&s0[(at + 16u) / 4u], SH4), acc);
        acc = coopMultiplyAdd(a2, coopLoad<coop_mat16x16<f16, B>>(&s0[(at + 32u) / 4u], SH4), acc);
        acc = coopMultiplyAdd(a3, coopLoad<coop_mat16x16<f16, B>>(&s0[(at + 48u) / 4u], SH4), acc);
        coopStoreT(acc, &scr[(g * SCR + c * 16u) / 4u], SS4);
    }
}

fn scores1(a0: coop_mat16x16<f16, A>, a1: coop_mat16x16<f16, A>, a2: coop_mat16x16<f16, A>,
           a3: coop_mat16x16<f16, A>, g: u32) {
    for (var c = 0u; c < 4u; c++) {
        let at = c * 16u * SH;
        var acc = coop_mat16x16<f32, C>();
        acc = coopMultiplyAdd(a0, coopLoad<coop_mat16x16<f16, B>>(&s1[at / 4u], SH4), acc);
        acc = coopMultiplyAdd(a1, coopLoad<coop_mat16x16<f16, B>>(&s1[(at + 16u) / 4u], SH4), acc);
        acc = coopMultiplyAdd(a2, coopLoad<coop_mat16x16<f16, B>>(&s1[(at + 32u) / 4u], SH4), acc);
        acc = coopMultiplyAdd(a3, coopLoad<coop_mat16x16<f16, B>>(&s1[(at + 48u) / 4u], SH4), acc);
        coopStoreT(acc, &scr[(g * SCR + c * 16u) / 4u], SS4);
    }
}

// Four 16 x 16 fragments side by side (16 x 64) into subgroup g's scratch.
fn to_scratch(g: u32, m0: coop_mat16x16<f32, C>, m1: coop_mat16x16<f32, C>,
              m2: coop_mat16x16<f32, C>, m3: coop_mat16x16<f32, C>) {
    coopStoreT(m0, &scr[g * SCR / 4u], SS4);
    coopStoreT(m1, &scr[(g * SCR + 16u) / 4u], SS4);
    coopStoreT(m2, &scr[(g * SCR + 32u) / 4u], SS4);
    coopStoreT(m3, &scr[(g * SCR + 48u) / 4u], SS4);
}

// Four scratch values from position at (a multiple of 4).
fn rd(at: u32) -> vec4<f32> {
    return scr[at / 4u];
}

// Four values as f16 into s2 from position at (a multiple of 4).
fn put2(at: u32, x: vec4<f32>) {
    s2[at / 4u] = vec4<f16>(x);
}

// Fragment c of subgroup g's 16 x 64 block of s2.
fn frag_p(g: u32, c: u32) -> coop_mat16x16<f16, A> {
    return coopLoadT<coop_mat16x16<f16, A>>(&s2[(g * 16u * SH + c * 16u) / 4u], SH4);
}

// Fragment (rows 16 r .., columns 16 c ..) of the rows staged in s0 / s1, as the right
// operand.
fn frag_b0(r: u32, c: u32) -> coop_mat16x16<f16, B> {
    return coopLoadT<coop_mat16x16<f16, B>>(&s0[(r * 16u * SH + c * 16u) / 4u], SH4);
}

fn frag_b1(r: u32, c: u32) -> coop_mat16x16<f16, B> {
    return coopLoadT<coop_mat16x16<f16, B>>(&s1[(r * 16u * SH + c * 16u) / 4u], SH4);
}

// The online softmax's running statistics of a lane's half row.
struct Online {
    m: f32,      // the row's running max (the same in both lanes)
    l: f32,      // the sum of the lane's own columns
    corr: f32,   // exp(old max - new max): what O is scaled by this step
}

// One step of the online softmax for query i and keys j .. j + 32 (the lane's half of
// the 64 scores at scratch position b): masked scores, the row max shared with the
// other lane through xch, exp(s - max) times the dropout z into s2 at pb (f16), and the
// updated (m, l). Called in uniform control flow (a barrier inside).
fn softmax_step(m: f32, l: f32, i: u32, j: u32, b: u32, pb: u32, g: u32, lane: u32, row: u32) -> Online {
    let neg = vec4<f32>(NEG);
    let x0 = select(neg, rd(b), seen_keys(i, j));
    let x1 = select(neg, rd(b + 4u), seen_keys(i, j + 4u));
    let x2 = select(neg, rd(b + 8u), seen_keys(i, j + 8u));
    let x3 = select(neg, rd(b + 12u), seen_keys(i, j + 12u));
    let x4 = select(neg, rd(b + 16u), seen_keys(i, j + 16u));
    let x5 = select(neg, rd(b + 20u), seen_keys(i, j + 20u));
    let x6 = select(neg, rd(b + 24u), seen_keys(i, j + 24u));
    let x7 = select(neg, rd(b + 28u), seen_keys(i, j + 28u));
    let mx4 = max(max(max(x0, x1), max(x2, x3)), max(max(x4, x5), max(x6, x7)));
    xch[g * 32u + lane] = max(max(mx4.x, mx4.y), max(mx4.z, mx4.w));
    workgroupBarrier();
    let mn = max(m, max(xch[g * 32u + lane], xch[g * 32u + (lane ^ 16u)]));
    let corr = exp(m - mn);
    let zero = vec4<f32>(0.0);
    let e0 = select(zero, exp(x0 - mn), x0 > neg);
    let e1 = select(zero, exp(x1 - mn), x1 > neg);
    let e2 = select(zero, exp(x2 - mn), x2 > neg);
    let e3 = select(zero, exp(x3 - mn), x3 > neg);
    let e4 = select(zero, exp(x4 - mn), x4 > neg);
    let e5 = select(zero, exp(x5 - mn), x5 > neg);
    let e6 = select(zero, exp(x6 - mn), x6 > neg);
    let e7 = select(zero, exp(x7 - mn), x7 > neg);
    let es = ((e0 + e1) + (e2 + e3)) + ((e4 + e5) + (e6 + e7));
    put2(pb, e0 * z_keys(row, j));
    put2(pb + 4u, e1 * z_keys(row, j + 4u));
    put2(pb + 8u, e2 * z_keys(row, j + 8u));
    put2(pb + 12u, e3 * z_keys(row, j + 12u));
    put2(pb + 16u, e4 * z_keys(row, j + 16u));
    put2(pb + 20u, e5 * z_keys(row, j + 20u));
    put2(pb + 24u, e6 * z_keys(row, j + 24u));
    put2(pb + 28u, e7 * z_keys(row, j + 28u));
    return Online(mn, l * corr + ((es.x + es.y) + (es.z + es.w)), corr);
}

@compute @workgroup_size(128)
fn attn_fwd_coop(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                 @builtin(local_invocation_index) tid: u32) {
    let w = block_of(wid, nwg, p.tq, p.hq);
    let g = tid / 32u;
    let lane = tid % 32u;
    let lr = lane % 16u;
    let c0 = (lane / 16u) * 32u;     // the lane's first column
    let i = w.r0 + g * 16u + lr;     // the lane's query
    let b = g * SCR + lr * SS + c0;  // the lane's first scratch value
    let pb = (g * 16u + lr) * SH + c0;
    stage(0u, 0u, w.bi, w.r0, p.tq, w.h, p.hq, p.scale, tid);   // Q, scaled
    workgroupBarrier();
    let q0 = frag_a0(g * 16u, 0u);
    let q1 = frag_a0(g * 16u, 1u);
    let q2 = frag_a0(g * 16u, 2u);
    let q3 = frag_a0(g * 16u, 3u);
    let row = drop_row(w.bi, w.h, i);
    var m = NEG;    // the row's running max (the same in both lanes)
    var l = 0.0;    // the sum of the lane's own columns
    var o0 = vec4<f32>(0.0);
    var o1 = vec4<f32>(0.0);
    var o2 = vec4<f32>(0.0);
    var o3 = vec4<f32>(0.0);
    var o4 = vec4<f32>(0.0);
    var o5 = vec4<f32>(0.0);
    var o6 = vec4<f32>(0.0);
    var o7 = vec4<f32>(0.0);
    let end = select(0u, key_end(w.r0), w.ok);
    var fk: array<vec4<f32>, 8>;   // the next step's K and V
    var fv: array<vec4<f32>, 8>;
    if (end > 0u) {
        for (var e = 0u; e < 8u; e++) {
            fk[e] = fetch(1u, w.bi, 0u, p.tk, w.kv, p.hkv, tid, e);
            fv[e] = fetch(2u, w.bi, 0u, p.tk, w.kv, p.hkv, tid, e);
        }
    }
    for (var j0 = 0u; j0 < end; j0 += BLK) {
        workgroupBarrier();   // everyone is done with s0, s1
        for (var e = 0u; e < 8u; e++) {
            put(0u, tid, e, fk[e], 1.0);
            put(1u, tid, e, fv[e], 1.0);
        }
        if (j0 + BLK < end) {
            for (var e = 0u; e < 8u; e++) {
                fk[e] = fetch(1u, w.bi, j0 + BLK, p.tk, w.kv, p.hkv, tid, e);
                fv[e] = fetch(2u, w.bi, j0 + BLK, p.tk, w.kv, p.hkv, tid, e);
            }
        }
        workgroupBarrier();
        scores0(q0, q1, q2, q3, g);
        workgroupBarrier();
        let st = softmax_step(m, l, i, j0 + c0, b, pb, g, lane, row);
        m = st.m;
        l = st.l;
        let corr = st.corr;
        workgroupBarrier();
        // P V: 16 x 64 probabilities times the 64 x 64 values, into the scratch.
        let p0 = frag_p(g, 0u);
        let p1 = frag_p(g, 1u);
        let p2 = frag_p(g, 2u);
        let p3 = frag_p(g, 3u);
        for (var n = 0u; n < 4u; n++) {
            var acc = coop_mat16x16<f32, C>();
            acc = coopMultiplyAdd(p0, frag_b1(0u, n), acc);
            acc = coopMultiplyAdd(p1, frag_b1(1u, n), acc);
            acc = coopMultiplyAdd(p2, frag_b1(2u, n), acc);
            acc = coopMultiplyAdd(p3, frag_b1(3u, n), acc);
            coopStoreT(acc, &scr[(g * SCR + n * 16u) / 4u], SS4);
        }
        workgroupBarrier();
        o0 = o0 * corr + rd(b);
        o1 = o1 * corr + rd(b + 4u);
        o2 = o2 * corr + rd(b + 8u);
        o3 = o3 * corr + rd(b + 12u);
        o4 = o4 * corr + rd(b + 16u);
        o5 = o5 * corr + rd(b + 20u);
        o6 = o6 * corr + rd(b + 24u);
        o7 = o7 * corr + rd(b + 28u);
    }
    workgroupBarrier();
    xch[g * 32u + lane] = l;
    workgroupBarrier();
    let lt = l + xch[g * 32u + (lane ^ 16u)];   // the same sum in both lanes
    if (w.ok && i < p.tq) {
        let at = row_at(w.bi, i, p.tq, w.h, p.hq) + c0 / 4u;
        let s = 1.0 / lt;
        let os = array<vec4<f32>, 8>(o0, o1, o2, o3, o4, o5, o6, o7);
        for (var e = 0u; e < 8u; e++) {
            if (c0 / 4u + e < D4) {
                o[at + e] = os[e] * s;
            }
        }
        if (lane < 16u) {
            lse[(w.bi * p.hq + w.h) * p.tq + i] = m + log(lt);
        }
    }
}

// ---- attn_fwd_coop_wide: the forward for head dims up to 128 (prompts of 8B-class models)
// Within 48 KB of workgroup memory (44,544 bytes): one staged tile sw of 64 rows of up to
// 128 values (rows of SW halves, zero-padded past the head dim) holds Q, then each step's
// K, then its V (the scores are done with K before V goes in; V's loads are in flight
// during the scores, the next K's during the softmax and P V). Subgroup g holds its 16
// rows of Q as eight 16 x 16 fragments; P V is made 64 columns at a time through the
// scratch; lane l keeps O's row l % 16, columns 64 h + 32 (l / 16) .. + 32 of both halves
// h (16 vec4s). Same formulas, order of sums per column block, mask and dropout as
// attn_fwd_coop; o and lse as it writes them.
const SW: u32 = 136u;     // stride of a staged row (halves)
const SW4: u32 = 34u;
var<workgroup> sw: array<vec4<f16>, 2176>;   // 64 rows of SW

// Slot e (0..16) of thread tid in a stage of 64 rows (from r0) of head hh of q (which 0),
// k (1) or v (2): vec4 t % 32 of row t / 32, t = tid + 128 e; zeros past nt, the head dim
// and the batch.
fn fetch_w(which: u32, bi: u32, r0: u32, nt: u32, hh: u32, nh: u32, tid: u32, e: u32) -> vec4<f32> {
    let t = tid + 128u * e;
    let r = r0 + t / 32u;
    let ch = t % 32u;
    var x = vec4<f32>(0.0);
    if (bi < p.b && r < nt && ch < D4) {
        let at = row_at(bi, r, nt, hh, nh) + ch;
        switch (which) {
            case 0u: { x = q[at]; }
            case 1u: { x = k[at]; }
            default: { x = v[at]; }
        }
    }
    return x;
}

// A fetched slot (times mul) as f16 into sw.
fn put_w(tid: u32, e: u32, x: vec4<f32>, mul: f32) {
    let t = tid + 128u * e;
    sw[((t / 32u) * SW) / 4u + t % 32u] = vec4<f16>(x * mul);
}

// Rows r .. r + 16, columns 16 c .. + 16 of sw (Q's fragment c of a subgroup's rows).
fn frag_qw(r: u32, c: u32) -> coop_mat16x16<f16, A> {
    return coopLoadT<coop_mat16x16<f16, A>>(&sw[(r * SW + c * 16u) / 4u], SW4);
}

// K^T's fragment: head dims 16 c .. + 16 of keys 16 n .. + 16 staged in sw.
fn frag_kw(n: u32, c: u32) -> coop_mat16x16<f16, B> {
    return coopLoad<coop_mat16x16<f16, B>>(&sw[(n * 16u * SW + c * 16u) / 4u], SW4);
}

// V's fragment: keys 16 r .. + 16, head dims 16 c .. + 16 staged in sw.
fn frag_vw(r: u32, c: u32) -> coop_mat16x16<f16, B> {
    return coopLoadT<coop_mat16x16<f16, B>>(&sw[(r * 16u * SW + c * 16u) / 4u], SW4);
}

@compute @workgroup_size(128)
fn attn_fwd_coop_wide(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                      @builtin(local_invocation_index) tid: u32) {
    let w = block_of(wid, nwg, p.tq, p.hq);
    let g = tid / 32u;
    let lane = tid % 32u;
    let lr = lane % 16u;
    let c0 = (lane / 16u) * 32u;     // the lane's first column of a 64-column half
    let i = w.r0 + g * 16u + lr;     // the lane's query
    let b = g * SCR + lr * SS + c0;  // the lane's first scratch value
    let pb = (g * 16u + lr) * SH + c0;
    for (var e = 0u; e < 16u; e++) {   // Q, scaled
        put_w(tid, e, fetch_w(0u, w.bi, w.r0, p.tq, w.h, p.hq, tid, e), p.scale);
    }
    workgroupBarrier();
    let q0 = frag_qw(g * 16u, 0u);
    let q1 = frag_qw(g * 16u, 1u);
    let q2 = frag_qw(g * 16u, 2u);
    let q3 = frag_qw(g * 16u, 3u);
    let q4 = frag_qw(g * 16u, 4u);
    let q5 = frag_qw(g * 16u, 5u);
    let q6 = frag_qw(g * 16u, 6u);
    let q7 = frag_qw(g * 16u, 7u);
    let row = drop_row(w.bi, w.h, i);
    var m = NEG;
    var l = 0.0;
    var os = array<vec4<f32>, 16>();   // O: columns 4 (e % 8) + c0 + 64 (e / 8)
    let end = select(0u, key_end(w.r0), w.ok);
    var fx: array<vec4<f32>, 16>;   // K or V in flight
    if (end > 0u) {
        for (var e = 0u; e < 16u; e++) {
            fx[e] = fetch_w(1u, w.bi, 0u, p.tk, w.kv, p.hkv, tid, e);
        }
    }
    for (var j0 = 0u; j0 < end; j0 += BLK) {
        workgroupBarrier();   // everyone is done with sw (Q or the last V) and s2
        for (var e = 0u; e < 16u; e++) {
            put_w(tid, e, fx[e], 1.0);
            fx[e] = fetch_w(2u, w.bi, j0, p.tk, w.kv, p.hkv, tid, e);
        }
        workgroupBarrier();
        // S = Q K^T: 16 x 64, each fragment a sum over the eight 16-wide head-dim chunks.
        for (var n = 0u; n < 4u; n++) {
            var acc = coop_mat16x16<f32, C>();
            acc = coopMultiplyAdd(q0, frag_kw(n, 0u), acc);
            acc = coopMultiplyAdd(q1, frag_kw(n, 1u), acc);
            acc = coopMultiplyAdd(q2, frag_kw(n, 2u), acc);
            acc = coopMultiplyAdd(q3, frag_kw(n, 3u), acc);
            acc = coopMultiplyAdd(q4, frag_kw(n, 4u), acc);
            acc = coopMultiplyAdd(q5, frag_kw(n, 5u), acc);
            acc = coopMultiplyAdd(q6, frag_kw(n, 6u), acc);
            acc = coopMultiplyAdd(q7, frag_kw(n, 7u), acc);
            coopStoreT(acc, &scr[(g * SCR + n * 16u) / 4u], SS4);
        }
        workgroupBarrier();   // the scores are in the scratch; nobody reads K any more
        for (var e = 0u; e < 16u; e++) {
            put_w(tid, e, fx[e], 1.0);
        }
        if (j0 + BLK < end) {
            for (var e = 0u; e < 16u; e++) {
                fx[e] = fetch_w(1u, w.bi, j0 + BLK, p.tk, w.kv, p.hkv, tid, e);
            }
        }
        let st = softmax_step(m, l, i, j0 + c0, b, pb, g, lane, row);
        m = st.m;
        l = st.l;
        workgroupBarrier();   // P in s2, V in sw
        let p0 = frag_p(g, 0u);
        let p1 = frag_p(g, 1u);
        let p2 = frag_p(g, 2u);
        let p3 = frag_p(g, 3u);
        for (var hf = 0u; hf < 2u; hf++) {
            for (var n = 0u; n < 4u; n++) {
                var acc = coop_mat16x16<f32, C>();
                acc = coopMultiplyAdd(p0, frag_vw(0u, 4u * hf + n), acc);
                acc = coopMultiplyAdd(p1, frag_vw(1u, 4u * hf + n), acc);
                acc = coopMultiplyAdd(p2, frag_vw(2u, 4u * hf + n), acc);
                acc = coopMultiplyAdd(p3, frag_vw(3u, 4u * hf + n), acc);
                coopStoreT(acc, &scr[(g * SCR + n * 16u) / 4u], SS4);
            }
            workgroupBarrier();
            for (var e = 0u; e < 8u; e++) {
                os[8u * hf + e] = os[8u * hf + e] * st.corr + rd(b + 4u * e);
            }
            workgroupBarrier();
        }
    }
    xch[g * 32u + lane] = l;
    workgroupBarrier();
    let lt = l + xch[g * 32u + (lane ^ 16u)];   // the same sum in both lanes
    if (w.ok && i < p.tq) {
        let at = row_at(w.bi, i, p.tq, w.h, p.hq);
        let s = 1.0 / lt;
        for (var e = 0u; e < 16u; e++) {
            let col4 = 16u * (e / 8u) + c0 / 4u + e % 8u;
            if (col4 < D4) {
                o[at + col4] = os[e] * s;
            }
        }
        if (lane < 16u) {
            lse[(w.bi * p.hq + w.h) * p.tq + i] = m + log(lt);
        }
    }
}

@compute @workgroup_size(128)
fn attn_bwd_dq_coop(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                    @builtin(local_invocation_index) tid: u32) {
    let w = block_of(wid, nwg, p.tq, p.hq);
    let g = tid / 32u;
    let lane = tid % 32u;
    let lr = lane % 16u;
    let c0 = (lane / 16u) * 32u;
    let i = w.r0 + g * 16u + lr;
    let b = g * SCR + lr * SS + c0;
    let pb = (g * 16u + lr) * SH + c0;
    stage(0u, 0u, w.bi, w.r0, p.tq, w.h, p.hq, p.scale, tid);   // Q, scaled
    stage(3u, 1u, w.bi, w.r0, p.tq, w.h, p.hq, 1.0, tid);       // dO
    workgroupBarrier();
    let q0 = frag_a0(g * 16u, 0u);
    let q1 = frag_a0(g * 16u, 1u);
    let q2 = frag_a0(g * 16u, 2u);
    let q3 = frag_a0(g * 16u, 3u);
    let d0 = frag_a1(g * 16u, 0u);
    let d1 = frag_a1(g * 16u, 1u);
    let d2 = frag_a1(g * 16u, 2u);
    let d3 = frag_a1(g * 16u, 3u);
    let row = drop_row(w.bi, w.h, i);
    var lse_i = 0.0;
    var delta_i = 0.0;
    if (w.ok && i < p.tq) {
        let at = (w.bi * p.hq + w.h) * p.tq + i;
        lse_i = lse_in[at];
        delta_i = delta_in[at];
    }
    var g0 = coop_mat16x16<f32, C>();
    var g1 = coop_mat16x16<f32, C>();
    var g2 = coop_mat16x16<f32, C>();
    var g3 = coop_mat16x16<f32, C>();
    let end = select(0u, key_end(w.r0), w.ok);
    var fk: array<vec4<f32>, 8>;   // the next step's K and V
    var fv: array<vec4<f32>, 8>;
    if (end > 0u) {
        for (var e = 0u; e < 8u; e++) {
            fk[e] = fetch(1u, w.bi, 0u, p.tk, w.kv, p.hkv, tid, e);
            fv[e] = fetch(2u, w.bi, 0u, p.tk, w.kv, p.hkv, tid, e);
        }
    }
    for (var j0 = 0u; j0 < end; j0 += BLK) {
        workgroupBarrier();   // everyone is done with s0, s1
        for (var e = 0u; e < 8u; e++) {
            put(0u, tid, e, fk[e], 1.0);
            put(1u, tid, e, fv[e], 1.0);
        }
        if (j0 + BLK < end) {
            for (var e = 0u; e < 8u; e++) {
                fk[e] = fetch(1u, w.bi, j0 + BLK, p.tk, w.kv, p.hkv, tid, e);
                fv[e] = fetch(2u, w.bi, j0 + BLK, p.tk, w.kv, p.hkv, tid, e);
            }
        }
        workgroupBarrier();
        scores0(q0, q1, q2, q3, g);   // S
        workgroupBarrier();
        let j = j0 + c0;
        let zero = vec4<f32>(0.0);
        let p0 = select(zero, exp(rd(b) - lse_i), seen_keys(i, j));
        let p1 = select(zero, exp(rd(b + 4u) - lse_i), seen_keys(i, j + 4u));
        let p2 = select(zero, exp(rd(b + 8u) - lse_i), seen_keys(i, j + 8u));
        let p3 = select(zero, exp(rd(b + 12u) - lse_i), seen_keys(i, j + 12u));
        let p4 = select(zero, exp(rd(b + 16u) - lse_i), seen_keys(i, j + 16u));
        let p5 = select(zero, exp(rd(b + 20u) - lse_i), seen_keys(i, j + 20u));
        let p6 = select(zero, exp(rd(b + 24u) - lse_i), seen_keys(i, j + 24u));
        let p7 = select(zero, exp(rd(b + 28u) - lse_i), seen_keys(i, j + 28u));
        workgroupBarrier();
        scores1(d0, d1, d2, d3, g);   // dP
        workgroupBarrier();
        put2(pb, p0 * (z_keys(row, j) * rd(b) - delta_i));
        put2(pb + 4u, p1 * (z_keys(row, j + 4u) * rd(b + 4u) - delta_i));
        put2(pb + 8u, p2 * (z_keys(row, j + 8u) * rd(b + 8u) - delta_i));
        put2(pb + 12u, p3 * (z_keys(row, j + 12u) * rd(b + 12u) - delta_i));
        put2(pb + 16u, p4 * (z_keys(row, j + 16u) * rd(b + 16u) - delta_i));
        put2(pb + 20u, p5 * (z_keys(row, j + 20u) * rd(b + 20u) - delta_i));
        put2(pb + 24u, p6 * (z_keys(row, j + 24u) * rd(b + 24u) - delta_i));
        put2(pb + 28u, p7 * (z_keys(row, j + 28u) * rd(b + 28u) - delta_i));
        workgroupBarrier();
        // dQ += dS K: 16 x 64 dS times the 64 x 64 keys.
        for (var c = 0u; c < 4u; c++) {
            let a = frag_p(g, c);
            g0 = coopMultiplyAdd(a, frag_b0(c, 0u), g0);
            g1 = coopMultiplyAdd(a, frag_b0(c, 1u), g1);
            g2 = coopMultiplyAdd(a, frag_b0(c, 2u), g2);
            g3 = coopMultiplyAdd(a, frag_b0(c, 3u), g3);
        }
    }
    workgroupBarrier();
    to_scratch(g, g0, g1, g2, g3);
    workgroupBarrier();
    if (w.ok && i < p.tq) {
        let at = row_at(w.bi, i, p.tq, w.h, p.hq) + c0 / 4u;
        for (var e = 0u; e < 8u; e++) {
            if (c0 / 4u + e < D4) {
                dq[at + e] = rd(b + 4u * e) * p.scale;
            }
        }
    }
}

@compute @workgroup_size(128)
fn attn_bwd_dkv_coop(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                     @builtin(local_invocation_index) tid: u32) {
    let w = block_of(wid, nwg, p.tk, p.hkv);
    let g = tid / 32u;
    let lane = tid % 32u;
    let lr = lane % 16u;
    let c0 = (lane / 16u) * 32u;
    let j = w.r0 + g * 16u + lr;     // the lane's key
    let b = g * SCR + lr * SS + c0;
    let pb = (g * 16u + lr) * SH + c0;
    stage(1u, 0u, w.bi, w.r0, p.tk, w.h, p.hkv, p.scale, tid);   // K, scaled
    stage(2u, 1u, w.bi, w.r0, p.tk, w.h, p.hkv, 1.0, tid);       // V
    workgroupBarrier();
    let k0 = frag_a0(g * 16u, 0u);
    let k1 = frag_a0(g * 16u, 1u);
    let k2 = frag_a0(g * 16u, 2u);
    let k3 = frag_a0(g * 16u, 3u);
    let v0 = frag_a1(g * 16u, 0u);
    let v1 = frag_a1(g * 16u, 1u);
    let v2 = frag_a1(g * 16u, 2u);
    let v3 = frag_a1(g * 16u, 3u);
    var gk0 = coop_mat16x16<f32, C>();
    var gk1 = coop_mat16x16<f32, C>();
    var gk2 = coop_mat16x16<f32, C>();
    var gk3 = coop_mat16x16<f32, C>();
    var gv0 = coop_mat16x16<f32, C>();
    var gv1 = coop_mat16x16<f32, C>();
    var gv2 = coop_mat16x16<f32, C>();
    var gv3 = coop_mat16x16<f32, C>();
    // The first query that can see the block's first key.
    var first = 0u;
    if (p.causal != 0u && w.r0 + p.tq > p.tk) {
        first = w.r0 + p.tq - p.tk;
    }
    let group = p.hq / p.hkv;
    // Steps: the group's query heads in order, each from `first`, 64 queries a step.
    let per_head = (p.tq - first + BLK - 1u) / BLK;
    let steps = select(0u, group * per_head, w.ok);
    var fq: array<vec4<f32>, 8>;   // the next step's Q and dO, and (tid < 64) lse, delta
    var fo: array<vec4<f32>, 8>;
    var fs = vec2<f32>(0.0);
    if (steps > 0u) {
        for (var e = 0u; e < 8u; e++) {
            fq[e] = fetch(0u, w.bi, first, p.tq, w.h * group, p.hq, tid, e);
            fo[e] = fetch(3u, w.bi, first, p.tq, w.h * group, p.hq, tid, e);
        }
        fs = stats(w.bi, w.h * group, first, tid);
    }
    for (var st = 0u; st < steps; st++) {
        let i0 = first + (st % per_head) * BLK;
        workgroupBarrier();   // everyone is done with s0, s1, s2 and xch
        for (var e = 0u; e < 8u; e++) {
            put(0u, tid, e, fq[e], 1.0);
            put(1u, tid, e, fo[e], 1.0);
        }
        if (tid < BLK) {
            xch[tid] = fs.x;
            xch[BLK + tid] = fs.y;
        }
        if (st + 1u < steps) {
            let hn = w.h * group + (st + 1u) / per_head;
            let in0 = first + ((st + 1u) % per_head) * BLK;
            for (var e = 0u; e < 8u; e++) {
                fq[e] = fetch(0u, w.bi, in0, p.tq, hn, p.hq, tid, e);
                fo[e] = fetch(3u, w.bi, in0, p.tq, hn, p.hq, tid, e);
            }
            fs = stats(w.bi, hn, in0, tid);
        }
        workgroupBarrier();
        scores0(k0, k1, k2, k3, g);   // S^T: the lane's key against 32 queries
        workgroupBarrier();
        let i = i0 + c0;
        let h = w.h * group + st / per_head;
        let z0 = z_queries(w.bi, h, i, j);
        let z1 = z_queries(w.bi, h, i + 4u, j);
        let z2 = z_queries(w.bi, h, i + 8u, j);
        let z3 = z_queries(w.bi, h, i + 12u, j);
        let z4 = z_queries(w.bi, h, i + 16u, j);
        let z5 = z_queries(w.bi, h, i + 20u, j);
        let z6 = z_queries(w.bi, h, i + 24u, j);
        let z7 = z_queries(w.bi, h, i + 28u, j);
        let zero = vec4<f32>(0.0);
        let p0 = select(zero, exp(rd(b) - rd_x(c0)), seen_queries(i, j));
        let p1 = select(zero, exp(rd(b + 4u) - rd_x(c0 + 4u)), seen_queries(i + 4u, j));
        let p2 = select(zero, exp(rd(b + 8u) - rd_x(c0 + 8u)), seen_queries(i + 8u, j));
        let p3 = select(zero, exp(rd(b + 12u) - rd_x(c0 + 12u)), seen_queries(i + 12u, j));
        let p4 = select(zero, exp(rd(b + 16u) - rd_x(c0 + 16u)), seen_queries(i + 16u, j));
        let p5 = select(zero, exp(rd(b + 20u) - rd_x(c0 + 20u)), seen_queries(i + 20u, j));
        let p6 = select(zero, exp(rd(b + 24u) - rd_x(c0 + 24u)), seen_queries(i + 24u, j));
        let p7 = select(zero, exp(rd(b + 28u) - rd_x(c0 + 28u)), seen_queries(i + 28u, j));
        put2(pb, p0 * z0);
        put2(pb + 4u, p1 * z1);
        put2(pb + 8u, p2 * z2);
        put2(pb + 12u, p3 * z3);
        put2(pb + 16u, p4 * z4);
        put2(pb + 20u, p5 * z5);
        put2(pb + 24u, p6 * z6);
        put2(pb + 28u, p7 * z7);
        workgroupBarrier();
        scores1(v0, v1, v2, v3, g);   // dP^T
        // dV += P^T dO: 16 x 64 probabilities times the 64 x 64 dO rows.
        for (var c = 0u; c < 4u; c++) {
            let a = frag_p(g, c);
            gv0 = coopMultiplyAdd(a, frag_b1(c, 0u), gv0);
            gv1 = coopMultiplyAdd(a, frag_b1(c, 1u), gv1);
            gv2 = coopMultiplyAdd(a, frag_b1(c, 2u), gv2);
            gv3 = coopMultiplyAdd(a, frag_b1(c, 3u), gv3);
        }
        workgroupBarrier();
        put2(pb, p0 * (z0 * rd(b) - rd_x(BLK + c0)));
        put2(pb + 4u, p1 * (z1 * rd(b + 4u) - rd_x(BLK + c0 + 4u)));
        put2(pb + 8u, p2 * (z2 * rd(b + 8u) - rd_x(BLK + c0 + 8u)));
        put2(pb + 12u, p3 * (z3 * rd(b + 12u) - rd_x(BLK + c0 + 12u)));
        put2(pb + 16u, p4 * (z4 * rd(b + 16u) - rd_x(BLK + c0 + 16u)));
        put2(pb + 20u, p5 * (z5 * rd(b + 20u) - rd_x(BLK + c0 + 20u)));
        put2(pb + 24u, p6 * (z6 * rd(b + 24u) - rd_x(BLK + c0 + 24u)));
        put2(pb + 28u, p7 * (z7 * rd(b + 28u) - rd_x(BLK + c0 + 28u)));
        workgroupBarrier();
        // dK += dS^T Q: 16 x 64 dS^T times the 64 x 64 query rows.
        for (var c = 0u; c < 4u; c++) {
            let a = frag_p(g, c);
            gk0 = coopMultiplyAdd(a, frag_b0(c, 0u), gk0);
            gk1 = coopMultiplyAdd(a, frag_b0(c, 1u), gk1);
            gk2 = coopMultiplyAdd(a, frag_b0(c, 2u), gk2);
            gk3 = coopMultiplyAdd(a, frag_b0(c, 3u), gk3);
        }
    }
    workgroupBarrier();
    to_scratch(g, gk0, gk1, gk2, gk3);
    workgroupBarrier();
    let live = w.ok && j < p.tk;
    let at = row_at(w.bi, j, p.tk, w.h, p.hkv) + c0 / 4u;
    if (live) {
        for (var e = 0u; e < 8u; e++) {
            if (c0 / 4u + e < D4) {
                dk[at + e] = rd(b + 4u * e) * p.scale;
            }
        }
    }
    workgroupBarrier();
    to_scratch(g, gv0, gv1, gv2, gv3);
    workgroupBarrier();
    if (live) {
        for (var e = 0u; e < 8u; e++) {
            if (c0 / 4u + e < D4) {
                dv[at + e] = rd(b + 4u * e);
            }
        }
    }
}

// Four staged statistics from index at of xch.
fn rd_x(at: u32) -> vec4<f32> {
    return vec4<f32>(xch[at], xch[at + 1u], xch[at + 2u], xch[at + 3u]);
}
