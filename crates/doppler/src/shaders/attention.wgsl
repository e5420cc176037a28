// Causal (or full) self-attention, flash style: no Tq x Tk score matrix in global memory.
//   q, o   (B, Tq, Hq, D)     k, v, dk, dv  (B, Tk, Hkv, D)     lse, delta  (B, Hq, Tq)
// Grouped-query heads: query head h reads key/value head h / (Hq / Hkv).
// Causal mask with queries at the end of the keys: query i sees key j iff j <= i + Tk - Tq.
//
// Forward, per query row (online softmax over key tiles, scale folded into q):
//   s_j = scale * q.k_j;  m = max_j s_j;  l = sum_j exp(s_j - m);  o = sum_j exp(s_j - m) v_j / l
//   lse = m + log(l) is saved for the backward.
// Backward (recomputes p_ij = exp(s_ij - lse_i), never stores it):
//   delta_i = dO_i . O_i
//   dp_ij = dO_i . v_j;   ds_ij = p_ij (dp_ij - delta_i)
//   dq_i = scale * sum_j ds_ij k_j        (attn_bwd_dq: one thread per query row)
//   dk_j = scale * sum_i ds_ij q_i        (attn_bwd_dkv: one thread per key row; the sums
//   dv_j = sum_i p_ij dO_i                 run over the group's query heads in order)
// Each thread owns one row and sums in index order: no atomics, same bits on every run.
// Grid: linear over (B * heads) * row blocks workgroups (2-D past 65535).
//
// Dropout on the probabilities (threshold > 0): z_ij = drop_scale where the (row, key)
// draw keeps p_ij, else 0 (z = 1 without dropout); l and lse stay the undropped softmax's.
//   o_i = sum_j z_ij p_ij v_j          (p_ij = exp(s_ij - lse_i))
//   delta_i = dO_i . O_i  (= sum_j p_ij z_ij dp_ij, so the formula stands)
//   ds_ij = p_ij (z_ij dp_ij - delta_i);   dv_j = sum_i z_ij p_ij dO_i
// The mask is never stored: each kernel regenerates it from (seed, row, key).

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

override D4: u32 = 16u;   // head dim / 4
override BC: u32 = 32u;   // rows per staged tile (keys in the forward and dq, queries in dkv)
const BR: u32 = 64u;      // rows per workgroup, one per thread
const D4MAX: u32 = 32u;   // head dim <= 128
const BCMAX: u32 = 64u;
const NEG: f32 = -1e30;

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> q: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> k: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read> v: array<vec4<f32>>;
@group(0) @binding(4) var<storage, read_write> o: array<vec4<f32>>;
@group(0) @binding(5) var<storage, read_write> lse: array<f32>;
@group(0) @binding(6) var<storage, read> o_in: array<vec4<f32>>;
@group(0) @binding(7) var<storage, read> d_o: array<vec4<f32>>;
@group(0) @binding(8) var<storage, read> lse_in: array<f32>;
@group(0) @binding(9) var<storage, read_write> delta: array<f32>;
@group(0) @binding(10) var<storage, read> delta_in: array<f32>;
@group(0) @binding(11) var<storage, read_write> dq: array<vec4<f32>>;
@group(0) @binding(12) var<storage, read_write> dk: array<vec4<f32>>;
@group(0) @binding(13) var<storage, read_write> dv: array<vec4<f32>>;

// Two staged tiles of BC rows (keys and values, or queries and their dO).
var<workgroup> ta: array<vec4<f32>, BC * D4>;
var<workgroup> tb: array<vec4<f32>, BC * D4>;
var<workgroup> ra: array<f32, BC>;   // per staged row: lse (dkv)
var<workgroup> rb: array<f32, BC>;   // per staged row: delta (dkv)

fn group_id(wid: vec3<u32>, nwg: vec3<u32>) -> u32 {
    return wid.x + wid.y * nwg.x;
}

// What one workgroup covers: `rows` rows from r0 of head h (of nh heads, rows of length nt)
// in batch bi; kv is the key/value head of a query head (h itself when nh is Hkv).
struct Block {
    bi: u32,
    h: u32,
    kv: u32,
    r0: u32,
    ok: bool,
}

fn block_of(wid: vec3<u32>, nwg: vec3<u32>, rows: u32, nt: u32, nh: u32) -> Block {
    let blocks = (nt + rows - 1u) / rows;
    let g = group_id(wid, nwg);
    let bh = g / blocks;
    let h = bh % nh;
    return Block(bh / nh, h, h / (nh / p.hkv), (g % blocks) * rows, bh < p.b * nh);
}

// First vec4 of row t of head h in a (B, T, H, D) tensor.
fn row_at(bi: u32, t: u32, nt: u32, h: u32, nh: u32) -> u32 {
    return ((bi * nt + t) * nh + h) * D4;
}

// PCG-style integer hash (O'Neill's PCG output permutation over an LCG step), as
// dropout.wgsl's.
fn pcg(v: u32) -> u32 {
    let state = v * 747796405u + 2891336453u;
    let word = ((state >> ((state >> 28u) + 4u)) ^ state) * 277803737u;
    return (word >> 22u) ^ word;
}

// Dropout's hash of score row (bi, h, i): its draws for key j are drop_z(drop_row(..), j).
fn drop_row(bi: u32, h: u32, i: u32) -> u32 {
    return pcg(((bi * p.hq + h) * p.tq + i) ^ pcg(p.seed_lo));
}

// z_ij: drop_scale where p_ij is kept, 0 where dropped; 1 without dropout.
fn drop_z(row: u32, j: u32) -> f32 {
    if (p.threshold == 0u) {
        return 1.0;
    }
    return select(0.0, p.drop_scale, (pcg(row ^ pcg(j ^ p.seed_hi)) >> 8u) >= p.threshold);
}

// Whether query i may see key j.
fn visible(i: u32, j: u32) -> bool {
    return j < p.tk && (p.causal == 0u || j <= i + p.tk - p.tq);
}

// Stages rows j0 .. j0 + BC of key/value head hk (zeros past the end).
fn stage_kv(bi: u32, hk: u32, j0: u32, lid: u32) {
    for (var t = lid; t < BC * D4; t += BR) {
        let j = j0 + t / D4;
        var a = vec4<f32>(0.0);
        var b = vec4<f32>(0.0);
        if (j < p.tk) {
            let at = row_at(bi, j, p.tk, hk, p.hkv) + t % D4;
            a = k[at];
            b = v[at];
        }
        ta[t] = a;
        tb[t] = b;
    }
}

// Keys a block of queries starting at i0 can see: [0, end).
fn key_end(i0: u32) -> u32 {
    if (p.causal == 0u) {
        return p.tk;
    }
    return min(p.tk, i0 + BR + p.tk - p.tq);
}

@compute @workgroup_size(BR)
fn attn_fwd(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
            @builtin(local_invocation_index) lid: u32) {
    let w = block_of(wid, nwg, BR, p.tq, p.hq);
    let bi = w.bi;
    let h = w.h;
    let hk = w.kv;
    let i0 = w.r0;
    let i = i0 + lid;
    // No early return: the barriers below must stay in uniform control flow.
    let live = w.ok && i < p.tq;
    var qr: array<vec4<f32>, D4MAX>;
    var acc: array<vec4<f32>, D4MAX>;
    if (live) {
        let at = row_at(bi, i, p.tq, h, p.hq);
        for (var d = 0u; d < D4; d++) {
            qr[d] = q[at + d] * p.scale;
            acc[d] = vec4<f32>(0.0);
        }
    }
    var m = NEG;
    var l = 0.0;
    var s: array<f32, BCMAX>;
    let row = drop_row(bi, h, i);
    let end = select(0u, key_end(i0), w.ok);
    for (var j0 = 0u; j0 < end; j0 += BC) {
        stage_kv(bi, hk, j0, lid);
        workgroupBarrier();
        if (live) {
            var mb = m;
            var any = false;
            for (var c = 0u; c < BC; c++) {
                var x = NEG;
                if (visible(i, j0 + c)) {
                    var dot = vec4<f32>(0.0);
                    for (var d = 0u; d < D4; d++) {
                        dot += qr[d] * ta[c * D4 + d];
                    }
                    x = dot.x + dot.y + dot.z + dot.w;
                    mb = max(mb, x);
                    any = true;
                }
                s[c] = x;
            }
            if (any) {
                let corr = exp(m - mb);
                l *= corr;
                for (var d = 0u; d < D4; d++) {
                    acc[d] *= corr;
                }
                for (var c = 0u; c < BC; c++) {
                    if (s[c] > NEG) {
                        let pc = exp(s[c] - mb);
                        l += pc;
                        let pz = pc * drop_z(row, j0 + c);
                        for (var d = 0u; d < D4; d++) {
                            acc[d] += pz * tb[c * D4 + d];
                        }
                    }
                }
                m = mb;
            }
        }
        workgroupBarrier();
    }
    if (live) {
        let at = row_at(bi, i, p.tq, h, p.hq);
        let inv = 1.0 / l;
        for (var d = 0u; d < D4; d++) {
            o[at + d] = acc[d] * inv;
        }
        lse[(bi * p.hq + h) * p.tq + i] = m + log(l);
    }
}

// delta = rowsum(dO * O), one thread per (b, h, i).   Grid: cover B * Hq * Tq threads.
@compute @workgroup_size(BR)
fn attn_delta(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
              @builtin(local_invocation_index) lid: u32) {
    let r = group_id(wid, nwg) * BR + lid;
    if (r >= p.b * p.hq * p.tq) {
        return;
    }
    let i = r % p.tq;
    let h = (r / p.tq) % p.hq;
    let bi = r / (p.tq * p.hq);
    let at = row_at(bi, i, p.tq, h, p.hq);
    var acc = vec4<f32>(0.0);
    for (var d = 0u; d < D4; d++) {
        acc += d_o[at + d] * o_in[at + d];
    }
    delta[r] = acc.x + acc.y + acc.z + acc.w;
}

@compute @workgroup_size(BR)
fn attn_bwd_dq(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
               @builtin(local_invocation_index) lid: u32) {
    let w = block_of(wid, nwg, BR, p.tq, p.hq);
    let bi = w.bi;
    let h = w.h;
    let hk = w.kv;
    let i0 = w.r0;
    let i = i0 + lid;
    let live = w.ok && i < p.tq;
    var qr: array<vec4<f32>, D4MAX>;
    var gr: array<vec4<f32>, D4MAX>;
    var acc: array<vec4<f32>, D4MAX>;
    var lse_i = 0.0;
    var delta_i = 0.0;
    let at = row_at(bi, i, p.tq, h, p.hq);
    if (live) {
        for (var d = 0u; d < D4; d++) {
            qr[d] = q[at + d] * p.scale;
            gr[d] = d_o[at + d];
            acc[d] = vec4<f32>(0.0);
        }
        let r = (bi * p.hq + h) * p.tq + i;
        lse_i = lse_in[r];
        delta_i = delta_in[r];
    }
    let row = drop_row(bi, h, i);
    let end = select(0u, key_end(i0), w.ok);
    for (var j0 = 0u; j0 < end; j0 += BC) {
        stage_kv(bi, hk, j0, lid);
        workgroupBarrier();
        if (live) {
            for (var c = 0u; c < BC; c++) {
                if (visible(i, j0 + c)) {
                    var sd = vec4<f32>(0.0);
                    var pd = vec4<f32>(0.0);
                    for (var d = 0u; d < D4; d++) {
                        sd += qr[d] * ta[c * D4 + d];
                        pd += gr[d] * tb[c * D4 + d];
                    }
                    let pij = exp(sd.x + sd.y + sd.z + sd.w - lse_i);
                    let z = drop_z(row, j0 + c);
                    let ds = pij * (z * (pd.x + pd.y + pd.z + pd.w) - delta_i);
                    for (var d = 0u; d < D4; d++) {
                        acc[d] += ds * ta[c * D4 + d];
                    }
                }
            }
        }
        workgroupBarrier();
    }
    if (live) {
        for (var d = 0u; d < D4; d++) {
            dq[at + d] = acc[d] * p.scale;
        }
    }
}

@compute @workgroup_size(BR)
fn attn_bwd_dkv(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                @builtin(local_invocation_index) lid: u32) {
    let w = block_of(wid, nwg, BR, p.tk, p.hkv);
    let bi = w.bi;
    let hk = w.h;
    let j0 = w.r0;
    let ok = w.ok;
    let j = j0 + lid;
    let live = ok && j < p.tk;
    var kr: array<vec4<f32>, D4MAX>;
    var vr: array<vec4<f32>, D4MAX>;
    var gk: array<vec4<f32>, D4MAX>;
    var gv: array<vec4<f32>, D4MAX>;
    let at = row_at(bi, j, p.tk, hk, p.hkv);
    if (live) {
        for (var d = 0u; d < D4; d++) {
            kr[d] = k[at + d] * p.scale;
            vr[d] = v[at + d];
            gk[d] = vec4<f32>(0.0);
            gv[d] = vec4<f32>(0.0);
        }
    }
    // First query that sees key j0 (causal): i + tk - tq >= j0.
    var first = 0u;
    if (p.causal != 0u && j0 + p.tq > p.tk) {
        first = (j0 + p.tq - p.tk) / BC * BC;
    }
    let group = p.hq / p.hkv;
    let hend = select(0u, group, ok);
    for (var gi = 0u; gi < hend; gi++) {
        let h = hk * group + gi;
        for (var i0 = first; i0 < p.tq; i0 += BC) {
            for (var t = lid; t < BC * D4; t += BR) {
                let i = i0 + t / D4;
                var a = vec4<f32>(0.0);
                var b = vec4<f32>(0.0);
                if (i < p.tq) {
                    let qa = row_at(bi, i, p.tq, h, p.hq) + t % D4;
                    a = q[qa];
                    b = d_o[qa];
                }
                ta[t] = a;
                tb[t] = b;
            }
            for (var t = lid; t < BC; t += BR) {
                let i = i0 + t;
                var a = 0.0;
                var b = 0.0;
                if (i < p.tq) {
                    let r = (bi * p.hq + h) * p.tq + i;
                    a = lse_in[r];
                    b = delta_in[r];
                }
                ra[t] = a;
                rb[t] = b;
            }
            workgroupBarrier();
            if (live) {
                for (var c = 0u; c < BC; c++) {
                    let i = i0 + c;
                    if (i < p.tq && visible(i, j)) {
                        var sd = vec4<f32>(0.0);
                        var pd = vec4<f32>(0.0);
                        for (var d = 0u; d < D4; d++) {
                            sd += kr[d] * ta[c * D4 + d];
                            pd += vr[d] * tb[c * D4 + d];
                        }
                        let pij = exp(sd.x + sd.y + sd.z + sd.w - ra[c]);
                        let z = drop_z(drop_row(bi, h, i), j);
                        let ds = pij * (z * (pd.x + pd.y + pd.z + pd.w) - rb[c]);
                        let pz = pij * z;
                        for (var d = 0u; d < D4; d++) {
                            gv[d] += pz * tb[c * D4 + d];
                            gk[d] += ds * ta[c * D4 + d];
                        }
                    }
                }
            }
            workgroupBarrier();
        }
    }
    if (live) {
        for (var d = 0u; d < D4; d++) {
            dk[at + d] = gk[d] * p.scale;
            dv[at + d] = gv[d];
        }
    }
}

// ---------------------------------------------------------------------------------------
// Tiled path (head dim <= 64; ~30 KB of workgroup memory): 256 threads share tiles of
// scores like a matrix product, so every staged vector feeds several rows. Same formulas.
//   attn_fwd_tiled:      32 query rows per workgroup, 32-key tiles; thread (ty, tx) = (tid/16,
//                        tid%16) scores rows 2ty, 2ty+1 against keys tx, tx+16 and owns
//                        vec4 tx of those two output rows. The 16 threads of a row share
//                        its running max through workgroup memory (online softmax, tile
//                        by tile) and add their shares of its sum at the end.
//   attn_bwd_dq_tiled:   32 query rows, 32-key tiles (2 x 2 scores a thread); dS goes
//                        through workgroup memory.
//   attn_bwd_dkv_tiled:  32 key rows, 32-query tiles (2 x 2 scores a thread) over the
//                        group's heads in order.
// Each step's staged rows (K and V; Q, dO and their statistics in dkv) are fetched into
// registers a step ahead (fetch_rows), so that their loads overlap the step before.
// Sums run in a fixed order per thread: same bits on every run.

const NT: u32 = 256u;
const CH: u32 = 16u;    // vec4 slots per staged row (head dim <= 64)
const CHP: u32 = 17u;   // their stride in workgroup memory: threads reading the same slot of
                        // different rows hit different banks

var<workgroup> sa: array<vec4<f32>, 544>;   // 32 rows of CHP
var<workgroup> sb: array<vec4<f32>, 544>;   // 32 rows
var<workgroup> sc: array<vec4<f32>, 544>;   // 32 rows
var<workgroup> sd: array<vec4<f32>, 544>;   // 32 rows
var<workgroup> sp: array<f32, 1024>;        // scores / probabilities
var<workgroup> sds: array<f32, 1024>;       // dS^T (dkv)
var<workgroup> rs: array<f32, 96>;          // per-row statistics
var<workgroup> pm: array<f32, 512>;         // [row][thread]: partial maxima / sums (forward)

// Stages `rows` rows (from r0) of head hh of a (B, T, H, D) tensor, times `mul`, into
// workgroup array `dst` (0: sa, 1: sb, 2: sc, 3: sd), zero past nt, D or the batch.
// `which` picks the source: 0 q, 1 k, 2 v, 3 dO.
fn stage_rows(which: u32, dst: u32, bi: u32, r0: u32, rows: u32, nt: u32, hh: u32, nh: u32, mul: f32, tid: u32) {
    for (var t = tid; t < rows * CH; t += NT) {
        let r = r0 + t / CH;
        let ch = t % CH;
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
        x *= mul;
        let slot = (t / CH) * CHP + ch;
        switch (dst) {
            case 0u: { sa[slot] = x; }
            case 1u: { sb[slot] = x; }
            case 2u: { sc[slot] = x; }
            default: { sd[slot] = x; }
        }
    }
}

// The two slots (t = tid, tid + 256) of a 32-row stage_rows of `which`, fetched into
// registers a step ahead so that the loads' latency hides behind the step before (zeros
// past nt, past D and past the batch); put_rows writes them where stage_rows would.
fn fetch_rows(which: u32, bi: u32, r0: u32, nt: u32, hh: u32, nh: u32, tid: u32) -> array<vec4<f32>, 2> {
    var x = array<vec4<f32>, 2>(vec4<f32>(0.0), vec4<f32>(0.0));
    for (var e = 0u; e < 2u; e++) {
        let t = tid + NT * e;
        let r = r0 + t / CH;
        let ch = t % CH;
        if (bi < p.b && r < nt && ch < D4) {
            let at = row_at(bi, r, nt, hh, nh) + ch;
            switch (which) {
                case 0u: { x[e] = q[at]; }
                case 1u: { x[e] = k[at]; }
                case 2u: { x[e] = v[at]; }
                default: { x[e] = d_o[at]; }
            }
        }
    }
    return x;
}

fn put_rows(dst: u32, x: array<vec4<f32>, 2>, tid: u32) {
    for (var e = 0u; e < 2u; e++) {
        let t = tid + NT * e;
        let slot = (t / CH) * CHP + t % CH;
        switch (dst) {
            case 0u: { sa[slot] = x[e]; }
            case 1u: { sb[slot] = x[e]; }
            case 2u: { sc[slot] = x[e]; }
            default: { sd[slot] = x[e]; }
        }
    }
}

// (lse, delta) of query i0 + tid of head h, for tid < 32 (zeros past Tq, and otherwise).
fn row_stats(bi: u32, h: u32, i0: u32, tid: u32) -> vec2<f32> {
    if (tid < 32u && bi < p.b && i0 + tid < p.tq) {
        let at = (bi * p.hq + h) * p.tq + i0 + tid;
        return vec2<f32>(lse_in[at], delta_in[at]);
    }
    return vec2<f32>(0.0);
}

// Keys a 32-row query block starting at i0 can see: [0, end).
fn key_end32(i0: u32) -> u32 {
    if (p.causal == 0u) {
        return p.tk;
    }
    return min(p.tk, i0 + 32u + p.tk - p.tq);
}

@compute @workgroup_size(NT)
fn attn_fwd_tiled(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                  @builtin(local_invocation_index) tid: u32) {
    let w = block_of(wid, nwg, 32u, p.tq, p.hq);
    let bi = w.bi;
    let h = w.h;
    let hk = w.kv;
    let i0 = w.r0;
    let ok = w.ok;
    let ty = tid / 16u;
    let tx = tid % 16u;
    stage_rows(0u, 0u, bi, i0, 32u, p.tq, h, p.hq, p.scale, tid);   // Q, scaled -> sa
    // Each row's running max and sum live with its 16 threads (the same max in all 16; the
    // sum of each thread's own columns, added across the 16 at the end).
    var m = vec2<f32>(NEG);
    var l = vec2<f32>(0.0);
    var o0 = vec4<f32>(0.0);
    var o1 = vec4<f32>(0.0);
    let end = select(0u, key_end32(i0), ok);
    let rows = vec2<u32>(drop_row(bi, h, i0 + 2u * ty), drop_row(bi, h, i0 + 2u * ty + 1u));
    var nk = fetch_rows(1u, bi, 0u, p.tk, hk, p.hkv, tid);   // the next step's K and V
    var nv = fetch_rows(2u, bi, 0u, p.tk, hk, p.hkv, tid);
    for (var j0 = 0u; j0 < end; j0 += 32u) {
        put_rows(1u, nk, tid);   // K -> sb
        let vj = nv;
        if (j0 + 32u < end) {
            nk = fetch_rows(1u, bi, j0 + 32u, p.tk, hk, p.hkv, tid);
            nv = fetch_rows(2u, bi, j0 + 32u, p.tk, hk, p.hkv, tid);
        }
        workgroupBarrier();
        var sco: array<vec2<f32>, 2>;   // [row][column tx, tx + 16]
        for (var rr = 0u; rr < 2u; rr++) {
            let r = 2u * ty + rr;
            for (var cc = 0u; cc < 2u; cc++) {
                let c = tx + 16u * cc;
                var s = 0.0;
                for (var ch = 0u; ch < D4; ch++) {
                    s += dot(sa[r * CHP + ch], sb[c * CHP + ch]);
                }
                let i = i0 + r;
                sco[rr][cc] = select(NEG, s, i < p.tq && visible(i, j0 + c));
            }
            pm[r * 16u + tx] = max(sco[rr].x, sco[rr].y);
        }
        workgroupBarrier();
        // Every thread of a row reads the row's 16 partial maxima in the same order.
        var corr = vec2<f32>(0.0);
        for (var rr = 0u; rr < 2u; rr++) {
            let r = 2u * ty + rr;
            var mx = m[rr];
            for (var t = 0u; t < 16u; t++) {
                mx = max(mx, pm[r * 16u + t]);
            }
            corr[rr] = exp(m[rr] - mx);
            m[rr] = mx;
            var pr = vec2<f32>(0.0);
            for (var cc = 0u; cc < 2u; cc++) {
                if (sco[rr][cc] > NEG) {
                    pr[cc] = exp(sco[rr][cc] - mx);
                }
                sp[r * 32u + tx + 16u * cc] = pr[cc] * drop_z(rows[rr], j0 + tx + 16u * cc);
            }
            l[rr] = l[rr] * corr[rr] + (pr.x + pr.y);
        }
        put_rows(1u, vj, tid);   // V -> sb (K is done)
        workgroupBarrier();
        o0 *= corr.x;
        o1 *= corr.y;
        for (var c = 0u; c < 32u; c++) {
            let vv = sb[c * CHP + tx];
            o0 += sp[(2u * ty) * 32u + c] * vv;
            o1 += sp[(2u * ty + 1u) * 32u + c] * vv;
        }
        workgroupBarrier();
    }
    // Row sums: each thread's share, added over the row's 16 threads in order.
    pm[(2u * ty) * 16u + tx] = l.x;
    pm[(2u * ty + 1u) * 16u + tx] = l.y;
    workgroupBarrier();
    if (ok) {
        for (var rr = 0u; rr < 2u; rr++) {
            let r = 2u * ty + rr;
            var lt = 0.0;
            for (var t = 0u; t < 16u; t++) {
                lt += pm[r * 16u + t];
            }
            let i = i0 + r;
            if (i < p.tq && tx < D4) {
                o[row_at(bi, i, p.tq, h, p.hq) + tx] = select(o0, o1, rr == 1u) / lt;
            }
            if (i < p.tq && tx == 0u) {
                lse[(bi * p.hq + h) * p.tq + i] = m[rr] + log(lt);
            }
        }
    }
}

@compute @workgroup_size(NT)
fn attn_bwd_dq_tiled(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                     @builtin(local_invocation_index) tid: u32) {
    let w = block_of(wid, nwg, 32u, p.tq, p.hq);
    let bi = w.bi;
    let h = w.h;
    let hk = w.kv;
    let i0 = w.r0;
    let ok = w.ok;
    let ty = tid / 16u;
    let tx = tid % 16u;
    stage_rows(0u, 0u, bi, i0, 32u, p.tq, h, p.hq, p.scale, tid);   // Q, scaled -> sa
    stage_rows(3u, 1u, bi, i0, 32u, p.tq, h, p.hq, 1.0, tid);       // dO -> sb
    var lse_r = vec2<f32>(0.0);
    var delta_r = vec2<f32>(0.0);
    for (var rr = 0u; rr < 2u; rr++) {
        let i = i0 + 2u * ty + rr;
        if (ok && i < p.tq) {
            let at = (bi * p.hq + h) * p.tq + i;
            lse_r[rr] = lse_in[at];
            delta_r[rr] = delta_in[at];
        }
    }
    var g0 = vec4<f32>(0.0);
    var g1 = vec4<f32>(0.0);
    let end = select(0u, key_end32(i0), ok);
    let rows = vec2<u32>(drop_row(bi, h, i0 + 2u * ty), drop_row(bi, h, i0 + 2u * ty + 1u));
    var nk = fetch_rows(1u, bi, 0u, p.tk, hk, p.hkv, tid);   // the next step's K and V
    var nv = fetch_rows(2u, bi, 0u, p.tk, hk, p.hkv, tid);
    for (var j0 = 0u; j0 < end; j0 += 32u) {
        put_rows(2u, nk, tid);   // K -> sc
        put_rows(3u, nv, tid);   // V -> sd
        if (j0 + 32u < end) {
            nk = fetch_rows(1u, bi, j0 + 32u, p.tk, hk, p.hkv, tid);
            nv = fetch_rows(2u, bi, j0 + 32u, p.tk, hk, p.hkv, tid);
        }
        workgroupBarrier();
        // Rows 2ty, 2ty + 1 against keys tx, tx + 16: each staged vec4 read feeds two dots.
        var s = mat2x2<f32>();
        var dp = mat2x2<f32>();
        for (var ch = 0u; ch < D4; ch++) {
            let q0 = sa[(2u * ty) * CHP + ch];
            let q1 = sa[(2u * ty + 1u) * CHP + ch];
            let o0 = sb[(2u * ty) * CHP + ch];
            let o1 = sb[(2u * ty + 1u) * CHP + ch];
            let k0 = sc[tx * CHP + ch];
            let k1 = sc[(tx + 16u) * CHP + ch];
            let v0 = sd[tx * CHP + ch];
            let v1 = sd[(tx + 16u) * CHP + ch];
            s[0] += vec2<f32>(dot(q0, k0), dot(q0, k1));
            s[1] += vec2<f32>(dot(q1, k0), dot(q1, k1));
            dp[0] += vec2<f32>(dot(o0, v0), dot(o0, v1));
            dp[1] += vec2<f32>(dot(o1, v0), dot(o1, v1));
        }
        for (var rr = 0u; rr < 2u; rr++) {
            let r = 2u * ty + rr;
            let i = i0 + r;
            for (var cc = 0u; cc < 2u; cc++) {
                let c = tx + 16u * cc;
                var ds = 0.0;
                if (i < p.tq && visible(i, j0 + c)) {
                    let z = drop_z(rows[rr], j0 + c);
                    ds = exp(s[rr][cc] - lse_r[rr]) * (z * dp[rr][cc] - delta_r[rr]);
                }
                sp[r * 32u + c] = ds;
            }
        }
        workgroupBarrier();
        for (var c = 0u; c < 32u; c++) {
            let kk = sc[c * CHP + tx];
            g0 += sp[(2u * ty) * 32u + c] * kk;
            g1 += sp[(2u * ty + 1u) * 32u + c] * kk;
        }
        workgroupBarrier();
    }
    if (ok && tx < D4) {
        for (var rr = 0u; rr < 2u; rr++) {
            let i = i0 + 2u * ty + rr;
            if (i < p.tq) {
                dq[row_at(bi, i, p.tq, h, p.hq) + tx] = select(g0, g1, rr == 1u) * p.scale;
            }
        }
    }
}

@compute @workgroup_size(NT)
fn attn_bwd_dkv_tiled(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                      @builtin(local_invocation_index) tid: u32) {
    let w = block_of(wid, nwg, 32u, p.tk, p.hkv);
    let bi = w.bi;
    let hk = w.h;
    let j0 = w.r0;
    let ok = w.ok;
    let ty = tid / 16u;
    let tx = tid % 16u;
    stage_rows(1u, 1u, bi, j0, 32u, p.tk, hk, p.hkv, p.scale, tid);   // K, scaled -> sb
    stage_rows(2u, 0u, bi, j0, 32u, p.tk, hk, p.hkv, 1.0, tid);       // V -> sa
    var gk0 = vec4<f32>(0.0);
    var gk1 = vec4<f32>(0.0);
    var gv0 = vec4<f32>(0.0);
    var gv1 = vec4<f32>(0.0);
    var first = 0u;
    if (p.causal != 0u && j0 + p.tq > p.tk) {
        first = (j0 + p.tq - p.tk) / 16u * 16u;
    }
    let group = p.hq / p.hkv;
    // Steps: the group's query heads in order, each from `first`, 32 queries a step; each
    // step's Q, dO, lse and delta are fetched a step ahead.
    let per_head = (p.tq - first + 31u) / 32u;
    let steps = select(0u, group * per_head, ok);
    var nq = fetch_rows(0u, bi, first, p.tq, hk * group, p.hq, tid);
    var no = fetch_rows(3u, bi, first, p.tq, hk * group, p.hq, tid);
    var ns = row_stats(bi, hk * group, first, tid);
    for (var st = 0u; st < steps; st++) {
        let i0 = first + (st % per_head) * 32u;
        let h = hk * group + st / per_head;
        let rows = vec2<u32>(drop_row(bi, h, i0 + tx), drop_row(bi, h, i0 + tx + 16u));
        put_rows(2u, nq, tid);   // Q -> sc
        put_rows(3u, no, tid);   // dO -> sd
        if (tid < 32u) {
            rs[tid] = ns.x;
            rs[32u + tid] = ns.y;
        }
        if (st + 1u < steps) {
            let hn = hk * group + (st + 1u) / per_head;
            let in0 = first + ((st + 1u) % per_head) * 32u;
            nq = fetch_rows(0u, bi, in0, p.tq, hn, p.hq, tid);
            no = fetch_rows(3u, bi, in0, p.tq, hn, p.hq, tid);
            ns = row_stats(bi, hn, in0, tid);
        }
        workgroupBarrier();
        // Keys 2ty, 2ty + 1 against queries tx, tx + 16.
        var s = mat2x2<f32>();
        var dp = mat2x2<f32>();
        for (var ch = 0u; ch < D4; ch++) {
            let k0 = sb[(2u * ty) * CHP + ch];
            let k1 = sb[(2u * ty + 1u) * CHP + ch];
            let v0 = sa[(2u * ty) * CHP + ch];
            let v1 = sa[(2u * ty + 1u) * CHP + ch];
            let q0 = sc[tx * CHP + ch];
            let q1 = sc[(tx + 16u) * CHP + ch];
            let o0 = sd[tx * CHP + ch];
            let o1 = sd[(tx + 16u) * CHP + ch];
            s[0] += vec2<f32>(dot(k0, q0), dot(k0, q1));
            s[1] += vec2<f32>(dot(k1, q0), dot(k1, q1));
            dp[0] += vec2<f32>(dot(v0, o0), dot(v0, o1));
            dp[1] += vec2<f32>(dot(v1, o0), dot(v1, o1));
        }
        for (var kk = 0u; kk < 2u; kk++) {
            let jr = 2u * ty + kk;
            let j = j0 + jr;
            for (var cc = 0u; cc < 2u; cc++) {
                let ir = tx + 16u * cc;
                let i = i0 + ir;
                var pij = 0.0;
                var ds = 0.0;
                if (j < p.tk && i < p.tq && visible(i, j)) {
                    let z = drop_z(rows[cc], j);
                    pij = exp(s[kk][cc] - rs[ir]);
                    ds = pij * (z * dp[kk][cc] - rs[32u + ir]);
                    pij *= z;
                }
                sp[jr * 32u + ir] = pij;
                sds[jr * 32u + ir] = ds;
            }
        }
        workgroupBarrier();
        for (var c = 0u; c < 32u; c++) {
            let dov = sd[c * CHP + tx];
            let qv = sc[c * CHP + tx];
            gv0 += sp[(2u * ty) * 32u + c] * dov;
            gv1 += sp[(2u * ty + 1u) * 32u + c] * dov;
            gk0 += sds[(2u * ty) * 32u + c] * qv;
            gk1 += sds[(2u * ty + 1u) * 32u + c] * qv;
        }
        workgroupBarrier();
    }
    if (ok && tx < D4) {
        for (var kk = 0u; kk < 2u; kk++) {
            let j = j0 + 2u * ty + kk;
            if (j < p.tk) {
                let at = row_at(bi, j, p.tk, hk, p.hkv) + tx;
                dk[at] = select(gk0, gk1, kk == 1u) * p.scale;
                dv[at] = select(gv0, gv1, kk == 1u);
            }
        }
    }
}
