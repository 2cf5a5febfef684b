//! GGUF format tests without real models: reading a file the Python `gguf`
//! writer produced, writer round trips, every hostile-input error kind, the
//! bounded random-mutation smoke test (the fuzz targets are in fuzz/), and
//! safetensors import.

use std::path::PathBuf;

use mirage_gguf::{
    GgmlType, GgufError, GgufFile, GgufWriter, Metadata, SafetensorsFile, Value, ValueType,
    MAX_ARRAY_DEPTH,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn fixture_path(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

// ---------------------------------------------------------------------------
// A file written by gguf-py (an independent implementation).

#[test]
fn reads_file_written_by_python_gguf() {
    let f = GgufFile::open(fixture_path("tiny_py.gguf")).unwrap();
    let md = f.metadata();
    assert_eq!(f.version(), 3);
    assert_eq!(md.len(), 16);
    assert_eq!(md.get_str("general.architecture"), Some("llama"));
    assert_eq!(md.get("t.u8"), Some(&Value::U8(200)));
    assert_eq!(md.get("t.i8"), Some(&Value::I8(-100)));
    assert_eq!(md.get("t.u16"), Some(&Value::U16(60000)));
    assert_eq!(md.get("t.i16"), Some(&Value::I16(-30000)));
    assert_eq!(md.get("t.u32"), Some(&Value::U32(4_000_000_000)));
    assert_eq!(md.get("t.i32"), Some(&Value::I32(-2_000_000_000)));
    assert_eq!(md.get("t.u64"), Some(&Value::U64((1 << 63) + 5)));
    assert_eq!(md.get("t.i64"), Some(&Value::I64(-(1 << 62))));
    assert_eq!(md.get("t.f32"), Some(&Value::F32(0.15625)));
    assert_eq!(md.get("t.f64"), Some(&Value::F64(-1e300)));
    assert_eq!(md.get_bool("t.bool"), Some(true));
    assert_eq!(md.get_str("t.str"), Some("héllo ✓"));
    assert_eq!(md.get_str_array("t.strs"), Some(vec!["a", "", "ü"]));
    assert_eq!(md.get_f32_array("t.f32s"), Some(vec![0.5, -1.5]));
    assert_eq!(md.get_u64("t.u8"), Some(200));
    assert_eq!(md.get_u64("t.i8"), None, "negative is not a u64");
    assert_eq!(md.get_f32("t.f64"), Some(-1e300f64 as f32));
    let nested = md.get_array("t.nested").unwrap();
    assert_eq!(nested.elem_type, ValueType::Array);
    let inner: Vec<Vec<i64>> = nested
        .values
        .iter()
        .map(|v| {
            v.as_array()
                .unwrap()
                .values
                .iter()
                .map(|x| x.as_i64().unwrap())
                .collect()
        })
        .collect();
    assert_eq!(inner, vec![vec![1, 2], vec![3], vec![4, 5, 6]]);

    let names: Vec<&str> = f.tensors().iter().map(|t| t.name.as_str()).collect();
    assert_eq!(names, ["a.f32", "b.f16", "c.q8_0"]);
    let a = f.tensor("a.f32").unwrap();
    assert_eq!(
        (a.info.ty, a.info.dims.as_slice(), a.info.offset),
        (GgmlType::F32, &[4u64, 2][..], 0)
    );
    assert_eq!(
        a.data,
        f32_bytes(&[-3.5, -2.5, -1.5, -0.5, 0.5, 1.5, 2.5, 3.5])
    );
    let b = f.tensor("b.f16").unwrap();
    let b_vals: Vec<f32> = b
        .data
        .chunks(2)
        .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
        .collect();
    assert_eq!(b_vals, [1.0, -2.0, 0.25, 1024.0]);
    let c = f.tensor("c.q8_0").unwrap();
    assert_eq!(
        (c.info.ty, c.info.dims.as_slice(), c.info.offset),
        (GgmlType::Q8_0, &[32u64, 2][..], 64)
    );
    assert_eq!(c.data.len(), 68);
    // Dequantized through crate::quant: exact for F32/F16, within half a
    // Q8_0 step (scale = max|x| / 127 = 4 / 127) of what Python quantized.
    assert_eq!(
        a.to_f32().unwrap(),
        [-3.5, -2.5, -1.5, -0.5, 0.5, 1.5, 2.5, 3.5]
    );
    assert_eq!(b.to_f32().unwrap(), [1.0, -2.0, 0.25, 1024.0]);
    let c_vals = c.to_f32().unwrap();
    assert_eq!(c_vals.len(), 64);
    for (i, v) in c_vals.iter().enumerate() {
        let want = i as f32 / 8.0 - 4.0;
        assert!(
            (v - want).abs() <= 0.5 * 4.0 / 127.0 + 1e-3,
            "c[{i}] = {v}, want {want}"
        );
    }
    assert!(f.tensor("missing").is_none());

    // Our writer reproduces the Python writer's bytes exactly.
    let mut out = Vec::new();
    GgufWriter::from_gguf(&f).write_to(&mut out).unwrap();
    assert_eq!(out, f.as_bytes());
}

// ---------------------------------------------------------------------------
// Writer round trips.

/// Metadata with every value type, nested and empty arrays.
fn every_value_metadata() -> Metadata {
    let mut md = Metadata::new();
    md.insert("general.architecture", Value::String("llama".into()));
    md.insert("k.u8", Value::U8(7));
    md.insert("k.i8", Value::I8(-7));
    md.insert("k.u16", Value::U16(65535));
    md.insert("k.i16", Value::I16(i16::MIN));
    md.insert("k.u32", Value::U32(u32::MAX));
    md.insert("k.i32", Value::I32(i32::MIN));
    md.insert("k.u64", Value::U64(u64::MAX));
    md.insert("k.i64", Value::I64(i64::MIN));
    md.insert("k.f32", Value::F32(f32::MIN_POSITIVE));
    md.insert("k.f64", Value::F64(std::f64::consts::PI));
    md.insert("k.bool", Value::Bool(false));
    md.insert("k.str", Value::String(String::new()));
    md.insert("k.strs", Value::string_array(["x", "yy", "zzz"]));
    md.insert("k.empty", Value::array(ValueType::F64, vec![]));
    md.insert(
        "k.nested",
        Value::array(
            ValueType::Array,
            vec![
                Value::array(ValueType::String, vec![Value::String("deep".into())]),
                Value::array(ValueType::String, vec![]),
            ],
        ),
    );
    md
}

/// A small valid file: two tensors (F32 [4, 2] then Q8_0 [32, 2]).
fn small_file(alignment: Option<u32>) -> Vec<u8> {
    let mut md = every_value_metadata();
    if let Some(a) = alignment {
        md.insert("general.alignment", Value::U32(a));
    }
    let mut w = GgufWriter::new(md);
    w.add_tensor(
        "t.aa",
        vec![4, 2],
        GgmlType::F32,
        f32_bytes(&[1., 2., 3., 4., 5., 6., 7., 8.]),
    )
    .unwrap();
    let q8: Vec<u8> = (0..68u8).collect();
    w.add_tensor("t.ab", vec![32, 2], GgmlType::Q8_0, q8)
        .unwrap();
    let mut out = Vec::new();
    let n = w.write_to(&mut out).unwrap();
    assert_eq!(n as usize, out.len());
    out
}

#[test]
fn writer_round_trips_every_value_type() {
    for alignment in [None, Some(64), Some(1)] {
        let bytes = small_file(alignment);
        let f = GgufFile::from_bytes(bytes.clone()).unwrap();
        let mut want = every_value_metadata();
        if let Some(a) = alignment {
            want.insert("general.alignment", Value::U32(a));
        }
        assert_eq!(f.metadata(), &want);
        let a = alignment.unwrap_or(32) as u64;
        assert_eq!(f.alignment(), a);
        assert_eq!(f.data_offset() % a, 0);
        assert_eq!(f.tensors()[1].offset, 32u64.div_ceil(a) * a);
        assert_eq!(
            f.tensor("t.aa").unwrap().data,
            f32_bytes(&[1., 2., 3., 4., 5., 6., 7., 8.])
        );
        assert_eq!(
            f.tensor("t.ab").unwrap().data,
            (0..68u8).collect::<Vec<_>>()
        );
        let mut again = Vec::new();
        GgufWriter::from_gguf(&f).write_to(&mut again).unwrap();
        assert_eq!(again, bytes, "rewrite must be byte-identical");
    }
}

#[test]
fn writer_writes_atomically_to_a_path() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.gguf");
    std::fs::write(&path, b"old contents").unwrap();
    let f = GgufFile::from_bytes(small_file(None)).unwrap();
    GgufWriter::from_gguf(&f).write_to_path(&path).unwrap();
    assert_eq!(std::fs::read(&path).unwrap(), f.as_bytes());
    let entries: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(
        entries.len(),
        1,
        "no temporary file may remain: {entries:?}"
    );
    // A failing write leaves the old file and no temporary behind.
    let missing_dir = dir.path().join("nope").join("m.gguf");
    let err = GgufWriter::from_gguf(&f)
        .write_to_path(&missing_dir)
        .unwrap_err();
    assert!(matches!(err, GgufError::Io { .. }), "{err}");
    // An empty file on disk is a truncation error, not a panic.
    let empty = dir.path().join("empty.gguf");
    std::fs::write(&empty, b"").unwrap();
    assert!(matches!(
        GgufFile::open(&empty),
        Err(GgufError::Truncated { offset: 0, .. })
    ));
    assert!(matches!(
        GgufFile::open(dir.path().join("absent")),
        Err(GgufError::Io { .. })
    ));
}

#[test]
fn writer_rejects_inconsistent_input() {
    let mut w = GgufWriter::new(Metadata::new());
    let bad_len = w.add_tensor("x", vec![4], GgmlType::F32, vec![0u8; 15]);
    assert!(matches!(bad_len, Err(GgufError::InvalidInput(_))));
    let bad_block = w.add_tensor("x", vec![33], GgmlType::Q8_0, vec![0u8; 34]);
    assert!(matches!(bad_block, Err(GgufError::InvalidInput(_))));
    w.add_tensor("x", vec![4], GgmlType::F32, vec![0u8; 16])
        .unwrap();
    assert!(matches!(
        w.add_tensor("x", vec![4], GgmlType::F32, vec![0u8; 16]),
        Err(GgufError::InvalidInput(_))
    ));
    w.metadata_mut().insert(
        "mixed",
        Value::array(ValueType::U8, vec![Value::U8(1), Value::I8(1)]),
    );
    assert!(matches!(
        w.write_to(Vec::new()),
        Err(GgufError::InvalidInput(_))
    ));
    w.metadata_mut().remove("mixed");
    w.metadata_mut().insert("general.alignment", Value::U32(48));
    assert!(matches!(
        w.write_to(Vec::new()),
        Err(GgufError::InvalidInput(_))
    ));
    w.metadata_mut().insert("general.alignment", Value::U32(16));
    assert!(w.write_to(Vec::new()).is_ok());
}

// ---------------------------------------------------------------------------
// Hostile input. Each test corrupts a valid file at a known field.

/// Byte offsets of the fields of `small_file(None)` that the tests corrupt.
struct Layout {
    bytes: Vec<u8>,
    /// The first KV pair (its key length field).
    first_kv: usize,
    /// The first KV's value type field.
    first_kv_type: usize,
    /// Tensor info of "t.ab" (its name length field).
    info_ab: usize,
    /// Tensor info of "t.aa".
    info_aa: usize,
}

impl Layout {
    fn new() -> Layout {
        let bytes = small_file(None);
        let find = |needle: &[u8]| {
            bytes
                .windows(needle.len())
                .rposition(|w| w == needle)
                .unwrap()
        };
        let mut name = 4u64.to_le_bytes().to_vec();
        name.extend_from_slice(b"t.ab");
        let info_ab = find(&name);
        name.truncate(8);
        name.extend_from_slice(b"t.aa");
        let info_aa = find(&name);
        let first_kv = 24;
        let key_len = u64::from_le_bytes(bytes[24..32].try_into().unwrap()) as usize;
        Layout {
            bytes,
            first_kv,
            first_kv_type: first_kv + 8 + key_len,
            info_ab,
            info_aa,
        }
    }

    // "t.ab" info: name(8+4) n_dims(4) dims(2*8) type(4) offset(8).
    fn ab_dims(&self) -> usize {
        self.info_ab + 12 + 4
    }
    fn ab_type(&self) -> usize {
        self.ab_dims() + 16
    }
    fn ab_offset(&self) -> usize {
        self.ab_type() + 4
    }

    fn with(&self, at: usize, patch: &[u8]) -> Vec<u8> {
        let mut b = self.bytes.clone();
        b[at..at + patch.len()].copy_from_slice(patch);
        b
    }
}

fn parse_err(bytes: Vec<u8>) -> GgufError {
    match GgufFile::from_bytes(bytes) {
        Ok(f) => panic!("corrupt file parsed: {f:?}"),
        Err(e) => e,
    }
}

fn assert_names_offset(e: &GgufError, offset: usize) {
    let msg = e.to_string();
    assert!(
        msg.contains(&format!("byte offset {offset}")),
        "message {msg:?} does not name byte offset {offset}"
    );
}

#[test]
fn every_truncation_is_an_error_not_a_panic() {
    let l = Layout::new();
    let f = GgufFile::from_bytes(l.bytes.clone()).unwrap();
    let last = f.tensors().last().unwrap();
    let data_end = (f.data_offset() + last.offset + last.n_bytes()) as usize;
    for len in 0..l.bytes.len() {
        let r = GgufFile::from_bytes(l.bytes[..len].to_vec());
        if len < data_end {
            assert!(r.is_err(), "prefix of {len} bytes parsed");
        } else {
            // Only trailing padding is missing: every tensor is in bounds.
            assert!(r.is_ok(), "prefix of {len} bytes: {:?}", r.err());
        }
    }
    assert!(matches!(
        parse_err(l.bytes[..10].to_vec()),
        GgufError::Truncated {
            offset: 8,
            needed: 8
        }
    ));
}

#[test]
fn bad_magic() {
    let l = Layout::new();
    let e = parse_err(l.with(0, b"GGML"));
    assert!(
        matches!(e, GgufError::BadMagic { found } if &found == b"GGML"),
        "{e}"
    );
    assert_names_offset(&e, 0);
}

#[test]
fn unsupported_versions() {
    let l = Layout::new();
    for (v, hint) in [(1u32, "v1"), (99, ""), (3u32.swap_bytes(), "big-endian")] {
        let e = parse_err(l.with(4, &v.to_le_bytes()));
        assert!(
            matches!(e, GgufError::UnsupportedVersion { version, .. } if version == v),
            "{e}"
        );
        assert_names_offset(&e, 4);
        assert!(e.to_string().contains(hint), "{e}");
    }
    // Version 2 has the same layout and is read.
    let f = GgufFile::from_bytes(l.with(4, &2u32.to_le_bytes())).unwrap();
    assert_eq!(f.version(), 2);
}

#[test]
fn absurd_counts() {
    let l = Layout::new();
    let e = parse_err(l.with(8, &u64::MAX.to_le_bytes()));
    assert!(
        matches!(
            e,
            GgufError::AbsurdCount {
                what: "tensor",
                count: u64::MAX,
                offset: 8
            }
        ),
        "{e}"
    );
    assert_names_offset(&e, 8);
    let e = parse_err(l.with(16, &u64::MAX.to_le_bytes()));
    assert!(
        matches!(
            e,
            GgufError::AbsurdCount {
                what: "metadata KV",
                count: u64::MAX,
                offset: 16
            }
        ),
        "{e}"
    );
    assert_names_offset(&e, 16);
    // Plausible-looking but still too many for the bytes left.
    let e = parse_err(l.with(8, &1_000_000u64.to_le_bytes()));
    assert!(
        matches!(e, GgufError::AbsurdCount { what: "tensor", .. }),
        "{e}"
    );
    // An array length of u64::MAX: the "k.strs" array's count field.
    let key = b"k.strs";
    let at = l.bytes.windows(key.len()).position(|w| w == key).unwrap() + key.len() + 4 + 4;
    let e = parse_err(l.with(at, &u64::MAX.to_le_bytes()));
    assert!(
        matches!(e, GgufError::AbsurdCount { what: "array element", offset, .. } if offset == at as u64),
        "{e}"
    );
    assert_names_offset(&e, at);
    // Too many dims.
    let e = parse_err(l.with(l.info_ab + 12, &5u32.to_le_bytes()));
    assert!(
        matches!(
            e,
            GgufError::AbsurdCount {
                what: "tensor dim",
                count: 5,
                ..
            }
        ),
        "{e}"
    );
    assert_names_offset(&e, l.info_ab + 12);
}

#[test]
fn string_length_of_2_pow_60() {
    let l = Layout::new();
    let e = parse_err(l.with(l.first_kv, &(1u64 << 60).to_le_bytes()));
    assert!(
        matches!(e, GgufError::StringTooLong { offset: 24, len, .. } if len == 1 << 60),
        "{e}"
    );
    assert_names_offset(&e, 24);
    // Same in a tensor name.
    let e = parse_err(l.with(l.info_ab, &(1u64 << 60).to_le_bytes()));
    assert!(
        matches!(e, GgufError::StringTooLong { offset, .. } if offset == l.info_ab as u64),
        "{e}"
    );
}

#[test]
fn invalid_utf8() {
    let l = Layout::new();
    let e = parse_err(l.with(l.first_kv + 8, &[0xff]));
    assert!(matches!(e, GgufError::InvalidUtf8 { offset: 32 }), "{e}");
    assert_names_offset(&e, 32);
}

/// An array nested `depth` levels deep (depth 1 = a plain array).
fn nested(depth: usize) -> Value {
    let mut v = Value::array(ValueType::U8, vec![Value::U8(1)]);
    for _ in 1..depth {
        v = Value::array(ValueType::Array, vec![v]);
    }
    v
}

#[test]
fn arrays_nested_too_deep() {
    let write = |v: Value| {
        let mut md = Metadata::new();
        md.insert("deep", v);
        let mut out = Vec::new();
        GgufWriter::new(md).write_to(&mut out).unwrap();
        out
    };
    let ok = GgufFile::from_bytes(write(nested(MAX_ARRAY_DEPTH))).unwrap();
    assert_eq!(ok.metadata().get("deep"), Some(&nested(MAX_ARRAY_DEPTH)));
    let e = parse_err(write(nested(MAX_ARRAY_DEPTH + 1)));
    // Header 24 + key (8 + 4) + type 4, then 8 levels of (elem type 4 + count 8).
    let deepest = 24 + 12 + 4 + MAX_ARRAY_DEPTH * 12;
    assert!(
        matches!(e, GgufError::NestingTooDeep { offset, .. } if offset == deepest as u64),
        "{e}"
    );
    assert_names_offset(&e, deepest);
    // A hostile file nesting a million levels: bounded, no stack overflow.
    let mut b = Vec::new();
    b.extend_from_slice(b"GGUF");
    b.extend_from_slice(&3u32.to_le_bytes());
    b.extend_from_slice(&0u64.to_le_bytes());
    b.extend_from_slice(&1u64.to_le_bytes());
    b.extend_from_slice(&1u64.to_le_bytes());
    b.push(b'k');
    b.extend_from_slice(&9u32.to_le_bytes());
    for _ in 0..1_000_000 {
        b.extend_from_slice(&9u32.to_le_bytes());
        b.extend_from_slice(&1u64.to_le_bytes());
    }
    assert!(matches!(parse_err(b), GgufError::NestingTooDeep { .. }));
}

#[test]
fn unknown_value_type() {
    let l = Layout::new();
    let e = parse_err(l.with(l.first_kv_type, &13u32.to_le_bytes()));
    assert!(
        matches!(e, GgufError::UnknownValueType { id: 13, offset } if offset == l.first_kv_type as u64),
        "{e}"
    );
    assert_names_offset(&e, l.first_kv_type);
}

#[test]
fn unknown_tensor_type() {
    let l = Layout::new();
    let e = parse_err(l.with(l.ab_type(), &4u32.to_le_bytes()));
    assert!(
        matches!(&e, GgufError::UnknownTensorType { name, id: 4, offset } if name == "t.ab" && *offset == l.ab_type() as u64),
        "{e}"
    );
    assert_names_offset(&e, l.ab_type());
}

#[test]
fn bad_shapes() {
    let l = Layout::new();
    // Element count overflows u64.
    let mut dims = (1u64 << 40).to_le_bytes().to_vec();
    dims.extend_from_slice(&(1u64 << 40).to_le_bytes());
    let e = parse_err(l.with(l.ab_dims(), &dims));
    assert!(
        matches!(&e, GgufError::ShapeMismatch { name, reason, .. } if name == "t.ab" && reason.contains("overflow")),
        "{e}"
    );
    assert_names_offset(&e, l.info_ab);
    // Above i64::MAX but below u64::MAX.
    let mut dims = (1u64 << 32).to_le_bytes().to_vec();
    dims.extend_from_slice(&(1u64 << 31).to_le_bytes());
    let e = parse_err(l.with(l.ab_dims(), &dims));
    assert!(matches!(e, GgufError::ShapeMismatch { .. }), "{e}");
    // Row length not a multiple of Q8_0's 32.
    let e = parse_err(l.with(l.ab_dims(), &33u64.to_le_bytes()));
    assert!(
        matches!(&e, GgufError::ShapeMismatch { ty: GgmlType::Q8_0, reason, .. } if reason.contains("block size")),
        "{e}"
    );
    assert_names_offset(&e, l.info_ab);
}

#[test]
fn overflowing_tensor_offset() {
    let l = Layout::new();
    let e = parse_err(l.with(l.ab_offset(), &(!31u64).to_le_bytes()));
    assert!(
        matches!(&e, GgufError::OffsetOverflow { name, offset } if name == "t.ab" && *offset == l.ab_offset() as u64),
        "{e}"
    );
    assert_names_offset(&e, l.ab_offset());
}

#[test]
fn tensor_data_past_the_end() {
    let l = Layout::new();
    let e = parse_err(l.with(l.ab_offset(), &(1u64 << 20).to_le_bytes()));
    assert!(
        matches!(&e, GgufError::TensorOutOfBounds { name, .. } if name == "t.ab"),
        "{e}"
    );
    // Overlong dims with a valid offset: data runs past the end too.
    let e = parse_err(l.with(l.ab_dims() + 8, &1000u64.to_le_bytes()));
    assert!(
        matches!(&e, GgufError::TensorOutOfBounds { name, .. } if name == "t.ab"),
        "{e}"
    );
}

#[test]
fn misaligned_tensor_offset() {
    let l = Layout::new();
    let e = parse_err(l.with(l.ab_offset(), &40u64.to_le_bytes()));
    assert!(
        matches!(&e, GgufError::MisalignedTensor { name, tensor_offset: 40, alignment: 32, offset } if name == "t.ab" && *offset == l.ab_offset() as u64),
        "{e}"
    );
    assert_names_offset(&e, l.ab_offset());
}

#[test]
fn duplicates_and_bad_alignment() {
    let l = Layout::new();
    // Rename tensor "t.ab" to "t.aa".
    let e = parse_err(l.with(l.info_ab + 8, b"t.aa"));
    assert!(
        matches!(&e, GgufError::DuplicateTensor { name, offset } if name == "t.aa" && *offset == l.info_ab as u64),
        "{e}"
    );
    assert_names_offset(&e, l.info_ab);
    assert!(l.info_aa < l.info_ab);
    // Rename key "k.u16" to "k.u32" (same length; "k.u32" comes later).
    let at = l.bytes.windows(5).position(|w| w == b"k.u16").unwrap();
    let e = parse_err(l.with(at, b"k.u32"));
    assert!(
        matches!(&e, GgufError::DuplicateKey { key, .. } if key == "k.u32"),
        "{e}"
    );
    // general.alignment of 48 (patched in after writing a valid 64).
    let bytes = small_file(Some(64));
    let key = b"general.alignment";
    let at = bytes.windows(key.len()).position(|w| w == key).unwrap();
    let mut b = bytes.clone();
    b[at + key.len() + 4..at + key.len() + 8].copy_from_slice(&48u32.to_le_bytes());
    let e = parse_err(b);
    assert!(
        matches!(e, GgufError::BadAlignment { value: 48, offset } if offset == at as u64 - 8),
        "{e}"
    );
    assert_names_offset(&e, at - 8);
}

// ---------------------------------------------------------------------------
// A bounded mutation smoke test (runs in CI; the coverage-guided targets,
// and the corpus, are in the workspace's fuzz/ harness).

/// Parses arbitrary bytes; if they parse, touches everything a user would.
fn exercise(bytes: Vec<u8>) {
    if let Ok(f) = GgufFile::from_bytes(bytes) {
        for (_, v) in f.metadata().iter() {
            let _ = v.as_u64();
        }
        let mut total = 0u64;
        for v in f.tensor_views() {
            assert_eq!(v.data.len() as u64, v.info.n_bytes());
            total += v.data.iter().map(|&b| b as u64).sum::<u64>();
        }
        let _ = total;
        let _ = f.hparams();
        // Whatever parses rewrites and re-parses to the same content
        // (compared as bytes of a second rewrite: NaN metadata != itself).
        // A tensor-less file may declare a huge alignment without holding the
        // padding; rewriting it would (correctly) write that padding.
        if f.alignment() > 1 << 20 {
            return;
        }
        let mut once = Vec::new();
        if GgufWriter::from_gguf(&f).write_to(&mut once).is_ok() {
            let g = GgufFile::from_bytes(once.clone()).expect("rewritten file must parse");
            assert_eq!(g.metadata().len(), f.metadata().len());
            for (a, b) in f.tensor_views().zip(g.tensor_views()) {
                assert_eq!(
                    (&a.info.name, &a.info.dims, a.info.ty),
                    (&b.info.name, &b.info.dims, b.info.ty)
                );
                assert_eq!(a.data, b.data);
            }
            let mut twice = Vec::new();
            GgufWriter::from_gguf(&g).write_to(&mut twice).unwrap();
            assert!(once == twice, "rewrite is not idempotent");
        }
    }
}

#[test]
fn random_mutations_never_panic() {
    let seeds = [
        small_file(None),
        std::fs::read(fixture_path("tiny_py.gguf")).unwrap(),
    ];
    let mut rng = StdRng::seed_from_u64(0x4d49_5241_4745);
    let interesting: [u64; 8] = [0, 1, 31, 32, 1 << 31, 1 << 60, u64::MAX / 2, u64::MAX];
    let mut parsed = 0;
    for i in 0..6000 {
        let mut b = seeds[i % seeds.len()].clone();
        for _ in 0..rng.random_range(1..4) {
            let at = rng.random_range(0..b.len());
            match rng.random_range(0..5) {
                0 => b[at] ^= 1 << rng.random_range(0..8),
                1 => b[at] = rng.random(),
                2 if at + 8 <= b.len() => {
                    let v = interesting[rng.random_range(0..interesting.len())];
                    b[at..at + 8].copy_from_slice(&v.to_le_bytes());
                }
                3 => b.truncate(at),
                _ => {
                    let v: u32 = rng.random_range(0..40);
                    let end = (at + 4).min(b.len());
                    b[at..end].copy_from_slice(&v.to_le_bytes()[..end - at]);
                }
            }
            if b.is_empty() {
                break;
            }
        }
        if GgufFile::from_bytes(b.clone()).is_ok() {
            parsed += 1;
        }
        exercise(b);
    }
    // Some mutations (tensor data, string contents) keep the file valid.
    assert!(
        parsed > 100,
        "only {parsed} mutants parsed: mutations too destructive to test anything"
    );
}

// ---------------------------------------------------------------------------
// safetensors import.

#[test]
fn imports_safetensors_written_by_python() {
    let st = SafetensorsFile::open(fixture_path("tiny.safetensors")).unwrap();
    let want: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixture_path("tiny.safetensors.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(st.len(), 3);
    assert!(st.unsupported().is_empty());
    assert_eq!(
        st.header_metadata().get("note").map(String::as_str),
        Some("mirage-gguf test fixture")
    );
    for (name, ty) in [
        ("a.f32", GgmlType::F32),
        ("b.f16", GgmlType::F16),
        ("c.bf16", GgmlType::BF16),
    ] {
        let t = st.tensor(name).unwrap().unwrap();
        let w = &want[name];
        let shape: Vec<usize> = w["shape"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as usize)
            .collect();
        assert_eq!(t.shape, shape.as_slice());
        let rev: Vec<u64> = shape.iter().rev().map(|&d| d as u64).collect();
        assert_eq!(t.dims, rev.as_slice(), "ggml order is the reversed shape");
        assert_eq!(t.ty, ty);
        let vals: Vec<f32> = w["values"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap() as f32)
            .collect();
        assert_eq!(t.to_f32(), vals, "{name}");
    }
    assert!(st.tensor("nope").unwrap().is_none());

    // Into GGUF and back.
    let mut w = GgufWriter::new(Metadata::new());
    let n = st
        .add_to_writer(&mut w, |name| Some(format!("imp.{name}")))
        .unwrap();
    assert_eq!(n, 3);
    let mut out = Vec::new();
    w.write_to(&mut out).unwrap();
    let g = GgufFile::from_bytes(out).unwrap();
    let c = g.tensor("imp.c.bf16").unwrap();
    assert_eq!(
        (c.info.ty, c.info.dims.as_slice()),
        (GgmlType::BF16, &[2u64, 2, 3][..])
    );
    assert_eq!(c.data, st.tensor("c.bf16").unwrap().unwrap().data);
    assert!(matches!(
        SafetensorsFile::from_bytes(vec![1, 2, 3]),
        Err(GgufError::Safetensors(_))
    ));
}

// ---------------------------------------------------------------------------
// Hyperparameters on synthetic metadata (the real models are in
// real_models.rs).

fn hparams_of(md: Metadata, tensors: &[&str]) -> Result<mirage_gguf::ModelHparams, GgufError> {
    let mut w = GgufWriter::new(md);
    for name in tensors {
        w.add_tensor(*name, vec![4], GgmlType::F32, vec![0u8; 16])
            .unwrap();
    }
    let mut out = Vec::new();
    w.write_to(&mut out).unwrap();
    // Metadata only: these files hold placeholder tensors.
    mirage_gguf::ModelHparams::from_metadata(&GgufFile::from_bytes(out).unwrap())
}

fn qwen3_metadata() -> Metadata {
    let mut md = Metadata::new();
    md.insert("general.architecture", Value::String("qwen3".into()));
    for (k, v) in [
        ("block_count", 28u32),
        ("embedding_length", 1024),
        ("feed_forward_length", 3072),
        ("attention.head_count", 16),
        ("attention.head_count_kv", 8),
        ("attention.key_length", 128),
        ("context_length", 40960),
        ("vocab_size", 151_936),
    ] {
        md.insert(format!("qwen3.{k}"), Value::U32(v));
    }
    md.insert("qwen3.attention.layer_norm_rms_epsilon", Value::F32(1e-6));
    md.insert("qwen3.rope.freq_base", Value::F32(1e6));
    md
}

#[test]
fn hparams_qwen3_and_errors() {
    let hp = hparams_of(
        qwen3_metadata(),
        &["blk.0.attn_q_norm.weight", "output.weight"],
    )
    .unwrap();
    assert_eq!(hp.arch, mirage_gguf::Arch::Qwen3);
    // key_length wins over n_embd / n_head (1024 / 16 = 64).
    assert_eq!((hp.head_dim, hp.q_dim(), hp.kv_dim()), (128, 2048, 1024));
    assert_eq!(
        hp.vocab_size, 151_936,
        "from {{arch}}.vocab_size when no tokenizer array"
    );
    assert!(hp.attn_qk_norm && !hp.attn_qkv_bias && !hp.tied_embeddings);
    assert!(hp.rope_scaling.is_none());

    let mut md = qwen3_metadata();
    md.insert("qwen3.rope.scaling.type", Value::String("yarn".into()));
    md.insert("qwen3.rope.scaling.factor", Value::F32(4.0));
    md.insert(
        "qwen3.rope.scaling.original_context_length",
        Value::U32(32768),
    );
    let rs = hparams_of(md, &[]).unwrap().rope_scaling.unwrap();
    assert_eq!(
        (rs.kind, rs.factor, rs.original_context_length),
        (mirage_gguf::RopeScalingType::Yarn, 4.0, Some(32768))
    );

    let mut md = qwen3_metadata();
    md.remove("qwen3.block_count");
    let e = hparams_of(md, &[]).unwrap_err();
    assert!(
        matches!(&e, GgufError::MissingKey { key } if key == "qwen3.block_count"),
        "{e}"
    );
    assert!(e.to_string().contains("qwen3.block_count"));

    let mut md = qwen3_metadata();
    md.insert("qwen3.attention.head_count_kv", Value::U32(5));
    assert!(matches!(
        hparams_of(md, &[]),
        Err(GgufError::BadHparam { .. })
    ));

    let mut md = qwen3_metadata();
    md.insert("qwen3.context_length", Value::String("long".into()));
    assert!(matches!(
        hparams_of(md, &[]),
        Err(GgufError::WrongType { .. })
    ));

    let mut md = qwen3_metadata();
    md.insert("general.architecture", Value::String("gpt2".into()));
    let e = hparams_of(md, &[]).unwrap_err();
    assert!(
        matches!(&e, GgufError::UnsupportedArch { arch } if arch == "gpt2"),
        "{e}"
    );

    let mut md = qwen3_metadata();
    md.remove("general.architecture");
    assert!(matches!(
        hparams_of(md, &[]),
        Err(GgufError::MissingKey { .. })
    ));
}

// ---------------------------------------------------------------------------
// Hyperparameters checked against the tensor table.

fn tiny_with(edit: impl FnOnce(&mut Metadata)) -> GgufFile {
    let mut w = mirage_gguf::synth::TinyModel::default().writer().unwrap();
    edit(w.metadata_mut());
    let mut out = Vec::new();
    w.write_to(&mut out).unwrap();
    GgufFile::from_bytes(out).unwrap()
}

#[test]
fn hparams_of_the_tiny_model_match_its_tensors() {
    let f = tiny_with(|_| {});
    let hp = f.hparams().unwrap();
    assert_eq!((hp.n_layer, hp.n_embd, hp.n_ff), (2, 32, 64));
    assert!(hp.tensor_mismatches(&f).is_empty());
}

#[test]
fn a_huge_block_count_is_a_mismatch_not_an_allocation() {
    let f = tiny_with(|md| {
        md.insert("llama.block_count", Value::U32(u32::MAX));
    });
    let e = f.hparams().unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, GgufError::HparamsMismatch { .. }), "{e:?}");
    assert!(
        msg.contains("llama.block_count") && msg.contains("4294967295") && msg.contains("blk.2"),
        "{msg}"
    );
    // The metadata alone still reads (inspect shows it), with the mismatch listed.
    let hp = mirage_gguf::ModelHparams::from_metadata(&f).unwrap();
    assert_eq!(hp.n_layer, u32::MAX as usize);
    let problems = hp.tensor_mismatches(&f);
    assert_eq!(problems.len(), 1, "{problems:?}");
}

#[test]
fn every_shape_hparam_is_checked_against_the_tensors() {
    for (key, value, names) in [
        ("llama.embedding_length", 64u32, "token_embd.weight"),
        (
            "llama.feed_forward_length",
            1 << 30,
            "blk.0.ffn_gate.weight",
        ),
        // 8 heads of 32 / 8 = 4 keep the query width; the KV width changes.
        ("llama.attention.head_count", 8, "blk.0.attn_k.weight"),
        ("llama.attention.head_count_kv", 4, "blk.0.attn_k.weight"),
        ("llama.attention.key_length", 1 << 20, "blk.0.attn_q.weight"),
        ("llama.block_count", 1, "blk.1"),
    ] {
        let f = tiny_with(|md| {
            md.insert(key, Value::U32(value));
        });
        let msg = f.hparams().unwrap_err().to_string();
        assert!(msg.contains(key) && msg.contains(names), "{key}: {msg}");
    }
    // A vocabulary larger than the embedding's rows.
    let f = tiny_with(|md| {
        let mut tokens: Vec<String> = md
            .get_str_array("tokenizer.ggml.tokens")
            .unwrap()
            .into_iter()
            .map(str::to_owned)
            .collect();
        tokens.push("extra".into());
        md.insert("tokenizer.ggml.tokens", Value::string_array(tokens));
        md.remove("tokenizer.ggml.token_type");
    });
    let msg = f.hparams().unwrap_err().to_string();
    assert!(
        msg.contains("token_embd.weight") && msg.contains("259"),
        "{msg}"
    );
    // Products that overflow are refused, not wrapped.
    let f = tiny_with(|md| {
        md.insert("llama.attention.head_count", Value::U64(u64::MAX / 2));
        md.insert("llama.attention.head_count_kv", Value::U64(u64::MAX / 2));
        md.insert("llama.attention.key_length", Value::U64(1 << 40));
    });
    assert!(f.hparams().is_err());
    let f = tiny_with(|md| {
        md.insert("llama.context_length", Value::U32(0));
    });
    assert!(f
        .hparams()
        .unwrap_err()
        .to_string()
        .contains("context_length"));
}
