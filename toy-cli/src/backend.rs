//! Run-time backend choice: each command body is generic over `B: ToyBackend` and monomorphized
//! once per backend here.
//!
//! GPU runtimes panic in a worker thread when their driver is missing, so each GPU backend is
//! probed first (Vulkan adapters for wgpu, libcuda + NVRTC for cuda) and a missing piece becomes
//! a one-line error that says how to fix it.

use anyhow::{Result, bail};
use burn::backend::{Flex, NdArray};
use clap::ValueEnum;
use toy_kernels::ToyBackend;

/// `--backend wgpu`: burn's CubeBackend over cubecl's wgpu runtime (fusion off).
#[cfg(feature = "wgpu")]
pub type Wgpu = burn_cubecl::CubeBackend<cubecl::wgpu::WgpuRuntime, f32, i32, u32>;
/// `--backend cuda`: burn's CubeBackend over cubecl's CUDA runtime (fusion off).
#[cfg(feature = "cuda")]
pub type Cuda = burn_cubecl::CubeBackend<cubecl::cuda::CudaRuntime, f32, i32, u8>;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum BackendKind {
    /// burn's Flex backend (pure Rust, multithreaded) with toy's native CPU kernels.
    Cpu,
    /// burn's NdArray backend with the reference kernels.
    Ndarray,
    /// Any GPU through wgpu (Vulkan on Linux, Metal on macOS, DX12 on Windows) with toy's cubecl
    /// kernels. `TOY_WGPU_DEVICE` picks the adapter: `discrete:N`, `integrated:N`, `virtual:N`,
    /// `cpu` (lavapipe) or `default`.
    Wgpu,
    /// wgpu forced onto Apple's Metal API (macOS only).
    Metal,
    /// NVIDIA GPUs through CUDA with toy's cubecl kernels (needs the driver and NVRTC).
    Cuda,
}

/// `--dtype`: the float type of weights and activations on GPU backends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum FloatKind {
    /// 32-bit floats everywhere (the only type of the CPU backends and of training).
    F32,
    /// 16-bit floats for weights and activations on wgpu/cuda, where the device supports them;
    /// quantized weights stay packed, and the kernels accumulate in f32.
    F16,
}

/// Where a command computes and in which float type: `--backend` and `--dtype`.
#[derive(Debug, Clone, Copy)]
pub struct Compute {
    pub backend: BackendKind,
    pub dtype: FloatKind,
}

/// Make `device` create f16 float tensors for `--dtype f16`, before any tensor exists on it
/// (burn's per-device dtype policy: every `from_data`/`zeros` without an explicit dtype then
/// gives f16, so the model code stays the same).
fn apply_float_kind<B: ToyBackend>(
    device: &B::Device,
    dtype: FloatKind,
    backend: &str,
) -> Result<()> {
    use burn::tensor::{DType, Element, FloatDType, set_default_dtypes};
    if dtype == FloatKind::F32 {
        return Ok(());
    }
    if !B::supports_dtype(device, DType::F16) {
        bail!(
            "--dtype f16: this {backend} device has no f16 arithmetic (for wgpu it needs the \
             SHADER_F16 feature); use --dtype f32"
        );
    }
    set_default_dtypes::<B>(device, FloatDType::F16, <B::IntElem as Element>::dtype())
        .map_err(|e| anyhow::anyhow!("--dtype f16: {e:?}"))
}

/// A command body that can run on any backend.
pub trait BackendJob {
    type Output;
    fn run<B: ToyBackend>(self, device: B::Device) -> Result<Self::Output>;
}

pub fn dispatch<J: BackendJob>(compute: Compute, job: J) -> Result<J::Output> {
    let Compute {
        backend: kind,
        dtype,
    } = compute;
    if dtype == FloatKind::F16 && matches!(kind, BackendKind::Cpu | BackendKind::Ndarray) {
        bail!(
            "--dtype f16 is for the GPU backends (wgpu, metal, cuda); --backend {} computes in f32",
            kind.name()
        );
    }
    match kind {
        BackendKind::Cpu => job.run::<Flex>(Default::default()),
        BackendKind::Ndarray => job.run::<NdArray>(Default::default()),
        BackendKind::Wgpu => wgpu_dispatch(job, false, dtype),
        BackendKind::Metal => wgpu_dispatch(job, true, dtype),
        BackendKind::Cuda => cuda_dispatch(job, dtype),
    }
}

impl BackendKind {
    pub fn name(self) -> &'static str {
        match self {
            BackendKind::Cpu => "cpu",
            BackendKind::Ndarray => "ndarray",
            BackendKind::Wgpu => "wgpu",
            BackendKind::Metal => "metal",
            BackendKind::Cuda => "cuda",
        }
    }
}

#[cfg(feature = "wgpu")]
fn wgpu_dispatch<J: BackendJob>(job: J, metal: bool, dtype: FloatKind) -> Result<J::Output> {
    let device = wgpu_device(metal)?;
    apply_float_kind::<Wgpu>(&device, dtype, if metal { "metal" } else { "wgpu" })?;
    job.run::<Wgpu>(device)
}

#[cfg(not(feature = "wgpu"))]
fn wgpu_dispatch<J: BackendJob>(_job: J, _metal: bool, _dtype: FloatKind) -> Result<J::Output> {
    bail!("this toy was built without the wgpu backend: rebuild with `--features wgpu`")
}

#[cfg(feature = "cuda")]
fn cuda_dispatch<J: BackendJob>(job: J, dtype: FloatKind) -> Result<J::Output> {
    cuda_probe()?;
    let device = Default::default();
    apply_float_kind::<Cuda>(&device, dtype, "cuda")?;
    job.run::<Cuda>(device)
}

#[cfg(not(feature = "cuda"))]
fn cuda_dispatch<J: BackendJob>(_job: J, _dtype: FloatKind) -> Result<J::Output> {
    bail!("this toy was built without the cuda backend: rebuild with `--features cuda`")
}

/// The wgpu device named by `TOY_WGPU_DEVICE`, after checking that the graphics API has an
/// adapter of that kind (cubecl panics in a worker thread otherwise).
#[cfg(feature = "wgpu")]
fn wgpu_device(metal: bool) -> Result<cubecl::wgpu::WgpuDevice> {
    use cubecl::wgpu::{GraphicsApi, WgpuDevice};

    // Mesa's window-system code prints "error: XDG_RUNTIME_DIR is invalid or not set" on headless
    // machines when a Vulkan instance starts; toy draws no windows, so give it a directory.
    if std::env::var_os("XDG_RUNTIME_DIR").is_none() {
        // SAFETY: called before any thread of ours reads the environment (the model and rayon's
        // pool start later).
        unsafe { std::env::set_var("XDG_RUNTIME_DIR", std::env::temp_dir()) };
    }
    let spec = std::env::var("TOY_WGPU_DEVICE").unwrap_or_default();
    let device = parse_wgpu_device(&spec)?;
    let api = if metal {
        if !cfg!(target_os = "macos") {
            bail!("--backend metal needs macOS; on this system use --backend wgpu (Vulkan)");
        }
        wgpu::Backend::Metal
    } else {
        cubecl::wgpu::AutoGraphicsApi::backend()
    };
    let instance = wgpu::Instance::new(wgpu::InstanceDescriptor {
        backends: api.into(),
        ..wgpu::InstanceDescriptor::new_without_display_handle()
    });
    let adapters = cubecl::future::block_on(instance.enumerate_adapters(api.into()));
    let infos: Vec<_> = adapters.iter().map(|a| a.get_info()).collect();
    if infos.is_empty() {
        bail!(
            "no {api:?} adapter found for --backend wgpu: install a {api:?} driver (on Linux \
             without a GPU: `apt-get install mesa-vulkan-drivers` for the lavapipe software \
             rasterizer), or use --backend cpu"
        );
    }
    let wanted = |t: wgpu::DeviceType| infos.iter().filter(|i| i.device_type == t).count();
    let (kind, index, count) = match device {
        WgpuDevice::DiscreteGpu(i) => ("discrete", i, wanted(wgpu::DeviceType::DiscreteGpu)),
        WgpuDevice::IntegratedGpu(i) => ("integrated", i, wanted(wgpu::DeviceType::IntegratedGpu)),
        WgpuDevice::VirtualGpu(i) => ("virtual", i, wanted(wgpu::DeviceType::VirtualGpu)),
        WgpuDevice::Cpu => ("cpu", 0, wanted(wgpu::DeviceType::Cpu)),
        _ => ("default", 0, infos.len()),
    };
    if index >= count {
        let found: Vec<_> = infos
            .iter()
            .map(|i| format!("{} ({:?})", i.name, i.device_type))
            .collect();
        bail!(
            "TOY_WGPU_DEVICE={spec}: no {kind} adapter number {index}; found: {}",
            found.join(", ")
        );
    }
    #[cfg(target_os = "macos")]
    if metal {
        cubecl::wgpu::init_setup::<cubecl::wgpu::Metal>(&device, Default::default());
    }
    Ok(device)
}

/// `TOY_WGPU_DEVICE`: `default` (or empty), `discrete[:N]`, `integrated[:N]`, `virtual[:N]`, `cpu`.
#[cfg(feature = "wgpu")]
fn parse_wgpu_device(spec: &str) -> Result<cubecl::wgpu::WgpuDevice> {
    use cubecl::wgpu::WgpuDevice;
    let (kind, index) = spec.split_once(':').unwrap_or((spec, "0"));
    let index: usize = index.parse().map_err(|_| {
        anyhow::anyhow!("TOY_WGPU_DEVICE={spec}: the adapter number must be an integer")
    })?;
    Ok(match kind.trim().to_ascii_lowercase().as_str() {
        "" | "default" => WgpuDevice::DefaultDevice,
        "discrete" => WgpuDevice::DiscreteGpu(index),
        "integrated" => WgpuDevice::IntegratedGpu(index),
        "virtual" => WgpuDevice::VirtualGpu(index),
        "cpu" => WgpuDevice::Cpu,
        other => bail!(
            "TOY_WGPU_DEVICE={other}: expected default, discrete[:N], integrated[:N], virtual[:N] or cpu"
        ),
    })
}

/// Check that CUDA can start: the driver library loads, `cuInit` succeeds, a device exists, and
/// NVRTC (which compiles the kernels at run time) loads.
#[cfg(feature = "cuda")]
fn cuda_probe() -> Result<()> {
    use libloading::{Library, Symbol};

    fn load(names: &[&str]) -> Option<Library> {
        // SAFETY: loading a system library runs its initializers; libcuda and libnvrtc are the
        // libraries the CUDA runtime itself would load next.
        names.iter().find_map(|n| unsafe { Library::new(*n) }.ok())
    }
    let Some(cuda) = load(&["libcuda.so.1", "libcuda.so", "nvcuda.dll"]) else {
        bail!(
            "--backend cuda: libcuda was not found (no NVIDIA driver on this machine); install \
             the NVIDIA driver, or use --backend wgpu or --backend cpu"
        );
    };
    // SAFETY: the symbols have these C signatures in every CUDA driver since 2.0.
    unsafe {
        let init: Symbol<unsafe extern "C" fn(u32) -> i32> = cuda.get(b"cuInit")?;
        let rc = init(0);
        if rc != 0 {
            bail!(
                "--backend cuda: cuInit failed with CUDA error {rc} (driver and GPU out of step, \
                 or no GPU visible: check nvidia-smi and CUDA_VISIBLE_DEVICES)"
            );
        }
        let count_fn: Symbol<unsafe extern "C" fn(*mut i32) -> i32> =
            cuda.get(b"cuDeviceGetCount")?;
        let mut count = 0;
        if count_fn(&mut count) != 0 || count == 0 {
            bail!("--backend cuda: the CUDA driver sees no GPU (check CUDA_VISIBLE_DEVICES)");
        }
    }
    let nvrtc_names: Vec<String> = ["libnvrtc.so".to_string()]
        .into_iter()
        .chain((11..=13).rev().map(|v| format!("libnvrtc.so.{v}")))
        .collect();
    let names: Vec<&str> = nvrtc_names.iter().map(String::as_str).collect();
    if load(&names).is_none() {
        bail!(
            "--backend cuda: NVRTC (libnvrtc.so) was not found; it compiles toy's kernels at run \
             time: install the CUDA toolkit's nvrtc package and put its lib directory on \
             LD_LIBRARY_PATH"
        );
    }
    Ok(())
}
