//! The one error type of the format layer. Every parse error names the byte
//! offset where the problem was found, so a corrupt file can be inspected
//! with a hex dump.

use std::path::PathBuf;

use crate::GgmlType;

/// Everything that can go wrong reading, validating or writing GGUF (and
/// importing safetensors).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GgufError {
    /// The file ended before a field could be read.
    #[error("truncated file: needed {needed} more bytes at byte offset {offset}")]
    Truncated {
        /// Where the read started.
        offset: u64,
        /// How many bytes the read needed.
        needed: u64,
    },
    /// The first four bytes are not `GGUF`.
    #[error("bad magic at byte offset 0: found {found:02x?}, expected \"GGUF\"")]
    BadMagic {
        /// The four bytes found.
        found: [u8; 4],
    },
    /// A GGUF version this reader does not read (only 2 and 3 are).
    #[error("unsupported GGUF version {version} at byte offset 4{hint} (this reader reads versions 2 and 3)")]
    UnsupportedVersion {
        /// The version field as read little-endian.
        version: u32,
        /// Extra explanation (v1 layout, big-endian file), may be empty.
        hint: &'static str,
    },
    /// A count field (tensors, KV pairs, array length, dims) that cannot fit
    /// in the bytes that remain, so it is corrupt; nothing is allocated for it.
    #[error("absurd {what} count {count} at byte offset {offset}")]
    AbsurdCount {
        /// What was being counted.
        what: &'static str,
        /// The count read.
        count: u64,
        /// Where the count field is.
        offset: u64,
    },
    /// A string whose length field exceeds the bytes that remain.
    #[error("string at byte offset {offset} claims {len} bytes but only {remaining} remain")]
    StringTooLong {
        /// Where the string's length field is.
        offset: u64,
        /// The claimed length.
        len: u64,
        /// Bytes left in the file after the length field.
        remaining: u64,
    },
    /// A string that is not UTF-8.
    #[error("invalid UTF-8 in string at byte offset {offset}")]
    InvalidUtf8 {
        /// Where the string's bytes start.
        offset: u64,
    },
    /// A metadata value type id that GGUF does not define.
    #[error("unknown metadata value type {id} at byte offset {offset}")]
    UnknownValueType {
        /// The type id read.
        id: u32,
        /// Where the type field is.
        offset: u64,
    },
    /// Arrays nested deeper than the reader allows.
    #[error("arrays nested deeper than {max} levels at byte offset {offset}")]
    NestingTooDeep {
        /// The maximum depth allowed.
        max: usize,
        /// Where the too-deep array starts.
        offset: u64,
    },
    /// A tensor type id this crate does not know.
    #[error("tensor {name:?}: unknown tensor type {id} at byte offset {offset}")]
    UnknownTensorType {
        /// The tensor's name.
        name: String,
        /// The type id read.
        id: u32,
        /// Where the type field is.
        offset: u64,
    },
    /// A tensor whose dims are invalid: too many, element count overflow, or
    /// a row length that is not a whole number of quantization blocks.
    #[error("tensor {name:?} at byte offset {offset}: bad shape {dims:?} for {ty}: {reason}")]
    ShapeMismatch {
        /// The tensor's name.
        name: String,
        /// The dims read (ggml order).
        dims: Vec<u64>,
        /// The tensor type.
        ty: GgmlType,
        /// Where the tensor info starts.
        offset: u64,
        /// What is wrong.
        reason: &'static str,
    },
    /// A tensor data offset that is not a multiple of the file's alignment.
    #[error("tensor {name:?}: data offset {tensor_offset} (field at byte offset {offset}) is not a multiple of the alignment {alignment}")]
    MisalignedTensor {
        /// The tensor's name.
        name: String,
        /// The tensor's offset relative to the data section.
        tensor_offset: u64,
        /// The alignment required.
        alignment: u64,
        /// Where the offset field is.
        offset: u64,
    },
    /// An offset or size computation overflowed u64.
    #[error("tensor {name:?}: offset arithmetic overflows (field at byte offset {offset})")]
    OffsetOverflow {
        /// The tensor's name.
        name: String,
        /// Where the offending field is.
        offset: u64,
    },
    /// Tensor data that extends past the end of the file.
    #[error(
        "tensor {name:?}: data [{start}, {end}) lies past the end of the file ({file_len} bytes)"
    )]
    TensorOutOfBounds {
        /// The tensor's name.
        name: String,
        /// Absolute start of the data.
        start: u64,
        /// Absolute end of the data.
        end: u64,
        /// The file's length.
        file_len: u64,
    },
    /// A metadata key that appears twice.
    #[error("duplicate metadata key {key:?} at byte offset {offset}")]
    DuplicateKey {
        /// The key.
        key: String,
        /// Where the second occurrence starts.
        offset: u64,
    },
    /// A tensor name that appears twice.
    #[error("duplicate tensor name {name:?} at byte offset {offset}")]
    DuplicateTensor {
        /// The name.
        name: String,
        /// Where the second occurrence starts.
        offset: u64,
    },
    /// `general.alignment` is not a positive power of two (or not a u32).
    #[error("bad general.alignment {value} at byte offset {offset}: must be a power of two u32")]
    BadAlignment {
        /// The value found.
        value: u64,
        /// Where the KV pair starts.
        offset: u64,
    },
    /// Opening, mapping or writing a file failed.
    #[error("I/O error on {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// Writing to a stream failed.
    #[error("write error: {source}")]
    Write {
        /// The OS error.
        #[from]
        source: std::io::Error,
    },
    /// The writer was given inconsistent input (data length not matching
    /// dims and type, an array with mixed element types, ...).
    #[error("invalid writer input: {0}")]
    InvalidInput(String),
    /// A required metadata key is missing.
    #[error("missing metadata key {key:?}")]
    MissingKey {
        /// The key.
        key: String,
    },
    /// A metadata key has the wrong type for its meaning.
    #[error("metadata key {key:?} has type {found}, expected {expected}")]
    WrongType {
        /// The key.
        key: String,
        /// The type found.
        found: &'static str,
        /// The type expected.
        expected: &'static str,
    },
    /// `general.architecture` names an architecture MIRAGE does not run.
    #[error("unsupported architecture {arch:?} (supported: llama, qwen2, qwen3)")]
    UnsupportedArch {
        /// The architecture string.
        arch: String,
    },
    /// A hyperparameter value that makes no sense (zero heads, ...).
    #[error("bad hyperparameter {key}: {reason}")]
    BadHparam {
        /// The key or derived quantity.
        key: String,
        /// What is wrong.
        reason: String,
    },
    /// Hyperparameters that the tensor table contradicts (a block count with
    /// no such blocks, a width no tensor has, ...).
    #[error("hyperparameters do not match the tensors: {first}{}", if *more > 0 { format!(" (and {more} more problems)") } else { String::new() })]
    HparamsMismatch {
        /// The first problem found.
        first: String,
        /// How many more were found.
        more: usize,
    },
    /// The safetensors file could not be parsed.
    #[error("safetensors: {0}")]
    Safetensors(String),
    /// A safetensors dtype that has no GGUF tensor type here.
    #[error("safetensors tensor {name:?} has dtype {dtype}, only F32/F16/BF16 import")]
    UnsupportedDtype {
        /// The tensor's name.
        name: String,
        /// The dtype, as safetensors names it.
        dtype: String,
    },
    /// Dequantizing a tensor failed.
    #[error("dequantize tensor {name:?}: {source}")]
    Dequantize {
        /// The tensor's name.
        name: String,
        /// What the codec said.
        #[source]
        source: crate::quant::QuantError,
    },
    /// A quantization target that is neither one of llama.cpp's presets nor
    /// a weight type ([`crate::quant_mix::Target::parse`]); the message lists
    /// both.
    #[error(
        "unknown type {asked:?}{}: presets (llama.cpp's mixes) {}; single types {}",
        crate::quant_mix::activation_format_note(.activation_format),
        crate::quant_mix::preset_names(),
        crate::quant_mix::single_type_names()
    )]
    UnknownQuantTarget {
        /// The name asked for, as given.
        asked: String,
        /// The type it names when that is an activation format (Q8_1, Q8_K), not a weight type.
        activation_format: Option<GgmlType>,
    },
    /// A tensor too large to materialise in this address space.
    #[error("tensor {name:?} has {n_elements} elements, too many to dequantize here")]
    TooLarge {
        /// The tensor's name.
        name: String,
        /// Its element count.
        n_elements: u64,
    },
}
