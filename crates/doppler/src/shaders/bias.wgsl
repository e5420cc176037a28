// Bias add over the last axis and its backward, a column sum in a fixed order.
//   bias_add:  x (R, N), b (N) -> y (R, N),  y = x + b       (dx = dy: no kernel)
//   bias_add4: the same on vec4 views when N is a multiple of 4
//   bias_grad: dy (R, N) -> partial (chunks, N), chunks = ceil(R / ROWS)
//              db = sum over rows of dy; the host repeats the pass until chunks == 1.
// A bias_grad workgroup covers 64 columns x ROWS rows: lane r of 4 adds rows r, r+4, ...
// of its chunk in order, then the 4 lanes add as a tree. Same bits on every run.
//   bias_grad4: the same on vec4 views when N is a multiple of 4, 256 columns a workgroup
//              (64 vec4s x 4 lanes); a lane loads 4 rows before adding them (one memory
//              latency for 4 rows, not 4: the scalar loop waits for each load in turn).
// Grids: bias_add linear over ceil(R*N / 256) workgroups (bias_add4: R*N/4); bias_grad
// (ceil(N / 64), chunks) flattened to linear (2-D past 65535).

struct Params {
    rows: u32,
    n: u32,
    chunks: u32,
    _pad: u32,
}

const WG: u32 = 256u;
const COLS: u32 = 64u;
const LANES: u32 = 4u;
const ROWS: u32 = 128u;   // rows per chunk: 32 per lane (256: too few workgroups on 8192 rows)

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> b: array<f32>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;
@group(0) @binding(4) var<storage, read> x4: array<vec4<f32>>;
@group(0) @binding(5) var<storage, read> b4: array<vec4<f32>>;
@group(0) @binding(6) var<storage, read_write> y4: array<vec4<f32>>;

var<workgroup> partial: array<f32, WG>;
var<workgroup> partial4: array<vec4<f32>, WG>;

@compute @workgroup_size(WG)
fn bias_add(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
            @builtin(local_invocation_index) lid: u32) {
    let i = (wid.x + wid.y * nwg.x) * WG + lid;
    if (i < p.rows * p.n) {
        y[i] = x[i] + b[i % p.n];
    }
}

@compute @workgroup_size(WG)
fn bias_add4(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
             @builtin(local_invocation_index) lid: u32) {
    let i = (wid.x + wid.y * nwg.x) * WG + lid;
    let n4 = p.n / 4u;
    if (i < p.rows * n4) {
        y4[i] = x4[i] + b4[i % n4];
    }
}

// x is dy (rows, n); y is the partial sums (chunks, n).
@compute @workgroup_size(WG)
fn bias_grad(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
             @builtin(local_invocation_index) lid: u32) {
    let g = wid.x + wid.y * nwg.x;
    let col_blocks = (p.n + COLS - 1u) / COLS;
    let chunk = g / col_blocks;
    let col = (g % col_blocks) * COLS + lid % COLS;
    let lane = lid / COLS;
    // No early return: the barriers below must stay in uniform control flow.
    let valid = chunk < p.chunks && col < p.n;
    var s = 0.0;
    if (valid) {
        let end = min((chunk + 1u) * ROWS, p.rows);
        for (var r = chunk * ROWS + lane; r < end; r += LANES) {
            s += x[r * p.n + col];
        }
    }
    partial[lid] = s;
    workgroupBarrier();
    if (lid < 2u * COLS) {
        partial[lid] += partial[lid + 2u * COLS];
    }
    workgroupBarrier();
    if (valid && lane == 0u) {
        y[chunk * p.n + col] = partial[lid] + partial[lid + COLS];
    }
}

// x4 is dy (rows, n / 4); y4 is the partial sums (chunks, n / 4).
@compute @workgroup_size(WG)
fn bias_grad4(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
              @builtin(local_invocation_index) lid: u32) {
    let g = wid.x + wid.y * nwg.x;
    let n4 = p.n / 4u;
    let col_blocks = (n4 + COLS - 1u) / COLS;
    let chunk = g / col_blocks;
    let col = (g % col_blocks) * COLS + lid % COLS;   // in vec4s
    let lane = lid / COLS;
    let valid = chunk < p.chunks && col < n4;
    var s = vec4<f32>(0.0);
    if (valid) {
        let end = min((chunk + 1u) * ROWS, p.rows);
        var r = chunk * ROWS + lane;
        for (; r + 3u * LANES < end; r += 4u * LANES) {
            let v0 = x4[r * n4 + col];
            let v1 = x4[(r + LANES) * n4 + col];
            let v2 = x4[(r + 2u * LANES) * n4 + col];
            let v3 = x4[(r + 3u * LANES) * n4 + col];
            s += v0;
            s += v1;
            s += v2;
            s += v3;
        }
        for (; r < end; r += LANES) {
            s += x4[r * n4 + col];
        }
    }
    partial4[lid] = s;
    workgroupBarrier();
    if (lid < 2u * COLS) {
        partial4[lid] += partial4[lid + 2u * COLS];
    }
    workgroupBarrier();
    if (valid && lane == 0u) {
        y4[chunk * n4 + col] = partial4[lid] + partial4[lid + COLS];
    }
}
