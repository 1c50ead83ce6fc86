//! Packed matmuls on weights in the blocks layout (`crate::packed`): Q5_0, Q5_1 and IQ4_NL with
//! 8-bit Q8_0/Q8_1 activation blocks, the K-quants and IQ4_XS with Q8_K activation
//! super-blocks, F16 with f16 and BF16 with bf16 activations — each output the bits llama.cpp's
//! x86 CPU backend computes.
//!
//! Which of llama.cpp's code paths computes an output decides its float summation order, so
//! each is reproduced ([`Form`]):
//! - `ggml_vec_dot_*` (arch/x86/quants.c, vec.cpp): eight f32 lanes, each the exact integer sum
//!   of 4-value groups (`lane = (i % 32) / 4`) scaled by one fused multiply-add per block, summed
//!   horizontally at the end; some types add a scalar or 4-lane term for their offsets;
//! - the repacked kernels (repack.cpp) llama.cpp moves Q4_0, Q4_K and IQ4_NL matmul weights into
//!   on AVX2 when the row count is a multiple of 8: one f32 accumulator per output, one fused
//!   multiply-add per block — per 256-value super-block in the one-row `gemv` kernel, per 64
//!   values in the 4-row `gemm` one (Q4_K), which takes the first `m - m % 4` rows;
//! - llamafile's tinyBLAS, which llama.cpp uses for several rows (`m ≥ 2`) of unrepacked IQ4_NL
//!   weights (and of F16/BF16 ones: `tinyblas.rs`, register-tiled): one vector accumulator per
//!   output, summed at the end;
//! - the tiled kernel (ggml-cpu/tiled) it uses for 8 rows or more of unrepacked K-quant and
//!   IQ4_XS weights: one accumulator per output, one fused multiply-add per super-block.
//!
//! `spec.rs` holds the specification of each path: scalar, in ggml's order of operations. This
//! file chooses the path of each output (`form`), dispatches to the fastest kernel this CPU has,
//! and runs the matmul.

use half::f16;
use rayon::prelude::*;
use toy_quant::f32_to_bf16;

use super::qmatmul::{QuantRow, quantize_row, transpose_columns};
use super::row_groups;
use super::{GgmlIsa, ggml_isa};
use crate::packed::{GgmlType, HostPackedView, RowLayout, deinterleave_rows, row_bytes, row_words};

mod spec;
use spec::*;
pub(super) use spec::{Q8K, dot_repacked_32, f16_at, quantize_q8_k, scales_q3_k};

/// Eight weight rows as an eight-row kernel reads them: apart (each row's GGUF bytes), or — for
/// Q4_K on the CPU backend — interleaved: the group's slice of `packed::interleave_q4k_x8`.
#[derive(Clone, Copy)]
pub(super) enum Rows8<'a> {
    Apart([&'a [u8]; 8]),
    Interleaved(&'a [u8]),
}

impl<'a> Rows8<'a> {
    /// Q4_K super-block `i0 + i` of row `c`, in the chunk that starts at super-block `i0` and
    /// holds `len` (the interleaved layout's chunks are `packed::Q4K_X8_CHUNK` long).
    #[inline(always)]
    pub(super) fn q4k_block(&self, c: usize, i0: usize, len: usize, i: usize) -> &'a [u8] {
        let (bytes, at) = match *self {
            Rows8::Apart(rows) => (rows[c], 144 * (i0 + i)),
            Rows8::Interleaved(group) => (group, 144 * (8 * i0 + c * len + i)),
        };
        &bytes[at..at + 144]
    }
}

/// Which of llama.cpp's code paths computes an output (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Form {
    VecDot,
    Gemv,
    Gemm,
    TinyBlas,
    Tiled,
}

/// Whether llama.cpp (x86, AVX2 or better) repacks a matmul weight of this type and row count:
/// Q4_0, Q4_K and IQ4_NL in either build, Q2_K in the AVX-512 build (`ggml_cpu_has_avx512()`).
pub(super) fn repacked(ty: GgmlType, rows: usize, repackable: bool) -> bool {
    repackable
        && rows.is_multiple_of(8)
        && (matches!(ty, GgmlType::Q4_0 | GgmlType::Q4K | GgmlType::IQ4NL)
            || (ty == GgmlType::Q2K && ggml_isa().avx512()))
}

/// The path llama.cpp takes for activation row `i` of `m`.
pub(super) fn form(ty: GgmlType, repacked: bool, i: usize, m: usize) -> Form {
    match ty {
        GgmlType::Q4K | GgmlType::Q2K if repacked && i < m - m % 4 => Form::Gemm,
        GgmlType::Q4K | GgmlType::Q2K | GgmlType::Q4_0 | GgmlType::IQ4NL if repacked => Form::Gemv,
        GgmlType::IQ4NL if m >= 2 => Form::TinyBlas,
        GgmlType::Q2K
        | GgmlType::Q3K
        | GgmlType::Q4K
        | GgmlType::Q5K
        | GgmlType::Q6K
        | GgmlType::IQ4XS
            if m >= 8 =>
        {
            Form::Tiled
        }
        _ => Form::VecDot,
    }
}

/// Four activation rows as Q8_K super-blocks, if all four are.
fn q8k_rows<'a>(x: [&'a ActRow; 4]) -> Option<[&'a [Q8K]; 4]> {
    match x {
        [
            ActRow::Q8K(a),
            ActRow::Q8K(b),
            ActRow::Q8K(c),
            ActRow::Q8K(d),
        ] => Some([a, b, c, d]),
        _ => None,
    }
}

/// One activation row in the form its weight type's dot product reads.
enum ActRow {
    Q8(QuantRow),
    Q8K(Vec<Q8K>),
    /// f16- or bf16-rounded values, as the GGUF bytes of that type.
    Half(Vec<u8>),
}

fn activation(ty: GgmlType, x: &[f32], form: Form) -> ActRow {
    match ty {
        GgmlType::Q5_0 | GgmlType::Q5_1 | GgmlType::IQ4NL | GgmlType::Q4_0 => {
            ActRow::Q8(quantize_row(x))
        }
        GgmlType::F16 => ActRow::Half(
            x.iter()
                .flat_map(|&v| f16::from_f32(v).to_le_bytes())
                .collect(),
        ),
        GgmlType::BF16 => ActRow::Half(
            x.iter()
                .flat_map(|&v| f32_to_bf16(v).to_le_bytes())
                .collect(),
        ),
        _ => ActRow::Q8K(quantize_q8_k(x, form == Form::Gemm)),
    }
}

/// Weight row `w` (its GGUF bytes) widened for the 16-bit dots.
fn half_row(ty: GgmlType, w: &[u8]) -> Vec<f32> {
    w.chunks_exact(2)
        .map(|b| {
            let bits = u16::from_le_bytes([b[0], b[1]]);
            match ty {
                GgmlType::F16 => f16::from_bits(bits).to_f32(),
                _ => f32::from_bits((bits as u32) << 16),
            }
        })
        .collect()
}

/// One output: weight row `w` (GGUF bytes) against one activation row — the scalar
/// specification.
fn dot(ty: GgmlType, w: &[u8], x: &ActRow, form: Form, isa: GgmlIsa) -> f32 {
    match (ty, x) {
        (_, ActRow::Q8K(y)) if form == Form::Tiled => dot_tiled(ty, w, y),
        (GgmlType::Q2K, ActRow::Q8K(y)) => match form {
            Form::Gemv => dot_q2_k_repacked(w, y, false),
            Form::Gemm => dot_q2_k_repacked(w, y, true),
            _ => dot_q2_k(w, y),
        },
        (GgmlType::Q3K, ActRow::Q8K(y)) => dot_q3_k(w, y),
        (GgmlType::Q4K, ActRow::Q8K(y)) => match form {
            Form::Gemv => dot_q4_k_repacked(w, y, false),
            Form::Gemm => dot_q4_k_repacked(w, y, true),
            _ => dot_q4_k(w, y),
        },
        (GgmlType::Q5K, ActRow::Q8K(y)) => dot_q5_k(w, y),
        (GgmlType::Q6K, ActRow::Q8K(y)) => dot_q6_k(w, y),
        (GgmlType::IQ4XS, ActRow::Q8K(y)) => dot_iq4_xs(w, y),
        (GgmlType::Q5_0, ActRow::Q8(y)) => dot_q5_0(w, y),
        (GgmlType::Q5_1, ActRow::Q8(y)) => dot_q5_1(w, y),
        (GgmlType::IQ4NL, ActRow::Q8(y)) if form == Form::Gemv => dot_repacked_32(
            w.len() / 18,
            y,
            |i, j| iq4_value(&w[18 * i + 2..18 * i + 18], j),
            |i| f16_at(w, 18 * i),
        ),
        (GgmlType::IQ4NL, ActRow::Q8(y)) => dot_iq4_nl(w, y, form == Form::TinyBlas),
        (GgmlType::F16 | GgmlType::BF16, ActRow::Half(y)) => {
            let w = half_row(ty, w);
            let y = half_row(ty, y);
            match ty {
                GgmlType::F16 => dot_f16_vec(&w, &y, isa),
                _ => dot_bf16_vec(&w, &y, isa),
            }
        }
        _ => unreachable!("{ty} with the wrong activation kind"),
    }
}

/// [`dot`] with AVX2: the same bits (the 16-bit dots of either llama.cpp build, the AVX-512
/// build's 16 lanes as two 8-lane halves).
#[cfg(target_arch = "x86_64")]
fn dot_avx2(ty: GgmlType, w: &[u8], x: &ActRow, form: Form, isa: GgmlIsa) -> f32 {
    use super::blocks_avx2 as v;
    use super::blocks32_avx2 as w32;
    // SAFETY: only called after `blocks_avx2::available()`; the AVX-512 kernels only where
    // `cpu_level` says the CPU has AVX-512 F/BW/VL/VNNI.
    unsafe {
        match (ty, x) {
            (_, ActRow::Q8K(y)) if form == Form::Tiled => v::dot_tiled(ty, w, y),
            (GgmlType::Q2K, ActRow::Q8K(y)) => match form {
                Form::Gemv => v::dot_q2_k_repacked(w, y, false),
                Form::Gemm => v::dot_q2_k_repacked(w, y, true),
                _ => v::dot_q2_k(w, y),
            },
            (GgmlType::Q3K, ActRow::Q8K(y)) => v::dot_q3_k(w, y),
            (GgmlType::Q4K, ActRow::Q8K(y)) => match form {
                Form::Gemv => v::dot_q4_k_repacked(w, y, false),
                Form::Gemm => v::dot_q4_k_repacked(w, y, true),
                _ => v::dot_q45_k(w, y, false),
            },
            (GgmlType::Q5K, ActRow::Q8K(y)) => v::dot_q45_k(w, y, true),
            // (AVX-512 VNNI: the same lanes in half the instructions.)
            (GgmlType::Q6K, ActRow::Q8K(y)) if super::cpu_level() >= super::CpuLevel::Avx512 => {
                super::blocks_vnni::dot_q6_k(w, y)
            }
            (GgmlType::Q6K, ActRow::Q8K(y)) => v::dot_q6_k(w, y),
            (GgmlType::IQ4XS, ActRow::Q8K(y)) => v::dot_iq4_xs(w, y),
            (GgmlType::Q5_0, ActRow::Q8(y)) => w32::dot_q5_0(w, y),
            (GgmlType::Q5_1, ActRow::Q8(y)) => w32::dot_q5_1(w, y),
            (GgmlType::IQ4NL, ActRow::Q8(y)) if form == Form::Gemv => {
                w32::dot_iq4_nl_repacked(w, y)
            }
            (GgmlType::IQ4NL, ActRow::Q8(y)) => w32::dot_iq4_nl(w, y, form == Form::TinyBlas),
            (GgmlType::F16 | GgmlType::BF16, ActRow::Half(y)) => match isa {
                GgmlIsa::Avx2 => v::dot_half_vec::<1>(w, y, ty == GgmlType::BF16),
                GgmlIsa::Avx512Bf16 if ty == GgmlType::BF16 => v::dot_bf16_pairs(w, y),
                GgmlIsa::Avx512 | GgmlIsa::Avx512Bf16 => {
                    v::dot_half_vec::<2>(w, y, ty == GgmlType::BF16)
                }
            },
            _ => dot(ty, w, x, form, isa),
        }
    }
}

/// Eight outputs — eight weight rows against one activation row — where an 8-row AVX2 kernel
/// computes them (the same bits as eight `dot_avx2` calls); `None` elsewhere.
fn dot8(ty: GgmlType, w: Rows8<'_>, x: &ActRow, form: Form) -> Option<[f32; 8]> {
    #[cfg(target_arch = "x86_64")]
    if super::cpu_level() >= super::CpuLevel::Avx2 {
        use super::blocks_avx2 as v;
        use super::blocks32_avx2 as w32;
        // SAFETY: the CPU has AVX2, FMA and F16C (`cpu_level`).
        return unsafe {
            match (ty, x, form, w) {
                (GgmlType::Q4K, ActRow::Q8K(y), Form::Gemv, w) => Some(v::dot8_q4_k_gemv(w, y)),
                (GgmlType::IQ4NL, ActRow::Q8(y), Form::Gemv, Rows8::Apart(w)) => {
                    let [y] =
                        w32::dot8_repacked_32::<1>(w[0].len() / 18, [y], w32::Repacked8::Iq4Nl(w));
                    Some(y)
                }
                _ => None,
            }
        };
    }
    let _ = (ty, w, x, form);
    None
}

/// `dot8` for four activation rows of the same form at once, where a kernel unpacks each weight
/// register once for all four (the same bits as four `dot8` calls); `None` elsewhere.
fn dot8_rows4(ty: GgmlType, w: Rows8<'_>, x: [&ActRow; 4], form: Form) -> Option<[[f32; 8]; 4]> {
    #[cfg(target_arch = "x86_64")]
    if let (Rows8::Apart(w), true) = (w, super::cpu_level() >= super::CpuLevel::Avx2) {
        use super::blocks32_avx2 as w32;
        let rows: [&QuantRow; 4] = match x {
            [ActRow::Q8(a), ActRow::Q8(b), ActRow::Q8(c), ActRow::Q8(d)] => [a, b, c, d],
            _ => return None,
        };
        // SAFETY: the CPU has AVX2, FMA and F16C (`cpu_level`).
        return unsafe {
            match (ty, form) {
                (GgmlType::IQ4NL, Form::Gemv) => Some(w32::dot8_repacked_32::<4>(
                    w[0].len() / 18,
                    rows,
                    w32::Repacked8::Iq4Nl(w),
                )),
                _ => None,
            }
        };
    }
    let _ = (ty, w, x, form);
    None
}

/// Four outputs — one weight row against four activation rows of the same form — where a
/// 4-row AVX2 kernel computes them (the same bits as four `dot_avx2` calls); `None` elsewhere.
fn dot_rows4(ty: GgmlType, w: &[u8], x: [&ActRow; 4], form: Form) -> Option<[f32; 4]> {
    #[cfg(target_arch = "x86_64")]
    if super::cpu_level() >= super::CpuLevel::Avx2 {
        use super::blocks32_avx2 as w32;
        if let (Some(x), GgmlType::Q4K) = (q8k_rows(x), ty) {
            // SAFETY: the CPU has AVX2, FMA and F16C (`cpu_level`).
            return (form == Form::Gemm)
                .then(|| unsafe { super::blocks_avx2::dot_q4_k_gemm_rows4(w, x) });
        }
        if let (Some(x), GgmlType::Q6K, Form::Tiled) = (q8k_rows(x), ty, form) {
            // SAFETY: the CPU has AVX2, FMA and F16C, and AVX-512 F/BW/VL/VNNI at that level
            // (`cpu_level`).
            return Some(unsafe {
                match super::cpu_level() >= super::CpuLevel::Avx512 {
                    true => super::blocks_vnni::dot_q6_k_tiled_rows4(w, x),
                    false => super::blocks_avx2::dot_q6_k_tiled_rows4(w, x),
                }
            });
        }
        let rows: [&QuantRow; 4] = match x {
            [ActRow::Q8(a), ActRow::Q8(b), ActRow::Q8(c), ActRow::Q8(d)] => [a, b, c, d],
            _ => return None,
        };
        // SAFETY: the CPU has AVX2, FMA and F16C (`cpu_level`).
        return unsafe {
            match (ty, form) {
                (GgmlType::Q5_0, Form::VecDot) => Some(w32::dot_q5_0_rows4(w, rows)),
                (GgmlType::Q5_1, Form::VecDot) => Some(w32::dot_q5_1_rows4(w, rows)),
                (GgmlType::IQ4NL, Form::TinyBlas) => Some(w32::dot_iq4_nl_tinyblas_rows4(w, rows)),
                _ => None,
            }
        };
    }
    let _ = (ty, w, x, form);
    None
}

/// `2·R` outputs — two weight rows against `R` activation rows of the same form — where a
/// CPU-specific kernel computes them (the same bits as `2·R` `dot_avx2` calls); `None`
/// elsewhere. Today: Q5_0 and Q5_1 on CPUs with AVX-512 VNNI, for `R` = 1 (decode) and 4, and on
/// AVX2 CPUs for `R` = 1.
fn dot2_rows<const R: usize>(
    ty: GgmlType,
    w: [&[u8]; 2],
    x: [&ActRow; R],
    form: Form,
) -> Option<[[f32; R]; 2]> {
    #[cfg(target_arch = "x86_64")]
    if super::cpu_level() >= super::CpuLevel::Avx512 && form == Form::VecDot {
        use super::blocks32_avx2 as w32;
        if !x.iter().all(|a| matches!(a, ActRow::Q8(_))) {
            return None;
        }
        let rows: [&QuantRow; R] = x.map(|a| match a {
            ActRow::Q8(q) => q,
            _ => unreachable!("checked above"),
        });
        // SAFETY: the CPU has AVX2, FMA, F16C and AVX-512 F/BW/VL/VNNI (`cpu_level`).
        return unsafe {
            match ty {
                GgmlType::Q5_0 => Some(w32::dot2_q5_vnni::<false, R>(w, rows)),
                GgmlType::Q5_1 => Some(w32::dot2_q5_vnni::<true, R>(w, rows)),
                _ => None,
            }
        };
    }
    // AVX2: the decode form (one activation row).
    #[cfg(target_arch = "x86_64")]
    if let ([ActRow::Q8(y)], true, Form::VecDot) =
        (&x[..], super::cpu_level() >= super::CpuLevel::Avx2, form)
    {
        use super::blocks32_avx2 as w32;
        // SAFETY: the CPU has AVX2, FMA and F16C (`cpu_level`).
        let two = unsafe {
            match ty {
                GgmlType::Q5_0 => w32::dot_q5_rows::<false, 2>(w, y),
                GgmlType::Q5_1 => w32::dot_q5_rows::<true, 2>(w, y),
                _ => return None,
            }
        };
        return Some(two.map(|y| [y; R])); // (R = 1: the one activation row)
    }
    let _ = (ty, w, x, form);
    None
}

/// One task of a Q4_K weight in the X16 layout (`w`: its group of sixteen rows, as stored):
/// every activation row in its form — four `Gemm` rows per call where they come in fours, one
/// otherwise, and `Gemv` rows one at a time — into `cols` (column `c`'s `m` values at `c·m`).
/// Only called where `flex::x16_kernels()`.
fn q4k_x16_task(w: &[u8], acts: &[ActRow], forms: &[Form], cols: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        use super::blocks_vnni::{gemm_q4_k_x16, gemv_q4_k_x16};
        let m = acts.len();
        let q8k = |i: usize| match &acts[i] {
            ActRow::Q8K(y) => y.as_slice(),
            _ => unreachable!("Q4_K takes Q8_K activations"),
        };
        let mut put = |i: usize, y: &[f32; 16]| (0..16).for_each(|c| cols[c * m + i] = y[c]);
        let mut i = 0;
        while i < m {
            // SAFETY (each call): the CPU has AVX-512 F/BW/VL/VNNI (`flex::x16_kernels`).
            if i + 4 <= m && forms[i..i + 4].iter().all(|&f| f == Form::Gemm) {
                let y = unsafe { gemm_q4_k_x16::<4>(w, std::array::from_fn(|a| q8k(i + a))) };
                y.iter().enumerate().for_each(|(a, y)| put(i + a, y));
                i += 4;
                continue;
            }
            let y = match forms[i] {
                Form::Gemm => unsafe { gemm_q4_k_x16::<1>(w, [q8k(i)])[0] },
                Form::Gemv => unsafe { gemv_q4_k_x16(w, q8k(i)) },
                f => unreachable!("a repacked Q4_K row in form {f:?}"),
            };
            put(i, &y);
            i += 1;
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    unreachable!(
        "no X16 kernels off x86-64 ({} bytes, {} rows, {} forms, {} outputs)",
        w.len(),
        acts.len(),
        forms.len(),
        cols.len()
    )
}

/// One task of a Q5_0 or Q5_1 weight in the X16 layout (`w`: its group of sixteen rows, as
/// stored): the activation rows two at a time (each block's weights unpacked once for both),
/// an odd last one alone, into `cols` (column `c`'s `m` values at `c·m`). Only called where
/// `flex::x16_kernels()`.
fn q5_x16_task(ty: GgmlType, w: &[u8], acts: &[ActRow], cols: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        use super::blocks_vnni::gemm_q5_x16;
        let m = acts.len();
        let q8 = |i: usize| match &acts[i] {
            ActRow::Q8(y) => y,
            _ => unreachable!("Q5 weights take Q8_0/Q8_1 activations"),
        };
        let mut put = |i: usize, y: &[f32; 16]| (0..16).for_each(|c| cols[c * m + i] = y[c]);
        let mut i = 0;
        // SAFETY (each call): the CPU has AVX-512 F/BW/VL/VNNI (`flex::x16_kernels`).
        while i + 2 <= m {
            let y = unsafe {
                match ty {
                    GgmlType::Q5_1 => gemm_q5_x16::<true, 2>(w, [q8(i), q8(i + 1)]),
                    _ => gemm_q5_x16::<false, 2>(w, [q8(i), q8(i + 1)]),
                }
            };
            put(i, &y[0]);
            put(i + 1, &y[1]);
            i += 2;
        }
        if i < m {
            let [y] = unsafe {
                match ty {
                    GgmlType::Q5_1 => gemm_q5_x16::<true, 1>(w, [q8(i)]),
                    _ => gemm_q5_x16::<false, 1>(w, [q8(i)]),
                }
            };
            put(i, &y);
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    unreachable!(
        "no X16 kernels off x86-64 ({ty}, {} bytes, {} rows, {} outputs)",
        w.len(),
        acts.len(),
        cols.len()
    )
}

/// The fastest `dot` this CPU has.
fn dot_impl() -> fn(GgmlType, &[u8], &ActRow, Form, GgmlIsa) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if super::cpu_level() >= super::CpuLevel::Avx2 {
        return dot_avx2;
    }
    dot
}

/// Activation rows per block of a matmul's loop (see `matmul`).
pub(super) const ROW_BLOCK: usize = 16;

/// `x[m, k] · Wᵀ` for a blocks-layout weight. Each row takes llama.cpp's path for its place
/// among `m` rows — or among its own sequence's rows, where a batched pass declared them
/// (`row_groups`).
pub(super) fn matmul(x: &[f32], m: usize, w: &HostPackedView<'_>, repackable: bool) -> Vec<f32> {
    let (k, n, ty) = (w.cols, w.rows, w.ty);
    let isa = ggml_isa();
    let repacked = repacked(ty, n, repackable);
    let groups = row_groups::for_rows(m);
    if matches!(ty, GgmlType::F16 | GgmlType::BF16) {
        // (Where tinyBLAS declines its shape, ggml takes the per-output `vec_dot`: VecDot.)
        let vec_dot = |x: &[f32], m: usize| matmul_forms(x, m, w, &vec![Form::VecDot; m]);
        let elem = match ty {
            GgmlType::F16 => super::tinyblas::Elem::F16,
            _ => super::tinyblas::Elem::BF16,
        };
        let several = |x: &[f32], m: usize| match super::tinyblas::applies(m, n, k, isa, elem) {
            true => half_tinyblas(x, m, w, isa),
            false => vec_dot(x, m),
        };
        return match groups {
            Some(groups) => row_groups::split_single_rows(x, k, n, &groups, vec_dot, several),
            None => several(x, m),
        };
    }
    let forms: Vec<Form> = match groups {
        Some(groups) => row_groups::positions(&groups)
            .map(|(i, m)| form(ty, repacked, i, m))
            .collect(),
        None => (0..m).map(|i| form(ty, repacked, i, m)).collect(),
    };
    matmul_forms(x, m, w, &forms)
}

/// `x[m, k] · Wᵀ` with row `i` computed in form `forms[i]`.
fn matmul_forms(x: &[f32], m: usize, w: &HostPackedView<'_>, forms: &[Form]) -> Vec<f32> {
    let (k, n, ty) = (w.cols, w.rows, w.ty);
    let isa = ggml_isa();
    let dot: fn(GgmlType, &[u8], &ActRow, Form, GgmlIsa) -> f32 = dot_impl();
    let acts: Vec<ActRow> = x
        .par_chunks_exact(k)
        .zip(forms)
        .map(|(x, &f)| activation(ty, x, f))
        .collect();
    const COLS: usize = 16;
    let per_row = row_words(ty, k);
    // An interleaved Q4_K weight (`packed::RowLayout`): the sixteen-row kernels read each
    // X16 group as it lies (a repacked Q4_K weight's rows are all `Gemm` or `Gemv`); the
    // eight-row decode kernel reads each X8 group so; the other forms read rows, which each
    // task puts back in order first (a copy of its 16 rows, small beside the arithmetic of
    // several rows).
    let x16 = w.layout == RowLayout::X16 && super::x16_kernels();
    // Whether an X16 kernel reads every row's form: Q4_K's `Gemm`/`Gemv`, Q5's `VecDot`.
    let x16_reads = x16
        && match ty {
            GgmlType::Q4K => forms.iter().all(|&f| matches!(f, Form::Gemm | Form::Gemv)),
            GgmlType::Q5_0 | GgmlType::Q5_1 => true,
            _ => false,
        };
    let needs_rows = match w.layout {
        RowLayout::Rows => false,
        // (The eight-row kernel is AVX2's: below that, every form reads rows.)
        RowLayout::X8 => {
            super::cpu_level() < super::CpuLevel::Avx2 || forms.iter().any(|&f| f != Form::Gemv)
        }
        RowLayout::X16 => !x16_reads,
    };
    let mut out_t = vec![0.0f32; n * m];
    out_t
        .par_chunks_mut(m * COLS)
        .enumerate()
        .for_each(|(g, cols)| {
            let ncols = cols.len() / m;
            let task_words = &w.words[g * COLS * per_row..(g * COLS + ncols) * per_row];
            if x16_reads {
                let w = bytemuck::cast_slice(task_words);
                match ty {
                    GgmlType::Q4K => q4k_x16_task(w, &acts, forms, cols),
                    _ => q5_x16_task(ty, w, &acts, cols),
                }
                return;
            }
            let plain: Option<Vec<u32>> =
                needs_rows.then(|| deinterleave_rows(w.layout, ty, task_words, ncols, k));
            let wr = |c: usize| match &plain {
                Some(p) => row_bytes(ty, k, p, c),
                None => {
                    debug_assert_eq!(w.layout, RowLayout::Rows, "rows of an interleaved weight");
                    row_bytes(ty, k, task_words, c)
                }
            };
            let rows8 = |c0: usize| match w.layout {
                RowLayout::X8 => Rows8::Interleaved(bytemuck::cast_slice(
                    &task_words[c0 * per_row..(c0 + 8) * per_row],
                )),
                _ => Rows8::Apart(std::array::from_fn(|r| wr(c0 + r))),
            };
            let two_rows = matches!(ty, GgmlType::Q5_0 | GgmlType::Q5_1);
            // Activation rows in blocks of 16 (llama.cpp's 16 × 16 tiles), so a block's
            // activations and the group's weight rows stay in L1 while they are reused.
            for i0 in (0..m).step_by(ROW_BLOCK) {
                let i1 = (i0 + ROW_BLOCK).min(m);
                let mut c0 = 0;
                // Eight outputs per call where an 8-row kernel exists (the same bits as `dot`).
                'eight: while c0 + 8 <= ncols {
                    let rows = rows8(c0);
                    let mut i = i0;
                    // Four activation rows per call where that kernel exists.
                    while i + 4 <= i1 && forms[i..i + 4].iter().all(|&f| f == forms[i]) {
                        let x = [&acts[i], &acts[i + 1], &acts[i + 2], &acts[i + 3]];
                        let Some(y) = dot8_rows4(ty, rows, x, forms[i]) else {
                            break;
                        };
                        for (a, y) in y.iter().enumerate() {
                            (0..8).for_each(|r| cols[(c0 + r) * m + i + a] = y[r]);
                        }
                        i += 4;
                    }
                    for i in i..i1 {
                        let Some(y) = dot8(ty, rows, &acts[i], forms[i]) else {
                            break 'eight;
                        };
                        (0..8).for_each(|r| cols[(c0 + r) * m + i] = y[r]);
                    }
                    c0 += 8;
                }
                // Two weight rows by four activation rows (or one) per call where that kernel
                // exists: Q5_0/Q5_1 (`dot2_rows`).
                'pairs: while two_rows && c0 + 2 <= ncols {
                    let pair = [wr(c0), wr(c0 + 1)];
                    let mut i = i0;
                    while i + 4 <= i1 && forms[i..i + 4].iter().all(|&f| f == forms[i]) {
                        let x = [&acts[i], &acts[i + 1], &acts[i + 2], &acts[i + 3]];
                        let Some(y) = dot2_rows(ty, pair, x, forms[i]) else {
                            break 'pairs;
                        };
                        cols[c0 * m + i..c0 * m + i + 4].copy_from_slice(&y[0]);
                        cols[(c0 + 1) * m + i..(c0 + 1) * m + i + 4].copy_from_slice(&y[1]);
                        i += 4;
                    }
                    for i in i..i1 {
                        if let Some([[y0], [y1]]) = dot2_rows(ty, pair, [&acts[i]], forms[i]) {
                            (cols[c0 * m + i], cols[(c0 + 1) * m + i]) = (y0, y1);
                            continue;
                        }
                        for (c, w) in [(c0, pair[0]), (c0 + 1, pair[1])] {
                            cols[c * m + i] = dot(ty, w, &acts[i], forms[i], isa);
                        }
                    }
                    c0 += 2;
                }
                for c in c0..ncols {
                    let wr = wr(c);
                    let mut i = i0;
                    // Four activation rows per call where a 4-row kernel exists.
                    while i + 4 <= i1 && forms[i..i + 4].iter().all(|&f| f == forms[i]) {
                        let rows = [&acts[i], &acts[i + 1], &acts[i + 2], &acts[i + 3]];
                        let Some(y) = dot_rows4(ty, wr, rows, forms[i]) else {
                            break;
                        };
                        cols[c * m + i..c * m + i + 4].copy_from_slice(&y);
                        i += 4;
                    }
                    for i in i..i1 {
                        cols[c * m + i] = dot(ty, wr, &acts[i], forms[i], isa);
                    }
                }
            }
        });
    transpose_columns(out_t, m, n)
}

/// F16/BF16 weights by `m ≥ 2` activation rows, which llama.cpp rounds to the weight's type and
/// multiplies with tinyBLAS (register-tiled: `tinyblas.rs`).
fn half_tinyblas(x: &[f32], m: usize, w: &HostPackedView<'_>, isa: GgmlIsa) -> Vec<f32> {
    let (k, n) = (w.cols, w.rows);
    let elem = match w.ty {
        GgmlType::F16 => super::tinyblas::Elem::F16,
        _ => super::tinyblas::Elem::BF16,
    };
    // A 16-bit row of `k` values (k a multiple of 8) is a whole number of words: the rows are
    // contiguous in `words`.
    let ws: &[u8] = bytemuck::cast_slice(&w.words[..n * k / 2]);
    super::tinyblas::matmul(x, m, ws, n, k, elem, isa)
}

#[cfg(test)]
mod tests;
