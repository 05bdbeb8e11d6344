//! Tensor element types ([`GgmlType`]) as numbered by ggml, with their block geometry.
//!
//! Every ggml type stores its elements in blocks: `block_size()` elements take `type_size()` bytes.
//! Plain types (F32, F16, BF16, I8…) have blocks of one element; the legacy quants (Q4_0…Q8_1, IQ4_NL,
//! MXFP4) have 32; the k-quants and most i-quants have 256. Numbers and sizes follow ggml's `ggml.h` /
//! `ggml-common.h` (type ids 4, 5 and 31–33, 36–38 were removed from ggml and are unknown here).

/// A ggml tensor element type, with the numeric id used in GGUF files.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[allow(non_camel_case_types)]
#[allow(missing_docs)]
#[repr(u32)]
pub enum GgmlType {
    F32 = 0,
    F16 = 1,
    Q4_0 = 2,
    Q4_1 = 3,
    Q5_0 = 6,
    Q5_1 = 7,
    Q8_0 = 8,
    Q8_1 = 9,
    Q2_K = 10,
    Q3_K = 11,
    Q4_K = 12,
    Q5_K = 13,
    Q6_K = 14,
    Q8_K = 15,
    IQ2_XXS = 16,
    IQ2_XS = 17,
    IQ3_XXS = 18,
    IQ1_S = 19,
    IQ4_NL = 20,
    IQ3_S = 21,
    IQ2_S = 22,
    IQ4_XS = 23,
    I8 = 24,
    I16 = 25,
    I32 = 26,
    I64 = 27,
    F64 = 28,
    IQ1_M = 29,
    BF16 = 30,
    TQ1_0 = 34,
    TQ2_0 = 35,
    MXFP4 = 39,
}

/// `(type, name, elements per block, bytes per block)` for every known type.
const TABLE: &[(GgmlType, &str, usize, usize)] = &[
    (GgmlType::F32, "F32", 1, 4),
    (GgmlType::F16, "F16", 1, 2),
    (GgmlType::Q4_0, "Q4_0", 32, 18),
    (GgmlType::Q4_1, "Q4_1", 32, 20),
    (GgmlType::Q5_0, "Q5_0", 32, 22),
    (GgmlType::Q5_1, "Q5_1", 32, 24),
    (GgmlType::Q8_0, "Q8_0", 32, 34),
    // ggml's block_q8_1 is two f16 (d, s) + 32 i8 = 36 bytes (some tools still say 40).
    (GgmlType::Q8_1, "Q8_1", 32, 36),
    (GgmlType::Q2_K, "Q2_K", 256, 84),
    (GgmlType::Q3_K, "Q3_K", 256, 110),
    (GgmlType::Q4_K, "Q4_K", 256, 144),
    (GgmlType::Q5_K, "Q5_K", 256, 176),
    (GgmlType::Q6_K, "Q6_K", 256, 210),
    (GgmlType::Q8_K, "Q8_K", 256, 292),
    (GgmlType::IQ2_XXS, "IQ2_XXS", 256, 66),
    (GgmlType::IQ2_XS, "IQ2_XS", 256, 74),
    (GgmlType::IQ3_XXS, "IQ3_XXS", 256, 98),
    (GgmlType::IQ1_S, "IQ1_S", 256, 50),
    (GgmlType::IQ4_NL, "IQ4_NL", 32, 18),
    (GgmlType::IQ3_S, "IQ3_S", 256, 110),
    (GgmlType::IQ2_S, "IQ2_S", 256, 82),
    (GgmlType::IQ4_XS, "IQ4_XS", 256, 136),
    (GgmlType::I8, "I8", 1, 1),
    (GgmlType::I16, "I16", 1, 2),
    (GgmlType::I32, "I32", 1, 4),
    (GgmlType::I64, "I64", 1, 8),
    (GgmlType::F64, "F64", 1, 8),
    (GgmlType::IQ1_M, "IQ1_M", 256, 56),
    (GgmlType::BF16, "BF16", 1, 2),
    (GgmlType::TQ1_0, "TQ1_0", 256, 54),
    (GgmlType::TQ2_0, "TQ2_0", 256, 66),
    (GgmlType::MXFP4, "MXFP4", 32, 17),
];

impl GgmlType {
    /// All known types, in id order.
    pub fn all() -> impl Iterator<Item = GgmlType> {
        TABLE.iter().map(|entry| entry.0)
    }

    /// The type with ggml id `v`, or `None` for unknown/removed ids.
    pub fn from_u32(v: u32) -> Option<GgmlType> {
        TABLE.iter().find(|entry| entry.0 as u32 == v).map(|entry| entry.0)
    }

    /// The ggml id of this type.
    pub fn id(self) -> u32 {
        self as u32
    }

    fn entry(self) -> &'static (GgmlType, &'static str, usize, usize) {
        // Every variant has exactly one row in TABLE (checked by a unit test); the fallback is F32's row.
        TABLE.iter().find(|entry| entry.0 == self).unwrap_or(&TABLE[0])
    }

    /// Elements per block (1 for plain types, 32 for legacy quants, 256 for k-quants).
    pub fn block_size(self) -> usize {
        self.entry().2
    }

    /// Bytes per block.
    pub fn type_size(self) -> usize {
        self.entry().3
    }

    /// The ggml name, e.g. `"Q4_K"`.
    pub fn name(self) -> &'static str {
        self.entry().1
    }

    /// True for block-quantized types (block size > 1).
    pub fn is_quantized(self) -> bool {
        self.block_size() > 1
    }

    /// Bytes taken by `n_elements` consecutive elements (one row), or `None` if `n_elements` is not a
    /// multiple of the block size or the size overflows.
    pub fn row_bytes(self, n_elements: usize) -> Option<usize> {
        let block = self.block_size();
        if !n_elements.is_multiple_of(block) {
            return None;
        }
        (n_elements / block).checked_mul(self.type_size())
    }
}

impl std::fmt::Display for GgmlType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_is_consistent() {
        for (i, entry) in TABLE.iter().enumerate() {
            assert_eq!(GgmlType::from_u32(entry.0 as u32), Some(entry.0));
            assert_eq!(entry.0.name(), entry.1);
            assert!(TABLE[i + 1..].iter().all(|other| other.0 != entry.0), "duplicate {}", entry.1);
        }
        assert_eq!(GgmlType::from_u32(4), None);
        assert_eq!(GgmlType::from_u32(31), None);
        assert_eq!(GgmlType::from_u32(u32::MAX), None);
    }

    #[test]
    fn sizes_match_ggml() {
        let expected = [
            (GgmlType::Q4_0, 32, 18),
            (GgmlType::Q4_1, 32, 20),
            (GgmlType::Q5_0, 32, 22),
            (GgmlType::Q5_1, 32, 24),
            (GgmlType::Q8_0, 32, 34),
            (GgmlType::Q8_1, 32, 36),
            (GgmlType::Q2_K, 256, 84),
            (GgmlType::Q3_K, 256, 110),
            (GgmlType::Q4_K, 256, 144),
            (GgmlType::Q5_K, 256, 176),
            (GgmlType::Q6_K, 256, 210),
            (GgmlType::Q8_K, 256, 292),
            (GgmlType::F32, 1, 4),
            (GgmlType::F16, 1, 2),
            (GgmlType::BF16, 1, 2),
        ];
        for (ty, block, size) in expected {
            assert_eq!((ty.block_size(), ty.type_size()), (block, size), "{ty}");
        }
    }

    #[test]
    fn row_bytes_checks_blocks_and_overflow() {
        assert_eq!(GgmlType::Q4_0.row_bytes(64), Some(36));
        assert_eq!(GgmlType::Q4_0.row_bytes(33), None);
        assert_eq!(GgmlType::Q4_K.row_bytes(576), None);
        assert_eq!(GgmlType::F32.row_bytes(7), Some(28));
        assert_eq!(GgmlType::F32.row_bytes(usize::MAX), None);
        assert_eq!(GgmlType::F16.row_bytes(0), Some(0));
    }
}
