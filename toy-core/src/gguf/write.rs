//! The GGUF v3 writer.
//!
//! The layout is the one gguf-py and llama.cpp write, so that reading a file and writing its
//! metadata and tensors back in the same order reproduces it byte for byte:
//!
//! ```text
//! "GGUF" | version u32 = 3 | n_tensors u64 | n_kv u64
//! n_kv × (key, value type u32, value)
//! n_tensors × (name, n_dims u32, dims u64 × n_dims (ne order), ggml type u32, offset u64)
//! zero padding to the alignment
//! n_tensors × (data, zero padding to the alignment)   (offsets are relative to the first)
//! ```
//!
//! Strings are a u64 byte length and UTF-8 bytes; arrays are an element type u32, a u64 count
//! and the elements without type tags. The alignment is `general.alignment` (a u32 power of two)
//! or 32.

use std::borrow::Cow;
use std::io::{self, Write};
use std::path::Path;

use super::GgmlType;
use super::read::{MAX_ARRAY_DEPTH, check_tensor_shape};
use super::types::{Value, ValueType};
use super::{DEFAULT_ALIGNMENT, GgufError, GgufFile, MAGIC, MAX_NAME_LEN, Result, TensorInfo};

/// The GGUF version this writer produces.
pub const WRITE_VERSION: u32 = 3;

const ALIGNMENT_KEY: &str = "general.alignment";

/// Builds a GGUF file: ordered metadata plus tensors whose bytes are either owned or borrowed
/// (for example straight from the mmap of a [`GgufFile`] being rewritten).
///
/// Every value and tensor is validated when it is added, so `write_to` can only fail on I/O.
#[derive(Debug, Default, Clone)]
pub struct GgufWriter<'a> {
    metadata: Vec<(String, Value)>,
    tensors: Vec<PendingTensor<'a>>,
}

#[derive(Debug, Clone)]
struct PendingTensor<'a> {
    name: String,
    dims: Vec<u64>,
    ggml_type: GgmlType,
    data: Cow<'a, [u8]>,
}

impl<'a> GgufWriter<'a> {
    /// An empty writer: no metadata, no tensors, default alignment.
    pub fn new() -> Self {
        Self::default()
    }

    /// A writer holding a copy of `file`'s metadata, in file order, and no tensors: the start of
    /// a conversion that rewrites the tensors.
    pub fn from_file(file: &GgufFile) -> Self {
        // The reader has validated everything the writer checks (array nesting, alignment).
        GgufWriter {
            metadata: file.metadata.clone(),
            tensors: Vec::new(),
        }
    }

    /// A writer holding `file`'s metadata and all its tensors (borrowed, not copied), in file
    /// order. Writing it reproduces a file written by gguf-py or llama.cpp byte for byte.
    pub fn from_file_with_tensors(file: &'a GgufFile) -> Result<Self> {
        let mut writer = Self::from_file(file);
        writer.tensors.reserve(file.tensors.len());
        for info in &file.tensors {
            writer.copy_tensor(file, info)?;
        }
        Ok(writer)
    }

    /// The metadata in the order it will be written.
    pub fn metadata(&self) -> &[(String, Value)] {
        &self.metadata
    }

    /// The metadata value under `key`, if set.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }

    /// Set a metadata value. A new key goes to the end; an existing key keeps its position and
    /// gets the new value (so rewriting one value of a file keeps the file's key order).
    ///
    /// Refuses arrays whose items are not all of the declared element type, arrays nested deeper
    /// than the reader accepts, and a `general.alignment` that is not a power-of-two u32.
    pub fn set(&mut self, key: impl Into<String>, value: Value) -> Result<()> {
        let key = key.into();
        check_value(&key, &value, 0)?;
        if key == ALIGNMENT_KEY {
            alignment_of(&value)?;
        }
        match self.metadata.iter_mut().find(|(k, _)| *k == key) {
            Some((_, slot)) => *slot = value,
            None => self.metadata.push((key, value)),
        }
        Ok(())
    }

    /// Remove a metadata key, returning its value.
    pub fn remove(&mut self, key: &str) -> Option<Value> {
        let i = self.metadata.iter().position(|(k, _)| k == key)?;
        Some(self.metadata.remove(i).1)
    }

    /// The alignment of the data section and of every tensor: `general.alignment` or 32.
    pub fn alignment(&self) -> u64 {
        self.get(ALIGNMENT_KEY)
            .and_then(|v| alignment_of(v).ok())
            .unwrap_or(DEFAULT_ALIGNMENT)
    }

    /// Add a tensor after the ones already added.
    ///
    /// `dims` are in ggml `ne` order (`dims[0]` is the row length: a PyTorch `[out, in]` weight
    /// is `[in, out]`), and `data` must hold exactly the bytes of a tensor of that shape and type.
    pub fn add_tensor(
        &mut self,
        name: impl Into<String>,
        dims: &[u64],
        ggml_type: GgmlType,
        data: impl Into<Cow<'a, [u8]>>,
    ) -> Result<()> {
        let name = name.into();
        let data = data.into();
        if name.len() as u64 > MAX_NAME_LEN {
            return Err(GgufError::BadTensor {
                name,
                reason: format!("name longer than {MAX_NAME_LEN} bytes"),
            });
        }
        if self.tensors.iter().any(|t| t.name == name) {
            return Err(GgufError::BadTensor {
                name,
                reason: "duplicate tensor name".into(),
            });
        }
        let info = TensorInfo {
            name,
            dims: dims.to_vec(),
            ggml_type,
            offset: 0,
        };
        check_tensor_shape(&info)?;
        let expected = info.n_bytes();
        if data.len() as u64 != expected {
            return Err(GgufError::BadTensor {
                name: info.name,
                reason: format!(
                    "{} bytes of data given, but {ggml_type} dims {dims:?} take {expected}",
                    data.len()
                ),
            });
        }
        self.tensors.push(PendingTensor {
            name: info.name,
            dims: info.dims,
            ggml_type,
            data,
        });
        Ok(())
    }

    /// Add a tensor of `file` (same name, dims and type), borrowing its bytes.
    pub fn copy_tensor(&mut self, file: &'a GgufFile, info: &TensorInfo) -> Result<()> {
        let data = tensor_bytes(file, info)?;
        self.add_tensor(
            info.name.clone(),
            &info.dims,
            info.ggml_type,
            Cow::Borrowed(data),
        )
    }

    /// Number of tensors added so far.
    pub fn n_tensors(&self) -> usize {
        self.tensors.len()
    }

    /// The types of the tensors added so far, in order.
    pub fn tensor_types(&self) -> impl Iterator<Item = GgmlType> + '_ {
        self.tensors.iter().map(|t| t.ggml_type)
    }

    /// Whether a tensor of this name has been added.
    pub fn has_tensor(&self, name: &str) -> bool {
        self.tensors.iter().any(|t| t.name == name)
    }

    /// Write the file to `out`, returning the number of bytes written. `out` gets one large
    /// write for the header and one per tensor and padding, so it need not be buffered.
    pub fn write_to(&self, out: impl Write) -> Result<u64> {
        self.write_inner(out).map_err(|source| GgufError::Write {
            target: "the GGUF output".to_string(),
            source,
        })
    }

    /// Write the file to `path` atomically: into a temporary file in the same directory, which
    /// is flushed to disk and then renamed over `path`. A reader never sees a partial file, and
    /// an error leaves any existing `path` untouched.
    pub fn write_atomic(&self, path: impl AsRef<Path>) -> Result<u64> {
        let path = path.as_ref();
        crate::atomic::write_atomic_with(path, |out| self.write_inner(out)).map_err(|source| {
            GgufError::Write {
                target: path.display().to_string(),
                source,
            }
        })
    }

    fn write_inner(&self, mut out: impl Write) -> io::Result<u64> {
        let alignment = self.alignment();
        // Header, metadata and tensor infos are small (a few MB for a large vocabulary): build
        // them in memory so that an unbuffered `out` still gets few, large writes.
        let mut head = Vec::with_capacity(1 << 16);
        head.extend_from_slice(&MAGIC);
        head.extend_from_slice(&WRITE_VERSION.to_le_bytes());
        head.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        head.extend_from_slice(&(self.metadata.len() as u64).to_le_bytes());
        for (key, value) in &self.metadata {
            put_str(&mut head, key);
            head.extend_from_slice(&(value.value_type() as u32).to_le_bytes());
            put_value(&mut head, value);
        }
        let mut offset = 0u64;
        for t in &self.tensors {
            put_str(&mut head, &t.name);
            head.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
            for d in &t.dims {
                head.extend_from_slice(&d.to_le_bytes());
            }
            head.extend_from_slice(&t.ggml_type.id().to_le_bytes());
            head.extend_from_slice(&offset.to_le_bytes());
            offset += (t.data.len() as u64).next_multiple_of(alignment);
        }
        out.write_all(&head)?;
        let mut written = head.len() as u64;
        written += write_padding(&mut out, written, alignment)?;
        for t in &self.tensors {
            out.write_all(&t.data)?;
            let len = t.data.len() as u64;
            written += len + write_padding(&mut out, len, alignment)?;
        }
        out.flush()?;
        Ok(written)
    }
}

/// Zeros from `len` up to the next multiple of `alignment`; returns how many. Written from a
/// small buffer: a file may legally ask for a huge alignment.
fn write_padding(out: &mut impl Write, len: u64, alignment: u64) -> io::Result<u64> {
    const ZEROS: [u8; 4096] = [0; 4096];
    let pad = len.next_multiple_of(alignment) - len;
    let mut left = pad;
    while left > 0 {
        let n = left.min(ZEROS.len() as u64);
        out.write_all(&ZEROS[..n as usize])?;
        left -= n;
    }
    Ok(pad)
}

/// The bytes of `info` in `file`, checked to lie inside the file (so a `TensorInfo` that does
/// not belong to `file` is an error, not a panic).
pub(super) fn tensor_bytes<'f>(file: &'f GgufFile, info: &TensorInfo) -> Result<&'f [u8]> {
    check_tensor_shape(info)?;
    let bytes = file.bytes();
    let start = file.data_offset.checked_add(info.offset);
    let end = start.and_then(|s| s.checked_add(info.n_bytes()));
    match (start, end) {
        (Some(start), Some(end)) if end <= bytes.len() as u64 => {
            Ok(&bytes[start as usize..end as usize])
        }
        _ => Err(GgufError::BadTensor {
            name: info.name.clone(),
            reason: format!(
                "its data (offset {}, {} bytes) lies outside the file; is it a tensor of \
                 another file?",
                info.offset,
                info.n_bytes()
            ),
        }),
    }
}

fn alignment_of(value: &Value) -> Result<u64> {
    match value {
        Value::U32(a) if a.is_power_of_two() => Ok(*a as u64),
        other => Err(GgufError::InvalidArgument(format!(
            "{ALIGNMENT_KEY} must be a power-of-two U32, not {:?} {}",
            other.value_type(),
            other.summary()
        ))),
    }
}

/// Arrays must be homogeneous (GGUF stores one element type per array) and no deeper than the
/// reader accepts.
fn check_value(key: &str, value: &Value, depth: u32) -> Result<()> {
    let Value::Array(elem, items) = value else {
        return Ok(());
    };
    if depth >= MAX_ARRAY_DEPTH {
        return Err(GgufError::InvalidArgument(format!(
            "metadata {key:?}: arrays nested deeper than {MAX_ARRAY_DEPTH} cannot be read back"
        )));
    }
    for (i, item) in items.iter().enumerate() {
        if item.value_type() != *elem {
            return Err(GgufError::InvalidArgument(format!(
                "metadata {key:?}: item {i} of an array of {elem:?} is a {:?}",
                item.value_type()
            )));
        }
        check_value(key, item, depth + 1)?;
    }
    Ok(())
}

fn put_str(buf: &mut Vec<u8>, s: &str) {
    buf.extend_from_slice(&(s.len() as u64).to_le_bytes());
    buf.extend_from_slice(s.as_bytes());
}

fn put_value(buf: &mut Vec<u8>, value: &Value) {
    match value {
        Value::U8(v) => buf.push(*v),
        Value::I8(v) => buf.extend_from_slice(&v.to_le_bytes()),
        Value::U16(v) => buf.extend_from_slice(&v.to_le_bytes()),
        Value::I16(v) => buf.extend_from_slice(&v.to_le_bytes()),
        Value::U32(v) => buf.extend_from_slice(&v.to_le_bytes()),
        Value::I32(v) => buf.extend_from_slice(&v.to_le_bytes()),
        Value::F32(v) => buf.extend_from_slice(&v.to_le_bytes()),
        Value::Bool(v) => buf.push(*v as u8),
        Value::String(s) => put_str(buf, s),
        Value::Array(elem, items) => {
            buf.extend_from_slice(&(*elem as u32).to_le_bytes());
            buf.extend_from_slice(&(items.len() as u64).to_le_bytes());
            for item in items {
                put_value(buf, item);
            }
        }
        Value::U64(v) => buf.extend_from_slice(&v.to_le_bytes()),
        Value::I64(v) => buf.extend_from_slice(&v.to_le_bytes()),
        Value::F64(v) => buf.extend_from_slice(&v.to_le_bytes()),
    }
}

// `ValueType as u32` relies on the enum's explicit discriminants being the GGUF tags.
const _: () = assert!(ValueType::F64 as u32 == 12 && ValueType::Array as u32 == 9);
