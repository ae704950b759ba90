/*
 * What Rust cannot call directly: SPDK's static inline functions, given real symbols.
 * Registration macros (module, RPC, log flag) belong to the crate that registers
 * something, so they live in that crate's own shim, not here.
 */
#include "wrapper.h"

void *
spdk_sys_io_channel_get_ctx(struct spdk_io_channel *ch)
{
	return spdk_io_channel_get_ctx(ch);
}

struct spdk_bdev_io *
spdk_sys_bdev_io_from_ctx(void *ctx)
{
	return spdk_bdev_io_from_ctx(ctx);
}

int
spdk_sys_thread_exec_msg(const struct spdk_thread *thread, spdk_msg_fn fn, void *ctx)
{
	return spdk_thread_exec_msg(thread, fn, ctx);
}

/* A bitfield of struct spdk_bdev: its layout is the compiler's, not bindgen's to guess. */
void
spdk_sys_bdev_set_split_on_optimal_io_boundary(struct spdk_bdev *bdev, bool split)
{
	bdev->split_on_optimal_io_boundary = split;
}
