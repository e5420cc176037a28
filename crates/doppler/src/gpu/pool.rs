//! Storage buffers reused by size class. A buffer goes back to the free list only when the
//! last [`PooledBuffer`] handle drops, and recorders keep a handle to every buffer their
//! submission uses until the GPU reports that submission complete.

use crate::error::{Error, Result};
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};

/// Counters, in bytes of size class (what the GPU actually holds).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct PoolStats {
    /// Bytes in buffers currently handed out (tensors, in-flight uniforms and staging).
    pub live_bytes: u64,
    /// Bytes in buffers waiting in the free lists.
    pub pooled_bytes: u64,
    /// Allocations served from a free list.
    pub hits: u64,
    /// Allocations that had to create a new buffer.
    pub misses: u64,
    /// Submissions whose buffers are still held because the GPU has not finished them.
    pub in_flight: u64,
    /// The most bytes the pool has held at once (live and pooled), since it was made.
    pub peak_bytes: u64,
}

type Key = (u64, u32);

#[derive(Default)]
struct Inner {
    /// Free buffers by size class, keyed by creation serial: the oldest is handed out
    /// first, so a step that allocates the same sizes as the last one gets the same
    /// buffers in the same roles (and reuses its cached bind groups, see binds.rs).
    free: HashMap<Key, BTreeMap<u64, wgpu::Buffer>>,
    serial: u64,
    stats: PoolStats,
    pending: Vec<(Arc<AtomicBool>, Vec<Arc<PooledBuffer>>)>,
}

/// The pool; shared by cloning.
#[derive(Clone, Default)]
pub struct BufferPool {
    inner: Arc<Mutex<Inner>>,
}

/// A buffer on loan from the pool. Dropping the last handle returns it to the free list.
pub struct PooledBuffer {
    pub buffer: wgpu::Buffer,
    serial: u64,
    class: u64,
    usage: wgpu::BufferUsages,
    pool: Weak<Mutex<Inner>>,
}

impl Drop for PooledBuffer {
    fn drop(&mut self) {
        if let Some(pool) = self.pool.upgrade() {
            let mut p = pool.lock().unwrap();
            p.stats.live_bytes -= self.class;
            p.stats.pooled_bytes += self.class;
            p.free
                .entry((self.class, self.usage.bits()))
                .or_default()
                .insert(self.serial, self.buffer.clone());
        }
    }
}

/// Size classes 2^k and 3·2^(k-1): at most a third of a buffer is slack.
pub fn size_class(bytes: u64) -> u64 {
    if bytes <= 256 {
        return 256;
    }
    let p = bytes.next_power_of_two();
    if bytes <= p / 4 * 3 {
        p / 4 * 3
    } else {
        p
    }
}

impl BufferPool {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn stats(&self) -> PoolStats {
        let p = self.inner.lock().unwrap();
        let mut s = p.stats;
        s.in_flight = p.pending.len() as u64;
        s
    }

    /// A buffer of at least `bytes` bytes with exactly `usage`.
    pub(crate) fn alloc(
        &self,
        device: &wgpu::Device,
        limits: &wgpu::Limits,
        bytes: u64,
        usage: wgpu::BufferUsages,
        label: &str,
    ) -> Result<Arc<PooledBuffer>> {
        let class = size_class(bytes.max(4));
        if class > limits.max_buffer_size && bytes <= limits.max_buffer_size {
            // The class rounds past the limit but the request fits: use the exact size.
            return self.create(device, bytes.next_multiple_of(16), usage, label);
        }
        if bytes > limits.max_buffer_size {
            return Err(Error::TooLarge {
                label: label.to_string(),
                bytes,
                limit_name: "max_buffer_size",
                limit: limits.max_buffer_size,
            });
        }
        self.collect();
        {
            let mut p = self.inner.lock().unwrap();
            if let Some((serial, buffer)) = p
                .free
                .get_mut(&(class, usage.bits()))
                .and_then(|v| v.pop_first())
            {
                p.stats.hits += 1;
                p.stats.pooled_bytes -= class;
                p.stats.live_bytes += class;
                return Ok(Arc::new(PooledBuffer {
                    buffer,
                    serial,
                    class,
                    usage,
                    pool: Arc::downgrade(&self.inner),
                }));
            }
        }
        self.create(device, class, usage, label)
    }

    fn create(
        &self,
        device: &wgpu::Device,
        class: u64,
        usage: wgpu::BufferUsages,
        label: &str,
    ) -> Result<Arc<PooledBuffer>> {
        let make = || {
            device.create_buffer(&wgpu::BufferDescriptor {
                label: Some(label),
                size: class,
                usage,
                mapped_at_creation: false,
            })
        };
        let buffer = match create_checked(device, make) {
            Some(b) => b,
            None => {
                // Out of memory: give the free lists back to the driver and try once more.
                self.trim();
                create_checked(device, make).ok_or_else(|| Error::OutOfMemory {
                    label: label.to_string(),
                    bytes: class,
                })?
            }
        };
        let mut p = self.inner.lock().unwrap();
        p.stats.misses += 1;
        p.stats.live_bytes += class;
        p.stats.peak_bytes = p
            .stats
            .peak_bytes
            .max(p.stats.live_bytes + p.stats.pooled_bytes);
        p.serial += 1;
        Ok(Arc::new(PooledBuffer {
            buffer,
            serial: p.serial,
            class,
            usage,
            pool: Arc::downgrade(&self.inner),
        }))
    }

    /// Keeps `bufs` alive until `done` is set (by the queue's work-done callback).
    pub(crate) fn retire(&self, done: Arc<AtomicBool>, bufs: Vec<Arc<PooledBuffer>>) {
        self.inner.lock().unwrap().pending.push((done, bufs));
    }

    /// Releases the buffers of finished submissions.
    pub fn collect(&self) {
        let finished: Vec<_> = {
            let mut p = self.inner.lock().unwrap();
            // Every allocation comes here: nothing to do (and nothing allocated) unless a
            // submission finished.
            if !p.pending.iter().any(|(d, _)| d.load(Ordering::Acquire)) {
                return;
            }
            let (done, pending): (Vec<_>, Vec<_>) = p
                .pending
                .drain(..)
                .partition(|(d, _)| d.load(Ordering::Acquire));
            p.pending = pending;
            done
        };
        // Dropped outside the lock: PooledBuffer::drop takes it.
        drop(finished);
    }

    /// Destroys every buffer in the free lists.
    pub fn trim(&self) {
        let mut p = self.inner.lock().unwrap();
        for (_, bufs) in p.free.drain() {
            for b in bufs.into_values() {
                b.destroy();
            }
        }
        p.stats.pooled_bytes = 0;
    }
}

/// Creates a buffer inside an out-of-memory error scope; `None` when the device is out of memory.
fn create_checked(device: &wgpu::Device, make: impl Fn() -> wgpu::Buffer) -> Option<wgpu::Buffer> {
    match super::scoped(device, wgpu::ErrorFilter::OutOfMemory, make) {
        (b, None) => Some(b),
        (_, Some(_)) => None,
    }
}

#[cfg(test)]
mod tests {
    use super::size_class;

    #[test]
    fn size_classes_bound_the_slack() {
        assert_eq!(size_class(1), 256);
        assert_eq!(size_class(256), 256);
        assert_eq!(size_class(257), 384);
        assert_eq!(size_class(384), 384);
        assert_eq!(size_class(385), 512);
        assert_eq!(size_class(1 << 20), 1 << 20);
        for b in [300u64, 1000, 4097, 1 << 25 | 1, 123_456_789] {
            let c = size_class(b);
            assert!(c >= b && c % 4 == 0 && (c - b) * 3 <= c, "{b} -> {c}");
        }
    }
}
