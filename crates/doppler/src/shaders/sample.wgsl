// Tokens chosen on the GPU from rows of logits, the same bits as infer::sample's CPU sampler
// (its greedy choice and its plain draw), so that a batched step's tokens need not come back
// to the host as logits first.
//
//   sample_rows   ids[r] for row r of logits (rows, V), as how[r] = (mode, 1/T bits, r lo,
//                 r hi) asks: mode 0 greedy: the largest finite logit, the lowest id among
//                 equal ones, in f32::total_cmp's order (compared as integer keys of the
//                 bits: no float arithmetic); mode 1 the draw: m the largest finite logit
//                 (subnormals read as 0), each finite logit's weight w = 2^31 e^((x - m) / T)
//                 in fixed point from the draw's tables (infer::sample::draw_weight: y =
//                 (x - m) (1/T) with every step's subnormal flushed, held at -23 or above,
//                 n = -y 2^20 truncated, three table entries of n's bits multiplied as
//                 (a b) >> 31 in that order), the weights' exact sum S (64-bit integers),
//                 the target floor(r S / 2^64), the token the first index whose running sum
//                 passes it; mode 2: 0 written (the host chooses that row).
//                 One workgroup of 256 threads a row. The largest logit (and greedy's
//                 choice) from strided, coalesced reads; the weights' sums by thread t over
//                 the t-th run of ceil(V / 256) logits, the runs' running sums by a parallel
//                 scan, the run holding the target found by every thread at once, then its
//                 weights again 256 at a time, scanned, the first past the target taken.
//                 Sums are exact, so none of this changes which token comes out; the tables
//                 are copied into workgroup memory first (three lookups a weight).

struct Params {
    rows: u32,
    vocab: u32,
    _pad0: u32,
    _pad1: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> logits: array<f32>;
@group(0) @binding(2) var<storage, read> how: array<vec4<u32>>;
@group(0) @binding(3) var<storage, read> table: array<u32>;
@group(0) @binding(4) var<storage, read_write> ids: array<u32>;

// Where the table's second and third parts start (infer::sample::DRAW_TABLE_LEN).
const MID: u32 = 737u;
const LOW: u32 = 1761u;

// infer::sample::DRAW_TABLE_LEN: the tables, copied here for a draw.
const TABLE_LEN: u32 = 1793u;
var<workgroup> wg_table: array<u32, TABLE_LEN>;
// Greedy's keys and ids; a draw's largest logits (as bits) in wg_key.
var<workgroup> wg_key: array<u32, 256>;
var<workgroup> wg_idx: array<u32, 256>;
// 64-bit sums being scanned, (lo, hi).
var<workgroup> wg_lo: array<u32, 256>;
var<workgroup> wg_hi: array<u32, 256>;
// The run holding the target, the sum before it; the token (a draw's last step).
var<workgroup> wg_run: u32;
var<workgroup> wg_before: vec2<u32>;
var<workgroup> wg_pick: u32;

fn finite(x: f32) -> bool {
    return (bitcast<u32>(x) & 0x7f800000u) != 0x7f800000u;
}

// x, or 0 where it is subnormal.
fn flush(x: f32) -> f32 {
    return select(x, 0.0, (bitcast<u32>(x) & 0x7f800000u) == 0u);
}

// f32::total_cmp's order as an unsigned key (finite values > 0).
fn key(x: f32) -> u32 {
    let b = bitcast<u32>(x);
    return select(b | 0x80000000u, ~b, (b & 0x80000000u) != 0u);
}

// (a b) >> 31 for a, b <= 2^31, from 16-bit halves.
fn mul31(a: u32, b: u32) -> u32 {
    let al = a & 0xffffu;
    let ah = a >> 16u;
    let bl = b & 0xffffu;
    let bh = b >> 16u;
    let ll = al * bl;
    let lh = al * bh;
    let hl = ah * bl;
    let mid = (ll >> 16u) + (lh & 0xffffu) + (hl & 0xffffu);
    let lo = (mid << 16u) | (ll & 0xffffu);
    let hi = ah * bh + (lh >> 16u) + (hl >> 16u) + (mid >> 16u);
    return (hi << 1u) | (lo >> 31u);
}

fn weight(x: f32, m: f32, inv: f32) -> u32 {
    if (!finite(x)) {
        return 0u;
    }
    var y = 0.0;
    if (inv != 0.0) {
        y = flush(flush(flush(x) - m) * inv);
    }
    let yc = select(-23.0, y, y > -23.0);
    let n = u32(-(yc * 1048576.0));
    return mul31(mul31(wg_table[n >> 15u], wg_table[MID + ((n >> 5u) & 1023u)]),
                 wg_table[LOW + (n & 31u)]);
}

fn add64(a: vec2<u32>, b: vec2<u32>) -> vec2<u32> {
    let lo = a.x + b.x;
    return vec2<u32>(lo, a.y + b.y + select(0u, 1u, lo < a.x));
}

// a > b, as (lo, hi) pairs.
fn gt64(a: vec2<u32>, b: vec2<u32>) -> bool {
    return a.y > b.y || (a.y == b.y && a.x > b.x);
}

// The high 64 bits of r s (both (lo, hi)), from 16-bit limbs.
fn mulhi64(r: vec2<u32>, s: vec2<u32>) -> vec2<u32> {
    let a = array<u32, 4>(r.x & 0xffffu, r.x >> 16u, r.y & 0xffffu, r.y >> 16u);
    let b = array<u32, 4>(s.x & 0xffffu, s.x >> 16u, s.y & 0xffffu, s.y >> 16u);
    var col = array<u32, 9>(0u, 0u, 0u, 0u, 0u, 0u, 0u, 0u, 0u);
    for (var i = 0u; i < 4u; i++) {
        for (var j = 0u; j < 4u; j++) {
            let t = a[i] * b[j];
            col[i + j] += t & 0xffffu;
            col[i + j + 1u] += t >> 16u;
        }
    }
    var carry = 0u;
    for (var k = 0u; k < 8u; k++) {
        let v = col[k] + carry;
        col[k] = v & 0xffffu;
        carry = v >> 16u;
    }
    return vec2<u32>(col[4] | (col[5] << 16u), col[6] | (col[7] << 16u));
}

// The inclusive running sums of the 256 threads' v in thread order, also left in wg_lo /
// wg_hi (every thread calls it).
fn scan64(lid: u32, v: vec2<u32>) -> vec2<u32> {
    var s = v;
    for (var d = 1u; d < 256u; d <<= 1u) {
        wg_lo[lid] = s.x;
        wg_hi[lid] = s.y;
        workgroupBarrier();
        if (lid >= d) {
            s = add64(s, vec2<u32>(wg_lo[lid - d], wg_hi[lid - d]));
        }
        workgroupBarrier();
    }
    // (Left in wg_lo / wg_hi for every thread to read.)
    wg_lo[lid] = s.x;
    wg_hi[lid] = s.y;
    workgroupBarrier();
    return s;
}

@compute @workgroup_size(256)
fn sample_rows(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
               @builtin(local_invocation_index) lid: u32) {
    let row = wid.x + wid.y * nwg.x;
    if (row >= p.rows) {
        return;
    }
    let h = how[row];
    if (h.x == 2u) {
        if (lid == 0u) {
            ids[row] = 0u;   // (the host chooses this row)
        }
        return;
    }
    let base = row * p.vocab;
    if (h.x == 0u) {
        // Greedy: the largest key, the lowest index among equal ones (key 0: none finite).
        // A thread meets its indices in increasing order and keeps the first of a key.
        var best = 0u;
        var at = 0xffffffffu;
        for (var i = lid; i < p.vocab; i += 256u) {
            let x = logits[base + i];
            if (finite(x) && key(x) > best) {
                best = key(x);
                at = i;
            }
        }
        wg_key[lid] = best;
        wg_idx[lid] = at;
        workgroupBarrier();
        for (var s = 128u; s > 0u; s >>= 1u) {
            if (lid < s) {
                let k = wg_key[lid + s];
                let i = wg_idx[lid + s];
                if (k > wg_key[lid] || (k == wg_key[lid] && i < wg_idx[lid])) {
                    wg_key[lid] = k;
                    wg_idx[lid] = i;
                }
            }
            workgroupBarrier();
        }
        if (lid == 0u) {
            ids[row] = select(wg_idx[0], 0u, wg_key[0] == 0u);
        }
        return;
    }
    // The draw's tables into workgroup memory (read after the barriers below).
    for (var i = lid; i < TABLE_LEN; i += 256u) {
        wg_table[i] = table[i];
    }
    // The largest finite logit (flushed), as a total_cmp key (keys of finite values are
    // ordered as the values; 0: none).
    var best = 0u;
    for (var i = lid; i < p.vocab; i += 256u) {
        let x = logits[base + i];
        if (finite(x)) {
            best = max(best, key(flush(x)));
        }
    }
    wg_key[lid] = best;
    workgroupBarrier();
    for (var s = 128u; s > 0u; s >>= 1u) {
        if (lid < s) {
            wg_key[lid] = max(wg_key[lid], wg_key[lid + s]);
        }
        workgroupBarrier();
    }
    let top = workgroupUniformLoad(&wg_key[0]);
    if (top == 0u) {
        if (lid == 0u) {
            ids[row] = 0u;   // no finite logit
        }
        return;
    }
    // (key's inverse for a finite value: its sign bit was set for x >= 0.)
    let m = bitcast<f32>(select(~top, top & 0x7fffffffu, (top & 0x80000000u) != 0u));
    let inv = bitcast<f32>(h.y);
    // Thread t's run of logits and its weights' sum.
    let per = (p.vocab + 255u) / 256u;
    let c0 = min(lid * per, p.vocab);
    let c1 = min(c0 + per, p.vocab);
    var sum = vec2<u32>(0u, 0u);
    for (var i = c0; i < c1; i++) {
        sum = add64(sum, vec2<u32>(weight(logits[base + i], m, inv), 0u));
    }
    // Running sums to the end of each run: S the last; the run holding the target is the
    // first whose end passes it (the last run if none does, as the serial search had it).
    let end = scan64(lid, sum);
    let goal = mulhi64(h.zw, vec2<u32>(wg_lo[255], wg_hi[255]));
    var before = vec2<u32>(0u, 0u);
    if (lid > 0u) {
        before = vec2<u32>(wg_lo[lid - 1u], wg_hi[lid - 1u]);
    }
    let past = lid == 255u || gt64(end, goal);
    let past_before = lid > 0u && gt64(before, goal);
    if (past && !past_before) {
        wg_run = lid;
        wg_before = before;
    }
    let run_t = workgroupUniformLoad(&wg_run);
    // That run's weights 256 at a time, scanned: the first index whose running sum passes
    // the target (its last index if none does).
    let r0 = min(run_t * per, p.vocab);
    let r1 = min(r0 + per, p.vocab);
    if (lid == 0u) {
        wg_pick = r1 - 1u;
    }
    var run = workgroupUniformLoad(&wg_before);
    for (var b = r0; b < r1; b += 256u) {
        let i = b + lid;
        var w = 0u;
        if (i < r1) {
            w = weight(logits[base + i], m, inv);
        }
        let inc = add64(run, scan64(lid, vec2<u32>(w, 0u)));
        var prev = run;
        if (lid > 0u) {
            prev = add64(run, vec2<u32>(wg_lo[lid - 1u], wg_hi[lid - 1u]));
        }
        if (i < r1 && gt64(inc, goal) && !gt64(prev, goal)) {
            wg_pick = i;
        }
        run = add64(run, vec2<u32>(wg_lo[255], wg_hi[255]));
        // (Every thread read the block's sums before the next block writes them.)
        workgroupBarrier();
    }
    if (lid == 0u) {
        ids[row] = wg_pick;
    }
}
