//! An image plus a short script of operations (open, read, write, discard, write-zeroes,
//! flush, reopen, check) through the engine on an in-memory device. The input layout is
//! documented at `qcow2_engine::fuzzing::image_ops`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    qcow2_engine::fuzzing::image_ops(data);
});
