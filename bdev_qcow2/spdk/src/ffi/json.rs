//! SPDK's parsed JSON values in, JSON text out (through `serde_json`).

use super::sys;
use serde_json::{Map, Value};
use std::ffi::CString;

/// Converts SPDK's flat array of parsed values (RPC `params`) into a `serde_json` value.
/// A null pointer (no params) is `Value::Null`.
///
/// # Safety
/// `params` must be null or point at a complete value as SPDK's JSON parser produces it
/// (a container's `len` counts the values up to its matching end).
pub unsafe fn decode(params: *const sys::spdk_json_val) -> Result<Value, String> {
    if params.is_null() {
        return Ok(Value::Null);
    }
    // SAFETY: `params` points at a value; a container's `len` tells how many follow.
    let first = unsafe { &*params };
    let count = match first.type_ {
        sys::SPDK_JSON_VAL_OBJECT_BEGIN | sys::SPDK_JSON_VAL_ARRAY_BEGIN => first.len as usize + 2,
        _ => 1,
    };
    // SAFETY: per the contract, `count` values are laid out contiguously.
    let vals = unsafe { std::slice::from_raw_parts(params, count) };
    let (v, _) = decode_at(vals, 0)?;
    Ok(v)
}

fn text(v: &sys::spdk_json_val) -> Result<String, String> {
    if v.start.is_null() {
        return Ok(String::new());
    }
    // SAFETY: strings, names and numbers point at `len` bytes of the request buffer, which
    // lives as long as the request.
    let bytes = unsafe { std::slice::from_raw_parts(v.start.cast::<u8>(), v.len as usize) };
    String::from_utf8(bytes.to_vec()).map_err(|_| "invalid UTF-8 in JSON string".to_string())
}

/// Decodes the value at `vals[i]`; returns it and the index after it.
fn decode_at(vals: &[sys::spdk_json_val], i: usize) -> Result<(Value, usize), String> {
    let v = vals.get(i).ok_or("truncated JSON value")?;
    match v.type_ {
        sys::SPDK_JSON_VAL_NULL => Ok((Value::Null, i + 1)),
        sys::SPDK_JSON_VAL_TRUE => Ok((Value::Bool(true), i + 1)),
        sys::SPDK_JSON_VAL_FALSE => Ok((Value::Bool(false), i + 1)),
        sys::SPDK_JSON_VAL_STRING => Ok((Value::String(text(v)?), i + 1)),
        sys::SPDK_JSON_VAL_NUMBER => {
            let t = text(v)?;
            let n: serde_json::Number =
                serde_json::from_str(&t).map_err(|_| format!("invalid number {t}"))?;
            Ok((Value::Number(n), i + 1))
        }
        sys::SPDK_JSON_VAL_ARRAY_BEGIN => {
            let end = i + 1 + v.len as usize;
            let mut out = Vec::new();
            let mut j = i + 1;
            while j < end {
                let (item, next) = decode_at(vals, j)?;
                out.push(item);
                j = next;
            }
            Ok((Value::Array(out), end + 1))
        }
        sys::SPDK_JSON_VAL_OBJECT_BEGIN => {
            let end = i + 1 + v.len as usize;
            let mut out = Map::new();
            let mut j = i + 1;
            while j < end {
                let name = vals.get(j).ok_or("truncated JSON object")?;
                if name.type_ != sys::SPDK_JSON_VAL_NAME {
                    return Err("expected a name in JSON object".into());
                }
                let (item, next) = decode_at(vals, j + 1)?;
                out.insert(text(name)?, item);
                j = next;
            }
            Ok((Value::Object(out), end + 1))
        }
        t => Err(format!("unexpected JSON value type {t}")),
    }
}

/// Writes `value` as the next value of `w`.
///
/// # Safety
/// `w` must be a live write context positioned where a value may go.
pub unsafe fn write_value(w: *mut sys::spdk_json_write_ctx, value: &Value) {
    let s = value.to_string();
    // SAFETY: `w` per the contract; `s` is valid JSON text of the given length.
    unsafe { sys::spdk_json_write_val_raw(w, s.as_ptr().cast(), s.len()) };
}

/// Writes `"name": value` into the object `w` is in.
///
/// # Safety
/// `w` must be a live write context inside an object.
pub unsafe fn write_named(w: *mut sys::spdk_json_write_ctx, name: &str, value: &Value) {
    let Ok(n) = CString::new(name) else { return };
    // SAFETY: `w` per the contract; `n` is a valid C string for the call.
    unsafe { sys::spdk_json_write_name(w, n.as_ptr()) };
    // SAFETY: a name was just written, so a value may follow.
    unsafe { write_value(w, value) };
}
