//! Metadata values ([`Value`]) and their GGUF type ids.
//!
//! GGUF stores each metadata value with a `u32` type tag: 0 u8, 1 i8, 2 u16, 3 i16, 4 u32, 5 i32, 6 f32,
//! 7 bool, 8 string, 9 array, 10 u64, 11 i64, 12 f64. An array carries one element type and a length;
//! arrays of arrays are allowed (each inner array has its own element type).

/// One metadata value.
#[derive(Clone, Debug, PartialEq)]
#[allow(missing_docs)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(Vec<Value>),
    U64(u64),
    I64(i64),
    F64(f64),
}

/// GGUF value type tags.
pub(crate) mod tag {
    pub const U8: u32 = 0;
    pub const I8: u32 = 1;
    pub const U16: u32 = 2;
    pub const I16: u32 = 3;
    pub const U32: u32 = 4;
    pub const I32: u32 = 5;
    pub const F32: u32 = 6;
    pub const BOOL: u32 = 7;
    pub const STRING: u32 = 8;
    pub const ARRAY: u32 = 9;
    pub const U64: u32 = 10;
    pub const I64: u32 = 11;
    pub const F64: u32 = 12;
}

/// The name of a type tag, for messages (`"unknown"` for an unknown tag).
pub(crate) fn tag_name(ty: u32) -> &'static str {
    match ty {
        tag::U8 => "u8",
        tag::I8 => "i8",
        tag::U16 => "u16",
        tag::I16 => "i16",
        tag::U32 => "u32",
        tag::I32 => "i32",
        tag::F32 => "f32",
        tag::BOOL => "bool",
        tag::STRING => "string",
        tag::ARRAY => "array",
        tag::U64 => "u64",
        tag::I64 => "i64",
        tag::F64 => "f64",
        _ => "unknown",
    }
}

impl Value {
    /// The GGUF type tag of this value.
    pub fn type_tag(&self) -> u32 {
        match self {
            Value::U8(_) => tag::U8,
            Value::I8(_) => tag::I8,
            Value::U16(_) => tag::U16,
            Value::I16(_) => tag::I16,
            Value::U32(_) => tag::U32,
            Value::I32(_) => tag::I32,
            Value::F32(_) => tag::F32,
            Value::Bool(_) => tag::BOOL,
            Value::String(_) => tag::STRING,
            Value::Array(_) => tag::ARRAY,
            Value::U64(_) => tag::U64,
            Value::I64(_) => tag::I64,
            Value::F64(_) => tag::F64,
        }
    }

    /// The type's name as used in messages: `"u32"`, `"string"`, `"array"`…
    pub fn type_name(&self) -> &'static str {
        tag_name(self.type_tag())
    }

    /// Any integer value, widened to i128 (private helper for the range-checked accessors).
    fn as_i128(&self) -> Option<i128> {
        Some(match *self {
            Value::U8(v) => v.into(),
            Value::I8(v) => v.into(),
            Value::U16(v) => v.into(),
            Value::I16(v) => v.into(),
            Value::U32(v) => v.into(),
            Value::I32(v) => v.into(),
            Value::U64(v) => v.into(),
            Value::I64(v) => v.into(),
            _ => return None,
        })
    }

    /// Any integer value that fits in a u64.
    pub fn as_u64(&self) -> Option<u64> {
        self.as_i128().and_then(|v| u64::try_from(v).ok())
    }

    /// Any integer value that fits in a u32.
    pub fn as_u32(&self) -> Option<u32> {
        self.as_i128().and_then(|v| u32::try_from(v).ok())
    }

    /// Any integer value that fits in an i64.
    pub fn as_i64(&self) -> Option<i64> {
        self.as_i128().and_then(|v| i64::try_from(v).ok())
    }

    /// Any integer value that fits in an i32.
    pub fn as_i32(&self) -> Option<i32> {
        self.as_i128().and_then(|v| i32::try_from(v).ok())
    }

    /// A float or integer value as f64 (large 64-bit integers round).
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v.into()),
            Value::F64(v) => Some(v),
            _ => self.as_i128().map(|v| v as f64),
        }
    }

    /// A float or integer value as f32 (rounding as `as` does).
    pub fn as_f32(&self) -> Option<f32> {
        match *self {
            Value::F32(v) => Some(v),
            _ => self.as_f64().map(|v| v as f32),
        }
    }

    /// A string value.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }

    /// A bool value.
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(b) => Some(b),
            _ => None,
        }
    }

    /// An array value's elements.
    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(items) => Some(items),
            _ => None,
        }
    }
}

impl From<&str> for Value {
    fn from(s: &str) -> Value {
        Value::String(s.to_owned())
    }
}

impl From<String> for Value {
    fn from(s: String) -> Value {
        Value::String(s)
    }
}

macro_rules! value_from {
    ($($t:ty => $variant:ident),*) => {$(
        impl From<$t> for Value {
            fn from(v: $t) -> Value {
                Value::$variant(v)
            }
        }
    )*};
}
value_from!(u8 => U8, i8 => I8, u16 => U16, i16 => I16, u32 => U32, i32 => I32, f32 => F32, bool => Bool,
    u64 => U64, i64 => I64, f64 => F64, Vec<Value> => Array);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn integer_accessors_convert_in_range() {
        assert_eq!(Value::I32(5).as_u64(), Some(5));
        assert_eq!(Value::I32(-5).as_u64(), None);
        assert_eq!(Value::U64(u64::MAX).as_i64(), None);
        assert_eq!(Value::U64(7).as_i64(), Some(7));
        assert_eq!(Value::U64(1 << 32).as_u32(), None);
        assert_eq!(Value::U8(3).as_f64(), Some(3.0));
        assert_eq!(Value::F32(0.5).as_f64(), Some(0.5));
        assert_eq!(Value::F32(0.5).as_u64(), None);
        assert_eq!(Value::Bool(true).as_u64(), None);
        assert_eq!(Value::from("x").as_str(), Some("x"));
        assert_eq!(Value::from(true).as_bool(), Some(true));
        assert_eq!(Value::Array(vec![]).as_array().map(<[Value]>::len), Some(0));
        assert_eq!(Value::F64(1.0).type_name(), "f64");
    }
}
