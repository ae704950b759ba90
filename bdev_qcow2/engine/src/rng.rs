//! A small deterministic generator for workloads (tests, fuzzing, benchmarks, `qcow2 perf`).

/// Deterministic pseudo-random numbers (xorshift64*), so workloads and failures reproduce.
pub struct Rng(pub u64);

impl Rng {
    /// A generator seeded with `seed` (0 is replaced: xorshift needs a non-zero state).
    pub fn new(seed: u64) -> Rng {
        Rng(seed.max(1))
    }
    /// The next number.
    #[allow(clippy::should_implement_trait)] // a generator, not an iterator
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    /// A number in `0..n` (`n > 0`).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}
