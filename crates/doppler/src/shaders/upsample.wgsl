// Upsampling for conv nets: pixel shuffle and nearest-neighbour upsample2d, with backwards.
// All four are gathers, one thread per output element, so no two threads write one place.
//   pixel_shuffle:    x (N, C*sh*sw, H, W) -> y (N, C, H*sh, W*sw)
//                     y[n, c, oh, ow] = x[n, c*sh*sw + (oh % sh)*sw + ow % sw, oh / sh, ow / sw]
//   pixel_unshuffle:  the inverse permutation: the backward of pixel_shuffle (dx from dy).
//   upsample_fwd:     x (NC, H, W) -> y (NC, H*sh, W*sw), y[., oh, ow] = x[., oh / sh, ow / sw]
//   upsample_bwd:     dx[., h, w] = sum over i < sh, j < sw (in that order) of
//                     dy[., h*sh + i, w*sw + j]
// p.c is C for the shuffles and N*C for upsample; h, w are the small (input) sizes.
// Grid: cover p.total threads, 256 per workgroup (2-D past 65535).

struct Params {
    total: u32,
    c: u32,
    h: u32,
    w: u32,
    sh: u32,
    sw: u32,
    _pad0: u32,
    _pad1: u32,
}

const WG: u32 = 256u;

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;

fn index(wid: vec3<u32>, nwg: vec3<u32>, lid: u32) -> u32 {
    return (wid.x + wid.y * nwg.x) * WG + lid;
}

@compute @workgroup_size(WG)
fn pixel_shuffle(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                 @builtin(local_invocation_index) lid: u32) {
    let i = index(wid, nwg, lid);
    if (i >= p.total) {
        return;
    }
    let ow_n = p.w * p.sw;
    let oh_n = p.h * p.sh;
    let ow = i % ow_n;
    let oh = (i / ow_n) % oh_n;
    let c = (i / (ow_n * oh_n)) % p.c;
    let n = i / (ow_n * oh_n * p.c);
    let ic = c * p.sh * p.sw + (oh % p.sh) * p.sw + ow % p.sw;
    y[i] = x[((n * p.c * p.sh * p.sw + ic) * p.h + oh / p.sh) * p.w + ow / p.sw];
}

// x is dy (N, C, H*sh, W*sw); y is dx (N, C*sh*sw, H, W).
@compute @workgroup_size(WG)
fn pixel_unshuffle(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                   @builtin(local_invocation_index) lid: u32) {
    let i = index(wid, nwg, lid);
    if (i >= p.total) {
        return;
    }
    let cr = p.c * p.sh * p.sw;
    let w = i % p.w;
    let h = (i / p.w) % p.h;
    let ic = (i / (p.w * p.h)) % cr;
    let n = i / (p.w * p.h * cr);
    let c = ic / (p.sh * p.sw);
    let oh = h * p.sh + (ic / p.sw) % p.sh;
    let ow = w * p.sw + ic % p.sw;
    y[i] = x[((n * p.c + c) * p.h * p.sh + oh) * p.w * p.sw + ow];
}

@compute @workgroup_size(WG)
fn upsample_fwd(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                @builtin(local_invocation_index) lid: u32) {
    let i = index(wid, nwg, lid);
    if (i >= p.total) {
        return;
    }
    let ow_n = p.w * p.sw;
    let oh_n = p.h * p.sh;
    let ow = i % ow_n;
    let oh = (i / ow_n) % oh_n;
    let nc = i / (ow_n * oh_n);
    y[i] = x[(nc * p.h + oh / p.sh) * p.w + ow / p.sw];
}

// x is dy (NC, H*sh, W*sw); y is dx (NC, H, W).
@compute @workgroup_size(WG)
fn upsample_bwd(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                @builtin(local_invocation_index) lid: u32) {
    let i = index(wid, nwg, lid);
    if (i >= p.total) {
        return;
    }
    let w = i % p.w;
    let h = (i / p.w) % p.h;
    let nc = i / (p.w * p.h);
    let ow_n = p.w * p.sw;
    var s = 0.0;
    for (var a = 0u; a < p.sh; a++) {
        let row = (nc * p.h * p.sh + h * p.sh + a) * ow_n + w * p.sw;
        for (var b = 0u; b < p.sw; b++) {
            s += x[row + b];
        }
    }
    y[i] = s;
}
