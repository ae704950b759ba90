//! JSON-RPC requests and their responses.

use super::sys;
use serde_json::Value;
use std::ffi::CString;

/// An RPC method's parameters, as JSON (`Value::Null` when there are none), or why they
/// could not be read.
pub type Params = Result<Value, String>;

/// JSON-RPC error code: invalid parameters.
pub const INVALID_PARAMS: i32 = sys::SPDK_JSONRPC_ERROR_INVALID_PARAMS;

/// A JSON-RPC request awaiting its response. Consumed by responding, which must happen
/// exactly once (from any SPDK thread).
pub struct Request(*mut sys::spdk_jsonrpc_request);

impl Request {
    /// Wraps a request handed to an RPC method.
    ///
    /// # Safety
    /// `r` must be a request not yet responded to; the returned value must be the only
    /// responder.
    pub unsafe fn from_raw(r: *mut sys::spdk_jsonrpc_request) -> Request {
        Request(r)
    }

    /// Responds with `result`.
    pub fn result(self, result: &Value) {
        // SAFETY: the request is live; begin/end pair up around one value.
        unsafe {
            let w = sys::spdk_jsonrpc_begin_result(self.0);
            if w.is_null() {
                return; // notification: no response wanted
            }
            super::json::write_value(w, result);
            sys::spdk_jsonrpc_end_result(self.0, w);
        }
    }

    /// Responds with an error: `code` (JSON-RPC) and a message.
    pub fn error(self, code: i32, msg: &str) {
        let m = CString::new(msg.replace('\0', " ")).unwrap_or_default();
        // SAFETY: the request is live; `m` is a valid C string for the call.
        unsafe { sys::spdk_jsonrpc_send_error_response(self.0, code, m.as_ptr()) }
    }

    /// Responds with an errno as the error code (SPDK's convention: negative errno).
    pub fn errno(self, errno: i32, msg: &str) {
        self.error(-errno, msg)
    }
}

/// Declares the `#[no_mangle]` entry point `register.c` registers for an RPC method, which
/// hands the request and its decoded parameters to the safe handler.
macro_rules! rpc_entry {
    ($name:ident => $handler:path) => {
        /// An RPC entry point (registered by `register.c`).
        ///
        /// # Safety
        /// Called by SPDK's RPC server with a live request and its params.
        #[no_mangle]
        pub unsafe extern "C" fn $name(
            request: *mut sys::spdk_jsonrpc_request,
            params: *const sys::spdk_json_val,
        ) {
            // SAFETY: SPDK's request, answered exactly once by the handler.
            let req = unsafe { Request::from_raw(request) };
            // SAFETY: SPDK's params, valid for the call.
            let params = unsafe { super::json::decode(params) };
            $handler(req, params);
        }
    };
}

rpc_entry!(bdev_qcow2_rpc_create => crate::rpc::create);
rpc_entry!(bdev_qcow2_rpc_format => crate::rpc::format);
rpc_entry!(bdev_qcow2_rpc_delete => crate::rpc::delete);
rpc_entry!(bdev_qcow2_rpc_get_stats => crate::rpc::get_stats);
rpc_entry!(bdev_qcow2_rpc_resize => crate::lifecycle_rpc::resize);
rpc_entry!(bdev_qcow2_rpc_snapshot_create => crate::lifecycle_rpc::snapshot_create);
rpc_entry!(bdev_qcow2_rpc_snapshot_delete => crate::lifecycle_rpc::snapshot_delete);
rpc_entry!(bdev_qcow2_rpc_snapshot_list => crate::lifecycle_rpc::snapshot_list);
rpc_entry!(bdev_qcow2_rpc_snapshot_external => crate::external_snapshot::snapshot_external);
rpc_entry!(bdev_qcow2_rpc_stream => crate::stream_rpc::stream);
