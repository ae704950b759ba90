//! qemu-img's `-p` progress line: `    (xx.xx/100%)` and a carriage return on stdout, at
//! least every 2% (and at 0 and 100%), then a newline when the command ends. Printed
//! whether or not stdout is a terminal, as qemu-img does, so scripts see the same text.

use std::io::Write;

/// The smallest step between two printed lines, in percent (qemu-img's `min_skip`).
const MIN_STEP: f64 = 2.0;

/// One command's progress.
#[derive(Debug)]
pub struct Progress {
    enabled: bool,
    current: f64,
    last_print: f64,
}

impl Progress {
    /// A progress line shown only when `enabled` (the `-p` flag).
    pub fn new(enabled: bool) -> Self {
        Progress {
            enabled,
            current: 0.0,
            last_print: 0.0,
        }
    }

    /// Done `part` more of `total` bytes (a zero `total` counts as done).
    pub fn advance(&mut self, part: u64, total: u64) {
        let delta = if total == 0 {
            100.0
        } else {
            part as f64 * 100.0 / total as f64
        };
        self.set(self.current + delta);
    }

    /// Done `pct` percent in all.
    pub fn set(&mut self, pct: f64) {
        self.current = pct.clamp(0.0, 100.0);
        let due = self.current == 0.0
            || self.current == 100.0
            || (self.current - self.last_print).abs() > MIN_STEP;
        if self.enabled && due {
            self.last_print = self.current;
            let mut out = std::io::stdout().lock();
            let _ = write!(out, "    ({:.2}/100%)\r", self.current);
            let _ = out.flush();
        }
    }

    /// Ends the line (nothing when disabled).
    pub fn finish(&self) {
        if self.enabled {
            let mut out = std::io::stdout().lock();
            let _ = writeln!(out);
            let _ = out.flush();
        }
    }
}
