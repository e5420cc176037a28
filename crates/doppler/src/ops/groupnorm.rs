//! GroupNorm, forward (saving mean and rstd per (n, group)) and backward (dx, dgamma,
//! dbeta), with a batch dimension and any spatial size. Shader: `groupnorm.wgsl`
//! (derivatives in its header).

use super::expect_f32;
use crate::error::{Error, Result};
use crate::gpu::{Binding::*, DType, Grid, Kernel, Recorder, Tensor};
use crate::shaders::GROUPNORM;

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
pub struct Params {
    pub n: u32,
    pub c: u32,
    pub s: u32,
    pub g: u32,
    pub eps: f32,
    pub _pad: [u32; 3],
}

static CH_STATS: Kernel = Kernel::new(&GROUPNORM, "gn_channel_stats", &[(1, Read), (5, ReadWrite)]);
static GR_STATS: Kernel = Kernel::new(
    &GROUPNORM,
    "gn_group_stats",
    &[(5, ReadWrite), (6, ReadWrite), (7, ReadWrite)],
);
static APPLY: Kernel = Kernel::new(
    &GROUPNORM,
    "gn_apply",
    &[
        (1, Read),
        (2, Read),
        (3, Read),
        (4, ReadWrite),
        (14, Read),
        (15, Read),
    ],
);
static BWD_CH: Kernel = Kernel::new(
    &GROUPNORM,
    "gn_bwd_channel",
    &[
        (1, Read),
        (8, Read),
        (12, ReadWrite),
        (14, Read),
        (15, Read),
    ],
);
static BWD_PARAMS: Kernel = Kernel::new(
    &GROUPNORM,
    "gn_bwd_params",
    &[(10, ReadWrite), (11, ReadWrite), (12, ReadWrite)],
);
static BWD_GROUP: Kernel = Kernel::new(
    &GROUPNORM,
    "gn_bwd_group",
    &[(2, Read), (12, ReadWrite), (13, ReadWrite)],
);
static BWD_DX: Kernel = Kernel::new(
    &GROUPNORM,
    "gn_bwd_dx",
    &[
        (1, Read),
        (2, Read),
        (8, Read),
        (9, ReadWrite),
        (13, ReadWrite),
        (14, Read),
        (15, Read),
    ],
);

pub struct GroupNormOut {
    pub y: Tensor,
    /// (N, G)
    pub mean: Tensor,
    /// (N, G): 1 / sqrt(var + eps)
    pub rstd: Tensor,
}

pub struct GroupNormGrads {
    pub dx: Tensor,
    pub dgamma: Tensor,
    pub dbeta: Tensor,
}

/// (N, C, S) from x (N, C, spatial...), checking gamma, beta and the group count.
fn dims(op: &'static str, x: &Tensor, gamma: &Tensor, groups: usize) -> Result<Params> {
    expect_f32(op, x)?;
    expect_f32(op, gamma)?;
    let sh = x.shape();
    if sh.len() < 2 {
        return Err(Error::Shape {
            op,
            detail: format!("x {sh:?}, expected (N, C, spatial...)"),
        });
    }
    let (n, c, s) = (sh[0], sh[1], sh[2..].iter().product::<usize>());
    if groups == 0 || c % groups != 0 {
        return Err(Error::Shape {
            op,
            detail: format!("{c} channels do not split into {groups} groups"),
        });
    }
    if gamma.shape() != [c] {
        return Err(Error::Shape {
            op,
            detail: format!("gamma {:?}, expected [{c}] for x {sh:?}", gamma.shape()),
        });
    }
    Ok(Params {
        n: n as u32,
        c: c as u32,
        s: s as u32,
        g: groups as u32,
        eps: 0.0,
        _pad: [0; 3],
    })
}

pub fn group_norm(
    rec: &mut Recorder<'_>,
    x: &Tensor,
    gamma: &Tensor,
    beta: &Tensor,
    groups: usize,
    eps: f32,
) -> Result<GroupNormOut> {
    let mut p = dims("group_norm", x, gamma, groups)?;
    expect_f32("group_norm", beta)?;
    if beta.shape() != gamma.shape() {
        return Err(Error::Shape {
            op: "group_norm",
            detail: format!("beta {:?} vs gamma {:?}", beta.shape(), gamma.shape()),
        });
    }
    p.eps = eps;
    let gpu = rec.gpu();
    let (n, c, g) = (p.n as usize, p.c as usize, groups);
    let chstats = Tensor::empty(gpu, &[n, c, 2], DType::F32, "group_norm.chstats")?;
    let mean = Tensor::empty(gpu, &[n, g], DType::F32, "group_norm.mean")?;
    let rstd = Tensor::empty(gpu, &[n, g], DType::F32, "group_norm.rstd")?;
    let y = Tensor::empty(gpu, x.shape(), DType::F32, "group_norm.y")?;
    let pb = bytemuck::bytes_of(&p);
    rec.dispatch(
        &CH_STATS,
        &[],
        pb,
        &[x, &chstats],
        Grid::Linear((n * c) as u64),
    )?;
    rec.dispatch(
        &GR_STATS,
        &[],
        pb,
        &[&chstats, &mean, &rstd],
        Grid::cover((n * g) as u64, 256),
    )?;
    rec.dispatch(
        &APPLY,
        &[],
        pb,
        &[x, gamma, beta, &y, &mean, &rstd],
        Grid::cover(x.numel() as u64, 256),
    )?;
    Ok(GroupNormOut { y, mean, rstd })
}

/// dx, dgamma and dbeta from the forward's input, gamma, saved statistics and dy.
pub fn group_norm_backward(
    rec: &mut Recorder<'_>,
    x: &Tensor,
    gamma: &Tensor,
    fwd: &GroupNormOut,
    dy: &Tensor,
    groups: usize,
) -> Result<GroupNormGrads> {
    let p = dims("group_norm_backward", x, gamma, groups)?;
    expect_f32("group_norm_backward", dy)?;
    let (n, c, g) = (p.n as usize, p.c as usize, groups);
    if dy.shape() != x.shape() || fwd.mean.shape() != [n, g] || fwd.rstd.shape() != [n, g] {
        return Err(Error::Shape {
            op: "group_norm_backward",
            detail: format!(
                "x {:?}, dy {:?}, mean {:?}, rstd {:?}",
                x.shape(),
                dy.shape(),
                fwd.mean.shape(),
                fwd.rstd.shape()
            ),
        });
    }
    let gpu = rec.gpu();
    let chsums = Tensor::empty(gpu, &[n, c, 2], DType::F32, "group_norm.chsums")?;
    let gsums = Tensor::empty(gpu, &[n, g, 2], DType::F32, "group_norm.gsums")?;
    let dx = Tensor::empty(gpu, x.shape(), DType::F32, "group_norm.dx")?;
    let dgamma = Tensor::empty(gpu, &[c], DType::F32, "group_norm.dgamma")?;
    let dbeta = Tensor::empty(gpu, &[c], DType::F32, "group_norm.dbeta")?;
    let pb = bytemuck::bytes_of(&p);
    let (mean, rstd) = (&fwd.mean, &fwd.rstd);
    rec.dispatch(
        &BWD_CH,
        &[],
        pb,
        &[x, dy, &chsums, mean, rstd],
        Grid::Linear((n * c) as u64),
    )?;
    rec.dispatch(
        &BWD_PARAMS,
        &[],
        pb,
        &[&dgamma, &dbeta, &chsums],
        Grid::Linear(c as u64),
    )?;
    rec.dispatch(
        &BWD_GROUP,
        &[],
        pb,
        &[gamma, &chsums, &gsums],
        Grid::cover((n * g) as u64, 256),
    )?;
    rec.dispatch(
        &BWD_DX,
        &[],
        pb,
        &[x, gamma, dy, &dx, &gsums, mean, rstd],
        Grid::cover(x.numel() as u64, 256),
    )?;
    Ok(GroupNormGrads { dx, dgamma, dbeta })
}
