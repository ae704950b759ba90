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
/// hands the request and its decoded parameters to the safe handler. Invoked next to the
/// handler (`rpc_entry!(bdev_qcow2_rpc_create => create);`).
#[macro_export]
macro_rules! rpc_entry {
    ($name:ident => $handler:path) => {
        /// An RPC entry point (registered by `register.c`).
        ///
        /// # Safety
        /// Called by SPDK's RPC server with a live request and its params.
        // Expanded next to its handler, outside `ffi`, but `unsafe` as written here.
        #[allow(unsafe_code)]
        #[no_mangle]
        pub unsafe extern "C" fn $name(
            request: *mut $crate::ffi::sys::spdk_jsonrpc_request,
            params: *const $crate::ffi::sys::spdk_json_val,
        ) {
            // SAFETY: SPDK's request and params, valid for the call; the request is answered
            // exactly once by the handler.
            let (req, params) = unsafe { $crate::ffi::rpc::entry(request, params) };
            $handler(req, params);
        }
    };
}

/// What an [`rpc_entry!`](crate::rpc_entry) hands its handler.
///
/// # Safety
/// `request` is a request SPDK's RPC server handed a method, not yet responded to (the
/// returned value becomes its only responder); `params` is null or its valid params.
pub unsafe fn entry(
    request: *mut sys::spdk_jsonrpc_request,
    params: *const sys::spdk_json_val,
) -> (Request, Params) {
    // SAFETY: per the contract.
    unsafe { (Request::from_raw(request), super::json::decode(params)) }
}
