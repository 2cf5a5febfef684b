//! The GGUF reader: one parser over a byte slice, used for memory-mapped
//! files and for owned buffers alike.
//!
//! Safety rules for hostile input: every read is bounds-checked; before a
//! `Vec` is reserved for `n` items, `n` is checked against the bytes that
//! remain (each item has a minimum encoded size); array nesting is capped at
//! [`MAX_ARRAY_DEPTH`]; every error carries the byte offset of the problem.

use std::collections::HashMap;
use std::path::Path;

use crate::error::GgufError;
use crate::hparams::ModelHparams;
use crate::metadata::{Array, Metadata, Value, ValueType};
use crate::resident::{FileBytes, FileMemory};
use crate::tensor::{TensorInfo, TensorView};
use crate::GgmlType;

/// `GGUF` as the first four bytes.
pub const GGUF_MAGIC: [u8; 4] = *b"GGUF";
/// The alignment a file has when it has no `general.alignment`.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// The metadata key that sets the alignment.
pub const ALIGNMENT_KEY: &str = "general.alignment";
/// Deepest array nesting accepted (an array of arrays is depth 2). Real
/// files use 1; the cap keeps recursion bounded on hostile input.
pub const MAX_ARRAY_DEPTH: usize = 8;
/// Most dims a tensor may have (ggml's `GGML_MAX_DIMS`).
pub const MAX_DIMS: u32 = 4;

/// The bytes a [`GgufFile`] parses: a read-only map of a file, or an owned
/// buffer.
enum Storage {
    File(FileBytes),
    Owned(Vec<u8>),
}

impl Storage {
    fn bytes(&self) -> &[u8] {
        match self {
            Storage::File(m) => m,
            Storage::Owned(v) => v,
        }
    }
}

/// A parsed GGUF file (versions 2 and 3). Owns its bytes (a memory map for
/// [`GgufFile::open`]); tensor data is borrowed from them without copying.
pub struct GgufFile {
    storage: Storage,
    version: u32,
    alignment: u64,
    data_offset: u64,
    metadata: Metadata,
    tensors: Vec<TensorInfo>,
    tensor_index: HashMap<String, usize>,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("version", &self.version)
            .field("len", &self.storage.bytes().len())
            .field("alignment", &self.alignment)
            .field("data_offset", &self.data_offset)
            .field("n_kv", &self.metadata.len())
            .field("n_tensors", &self.tensors.len())
            .finish()
    }
}

impl GgufFile {
    /// Memory-maps and parses a file.
    pub fn open(path: impl AsRef<Path>) -> Result<GgufFile, GgufError> {
        GgufFile::open_with(path, FileMemory::Mapped)
    }

    /// Parses a file held as `memory` says: mapped, or read into memory
    /// ([`FileMemory::Resident`], for the CPU decode: see [`crate::resident`]).
    pub fn open_with(path: impl AsRef<Path>, memory: FileMemory) -> Result<GgufFile, GgufError> {
        let path = path.as_ref();
        let bytes = FileBytes::open(path, memory).map_err(|source| GgufError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        GgufFile::parse(Storage::File(bytes))
    }

    /// How the file's bytes are held ([`FileMemory::Mapped`] also for an
    /// owned buffer from [`GgufFile::from_bytes`]).
    pub fn memory(&self) -> FileMemory {
        match &self.storage {
            Storage::File(b) => b.memory(),
            Storage::Owned(_) => FileMemory::Mapped,
        }
    }

    /// Parses an owned buffer (same parser as [`GgufFile::open`]).
    pub fn from_bytes(bytes: Vec<u8>) -> Result<GgufFile, GgufError> {
        GgufFile::parse(Storage::Owned(bytes))
    }

    fn parse(storage: Storage) -> Result<GgufFile, GgufError> {
        let parsed = parse_gguf(storage.bytes())?;
        let tensor_index = parsed
            .tensors
            .iter()
            .enumerate()
            .map(|(i, t)| (t.name.clone(), i))
            .collect();
        Ok(GgufFile {
            storage,
            version: parsed.version,
            alignment: parsed.alignment,
            data_offset: parsed.data_offset,
            metadata: parsed.metadata,
            tensors: parsed.tensors,
            tensor_index,
        })
    }

    /// The GGUF version (2 or 3).
    pub fn version(&self) -> u32 {
        self.version
    }

    /// `general.alignment`, or 32 when absent.
    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// Absolute byte offset of the tensor data section.
    pub fn data_offset(&self) -> u64 {
        self.data_offset
    }

    /// The whole file's bytes.
    pub fn as_bytes(&self) -> &[u8] {
        self.storage.bytes()
    }

    /// Length of the file in bytes.
    pub fn len(&self) -> u64 {
        self.storage.bytes().len() as u64
    }

    /// Whether the file is empty (never true for a parsed file).
    pub fn is_empty(&self) -> bool {
        self.storage.bytes().is_empty()
    }

    /// The metadata, in file order.
    pub fn metadata(&self) -> &Metadata {
        &self.metadata
    }

    /// The tensor infos, in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// The tensor info of a name.
    pub fn tensor_info(&self, name: &str) -> Option<&TensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }

    /// A zero-copy view of a tensor by name.
    pub fn tensor(&self, name: &str) -> Option<TensorView<'_>> {
        let info = self.tensor_info(name)?;
        Some(TensorView {
            info,
            data: self.tensor_data(info),
        })
    }

    /// All tensors as views, in file order.
    pub fn tensor_views(&self) -> impl Iterator<Item = TensorView<'_>> {
        self.tensors.iter().map(|info| TensorView {
            info,
            data: self.tensor_data(info),
        })
    }

    /// The data bytes of a tensor info of this file.
    ///
    /// # Panics
    /// If `info` did not come from this file and lies out of its bounds.
    pub fn tensor_data(&self, info: &TensorInfo) -> &[u8] {
        // Bounds and overflow were checked at parse time for this file's infos.
        let start = (self.data_offset + info.offset) as usize;
        let end = start + info.n_bytes() as usize;
        &self.storage.bytes()[start..end]
    }

    /// Typed hyperparameters of the model (llama, qwen2, qwen3).
    pub fn hparams(&self) -> Result<ModelHparams, GgufError> {
        ModelHparams::from_gguf(self)
    }
}

/// What [`parse_gguf`] extracts from a buffer.
pub(crate) struct Parsed {
    pub version: u32,
    pub alignment: u64,
    pub data_offset: u64,
    pub metadata: Metadata,
    pub tensors: Vec<TensorInfo>,
}

/// A bounds-checked little-endian cursor.
struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn offset(&self) -> u64 {
        self.pos as u64
    }

    fn remaining(&self) -> u64 {
        (self.buf.len() - self.pos) as u64
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], GgufError> {
        if self.buf.len() - self.pos < n {
            return Err(GgufError::Truncated {
                offset: self.offset(),
                needed: n as u64,
            });
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], GgufError> {
        let s = self.take(N)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u8(&mut self) -> Result<u8, GgufError> {
        Ok(self.array::<1>()?[0])
    }
    fn u16(&mut self) -> Result<u16, GgufError> {
        Ok(u16::from_le_bytes(self.array()?))
    }
    fn u32(&mut self) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.array()?))
    }
    fn u64(&mut self) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    fn string(&mut self) -> Result<String, GgufError> {
        let at = self.offset();
        let len = self.u64()?;
        if len > self.remaining() {
            return Err(GgufError::StringTooLong {
                offset: at,
                len,
                remaining: self.remaining(),
            });
        }
        let start = self.offset();
        let bytes = self.take(len as usize)?;
        match std::str::from_utf8(bytes) {
            Ok(s) => Ok(s.to_owned()),
            Err(_) => Err(GgufError::InvalidUtf8 { offset: start }),
        }
    }

    /// Reads a count and checks that `count` items of at least `min_size`
    /// bytes each fit in what remains.
    fn count(&mut self, what: &'static str, min_size: u64) -> Result<u64, GgufError> {
        let at = self.offset();
        let count = self.u64()?;
        let fits = count
            .checked_mul(min_size)
            .is_some_and(|need| need <= self.remaining());
        if !fits {
            return Err(GgufError::AbsurdCount {
                what,
                count,
                offset: at,
            });
        }
        Ok(count)
    }

    fn value_type(&mut self) -> Result<ValueType, GgufError> {
        let at = self.offset();
        let id = self.u32()?;
        ValueType::from_id(id).ok_or(GgufError::UnknownValueType { id, offset: at })
    }

    fn value(&mut self, ty: ValueType, depth: usize) -> Result<Value, GgufError> {
        Ok(match ty {
            ValueType::U8 => Value::U8(self.u8()?),
            ValueType::I8 => Value::I8(self.u8()? as i8),
            ValueType::U16 => Value::U16(self.u16()?),
            ValueType::I16 => Value::I16(self.u16()? as i16),
            ValueType::U32 => Value::U32(self.u32()?),
            ValueType::I32 => Value::I32(self.u32()? as i32),
            ValueType::U64 => Value::U64(self.u64()?),
            ValueType::I64 => Value::I64(self.u64()? as i64),
            ValueType::F32 => Value::F32(f32::from_bits(self.u32()?)),
            ValueType::F64 => Value::F64(f64::from_bits(self.u64()?)),
            // Any non-zero byte reads as true, as in ggml; the writer writes
            // 0/1, so only non-canonical files would not round-trip.
            ValueType::Bool => Value::Bool(self.u8()? != 0),
            ValueType::String => Value::String(self.string()?),
            ValueType::Array => {
                let at = self.offset();
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(GgufError::NestingTooDeep {
                        max: MAX_ARRAY_DEPTH,
                        offset: at,
                    });
                }
                let elem_type = self.value_type()?;
                let n = self.count("array element", elem_type.min_encoded_size())?;
                // n is bounded by the bytes left, but a Value is larger than
                // its encoding: reserve a bounded amount, grow as parsed.
                let mut values = Vec::with_capacity((n as usize).min(MAX_UPFRONT_RESERVE));
                for _ in 0..n {
                    values.push(self.value(elem_type, depth + 1)?);
                }
                Value::Array(Array { elem_type, values })
            }
        })
    }
}

/// Most elements reserved before parsing an array; longer arrays grow as
/// their elements are actually read.
const MAX_UPFRONT_RESERVE: usize = 1 << 16;

/// Bytes at least needed by one KV pair: key length, type, a 1-byte value.
const MIN_KV_SIZE: u64 = 8 + 4 + 1;
/// Bytes at least needed by one tensor info: name length, n_dims, (no dims),
/// type, offset.
const MIN_TENSOR_INFO_SIZE: u64 = 8 + 4 + 4 + 8;

fn align_up(x: u64, align: u64) -> Option<u64> {
    x.checked_add(align - 1).map(|v| v / align * align)
}

pub(crate) fn parse_gguf(buf: &[u8]) -> Result<Parsed, GgufError> {
    let mut c = Cursor { buf, pos: 0 };
    let magic: [u8; 4] = c.array()?;
    if magic != GGUF_MAGIC {
        return Err(GgufError::BadMagic { found: magic });
    }
    let version = c.u32()?;
    match version {
        2 | 3 => {}
        1 => {
            return Err(GgufError::UnsupportedVersion {
                version,
                hint:
                    " (GGUF v1 uses 32-bit counts; re-convert the model with a current llama.cpp)",
            })
        }
        v if v.swap_bytes() == 2 || v.swap_bytes() == 3 => {
            return Err(GgufError::UnsupportedVersion {
                version,
                hint: " (this is a big-endian GGUF file)",
            })
        }
        _ => return Err(GgufError::UnsupportedVersion { version, hint: "" }),
    }
    // Both counts are read before either is checked against the remaining
    // bytes, matching the header layout.
    let n_tensors_at = c.offset();
    let n_tensors = c.u64()?;
    let n_kv = c.count("metadata KV", MIN_KV_SIZE)?;
    let tensor_bytes_ok = n_tensors
        .checked_mul(MIN_TENSOR_INFO_SIZE)
        .and_then(|t| t.checked_add(n_kv * MIN_KV_SIZE))
        .is_some_and(|need| need <= c.remaining());
    if !tensor_bytes_ok {
        return Err(GgufError::AbsurdCount {
            what: "tensor",
            count: n_tensors,
            offset: n_tensors_at,
        });
    }

    let mut metadata = Metadata::new();
    let mut alignment = DEFAULT_ALIGNMENT;
    for _ in 0..n_kv {
        let kv_at = c.offset();
        let key = c.string()?;
        let ty = c.value_type()?;
        let value = c.value(ty, 0)?;
        if metadata.contains_key(&key) {
            return Err(GgufError::DuplicateKey { key, offset: kv_at });
        }
        if key == ALIGNMENT_KEY {
            alignment = match value {
                Value::U32(a) if a.is_power_of_two() => a as u64,
                ref v => {
                    let value = v.as_u64().unwrap_or(0);
                    return Err(GgufError::BadAlignment {
                        value,
                        offset: kv_at,
                    });
                }
            };
        }
        metadata.insert(key, value);
    }

    let reserve = (n_tensors as usize).min(MAX_UPFRONT_RESERVE);
    let mut tensors: Vec<TensorInfo> = Vec::with_capacity(reserve);
    let mut seen: HashMap<String, ()> = HashMap::with_capacity(reserve);
    let mut offset_fields = Vec::with_capacity(reserve);
    for _ in 0..n_tensors {
        let info_at = c.offset();
        let name = c.string()?;
        let n_dims_at = c.offset();
        let n_dims = c.u32()?;
        if n_dims > MAX_DIMS {
            return Err(GgufError::AbsurdCount {
                what: "tensor dim",
                count: n_dims as u64,
                offset: n_dims_at,
            });
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            dims.push(c.u64()?);
        }
        let ty_at = c.offset();
        let ty_id = c.u32()?;
        let Some(ty) = GgmlType::from_id(ty_id) else {
            return Err(GgufError::UnknownTensorType {
                name,
                id: ty_id,
                offset: ty_at,
            });
        };
        let offset_at = c.offset();
        let offset = c.u64()?;
        let shape_err = |reason| GgufError::ShapeMismatch {
            name: name.clone(),
            dims: dims.clone(),
            ty,
            offset: info_at,
            reason,
        };
        let n_elements = dims.iter().try_fold(1u64, |acc, &d| acc.checked_mul(d));
        let Some(n_elements) = n_elements else {
            return Err(shape_err("element count overflows u64"));
        };
        // ggml also bounds the element count by i64.
        if n_elements > i64::MAX as u64 {
            return Err(shape_err("element count exceeds i64::MAX"));
        }
        let row = dims.first().copied().unwrap_or(1);
        if row % ty.block_size() as u64 != 0 {
            return Err(shape_err(
                "row length (dims[0]) is not a multiple of the block size",
            ));
        }
        if ty.bytes_for(n_elements).is_none() {
            return Err(shape_err("byte size overflows u64"));
        }
        if seen.insert(name.clone(), ()).is_some() {
            return Err(GgufError::DuplicateTensor {
                name,
                offset: info_at,
            });
        }
        tensors.push(TensorInfo {
            name,
            dims,
            ty,
            offset,
        });
        offset_fields.push(offset_at);
    }

    let infos_end = c.offset();
    let data_offset = align_up(infos_end, alignment).ok_or(GgufError::Truncated {
        offset: infos_end,
        needed: alignment,
    })?;
    let file_len = buf.len() as u64;
    for (t, &field_at) in tensors.iter().zip(&offset_fields) {
        if t.offset % alignment != 0 {
            return Err(GgufError::MisalignedTensor {
                name: t.name.clone(),
                tensor_offset: t.offset,
                alignment,
                offset: field_at,
            });
        }
        let overflow = || GgufError::OffsetOverflow {
            name: t.name.clone(),
            offset: field_at,
        };
        let start = data_offset.checked_add(t.offset).ok_or_else(overflow)?;
        let end = start.checked_add(t.n_bytes()).ok_or_else(overflow)?;
        if end > file_len {
            return Err(GgufError::TensorOutOfBounds {
                name: t.name.clone(),
                start,
                end,
                file_len,
            });
        }
    }
    if !tensors.is_empty() && data_offset > file_len {
        return Err(GgufError::Truncated {
            offset: infos_end,
            needed: data_offset - infos_end,
        });
    }

    Ok(Parsed {
        version,
        alignment,
        data_offset,
        metadata,
        tensors,
    })
}
