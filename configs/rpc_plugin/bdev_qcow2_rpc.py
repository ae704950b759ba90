"""rpc.py plugin adding the bdev_qcow2_* commands.

    PYTHONPATH=configs/rpc_plugin rpc.py --plugin bdev_qcow2_rpc bdev_qcow2_create -b q0 --base-bdev aio0
"""


def bdev_qcow2_create(client, name, base_bdev, backing_bdev=None, read_only=None,
                      l2_cache_size=None, l2_slice_size=None, cache_ways=None, prefetch=None,
                      ordered_layout=None, zero_offload=None, prefetch_ring_size=None,
                      prefetch_max_window=None, alloc_granule=None, zero_ahead=None,
                      pass_discard_request=None, pass_discard_snapshot=None,
                      pass_discard_other=None, uuid=None, space_warn_percent=None,
                      backing_cache_size=None, key=None):
    params = {'name': name, 'base_bdev': base_bdev}
    if backing_bdev is not None:
        params['backing_bdev'] = backing_bdev
    if read_only is not None:
        params['read_only'] = read_only
    if l2_cache_size is not None:
        params['l2_cache_size'] = l2_cache_size
    if l2_slice_size is not None:
        params['l2_slice_size'] = l2_slice_size
    if cache_ways is not None:
        params['cache_ways'] = cache_ways
    if prefetch is not None:
        params['prefetch'] = prefetch
    if prefetch_ring_size is not None:
        params['prefetch_ring_size'] = prefetch_ring_size
    if prefetch_max_window is not None:
        params['prefetch_max_window'] = prefetch_max_window
    if ordered_layout:
        params['ordered_layout'] = True
    if zero_offload is not None:
        params['zero_offload'] = zero_offload
    if alloc_granule is not None:
        params['alloc_granule'] = alloc_granule
    if zero_ahead is not None:
        params['zero_ahead'] = zero_ahead
    for k, v in (('pass_discard_request', pass_discard_request),
                 ('pass_discard_snapshot', pass_discard_snapshot),
                 ('pass_discard_other', pass_discard_other)):
        if v is not None:
            params[k] = v if isinstance(v, bool) else v == 'on'
    if uuid is not None:
        params['uuid'] = uuid
    if space_warn_percent is not None:
        params['space_warn_percent'] = space_warn_percent
    if backing_cache_size is not None:
        params['backing_cache_size'] = backing_cache_size
    if key is not None:
        params['key'] = key
    return client.call('bdev_qcow2_create', params)


def bdev_qcow2_format(client, base_bdev, size=None, cluster_size=None, extended_l2=None,
                      refcount_bits=None, compat=None, lazy_refcounts=None,
                      compression_type=None, preallocation=None, zero_base=None,
                      backing_bdev=None, key=None, encrypt_iter_time_ms=None):
    params = {'base_bdev': base_bdev}
    for k, v in (('size', size), ('backing_bdev', backing_bdev), ('key', key),
                 ('encrypt_iter_time_ms', encrypt_iter_time_ms),
                 ('cluster_size', cluster_size), ('extended_l2', extended_l2),
                 ('refcount_bits', refcount_bits), ('compat', compat),
                 ('lazy_refcounts', lazy_refcounts), ('compression_type', compression_type),
                 ('preallocation', preallocation), ('zero_base', zero_base)):
        if v is not None:
            params[k] = v
    return client.call('bdev_qcow2_format', params)


def bdev_qcow2_overlay_create(client, name, base_bdev, backing_bdev, size=None,
                              cluster_size=None, extended_l2=None, uuid=None,
                              backing_cache_size=None, key=None, encrypt_iter_time_ms=None):
    params = {'name': name, 'base_bdev': base_bdev, 'backing_bdev': backing_bdev}
    for k, v in (('size', size), ('cluster_size', cluster_size), ('key', key),
                 ('encrypt_iter_time_ms', encrypt_iter_time_ms),
                 ('extended_l2', extended_l2), ('uuid', uuid),
                 ('backing_cache_size', backing_cache_size)):
        if v is not None:
            params[k] = v
    return client.call('bdev_qcow2_overlay_create', params)


def bdev_qcow2_delete(client, name):
    return client.call('bdev_qcow2_delete', {'name': name})


def bdev_qcow2_get_stats(client, name=None):
    params = {}
    if name is not None:
        params['name'] = name
    return client.call('bdev_qcow2_get_stats', params)


def bdev_qcow2_resize(client, name, size):
    return client.call('bdev_qcow2_resize', {'name': name, 'size': size})


def bdev_qcow2_stream(client, name, rate_limit=None):
    params = {'name': name}
    if rate_limit is not None:
        params['rate_limit'] = rate_limit
    return client.call('bdev_qcow2_stream', params)


def bdev_qcow2_snapshot_create(client, name, snapshot):
    return client.call('bdev_qcow2_snapshot_create', {'name': name, 'snapshot': snapshot})


def bdev_qcow2_snapshot_delete(client, name, snapshot):
    return client.call('bdev_qcow2_snapshot_delete', {'name': name, 'snapshot': snapshot})


def bdev_qcow2_snapshot_list(client, name):
    return client.call('bdev_qcow2_snapshot_list', {'name': name})


def bdev_qcow2_snapshot_external(client, name, base_bdev, snapshot_name=None,
                                 snapshot_uuid=None, encrypt_iter_time_ms=None):
    params = {'name': name, 'base_bdev': base_bdev}
    if snapshot_name is not None:
        params['snapshot_name'] = snapshot_name
    if snapshot_uuid is not None:
        params['snapshot_uuid'] = snapshot_uuid
    if encrypt_iter_time_ms is not None:
        params['encrypt_iter_time_ms'] = encrypt_iter_time_ms
    return client.call('bdev_qcow2_snapshot_external', params)


def add_encrypt_args(p):
    p.add_argument('-k', '--key',
                   help='encrypt the image (LUKS, aes-256-xts-plain64 as qemu-img) with the '
                   'passphrase held by this key of SPDK\'s keyring (keyring_file_add_key)')
    p.add_argument('--encrypt-iter-time-ms', dest='encrypt_iter_time_ms', type=int,
                   help='milliseconds of PBKDF2 the key slot takes (default 2000, as qemu-img)')


def spdk_rpc_plugin_initialize(subparsers):
    def create(args):
        print_json(bdev_qcow2_create(args.client, name=args.name, base_bdev=args.base_bdev,
                                     backing_bdev=args.backing_bdev,
                                     read_only=args.read_only,
                                     l2_cache_size=args.l2_cache_size,
                                     l2_slice_size=args.l2_slice_size,
                                     cache_ways=args.cache_ways,
                                     prefetch=args.prefetch,
                                     prefetch_ring_size=args.prefetch_ring_size,
                                     prefetch_max_window=args.prefetch_max_window,
                                     ordered_layout=args.ordered_layout,
                                     zero_offload=args.zero_offload,
                                     alloc_granule=args.alloc_granule,
                                     zero_ahead=args.zero_ahead,
                                     pass_discard_request=args.pass_discard_request,
                                     pass_discard_snapshot=args.pass_discard_snapshot,
                                     pass_discard_other=args.pass_discard_other,
                                     uuid=args.uuid,
                                     space_warn_percent=args.space_warn_percent,
                                     backing_cache_size=args.backing_cache_size,
                                     key=args.key))

    p = subparsers.add_parser('bdev_qcow2_create',
                              help='Serve a qcow2 image stored on a bdev as a new bdev')
    p.add_argument('-b', '--name', required=True, help='name of the qcow2 bdev to create')
    p.add_argument('--base-bdev', required=True, help='bdev holding the qcow2 image')
    p.add_argument('--backing-bdev', help='bdev holding the backing image (raw or qcow2 bdev)')
    p.add_argument('--read-only', dest='read_only', action='store_true', default=None,
                   help='serve read-only (per-channel replicas; the base is claimed shared)')
    p.add_argument('--read-write', dest='read_only', action='store_false',
                   help='writable (the default): the image is opened for writing')
    p.add_argument('--l2-cache-size', type=int, help='bytes of L2 slice cache per channel')
    p.add_argument('--l2-slice-size', type=int, help='L2 slice size in bytes (default 4096)')
    p.add_argument('--cache-ways', type=int, help='ways per set of the slice cache (default 8)')
    p.add_argument('--prefetch', dest='prefetch', action='store_true', default=None,
                   help='read-ahead on sequential streams, of data into each channel\'s '
                   'prefetch ring and of L2 slices (the default)')
    p.add_argument('--no-prefetch', dest='prefetch', action='store_false',
                   help='no read-ahead')
    p.add_argument('--prefetch-ring-size', type=int,
                   help='bytes of prefetch ring per channel (multiple of 128 KiB, default 5 MiB)')
    p.add_argument('--prefetch-max-window', type=int,
                   help='most bytes a stream reads ahead (multiple of 128 KiB, default 1 MiB)')
    p.add_argument('--ordered-layout', action='store_true', default=None,
                   help="lay each L2 slice's data out on the base in guest order")
    p.add_argument('--alloc-granule', type=int,
                   help='bytes a first write takes at once where the base reads zeros '
                   '(default 65536; 0: one cluster per first write)')
    p.add_argument('--zero-offload', dest='zero_offload', action='store_true', default=None,
                   help='zero the rest of a partly written new cluster with the base\'s '
                   'WRITE_ZEROES on any base that zeroes natively (default: NVMe bdevs only)')
    p.add_argument('--no-zero-offload', dest='zero_offload', action='store_false',
                   help='write partly written new clusters whole from a zeroed buffer')
    p.add_argument('--zero-ahead', dest='zero_ahead', action='store_true', default=None,
                   help='zero the base past the clusters in use ahead of the allocator, so '
                   'that first writes into new clusters write the guest\'s bytes alone, on '
                   'any base that zeroes natively, e.g. AIO with --fallocate (default: NVMe bdevs '
                   'only; images with a zeroed tail of their own need none)')
    p.add_argument('--no-zero-ahead', dest='zero_ahead', action='store_false',
                   help='never zero ahead of the allocator')
    for what, default, freed in (('request', 'on', 'a guest unmap or write-zeroes with unmap'),
                                 ('snapshot', 'on', "a snapshot's deletion"),
                                 ('other', 'off', 'anything else (copy-on-write, old tables)')):
        p.add_argument('--pass-discard-' + what, dest='pass_discard_' + what,
                       choices=['on', 'off'], default=None,
                       type=str,
                       help='unmap on the base the clusters %s frees, as QEMU\'s '
                       'pass-discard-%s (default %s)' % (freed, what, default))
    p.add_argument('-u', '--uuid',
                   help='UUID of the bdev (an NVMe-oF namespace\'s NGUID/UUID; default: '
                   'derived from the base bdev\'s UUID and the name, the same on every start)')
    p.add_argument('--space-warn-percent', type=int,
                   help='warn in the log once the image ends past this percentage of the '
                   'base bdev (default 90; 0: off)')
    p.add_argument('--backing-cache-size', dest='backing_cache_size', type=int,
                   help='bytes of the read cache of the backing bdev shared by every qcow2 '
                   'bdev over it, used while two or more share it (default 256 MiB; 0: none)')
    p.add_argument('-k', '--key',
                   help='name of the key in SPDK\'s keyring (keyring_file_add_key) holding '
                   'the passphrase of an encrypted (LUKS) image')
    p.set_defaults(func=create)

    def fmt(args):
        print_json(bdev_qcow2_format(args.client, base_bdev=args.base_bdev, size=args.size,
                                     cluster_size=args.cluster_size,
                                     extended_l2=args.extended_l2,
                                     refcount_bits=args.refcount_bits, compat=args.compat,
                                     lazy_refcounts=args.lazy_refcounts,
                                     compression_type=args.compression_type,
                                     preallocation=args.preallocation,
                                     zero_base=args.zero_base,
                                     backing_bdev=args.backing_bdev, key=args.key,
                                     encrypt_iter_time_ms=args.encrypt_iter_time_ms))

    p = subparsers.add_parser('bdev_qcow2_format',
                              help='Write a fresh, empty qcow2 image onto a bdev (erases it)')
    p.add_argument('base_bdev', help='bdev to format')
    p.add_argument('-s', '--size', type=int,
                   help='virtual size in bytes (required unless --backing-bdev gives it)')
    p.add_argument('--backing-bdev',
                   help='make the image an overlay of this bdev (raw, or a qcow2 bdev)')
    p.add_argument('--cluster-size', type=int, help='cluster size in bytes (default 65536)')
    p.add_argument('--extended-l2', action='store_true', default=None,
                   help='extended L2 entries (subclusters)')
    p.add_argument('--refcount-bits', type=int, help='refcount width (default 16)')
    p.add_argument('--compat', choices=['1.1', '0.10'], help='qcow2 version (default 1.1)')
    p.add_argument('--lazy-refcounts', action='store_true', default=None,
                   help='lazy refcounts (compat 1.1)')
    p.add_argument('--compression-type', choices=['zlib', 'zstd'],
                   help='compression of compressed clusters (default zlib)')
    p.add_argument('--preallocation', choices=['off', 'metadata', 'full'],
                   help='allocate every cluster: metadata (as preallocated zero clusters) '
                        'or full (written with zeros); default off')
    p.add_argument('--zero-base', dest='zero_base', action='store_true', default=None,
                   help='zero the base first and record it, so first writes write the '
                        'guest\'s bytes alone (default: on malloc and NVMe bases)')
    p.add_argument('--no-zero-base', dest='zero_base', action='store_false',
                   help='leave the base as it is (first writes write whole clusters)')
    add_encrypt_args(p)
    p.set_defaults(func=fmt)

    def overlay(args):
        print_json(bdev_qcow2_overlay_create(args.client, name=args.name,
                                             base_bdev=args.base_bdev,
                                             backing_bdev=args.backing_bdev, size=args.size,
                                             cluster_size=args.cluster_size,
                                             extended_l2=args.extended_l2, uuid=args.uuid,
                                             backing_cache_size=args.backing_cache_size,
                                             key=args.key,
                                             encrypt_iter_time_ms=args.encrypt_iter_time_ms))

    p = subparsers.add_parser('bdev_qcow2_overlay_create',
                              help='Format an overlay of a backing bdev on a bdev (erases it) '
                              'and serve it as a new qcow2 bdev, in one call')
    p.add_argument('-b', '--name', required=True, help='name of the qcow2 bdev to create')
    p.add_argument('--base-bdev', required=True, help='bdev to format the overlay on')
    p.add_argument('--backing-bdev', required=True,
                   help='bdev the overlay reads through (raw, or a qcow2 bdev)')
    p.add_argument('-s', '--size', type=int,
                   help='virtual size in bytes (default: the backing bdev\'s)')
    p.add_argument('--cluster-size', type=int, help='cluster size in bytes (default 65536)')
    p.add_argument('--extended-l2', action='store_true', default=None,
                   help='extended L2 entries (subclusters)')
    p.add_argument('-u', '--uuid', help='UUID of the bdev (default: derived)')
    p.add_argument('--backing-cache-size', dest='backing_cache_size', type=int,
                   help='bytes of the backing bdev\'s shared read cache (default 256 MiB; 0: none)')
    add_encrypt_args(p)
    p.set_defaults(func=overlay)

    def delete(args):
        print_json(bdev_qcow2_delete(args.client, name=args.name))

    p = subparsers.add_parser('bdev_qcow2_delete', help='Delete a qcow2 bdev')
    p.add_argument('name', help='qcow2 bdev name')
    p.set_defaults(func=delete)

    def get_stats(args):
        print_json(bdev_qcow2_get_stats(args.client, name=args.name))

    p = subparsers.add_parser('bdev_qcow2_get_stats',
                              help='Per-channel and total counters of qcow2 bdevs')
    p.add_argument('-b', '--name', help='one qcow2 bdev (default: all)')
    p.set_defaults(func=get_stats)

    def resize(args):
        print_json(bdev_qcow2_resize(args.client, name=args.name, size=args.size))

    p = subparsers.add_parser('bdev_qcow2_resize',
                              help='Grow a qcow2 bdev while it serves I/O (or shrink an '
                                   'unopened one whose cut-off range holds no data)')
    p.add_argument('-b', '--name', required=True, help='qcow2 bdev name')
    p.add_argument('-s', '--size', type=int, required=True, help='new size in bytes')
    p.set_defaults(func=resize)

    def stream(args):
        print_json(bdev_qcow2_stream(args.client, name=args.name, rate_limit=args.rate_limit))

    p = subparsers.add_parser('bdev_qcow2_stream',
                              help='Copy what a qcow2 bdev reads from its backing bdev into '
                                   'it in the background, then drop the backing reference '
                                   '(progress in bdev_qcow2_get_stats)')
    p.add_argument('-b', '--name', required=True, help='qcow2 bdev name')
    p.add_argument('-r', '--rate-limit', type=int, default=None,
                   help='bytes per second copied at most (0: no limit)')
    p.set_defaults(func=stream)

    def snapshot_create(args):
        print_json(bdev_qcow2_snapshot_create(args.client, name=args.name,
                                              snapshot=args.snapshot))

    p = subparsers.add_parser('bdev_qcow2_snapshot_create',
                              help='Take an internal snapshot of a qcow2 bdev while it '
                                   'serves I/O')
    p.add_argument('-b', '--name', required=True, help='qcow2 bdev name')
    p.add_argument('-n', '--snapshot', required=True, help='snapshot name')
    p.set_defaults(func=snapshot_create)

    def snapshot_delete(args):
        print_json(bdev_qcow2_snapshot_delete(args.client, name=args.name,
                                              snapshot=args.snapshot))

    p = subparsers.add_parser('bdev_qcow2_snapshot_delete',
                              help='Delete an internal snapshot of a qcow2 bdev')
    p.add_argument('-b', '--name', required=True, help='qcow2 bdev name')
    p.add_argument('-n', '--snapshot', required=True, help='snapshot id or name')
    p.set_defaults(func=snapshot_delete)

    def snapshot_external(args):
        print_json(bdev_qcow2_snapshot_external(args.client, name=args.name,
                                                base_bdev=args.base_bdev,
                                                snapshot_name=args.snapshot_name,
                                                snapshot_uuid=args.snapshot_uuid,
                                                encrypt_iter_time_ms=args.encrypt_iter_time_ms))

    p = subparsers.add_parser('bdev_qcow2_snapshot_external',
                              help='Switch a qcow2 bdev to a new overlay formatted on another '
                                   'bdev while it serves I/O; its old image becomes a '
                                   'read-only qcow2 bdev, the overlay\'s backing')
    p.add_argument('-b', '--name', required=True, help='qcow2 bdev name')
    p.add_argument('--base-bdev', dest='base_bdev', required=True,
                   help='bdev to format the overlay on (everything on it is lost)')
    p.add_argument('-n', '--snapshot-name', dest='snapshot_name',
                   help='name of the old image\'s read-only bdev (default <name>_snap<N>)')
    p.add_argument('--snapshot-uuid', dest='snapshot_uuid',
                   help='UUID of that read-only bdev (default: derived from its base bdev\'s '
                   'UUID and its name)')
    p.add_argument('--encrypt-iter-time-ms', dest='encrypt_iter_time_ms', type=int,
                   help='an encrypted bdev\'s overlay is encrypted with its key: milliseconds '
                   'of PBKDF2 for its key slot (default 2000, as qemu-img)')
    p.set_defaults(func=snapshot_external)

    def snapshot_list(args):
        print_json(bdev_qcow2_snapshot_list(args.client, name=args.name))

    p = subparsers.add_parser('bdev_qcow2_snapshot_list',
                              help='List the internal snapshots of a qcow2 bdev')
    p.add_argument('-b', '--name', required=True, help='qcow2 bdev name')
    p.set_defaults(func=snapshot_list)


def print_json(obj):
    import json
    print(json.dumps(obj, indent=2))
