/*
 * Registration with SPDK at load time (constructors): the bdev module "qcow2", its RPC
 * methods and its log flag. Everything registered here is defined in Rust, where the module
 * invokes src/ffi's macros: bdev_module! (src/module.rs) and rpc_entry! (next to each handler).
 */
#include <spdk/stdinc.h>
#include <spdk/bdev_module.h>
#include <spdk/rpc.h>
#include <spdk/log.h>

extern struct spdk_bdev_module BDEV_QCOW2_MODULE;
void bdev_qcow2_rpc_create(struct spdk_jsonrpc_request *request, const struct spdk_json_val *params);
void bdev_qcow2_rpc_format(struct spdk_jsonrpc_request *request, const struct spdk_json_val *params);
void bdev_qcow2_rpc_delete(struct spdk_jsonrpc_request *request, const struct spdk_json_val *params);
void bdev_qcow2_rpc_get_stats(struct spdk_jsonrpc_request *request,
			      const struct spdk_json_val *params);
void bdev_qcow2_rpc_resize(struct spdk_jsonrpc_request *request, const struct spdk_json_val *params);
void bdev_qcow2_rpc_snapshot_create(struct spdk_jsonrpc_request *request,
				    const struct spdk_json_val *params);
void bdev_qcow2_rpc_snapshot_delete(struct spdk_jsonrpc_request *request,
				    const struct spdk_json_val *params);
void bdev_qcow2_rpc_snapshot_list(struct spdk_jsonrpc_request *request,
				  const struct spdk_json_val *params);
void bdev_qcow2_rpc_snapshot_external(struct spdk_jsonrpc_request *request,
				      const struct spdk_json_val *params);
void bdev_qcow2_rpc_overlay_create(struct spdk_jsonrpc_request *request,
				    const struct spdk_json_val *params);
void bdev_qcow2_rpc_stream(struct spdk_jsonrpc_request *request, const struct spdk_json_val *params);

SPDK_BDEV_MODULE_REGISTER(qcow2, &BDEV_QCOW2_MODULE)
SPDK_RPC_REGISTER("bdev_qcow2_create", bdev_qcow2_rpc_create, SPDK_RPC_RUNTIME)
SPDK_RPC_REGISTER("bdev_qcow2_format", bdev_qcow2_rpc_format, SPDK_RPC_RUNTIME)
SPDK_RPC_REGISTER("bdev_qcow2_overlay_create", bdev_qcow2_rpc_overlay_create, SPDK_RPC_RUNTIME)
SPDK_RPC_REGISTER("bdev_qcow2_delete", bdev_qcow2_rpc_delete, SPDK_RPC_RUNTIME)
SPDK_RPC_REGISTER("bdev_qcow2_get_stats", bdev_qcow2_rpc_get_stats, SPDK_RPC_RUNTIME)
SPDK_RPC_REGISTER("bdev_qcow2_resize", bdev_qcow2_rpc_resize, SPDK_RPC_RUNTIME)
SPDK_RPC_REGISTER("bdev_qcow2_snapshot_create", bdev_qcow2_rpc_snapshot_create, SPDK_RPC_RUNTIME)
SPDK_RPC_REGISTER("bdev_qcow2_snapshot_delete", bdev_qcow2_rpc_snapshot_delete, SPDK_RPC_RUNTIME)
SPDK_RPC_REGISTER("bdev_qcow2_snapshot_list", bdev_qcow2_rpc_snapshot_list, SPDK_RPC_RUNTIME)
SPDK_RPC_REGISTER("bdev_qcow2_snapshot_external", bdev_qcow2_rpc_snapshot_external,
		  SPDK_RPC_RUNTIME)
SPDK_RPC_REGISTER("bdev_qcow2_stream", bdev_qcow2_rpc_stream, SPDK_RPC_RUNTIME)
SPDK_LOG_REGISTER_COMPONENT(vbdev_qcow2)
