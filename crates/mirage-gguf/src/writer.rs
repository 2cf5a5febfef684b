//! The GGUF writer: ordered metadata plus tensors, laid out the way
//! llama.cpp's `gguf_write_to_file` does (header, KV pairs, tensor infos,
//! zero padding to the alignment, then each tensor's data padded to the
//! alignment), so that rewriting a llama.cpp file reproduces it byte for byte.

use std::borrow::Cow;
use std::collections::HashSet;
use std::fs::{self, File};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use crate::error::GgufError;
use crate::metadata::{Metadata, Value, ValueType};
use crate::reader::{GgufFile, ALIGNMENT_KEY, DEFAULT_ALIGNMENT, GGUF_MAGIC, MAX_DIMS};
use crate::GgmlType;

/// One tensor to write: name, dims (ggml order), type and its bytes.
#[derive(Debug, Clone)]
pub struct WriterTensor<'a> {
    /// The tensor's name.
    pub name: String,
    /// Dims in ggml order (`dims[0]` is the row length).
    pub dims: Vec<u64>,
    /// Element type.
    pub ty: GgmlType,
    /// Exactly the bytes `ty` needs for `dims`.
    pub data: Cow<'a, [u8]>,
}

/// Builds a GGUF file from ordered metadata and tensors. Tensor data may be
/// borrowed (e.g. from a memory-mapped [`GgufFile`]) or owned.
#[derive(Debug, Clone)]
pub struct GgufWriter<'a> {
    version: u32,
    metadata: Metadata,
    tensors: Vec<WriterTensor<'a>>,
    names: HashSet<String>,
}

fn invalid(msg: impl Into<String>) -> GgufError {
    GgufError::InvalidInput(msg.into())
}

impl<'a> GgufWriter<'a> {
    /// A writer for GGUF v3 with the given metadata and no tensors. The
    /// alignment is the metadata's `general.alignment` (a u32), or 32.
    pub fn new(metadata: Metadata) -> GgufWriter<'a> {
        GgufWriter { version: 3, metadata, tensors: Vec::new(), names: HashSet::new() }
    }

    /// A writer that reproduces `file` unchanged: same version, metadata
    /// order, tensor order and data (borrowed, not copied).
    pub fn from_gguf(file: &'a GgufFile) -> GgufWriter<'a> {
        let mut w = GgufWriter::new(file.metadata().clone());
        w.version = file.version();
        for view in file.tensor_views() {
            w.names.insert(view.info.name.clone());
            w.tensors.push(WriterTensor {
                name: view.info.name.clone(),
                dims: view.info.dims.clone(),
                ty: view.info.ty,
                data: Cow::Borrowed(view.data),
            });
        }
        w
    }

    /// Sets the GGUF version to write (2 or 3; both share one layout).
    pub fn set_version(&mut self, version: u32) -> Result<(), GgufError> {
        if version != 2 && version != 3 {
            return Err(invalid(format!("can only write GGUF v2 or v3, not v{version}")));
        }
        self.version = version;
        Ok(())
    }

    /// The metadata, for editing before writing.
    pub fn metadata_mut(&mut self) -> &mut Metadata {
        &mut self.metadata
    }

    /// The metadata.
    pub fn metadata(&self) -> &Metadata {
        &self.metadata
    }

    /// The tensors added so far, in write order.
    pub fn tensors(&self) -> &[WriterTensor<'a>] {
        &self.tensors
    }

    /// Appends a tensor, checking that the name is new, the dims are valid
    /// for `ty` and `data` has exactly the bytes they need.
    pub fn add_tensor(
        &mut self,
        name: impl Into<String>,
        dims: Vec<u64>,
        ty: GgmlType,
        data: impl Into<Cow<'a, [u8]>>,
    ) -> Result<(), GgufError> {
        let name = name.into();
        let data = data.into();
        if dims.len() > MAX_DIMS as usize {
            return Err(invalid(format!("tensor {name:?}: {} dims, at most {MAX_DIMS}", dims.len())));
        }
        let row = dims.first().copied().unwrap_or(1);
        if row % ty.block_size() as u64 != 0 {
            return Err(invalid(format!(
                "tensor {name:?}: row length {row} is not a multiple of {ty}'s block size {}",
                ty.block_size()
            )));
        }
        let n = dims.iter().try_fold(1u64, |a, &d| a.checked_mul(d));
        let need = n.and_then(|n| ty.bytes_for(n));
        if need != Some(data.len() as u64) {
            return Err(invalid(format!(
                "tensor {name:?}: dims {dims:?} of {ty} need {need:?} bytes, got {}",
                data.len()
            )));
        }
        if !self.names.insert(name.clone()) {
            return Err(invalid(format!("duplicate tensor name {name:?}")));
        }
        self.tensors.push(WriterTensor { name, dims, ty, data });
        Ok(())
    }

    /// The alignment the file will have.
    pub fn alignment(&self) -> Result<u64, GgufError> {
        match self.metadata.get(ALIGNMENT_KEY) {
            None => Ok(DEFAULT_ALIGNMENT),
            Some(Value::U32(a)) if a.is_power_of_two() => Ok(*a as u64),
            Some(v) => Err(invalid(format!("{ALIGNMENT_KEY} must be a power-of-two u32, got {v:?}"))),
        }
    }

    /// Writes the file to a stream; returns the number of bytes written.
    pub fn write_to<W: Write>(&self, mut w: W) -> Result<u64, GgufError> {
        let alignment = self.alignment()?;
        for (key, value) in self.metadata.iter() {
            check_value(key, value)?;
        }
        let mut out = CountingWriter { inner: &mut w, written: 0 };
        out.put(&GGUF_MAGIC)?;
        out.put(&self.version.to_le_bytes())?;
        out.put(&(self.tensors.len() as u64).to_le_bytes())?;
        out.put(&(self.metadata.len() as u64).to_le_bytes())?;
        for (key, value) in self.metadata.iter() {
            put_string(&mut out, key)?;
            out.put(&value.value_type().id().to_le_bytes())?;
            put_value(&mut out, value)?;
        }
        let mut offset = 0u64;
        for t in &self.tensors {
            put_string(&mut out, &t.name)?;
            out.put(&(t.dims.len() as u32).to_le_bytes())?;
            for d in &t.dims {
                out.put(&d.to_le_bytes())?;
            }
            out.put(&t.ty.id().to_le_bytes())?;
            out.put(&offset.to_le_bytes())?;
            offset += padded(t.data.len() as u64, alignment);
        }
        out.pad(alignment)?;
        for t in &self.tensors {
            out.put(&t.data)?;
            out.pad(alignment)?;
        }
        out.inner.flush()?;
        Ok(out.written)
    }

    /// Writes the file to `path` atomically: to `PATH.tmp-<pid>` first,
    /// fsynced, then renamed over `path`, so a reader (or a crash) never sees
    /// a half-written model. Returns the number of bytes written.
    pub fn write_to_path(&self, path: impl AsRef<Path>) -> Result<u64, GgufError> {
        let path = path.as_ref();
        let mut tmp_name = path.file_name().unwrap_or_default().to_os_string();
        tmp_name.push(format!(".tmp-{}", std::process::id()));
        let tmp = path.with_file_name(tmp_name);
        let result = self.write_tmp(&tmp).and_then(|n| {
            fs::rename(&tmp, path).map_err(|source| GgufError::Io { path: path.to_path_buf(), source })?;
            Ok(n)
        });
        if result.is_err() {
            let _ = fs::remove_file(&tmp);
        } else if let Some(dir) = path.parent() {
            // Persist the rename itself; best effort, not all platforms allow
            // opening a directory.
            let dir = if dir.as_os_str().is_empty() { Path::new(".") } else { dir };
            if let Ok(d) = File::open(dir) {
                let _ = d.sync_all();
            }
        }
        result
    }

    fn write_tmp(&self, tmp: &PathBuf) -> Result<u64, GgufError> {
        let io_err = |source| GgufError::Io { path: tmp.clone(), source };
        let file = File::create(tmp).map_err(io_err)?;
        let mut buf = BufWriter::with_capacity(4 << 20, file);
        let n = self.write_to(&mut buf).map_err(|e| match e {
            GgufError::Write { source } => io_err(source),
            e => e,
        })?;
        let file = buf.into_inner().map_err(|e| io_err(e.into_error()))?;
        file.sync_all().map_err(io_err)?;
        Ok(n)
    }
}

fn padded(x: u64, align: u64) -> u64 {
    x.div_ceil(align) * align
}

struct CountingWriter<'w, W: Write> {
    inner: &'w mut W,
    written: u64,
}

impl<W: Write> CountingWriter<'_, W> {
    fn put(&mut self, b: &[u8]) -> Result<(), GgufError> {
        self.inner.write_all(b)?;
        self.written += b.len() as u64;
        Ok(())
    }

    fn pad(&mut self, align: u64) -> Result<(), GgufError> {
        const ZEROS: [u8; 64] = [0; 64];
        let mut n = padded(self.written, align) - self.written;
        while n > 0 {
            let k = n.min(ZEROS.len() as u64);
            self.put(&ZEROS[..k as usize])?;
            n -= k;
        }
        Ok(())
    }
}

fn put_string<W: Write>(out: &mut CountingWriter<'_, W>, s: &str) -> Result<(), GgufError> {
    out.put(&(s.len() as u64).to_le_bytes())?;
    out.put(s.as_bytes())
}

fn put_value<W: Write>(out: &mut CountingWriter<'_, W>, v: &Value) -> Result<(), GgufError> {
    match v {
        Value::U8(x) => out.put(&[*x]),
        Value::I8(x) => out.put(&x.to_le_bytes()),
        Value::U16(x) => out.put(&x.to_le_bytes()),
        Value::I16(x) => out.put(&x.to_le_bytes()),
        Value::U32(x) => out.put(&x.to_le_bytes()),
        Value::I32(x) => out.put(&x.to_le_bytes()),
        Value::U64(x) => out.put(&x.to_le_bytes()),
        Value::I64(x) => out.put(&x.to_le_bytes()),
        Value::F32(x) => out.put(&x.to_le_bytes()),
        Value::F64(x) => out.put(&x.to_le_bytes()),
        Value::Bool(x) => out.put(&[*x as u8]),
        Value::String(s) => put_string(out, s),
        Value::Array(a) => {
            out.put(&a.elem_type.id().to_le_bytes())?;
            out.put(&(a.values.len() as u64).to_le_bytes())?;
            for x in &a.values {
                put_value(out, x)?;
            }
            Ok(())
        }
    }
}

/// Checks that every array's elements have its declared element type (the
/// format stores one type per array), before anything is written.
fn check_value(key: &str, v: &Value) -> Result<(), GgufError> {
    if let Value::Array(a) = v {
        for x in &a.values {
            if x.value_type() != a.elem_type {
                return Err(invalid(format!(
                    "metadata {key:?}: array of {} holds a {}",
                    a.elem_type.name(),
                    x.value_type().name()
                )));
            }
            if a.elem_type == ValueType::Array {
                check_value(key, x)?;
            }
        }
    }
    Ok(())
}
