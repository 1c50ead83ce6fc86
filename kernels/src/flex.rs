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
use std::sync::atomic::{AtomicBool, Ordering};

use burn::backend::Flex;
use burn::backend::flex::FlexTensor;
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{DType, TensorData, TensorMetadata};
use half::f16;
use rayon::prelude::*;

use crate::quant::BLOCK;
use crate::{AdamWStep, AttentionOptions, RopeLayout, ToyBackend, reference};

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
            f()
        })
    }

    fn q8_0_matmul(
        x: FloatTensor<Self>,
        words: IntTensor<Self>,
        scales: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        match Operands::new(&x, &words, &scales) {
            Some(ops) => ops.run(Format::Q8_0),
            None => reference::q8_0_matmul::<Self>(x, words, scales),
        }
    }

    fn q4_0_matmul(
        x: FloatTensor<Self>,
        words: IntTensor<Self>,
        scales: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        match Operands::new(&x, &words, &scales) {
            Some(ops) => ops.run(Format::Q4_0),
            None => reference::q4_0_matmul::<Self>(x, words, scales),
        }
    }

    fn dense_linear(x: FloatTensor<Self>, w: FloatTensor<Self>) -> FloatTensor<Self> {
        let (x, w) = (x.to_contiguous(), w.to_contiguous());
        let (Some((xd, [m, k])), Some((wd, [n, wk]))) = (matrix(&x), matrix(&w)) else {
            return reference::dense_linear::<Self>(x, w);
        };
        if wk != k {
            return reference::dense_linear::<Self>(x, w);
        }
        // x · wᵀ: wᵀ[k, n] is w read with column stride k.
        let y = linear::new_product(m, n, k, (xd, 1, k), (wd, k, 1));
        FlexTensor::from_data(TensorData::new(y, [m, n]))
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
        let mut out = vec![0.0f32; us.len()];
        out.par_chunks_mut(d)
            .zip(gs.par_chunks(d).zip(us.par_chunks(d)))
            .for_each(|(y, (g, u))| swiglu_row(g, u, y));
        FlexTensor::from_data(TensorData::new(out, shape))
    }

    fn attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        options: AttentionOptions,
    ) -> FloatTensor<Self> {
        let (qs, ks) = (q.shape(), k.shape());
        let native = options.softcap.is_none() && qs.num_dims() == 4 && q.dtype() == DType::F32;
        let (Some(qd), Some(kd), Some(vd)) = (f32_elements(&q), f32_elements(&k), f32_elements(&v))
        else {
            return reference::attention::<Self>(q, k, v, options);
        };
        if !native {
            return reference::attention::<Self>(q, k, v, options);
        }
        let dims = AttnDims::new(&qs, &ks);
        let out = attention_ggml(&qd, &kd, &vd, &dims, &options);
        FlexTensor::from_data(TensorData::new(out, qs))
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

    fn q4_1_matmul(
        x: FloatTensor<Self>,
        words: IntTensor<Self>,
        scales: FloatTensor<Self>,
        mins: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        match Operands::new(&x, &words, &scales) {
            Some(mut ops) if mins.dtype() == DType::F32 && mins.shape() == scales.shape() => {
                ops.mins = Some(mins.to_contiguous());
                ops.run(Format::Q4_1)
            }
            _ => reference::q4_1_matmul::<Self>(x, words, scales, mins),
        }
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

/// A contiguous f32 matrix's data and `[rows, cols]`.
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
    (fn $name:ident = $imp:ident($($arg:ident: $ty:ty),*) $(-> $ret:ty)?) => {
        fn $name($($arg: $ty),*) $(-> $ret)? {
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

/// GCC's `_mm512_reduce_add_ps`: halves (8 + 8), quarters (4 + 4), then (0+2)+(1+3).
#[inline(always)]
fn reduce_add16(v: &[f32; 16]) -> f32 {
    let t3: [f32; 8] = std::array::from_fn(|i| v[8 + i] + v[i]);
    let t6: [f32; 4] = std::array::from_fn(|i| t3[4 + i] + t3[i]);
    (t6[0] + t6[2]) + (t6[1] + t6[3])
}

/// ggml's `ggml_vec_dot_f32` (AVX-512): four 16-lane accumulators over steps of 64 with FMA,
/// reduced pairwise (0+2, 1+3, then 0+1) and horizontally; the tail is summed serially.
/// `x(i)`/`y(i)` give the operands so that strided rows need no copy.
#[inline(always)]
fn vec_dot_f32(n: usize, x: impl Fn(usize) -> f32, y: impl Fn(usize) -> f32) -> f32 {
    let mut acc = [[0.0f32; 16]; 4];
    let np = n / 64 * 64;
    for i in (0..np).step_by(64) {
        for (j, lanes) in acc.iter_mut().enumerate() {
            for (l, a) in lanes.iter_mut().enumerate() {
                let idx = i + 16 * j + l;
                *a = x(idx).mul_add(y(idx), *a);
            }
        }
    }
    let mut r = [0.0f32; 16];
    for l in 0..16 {
        r[l] = (acc[0][l] + acc[2][l]) + (acc[1][l] + acc[3][l]);
    }
    let mut sum = reduce_add16(&r);
    for i in np..n {
        sum = x(i).mul_add(y(i), sum);
    }
    sum
}

struct AttnDims {
    b: usize,
    h: usize,
    tq: usize,
    d: usize,
    h_kv: usize,
    tk: usize,
}

impl AttnDims {
    /// From the shapes of `q[b, h, tq, d]` and `k[b, h_kv, tk, d]`.
    fn new(q: &burn::tensor::Shape, k: &burn::tensor::Shape) -> Self {
        AttnDims {
            b: q[0],
            h: q[1],
            tq: q[2],
            d: q[3],
            h_kv: k[1],
            tk: k[2],
        }
    }
}

/// llama.cpp's attention without flash attention, op for op: `kq = K·q` (vec_dot_f32), softmax
/// with the scale and causal mask over the KV length padded to 256 (ggml_soft_max: vector expf,
/// 16-wide chunk sums added in f64, then multiply by `(float)(1/sum)`), then `kqv = Vᵀ·p` —
/// vec_dot_f32 for one query row, llamafile's tinyBLAS (one 16-lane FMA accumulator, then a
/// horizontal sum) for several. Query heads `i` read K/V head `i / (h / h_kv)`.
fn attention_ggml(q: &[f32], k: &[f32], v: &[f32], s: &AttnDims, o: &AttentionOptions) -> Vec<f32> {
    let AttnDims {
        b,
        h,
        tq,
        d,
        h_kv,
        tk,
    } = *s;
    let group = h / h_kv;
    let mask = reference::causal_mask(tq, tk, o);
    let mut out = vec![0.0f32; b * h * tq * d];
    out.par_chunks_mut(tq * d)
        .enumerate()
        .for_each(|(bh, out)| {
            let (bi, hi) = (bh / h, bh % h);
            let kv = (bi * h_kv + hi / group) * tk * d;
            let (kh, vh) = (&k[kv..kv + tk * d], &v[kv..kv + tk * d]);
            let qh = &q[bh * tq * d..(bh + 1) * tq * d];
            attend_head(qh, kh, vh, &mask, out, [tq, tk, d], o.scale);
        });
    out
}

/// The two inner loops of `attend_head_impl` that decide its speed, in a portable form and, on
/// x86-64, an AVX-512 one (sixteen 16-lane accumulators fit AVX-512's 32 registers; the portable
/// form compiled for AVX-512 still keeps them on the stack). Both give the same bits.
trait HeadLoops {
    /// `vec_dot_f32(d, K[j], q)` for the keys `j0..j0 + 16` of a transposed `kt[d][stride]`.
    fn scores16(kt: &[f32], stride: usize, j0: usize, q: &[f32]) -> [f32; 16];
    /// tinyBLAS's `out[c] = Σ_j V[j][c] · p[j]` over the keys `lo..end`.
    fn weighted_sum(v: &[f32], p: &[f32], lo: usize, end: usize, d: usize, out: &mut [f32]);
}

struct Portable;

impl HeadLoops for Portable {
    #[inline(always)]
    fn scores16(kt: &[f32], stride: usize, j0: usize, q: &[f32]) -> [f32; 16] {
        vec_dot_f32_16keys(kt, stride, j0, q)
    }
    #[inline(always)]
    fn weighted_sum(v: &[f32], p: &[f32], lo: usize, end: usize, d: usize, out: &mut [f32]) {
        weighted_sum_rows(v, p, lo, end, d, out)
    }
}

/// One query head against its K/V head, with the fastest loops this CPU has.
fn attend_head(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    mask: &[bool],
    out: &mut [f32],
    dims: [usize; 3],
    scale: f32,
) {
    #[cfg(target_arch = "x86_64")]
    {
        if attn512::available() {
            // SAFETY: the CPU has the features `attn512::attend_head` is compiled for.
            return unsafe { attn512::attend_head(q, k, v, mask, out, dims, scale) };
        }
        attend_head_fma(q, k, v, mask, out, dims, scale)
    }
    #[cfg(not(target_arch = "x86_64"))]
    attend_head_impl::<Portable>(q, k, v, mask, out, dims, scale)
}

with_fma!(fn attend_head_fma = attend_head_portable(q: &[f32], k: &[f32], v: &[f32], mask: &[bool], out: &mut [f32], dims: [usize; 3], scale: f32));

#[inline(always)]
fn attend_head_portable(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    mask: &[bool],
    out: &mut [f32],
    dims: [usize; 3],
    scale: f32,
) {
    attend_head_impl::<Portable>(q, k, v, mask, out, dims, scale)
}

#[cfg(target_arch = "x86_64")]
mod attn512 {
    use std::arch::x86_64::*;

    use super::{HeadLoops, attend_head_impl, weighted_sum_tail_columns};

    pub(super) fn available() -> bool {
        is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("fma")
    }

    struct Avx512;

    impl HeadLoops for Avx512 {
        #[inline(always)]
        fn scores16(kt: &[f32], stride: usize, j0: usize, q: &[f32]) -> [f32; 16] {
            // SAFETY: only reached through `attend_head` below, which the caller runs after
            // checking `available()`.
            unsafe { scores16(kt, stride, j0, q) }
        }
        #[inline(always)]
        fn weighted_sum(v: &[f32], p: &[f32], lo: usize, end: usize, d: usize, out: &mut [f32]) {
            // SAFETY: as above.
            unsafe { weighted_sum(v, p, lo, end, d, out) }
        }
    }

    #[target_feature(enable = "avx512f,avx2,fma")]
    pub(super) fn attend_head(
        q: &[f32],
        k: &[f32],
        v: &[f32],
        mask: &[bool],
        out: &mut [f32],
        dims: [usize; 3],
        scale: f32,
    ) {
        attend_head_impl::<Avx512>(q, k, v, mask, out, dims, scale)
    }

    /// `vec_dot_f32_16keys` (see there for the order of operations), one key per lane.
    #[target_feature(enable = "avx512f,avx2,fma")]
    #[inline]
    fn scores16(kt: &[f32], stride: usize, j0: usize, q: &[f32]) -> [f32; 16] {
        let d = q.len();
        let np = d / 64 * 64;
        assert!(j0 + 16 <= stride && kt.len() >= d * stride);
        // SAFETY: every load reads kt[c * stride + j0..][..16] with c < d (asserted in bounds)
        // and q[c] with c < d.
        unsafe {
            let keys = kt.as_ptr().add(j0);
            let fma = |c: usize, acc: __m512| {
                _mm512_fmadd_ps(
                    _mm512_loadu_ps(keys.add(c * stride)),
                    _mm512_set1_ps(*q.get_unchecked(c)),
                    acc,
                )
            };
            let mut t3 = [_mm512_setzero_ps(); 8];
            for (i, t) in t3.iter_mut().enumerate() {
                let mut r = [_mm512_setzero_ps(); 2];
                for (half, rl) in r.iter_mut().enumerate() {
                    let l = 8 * (1 - half) + i;
                    let mut acc = [_mm512_setzero_ps(); 4];
                    for c0 in (0..np).step_by(64) {
                        for (rr, a) in acc.iter_mut().enumerate() {
                            *a = fma(c0 + 16 * rr + l, *a);
                        }
                    }
                    *rl =
                        _mm512_add_ps(_mm512_add_ps(acc[0], acc[2]), _mm512_add_ps(acc[1], acc[3]));
                }
                *t = _mm512_add_ps(r[0], r[1]);
            }
            let t6: [__m512; 4] = std::array::from_fn(|i| _mm512_add_ps(t3[4 + i], t3[i]));
            let mut sum = _mm512_add_ps(_mm512_add_ps(t6[0], t6[2]), _mm512_add_ps(t6[1], t6[3]));
            for c in np..d {
                sum = fma(c, sum);
            }
            let mut keys_out = [0.0f32; 16];
            _mm512_storeu_ps(keys_out.as_mut_ptr(), sum);
            keys_out
        }
    }

    /// `weighted_sum_rows` (see there for the order of operations), sixteen columns per register.
    #[target_feature(enable = "avx512f,avx2,fma")]
    #[inline]
    fn weighted_sum(v: &[f32], p: &[f32], lo: usize, end: usize, d: usize, out: &mut [f32]) {
        assert!(lo.is_multiple_of(16) && lo <= end && end * d <= v.len() && end <= p.len());
        assert_eq!(out.len(), d);
        let d16 = d / 16 * 16;
        let full = lo + (end - lo) / 16 * 16;
        // SAFETY: rows j < end (asserted), columns c0..c0 + 16 <= d16 <= d.
        unsafe {
            let add_key = |j: usize, c0: usize, acc: __m512| {
                _mm512_fmadd_ps(
                    _mm512_loadu_ps(v.as_ptr().add(j * d + c0)),
                    _mm512_set1_ps(*p.get_unchecked(j)),
                    acc,
                )
            };
            for c0 in (0..d16).step_by(16) {
                let mut acc = [_mm512_setzero_ps(); 16];
                for j0 in (lo..full).step_by(16) {
                    for (l, a) in acc.iter_mut().enumerate() {
                        *a = add_key(j0 + l, c0, *a);
                    }
                }
                // The last, partial group of keys: a branch per lane keeps the lane index
                // constant (an indexed store would put all 16 accumulators in memory).
                for (l, a) in acc.iter_mut().enumerate() {
                    if full + l < end {
                        *a = add_key(full + l, c0, *a);
                    }
                }
                let t3: [__m512; 8] = std::array::from_fn(|i| _mm512_add_ps(acc[8 + i], acc[i]));
                let t6: [__m512; 4] = std::array::from_fn(|i| _mm512_add_ps(t3[4 + i], t3[i]));
                let sum = _mm512_add_ps(_mm512_add_ps(t6[0], t6[2]), _mm512_add_ps(t6[1], t6[3]));
                _mm512_storeu_ps(out.as_mut_ptr().add(c0), sum);
            }
        }
        weighted_sum_tail_columns(v, p, lo, end, d, out);
    }
}

/// One query head against its K/V head (see `attention_ggml`).
///
/// The `V·p` products are accumulated for all output columns at once (key-major, so V is read
/// row by row), each column keeping its own lane accumulators in ggml's order. Keys whose
/// probability is exactly 0 (masked: in the future, outside the window, or llama.cpp's padding
/// up to 256) only ever add `v·0 = ±0` to a lane, which leaves it unchanged (a lane is never -0:
/// it starts at +0 and `+0 + -0 = +0`), and their softmax chunks add 0 to the sum; so the loops
/// run over the 64-aligned span of visible keys only.
#[inline(always)]
fn attend_head_impl<L: HeadLoops>(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    mask: &[bool],
    out: &mut [f32],
    [tq, tk, d]: [usize; 3],
    scale: f32,
) {
    let n_pad = tk.div_ceil(64) * 64;
    let mut p = vec![0.0f32; n_pad];
    // Decode's lane accumulators, `[lane][column]`: vec_dot_f32's 64 lanes.
    let mut acc = vec![0.0f32; if tq == 1 { 64 * d } else { 0 }];
    // For several query rows, K transposed once (`[d][tk16]`, zero-padded to 16 keys) lets the
    // scores of 16 keys be computed together, one key per lane.
    let tk16 = tk.div_ceil(16) * 16;
    let kt = (tq >= 4).then(|| {
        let mut kt = vec![0.0f32; d * tk16];
        for (j, row) in k.chunks_exact(d).enumerate() {
            for (c, &x) in row.iter().enumerate() {
                kt[c * tk16 + j] = x;
            }
        }
        kt
    });
    for i in 0..tq {
        let qrow = &q[i * d..(i + 1) * d];
        let mrow = &mask[i * tk..(i + 1) * tk];
        // The 64-aligned span holding every visible key (all of it if none is visible).
        let (lo, hi) = match (
            mrow.iter().position(|&m| !m),
            mrow.iter().rposition(|&m| !m),
        ) {
            (Some(first), Some(last)) => (first / 64 * 64, (last / 64 + 1) * 64),
            _ => (0, n_pad),
        };
        // Scores, scaled and masked, as ggml_soft_max sees its input row.
        let visible = |j: usize| j < tk && !mrow[j];
        match &kt {
            Some(kt) => {
                for j0 in (lo..hi.min(tk16)).step_by(16) {
                    let dots = L::scores16(kt, tk16, j0, qrow);
                    for (l, dot) in dots.into_iter().enumerate() {
                        let j = j0 + l;
                        p[j] = if visible(j) {
                            dot * scale
                        } else {
                            f32::NEG_INFINITY
                        };
                    }
                }
                p[tk16.clamp(lo, hi)..hi].fill(f32::NEG_INFINITY);
            }
            None => {
                for (j, pj) in p.iter_mut().enumerate().take(hi).skip(lo) {
                    *pj = if visible(j) {
                        vec_dot_f32(d, |c| k[j * d + c], |c| qrow[c]) * scale
                    } else {
                        f32::NEG_INFINITY
                    };
                }
            }
        }
        let max = p[lo..hi].iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
        let mut sum = 0.0f64;
        for chunk in p[lo..hi].chunks_exact_mut(16) {
            for e in chunk.iter_mut() {
                *e = ggml_expf(*e - max);
            }
            sum += reduce_add16((&*chunk).try_into().expect("16 lanes")) as f64;
        }
        let inv = (1.0 / sum) as f32;
        p[lo..hi].iter_mut().for_each(|e| *e *= inv);
        let o = &mut out[i * d..(i + 1) * d];
        if tq > 1 {
            L::weighted_sum(v, &p, lo, hi.min(tk), d, o);
        } else {
            acc.fill(0.0);
            for (j, &pj) in p.iter().enumerate().take(hi.min(tk)).skip(lo) {
                let lane = &mut acc[(j % 64) * d..(j % 64 + 1) * d];
                for (a, &vj) in lane.iter_mut().zip(&v[j * d..(j + 1) * d]) {
                    *a = vj.mul_add(pj, *a);
                }
            }
            let lane = |l: usize| &acc[l * d..(l + 1) * d];
            // vec_dot_f32's reduction: r[l] = (L[l] + L[32+l]) + (L[16+l] + L[48+l]), then
            // reduce_add16(r); column by column, vectorized over columns.
            let mut r = vec![0.0f32; 16 * d];
            for l in 0..16 {
                let (a, b, c, e) = (lane(l), lane(32 + l), lane(16 + l), lane(48 + l));
                for (x, rv) in r[l * d..(l + 1) * d].iter_mut().enumerate() {
                    *rv = (a[x] + b[x]) + (c[x] + e[x]);
                }
            }
            reduce_add16_columns(&r, d, o);
        }
    }
}

/// `vec_dot_f32(d, K[j], q)` for the 16 keys `j0..j0 + 16` of a transposed `kt[d][stride]`, each
/// key in its own lane with exactly `vec_dot_f32`'s operations (vectorized over keys).
///
/// `vec_dot_f32`'s accumulator lane `l` of register `r` only ever sees the columns
/// `c ≡ 16r + l (mod 64)`, so the 64 chains are independent: they are run one final lane `l` at a
/// time (its four registers' chains, then `(r0 + r2) + (r1 + r3)`), and folded straight into the
/// first level of the horizontal sum. That keeps about a dozen 16-key vectors live instead of 64,
/// which the compiler could only keep on the stack.
#[inline(always)]
fn vec_dot_f32_16keys(kt: &[f32], stride: usize, j0: usize, q: &[f32]) -> [f32; 16] {
    type Keys = [f32; 16];
    let d = q.len();
    let np = d / 64 * 64;
    let key_lanes = |c: usize| -> &Keys {
        (&kt[c * stride + j0..c * stride + j0 + 16])
            .try_into()
            .expect("16 keys")
    };
    let add = |a: &Keys, b: &Keys| -> Keys { std::array::from_fn(|x| a[x] + b[x]) };
    // GCC's reduce_add16 over l: (r[8 + i] + r[i]), then quarters, then (0+2) + (1+3), where
    // r[l] = (acc0[l] + acc2[l]) + (acc1[l] + acc3[l]) and acc_r[l] sums the columns 16r + l + 64i.
    // (Plain loops: a closure this size would not be inlined, and would then be compiled without
    // the caller's FMA.)
    let mut t3 = [[0.0f32; 16]; 8];
    for (i, t) in t3.iter_mut().enumerate() {
        let mut r = [[0.0f32; 16]; 2];
        for (half, rl) in r.iter_mut().enumerate() {
            let l = 8 * (1 - half) + i;
            let mut acc = [[0.0f32; 16]; 4];
            for c0 in (0..np).step_by(64) {
                for (r, a) in acc.iter_mut().enumerate() {
                    let c = c0 + 16 * r + l;
                    let (kc, qc) = (key_lanes(c), q[c]);
                    for x in 0..16 {
                        a[x] = kc[x].mul_add(qc, a[x]);
                    }
                }
            }
            *rl = add(&add(&acc[0], &acc[2]), &add(&acc[1], &acc[3]));
        }
        *t = add(&r[0], &r[1]);
    }
    let t6: [Keys; 4] = std::array::from_fn(|i| add(&t3[4 + i], &t3[i]));
    let mut sum = add(&add(&t6[0], &t6[2]), &add(&t6[1], &t6[3]));
    for c in np..d {
        let kc = key_lanes(c);
        for x in 0..16 {
            sum[x] = kc[x].mul_add(q[c], sum[x]);
        }
    }
    sum
}

/// tinyBLAS's `Σ_j V[j][c] · p[j]` for the keys `lo..end` (`lo` a multiple of 16) and every
/// column `c`: key `j` goes to lane `j % 16` of column `c`'s accumulator, in key order, and the
/// 16 lanes are summed as `reduce_add16`. Sixteen columns at a time, so that the 16 lanes × 16
/// columns stay in registers while V is read row by row.
#[inline(always)]
fn weighted_sum_rows(v: &[f32], p: &[f32], lo: usize, end: usize, d: usize, out: &mut [f32]) {
    type Cols = [f32; 16];
    let d16 = d / 16 * 16;
    for c0 in (0..d16).step_by(16) {
        let mut acc = [[0.0f32; 16]; 16];
        // Keys j0..j0 + 16 go to lanes 0..16 (j0 is a multiple of 16); the lane index is a
        // constant of the unrolled loop, so each lane's accumulator is a register.
        let full = lo + (end - lo) / 16 * 16;
        for j0 in (lo..full).step_by(16) {
            for (l, a) in acc.iter_mut().enumerate() {
                let j = j0 + l;
                let vj: &Cols = (&v[j * d + c0..j * d + c0 + 16])
                    .try_into()
                    .expect("16 cols");
                for x in 0..16 {
                    a[x] = vj[x].mul_add(p[j], a[x]);
                }
            }
        }
        for (l, a) in acc.iter_mut().enumerate().take(end - full) {
            let j = full + l;
            for x in 0..16 {
                a[x] = v[j * d + c0 + x].mul_add(p[j], a[x]);
            }
        }
        let add = |a: &Cols, b: &Cols| -> Cols { std::array::from_fn(|x| a[x] + b[x]) };
        let t3: [Cols; 8] = std::array::from_fn(|i| add(&acc[8 + i], &acc[i]));
        let t6: [Cols; 4] = std::array::from_fn(|i| add(&t3[4 + i], &t3[i]));
        out[c0..c0 + 16].copy_from_slice(&add(&add(&t6[0], &t6[2]), &add(&t6[1], &t6[3])));
    }
    weighted_sum_tail_columns(v, p, lo, end, d, out);
}

/// `weighted_sum_rows` for the columns past the last multiple of 16, one column at a time.
#[inline(always)]
fn weighted_sum_tail_columns(
    v: &[f32],
    p: &[f32],
    lo: usize,
    end: usize,
    d: usize,
    out: &mut [f32],
) {
    for (c, o) in out.iter_mut().enumerate().skip(d / 16 * 16) {
        let mut acc = [0.0f32; 16];
        for j in lo..end {
            acc[j % 16] = v[j * d + c].mul_add(p[j], acc[j % 16]);
        }
        *o = reduce_add16(&acc);
    }
}

/// `reduce_add16` of each column of `lanes[16][d]` into `out[d]`, vectorized over columns.
#[inline(always)]
fn reduce_add16_columns(lanes: &[f32], d: usize, out: &mut [f32]) {
    let l = |i: usize| &lanes[i * d..(i + 1) * d];
    for (c, o) in out.iter_mut().enumerate() {
        let t3: [f32; 8] = std::array::from_fn(|i| l(8 + i)[c] + l(i)[c]);
        let t6: [f32; 4] = std::array::from_fn(|i| t3[4 + i] + t3[i]);
        *o = (t6[0] + t6[2]) + (t6[1] + t6[3]);
    }
}

with_fma!(fn rope_head = rope_head_impl(head: &mut [f32], cos: &[f32], sin: &[f32], dims: [usize; 2], layout: RopeLayout));

/// Rotate every row (token) of one head with that token's cos/sin row.
#[inline(always)]
fn rope_head_impl(
    head: &mut [f32],
    cos: &[f32],
    sin: &[f32],
    [d, half]: [usize; 2],
    layout: RopeLayout,
) {
    for (ti, row) in head.chunks_mut(d).enumerate() {
        let (cs, ss) = (
            &cos[ti * half..(ti + 1) * half],
            &sin[ti * half..(ti + 1) * half],
        );
        for i in 0..half {
            let (i0, i1) = match layout {
                RopeLayout::Interleaved => (2 * i, 2 * i + 1),
                RopeLayout::Neox => (i, i + half),
            };
            let (x0, x1, c, s) = (row[i0], row[i1], cs[i], ss[i]);
            // GCC contracts ggml's `x0*cos - x1*sin` / `x0*sin + x1*cos` into these FMAs
            // (read off the disassembly of llama.cpp's x86-64 build).
            row[i0] = x0.mul_add(c, -(x1 * s));
            row[i1] = x0.mul_add(s, x1 * c);
        }
    }
}

/// ggml's vectorized `expf` (`ggml_v_expf`, AVX-512 flavour) in scalar form: a degree-5
/// polynomial on the reduced argument, scaled by `2^n` in one rounding. Used where llama.cpp
/// uses it (SiLU, softmax) so that our activations round exactly like its.
#[inline(always)]
fn ggml_expf(x: f32) -> f32 {
    let (j, z) = expf_parts(x);
    let n = z - EXPF_ROUND;
    if n.abs() > 192.0 {
        return if n <= 0.0 { 0.0 } else { f32::INFINITY };
    }
    // `_mm512_scalef_ps(j, n)`: j · 2^n, exact in f64 for |n| <= 192, then one rounding.
    let pow2 = f64::from_bits(((n as i64 + 1023) as u64) << 52);
    (j as f64 * pow2) as f32
}

/// 0x1.8p23: adding it to a float below 2^22 rounds to an integer (in the low mantissa bits).
const EXPF_ROUND: f32 = 12_582_912.0;

/// The shared part of ggml's vector `expf`: `(j, z)` with `exp(x) = j · 2^n`, `j` ggml's degree-5
/// polynomial of the reduced argument `x - n ln 2`, and `z = x / ln 2 + EXPF_ROUND`, whose value
/// is `n + EXPF_ROUND` and whose low mantissa bits hold `n`. Callers differ in how they scale.
#[inline(always)]
fn expf_parts(x: f32) -> (f32, f32) {
    let c = f32::from_bits;
    let z = x.mul_add(c(0x3fb8_aa3b), EXPF_ROUND); // x / ln 2 + r
    let n = z - EXPF_ROUND;
    let b = (-n).mul_add(c(0x35bf_be8e), (-n).mul_add(c(0x3f31_7200), x)); // x - n ln 2, in two parts
    let u = b * b;
    let j = c(0x3c07_2010)
        .mul_add(b, c(0x3d2b_9f17))
        .mul_add(u, c(0x3e2a_af33).mul_add(b, c(0x3eff_fedb)));
    let j = j.mul_add(u, c(0x3f7f_fff6).mul_add(b, 1.0));
    (j, z)
}

with_fma!(fn swiglu_row = swiglu_row_impl(g: &[f32], u: &[f32], y: &mut [f32]));

/// ggml's `swiglu`: `silu(g) * u` with `silu(x) = x / (1 + expf(-x))`, 16 lanes at a time with the
/// vector `expf`, the tail (row length not a multiple of 16) with libm's `expf`.
#[inline(always)]
fn swiglu_row_impl(g: &[f32], u: &[f32], y: &mut [f32]) {
    let vector = g.len() / 16 * 16;
    for i in 0..g.len() {
        let x = g[i];
        let e = if i < vector {
            ggml_expf(0.0 - x)
        } else {
            (-x).exp()
        };
        y[i] = x / (1.0 + e) * u[i];
    }
}

/// ggml's `rms_norm` (+ the weight multiply it fuses): the sum of squares in f64, then
/// `y = (x * (1 / sqrtf(mean + eps))) * w` in f32.
fn rms_norm_row(x: &[f32], w: &[f32], eps: f32, y: &mut [f32]) {
    let sum: f64 = x.iter().map(|&v| (v * v) as f64).sum();
    let mean = (sum / x.len() as f64) as f32;
    let scale = 1.0 / (mean + eps).sqrt();
    for ((y, &x), &w) in y.iter_mut().zip(x).zip(w) {
        *y = x * scale * w;
    }
}

/// An activation row quantized to 8-bit blocks (ggml's Q8_0 / Q8_1).
struct QuantRow {
    quants: Vec<i8>,
    scales: Vec<f32>,
    /// Q8_1's `f16(d * Σq)` per block: what Q4_1's offsets multiply.
    sums: Vec<f32>,
}

with_fma!(fn quantize_row = quantize_row_impl(x: &[f32]) -> QuantRow);

/// ggml's `quantize_row_q8_0` / `quantize_row_q8_1` (x86 path): `d = amax / 127` stored as
/// f16, `q = round_half_even(x * 127 / amax)`, and for Q8_1 `s = f16(d * Σq)` with the unrounded d.
#[inline(always)]
fn quantize_row_impl(x: &[f32]) -> QuantRow {
    let mut quants = Vec::with_capacity(x.len());
    let mut scales = Vec::with_capacity(x.len() / BLOCK);
    let mut sums = Vec::with_capacity(x.len() / BLOCK);
    for block in x.chunks_exact(BLOCK) {
        let amax = block.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        scales.push(f16::from_f32(d).to_f32());
        let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
        let start = quants.len();
        quants.extend(block.iter().map(|v| (v * id).round_ties_even() as i8));
        let sum: i32 = quants[start..].iter().map(|&q| q as i32).sum();
        sums.push(f16::from_f32(d * sum as f32).to_f32());
    }
    QuantRow {
        quants,
        scales,
        sums,
    }
}

// The dot products reproduce ggml's x86 `ggml_vec_dot_*` to the bit: per block, eight lanes
// each hold an exact integer sum of 4 products (elements 4l..4l+4), converted to f32 and
// accumulated with one fused multiply-add by `d_w * d_x`; the 8 lanes are summed at the end in
// ggml's `hsum_float_8` order. The scalar functions are the specification; the AVX2 ones compute
// the same bits faster and are used when the CPU has AVX2 and FMA.

#[cfg(target_arch = "x86_64")]
mod grad;
mod linear;
mod loss;
mod optim;
mod vnni;

/// Which weight block format a dot product reads.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Format {
    Q8_0,
    Q4_0,
    Q4_1,
}

impl Format {
    /// Bytes of quants per block in the packed layout.
    fn block_bytes(self) -> usize {
        match self {
            Format::Q8_0 => BLOCK,
            Format::Q4_0 | Format::Q4_1 => BLOCK / 2,
        }
    }
}

/// ggml's `hsum_float_8`: (lanes 0..4 + lanes 4..8), then pairs (0+2, 1+3), then the two.
fn hsum8(acc: [f32; 8]) -> f32 {
    let r: [f32; 4] = std::array::from_fn(|i| acc[i + 4] + acc[i]);
    (r[0] + r[2]) + (r[1] + r[3])
}

/// Weight quant `i` (0..32) of a block, as the signed value ggml multiplies.
fn weight_quant(format: Format, block: &[u8], i: usize) -> i32 {
    match format {
        Format::Q8_0 => block[i] as i8 as i32,
        Format::Q4_0 | Format::Q4_1 => {
            let byte = block[i % 16];
            let nibble = if i < 16 { byte & 0x0F } else { byte >> 4 } as i32;
            if format == Format::Q4_0 {
                nibble - 8
            } else {
                nibble
            }
        }
    }
}

/// The specification: one output element, scalar.
fn dot_scalar(format: Format, x: &QuantRow, w: &[u8], w_scales: &[f32], w_mins: &[f32]) -> f32 {
    let bb = format.block_bytes();
    let mut acc = [0.0f32; 8];
    let mut mins = 0.0f32;
    for (b, (xq, wq)) in x
        .quants
        .chunks_exact(BLOCK)
        .zip(w.chunks_exact(bb))
        .enumerate()
    {
        let d = w_scales[b] * x.scales[b];
        for (l, lane) in acc.iter_mut().enumerate() {
            let sumi: i32 = (4 * l..4 * l + 4)
                .map(|i| weight_quant(format, wq, i) * xq[i] as i32)
                .sum();
            *lane = d.mul_add(sumi as f32, *lane);
        }
        if format == Format::Q4_1 {
            mins = w_mins[b].mul_add(x.sums[b], mins);
        }
    }
    hsum8(acc) + mins
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{BLOCK, Format, QuantRow};

    /// 32 weight quants of a block as i8 (Q4 nibbles unpacked: low nibbles then high nibbles).
    #[target_feature(enable = "avx2")]
    #[inline]
    unsafe fn load_weights(format: Format, block: &[u8]) -> __m256i {
        unsafe {
            match format {
                Format::Q8_0 => _mm256_loadu_si256(block.as_ptr() as *const __m256i),
                Format::Q4_0 | Format::Q4_1 => {
                    let packed = _mm_loadu_si128(block.as_ptr() as *const __m128i);
                    let both = _mm256_set_m128i(_mm_srli_epi16(packed, 4), packed);
                    let nibbles = _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
                    if format == Format::Q4_0 {
                        _mm256_sub_epi8(nibbles, _mm256_set1_epi8(8))
                    } else {
                        nibbles
                    }
                }
            }
        }
    }

    /// Eight i32 lanes, lane l = Σ w[i] x[i] over i in 4l..4l+4 (ggml's mul_sum_i8_pairs).
    #[target_feature(enable = "avx2")]
    #[inline]
    unsafe fn lane_sums(format: Format, w: __m256i, x: __m256i) -> __m256i {
        let ones = _mm256_set1_epi16(1);
        if format == Format::Q4_1 {
            // Unsigned weights times signed activations directly.
            return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), ones);
        }
        // maddubs needs an unsigned operand: |w| times x with w's sign moved onto x.
        let aw = _mm256_sign_epi8(w, w);
        let sx = _mm256_sign_epi8(x, w);
        _mm256_madd_epi16(_mm256_maddubs_epi16(aw, sx), ones)
    }

    /// Four output elements — four weight rows against one activation row — with independent
    /// accumulators, so one chain's FMA latency does not stall the others. Each is bit-identical
    /// to `dot_scalar`.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn dot4(
        format: Format,
        x: &QuantRow,
        w: [&[u8]; 4],
        s: [&[f32]; 4],
        m: [&[f32]; 4],
    ) -> [f32; 4] {
        // One specialized loop per format: no per-block branch on it.
        unsafe {
            match format {
                Format::Q8_0 => dot4_for::<0>(x, w, s, m),
                Format::Q4_0 => dot4_for::<1>(x, w, s, m),
                Format::Q4_1 => dot4_for::<2>(x, w, s, m),
            }
        }
    }

    const FORMATS: [Format; 3] = [Format::Q8_0, Format::Q4_0, Format::Q4_1];

    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn dot4_for<const F: usize>(
        x: &QuantRow,
        w: [&[u8]; 4],
        s: [&[f32]; 4],
        m: [&[f32]; 4],
    ) -> [f32; 4] {
        let format = FORMATS[F];
        let bb = format.block_bytes();
        let blocks = x.scales.len();
        // The caller passes whole rows: `blocks` blocks of weights, scales (and mins for Q4_1).
        for r in 0..4 {
            assert!(w[r].len() >= blocks * bb && s[r].len() >= blocks);
            assert!(format != Format::Q4_1 || m[r].len() >= blocks);
        }
        unsafe {
            let mut acc = [_mm256_setzero_ps(); 4];
            let mut mins = [0.0f32; 4];
            for b in 0..blocks {
                let xq = _mm256_loadu_si256(x.quants.as_ptr().add(b * BLOCK) as *const __m256i);
                let xd = *x.scales.get_unchecked(b);
                for r in 0..4 {
                    let d = _mm256_set1_ps(*s[r].get_unchecked(b) * xd);
                    let wq = load_weights(format, w[r].get_unchecked(b * bb..));
                    let q = _mm256_cvtepi32_ps(lane_sums(format, wq, xq));
                    acc[r] = _mm256_fmadd_ps(d, q, acc[r]);
                    if format == Format::Q4_1 {
                        mins[r] = m[r]
                            .get_unchecked(b)
                            .mul_add(*x.sums.get_unchecked(b), mins[r]);
                    }
                }
            }
            std::array::from_fn(|r| {
                let mut lanes = [0.0f32; 8];
                _mm256_storeu_ps(lanes.as_mut_ptr(), acc[r]);
                super::hsum8(lanes) + mins[r]
            })
        }
    }
}

/// Four output elements' dot products (see `avx2::dot4`).
type Dot4Fn = fn(Format, &QuantRow, [&[u8]; 4], [&[f32]; 4], [&[f32]; 4]) -> [f32; 4];

/// The fastest implementation this CPU has (chosen once per matmul, not per element).
fn dot4_impl() -> Dot4Fn {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
        // SAFETY: the CPU has the features `avx2::dot4` is compiled for; callers pass whole blocks.
        return |format, x, w, s, m| unsafe { avx2::dot4(format, x, w, s, m) };
    }
    |format, x, w, s, m| std::array::from_fn(|r| dot_scalar(format, x, w[r], s[r], m[r]))
}

/// Host views of the operands, when they are in the layout the native loops need.
struct Operands {
    /// Contiguous f32 activations (a view of the caller's buffer, not a copy).
    x: FlexTensor,
    m: usize,
    k: usize,
    n: usize,
    words: FlexTensor,
    scales: FlexTensor,
    mins: Option<FlexTensor>,
}

impl Operands {
    fn new(x: &FlexTensor, words: &FlexTensor, scales: &FlexTensor) -> Option<Self> {
        let (xs, ws, ss) = (x.shape(), words.shape(), scales.shape());
        if x.dtype() != DType::F32
            || scales.dtype() != DType::F32
            || xs.num_dims() != 2
            || ws.num_dims() != 2
        {
            return None;
        }
        let (m, k, n) = (xs[0], xs[1], ws[0]);
        if k % BLOCK != 0 || ss[0] != n || ss[1] != k / BLOCK {
            return None;
        }
        let x = x.to_contiguous();
        x.as_slice::<f32>()?;
        let words = words.to_contiguous();
        let scales = scales.to_contiguous();
        if !matches!(words.dtype(), DType::U32 | DType::I32) {
            return None;
        }
        Some(Operands {
            x,
            m,
            k,
            n,
            words,
            scales,
            mins: None,
        })
    }

    fn word_bytes(&self) -> &[u8] {
        match self.words.dtype() {
            DType::U32 => {
                bytemuck::cast_slice(self.words.as_slice::<u32>().expect("contiguous u32"))
            }
            _ => bytemuck::cast_slice(self.words.as_slice::<i32>().expect("contiguous i32")),
        }
    }

    fn run(self, format: Format) -> FlexTensor {
        let (m, k, n) = (self.m, self.k, self.n);
        let x = self.x.as_slice::<f32>().expect("checked in Operands::new");
        let bytes = self.word_bytes();
        let scales = self.scales.as_slice::<f32>().expect("contiguous f32");
        let mins = self
            .mins
            .as_ref()
            .map(|t| t.as_slice::<f32>().expect("contiguous f32"))
            .unwrap_or(&[]);
        #[cfg(target_arch = "x86_64")]
        if vnni::available() {
            let w = vnni::Weights {
                bytes,
                scales,
                mins,
                n,
            };
            let out = vnni::matmul(format, x, m, k, w);
            return FlexTensor::from_data(TensorData::new(out, [m, n]));
        }
        let rows: Vec<QuantRow> = x.par_chunks_exact(k).map(quantize_row).collect();
        let row_bytes = bytes.len() / n;
        let blocks = k / BLOCK;
        let dot4 = dot4_impl();
        let weight = |j: usize| {
            let mn = if mins.is_empty() {
                &[][..]
            } else {
                &mins[j * blocks..(j + 1) * blocks]
            };
            (
                &bytes[j * row_bytes..(j + 1) * row_bytes],
                &scales[j * blocks..(j + 1) * blocks],
                mn,
            )
        };
        // Output column j (weight row j) for every activation row, in parallel over groups of
        // columns (one column is too little work to hand to a thread), four columns per call.
        const COLS: usize = 16;
        let mut out_t = vec![0.0f32; n * m];
        let work = |(g, cols): (usize, &mut [f32])| {
            let ncols = cols.len() / m;
            for c0 in (0..ncols).step_by(4) {
                // Past the last column, repeat it (computed, not stored).
                let parts: [_; 4] =
                    std::array::from_fn(|r| weight(g * COLS + (c0 + r).min(ncols - 1)));
                let (w, s, mn) = (parts.map(|p| p.0), parts.map(|p| p.1), parts.map(|p| p.2));
                for (i, row) in rows.iter().enumerate() {
                    let y = dot4(format, row, w, s, mn);
                    for (r, &v) in y.iter().enumerate().take(ncols - c0) {
                        cols[(c0 + r) * m + i] = v;
                    }
                }
            }
        };
        // Even a decode step's small projections gain from both cores: measured, running them on
        // one thread to save the pool's wake-up made decode 35% slower.
        out_t.par_chunks_mut(m * COLS).enumerate().for_each(work);
        let out = if m == 1 {
            out_t
        } else {
            let mut out = vec![0.0f32; m * n];
            for j in 0..n {
                for i in 0..m {
                    out[i * n + j] = out_t[j * m + i];
                }
            }
            out
        };
        FlexTensor::from_data(TensorData::new(out, [m, n]))
    }
}

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

    /// The SIMD path must give the scalar specification's bits exactly.
    #[test]
    fn simd_dot_is_bit_identical_to_scalar() {
        let mut seed = 1u64;
        let mut next = move || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (seed >> 33) as u32
        };
        for format in [Format::Q8_0, Format::Q4_0, Format::Q4_1] {
            for blocks in [1usize, 3, 18, 48] {
                let k = blocks * BLOCK;
                let x: Vec<f32> = (0..k)
                    .map(|_| next() as f32 / u32::MAX as f32 * 4.0 - 2.0)
                    .collect();
                let row = quantize_row(&x);
                let w: Vec<u8> = (0..blocks * format.block_bytes())
                    .map(|_| next() as u8)
                    .collect();
                let s: Vec<f32> = (0..blocks)
                    .map(|_| next() as f32 / u32::MAX as f32 * 0.1)
                    .collect();
                let mn: Vec<f32> = (0..blocks)
                    .map(|_| next() as f32 / u32::MAX as f32 - 0.5)
                    .collect();
                let want = dot_scalar(format, &row, &w, &s, &mn);
                let got = dot4_impl()(format, &row, [&w; 4], [&s; 4], [&mn; 4]);
                assert!(
                    got.iter().all(|g| g.to_bits() == want.to_bits()),
                    "{got:?} vs {want}"
                );
            }
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

#[cfg(test)]
mod attention_tests {
    use super::*;

    /// The specification: the straightforward loops over the whole padded key range (strided
    /// reads of V), as first written from llama.cpp's ops.
    fn attend_head_spec(
        q: &[f32],
        k: &[f32],
        v: &[f32],
        mask: &[bool],
        out: &mut [f32],
        [tq, tk, d]: [usize; 3],
        scale: f32,
    ) {
        let n_pad = tk.div_ceil(64) * 64;
        let mut p = vec![0.0f32; n_pad];
        for i in 0..tq {
            let qrow = &q[i * d..(i + 1) * d];
            let mut max = f32::NEG_INFINITY;
            for (j, pj) in p.iter_mut().enumerate() {
                *pj = if j < tk && !mask[i * tk + j] {
                    vec_dot_f32(d, |c| k[j * d + c], |c| qrow[c]) * scale
                } else {
                    f32::NEG_INFINITY
                };
                max = max.max(*pj);
            }
            let mut sum = 0.0f64;
            for chunk in p.chunks_exact_mut(16) {
                for e in chunk.iter_mut() {
                    *e = ggml_expf(*e - max);
                }
                sum += reduce_add16((&*chunk).try_into().expect("16 lanes")) as f64;
            }
            let inv = (1.0 / sum) as f32;
            p.iter_mut().for_each(|e| *e *= inv);
            for (c, o) in out[i * d..(i + 1) * d].iter_mut().enumerate() {
                let vcol = |j: usize| if j < tk { v[j * d + c] } else { 0.0 };
                *o = if tq == 1 {
                    vec_dot_f32(n_pad, vcol, |j| p[j])
                } else {
                    let mut acc = [0.0f32; 16];
                    for l in (0..n_pad).step_by(16) {
                        for (lane, a) in acc.iter_mut().enumerate() {
                            *a = vcol(l + lane).mul_add(p[l + lane], *a);
                        }
                    }
                    reduce_add16(&acc)
                };
            }
        }
    }

    type AttendHead = fn(&[f32], &[f32], &[f32], &[bool], &mut [f32], [usize; 3], f32);

    /// The key-major, visible-span attention gives the specification's bits: decode and prefill,
    /// with and without a cache offset and a window, head widths that are and are not multiples
    /// of 16, key counts on both sides of the 64-key blocks.
    #[test]
    fn attention_is_bit_identical_to_spec() {
        let mut seed = 5u64;
        let mut next = move || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (seed >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
        };
        for d in [64usize, 24, 80, 128] {
            for (tq, past) in [
                (1usize, 0usize),
                (1, 70),
                (1, 130),
                (5, 0),
                (37, 0),
                (9, 120),
                (70, 3),
            ] {
                for window in [None, Some(50)] {
                    let tk = tq + past;
                    let q: Vec<f32> = (0..tq * d).map(|_| next() * 3.0).collect();
                    let k: Vec<f32> = (0..tk * d).map(|_| next() * 3.0).collect();
                    let v: Vec<f32> = (0..tk * d).map(|_| next()).collect();
                    let o = AttentionOptions {
                        scale: 1.0 / (d as f32).sqrt(),
                        q_offset: past,
                        window,
                        softcap: None,
                    };
                    let mask = reference::causal_mask(tq, tk, &o);
                    let mut want = vec![0.0f32; tq * d];
                    attend_head_spec(&q, &k, &v, &mask, &mut want, [tq, tk, d], o.scale);
                    // The build this CPU dispatches to, and the portable one.
                    let build: [(&str, AttendHead); 2] = [
                        ("dispatched", attend_head),
                        ("portable", attend_head_impl::<Portable>),
                    ];
                    for (name, attend) in build {
                        let mut got = vec![0.0f32; tq * d];
                        attend(&q, &k, &v, &mask, &mut got, [tq, tk, d], o.scale);
                        for (x, (g, w)) in got.iter().zip(&want).enumerate() {
                            assert_eq!(
                                g.to_bits(),
                                w.to_bits(),
                                "{name} d={d} tq={tq} past={past} window={window:?} [{x}]: {g} vs {w}"
                            );
                        }
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod expf_tests {
    use super::ggml_expf;

    /// The polynomial is accurate to a couple of ulp over the range activations take.
    #[test]
    fn ggml_expf_is_accurate() {
        for i in -8000..8000 {
            let x = i as f32 * 0.01;
            let want = (x as f64).exp();
            let got = ggml_expf(x) as f64;
            assert!(((got - want) / want).abs() < 4e-7, "x={x}: {got} vs {want}");
        }
        assert_eq!(ggml_expf(-200.0), 0.0);
        assert_eq!(ggml_expf(200.0), f32::INFINITY);
    }
}
