//! Device operations. Each op encodes into a caller's command encoder (so a forward pass can
//! chain many without a round trip) and has a convenience form that uploads, runs and reads back.

pub mod act8;
pub mod experts;
pub mod experts_tiled;
pub mod graph;
pub mod matvec;
pub mod tiled;
