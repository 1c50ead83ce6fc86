//! The GGUF reader: memory-maps a file and validates every count, offset and size against the
//! file length before allocating anything, so a truncated or hostile file is an error, not a
//! crash or a huge allocation.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use super::GgmlType;
use super::types::{Value, ValueType};
use super::{GgufError, Result};

/// GGUF magic, the bytes "GGUF".
pub const MAGIC: [u8; 4] = *b"GGUF";
/// Default alignment of the tensor data section (`general.alignment` overrides it).
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// ggml tensors have at most 4 dimensions.
pub const MAX_DIMS: u32 = 4;
/// Longest tensor name ggml accepts (`GGML_MAX_NAME - 1`).
pub const MAX_NAME_LEN: u64 = 63;
/// Deepest nesting of arrays we accept (real files use 1); the writer refuses deeper ones too.
pub(super) const MAX_ARRAY_DEPTH: u32 = 4;

/// One tensor's header entry.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorInfo {
    /// Tensor name, at most `MAX_NAME_LEN` bytes.
    pub name: String,
    /// ggml `ne`: `dims[0]` is the fastest-varying (row length). A GGUF matrix `[in, out]` is a
    /// row-major `[out, in]` PyTorch weight.
    pub dims: Vec<u64>,
    /// How the elements are stored.
    pub ggml_type: GgmlType,
    /// Offset of the data from the start of the data section.
    pub offset: u64,
}

impl TensorInfo {
    /// Number of elements, the product of the dims.
    pub fn n_elements(&self) -> u64 {
        self.dims.iter().product()
    }

    /// Size of the tensor data in bytes (validated at read time not to overflow).
    pub fn n_bytes(&self) -> u64 {
        let rows: u64 = self.dims.iter().skip(1).product();
        self.ggml_type.row_bytes(self.dims[0]).unwrap_or(0) * rows
    }

    /// The dims in PyTorch order (slowest first), as `usize`.
    pub fn shape(&self) -> Vec<usize> {
        self.dims.iter().rev().map(|&d| d as usize).collect()
    }
}

enum Storage {
    Mmap(Mmap),
    Owned(Vec<u8>),
}

impl Storage {
    fn bytes(&self) -> &[u8] {
        match self {
            Storage::Mmap(m) => m,
            Storage::Owned(v) => v,
        }
    }
}

/// An open GGUF file: metadata in file order, tensor infos, and zero-copy access to tensor bytes.
pub struct GgufFile {
    storage: Storage,
    path: Option<PathBuf>,
    /// GGUF format version, 2 or 3.
    pub version: u32,
    /// Metadata key/value pairs in the order of the file.
    pub metadata: Vec<(String, Value)>,
    key_index: HashMap<String, usize>,
    /// Tensor infos in the order of the file.
    pub tensors: Vec<TensorInfo>,
    tensor_index: HashMap<String, usize>,
    /// Alignment of the data section and of each tensor's offset.
    pub alignment: u64,
    /// Absolute offset of the data section.
    pub data_offset: u64,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("metadata", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

impl GgufFile {
    /// Open and validate a GGUF file. The file is memory-mapped: tensor data is not copied.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let io = |source| GgufError::Io {
            path: path.to_path_buf(),
            source,
        };
        let file = File::open(path).map_err(io)?;
        if file.metadata().map_err(io)?.is_dir() {
            return Err(GgufError::Io {
                path: path.to_path_buf(),
                source: std::io::Error::other("is a directory, not a GGUF file"),
            });
        }
        // SAFETY: the map is read-only; like every mmap reader we rely on the file not being
        // truncated by another process while it is open.
        let mmap = unsafe { Mmap::map(&file) }.map_err(io)?;
        let mut gguf = Self::parse(Storage::Mmap(mmap))?;
        gguf.path = Some(path.to_path_buf());
        Ok(gguf)
    }

    /// Parse a GGUF image held in memory.
    pub fn from_bytes(bytes: Vec<u8>) -> Result<Self> {
        Self::parse(Storage::Owned(bytes))
    }

    /// The path the file was opened from, or `None` for one parsed from memory.
    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    /// Tell the OS this process no longer needs the file's pages, once the tensors have been
    /// copied to where they are used: they stop counting in the process's resident memory (which
    /// would otherwise hold the model twice), and are read again from the page cache if touched.
    /// A no-op for in-memory files and off Unix.
    pub fn release_pages(&self) {
        #[cfg(unix)]
        if let Storage::Mmap(m) = &self.storage {
            // SAFETY: the map is read-only and file-backed, so dropping its pages loses nothing:
            // a later read faults them in again from the file.
            let _ = unsafe { m.unchecked_advise(memmap2::UncheckedAdvice::DontNeed) };
        }
    }

    /// [`release_pages`](Self::release_pages) for one tensor's bytes, once they have been copied
    /// out: a loader that releases each tensor as it goes never holds the file and the model in
    /// memory at once. (The pages at the range's ends may hold neighbours' bytes; those are simply
    /// read again if touched.)
    pub fn release_tensor_pages(&self, info: &TensorInfo) {
        #[cfg(unix)]
        if let Storage::Mmap(m) = &self.storage {
            let start = (self.data_offset + info.offset) as usize;
            // SAFETY: as in `release_pages`: read-only, file-backed.
            let _ = unsafe {
                m.unchecked_advise_range(
                    memmap2::UncheckedAdvice::DontNeed,
                    start,
                    info.n_bytes() as usize,
                )
            };
        }
        #[cfg(not(unix))]
        let _ = info;
    }

    /// The whole file.
    pub fn bytes(&self) -> &[u8] {
        self.storage.bytes()
    }

    /// The metadata value under `key`, if present.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.key_index.get(key).map(|&i| &self.metadata[i].1)
    }

    /// A metadata value that must be present.
    pub fn require(&self, key: &str) -> Result<&Value> {
        self.get(key)
            .ok_or_else(|| GgufError::MissingKey(key.to_string()))
    }

    /// A string metadata value: `None` if absent, an error if of another type.
    pub fn get_str(&self, key: &str) -> Result<Option<&str>> {
        self.get(key)
            .map(|v| v.as_str().ok_or_else(|| wrong_type(key, "a string", v)))
            .transpose()
    }

    /// An integer metadata value of any width as u64: `None` if absent, an error if not a
    /// non-negative integer.
    pub fn get_u64(&self, key: &str) -> Result<Option<u64>> {
        self.get(key)
            .map(|v| {
                v.as_u64()
                    .ok_or_else(|| wrong_type(key, "an unsigned integer", v))
            })
            .transpose()
    }

    /// A float or integer metadata value as f64: `None` if absent, an error if not a number.
    pub fn get_f64(&self, key: &str) -> Result<Option<f64>> {
        self.get(key)
            .map(|v| v.as_f64().ok_or_else(|| wrong_type(key, "a number", v)))
            .transpose()
    }

    /// A bool metadata value: `None` if absent, an error if of another type.
    pub fn get_bool(&self, key: &str) -> Result<Option<bool>> {
        self.get(key)
            .map(|v| v.as_bool().ok_or_else(|| wrong_type(key, "a bool", v)))
            .transpose()
    }

    /// An array metadata value's elements: `None` if absent, an error if of another type.
    pub fn get_array(&self, key: &str) -> Result<Option<&[Value]>> {
        self.get(key)
            .map(|v| v.as_array().ok_or_else(|| wrong_type(key, "an array", v)))
            .transpose()
    }

    /// `general.architecture`, which prefixes most model keys.
    pub fn architecture(&self) -> Result<&str> {
        self.get_str("general.architecture")?
            .ok_or_else(|| GgufError::MissingKey("general.architecture".into()))
    }

    /// The info of the tensor named `name`, if the file has one.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }

    /// The raw bytes of a tensor (validated at open time to lie inside the file).
    pub fn tensor_data(&self, info: &TensorInfo) -> &[u8] {
        let start = (self.data_offset + info.offset) as usize;
        &self.bytes()[start..start + info.n_bytes() as usize]
    }

    fn parse(storage: Storage) -> Result<Self> {
        let bytes = storage.bytes();
        let mut r = Cursor { bytes, pos: 0 };
        let magic = r.take(4, "magic")?;
        if magic != MAGIC {
            return Err(GgufError::BadMagic([
                magic[0], magic[1], magic[2], magic[3],
            ]));
        }
        let version = r.u32("version")?;
        if version.swap_bytes() == 2 || version.swap_bytes() == 3 {
            return Err(GgufError::BigEndian);
        }
        if !(2..=3).contains(&version) {
            return Err(GgufError::UnsupportedVersion(version));
        }
        let n_tensors = r.u64("tensor count")?;
        let n_kv = r.u64("metadata count")?;
        // Bound counts by what the rest of the file could hold before reserving anything.
        r.check_count(n_kv, 8 + 4 + 1, "metadata count")?;
        r.check_count(n_tensors, 8 + 4 + 8 + 4 + 8, "tensor count")?;

        let mut metadata = Vec::with_capacity(n_kv as usize);
        let mut key_index = HashMap::with_capacity(n_kv as usize);
        for _ in 0..n_kv {
            let key = r.string("metadata key")?;
            let tag = r.u32("value type")?;
            let ty = ValueType::from_id(tag).ok_or_else(|| GgufError::UnknownValueType {
                key: key.clone(),
                tag,
            })?;
            let value = r.value(ty, &key, 0)?;
            if key_index.insert(key.clone(), metadata.len()).is_some() {
                return Err(GgufError::DuplicateKey(key));
            }
            metadata.push((key, value));
        }

        let alignment = match metadata.get(
            key_index
                .get("general.alignment")
                .copied()
                .unwrap_or(usize::MAX),
        ) {
            None => DEFAULT_ALIGNMENT,
            Some((_, Value::U32(a))) if *a > 0 && a.is_power_of_two() => *a as u64,
            Some((_, v)) => {
                return Err(GgufError::Invalid(format!(
                    "general.alignment must be a power-of-two u32, found {}",
                    v.summary()
                )));
            }
        };

        let mut tensors = Vec::with_capacity(n_tensors as usize);
        let mut tensor_index = HashMap::with_capacity(n_tensors as usize);
        for _ in 0..n_tensors {
            let name = r.string("tensor name")?;
            if name.len() as u64 > MAX_NAME_LEN {
                return Err(GgufError::BadTensor {
                    name,
                    reason: "name longer than 63 bytes".into(),
                });
            }
            let n_dims = r.u32("tensor dims")?;
            if n_dims == 0 || n_dims > MAX_DIMS {
                return Err(GgufError::BadTensor {
                    name,
                    reason: format!("{n_dims} dimensions (ggml allows 1 to {MAX_DIMS})"),
                });
            }
            let mut dims = Vec::with_capacity(n_dims as usize);
            for _ in 0..n_dims {
                dims.push(r.u64("tensor dim")?);
            }
            let type_id = r.u32("tensor type")?;
            let ggml_type =
                GgmlType::from_id(type_id).ok_or_else(|| GgufError::UnsupportedTensorType {
                    name: name.clone(),
                    type_id,
                })?;
            let offset = r.u64("tensor offset")?;
            let info = TensorInfo {
                name: name.clone(),
                dims,
                ggml_type,
                offset,
            };
            check_tensor_shape(&info)?;
            if offset % alignment != 0 {
                return Err(GgufError::BadTensor {
                    name,
                    reason: format!(
                        "data offset {offset} is not a multiple of the alignment {alignment}"
                    ),
                });
            }
            if tensor_index.insert(name.clone(), tensors.len()).is_some() {
                return Err(GgufError::BadTensor {
                    name,
                    reason: "duplicate tensor name".into(),
                });
            }
            tensors.push(info);
        }

        let data_offset = (r.pos as u64).next_multiple_of(alignment);
        let file_len = bytes.len() as u64;
        for t in &tensors {
            let end = data_offset
                .checked_add(t.offset)
                .and_then(|s| s.checked_add(t.n_bytes()));
            match end {
                Some(end) if end <= file_len => {}
                _ => {
                    return Err(GgufError::Truncated {
                        what: format!("data of tensor {:?}", t.name),
                        need: end.unwrap_or(u64::MAX),
                        have: file_len,
                    });
                }
            }
        }

        Ok(GgufFile {
            storage,
            path: None,
            version,
            metadata,
            key_index,
            tensors,
            tensor_index,
            alignment,
            data_offset,
        })
    }
}

fn wrong_type(key: &str, expected: &'static str, found: &Value) -> GgufError {
    GgufError::WrongType {
        key: key.to_string(),
        expected,
        found: format!("{:?}", found.value_type()),
    }
}

/// Dims must be positive, their product must not overflow, and rows must hold whole blocks.
/// (Shared with the writer, which refuses to write what the reader would refuse to read.)
pub(super) fn check_tensor_shape(t: &TensorInfo) -> Result<()> {
    let bad = |reason: String| GgufError::BadTensor {
        name: t.name.clone(),
        reason,
    };
    if t.dims.is_empty() || t.dims.len() > MAX_DIMS as usize {
        return Err(bad(format!(
            "{} dimensions (ggml allows 1 to {MAX_DIMS})",
            t.dims.len()
        )));
    }
    if t.dims.iter().any(|&d| d == 0 || d > i64::MAX as u64) {
        return Err(bad(format!("invalid dims {:?}", t.dims)));
    }
    // Checked apart from the size so that an overflowing row is not reported as a block-size
    // mismatch (`row_bytes` returns None for both).
    let block = t.ggml_type.block_size() as u64;
    if !t.dims[0].is_multiple_of(block) {
        return Err(bad(format!(
            "row length {} is not a multiple of the {} block size {block}",
            t.dims[0], t.ggml_type
        )));
    }
    let n = t.dims.iter().try_fold(1u64, |acc, &d| acc.checked_mul(d));
    let row = t.ggml_type.row_bytes(t.dims[0]);
    let rows = t
        .dims
        .iter()
        .skip(1)
        .try_fold(1u64, |acc, &d| acc.checked_mul(d));
    match (n, row, rows) {
        (Some(n), Some(row), Some(rows))
            if n < i64::MAX as u64
                && row.checked_mul(rows).is_some_and(|b| b < i64::MAX as u64) =>
        {
            Ok(())
        }
        _ => Err(bad(format!("dims {:?} overflow", t.dims))),
    }
}

struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn remaining(&self) -> u64 {
        (self.bytes.len() - self.pos) as u64
    }

    fn take(&mut self, n: u64, what: &str) -> Result<&'a [u8]> {
        if n > self.remaining() {
            return Err(GgufError::Truncated {
                what: what.escape_debug().to_string(),
                need: (self.pos as u64).saturating_add(n),
                have: self.bytes.len() as u64,
            });
        }
        let s = &self.bytes[self.pos..self.pos + n as usize];
        self.pos += n as usize;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        Ok(self
            .take(N as u64, what)?
            .try_into()
            .expect("length checked"))
    }

    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// A count of items of at least `min_size` bytes each must fit in what is left of the file.
    fn check_count(&self, count: u64, min_size: u64, what: &str) -> Result<()> {
        if count
            .checked_mul(min_size)
            .is_none_or(|need| need > self.remaining())
        {
            return Err(GgufError::TooLarge {
                what: what.escape_debug().to_string(),
                count,
                remaining: self.remaining(),
            });
        }
        Ok(())
    }

    fn string(&mut self, what: &str) -> Result<String> {
        let len = self.u64(what)?;
        if len > self.remaining() {
            return Err(GgufError::TooLarge {
                what: format!("{} length", what.escape_debug()),
                count: len,
                remaining: self.remaining(),
            });
        }
        let raw = self.take(len, what)?;
        String::from_utf8(raw.to_vec())
            .map_err(|_| GgufError::InvalidUtf8(what.escape_debug().to_string()))
    }

    fn value(&mut self, ty: ValueType, key: &str, depth: u32) -> Result<Value> {
        Ok(match ty {
            ValueType::U8 => Value::U8(self.array::<1>(key)?[0]),
            ValueType::I8 => Value::I8(self.array::<1>(key)?[0] as i8),
            ValueType::U16 => Value::U16(u16::from_le_bytes(self.array(key)?)),
            ValueType::I16 => Value::I16(i16::from_le_bytes(self.array(key)?)),
            ValueType::U32 => Value::U32(self.u32(key)?),
            ValueType::I32 => Value::I32(i32::from_le_bytes(self.array(key)?)),
            ValueType::F32 => Value::F32(f32::from_le_bytes(self.array(key)?)),
            ValueType::U64 => Value::U64(self.u64(key)?),
            ValueType::I64 => Value::I64(i64::from_le_bytes(self.array(key)?)),
            ValueType::F64 => Value::F64(f64::from_le_bytes(self.array(key)?)),
            ValueType::Bool => match self.array::<1>(key)?[0] {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                b => {
                    return Err(GgufError::Invalid(format!(
                        "{key:?}: bool byte {b} is neither 0 nor 1"
                    )));
                }
            },
            ValueType::String => Value::String(self.string(key)?),
            ValueType::Array => {
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(GgufError::Invalid(format!(
                        "{key:?}: arrays nested deeper than {MAX_ARRAY_DEPTH}"
                    )));
                }
                let tag = self.u32(key)?;
                let elem = ValueType::from_id(tag).ok_or_else(|| GgufError::UnknownValueType {
                    key: key.to_string(),
                    tag,
                })?;
                let count = self.u64(key)?;
                self.check_count(count, elem.min_size(), &format!("array {key} count"))?;
                let mut items = Vec::with_capacity(count as usize);
                for _ in 0..count {
                    items.push(self.value(elem, key, depth + 1)?);
                }
                Value::Array(elem, items)
            }
        })
    }
}
