//! Embedding gather (f32 and f16 tables) and its deterministic backward.

use super::{push, s, twice, CheckResult, Outcome};
use crate::check::{compare, same_bits, Rng, Tolerance};
use crate::gpu::{Gpu, Tensor};
use crate::ops::embedding::{embedding, embedding_backward_into, SEGMENT};
use crate::reference::{embedding as cpu, widen};

/// (ids shape, V, H, f16 table): odd sizes with a batch, an odd H for the f16 pairs, and
/// 65537 x 256 outputs (grid goes 2-D).
pub const FWD_CASES: [(&[usize], usize, usize, bool); 4] = [
    (&[3, 11], 50, 7, false),
    (&[4, 9], 33, 5, true),
    (&[65_537], 1000, 256, false),
    (&[1], 1, 1, true),
];

/// (ids shape, V, H, hot id share, accumulate): random ids; few ids repeated (segments);
/// one id in half of the positions; accumulation into an existing gradient; and V x H past
/// 65535 x 256 (the final pass goes 2-D).
pub const BWD_CASES: [(&[usize], usize, usize, f64, bool); 5] = [
    (&[2, 37], 50, 7, 0.0, false),
    (&[1000], 20, 33, 0.0, false),
    (&[5, 1000], 3000, 9, 0.5, false),
    (&[300], 40, 5, 0.3, true),
    (&[300], 65_536, 257, 0.0, false),
];

pub(super) async fn checks(gpu: &Gpu, out: &mut Vec<CheckResult>) {
    for (i, &(ishape, v, h, f16)) in FWD_CASES.iter().enumerate() {
        let mut rng = Rng::new(700 + i as u64);
        let n: usize = ishape.iter().product();
        let table = rng.vec(v * h);
        let table16: Vec<half::f16> = table.iter().map(|&x| half::f16::from_f32(x)).collect();
        let ids: Vec<u32> = (0..n).map(|_| (rng.next_u64() % v as u64) as u32).collect();
        let r = twice("embedding", async || {
            let t = if f16 {
                Tensor::from_f16(gpu, &[v, h], &table16, "table")?
            } else {
                Tensor::from_f32(gpu, &[v, h], &table, "table")?
            };
            let ti = Tensor::from_u32(gpu, ishape, &ids, "ids")?;
            let y = gpu.run_async(|rec| embedding(rec, &t, &ti)).await?;
            Ok(vec![y.to_vec_f32(gpu).await?])
        })
        .await
        .and_then(|got| {
            let src: Vec<f64> = if f16 {
                table16.iter().map(|x| x.to_f64()).collect()
            } else {
                widen(&table)
            };
            // A gather copies: exact.
            compare(
                "embedding",
                &got[0],
                &cpu::embedding(&src, h, &ids),
                None,
                Tolerance { abs: 0.0, rel: 0.0 },
            )
            .map_err(s)
        });
        push(
            out,
            "embedding",
            format!(
                "table [{v}, {h}] {}, ids {ishape:?}",
                if f16 { "f16" } else { "f32" }
            ),
            r,
        );
    }
    for (i, &(ishape, v, h, hot, accumulate)) in BWD_CASES.iter().enumerate() {
        let mut rng = Rng::new(800 + i as u64);
        let n: usize = ishape.iter().product();
        let ids: Vec<u32> = (0..n)
            // Even positions in the first 2 * hot of the sequence: a `hot` share of all.
            .map(|k| {
                if k % 2 == 0 && (k as f64) < 2.0 * hot * n as f64 {
                    17 % v as u32
                } else {
                    (rng.next_u64() % v as u64) as u32
                }
            })
            .collect();
        let dout = rng.vec(n * h);
        let init = rng.vec(v * h);
        let dshape = [ishape, &[h][..]].concat();
        let r = twice("embedding_backward", async || {
            let ti = Tensor::from_u32(gpu, ishape, &ids, "ids")?;
            let td = Tensor::from_f32(gpu, &dshape, &dout, "dout")?;
            let dt = Tensor::from_f32(gpu, &[v, h], &init, "dtable")?;
            gpu.run_async(|rec| embedding_backward_into(rec, &ti, &td, &dt, accumulate))
                .await?;
            Ok(vec![dt.to_vec_f32(gpu).await?])
        })
        .await
        .and_then(|got| {
            let mut want = cpu::embedding_backward(&ids, &widen(&dout), v, h);
            let abs: Vec<f64> = dout.iter().map(|x| x.abs() as f64).collect();
            let mut scale = cpu::embedding_backward(&ids, &abs, v, h);
            if accumulate {
                for k in 0..v * h {
                    want[k] += init[k] as f64;
                    scale[k] += init[k].abs() as f64;
                }
            }
            let most = (0..v)
                .map(|id| ids.iter().filter(|&&x| x == id as u32).count())
                .max()
                .unwrap_or(1);
            let st = compare(
                "embedding_backward",
                &got[0],
                &want,
                Some(&scale),
                Tolerance::sum(most + 1),
            )
            .map_err(s)?;
            // And bit for bit the documented order: positions ascending, long runs in segments.
            let exact = cpu::embedding_backward_f32_ordered(
                &ids,
                &dout,
                accumulate.then_some(&init[..]),
                v,
                h,
                SEGMENT,
            );
            same_bits("embedding_backward (summation order)", &exact, &got[0]).map_err(s)?;
            Ok(st)
        });
        let what = format!(
            "ids {ishape:?} -> [{v}, {h}]{}{}",
            if hot > 0.0 { " hot id" } else { "" },
            if accumulate { " +=" } else { "" }
        );
        push(out, "embedding backward", what, r);
    }
    push(
        out,
        "embedding bad id",
        "V = 10, id 12 at position 2".into(),
        bad_id(gpu).await,
    );
}

/// An id >= V must come back as an error naming it, from the forward and the backward.
async fn bad_id(gpu: &Gpu) -> Outcome {
    let t = Tensor::from_f32(gpu, &[10, 4], &[1.0; 40], "table").map_err(s)?;
    let ids = Tensor::from_u32(gpu, &[4], &[0, 9, 12, 3], "ids").map_err(s)?;
    let d = Tensor::from_f32(gpu, &[4, 4], &[1.0; 16], "dout").map_err(s)?;
    let fwd = gpu.run_async(|rec| embedding(rec, &t, &ids)).await;
    let bwd = gpu
        .run_async(|rec| embedding_backward_into(rec, &ids, &d, &t, false))
        .await;
    for (what, r) in [("forward", fwd.map(|_| ())), ("backward", bwd)] {
        match r {
            Err(crate::Error::IndexOutOfRange {
                position: 2,
                id: 12,
                limit: 10,
                ..
            }) => {}
            Err(e) => return Err(format!("{what}: wrong error: {e}")),
            Ok(()) => return Err(format!("{what}: id 12 with V = 10 was accepted")),
        }
    }
    Ok(Default::default())
}
