//! GGUF (versions 2 and 3): header, typed metadata, tensor infos, aligned tensor data.
//! Layout (little-endian): "GGUF", u32 version, u64 tensor count, u64 metadata count,
//! metadata (string key, u32 type, value), tensor infos (string name, u32 n_dims, u64 dims
//! (innermost first), u32 ggml type, u64 offset into the data section), padding to
//! `general.alignment` (default 32), then the data section. Strings are u64 length + UTF-8.
//!
//! Every count and length read from the file is checked against the bytes that remain
//! before anything is allocated: a malformed or truncated file is an error, never a panic
//! or a huge allocation.

use std::collections::BTreeMap;

pub use super::{check_len, Bytes, FileData, LocalFuture, RangeRead};
use crate::error::{Error, Result};

pub const MAGIC: &[u8; 4] = b"GGUF";

/// Most items reserved ahead for a count the header states (a crafted count in a large
/// file would otherwise ask for gigabytes before the first item is read).
const MAX_PREALLOC: usize = 1 << 16;
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// ggml's limit on tensor dimensions.
pub const MAX_DIMS: usize = 4;

/// ggml tensor types: (id, name, elements per block, bytes per block).
const TYPES: &[(u32, &str, u64, u64)] = &[
    (0, "F32", 1, 4),
    (1, "F16", 1, 2),
    (2, "Q4_0", 32, 18),
    (3, "Q4_1", 32, 20),
    (6, "Q5_0", 32, 22),
    (7, "Q5_1", 32, 24),
    (8, "Q8_0", 32, 34),
    (9, "Q8_1", 32, 36),
    (10, "Q2_K", 256, 84),
    (11, "Q3_K", 256, 110),
    (12, "Q4_K", 256, 144),
    (13, "Q5_K", 256, 176),
    (14, "Q6_K", 256, 210),
    (15, "Q8_K", 256, 292),
    (24, "I8", 1, 1),
    (25, "I16", 1, 2),
    (26, "I32", 1, 4),
    (27, "I64", 1, 8),
    (28, "F64", 1, 8),
    (30, "BF16", 1, 2),
];

/// A ggml tensor type this reader knows the block layout of.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GgmlType(pub u32);

impl GgmlType {
    fn entry(self) -> Option<&'static (u32, &'static str, u64, u64)> {
        TYPES.iter().find(|t| t.0 == self.0)
    }

    pub fn name(self) -> &'static str {
        self.entry().map_or("unknown", |t| t.1)
    }

    /// (elements per block, bytes per block)
    pub fn block(self) -> Option<(u64, u64)> {
        self.entry().map(|t| (t.2, t.3))
    }

    pub fn from_name(name: &str) -> Option<GgmlType> {
        TYPES
            .iter()
            .find(|t| t.1.eq_ignore_ascii_case(name))
            .map(|t| GgmlType(t.0))
    }
}

/// A metadata value.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
#[serde(untagged)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(Vec<Value>),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl Value {
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v as u64),
            Value::U16(v) => Some(v as u64),
            Value::U32(v) => Some(v as u64),
            Value::U64(v) => Some(v),
            Value::I8(v) if v >= 0 => Some(v as u64),
            Value::I16(v) if v >= 0 => Some(v as u64),
            Value::I32(v) if v >= 0 => Some(v as u64),
            Value::I64(v) if v >= 0 => Some(v as u64),
            _ => None,
        }
    }

    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v as f64),
            Value::F64(v) => Some(v),
            _ => self.as_u64().map(|v| v as f64),
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }

    /// Short form for listings: arrays as their type and length.
    pub fn summary(&self) -> String {
        match self {
            Value::String(s) if s.chars().count() > 80 => {
                format!("{:?}...", s.chars().take(77).collect::<String>())
            }
            Value::String(s) => format!("{s:?}"),
            Value::Array(a) => match a.first() {
                Some(first) => format!("[{} x {}]", a.len(), first.type_name()),
                None => "[]".into(),
            },
            other => format!("{}", serde_json::to_value(other).unwrap_or_default()),
        }
    }

    fn type_name(&self) -> &'static str {
        match self {
            Value::U8(_) => "u8",
            Value::I8(_) => "i8",
            Value::U16(_) => "u16",
            Value::I16(_) => "i16",
            Value::U32(_) => "u32",
            Value::I32(_) => "i32",
            Value::F32(_) => "f32",
            Value::Bool(_) => "bool",
            Value::String(_) => "string",
            Value::Array(_) => "array",
            Value::U64(_) => "u64",
            Value::I64(_) => "i64",
            Value::F64(_) => "f64",
        }
    }
}

#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct TensorInfo {
    pub name: String,
    /// ggml order: innermost (contiguous) dimension first.
    pub dims: Vec<u64>,
    #[serde(serialize_with = "type_name")]
    pub ty: GgmlType,
    /// Byte offset in the data section.
    pub offset: u64,
    pub n_elements: u64,
    pub n_bytes: u64,
}

fn type_name<S: serde::Serializer>(t: &GgmlType, s: S) -> std::result::Result<S::Ok, S::Error> {
    s.serialize_str(t.name())
}

/// A parsed file: metadata, tensor infos, and where the data section starts.
#[derive(Clone, Debug)]
pub struct Gguf {
    pub version: u32,
    pub metadata: BTreeMap<String, Value>,
    pub tensors: Vec<TensorInfo>,
    pub alignment: u64,
    /// Offset of the data section in the file.
    pub data_offset: u64,
}

struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
    name: &'a str,
    /// The whole file's length: `buf` may be its first bytes only ([`Gguf::parse_prefix`]).
    total: u64,
    /// Set when a read ran past `buf` but not past the file: more of it is needed.
    short: bool,
}

impl<'a> Reader<'a> {
    fn err(&self, detail: impl Into<String>) -> Error {
        Error::Format {
            path: self.name.to_string(),
            detail: format!("{} (at byte {})", detail.into(), self.pos),
        }
    }

    /// Bytes left in the file (not only in `buf`).
    fn remaining(&self) -> usize {
        usize::try_from(self.total - self.pos as u64).unwrap_or(usize::MAX)
    }

    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        if n <= self.remaining() && n > self.buf.len() - self.pos {
            self.short = true;
            return Err(self.err(format!("{what} lies past the bytes read so far")));
        }
        if n > self.remaining() {
            return Err(self.err(format!(
                "truncated: {what} needs {n} bytes, {} left",
                self.remaining()
            )));
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.take(4, what)?.try_into().unwrap()))
    }

    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.take(8, what)?.try_into().unwrap()))
    }

    /// A count of items each at least `min_size` bytes: bounded by what is left.
    fn count(&mut self, what: &str, min_size: usize) -> Result<usize> {
        let n = self.u64(what)?;
        if n > (self.remaining() / min_size.max(1)) as u64 {
            return Err(self.err(format!(
                "truncated or corrupt: {what} {n} cannot fit in the {} bytes left",
                self.remaining()
            )));
        }
        Ok(n as usize)
    }

    fn string(&mut self, what: &str) -> Result<String> {
        let n = self.count(what, 1)?;
        let bytes = self.take(n, what)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| self.err(format!("{what} is not UTF-8")))
    }

    fn value(&mut self, ty: u32, key: &str, depth: u32) -> Result<Value> {
        let b = |r: &mut Self, n| r.take(n, key);
        Ok(match ty {
            0 => Value::U8(b(self, 1)?[0]),
            1 => Value::I8(b(self, 1)?[0] as i8),
            2 => Value::U16(u16::from_le_bytes(b(self, 2)?.try_into().unwrap())),
            3 => Value::I16(i16::from_le_bytes(b(self, 2)?.try_into().unwrap())),
            4 => Value::U32(u32::from_le_bytes(b(self, 4)?.try_into().unwrap())),
            5 => Value::I32(i32::from_le_bytes(b(self, 4)?.try_into().unwrap())),
            6 => Value::F32(f32::from_le_bytes(b(self, 4)?.try_into().unwrap())),
            7 => match b(self, 1)?[0] {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                v => return Err(self.err(format!("metadata {key}: bool byte {v}"))),
            },
            8 => Value::String(self.string(key)?),
            9 => {
                if depth > 0 {
                    return Err(self.err(format!("metadata {key}: nested arrays")));
                }
                let ety = self.u32(key)?;
                let min = match ety {
                    0 | 1 | 7 => 1,
                    2 | 3 => 2,
                    4..=6 => 4,
                    8 | 10..=12 => 8,
                    _ => {
                        return Err(
                            self.err(format!("metadata {key}: unknown array element type {ety}"))
                        )
                    }
                };
                let n = self.count(key, min)?;
                // Counts are bounded by the file's length, not by memory: grow as read.
                let mut out = Vec::with_capacity(n.min(MAX_PREALLOC));
                for _ in 0..n {
                    out.push(self.value(ety, key, depth + 1)?);
                }
                Value::Array(out)
            }
            10 => Value::U64(u64::from_le_bytes(b(self, 8)?.try_into().unwrap())),
            11 => Value::I64(i64::from_le_bytes(b(self, 8)?.try_into().unwrap())),
            12 => Value::F64(f64::from_le_bytes(b(self, 8)?.try_into().unwrap())),
            _ => return Err(self.err(format!("metadata {key}: unknown value type {ty}"))),
        })
    }
}

impl Gguf {
    /// Parses the header, metadata and tensor infos of a whole file's bytes and checks
    /// every tensor lies inside the data section. `name` labels errors.
    pub fn parse(buf: &[u8], name: &str) -> Result<Gguf> {
        match Self::parse_prefix(buf, buf.len() as u64, name)? {
            Some(g) => Ok(g),
            None => unreachable!("the whole file was given"),
        }
    }

    /// [`Gguf::parse`] from the first bytes of a file of `total` bytes: None when the
    /// header runs past them (read more and try again).
    pub fn parse_prefix(buf: &[u8], total: u64, name: &str) -> Result<Option<Gguf>> {
        let mut r = Reader {
            buf,
            pos: 0,
            name,
            total: total.max(buf.len() as u64),
            short: false,
        };
        match Self::parse_with(&mut r) {
            Err(_) if r.short => Ok(None),
            other => other.map(Some),
        }
    }

    fn parse_with(r: &mut Reader<'_>) -> Result<Gguf> {
        let name = r.name;
        let magic = r.take(4, "magic")?;
        if magic != MAGIC {
            return Err(r.err(format!("not a GGUF file (magic {magic:02x?})")));
        }
        let version = r.u32("version")?;
        if !(2..=3).contains(&version) {
            return Err(r.err(format!(
                "GGUF version {version} (this reader takes 2 and 3)"
            )));
        }
        // A tensor info is at least 8 + 4 + 8 + 4 + 8 bytes, a metadata pair 8 + 4 + 1.
        let n_tensors = r.count("tensor count", 32)?;
        let n_kv = r.count("metadata count", 13)?;
        let mut metadata = BTreeMap::new();
        for _ in 0..n_kv {
            let key = r.string("metadata key")?;
            let ty = r.u32(&key)?;
            let v = r.value(ty, &key, 0)?;
            if metadata.insert(key.clone(), v).is_some() {
                return Err(r.err(format!("metadata key {key} appears twice")));
            }
        }
        let alignment = match metadata.get("general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some(v) => match v.as_u64() {
                Some(a) if a > 0 && a.is_power_of_two() && a <= 1 << 20 => a,
                _ => return Err(r.err(format!("general.alignment {v:?} is not a power of two"))),
            },
        };
        let mut tensors = Vec::with_capacity(n_tensors.min(MAX_PREALLOC));
        for _ in 0..n_tensors {
            let name = r.string("tensor name")?;
            let n_dims = r.u32(&name)? as usize;
            if n_dims == 0 || n_dims > MAX_DIMS {
                return Err(r.err(format!(
                    "tensor {name}: {n_dims} dimensions (1..={MAX_DIMS})"
                )));
            }
            let mut dims = Vec::with_capacity(n_dims);
            for _ in 0..n_dims {
                dims.push(r.u64(&name)?);
            }
            let ty = GgmlType(r.u32(&name)?);
            let offset = r.u64(&name)?;
            let Some((block, block_bytes)) = ty.block() else {
                return Err(r.err(format!("tensor {name}: unknown tensor type {}", ty.0)));
            };
            let n_elements = dims.iter().try_fold(1u64, |a, &d| a.checked_mul(d));
            let Some(n_elements) = n_elements.filter(|&n| n > 0 && n < 1 << 48) else {
                return Err(r.err(format!(
                    "tensor {name}: dimensions {dims:?} give no valid element count"
                )));
            };
            if dims[0] % block != 0 {
                return Err(r.err(format!(
                    "tensor {name}: row length {} is not a multiple of {}'s block of {block}",
                    dims[0],
                    ty.name()
                )));
            }
            if offset % alignment != 0 {
                return Err(r.err(format!(
                    "tensor {name}: offset {offset} not aligned to {alignment}"
                )));
            }
            let n_bytes = n_elements / block * block_bytes;
            tensors.push(TensorInfo {
                name,
                dims,
                ty,
                offset,
                n_elements,
                n_bytes,
            });
        }
        let data_offset = (r.pos as u64).next_multiple_of(alignment);
        let data_len = r.total.saturating_sub(data_offset);
        for t in &tensors {
            let end = t.offset.checked_add(t.n_bytes);
            if end.is_none_or(|e| e > data_len) {
                return Err(Error::Format {
                    path: name.to_string(),
                    detail: format!(
                        "truncated: tensor {} ({} {:?}) needs bytes {}..{} of the data section, which has {data_len}",
                        t.name,
                        t.ty.name(),
                        t.dims,
                        t.offset,
                        t.offset.saturating_add(t.n_bytes)
                    ),
                });
            }
        }
        Ok(Gguf {
            version,
            metadata,
            tensors,
            alignment,
            data_offset,
        })
    }

    /// The tensor's bytes within the whole file's bytes (checked by `parse`).
    pub fn tensor_data<'a>(&self, file: &'a [u8], t: &TensorInfo) -> &'a [u8] {
        let start = (self.data_offset + t.offset) as usize;
        &file[start..start + t.n_bytes as usize]
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }
}

/// A GGUF file, parsed: its bytes whole (a map of the file, or bytes in memory) or read a
/// tensor at a time ([`GgufFile::from_reader`]).
pub struct GgufFile {
    pub gguf: Gguf,
    pub path: String,
    data: FileData,
}

/// The first read of a file's header; doubled while the header runs past it.
const HEADER_READ: usize = 1 << 20;

impl GgufFile {
    /// A GGUF file on disk, read a tensor at a time (see [`super::DiskFile`]: a file cut
    /// short while it loads is an error, not a SIGBUS).
    #[cfg(not(target_arch = "wasm32"))]
    pub fn open(path: &std::path::Path) -> Result<GgufFile> {
        let file = super::DiskFile::open(path)?;
        pollster::block_on(Self::from_reader(
            Box::new(file),
            &path.display().to_string(),
        ))
    }

    /// A GGUF file already in memory; `path` names it in errors.
    pub fn from_bytes(bytes: Bytes, path: &str) -> Result<GgufFile> {
        let gguf = Gguf::parse(&bytes, path)?;
        Ok(GgufFile {
            gguf,
            path: path.to_string(),
            data: FileData::Whole(bytes),
        })
    }

    /// A GGUF file read on demand: its header now (read in growing slices until it
    /// parses), each tensor's bytes when [`GgufFile::read_tensor`] asks for them.
    pub async fn from_reader(reader: Box<dyn RangeRead>, path: &str) -> Result<GgufFile> {
        let total = reader.len();
        let mut want = HEADER_READ;
        loop {
            let n = (want as u64).min(total) as usize;
            let head = reader.read(0, n).await?;
            let head = check_len(head, 0, n, path)?;
            if let Some(gguf) = Gguf::parse_prefix(&head, total, path)? {
                return Ok(GgufFile {
                    gguf,
                    path: path.to_string(),
                    data: FileData::Ranges(reader),
                });
            }
            if n as u64 >= total {
                unreachable!("a whole file's header parses or fails");
            }
            want = want.saturating_mul(2);
        }
    }

    /// The whole file's bytes; None when it is read on demand.
    pub fn bytes(&self) -> Option<&[u8]> {
        match &self.data {
            FileData::Whole(b) => Some(b),
            FileData::Ranges(_) => None,
        }
    }

    /// A tensor's bytes: borrowed from the whole file, or read from the file now.
    pub async fn read_tensor(&self, t: &TensorInfo) -> Result<std::borrow::Cow<'_, [u8]>> {
        let at = self.gguf.data_offset + t.offset;
        self.data.read(at, t.n_bytes as usize, &self.path).await
    }
}

/// Writes GGUF v3 (for tests, fixtures and synthetic models): metadata in the given order,
/// tensors packed at `alignment`.
pub fn write(
    metadata: &[(&str, Value)],
    tensors: &[(&str, &[u64], GgmlType, &[u8])],
    alignment: u64,
) -> Vec<u8> {
    fn string(out: &mut Vec<u8>, s: &str) {
        out.extend((s.len() as u64).to_le_bytes());
        out.extend(s.as_bytes());
    }
    fn value(out: &mut Vec<u8>, v: &Value) {
        match v {
            Value::U8(x) => out.push(*x),
            Value::I8(x) => out.push(*x as u8),
            Value::U16(x) => out.extend(x.to_le_bytes()),
            Value::I16(x) => out.extend(x.to_le_bytes()),
            Value::U32(x) => out.extend(x.to_le_bytes()),
            Value::I32(x) => out.extend(x.to_le_bytes()),
            Value::F32(x) => out.extend(x.to_le_bytes()),
            Value::Bool(x) => out.push(*x as u8),
            Value::String(s) => string(out, s),
            Value::Array(a) => {
                out.extend(a.first().map_or(4, type_id).to_le_bytes());
                out.extend((a.len() as u64).to_le_bytes());
                a.iter().for_each(|x| value(out, x));
            }
            Value::U64(x) => out.extend(x.to_le_bytes()),
            Value::I64(x) => out.extend(x.to_le_bytes()),
            Value::F64(x) => out.extend(x.to_le_bytes()),
        }
    }
    fn type_id(v: &Value) -> u32 {
        match v {
            Value::U8(_) => 0,
            Value::I8(_) => 1,
            Value::U16(_) => 2,
            Value::I16(_) => 3,
            Value::U32(_) => 4,
            Value::I32(_) => 5,
            Value::F32(_) => 6,
            Value::Bool(_) => 7,
            Value::String(_) => 8,
            Value::Array(_) => 9,
            Value::U64(_) => 10,
            Value::I64(_) => 11,
            Value::F64(_) => 12,
        }
    }
    let mut out = Vec::new();
    out.extend(MAGIC);
    out.extend(3u32.to_le_bytes());
    out.extend((tensors.len() as u64).to_le_bytes());
    out.extend((metadata.len() as u64).to_le_bytes());
    for (k, v) in metadata {
        string(&mut out, k);
        out.extend(type_id(v).to_le_bytes());
        value(&mut out, v);
    }
    let mut offset = 0u64;
    let mut offsets = Vec::new();
    for (name, dims, ty, data) in tensors {
        string(&mut out, name);
        out.extend((dims.len() as u32).to_le_bytes());
        dims.iter().for_each(|d| out.extend(d.to_le_bytes()));
        out.extend(ty.0.to_le_bytes());
        out.extend(offset.to_le_bytes());
        offsets.push(offset);
        offset = (offset + data.len() as u64).next_multiple_of(alignment);
    }
    let start = (out.len() as u64).next_multiple_of(alignment);
    out.resize(start as usize, 0);
    for ((_, _, _, data), off) in tensors.iter().zip(offsets) {
        out.resize((start + off) as usize, 0);
        out.extend(*data);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::check::Rng;

    fn sample() -> Vec<u8> {
        let f32s: Vec<u8> = (0..6).flat_map(|i| (i as f32).to_le_bytes()).collect();
        let q8 = vec![7u8; 34 * 2];
        write(
            &[
                ("general.architecture", Value::String("llama".into())),
                ("llama.context_length", Value::U32(2048)),
                ("llama.rope.freq_base", Value::F32(10000.0)),
                (
                    "tokenizer.ggml.tokens",
                    Value::Array(vec![Value::String("a".into()), Value::String("b".into())]),
                ),
                ("general.flag", Value::Bool(true)),
                ("x.i64", Value::I64(-5)),
            ],
            &[
                ("w", &[3, 2], GgmlType(0), &f32s),
                ("q", &[64], GgmlType(8), &q8),
            ],
            32,
        )
    }

    #[test]
    fn round_trips_metadata_and_tensors() {
        let buf = sample();
        let g = Gguf::parse(&buf, "sample").unwrap();
        assert_eq!(g.version, 3);
        assert_eq!(g.metadata["general.architecture"].as_str(), Some("llama"));
        assert_eq!(g.metadata["llama.context_length"].as_u64(), Some(2048));
        assert_eq!(
            g.metadata["tokenizer.ggml.tokens"],
            Value::Array(vec![Value::String("a".into()), Value::String("b".into())])
        );
        assert_eq!(g.metadata["x.i64"], Value::I64(-5));
        let w = g.tensor("w").unwrap();
        assert_eq!((w.n_elements, w.n_bytes, w.ty.name()), (6, 24, "F32"));
        let data = g.tensor_data(&buf, w);
        assert_eq!(f32::from_le_bytes(data[20..24].try_into().unwrap()), 5.0);
        let q = g.tensor("q").unwrap();
        assert_eq!((q.n_bytes, q.offset % 32), (68, 0));
        assert_eq!(g.tensor_data(&buf, q), &[7u8; 68][..]);
    }

    /// Reads `cut` bytes short of the file's end (a file shortened after it was opened).
    struct Shortened {
        bytes: Vec<u8>,
        cut: std::rc::Rc<std::cell::Cell<usize>>,
    }

    impl RangeRead for Shortened {
        fn len(&self) -> u64 {
            self.bytes.len() as u64
        }
        fn read(&self, start: u64, len: usize) -> LocalFuture<'_, Result<Vec<u8>>> {
            let end = (start as usize + len).min(self.bytes.len() - self.cut.get());
            let got = self.bytes[(start as usize).min(end)..end].to_vec();
            Box::pin(std::future::ready(Ok(got)))
        }
    }

    #[test]
    fn a_file_read_on_demand_parses_as_the_whole() {
        // A header past the first read (1 MiB): 40,000 pieces of 30 bytes, as a 49K
        // vocabulary's tokens and merges are.
        let pieces: Vec<Value> = (0..40_000)
            .map(|i| Value::String(format!("{i:030}")))
            .collect();
        let f32s: Vec<u8> = (0..6).flat_map(|i| (i as f32).to_le_bytes()).collect();
        let buf = write(
            &[("tokenizer.ggml.tokens", Value::Array(pieces))],
            &[("w", &[3, 2], GgmlType(0), &f32s)],
            32,
        );
        assert!(buf.len() > HEADER_READ);
        let whole = Gguf::parse(&buf, "big.gguf").unwrap();
        // A prefix that stops inside the header asks for more; one inside the data parses.
        assert!(
            Gguf::parse_prefix(&buf[..1000], buf.len() as u64, "big.gguf")
                .unwrap()
                .is_none()
        );
        let at = whole.data_offset as usize;
        let g = Gguf::parse_prefix(&buf[..at], buf.len() as u64, "big.gguf").unwrap();
        assert_eq!(g.unwrap().tensors, whole.tensors);
        // A bad magic is an error at once, whatever was read.
        let e = Gguf::parse_prefix(b"GGML", 1 << 30, "x").unwrap_err();
        assert!(e.to_string().contains("not a GGUF file"), "{e}");

        let cut = std::rc::Rc::new(std::cell::Cell::new(0));
        let reader = Shortened {
            bytes: buf.clone(),
            cut: cut.clone(),
        };
        let file = pollster::block_on(GgufFile::from_reader(Box::new(reader), "big.gguf")).unwrap();
        assert_eq!(file.gguf.tensors, whole.tensors);
        assert!(file.bytes().is_none());
        let w = file.gguf.tensor("w").unwrap();
        let data = pollster::block_on(file.read_tensor(w)).unwrap();
        assert_eq!(&data[..], &f32s[..]);

        // Shortened after it was opened: the tensor's read names the file and the range.
        cut.set(4);
        let e = pollster::block_on(file.read_tensor(w))
            .unwrap_err()
            .to_string();
        assert!(e.contains("big.gguf") && e.contains("truncated"), "{e}");
        // Truncated before it was opened: the same error as the whole file's.
        let cut = buf[..buf.len() - 4].to_vec();
        let e = pollster::block_on(GgufFile::from_reader(Box::new(cut), "big.gguf"))
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("truncated") && e.contains("tensor w"), "{e}");
    }

    #[test]
    fn a_file_cut_short_while_it_loads_is_an_error_not_a_crash() {
        let f32s: Vec<u8> = (0..6).flat_map(|i| (i as f32).to_le_bytes()).collect();
        let buf = write(&[], &[("w", &[3, 2], GgmlType(0), &f32s)], 32);
        let path = std::env::temp_dir().join(format!("doppler-cut-{}.gguf", std::process::id()));
        std::fs::write(&path, &buf).unwrap();
        let file = GgufFile::open(&path).unwrap();
        let w = file.gguf.tensor("w").unwrap().clone();
        assert_eq!(
            &pollster::block_on(file.read_tensor(&w)).unwrap()[..],
            &f32s[..]
        );
        // Shortened underneath (a map of it would end the process with SIGBUS here).
        std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(buf.len() as u64 - 8)
            .unwrap();
        let e = pollster::block_on(file.read_tensor(&w))
            .unwrap_err()
            .to_string();
        std::fs::remove_file(&path).unwrap();
        assert!(e.contains("doppler-cut-") && e.contains("truncated"), "{e}");
    }

    #[test]
    fn bad_files_get_clear_errors() {
        let buf = sample();
        let msg = |b: &[u8]| Gguf::parse(b, "m.gguf").unwrap_err().to_string();
        assert!(msg(b"GGML....").contains("not a GGUF file"));
        let mut v1 = buf.clone();
        v1[4] = 1;
        assert!(msg(&v1).contains("version 1"));
        let e = msg(&buf[..buf.len() - 10]);
        assert!(e.contains("truncated") && e.contains("tensor q"), "{e}");
        let e = msg(&buf[..40]);
        assert!(e.contains("m.gguf") && e.contains("truncated"), "{e}");
        // An unknown tensor type (the u32 after w's dims).
        let mut bad = buf.clone();
        let name_pos = buf
            .windows(9)
            .position(|w| w == [1, 0, 0, 0, 0, 0, 0, 0, b'w'])
            .unwrap();
        let ty_pos = name_pos + 9 + 4 + 16;
        bad[ty_pos..ty_pos + 4].copy_from_slice(&99u32.to_le_bytes());
        let e = msg(&bad);
        assert!(
            e.contains("tensor w") && e.contains("unknown tensor type 99"),
            "{e}"
        );
        // A count far beyond the file.
        let mut huge = buf.clone();
        huge[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(msg(&huge).contains("tensor count"));
    }

    /// Seeded mutations of a valid file (byte flips, overwrites with extreme values,
    /// truncations, insertions): parsing returns Ok or Err, never panics.
    #[test]
    fn mutated_files_never_panic() {
        let base = sample();
        let mut rng = Rng::new(99);
        for _ in 0..20_000 {
            let mut b = base.clone();
            for _ in 0..1 + rng.next_u64() % 4 {
                let i = (rng.next_u64() % b.len() as u64) as usize;
                match rng.next_u64() % 5 {
                    0 => b[i] ^= 1 << (rng.next_u64() % 8),
                    1 => b[i] = 0xff,
                    2 => {
                        let end = (i + 8).min(b.len());
                        b[i..end].iter_mut().for_each(|x| *x = 0xff);
                    }
                    3 => b.truncate(i),
                    _ => b.insert(i, rng.next_u64() as u8),
                }
                if b.is_empty() {
                    break;
                }
            }
            let _ = Gguf::parse(&b, "fuzz");
        }
    }
}
