//! The tool's only `unsafe` code: small safe wrappers over libc calls, the aligned heap
//! memory the io_uring device reads and writes, and the submission of SQEs that point at
//! it. Every other module of the crate is free of `unsafe` (`#![deny(unsafe_code)]` at the
//! crate root; this module alone is exempt), and every block here has its `// SAFETY:`
//! note.

pub mod aligned_buf;
pub mod ring;
pub mod sys;
