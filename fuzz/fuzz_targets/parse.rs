//! The on-disk decoders alone: header and extensions, snapshot table, L1/L2/refcount-table
//! entries, refcount blocks. The input layout is documented at
//! `qcow2_engine::fuzzing::parse`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    qcow2_engine::fuzzing::parse(data);
});
