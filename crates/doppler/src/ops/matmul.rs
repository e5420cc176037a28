//! Batched f32 matrix product with either operand transposed. Shader: `matmul.wgsl`, or
//! `matmul_coop.wgsl` on cooperative matrices (tensor cores) in the GPU's
//! [`MatmulMode`]: f16 operands, or f16x3 (each operand scaled by a power of two and split
//! into two f16 halves, three products; `matmul.wgsl`'s `absmax` finds the scales).
//!
//! An optional bias row is added in the same pass ([`matmul_bias`], a linear layer's
//! x W^T + b).
//!
//! Derivatives of C = A @ B (no transposes), for upstream dC:
//!   dA = dC @ B^T   (matmul with trans_b)
//!   dB = A^T @ dC   (matmul with trans_a)
//! so the backward is two calls of the same kernel; `beta = 1` accumulates into a gradient.

use super::expect_f32;
use crate::error::{Error, Result};
use crate::gpu::{Binding::*, DType, Grid, Kernel, MatmulMode, Recorder, Tensor};
use crate::shaders::{MATMUL, MATMUL_COOP};

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
pub struct Params {
    pub m: u32,
    pub n: u32,
    pub k: u32,
    pub stride_a: u32,
    pub stride_b: u32,
    pub stride_c: u32,
    pub alpha: f32,
    pub beta: f32,
    /// 1: add the bias binding's row to every row of C.
    pub bias: u32,
    /// Split-K (A^T B only): the last batch slice's k where it is shorter than `k`; 0: none.
    pub k_last: u32,
    pub _pad: [u32; 2],
}

// a and b are each bound twice: as scalars and as vec4s; then c and the bias row (a
// stand-in, not read, without one).
static MATMUL_KERNEL: Kernel = Kernel::new(
    &MATMUL,
    "matmul",
    &[
        (1, Read),
        (2, Read),
        (3, Read),
        (4, Read),
        (5, ReadWrite),
        (7, Read),
    ],
);

// The same product on cooperative matrices (operands rounded to f16, or split in two
// (SPLIT), f32 sums; VEC only): binds the vec4 views of a and b, c, the operands' absmax
// partials (SPLIT; a stand-in otherwise) and the bias row.
static MATMUL_COOP_KERNEL: Kernel = Kernel {
    shader: &MATMUL_COOP,
    entry: "matmul_coop",
    storage: &[(2, Read), (4, Read), (5, ReadWrite), (6, Read), (7, Read)],
    features: wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX.union(wgpu::Features::SHADER_F16),
};

// The largest magnitude of each operand, ABSMAX_PARTS partials each (for SPLIT).
static ABSMAX: Kernel = Kernel::new(&MATMUL, "absmax", &[(2, Read), (4, Read), (8, ReadWrite)]);
/// Partials per operand of `absmax` (its grid's x; `matmul_coop.wgsl` reads 2 x 256).
pub const ABSMAX_PARTS: u32 = 256;

static SPLITK_SUM: Kernel = Kernel::new(
    &MATMUL,
    "splitk_sum",
    &[(5, ReadWrite), (6, Read), (7, Read)],
);

/// Output tile of one workgroup.
const TILE: u64 = 128;
/// Workgroups a GPU runs at once, for split-K's choice (two a core, ~128 cores)...
const WAVE: u64 = 256;
/// ...how much shorter split-K must make the product (waves x k a chunk) to be worth its
/// partial sums...
const MIN_GAIN: f64 = 0.15;
/// ...each chunk keeps at least this many k...
const MIN_SPLIT_K: usize = 512;
/// ...a multiple of this (whole k steps of both kernels; the last chunk takes the rest).
const SPLIT_ALIGN: usize = 32;

/// Split-K for a product of `tiles` output tiles and depth k: (chunks, k a chunk, k of the
/// last chunk), or None to leave it whole. Workgroups run in waves of WAVE; the chunk count
/// (up to 8, each chunk at least MIN_SPLIT_K deep) is the one with the least waves x k a
/// chunk, if that is MIN_GAIN below the whole product's. Chunks are multiples of
/// SPLIT_ALIGN and the last one holds the rest (shorter or equal). On an H200 (GPT-2's
/// weight gradients, K = 8192) the 36-tile product runs fastest in 7 chunks (f16 operands
/// 0.218 -> 0.079 ms, f32 1.44 -> 0.38) and the 144-tile ones within 5% of their best
/// (f16 0.295 -> 0.249 ms, best 0.237 in 3; f32 2.40 -> 1.38, best 1.37 in 8).
fn split_k(tiles: u64, k: usize) -> Option<(usize, usize, usize)> {
    if tiles >= 2 * WAVE {
        return None;
    }
    let chunks = |sp: usize| {
        let kc = k.div_ceil(sp).next_multiple_of(SPLIT_ALIGN);
        let last = k.checked_sub((sp - 1) * kc)?;
        (kc >= MIN_SPLIT_K && last > 0).then_some((sp, kc, last))
    };
    let time = |sp: usize, kc: usize| (tiles * sp as u64).div_ceil(WAVE) * kc as u64;
    let whole = time(1, k);
    (2..=8usize)
        .filter_map(chunks)
        .min_by_key(|&(sp, kc, _)| time(sp, kc))
        .filter(|&(sp, kc, _)| (time(sp, kc) as f64) <= (1.0 - MIN_GAIN) * whole as f64)
}

#[derive(Clone, Copy, Debug)]
pub struct MatmulOpts {
    /// A is stored (..., K, M) and used transposed.
    pub trans_a: bool,
    /// B is stored (..., N, K) and used transposed.
    pub trans_b: bool,
    pub alpha: f32,
}

impl Default for MatmulOpts {
    fn default() -> Self {
        MatmulOpts {
            trans_a: false,
            trans_b: false,
            alpha: 1.0,
        }
    }
}

/// The problem a pair of operands describes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MatmulShape {
    /// Leading (batch) dimensions of the output.
    pub batch_dims: Vec<usize>,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    /// Whether A / B have a batch (otherwise broadcast over it).
    pub batched_a: bool,
    pub batched_b: bool,
}

impl MatmulShape {
    pub fn batch(&self) -> usize {
        self.batch_dims.iter().product()
    }

    pub fn out_shape(&self) -> Vec<usize> {
        let mut s = self.batch_dims.clone();
        s.extend([self.m, self.n]);
        s
    }

    /// Operands are (..., rows, cols) with equal leading dims, or one of them 2-D (broadcast).
    pub fn infer(a: &[usize], b: &[usize], opts: &MatmulOpts) -> Result<MatmulShape> {
        let err = |why: &str| Error::Shape {
            op: "matmul",
            detail: format!(
                "a {a:?}{} @ b {b:?}{}: {why}",
                if opts.trans_a { "^T" } else { "" },
                if opts.trans_b { "^T" } else { "" }
            ),
        };
        if a.len() < 2 || b.len() < 2 {
            return Err(err("operands need at least 2 dimensions"));
        }
        let (ab, ar) = a.split_at(a.len() - 2);
        let (bb, br) = b.split_at(b.len() - 2);
        let (m, ka) = if opts.trans_a {
            (ar[1], ar[0])
        } else {
            (ar[0], ar[1])
        };
        let (kb, n) = if opts.trans_b {
            (br[1], br[0])
        } else {
            (br[0], br[1])
        };
        if ka != kb {
            return Err(err(&format!("inner dimensions differ ({ka} vs {kb})")));
        }
        let batch_dims = match (ab.is_empty(), bb.is_empty()) {
            (_, true) => ab.to_vec(),
            (true, false) => bb.to_vec(),
            (false, false) if ab == bb => ab.to_vec(),
            _ => return Err(err("batch dimensions differ")),
        };
        Ok(MatmulShape {
            batch_dims,
            m,
            n,
            k: ka,
            batched_a: !ab.is_empty(),
            batched_b: !bb.is_empty(),
        })
    }
}

/// C = alpha * op(A) @ op(B), a new tensor of shape (batch..., M, N).
pub fn matmul(rec: &mut Recorder<'_>, a: &Tensor, b: &Tensor, opts: MatmulOpts) -> Result<Tensor> {
    let s = MatmulShape::infer(a.shape(), b.shape(), &opts)?;
    let c = Tensor::empty(rec.gpu(), &s.out_shape(), a.dtype(), "matmul.out")?;
    matmul_into(rec, a, b, &c, opts, 0.0)?;
    Ok(c)
}

/// C = alpha * op(A) @ op(B) + bias, a new tensor of shape (batch..., M, N); bias (N) is
/// added to every row (not scaled by alpha).
pub fn matmul_bias(
    rec: &mut Recorder<'_>,
    a: &Tensor,
    b: &Tensor,
    bias: &Tensor,
    opts: MatmulOpts,
) -> Result<Tensor> {
    let s = MatmulShape::infer(a.shape(), b.shape(), &opts)?;
    let c = Tensor::empty(rec.gpu(), &s.out_shape(), a.dtype(), "matmul.out")?;
    matmul_into_tuned(rec, a, b, &c, Some(bias), opts, 0.0, Tuning::default())?;
    Ok(c)
}

/// Kernel shape choices that do not change the result's meaning (benchmarks sweep them).
#[derive(Clone, Copy, Debug)]
pub struct Tuning {
    /// k depth of each slab staged in workgroup memory: 8 or 16 (the f32 kernel).
    pub bk: u32,
    /// How the products are computed; None: the GPU's [`MatmulMode`] (products whose
    /// operand rows are not multiples of 4 are f32 in every mode).
    pub mode: Option<MatmulMode>,
}

impl Default for Tuning {
    fn default() -> Self {
        Tuning { bk: 16, mode: None }
    }
}

/// C = alpha * op(A) @ op(B) + beta * C, into an existing C. With beta = 0, C is not read.
pub fn matmul_into(
    rec: &mut Recorder<'_>,
    a: &Tensor,
    b: &Tensor,
    c: &Tensor,
    opts: MatmulOpts,
    beta: f32,
) -> Result<()> {
    matmul_into_tuned(rec, a, b, c, None, opts, beta, Tuning::default())
}

/// [`matmul_into`] with an optional bias row (N) and an explicit kernel [`Tuning`]:
/// C = alpha * op(A) @ op(B) + bias + beta * C. Every product goes through here.
#[allow(clippy::too_many_arguments)]
pub fn matmul_into_tuned(
    rec: &mut Recorder<'_>,
    a: &Tensor,
    b: &Tensor,
    c: &Tensor,
    bias: Option<&Tensor>,
    opts: MatmulOpts,
    beta: f32,
    tuning: Tuning,
) -> Result<()> {
    if !matches!(tuning.bk, 8 | 16) {
        return Err(Error::Shape {
            op: "matmul",
            detail: format!("tuning bk = {} (must be 8 or 16)", tuning.bk),
        });
    }
    expect_f32("matmul", a)?;
    expect_f32("matmul", b)?;
    expect_f32("matmul", c)?;
    let s = MatmulShape::infer(a.shape(), b.shape(), &opts)?;
    if c.shape() != s.out_shape().as_slice() {
        return Err(Error::Shape {
            op: "matmul",
            detail: format!("output {:?}, expected {:?}", c.shape(), s.out_shape()),
        });
    }
    let (m, n, k) = (s.m, s.n, s.k);
    if let Some(t) = bias {
        expect_f32("matmul", t)?;
        if t.shape() != [n] {
            return Err(Error::Shape {
                op: "matmul",
                detail: format!(
                    "bias {:?} for a product with {n} columns (a {:?}, b {:?}): expected [{n}]",
                    t.shape(),
                    a.shape(),
                    b.shape()
                ),
            });
        }
    }
    // Without a bias the binding gets a stand-in (a, already bound read-only).
    let bias_t = bias.unwrap_or(a);
    // vec4 loads need the contiguous dimension of each operand to be a multiple of 4.
    let a_inner = if opts.trans_a { m } else { k };
    let b_inner = if opts.trans_b { k } else { n };
    let vec = a_inner % 4 == 0 && b_inner % 4 == 0;
    let params = Params {
        m: m as u32,
        n: n as u32,
        k: k as u32,
        stride_a: if s.batched_a { (m * k) as u32 } else { 0 },
        stride_b: if s.batched_b { (k * n) as u32 } else { 0 },
        stride_c: (m * n) as u32,
        alpha: opts.alpha,
        beta,
        bias: bias.is_some() as u32,
        k_last: 0,
        _pad: [0; 2],
    };
    let constants = [
        ("TRANS_A", opts.trans_a as u32 as f64),
        ("TRANS_B", opts.trans_b as u32 as f64),
        ("VEC", vec as u32 as f64),
        ("BK", tuning.bk as f64),
    ];
    // Cooperative matrices where asked for and possible: the same 128 x 128 tiles.
    let gpu = rec.gpu();
    let asked = tuning.mode.unwrap_or(gpu.matmul);
    if tuning.mode.is_some_and(|m| m != MatmulMode::F32) && !(vec && gpu.coop_matmul_possible()) {
        return Err(Error::Invalid {
            op: "matmul",
            detail: format!(
                "the {} product needs cooperative matrices, f16 and subgroups of 32 (adapter {}) and operands whose rows are multiples of 4 (a {:?}, b {:?})",
                asked.name(),
                gpu.info.name,
                a.shape(),
                b.shape()
            ),
        });
    }
    let mode = if vec { asked } else { MatmulMode::F32 };
    // f16x3 scales each operand by its largest magnitude: found once for the product
    // (split-K's chunks included).
    let maxes = match mode {
        MatmulMode::F16x3 => Some(absmax_parts(rec, a, b)?),
        _ => None,
    };
    let coop = Coop {
        mode,
        maxes: maxes.as_ref().unwrap_or(a),
    };
    let tiles = (n as u64).div_ceil(TILE) * (m as u64).div_ceil(TILE);
    // Split-K needs K to be the outer (row) axis of both operands: A^T B, unbatched.
    if opts.trans_a && !opts.trans_b && s.batch() == 1 {
        if let Some((sp, kc, last)) = split_k(tiles, k) {
            let parts = Tensor::empty(rec.gpu(), &[sp, m, n], c.dtype(), "matmul.splitk")?;
            let p = Params {
                k: kc as u32,
                stride_a: (kc * m) as u32,
                stride_b: (kc * n) as u32,
                beta: 0.0,
                bias: 0,
                k_last: if last < kc { last as u32 } else { 0 },
                ..params
            };
            let grid = Grid::Xyz([
                (n as u64).div_ceil(TILE) as u32,
                (m as u64).div_ceil(TILE) as u32,
                sp as u32,
            ]);
            product(rec, &coop, &constants, 0, &p, [a, b, &parts, bias_t], grid)?;
            let p = Params {
                k: sp as u32,
                beta,
                ..params
            };
            return rec.dispatch(
                &SPLITK_SUM,
                &[],
                bytemuck::bytes_of(&p),
                &[c, &parts, bias_t],
                Grid::cover((m * n) as u64, 256),
            );
        }
    }
    let grid = Grid::Xyz([
        (n as u64).div_ceil(TILE) as u32,
        (m as u64).div_ceil(TILE) as u32,
        s.batch() as u32,
    ]);
    // The cooperative kernel starts its sums from C (beta 1) or the bias row where every
    // tile is whole and alpha is 1 (INIT 1, 2), and then stores straight to C; not f16x3,
    // whose sums are in its operands' scale (C or the bias row scaled into it could
    // overflow).
    let whole = m as u64 % TILE == 0
        && n as u64 % TILE == 0
        && opts.alpha == 1.0
        && mode != MatmulMode::F16x3;
    let init = match (whole, beta, bias.is_some()) {
        (true, 1.0, false) => 1,
        (true, 0.0, true) => 2,
        _ => 0,
    };
    product(
        rec,
        &coop,
        &constants,
        init,
        &params,
        [a, b, c, bias_t],
        grid,
    )
}

/// The largest magnitudes of `a` and `b` (f32 tensors of whole vec4s), as f32 bits in a
/// U32 tensor (2 x ABSMAX_PARTS): workgroup x's share (vec4s i with (i % 65536) / 256 == x)
/// of a, then of b. What the f16x3 product scales its operands by.
pub fn absmax_parts(rec: &mut Recorder<'_>, a: &Tensor, b: &Tensor) -> Result<Tensor> {
    expect_f32("matmul absmax", a)?;
    expect_f32("matmul absmax", b)?;
    if a.numel() % 4 != 0 || b.numel() % 4 != 0 {
        return Err(Error::Shape {
            op: "matmul absmax",
            detail: format!(
                "a {:?}, b {:?}: element counts must be multiples of 4",
                a.shape(),
                b.shape()
            ),
        });
    }
    let t = Tensor::empty(
        rec.gpu(),
        &[2 * ABSMAX_PARTS as usize],
        DType::U32,
        "matmul.absmax",
    )?;
    let p = Params {
        m: (a.numel() / 4) as u32,
        n: (b.numel() / 4) as u32,
        k: 0,
        stride_a: 0,
        stride_b: 0,
        stride_c: 0,
        alpha: 1.0,
        beta: 0.0,
        bias: 0,
        k_last: 0,
        _pad: [0; 2],
    };
    rec.dispatch(
        &ABSMAX,
        &[],
        bytemuck::bytes_of(&p),
        &[a, b, &t],
        Grid::Xyz([ABSMAX_PARTS, 2, 1]),
    )?;
    Ok(t)
}

/// How a product's dispatch runs: its mode and, for f16x3, the operands' absmax
/// partials (a stand-in otherwise).
struct Coop<'t> {
    mode: MatmulMode,
    maxes: &'t Tensor,
}

/// One dispatch of the product kernel (the cooperative-matrix one in the tensor-core
/// modes, starting its sums as `init` says) into `abc[2]` (`abc[3]`: the bias row or its
/// stand-in).
fn product(
    rec: &mut Recorder<'_>,
    coop: &Coop<'_>,
    constants: &[(&'static str, f64)],
    init: u32,
    p: &Params,
    abc: [&Tensor; 4],
    grid: Grid,
) -> Result<()> {
    let [a, b, c, bias] = abc;
    if coop.mode != MatmulMode::F32 {
        let consts = [
            constants[0],
            constants[1],
            ("INIT", init as f64),
            ("SPLIT", (coop.mode == MatmulMode::F16x3) as u32 as f64),
        ];
        rec.dispatch(
            &MATMUL_COOP_KERNEL,
            &consts,
            bytemuck::bytes_of(p),
            &[a, b, c, coop.maxes, bias],
            grid,
        )
    } else {
        rec.dispatch(
            &MATMUL_KERNEL,
            constants,
            bytemuck::bytes_of(p),
            &[a, a, b, b, c, bias],
            grid,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::split_k;

    #[test]
    fn split_k_shortens_the_waves_with_a_shorter_last_chunk() {
        // GPT-2's weight gradients, K = 8192: q/k/v/o (36 tiles) and fc/proj (144) in 7
        // chunks (252 and 1008 workgroups).
        assert_eq!(split_k(36, 8192), Some((7, 1184, 1088)));
        assert_eq!(split_k(144, 8192), Some((7, 1184, 1088)));
        // verify's cases: equal chunks, and a shorter last one.
        assert_eq!(split_k(1, 2048), Some((4, 512, 512)));
        assert_eq!(split_k(4, 4100), Some((8, 544, 292)));
        assert_eq!(split_k(1, 2050), Some((4, 544, 418)));
        assert_eq!(split_k(1, 1000), Some((2, 512, 488)));
        // Too shallow to split, too many tiles, or no shorter.
        assert_eq!(split_k(1, 900), None);
        assert_eq!(split_k(512, 1 << 20), None);
        assert_eq!(split_k(256, 1024), None);
        for (tiles, k) in [
            (1u64, 1024usize),
            (36, 8192),
            (100, 5000),
            (3, 100_003),
            (200, 9000),
        ] {
            let (sp, kc, last) = split_k(tiles, k).unwrap();
            assert!((sp - 1) * kc + last == k && last > 0 && last <= kc && kc % 32 == 0);
            assert!((2..=8).contains(&sp) && kc >= 512);
        }
    }
}
