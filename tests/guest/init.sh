#!/bin/busybox sh
# The guest side of tests/guest: PID 1 of the initramfs the host builds for each boot.
# The kernel command line names the boot's mode (g.mode=...); /ops and /files, written by
# the host, say what to write and where, with bytes taken from /blob. Every result goes to
# the serial console on a line starting with "@@ ", which is all the host reads.
/bin/busybox --install -s /bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
for m in $(cat /modules); do insmod "/lib/modules/$m" || echo "@@ FAIL insmod $m"; done

say() { echo "@@ $*"; }
mode=$(sed -n 's/.*g\.mode=\([a-z-]*\).*/\1/p' /proc/cmdline)
say "UP $mode $(cut -d' ' -f1 /proc/uptime)"

# The raw disk: each write read back through the device, discards read back as zeros.
raw_ops() {
    n=0
    while read -r op dst src len direct; do
        n=$((n + 1))
        case "$op" in
        W)
            flag=""
            bs=4096
            if [ "$direct" = 1 ]; then
                flag="oflag=direct,seek_bytes"
                bs=512
                [ $((len % 65536)) = 0 ] && bs=65536
            else
                flag="oflag=seek_bytes"
            fi
            dd if=/blob of=/dev/vda bs=$bs iflag=skip_bytes,count_bytes $flag \
                skip="$src" seek="$dst" count="$len" conv=notrunc status=none ||
                say "BAD $n write"
            blockdev --flushbufs /dev/vda
            if cmp -n "$len" /dev/vda /blob "$dst" "$src" >/dev/null; then
                say "OK $n"
            else
                say "BAD $n readback"
            fi
            ;;
        D)
            len=$src
            blkdiscard -o "$dst" -l "$len" /dev/vda || say "BAD $n discard"
            blockdev --flushbufs /dev/vda
            if cmp -n "$len" /dev/vda /dev/zero "$dst" 0 >/dev/null; then
                say "OK $n"
            else
                say "BAD $n zeros"
            fi
            ;;
        esac
    done </ops
    sync
    blockdev --flushbufs /dev/vda
}

digest_vda() {
    echo 3 >/proc/sys/vm/drop_caches
    say "MD5 vda $(md5sum </dev/vda | cut -d' ' -f1)"
}

# Files on the ext4 disk: name, offset in /blob, length.
fill_ext4() {
    mkfs.ext4 -q -F /dev/vdb || say "FAIL mkfs"
    mount -t ext4 /dev/vdb /mnt || say "FAIL mount"
    mkdir -p /mnt/d
    while read -r name src len; do
        dd if=/blob of="/mnt/d/$name" bs=65536 iflag=skip_bytes,count_bytes \
            skip="$src" count="$len" status=none || say "BAD $name write"
    done </files
    sync
}

check_ext4() {
    echo 3 >/proc/sys/vm/drop_caches
    while read -r name src len; do
        f="/mnt/d/$name"
        if [ "$(stat -c %s "$f" 2>/dev/null)" = "$len" ] && cmp -n "$len" "$f" /blob 0 "$src" >/dev/null; then
            say "OK $name"
        else
            say "BAD $name"
        fi
    done </files
}

# Files written and fsynced one by one until the host kills the target under us.
fsync_loop() {
    mkfs.ext4 -q -F /dev/vdb || say "FAIL mkfs"
    mount -t ext4 /dev/vdb /mnt || say "FAIL mount"
    mkdir -p /mnt/d
    sync /mnt /mnt/d
    while read -r name src len; do
        dd if=/blob of="/mnt/d/$name" bs=65536 iflag=skip_bytes,count_bytes \
            skip="$src" count="$len" status=none &&
            sync "/mnt/d/$name" /mnt/d && say "FSYNCED $name"
    done </files
    say "LOOP-END"
    # The host kills the target before this: keep the guest busy until then.
    while :; do sleep 1; done
}

case "$mode" in
probe) ;;
quickstart)
    say "DISK vda $(blockdev --getsize64 /dev/vda)"
    raw_ops
    digest_vda
    ;;
write)
    say "QUEUES $(ls /sys/block/vda/mq | wc -l)"
    raw_ops
    digest_vda
    fill_ext4
    check_ext4
    umount /mnt || say "FAIL umount"
    ;;
verify)
    digest_vda
    mount -t ext4 /dev/vdb /mnt || say "FAIL mount"
    check_ext4
    umount /mnt || say "FAIL umount"
    ;;
crash)
    fsync_loop
    ;;
crash-check)
    mount -t ext4 /dev/vdb /mnt || say "FAIL mount"
    check_ext4
    umount /mnt || say "FAIL umount"
    ;;
esac
say "DONE"
sync
poweroff -f
