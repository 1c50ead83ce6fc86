//! Native overrides for burn's Flex backend (`--backend cpu`).
//!
//! The quantized matmuls follow ggml's CPU algorithm: each activation row is quantized to
//! 8-bit blocks of 32 (scale `amax / 127` rounded to f16, quants rounded half to even — ggml's
//! Q8_0, or Q8_1 which also keeps `scale * Σq` for Q4_1's offsets), each block's dot product with
//! the weight block is an exact integer sum, and the sum is scaled once by
//! `d_weight * d_activation`. That is both much faster than dequantizing the weight and the
//! way to reproduce llama.cpp's numbers. Rows of the output are computed in parallel with rayon.

use std::borrow::Cow;
use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};

use burn::backend::Flex;
use burn::backend::flex::FlexTensor;
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{DType, TensorData, TensorMetadata};
use half::f16;
use rayon::prelude::*;

use crate::packed::{BLOCK, HostPackedView, dequantize_rows};
use crate::{
    AdamWStep, AttentionOptions, AttentionPart, PackedTensor, RopeLayout, ToyBackend, reference,
};

/// Which x86 build of llama.cpp the CPU backend reproduces where that build's arithmetic depends
/// on its vector width: attention's f32 dot products, the vector `expf` of SiLU and softmax,
/// llamafile's tinyBLAS and the 16-bit weights' dot products sum 8 lanes (AVX2) or 16
/// (AVX-512). The quantized dot products, RMSNorm and RoPE are the same in both builds. toy's
/// kernels give these bits on any CPU; the setting only chooses which llama.cpp to agree with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GgmlIsa {
    /// The AVX2 build: 8 f32 lanes.
    Avx2,
    /// The AVX-512 build without AVX512_BF16: 16 f32 lanes.
    Avx512,
    /// The AVX-512 build compiled with AVX512_BF16 (what `GGML_NATIVE` gives on Zen 4 or
    /// Sapphire Rapids): as `Avx512`, but bf16 dot products (`vec_dot_bf16`, bf16 tinyBLAS) take
    /// `vdpbf16ps`, which adds each lane's odd product, then its even one, to the accumulator.
    Avx512Bf16,
}

impl GgmlIsa {
    /// f32 lanes of the build's vectors.
    pub fn lanes(self) -> usize {
        match self {
            GgmlIsa::Avx2 => 8,
            GgmlIsa::Avx512 | GgmlIsa::Avx512Bf16 => 16,
        }
    }

    /// An AVX-512 build (with or without AVX512_BF16).
    pub fn avx512(self) -> bool {
        self != GgmlIsa::Avx2
    }

    fn code(self) -> u8 {
        match self {
            GgmlIsa::Avx2 => 1,
            GgmlIsa::Avx512 => 2,
            GgmlIsa::Avx512Bf16 => 3,
        }
    }
}

/// The instruction sets toy's CPU kernels use: the best this CPU has, or a lower level forced
/// with `TOY_CPU` (`scalar`, `avx2`, `avx512`) so that every path can be tested on one machine.
/// It changes speed only, never a result: every path computes the same bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum CpuLevel {
    /// Portable Rust (what runs off x86-64).
    Scalar,
    /// AVX2, FMA and F16C.
    Avx2,
    /// AVX-512 (F, BW, VL, VNNI) on top of AVX2.
    Avx512,
}

/// The level in use (see [`CpuLevel`]); read once.
pub fn cpu_level() -> CpuLevel {
    static LEVEL: std::sync::OnceLock<CpuLevel> = std::sync::OnceLock::new();
    *LEVEL.get_or_init(|| {
        let best = detect_cpu_level();
        match std::env::var("TOY_CPU").as_deref() {
            Ok("scalar") => CpuLevel::Scalar,
            Ok("avx2") => best.min(CpuLevel::Avx2),
            _ => best,
        }
    })
}

/// Whether the kernels that read the X16 layout (`packed::RowLayout::X16`: `blocks_vnni`,
/// `vnni::row_x16`/`pair_x16`) run on this CPU: AVX-512 F/BW/VL/VNNI, so `Avx512`.
pub(crate) fn x16_kernels() -> bool {
    cfg!(target_arch = "x86_64") && cpu_level() >= CpuLevel::Avx512
}

fn detect_cpu_level() -> CpuLevel {
    #[cfg(target_arch = "x86_64")]
    {
        let has = |f: &str| match f {
            "avx2" => std::is_x86_feature_detected!("avx2"),
            "fma" => std::is_x86_feature_detected!("fma"),
            "f16c" => std::is_x86_feature_detected!("f16c"),
            "avx512f" => std::is_x86_feature_detected!("avx512f"),
            "avx512bw" => std::is_x86_feature_detected!("avx512bw"),
            "avx512vl" => std::is_x86_feature_detected!("avx512vl"),
            _ => std::is_x86_feature_detected!("avx512vnni"),
        };
        if ["avx2", "fma", "f16c"].iter().all(|f| has(f)) {
            if ["avx512f", "avx512bw", "avx512vl", "avx512vnni"]
                .iter()
                .all(|f| has(f))
            {
                return CpuLevel::Avx512;
            }
            return CpuLevel::Avx2;
        }
    }
    CpuLevel::Scalar
}

/// 0 until chosen: then `GgmlIsa::code`.
static GGML_ISA: AtomicU8 = AtomicU8::new(0);

/// The llama.cpp build reproduced: `set_ggml_isa`'s choice, else `TOY_GGML_ISA` (`avx2`,
/// `avx512` or `avx512bf16`), else the one a native llama.cpp build runs on this CPU — AVX-512
/// where the CPU has AVX-512 F and DQ (with AVX512_BF16 where it has that too; unless `TOY_CPU`
/// forces a lower level), AVX2 otherwise.
pub fn ggml_isa() -> GgmlIsa {
    match GGML_ISA.load(Ordering::Relaxed) {
        1 => GgmlIsa::Avx2,
        2 => GgmlIsa::Avx512,
        3 => GgmlIsa::Avx512Bf16,
        _ => {
            let isa = match std::env::var("TOY_GGML_ISA").as_deref() {
                Ok("avx2") => GgmlIsa::Avx2,
                Ok("avx512") => GgmlIsa::Avx512,
                Ok("avx512bf16" | "avx512_bf16") => GgmlIsa::Avx512Bf16,
                _ => host_ggml_isa(),
            };
            GGML_ISA.store(isa.code(), Ordering::Relaxed);
            isa
        }
    }
}

/// The build llama.cpp's x86 CPU backend picks for this CPU (see [`ggml_isa`]).
fn host_ggml_isa() -> GgmlIsa {
    let forced_down = matches!(std::env::var("TOY_CPU").as_deref(), Ok("avx2" | "scalar"));
    #[cfg(target_arch = "x86_64")]
    if !forced_down
        && std::is_x86_feature_detected!("avx512f")
        && std::is_x86_feature_detected!("avx512dq")
    {
        if std::is_x86_feature_detected!("avx512bf16") {
            return GgmlIsa::Avx512Bf16;
        }
        return GgmlIsa::Avx512;
    }
    let _ = forced_down;
    GgmlIsa::Avx2
}

/// Choose the llama.cpp build to reproduce (for the whole process).
pub fn set_ggml_isa(isa: GgmlIsa) {
    GGML_ISA.store(isa.code(), Ordering::Relaxed);
}

thread_local! {
    /// Forward passes running on this thread (see `run_pass`).
    static PASSES_ON_THIS_THREAD: Cell<usize> = const { Cell::new(0) };
}

/// Marks the end of a `run_pass` pass when dropped.
struct PassEnd<'a>(&'a AtomicBool);

impl Drop for PassEnd<'_> {
    fn drop(&mut self) {
        PASSES_ON_THIS_THREAD.set(PASSES_ON_THIS_THREAD.get() - 1);
        self.0.store(true, Ordering::Release);
    }
}

impl ToyBackend for Flex {
    /// On a worker of rayon's pool, with the other workers kept awake for the length of the
    /// pass. A parallel op started from outside the pool hands its work to the workers and
    /// puts the caller to sleep until they finish; from a worker it splits in place. And a
    /// worker that finds no work soon goes to sleep, so each of the few hundred small ops of a
    /// decoded token would pay for waking it (measured: 13% of decode time in the scheduler).
    /// Instead each other worker runs a job that keeps taking rayon's pending work until the
    /// pass ends, as ggml's threads spin between ops.
    fn run_pass<R: Send>(f: impl FnOnce() -> R + Send) -> R {
        let done = AtomicBool::new(false);
        // The pass may run on another thread: its row groups go with it.
        let groups = row_groups::current();
        rayon::scope(|scope| {
            for _ in 1..rayon::current_num_threads() {
                scope.spawn(|_| {
                    // A worker with a pass of its own below this job (the pass's own worker,
                    // waiting on a stolen piece of its work, or another pass's) must get back to
                    // it: spinning there until this pass ends could wait forever.
                    if PASSES_ON_THIS_THREAD.get() > 0 {
                        return;
                    }
                    while !done.load(Ordering::Acquire) {
                        if rayon::yield_now() != Some(rayon::Yield::Executed) {
                            std::hint::spin_loop();
                        }
                    }
                });
            }
            PASSES_ON_THIS_THREAD.set(PASSES_ON_THIS_THREAD.get() + 1);
            // Ends the pass on return and on unwind alike: if `f` panicked and the spinning
            // jobs were never told, the scope would wait for them forever instead of
            // propagating the panic.
            let _end = PassEnd(&done);
            row_groups::scoped(groups, f)
        })
    }

    fn with_row_groups<R>(lens: &[usize], f: impl FnOnce() -> R) -> R {
        row_groups::scoped(Some(lens.to_vec()), f)
    }

    /// With AVX-512 VNNI, sixteen rows transposed per super-block, for the kernels that keep
    /// sixteen outputs in the lanes of one register (`blocks_vnni`); with AVX2, eight rows
    /// interleaved by chunks, which the eight-row kernel reads as one stream at 2–3× the
    /// bandwidth of eight rows apart (measured on a Zen 4).
    fn row_layout() -> crate::packed::RowLayout {
        use crate::packed::RowLayout;
        match cpu_level() {
            _ if x16_kernels() => RowLayout::X16,
            CpuLevel::Avx2 | CpuLevel::Avx512 => RowLayout::X8,
            CpuLevel::Scalar => RowLayout::Rows,
        }
    }

    fn packed_matmul(x: FloatTensor<Self>, w: PackedTensor<Self>) -> FloatTensor<Self> {
        match Operands::new(&x, &w) {
            Some(ops) => ops.run(),
            None => reference::packed_matmul::<Self>(x, w),
        }
    }

    /// The weights as parallel tasks of one region: a thread that finishes its share of one
    /// weight takes work from the next instead of waiting at the end of each matmul (a decoded
    /// token's Q, K and V of SmolLM2 are 576, 192 and 192 rows: a few tasks each). Measured on
    /// a Zen 4 with 2 threads, alternated runs: SmolLM2 decode +6% (Q8_0) and +8% (Q4_0),
    /// Q4_0 prefill +5%. Each product is computed as alone, bit for bit; the row groups of a
    /// batched pass go with each task to the thread that runs it.
    fn packed_matmuls(x: FloatTensor<Self>, ws: Vec<PackedTensor<Self>>) -> Vec<FloatTensor<Self>> {
        let groups = row_groups::current();
        ws.into_par_iter()
            .map(|w| row_groups::scoped(groups.clone(), || Self::packed_matmul(x.clone(), w)))
            .collect()
    }

    fn packed_matmul_backward(dy: FloatTensor<Self>, w: PackedTensor<Self>) -> FloatTensor<Self> {
        let dy = dy.to_contiguous();
        let (Some(host), Some((dys, [m, n]))) = (HostWeight::new(&w), matrix(&dy)) else {
            return reference::packed_matmul_backward::<Self>(dy, w);
        };
        if n != host.view().rows || dy.dtype() != DType::F32 {
            return reference::packed_matmul_backward::<Self>(dy, w);
        }
        let dx = packed_backward(dys, m, &host.view());
        FlexTensor::from_data(TensorData::new(dx, [m, w.cols]))
    }

    fn packed_dequantize(w: PackedTensor<Self>) -> FloatTensor<Self> {
        let Some(host) = HostWeight::new(&w) else {
            return reference::packed_dequantize::<Self>(w)
                .into_primitive()
                .tensor();
        };
        let v = host.view();
        let mut out = vec![0.0f32; v.rows * v.cols];
        out.par_chunks_mut(v.cols * 64)
            .enumerate()
            .for_each(|(c, rows)| {
                let r0 = c * 64;
                rows.copy_from_slice(&dequantize_rows(&v, r0..r0 + rows.len() / v.cols));
            });
        FlexTensor::from_data(TensorData::new(out, [v.rows, v.cols]))
    }

    fn packed_rows(w: PackedTensor<Self>, ids: IntTensor<Self>) -> FloatTensor<Self> {
        let Some(host) = HostWeight::new(&w) else {
            return reference::packed_rows::<Self>(w, ids);
        };
        let ids: Vec<i64> = ids.into_data().iter::<i64>().collect();
        let rows = host.view().rows as i64;
        if ids.iter().any(|&i| !(0..rows).contains(&i)) {
            // Out of range: let the reference body's `select` report it as burn does.
            return reference::packed_rows::<Self>(
                w,
                FlexTensor::from_data(TensorData::new(ids.clone(), [ids.len()])),
            );
        }
        let cols = w.cols;
        let mut out = vec![0.0f32; ids.len() * cols];
        out.par_chunks_mut(cols).zip(&ids).for_each(|(row, &i)| {
            row.copy_from_slice(&dequantize_rows(&host.view(), [i as usize]));
        });
        FlexTensor::from_data(TensorData::new(out, [ids.len(), cols]))
    }

    fn dense_linear(x: FloatTensor<Self>, w: FloatTensor<Self>) -> FloatTensor<Self> {
        // llama.cpp's arithmetic: tinyBLAS for several rows, vec_dot_f32 for one (decode).
        // Where tinyBLAS's shape conditions fail, `gemm`, whose blocked products beat ggml's
        // per-output fallback. (Training's forward, `dense_linear_tracked`, is `gemm`'s.)
        // A batched pass's rows take the path their own sequence's row count picks.
        dense_product(x, w, |xd, m, wd, n, k| {
            let isa = ggml_isa();
            let several = |xd: &[f32], m: usize| {
                if tinyblas::applies(m, n, k, isa, tinyblas::Elem::F32) {
                    let wb = bytemuck::cast_slice(wd);
                    tinyblas::matmul(xd, m, wb, n, k, tinyblas::Elem::F32, isa)
                } else if m == 1 {
                    tinyblas::vec_dot_matmul(xd, m, wd, n, k, isa)
                } else {
                    gemm_linear(xd, m, wd, n, k)
                }
            };
            match row_groups::for_rows(m) {
                Some(groups) => row_groups::split_single_rows(
                    xd,
                    k,
                    n,
                    &groups,
                    |xd, m| tinyblas::vec_dot_matmul(xd, m, wd, n, k, isa),
                    several,
                ),
                None => several(xd, m),
            }
        })
    }

    fn dense_linear_tracked(x: FloatTensor<Self>, w: FloatTensor<Self>) -> FloatTensor<Self> {
        dense_product(x, w, gemm_linear)
    }

    fn dense_linear_backward(
        w: FloatTensor<Self>,
        dy: FloatTensor<Self>,
        x: Option<FloatTensor<Self>>,
    ) -> (FloatTensor<Self>, Option<FloatTensor<Self>>) {
        let (w, dy) = (w.to_contiguous(), dy.to_contiguous());
        let x = x.map(|x| x.to_contiguous());
        let (Some((wd, [n, k])), Some((dyd, [m, dn]))) = (matrix(&w), matrix(&dy)) else {
            return reference::dense_linear_backward::<Self>(w, dy, x);
        };
        let xd = match x.as_ref().map(matrix) {
            None => None,
            Some(Some((xd, [xm, xk]))) if xm == m && xk == k => Some(xd),
            Some(_) => return reference::dense_linear_backward::<Self>(w, dy, x),
        };
        if dn != n {
            return reference::dense_linear_backward::<Self>(w, dy, x);
        }
        let dx = linear::new_product(m, k, n, (dyd, 1, n), (wd, 1, k)); // dy · w
        let dw = xd.map(|xd| {
            let dw = linear::new_product(n, k, m, (dyd, n, 1), (xd, 1, k)); // dyᵀ · x
            FlexTensor::from_data(TensorData::new(dw, [n, k]))
        });
        (FlexTensor::from_data(TensorData::new(dx, [m, k])), dw)
    }

    fn rms_norm(x: FloatTensor<Self>, weight: FloatTensor<Self>, eps: f32) -> FloatTensor<Self> {
        let shape = x.shape();
        let d = shape[shape.num_dims() - 1];
        let (x, w) = (x.to_contiguous(), weight.to_contiguous());
        let (Some(xs), Some(ws)) = (x.as_slice::<f32>(), w.as_slice::<f32>()) else {
            return reference::rms_norm::<Self>(x, weight, eps);
        };
        let mut out = vec![0.0f32; xs.len()];
        out.par_chunks_mut(d)
            .zip(xs.par_chunks(d))
            .for_each(|(y, x)| rms_norm_row(x, ws, eps, y));
        FlexTensor::from_data(TensorData::new(out, shape))
    }

    fn rms_norm_backward(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        eps: f32,
        dy: FloatTensor<Self>,
        weight_grad: bool,
    ) -> (FloatTensor<Self>, Option<FloatTensor<Self>>) {
        let (shape, weight_shape) = (x.shape(), weight.shape());
        let d = shape[shape.num_dims() - 1];
        let (Some(xs), Some(ws), Some(dys)) =
            (f32_elements(&x), f32_elements(&weight), f32_elements(&dy))
        else {
            return reference::rms_norm_backward::<Self>(x, weight, eps, dy, weight_grad);
        };
        if ws.len() != d || dys.len() != xs.len() {
            return reference::rms_norm_backward::<Self>(x, weight, eps, dy, weight_grad);
        }
        let (dx, dw) = grad::rms_norm_backward(&xs, &ws, &dys, eps, weight_grad);
        (
            FlexTensor::from_data(TensorData::new(dx, shape)),
            dw.map(|dw| FlexTensor::from_data(TensorData::new(dw, weight_shape))),
        )
    }

    fn swiglu_backward(
        gate: FloatTensor<Self>,
        up: FloatTensor<Self>,
        dy: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let shape = up.shape();
        let (Some(gs), Some(us), Some(dys)) =
            (f32_elements(&gate), f32_elements(&up), f32_elements(&dy))
        else {
            return reference::swiglu_backward::<Self>(gate, up, dy);
        };
        if gs.len() != us.len() || dys.len() != us.len() {
            return reference::swiglu_backward::<Self>(gate, up, dy);
        }
        let (d_gate, d_up) = grad::swiglu_backward(&gs, &us, &dys);
        (
            FlexTensor::from_data(TensorData::new(d_gate, shape.clone())),
            FlexTensor::from_data(TensorData::new(d_up, shape)),
        )
    }

    fn swiglu(gate: FloatTensor<Self>, up: FloatTensor<Self>) -> FloatTensor<Self> {
        let shape = up.shape();
        let (g, u) = (gate.to_contiguous(), up.to_contiguous());
        let (Some(gs), Some(us)) = (g.as_slice::<f32>(), u.as_slice::<f32>()) else {
            return reference::swiglu::<Self>(gate, up);
        };
        if gs.len() != us.len() {
            return reference::swiglu::<Self>(gate, up);
        }
        let d = shape[shape.num_dims() - 1];
        let isa = ggml_isa();
        let mut out = vec![0.0f32; us.len()];
        out.par_chunks_mut(d)
            .zip(gs.par_chunks(d).zip(us.par_chunks(d)))
            .for_each(|(y, (g, u))| swiglu_row(g, u, y, isa));
        FlexTensor::from_data(TensorData::new(out, shape))
    }

    fn attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        options: AttentionOptions,
    ) -> FloatTensor<Self> {
        let part = AttentionPart { q, k, v, options };
        let Some(input) = ggml_attention_input(&part) else {
            return reference::attention::<Self>(part.q, part.k, part.v, part.options);
        };
        let out = attention_ggml(&[input]).pop().expect("one output");
        FlexTensor::from_data(TensorData::new(out, part.q.shape()))
    }

    fn write_tokens(
        buffer: FloatTensor<Self>,
        x: FloatTensor<Self>,
        at: usize,
    ) -> FloatTensor<Self> {
        let (bs, xs) = (buffer.shape(), x.shape());
        let whole = buffer.is_contiguous()
            && buffer.layout().start_offset() == 0
            && buffer.bytes().len() == bs.num_elements() * buffer.dtype().size();
        if !whole || bs.num_dims() != 4 || xs.num_dims() != 4 || x.dtype() != buffer.dtype() {
            return reference::write_tokens::<Self>(buffer, x, at);
        }
        match buffer.dtype() {
            DType::F32 => write_tokens_typed::<f32>(buffer, &x, at),
            DType::F16 => write_tokens_typed::<f16>(buffer, &x, at),
            DType::BF16 => write_tokens_typed::<half::bf16>(buffer, &x, at),
            _ => reference::write_tokens::<Self>(buffer, x, at),
        }
    }

    fn attention_batch(parts: Vec<AttentionPart<Self>>) -> Vec<FloatTensor<Self>> {
        let inputs: Option<Vec<attention::AttnInput<'_>>> =
            parts.iter().map(ggml_attention_input).collect();
        let Some(inputs) = inputs else {
            // A part llama.cpp's arithmetic does not cover: each part on its own.
            return parts
                .into_iter()
                .map(|p| <Self as ToyBackend>::attention(p.q, p.k, p.v, p.options))
                .collect();
        };
        let outs = attention_ggml(&inputs);
        drop(inputs);
        outs.into_iter()
            .zip(&parts)
            .map(|(out, p)| FlexTensor::from_data(TensorData::new(out, p.q.shape())))
            .collect()
    }

    fn attention_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        d_out: FloatTensor<Self>,
        options: AttentionOptions,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let (qs, ks) = (q.shape(), k.shape());
        let slices = (
            f32_elements(&q),
            f32_elements(&k),
            f32_elements(&v),
            f32_elements(&d_out),
        );
        let (Some(qd), Some(kd), Some(vd), Some(dod)) = slices else {
            return reference::attention_backward::<Self>(q, k, v, d_out, &options);
        };
        if qs.num_dims() != 4 || dod.len() != qd.len() {
            return reference::attention_backward::<Self>(q, k, v, d_out, &options);
        }
        let dims = AttnDims::new(&qs, &ks);
        let (dq, dk, dv) = grad::attention_backward(&qd, &kd, &vd, &dod, &dims, &options);
        (
            FlexTensor::from_data(TensorData::new(dq, qs)),
            FlexTensor::from_data(TensorData::new(dk, ks.clone())),
            FlexTensor::from_data(TensorData::new(dv, ks)),
        )
    }

    fn merge_heads(x: FloatTensor<Self>) -> FloatTensor<Self> {
        let shape = x.shape();
        if shape.num_dims() != 4 || x.dtype() != DType::F32 {
            return reference::merge_heads::<Self>(x);
        }
        let [b, heads, t, d] = [shape[0], shape[1], shape[2], shape[3]];
        // The merged layout is the heads' view with tokens before heads, made contiguous.
        let view = x.transpose(1, 2);
        let merged = f32_elements(&view).expect("an f32 tensor").into_owned();
        FlexTensor::from_data(TensorData::new(merged, [b, t, heads * d]))
    }

    fn rope(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        layout: RopeLayout,
    ) -> FloatTensor<Self> {
        let shape = x.shape();
        let (Some(xs), Some(cs), Some(ss)) =
            (f32_elements(&x), f32_elements(&cos), f32_elements(&sin))
        else {
            return reference::rope::<Self>(x, cos, sin, layout);
        };
        if shape.num_dims() != 4 || cs.len() != ss.len() || cs.len() % shape[2] != 0 {
            return reference::rope::<Self>(x, cos, sin, layout);
        }
        let (t, d) = (shape[2], shape[3]);
        let half = cs.len() / t;
        let mut out = xs.into_owned();
        out.par_chunks_mut(t * d)
            .for_each(|head| rope_head(head, &cs, &ss, [d, half], layout));
        FlexTensor::from_data(TensorData::new(out, shape))
    }

    fn linear_cross_entropy_forward(
        h: FloatTensor<Self>,
        w: FloatTensor<Self>,
        targets: IntTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let Some(head) = HeadOperands::new(&h, &w, &targets) else {
            return reference::linear_cross_entropy::<Self>(h, w, targets);
        };
        let (loss, logsumexp) = head.with_slices(loss::forward);
        let n = logsumexp.len();
        (
            FlexTensor::from_data(TensorData::new(vec![loss], [1])),
            FlexTensor::from_data(TensorData::new(logsumexp, [n, 1])),
        )
    }

    fn linear_cross_entropy_backward(
        h: FloatTensor<Self>,
        w: FloatTensor<Self>,
        targets: IntTensor<Self>,
        logsumexp: FloatTensor<Self>,
        dloss: FloatTensor<Self>,
        weight_grad: bool,
    ) -> (FloatTensor<Self>, Option<FloatTensor<Self>>) {
        let (lse, dl) = (logsumexp.to_contiguous(), dloss.to_contiguous());
        let (Some(head), Some(lse), Some(&[dl])) = (
            HeadOperands::new(&h, &w, &targets),
            lse.as_slice::<f32>(),
            dl.as_slice::<f32>(),
        ) else {
            return reference::linear_cross_entropy_backward::<Self>(
                h,
                w,
                targets,
                logsumexp,
                dloss,
                weight_grad,
            );
        };
        let (n, d, vocab) = (head.targets.len(), head.d, head.w.shape()[0]);
        let scale = dl / n as f32;
        let (dh, dw) =
            head.with_slices(|h, w, t, d| loss::backward(h, w, t, lse, scale, d, weight_grad));
        (
            FlexTensor::from_data(TensorData::new(dh, [n, d])),
            dw.map(|dw| FlexTensor::from_data(TensorData::new(dw, [vocab, d]))),
        )
    }

    fn adamw_step(
        param: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        moments: Option<(FloatTensor<Self>, FloatTensor<Self>)>,
        step: AdamWStep,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let n = param.shape().num_elements();
        let same = |t: &FlexTensor| t.dtype() == DType::F32 && t.shape().num_elements() == n;
        let native = param.dtype() == DType::F32
            && same(&grad)
            && moments.as_ref().is_none_or(|(m, v)| same(m) && same(v));
        if !native {
            return reference::adamw_step::<Self>(param, grad, moments, step);
        }
        let shape = param.shape();
        let first = moments.is_none();
        let (m, v) = moments.unwrap_or_else(|| {
            let zeros = || FlexTensor::zeros(shape.clone(), DType::F32);
            (zeros(), zeros())
        });
        let grad = grad.to_contiguous();
        let g = grad.as_slice::<f32>().expect("a contiguous f32 tensor");
        let (mut p, mut m, mut v) = (owned(param), owned(m), owned(v));
        optim::adamw(
            p.storage_mut(),
            g,
            m.storage_mut(),
            v.storage_mut(),
            first,
            &step,
        );
        let shaped = |t: FlexTensor| t.reshape(shape.clone());
        (shaped(p), shaped(m), shaped(v))
    }

    fn sum_squares(x: FloatTensor<Self>) -> FloatTensor<Self> {
        let x = x.to_contiguous();
        match x.as_slice::<f32>() {
            Some(xs) => FlexTensor::from_data(TensorData::new(vec![optim::sum_squares(xs)], [1])),
            None => reference::sum_squares::<Self>(x),
        }
    }
}

/// `t`'s f32 elements in row-major order: borrowed when `t` is contiguous, else copied a row
/// (of the last dimension) at a time. burn-flex's `to_contiguous` computes a strided index per
/// element, which made the `[b, t, h, d]` ↔ `[b, h, t, d]` views around attention about a
/// tenth of a LoRA step's single-threaded time.
fn f32_elements(t: &FlexTensor) -> Option<Cow<'_, [f32]>> {
    if let Some(s) = t.as_slice::<f32>() {
        return Some(Cow::Borrowed(s));
    }
    if t.dtype() != DType::F32 {
        return None;
    }
    let layout = t.layout();
    let (shape, strides) = (layout.shape(), layout.strides());
    let rank = shape.num_dims();
    let d = shape[rank - 1];
    if strides[rank - 1] != 1 || strides.iter().any(|&s| s < 0) || d == 0 {
        let t = t.to_contiguous();
        return Some(Cow::Owned(t.as_slice::<f32>()?.to_vec()));
    }
    let (data, start) = (t.storage::<f32>(), layout.start_offset());
    let mut out = vec![0.0f32; shape.num_elements()];
    out.par_chunks_mut(d)
        .with_min_len(64)
        .enumerate()
        .for_each(|(row, dst)| {
            // The row's offset: its index over the leading dimensions, last one fastest.
            let (mut rest, mut offset) = (row, start);
            for dim in (0..rank - 1).rev() {
                offset += (rest % shape[dim]) * strides[dim] as usize;
                rest /= shape[dim];
            }
            dst.copy_from_slice(&data[offset..offset + d]);
        });
    Some(Cow::Owned(out))
}

/// [`ToyBackend::write_tokens`] on a whole contiguous buffer: `storage_mut` writes in place when
/// the buffer's data is held once (a KV cache's, between steps), and copies it first otherwise.
fn write_tokens_typed<E: burn::tensor::Element + bytemuck::Pod>(
    mut buffer: FlexTensor,
    x: &FlexTensor,
    at: usize,
) -> FlexTensor {
    let [b, h, capacity, d] = buffer.shape().dims::<4>();
    let t = x.shape()[2];
    let x = x.to_contiguous();
    let src = &x.storage::<E>()[..b * h * t * d];
    let dst = buffer.storage_mut::<E>();
    for (bh, rows) in src.chunks(t * d).enumerate() {
        let start = (bh * capacity + at) * d;
        dst[start..start + t * d].copy_from_slice(rows);
    }
    buffer
}

/// A part's operands for [`attention_ggml`], when it has the form that llama.cpp's arithmetic
/// covers (f32, `[b, h, t, d]`, no soft-cap); `None` sends it to the reference body.
fn ggml_attention_input(p: &AttentionPart<Flex>) -> Option<attention::AttnInput<'_>> {
    let (qs, ks) = (p.q.shape(), p.k.shape());
    let native = p.options.softcap.is_none()
        && qs.num_dims() == 4
        && ks.num_dims() == 4
        && p.q.dtype() == DType::F32;
    if !native {
        return None;
    }
    Some(attention::AttnInput {
        q: f32_elements(&p.q)?,
        k: kv_heads(&p.k)?,
        v: kv_heads(&p.v)?,
        dims: AttnDims::new(&qs, &ks),
        options: p.options,
    })
}

/// An f32 `[b, h_kv, tk, d]` key or value tensor as [`attention::Heads`]: read in place when each
/// head's tokens are contiguous (a KV cache's view of its held tokens), copied otherwise.
fn kv_heads(t: &FlexTensor) -> Option<attention::Heads<'_>> {
    let layout = t.layout();
    let (shape, strides) = (layout.shape(), layout.strides());
    let [_, h_kv, tk, d] = [shape[0], shape[1], shape[2], shape[3]];
    let rows_contiguous = strides[3] == 1 && (strides[2] == d as isize || tk == 1);
    if t.dtype() == DType::F32 && rows_contiguous && strides[..2].iter().all(|&s| s >= 0) {
        return Some(attention::Heads {
            data: Cow::Borrowed(t.storage::<f32>()),
            start: layout.start_offset(),
            strides: [strides[0] as usize, strides[1] as usize],
        });
    }
    let data = f32_elements(t)?;
    Some(attention::Heads::contiguous(data, h_kv, tk, d))
}

/// A contiguous f32 matrix's data and `[rows, cols]`.
/// `x[m, k] · w[n, k]ᵀ` by `product(x, m, w, n, k)` for f32 matrices; the reference body for
/// anything else (other dtypes, ranks, mismatched `k`).
fn dense_product(
    x: FlexTensor,
    w: FlexTensor,
    product: impl Fn(&[f32], usize, &[f32], usize, usize) -> Vec<f32>,
) -> FlexTensor {
    let (x, w) = (x.to_contiguous(), w.to_contiguous());
    match (matrix(&x), matrix(&w)) {
        (Some((xd, [m, k])), Some((wd, [n, wk]))) if wk == k => {
            FlexTensor::from_data(TensorData::new(product(xd, m, wd, n, k), [m, n]))
        }
        _ => reference::dense_linear::<Flex>(x, w),
    }
}

/// `x · wᵀ` with `gemm`: wᵀ[k, n] is w read with column stride k.
fn gemm_linear(xd: &[f32], m: usize, wd: &[f32], n: usize, k: usize) -> Vec<f32> {
    linear::new_product(m, n, k, (xd, 1, k), (wd, k, 1))
}

fn matrix(t: &FlexTensor) -> Option<(&[f32], [usize; 2])> {
    let shape = t.shape();
    if shape.num_dims() != 2 {
        return None;
    }
    Some((t.as_slice::<f32>()?, [shape[0], shape[1]]))
}

/// `t` contiguous, in a buffer this code may write: itself when it is contiguous and nothing
/// else holds its buffer (no copy), else a copy.
fn owned(t: FlexTensor) -> FlexTensor {
    // `to_contiguous` of a contiguous tensor shares the buffer; dropping `t` (shadowing would
    // not) leaves it unique again.
    let contiguous = t.to_contiguous();
    drop(t);
    let mut t = contiguous;
    t.storage_mut::<f32>(); // copies the buffer only if something else still holds it
    t
}

/// The operands of the output head's loss, when the native loop can take them: f32 `h[n, d]`
/// and `w[vocab, d]`, and targets inside the vocabulary (others go to the reference body).
struct HeadOperands {
    h: FlexTensor,
    w: FlexTensor,
    targets: Vec<usize>,
    d: usize,
}

impl HeadOperands {
    fn new(h: &FlexTensor, w: &FlexTensor, targets: &FlexTensor) -> Option<Self> {
        let (hs, ws) = (h.shape(), w.shape());
        let f32s = h.dtype() == DType::F32 && w.dtype() == DType::F32;
        if !f32s || hs.num_dims() != 2 || ws.num_dims() != 2 || hs[1] != ws[1] || hs[1] == 0 {
            return None;
        }
        let vocab = ws[0] as i64;
        let targets: Vec<usize> = targets
            .clone()
            .into_data()
            .iter::<i64>()
            .map(|t| (0..vocab).contains(&t).then_some(t as usize))
            .collect::<Option<_>>()?;
        (targets.len() == hs[0]).then(|| HeadOperands {
            h: h.to_contiguous(),
            w: w.to_contiguous(),
            targets,
            d: hs[1],
        })
    }

    fn with_slices<R>(&self, f: impl FnOnce(&[f32], &[f32], &[usize], usize) -> R) -> R {
        let h = self.h.as_slice::<f32>().expect("contiguous f32");
        let w = self.w.as_slice::<f32>().expect("contiguous f32");
        f(h, w, &self.targets, self.d)
    }
}

/// Defines `$name`, which runs `$imp` compiled with AVX2 and FMA when the CPU has them.
/// `f32::mul_add` and `round_ties_even` are exact but slow library calls unless those features
/// are enabled at compile time; the instructions round exactly as the calls do, so both builds
/// give the same bits.
macro_rules! with_fma {
    ($vis:vis fn $name:ident = $imp:ident($($arg:ident: $ty:ty),*) $(-> $ret:ty)?) => {
        $vis fn $name($($arg: $ty),*) $(-> $ret)? {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx2,fma")]
                unsafe fn fast($($arg: $ty),*) $(-> $ret)? {
                    $imp($($arg),*)
                }
                if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
                    // SAFETY: the CPU has the feature `fast` is compiled for.
                    return unsafe { fast($($arg),*) };
                }
            }
            $imp($($arg),*)
        }
    };
}

mod attention;
#[cfg(test)]
mod avx2_fixture_tests;
mod blocks;
#[cfg(target_arch = "x86_64")]
mod blocks32_avx2;
#[cfg(target_arch = "x86_64")]
mod blocks_avx2;
#[cfg(target_arch = "x86_64")]
mod blocks_vnni;
mod elementwise;
#[cfg(target_arch = "x86_64")]
mod grad;
mod linear;
mod loss;
mod optim;
mod qmatmul;
mod reduce;
mod row_groups;
mod tinyblas;
mod vnni;

use attention::*;
use elementwise::*;
use qmatmul::*;
use reduce::*;

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::Tensor;

    /// The row-wise copy gives `to_contiguous`'s elements for the views attention makes
    /// (a swap of the head and time dims, a narrow, an offset start) and borrows contiguous data.
    #[test]
    fn f32_elements_matches_to_contiguous() {
        let device = Default::default();
        let x = Tensor::<Flex, 1>::from_data(
            TensorData::new((0..2 * 5 * 3 * 4).map(|i| i as f32).collect(), [120]),
            &device,
        )
        .reshape([2, 5, 3, 4]);
        let views = [
            x.clone().swap_dims(1, 2),
            x.clone().narrow(1, 1, 3).swap_dims(1, 2),
            x.clone().narrow(3, 1, 2),
            x.clone(),
        ];
        for (i, view) in views.into_iter().enumerate() {
            let t = view.into_primitive().tensor();
            let want = t.to_contiguous().as_slice::<f32>().unwrap().to_vec();
            let got = f32_elements(&t).unwrap();
            assert_eq!(*got, *want, "view {i}");
            assert_eq!(matches!(got, Cow::Borrowed(_)), i == 3, "view {i}");
        }
    }
}

#[cfg(test)]
mod run_pass_tests {
    use super::*;

    /// Passes running at once on different workers of pools of 2–4 threads, each with parallel
    /// work for the spinning workers to take, all end (every spinning job returns) with the
    /// same results.
    #[test]
    fn concurrent_passes_finish() {
        for threads in [2, 3, 4] {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .expect("a pool");
            let passes = || -> u64 {
                (0..200usize)
                    .map(|n| {
                        Flex::run_pass(|| {
                            (0..20_000 + n)
                                .into_par_iter()
                                .with_max_len(64)
                                .map(|i| (0..i as u64 % 97).sum::<u64>())
                                .sum::<u64>()
                        })
                    })
                    .sum()
            };
            let ((a, b), (c, d)) = pool.install(|| {
                rayon::join(
                    || rayon::join(passes, passes),
                    || rayon::join(passes, passes),
                )
            });
            assert!(a == b && b == c && c == d);
        }
    }

    /// A pass that panics (after the other worker has taken its spinning job) propagates the
    /// panic instead of leaving the scope waiting on a job that spins forever, and the pool
    /// runs passes afterwards.
    #[test]
    fn a_panicking_pass_propagates_its_panic() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .expect("a pool");
        let caught = pool.install(|| {
            std::panic::catch_unwind(|| {
                Flex::run_pass(|| {
                    std::thread::sleep(std::time::Duration::from_millis(50));
                    panic!("a bug in the forward pass")
                })
            })
        });
        assert!(caught.is_err());
        assert_eq!(pool.install(|| Flex::run_pass(|| 7)), 7);
    }
}
