//! The LUKS header decoder, and the unlock of what decodes cheaply. The input layout is
//! documented at `qcow2_engine::fuzzing::luks`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    qcow2_engine::fuzzing::luks(data);
});
