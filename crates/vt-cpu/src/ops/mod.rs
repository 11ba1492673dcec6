//! The CPU reference ops, each a plain function over f32 slices (weights in stored form).

pub mod attention;
pub mod conv;
pub mod gdn;
pub mod matmul;
pub mod moe;
pub mod norm;
pub mod quant;
pub mod rope;
pub mod rows;
