//! `vkstats [--ir DIR] FILE.spv...`: creates each compute module's pipeline on the first Vulkan
//! device with VK_KHR_pipeline_executable_properties and prints the driver's statistics
//! of it (NVIDIA: registers a thread, shared memory, binary size), one line a file:
//! `name<TAB>[executable] stat=value ...`. The files are the modules Doppler writes with
//! `DOPPLER_DUMP_SPIRV=DIR` (gpu/spirv.rs): binding 0 a uniform buffer, every other binding
//! a storage buffer, as those modules are numbered. `--ir DIR` also writes whatever
//! internal representations the driver offers for each executable (not yet run on a GPU).
//!
//! Build: `cargo build --release` in this folder (not part of the workspace). NVIDIA's
//! `Local_Memory_Size` read 2^36 on the H100 for every kernel (not a size); `Stack_Size`
//! is where spills would show.
use ash::vk;
use std::ffi::CString;

/// The entry point's name and the highest binding number of a SPIR-V module (the same walk
/// over instructions as gpu/spirv.rs's `instructions`, kept here so that this tool does not
/// build the library).
fn parse(words: &[u32]) -> (String, u32) {
    let mut at = 5;
    let mut entry = String::from("main");
    let mut max_binding = 0;
    while at < words.len() {
        let count = (words[at] >> 16) as usize;
        let op = words[at] & 0xffff;
        if count == 0 || at + count > words.len() {
            break; // malformed: the driver will say so when the module is created
        }
        let ins = &words[at..at + count];
        if op == 15 && ins.len() > 3 {
            let bytes: Vec<u8> = ins[3..].iter().flat_map(|w| w.to_le_bytes()).collect();
            let end = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
            entry = String::from_utf8_lossy(&bytes[..end]).into_owned();
        }
        if op == 71 && ins.len() >= 4 && ins[2] == 33 {
            max_binding = max_binding.max(ins[3]);
        }
        at += count;
    }
    (entry, max_binding)
}

/// Prints what failed and exits (no device, no driver, ...).
fn fail(what: &str, e: impl std::fmt::Debug) -> ! {
    eprintln!("vkstats: {what}: {e:?}");
    std::process::exit(1);
}

fn main() {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    // `--ir DIR`: also write each executable's internal representations (whatever the
    // driver offers: text or binary) to DIR/<file>.<executable>.<name>.
    let ir_dir = match args.iter().position(|a| a == "--ir") {
        Some(i) if i + 1 < args.len() => {
            let dir = args.remove(i + 1);
            args.remove(i);
            Some(std::path::PathBuf::from(dir))
        }
        Some(_) => {
            eprintln!("--ir needs a directory");
            std::process::exit(2);
        }
        None => None,
    };
    let files = args;
    if files.is_empty() || files.iter().any(|f| f == "-h" || f == "--help") {
        eprintln!("usage: vkstats [--ir DIR] FILE.spv...  (driver statistics of compute modules)");
        std::process::exit(2);
    }
    unsafe {
        let entry = ash::Entry::load().unwrap_or_else(|e| fail("loading libvulkan", e));
        let app = vk::ApplicationInfo::default().api_version(vk::API_VERSION_1_3);
        let instance = entry
            .create_instance(
                &vk::InstanceCreateInfo::default().application_info(&app),
                None,
            )
            .unwrap_or_else(|e| fail("vkCreateInstance", e));
        let pds = instance
            .enumerate_physical_devices()
            .unwrap_or_else(|e| fail("vkEnumeratePhysicalDevices", e));
        let want = [
            ash::khr::pipeline_executable_properties::NAME,
            ash::khr::cooperative_matrix::NAME,
        ];
        let mut chosen = None;
        for pd in pds {
            let exts = instance
                .enumerate_device_extension_properties(pd)
                .unwrap_or_default();
            let has =
                |n: &std::ffi::CStr| exts.iter().any(|e| e.extension_name_as_c_str() == Ok(n));
            let props = instance.get_physical_device_properties(pd);
            eprintln!(
                "device {:?} pipeline_executable_properties={}",
                props.device_name_as_c_str(),
                has(want[0])
            );
            if has(want[0]) {
                let names: Vec<*const i8> =
                    want.iter().filter(|n| has(n)).map(|n| n.as_ptr()).collect();
                chosen = Some((pd, names));
                break;
            }
        }
        let Some((pd, names)) = chosen else {
            eprintln!("no device with VK_KHR_pipeline_executable_properties");
            std::process::exit(2);
        };
        let qf = instance
            .get_physical_device_queue_family_properties(pd)
            .iter()
            .position(|q| q.queue_flags.contains(vk::QueueFlags::COMPUTE))
            .unwrap_or_else(|| fail("queue families", "none with compute")) as u32;
        let mut v11 = vk::PhysicalDeviceVulkan11Features::default();
        let mut v12 = vk::PhysicalDeviceVulkan12Features::default();
        let mut v13 = vk::PhysicalDeviceVulkan13Features::default();
        let mut coop = vk::PhysicalDeviceCooperativeMatrixFeaturesKHR::default();
        let mut pexe = vk::PhysicalDevicePipelineExecutablePropertiesFeaturesKHR::default();
        let mut f2 = vk::PhysicalDeviceFeatures2::default()
            .push_next(&mut v11)
            .push_next(&mut v12)
            .push_next(&mut v13)
            .push_next(&mut coop)
            .push_next(&mut pexe);
        instance.get_physical_device_features2(pd, &mut f2);
        let prio = [1.0f32];
        let qci = [vk::DeviceQueueCreateInfo::default()
            .queue_family_index(qf)
            .queue_priorities(&prio)];
        let dci = vk::DeviceCreateInfo::default()
            .queue_create_infos(&qci)
            .enabled_extension_names(&names)
            .push_next(&mut f2);
        let device = instance
            .create_device(pd, &dci, None)
            .unwrap_or_else(|e| fail("vkCreateDevice", e));
        let pe = ash::khr::pipeline_executable_properties::Device::new(&instance, &device);
        let mut capture = vk::PipelineCreateFlags::CAPTURE_STATISTICS_KHR;
        if ir_dir.is_some() {
            capture |= vk::PipelineCreateFlags::CAPTURE_INTERNAL_REPRESENTATIONS_KHR;
        }
        for file in files {
            let bytes = match std::fs::read(&file) {
                Ok(b) if b.len() % 4 == 0 && b.len() >= 20 => b,
                Ok(_) => {
                    println!("{file}\tnot a SPIR-V module (size)");
                    continue;
                }
                Err(e) => {
                    println!("{file}\t{e}");
                    continue;
                }
            };
            let words: Vec<u32> = bytes
                .chunks_exact(4)
                .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            let (ep, maxb) = parse(&words);
            let bindings: Vec<vk::DescriptorSetLayoutBinding> = (0..=maxb)
                .map(|b| {
                    vk::DescriptorSetLayoutBinding::default()
                        .binding(b)
                        .descriptor_type(if b == 0 {
                            vk::DescriptorType::UNIFORM_BUFFER_DYNAMIC
                        } else {
                            vk::DescriptorType::STORAGE_BUFFER
                        })
                        .descriptor_count(1)
                        .stage_flags(vk::ShaderStageFlags::COMPUTE)
                })
                .collect();
            let dsl = device
                .create_descriptor_set_layout(
                    &vk::DescriptorSetLayoutCreateInfo::default().bindings(&bindings),
                    None,
                )
                .unwrap_or_else(|e| fail("vkCreateDescriptorSetLayout", e));
            let dsls = [dsl];
            let pl = device
                .create_pipeline_layout(
                    &vk::PipelineLayoutCreateInfo::default().set_layouts(&dsls),
                    None,
                )
                .unwrap_or_else(|e| fail("vkCreatePipelineLayout", e));
            let module = match device
                .create_shader_module(&vk::ShaderModuleCreateInfo::default().code(&words), None)
            {
                Ok(m) => m,
                Err(e) => {
                    println!("{file}\tmodule error {e:?}");
                    device.destroy_pipeline_layout(pl, None);
                    device.destroy_descriptor_set_layout(dsl, None);
                    continue;
                }
            };
            let cname = CString::new(ep).unwrap_or_default();
            let stage = vk::PipelineShaderStageCreateInfo::default()
                .stage(vk::ShaderStageFlags::COMPUTE)
                .module(module)
                .name(&cname);
            let ci = vk::ComputePipelineCreateInfo::default()
                .flags(capture)
                .stage(stage)
                .layout(pl);
            let p = match device.create_compute_pipelines(vk::PipelineCache::null(), &[ci], None) {
                Ok(v) => v[0],
                Err((_, e)) => {
                    println!("{file}\tpipeline error {e:?}");
                    device.destroy_shader_module(module, None);
                    device.destroy_pipeline_layout(pl, None);
                    device.destroy_descriptor_set_layout(dsl, None);
                    continue;
                }
            };
            let execs = pe
                .get_pipeline_executable_properties(&vk::PipelineInfoKHR::default().pipeline(p))
                .unwrap_or_default();
            let base = file.rsplit('/').next().unwrap_or(&file).to_string();
            let mut line = base.clone();
            for (i, x) in execs.iter().enumerate() {
                line += &format!(
                    "\t[{:?} sg={}]",
                    x.name_as_c_str().unwrap_or_default(),
                    x.subgroup_size
                );
                let stats = pe
                    .get_pipeline_executable_statistics(
                        &vk::PipelineExecutableInfoKHR::default()
                            .pipeline(p)
                            .executable_index(i as u32),
                    )
                    .unwrap_or_default();
                for s in &stats {
                    let n = s
                        .name_as_c_str()
                        .unwrap_or_default()
                        .to_string_lossy()
                        .replace(' ', "_");
                    let v = match s.format {
                        vk::PipelineExecutableStatisticFormatKHR::BOOL32 => {
                            format!("{}", s.value.b32)
                        }
                        vk::PipelineExecutableStatisticFormatKHR::INT64 => {
                            format!("{}", s.value.i64)
                        }
                        vk::PipelineExecutableStatisticFormatKHR::UINT64 => {
                            format!("{}", s.value.u64)
                        }
                        _ => format!("{}", s.value.f64),
                    };
                    line += &format!(" {n}={v}");
                }
                if let Some(dir) = &ir_dir {
                    let info = vk::PipelineExecutableInfoKHR::default()
                        .pipeline(p)
                        .executable_index(i as u32);
                    line += &write_irs(&pe, &device, &info, dir, &format!("{base}.{i}"));
                }
            }
            println!("{line}");
            device.destroy_pipeline(p, None);
            device.destroy_shader_module(module, None);
            device.destroy_pipeline_layout(pl, None);
            device.destroy_descriptor_set_layout(dsl, None);
        }
    }
}

/// Writes the internal representations of one executable (two calls: sizes, then data)
/// to `dir/<stem>.<name>`; returns a note for the file's line.
unsafe fn write_irs(
    pe: &ash::khr::pipeline_executable_properties::Device,
    device: &ash::Device,
    info: &vk::PipelineExecutableInfoKHR,
    dir: &std::path::Path,
    stem: &str,
) -> String {
    let get = pe.fp().get_pipeline_executable_internal_representations_khr;
    let mut count = 0u32;
    if get(device.handle(), info, &mut count, std::ptr::null_mut()) != vk::Result::SUCCESS {
        return " ir=error".into();
    }
    let mut reps = vec![vk::PipelineExecutableInternalRepresentationKHR::default(); count as usize];
    if get(device.handle(), info, &mut count, reps.as_mut_ptr()) != vk::Result::SUCCESS {
        return " ir=error".into();
    }
    let mut bufs: Vec<Vec<u8>> = reps.iter().map(|r| vec![0u8; r.data_size]).collect();
    for (r, b) in reps.iter_mut().zip(bufs.iter_mut()) {
        r.p_data = b.as_mut_ptr().cast();
    }
    let result = get(device.handle(), info, &mut count, reps.as_mut_ptr());
    if result != vk::Result::SUCCESS && result != vk::Result::INCOMPLETE {
        return format!(" ir=error({result:?})");
    }
    let _ = std::fs::create_dir_all(dir);
    let mut note = String::new();
    for (r, b) in reps.iter().zip(&bufs) {
        let name: String = r
            .name_as_c_str()
            .unwrap_or_default()
            .to_string_lossy()
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
            .collect();
        let mut data = &b[..r.data_size.min(b.len())];
        if r.is_text != 0 {
            let end = data.iter().position(|&c| c == 0).unwrap_or(data.len());
            data = &data[..end];
        }
        let path = dir.join(format!("{stem}.{name}"));
        match std::fs::write(&path, data) {
            Ok(()) => {
                note += &format!(
                    " ir:{name}={}B{}",
                    data.len(),
                    if r.is_text != 0 { "(text)" } else { "" }
                )
            }
            Err(e) => note += &format!(" ir:{name}=error({e})"),
        }
    }
    if reps.is_empty() {
        note += " ir=none";
    }
    note
}
