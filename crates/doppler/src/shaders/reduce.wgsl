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
