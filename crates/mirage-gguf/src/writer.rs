//! The GGUF writer: ordered metadata plus tensors, laid out the way
//! llama.cpp's `gguf_write_to_file` does (header, KV pairs, tensor infos,
//! zero padding to the alignment, then each tensor's data padded to the
//! alignment), so that rewriting a llama.cpp file reproduces it byte for byte.

use std::borrow::Cow;
use std::collections::HashSet;

use std::io::{BufWriter, Write};
use std::path::Path;

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
        GgufWriter {
            version: 3,
            metadata,
            tensors: Vec::new(),
            names: HashSet::new(),
        }
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
            return Err(invalid(format!(
                "can only write GGUF v2 or v3, not v{version}"
            )));
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
            return Err(invalid(format!(
                "tensor {name:?}: {} dims, at most {MAX_DIMS}",
                dims.len()
            )));
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
        self.tensors.push(WriterTensor {
            name,
            dims,
            ty,
            data,
        });
        Ok(())
    }

    /// The alignment the file will have.
    pub fn alignment(&self) -> Result<u64, GgufError> {
        match self.metadata.get(ALIGNMENT_KEY) {
            None => Ok(DEFAULT_ALIGNMENT),
            Some(Value::U32(a)) if a.is_power_of_two() => Ok(*a as u64),
            Some(v) => Err(invalid(format!(
                "{ALIGNMENT_KEY} must be a power-of-two u32, got {v:?}"
            ))),
        }
    }

    /// Writes the file to a stream; returns the number of bytes written.
    pub fn write_to<W: Write>(&self, mut w: W) -> Result<u64, GgufError> {
        let alignment = self.alignment()?;
        let mut out = CountingWriter {
            inner: &mut w,
            written: 0,
        };
        let infos: Vec<(&str, &[u64], GgmlType, u64)> = self
            .tensors
            .iter()
            .map(|t| {
                (
                    t.name.as_str(),
                    t.dims.as_slice(),
                    t.ty,
                    t.data.len() as u64,
                )
            })
            .collect();
        write_header(&mut out, self.version, &self.metadata, &infos, alignment)?;
        for t in &self.tensors {
            out.put(&t.data)?;
            out.pad(alignment)?;
        }
        out.inner.flush()?;
        Ok(out.written)
    }

    /// Writes the file to `path` atomically through
    /// [`crate::atomic::AtomicFile`]: to `.NAME.tmp-<pid>` first (locked,
    /// fsynced), then renamed over `path`, so a reader (or a crash) never
    /// sees a half-written model, and a temporary left by a killed writer is
    /// removed by the next write to `path`. Returns the number of bytes
    /// written.
    pub fn write_to_path(&self, path: impl AsRef<Path>) -> Result<u64, GgufError> {
        let path = path.as_ref();
        let io_err = |p: &Path| {
            let p = p.to_path_buf();
            move |source| GgufError::Io { path: p, source }
        };
        let mut out = crate::atomic::AtomicFile::create(path).map_err(io_err(path))?;
        let tmp = out.temp_path().to_path_buf();
        let mut buf = BufWriter::with_capacity(4 << 20, out.file());
        let n = self.write_to(&mut buf).map_err(|e| match e {
            GgufError::Write { source } => io_err(&tmp)(source),
            e => e,
        })?;
        buf.flush().map_err(io_err(&tmp))?;
        drop(buf);
        out.commit().map_err(io_err(path))?;
        Ok(n)
    }
}

/// Header, KV pairs and tensor infos (name, dims, type, data bytes), padded
/// to the alignment: everything before the first tensor's data.
fn write_header<W: Write>(
    out: &mut CountingWriter<'_, W>,
    version: u32,
    metadata: &Metadata,
    tensors: &[(&str, &[u64], GgmlType, u64)],
    alignment: u64,
) -> Result<(), GgufError> {
    for (key, value) in metadata.iter() {
        check_value(key, value)?;
    }
    out.put(&GGUF_MAGIC)?;
    out.put(&version.to_le_bytes())?;
    out.put(&(tensors.len() as u64).to_le_bytes())?;
    out.put(&(metadata.len() as u64).to_le_bytes())?;
    for (key, value) in metadata.iter() {
        put_string(out, key)?;
        out.put(&value.value_type().id().to_le_bytes())?;
        put_value(out, value)?;
    }
    let mut offset = 0u64;
    for &(name, dims, ty, bytes) in tensors {
        put_string(out, name)?;
        out.put(&(dims.len() as u32).to_le_bytes())?;
        for d in dims {
            out.put(&d.to_le_bytes())?;
        }
        out.put(&ty.id().to_le_bytes())?;
        out.put(&offset.to_le_bytes())?;
        offset += padded(bytes, alignment);
    }
    out.pad(alignment)
}

/// The name, dims (ggml order) and type of a tensor whose bytes
/// [`GgufStreamWriter`] receives later.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorDecl {
    /// The tensor's name.
    pub name: String,
    /// Dims in ggml order (`dims[0]` is the row length).
    pub dims: Vec<u64>,
    /// Element type.
    pub ty: GgmlType,
}

impl TensorDecl {
    /// Bytes of its data, checked like [`GgufWriter::add_tensor`] checks.
    pub fn n_bytes(&self) -> Result<u64, GgufError> {
        if self.dims.len() > MAX_DIMS as usize {
            return Err(invalid(format!(
                "tensor {:?}: {} dims, at most {MAX_DIMS}",
                self.name,
                self.dims.len()
            )));
        }
        let row = self.dims.first().copied().unwrap_or(1);
        if row % self.ty.block_size() as u64 != 0 {
            return Err(invalid(format!(
                "tensor {:?}: row length {row} is not a multiple of {}'s block size {}",
                self.name,
                self.ty,
                self.ty.block_size()
            )));
        }
        self.dims
            .iter()
            .try_fold(1u64, |a, &d| a.checked_mul(d))
            .and_then(|n| self.ty.bytes_for(n))
            .ok_or_else(|| {
                invalid(format!(
                    "tensor {:?}: dims {:?} overflow",
                    self.name, self.dims
                ))
            })
    }
}

/// Writes a GGUF file whose tensors are too large to hold in memory: the
/// header and tensor infos first ([`GgufStreamWriter::new`]), then each
/// declared tensor's bytes in order, in pieces of any size
/// ([`GgufStreamWriter::write_data`]); the padding between tensors is added
/// here. The layout is [`GgufWriter`]'s.
pub struct GgufStreamWriter<W: Write> {
    out: W,
    written: u64,
    alignment: u64,
    /// (name, bytes) of every declared tensor.
    sizes: Vec<(String, u64)>,
    /// The tensor receiving bytes, and how many it has.
    current: usize,
    in_current: u64,
}

impl<W: Write> std::fmt::Debug for GgufStreamWriter<W> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufStreamWriter")
            .field("written", &self.written)
            .field("current", &self.current)
            .finish()
    }
}

impl<W: Write> GgufStreamWriter<W> {
    /// Writes the header for `metadata` and `tensors` (GGUF v3; alignment
    /// from `general.alignment` or 32). Tensor names must be unique.
    pub fn new(
        mut out: W,
        metadata: &Metadata,
        tensors: &[TensorDecl],
    ) -> Result<GgufStreamWriter<W>, GgufError> {
        let alignment = GgufWriter::new(metadata.clone()).alignment()?;
        let mut names = HashSet::new();
        let mut sizes = Vec::with_capacity(tensors.len());
        for t in tensors {
            if !names.insert(t.name.as_str()) {
                return Err(invalid(format!("duplicate tensor name {:?}", t.name)));
            }
            sizes.push((t.name.clone(), t.n_bytes()?));
        }
        let infos: Vec<(&str, &[u64], GgmlType, u64)> = tensors
            .iter()
            .zip(&sizes)
            .map(|(t, s)| (t.name.as_str(), t.dims.as_slice(), t.ty, s.1))
            .collect();
        let mut counting = CountingWriter {
            inner: &mut out,
            written: 0,
        };
        write_header(&mut counting, 3, metadata, &infos, alignment)?;
        let written = counting.written;
        let mut w = GgufStreamWriter {
            out,
            written,
            alignment,
            sizes,
            current: 0,
            in_current: 0,
        };
        w.skip_empty()?;
        Ok(w)
    }

    /// Bytes the current tensor still needs (0 when every tensor is complete).
    pub fn remaining_in_tensor(&self) -> u64 {
        self.sizes
            .get(self.current)
            .map(|s| s.1 - self.in_current)
            .unwrap_or(0)
    }

    /// Appends data; a piece may end inside a tensor or run across the end
    /// of one into the next. More bytes than the tensors declared is an error.
    pub fn write_data(&mut self, mut data: &[u8]) -> Result<(), GgufError> {
        while !data.is_empty() {
            let Some(&(_, size)) = self.sizes.get(self.current) else {
                return Err(invalid(format!(
                    "{} bytes past the last tensor",
                    data.len()
                )));
            };
            let take = ((size - self.in_current).min(data.len() as u64)) as usize;
            self.put(&data[..take])?;
            self.in_current += take as u64;
            data = &data[take..];
            self.skip_empty()?;
        }
        Ok(())
    }

    /// Checks that every tensor got all its bytes, flushes and returns the
    /// stream and the file's length.
    pub fn finish(mut self) -> Result<(W, u64), GgufError> {
        if let Some((name, size)) = self.sizes.get(self.current) {
            return Err(invalid(format!(
                "tensor {name:?} got {} of its {size} bytes",
                self.in_current
            )));
        }
        self.out.flush()?;
        Ok((self.out, self.written))
    }

    /// After a tensor is complete: pads to the alignment and moves on (past
    /// empty tensors too).
    fn skip_empty(&mut self) -> Result<(), GgufError> {
        while let Some(&(_, size)) = self.sizes.get(self.current) {
            if self.in_current < size {
                break;
            }
            let pad = padded(self.written, self.alignment) - self.written;
            const ZEROS: [u8; 64] = [0; 64];
            let mut n = pad;
            while n > 0 {
                let k = n.min(64);
                self.put(&ZEROS[..k as usize])?;
                n -= k;
            }
            self.current += 1;
            self.in_current = 0;
        }
        Ok(())
    }

    fn put(&mut self, b: &[u8]) -> Result<(), GgufError> {
        self.out.write_all(b)?;
        self.written += b.len() as u64;
        Ok(())
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stream_writer_equals_the_in_memory_writer_and_checks_sizes() {
        let mut md = Metadata::new();
        md.insert("general.architecture", Value::String("test".into()));
        let a: Vec<u8> = (0..34 * 3).map(|i| i as u8).collect(); // 3 Q8_0 blocks
        let b: Vec<u8> = (0..4 * 5).map(|i| (i * 7) as u8).collect(); // 5 f32
        let mut w = GgufWriter::new(md.clone());
        w.add_tensor("a", vec![32, 3], GgmlType::Q8_0, a.clone())
            .unwrap();
        w.add_tensor("b", vec![5], GgmlType::F32, b.clone())
            .unwrap();
        let mut want = Vec::new();
        w.write_to(&mut want).unwrap();
        let decls = [
            TensorDecl {
                name: "a".into(),
                dims: vec![32, 3],
                ty: GgmlType::Q8_0,
            },
            TensorDecl {
                name: "b".into(),
                dims: vec![5],
                ty: GgmlType::F32,
            },
        ];
        // Pieces that end inside a tensor and run across the boundary.
        let all: Vec<u8> = a.iter().chain(&b).copied().collect();
        let mut s = GgufStreamWriter::new(Vec::new(), &md, &decls).unwrap();
        for piece in all.chunks(7) {
            s.write_data(piece).unwrap();
        }
        let (got, n) = s.finish().unwrap();
        assert_eq!(got, want);
        assert_eq!(n, want.len() as u64);
        // Too few bytes, too many, bad dims, duplicate names.
        let mut s = GgufStreamWriter::new(Vec::new(), &md, &decls).unwrap();
        s.write_data(&all[..10]).unwrap();
        assert_eq!(s.remaining_in_tensor(), a.len() as u64 - 10);
        assert!(s.finish().is_err());
        let mut s = GgufStreamWriter::new(Vec::new(), &md, &decls).unwrap();
        assert!(s.write_data(&[all.clone(), vec![0]].concat()).is_err());
        let bad = [TensorDecl {
            name: "a".into(),
            dims: vec![31],
            ty: GgmlType::Q8_0,
        }];
        assert!(GgufStreamWriter::new(Vec::new(), &md, &bad).is_err());
        let dup = [decls[1].clone(), decls[1].clone()];
        assert!(GgufStreamWriter::new(Vec::new(), &md, &dup).is_err());
    }
}
