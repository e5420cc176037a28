// Sum over the last axis, in a fixed order (same bits on every run).
//   x [rows, n] -> out [rows, chunks], chunks = ceil(n / (WG * ITEMS))
// One workgroup sums one chunk of one row: thread t adds elements t, t+WG, t+2*WG, ... of
// the chunk in index order, then a tree in workgroup memory halves WG partial sums down to
// one. The host repeats the pass on [rows, chunks] until chunks == 1.
// Grid: linear over rows * chunks workgroups (2-D past 65535).

struct Params {
    rows: u32,
    n: u32,        // row length
    chunks: u32,   // chunks per row
    _pad: u32,
}

override WG: u32 = 256u;   // power of two
const ITEMS: u32 = 16u;    // elements per thread per chunk

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> out: array<f32>;

var<workgroup> partial: array<f32, WG>;

@compute @workgroup_size(WG)
fn sum_rows(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
            @builtin(local_invocation_index) lid: u32) {
    let g = wid.x + wid.y * nwg.x;
    // No early return: the barriers below must stay in uniform control flow.
    let valid = g < p.rows * p.chunks;
    let row = g / p.chunks;
    let chunk = g % p.chunks;
    let start = chunk * WG * ITEMS;
    let end = min(start + WG * ITEMS, p.n);
    var s = 0.0;
    if (valid) {
        let base = row * p.n;
        for (var i = start + lid; i < end; i += WG) {
            s += x[base + i];
        }
    }
    partial[lid] = s;
    workgroupBarrier();
    for (var stride = WG / 2u; stride > 0u; stride >>= 1u) {
        if (lid < stride) {
            partial[lid] += partial[lid + stride];
        }
        workgroupBarrier();
    }
    if (valid && lid == 0u) {
        out[row * p.chunks + chunk] = partial[0];
    }
}

// argmax_rows: idx[r] = the smallest j whose x[r, j] is the largest finite value of row r;
// 0 when the row has no finite value (as the CPU sampler's greedy pick).
//   x [rows, n] -> idx [rows]
// One workgroup a row: thread t scans elements t, t+WG, ... keeping its best (value,
// index), then a tree in workgroup memory keeps the better of each pair. Grid: rows.
@group(0) @binding(3) var<storage, read_write> idx: array<u32>;

const NONE: u32 = 0xffffffffu;
var<workgroup> best_v: array<f32, WG>;
var<workgroup> best_i: array<u32, WG>;

// Whether (v2, i2) beats (v1, i1): a valid index, a larger value, or equal and earlier.
fn better(v2: f32, i2: u32, v1: f32, i1: u32) -> bool {
    return i2 != NONE && (i1 == NONE || v2 > v1 || (v2 == v1 && i2 < i1));
}

@compute @workgroup_size(WG)
fn argmax_rows(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
               @builtin(local_invocation_index) lid: u32) {
    let row = wid.x + wid.y * nwg.x;
    let valid = row < p.rows;
    var bv = 0.0;
    var bi = NONE;
    if (valid) {
        let base = row * p.n;
        for (var j = lid; j < p.n; j += WG) {
            let v = x[base + j];
            // abs(v) <= max finite is false for NaN and both infinities.
            if (abs(v) <= 3.4028234663852886e38 && better(v, j, bv, bi)) {
                bv = v;
                bi = j;
            }
        }
    }
    best_v[lid] = bv;
    best_i[lid] = bi;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        if (lid < s && better(best_v[lid + s], best_i[lid + s], best_v[lid], best_i[lid])) {
            best_v[lid] = best_v[lid + s];
            best_i[lid] = best_i[lid + s];
        }
        workgroupBarrier();
    }
    if (valid && lid == 0u) {
        idx[row] = select(best_i[0], 0u, best_i[0] == NONE);
    }
}

// sum_words: the wrapping sum of the u32 words of two buffers, read as fast as the memory
// allows: a streaming reader with the least work a byte, for `bench generate`'s floor (a
// decode step's reads as a chain of dispatches that do nothing else).
//   wa [p.rows vec4 words], wb [p.n vec4 words], dep [1+] -> wout [p.chunks]
//   wout[g] = dep[0] + (sum of the words group g reads)      (mod 2^32)
// Group g, thread t reads vec4 words g*WG + t, then every p.chunks * WG further, four loads
// in flight before it adds them. Summed over g: p.chunks * dep[0] + all the words of both.
// dep is the word of the dispatch before (a chain waits on it). Grid: p.chunks workgroups.
@group(0) @binding(4) var<storage, read> wa: array<vec4<u32>>;
@group(0) @binding(5) var<storage, read> wb: array<vec4<u32>>;
@group(0) @binding(6) var<storage, read> dep: array<u32>;
@group(0) @binding(7) var<storage, read_write> wout: array<u32>;

var<workgroup> wpart: array<u32, WG>;

@compute @workgroup_size(WG)
fn sum_words(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let stride = p.chunks * WG;
    var s = vec4<u32>(0u);
    var i = wid.x * WG + lid;
    for (; i + 3u * stride < p.rows; i += 4u * stride) {
        let v0 = wa[i];
        let v1 = wa[i + stride];
        let v2 = wa[i + 2u * stride];
        let v3 = wa[i + 3u * stride];
        s += (v0 + v1) + (v2 + v3);
    }
    for (; i < p.rows; i += stride) {
        s += wa[i];
    }
    i = wid.x * WG + lid;
    for (; i + 3u * stride < p.n; i += 4u * stride) {
        let v0 = wb[i];
        let v1 = wb[i + stride];
        let v2 = wb[i + 2u * stride];
        let v3 = wb[i + 3u * stride];
        s += (v0 + v1) + (v2 + v3);
    }
    for (; i < p.n; i += stride) {
        s += wb[i];
    }
    wpart[lid] = (s.x + s.y) + (s.z + s.w);
    workgroupBarrier();
    for (var h = WG / 2u; h > 0u; h >>= 1u) {
        if (lid < h) {
            wpart[lid] += wpart[lid + h];
        }
        workgroupBarrier();
    }
    if (lid == 0u) {
        wout[wid.x] = wpart[0] + dep[0];
    }
}
