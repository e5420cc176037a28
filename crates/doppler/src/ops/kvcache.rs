//! Inference attention over a key/value cache: storing new keys and values, and causal
//! grouped-query attention of new queries over everything cached. Shader: `kvcache.wgsl`.
//! (Training uses `attention`, whose backward needs the logsumexp; this one has none.)

use super::expect_f32;
use crate::error::{Error, Result};
use crate::gpu::{Binding::*, DType, Gpu, Grid, Kernel, Recorder, Tensor};
use crate::ops::attention::{self, AttnOpts, AttnPath};
use crate::ops::rope::{Pairing, RopeTable};
use crate::shaders::KVCACHE;
use bytemuck::Zeroable;

#[repr(C)]
#[derive(Clone, Copy, Debug, bytemuck::Pod, bytemuck::Zeroable)]
pub struct Params {
    pub t: u32,
    pub pos: u32,
    pub hq: u32,
    pub hkv: u32,
    pub d: u32,
    pub tmax: u32,
    pub scale: f32,
    pub row: u32,
    /// 0: every earlier key; else the keys of the last `window` positions.
    pub window: u32,
    /// The cache's rows: token j is in row j % ring.
    pub ring: u32,
    /// rope_store of the unsummed partials: slices of k the projections come in.
    pub splits: u32,
    pub _pad: u32,
}

static STORE: Kernel = Kernel::new(&KVCACHE, "kv_store", &[(5, Read), (6, ReadWrite)]);
static WIDEN: Kernel = Kernel::new(&KVCACHE, "kv_widen", &[(4, ReadWrite), (6, ReadWrite)]);
static ATTEND: Kernel = Kernel::new(
    &KVCACHE,
    "attend",
    &[(1, Read), (2, Read), (3, Read), (4, ReadWrite)],
);
static ATTEND_PART: Kernel = Kernel::new(
    &KVCACHE,
    "attend_part",
    &[
        (1, Read),
        (2, Read),
        (3, Read),
        (14, Read),
        (15, Read),
        (16, Read),
        (17, Read),
        (12, ReadWrite),
        (18, Read),
    ],
);
static ATTEND_MERGE: Kernel =
    Kernel::new(&KVCACHE, "attend_merge", &[(4, ReadWrite), (12, ReadWrite)]);
static ATTEND_MERGE_X8: Kernel = Kernel::new(
    &KVCACHE,
    "attend_merge_x8",
    &[(12, ReadWrite), (13, ReadWrite)],
);

/// Queries up to which attention splits the keys into ranges of 64 (decode), however few
/// the keys: since `attend_part` loads its keys and values up front, that is faster than
/// one workgroup a head (`attend`) for short contexts too (H200, SmolLM2 shapes, 16 + 100
/// tokens: 920-938 -> 978-1000 tok/s, GPU 1.04 -> 0.89 ms a step).
pub const SPLIT_MAX_QUERIES: usize = 4;
const SPLIT: usize = 64;

static ROPE_STORE: Kernel = Kernel::new(
    &KVCACHE,
    "rope_store",
    &[
        (5, Read),
        (7, Read),
        (8, Read),
        (9, ReadWrite),
        (10, ReadWrite),
        (11, ReadWrite),
        (18, Read),
    ],
);

/// Largest head dimension (one thread per dimension in a workgroup of 256).
pub const MAX_HEAD_DIM: usize = 256;

/// How a cache stores keys and values (llama.cpp's cache types): f32, f16, or q8_0 (per
/// head and token, D / 4 words of 8-bit integers and D / 32 f32 scales, one a block of 32:
/// 1.125 bytes a value; head size a multiple of 32). Every sum over them is f32.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum KvType {
    F32,
    F16,
    Q8_0,
}

impl KvType {
    /// A cache tensor's type: f32 and f16 tensors as such, q8_0 as u32 words.
    pub fn of(t: &Tensor) -> KvType {
        match t.dtype() {
            DType::F32 => KvType::F32,
            DType::F16 => KvType::F16,
            DType::U32 => KvType::Q8_0,
        }
    }

    /// The tensor of `rows` tokens of `hkv` heads of `d` values.
    pub fn tensor(
        self,
        gpu: &Gpu,
        rows: usize,
        hkv: usize,
        d: usize,
        label: &str,
    ) -> Result<Tensor> {
        match self {
            KvType::F32 => Tensor::empty(gpu, &[rows, hkv, d], DType::F32, label),
            KvType::F16 => Tensor::empty(gpu, &[rows, hkv, d], DType::F16, label),
            KvType::Q8_0 => Tensor::empty(gpu, &[rows, hkv, d * 9 / 32], DType::U32, label),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            KvType::F32 => "f32",
            KvType::F16 => "f16",
            KvType::Q8_0 => "q8_0",
        }
    }
}

/// A cache tensor's shape in values: (rows, Hkv, D) (q8_0's words: D * 9 / 32 a head).
fn logical(t: &Tensor) -> Vec<usize> {
    let mut s = t.shape().to_vec();
    if t.dtype() == DType::U32 && s.len() == 3 {
        s[2] = if s[2] % 9 == 0 { s[2] / 9 * 32 } else { 0 };
    }
    s
}

/// The kernels' KV_F16 and KV_Q8 constants for caches of one type, or an error naming `op`.
fn kv_consts(op: &'static str, caches: &[&Tensor]) -> Result<[(&'static str, f64); 2]> {
    let ty = KvType::of(caches[0]);
    if caches.iter().any(|c| KvType::of(c) != ty) {
        return Err(Error::Shape {
            op,
            detail: format!(
                "caches {:?}: expected one type (f32, f16 or q8_0)",
                caches.iter().map(|c| KvType::of(c)).collect::<Vec<_>>()
            ),
        });
    }
    Ok([
        ("KV_F16", (ty == KvType::F16) as u32 as f64),
        ("KV_Q8", (ty == KvType::Q8_0) as u32 as f64),
    ])
}

/// Tokens a step may add to a layer with an attention window beyond the window itself:
/// such a layer keeps a ring of `window - 1 + RING_STEP` rows (the last keys), and longer
/// prompts run in steps of at most `RING_STEP` tokens (llama.cpp sizes its sliding-window
/// caches the same way, from its batch of 512).
pub const RING_STEP: usize = 512;

/// Keys and values of every layer for up to `capacity` tokens, each (rows, Hkv, D): all
/// `capacity` rows, or for a layer with an attention window of W (`windows`) a ring of the
/// last min(capacity, W - 1 + step) tokens. Stored as f32 or f16 (`dtype`; every sum over
/// them is f32).
pub struct KvCache {
    pub k: Vec<Tensor>,
    pub v: Vec<Tensor>,
    /// Each layer's attention window (None: every earlier token).
    pub windows: Vec<Option<usize>>,
    /// Tokens stored so far.
    pub len: usize,
    pub capacity: usize,
    pub hkv: usize,
    pub d: usize,
}

impl KvCache {
    /// An f32 cache of `layers` layers attending to every earlier token.
    pub fn new(gpu: &Gpu, layers: usize, capacity: usize, hkv: usize, d: usize) -> Result<KvCache> {
        let windows = vec![None; layers];
        Self::with_windows(gpu, &windows, capacity, hkv, d, RING_STEP, KvType::F32)
    }

    /// A cache whose layers attend to the windows given (one per layer), each windowed
    /// layer holding a ring of `window - 1 + step` rows where that is less than `capacity`.
    pub fn with_windows(
        gpu: &Gpu,
        windows: &[Option<usize>],
        capacity: usize,
        hkv: usize,
        d: usize,
        step: usize,
        ty: KvType,
    ) -> Result<KvCache> {
        if d == 0
            || d > MAX_HEAD_DIM
            || d % 4 != 0
            || hkv == 0
            || capacity == 0
            || step == 0
            || windows.contains(&Some(0))
            || (ty == KvType::Q8_0 && d % 32 != 0)
        {
            return Err(Error::Invalid {
                op: "kv_cache",
                detail: format!(
                    "capacity {capacity}, {hkv} kv heads of dim {d} (a multiple of 4 up to {MAX_HEAD_DIM}; of 32 for q8_0), windows {windows:?}, step {step}, {}",
                    ty.name()
                ),
            });
        }
        let mut k = Vec::with_capacity(windows.len());
        let mut v = Vec::with_capacity(windows.len());
        for w in windows {
            let rows = w.map_or(capacity, |w| capacity.min(w - 1 + step));
            k.push(ty.tensor(gpu, rows, hkv, d, "kv_cache.k")?);
            v.push(ty.tensor(gpu, rows, hkv, d, "kv_cache.v")?);
        }
        Ok(KvCache {
            k,
            v,
            windows: windows.to_vec(),
            len: 0,
            capacity,
            hkv,
            d,
        })
    }

    /// Room for `t` more tokens?
    pub fn fits(&self, t: usize) -> bool {
        self.len + t <= self.capacity
    }

    /// The most tokens one step may add: a ring holds a window's keys and one step's.
    pub fn max_step(&self) -> usize {
        self.windows
            .iter()
            .zip(&self.k)
            .filter_map(|(w, k)| {
                let rows = k.shape()[0];
                w.filter(|_| rows < self.capacity).map(|w| rows + 1 - w)
            })
            .min()
            .unwrap_or(usize::MAX)
    }

    /// Bytes the caches take on the GPU.
    pub fn bytes(&self) -> u64 {
        self.k.iter().chain(&self.v).map(|t| t.byte_size()).sum()
    }

    /// f32, f16 or q8_0.
    pub fn kv_type(&self) -> KvType {
        self.k.first().map_or(KvType::F32, KvType::of)
    }
}

/// The cache type a model gets by default: f16 where the adapter has shader-f16 (the
/// kernels pack and unpack halves in core WGSL, but an adapter without f16 arithmetic is
/// taken as one whose users expect f32 throughout), f32 otherwise.
pub fn default_kv_type(gpu: &Gpu) -> KvType {
    match gpu.features.contains(wgpu::Features::SHADER_F16) {
        true => KvType::F16,
        false => KvType::F32,
    }
}

fn params(
    q: &[usize],
    cache: &[usize],
    pos: usize,
    window: Option<usize>,
    what: &str,
) -> Result<Params> {
    let err = |why: String| Error::Shape {
        op: "kv_attend",
        detail: format!("{what} {q:?}, cache {cache:?}, position {pos}, window {window:?}: {why}"),
    };
    if q.len() != 3 || cache.len() != 3 {
        return Err(err(
            "expected (T, H, D) and a cache (capacity, Hkv, D)".into()
        ));
    }
    let (t, h, d) = (q[0], q[1], q[2]);
    let (tmax, hkv) = (cache[0], cache[1]);
    if cache[2] != d || d == 0 || d > MAX_HEAD_DIM || d % 4 != 0 {
        return Err(err(format!(
            "head dims differ, or are not a multiple of 4 up to {MAX_HEAD_DIM} (of 32 for q8_0)"
        )));
    }
    // A windowed layer's cache is a ring once the tokens pass its rows: it must then hold
    // the window before the first new token and the new tokens.
    let ring_holds = window.is_some_and(|w| w > 0 && w - 1 + t <= tmax);
    if pos + t > tmax && !ring_holds {
        return Err(err(format!(
            "{} tokens exceed the cache's {tmax} rows{}",
            pos + t,
            match window {
                Some(w) => format!(" (a ring needs {} for a window of {w})", w + t - 1),
                None => String::new(),
            }
        )));
    }
    if window == Some(0) {
        return Err(err("a window of 0 keys".into()));
    }
    if t == 0 || hkv == 0 || h % hkv != 0 {
        return Err(err(
            "no tokens, or query heads not a multiple of kv heads".into()
        ));
    }
    Ok(Params {
        t: t as u32,
        pos: pos as u32,
        hq: h as u32,
        hkv: hkv as u32,
        d: d as u32,
        tmax: tmax as u32,
        scale: 1.0 / (d as f32).sqrt(),
        row: (hkv * d) as u32,
        window: window.unwrap_or(0) as u32,
        ring: tmax as u32,
        splits: 1,
        _pad: 0,
    })
}

/// Writes `x` (T, Hkv, D) into `cache` at tokens pos..pos+T (rows (pos + t) % rows: with a
/// `window`, the cache may be a ring).
pub fn kv_store(
    rec: &mut Recorder<'_>,
    cache: &Tensor,
    x: &Tensor,
    pos: usize,
    window: Option<usize>,
) -> Result<()> {
    expect_f32("kv_store", x)?;
    let p = params(x.shape(), &logical(cache), pos, window, "x")?;
    if p.hq != p.hkv {
        return Err(Error::Shape {
            op: "kv_store",
            detail: format!("x {:?} vs cache {:?}", x.shape(), cache.shape()),
        });
    }
    let c = kv_consts("kv_store", &[cache])?;
    // An element a thread, a pair (f16), a block of 32 (q8_0).
    let per = match KvType::of(cache) {
        KvType::F32 => 1,
        KvType::F16 => 2,
        KvType::Q8_0 => 32,
    };
    let threads = (p.t * p.row) as u64 / per;
    rec.dispatch(
        &STORE,
        &c,
        bytemuck::bytes_of(&p),
        &[x, cache],
        Grid::cover(threads, 256),
    )
}

/// The first `rows` rows of a cache (rows, Hkv, D) as a new f32 tensor (1, rows, Hkv, D).
fn widen(rec: &mut Recorder<'_>, cache: &Tensor, rows: usize) -> Result<Tensor> {
    let sh = logical(cache);
    let row = sh[1] * sh[2];
    let out = Tensor::empty(
        rec.gpu(),
        &[1, rows, sh[1], sh[2]],
        DType::F32,
        "kv_widen.o",
    )?;
    let p = Params {
        t: rows as u32,
        d: sh[2] as u32,
        row: row as u32,
        ring: sh[0] as u32,
        ..Params::zeroed()
    };
    let c = kv_consts("kv_widen", &[cache])?;
    rec.dispatch(
        &WIDEN,
        &c,
        bytemuck::bytes_of(&p),
        &[&out, cache],
        Grid::cover((rows * row) as u64, 256),
    )?;
    Ok(out)
}

/// A token's attention split over key ranges and not merged yet: `part` (Hq, splits, D + 2)
/// holds each range's unnormalised output, max score and sum of exponentials. A product
/// can merge it on the way in ([`crate::ops::quant::qmatvec_merged`]).
pub struct AttnParts {
    pub part: Tensor,
    pub heads: usize,
    pub d: usize,
    pub splits: usize,
}

/// The first half of [`kv_attend`] when it splits the keys into ranges (up to
/// [`SPLIT_MAX_QUERIES`] queries): the ranges' partial results. None when it would not
/// split.
pub fn kv_attend_parts(
    rec: &mut Recorder<'_>,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    pos: usize,
    window: Option<usize>,
) -> Result<Option<AttnParts>> {
    expect_f32("kv_attend", q)?;
    let p = params(q.shape(), &logical(k), pos, window, "q")?;
    if k.shape() != v.shape() {
        return Err(Error::Shape {
            op: "kv_attend",
            detail: format!("k cache {:?} vs v cache {:?}", k.shape(), v.shape()),
        });
    }
    // Keys from the first one the first query sees (kvcache.wgsl's first_key(0)).
    let first = window.map_or(0, |w| (pos + 1).saturating_sub(w));
    let (t, keys) = (p.t as usize, pos + p.t as usize - first);
    if t > SPLIT_MAX_QUERIES {
        return Ok(None);
    }
    let splits = keys.div_ceil(SPLIT);
    let rows = t * p.hq as usize * splits;
    let part = Tensor::empty(
        rec.gpu(),
        &[rows, p.d as usize + 2],
        DType::F32,
        "kv_attend.part",
    )?;
    let pre = part_preload(p.d as usize);
    let [c16, c8] = kv_consts("kv_attend", &[k, v])?;
    // (Binding 18, the page lists, is read only with PAGED: q stands in.)
    rec.dispatch(
        &ATTEND_PART,
        &[("PRE", pre as f64), c16, c8],
        bytemuck::bytes_of(&p),
        &[q, k, v, k, v, k, v, &part, q],
        Grid::Linear(rows as u64),
    )?;
    Ok(Some(AttnParts {
        part,
        heads: t * p.hq as usize,
        d: p.d as usize,
        splits,
    }))
}

/// `attend_part`'s PRE: the vec4s of keys and of values a thread holds: (D / 4) / 4
/// quarters, and 64 keys over 256 / (D / 4) groups: D / 16 each, at least 1, at most the
/// kernel's 8.
fn part_preload(d: usize) -> usize {
    d.div_ceil(16).clamp(1, 8)
}

/// Causal attention of q (T, Hq, D), the tokens at pos..pos+T, over the cached keys and
/// values 0..pos+T (the new ones stored already), or with a `window` of W over the last W
/// of them (query i sees keys j, i - W < j <= i; the cache may then be a ring). Scale
/// 1/sqrt(D). Up to
/// [`SPLIT_MAX_QUERIES`] queries split the keys into ranges (two dispatches, many more
/// workgroups); more queries run the tiled attention of `ops::attention` where it fits
/// (its cooperative-matrix forward to head dim 128 where [`prompt_on_coop`]; else the
/// tiled kernels to head dim 64, cooperative when the GPU was opened for f16 products),
/// otherwise one workgroup per (t, h).
pub fn kv_attend(
    rec: &mut Recorder<'_>,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    pos: usize,
    window: Option<usize>,
) -> Result<Tensor> {
    let parts = kv_attend_parts(rec, q, k, v, pos, window)?;
    let p = params(q.shape(), &logical(k), pos, window, "q")?;
    let (t, hq, hkv, d) = (p.t as usize, p.hq as usize, p.hkv as usize, p.d as usize);
    // The tiled kernels read keys 0..pos+T in order: a ring that has wrapped goes to
    // `attend`, as does a window that hides keys from some query (no mask for it there).
    let contiguous = pos + t <= k.shape()[0] && window.is_none_or(|w| pos + t <= w);
    let coop = prompt_on_coop(rec.gpu(), d);
    if parts.is_none()
        && t > SPLIT_MAX_QUERIES
        && contiguous
        && (coop || attention::tiled_fits(rec.gpu(), d))
    {
        // A prompt: the training kernels' tiled attention (a block of queries shares each
        // tile of keys) over the filled part of the caches; its causal mask lets query i
        // see keys up to pos + i. On cooperative matrices (f16 operands, f32 sums, head
        // dim <= 128) where the quantized prompt products are ([`prompt_on_coop`]), else
        // `Auto`: the cooperative kernels when the GPU was opened for f16 products
        // (`DOPPLER_MATMUL=f16`), the tiled ones otherwise (which fit: checked above).
        let opts = AttnOpts {
            causal: true,
            scale: None,
            path: if coop { AttnPath::Coop } else { AttnPath::Auto },
            dropout: None,
        };
        // f16 caches: their rows copied out as f32 (one pass over them; the attention
        // reads each many times).
        let (kc, vc) = match k.dtype() {
            DType::F32 => (
                k.prefix(&[1, pos + t, hkv, d])?,
                v.prefix(&[1, pos + t, hkv, d])?,
            ),
            _ => (widen(rec, k, pos + t)?, widen(rec, v, pos + t)?),
        };
        let out = attention::attention(rec, &q.reshape(&[1, t, hq, d])?, &kc, &vc, opts)?;
        return out.o.reshape(q.shape());
    }
    if let Some(parts) = parts {
        return attend_merge(rec, &parts)?.reshape(q.shape());
    }
    let o = Tensor::empty(rec.gpu(), q.shape(), DType::F32, "kv_attend.o")?;
    let grid = Grid::Linear((p.t * p.hq) as u64);
    let c = kv_consts("kv_attend", &[k, v])?;
    rec.dispatch(&ATTEND, &c, bytemuck::bytes_of(&p), &[q, k, v, &o], grid)?;
    Ok(o)
}

/// Whether prompts (more than [`SPLIT_MAX_QUERIES`] queries over contiguous keys) attend
/// on cooperative matrices at head dim `d`: where the quantized prompt products do
/// ([`crate::gpu::GpuOptions::quant_coop`], default on; `DOPPLER_QUANT_COOP=off` keeps
/// both f32) and the forward fits ([`attention::coop_forward_fits`]).
pub fn prompt_on_coop(gpu: &Gpu, d: usize) -> bool {
    gpu.quant_coop && attention::coop_forward_fits(gpu, d)
}

/// The second half of [`kv_attend`]: each (query, head)'s key ranges merged, o (1, T Hq,
/// D) (`parts.heads` = T Hq rows; a query's ranges past its own keys are empty).
pub fn attend_merge(rec: &mut Recorder<'_>, parts: &AttnParts) -> Result<Tensor> {
    let p = parts_params(parts, "attend_merge")?;
    let o = Tensor::empty(
        rec.gpu(),
        &[1, parts.heads, parts.d],
        DType::F32,
        "attend_merge.o",
    )?;
    let grid = Grid::Linear(parts.heads as u64);
    rec.dispatch(
        &ATTEND_MERGE,
        &[],
        bytemuck::bytes_of(&p),
        &[&o, &parts.part],
        grid,
    )?;
    Ok(o)
}

/// [`attend_merge`] with its output rounded for an XQ8 decode product (`quant.wgsl`'s
/// layout of x: the row of Hq D columns in groups of 16, as `quant::quantize_x8` rounds it;
/// D a multiple of 16): one dispatch instead of two, the same bits.
pub fn attend_merge_x8(rec: &mut Recorder<'_>, parts: &AttnParts) -> Result<Tensor> {
    let p = parts_params(parts, "attend_merge_x8")?;
    if parts.d % 16 != 0 {
        return Err(Error::Shape {
            op: "attend_merge_x8",
            detail: format!("head size {} is not a multiple of 16", parts.d),
        });
    }
    let k = parts.heads * parts.d;
    let xq = Tensor::empty(
        rec.gpu(),
        &[1, k / 4 + k / 8],
        DType::U32,
        "attend_merge_x8.xq",
    )?;
    let grid = Grid::Linear(parts.heads as u64);
    rec.dispatch(
        &ATTEND_MERGE_X8,
        &[],
        bytemuck::bytes_of(&p),
        &[&parts.part, &xq],
        grid,
    )?;
    Ok(xq)
}

/// The merge kernels' parameters for parts of `heads` rows over `splits` ranges: the
/// kernels read only the head size and (through splits()) the range count.
fn parts_params(parts: &AttnParts, op: &'static str) -> Result<Params> {
    let (h, d, ns) = (parts.heads, parts.d, parts.splits);
    if parts.part.numel() != h * ns * (d + 2) || d % 4 != 0 || d > 256 || ns == 0 {
        return Err(Error::Shape {
            op,
            detail: format!(
                "parts {:?} for {h} heads of {d} over {ns} key ranges (head size a multiple of 4, at most 256)",
                parts.part.shape()
            ),
        });
    }
    // splits() in the shader is (pos + t) / 64 rounded up: any key count in the last range.
    Ok(Params {
        t: 1,
        pos: ((ns - 1) * SPLIT) as u32,
        hq: h as u32,
        hkv: h as u32,
        d: d as u32,
        tmax: (ns * SPLIT) as u32,
        scale: 1.0,
        row: (h * d) as u32,
        window: 0,
        ring: (ns * SPLIT) as u32,
        splits: 1,
        _pad: 0,
    })
}

/// Where the stacked projections of new tokens go: the bias added to them, RoPE's table
/// and pairing, the query heads, the caches and the position of the first token. What
/// [`rope_store`] does after a product, and what `quant::qmatmul_rope_store` does in one.
#[derive(Clone, Copy)]
pub struct RopeStore<'a> {
    /// ((Hq + 2 Hkv) D), added before RoPE.
    pub bias: Option<&'a Tensor>,
    pub table: &'a RopeTable,
    pub pairing: Pairing,
    /// Query heads Hq (the caches give Hkv and D).
    pub hq: usize,
    pub k_cache: &'a Tensor,
    pub v_cache: &'a Tensor,
    pub pos: usize,
    /// The layer's attention window (its cache may then be a ring).
    pub window: Option<usize>,
    /// Rows of different sequences in a pool of pages ([`PagedRows`]): each row's own
    /// position and cache rows (`pos` and `window` unused then).
    pub paged: Option<&'a PagedRows>,
}

impl RopeStore<'_> {
    /// Checks `rows` stacked projections of `width` against the caches, bias and table.
    pub(crate) fn params(&self, op: &'static str, rows: usize, width: usize) -> Result<Params> {
        let cs = &logical(self.k_cache)[..];
        let (hkv, d) = (
            cs.get(1).copied().unwrap_or(0),
            cs.get(2).copied().unwrap_or(0),
        );
        let want = (self.hq + 2 * hkv) * d;
        if let Some(pg) = self.paged {
            pg.check(op, rows, cs, self.table.positions)?;
        }
        let (pos, window) = match self.paged {
            Some(_) => (0, None),
            None => (self.pos, self.window),
        };
        let p = params(&[rows, self.hq, d], cs, pos, window, "qkv")?;
        if width != want
            || logical(self.v_cache) != cs
            || self.table.head_dim != d
            || self.bias.is_some_and(|b| b.shape() != [want])
        {
            return Err(Error::Shape {
                op,
                detail: format!(
                    "{rows} rows of {width} q, k and v (expected {want}), caches {cs:?} / {:?}, bias {:?}, RoPE head dim {}",
                    self.v_cache.shape(),
                    self.bias.map(|b| b.shape().to_vec()),
                    self.table.head_dim
                ),
            });
        }
        if self.paged.is_none() && self.pos + rows > self.table.positions {
            return Err(Error::Shape {
                op,
                detail: format!(
                    "positions {}..{} exceed the RoPE table's {}",
                    self.pos,
                    self.pos + rows,
                    self.table.positions
                ),
            });
        }
        expect_f32(op, &self.table.table)?;
        kv_consts(op, &[self.k_cache, self.v_cache])?;
        if let Some(b) = self.bias {
            expect_f32(op, b)?;
        }
        Ok(p)
    }
}

/// Splits the stacked projections `qkv` (T, (Hq + 2 Hkv) D) of the tokens at pos..pos+T:
/// adds the bias ((Hq + 2 Hkv) D) if any, turns q and k by RoPE, stores k and v in the
/// caches and returns q (T, Hq, D). One dispatch for what `bias_add`, `rope` twice and
/// `kv_store` twice do.
pub fn rope_store(rec: &mut Recorder<'_>, qkv: &Tensor, to: &RopeStore<'_>) -> Result<Tensor> {
    rope_store_split(rec, qkv, 1, to)
}

/// [`rope_store`] of projections that come as the partial products over `splits` slices
/// of k (`qkv` (splits, T, (Hq + 2 Hkv) D), [`crate::ops::quant::qmatmul_unsummed`]),
/// summed in slice order as `splitk_sum` sums them: the same bits as that sum then
/// [`rope_store`], one dispatch instead of two. `splits` 1: `qkv` (T, ..) as it is.
pub fn rope_store_split(
    rec: &mut Recorder<'_>,
    qkv: &Tensor,
    splits: usize,
    to: &RopeStore<'_>,
) -> Result<Tensor> {
    expect_f32("rope_store", qkv)?;
    let sh = match (splits, qkv.shape()) {
        (1, [t, w]) => [*t, *w],
        (s, [z, t, w]) if s > 1 && *z == s => [*t, *w],
        (_, sh) => {
            return Err(Error::Shape {
                op: "rope_store",
                detail: format!(
                    "qkv {sh:?} in {splits} slices of k, expected (T, (Hq + 2 Hkv) D), or (slices, T, ..) for more than one"
                ),
            })
        }
    };
    let mut p = to.params("rope_store", sh[0], sh[1])?;
    p.splits = splits as u32;
    let (t, hq, d) = (sh[0], to.hq, p.d as usize);
    let q = Tensor::empty(rec.gpu(), &[t, hq, d], DType::F32, "rope_store.q")?;
    let [c16, c8] = kv_consts("rope_store", &[to.k_cache, to.v_cache])?;
    let c = [
        ("HAS_BIAS", to.bias.is_some() as u32 as f64),
        (
            "INTERLEAVED",
            (to.pairing == Pairing::Interleaved) as u32 as f64,
        ),
        c16,
        c8,
        ("PAGED", to.paged.is_some() as u32 as f64),
        ("SPLIT_SRC", (splits > 1) as u32 as f64),
    ];
    // One RoPE pair a thread, two for f16 caches (whole words); q8_0: q's pairs, then
    // a block of 32 of each k and v head a thread.
    let pairs = match KvType::of(to.k_cache) {
        KvType::F32 => (t * sh[1] / 2) as u64,
        KvType::F16 => (t * sh[1] / 4) as u64,
        KvType::Q8_0 => (t * hq * d / 2 + t * 2 * (sh[1] / d - hq) * d / 32) as u64,
    };
    rec.dispatch(
        &ROPE_STORE,
        &c,
        bytemuck::bytes_of(&p),
        &[
            qkv,
            to.bias.unwrap_or(qkv),
            &to.table.table,
            &q,
            to.k_cache,
            to.v_cache,
            to.paged.map_or(qkv, |pg| &pg.info),
        ],
        Grid::cover(pairs, 256),
    )?;
    Ok(q)
}

/// Rows of keys a page of a paged pool holds (`kvcache.wgsl`'s PAGE).
pub const PAGE: usize = 16;

/// Where each row of a batched step lives in a pool of pages: per row, its token's
/// position in its sequence and that sequence's pages (PAGE cache rows each, in order).
/// On the GPU as one u32 buffer: (position, start of the page list) per row, then the
/// lists.
pub struct PagedRows {
    pub info: Tensor,
    rows: usize,
    /// Largest position + 1 and the largest page id + 1 (checked against the tensors).
    positions: usize,
    pages: usize,
}

impl PagedRows {
    /// `rows`: each row's position and its sequence's page list (long enough for it).
    pub fn new(gpu: &Gpu, rows: &[(usize, &[u32])]) -> Result<PagedRows> {
        let mut info: Vec<u32> = Vec::with_capacity(rows.len() * 3);
        let mut lists: Vec<u32> = Vec::new();
        let head = 2 * rows.len();
        let (mut positions, mut pages) = (0, 0);
        for (i, &(pos, list)) in rows.iter().enumerate() {
            if pos / PAGE >= list.len() {
                return Err(Error::Shape {
                    op: "paged rows",
                    detail: format!(
                        "row {i} at position {pos} has {} pages of {PAGE} rows",
                        list.len()
                    ),
                });
            }
            info.push(pos as u32);
            info.push((head + lists.len()) as u32);
            lists.extend_from_slice(&list[..pos / PAGE + 1]);
            positions = positions.max(pos + 1);
            pages = pages.max(list.iter().map(|&p| p as usize + 1).max().unwrap_or(0));
        }
        info.extend(lists);
        if rows.is_empty() {
            return Err(Error::Invalid {
                op: "paged rows",
                detail: "no rows".into(),
            });
        }
        Ok(PagedRows {
            info: Tensor::from_u32(gpu, &[info.len()], &info, "paged.rows")?,
            rows: rows.len(),
            positions,
            pages,
        })
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    /// `rows` rows through a pool (its pages, Hkv, D) and a RoPE table of `table`
    /// positions.
    fn check(&self, op: &'static str, rows: usize, pool: &[usize], table: usize) -> Result<()> {
        let pool_pages = pool.first().copied().unwrap_or(0) / PAGE;
        if rows != self.rows || self.pages > pool_pages || self.positions > table {
            return Err(Error::Shape {
                op,
                detail: format!(
                    "{rows} rows for {} paged rows, pages up to {} in a pool of {pool_pages}, positions up to {} with a RoPE table of {table}",
                    self.rows, self.pages, self.positions
                ),
            });
        }
        Ok(())
    }
}

/// A pool of pages for `layers` layers: keys and values (pages * PAGE rows, Hkv, D) each.
pub fn paged_pool(
    gpu: &Gpu,
    layers: usize,
    pages: usize,
    hkv: usize,
    d: usize,
    ty: KvType,
) -> Result<KvCache> {
    KvCache::with_windows(
        gpu,
        &vec![None; layers],
        pages * PAGE,
        hkv,
        d,
        RING_STEP,
        ty,
    )
}

/// How [`kv_attend_paged`] spreads its work over workgroups; the same bits either way.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PagedWork {
    /// One workgroup a (row, query heads, range of 64 keys), then `attend_merge` (two
    /// dispatches, the most workgroups).
    Split,
    /// One workgroup a (row, query heads), walking the row's ranges and merging them as
    /// `attend_merge` does (one dispatch).
    Loop,
}

/// Workgroups from which [`kv_attend_paged`] walks a row's ranges in one workgroup rather
/// than one a range: enough to fill the GPU without splitting the keys, and the merge's
/// dispatch saved. (docs/benchmarks.md, session 34: an 8B at 32 rows, 256 workgroups,
/// 512-token context: 3.60 ms of attention a step looped against 3.92 split on an H200;
/// at 8 rows, 64 workgroups, 2.99 looped against 1.54 split.)
const LOOP_UNITS: usize = 256;

/// (Row, head) pairs up to which [`kv_attend_paged`] gives each its own workgroup walking
/// its ranges, where rows have at most two ranges (128 keys): no merge dispatch, and more
/// workgroups than heads shared. (docs/benchmarks.md, session 35, H100: SmolLM2 at 32 rows
/// of 64-token prompts, 288 workgroups, 0.42 ms of attention a step against 0.57 sharing 3
/// heads and merging; an 8B at 8 rows 0.62 against 0.78; at 64 SmolLM2 rows, 576, 0.65
/// against 0.62.)
const FEW_UNITS: usize = 512;

/// Bytes of partial results [`kv_attend_paged`] holds at once: rows beyond go in groups
/// through the same buffer (the step keeps each layer's until it completes).
pub const PAGED_SCRATCH: usize = 16 << 20;

/// Query heads `attend_part` takes a workgroup for `g` query heads a kv head: the largest
/// divisor of g up to 8 (its keys and values then read once for them all).
fn heads_per_workgroup(g: usize) -> usize {
    (1..=g.clamp(1, 8)).rev().find(|n| g % n == 0).unwrap_or(1)
}

/// Causal attention of each row of `q` (M, Hq, D), a token of its own sequence, over that
/// sequence's keys so far in the paged pool (`k`, `v`: (pages * PAGE, Hkv, D), the row's
/// own key already stored), as a single sequence's decode attends: its keys in ranges of
/// 64 from key 0 (as many ranges for every row as the longest row needs), each range's
/// softmax sums, then the ranges merged in order (`attend_part` with PAGED). A workgroup
/// takes the query heads that share a kv head (up to 8), so the keys and values are read
/// once for them. One workgroup a range and `attend_merge`, or where there are enough
/// rows and heads to fill the GPU ([`LOOP_UNITS`]) or a single range, one workgroup
/// walking the row's ranges ([`PagedWork`]); few short rows ([`FEW_UNITS`]): a workgroup
/// a head walking its ranges; rows in groups whose partial results fit
/// [`PAGED_SCRATCH`]. Scale 1/sqrt(D). A row's ranges past its own keys are empty and add
/// exact zeros, so its result does not depend on the other rows.
pub fn kv_attend_paged(
    rec: &mut Recorder<'_>,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    rows: &PagedRows,
) -> Result<Tensor> {
    let l = PagedLayout::get();
    kv_attend_paged_as(rec, q, k, v, rows, l.work, l.heads, PAGED_SCRATCH)
}

/// How [`kv_attend_paged`] lays out its work where the environment says so, for measuring
/// the choices on a GPU (the same bits every way): `DOPPLER_PAGED_ATTEND=WORK[,HEADS]`,
/// WORK `split`, `loop` or `auto` ([`PagedWork`]; auto: as it chooses), HEADS the query
/// heads a workgroup (a divisor of the heads that share a kv head, else ignored). Read
/// once a process.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PagedLayout {
    pub work: Option<PagedWork>,
    pub heads: Option<usize>,
}

impl PagedLayout {
    /// From the variable's value (see the type), warning about and ignoring a bad one.
    pub fn parse(v: Option<&str>) -> PagedLayout {
        let Some(v) = v else {
            return PagedLayout::default();
        };
        let mut it = v.split(',').map(str::trim);
        let work = match it.next() {
            Some("split") => Some(Some(PagedWork::Split)),
            Some("loop") => Some(Some(PagedWork::Loop)),
            Some("auto") => Some(None),
            _ => None,
        };
        let heads = match it.next() {
            None => Some(None),
            Some(h) => h.parse().ok().filter(|&h| (1..=8).contains(&h)).map(Some),
        };
        match (work, heads, it.next()) {
            (Some(work), Some(heads), None) => PagedLayout { work, heads },
            _ => {
                tracing::warn!(
                    "DOPPLER_PAGED_ATTEND={v:?} is not split|loop|auto[,HEADS 1 to 8]: auto"
                );
                PagedLayout::default()
            }
        }
    }

    /// This process's layout (read once).
    pub fn get() -> PagedLayout {
        static LAYOUT: std::sync::OnceLock<PagedLayout> = std::sync::OnceLock::new();
        *LAYOUT.get_or_init(|| {
            PagedLayout::parse(std::env::var("DOPPLER_PAGED_ATTEND").ok().as_deref())
        })
    }
}

/// [`kv_attend_paged`] with its work laid out as `work` says and `heads` query heads a
/// workgroup where they divide the heads that share a kv head (None: as it chooses), its
/// rows in groups whose partial results fit `scratch` bytes.
#[allow(clippy::too_many_arguments)]
pub fn kv_attend_paged_as(
    rec: &mut Recorder<'_>,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    rows: &PagedRows,
    work: Option<PagedWork>,
    heads: Option<usize>,
    scratch: usize,
) -> Result<Tensor> {
    let cs = logical(k);
    rows.check(
        "kv_attend_paged",
        q.shape().first().copied().unwrap_or(0),
        &cs,
        usize::MAX,
    )?;
    let p = params(q.shape(), &cs, 0, None, "q")?;
    if logical(v) != cs {
        return Err(Error::Shape {
            op: "kv_attend_paged",
            detail: format!("keys {cs:?} and values {:?} differ", v.shape()),
        });
    }
    let [c16, c8] = kv_consts("kv_attend_paged", &[k, v])?;
    let (m, hq, d) = (p.t as usize, p.hq as usize, p.d as usize);
    let splits = rows.positions.div_ceil(SPLIT);
    let g = hq / p.hkv as usize;
    let per = match heads {
        Some(h) if h >= 1 && g % h == 0 => h,
        _ => heads_per_workgroup(g),
    };
    // A row's share of `part`: its ranges' parts, and looped its output before them. Rows
    // go in groups whose parts fit `scratch` bytes, one `part` for all the groups (a
    // prompt's 512 rows at a long context would otherwise need gigabytes a step).
    let row_len = hq * (splits * (d + 2) + d);
    let group = (scratch / (4 * row_len)).clamp(1, m);
    let part = Tensor::empty(
        rec.gpu(),
        &[group * row_len],
        DType::F32,
        "kv_attend_paged.part",
    )?;
    // Rows r0..r0 + n into `part`: their outputs (a view of `part` or the merge's).
    let rows_from = |rec: &mut Recorder<'_>, r0: usize, n: usize| -> Result<Tensor> {
        // Short rows and few of them: a workgroup a head walking its ranges ([`FEW_UNITS`]).
        let few = work.is_none() && heads.is_none() && splits <= 2 && n * hq <= FEW_UNITS;
        let per = if few { 1 } else { per };
        let units = n * hq / per;
        let work = work.unwrap_or(match few || splits == 1 || units >= LOOP_UNITS {
            true => PagedWork::Loop,
            false => PagedWork::Split,
        });
        // Looped, o comes first in `part`, the ranges' parts after it.
        let looped = work == PagedWork::Loop;
        let c = [
            ("PRE", part_preload(d) as f64),
            c16,
            c8,
            ("PAGED", 1.0),
            ("LOOP", looped as u32 as f64),
            ("HEADS", per as f64),
        ];
        // (The kernel reads pos as the first row with PAGED.)
        let pp = Params {
            t: n as u32,
            pos: r0 as u32,
            splits: splits as u32,
            ..p
        };
        rec.dispatch(
            &ATTEND_PART,
            &c,
            bytemuck::bytes_of(&pp),
            &[q, k, v, k, v, k, v, &part, &rows.info],
            Grid::Linear((units * if looped { 1 } else { splits }) as u64),
        )?;
        if looped {
            return part.prefix(&[n * hq * d]);
        }
        let parts = AttnParts {
            part: part.prefix(&[n * hq * splits * (d + 2)])?,
            heads: n * hq,
            d,
            splits,
        };
        attend_merge(rec, &parts)
    };
    if group == m {
        return rows_from(rec, 0, m)?.reshape(q.shape());
    }
    let o = Tensor::empty(rec.gpu(), q.shape(), DType::F32, "kv_attend_paged.o")?;
    for r0 in (0..m).step_by(group) {
        let n = group.min(m - r0);
        let og = rows_from(rec, r0, n)?;
        rec.copy_elements(&og, 0, &o, r0 * hq * d, n * hq * d)?;
    }
    Ok(o)
}

#[cfg(test)]
mod tests {
    use super::{heads_per_workgroup, PagedLayout, PagedWork};

    #[test]
    fn paged_layouts_parse() {
        let l = |v| PagedLayout::parse(v);
        assert_eq!(l(None), PagedLayout::default());
        assert_eq!(l(Some("auto")), PagedLayout::default());
        let want = |work, heads| PagedLayout { work, heads };
        assert_eq!(l(Some("loop,1")), want(Some(PagedWork::Loop), Some(1)));
        assert_eq!(l(Some(" split ")), want(Some(PagedWork::Split), None));
        assert_eq!(l(Some("auto,2")), want(None, Some(2)));
        for bad in ["", "loops", "loop,0", "loop,9", "loop,x", "loop,1,2"] {
            assert_eq!(l(Some(bad)), PagedLayout::default(), "{bad:?}");
        }
    }

    #[test]
    fn query_heads_a_workgroup_divide_the_group() {
        let got: Vec<usize> = [1, 2, 3, 4, 6, 7, 8, 12, 16, 0]
            .map(heads_per_workgroup)
            .to_vec();
        assert_eq!(got, [1, 2, 3, 4, 6, 7, 8, 6, 8, 1]);
    }
}
