// Embedding: gather forward, deterministic scatter-add backward.
//   table (V, H) f32, or f16 read as packed pairs (no shader-f16 feature needed);
//   ids (N) u32; out / dout (N, H) f32.
// Forward, embed_fwd (F16: the table is read as f16 pairs), one thread per output element (linear grid, 2-D past
// 65535 workgroups): out[n, h] = table[ids[n], h]. An id >= V is counted in `flag` (the
// host reports it as an error) and its row is written as zeros.
//
// Backward: dtable[v, :] (+)= sum over positions n with ids[n] == v of dout[n, :], summed
// in increasing n, so the result is the same bits on every run (no float atomics). The
// positions are cut into NB blocks of L (a multiple of 256) and stably counting-sorted:
//   embed_count       one thread per position: hist[b, v] = occurrences of v in block b
//                     (integer atomics: exact, order-free)
//   embed_block_scan  one thread per id: hist[b, v] becomes the occurrences of v in blocks
//                     before b (the block's base within the bucket); counts[v] the total
//   embed_tile_sums   one workgroup per tile of 1024 ids: the tile's totals of counts and
//                     of segments (ids seen more than S times are cut into segments of S
//                     positions so that one hot id is summed in parallel)
//   embed_tile_scan   one workgroup per tile: offsets, seg_offsets = exclusive scans over
//                     ids (the tile's base from the earlier tiles' totals, in order)
//   embed_sort        one workgroup per block: 256 positions at a time, each position's
//                     rank among equal ids in the batch; sorted[offsets[v] + base + rank] = n
//   embed_segments    one thread per id: (start, length) of each of its segments in `sorted`
//   embed_partial     one workgroup per segment: partial[s, :] = sum of its <= S rows of dout
//   embed_reduce      one thread per (v, h): ids seen at most S times sum their dout rows
//                     directly, the others their segments' partials, each in order.

struct Params {
    n: u32,      // positions
    h: u32,      // hidden size
    v: u32,      // vocabulary
    block: u32,  // L: positions per sort block (multiple of WG)
    blocks: u32, // NB
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

override WG: u32 = 256u;
override ACCUMULATE: bool = false;   // embed_reduce: add into dtable instead of overwriting
override F16: bool = false;          // embed_fwd: the table holds f16 pairs (bound at 3; 2 unused)
const S: u32 = 32u;                  // positions per segment
const INVALID: u32 = 0xffffffffu;

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> ids: array<u32>;
@group(0) @binding(2) var<storage, read> table: array<f32>;
@group(0) @binding(3) var<storage, read> table16: array<u32>;          // f16 pairs
@group(0) @binding(4) var<storage, read_write> out: array<f32>;
@group(0) @binding(5) var<storage, read_write> flag: array<atomic<u32>>;
@group(0) @binding(6) var<storage, read_write> hist: array<atomic<u32>>;       // (NB, V), zeroed
@group(0) @binding(7) var<storage, read_write> offsets: array<u32>;            // (V + 1)
@group(0) @binding(8) var<storage, read_write> seg_offsets: array<u32>;        // (V + 1)
@group(0) @binding(9) var<storage, read_write> counts: array<u32>;             // (V)
@group(0) @binding(10) var<storage, read_write> sorted: array<u32>;            // (N)
@group(0) @binding(11) var<storage, read_write> segs: array<vec2<u32>>;        // (start, len)
@group(0) @binding(12) var<storage, read> dout: array<f32>;
@group(0) @binding(13) var<storage, read_write> partial: array<f32>;           // (segments, H)
@group(0) @binding(14) var<storage, read_write> dtable: array<f32>;            // (V, H)
@group(0) @binding(15) var<storage, read_write> tile_sums: array<vec2<u32>>;   // (tiles)
@group(0) @binding(16) var<storage, read> counts_in: array<u32>;               // counts, read-only view

var<workgroup> wg_a: array<u32, WG>;
var<workgroup> wg_b: array<u32, WG>;
const TILE: u32 = 4u * WG_SCAN;   // ids per scan tile
const WG_SCAN: u32 = 256u;

fn flat_index(wid: vec3<u32>, nwg: vec3<u32>, lid: u32) -> u32 {
    return (wid.x + wid.y * nwg.x) * WG + lid;
}

fn check_id(n: u32, id: u32) -> bool {
    if (id < p.v) { return true; }
    atomicAdd(&flag[0], 1u);
    atomicMax(&flag[1], 0xffffffffu - n);   // keeps the first bad position
    return false;
}

// Table element e: an f32, or half of a packed pair of f16s (F16).
fn table_at(e: u32) -> f32 {
    if (F16) { return unpack2x16float(table16[e / 2u])[e % 2u]; }
    return table[e];
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
    if (id < p.v) { val = table_at(id * p.h + i % p.h); } else if (i % p.h == 0u) { check_id(n, id); }
    out[i] = val;
}

@compute @workgroup_size(WG)
fn embed_count(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
               @builtin(local_invocation_index) lid: u32) {
    let n = flat_index(wid, nwg, lid);
    if (n >= p.n) { return; }
    let id = ids[n];
    if (check_id(n, id)) { atomicAdd(&hist[(n / p.block) * p.v + id], 1u); }
}

@compute @workgroup_size(WG)
fn embed_block_scan(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                    @builtin(local_invocation_index) lid: u32) {
    let v = flat_index(wid, nwg, lid);
    if (v >= p.v) { return; }
    var run = 0u;
    for (var b = 0u; b < p.blocks; b++) {
        let c = atomicLoad(&hist[b * p.v + v]);
        atomicStore(&hist[b * p.v + v], run);
        run += c;
    }
    counts[v] = run;
}

fn segments_of(c: u32) -> u32 {
    return select(0u, (c + S - 1u) / S, c > S);
}

// Workgroup sum of v over all WG_SCAN invocations (integers: exact). Uniform control flow.
fn sum_pair(lid: u32, v: vec2<u32>) -> vec2<u32> {
    wg_a[lid] = v.x;
    wg_b[lid] = v.y;
    workgroupBarrier();
    for (var stride = WG_SCAN / 2u; stride > 0u; stride >>= 1u) {
        if (lid < stride) {
            wg_a[lid] += wg_a[lid + stride];
            wg_b[lid] += wg_b[lid + stride];
        }
        workgroupBarrier();
    }
    let r = vec2<u32>(wg_a[0], wg_b[0]);
    workgroupBarrier();
    return r;
}

// Sums of (counts, segments) of ids v0 .. v0 + 4 * WG_SCAN, four consecutive ids a thread.
fn tile_load(v0: u32, lid: u32) -> array<vec2<u32>, 4> {
    var r: array<vec2<u32>, 4>;
    for (var j = 0u; j < 4u; j++) {
        let v = v0 + 4u * lid + j;
        var c = 0u;
        if (v < p.v) { c = counts[v]; }
        r[j] = vec2<u32>(c, segments_of(c));
    }
    return r;
}

@compute @workgroup_size(WG_SCAN)
fn embed_tile_sums(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let r = tile_load(wid.x * TILE, lid);
    let t = r[0] + r[1] + r[2] + r[3];
    let tot = sum_pair(lid, t);
    if (lid == 0u) { tile_sums[wid.x] = tot; }
}

@compute @workgroup_size(WG_SCAN)
fn embed_tile_scan(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                   @builtin(local_invocation_index) lid: u32) {
    // This tile's base: the totals of the tiles before it (integers: order is irrelevant).
    var base = vec2<u32>(0u);
    for (var t = lid; t < wid.x; t += WG_SCAN) { base += tile_sums[t]; }
    let tile_base = sum_pair(lid, base);
    // Exclusive scan of the per-thread sums (Hillis-Steele on inclusive sums).
    let r = tile_load(wid.x * TILE, lid);
    let mine = r[0] + r[1] + r[2] + r[3];
    wg_a[lid] = mine.x;
    wg_b[lid] = mine.y;
    workgroupBarrier();
    for (var d = 1u; d < WG_SCAN; d <<= 1u) {
        var add = vec2<u32>(0u);
        if (lid >= d) { add = vec2<u32>(wg_a[lid - d], wg_b[lid - d]); }
        workgroupBarrier();
        wg_a[lid] += add.x;
        wg_b[lid] += add.y;
        workgroupBarrier();
    }
    var run = tile_base + vec2<u32>(wg_a[lid], wg_b[lid]) - mine;
    for (var j = 0u; j < 4u; j++) {
        let v = wid.x * TILE + 4u * lid + j;
        if (v < p.v) {
            offsets[v] = run.x;
            seg_offsets[v] = run.y;
        }
        run += r[j];
    }
    if (wid.x + 1u == nwg.x && lid + 1u == WG_SCAN) {
        offsets[p.v] = run.x;
        seg_offsets[p.v] = run.y;
    }
}

@compute @workgroup_size(WG)
fn embed_sort(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let b = wid.x;
    let end = min((b + 1u) * p.block, p.n);
    for (var base = b * p.block; base < end; base += WG) {
        let n = base + lid;
        var id = INVALID;
        if (n < end) {
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
        // hist[b, id] is this block's running base for id: only this workgroup touches row b.
        var slot = 0u;
        if (id != INVALID) {
            slot = atomicLoad(&hist[b * p.v + id]);
            sorted[offsets[id] + slot + rank] = n;
        }
        storageBarrier();   // every base read before any is advanced
        workgroupBarrier();
        if (id != INVALID && last) {
            atomicStore(&hist[b * p.v + id], slot + rank + 1u);
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
    let c = counts[v];
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
    let c = counts_in[v];
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
