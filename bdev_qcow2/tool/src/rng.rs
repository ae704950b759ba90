//! The engine's deterministic generator, for perf, benchmarks and tests.

pub use qcow2_engine::rng::Rng;
