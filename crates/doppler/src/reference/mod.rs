//! Plain CPU loops in f64: the oracle the GPU kernels are tested against. Same names as
//! the ops they check. Every backward here is itself checked against central finite
//! differences of its forward.

pub mod attention;
pub mod bias;
pub mod conv2d;
pub mod convnet;
pub mod cross_entropy;
pub mod dropout;
pub mod embedding;
pub mod gelu;
pub mod groupnorm;
pub mod norm;
pub mod optim;
pub mod pool;
pub mod quant;
pub mod rope;
pub mod silu;
pub mod softmax;
pub mod transformer;
pub mod upsample;

/// Central finite differences of a scalar function: d f / d x_i ~ (f(x + h e_i) - f(x - h e_i)) / 2h,
/// with h scaled to each x_i.
pub fn finite_diff(f: impl Fn(&[f64]) -> f64, x: &[f64]) -> Vec<f64> {
    let mut x = x.to_vec();
    (0..x.len())
        .map(|i| {
            let v = x[i];
            let h = 1e-5 * v.abs().max(1.0);
            x[i] = v + h;
            let up = f(&x);
            x[i] = v - h;
            let down = f(&x);
            x[i] = v;
            (up - down) / (2.0 * h)
        })
        .collect()
}

/// Panics naming the first index where |got - want| > tol * max(1, |want|).
pub fn assert_close(what: &str, got: &[f64], want: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len(), "{what}: lengths differ");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= tol * w.abs().max(1.0),
            "{what}: index {i}: {g} vs {w}"
        );
    }
}

/// f32 data as f64, for feeding GPU test inputs to the reference.
pub fn widen(x: &[f32]) -> Vec<f64> {
    x.iter().map(|&v| v as f64).collect()
}

/// a + b
pub fn add(a: &[f32], b: &[f32]) -> Vec<f64> {
    a.iter()
        .zip(b)
        .map(|(&x, &y)| x as f64 + y as f64)
        .collect()
}

/// a * b
pub fn mul(a: &[f32], b: &[f32]) -> Vec<f64> {
    a.iter()
        .zip(b)
        .map(|(&x, &y)| x as f64 * y as f64)
        .collect()
}

/// alpha * a
pub fn scale(a: &[f32], alpha: f32) -> Vec<f64> {
    a.iter().map(|&x| alpha as f64 * x as f64).collect()
}

/// Row sums of x (rows, n), and the sums of |x| (the scale of the rounding error).
pub fn sum_rows(x: &[f32], rows: usize, n: usize) -> (Vec<f64>, Vec<f64>) {
    (0..rows)
        .map(|r| {
            let row = &x[r * n..(r + 1) * n];
            (
                row.iter().map(|&v| v as f64).sum::<f64>(),
                row.iter().map(|&v| (v as f64).abs()).sum::<f64>(),
            )
        })
        .unzip()
}

/// Layout of a batched product, as `ops::matmul` takes it.
#[derive(Clone, Copy, Debug)]
pub struct MatmulDims {
    pub batch: usize,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub trans_a: bool,
    pub trans_b: bool,
    /// false: A has no batch dimension and is shared by every batch.
    pub batched_a: bool,
    pub batched_b: bool,
}

/// C = alpha * op(A) @ op(B) + bias + beta * C0 (C0 may be empty when beta = 0; bias (N)
/// added to every row), and the matching sum of |alpha * a * b| + |bias| + |beta * c0| per
/// element (the scale of the rounding error).
#[allow(clippy::too_many_arguments)]
pub fn matmul(
    a: &[f32],
    b: &[f32],
    c0: &[f32],
    bias: Option<&[f32]>,
    d: MatmulDims,
    alpha: f32,
    beta: f32,
) -> (Vec<f64>, Vec<f64>) {
    let MatmulDims { batch, m, n, k, .. } = d;
    let mut c = vec![0.0; batch * m * n];
    let mut scale = vec![0.0; batch * m * n];
    for bi in 0..batch {
        let ao = if d.batched_a { bi * m * k } else { 0 };
        let bo = if d.batched_b { bi * k * n } else { 0 };
        for i in 0..m {
            for j in 0..n {
                let (mut s, mut s_abs) = (0.0f64, 0.0f64);
                for p in 0..k {
                    let av = if d.trans_a {
                        a[ao + p * m + i]
                    } else {
                        a[ao + i * k + p]
                    } as f64;
                    let bv = if d.trans_b {
                        b[bo + j * k + p]
                    } else {
                        b[bo + p * n + j]
                    } as f64;
                    s += av * bv;
                    s_abs += (av * bv).abs();
                }
                let idx = bi * m * n + i * n + j;
                let old = if beta != 0.0 {
                    beta as f64 * c0[idx] as f64
                } else {
                    0.0
                };
                let bj = bias.map_or(0.0, |b| b[j] as f64);
                c[idx] = alpha as f64 * s + bj + old;
                scale[idx] = (alpha as f64 * s_abs).abs() + bj.abs() + old.abs();
            }
        }
    }
    (c, scale)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matmul_reference_by_hand() {
        // [[1,2],[3,4]] @ [[5,6],[7,8]] = [[19,22],[43,50]]
        let d = MatmulDims {
            batch: 1,
            m: 2,
            n: 2,
            k: 2,
            trans_a: false,
            trans_b: false,
            batched_a: true,
            batched_b: true,
        };
        let (c, _) = matmul(&[1., 2., 3., 4.], &[5., 6., 7., 8.], &[], None, d, 1.0, 0.0);
        assert_eq!(c, vec![19., 22., 43., 50.]);
        // Same product from transposed storage of both operands.
        let dt = MatmulDims {
            trans_a: true,
            trans_b: true,
            ..d
        };
        let (ct, _) = matmul(
            &[1., 3., 2., 4.],
            &[5., 7., 6., 8.],
            &[],
            None,
            dt,
            1.0,
            0.0,
        );
        assert_eq!(ct, c);
        // alpha and beta.
        let (c2, _) = matmul(
            &[1., 2., 3., 4.],
            &[5., 6., 7., 8.],
            &[1., 1., 1., 1.],
            None,
            d,
            2.0,
            3.0,
        );
        assert_eq!(c2, vec![41., 47., 89., 103.]);
        // A bias row, not scaled by alpha.
        let (c3, _) = matmul(
            &[1., 2., 3., 4.],
            &[5., 6., 7., 8.],
            &[],
            Some(&[10., 20.]),
            d,
            2.0,
            0.0,
        );
        assert_eq!(c3, vec![48., 64., 96., 120.]);
    }

    #[test]
    fn sum_rows_by_hand() {
        let (s, a) = sum_rows(&[1., -2., 3., 4., 5., -6.], 2, 3);
        assert_eq!(s, vec![2., 3.]);
        assert_eq!(a, vec![6., 15.]);
    }
}
