//! Column ranges of row-major f32 matrices: `slice` takes columns start..start + width of
//! every row (a stacked product's output split into q, k and v), `place` writes a slice's
//! gradient back into the wider matrix (zeros elsewhere, or added into a gradient being
//! accumulated). Shader: `columns.wgsl`. The derivative pair: d slice = place, and place
//! is linear in its input.

use super::expect_f32;
use crate::error::{Error, Result};
use crate::gpu::{Binding::*, DType, Grid, Kernel, Recorder, Tensor};
use crate::shaders::COLUMNS;

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
pub struct Params {
    pub rows: u32,
    pub width: u32,
    pub src_stride: u32,
    pub src_off: u32,
    pub dst_stride: u32,
    pub dst_off: u32,
    pub mode: u32,
    pub _pad: u32,
}

static COLUMNS_K: Kernel = Kernel::new(&COLUMNS, "columns", &[(1, Read), (2, ReadWrite)]);

fn check(op: &'static str, x: &Tensor, start: usize, width: usize) -> Result<usize> {
    expect_f32(op, x)?;
    let cols = x.shape().last().copied().unwrap_or(0);
    if width == 0 || start + width > cols {
        return Err(Error::Shape {
            op,
            detail: format!(
                "columns {start}..{} of {:?}: outside its {cols} columns (or empty)",
                start + width,
                x.shape()
            ),
        });
    }
    Ok(cols)
}

/// x (.., C) -> (.., width): columns start .. start + width of every row.
pub fn slice(rec: &mut Recorder<'_>, x: &Tensor, start: usize, width: usize) -> Result<Tensor> {
    let cols = check("slice", x, start, width)?;
    let rows = x.numel() / cols;
    let mut shape = x.shape().to_vec();
    *shape.last_mut().expect("checked") = width;
    let y = Tensor::empty(rec.gpu(), &shape, DType::F32, "slice.y")?;
    let p = Params {
        rows: rows as u32,
        width: width as u32,
        src_stride: cols as u32,
        src_off: start as u32,
        dst_stride: width as u32,
        dst_off: 0,
        mode: 0,
        _pad: 0,
    };
    let n = (rows * width) as u64;
    rec.dispatch(
        &COLUMNS_K,
        &[],
        bytemuck::bytes_of(&p),
        &[x, &y],
        Grid::cover(n, 256),
    )?;
    Ok(y)
}

/// g (.., width) into columns start .. start + width of `into` (.., C): added to what it
/// holds when `into` is given (returned), else a new (.., C) with zeros elsewhere.
pub fn place(
    rec: &mut Recorder<'_>,
    g: &Tensor,
    start: usize,
    cols: usize,
    into: Option<&Tensor>,
) -> Result<Tensor> {
    expect_f32("place", g)?;
    let width = g.shape().last().copied().unwrap_or(0);
    let mut shape = g.shape().to_vec();
    if let Some(l) = shape.last_mut() {
        *l = cols;
    }
    let (dst, mode) = match into {
        Some(t) => {
            check("place", t, start, width)?;
            if t.shape() != shape.as_slice() {
                return Err(Error::Shape {
                    op: "place",
                    detail: format!("g {:?} into {:?}: rows differ", g.shape(), t.shape()),
                });
            }
            (t.clone(), 1)
        }
        None => (Tensor::empty(rec.gpu(), &shape, DType::F32, "place.y")?, 2),
    };
    check("place", &dst, start, width)?;
    let rows = g.numel() / width;
    let p = Params {
        rows: rows as u32,
        width: width as u32,
        src_stride: width as u32,
        src_off: 0,
        dst_stride: cols as u32,
        dst_off: start as u32,
        mode,
        _pad: 0,
    };
    let n = match mode {
        2 => rows * cols,
        _ => rows * width,
    } as u64;
    rec.dispatch(
        &COLUMNS_K,
        &[],
        bytemuck::bytes_of(&p),
        &[g, &dst],
        Grid::cover(n, 256),
    )?;
    Ok(dst)
}
