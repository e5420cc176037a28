// Column ranges of row-major matrices: what splits a stacked product's output into its
// parts (q, k and v) and gathers their gradients back.
//   columns: dst[r, p.dst_off + c] = src[r, p.src_off + c]   (r < rows, c < width)
//            mode 0: only those elements are written;
//            mode 1: added to what dst holds there (accumulating a gradient);
//            mode 2: each whole row of dst is written, zeros outside the range
//            (threads then cover rows x dst_stride).
// src's rows are p.src_stride long, dst's p.dst_stride. One element a thread; grid linear
// (2-D past 65535 workgroups).

struct Params {
    rows: u32,
    width: u32,
    src_stride: u32,
    src_off: u32,
    dst_stride: u32,
    dst_off: u32,
    mode: u32,
    _pad: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> src: array<f32>;
@group(0) @binding(2) var<storage, read_write> dst: array<f32>;

@compute @workgroup_size(256)
fn columns(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
           @builtin(local_invocation_index) lid: u32) {
    let i = (wid.x + wid.y * nwg.x) * 256u + lid;
    if (p.mode == 2u) {
        if (i >= p.rows * p.dst_stride) {
            return;
        }
        let r = i / p.dst_stride;
        let j = i % p.dst_stride;
        var v = 0.0;
        if (j >= p.dst_off && j < p.dst_off + p.width) {
            v = src[r * p.src_stride + p.src_off + j - p.dst_off];
        }
        dst[i] = v;
        return;
    }
    if (i >= p.rows * p.width) {
        return;
    }
    let r = i / p.width;
    let c = i % p.width;
    let at = r * p.dst_stride + p.dst_off + c;
    let v = src[r * p.src_stride + p.src_off + c];
    dst[at] = select(v, dst[at] + v, p.mode == 1u);
}
