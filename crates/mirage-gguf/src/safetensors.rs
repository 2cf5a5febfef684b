//! Import of `.safetensors` files into the GGUF tensor abstraction: each
//! F32/F16/BF16 tensor comes out with its dims in ggml order (the reverse of
//! the safetensors/PyTorch shape) and its bytes borrowed from the file, so a
//! [`crate::GgufWriter`] can take it as is.

use std::collections::HashMap;
use std::fs::File;
use std::path::Path;

use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};

use crate::error::GgufError;
use crate::writer::GgufWriter;
use crate::GgmlType;

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

#[derive(Debug, Clone)]
struct Entry {
    name: String,
    shape: Vec<usize>,
    dims: Vec<u64>,
    ty: GgmlType,
    start: usize,
    end: usize,
}

/// One imported tensor: name, dims in ggml order, type, bytes (borrowed).
#[derive(Debug, Clone, Copy)]
pub struct ImportedTensor<'a> {
    /// The tensor's name as stored in the safetensors file.
    pub name: &'a str,
    /// Dims in ggml order (reversed safetensors shape; `[1]` for a scalar).
    pub dims: &'a [u64],
    /// The shape as safetensors stores it (row-major, outermost first).
    pub shape: &'a [usize],
    /// F32, F16 or BF16.
    pub ty: GgmlType,
    /// The raw little-endian element bytes.
    pub data: &'a [u8],
}

impl ImportedTensor<'_> {
    /// The elements as f32 (row-major, same order as the bytes).
    pub fn to_f32(&self) -> Vec<f32> {
        match self.ty {
            GgmlType::F32 => self
                .data
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
            GgmlType::F16 => self
                .data
                .chunks_exact(2)
                .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            // Only these three types are ever imported.
            _ => self
                .data
                .chunks_exact(2)
                .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
        }
    }
}

/// A parsed `.safetensors` file (memory-mapped or owned).
pub struct SafetensorsFile {
    storage: Storage,
    entries: Vec<Entry>,
    index: HashMap<String, usize>,
    unsupported: Vec<(String, String)>,
    metadata: HashMap<String, String>,
}

impl std::fmt::Debug for SafetensorsFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SafetensorsFile")
            .field("n_tensors", &self.entries.len())
            .field("unsupported", &self.unsupported)
            .finish()
    }
}

impl SafetensorsFile {
    /// Memory-maps and parses a file.
    pub fn open(path: impl AsRef<Path>) -> Result<SafetensorsFile, GgufError> {
        let path = path.as_ref();
        let io_err = |source| GgufError::Io {
            path: path.to_path_buf(),
            source,
        };
        let file = File::open(path).map_err(io_err)?;
        if file.metadata().map_err(io_err)?.len() == 0 {
            return SafetensorsFile::from_bytes(Vec::new());
        }
        // SAFETY: read-only map; the file must not be modified while open
        // (the same contract as every mmap-based loader).
        let map = unsafe { Mmap::map(&file) }.map_err(io_err)?;
        SafetensorsFile::parse(Storage::Mmap(map))
    }

    /// Parses an owned buffer.
    pub fn from_bytes(bytes: Vec<u8>) -> Result<SafetensorsFile, GgufError> {
        SafetensorsFile::parse(Storage::Owned(bytes))
    }

    fn parse(storage: Storage) -> Result<SafetensorsFile, GgufError> {
        let bytes = storage.bytes();
        let st =
            SafeTensors::deserialize(bytes).map_err(|e| GgufError::Safetensors(e.to_string()))?;
        let (_, header) =
            SafeTensors::read_metadata(bytes).map_err(|e| GgufError::Safetensors(e.to_string()))?;
        let metadata = header.metadata().clone().unwrap_or_default();
        let base = bytes.as_ptr() as usize;
        let mut entries = Vec::new();
        let mut unsupported = Vec::new();
        for (name, view) in st.tensors() {
            let ty = match view.dtype() {
                Dtype::F32 => GgmlType::F32,
                Dtype::F16 => GgmlType::F16,
                Dtype::BF16 => GgmlType::BF16,
                other => {
                    unsupported.push((name, format!("{other:?}")));
                    continue;
                }
            };
            // The view borrows `bytes`, so its position is an offset into it.
            let start = view.data().as_ptr() as usize - base;
            let end = start + view.data().len();
            let shape = view.shape().to_vec();
            let mut dims: Vec<u64> = shape.iter().rev().map(|&d| d as u64).collect();
            if dims.is_empty() {
                dims.push(1);
            }
            entries.push(Entry {
                name,
                shape,
                dims,
                ty,
                start,
                end,
            });
        }
        // File (data) order, so that imports are deterministic.
        entries.sort_by_key(|e| (e.start, e.name.clone()));
        unsupported.sort();
        let index = entries
            .iter()
            .enumerate()
            .map(|(i, e)| (e.name.clone(), i))
            .collect();
        Ok(SafetensorsFile {
            storage,
            entries,
            index,
            unsupported,
            metadata,
        })
    }

    fn view<'a>(&'a self, e: &'a Entry) -> ImportedTensor<'a> {
        ImportedTensor {
            name: &e.name,
            dims: &e.dims,
            shape: &e.shape,
            ty: e.ty,
            data: &self.storage.bytes()[e.start..e.end],
        }
    }

    /// The importable (F32/F16/BF16) tensors, in data order.
    pub fn tensors(&self) -> impl Iterator<Item = ImportedTensor<'_>> {
        self.entries.iter().map(|e| self.view(e))
    }

    /// One tensor by name; [`GgufError::UnsupportedDtype`] for a tensor of
    /// another dtype, `Ok(None)` for an unknown name.
    pub fn tensor(&self, name: &str) -> Result<Option<ImportedTensor<'_>>, GgufError> {
        if let Some((_, dtype)) = self.unsupported.iter().find(|(n, _)| n == name) {
            return Err(GgufError::UnsupportedDtype {
                name: name.into(),
                dtype: dtype.clone(),
            });
        }
        Ok(self.index.get(name).map(|&i| self.view(&self.entries[i])))
    }

    /// Number of importable tensors.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether there are no importable tensors.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Tensors skipped because their dtype has no GGUF equivalent here:
    /// (name, dtype).
    pub fn unsupported(&self) -> &[(String, String)] {
        &self.unsupported
    }

    /// The free-form `__metadata__` strings of the header.
    pub fn header_metadata(&self) -> &HashMap<String, String> {
        &self.metadata
    }

    /// Adds every importable tensor to a writer, under `rename(name)` (return
    /// `None` to leave a tensor out). Fails on unsupported dtypes unless
    /// they are all left out by `rename`.
    pub fn add_to_writer<'a>(
        &'a self,
        writer: &mut GgufWriter<'a>,
        mut rename: impl FnMut(&str) -> Option<String>,
    ) -> Result<usize, GgufError> {
        for (name, dtype) in &self.unsupported {
            if rename(name).is_some() {
                return Err(GgufError::UnsupportedDtype {
                    name: name.clone(),
                    dtype: dtype.clone(),
                });
            }
        }
        let mut n = 0;
        for t in self.tensors() {
            if let Some(new_name) = rename(t.name) {
                writer.add_tensor(new_name, t.dims.to_vec(), t.ty, t.data)?;
                n += 1;
            }
        }
        Ok(n)
    }
}
