//! ggml's tensor types: ids, block sizes and byte sizes.

use std::fmt;

/// A ggml tensor type: how the elements of a tensor are stored.
///
/// Quantized types store elements in blocks of `block_size()` values that take `type_size()` bytes.
/// The ids are ggml's (`enum ggml_type`); `GgmlType::from_id` gives `None` for an id toy does not
/// know, and the GGUF reader refuses such a tensor with an error that names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GgmlType {
    /// 32-bit IEEE float.
    F32,
    /// 16-bit IEEE half float.
    F16,
    /// Blocks of 32 4-bit values with one f16 scale.
    Q4_0,
    /// Blocks of 32 4-bit values with an f16 scale and an f16 minimum.
    Q4_1,
    /// Blocks of 32 5-bit values with one f16 scale.
    Q5_0,
    /// Blocks of 32 5-bit values with an f16 scale and an f16 minimum.
    Q5_1,
    /// Blocks of 32 i8 values with one f16 scale.
    Q8_0,
    /// Blocks of 32 i8 values with an f16 scale and an f16 sum; not dequantized here.
    Q8_1,
    /// Q2_K: super-blocks of 256 2-bit values with 4-bit sub-block scales and minimums.
    Q2K,
    /// Q3_K: super-blocks of 256 3-bit values with 6-bit sub-block scales.
    Q3K,
    /// Q4_K: super-blocks of 256 4-bit values with 6-bit sub-block scales and minimums.
    Q4K,
    /// Q5_K: super-blocks of 256 5-bit values with 6-bit sub-block scales and minimums.
    Q5K,
    /// Q6_K: super-blocks of 256 6-bit values with i8 sub-block scales.
    Q6K,
    /// Q8_K: super-blocks of 256 i8 values with an f32 scale and i16 block sums.
    Q8K,
    /// IQ4_NL: blocks of 32 4-bit indices into the non-linear grid `IQ4_GRID`, with an f16 scale.
    IQ4NL,
    /// IQ4_XS: super-blocks of 256 `IQ4_GRID` indices with 6-bit sub-block scales.
    IQ4XS,
    /// 8-bit signed integer.
    I8,
    /// 16-bit signed integer.
    I16,
    /// 32-bit signed integer.
    I32,
    /// 64-bit signed integer.
    I64,
    /// 64-bit IEEE float.
    F64,
    /// bfloat16: the top 16 bits of an f32.
    BF16,
}

impl GgmlType {
    /// Every type we can size (and so read); ids follow ggml's `enum ggml_type`.
    pub const ALL: [GgmlType; 22] = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q8_0,
        GgmlType::Q8_1,
        GgmlType::Q2K,
        GgmlType::Q3K,
        GgmlType::Q4K,
        GgmlType::Q5K,
        GgmlType::Q6K,
        GgmlType::Q8K,
        GgmlType::IQ4NL,
        GgmlType::IQ4XS,
        GgmlType::I8,
        GgmlType::I16,
        GgmlType::I32,
        GgmlType::I64,
        GgmlType::F64,
        GgmlType::BF16,
    ];

    /// The type with ggml id `id`, or `None` for an id we do not know.
    pub fn from_id(id: u32) -> Option<Self> {
        Self::ALL.into_iter().find(|t| t.id() == id)
    }

    /// ggml's numeric id for the type (`enum ggml_type`), as stored in GGUF tensor infos.
    pub fn id(self) -> u32 {
        match self {
            GgmlType::F32 => 0,
            GgmlType::F16 => 1,
            GgmlType::Q4_0 => 2,
            GgmlType::Q4_1 => 3,
            GgmlType::Q5_0 => 6,
            GgmlType::Q5_1 => 7,
            GgmlType::Q8_0 => 8,
            GgmlType::Q8_1 => 9,
            GgmlType::Q2K => 10,
            GgmlType::Q3K => 11,
            GgmlType::Q4K => 12,
            GgmlType::Q5K => 13,
            GgmlType::Q6K => 14,
            GgmlType::Q8K => 15,
            GgmlType::IQ4NL => 20,
            GgmlType::IQ4XS => 23,
            GgmlType::I8 => 24,
            GgmlType::I16 => 25,
            GgmlType::I32 => 26,
            GgmlType::I64 => 27,
            GgmlType::F64 => 28,
            GgmlType::BF16 => 30,
        }
    }

    /// Elements per block (1 for plain types).
    pub fn block_size(self) -> usize {
        match self {
            GgmlType::Q4_0
            | GgmlType::Q4_1
            | GgmlType::Q5_0
            | GgmlType::Q5_1
            | GgmlType::Q8_0
            | GgmlType::Q8_1
            | GgmlType::IQ4NL => 32,
            GgmlType::Q2K
            | GgmlType::Q3K
            | GgmlType::Q4K
            | GgmlType::Q5K
            | GgmlType::Q6K
            | GgmlType::Q8K
            | GgmlType::IQ4XS => 256,
            _ => 1,
        }
    }

    /// Bytes per block (per element for plain types).
    pub fn type_size(self) -> usize {
        match self {
            GgmlType::F32 | GgmlType::I32 => 4,
            GgmlType::F16 | GgmlType::BF16 | GgmlType::I16 => 2,
            GgmlType::I8 => 1,
            GgmlType::I64 | GgmlType::F64 => 8,
            GgmlType::Q4_0 => 2 + 16,
            GgmlType::Q4_1 => 2 + 2 + 16,
            GgmlType::Q5_0 => 2 + 4 + 16,
            GgmlType::Q5_1 => 2 + 2 + 4 + 16,
            GgmlType::Q8_0 => 2 + 32,
            GgmlType::Q8_1 => 4 + 32,
            GgmlType::Q2K => 16 + 64 + 2 + 2,
            GgmlType::Q3K => 32 + 64 + 12 + 2,
            GgmlType::Q4K => 2 + 2 + 12 + 128,
            GgmlType::Q5K => 2 + 2 + 12 + 32 + 128,
            GgmlType::Q6K => 128 + 64 + 16 + 2,
            GgmlType::Q8K => 4 + 256 + 2 * 16,
            GgmlType::IQ4NL => 2 + 16,
            GgmlType::IQ4XS => 2 + 2 + 4 + 128,
        }
    }

    /// Bytes taken by a row of `n` elements, or `None` if `n` is not a whole number of blocks.
    pub fn row_bytes(self, n: u64) -> Option<u64> {
        let bs = self.block_size() as u64;
        if !n.is_multiple_of(bs) {
            return None;
        }
        (n / bs).checked_mul(self.type_size() as u64)
    }

    /// The name ggml and llama.cpp print (`Q8_0`, `Q4_K`, `F32`, …).
    pub fn name(self) -> &'static str {
        match self {
            GgmlType::F32 => "F32",
            GgmlType::F16 => "F16",
            GgmlType::Q4_0 => "Q4_0",
            GgmlType::Q4_1 => "Q4_1",
            GgmlType::Q5_0 => "Q5_0",
            GgmlType::Q5_1 => "Q5_1",
            GgmlType::Q8_0 => "Q8_0",
            GgmlType::Q8_1 => "Q8_1",
            GgmlType::Q2K => "Q2_K",
            GgmlType::Q3K => "Q3_K",
            GgmlType::Q4K => "Q4_K",
            GgmlType::Q5K => "Q5_K",
            GgmlType::Q6K => "Q6_K",
            GgmlType::Q8K => "Q8_K",
            GgmlType::IQ4NL => "IQ4_NL",
            GgmlType::IQ4XS => "IQ4_XS",
            GgmlType::I8 => "I8",
            GgmlType::I16 => "I16",
            GgmlType::I32 => "I32",
            GgmlType::I64 => "I64",
            GgmlType::F64 => "F64",
            GgmlType::BF16 => "BF16",
        }
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}
