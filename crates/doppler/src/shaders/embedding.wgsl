// Embedding: gather forward, deterministic scatter-add backward.
//   table (V, H) f32, or f16 read as packed pairs (no shader-f16 feature needed);
//   ids (N) u32; out / dout (N, H) f32.
// Forward, embed_fwd / embed_fwd_f16, one thread per output element (linear grid, 2-D past
// 65535 workgroups): out[n, h] = table[ids[n], h]. An id >= V is counted in `flag` (the
// host reports it as an error) and its row is written as zeros.
//
// Backward: dtable[v, :] (+)= sum over positions n with ids[n] == v of dout[n, :], summed
// in increasing n, so the result is the same bits on every run (no float atomics):
//   embed_count     one thread per position: counts[v] = number of positions with id v
//                   (integer atomics: exact, order-free)
//   embed_scan      one workgroup: offsets = exclusive scan of counts; seg_offsets =
//                   exclusive scan of the segment counts (ids seen more than S times are cut
//                   into segments of S positions so that one hot id is summed in parallel)
//   embed_sort      one workgroup: stable counting sort of positions by id into `sorted`,
//                   256 positions at a time (rank among equal ids within the batch of 256)
//   embed_segments  one thread per id: (start, length) of each of its segments in `sorted`
//   embed_partial   one workgroup per segment: partial[s, :] = sum of its <= S rows of dout
//   embed_reduce    one thread per (v, h): ids seen at most S times sum their dout rows
//                   directly, the others their segments' partials, each in order.

struct Params {
    n: u32,      // positions
    h: u32,      // hidden size
    v: u32,      // vocabulary
    _pad: u32,
}

override WG: u32 = 256u;
override ACCUMULATE: bool = false;   // embed_reduce: add into dtable instead of overwriting
const S: u32 = 32u;                  // positions per segment
const INVALID: u32 = 0xffffffffu;

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> ids: array<u32>;
@group(0) @binding(2) var<storage, read> table: array<f32>;
@group(0) @binding(3) var<storage, read> table16: array<u32>;          // f16 pairs
@group(0) @binding(4) var<storage, read_write> out: array<f32>;
@group(0) @binding(5) var<storage, read_write> flag: array<atomic<u32>>;
@group(0) @binding(6) var<storage, read_write> counts: array<atomic<u32>>;     // (V)
@group(0) @binding(7) var<storage, read_write> offsets: array<u32>;            // (V + 1)
@group(0) @binding(8) var<storage, read_write> seg_offsets: array<u32>;        // (V + 1)
@group(0) @binding(9) var<storage, read_write> running: array<u32>;            // (V), zeroed
@group(0) @binding(10) var<storage, read_write> sorted: array<u32>;            // (N)
@group(0) @binding(11) var<storage, read_write> segs: array<vec2<u32>>;        // (start, len)
@group(0) @binding(12) var<storage, read> dout: array<f32>;
@group(0) @binding(13) var<storage, read_write> partial: array<f32>;           // (segments, H)
@group(0) @binding(14) var<storage, read_write> dtable: array<f32>;            // (V, H)

var<workgroup> wg_a: array<u32, WG>;
var<workgroup> wg_b: array<u32, WG>;

fn flat_index(wid: vec3<u32>, nwg: vec3<u32>, lid: u32) -> u32 {
    return (wid.x + wid.y * nwg.x) * WG + lid;
}

fn check_id(n: u32, id: u32) -> bool {
    if (id < p.v) { return true; }
    atomicAdd(&flag[0], 1u);
    atomicMax(&flag[1], 0xffffffffu - n);   // keeps the first bad position
    return false;
}

@compute @workgroup_size(WG)
fn embed_fwd(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
             @builtin(local_invocation_index) lid: u32) {
    let i = flat_index(wid, nwg, lid);
    if (i >= p.n * p.h) { return; }
    let n = i / p.h;
    let id = ids[n];
    var val = 0.0;
    // One thread per row reports; all of the row's threads see the same id.
    if (id < p.v) { val = table[id * p.h + i % p.h]; } else if (i % p.h == 0u) { check_id(n, id); }
    out[i] = val;
}

@compute @workgroup_size(WG)
fn embed_fwd_f16(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                 @builtin(local_invocation_index) lid: u32) {
    let i = flat_index(wid, nwg, lid);
    if (i >= p.n * p.h) { return; }
    let n = i / p.h;
    let id = ids[n];
    var val = 0.0;
    if (id < p.v) {
        let e = id * p.h + i % p.h;
        val = unpack2x16float(table16[e / 2u])[e % 2u];
    } else if (i % p.h == 0u) {
        check_id(n, id);
    }
    out[i] = val;
}

@compute @workgroup_size(WG)
fn embed_count(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
               @builtin(local_invocation_index) lid: u32) {
    let n = flat_index(wid, nwg, lid);
    if (n >= p.n) { return; }
    let id = ids[n];
    if (check_id(n, id)) { atomicAdd(&counts[id], 1u); }
}

fn segments_of(c: u32) -> u32 {
    return select(0u, (c + S - 1u) / S, c > S);
}

@compute @workgroup_size(WG)
fn embed_scan(@builtin(local_invocation_index) lid: u32) {
    // Thread lid owns ids [lo, hi): block sums, a scan over the WG block sums, then the
    // per-id prefix within each block.
    let per = (p.v + WG - 1u) / WG;
    let lo = min(lid * per, p.v);
    let hi = min(lo + per, p.v);
    var c = 0u;
    var sg = 0u;
    for (var v = lo; v < hi; v++) {
        let k = atomicLoad(&counts[v]);
        c += k;
        sg += segments_of(k);
    }
    wg_a[lid] = c;
    wg_b[lid] = sg;
    workgroupBarrier();
    if (lid == 0u) {
        var ca = 0u;
        var sa = 0u;
        for (var t = 0u; t < WG; t++) {
            let x = wg_a[t];
            let y = wg_b[t];
            wg_a[t] = ca;
            wg_b[t] = sa;
            ca += x;
            sa += y;
        }
        offsets[p.v] = ca;
        seg_offsets[p.v] = sa;
    }
    workgroupBarrier();
    var oa = wg_a[lid];
    var sa = wg_b[lid];
    for (var v = lo; v < hi; v++) {
        let k = atomicLoad(&counts[v]);
        offsets[v] = oa;
        seg_offsets[v] = sa;
        oa += k;
        sa += segments_of(k);
    }
}

@compute @workgroup_size(WG)
fn embed_sort(@builtin(local_invocation_index) lid: u32) {
    for (var base = 0u; base < p.n; base += WG) {
        let n = base + lid;
        var id = INVALID;
        if (n < p.n) {
            id = ids[n];
            if (id >= p.v) { id = INVALID; }
        }
        wg_a[lid] = id;
        workgroupBarrier();
        var rank = 0u;
        var last = true;
        for (var j = 0u; j < WG; j++) {
            let same = wg_a[j] == id;
            rank += select(0u, 1u, same && j < lid);
            last = last && !(same && j > lid);
        }
        if (id != INVALID) {
            sorted[offsets[id] + running[id] + rank] = n;
        }
        storageBarrier();
        workgroupBarrier();
        if (id != INVALID && last) {
            running[id] += rank + 1u;
        }
        storageBarrier();
        workgroupBarrier();
    }
}

@compute @workgroup_size(WG)
fn embed_segments(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                  @builtin(local_invocation_index) lid: u32) {
    let v = flat_index(wid, nwg, lid);
    if (v >= p.v) { return; }
    let c = atomicLoad(&counts[v]);
    let k = segments_of(c);
    for (var j = 0u; j < k; j++) {
        segs[seg_offsets[v] + j] = vec2<u32>(offsets[v] + j * S, min(S, c - j * S));
    }
}

@compute @workgroup_size(WG)
fn embed_partial(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                 @builtin(local_invocation_index) lid: u32) {
    let s = wid.x + wid.y * nwg.x;
    if (s >= seg_offsets[p.v]) { return; }   // the grid is an upper bound
    let seg = segs[s];
    for (var h = lid; h < p.h; h += WG) {
        var acc = 0.0;
        for (var i = 0u; i < seg.y; i++) {
            acc += dout[sorted[seg.x + i] * p.h + h];
        }
        partial[s * p.h + h] = acc;
    }
}

@compute @workgroup_size(WG)
fn embed_reduce(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                @builtin(local_invocation_index) lid: u32) {
    let i = flat_index(wid, nwg, lid);
    if (i >= p.v * p.h) { return; }
    let v = i / p.h;
    let h = i % p.h;
    var acc = 0.0;
    if (ACCUMULATE) { acc = dtable[i]; }
    let c = atomicLoad(&counts[v]);
    if (c <= S) {
        let o = offsets[v];
        for (var k = 0u; k < c; k++) {
            acc += dout[sorted[o + k] * p.h + h];
        }
    } else {
        for (var s = seg_offsets[v]; s < seg_offsets[v + 1u]; s++) {
            acc += partial[s * p.h + h];
        }
    }
    dtable[i] = acc;
}
