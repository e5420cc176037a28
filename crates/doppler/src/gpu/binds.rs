//! Bind groups built once and reused. A dispatch's bind group is fixed by its pipeline,
//! the size of its parameter block and the storage buffers it binds; its parameters live
//! in one uniform buffer shared by every submission and are picked by a dynamic offset.
//! A decode step binds the same weights, caches and (pooled, hence recurring) activation
//! buffers every token, so after the first tokens it builds no bind group at all.

use super::pipeline::{CachedPipeline, FxMap};
use super::Gpu;
use crate::error::{Error, Result};
use std::num::NonZeroU64;

/// (pipeline, parameter block size, storage buffers with their binding sizes).
type Key = (usize, u64, Vec<(wgpu::Buffer, u64)>);

/// Cached bind groups are dropped all at once past this many (buffers come and go).
const MAX_GROUPS: usize = 16384;

#[derive(Default)]
pub(crate) struct Binds {
    /// The shared parameter buffer (grows; a new one drops every cached group).
    uniform: Option<wgpu::Buffer>,
    groups: FxMap<Key, wgpu::BindGroup>,
    /// The key being looked up, reused: a hit allocates nothing.
    scratch: Key,
    pub built: u64,
    pub reused: u64,
}

impl Binds {
    /// The parameter buffer, at least `bytes` long.
    pub fn uniform(&mut self, gpu: &Gpu, bytes: u64) -> Result<wgpu::Buffer> {
        if let Some(u) = &self.uniform {
            if u.size() >= bytes {
                return Ok(u.clone());
            }
        }
        let size = bytes.next_power_of_two().max(64 << 10);
        if size > gpu.limits.max_buffer_size {
            return Err(Error::TooLarge {
                label: "uniforms".into(),
                bytes: size,
                limit_name: "max_buffer_size",
                limit: gpu.limits.max_buffer_size,
            });
        }
        let u = gpu.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("uniforms"),
            size,
            usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        self.groups.clear();
        self.uniform = Some(u.clone());
        Ok(u)
    }

    /// The bind group of `pipe` with a `uniform_size`-byte parameter block (at a dynamic
    /// offset) and `storage` (buffer, binding size) at the pipeline's storage bindings.
    pub fn group<'a>(
        &mut self,
        gpu: &Gpu,
        pipe: &CachedPipeline,
        uniform_size: u64,
        storage: impl Iterator<Item = (&'a wgpu::Buffer, u64)>,
    ) -> wgpu::BindGroup {
        self.scratch.0 = pipe as *const CachedPipeline as usize;
        self.scratch.1 = uniform_size;
        self.scratch.2.clear();
        self.scratch
            .2
            .extend(storage.map(|(b, size)| (b.clone(), size)));
        if let Some(g) = self.groups.get(&self.scratch) {
            self.reused += 1;
            return g.clone();
        }
        let key = self.scratch.clone();
        let uniform = self
            .uniform
            .as_ref()
            .expect("uniform buffer made before bind groups");
        let mut entries = vec![wgpu::BindGroupEntry {
            binding: 0,
            resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                buffer: uniform,
                offset: 0,
                size: NonZeroU64::new(uniform_size),
            }),
        }];
        for ((buffer, size), &(binding, _)) in key.2.iter().zip(pipe.storage) {
            entries.push(wgpu::BindGroupEntry {
                binding,
                resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                    buffer,
                    offset: 0,
                    size: NonZeroU64::new(*size),
                }),
            });
        }
        let g = gpu.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: Some(&pipe.name),
            layout: &pipe.layout,
            entries: &entries,
        });
        if self.groups.len() >= MAX_GROUPS {
            self.groups.clear();
        }
        self.built += 1;
        self.groups.insert(key, g.clone());
        g
    }
}
