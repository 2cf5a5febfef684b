//! Quantization codecs (dequantize, quantize, dot products) for every
//! [`crate::GgmlType`].
