//! Rotary position embedding (RoPE), forward and backward, both pairings. Shader:
//! `rope.wgsl`. The backward is the forward's transpose: a turn by the negative angle.

use super::expect_f32;
use crate::error::{Error, Result};
use crate::gpu::{Binding::*, DType, Gpu, Grid, Kernel, Recorder, Tensor};
use crate::shaders::ROPE;

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
pub struct Params {
    pub pairs: u32,
    pub t: u32,
    pub h: u32,
    pub dh: u32,
    pub offset: u32,
    pub backward: u32,
    pub _pad: [u32; 2],
}

static ROPE_K: Kernel = Kernel::new(&ROPE, "rope", &[(1, Read), (2, Read), (3, ReadWrite)]);

/// Threads per workgroup: one pair each.
const WG: u64 = 64;

/// cos and sin of every (position, pair) angle, computed once on the host in f64.
pub struct RopeTable {
    /// (positions, Dh/2, 2): (cos, sin)
    pub table: Tensor,
    pub positions: usize,
    pub head_dim: usize,
}

impl RopeTable {
    /// angle(pos, k) = pos * theta^(-2k / head_dim).
    pub fn new(gpu: &Gpu, positions: usize, head_dim: usize, theta: f64) -> Result<RopeTable> {
        if head_dim == 0 || head_dim % 2 != 0 || theta <= 0.0 {
            return Err(Error::Invalid {
                op: "rope",
                detail: format!("head_dim {head_dim} (must be even), theta {theta}"),
            });
        }
        RopeTable::from_inv_freq(gpu, positions, &inv_freq(head_dim, theta))
    }

    /// angle(pos, k) = pos * inv_freq[k], for frequencies a model rescales (Llama 3).
    pub fn from_inv_freq(gpu: &Gpu, positions: usize, inv_freq: &[f64]) -> Result<RopeTable> {
        RopeTable::from_inv_freq_scaled(gpu, positions, inv_freq, 1.0)
    }

    /// [`RopeTable::from_inv_freq`] with cos and sin multiplied by `scale` (LongRoPE's
    /// attention factor: both q and k are turned, so scores grow by scale^2).
    pub fn from_inv_freq_scaled(
        gpu: &Gpu,
        positions: usize,
        inv_freq: &[f64],
        scale: f64,
    ) -> Result<RopeTable> {
        if inv_freq.is_empty()
            || positions == 0
            || inv_freq.iter().any(|f| !f.is_finite())
            || !(scale.is_finite() && scale > 0.0)
        {
            return Err(Error::Invalid {
                op: "rope",
                detail: format!(
                    "positions {positions}, {} frequencies (finite, at least one), scale {scale}",
                    inv_freq.len()
                ),
            });
        }
        let mut data = Vec::with_capacity(positions * inv_freq.len() * 2);
        for pos in 0..positions {
            for f in inv_freq {
                let angle = pos as f64 * f;
                data.extend([(angle.cos() * scale) as f32, (angle.sin() * scale) as f32]);
            }
        }
        let table = Tensor::from_f32(gpu, &[positions, inv_freq.len(), 2], &data, "rope.table")?;
        Ok(RopeTable {
            table,
            positions,
            head_dim: 2 * inv_freq.len(),
        })
    }
}

/// theta^(-2k / head_dim) for k < head_dim / 2.
pub fn inv_freq(head_dim: usize, theta: f64) -> Vec<f64> {
    (0..head_dim / 2)
        .map(|k| theta.powf(-2.0 * k as f64 / head_dim as f64))
        .collect()
}

/// Which elements form a rotating pair.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pairing {
    /// (2k, 2k + 1): Meta's and GGUF's Llama.
    Interleaved,
    /// (k, k + Dh/2): Hugging Face's "rotate half".
    Half,
}

fn run(
    rec: &mut Recorder<'_>,
    op: &'static str,
    x: &Tensor,
    t: &RopeTable,
    offset: usize,
    pairing: Pairing,
    backward: bool,
) -> Result<Tensor> {
    expect_f32(op, x)?;
    let sh = x.shape();
    if sh.len() < 3 || sh[sh.len() - 1] != t.head_dim {
        return Err(Error::Shape {
            op,
            detail: format!("x {sh:?}, expected (..., T, H, {})", t.head_dim),
        });
    }
    let (tt, h, dh) = (sh[sh.len() - 3], sh[sh.len() - 2], sh[sh.len() - 1]);
    if offset + tt > t.positions {
        return Err(Error::Shape {
            op,
            detail: format!(
                "positions {offset}..{} exceed the table's {}",
                offset + tt,
                t.positions
            ),
        });
    }
    let y = Tensor::empty(rec.gpu(), sh, DType::F32, "rope.y")?;
    let p = Params {
        pairs: (x.numel() / 2) as u32,
        t: tt as u32,
        h: h as u32,
        dh: dh as u32,
        offset: offset as u32,
        backward: backward as u32,
        _pad: [0; 2],
    };
    let c = [
        (
            "INTERLEAVED",
            (pairing == Pairing::Interleaved) as u32 as f64,
        ),
        ("WG", WG as f64),
    ];
    rec.dispatch(
        &ROPE_K,
        &c,
        bytemuck::bytes_of(&p),
        &[x, &t.table, &y],
        Grid::cover(p.pairs as u64, WG),
    )?;
    Ok(y)
}

/// x (..., T, H, Dh) at positions offset..offset+T.
pub fn rope(
    rec: &mut Recorder<'_>,
    x: &Tensor,
    table: &RopeTable,
    offset: usize,
    pairing: Pairing,
) -> Result<Tensor> {
    run(rec, "rope", x, table, offset, pairing, false)
}

pub fn rope_backward(
    rec: &mut Recorder<'_>,
    dy: &Tensor,
    table: &RopeTable,
    offset: usize,
    pairing: Pairing,
) -> Result<Tensor> {
    run(rec, "rope_backward", dy, table, offset, pairing, true)
}
