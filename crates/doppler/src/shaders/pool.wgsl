// Average pooling over windows of kh x kw with stride (sh, sw), no padding, as
// torch.nn.functional.avg_pool2d(x, (kh, kw), (sh, sw)); global pooling is kh = H, kw = W.
//   avg_pool_fwd:  x (NC, H, W) -> y (NC, OH, OW),
//                  y[., oy, ox] = (sum over i < kh, j < kw, in that order, of
//                                  x[., oy*sh + i, ox*sw + j]) / (kh*kw)
//   avg_pool_bwd:  dx[., h, w] = sum over the windows (oy, ox) holding (h, w), in raster
//                  order, of dy[., oy, ox] / (kh*kw)
// Both are gathers, one thread per output element.
// Grid: cover p.total threads, 256 per workgroup (2-D past 65535).

struct Params {
    total: u32,
    h: u32,
    w: u32,
    oh: u32,
    ow: u32,
    kh: u32,
    kw: u32,
    sh: u32,
    sw: u32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

const WG: u32 = 256u;

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;

fn index(wid: vec3<u32>, nwg: vec3<u32>, lid: u32) -> u32 {
    return (wid.x + wid.y * nwg.x) * WG + lid;
}

@compute @workgroup_size(WG)
fn avg_pool_fwd(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                @builtin(local_invocation_index) lid: u32) {
    let i = index(wid, nwg, lid);
    if (i >= p.total) {
        return;
    }
    let ox = i % p.ow;
    let oy = (i / p.ow) % p.oh;
    let nc = i / (p.ow * p.oh);
    var s = 0.0;
    for (var a = 0u; a < p.kh; a++) {
        let row = (nc * p.h + oy * p.sh + a) * p.w + ox * p.sw;
        for (var b = 0u; b < p.kw; b++) {
            s += x[row + b];
        }
    }
    y[i] = s / f32(p.kh * p.kw);
}

// x is dy (NC, OH, OW); y is dx (NC, H, W); p.total = NC*H*W.
@compute @workgroup_size(WG)
fn avg_pool_bwd(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                @builtin(local_invocation_index) lid: u32) {
    let i = index(wid, nwg, lid);
    if (i >= p.total) {
        return;
    }
    let c = i % p.w;
    let r = (i / p.w) % p.h;
    let nc = i / (p.w * p.h);
    // Windows oy with oy*sh <= r < oy*sh + kh, and oy < OH (likewise ox).
    let y0 = select(0u, (r + 1u - p.kh + p.sh - 1u) / p.sh, r + 1u > p.kh);
    let y1 = min(r / p.sh + 1u, p.oh);
    let x0 = select(0u, (c + 1u - p.kw + p.sw - 1u) / p.sw, c + 1u > p.kw);
    let x1 = min(c / p.sw + 1u, p.ow);
    var s = 0.0;
    for (var oy = y0; oy < y1; oy++) {
        for (var ox = x0; ox < x1; ox++) {
            s += x[(nc * p.oh + oy) * p.ow + ox];
        }
    }
    y[i] = s / f32(p.kh * p.kw);
}
