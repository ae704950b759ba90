/* Public SPDK headers only: the surface bindgen translates (see build.rs for the allowlist). */
#include <spdk/stdinc.h>
#include <spdk/bdev.h>
#include <spdk/bdev_module.h>
#include <spdk/thread.h>
#include <spdk/rpc.h>
#include <spdk/jsonrpc.h>
#include <spdk/json.h>
#include <spdk/log.h>
#include <spdk/env.h>
#include <spdk/util.h>
#include <spdk/string.h>
#include <spdk/uuid.h>
#include <spdk/keyring.h>

/* The shim: static inlines of the headers above, given a linkable symbol (shim.c). */
void *spdk_sys_io_channel_get_ctx(struct spdk_io_channel *ch);
void spdk_sys_bdev_set_split_on_optimal_io_boundary(struct spdk_bdev *bdev, bool split);
struct spdk_bdev_io *spdk_sys_bdev_io_from_ctx(void *ctx);
int spdk_sys_thread_exec_msg(const struct spdk_thread *thread, spdk_msg_fn fn, void *ctx);
