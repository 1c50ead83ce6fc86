//! Tests of `toy_core::gguf` against the fixtures gguf-py made (`fixtures/gguf/make_fixtures.py`)
//! and the real SmolLM2-135M Q4_1 model: metadata read back, dequantization bit for bit,
//! quantization byte for byte, writer round trips byte for byte, and hostile inputs to the
//! reader (each refused with the right error, in one line, without a large allocation).

use std::alloc::{GlobalAlloc, Layout, System};
use std::borrow::Cow;
use std::cell::Cell;
use std::collections::BTreeSet;
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use toy_core::gguf::{
    DEQUANT_TYPES, GgmlType, GgufError, GgufFile, GgufWriter, TensorInfo, Value, ValueType,
    dequantize, dequantize_to_vec, quantize, quantize_q4_0, quantize_q8_0, tensor_to_f32,
};

// ------------------------------------------------------------------------ allocation tracking

/// Records, per thread, the largest single allocation, so hostile-input tests can check that
/// the reader refuses a huge count before reserving memory for it.
struct TrackingAlloc;

thread_local! {
    static LARGEST: Cell<usize> = const { Cell::new(0) };
}

fn note_allocation(size: usize) {
    // `try_with`: the allocator may run while the thread's locals are being torn down.
    let _ = LARGEST.try_with(|m| m.set(m.get().max(size)));
}

unsafe impl GlobalAlloc for TrackingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note_allocation(layout.size());
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note_allocation(layout.size());
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note_allocation(new_size);
        unsafe { System.realloc(ptr, layout, new_size) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOCATOR: TrackingAlloc = TrackingAlloc;

/// Run `f` and return its result with the largest single allocation it made on this thread.
fn largest_allocation<T>(f: impl FnOnce() -> T) -> (T, usize) {
    LARGEST.with(|m| m.set(0));
    let out = f();
    (out, LARGEST.with(|m| m.get()))
}

// ------------------------------------------------------------------------ helpers

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../fixtures/gguf")
        .join(name)
}

fn read_fixture(name: &str) -> Vec<u8> {
    let path = fixture(name);
    std::fs::read(&path).unwrap_or_else(|e| {
        panic!(
            "cannot read fixture {}: {e}; regenerate with `python3 fixtures/gguf/make_fixtures.py`",
            path.display()
        )
    })
}

fn open_fixture(name: &str) -> GgufFile {
    GgufFile::open(fixture(name)).unwrap_or_else(|e| panic!("fixture {name}: {e}"))
}

fn read_f32s(name: &str) -> Vec<f32> {
    let bytes = read_fixture(name);
    assert_eq!(bytes.len() % 4, 0, "{name} is not a whole number of f32");
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

fn json_fixture(name: &str) -> serde_json::Value {
    serde_json::from_slice(&read_fixture(name)).unwrap_or_else(|e| panic!("{name}: {e}"))
}

/// A fresh, empty directory for one test's files.
fn temp_dir(test: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("gguf-{test}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Bit patterns, so NaN == NaN and -0.0 != 0.0.
fn same_bits(a: &[f32], b: &[f32]) -> Result<(), String> {
    if a.len() != b.len() {
        return Err(format!("{} values, expected {}", a.len(), b.len()));
    }
    let bad: Vec<usize> = (0..a.len())
        .filter(|&i| a[i].to_bits() != b[i].to_bits())
        .collect();
    match bad.first() {
        None => Ok(()),
        Some(&i) => Err(format!(
            "{} of {} values differ; first at {i}: got {} ({:#010x}), expected {} ({:#010x})",
            bad.len(),
            a.len(),
            a[i],
            a[i].to_bits(),
            b[i],
            b[i].to_bits()
        )),
    }
}

fn same_bytes(got: &[u8], expected: &[u8], what: &str) {
    assert_eq!(got.len(), expected.len(), "{what}: length");
    if let Some(i) = (0..got.len()).find(|&i| got[i] != expected[i]) {
        panic!(
            "{what}: first difference at byte {i}: got {:#04x}, expected {:#04x}",
            got[i], expected[i]
        );
    }
}

/// Metadata values compared with floats by bit pattern.
fn same_value(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::F32(x), Value::F32(y)) => x.to_bits() == y.to_bits(),
        (Value::F64(x), Value::F64(y)) => x.to_bits() == y.to_bits(),
        (Value::Array(ta, xs), Value::Array(tb, ys)) => {
            ta == tb && xs.len() == ys.len() && xs.iter().zip(ys).all(|(x, y)| same_value(x, y))
        }
        _ => a == b,
    }
}

fn value_type_named(name: &str) -> ValueType {
    use ValueType::*;
    match name {
        "U8" => U8,
        "I8" => I8,
        "U16" => U16,
        "I16" => I16,
        "U32" => U32,
        "I32" => I32,
        "F32" => F32,
        "Bool" => Bool,
        "String" => String,
        "Array" => Array,
        "U64" => U64,
        "I64" => I64,
        "F64" => F64,
        other => panic!("unknown value type {other:?} in metadata.json"),
    }
}

/// A value as `make_fixtures.py` describes it in `metadata.json`.
fn value_from_json(j: &serde_json::Value) -> Value {
    let int = || j["value"].as_i64().expect("integer value");
    let uint = || j["value"].as_u64().expect("unsigned value");
    let bits = || j["bits"].as_u64().expect("float bits");
    match j["type"].as_str().expect("type") {
        "U8" => Value::U8(uint().try_into().unwrap()),
        "I8" => Value::I8(int().try_into().unwrap()),
        "U16" => Value::U16(uint().try_into().unwrap()),
        "I16" => Value::I16(int().try_into().unwrap()),
        "U32" => Value::U32(uint().try_into().unwrap()),
        "I32" => Value::I32(int().try_into().unwrap()),
        "U64" => Value::U64(uint()),
        "I64" => Value::I64(int()),
        "F32" => Value::F32(f32::from_bits(bits().try_into().unwrap())),
        "F64" => Value::F64(f64::from_bits(bits())),
        "Bool" => Value::Bool(j["value"].as_bool().unwrap()),
        "String" => Value::String(j["value"].as_str().unwrap().to_string()),
        "Array" => Value::Array(
            value_type_named(j["elem"].as_str().unwrap()),
            j["items"]
                .as_array()
                .unwrap()
                .iter()
                .map(value_from_json)
                .collect(),
        ),
        other => panic!("unknown type {other:?} in metadata.json"),
    }
}

fn ggml_type_named(name: &str) -> GgmlType {
    GgmlType::ALL
        .into_iter()
        .find(|t| t.name() == name)
        .unwrap_or_else(|| panic!("type {name}"))
}

/// Position of the length prefix of the GGUF string `s` (a key or tensor name) in `bytes`,
/// which must contain it exactly once.
fn string_pos(bytes: &[u8], s: &str) -> usize {
    let mut needle = (s.len() as u64).to_le_bytes().to_vec();
    needle.extend_from_slice(s.as_bytes());
    let hits: Vec<usize> = bytes
        .windows(needle.len())
        .enumerate()
        .filter(|(_, w)| *w == needle)
        .map(|(i, _)| i)
        .collect();
    assert_eq!(hits.len(), 1, "{s:?} should occur once in the fixture");
    hits[0]
}

/// Position of the value type tag of metadata key `key`.
fn value_tag_pos(bytes: &[u8], key: &str) -> usize {
    string_pos(bytes, key) + 8 + key.len()
}

/// Positions inside the info of tensor `name`: (n_dims, first dim, type id, offset).
fn tensor_info_pos(bytes: &[u8], name: &str) -> (usize, usize, usize, usize) {
    let n_dims_pos = string_pos(bytes, name) + 8 + name.len();
    let n_dims = u32::from_le_bytes(bytes[n_dims_pos..n_dims_pos + 4].try_into().unwrap()) as usize;
    let dims = n_dims_pos + 4;
    let ty = dims + 8 * n_dims;
    (n_dims_pos, dims, ty, ty + 4)
}

fn put_u32(bytes: &mut [u8], pos: usize, v: u32) {
    bytes[pos..pos + 4].copy_from_slice(&v.to_le_bytes());
}

fn put_u64(bytes: &mut [u8], pos: usize, v: u64) {
    bytes[pos..pos + 8].copy_from_slice(&v.to_le_bytes());
}

fn assert_one_line(err: &GgufError) {
    let msg = err.to_string();
    assert!(!msg.trim().is_empty(), "empty error message for {err:?}");
    assert!(
        !msg.contains('\n') && !msg.contains('\r'),
        "multi-line error message: {msg:?}"
    );
}

/// Parse hostile bytes: must fail, with a one-line message, and without any allocation larger
/// than 1 MiB (the fixtures are a few KB; a reader that trusts a count of 2^60 would try to
/// reserve exabytes).
fn parse_err(bytes: Vec<u8>) -> GgufError {
    let (result, largest) = largest_allocation(|| GgufFile::from_bytes(bytes));
    let err = match result {
        Ok(f) => panic!("hostile input was accepted: {f:?}"),
        Err(e) => e,
    };
    assert!(
        largest < 1 << 20,
        "the reader allocated {largest} bytes at once before failing with: {err}"
    );
    assert_one_line(&err);
    err
}

// ------------------------------------------------------------------------ metadata

#[test]
fn metadata_matches_what_gguf_py_wrote() {
    let file = open_fixture("metadata.gguf");
    let expected: Vec<(String, Value)> = json_fixture("metadata.json")
        .as_array()
        .unwrap()
        .iter()
        .map(|kv| (kv[0].as_str().unwrap().to_string(), value_from_json(&kv[1])))
        .collect();
    assert!(expected.len() >= 35, "metadata.json lost entries");
    assert_eq!(file.metadata.len(), expected.len(), "number of keys");
    for ((key, value), (ekey, evalue)) in file.metadata.iter().zip(&expected) {
        assert_eq!(key, ekey, "keys out of order");
        assert!(
            same_value(value, evalue),
            "{key}: read {value:?}, gguf-py wrote {evalue:?}"
        );
        assert!(
            same_value(file.get(key).unwrap(), evalue),
            "lookup of {key}"
        );
    }
    // Every value type, empty arrays and nested arrays are really in the fixture.
    let mut types = BTreeSet::new();
    for (_, v) in &file.metadata {
        types.insert(format!("{:?}", v.value_type()));
        if let Value::Array(t, items) = v {
            types.insert(format!("array of {t:?}"));
            if items.is_empty() {
                types.insert("empty array".into());
            }
        }
    }
    for t in [
        "U8", "I8", "U16", "I16", "U32", "I32", "F32", "Bool", "String", "U64", "I64", "F64",
    ] {
        assert!(
            types.contains(t) && types.contains(&format!("array of {t}")),
            "no {t} in fixture"
        );
    }
    assert!(types.contains("array of Array") && types.contains("empty array"));

    assert_eq!(file.version, 3);
    assert_eq!(file.alignment, 32);
    assert_eq!(file.architecture().unwrap(), "toytest");
    assert_eq!(file.get_u64("test.u32").unwrap(), Some(u32::MAX as u64));
    assert_eq!(file.get_str("test.ключ.鍵").unwrap(), Some("a unicode key"));
    assert!(matches!(
        file.get_str("test.u8"),
        Err(GgufError::WrongType { .. })
    ));

    let tiny = file.tensor("tiny").expect("tensor tiny");
    assert_eq!(
        (tiny.dims.as_slice(), tiny.ggml_type),
        (&[3u64, 2, 2][..], GgmlType::F32)
    );
    assert_eq!(tiny.shape(), vec![2, 2, 3]);
    let values = tensor_to_f32(&file, tiny).unwrap();
    let expected: Vec<f32> = (0..12).map(|i| i as f32 * 0.25).collect();
    same_bits(&values, &expected).unwrap();
}

// ------------------------------------------------------------------------ dequantization

#[test]
fn dequantize_matches_gguf_py_bit_for_bit() {
    let file = open_fixture("tensors.gguf");
    let index = json_fixture("tensors.json");
    let entries = index.as_array().unwrap();
    let mut covered = BTreeSet::new();
    let mut failures = Vec::new();
    for e in entries {
        let name = e["name"].as_str().unwrap();
        let ty = ggml_type_named(e["type"].as_str().unwrap());
        let dims: Vec<u64> = e["dims"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d.as_u64().unwrap())
            .collect();
        let info = file
            .tensor(name)
            .unwrap_or_else(|| panic!("no tensor {name}"));
        assert_eq!((info.ggml_type, &info.dims), (ty, &dims), "tensor {name}");
        let expected = read_f32s(e["expected"].as_str().unwrap());

        let whole = tensor_to_f32(&file, info).unwrap();
        if let Err(msg) = same_bits(&whole, &expected) {
            failures.push(format!("{ty}: {msg}"));
            continue;
        }
        // Row by row into slices of one buffer, as a loader fills a tensor.
        let data = file.tensor_data(info);
        let row_bytes = ty.row_bytes(dims[0]).unwrap() as usize;
        let mut rows = vec![f32::NAN; whole.len()];
        for (bytes, out) in data
            .chunks(row_bytes)
            .zip(rows.chunks_mut(dims[0] as usize))
        {
            dequantize(ty, bytes, out).unwrap();
        }
        same_bits(&rows, &expected).unwrap_or_else(|m| failures.push(format!("{ty} by rows: {m}")));
        covered.insert(ty.name());
    }
    assert!(
        failures.is_empty(),
        "dequantization differs from gguf-py:\n{}",
        failures.join("\n")
    );
    let wanted: BTreeSet<&str> = DEQUANT_TYPES.iter().map(|t| t.name()).collect();
    assert_eq!(
        covered, wanted,
        "the fixture must hold a tensor of every dequantized type"
    );
}

#[test]
fn dequantize_refuses_unsupported_types_and_bad_lengths() {
    for ty in GgmlType::ALL
        .into_iter()
        .filter(|t| !DEQUANT_TYPES.contains(t))
    {
        let bytes = vec![0u8; ty.type_size() * 4];
        let err = GgufError::from(dequantize_to_vec(ty, &bytes).unwrap_err());
        assert!(matches!(err, GgufError::Unsupported(_)), "{ty}: {err:?}");
        assert!(err.to_string().contains(ty.name()), "{ty}: {err}");
        assert_one_line(&err);
    }

    // A partial block, and an output of the wrong size.
    let err = GgufError::from(dequantize_to_vec(GgmlType::Q4_0, &[0u8; 17]).unwrap_err());
    assert!(matches!(err, GgufError::InvalidArgument(_)), "{err:?}");
    assert!(err.to_string().contains("18-byte blocks"), "{err}");
    let mut out = vec![0.0f32; 31];
    let err = GgufError::from(dequantize(GgmlType::Q4_0, &[0u8; 18], &mut out).unwrap_err());
    assert!(matches!(err, GgufError::InvalidArgument(_)), "{err:?}");
    assert_one_line(&err);
    assert!(dequantize_to_vec(GgmlType::Q6K, &[]).unwrap().is_empty());

    // A tensor of a type toy reads but does not dequantize names the tensor and the type.
    let mut w = GgufWriter::new();
    w.add_tensor("ints", &[4], GgmlType::I32, vec![0u8; 16])
        .unwrap();
    let mut bytes = Vec::new();
    w.write_to(&mut bytes).unwrap();
    let file = GgufFile::from_bytes(bytes).unwrap();
    let err = tensor_to_f32(&file, file.tensor("ints").unwrap()).unwrap_err();
    assert!(matches!(err, GgufError::Unsupported(_)), "{err:?}");
    assert!(
        err.to_string().contains("\"ints\"") && err.to_string().contains("I32"),
        "{err}"
    );

    // A TensorInfo from another file is an error, not an out-of-bounds panic.
    let big = open_fixture("tensors.gguf");
    let foreign = big.tensors.last().unwrap().clone();
    let err = tensor_to_f32(&file, &foreign).unwrap_err();
    assert!(matches!(err, GgufError::BadTensor { .. }), "{err:?}");
    let absurd = TensorInfo {
        dims: vec![u64::MAX / 2, 4],
        ..foreign
    };
    assert!(matches!(
        tensor_to_f32(&file, &absurd),
        Err(GgufError::BadTensor { .. })
    ));
}

// ------------------------------------------------------------------------ quantization

#[test]
fn quantize_matches_gguf_py_byte_for_byte() {
    let input = read_f32s("quant_input.f32");
    assert_eq!(input.len(), 512);
    for (ty, file) in [
        (GgmlType::Q8_0, "quant_input.q8_0.bin"),
        (GgmlType::Q4_0, "quant_input.q4_0.bin"),
        (GgmlType::F16, "quant_input.f16.bin"),
        (GgmlType::BF16, "quant_input.bf16.bin"),
    ] {
        let expected = read_fixture(file);
        same_bytes(
            &quantize(ty, &input).unwrap(),
            &expected,
            &format!("{ty} of quant_input"),
        );
        // Block by block gives the same bytes as the whole slice.
        let by_block: Vec<u8> = input
            .chunks(64)
            .flat_map(|c| quantize(ty, c).unwrap())
            .collect();
        same_bytes(
            &by_block,
            &expected,
            &format!("{ty} of quant_input in pieces"),
        );
    }
    same_bytes(
        &quantize_q8_0(&input).unwrap(),
        &read_fixture("quant_input.q8_0.bin"),
        "quantize_q8_0",
    );
    same_bytes(
        &quantize_q4_0(&input).unwrap(),
        &read_fixture("quant_input.q4_0.bin"),
        "quantize_q4_0",
    );

    // Infinities, NaN, ties, subnormals, overflow and random bit patterns.
    let special = read_f32s("quant_special.f32");
    assert!(special.iter().any(|v| v.is_nan()) && special.iter().any(|v| v.is_infinite()));
    for (ty, file) in [
        (GgmlType::F16, "quant_special.f16.bin"),
        (GgmlType::BF16, "quant_special.bf16.bin"),
    ] {
        same_bytes(
            &quantize(ty, &special).unwrap(),
            &read_fixture(file),
            &format!("{ty} of quant_special"),
        );
    }
}

#[test]
fn quantize_round_trips_and_edge_cases() {
    let input = read_f32s("quant_input.f32");
    // F32 is the identity; F16 and BF16 quantize then dequantize to the nearest representable.
    let f32_bytes = quantize(GgmlType::F32, &input).unwrap();
    same_bits(
        &dequantize_to_vec(GgmlType::F32, &f32_bytes).unwrap(),
        &input,
    )
    .unwrap();
    let f16_back =
        dequantize_to_vec(GgmlType::F16, &quantize(GgmlType::F16, &input).unwrap()).unwrap();
    let expect: Vec<f32> = input
        .iter()
        .map(|&v| half::f16::from_f32(v).to_f32())
        .collect();
    same_bits(&f16_back, &expect).unwrap();

    // Q8_0 and Q4_0 reconstruct each value to within half a step of the block's scale.
    for (ty, bytes) in [
        (GgmlType::Q8_0, quantize_q8_0(&input).unwrap()),
        (GgmlType::Q4_0, quantize_q4_0(&input).unwrap()),
    ] {
        let back = dequantize_to_vec(ty, &bytes).unwrap();
        let blocks = bytes
            .chunks(ty.type_size())
            .zip(input.chunks(32))
            .zip(back.chunks(32));
        let mut checked = 0;
        for (b, ((block, x), y)) in blocks.enumerate() {
            let d = half::f16::from_le_bytes([block[0], block[1]])
                .to_f32()
                .abs();
            // Skip the blocks whose scale is not a normal f16 (the 1e7 block overflows to
            // infinity, the tiny ones become subnormal): there the f16 rounding of d dominates.
            if !d.is_normal() || d < half::f16::MIN_POSITIVE.to_f32() {
                continue;
            }
            let amax = x.iter().map(|v| v.abs()).fold(0.0, f32::max);
            // Half a step, or a whole one for the Q4_0 value clipped from +8 to +7 steps; the
            // f16 rounding of d adds up to 2^-11 of amax.
            let tol = d * if ty == GgmlType::Q4_0 { 1.0 } else { 0.5 } + amax * 1e-3;
            for (xi, yi) in x.iter().zip(y) {
                assert!(
                    (xi - yi).abs() <= tol,
                    "{ty} block {b}: {xi} came back as {yi} (d {d})"
                );
            }
            checked += 1;
        }
        assert!(checked >= 10, "{ty}: only {checked} blocks checked");
    }

    // ggml starts Q4_0's max at +0.0, so an all-zero block has d = +0.0 / -8 = -0.0.
    let zeros = quantize_q4_0(&[-0.0; 32]).unwrap();
    assert_eq!(&zeros[..2], &half::f16::from_f32(-0.0).to_le_bytes());
    assert!(
        zeros[2..].iter().all(|&b| b == 0x88),
        "zero quantizes to 8 in both nibbles"
    );
    assert_eq!(quantize_q8_0(&[0.0; 32]).unwrap(), vec![0u8; 34]);
    // Round half away from zero: amax 127 makes d exactly 1.
    let mut ties = [0.0f32; 32];
    ties[..5].copy_from_slice(&[127.0, 0.5, -0.5, 2.5, -2.5]);
    let q = quantize_q8_0(&ties).unwrap();
    assert_eq!(&q[2..7], &[127u8, 1, (-1i8) as u8, 3, (-3i8) as u8]);

    for ty in [GgmlType::Q4K, GgmlType::Q8_1, GgmlType::I32] {
        let err = GgufError::from(quantize(ty, &[0.0; 256]).unwrap_err());
        assert!(
            matches!(err, GgufError::Unsupported(_)) && err.to_string().contains(ty.name()),
            "{err}"
        );
    }
    for err in [
        GgufError::from(quantize_q8_0(&[1.0; 33]).unwrap_err()),
        GgufError::from(quantize(GgmlType::Q4_0, &[1.0; 31]).unwrap_err()),
    ] {
        assert!(matches!(err, GgufError::InvalidArgument(_)), "{err:?}");
        assert_one_line(&err);
    }
    assert!(quantize_q8_0(&[]).unwrap().is_empty());
}

// ------------------------------------------------------------------------ writer

const GGUF_FIXTURES: [&str; 4] = [
    "metadata.gguf",
    "tensors.gguf",
    "aligned.gguf",
    "no_tensors.gguf",
];

#[test]
fn writer_round_trips_fixtures_byte_for_byte() {
    let dir = temp_dir("round-trip");
    for name in GGUF_FIXTURES {
        let original = read_fixture(name);
        let file = open_fixture(name);

        // Borrowed tensor bytes, straight from the mmap.
        let writer = GgufWriter::from_file_with_tensors(&file).unwrap();
        let mut out = Vec::new();
        let n = writer.write_to(&mut out).unwrap();
        assert_eq!(n, out.len() as u64, "{name}: reported size");
        same_bytes(&out, &original, &format!("{name} rewritten"));

        // Metadata copied, tensors added one by one with owned bytes.
        let mut writer = GgufWriter::from_file(&file);
        assert_eq!(writer.n_tensors(), 0);
        for info in &file.tensors {
            let data = file.tensor_data(info).to_vec();
            writer
                .add_tensor(info.name.clone(), &info.dims, info.ggml_type, data)
                .unwrap();
        }
        let mut out = Vec::new();
        writer.write_to(&mut out).unwrap();
        same_bytes(&out, &original, &format!("{name} rebuilt"));

        // Atomically to disk, replacing an existing file.
        let path = dir.join(name);
        std::fs::write(&path, b"old contents").unwrap();
        writer.write_atomic(&path).unwrap();
        same_bytes(
            &std::fs::read(&path).unwrap(),
            &original,
            &format!("{name} written atomically"),
        );
    }
    let leftovers: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| !GGUF_FIXTURES.contains(&n.as_str()))
        .collect();
    assert!(
        leftovers.is_empty(),
        "temporary files left behind: {leftovers:?}"
    );

    let aligned = open_fixture("aligned.gguf");
    assert_eq!(aligned.alignment, 128);
    assert_eq!(aligned.data_offset % 128, 0);
    assert!(aligned.tensors.iter().all(|t| t.offset % 128 == 0));
    let dims: Vec<usize> = aligned.tensors.iter().map(|t| t.dims.len()).collect();
    assert_eq!(dims, [1, 2, 2, 3, 4]);
    assert!(open_fixture("no_tensors.gguf").tensors.is_empty());
}

#[test]
fn writer_output_reads_back() {
    let input = read_f32s("quant_input.f32");
    let q8 = quantize_q8_0(&input).unwrap();
    let mut w = GgufWriter::new();
    w.set("general.architecture", Value::String("llama".into()))
        .unwrap();
    w.set("general.alignment", Value::U32(64)).unwrap();
    w.set("a.u8", Value::U8(7)).unwrap();
    w.set(
        "a.strings",
        Value::Array(ValueType::String, vec![Value::String("x".into())]),
    )
    .unwrap();
    w.set("a.empty", Value::Array(ValueType::F64, vec![]))
        .unwrap();
    w.add_tensor("w.q8", &[32, 16], GgmlType::Q8_0, Cow::Borrowed(&q8[..]))
        .unwrap();
    w.add_tensor(
        "w.f32",
        &[5],
        GgmlType::F32,
        quantize(GgmlType::F32, &input[..5]).unwrap(),
    )
    .unwrap();
    assert_eq!(w.alignment(), 64);
    let mut bytes = Vec::new();
    w.write_to(&mut bytes).unwrap();

    let file = GgufFile::from_bytes(bytes).unwrap();
    assert_eq!(file.version, 3);
    assert_eq!(file.alignment, 64);
    assert_eq!(file.data_offset % 64, 0);
    assert_eq!(file.bytes().len() % 64, 0, "the last tensor is padded too");
    for (key, value) in w.metadata() {
        assert!(same_value(file.get(key).unwrap(), value), "{key}");
    }
    let keys: Vec<&str> = file.metadata.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(
        keys,
        [
            "general.architecture",
            "general.alignment",
            "a.u8",
            "a.strings",
            "a.empty"
        ]
    );
    let t = file.tensor("w.q8").unwrap();
    assert_eq!(file.tensor_data(t), &q8[..]);
    let back = tensor_to_f32(&file, file.tensor("w.f32").unwrap()).unwrap();
    same_bits(&back, &input[..5]).unwrap();

    // An empty writer makes a valid, empty file.
    let mut bytes = Vec::new();
    GgufWriter::new().write_to(&mut bytes).unwrap();
    let empty = GgufFile::from_bytes(bytes).unwrap();
    assert!(empty.metadata.is_empty() && empty.tensors.is_empty());
}

#[test]
fn writer_set_keeps_order_and_validates() {
    let file = open_fixture("metadata.gguf");
    let mut w = GgufWriter::from_file(&file);
    let before: Vec<String> = w.metadata().iter().map(|(k, _)| k.clone()).collect();
    w.set("test.u16", Value::U16(1)).unwrap();
    w.set("test.string", Value::String("replaced".into()))
        .unwrap();
    let after: Vec<String> = w.metadata().iter().map(|(k, _)| k.clone()).collect();
    assert_eq!(before, after, "replacing a value keeps the key's position");
    assert_eq!(w.get("test.u16"), Some(&Value::U16(1)));
    w.set("zzz.new", Value::Bool(true)).unwrap();
    assert_eq!(w.metadata().last().unwrap().0, "zzz.new");
    assert_eq!(w.remove("test.u8"), Some(Value::U8(255)));
    assert_eq!(w.remove("test.u8"), None);
    assert_eq!(w.metadata().len(), before.len());

    for bad in [
        Value::U32(100),
        Value::U32(0),
        Value::U64(64),
        Value::String("32".into()),
    ] {
        let err = w.set("general.alignment", bad.clone()).unwrap_err();
        assert!(
            matches!(err, GgufError::InvalidArgument(_)),
            "{bad:?}: {err:?}"
        );
        assert_one_line(&err);
    }
    assert!(
        w.get("general.alignment").is_none(),
        "a refused value is not stored"
    );
    let mixed = Value::Array(ValueType::U32, vec![Value::U32(1), Value::I32(2)]);
    assert!(matches!(
        w.set("mixed", mixed),
        Err(GgufError::InvalidArgument(_))
    ));
    let mut deep = Value::Array(ValueType::U8, vec![Value::U8(1)]);
    for _ in 0..4 {
        deep = Value::Array(ValueType::Array, vec![deep]);
    }
    let err = w.set("deep", deep).unwrap_err();
    assert!(err.to_string().contains("nested"), "{err}");
}

#[test]
fn writer_validates_tensors() {
    let mut w = GgufWriter::new();
    w.add_tensor("ok", &[32, 2], GgmlType::Q8_0, vec![0u8; 68])
        .unwrap();
    let cases: Vec<(&str, Vec<u64>, GgmlType, usize, &str)> = vec![
        ("ok", vec![32], GgmlType::Q8_0, 34, "duplicate"),
        ("short", vec![32, 2], GgmlType::Q8_0, 67, "67 bytes"),
        ("partial_block", vec![30], GgmlType::Q8_0, 34, "multiple"),
        ("no_dims", vec![], GgmlType::F32, 0, "dimensions"),
        (
            "five_dims",
            vec![1, 1, 1, 1, 1],
            GgmlType::F32,
            4,
            "dimensions",
        ),
        ("zero", vec![4, 0], GgmlType::F32, 0, "invalid dims"),
        (
            "overflow",
            vec![1 << 40, 1 << 40],
            GgmlType::F32,
            0,
            "overflow",
        ),
    ];
    for (name, dims, ty, len, needle) in cases {
        let err = w.add_tensor(name, &dims, ty, vec![0u8; len]).unwrap_err();
        assert!(
            matches!(err, GgufError::BadTensor { .. }),
            "{name}: {err:?}"
        );
        assert!(err.to_string().contains(needle), "{name}: {err}");
        assert_one_line(&err);
    }
    let long = "x".repeat(64);
    assert!(matches!(
        w.add_tensor(long, &[1], GgmlType::F32, vec![0u8; 4]),
        Err(GgufError::BadTensor { .. })
    ));
    assert_eq!(w.n_tensors(), 1, "refused tensors are not added");
}

#[test]
fn write_atomic_reports_errors_and_cleans_up() {
    let dir = temp_dir("atomic-errors");
    let w = GgufWriter::new();
    let missing = dir.join("no/such/dir/out.gguf");
    let err = w.write_atomic(&missing).unwrap_err();
    assert!(matches!(err, GgufError::Write { .. }), "{err:?}");
    assert!(err.to_string().contains("out.gguf"), "{err}");
    assert_one_line(&err);
    // Renaming over a directory fails after the data is written: the temporary file goes.
    let target = dir.join("a_directory");
    std::fs::create_dir(&target).unwrap();
    std::fs::write(target.join("keep"), b"x").unwrap();
    assert!(matches!(
        w.write_atomic(&target),
        Err(GgufError::Write { .. })
    ));
    let names: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, ["a_directory"], "temporary file left behind");

    struct Failing;
    impl Write for Failing {
        fn write(&mut self, _: &[u8]) -> io::Result<usize> {
            Err(io::Error::other("disk full"))
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }
    let err = w.write_to(Failing).unwrap_err();
    assert!(
        matches!(err, GgufError::Write { .. }) && err.to_string().contains("disk full"),
        "{err}"
    );
}

// ------------------------------------------------------------------------ the real model

/// A `Write` that compares what it is given with the expected bytes instead of storing them.
struct CompareSink<'a> {
    expected: &'a [u8],
    pos: usize,
    first_difference: Option<usize>,
}

impl Write for CompareSink<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if self.first_difference.is_none() {
            let rest = self.expected.get(self.pos..).unwrap_or(&[]);
            let common = rest.len().min(buf.len());
            if let Some(i) = (0..common).find(|&i| rest[i] != buf[i]) {
                self.first_difference = Some(self.pos + i);
            } else if buf.len() > rest.len() {
                self.first_difference = Some(self.expected.len());
            }
        }
        self.pos += buf.len();
        Ok(buf.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

fn real_model() -> GgufFile {
    let home = std::env::var_os("HOME").expect("HOME is not set");
    let path = Path::new(&home).join(".cache/toy-models/SmolLM2-135M-Instruct.Q4_1.gguf");
    if !path.exists() {
        panic!(
            "{} is missing: run scripts/fetch-smollm2.sh to download it",
            path.display()
        );
    }
    GgufFile::open(&path).unwrap()
}

#[test]
fn real_model_round_trips_byte_for_byte() {
    let file = real_model();
    let writer = GgufWriter::from_file_with_tensors(&file).unwrap();
    let mut sink = CompareSink {
        expected: file.bytes(),
        pos: 0,
        first_difference: None,
    };
    let n = writer.write_to(&mut sink).unwrap();
    assert_eq!(
        sink.first_difference, None,
        "the rewritten model differs from the original"
    );
    assert_eq!(
        (n, sink.pos),
        (file.bytes().len() as u64, file.bytes().len())
    );
}

#[test]
fn real_model_dequantizes() {
    let file = real_model();
    let mut types = BTreeSet::new();
    let mut total = 0u64;
    for info in &file.tensors {
        let values = tensor_to_f32(&file, info).unwrap();
        assert_eq!(values.len() as u64, info.n_elements(), "{}", info.name);
        assert!(
            values.iter().all(|v| v.is_finite()),
            "{} has non-finite values",
            info.name
        );
        types.insert(info.ggml_type.name());
        total += values.len() as u64;
    }
    assert_eq!(types, BTreeSet::from(["F32", "Q4_1", "Q8_0"]));
    assert!(total > 130_000_000, "{total} parameters");
}

// ------------------------------------------------------------------------ hostile inputs

#[test]
fn truncated_files_are_refused() {
    let original = read_fixture("metadata.gguf");
    let file = GgufFile::from_bytes(original.clone()).unwrap();
    let tiny = file.tensor("tiny").unwrap();
    let data_end = (file.data_offset + tiny.offset + tiny.n_bytes()) as usize;
    let last_key = value_tag_pos(&original, "test.array.empty_strings");
    let (_, tiny_dims, _, _) = tensor_info_pos(&original, "tiny");
    // Tag, element type, count, then "a" (8 + 1 bytes), "" (8), and 3 bytes into "ünïcödé".
    let in_string = value_tag_pos(&original, "test.array.string") + 4 + 4 + 8 + 9 + 8 + 8 + 3;

    let cuts: [(usize, &str); 8] = [
        (0, "magic"),
        (2, "magic"),
        (6, "version"),
        (20, "metadata count"),
        (last_key + 4 + 4 + 3, "test.array.empty_strings"), // inside the array count
        (tiny_dims + 5, "tensor dim"),                      // inside the tensor infos
        (file.data_offset as usize + 5, "data of tensor \"tiny\""),
        (data_end - 1, "data of tensor \"tiny\""),
    ];
    for (cut, what_expected) in cuts {
        match parse_err(original[..cut].to_vec()) {
            GgufError::Truncated { what, have, .. } => {
                assert!(what.contains(what_expected), "cut at {cut}: {what:?}");
                assert_eq!(have, cut as u64);
            }
            other => panic!("cut at {cut}: expected Truncated, got {other:?}"),
        }
    }
    // Cut inside a string, the declared length is more than what is left: TooLarge, and the
    // message says the file may be truncated.
    let err = parse_err(original[..in_string].to_vec());
    assert!(matches!(err, GgufError::TooLarge { .. }), "{err:?}");
    assert!(err.to_string().contains("truncated"), "{err}");

    let dir = temp_dir("truncated");
    let empty = dir.join("empty.gguf");
    std::fs::write(&empty, b"").unwrap();
    let err = GgufFile::open(&empty).unwrap_err();
    assert!(
        matches!(&err, GgufError::Truncated { what, have: 0, .. } if what == "magic"),
        "{err:?}"
    );
    assert_one_line(&err);
}

#[test]
fn wrong_magic_is_refused() {
    let mut bytes = read_fixture("metadata.gguf");
    bytes[..4].copy_from_slice(b"GGML");
    let err = parse_err(bytes);
    assert!(
        matches!(err, GgufError::BadMagic(m) if &m == b"GGML"),
        "{err:?}"
    );
    assert!(err.to_string().contains("not a GGUF file"), "{err}");
}

#[test]
fn big_endian_and_unknown_versions_are_refused() {
    let original = read_fixture("metadata.gguf");
    let mut bytes = original.clone();
    bytes[4..8].copy_from_slice(&3u32.to_be_bytes());
    assert!(matches!(parse_err(bytes), GgufError::BigEndian));
    for version in [0u32, 1, 4, 0xFFFF_FFFF] {
        let mut bytes = original.clone();
        put_u32(&mut bytes, 4, version);
        assert!(matches!(parse_err(bytes), GgufError::UnsupportedVersion(v) if v == version));
    }
}

#[test]
fn huge_counts_fail_fast_without_allocating() {
    let original = read_fixture("metadata.gguf");
    let huge = 1u64 << 60;
    let patched = |pos: usize, v: u64| {
        let mut bytes = original.clone();
        put_u64(&mut bytes, pos, v);
        bytes
    };
    let cases = [
        // Counts small enough that reserving for them would succeed (and show up as a large
        // allocation) but still more than the file could hold.
        (8, 1 << 20, "tensor count"),
        (16, 1 << 20, "metadata count"),
        (
            value_tag_pos(&original, "test.array.u8") + 8,
            1 << 20,
            "test.array.u8",
        ),
        (8, huge, "tensor count"),
        (8, u64::MAX, "tensor count"),
        (16, huge, "metadata count"),
        (24, huge, "metadata key length"), // first key's length
        (
            value_tag_pos(&original, "test.string") + 4,
            huge,
            "test.string",
        ), // a string value
        (
            value_tag_pos(&original, "test.array.u8") + 8,
            huge,
            "test.array.u8",
        ), // array count
        (
            value_tag_pos(&original, "test.array.nested") + 8,
            u64::MAX,
            "test.array.nested",
        ),
        (
            value_tag_pos(&original, "test.array.string") + 8 + 8,
            huge,
            "test.array.string",
        ), // an item
    ];
    for (pos, value, what_expected) in cases {
        match parse_err(patched(pos, value)) {
            GgufError::TooLarge { what, count, .. } => {
                assert!(
                    what.contains(what_expected),
                    "{what:?} should mention {what_expected}"
                );
                assert_eq!(count, value);
            }
            other => panic!("{what_expected} = {value}: expected TooLarge, got {other:?}"),
        }
    }
    // A dim so large that the tensor's size overflows.
    let (_, dims, _, _) = tensor_info_pos(&original, "tiny");
    let err = parse_err(patched(dims, 1 << 62));
    assert!(
        matches!(&err, GgufError::BadTensor { reason, .. } if reason.contains("overflow")),
        "{err:?}"
    );
}

#[test]
fn unknown_value_types_are_refused() {
    let original = read_fixture("metadata.gguf");
    let mut bytes = original.clone();
    put_u32(&mut bytes, value_tag_pos(&original, "test.u8"), 13);
    let err = parse_err(bytes);
    assert!(
        matches!(&err, GgufError::UnknownValueType { key, tag: 13 } if key == "test.u8"),
        "{err:?}"
    );

    // The element type of an array.
    let mut bytes = original.clone();
    put_u32(
        &mut bytes,
        value_tag_pos(&original, "test.array.i16") + 4,
        99,
    );
    let err = parse_err(bytes);
    assert!(
        matches!(&err, GgufError::UnknownValueType { key, tag: 99 } if key == "test.array.i16"),
        "{err:?}"
    );
}

#[test]
fn unknown_tensor_types_are_refused() {
    let original = read_fixture("tensors.gguf");
    for id in [4u32, 5, 31, 1000] {
        let mut bytes = original.clone();
        let (_, _, ty, _) = tensor_info_pos(&original, "q4_0");
        put_u32(&mut bytes, ty, id);
        match parse_err(bytes) {
            GgufError::UnsupportedTensorType { name, type_id } => {
                assert_eq!((name.as_str(), type_id), ("q4_0", id));
            }
            other => panic!("type id {id}: expected UnsupportedTensorType, got {other:?}"),
        }
    }
}

#[test]
fn tensor_offsets_beyond_the_file_are_refused() {
    let original = read_fixture("tensors.gguf");
    let (_, _, _, offset) = tensor_info_pos(&original, "q8_k");
    for bad in [1u64 << 40, u64::MAX - 31] {
        let mut bytes = original.clone();
        put_u64(&mut bytes, offset, bad);
        match parse_err(bytes) {
            GgufError::Truncated { what, .. } => assert!(what.contains("q8_k"), "{what}"),
            other => panic!("offset {bad}: expected Truncated, got {other:?}"),
        }
    }
    // Inside the file but not aligned.
    let mut bytes = original.clone();
    let good = u64::from_le_bytes(original[offset..offset + 8].try_into().unwrap());
    put_u64(&mut bytes, offset, good + 1);
    let err = parse_err(bytes);
    assert!(
        matches!(&err, GgufError::BadTensor { name, .. } if name == "q8_k"),
        "{err:?}"
    );
}

#[test]
fn missing_files_and_directories_are_refused() {
    let dir = temp_dir("missing");
    let missing = dir.join("does-not-exist.gguf");
    let err = GgufFile::open(&missing).unwrap_err();
    match &err {
        GgufError::Io { source, .. } => assert_eq!(source.kind(), io::ErrorKind::NotFound),
        other => panic!("expected Io, got {other:?}"),
    }
    assert!(err.to_string().contains("does-not-exist.gguf"), "{err}");
    assert_one_line(&err);

    let err = GgufFile::open(&dir).unwrap_err();
    assert!(matches!(err, GgufError::Io { .. }), "{err:?}");
    assert!(err.to_string().contains("directory"), "{err}");
    assert_one_line(&err);
}

#[test]
fn other_corruptions_are_refused() {
    let meta = read_fixture("metadata.gguf");
    let patch = |f: &dyn Fn(&mut Vec<u8>)| {
        let mut bytes = meta.clone();
        f(&mut bytes);
        parse_err(bytes)
    };

    let bool_pos = value_tag_pos(&meta, "test.bool.true") + 4;
    let err = patch(&|b| b[bool_pos] = 2);
    assert!(
        matches!(err, GgufError::Invalid(_)) && err.to_string().contains("test.bool.true"),
        "{err}"
    );

    let key = string_pos(&meta, "test.u8") + 8;
    let err = patch(&|b| b[key] = 0xFF);
    assert!(matches!(err, GgufError::InvalidUtf8(_)), "{err:?}");

    // "test.u8" becomes "test.i8", which comes next.
    let err = patch(&|b| b[key + 5] = b'i');
    assert!(
        matches!(&err, GgufError::DuplicateKey(k) if k == "test.i8"),
        "{err:?}"
    );

    // A key holding a newline is escaped: the message stays on one line.
    let err = patch(&|b| {
        b[key + 4] = b'\n';
        put_u32(b, key + 7, 13);
    });
    assert!(
        matches!(&err, GgufError::UnknownValueType { key, .. } if key == "test\nu8"),
        "{err:?}"
    );

    let (n_dims, dims, _, _) = tensor_info_pos(&meta, "tiny");
    for bad_n in [0u32, 5] {
        let err = patch(&|b| put_u32(b, n_dims, bad_n));
        assert!(
            matches!(&err, GgufError::BadTensor { reason, .. } if reason.contains("dimensions")),
            "{err:?}"
        );
    }
    let err = patch(&|b| put_u64(b, dims, 0));
    assert!(
        matches!(&err, GgufError::BadTensor { name, .. } if name == "tiny"),
        "{err:?}"
    );

    let tensors = read_fixture("tensors.gguf");
    let (_, q4_dims, _, _) = tensor_info_pos(&tensors, "q4_0");
    let mut bytes = tensors.clone();
    put_u64(&mut bytes, q4_dims, 100);
    let err = parse_err(bytes);
    assert!(
        matches!(&err, GgufError::BadTensor { reason, .. } if reason.contains("multiple of")),
        "{err:?}"
    );

    let aligned = read_fixture("aligned.gguf");
    let pos = value_tag_pos(&aligned, "general.alignment") + 4;
    assert_eq!(
        u32::from_le_bytes(aligned[pos..pos + 4].try_into().unwrap()),
        128
    );
    for bad in [0u32, 100] {
        let mut bytes = aligned.clone();
        put_u32(&mut bytes, pos, bad);
        let err = parse_err(bytes);
        assert!(
            matches!(&err, GgufError::Invalid(m) if m.contains("general.alignment")),
            "{err:?}"
        );
    }
}
