//! Model file formats, and how a model file's bytes are had: whole (bytes in memory) or
//! read in ranges on demand (a file on disk, a browser `File`).

pub mod gguf;

use std::borrow::Cow;

use crate::error::{Error, Result};

/// A model file's bytes in memory (a download in the browser, files made in tests).
pub type Bytes = Box<dyn std::ops::Deref<Target = [u8]> + Send + Sync>;

/// A boxed future that need not be `Send` (the browser's are not).
pub type LocalFuture<'a, T> = std::pin::Pin<Box<dyn std::future::Future<Output = T> + 'a>>;

/// A file read in ranges on demand (a browser `File`, read slice by slice): a model's
/// weights go to the GPU a tensor at a time, never the whole file in memory.
pub trait RangeRead {
    /// The file's length in bytes.
    fn len(&self) -> u64;
    /// `len` bytes from `start` (inside the file).
    fn read(&self, start: u64, len: usize) -> LocalFuture<'_, Result<Vec<u8>>>;
}

/// Bytes in memory read in ranges (tests, and the browser's checks of the on-demand path).
impl RangeRead for Vec<u8> {
    fn len(&self) -> u64 {
        self.as_slice().len() as u64
    }
    fn read(&self, start: u64, len: usize) -> LocalFuture<'_, Result<Vec<u8>>> {
        let start = usize::try_from(start)
            .unwrap_or(usize::MAX)
            .min(self.as_slice().len());
        let end = start.saturating_add(len).min(self.as_slice().len());
        Box::pin(std::future::ready(Ok(self[start..end].to_vec())))
    }
}

/// A file on disk read in ranges (native). A file shortened or rewritten while a model
/// loads then gives an error naming it, where a memory map of it would end the process
/// with SIGBUS.
#[cfg(not(target_arch = "wasm32"))]
pub struct DiskFile {
    file: std::sync::Mutex<std::fs::File>,
    len: u64,
    path: String,
}

#[cfg(not(target_arch = "wasm32"))]
impl DiskFile {
    /// Opens a regular file; a directory, a pipe or a device is refused before it is
    /// opened (opening a pipe waits for a writer).
    pub fn open(path: &std::path::Path) -> Result<DiskFile> {
        let shown = path.display().to_string();
        let io = |source| Error::Io {
            path: shown.clone(),
            source,
        };
        let meta = std::fs::metadata(path).map_err(io)?;
        if !meta.is_file() {
            return Err(Error::Format {
                path: shown.clone(),
                detail: match meta.is_dir() {
                    true => "is a directory, not a model file (a Hugging Face directory needs config.json)".into(),
                    false => "is not a regular file (a pipe or a device): save the model to a file first".into(),
                },
            });
        }
        let file = std::fs::File::open(path).map_err(io)?;
        Ok(DiskFile {
            file: std::sync::Mutex::new(file),
            len: meta.len(),
            path: shown,
        })
    }
}

#[cfg(not(target_arch = "wasm32"))]
impl RangeRead for DiskFile {
    fn len(&self) -> u64 {
        self.len
    }
    fn read(&self, start: u64, len: usize) -> LocalFuture<'_, Result<Vec<u8>>> {
        use std::io::{Read, Seek, SeekFrom};
        let read = || -> std::io::Result<Vec<u8>> {
            let mut f = self.file.lock().unwrap_or_else(|e| e.into_inner());
            f.seek(SeekFrom::Start(start))?;
            let mut buf = vec![0u8; len];
            let mut got = 0;
            // Fewer bytes than asked (the file was cut short) come back as they are:
            // check_len names the range.
            while got < len {
                match f.read(&mut buf[got..])? {
                    0 => break,
                    n => got += n,
                }
            }
            buf.truncate(got);
            Ok(buf)
        };
        let out = read().map_err(|source| Error::Io {
            path: self.path.clone(),
            source,
        });
        Box::pin(std::future::ready(out))
    }
}

/// A model file's bytes, whole or read on demand.
pub enum FileData {
    Whole(Bytes),
    Ranges(Box<dyn RangeRead>),
}

impl FileData {
    pub fn len(&self) -> u64 {
        match self {
            FileData::Whole(b) => b.len() as u64,
            FileData::Ranges(r) => r.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// `len` bytes at `start`: borrowed from the whole file, or read now. An error names
    /// `path` when the range passes the end or fewer bytes came (the file changed or was
    /// cut short since it was opened).
    pub async fn read(&self, start: u64, len: usize, path: &str) -> Result<Cow<'_, [u8]>> {
        let end = start.checked_add(len as u64).filter(|&e| e <= self.len());
        let Some(end) = end else {
            return Err(Error::Format {
                path: path.to_string(),
                detail: format!(
                    "truncated: bytes {start}..{} lie past the end of the file ({} bytes)",
                    start.saturating_add(len as u64),
                    self.len()
                ),
            });
        };
        match self {
            FileData::Whole(b) => Ok(Cow::Borrowed(&b[start as usize..end as usize])),
            FileData::Ranges(r) => Ok(Cow::Owned(check_len(
                r.read(start, len).await?,
                start,
                len,
                path,
            )?)),
        }
    }

    /// The whole file (config.json, tokenizer.json).
    pub async fn read_all(&self, path: &str) -> Result<Cow<'_, [u8]>> {
        let n = usize::try_from(self.len()).map_err(|_| Error::Format {
            path: path.into(),
            detail: format!("{} bytes do not fit in memory here", self.len()),
        })?;
        self.read(0, n, path).await
    }
}

fn truncated(path: &str, start: u64, len: usize, got: u64) -> Error {
    Error::Format {
        path: path.to_string(),
        detail: format!(
            "truncated: bytes {start}..{} read as {got} bytes (the file changed since it was opened?)",
            start.saturating_add(len as u64),
        ),
    }
}

/// `got`, the read of `len` bytes at `start`, or the error naming `path` when fewer came.
pub fn check_len(got: Vec<u8>, start: u64, len: usize, path: &str) -> Result<Vec<u8>> {
    match got.len() == len {
        true => Ok(got),
        false => Err(truncated(path, start, len, got.len() as u64)),
    }
}
