//! `tracing` events (ours and the engine's) written into SPDK's log.
//!
//! Levels map so that the default SPDK print level (NOTICE) shows errors, warnings and
//! `info!`; `debug!` and `trace!` are shown when the `vbdev_qcow2` log flag is on
//! (`--logflag vbdev_qcow2` or the `log_set_flag` RPC) and SPDK's print level allows them.

use crate::ffi::{log, sys};
use std::ffi::CString;
use std::fmt::Write as _;
use tracing::field::{Field, Visit};
use tracing::subscriber::Interest;
use tracing::{Event, Level, Metadata, Subscriber};
use tracing_subscriber::layer::{Context, Layer, SubscriberExt};

/// The layer that forwards events to `spdk_log`.
pub struct SpdkLog;

fn spdk_level(l: &Level) -> sys::spdk_log_level {
    match *l {
        Level::ERROR => sys::SPDK_LOG_ERROR,
        Level::WARN => sys::SPDK_LOG_WARN,
        Level::INFO => sys::SPDK_LOG_NOTICE,
        Level::DEBUG => sys::SPDK_LOG_INFO,
        Level::TRACE => sys::SPDK_LOG_DEBUG,
    }
}

#[derive(Default)]
struct Message(String);

impl Visit for Message {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            let _ = write!(self.0, "{value:?}");
        } else {
            let _ = write!(self.0, " {}={value:?}", field.name());
        }
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            self.0.push_str(value);
        } else {
            let _ = write!(self.0, " {}={value}", field.name());
        }
    }
}

impl<S: Subscriber> Layer<S> for SpdkLog {
    fn register_callsite(&self, meta: &'static Metadata<'static>) -> Interest {
        if *meta.level() <= Level::INFO {
            Interest::always()
        } else {
            // The flag and print level can change at run time: ask each time.
            Interest::sometimes()
        }
    }

    fn enabled(&self, meta: &Metadata<'_>, _ctx: Context<'_, S>) -> bool {
        *meta.level() <= Level::INFO
            || (log::flag_enabled() && spdk_level(meta.level()) <= log::print_level())
    }

    fn on_event(&self, event: &Event<'_>, _ctx: Context<'_, S>) {
        let meta = event.metadata();
        let mut msg = Message::default();
        event.record(&mut msg);
        let clean = |s: &str| CString::new(s.replace('\0', " ")).unwrap_or_default();
        log::write(
            spdk_level(meta.level()),
            &clean(meta.file().unwrap_or("bdev_qcow2")),
            meta.line().unwrap_or(0),
            &clean(meta.target()),
            &clean(&msg.0),
        );
    }
}

/// Installs the layer as the process's global subscriber (once; later calls and hosts
/// that installed their own subscriber are left alone).
pub fn init() {
    let subscriber = tracing_subscriber::registry().with(SpdkLog);
    let _ = tracing::subscriber::set_global_default(subscriber);
}
