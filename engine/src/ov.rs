//! The OpenVINO side of the engine: a compiled paged model and its infer request (C++ in
//! `cpp/session.cpp`, bridged by cxx). The conversion to our op happens there, in memory, with
//! the project's one converter (`../cpp/convert.cpp`).

#[cxx::bridge(namespace = "pa_engine")]
pub(crate) mod ffi {
    /// A KV cache element type: the discriminants are `ElemType`'s (the `PA_ELEM_*` codes),
    /// which the C++ side maps with its one table (`cpp/convert.cpp`).
    #[repr(u8)]
    enum CacheType {
        F32 = 0,
        F16 = 1,
        Bf16 = 2,
        U8 = 4,
        U4 = 5,
    }

    /// How the stateful model is turned into a paged one (`paged_attention::ConvertConfig`).
    struct ConvertOptions {
        block_size: u32,
        cache_type: CacheType,
        serving: bool,
        gather_logits: bool,
        /// OpenVINO features to ask the pass for, which the converter then refuses (tests).
        allow_xattention: bool,
        allow_adaptive_rkv: bool,
        allow_qq_bias: bool,
    }

    /// A model input or output: its tensor name, element type (OpenVINO's short name: f32, i64,
    /// u8, ...) and shape (-1 for a dynamic dimension; empty for a scalar).
    #[derive(Debug, Clone)]
    struct Port {
        name: String,
        element_type: String,
        shape: Vec<i64>,
    }

    struct Property {
        key: String,
        value: String,
    }

    unsafe extern "C++" {
        include!("session.hpp");

        type Session;

        fn open_session(xml: &str, options: &ConvertOptions) -> Result<UniquePtr<Session>>;
        fn inputs(self: &Session) -> Vec<Port>;
        fn outputs(self: &Session) -> Vec<Port>;
        fn converted_layers(self: &Session) -> usize;
        fn gathered_logits(self: &Session) -> bool;
        fn save(self: &Session, xml: &str) -> Result<()>;
        fn compile(self: Pin<&mut Session>, device: &str, properties: &[Property]) -> Result<()>;
        /// # Safety
        /// `data` must point to `shape`'s elements of `element_type`, valid and not moved until
        /// the next `set_input` of this index or the session's end (the request keeps it).
        unsafe fn set_input(
            self: Pin<&mut Session>,
            index: usize,
            element_type: CacheType,
            shape: &[usize],
            data: *mut u8,
        ) -> Result<()>;
        fn copy_input(
            self: Pin<&mut Session>,
            index: usize,
            shape: &[usize],
            data: &[u8],
        ) -> Result<()>;
        fn infer(self: Pin<&mut Session>) -> Result<()>;
        fn output_f32(self: &Session, index: usize) -> Result<&[f32]>;
    }
}

pub(crate) use ffi::{CacheType, ConvertOptions, Property, Session};

impl CacheType {
    /// The bridge's name for a KV cache type; `None` for an element type no cache has.
    pub(crate) fn of(t: paged_attention::ElemType) -> Option<CacheType> {
        use paged_attention::ElemType as E;
        Some(match t {
            E::F32 => CacheType::F32,
            E::F16 => CacheType::F16,
            E::BF16 => CacheType::Bf16,
            E::U8 => CacheType::U8,
            E::U4 => CacheType::U4,
            E::I32 => return None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::CacheType;
    use paged_attention::dtype::CACHE_TYPES;

    #[test]
    fn the_bridge_enum_carries_the_element_codes() {
        for t in CACHE_TYPES {
            let c = CacheType::of(t).expect("every cache type crosses the bridge");
            assert_eq!(c.repr as i32, t as i32, "{t}");
        }
        assert!(CacheType::of(paged_attention::ElemType::I32).is_none());
    }
}
