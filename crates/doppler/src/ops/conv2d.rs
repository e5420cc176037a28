//! 2-D convolution (NCHW) with stride, padding, dilation and groups, forward and backward
//! (dx, dw, db), as implicit GEMMs (no im2col buffer). Shaders: `conv2d.wgsl` (the three
//! GEMMs are spelled out in its header, f32; and the small kernels around them), or
//! `conv2d_coop.wgsl`, the same GEMMs on cooperative matrices (f16 operands, f32 sums)
//! where products take f16 operands ([`MatmulMode::F16`]): see [`ConvPath`]. f16 operands
//! have f16's range: train with a dynamic loss scale there, as for the f16 products.
//!
//! Derivatives of y = conv(x, w) + b: dx is the transposed convolution of dy with w (a
//! gather over the (ky, kx) taps that reach each input pixel), dw[co, ci, ky, kx] =
//! sum over (n, oy, ox) of dy * x at the tap, db[co] = sum over (n, oy, ox) of dy.
//!
//! How dx runs: for stride 1, as the forward convolution of dy with w flipped in ky and kx
//! and transposed in (co, ci), padding d (k - 1) - p (the forward's gather, ~2x faster than
//! dx's on the H200); for a stride s > 1 (dilation 1), by residue classes of dx's pixels
//! (polyphase: rows r + s j take only the taps k with (r + p - k) divisible by s, a
//! stride-1 forward convolution of dy each, interleaved into dx), so that no product is
//! one with a skipped tap; otherwise (a class with no tap, dilation with stride) the
//! gather. A forward or dx GEMM with few output tiles splits its k (split-K, partial
//! outputs summed in a fixed order), dw always splits its N*OH*OW reduction.

use crate::error::{Error, Result};
use crate::gpu::{Binding::*, DType, Gpu, Grid, Kernel, MatmulMode, Recorder, Tensor};
use crate::shaders::{CONV2D, CONV2D_COOP};

#[repr(C)]
#[derive(Clone, Copy, Default, bytemuck::Pod, bytemuck::Zeroable)]
pub struct Params {
    pub n: u32,
    pub cin: u32,
    pub h: u32,
    pub w: u32,
    pub cout: u32,
    pub oh: u32,
    pub ow: u32,
    pub kh: u32,
    pub kw: u32,
    pub sh: u32,
    pub sw: u32,
    pub ph: u32,
    pub pw: u32,
    pub dh: u32,
    pub dw: u32,
    pub groups: u32,
    pub tiles_p: u32,
    pub tiles_m: u32,
    pub splits: u32,
    pub chunk: u32,
    /// A strided dx's residue class (polyphase, [`conv2d_backward`]): dx rows ry + sh j
    /// and columns rx + sw i, from taps ky0 + sh t (t < ty) and kx0 + sw t (t < tx),
    /// read at rows r0y + j, columns r0x + i of the class's output (th x tw).
    pub ry: u32,
    pub rx: u32,
    pub ky0: u32,
    pub kx0: u32,
    pub ty: u32,
    pub tx: u32,
    pub r0y: u32,
    pub r0x: u32,
    pub th: u32,
    pub tw: u32,
    pub _pad: [u32; 2],
}

static GEMM: Kernel = Kernel::new(
    &CONV2D,
    "conv_gemm",
    &[(1, Read), (2, Read), (3, Read), (4, ReadWrite), (5, Read)],
);
// The same GEMMs on cooperative matrices: same bindings.
static GEMM_COOP: Kernel = Kernel {
    shader: &CONV2D_COOP,
    entry: "conv_gemm_coop",
    storage: &[(1, Read), (2, Read), (3, Read), (4, ReadWrite), (5, Read)],
    features: wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX.union(wgpu::Features::SHADER_F16),
};
static SPLIT_SUM: Kernel = Kernel::new(
    &CONV2D,
    "conv_split_sum",
    &[(3, Read), (6, Read), (7, ReadWrite)],
);
static FLIP: Kernel = Kernel::new(&CONV2D, "conv_flip_weights", &[(2, Read), (7, ReadWrite)]);
static SUB_WEIGHTS: Kernel = Kernel::new(&CONV2D, "conv_sub_weights", &[(2, Read), (7, ReadWrite)]);
static INTERLEAVE: Kernel = Kernel::new(&CONV2D, "conv_interleave", &[(6, Read), (7, ReadWrite)]);
static BIAS_GRAD: Kernel = Kernel::new(&CONV2D, "conv_bias_grad", &[(5, Read), (8, ReadWrite)]);

/// Output tile edge and k-slab depth of `conv_gemm`.
const TILE: usize = 64;
const SLAB: usize = 16;
/// Output tile of `conv_gemm_coop`: rows (M) by columns (P).
const COOP_TILE: (usize, usize) = (64, 128);
/// GEMMs with fewer rows or a shorter depth than this stay f32 under [`ConvPath::Auto`]
/// (a 16 x 16 fragment would be mostly padding: a depthwise conv, a 1-channel stem).
const COOP_MIN: usize = 16;

/// Which kernel runs a convolution's three GEMMs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum ConvPath {
    /// Cooperative matrices where the GPU's products take f16 operands
    /// ([`MatmulMode::F16`], `DOPPLER_MATMUL=f16`, `--matmul f16`) and the GEMM has at
    /// least 16 rows and depth 16; f32 otherwise (also under f16x3, whose products keep
    /// f32's precision).
    #[default]
    Auto,
    /// `conv2d.wgsl`: f32 arithmetic.
    F32,
    /// `conv2d_coop.wgsl`: operands rounded to f16, f32 sums. An error on an adapter
    /// without cooperative matrices.
    Coop,
}

impl ConvPath {
    /// Whether a GEMM of `rows` x depth `depth` runs on cooperative matrices.
    fn coop(self, gpu: &Gpu, rows: usize, depth: usize) -> Result<bool> {
        match self {
            ConvPath::F32 => Ok(false),
            ConvPath::Auto => Ok(gpu.matmul == MatmulMode::F16
                && gpu.coop_matmul_possible()
                && rows >= COOP_MIN
                && depth >= COOP_MIN),
            ConvPath::Coop if gpu.coop_matmul_possible() => Ok(true),
            ConvPath::Coop => Err(Error::Invalid {
                op: "conv2d",
                detail: format!(
                    "the cooperative-matrix path needs cooperative matrices, f16 and subgroups of 32; adapter {:?} lacks them",
                    gpu.info.name
                ),
            }),
        }
    }
}

/// Reduction length one dw split covers (a multiple of SLAB).
const WGRAD_CHUNK: usize = 512;

/// PyTorch's `conv2d` arguments, as (height, width) pairs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Conv2dOpts {
    pub stride: (usize, usize),
    pub padding: (usize, usize),
    pub dilation: (usize, usize),
    pub groups: usize,
}

impl Default for Conv2dOpts {
    fn default() -> Self {
        Conv2dOpts {
            stride: (1, 1),
            padding: (0, 0),
            dilation: (1, 1),
            groups: 1,
        }
    }
}

/// Checks shapes and fills the size fields of the kernel parameters.
pub fn conv_params(x: &[usize], w: &[usize], o: &Conv2dOpts) -> Result<Params> {
    let err = |why: String| Error::Shape {
        op: "conv2d",
        detail: format!("x {x:?}, w {w:?}, {o:?}: {why}"),
    };
    let (&[n, cin, h, wd], &[cout, cig, kh, kw]) = (x, w) else {
        return Err(err(
            "x must be (N, Cin, H, W) and w (Cout, Cin/groups, KH, KW)".into(),
        ));
    };
    let g = o.groups;
    if g == 0 || cin % g != 0 || cout % g != 0 || cig != cin / g {
        return Err(err(format!(
            "groups {g} must divide Cin {cin} and Cout {cout}, with w's dim 1 = Cin/groups"
        )));
    }
    if [o.stride.0, o.stride.1, o.dilation.0, o.dilation.1, kh, kw].contains(&0) {
        return Err(err(
            "stride, dilation and kernel size must be positive".into()
        ));
    }
    let out = |size: usize, pad: usize, dil: usize, k: usize, st: usize| {
        (size + 2 * pad)
            .checked_sub(dil * (k - 1) + 1)
            .map(|v| v / st + 1)
    };
    let (Some(oh), Some(ow)) = (
        out(h, o.padding.0, o.dilation.0, kh, o.stride.0),
        out(wd, o.padding.1, o.dilation.1, kw, o.stride.1),
    ) else {
        return Err(err(
            "the (dilated) kernel is larger than the padded input".into()
        ));
    };
    let u = |v: usize| v as u32;
    Ok(Params {
        n: u(n),
        cin: u(cin),
        h: u(h),
        w: u(wd),
        cout: u(cout),
        oh: u(oh),
        ow: u(ow),
        kh: u(kh),
        kw: u(kw),
        sh: u(o.stride.0),
        sw: u(o.stride.1),
        ph: u(o.padding.0),
        pw: u(o.padding.1),
        dh: u(o.dilation.0),
        dw: u(o.dilation.1),
        groups: u(g),
        ..Default::default()
    })
}

fn f32s(op: &'static str, ts: &[&Tensor]) -> Result<()> {
    ts.iter().try_for_each(|t| super::expect_f32(op, t))
}

/// Records one `conv_gemm` (or, with `coop`, `conv_gemm_coop`) of `mode` (0 forward, 1 dx,
/// 2 dw partials) over `splits` chunks of `chunk` k each, sizing the grid.
#[allow(clippy::too_many_arguments)]
fn gemm(
    rec: &mut Recorder<'_>,
    mut p: Params,
    mode: u32,
    m: usize,
    cols: usize,
    (splits, chunk): (usize, usize),
    bias: bool,
    coop: bool,
    t: [&Tensor; 5],
) -> Result<()> {
    let (tile_m, tile_p) = if coop { COOP_TILE } else { (TILE, TILE) };
    p.tiles_p = cols.div_ceil(tile_p) as u32;
    p.tiles_m = m.div_ceil(tile_m) as u32;
    p.splits = splits as u32;
    p.chunk = chunk as u32;
    let workgroups = p.tiles_p as u64 * p.tiles_m as u64 * (p.groups as u64 * splits as u64);
    rec.dispatch(
        if coop { &GEMM_COOP } else { &GEMM },
        &[("MODE", mode as f64), ("HAS_BIAS", bias as u32 as f64)],
        bytemuck::bytes_of(&p),
        &t,
        Grid::Linear(workgroups),
    )
}

/// Workgroups that keep a GPU busy (a few on each of ~132 cores): a forward or dx GEMM of
/// fewer tiles than half this splits its k (split-K) to approach it.
const BUSY: usize = 528;
/// Each split keeps at least this many k slabs.
const MIN_SPLIT_SLABS: usize = 4;

/// (splits, k a split) for the forward or dx GEMM: k whole where its tiles fill the GPU,
/// else up to 8 chunks of whole slabs (`slab`), each at least MIN_SPLIT_SLABS of them. The
/// shape alone decides, so the sums' order (and bits) never change for a shape.
fn split_k(tiles: usize, k: usize, slab: usize) -> (usize, usize) {
    if tiles >= BUSY / 2 {
        return (1, k);
    }
    let want = (BUSY / tiles.max(1)).clamp(1, 8);
    let chunk = k
        .div_ceil(want)
        .next_multiple_of(slab)
        .max(MIN_SPLIT_SLABS * slab);
    match k.div_ceil(chunk) {
        0 | 1 => (1, k),
        splits => (splits, chunk),
    }
}

/// The GEMM of `mode` (0 forward, 1 dx, 2 dw) into `out`, split along k (forward and dx
/// where the output has few tiles, [`split_k`]; dw always, in chunks of WGRAD_CHUNK of its
/// N*OH*OW reduction): partial outputs, then `conv_split_sum` adds them in order (and the
/// bias).
#[allow(clippy::too_many_arguments)]
fn gemm_out(
    rec: &mut Recorder<'_>,
    p: Params,
    mode: u32,
    (m, cols, k): (usize, usize, usize),
    coop: bool,
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    out: &Tensor,
    dy: &Tensor,
) -> Result<()> {
    let ((tile_m, tile_p), slab) = if coop {
        (COOP_TILE, 32)
    } else {
        ((TILE, TILE), SLAB)
    };
    let tiles = m.div_ceil(tile_m) * cols.div_ceil(tile_p) * p.groups as usize;
    let (splits, chunk) = match mode {
        2 => {
            let chunk = k.min(WGRAD_CHUNK).next_multiple_of(SLAB);
            (k.div_ceil(chunk), chunk)
        }
        _ => split_k(tiles, k, slab),
    };
    let b = bias.unwrap_or(w);
    if splits == 1 {
        return gemm(
            rec,
            p,
            mode,
            m,
            cols,
            (1, k),
            bias.is_some(),
            coop,
            [x, w, b, out, dy],
        );
    }
    let len = out.numel();
    let partial = Tensor::empty(rec.gpu(), &[splits, len], DType::F32, "conv2d.partial")?;
    gemm(
        rec,
        p,
        mode,
        m,
        cols,
        (splits, chunk),
        false,
        coop,
        [x, w, b, &partial, dy],
    )?;
    let mut ps = p;
    ps.splits = splits as u32;
    rec.dispatch(
        &SPLIT_SUM,
        &[
            ("MODE", mode as f64),
            ("HAS_BIAS", bias.is_some() as u32 as f64),
        ],
        bytemuck::bytes_of(&ps),
        &[b, &partial, out],
        Grid::cover(len as u64, 256),
    )
}

/// y (N, Cout, OH, OW) = conv2d(x, w) + bias, on the GPU's path ([`ConvPath::Auto`]).
pub fn conv2d(
    rec: &mut Recorder<'_>,
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    o: Conv2dOpts,
) -> Result<Tensor> {
    conv2d_on(rec, x, w, bias, o, ConvPath::Auto)
}

/// [`conv2d`] on a chosen path.
pub fn conv2d_on(
    rec: &mut Recorder<'_>,
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    o: Conv2dOpts,
    path: ConvPath,
) -> Result<Tensor> {
    f32s("conv2d", &[x, w])?;
    let p = conv_params(x.shape(), w.shape(), &o)?;
    if let Some(b) = bias {
        f32s("conv2d", &[b])?;
        if b.shape() != [p.cout as usize] {
            return Err(Error::Shape {
                op: "conv2d",
                detail: format!("bias {:?}, expected [{}]", b.shape(), p.cout),
            });
        }
    }
    let (n, cout, oh, ow) = (p.n as usize, p.cout as usize, p.oh as usize, p.ow as usize);
    let depth = w.numel() / cout;
    let coop = path.coop(rec.gpu(), cout / o.groups, depth)?;
    let y = Tensor::empty(rec.gpu(), &[n, cout, oh, ow], DType::F32, "conv2d.y")?;
    // Unused bindings get any buffer of the right kind (dy: x).
    let dims = (cout / o.groups, n * oh * ow, depth);
    gemm_out(rec, p, 0, dims, coop, x, w, bias, &y, x)?;
    Ok(y)
}

pub struct Conv2dGrads {
    pub dx: Tensor,
    pub dw: Tensor,
    /// Present when asked for.
    pub db: Option<Tensor>,
}

/// One residue class (cy, cx) of a strided dx: its taps as a stride-1 kernel
/// (`conv_sub_weights`), the forward GEMM over dy, `conv_interleave` into dx.
#[allow(clippy::too_many_arguments)]
fn dx_class(
    rec: &mut Recorder<'_>,
    p: &Params,
    o: &Conv2dOpts,
    w: &Tensor,
    dy: &Tensor,
    dx: &Tensor,
    (cy, cx): (&Phase, &Phase),
    path: ConvPath,
) -> Result<()> {
    let g = o.groups;
    let (n, cin, cout) = (p.n as usize, p.cin as usize, p.cout as usize);
    let ws_shape = [cin, cout / g, cy.taps, cx.taps];
    let ws = Tensor::empty(rec.gpu(), &ws_shape, DType::F32, "conv2d.w_class")?;
    let mut pc = *p;
    (pc.ry, pc.rx, pc.ky0, pc.kx0) = (cy.r as u32, cx.r as u32, cy.k0 as u32, cx.k0 as u32);
    (pc.ty, pc.tx, pc.r0y, pc.r0x) = (cy.taps as u32, cx.taps as u32, cy.r0 as u32, cx.r0 as u32);
    rec.dispatch(
        &SUB_WEIGHTS,
        &[],
        bytemuck::bytes_of(&pc),
        &[w, &ws],
        Grid::cover(ws.numel() as u64, 256),
    )?;
    let of = Conv2dOpts {
        stride: (1, 1),
        padding: (cy.pad, cx.pad),
        dilation: (1, 1),
        groups: g,
    };
    let pf = conv_params(dy.shape(), &ws_shape, &of)?;
    let (th, tw) = (pf.oh as usize, pf.ow as usize);
    let class = Tensor::empty(rec.gpu(), &[n, cin, th, tw], DType::F32, "conv2d.dx_class")?;
    let depth = cout / g * cy.taps * cx.taps;
    let coop = path.coop(rec.gpu(), cin / g, depth)?;
    gemm_out(
        rec,
        pf,
        0,
        (cin / g, n * th * tw, depth),
        coop,
        dy,
        &ws,
        None,
        &class,
        dy,
    )?;
    (pc.th, pc.tw) = (th as u32, tw as u32);
    rec.dispatch(
        &INTERLEAVE,
        &[],
        bytemuck::bytes_of(&pc),
        &[&class, dx],
        Grid::cover((n * cin * cy.len * cx.len) as u64, 256),
    )
}

/// For a stride-1 convolution whose padding is at most d (k - 1) on each axis: the
/// parameters of dx as a forward convolution of dy (N, Cout, OH, OW) with w flipped and
/// transposed (Cin, Cout/groups, KH, KW), padding d (k - 1) - p, and that weight's shape.
fn flipped(p: &Params, o: &Conv2dOpts) -> Option<(Params, [usize; 4])> {
    let (kh, kw) = (p.kh as usize, p.kw as usize);
    let pad = |d: usize, k: usize, pad: usize| (d * (k - 1)).checked_sub(pad);
    if o.stride != (1, 1) {
        return None;
    }
    let of = Conv2dOpts {
        stride: (1, 1),
        padding: (
            pad(o.dilation.0, kh, o.padding.0)?,
            pad(o.dilation.1, kw, o.padding.1)?,
        ),
        dilation: o.dilation,
        groups: o.groups,
    };
    let (cin, cout) = (p.cin as usize, p.cout as usize);
    let wf = [cin, cout / o.groups, kh, kw];
    let dy = [p.n as usize, cout, p.oh as usize, p.ow as usize];
    let pf = conv_params(&dy, &wf, &of).ok()?;
    (pf.oh == p.h && pf.ow == p.w).then_some((pf, wf))
}

/// One residue class along an axis of a strided dx: the rows r + s j (j < len) of dx take
/// the taps k0 + s t (t < taps) alone, a stride-1 convolution of dy with those taps
/// (flipped) at padding `pad`, whose output row r0 + j is dx's row r + s j.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Phase {
    r: usize,
    k0: usize,
    taps: usize,
    pad: usize,
    r0: usize,
    len: usize,
}

/// The `s` classes along an axis of x's `size` (dy's `out`), kernel `k`, stride `s`,
/// padding `pad`, dilation 1; None where a class has no pixel or no tap (the dx gather
/// then).
fn phases(size: usize, out: usize, k: usize, s: usize, pad: usize) -> Option<Vec<Phase>> {
    (0..s)
        .map(|r| {
            let len = size.checked_sub(r).filter(|&v| v > 0)?.div_ceil(s);
            let at = |ky: usize| r as i64 + pad as i64 - ky as i64;
            let k0 = (0..k).find(|&ky| at(ky).rem_euclid(s as i64) == 0)?;
            let taps = (k - k0).div_ceil(s);
            // Output row r' of the class's convolution reads dy rows r' - q + u (u < taps),
            // which are dx row j's when r' = j + q + e0 - (taps - 1): the least padding q
            // for which that is a row of the output for every j.
            let e0 = at(k0) / s as i64;
            (0..=out + len + k).find_map(|q| {
                let r0 = q as i64 + e0 - (taps as i64 - 1);
                let rows = (out + 2 * q + 1).checked_sub(taps)?;
                (r0 >= 0 && r0 as usize + len <= rows).then_some(Phase {
                    r,
                    k0,
                    taps,
                    pad: q,
                    r0: r0 as usize,
                    len,
                })
            })
        })
        .collect()
}

/// dx, dw and (with `bias`) db from the forward's x and w and the upstream dy, on the
/// GPU's path ([`ConvPath::Auto`]).
pub fn conv2d_backward(
    rec: &mut Recorder<'_>,
    x: &Tensor,
    w: &Tensor,
    dy: &Tensor,
    o: Conv2dOpts,
    bias: bool,
) -> Result<Conv2dGrads> {
    conv2d_backward_on(rec, x, w, dy, o, bias, ConvPath::Auto)
}

/// [`conv2d_backward`] on a chosen path (db is always f32).
pub fn conv2d_backward_on(
    rec: &mut Recorder<'_>,
    x: &Tensor,
    w: &Tensor,
    dy: &Tensor,
    o: Conv2dOpts,
    bias: bool,
    path: ConvPath,
) -> Result<Conv2dGrads> {
    f32s("conv2d_backward", &[x, w, dy])?;
    let p = conv_params(x.shape(), w.shape(), &o)?;
    let (n, cin, h, wd) = (p.n as usize, p.cin as usize, p.h as usize, p.w as usize);
    let (cout, oh, ow) = (p.cout as usize, p.oh as usize, p.ow as usize);
    if dy.shape() != [n, cout, oh, ow] {
        return Err(Error::Shape {
            op: "conv2d_backward",
            detail: format!("dy {:?}, expected {:?}", dy.shape(), [n, cout, oh, ow]),
        });
    }
    let g = o.groups;
    let gpu = rec.gpu();
    let khw = w.numel() / (cout * (cin / g));
    let coop_dx = path.coop(gpu, cin / g, cout / g * khw)?;
    let coop_dw = path.coop(gpu, cout / g, n * oh * ow)?;
    let dx = Tensor::empty(gpu, x.shape(), DType::F32, "conv2d.dx")?;
    let dims = (cin / g, n * h * wd, cout / g * khw);
    match flipped(&p, &o) {
        // Stride 1: dx = conv(dy, w flipped), the forward's gather (the dx gather's
        // stride tests and weight layout ran ~2x slower on the H200).
        Some((pf, wf_shape)) => {
            let wf = Tensor::empty(gpu, &wf_shape, DType::F32, "conv2d.w_flipped")?;
            rec.dispatch(
                &FLIP,
                &[],
                bytemuck::bytes_of(&p),
                &[w, &wf],
                Grid::cover(w.numel() as u64, 256),
            )?;
            gemm_out(rec, pf, 0, dims, coop_dx, dy, &wf, None, &dx, dy)?;
        }
        None => {
            let classes = match o.dilation == (1, 1) {
                true => phases(h, oh, p.kh as usize, o.stride.0, o.padding.0).zip(phases(
                    wd,
                    ow,
                    p.kw as usize,
                    o.stride.1,
                    o.padding.1,
                )),
                false => None,
            };
            match classes {
                // Strided: each residue class of dx's pixels (ry, rx) as the forward
                // convolution of dy with the taps that reach it, interleaved into dx (the
                // gather's stride tests skip (s^2 - 1) / s^2 of its products).
                Some((ys, xs)) => {
                    for (cy, cx) in ys.iter().flat_map(|y| xs.iter().map(move |x| (y, x))) {
                        dx_class(rec, &p, &o, w, dy, &dx, (cy, cx), path)?;
                    }
                }
                None => gemm_out(rec, p, 1, dims, coop_dx, x, w, None, &dx, dy)?,
            }
        }
    }

    let dw = Tensor::empty(gpu, w.shape(), DType::F32, "conv2d.dw")?;
    let dims = (cout / g, w.numel() / cout, n * oh * ow);
    gemm_out(rec, p, 2, dims, coop_dw, x, w, None, &dw, dy)?;

    let db = if bias {
        let db = Tensor::empty(gpu, &[cout], DType::F32, "conv2d.db")?;
        rec.dispatch(
            &BIAS_GRAD,
            &[],
            bytemuck::bytes_of(&p),
            &[dy, &db],
            Grid::Linear(cout as u64),
        )?;
        Some(db)
    } else {
        None
    };
    Ok(Conv2dGrads { dx, dw, db })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strided_dx_classes() {
        // 3x3, stride 2, padding 1 over 32 rows (16 out): even rows take the middle tap,
        // odd rows the outer two, each at padding 0 and 1.
        let c = phases(32, 16, 3, 2, 1).unwrap();
        assert_eq!(
            c[0],
            Phase {
                r: 0,
                k0: 1,
                taps: 1,
                pad: 0,
                r0: 0,
                len: 16
            }
        );
        assert_eq!(
            c[1],
            Phase {
                r: 1,
                k0: 0,
                taps: 2,
                pad: 1,
                r0: 1,
                len: 16
            }
        );
        // A 1x1 stride-2 kernel reaches no odd row: no classes.
        assert_eq!(phases(8, 4, 1, 2, 0), None);
        // Fewer rows than the stride: a class without pixels.
        assert_eq!(phases(1, 1, 3, 2, 1), None);
    }
}
